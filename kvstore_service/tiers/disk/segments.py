"""The disk tier's segments: the segment set (oldest first), the active one records are appended to,
closing a full one (footer, file cut, index checkpoint), rotation and reclaim of the oldest, clear
markers, and loading them all at open (from checkpoints, or scans of segments without one). The bytes:
docs/formats.md ("Disk tier").

`Segments` is the state and file work under `DiskTier` (tiers/disk/__init__.py): appending, closing
and reclaiming run under the write lock (one write, or close, at a time); `_lock` guards the in-memory
index, the segments' keys and readers, the catalog's state and the counters, and is never held during
I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore_service import native
from kvstore_service.tiers.disk.catalog import Catalog
from kvstore_service.tiers.disk.format import (
    ALIGN,
    CATALOG_FILE,
    ENTRY,
    FOOTER,
    KIND_CLEAR,
    KIND_FOOTER,
    SEGMENT_FILE,
    SEQ_SHIFT,
    Entry,
    Position,
    encode_index,
    footer_block,
    index_file,
    pack_location,
    pad,
    parse_footer,
    parse_index,
    segment_file,
    unpack_location,
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

    # -- opening ----------------------------------------------------------------------------------

    def _load(self) -> None:
        names = os.listdir(self._dir_fd)
        seqs = sorted(int(m.group(1), 16) for name in names if (m := SEGMENT_FILE.fullmatch(name)))
        for name in names:  # leftovers: temporary files, index files of reclaimed segments
            stale = name.endswith(".tmp") or (name.endswith(".idx") and name[:-4] + ".kvd" not in names)
            if stale and (name.startswith("seg-") or name == CATALOG_FILE + ".tmp"):
                os.unlink(name, dir_fd=self._dir_fd)
        catalog = self._catalog.read(self._dir_fd)
        scanned = 0
        for seq in seqs:
            scanned += self._load_segment(seq)
        newest = max((seg.cleared for seg in self._segments.values()), default=0)
        doubt = ("is damaged" if catalog is False else f"is missing beside {len(seqs)} segment(s)"
                 if catalog is None and seqs else f"is older than the segments (it knows {self._catalog.generation} "
                 f"clear(s), they {newest})" if self._catalog.generation < newest else "")
        if doubt:  # a clear may be missing from it: drop every block there is, and stamp that clear too
            log.warning("disk tier %s: the catalog (clears, names) %s: every block on disk is dropped, lest a "
                        "cleared one come back", self.path, doubt)
            self._catalog.clear_all, self._catalog.clears, self._catalog.names = (
                (seqs[-1] + 1 if seqs else 1, 0), {}, {})
            self._index = {}
            for seg in self._segments.values():
                seg.keys = {}
            self._catalog.generation, self._catalog.marker_due = max(self._catalog.generation, newest) + 1, True
        # Past every clear's position too: a record written from now on must come after them all.
        self._next_seq = max([seqs[-1] + 1 if seqs else 1] + [at[0] + 1 for at in self._catalog.clears.values()]
                             + [self._catalog.clear_all[0] + 1])
        self._catalog.names = {scope: name for scope, name in self._catalog.names.items() if scope in self._index}
        while len(self._segments) >= self.max_segments and self._reclaim_oldest():
            pass  # a smaller --disk-size than last time: keep room for a new segment
        self._write_catalog()  # (a damaged one replaced now: else a crash would drop this run's blocks too)
        self._write_marker()
        free = os.statvfs(self._dir_fd)
        have = free.f_bavail * free.f_frsize + sum(s.size for s in self._segments.values())
        if have < self.capacity_bytes:
            log.warning("disk tier %s: the file system has room for %d bytes of segments, fewer than the %d "
                        "configured: the tier will be disabled when the disk fills up", self.path, have,
                        self.capacity_bytes)
        log.info("disk tier %s: %d blocks in %d segments (%d scanned), O_DIRECT %s", self.path,
                 sum(map(len, self._index.values())), len(self._segments), scanned,
                 f"with {self._mem_align}-byte memory alignment" if self._direct else "not used")

    def _load_segment(self, seq: int) -> int:
        """Index one segment from its checkpoint, or by a scan (then closed, torn tail cut). Returns 1
        if it was scanned."""
        loaded = self._read_index(seq)
        scanned = loaded is None
        if loaded is None:
            entries, end, closed, cleared = self._scan(seq)
            if not entries and not cleared:
                self._remove_files(seq)
                return 1
            if not closed:
                log.info("disk tier %s: segment %d was not closed; %d records kept, cut at byte %d", self.path, seq,
                         len(entries), end)
            fd = os.open(segment_file(seq), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | self._direct,
                         dir_fd=self._dir_fd)
            try:
                packed = [ENTRY.pack(off, n, crc, len(key), scope, key) for off, n, crc, scope, key in entries]
                self._close_segment(seq, fd, end, packed, not closed, cleared)
            finally:
                os.close(fd)
        else:
            entries, end, cleared = loaded
        seg = Segment(seq, end + ALIGN, closed=True, cleared=cleared)
        for off, length, crc, scope, key in entries:
            if (seq, off) < self._catalog.cleared(scope):
                continue  # written before a clear of its namespace
            self._index.setdefault(scope, {})[key] = pack_location(seq, off, length, crc)  # a later segment's wins
            seg.keys.setdefault(scope, []).append(key)
        self._segments[seq] = seg
        return int(scanned)

    def _read_index(self, seq: int) -> tuple[list[Entry], int, int] | None:
        """A segment's entries, footer offset and newest clear marker from its index file, if that is valid
        and matches the segment's footer; else None."""
        try:
            fd = os.open(index_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            parsed = parse_index(f.read(), seq)
        if parsed is None:
            return None
        entries, footer_at, records, entries_crc, cleared = parsed
        fd = os.open(segment_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        try:
            block = os.pread(fd, ALIGN, footer_at)
        finally:
            os.close(fd)
        if len(block) < FOOTER.size or parse_footer(block) != (seq, footer_at, records, entries_crc):
            return None
        return entries, footer_at, cleared

    def _scan(self, seq: int) -> tuple[list[Entry], int, bool, int]:
        """The records of a segment read from their headers: (entries, where they end, closed, the
        generation of its newest clear marker)."""
        fd = os.open(segment_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        entries: list[Entry] = []
        off = cleared = 0
        try:
            file_size = os.fstat(fd).st_size
            while off + ALIGN <= file_size:
                block = os.pread(fd, ALIGN, off)
                header = native.disk_parse_header(block) if len(block) == ALIGN else None
                if header is None:
                    marker = parse_footer(block, KIND_CLEAR) if len(block) == ALIGN else None
                    if marker is not None and marker[:2] == (seq, off):
                        cleared = max(cleared, marker[2])
                        off += ALIGN
                        continue
                    footer = parse_footer(block) if len(block) == ALIGN else None
                    return entries, off, footer is not None and footer[:2] == (seq, off), cleared
                _, got_seq, at, length, crc, scope, key = header
                end = off + ALIGN + pad(length)
                if got_seq != seq or at != off or end > file_size:
                    break
                entries.append((off, length, crc, scope, key))
                off = end
        finally:
            os.close(fd)
        return entries, off, False, cleared

    # -- writing ----------------------------------------------------------------------------------

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

    def _write_records(self, seg: Segment, scope: bytes, keys: Sequence[bytes], key_size: int, chosen: list[int],
                       base: int, offsets: Sequence[int], length: int, crcs: Sequence[int]) -> int:
        """Append these blocks to the active segment (one native call); index the ones written. An
        OSError for the first that failed."""
        n, record = len(chosen), ALIGN + pad(length)
        with self._lock:  # (for _position: a clear from now on comes after these records)
            at = [seg.size + k * record for k in range(n)]
            seg.size += n * record
        sums = [crcs[i] for i in chosen]
        results = native.disk_write([self._active_fd] * n, at, [seg.seq] * n, base, [offsets[i] for i in chosen],
                                    length, sums, scope, b"".join([keys[i] for i in chosen]), key_size,
                                    self.threads, self._mode, self._mem_align)
        done = [k for k, rc in enumerate(results) if rc == 0]
        self._active_entries.extend(ENTRY.pack(at[k], length, sums[k], key_size, scope, keys[chosen[k]])
                                    for k in done)
        with self._lock:
            cleared = self._catalog.cleared(scope)
            live = [k for k in done if (seg.seq, at[k]) >= cleared]  # (the others: a clear came meanwhile)
            index = self._index.setdefault(scope, {}) if live else {}
            seg_keys = seg.keys.setdefault(scope, []) if live else []
            for k in live:
                key = keys[chosen[k]]
                index[key] = pack_location(seg.seq, at[k], length, sums[k])
                seg_keys.append(key)
                self._changes.append((scope, key, True))
        failed = next((rc for rc in results if rc != 0), 0)
        if failed:
            raise OSError(-failed, os.strerror(-failed), os.path.join(self.path, segment_file(seg.seq)))
        return len(done)

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

    def _read_records(self, scope: bytes, keys: Sequence[bytes], key_size: int, plan: list[tuple[int, int]],
                      base: int, offsets: Sequence[int], length: int) -> list[int]:
        fds: dict[int, int] = {}
        try:
            for seq in sorted({value >> SEQ_SHIFT for _, value in plan}):
                fds[seq] = os.open(segment_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | self._direct,
                                   dir_fd=self._dir_fd)
            where = [unpack_location(value) for _, value in plan]
            return native.disk_read([fds[seq] for seq, _, _, _ in where], [off for _, off, _, _ in where],
                                    [seq for seq, _, _, _ in where], base, [offsets[i] for i, _ in plan], length,
                                    [crc for _, _, _, crc in where], scope, b"".join([keys[i] for i, _ in plan]),
                                    key_size, self.threads, self._mode, self._mem_align)
        finally:
            for fd in fds.values():
                os.close(fd)

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


