"""The disk tier's segments loaded at open: each one indexed from its checkpoint (index file), or by a scan of
its record headers where it has none or a stale one (the segment then closed, a torn tail cut); leftovers
removed; the catalog checked against the segments' clear markers, and every block dropped where it may
have missed a clear (see Clear in docs/tiers.md).
"""

from __future__ import annotations

import logging
import os

from kvstore_service import native_disk
from kvstore_service.tiers.disk.format import (
    ALIGN,
    CATALOG_FILE,
    ENTRY,
    FOOTER,
    KIND_CLEAR,
    SEGMENT_FILE,
    Entry,
    index_file,
    pack_location,
    pad,
    parse_footer,
    parse_index,
    segment_file,
)
from kvstore_service.tiers.disk.segments import Segment, Segments

log = logging.getLogger("kvstore_service.tiers.disk")


class Loading(Segments):
    """`DiskTier.open`'s part: `_load` reads what a directory holds into the segments' books."""

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
                header = native_disk.disk_parse_header(block) if len(block) == ALIGN else None
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
