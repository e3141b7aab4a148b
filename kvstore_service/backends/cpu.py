"""CPU backend: the engine's KV cache is a memfd. Sealed against shrinking, the daemon maps it too and
copies with the native engine; not sealed (SGLang's shared host pool is made so), the daemon reads and
writes it as a file (pread/pwrite: a shrunk file fails a job, never faults the daemon)."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
from array import array
from dataclasses import dataclass

from kvstore_client.protocol import memfd
from kvstore_service import native
from kvstore_service.backends.base import Backend, ChecksumSample, Mapping, ProgressWord, TransferPlan
from kvstore_service.pool import MADV_POPULATE_WRITE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


POPULATE_CHUNK = 64 << 20  # the session can end between two chunks (~10-20 ms each)
# A load up to this size is copied whole by one thread with plain stores, so its bytes are still in
# the caches when the engine's next forward reads them (a 2k-token hit's one-token forward ran 5-30
# ms longer after non-temporal loads). Plain stores are bound by memory bandwidth (the read for
# ownership): a second thread adds little, and a 48 MiB load split over two copy threads took 7.6-9.2
# ms from submit to completion against 5.2-5.6 whole. Larger loads stream, in chunks over all copy
# threads: plain stores copy ~30% slower, and most of such a load would not stay in the caches anyway.
PLAIN_LOAD_BYTES = 64 << 20


def _populate(addr: int, size: int, stop: threading.Event) -> None:
    """Map every page the layout addresses into our page table now, a chunk at a time until told to
    stop. Otherwise the first copies of each page fault (one per 4 KiB written, one per 64 KiB
    read), which halves the first stores' and loads' speed. ctypes releases the GIL: the daemon
    serves meanwhile. Kernels before 5.14 lack the advice (EINVAL): pages then fault in on use."""
    for start in range(0, size, POPULATE_CHUNK):
        if stop.is_set():
            return
        _libc.madvise(addr + start, min(POPULATE_CHUNK, size - start), MADV_POPULATE_WRITE)


@dataclass
class _File:
    """An unsealed memfd, read and written by offset: its descriptor, and an inaccessible reservation of
    its size whose addresses stand for its bytes in plans (bounds-checked as a mapping's are; a byte
    touched there by mistake faults at once instead of reading something else)."""

    fd: int
    reserved: int
    size: int

    @classmethod
    def open(cls, fd: int, size: int) -> _File:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            raise ValueError("the KV memory's descriptor is not open for reading and writing")
        if os.fstat(fd).st_size < size:
            raise ValueError(f"the KV memory has {os.fstat(fd).st_size} bytes, {size} are needed")
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        reserved = _libc.mmap(None, size, mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0, flags, -1, 0)
        if reserved in (None, _MAP_FAILED):
            raise ValueError(f"cannot reserve {size} bytes of address space for the KV memory")
        return cls(os.dup(fd), reserved, size)

    def copy(self, pool_base: int, pool_offsets: array, addresses: array, sizes: array, to_engine: bool) -> None:
        offsets = array("Q", (a - self.reserved for a in addresses))
        native.file_copy(self.fd, pool_base, pool_offsets, offsets, sizes, to_file=to_engine)

    def close(self) -> None:
        _libc.munmap(self.reserved, self.size)
        os.close(self.fd)


@dataclass
class _Held:
    """What a CPU mapping keeps until unmap: the mmap, the ctypes view whose address is the mapping's
    base (an export of the mmap, dropped before closing it) and the thread populating its pages."""

    mm: mmap.mmap
    anchor: ctypes.c_char | None
    populating: threading.Thread
    stop: threading.Event


class CpuBackend(Backend):
    name = "cpu"
    whole_load_bytes = PLAIN_LOAD_BYTES
    copies_on_host = True

    def map(self, handle: bytes, size: int, device: int, fd: int | None) -> Mapping:
        if fd is None:
            raise ValueError("cpu KV memory travels as a memfd over the <socket>.cred handshake; none came")
        if not memfd.sealed(fd, "the KV memory"):  # (it could shrink under a mapping: SIGBUS)
            held = _File.open(fd, size)
            return Mapping(held.reserved, size, handle=held)
        memfd.check_sealed(fd, size, "the KV memory")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(anchor)
        stop = threading.Event()
        populating = threading.Thread(target=_populate, args=(base, size, stop), name="kvstore-populate",
                                      daemon=True)
        populating.start()
        return Mapping(base, size, handle=_Held(mm, anchor, populating, stop))

    def unmap(self, mapping: Mapping) -> None:
        held = mapping.handle
        if isinstance(held, _File):
            mapping.handle = None
            held.close()
            return
        assert isinstance(held, _Held)
        held.stop.set()
        held.populating.join()  # it must not touch the range once unmapped (and maybe reused)
        held.anchor = None
        mapping.handle = None
        try:
            held.mm.close()
        except BufferError:  # a stray export still holds it; the GC unmaps it later
            pass

    def transfer(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool, blocks: int,
                 check: ChecksumSample | None = None) -> list[int]:
        """The chunk in one native call: its checksum sample, its copy and, for a whole load, each
        region's arrival posted in the completion channel, all without the GIL (a progress callback
        other than the channel's own word goes through copy(), region by region)."""
        progress = plan.progress
        if isinstance(mapping.handle, _File) or (progress is not None and not isinstance(progress, ProgressWord)):
            return super().transfer(mapping, pool_base, plan, to_engine, blocks, check)
        whole = progress is not None and to_engine
        return native.transfer(pool_base, plan.pool_offsets, plan.engine_addresses, plan.sizes, to_engine, blocks,
                               streaming=not whole,
                               progress=progress.address if whole and progress is not None else 0,
                               progress_word=progress.word if whole and progress is not None else 0,
                               check=None if check is None else check.positions,
                               check_offsets=None if check is None else check.offsets,
                               check_size=0 if check is None else check.size,
                               expected=None if check is None else check.expected)

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        if isinstance(mapping.handle, _File):
            parts = plan.regions if to_engine and plan.progress is not None else 1
            per = len(plan.sizes) // parts
            for k in range(parts):
                part = slice(k * per, (k + 1) * per)
                mapping.handle.copy(pool_base, plan.pool_offsets[part], plan.engine_addresses[part],
                                    plan.sizes[part], to_engine)
                if plan.progress is not None and to_engine:
                    plan.progress(k + 1)
        elif to_engine and plan.progress is not None:
            per = len(plan.sizes) // plan.regions  # runs of one region (one layer, or a part of one)
            for k in range(plan.regions):
                part = slice(k * per, (k + 1) * per)
                native.copy_blocks(pool_base, 0, plan.pool_offsets[part], plan.engine_addresses[part],
                                   plan.sizes[part], streaming=False)
                plan.progress(k + 1)
        elif to_engine:
            native.copy_blocks(pool_base, 0, plan.pool_offsets, plan.engine_addresses, plan.sizes)
        else:
            native.copy_blocks(0, pool_base, plan.engine_addresses, plan.pool_offsets, plan.sizes)
