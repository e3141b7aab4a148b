"""The disk tier: pool blocks kept in segment files on a local disk (NVMe), surviving restarts.

    tier = DiskTier.open("/var/lib/kvstore", 1 << 40, executor=threads.disk)  # blocking: checks, loads
    tier.write_behind(pool, scope, keys, offsets, checksums, release)   # loop: queued, written on `executor`
    async for crcs in tier.fetch_verified(pool, scope, keys, place): ... # the leading run on disk, verified
    held = tier.holds(scope, keys)                                       # loop: which keys are on disk
    forgotten = tier.forget([scope.ns_hash])                             # loop: gone; await forgotten.saved
    await tier.aclose(drain_s)                                           # writes finished, segments closed

That is the tiers' contract (tiers/base.py), the tier's only face: `Tiers` drives it (with `unwritten`,
`names`, `take_changes` and `stats`), and so do the tests. ``scope`` is a `Scope` (its ``ns_hash``, 16
bytes, keys the records; its ``name`` is kept in the catalog; its ``block_bytes`` is every block's
length), keys are 1..64 bytes (all of one length in a call), and ``offsets`` the blocks' payload offsets
in the pool's memory (``Pool.base``). Its parts: the bytes (format.py; described in docs/formats.md),
the directory's trust and lock (directory.py), the clears and names that outlive a restart
(catalog.py), the segment files and the index of their records (segments.py), loaded at open
(loading.py), written to (writing.py) and read back verified (reading.py). Clear, restart, durability
and space: docs/tiers.md.

Failure model: the tier is a cache under the pool, so its faults never reach the caller. A directory
that is unsafe (a symbolic link, another uid's, group/world writable) or in use by another process is
refused at ``open`` (DiskDirectoryError, a ValueError). Any other OSError (no space: ENOSPC, an I/O
error, a directory removed or not writable) disables the tier for good: one error log line,
``stats().healthy`` False and ``stats().error`` saying what failed; writes behind are then dropped
(counted), fetches and ``holds`` find nothing. A record that fails verification at a fetch is dropped
from the index, counted (``corrupt``) and ends the fetch there (a miss); the tier stays healthy.
Malformed arguments (a scope not of 16 bytes, keys of several lengths, offsets or checksums not one
per key) are a caller's bug: ValueError, before anything is taken.

Write-behind: ``write_behind`` (on the event loop, never waits) takes the blocks worth writing (not on
disk, not queued) while their bytes fit in ``queue_bytes`` and reserves that room; the rest are dropped
(counted) and released at once. The blocks taken are written on ``executor``, a batch a call, and
released (and their room with them) when that write returns; ``aclose`` waits for the writes under way.

Threading: the contract's calls run on the event loop (in memory, brief); the I/O they start (writes,
reads, catalog saves) blocks and runs on ``executor``, any number at once (writes one at a time by
the write lock, catalog writes by the catalog's; reads in parallel with each other and with writes).
One lock guards the in-memory index, clears, names and counters and is never held during I/O. The
I/O of a call is one native call (csrc/disk_io.cpp) that moves the whole batch (O_DIRECT where the
file system has it) on ``threads`` threads with the GIL released; each record goes through an aligned
buffer (a copy), or with ``io_mode='direct'`` straight between the pool and the file where the pool
address meets O_DIRECT's memory alignment. After ``aclose`` the tier finds nothing.

Memory: about 170 bytes per block on disk with 32-byte keys (1 TiB of 256 KiB blocks: ~0.7 GB).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import mmap
import os
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from itertools import takewhile
from typing import Any, Final

from kvstore_service.stats import DiskStats
from kvstore_service.threads import Threads
from kvstore_service.tiers.base import Forgotten, Memory, Place, Scope
from kvstore_service.tiers.disk.catalog import Catalog
from kvstore_service.tiers.disk.directory import DiskDirectoryError, open_directory, probe_direct_io, take_lock
from kvstore_service.tiers.disk.format import ALIGN, IO_MODES, MIN_SEGMENT_BYTES, check_batch
from kvstore_service.tiers.disk.loading import Loading
from kvstore_service.tiers.disk.reading import Reading
from kvstore_service.tiers.disk.writing import Writing

__all__ = ["ALIGN", "DiskDirectoryError", "DiskTier"]

log = logging.getLogger(__name__)

# DiskStats' counters (the rest is read off the tier's state)
_COUNTERS: Final = tuple(f.name for f in dataclasses.fields(DiskStats)
                         if f.name not in ("blocks", "bytes", "capacity_bytes", "segments", "direct_io", "healthy",
                                           "error"))


class DiskTier(Writing, Reading, Loading):
    """Blocks in segment files under one directory; see the module docstring. Build with `open`."""

    def __init__(self, path: str, size: int, *, executor: Executor, segment_bytes: int = 256 << 20,
                 queue_bytes: int = 256 << 20, threads: int = 2, io_mode: str = "staged") -> None:
        if segment_bytes < MIN_SEGMENT_BYTES or segment_bytes % ALIGN:
            raise ValueError(f"disk segment size must be a multiple of {ALIGN} of at least {MIN_SEGMENT_BYTES} bytes "
                             f"(got {segment_bytes})")
        if size < 2 * segment_bytes:
            raise ValueError(f"disk size {size} must hold at least two {segment_bytes}-byte segments")
        if not 1 <= threads <= 64:
            raise ValueError(f"disk I/O threads must be 1..64 (got {threads})")
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {sorted(IO_MODES)} (got {io_mode!r})")
        self.path, self.segment_bytes, self.queue_bytes, self.threads = path, segment_bytes, queue_bytes, threads
        self.max_segments = size // segment_bytes
        self.capacity_bytes = self.max_segments * segment_bytes
        self._mode, self._direct, self._mem_align = IO_MODES[io_mode], 0, ALIGN
        self._lock, self._write_lock = threading.Lock(), threading.Lock()  # (see Segments)
        self._index, self._segments, self._active = {}, {}, None
        self._active_fd, self._active_entries, self._unsynced, self._next_seq = -1, [], [], 1
        self._queued: dict[bytes, int] = {}  # scope + key -> bytes reserved by _admit
        self._changes = []
        self._catalog = Catalog()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._healthy, self._error = True, ""
        self._dir_fd = self._lock_fd = -1
        self._closed = False
        self._block = mmap.mmap(-1, ALIGN)
        # Disk calls block on I/O (the native engine has its own threads): the tiers' contract runs them on
        # the daemon's disk threads (Threads.disk), which the daemon stops after the tier is closed.
        self._io = executor
        self._tasks: set[asyncio.Task[None]] = set()  # writes behind and catalog saves under way

    @classmethod
    def open(cls, path: str, size: int, *, executor: Executor, segment_bytes: int = 256 << 20,
             queue_bytes: int = 256 << 20, threads: int = 2, io_mode: str = "staged") -> DiskTier:
        """Open (or create) the tier in directory `path` holding up to `size` bytes of segments: checks
        the directory, loads the segments' index checkpoints and scans segments without one. Blocking.
        DiskDirectoryError (ValueError) for an unsafe or busy directory, ValueError for bad arguments;
        any other failure returns a disabled tier (``stats().healthy`` False). `executor`: the threads the
        tiers' contract runs the I/O on (the daemon's `Threads.disk`; the blocking calls above do not use
        it). `io_mode`: 'staged' (each record through an aligned buffer: a copy, measured faster from a
        /dev/shm pool) or 'direct' (payload pages straight from/into memory where aligned for O_DIRECT,
        else staged)."""
        tier = cls(path, size, executor=executor, segment_bytes=segment_bytes, queue_bytes=queue_bytes,
                   threads=threads, io_mode=io_mode)
        try:
            tier._dir_fd = open_directory(path)
            tier._lock_fd = take_lock(tier._dir_fd, path)
            tier._direct, tier._mem_align = probe_direct_io(tier._dir_fd, path)
            tier._load()
        except OSError as e:
            tier._fail("opening it", e)
        return tier

    # -- the tiers' contract (tiers/base.py): on the event loop, the I/O on the tier's threads -----------

    def write_behind(self, memory: Memory, scope: Scope, keys: Sequence[bytes], offsets: Sequence[int],
                     checksums: Sequence[int], release: Callable[[int], None]) -> int:
        """Take the blocks not on disk nor queued while their bytes fit in the write queue (the others are
        released at once; those that do not fit are dropped, counted) and write them on the tier's threads,
        each released when its batch's write returns."""
        check_batch(scope.ns_hash, keys, scope.block_bytes, offsets, checksums)
        chosen = self._admit(scope.ns_hash, keys, scope.block_bytes)
        for i in sorted(set(range(len(keys))) - set(chosen)):
            release(i)
        if chosen:
            self._spawn(self._write_behind(memory, scope, [keys[i] for i in chosen], [offsets[i] for i in chosen],
                                           [checksums[i] for i in chosen], lambda n: release(chosen[n])))
        return len(chosen)

    async def fetch_verified(self, memory: Memory, scope: Scope, keys: Sequence[bytes],
                             place: Place) -> AsyncGenerator[list[int]]:
        """The leading keys on disk (counted as hits, the rest as misses), read into their places and
        verified in one batch; it ends before the first corrupt one (dropped, counted)."""
        check_batch(scope.ns_hash, keys, scope.block_bytes)
        n = self._leading(scope.ns_hash, keys)
        offsets = place(0, n) if n else []  # (a store may have brought some meanwhile)
        if not offsets:
            return
        sums: list[int | None] = [None] * len(offsets)
        try:
            sums = await Threads.run(self._io, self._read, scope.ns_hash, keys[:len(offsets)], memory.base, offsets,
                                     scope.block_bytes)
        except Exception:
            log.exception("reading %d blocks from disk failed", len(offsets))
        good = list(takewhile(lambda s: s is not None, sums))
        if good:
            yield good  # type: ignore[misc]

    def holds(self, scope: Scope, keys: Sequence[bytes]) -> set[bytes]:
        """Those of `keys` on disk, from the index in memory (brief; not counted as hits or misses)."""
        with self._lock:
            index = self._index.get(scope.ns_hash) if self._healthy and not self._closed else None
            return index.keys() & keys if index else set()

    def unwritten(self, scope: Scope, keys: Sequence[bytes]) -> None:
        """Blocks that will never be written behind: dropped writes, counted, but for those on disk already."""
        with self._lock:
            index = self._index.get(scope.ns_hash, {})
            self._counts["write_dropped"] += sum(key not in index for key in keys)

    def forget(self, scopes: Sequence[bytes] | None) -> Forgotten:
        """Drop the blocks of these namespaces (None: of every namespace) from the index: fetches and `holds`
        miss them from now on. The catalog is saved on the tier's threads (`saved`, the task to await before
        answering): the clear lasts across a restart from then on (see Clear in docs/tiers.md)."""
        dropped = self._clear(scopes)
        return Forgotten(dropped, self._spawn(self._save_catalog_behind()) if dropped else None)

    def names(self) -> dict[bytes, str]:
        """The names of the namespaces with blocks on disk, where their writes were told them (a `Scope`'s
        name): scope -> name, from the catalog (so after a restart too)."""
        with self._lock:
            return dict(self._catalog.names)

    def take_changes(self) -> list[tuple[bytes, bytes, bool]]:
        """The blocks written (True) and dropped (False) since the last call, in order: (scope, key, written);
        a key b"" stands for every block of the scope, a scope b"" for every scope."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(**self._counts, blocks=sum(map(len, self._index.values())),  # type: ignore[arg-type]
                             bytes=sum(seg.size for seg in self._segments.values()), segments=len(self._segments),
                             capacity_bytes=self.capacity_bytes, direct_io=bool(self._direct), healthy=self._healthy,
                             error=self._error)

    async def aclose(self, drain_s: float) -> None:
        """Finish the writes and catalog saves under way (whatever `drain_s`: they are short), then close the
        active segment (footer and index checkpoint) and release the directory, on the tier's threads (the
        daemon stops those after). Fetches find nothing after it; writes behind are dropped (counted)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await Threads.run(self._io, self._close)

    # -- the contract's parts on the event loop (in memory; brief) ----------------------------------------

    def _leading(self, scope: bytes, keys: Sequence[bytes]) -> int:
        """How many of the leading keys are on disk; counted as hits, the rest as misses."""
        found = 0
        with self._lock:
            index = self._index.get(scope) if self._healthy and not self._closed else None
            if index:
                for key in keys:
                    if key not in index:
                        break
                    found += 1
            self._counts["hits"] += found
            self._counts["misses"] += len(keys) - found
        return found

    def _admit(self, scope: bytes, keys: Sequence[bytes], length: int) -> list[int]:
        """Which of these blocks (`length` bytes each) to hand to `_write`: those not on disk nor queued,
        while they fit in the write queue (the rest are dropped, counted). Reserves their room until
        `_write` gets their keys."""
        chosen: list[int] = []
        with self._lock:
            if not self._healthy or self._closed:
                self._counts["write_dropped"] += len(keys)
                return chosen
            index = self._index.get(scope, {})
            for i, key in enumerate(keys):
                name = scope + key
                if key in index or name in self._queued:
                    continue
                if self._counts["queued_bytes"] + length > self.queue_bytes:
                    self._counts["write_dropped"] += 1
                    continue
                self._queued[name] = length
                self._counts["queued_bytes"] += length
                chosen.append(i)
        return chosen

    def _clear(self, scopes: Sequence[bytes] | None) -> dict[bytes, dict[bytes, int]]:
        """Drop the blocks of these namespaces (None: of every namespace) from the index, and record the
        clear in the catalog (in memory: `_save_catalog` writes it). Returns the keys dropped, by namespace."""
        with self._lock:
            at = self._position()
            if scopes is None:
                dropped, self._index = self._index, {}
            else:  # (one without a block has no record to kill but those being written, which the pool still
                # holds: they stay, on disk too)
                dropped = {scope: keys for scope in scopes if (keys := self._index.pop(scope, None))}
            if dropped:
                self._catalog.record_clear(None if scopes is None else list(dropped), at)
                self._changes.extend([(b"", b"", False)] if scopes is None else [(s, b"", False) for s in dropped])
            return dropped

    async def _write_behind(self, memory: Memory, scope: Scope, keys: list[bytes], offsets: list[int],
                            checksums: list[int], release: Callable[[int], None]) -> None:
        try:
            await Threads.run(self._io, self._write, scope.ns_hash, keys, memory.base, offsets, scope.block_bytes,
                              checksums, scope.name)
        except Exception:  # (I/O failures disable the tier inside; this is a bug)
            log.exception("writing %d blocks to disk failed", len(keys))
        finally:
            for n in range(len(keys)):
                release(n)

    async def _save_catalog_behind(self) -> None:
        try:
            await Threads.run(self._io, self._save_catalog)
        except Exception:  # (I/O failures disable the tier inside; this is a bug)
            log.exception("writing the disk tier's catalog failed")

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # (aclose waits for it)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the contract's I/O, on the tier's threads (blocking; writes: writing.py, reads: reading.py) -----

    def _save_catalog(self) -> None:
        """Write the catalog (clears, names) if it changed, flushed, then a clear's marker into the active
        segment: a clear lasts from when this returns. Waits for a write under way. Never raises for I/O
        failures (the tier disables itself)."""
        try:
            self._write_catalog()
            with self._write_lock:
                if self._usable():
                    self._write_marker()
        except OSError as e:
            self._fail("writing the catalog", e)

    def _close(self) -> None:
        """Close the active segment (footer and index checkpoint) and release the directory. No
        `_write`/`_read` may run meanwhile; after it they find nothing."""
        with self._write_lock:
            if self._closed:
                return
            try:
                if self._healthy:
                    self._write_catalog()
                    self._write_marker()
                if self._active is not None and self._healthy:
                    self._close_active()
                if self._healthy:
                    self._write_catalog()  # (the clears that no segment needs any more left out)
                    self._flush()
            except OSError as e:
                self._fail("closing it", e)
            finally:
                with self._catalog.lock, self._lock:  # (a catalog write under way has finished)
                    self._closed = True
                if self._active_fd >= 0:
                    os.close(self._active_fd)
                    self._active_fd = -1
                for fd in (self._lock_fd, self._dir_fd):
                    if fd >= 0:
                        os.close(fd)
                self._lock_fd = self._dir_fd = -1
                self._block.close()
