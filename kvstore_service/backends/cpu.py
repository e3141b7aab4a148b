"""CPU backend: the engine's KV cache is a sealed memfd the daemon maps too."""

from __future__ import annotations

import ctypes
import mmap

from kvstore_client import memfd
from kvstore_service import native
from kvstore_service.backends.base import Backend, Mapping, TransferPlan


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, copy_threads: int) -> None:
        self.copy_threads = copy_threads

    def map(self, handle: bytes, size: int, device: int, fd: int | None) -> Mapping:
        if fd is None:
            raise ValueError("cpu KV memory travels as a memfd over the <socket>.cred handshake; none came")
        # Sealed against shrinking: the engine cannot pull pages from under a copy (SIGBUS).
        memfd.check_sealed(fd, size, "the KV memory")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(mm)
        return Mapping(ctypes.addressof(anchor), size, handle=(mm, anchor))

    def unmap(self, mapping: Mapping) -> None:
        mm, anchor = mapping.handle  # type: ignore[misc]
        del anchor
        mapping.handle = None
        try:
            mm.close()
        except BufferError:  # a stray export still holds it; the GC unmaps it later
            pass

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        if to_engine:
            native.copy_blocks(pool_base, mapping.base, plan.pool_offsets, plan.engine_offsets, plan.sizes,
                               self.copy_threads)
        else:
            native.copy_blocks(mapping.base, pool_base, plan.engine_offsets, plan.pool_offsets, plan.sizes,
                               self.copy_threads)
