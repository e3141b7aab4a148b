"""CPU backend: the engine's KV cache lives in a shared-memory file the daemon maps too."""

from __future__ import annotations

import ctypes
import mmap
import os
import stat

from kvstore_service import native
from kvstore_service.backends.base import Backend, Mapping, TransferPlan


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, copy_threads: int, shm_dir: str) -> None:
        self.copy_threads = copy_threads
        self.shm_dir = os.path.realpath(shm_dir)

    def check_path(self, path: str) -> str:
        """Only regular files inside the shared-memory directory: a client must not make the
        daemon write into arbitrary files."""
        if not os.path.isabs(path):
            raise ValueError(f"shared-memory path {path!r} is not absolute")
        real = os.path.realpath(path)
        if os.path.dirname(real) != self.shm_dir or real != os.path.normpath(path):
            raise ValueError(f"shared-memory path {path!r} must be a file directly in {self.shm_dir}")
        return real

    def map(self, handle: bytes, size: int, device: int) -> Mapping:
        path = self.check_path(handle.decode(errors="replace"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise ValueError(f"cannot open KV memory {path}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"KV memory {path} is not a regular file")
            if st.st_size < size:
                raise ValueError(f"KV memory {path} has {st.st_size} bytes, the layout needs {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
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
