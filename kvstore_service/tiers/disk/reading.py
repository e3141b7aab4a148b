"""The disk tier's reads: a call's blocks read from their segments into the pool and verified (header and
CRC32C) in one native call (csrc/disk_io.cpp); a record that fails verification is dropped and counted.

They run on the tier's threads, in parallel with each other and with writes; the segments read are
pinned meanwhile (not reclaimed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from kvstore_service import native_disk
from kvstore_service.tiers.disk.format import SEQ_SHIFT, check_batch, segment_file, unpack_location
from kvstore_service.tiers.disk.segments import Segments

log = logging.getLogger("kvstore_service.tiers.disk")


class Reading(Segments):
    """`_read`: a fetch's I/O (`DiskTier.fetch_verified` runs it on the tier's threads)."""

    def _read(self, scope: bytes, keys: Sequence[bytes], base: int, offsets: Sequence[int],
              length: int) -> list[int | None]:
        """Read each key's block into ``base + offsets[i]`` and verify it. Returns each block's CRC32C
        (verified), or None: not on disk (or not of this length), corrupt (dropped, counted), or the tier
        failed. Never raises for I/O failures; ValueError for malformed arguments."""
        key_size = check_batch(scope, keys, length, offsets)
        out: list[int | None] = [None] * len(keys)
        if not keys or not self._usable():
            return out
        start = time.perf_counter()
        plan = self._start_read(scope, keys, length)  # [(i, packed location)]; their segments pinned
        results: list[int] | None = None
        try:
            if plan:
                results = self._read_records(scope, keys, key_size, plan, base, offsets, length)
        except OSError as e:
            self._fail("a read", e)
        finally:
            self._finish_read(scope, keys, length, plan, results, out, time.perf_counter() - start)
        return out

    def _start_read(self, scope: bytes, keys: Sequence[bytes], length: int) -> list[tuple[int, int]]:
        """(i, location) of the keys on disk with blocks of this length; their segments pinned."""
        plan: list[tuple[int, int]] = []
        with self._lock:
            index = self._index.get(scope, {})
            for i, key in enumerate(keys):
                value = index.get(key)
                if value is not None and unpack_location(value)[2] == length:
                    plan.append((i, value))
            for seq in {value >> SEQ_SHIFT for _, value in plan}:
                self._segments[seq].readers += 1
        return plan

    def _finish_read(self, scope: bytes, keys: Sequence[bytes], length: int, plan: list[tuple[int, int]],
                     results: list[int] | None, out: list[int | None], seconds: float) -> None:
        """Unpin the segments; fill `out`; drop and count corrupt records; an I/O error disables."""
        corrupt = 0
        failed = 0
        with self._lock:
            for seq in {value >> SEQ_SHIFT for _, value in plan}:
                self._segments[seq].readers -= 1
            index = self._index.get(scope, {})
            for (i, value), rc in zip(plan, results or (), strict=False):
                if rc == 0:
                    out[i] = value & 0xFFFFFFFF
                elif rc > 0:
                    corrupt += 1
                    if index.get(keys[i]) == value:
                        del index[keys[i]]
                        self._changes.append((scope, keys[i], False))
                else:
                    failed = failed or rc
            done = sum(v is not None for v in out)
            self._counts["read_blocks"] += done
            self._counts["read_bytes"] += done * length
            self._counts["corrupt"] += corrupt
            self._counts["read_seconds"] += seconds
        if corrupt:
            log.warning("disk tier %s: %d block(s) failed verification at a read and were dropped", self.path, corrupt)
        if failed:
            self._fail("a read", OSError(-failed, os.strerror(-failed), self.path))

    def _read_records(self, scope: bytes, keys: Sequence[bytes], key_size: int, plan: list[tuple[int, int]],
                      base: int, offsets: Sequence[int], length: int) -> list[int]:
        fds: dict[int, int] = {}
        try:
            for seq in sorted({value >> SEQ_SHIFT for _, value in plan}):
                fds[seq] = os.open(segment_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | self._direct,
                                   dir_fd=self._dir_fd)
            where = [unpack_location(value) for _, value in plan]
            return native_disk.disk_read([fds[seq] for seq, _, _, _ in where], [off for _, off, _, _ in where],
                                         [seq for seq, _, _, _ in where], base, [offsets[i] for i, _ in plan], length,
                                         [crc for _, _, _, crc in where], scope, b"".join([keys[i] for i, _ in plan]),
                                         key_size, self.threads, self._mode, self._mem_align)
        finally:
            for fd in fds.values():
                os.close(fd)
