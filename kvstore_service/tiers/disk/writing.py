"""The disk tier's writes: a call's blocks not on disk yet appended to the active segment, a segment at a time
(rotating to a new one as each fills), in one native call each (csrc/disk_io.cpp), then indexed.

They run on the tier's threads, one at a time under the write lock; the blocks must not change meanwhile.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from kvstore_service import native_disk
from kvstore_service.tiers.disk.format import ALIGN, ENTRY, check_batch, pack_location, pad, segment_file
from kvstore_service.tiers.disk.segments import Segment, Segments

log = logging.getLogger("kvstore_service.tiers.disk")


class Writing(Segments):
    """`_write`: the write behind's I/O (`DiskTier.write_behind` runs it on the tier's threads)."""

    _queued: dict[bytes, int]  # scope + key -> bytes reserved by DiskTier._admit until _write takes them

    def _write(self, scope: bytes, keys: Sequence[bytes], base: int, offsets: Sequence[int], length: int,
               crcs: Sequence[int], name: str = "") -> int:
        """Write the blocks at ``base + offsets[i]`` (``length`` bytes, CRC32C ``crcs[i]``) that are not
        on disk yet (the blocks must not change until it returns). Returns how many it wrote; the others
        were on disk already or are dropped (counted): tier disabled, no space that could be reclaimed.
        Never raises for I/O failures (the tier disables itself); ValueError for malformed arguments.
        Releases the keys' `_admit` reservations. `name`: the namespace's, saved in the catalog before
        its first record (see `names`)."""
        key_size = check_batch(scope, keys, length, offsets, crcs)
        start = time.perf_counter()
        written = dropped = 0
        try:
            if self._usable():
                with self._write_lock:
                    written, dropped = self._write_locked(scope, keys, key_size, base, offsets, length, crcs, name)
            else:
                dropped = len(keys)
        finally:
            with self._lock:
                for key in keys:
                    self._counts["queued_bytes"] -= self._queued.pop(scope + key, 0)
                self._counts["written"] += written
                self._counts["write_bytes"] += written * length
                self._counts["write_dropped"] += dropped
                self._counts["write_seconds"] += time.perf_counter() - start
        return written

    def _write_locked(self, scope: bytes, keys: Sequence[bytes], key_size: int, base: int, offsets: Sequence[int],
                      length: int, crcs: Sequence[int], name: str) -> tuple[int, int]:
        """(written, dropped) of one write call, under the write lock."""
        todo: list[int] = []
        seen: set[bytes] = set()  # a key twice in one call is written once
        with self._lock:
            index = self._index.get(scope, {})
            for i, key in enumerate(keys):
                if key not in index and key not in seen:
                    seen.add(key)
                    todo.append(i)
        record = ALIGN + pad(length)
        if record > self.segment_bytes - ALIGN:
            log.warning("disk tier %s: a %d-byte block does not fit a %d-byte segment; not written", self.path,
                        length, self.segment_bytes)
            return 0, len(todo)
        written = 0
        try:
            self._write_marker()  # (one that found no room before)
            if todo and name:
                self._name(scope, name)
            while todo and self._usable():
                seg = self._room(record)
                if seg is None:
                    break  # every older segment is being read: try again with the next write
                fit = min(len(todo), (self.segment_bytes - ALIGN - seg.size) // record)
                written += self._write_records(seg, scope, keys, key_size, todo[:fit], base, offsets, length, crcs)
                todo = todo[fit:]
        except OSError as e:
            self._fail("a write", e)
        return written, len(todo)

    def _write_records(self, seg: Segment, scope: bytes, keys: Sequence[bytes], key_size: int, chosen: list[int],
                       base: int, offsets: Sequence[int], length: int, crcs: Sequence[int]) -> int:
        """Append these blocks to the active segment (one native call); index the ones written. An
        OSError for the first that failed."""
        n, record = len(chosen), ALIGN + pad(length)
        with self._lock:  # (for _position: a clear from now on comes after these records)
            at = [seg.size + k * record for k in range(n)]
            seg.size += n * record
        sums = [crcs[i] for i in chosen]
        results = native_disk.disk_write([self._active_fd] * n, at, [seg.seq] * n, base, [offsets[i] for i in chosen],
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
