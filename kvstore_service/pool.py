"""The block pool: one shared-memory file, carved into segments, each segment into slots.

Layout of the pool file (all little-endian):

    [pool header 4 KiB][segment table: u64 slot payload size per segment][pad to 2 MiB]
    [segment 0][segment 1]...

A segment serves one payload size at a time (namespaces with equal block size share segments) and
holds `n` slots: first `n` slot headers of 128 bytes, then `n` payloads. A slot header describes its
block (namespace hash, key, length, checksum), so a restarted daemon rebuilds the index by scanning
headers. A header is written only once the block's bytes are all copied and their checksum is taken
(the block's seal), and invalidated before a slot is reused: a block torn by a crash, or not sealed
yet, has no valid header and is dropped, never served. A recovered block is served only once its
bytes match its header's checksum again (index.py, seals.py).

This module knows bytes and offsets only; which key lives where (and LRU, pins) is index.py's job.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from kvstore_service import native, native_memory

log = logging.getLogger(__name__)

POOL_MAGIC = b"KVSTPOOL"
POOL_VERSION = 2  # 2: slot headers checked with CRC32C (1: zlib crc32)
POOL_HEADER = struct.Struct("<8sIIQQQQ")  # magic, version, pad, size, segment_size, segments, data_offset
POOL_HEADER_BYTES = 4096
DATA_ALIGN = 2 << 20  # segments start 2 MiB aligned: hugepage and NPU host-register friendly
PAYLOAD_ALIGN = 256

class SlotState(IntEnum):
    """A valid slot header's state (a slot whose copy runs, or whose block is not sealed yet, has no
    valid header at all). Headers of state 3 (STORED: written before the checksum, by daemons before
    verified restarts) are not recovered."""

    SEALED = 2  # with the checksum taken when it was stored


# Slot headers (state, payload length, checksum, generation, namespace hash, key, CRC32C): their
# layout is defined once, by the native engine (SlotHeader in csrc/slot_headers.cpp), which writes
# (Pool.write_headers) and parses (parse_slot_header) them. Changing it needs a new POOL_VERSION.
SLOT_HEADER_BYTES: int = native.SLOT_HEADER_BYTES  # header stride at the start of a segment (128)


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def slots_per_segment(segment_size: int, payload_size: int) -> int:
    stride = _align(payload_size, PAYLOAD_ALIGN)
    n = segment_size // (stride + SLOT_HEADER_BYTES)
    while n and _align(n * SLOT_HEADER_BYTES, PAYLOAD_ALIGN) + n * stride > segment_size:
        n -= 1
    return n


@dataclass(slots=True)
class SlotHeader:
    state: int
    payload_len: int
    checksum: int
    generation: int
    ns_hash: bytes
    key: bytes


def parse_slot_header(data: mmap.mmap, offset: int) -> SlotHeader | None:
    """The header at `offset`, or None if it is not a valid one (never written, torn, invalidated)."""
    fields = native.parse_slot_header(data, offset)
    return None if fields is None else SlotHeader(*fields)


@dataclass(slots=True)
class Segment:
    index: int
    offset: int  # of the segment within the pool file
    payload_size: int = 0  # 0: unassigned
    slots: int = 0
    payload_stride: int = 0
    payload_base: int = 0  # offset of slot 0's payload within the pool file
    free_slots: list[int] = field(default_factory=list)

    @property
    def used(self) -> int:
        return self.slots - len(self.free_slots)

    def header_offset(self, slot: int) -> int:
        return self.offset + slot * SLOT_HEADER_BYTES

    def payload_offset(self, slot: int) -> int:
        return self.payload_base + slot * self.payload_stride

    def lay_out(self, payload_size: int, segment_size: int) -> None:
        """Carve the segment into slots of `payload_size`: their headers, then their payloads (also how
        a reader of the pool file finds them)."""
        self.payload_size = payload_size
        self.payload_stride = _align(payload_size, PAYLOAD_ALIGN)
        self.slots = slots_per_segment(segment_size, payload_size)
        self.payload_base = self.offset + _align(self.slots * SLOT_HEADER_BYTES, PAYLOAD_ALIGN)


class SlotRef(NamedTuple):  # a tuple: ~5x cheaper to create than a frozen dataclass
    segment: int
    slot: int


class PoolFullError(Exception):
    pass


def _open_private(path: str) -> int:
    """The pool file, created by us (O_EXCL) or, if it exists, only when it is a regular file of our
    own that nobody else may write: in a world-writable /dev/shm a planted symlink would make us
    overwrite its target, and a file another uid can write could carry forged blocks."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except OSError as e:  # ELOOP: a symbolic link
        raise PoolFileError(f"pool file {path} cannot be opened safely ({e.strerror}); is it a symbolic link? "
                            "remove it or choose another --pool-path") from None
    st = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
               else f"belongs to uid {st.st_uid}, not to the daemon's uid {os.geteuid()}"
               if st.st_uid != os.geteuid()
               else f"may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
               if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else "")
    if problem:
        os.close(fd)
        raise PoolFileError(f"pool file {path} {problem}: remove it or choose another --pool-path")
    return fd


