"""`kvstore bench`: the data path and control path measured against their physical limits, in one run."""

from __future__ import annotations

import contextlib
import random
import secrets
import shutil
import statistics
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from kvstore_client import KVStoreClient
from kvstore_client.client import MemorySpec, Session
from kvstore_client.device import export_kv_memory, synchronize_before_store
from kvstore_client.shm import SharedKVMemory
from kvstore_service import native
from kvstore_service.backends.cpu import PLAIN_LOAD_BYTES
from kvstore_service.bench_limits import CacheSweep, DeviceCopy, Memcpy, paired_ratios, percentile, timed
from kvstore_service.harness import DaemonProcess


@contextlib.contextmanager
def private_daemon(pool_bytes: int, copy_threads: int, env: dict[str, str] | None = None,
                   log_level: str = "WARNING") -> Iterator[str]:
    """A daemon of our own on a temp socket and pool file (`env` added to its environment; its log is
    daemon.log beside the socket), stopped afterwards."""
    daemon = DaemonProcess(tempfile.mkdtemp(prefix="kvstore-bench-"), str(pool_bytes), "64MiB", "--fresh",
                           "--copy-threads", str(copy_threads), "--log-level", log_level, env=env)
    try:
        yield daemon.start().socket
    finally:
        daemon.cleanup()
        shutil.rmtree(daemon.workdir, ignore_errors=True)


BURST = 3  # stores back to back in each round of the sustained figure


def engine_memory(backend: str, num_blocks: int, block_bytes: int) -> tuple[SharedKVMemory | None, MemorySpec,
                                                                             torch.Tensor]:
    """The benchmark engine's KV cache: shared memory on cpu, device memory exported by IPC otherwise."""
    if backend == "cpu":
        memory = SharedKVMemory(num_blocks * block_bytes)
        memory.tensor.fill_(1)
        return memory, memory.memory_spec(num_blocks, [(0, block_bytes, block_bytes)]), memory.tensor
    kv = torch.ones(num_blocks, block_bytes, dtype=torch.uint8, device=backend)
    return None, export_kv_memory([kv], num_blocks, [(0, block_bytes, block_bytes)]), kv


def run_job(session: Session, submit: Callable[[], int]) -> float:
    """Seconds from submit to completion seen through the completion channel."""
    t0 = time.perf_counter()
    job = submit()
    done = session.wait([job], timeout=120)[job]
    elapsed = time.perf_counter() - t0
    if not done.ok:
        raise RuntimeError(f"benchmark job failed: {done}")
    return elapsed


def wait_sealed(client: KVStoreClient, timeout: float = 120.0) -> None:
    """Until the daemon has taken the checksums of every stored block (it does so after the copies)."""
    deadline = time.monotonic() + timeout
    while client.stats().unsealed_blocks:
        if time.monotonic() > deadline:
            raise TimeoutError("the daemon did not seal its stored blocks in time")
        time.sleep(0.002)


