"""CPU backend: the engine's KV cache is a memfd the daemon maps too. Sealed against shrinking, as
kvstore's clients make it, nobody can pull its pages from under a copy. Not sealed (SGLang's shared host
pool is made so), the mapping is guarded (csrc/guard.cpp): a copy past the end its owner shrank it to
goes on over anonymous memory instead of faulting the daemon (SIGBUS), and every job of it fails."""

from __future__ import annotations

import ctypes
import mmap
import threading
from dataclasses import dataclass

from kvstore_client.protocol import memfd
from kvstore_service import native, native_memory
from kvstore_service.backends.base import Backend, ChecksumSample, Mapping, TransferPlan

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
    read), which halves the first stores' and loads' speed. native_memory.populate releases the GIL: the daemon
    serves meanwhile. Kernels before 5.14 lack the advice (EINVAL): pages then fault in on use."""
    for start in range(0, size, POPULATE_CHUNK):
        if stop.is_set():
            return
        native_memory.populate(addr + start, min(POPULATE_CHUNK, size - start), 1)


@dataclass
class _Held:
    """What a CPU mapping keeps until unmap: the mmap, the ctypes view whose address is the mapping's
    base (an export of the mmap, dropped before closing it), the thread populating its pages and, for
    memory its owner can shrink, its guard (native_memory.guard_memory)."""

    mm: mmap.mmap
    anchor: ctypes.c_char | None
    populating: threading.Thread
    stop: threading.Event
    guard: int | None = None


class ShrunkMemory(OSError):
    """The engine shrank KV memory the daemon maps (an unsealed memfd): its copies are void."""


class CpuBackend(Backend):
    name = "cpu"
    whole_load_bytes = PLAIN_LOAD_BYTES
    copies_on_host = True

    def map(self, handle: bytes, size: int, device: int, fd: int | None) -> Mapping:
        if fd is None:
            raise ValueError("cpu KV memory travels as a memfd over the <socket>.cred handshake; none came")
        sealed = memfd.sealed(fd, "the KV memory")
        memfd.check_size(fd, size, "the KV memory")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(anchor)
        # Not sealed: the engine could pull pages from under a copy (SIGBUS); the guard catches that.
        try:
            guard = None if sealed else native_memory.guard_memory(base, size)
        except ValueError:
            del anchor
            mm.close()
            raise
        stop = threading.Event()
        populating = threading.Thread(target=_populate, args=(base, size, stop), name="kvstore-populate",
                                      daemon=True)
        populating.start()
        return Mapping(base, size, handle=_Held(mm, anchor, populating, stop, guard))

    def unmap(self, mapping: Mapping) -> None:
        held = mapping.handle
        assert isinstance(held, _Held)
        held.stop.set()
        held.populating.join()  # it must not touch the range once unmapped (and maybe reused)
        if held.guard is not None:
            native_memory.unguard_memory(held.guard)
        held.anchor = None
        mapping.handle = None
        try:
            held.mm.close()
        except BufferError:  # a stray export still holds it; the GC unmaps it later
            pass

    def transfer(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool,
                 check: ChecksumSample | None = None) -> list[int]:
        """The chunk in one native call: its checksum sample, its copy and, for a whole load, each
        region's arrival posted in the completion channel, all without the GIL."""
        return _transfer(mapping, pool_base, plan, to_engine, check)

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        _transfer(mapping, pool_base, plan, to_engine, None)


def _transfer(mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool,
              check: ChecksumSample | None) -> list[int]:
    _check_intact(mapping)
    progress = plan.progress if to_engine else None
    corrupt = native.transfer(pool_base, plan.runs, to_engine, streaming=progress is None,
                              progress=0 if progress is None else progress.address,
                              progress_word=0 if progress is None else progress.word,
                              check=None if check is None else check.positions,
                              check_offsets=None if check is None else check.offsets,
                              check_size=0 if check is None else check.size,
                              expected=None if check is None else check.expected)
    _check_intact(mapping)  # (a store that read zeros where the memory was shrunk commits nothing)
    return corrupt


def _check_intact(mapping: Mapping) -> None:
    held = mapping.handle
    if isinstance(held, _Held) and held.guard is not None and native_memory.guard_faulted(held.guard):
        raise ShrunkMemory("the engine shrank its KV memory under the daemon's mapping: its jobs fail")