class PoolFileError(ValueError):
    """The pool file cannot be trusted; the daemon refuses to start (exit 2)."""


class Pool:
    """Owns the mapped pool file and hands out slots of a given payload size."""

    def __init__(self, path: str, size: int, segment_size: int, fresh: bool = False, populate_threads: int = 1,
                 numa_nodes: list[int] | None = None, populate_first: int | None = None) -> None:
        """A new pool's first `populate_first` bytes (None: all) are faulted in here; the rest wait, unusable,
        for `populate_next` and `add_ready` (the daemon grows the pool while it serves)."""
        if segment_size < 1 << 20:
            raise ValueError("segment size must be at least 1 MiB")
        self.path = path
        self.segment_size = _align(segment_size, PAYLOAD_ALIGN)
        # Capacity is `size` rounded down to whole segments; the headers come on top of it.
        num_segments = size // self.segment_size
        if num_segments < 1:
            raise ValueError(f"pool size {size} is too small for one {segment_size}-byte segment")
        self.data_offset = _align(POOL_HEADER_BYTES + 8 * num_segments, DATA_ALIGN)
        self.size = self.data_offset + num_segments * self.segment_size
        self.capacity = num_segments * self.segment_size
        self._check_room()  # before anything is built for a pool that cannot be
        self.segments = [Segment(i, self.data_offset + i * self.segment_size) for i in range(num_segments)]
        self.free_segments: list[int] = []
        self.unready = range(0)  # segments not faulted in yet: a new pool's last ones, fewer as it grows
        self.populate_threads = populate_threads
        self.partial: dict[int, set[int]] = {}  # payload size -> segments with a free slot
        self.reattached = False
        self._generation = 0
        self._mmap = self._open(fresh, numa_nodes)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        if not self.reattached:
            self.unready = range(len(self.segments))
            first = -(-(self.capacity if populate_first is None else populate_first) // self.segment_size)
            log.info("setting up a new pool of %d bytes on %d threads%s: %d bytes before serving, the rest while "
                     "serving", self.size, populate_threads, f", interleaved over NUMA nodes {numa_nodes}"
                     if numa_nodes else "", min(first, len(self.segments)) * self.segment_size)
            self.add_ready(self.populate_next(first))

    @property
    def ready_bytes(self) -> int:
        """The capacity set up and usable (a new pool's grows as `add_ready` adds segments)."""
        return (len(self.segments) - len(self.unready)) * self.segment_size

    # -- file ------------------------------------------------------------------------------------

    def _check_room(self) -> None:
        """The mount holds the pool (an existing pool file's pages count: they are reused)."""
        folder = os.path.dirname(self.path) or "."
        os.makedirs(folder, exist_ok=True)
        free = os.statvfs(folder)
        if not free.f_blocks:  # no size given (hugetlbfs without size=): mmap reserves the pages, or fails
            return
        try:
            existing = os.stat(self.path, follow_symlinks=False).st_size
        except FileNotFoundError:
            existing = 0
        if free.f_bavail * free.f_frsize + existing < self.size:
            raise PoolFullError(f"{folder} has {free.f_bavail * free.f_frsize} bytes free, the pool needs "
                                f"{self.size}: lower --pool-size or grow the shared-memory mount")

    def _open(self, fresh: bool, numa_nodes: list[int] | None) -> mmap.mmap:
        fd = _open_private(self.path)
        try:
            existing = os.fstat(fd).st_size
            header = os.pread(fd, POOL_HEADER.size, 0) if existing >= POOL_HEADER.size else b""
            expected = POOL_HEADER.pack(
                POOL_MAGIC, POOL_VERSION, 0, self.size, self.segment_size, len(self.segments), self.data_offset
            )
            self.reattached = not fresh and existing == self.size and header == expected
            if not self.reattached:
                if header[:8] == POOL_MAGIC and not fresh:
                    log.warning("pool file %s has another geometry; starting empty", self.path)
                os.ftruncate(fd, 0)  # drop old pages
                os.ftruncate(fd, self.size)
            try:
                mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:  # hugetlbfs reserves the pages here
                raise PoolFullError(f"{self.path}: cannot map {self.size} bytes ({e.strerror}); on hugetlbfs, "
                                    "reserve more huge pages (vm.nr_hugepages) or lower --pool-size") from None
        finally:
            os.close(fd)
        if not self.reattached:
            # Spread over the NUMA nodes before any page is faulted in, where asked: every device's engines
            # share the blocks, so no one node is theirs (the populating threads would place them at random).
            base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            if numa_nodes and (rc := native_memory.interleave(base, self.size, numa_nodes)):
                log.warning("pool %s: not spread over NUMA nodes %s (%s); pages go where first touched",
                            self.path, numa_nodes, os.strerror(rc))
            mm[: POOL_HEADER.size] = expected
        else:
            self._load_segment_table(mm)
        return mm

    def populate_next(self, segments: int) -> list[int]:
        """Blocking (a thread's): fault the next `segments` unready segments in, on `populate_threads`
        threads (a first touch during a store costs more than the copy); returns them for `add_ready`.
        Only the caller's thread may grow the pool, one call at a time. OSError where the memory is not
        there (a shared-memory mount filled by others since the start): those segments stay unready."""
        chosen = list(self.unready[:max(segments, 0)])
        if chosen:
            start, size = self.segments[chosen[0]].offset, len(chosen) * self.segment_size
            rc = native_memory.populate(self.base + start, size, self.populate_threads)
            if rc == errno.EINVAL:  # a kernel before 5.14: touched instead
                ctypes.memset(self.base + start, 0, size)
            elif rc:
                raise OSError(rc, f"pool {self.path}: faulting {size} bytes in failed ({os.strerror(rc)})")
        return chosen

    def add_ready(self, segments: list[int]) -> None:
        """These segments (`populate_next`'s), populated, are usable from now on."""
        assert segments == list(self.unready[:len(segments)])
        self.unready = self.unready[len(segments):]
        self.free_segments[:0] = segments[::-1]  # (taken last: segments freed since go first)

    def _load_segment_table(self, mm: mmap.mmap) -> None:
        for seg in self.segments:
            (payload_size,) = struct.unpack_from("<Q", mm, POOL_HEADER_BYTES + 8 * seg.index)
            if payload_size == 0 or payload_size > self.segment_size:
                self.free_segments.append(seg.index)
            else:
                self._assign(seg, payload_size, mm)
        self.free_segments.reverse()

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:  # a ctypes view still points at it; process exit unmaps it
            pass

    # -- segments and slots ----------------------------------------------------------------------

    def slots_per_segment(self, payload_size: int) -> int:
        return slots_per_segment(self.segment_size, payload_size)

    def _assign(self, seg: Segment, payload_size: int, mm: mmap.mmap | None = None) -> None:
        seg.lay_out(payload_size, self.segment_size)
        if mm is None:  # a new assignment: old bytes here must never parse as slot headers
            ctypes.memset(self.base + seg.offset, 0, seg.payload_base - seg.offset)
        seg.free_slots = list(range(seg.slots - 1, -1, -1))
        struct.pack_into("<Q", mm if mm is not None else self._mmap, POOL_HEADER_BYTES + 8 * seg.index,
                         payload_size)
        self.partial.setdefault(payload_size, set()).add(seg.index)

    def _unassign(self, seg: Segment) -> None:
        self.partial.get(seg.payload_size, set()).discard(seg.index)
        struct.pack_into("<Q", self._mmap, POOL_HEADER_BYTES + 8 * seg.index, 0)
        seg.payload_size = seg.slots = seg.payload_stride = seg.payload_base = 0
        seg.free_slots = []
        self.free_segments.append(seg.index)

    def allocate(self, payload_size: int) -> SlotRef | None:
        """A free slot for a payload of this size, or None when no slot or segment is free."""
        partial = self.partial.get(payload_size)
        if not partial:
            if self.slots_per_segment(payload_size) < 1:
                raise PoolFullError(f"a {payload_size}-byte block does not fit a {self.segment_size}-byte segment")
            if not self.free_segments:
                return None
            self._assign(self.segments[self.free_segments.pop()], payload_size)
            partial = self.partial[payload_size]
        seg = self.segments[next(iter(partial))]
        slot = seg.free_slots.pop()
        if not seg.free_slots:
            partial.discard(seg.index)
        return SlotRef(seg.index, slot)

    def allocate_many(self, payload_size: int, n: int) -> list[tuple[Segment, list[int]]]:
        """Up to n free slots (fewer when the pool runs out), grouped by segment: a store reserves a
        whole chunk of blocks at once."""
        taken: list[tuple[Segment, list[int]]] = []
        count = 0
        while count < n:
            first = self.allocate(payload_size)  # picks (or assigns) a segment with a free slot
            if first is None:
                break
            seg = self.segments[first.segment]
            take = min(n - count - 1, len(seg.free_slots))
            slots = [first.slot]
            if take:
                slots += seg.free_slots[-take:][::-1]
                del seg.free_slots[-take:]
                if not seg.free_slots:
                    self.partial[payload_size].discard(seg.index)
            taken.append((seg, slots))
            count += len(slots)
        return taken

    def release(self, segment: int, slots: list[int]) -> None:
        """Free these slots of one segment, their headers invalidated first."""
        seg = self.segments[segment]
        native.invalidate_slot_headers(self.base + seg.offset, slots, seg.slots)
        seg.free_slots += slots
        if seg.used == 0:
            self._unassign(seg)
        else:
            self.partial.setdefault(seg.payload_size, set()).add(seg.index)

    def payload_offset(self, ref: SlotRef) -> int:
        return self.segments[ref.segment].payload_offset(ref.slot)

    def view(self, offset: int, length: int) -> memoryview:
        """The pool's bytes at `offset` (a payload), without a copy."""
        return memoryview(self._mmap)[offset:offset + length]

    # -- slot headers ----------------------------------------------------------------------------

    def next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def header_offset(self, ref: SlotRef) -> int:
        return self.segments[ref.segment].header_offset(ref.slot)

    def write_headers(self, offsets: native.U64Array, state: int, payload_len: int, generation: int, ns_hash: bytes,
                      keys: bytes, key_size: int, checksums: list[int] | None = None) -> None:
        """Write the headers of blocks whose bytes are all in (any thread; natively, GIL released)."""
        native.write_slot_headers(self.base, offsets, state, payload_len, generation, ns_hash, keys, key_size,
                                  checksums)

    def invalidate(self, ref: SlotRef) -> None:
        """Mark a slot's header invalid before its payload is rewritten: a crash mid-copy then
        leaves a slot that recovery drops, never the old header over new, torn bytes."""
        seg = self.segments[ref.segment]
        native.invalidate_slot_headers(self.base + seg.offset, [ref.slot], seg.slots)

    def read_header(self, ref: SlotRef) -> SlotHeader | None:
        return parse_slot_header(self._mmap, self.segments[ref.segment].header_offset(ref.slot))

    def recover(self) -> Iterator[tuple[SlotRef, SlotHeader]]:
        """After re-attaching: yield the slots of sealed blocks (whose bytes the caller must still check
        against their checksums); free torn, unsealed and empty ones."""
        for seg in self.segments:
            if not seg.payload_size:
                continue
            seg.free_slots = []
            for slot in range(seg.slots - 1, -1, -1):
                ref = SlotRef(seg.index, slot)
                header = self.read_header(ref)
                if (header is not None and header.state == SlotState.SEALED
                        and header.payload_len == seg.payload_size):
                    self._generation = max(self._generation, header.generation)
                    yield ref, header
                else:
                    self.invalidate(ref)
                    seg.free_slots.append(slot)
            if seg.used == 0:
                self._unassign(seg)
            elif not seg.free_slots:
                self.partial[seg.payload_size].discard(seg.index)
