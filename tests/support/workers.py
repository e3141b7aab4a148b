"""Engine workers: random stores, loads and lookups (some under a lease) of keys whose block
contents derive from them, every loaded byte verified; they survive daemon restarts. In this
process (`Worker`) or each in its own (`spawn_worker`, which runs this module as a script)::

    python -m support.workers --socket S [--scope own0] [--jobs 1000] [--until-eof] ...

(with tests/ on PYTHONPATH: `support.child_env()`). Its first stdout line is `ready` once it
registered, its last a JSON `WorkerReport`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvstore_client import KVStoreError
from kvstore_client.protocol.completion import Completion
from support import REPO, child_env
from support.blocks import content_of, key_of
from support.shm_engine import ShmEngine


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
    p = argparse.ArgumentParser(prog="python -m support.workers")
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
    return subprocess.Popen([sys.executable, "-m", "support.workers", "--socket", socket, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=child_env())


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


if __name__ == "__main__":
    worker_main(sys.argv[1:])
