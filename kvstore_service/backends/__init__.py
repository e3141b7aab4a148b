"""Device backends: how the daemon maps an engine's KV memory and moves blocks to and from the pool.

The daemon core only sees `Backend`; cpu, cuda and npu sit side by side behind it.
"""

from __future__ import annotations

from kvstore_service.backends.base import Backend, Mapping, TransferPlan

__all__ = ["Backend", "Mapping", "TransferPlan", "make_backend"]


def make_backend(name: str) -> Backend:
    """The backend for a registration's `memory.backend`; ValueError for an unknown one."""
    if name == "cpu":
        from kvstore_service.backends.cpu import CpuBackend

        return CpuBackend()
    if name == "cuda":
        from kvstore_service.backends.cuda import CudaBackend

        return CudaBackend()
    if name == "npu":
        from kvstore_service.backends.npu import NpuBackend

        return NpuBackend()
    raise ValueError(f"unknown backend {name!r}: expected cpu, cuda or npu")
