"""Real Redis servers on loopback for the remote-tier tests and benchmark: one `redis-server`, or a
cluster of masters (`redis-cli --cluster create ... --cluster-replicas 0`), each in its own directory,
with `maxmemory` + `allkeys-lru` as an operator would run the shared cold tier.

Redis has no "port 0", so ports come from support.ports (below the ephemeral range; a cluster node
also needs port + 10000 free for its bus). A stopped or killed node restarts on the same port from
the same directory (so with the same nodes.conf and cluster identity).

`require_redis_server()` is the one place that decides whether the tests skip: only when redis-server
is missing and neither KVSTORE_TEST_REQUIRE_REDIS nor KVSTORE_TEST_INSTALLED (CI) is set; with
either set a missing server fails the test, so CI cannot silently skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from redis.crc import key_slot

from support.ports import LOOPBACK, free_ports


def require_redis_server() -> str:
    """The path of redis-server; skips the test if it is missing (fails it where it is required)."""
    path = shutil.which("redis-server")
    if path and shutil.which("redis-cli"):
        return path
    message = "redis-server/redis-cli not installed (Debian: apt-get install redis-server)"
    if os.environ.get("KVSTORE_TEST_REQUIRE_REDIS") or os.environ.get("KVSTORE_TEST_INSTALLED"):
        pytest.fail(message + "; required here (KVSTORE_TEST_REQUIRE_REDIS or KVSTORE_TEST_INSTALLED is set)")
    pytest.skip(message)


class RedisServer:
    """One redis-server process on 127.0.0.1:`port`, its data and log in `directory`; with `tls`
    (certificate, key and CA files), TLS only on that port."""

    def __init__(self, directory: Path, port: int, *, cluster: bool = False, maxmemory: str = "512mb",
                 password: str | None = None, tls: tuple[str, str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.port = port
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.password = password
        self.tls = tls
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def args(self) -> list[str]:
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        args = [require_redis_server(), *ports, "--bind", LOOPBACK, "--dir", str(self.directory),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "redis.log",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--enable-debug-command", "local"]  # DEBUG SLEEP: a slow store in the tests
        if self.cluster:
            # full-coverage off: a dead master loses only its slots; the others keep answering.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca,
                     "--tls-auth-clients", "no"]
        return args + list(self.extra)

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args(), cwd=self.directory, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while self.cli("PING", check=False).strip() != "PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {self.log_tail()}")
            time.sleep(0.02)
        return self

    def cli(self, *args: str, check: bool = True, timeout: float = 10.0) -> str:
        """redis-cli against this server; its stdout."""
        env = dict(os.environ, REDISCLI_AUTH=self.password) if self.password else None
        tls = ["--tls", "--cacert", self.tls[2]] if self.tls else []
        cmd = ["redis-cli", "-h", LOOPBACK, "-p", str(self.port), *tls, *args]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            if check:
                raise
            return ""
        if check and (out.returncode != 0 or out.stdout.startswith("ERR")):
            raise RuntimeError(f"redis-cli {' '.join(args)}: {out.stdout}{out.stderr}")
        return out.stdout

    def kill(self) -> None:
        """SIGKILL (a crashed node); the directory stays for a restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # a stopped (paused) process dies too
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: a hung node (connections stay open, nothing answers)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.directory / "redis.log").read_text().splitlines()[-lines:])
        return "(no log)"


class RedisCluster:
    """`masters` cluster-enabled servers joined into one cluster, no replicas."""

    def __init__(self, directory: Path, masters: int = 3, maxmemory: str = "512mb") -> None:
        self.nodes = [RedisServer(directory / f"node{i}", port, cluster=True, maxmemory=maxmemory)
                      for i, port in enumerate(free_ports(masters, bus=True))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        self.nodes[0].cli("--cluster", "create", *(n.address for n in self.nodes), "--cluster-replicas", "0",
                          "--cluster-yes", timeout=timeout)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and knows every node's slots."""
        deadline = time.monotonic() + timeout
        while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) for n in self.nodes if n.proc):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster not ok: " + " | ".join(n.log_tail(5) for n in self.nodes))
            time.sleep(0.05)

    def slot_map(self) -> list[tuple[int, int, RedisServer]]:
        """(first slot, last slot, node) of every range, as the nodes themselves report (CLUSTER NODES)."""
        ranges = []
        for node in self.nodes:
            mine = next(line for line in node.cli("CLUSTER", "NODES").splitlines() if "myself" in line)
            for spec in mine.split()[8:]:
                lo, _, hi = spec.partition("-")
                ranges.append((int(lo), int(hi or lo), node))
        return ranges

    def node_of(self, key: bytes, slot_map: list[tuple[int, int, RedisServer]] | None = None) -> RedisServer:
        """The node that serves `key`."""
        slot = key_slot(key)
        return next(node for lo, hi, node in slot_map or self.slot_map() if lo <= slot <= hi)

    def keyslot(self, key: bytes) -> int:
        """The server's answer (CLUSTER KEYSLOT), not the client's."""
        return int(self.nodes[0].cli("CLUSTER", "KEYSLOT", key.decode()).strip())

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
