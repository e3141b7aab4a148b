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

import torch

from kvstore_client import KVStoreClient
from kvstore_client.client import MemorySpec, Session
from kvstore_client.device import export_kv_memory, synchronize_before_store
from kvstore_client.process import DaemonProcess
from kvstore_client.shm import SharedKVMemory
from kvstore_service import native


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
    return None, export_kv_memory([kv]), kv


def run_job(session: Session, submit: Callable[[], int]) -> float:
    """Seconds from submit to completion seen through the completion channel."""
    t0 = time.perf_counter()
    job = submit()
    done = session.wait([job], timeout=120)[job]
    elapsed = time.perf_counter() - t0
    if not done.ok:
        raise RuntimeError(f"benchmark job failed: {done}")
    return elapsed


def run_bench(socket: str | None, blocks: int, block_bytes: int, rounds: int, backend: str,
              copy_threads: int = 2) -> dict:
    """Store and load GB/s are each paired with the limit measured right before them (best of 3):
    on a shared machine the ratio of a pair is stable while absolute GB/s are not. The reported
    ratio is the median over rounds; GB/s figures are the best round."""
    total = blocks * block_bytes
    results: dict = {"backend": backend, "blocks": blocks, "block_bytes": block_bytes, "native": native.NATIVE}
    memcpy = Memcpy(total)
    if backend != "cpu":
        results["device_copy_gbps"] = device_copy_gbps(backend, total, rounds)
    limit = (lambda: results["device_copy_gbps"]) if backend != "cpu" else (lambda: memcpy.gbps(3))
    pool_bytes = (2 * rounds + 2) * total + (64 << 20)
    ctx = private_daemon(pool_bytes, copy_threads) if socket is None else contextlib.nullcontext(socket)
    with ctx as sock:
        client = KVStoreClient(sock)
        cache_blocks = 2 * blocks  # block ids scattered over a cache twice the job's size
        memory, spec, kv = engine_memory(backend, cache_blocks, block_bytes)
        session = client.session(f"bench-{secrets.token_hex(4)}", spec)
        try:
            rng = random.Random(0)
            limits: list[float] = []
            engine_limits: list[float] = []  # cpu: the copy engine's own contiguous copy, paired likewise

            def measure_limits() -> None:
                limits.append(limit())
                if backend == "cpu":
                    engine_limits.append(memcpy.gbps(3, copy_engine=True))

            store, load, all_keys = [], [], []
            # Warm-up, not measured: the daemon maps the cache's pages in the background after
            # registration, and the first jobs run code and touch memory nothing touched before.
            warm_keys = [secrets.token_bytes(32) for _ in range(blocks)]
            warm_ids = rng.sample(range(cache_blocks), blocks)
            run_job(session, lambda: session.store(warm_keys, warm_ids))
            run_job(session, lambda: session.load(warm_keys, warm_ids))
            for _ in range(rounds):
                keys = [secrets.token_bytes(32) for _ in range(blocks)]
                ids = rng.sample(range(cache_blocks), blocks)
                # The daemon checksums a store's blocks after reporting it done; let the previous
                # round's checksums finish so that this measures one store's latency.
                time.sleep(0.1 + 2 * total / (memcpy.gbps(1) * 1e9))
                measure_limits()
                synchronize_before_store(kv.device)
                store.append(total / run_job(session, lambda k=keys, i=ids: session.store(k, i)) / 1e9)
                all_keys.append(keys)
            # Back to back, the checksum passes compete with the copies: the sustained rate.
            started = time.perf_counter()
            for _ in range(rounds):
                keys = [secrets.token_bytes(32) for _ in range(blocks)]
                ids = rng.sample(range(cache_blocks), blocks)
                run_job(session, lambda k=keys, i=ids: session.store(k, i))
            results["store_sustained_gbps"] = rounds * total / (time.perf_counter() - started) / 1e9
            for r in range(rounds):
                ids = rng.sample(range(cache_blocks), blocks)
                measure_limits()
                load.append(total / run_job(session, lambda k=all_keys[r], i=ids: session.load(k, i)) / 1e9)
            results["memcpy_gbps"] = max(limits) if backend == "cpu" else memcpy.gbps(rounds)
            results["store_gbps"] = max(store)
            results["load_gbps"] = max(load)
            ratios = paired_ratios(store + load, limits)
            results["store_vs_limit"] = statistics.median(ratios[:rounds])
            results["load_vs_limit"] = statistics.median(ratios[rounds:])
            results["store_vs_limit_rounds"] = [round(r, 3) for r in ratios[:rounds]]
            results["load_vs_limit_rounds"] = [round(r, 3) for r in ratios[rounds:]]
            if engine_limits:
                results["copy_engine_gbps"] = max(engine_limits)
                ratios = paired_ratios(store + load, engine_limits)
                results["store_vs_copy_engine"] = statistics.median(ratios[:rounds])
                results["load_vs_copy_engine"] = statistics.median(ratios[rounds:])

            # Interleaved in batches, so that both medians see the same machine.
            lookup_keys = all_keys[-1][:1000] + [secrets.token_bytes(32) for _ in range(max(0, 1000 - blocks))]
            empty_us, lookup_us = [], []
            for _ in range(10):
                empty_us += timed(client.health, 30)
                lookup_us += timed(lambda: session.lookup(lookup_keys), 30)
            results["grpc_empty_p50_us"] = statistics.median(empty_us)
            results["lookup_1k_p50_us"] = statistics.median(lookup_us)
            results["lookup_vs_grpc_empty"] = results["lookup_1k_p50_us"] / results["grpc_empty_p50_us"]

            small = 64
            submit_us, poll_us = [], []
            for i in range(200):
                keys = all_keys[-1][(i * small) % blocks:][:small]
                ids = list(range(len(keys)))
                t0 = time.perf_counter()
                job = session.load(keys, ids)
                submit_us.append((time.perf_counter() - t0) * 1e6)
                while True:  # the engine's per-step check, measured while the job runs and after
                    t0 = time.perf_counter()
                    done = session.poll()
                    poll_us.append((time.perf_counter() - t0) * 1e6)
                    if done:
                        assert done[0].job_id == job and done[0].ok
                        break
            results["submit_p50_us"] = statistics.median(submit_us)
            results["submit_p99_us"] = percentile(submit_us, 0.99)
            results["poll_p50_us"] = statistics.median(poll_us)
            results["poll_p99_us"] = percentile(poll_us, 0.99)
        finally:
            session.close()
            if memory is not None:
                memory.close()
            client.close()
            memcpy.close()
    return results
