"""A `kvstore serve` child process for tests, benchmarks and soak runs: start it, wait until it is
healthy, stop or kill it, start it again on the same pool file.

A harness, not part of the daemon: it drives a daemon as its clients do (`kvstore bench` uses it, so
it ships with the daemon; the client package ships none)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstore_client import KVStoreClient, Unavailable

_WITH_FILE_LIMIT = ("import os, resource, sys; n = int(sys.argv[1]); "
                    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])")


class DaemonProcess:
    def __init__(self, workdir: str | Path, pool_size: str = "64MiB", segment_size: str = "4MiB", *extra: str,
                 max_open_files: int | None = None, env: dict[str, str] | None = None,
                 pool_path: str | None = None, uid: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket = str(self.workdir / "kvstore.sock")
        self.pool_path = pool_path or f"/dev/shm/kvstore-run-{secrets.token_hex(4)}"
        self.log = self.workdir / "daemon.log"
        self.max_open_files = max_open_files  # the daemon's RLIMIT_NOFILE; None: inherited
        self.env = None if env is None else {**os.environ, **env}  # added to ours; None: ours
        self.uid = uid  # run the daemon as this uid and gid, no other groups (needs root); None: ours
        self.args = ["--socket", self.socket, "--pool-path", self.pool_path, "--pool-size", pool_size,
                     "--segment-size", segment_size, "--attach-timeout-s", "3", *extra]
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *extra: str, timeout: float = 60.0) -> DaemonProcess:
        """Start (again, on the same pool) and return once the health service says SERVING."""
        command = [sys.executable, "-m", "kvstore_service", "serve", *self.args, *extra]
        if self.max_open_files:
            # The limit is set by a launcher that execs the daemon, not by a preexec_fn: that makes Popen
            # fork with gRPC's threads running here, gRPC restarts its poller in the child, close_fds
            # closes the poller's epoll descriptor and the child aborts before exec (grpc/grpc#43055).
            command = [sys.executable, "-c", _WITH_FILE_LIMIT, str(self.max_open_files), *command]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         env=self.env, user=self.uid, group=self.uid,
                                         extra_groups=None if self.uid is None else [])
        client = KVStoreClient(self.socket, timeout=1.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.health() == "SERVING":
                        break
                except Unavailable:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not become healthy:\n{self.log_tail()}")
                time.sleep(0.05)
        finally:
            client.close()
        self.starts += 1
        return self

    def client(self, timeout: float = 10.0) -> KVStoreClient:
        return KVStoreClient(self.socket, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cleanup(self) -> None:
        self.stop()
        for path in (self.pool_path, f"{self.pool_path}.events"):  # (the pool, and its descriptions' journal)
            try:
                os.unlink(path)
            except OSError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-lines:])
        except OSError:
            return ""
