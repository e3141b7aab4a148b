"""Soak test: a real daemon, engine processes doing random store/load/lookup, faults injected.

    python benchmarks/soak.py [--engines 4] [--jobs 10000] [--kill-engines 100] [--kill-daemon N] [--json F]

Phase 1 runs `--engines` worker processes of `--jobs` operations each (stores, loads, lookups, some
under a lease) while `--kill-engines` extra workers are started and killed with SIGKILL mid-job one
after another. Every loaded block is verified by its engine: block contents derive from keys, so
any process can check bytes it did not write. Afterwards the daemon must hold no engine, lease,
job, mapping or shared-memory file of any worker. Phase 2 (with `--kill-daemon N`) runs the workers
again and kills the daemon with SIGKILL N times mid-traffic, restarting it on the same pool file:
stores that completed before a kill must still load byte-exact, and the workers re-register alone.

`corrupt` counts blocks whose bytes differ from their key's content (or a count the daemon got
wrong); `lost` counts blocks whose store completed but that later missed although nothing was
evicted. Both must be 0. Also importable: `ShmEngine`, `Worker` and `DaemonProcess` serve the tests.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import mmap
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore_client import KVStoreClient, KVStoreError, MemorySpec, memfd, process
from kvstore_client.protocol.completion import Completion

REPO = Path(__file__).resolve().parent.parent
Regions = Sequence[tuple[int, int, int]]


def key_of(scope: str, i: int) -> bytes:
    return hashlib.sha256(f"{scope}/{i}".encode()).digest()


def content_of(key: bytes, size: int) -> bytes:
    """The bytes a block stored under `key` holds (the same bytes as tests/engine.py's content_of)."""
    return random.Random(key).randbytes(size)


# -- daemon --------------------------------------------------------------------------------------


class DaemonProcess(process.DaemonProcess):
    """The daemon process, plus what the soak reads of it."""

    def memory_kib(self) -> dict[str, int]:
        """VmRSS and its parts (anonymous, shared memory) in KiB; the pool is mapped, so RssShmem grows
        as it fills; RssAnon is the daemon's own heap."""
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssShmem"):
                    out[name] = int(value.split()[0])
        return out

    def references(self, needles: Sequence[str]) -> list[str]:
        return references(self.pid, needles)


def references(pid: int, needles: Sequence[str]) -> list[str]:
    """Mappings and open files of process `pid` whose path contains one of `needles`."""
    found = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            found += [line.strip() for line in f if any(n in line for n in needles)]
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if any(n in target for n in needles):
                found.append(f"fd {fd} -> {target}")
    except FileNotFoundError:
        pass
    return found


def engine_needles(pids: Sequence[int]) -> list[str]:
    """What the KV memory of these worker processes looks like in the daemon's maps and fds."""
    return [f"memfd:kvstore-kv-{pid}-" for pid in pids]


def completion_channels(pid: int) -> int:
    """Completion channels process `pid` (the daemon) maps: one per session with KV memory."""
    return sum(1 for line in references(pid, ["memfd:kvstore-done"]) if not line.startswith("fd "))


def shm_files(pid: int) -> list[str]:
    """Files in /dev/shm named after process `pid` (engines keep their memory in memfds: none). The
    pid must stand as its own token: pool names carry random hex that may contain its digits."""
    token = re.compile(rf"(^|[^0-9a-f]){pid}($|[^0-9a-f])")
    return [p for p in glob.glob("/dev/shm/*") if token.search(os.path.basename(p))]


# -- engine --------------------------------------------------------------------------------------


class ShmEngine:
    """An engine without torch: KV memory in a sealed memfd (any region layout), one session. The
    memfd is named `kvstore-kv-<pid>-<random>`, so the daemon's /proc maps tell whose it holds."""

    def __init__(self, socket: str, namespace: str, num_blocks: int, regions: Regions,
                 completion_slots: int = 1024, timeout: float = 10.0) -> None:
        self.num_blocks = num_blocks
        self.regions = list(regions)
        self.block_bytes = sum(r[2] for r in self.regions)
        self.size = max(o + (num_blocks - 1) * s + b for o, s, b in self.regions)
        self.name = f"kvstore-kv-{os.getpid()}-{secrets.token_hex(4)}"
        self.fd = memfd.create(self.name, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.spec = MemorySpec("cpu", b"", self.size, num_blocks, tuple(self.regions), fd=self.fd)
        self.client = KVStoreClient(socket, timeout=timeout)
        self.session = self.client.session(namespace, self.spec, completion_slots=completion_slots)

    @classmethod
    def contiguous(cls, socket: str, namespace: str, num_blocks: int, block_bytes: int, **kw) -> ShmEngine:
        return cls(socket, namespace, num_blocks, [(0, block_bytes, block_bytes)], **kw)

    def read(self, block: int) -> bytes:
        return b"".join(self.mm[o + block * s: o + block * s + n] for o, s, n in self.regions)

    def write(self, block: int, data: bytes) -> None:
        at = 0
        for o, s, n in self.regions:
            self.mm[o + block * s: o + block * s + n] = data[at: at + n]
            at += n

    def fill(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        for key, b in zip(keys, blocks, strict=True):
            self.write(b, content_of(key, self.block_bytes))

    def zero(self, blocks: Sequence[int]) -> None:
        zeros = bytes(self.block_bytes)
        for b in blocks:
            self.write(b, zeros)

    def corrupt_blocks(self, keys: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Blocks whose bytes differ from their key's content."""
        return sum(self.read(b) != content_of(k, self.block_bytes) for k, b in zip(keys, blocks, strict=True))

    def store(self, keys: Sequence[bytes], blocks: Sequence[int], timeout: float = 30.0) -> Completion:
        self.fill(keys, blocks)
        job = self.session.store(keys, blocks)
        return self.session.wait([job], timeout)[job]

    def load(self, keys: Sequence[bytes], blocks: Sequence[int], timeout: float = 30.0) -> Completion:
        self.zero(blocks)
        job = self.session.load(keys, blocks)
        return self.session.wait([job], timeout)[job]

    def close(self) -> None:
        self.session.close()
        self.client.close()
        self.mm.close()
        os.close(self.fd)


# -- worker --------------------------------------------------------------------------------------


@dataclass
class WorkerConfig:
    socket: str
    namespace: str = "soak"
    scope: str = "own0"  # this worker's own keys: the only ones whose loss it can tell
    read_scopes: tuple[str, ...] = ("shared",)  # other key spaces it loads and verifies
    keys: int = 256
    shared_keys: int = 64
    num_blocks: int = 64
    block_bytes: int = 16 * 1024
    jobs: int = 1000  # operations (store, load, lookup) before it stops
    depth: int = 4  # jobs in flight
    seed: int = 0


@dataclass
class WorkerReport:
    pid: int = 0
    ops: int = 0
    stores: int = 0
    stored_blocks: int = 0
    loads: int = 0
    loaded_blocks: int = 0  # verified byte-exact
    missed_blocks: int = 0
    lookups: int = 0
    leases: int = 0
    corrupt: int = 0
    lost: int = 0
    lost_excused: int = 0  # misses of stored blocks while the daemon had evicted something
    failed_jobs: int = 0  # reported failed as a whole (daemon gone, request refused)
    rpc_errors: int = 0
    registrations: int = 0
    connected: bool = False
    ok_after_reregister: int = 0  # jobs that succeeded under a later registration
    # lost blocks whose completed store had overlapped another in-flight store of the same key
    lost_after_inflight_dedupe: int = 0
    lost_keys: list[str] = field(default_factory=list)


@dataclass
class _Job:
    is_store: bool
    keys: list[bytes]
    blocks: list[int]
    registration: int
    own: bool
    overlapping: set[bytes] = field(default_factory=set)  # keys also in an earlier unfinished store


class Worker:
    """Random stores, loads and lookups with every loaded byte verified; survives daemon restarts."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed or os.getpid())
        self.engine = ShmEngine.contiguous(config.socket, config.namespace, config.num_blocks,
                                           config.block_bytes)
        self.session = self.engine.session
        self.own = [key_of(config.scope, i) for i in range(config.keys)]
        self.shared = [key_of("shared", i) for i in range(config.shared_keys)]
        self.others = [key_of(s, i) for s in config.read_scopes if s != "shared" for i in range(config.keys)]
        self.stored: set[bytes] = set()  # own keys whose store completed in full
        self.deduped: set[bytes] = set()  # stored while an earlier store of the same key was in flight
        self.jobs: dict[int, _Job] = {}
        self.free = set(range(config.num_blocks))
        self.zeros = bytes(config.block_bytes)
        self.report = WorkerReport(pid=os.getpid())

    def run(self, stop: threading.Event | None = None) -> WorkerReport:
        while self.report.ops < self.config.jobs and not (stop is not None and stop.is_set()):
            self.step()
        deadline = time.monotonic() + 60
        while self.jobs and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.001)
        self.report.registrations = self.session.registrations
        self.report.connected = self.session.connected
        return self.report

    def close(self) -> None:
        self.engine.close()

    def step(self) -> None:
        self._reap()
        if not self.session.connected:
            time.sleep(0.01)
            return
        if len(self.jobs) >= self.config.depth or len(self.free) < 8:
            time.sleep(0.0005)
            return
        r = self.rng.random()
        if r < 0.4:
            self._store()
        elif r < 0.8:
            self._load()
        else:
            self._lookup()

    def _take_blocks(self, n: int) -> list[int]:
        blocks = self.rng.sample(sorted(self.free), n)
        self.free.difference_update(blocks)
        return blocks

    def _store(self) -> None:
        own = self.rng.random() < 0.8
        keys = self.rng.sample(self.own if own else self.shared, self.rng.randint(1, 8))
        blocks = self._take_blocks(len(keys))
        self.engine.fill(keys, blocks)
        registration = self.session.registrations
        overlapping = {k for j in self.jobs.values() if j.is_store for k in j.keys}.intersection(keys)
        job = self.session.store(keys, blocks)
        self.jobs[job] = _Job(True, keys, blocks, registration, own, overlapping)

    def _load(self) -> None:
        pool = sorted(self.stored) if self.stored and self.rng.random() < 0.5 else self.shared + self.others
        if not pool:
            pool = self.own
        keys = self.rng.sample(pool, min(len(pool), self.rng.randint(1, 8)))
        blocks = self._take_blocks(len(keys))
        self.engine.zero(blocks)
        registration = self.session.registrations
        job = self.session.load(keys, blocks)
        self.jobs[job] = _Job(False, keys, blocks, registration, False)

    def _lookup(self) -> None:
        self.report.ops += 1
        self.report.lookups += 1
        if not self.stored:
            return
        keys = self.rng.sample(sorted(self.stored), min(len(self.stored), self.rng.randint(1, 16)))
        lease = self.rng.random() < 0.3
        registration = self.session.registrations
        try:
            hits, lease_id = self.session.lookup(keys, lease=lease, lease_ttl_ms=self.rng.choice([0, 50, 5000]))
            if lease_id:
                self.report.leases += 1
                self.session.release_lease(lease_id, wait=True)
        except KVStoreError:
            self.report.rpc_errors += 1
            return
        if hits < len(keys) and registration == self.session.registrations:
            self._missing(keys[hits])

    def _missing(self, key: bytes) -> None:
        """A key whose store completed in full did not load or look up: ask the daemon once more (a
        job the client failed locally looks like a miss), then count it lost unless evictions explain it."""
        try:
            if self.session.lookup([key])[0] == 1:
                return
            evicted = self.engine.client.stats().evictions > 0
        except KVStoreError:
            self.report.rpc_errors += 1
            return
        if evicted:
            self.report.lost_excused += 1
        else:
            self.report.lost += 1
            self.report.lost_keys.append(key.hex()[:16])
            if key in self.deduped:
                self.report.lost_after_inflight_dedupe += 1
        self.stored.discard(key)

    def _reap(self) -> None:
        for c in self.session.poll():
            job = self.jobs.pop(c.job_id, None)
            if job is None:
                continue
            self._finish(job, c)
            self.free.update(job.blocks)

    def _finish(self, job: _Job, c: Completion) -> None:
        self.report.ops += 1
        # A job that spans a lost connection or a re-registration was failed by the client, whatever
        # the dead daemon had copied: it tells nothing (and its blocks may hold half a copy).
        disrupted = (job.registration != self.session.registrations or not self.session.connected
                     or c.blocks_ok + c.blocks_failed != len(job.keys))
        if disrupted:
            self.report.failed_jobs += 1
            return
        later = job.registration > 1
        if job.is_store:
            self.report.stores += 1
            self.report.stored_blocks += c.blocks_ok
            if c.blocks_failed == 0:
                if job.own:
                    self.stored.update(job.keys)
                    self.deduped.update(job.overlapping)
                self.report.ok_after_reregister += later
            return
        self.report.loads += 1
        good = 0
        for key, b in zip(job.keys, job.blocks, strict=True):
            data = self.engine.read(b)
            if data == content_of(key, self.config.block_bytes):
                good += 1
            elif data == self.zeros:  # not loaded (missing): nothing written
                self.report.missed_blocks += 1
                if key in self.stored:
                    self._missing(key)
            else:
                self.report.corrupt += 1  # torn or foreign bytes served
        if good != c.blocks_ok:
            self.report.corrupt += abs(good - c.blocks_ok)  # the daemon's count disagrees with the bytes
        self.report.loaded_blocks += good
        self.report.ok_after_reregister += later and c.blocks_failed == 0


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="soak.py worker")
    p.add_argument("--socket", required=True)
    p.add_argument("--namespace", default="soak")
    p.add_argument("--scope", default="own0")
    p.add_argument("--read-scopes", default="shared")
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--shared-keys", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-bytes", type=int, default=16 * 1024)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--until-eof", action="store_true", help="run until stdin closes, not --jobs operations")
    a = p.parse_args(argv)
    config = WorkerConfig(a.socket, a.namespace, a.scope, tuple(a.read_scopes.split(",")), a.keys, a.shared_keys,
                          a.num_blocks, a.block_bytes, a.jobs, a.depth, a.seed)
    worker = Worker(config)
    stop = threading.Event()
    if a.until_eof:
        config.jobs = 1 << 62
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    report = worker.run(stop)
    worker.close()
    print(json.dumps(asdict(report)), flush=True)


def spawn_worker(socket: str, *args: str) -> subprocess.Popen:
    """A worker process; its first stdout line is `ready` once it registered, its last a JSON report.
    With `--until-eof` it works until its stdin is closed."""
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "worker", "--socket", socket, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)


def wait_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"worker {proc.pid} did not start (exit {proc.wait()}): {line!r}")


def collect(proc: subprocess.Popen, timeout: float = 600) -> dict:
    """Close its stdin (which ends an `--until-eof` worker) and read its report."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {proc.pid} exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def kill_mid_job(socket: str, count: int, rng: random.Random, *args: str,
                 before_kill: Callable[[], object] | None = None) -> list[int]:
    """Start workers one after another and SIGKILL each while its jobs run. Returns their pids."""
    pids = []
    for _ in range(count):
        proc = spawn_worker(socket, "--jobs", "1000000", *args)
        wait_ready(proc)
        time.sleep(rng.uniform(0.02, 0.25))
        if before_kill is not None:
            before_kill()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        pids.append(proc.pid)
    return pids


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


# -- soak ----------------------------------------------------------------------------------------


def _sum(reports: list[dict], name: str) -> int:
    return sum(int(r[name]) for r in reports)


def _worker_args(a: argparse.Namespace, index: int) -> list[str]:
    scopes = ",".join(["shared", "kill"] + [f"own{i}" for i in range(a.engines) if i != index])
    return ["--scope", f"own{index}", "--read-scopes", scopes, "--keys", str(a.keys), "--jobs", str(a.jobs),
            "--block-bytes", str(a.block_bytes), "--seed", str(a.seed * 1000 + index + 1)]


def _idle(client: KVStoreClient) -> bool:
    stats = client.stats()
    return stats.engines == 0 and stats.leases == 0 and stats.jobs_in_flight == 0


def _leak_check(daemon: DaemonProcess, client: KVStoreClient, killed: list[int]) -> dict:
    """After every worker ended: no session, lease or job left, no memory of a killed worker still
    mapped or open in the daemon, no completion channel left, nothing of theirs in /dev/shm."""
    settled = wait_for(lambda: _idle(client))
    stats = client.stats()
    wait_for(lambda: not daemon.references(engine_needles(killed)) and not completion_channels(daemon.pid),
             timeout=10)
    return {"settled": settled, "engines": stats.engines, "leases": stats.leases,
            "jobs_in_flight": stats.jobs_in_flight, "leaked_mappings": len(daemon.references(engine_needles(killed))),
            "leaked_channels": completion_channels(daemon.pid),
            "leaked_files": sum(len(shm_files(pid)) for pid in killed)}


def soak(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    workdir = tempfile.mkdtemp(prefix="kvstore-soak-")
    needed = (a.engines * a.keys + 64 + 256) * a.block_bytes
    pool = max(64 << 20, 2 * needed + (8 << 20))
    daemon = DaemonProcess(workdir, str(pool), "4MiB").start()
    client = KVStoreClient(daemon.socket)
    result: dict = {"engines": a.engines, "jobs_per_engine": a.jobs, "kill_engines": a.kill_engines,
                    "kill_daemon": a.kill_daemon, "pool_bytes": pool}
    try:
        shm_before = sorted(glob.glob("/dev/shm/kvstore-*"))
        result["rss_kib_before"] = daemon.memory_kib()
        samples: list[int] = []  # RssAnon every half second: flat, or growing with the work done?
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.5):
                samples.append(daemon.memory_kib()["RssAnon"])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        workers = [spawn_worker(daemon.socket, *_worker_args(a, i)) for i in range(a.engines)]
        for w in workers:
            wait_ready(w)
        killed = kill_mid_job(daemon.socket, a.kill_engines, rng, "--scope", "kill", "--keys", "128",
                              "--block-bytes", str(a.block_bytes), "--read-scopes", "shared")
        reports = [collect(w) for w in workers]
        sampling.set()
        sampler.join()
        result["phase1_seconds"] = round(time.monotonic() - started, 1)
        # RssAnon at 0, 25, 50, 75 and 100 % of phase 1
        result["rss_anon_kib_during"] = [samples[round(f * (len(samples) - 1))] for f in (0, .25, .5, .75, 1)] \
            if samples else []
        result["leaks"] = _leak_check(daemon, client, killed)
        stats = client.stats()
        result["rss_kib_after"] = daemon.memory_kib()
        result["phase1"] = _summarize(reports, stats)
        shm_after = sorted(glob.glob("/dev/shm/kvstore-*"))
        result["shm_files_before"] = len(shm_before)
        result["shm_files_after"] = len(shm_after)
        result["shm_files_new"] = sorted(set(shm_after) - set(shm_before) - {daemon.pool_path})

        if a.kill_daemon:
            # The workers run until every kill is done and they worked a while on the last daemon.
            started = time.monotonic()
            workers = [spawn_worker(daemon.socket, *_worker_args(a, i), "--until-eof") for i in range(a.engines)]
            for w in workers:
                wait_ready(w)
            for _ in range(a.kill_daemon):
                time.sleep(rng.uniform(0.5, 2.0))
                daemon.kill()
                daemon.start()
            time.sleep(8.0)  # reconnect backoff is at most 5 s, then traffic on the last daemon
            reports = [collect(w) for w in workers]
            client.close()
            client = KVStoreClient(daemon.socket)
            stats = client.stats()
            result["phase2_seconds"] = round(time.monotonic() - started, 1)
            result["daemon_kills"] = a.kill_daemon
            result["phase2"] = _summarize(reports, stats)
            result["phase2"]["min_registrations"] = min(r["registrations"] for r in reports)
            result["phase2"]["all_connected"] = all(r["connected"] for r in reports)
            result["phase2"]["ok_after_reregister"] = _sum(reports, "ok_after_reregister")
            result["phase2"]["leaks"] = _leak_check(daemon, client, [])
        result["daemon_alive"] = daemon.alive()
    finally:
        client.close()
        daemon.cleanup()
    phases = [result[p] for p in ("phase1", "phase2") if p in result]
    leaks = [result["leaks"]] + [p["leaks"] for p in phases if "leaks" in p]
    result["ok"] = (all(p["corrupt"] == 0 and p["lost"] == 0 for p in phases) and result["daemon_alive"]
                    and all(x["settled"] and not (x["leaked_files"] or x["leaked_mappings"] or x["leaked_channels"])
                            for x in leaks))
    return result


def _summarize(reports: list[dict], stats) -> dict:
    names = ("ops", "stores", "stored_blocks", "loads", "loaded_blocks", "missed_blocks", "lookups", "leases",
             "corrupt", "lost", "lost_excused", "lost_after_inflight_dedupe", "failed_jobs", "rpc_errors")
    out = {n: _sum(reports, n) for n in names}
    out.update(daemon_blocks=stats.blocks, daemon_evictions=stats.evictions,
               daemon_corrupt_blocks=stats.corrupt_blocks, daemon_failed_blocks=stats.failed_blocks)
    return out


def print_table(result: dict) -> None:
    rows: list[tuple[str, object]] = [
        ("engines x ops", f"{result['engines']} x {result['jobs_per_engine']}"),
        ("pool bytes", result["pool_bytes"]),
    ]
    for phase in ("phase1", "phase2"):
        if phase not in result:
            continue
        p = result[phase]
        rows += [(f"{phase} {k}", v) for k, v in p.items() if k != "leaks"]
        rows.append((f"{phase} seconds", result[f"{phase}_seconds"]))
    rows += [(f"leaks {k}", v) for k, v in result["leaks"].items()]
    if "phase2" in result:
        rows += [("daemon kills", result["daemon_kills"])]
        rows += [(f"phase2 leaks {k}", v) for k, v in result["phase2"]["leaks"].items()]
    rows += [("engines killed", result["kill_engines"]),
             ("daemon RSS KiB before", result["rss_kib_before"]), ("daemon RSS KiB after", result["rss_kib_after"]),
             ("daemon RssAnon KiB during phase 1", result["rss_anon_kib_during"]),
             ("/dev/shm kvstore files before", result["shm_files_before"]),
             ("/dev/shm kvstore files after", result["shm_files_after"]),
             ("new /dev/shm files left", len(result["shm_files_new"])), ("daemon alive", result["daemon_alive"]),
             ("OK", result["ok"])]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--jobs", type=int, default=10000, help="operations per engine process")
    p.add_argument("--kill-engines", type=int, default=100, help="engine processes killed mid-job (phase 1)")
    p.add_argument("--kill-daemon", type=int, default=0, help="daemon SIGKILLs + restarts (phase 2)")
    p.add_argument("--keys", type=int, default=256, help="own keys per engine")
    p.add_argument("--block-bytes", type=int, default=16 * 1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args()
    result = soak(a)
    print_table(result)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
