"""The disk tier's segments: the segment set (oldest first), the active one records are appended to,
closing a full one (footer, file cut, index checkpoint), rotation and reclaim of the oldest, clear
markers, the catalog's file, faults. The bytes: docs/formats.md ("Disk tier").

`Segments` is the state and file work under `DiskTier` (tiers/disk/__init__.py), and under its parts
that load the segments at open (loading.py), append records to them (writing.py) and read records back
(reading.py): appending, closing and reclaiming run under the write lock (one write, or close, at a
time); `_lock` guards the in-memory index, the segments' keys and readers, the catalog's state and the
counters, and is never held during I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from dataclasses import dataclass, field

from kvstore_service.tiers.disk.catalog import Catalog
from kvstore_service.tiers.disk.format import (
    ALIGN,
    KIND_CLEAR,
    KIND_FOOTER,
    SEQ_SHIFT,
    Position,
    encode_index,
    footer_block,
    index_file,
    segment_file,
)

log = logging.getLogger("kvstore_service.tiers.disk")


@dataclass(slots=True, eq=False)
class Segment:
    seq: int
    size: int = 0  # bytes of its records (and of its footer once closed)
    closed: bool = False  # its footer written, the file cut: it never changes again
    keys: dict[bytes, list[bytes]] = field(default_factory=dict)  # scope -> keys written to it (some gone since)
    readers: int = 0  # read() calls reading it now: it is not reclaimed meanwhile
    cleared: int = 0  # the generation of its newest clear marker (0: none)



class Segments:
    """The segment files of one directory and the in-memory index of their records; see the module
    docstring. Its state is set up by `DiskTier.__init__`."""

    path: str
    segment_bytes: int
    max_segments: int
    capacity_bytes: int
    threads: int
    _mode: int
    _direct: int  # os.O_DIRECT once probed
    _changes: list[tuple[bytes, bytes, bool]]  # (scope, key, written) for the routers' events: DiskTier.take_changes
    _mem_align: int
    _lock: threading.Lock  # the index, segments' keys and readers, catalog, counters, queue: never during I/O
    _write_lock: threading.Lock  # one write (or close) at a time: the active segment, rotation, files
    _index: dict[bytes, dict[bytes, int]]  # scope -> key -> pack_location(...)
    _segments: dict[int, Segment]  # by number: oldest first
    _active: Segment | None
    _active_fd: int
    _active_entries: list[bytes]  # the active segment's index entries, packed
    _unsynced: list[int]  # segments closed since open, not flushed to stable storage yet
    _next_seq: int
    _catalog: Catalog
    _counts: dict[str, float]  # DiskStats' counters
    _healthy: bool
    _error: str
    _dir_fd: int
    _lock_fd: int
    _closed: bool
    _block: mmap.mmap  # a page-aligned block for footers (O_DIRECT)

    # -- the active segment, rotation, markers, the catalog's file ---------------------------------

    def _room(self, record: int) -> Segment | None:
        """The active segment with room for one more record: a new one when it is full (closing the old
        one and reclaiming the oldest segment if the tier is full), or None if none can be reclaimed."""
        seg = self._active
        if seg is not None and seg.size + record <= self.segment_bytes - ALIGN:
            return seg
        if seg is not None:
            self._close_active()
        while len(self._segments) >= self.max_segments:
            if not self._reclaim_oldest():
                return None
        seq = self._next_seq
        fd = os.open(segment_file(seq), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                     | self._direct, 0o600, dir_fd=self._dir_fd)
        try:
            os.posix_fallocate(fd, 0, self.segment_bytes)  # no space: fails here, not mid-record
        except OSError as e:
            os.close(fd)
            os.unlink(segment_file(seq), dir_fd=self._dir_fd)
            raise OSError(e.errno, e.strerror, os.path.join(self.path, segment_file(seq))) from e
        seg = Segment(seq)
        with self._lock:  # (together, for _position)
            self._segments[seq] = seg
            self._active, self._next_seq = seg, seq + 1
        self._active_fd, self._active_entries = fd, []
        return seg

    def _close_active(self) -> None:
        seg, fd = self._active, self._active_fd
        assert seg is not None
        with self._lock:
            self._active = None
        self._active_fd = -1
        try:
            if self._active_entries or seg.cleared:
                self._close_segment(seg.seq, fd, seg.size, self._active_entries, True, seg.cleared)
                seg.size += ALIGN
                seg.closed = True
        finally:
            os.close(fd)
        if not self._active_entries and not seg.cleared:  # nothing written to it
            with self._lock:
                del self._segments[seg.seq]
            self._remove_files(seg.seq)
        self._active_entries = []

    def _close_segment(self, seq: int, fd: int, end: int, packed: list[bytes], write_footer: bool,
                       cleared: int) -> None:
        """Footer at `end` (unless one is there), the file cut after it, and the index checkpoint (with
        the segment's newest clear marker)."""
        data, entries_crc = encode_index(seq, end, packed, cleared)
        if write_footer:
            self._block[:] = footer_block(KIND_FOOTER, seq, end, len(packed), entries_crc)
            if os.pwrite(fd, self._block, end) != ALIGN:
                raise OSError(errno.EIO, "short write of a segment footer", segment_file(seq))
        os.ftruncate(fd, end + ALIGN)
        self._unsynced.append(seq)  # flushed at close (not here: a flush costs as much as writing the segment)
        tmp = index_file(seq) + ".tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=self._dir_fd)
        with os.fdopen(out, "wb") as f:
            f.write(data)
        os.replace(tmp, index_file(seq), src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def _write_marker(self) -> None:
        """A clear's marker (the generation of the catalog as saved) into the active segment, flushed: from
        then on a catalog older than it is known for one (see Clear in docs/tiers.md). Under the
        write lock; left for the next write if no segment has room."""
        with self._lock:
            if not self._catalog.marker_due:
                return
            generation = self._catalog.saved_generation
        seg = self._room(ALIGN)
        if seg is None:
            return
        with self._lock:
            at = seg.size
            seg.size += ALIGN
            self._catalog.marker_due = generation < self._catalog.generation
        self._block[:] = footer_block(KIND_CLEAR, seg.seq, at, generation, 0)
        if os.pwrite(self._active_fd, self._block, at) != ALIGN:
            raise OSError(errno.EIO, "short write of a clear marker", segment_file(seg.seq))
        os.fdatasync(self._active_fd)
        seg.cleared = generation

    def _position(self) -> Position:
        """Where the next record goes (under the lock): every record before it was placed before now."""
        seg = self._active
        return (seg.seq, seg.size) if seg is not None else (self._next_seq, 0)

    def _name(self, scope: bytes, name: str) -> None:
        """Save a namespace's name in the catalog (before its first record is written)."""
        with self._lock:
            if not self._catalog.name(scope, name):
                return
        self._write_catalog()

    def _write_catalog(self) -> None:
        """Replace the catalog file if the catalog changed: atomically, flushed (a clear must last)."""
        with self._catalog.lock:
            with self._lock:
                if self._closed or self._dir_fd < 0:
                    return
                data = self._catalog.encode(min(self._segments, default=None))
                generation = self._catalog.generation
            self._catalog.save(self._dir_fd, data, generation)

    def _flush(self) -> None:
        """Make the segments closed since open and their index files durable (the device's write cache)."""
        for seq in self._unsynced:
            if seq not in self._segments:
                continue  # reclaimed since
            for name in (segment_file(seq), index_file(seq)):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
        os.fsync(self._dir_fd)
        self._unsynced = []

    def _reclaim_oldest(self) -> bool:
        """Drop the oldest segment no read is reading (its blocks leave the index); False if none."""
        with self._lock:
            victim = next((s for s in self._segments.values() if s.readers == 0 and s is not self._active), None)
            if victim is None:
                return False
            del self._segments[victim.seq]
            for scope, keys in victim.keys.items():
                index = self._index.get(scope)
                for key in keys if index is not None else ():
                    value = index.get(key)  # type: ignore[union-attr]
                    if value is not None and value >> SEQ_SHIFT == victim.seq:
                        del index[key]  # type: ignore[union-attr]
                        self._changes.append((scope, key, False))
                if index is not None and not index:
                    del self._index[scope]
            self._counts["reclaimed_segments"] += 1
        self._remove_files(victim.seq)
        return True

    def _remove_files(self, seq: int) -> None:
        for name in (index_file(seq), segment_file(seq)):
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass

    # -- faults -----------------------------------------------------------------------------------

    def _usable(self) -> bool:
        return self._healthy and not self._closed

    def _fail(self, what: str, exc: OSError) -> None:
        """Disable the tier for good (the first failure is logged; later ones only counted)."""
        code = errno.errorcode.get(exc.errno or 0, "error")
        where = f" ({exc.filename})" if exc.filename else ""
        with self._lock:
            self._counts["errors"] += 1
            if not self._healthy or self._closed:
                return
            self._healthy = False
            self._changes.append((b"", b"", False))  # (every block: lookups find none from now on)
            self._error = (f"{what} failed: {exc.strerror or exc} [{code}]{where}; the disk tier is disabled "
                                 "until the daemon restarts (the pool keeps serving)")
        log.error("disk tier %s: %s", self.path, self._error)


