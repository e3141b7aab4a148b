"""`kvstore bench`: the data path and control path measured against their physical limits, in one run."""

from __future__ import annotations

import contextlib
import ctypes
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
from kvstore_service.harness import DaemonProcess


@contextlib.contextmanager
def private_daemon(pool_bytes: int, copy_threads: int) -> Iterator[str]:
    """A daemon of our own on a temp socket and pool file, stopped afterwards."""
    daemon = DaemonProcess(tempfile.mkdtemp(prefix="kvstore-bench-"), str(pool_bytes), "64MiB", "--fresh",
                           "--copy-threads", str(copy_threads), "--log-level", "WARNING")
    try:
        yield daemon.start().socket
    finally:
        daemon.cleanup()
        shutil.rmtree(daemon.workdir, ignore_errors=True)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Microseconds per call."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def paired_ratios(gbps: list[float], limits: list[float]) -> list[float]:
    """Each round's GB/s over the limit measured right before it."""
    return [rate / limit for rate, limit in zip(gbps, limits, strict=True)]


class Memcpy:
    """The limit: one contiguous copy of the same bytes between two shared-memory buffers."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.src, self.dst = SharedKVMemory(total), SharedKVMemory(total)
        self.src.tensor.fill_(7)
        self.dst.tensor.fill_(0)  # fault the pages in first, as the pool and cache are

    def gbps(self, rounds: int, copy_engine: bool = False) -> float:
        """Best of `rounds` with memcpy or, with `copy_engine`, with the native copy engine on two
        threads (streaming stores: faster than memcpy on x86-64 with AVX2)."""
        src, dst = self.src.tensor.data_ptr(), self.dst.tensor.data_ptr()
        one_run, size = array("Q", [0]), array("Q", [self.total])
        copy = ((lambda: native.copy_blocks(src, dst, one_run, one_run, size, 2)) if copy_engine
                else (lambda: ctypes.memmove(dst, src, self.total)))
        best = min(timed(copy, rounds))
        return self.total / (best / 1e6) / 1e9

    def close(self) -> None:
        self.src.close()
        self.dst.close()


def device_copy_gbps(backend: str, total: int, rounds: int) -> float:
    """The limit on a device: one pinned host -> device copy of the same bytes, in this process."""
    device = torch.device(backend)
    host = torch.ones(total, dtype=torch.uint8).pin_memory()
    dev = torch.empty(total, dtype=torch.uint8, device=device)

    def once() -> None:
        dev.copy_(host, non_blocking=True)
        synchronize_before_store(device)

    once()
    return total / (min(timed(once, rounds)) / 1e6) / 1e9


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

    def __init__(self, client: KVStoreClient, backend: str, blocks: int, block_bytes: int, rounds: int) -> None:
        self.client, self.backend, self.blocks = client, backend, blocks
        self.total = blocks * block_bytes
        self.memcpy = Memcpy(self.total)
        self.device_gbps = device_copy_gbps(backend, self.total, rounds) if backend != "cpu" else 0.0
        self.cache_blocks = 2 * blocks  # block ids scattered over a cache twice the job's size
        self.memory, spec, self.kv = engine_memory(backend, self.cache_blocks, block_bytes)
        self.session = client.session(f"bench-{secrets.token_hex(4)}", spec)
        self.rng = random.Random(0)
        self.limits: list[float] = []
        self.engine_limits: list[float] = []  # cpu: the copy engine's own contiguous copy, paired likewise
        self.stored: list[list[bytes]] = []  # keys of the measured stores

    def ids(self) -> list[int]:
        """Block ids scattered over the cache."""
        return self.rng.sample(range(self.cache_blocks), self.blocks)

    def job(self) -> tuple[list[bytes], list[int]]:
        return [secrets.token_bytes(32) for _ in range(self.blocks)], self.ids()

    def measure_limits(self) -> None:
        self.limits.append(self.device_gbps or self.memcpy.gbps(3))
        if self.backend == "cpu":
            self.engine_limits.append(self.memcpy.gbps(3, copy_engine=True))

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
    """Store and load GB/s, each round paired with the limits measured right before it."""
    warm = run.job()  # not measured: the first jobs touch code and memory nothing touched before
    run.store(*warm)
    run.load(*warm)
    store, load = [], []
    for _ in range(rounds):
        keys, ids = run.job()
        wait_sealed(run.client)  # one store's latency, not the previous one's checksums
        run.measure_limits()
        store.append(run.store(keys, ids))
        run.stored.append(keys)
    # Back to back: what a burst of stores sustains, and what it sustains once its checksums are in.
    started = time.perf_counter()
    for _ in range(rounds):
        run.store(*run.job())
    copied = time.perf_counter() - started
    wait_sealed(run.client)
    sealed = time.perf_counter() - started
    for keys in run.stored:
        run.measure_limits()
        load.append(run.load(keys, run.ids()))
    results: dict[str, Any] = {
        "store_sustained_gbps": rounds * run.total / copied / 1e9,
        "store_sustained_sealed_gbps": rounds * run.total / sealed / 1e9,
        "memcpy_gbps": max(run.limits) if run.backend == "cpu" else run.memcpy.gbps(rounds),
        "store_gbps": max(store), "load_gbps": max(load),
    }
    if run.device_gbps:
        results["device_copy_gbps"] = run.device_gbps
    for name, limits in (("limit", run.limits), ("copy_engine", run.engine_limits)):
        if limits:
            ratios = paired_ratios(store + load, limits)
            results[f"store_vs_{name}"] = statistics.median(ratios[:rounds])
            results[f"load_vs_{name}"] = statistics.median(ratios[rounds:])
            results[f"store_vs_{name}_rounds"] = [round(r, 3) for r in ratios[:rounds]]
            results[f"load_vs_{name}_rounds"] = [round(r, 3) for r in ratios[rounds:]]
    if run.engine_limits:
        results["copy_engine_gbps"] = max(run.engine_limits)
        results["store_sustained_vs_copy_engine"] = results["store_sustained_gbps"] / statistics.median(
            run.engine_limits)
        results["store_sustained_sealed_vs_copy_engine"] = results["store_sustained_sealed_gbps"] / statistics.median(
            run.engine_limits)
    return results


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
              copy_threads: int = 2) -> dict[str, Any]:
    """Store and load GB/s are each paired with the limit measured right before them (best of 3):
    on a shared machine the ratio of a pair is stable while absolute GB/s are not. The reported
    ratio is the median over rounds; GB/s figures are the best round."""
    require_device(backend)
    results: dict[str, Any] = {"backend": backend, "blocks": blocks, "block_bytes": block_bytes}
    pool_bytes = (2 * rounds + 2) * blocks * block_bytes + (64 << 20)
    ctx = private_daemon(pool_bytes, copy_threads) if socket is None else contextlib.nullcontext(socket)
    with ctx as sock:
        client = KVStoreClient(sock)
        run = Run(client, backend, blocks, block_bytes, rounds)
        try:
            results.update(data_path(run, rounds))
            results.update(control_path(run, run.stored[-1]))
        finally:
            run.close()
            client.close()
    return results
