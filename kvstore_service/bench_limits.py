"""The physical limits `kvstore bench` measures against, in the same run: one contiguous copy of the same
bytes (memcpy, or the native copy engine), a device's pinned copy; and how a round is paired with them."""

from __future__ import annotations

import ctypes
import time
from array import array
from collections.abc import Callable

import torch

from kvstore_client.device import synchronize_before_store
from kvstore_client.shm import SharedKVMemory
from kvstore_service import native


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
    """Each round's GB/s over the limit measured around it: `limits` holds one copy right before and
    one right after each round, and the round is paired with their mean. One sample each, as the
    round is one job: a best-of-n limit would bias the ratios down on a noisy machine."""
    around = [(before + after) / 2 for before, after in zip(limits[::2], limits[1::2], strict=True)]
    return [rate / limit for rate, limit in zip(gbps, around, strict=True)]


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


class DeviceCopy:
    """The limit on a device: one pinned host -> device copy of the same bytes, in this process."""

    def __init__(self, backend: str, total: int) -> None:
        self.total = total
        self.host = torch.ones(total, dtype=torch.uint8).pin_memory()
        self.dev = torch.empty(total, dtype=torch.uint8, device=torch.device(backend))
        self.once()

    def once(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)
        synchronize_before_store(self.dev.device)

    def gbps(self, rounds: int) -> float:
        """Best of `rounds`."""
        return self.total / (min(timed(self.once, rounds)) / 1e6) / 1e9


class CacheSweep:
    """Calling it leaves the host's caches cold: it copies a buffer of SWEEP_BYTES (several times a
    server CPU's last-level cache) over another."""

    SWEEP_BYTES = 256 << 20

    def __init__(self) -> None:
        self.buffers = torch.ones(self.SWEEP_BYTES, dtype=torch.uint8), torch.empty(self.SWEEP_BYTES, dtype=torch.uint8)

    def __call__(self) -> None:
        self.buffers[1].copy_(self.buffers[0])