class Run:
    """One engine session on a daemon, with the limits its copies are paired with."""

    def __init__(self, client: KVStoreClient, backend: str, blocks: int, block_bytes: int) -> None:
        self.client, self.backend, self.blocks = client, backend, blocks
        self.total = blocks * block_bytes
        self.memcpy = Memcpy(self.total)
        self.device = DeviceCopy(backend, self.total) if backend != "cpu" else None
        self.cache_blocks = 2 * blocks  # block ids scattered over a cache twice the job's size
        self.memory, spec, self.kv = engine_memory(backend, self.cache_blocks, block_bytes)
        self.session = client.session(f"bench-{secrets.token_hex(4)}", spec)
        self.rng = random.Random(0)
        self.ruler = "limit" if self.device else "copy_engine"  # what the ratios' names say they are of
        self.stored: list[bytes] = []  # keys of the last measured store

    def ids(self) -> list[int]:
        """Block ids scattered over the cache."""
        return self.rng.sample(range(self.cache_blocks), self.blocks)

    def job(self) -> tuple[list[bytes], list[int]]:
        return [secrets.token_bytes(32) for _ in range(self.blocks)], self.ids()

    def limit_gbps(self) -> float:
        """One copy of the fastest this machine moves the job's bytes: the pinned host -> device copy,
        or on cpu the copy engine's contiguous copy. Each round is paired with one right before it and
        one right after it. (On cpu memcpy is measured apart: a 512 MiB memmove right before a store
        cost it 0.1 of the ratio.)"""
        return self.device.gbps(1) if self.device else self.memcpy.gbps(1, copy_engine=True)

    def same_runs_gbps(self, ids: list[int], to_engine: bool) -> float:
        """cpu: the copy engine moving this job's own runs (its scattered engine blocks, a pool-like
        buffer's slots in order) on two threads with streaming stores, as the daemon's copy threads
        do, with no daemon around it: what the job's layout allows, against the contiguous limit."""
        assert self.memory is not None
        block_bytes = self.total // self.blocks
        engine = array("Q", [i * block_bytes for i in ids])
        slots, sizes = array("Q", range(0, self.total, block_bytes)), array("Q", [block_bytes] * len(ids))
        pool, kv = self.memcpy.dst.tensor.data_ptr(), self.memory.tensor.data_ptr()
        src, dst, src_offsets, dst_offsets = (pool, kv, slots, engine) if to_engine else (kv, pool, engine, slots)
        t0 = time.perf_counter()
        native.copy_blocks(src, dst, src_offsets, dst_offsets, sizes, 2, True)
        return self.total / (time.perf_counter() - t0) / 1e9

    def store(self, keys: list[bytes], ids: list[int]) -> float:
        synchronize_before_store(self.kv.device)
        return self.total / run_job(self.session, partial(self.session.store, keys, ids)) / 1e9

    def load(self, keys: list[bytes], ids: list[int]) -> float:
        return self.total / run_job(self.session, partial(self.session.load, keys, ids)) / 1e9

    def close(self) -> None:
        self.session.close()
        if self.memory is not None:
            self.memory.close()
        self.memcpy.close()


def data_path(run: Run, rounds: int) -> dict[str, Any]:
    """Store and load GB/s, each round paired with the limits measured around it. A round stores a
    job into slots used before (its namespace cleared first: a full pool's steady state) and loads
    it back into other block ids. (A first write into pool pages populated long before, which a
    pool sized for every round would measure, ran at 3-19 GB/s against 20-25 GB/s again on our
    2-vCPU VM: the hypervisor's doing, not the daemon's.)"""
    warm = run.job()  # not measured: the first jobs touch code and memory nothing touched before
    run.store(*warm)
    run.load(*warm)
    store, load, store_limits, load_limits = [], [], [], []
    same_runs: dict[str, list[float]] = {"store": [], "load": []}  # cpu: the job's runs copied without the daemon
    for _ in range(rounds):
        keys, ids = run.job()
        wait_sealed(run.client)  # one store's latency, not the previous one's checksums
        run.client.clear(run.session.namespace)
        store_limits.append(run.limit_gbps())
        if run.memory is not None:
            same_runs["store"].append(run.same_runs_gbps(ids, False))
        store.append(run.store(keys, ids))
        run.stored = keys
        wait_sealed(run.client)  # (a limit copied beside the seals ran at ~0.7 of a quiet one's speed)
        store_limits.append(run.limit_gbps())
        load_limits.append(run.limit_gbps())
        ids = run.ids()
        if run.memory is not None:
            same_runs["load"].append(run.same_runs_gbps(ids, True))
        load.append(run.load(keys, ids))
        load_limits.append(run.limit_gbps())
    limits, name = store_limits + load_limits, run.ruler
    results: dict[str, Any] = {
        "memcpy_gbps": run.memcpy.gbps(rounds), "store_gbps": max(store), "load_gbps": max(load),
        "device_copy_gbps" if run.device else "copy_engine_gbps": max(limits),
        f"{name}_gbps_median": statistics.median(limits),
    }
    ratios = paired_ratios(store + load, limits)
    results[f"store_vs_{name}"] = statistics.median(ratios[:rounds])
    results[f"load_vs_{name}"] = statistics.median(ratios[rounds:])
    results[f"store_vs_{name}_rounds"] = [round(r, 3) for r in ratios[:rounds]]
    results[f"load_vs_{name}_rounds"] = [round(r, 3) for r in ratios[rounds:]]
    if same_runs["store"]:
        # What the daemon adds, apart from what the job's layout costs any copy: each job against
        # its own runs copied right before it, and those copies against the limit around them.
        for kind, jobs in (("store", store), ("load", load)):
            results[f"{kind}_vs_same_runs"] = statistics.median(
                job / copy for job, copy in zip(jobs, same_runs[kind], strict=True))
        results["same_runs_vs_copy_engine"] = statistics.median(
            paired_ratios(same_runs["store"] + same_runs["load"], limits))
    return results


def sustained(run: Run, rounds: int, burst: int = BURST) -> dict[str, Any]:
    """Bursts of `burst` stores back to back (their seals yield to the copies), each burst paired with
    the limits measured around it: what stores sustain, and what they sustain once sealed. Into a full
    pool, a busy node's steady state: stores not measured fill it first, until one evicts, and then
    each stored block evicts an old one (a namespace cleared before each burst would hide what
    evictions cost)."""
    copied, sealed, limits = [], [], []
    stats = run.client.stats()
    for _ in range(stats.capacity_bytes // run.total + 1):
        run.store(*run.job())
        if run.client.stats().evictions > stats.evictions:
            break
    evictions = run.client.stats().evictions
    for _ in range(rounds):
        wait_sealed(run.client)
        jobs = [run.job() for _ in range(burst)]
        limits.append(run.limit_gbps())
        if run.backend != "cpu":
            synchronize_before_store(run.kv.device)
        started = time.perf_counter()
        ids = [run.session.store(keys, block_ids) for keys, block_ids in jobs]
        for job, done in run.session.wait(ids, timeout=120).items():
            if not done.ok:
                raise RuntimeError(f"benchmark job {job} failed: {done}")
        copied.append(burst * run.total / (time.perf_counter() - started) / 1e9)
        wait_sealed(run.client)
        sealed.append(burst * run.total / (time.perf_counter() - started) / 1e9)
        limits.append(run.limit_gbps())
    results: dict[str, Any] = {"store_sustained_gbps": max(copied), "store_sustained_sealed_gbps": max(sealed),
                               "store_sustained_evicted_blocks": run.client.stats().evictions - evictions}
    run.client.clear(run.session.namespace)
    ratios, name = paired_ratios(copied, limits), run.ruler
    results[f"store_sustained_vs_{name}"] = statistics.median(ratios)
    results[f"store_sustained_vs_{name}_rounds"] = [round(r, 3) for r in ratios]
    results[f"store_sustained_sealed_vs_{name}"] = statistics.median(paired_ratios(sealed, limits))
    return results


class SmallLoad:
    """A vLLM-sized hit: `blocks` blocks of a layout with a K and a V region per layer (vLLM's CPU
    and CUDA caches), each `region_bytes` (16 tokens x 8 KV heads x 128 x bf16 = 32 KiB), loaded
    into scattered block ids. Its limit: the same copy without the daemon, i.e. the native engine
    copying the same runs from a pool-like buffer as the daemon does (cpu: up to PLAIN_LOAD_BYTES on
    one thread with plain stores, else streamed on two) or one pinned host -> device copy of the same
    bytes (devices). On cpu, both the limit's copy and the daemon's load start with the host's caches
    cold (`CacheSweep`), as after a forward pass: a limit copied again from a warm source was ~7% faster
    than any the daemon can make from its pool (16 blocks of 64 x 32 KiB, 5.07 vs 5.41 ms)."""

    def __init__(self, client: KVStoreClient, backend: str, blocks: int, layers: int, region_bytes: int) -> None:
        self.backend, self.blocks = backend, blocks
        self.cache_blocks = 4 * blocks
        regions = [(r * self.cache_blocks * region_bytes, region_bytes, region_bytes) for r in range(2 * layers)]
        self.block_bytes = 2 * layers * region_bytes
        self.total = blocks * self.block_bytes
        size = self.cache_blocks * self.block_bytes
        if backend == "cpu":
            self.memory: SharedKVMemory | None = SharedKVMemory(size)
            self.memory.tensor.fill_(1)
            spec, self.kv = self.memory.memory_spec(self.cache_blocks, regions), self.memory.tensor
            self.pool_like: SharedKVMemory | None = SharedKVMemory(self.total)
            self.pool_like.tensor.fill_(2)
        else:
            self.memory, self.pool_like = None, None
            self.kv = torch.ones(size, dtype=torch.uint8, device=backend)
            spec = export_kv_memory([self.kv], self.cache_blocks, regions)
            self.device = DeviceCopy(backend, self.total)
        self.regions = regions
        self.sweep = CacheSweep() if backend == "cpu" else None
        self.session = client.session(f"bench-small-{secrets.token_hex(4)}", spec)
        self.rng = random.Random(1)
        self.keys = [secrets.token_bytes(32) for _ in range(blocks)]
        synchronize_before_store(self.kv.device)
        run_job(self.session, partial(self.session.store, self.keys, self.rng.sample(range(self.cache_blocks),
                                                                                     blocks)))

    def copy_seconds(self, ids: list[int], rounds: int = 3) -> float:
        """The limit for a load into these block ids: best of `rounds`."""
        if self.backend != "cpu":
            return self.total / self.device.gbps(rounds) / 1e9
        assert self.memory is not None and self.pool_like is not None
        src, dst = self.pool_like.tensor.data_ptr(), self.memory.tensor.data_ptr()
        pool_offsets, engine_offsets, sizes = array("Q"), array("Q"), array("Q")
        before = 0
        for offset, stride, size in self.regions:  # region-major, as the daemon plans a load
            pool_offsets.extend(k * self.block_bytes + before for k in range(len(ids)))
            engine_offsets.extend(offset + b * stride for b in ids)
            sizes.extend([size] * len(ids))
            before += size
        # As the daemon copies it: whole on one thread with plain stores, or streamed on two threads.
        threads, streaming = (1, False) if self.total <= PLAIN_LOAD_BYTES else (2, True)
        best = float("inf")
        for _ in range(rounds):
            self._sweep()
            t0 = time.perf_counter()
            native.copy_blocks(src, dst, pool_offsets, engine_offsets, sizes, threads, streaming)
            best = min(best, time.perf_counter() - t0)
        return best

    def load_seconds(self, ids: list[int]) -> float:
        """Submit-to-completion of the hit's load into these block ids (on cpu, caches cold)."""
        self._sweep()
        return run_job(self.session, partial(self.session.load, self.keys, ids))

    def _sweep(self) -> None:
        if self.sweep is not None:
            self.sweep()

    def measure(self, rounds: int, name: str = "small_load") -> dict[str, Any]:
        """Submit-to-completion of the load, each round paired with the limit measured right before it
        (reported as `name`_...)."""
        ids = self.rng.sample(range(self.cache_blocks), self.blocks)
        run_job(self.session, partial(self.session.load, self.keys, ids))  # warm
        over_us, ratios, job_us, copy_us = [], [], [], []
        for _ in range(rounds):
            ids = self.rng.sample(range(self.cache_blocks), self.blocks)
            limit = self.copy_seconds(ids)
            took = self.load_seconds(ids)
            over_us.append((took - limit) * 1e6)
            ratios.append(took / limit)
            job_us.append(took * 1e6)
            copy_us.append(limit * 1e6)
        return {
            f"{name}_blocks": self.blocks, f"{name}_bytes": self.total, f"{name}_regions": len(self.regions),
            f"{name}_p50_us": statistics.median(job_us), f"{name}_copy_p50_us": statistics.median(copy_us),
            f"{name}_overhead_p50_us": statistics.median(over_us), f"{name}_vs_copy": statistics.median(ratios),
        }

    def close(self) -> None:
        self.session.close()
        for memory in (self.memory, self.pool_like):
            if memory is not None:
                memory.close()


def control_path(run: Run, keys: list[bytes]) -> dict[str, Any]:
    """The RPC floor, a 1000-key lookup, and an engine's per-step submit and poll costs."""
    # Interleaved in batches, so that both medians see the same machine.
    lookup_keys = keys[:1000] + [secrets.token_bytes(32) for _ in range(max(0, 1000 - len(keys)))]
    empty_us, lookup_us = [], []
    for _ in range(10):
        empty_us += timed(run.client.health, 30)
        lookup_us += timed(lambda: run.session.lookup(lookup_keys), 30)
    small = 64
    submit_us, poll_us = [], []
    for i in range(200):
        some = keys[(i * small) % len(keys):][:small]
        t0 = time.perf_counter()
        job = run.session.load(some, list(range(len(some))))
        submit_us.append((time.perf_counter() - t0) * 1e6)
        while True:  # the engine's per-step check, measured while the job runs and after
            t0 = time.perf_counter()
            done = run.session.poll()
            poll_us.append((time.perf_counter() - t0) * 1e6)
            if done:
                assert done[0].job_id == job and done[0].ok
                break
    return {
        "grpc_empty_p50_us": statistics.median(empty_us), "lookup_1k_p50_us": statistics.median(lookup_us),
        "lookup_vs_grpc_empty": statistics.median(lookup_us) / statistics.median(empty_us),
        "submit_p50_us": statistics.median(submit_us), "submit_p99_us": percentile(submit_us, 0.99),
        "poll_p50_us": statistics.median(poll_us), "poll_p99_us": percentile(poll_us, 0.99),
    }


class DeviceUnavailable(RuntimeError):
    """The benchmark's backend cannot run on this machine."""


def require_device(backend: str) -> None:
    """Refuse, with one line, a backend this machine cannot run (else torch fails deep inside the limit)."""
    if backend == "cpu":
        return
    if backend == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError:
            raise DeviceUnavailable("--backend npu needs torch_npu, which is not installed here") from None
    module = getattr(torch, backend)
    if not module.is_available():
        raise DeviceUnavailable(f"--backend {backend}: no {backend.upper()} device is usable here "
                           f"(torch {torch.__version__} sees none)")


def run_bench(socket: str | None, blocks: int, block_bytes: int, rounds: int, backend: str,
              copy_threads: int = 2, small_blocks: int = 16, small_layers: int = 32,
              small_region_bytes: int = 32 << 10, small_rounds: int = 30, hit_blocks: int = 128) -> dict[str, Any]:
    """Store and load GB/s are each paired with the limit measured around them (one copy before, one after):
    on a shared machine the ratio of a pair is stable while absolute GB/s are not. The reported
    ratio is the median over rounds; GB/s figures are the best round. Then the control path, the
    overhead of a small vLLM-sized load (an engine step's hit) and of a 2048-token hit (`hit_blocks`
    blocks of 16 tokens) over their copies, and bursts of stores (sustained)."""
    require_device(backend)
    results: dict[str, Any] = {"backend": backend, "blocks": blocks, "block_bytes": block_bytes, "rounds": rounds}
    job_bytes = blocks * block_bytes
    small_bytes = (small_blocks + hit_blocks) * 2 * small_layers * small_region_bytes
    pool_bytes = (BURST + 2) * job_bytes + 2 * small_bytes + (64 << 20)
    ctx = private_daemon(pool_bytes, copy_threads) if socket is None else contextlib.nullcontext(socket)
    with ctx as sock:
        client = KVStoreClient(sock)
        run = Run(client, backend, blocks, block_bytes)
        try:
            results.update(data_path(run, rounds))
            results.update(control_path(run, run.stored))
            for name, n, hit_rounds in (("small_load", small_blocks, small_rounds),
                                        ("hit_2048", hit_blocks, max(3, small_rounds // 3))):
                small = SmallLoad(client, backend, n, small_layers, small_region_bytes)
                try:
                    results.update(small.measure(hit_rounds, name))
                finally:
                    small.close()
            results.update(sustained(run, rounds))
        finally:
            run.close()
            client.close()
    return results
