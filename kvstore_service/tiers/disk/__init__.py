"""The disk tier: pool blocks kept in segment files on a local disk (NVMe), surviving restarts.

    tier = DiskTier.open("/var/lib/kvstore", 1 << 40)             # blocking: checks, loads, scans
    chosen = tier.admit(scope, keys, length)                       # loop: which to write; reserves queue room
    tier.write(scope, keys, pool.base, offsets, length, crcs)     # worker thread; the blocks stay pinned
    n = tier.leading(scope, keys)                                  # loop: how many leading keys are on disk
    got = tier.read(scope, keys[:n], pool.base, offsets, length)  # worker thread: into fresh slots, verified
    dropped = tier.clear([scope])                                  # loop: a namespace's blocks gone (None: all)
    tier.save_catalog()                                            # worker thread: ... for good (the catalog)
    tier.close()                                                   # seals the active segment, writes its index

``scope`` is a namespace hash (16 bytes), keys are 1..64 bytes (all of one length in a call), ``base``
is the address of the pool's memory (``Pool.base``) and ``offsets`` the blocks' payload offsets in it.

Files (in one directory of the daemon's uid that only it may write, created 0700; ``lock`` holds an flock
while a tier is open):

- ``seg-<16 hex digits>.kvd``: a segment, numbered in write order, preallocated to ``segment_bytes``.
  Records are appended at 4 KiB-aligned offsets. A record is a 4 KiB header block (RecordHeader in
  csrc/disk_io.cpp: magic ``KVDR``, version, segment number, its own offset, payload length, CRC32C of
  the payload, key length, scope, key, CRC32C of the header), then the payload padded to 4 KiB. A full
  segment is sealed: a footer block (magic ``KVDF``, version, kind 2, segment number, its offset, record
  count, CRC32C of the segment's index entries, CRC32C of the footer) after its last record, and the
  file cut there.
- ``seg-<n>.idx``: the segment's index checkpoint, written when it is sealed (the segment no longer
  changes after, so the checkpoint of a sealed segment never needs rewriting): header (``KVDINDEX``,
  version, entry size, segment number, footer offset, record count, CRC32C of the entries), the entries
  (offset, payload length, payload CRC32C, key length, scope, key), CRC32C of all that. It is used only
  if it matches the segment's footer (same count and entries CRC); otherwise the segment is scanned.
- ``catalog``: what a restart needs besides the segments (header ``KVDCATLG``, version, entry count, the
  position of the last clear of everything, the generation: how many clears there have been; per namespace:
  scope, the position of its last clear, its name; CRC32C of all that), replaced atomically (a temporary
  file, fsync, rename, fsync of the directory). Written at every ``open``, so one always exists beside
  segments.
- A clear marker: a block like a footer (kind 3, the clear's generation in place of the record count) that
  a clear writes into the active segment after the catalog; a segment's index checkpoint keeps its newest.

Clear (``clear``): a namespace's blocks leave the index at once, and its clear is recorded as a position,
the (segment, offset) where the next record would go: a record of that namespace before it was written
before the clear and is dead. Positions only grow (segments are numbered in write order, records appended),
so one position per namespace (and one for a clear of everything) says it all, whatever the checkpoints
and scans find later: ``open`` skips dead records, and a write under way at the clear does not index the
records it had placed before it. Blocks written after the clear are kept, even under a key cleared. The
catalog (``save_catalog``, on a worker thread after the clear) makes it last: until it is written a
crash forgets the clear, never anything else. A clear's position is dropped once no segment at or before
it is left (reclaimed): it can match nothing. Then the clear's marker goes into the active segment
(flushed), stamped with the catalog's generation. A catalog in doubt counts as a clear of every segment
there is (a cache may lose blocks; it must not bring cleared ones back): one that fails its check, one
missing beside segments (deleted), or one older than the segments' newest marker (restored from before a
clear); that clear gets its own marker, so the same catalog put back again is caught again. ``open``
writes the catalog it ends with. The names (given to
``write``, saved before a namespace's first record) let a clear of a tenant find its namespaces after a
restart; ``open`` forgets those with no block left.

Restart (``open``): each segment's entries come from its index file, or from a scan of its record
headers (a segment without a valid index: the active one at a crash). A scan stops at the first block
that is not a valid header of this segment at this offset, or a record running past the end of the
file: the torn tail, which is cut off; the segment is then sealed as it is. New writes always start a
new segment. Only headers are read at restart: a record is served only after ``read`` verified it
(its header is the expected one and its payload matches its CRC32C), which every read does.

Durability: writes are O_DIRECT, so a killed daemon loses nothing it reported written. Nothing is
flushed from the device's write cache (fdatasync) while the tier runs: measured here, a flush per sealed
segment cost as much as writing it. ``close`` flushes every segment sealed since ``open``. A power loss
may lose or tear records written since: they then fail verification (scan or read) and are dropped.

Space: at most ``size // segment_bytes`` segments. A new segment takes the place of the oldest one
(all its blocks dropped with it), skipping segments that a ``read`` is reading (the next write tries
them again). A block already on disk is not written again.

Failure model: the tier is a cache under the pool, so its faults never reach the caller. A directory
that is unsafe (a symbolic link, another uid's, group/world writable) or in use by another process is
refused at ``open`` (DiskDirectoryError, a ValueError). Any other OSError (no space: ENOSPC, an I/O
error, a directory removed or not writable) disables the tier for good: one error log line,
``stats().healthy`` False and ``stats().error`` saying what failed; ``write`` then drops (counted),
``read`` and ``leading`` find nothing. A record that fails verification at a read is dropped from the
index, counted (``corrupt``) and reported as absent (None); the tier stays healthy.

Write-behind: ``admit`` (on the event loop, never waits) picks the blocks worth writing (not on disk, not
queued) while their bytes fit in ``queue_bytes`` and reserves that room; the rest are dropped (counted).
``write`` releases the reservations of its keys when it returns (``cancel`` releases ones never written).

Threading: ``leading``, ``admit``, ``cancel``, ``unwritten``, ``clear``, ``names`` and ``stats`` are for
the event loop (in memory, brief); ``write``, ``read`` and ``save_catalog`` block on I/O and run on worker
threads, any number at once (writes are run one at a time by an internal lock, catalog writes by another;
reads run in parallel with each other and with writes). One lock guards the in-memory index, clears, names
and counters and is never held during I/O. The I/O of a call is one native call (csrc/
disk_io.cpp) that moves the whole batch (O_DIRECT where the file system has it) on ``threads`` threads
with the GIL released, each keeping one request in flight (Linux AIO) while it prepares or verifies
another; each record goes through an aligned buffer (a copy), or with
``io_mode='direct'`` straight between the pool and the file where the pool address meets O_DIRECT's
memory alignment (slower from a /dev/shm pool here: see csrc/disk_io.cpp). ``close`` must not run
concurrently with ``write``/``read``; after it they find nothing.

Memory: about 170 bytes per block on disk with 32-byte keys (1 TiB of 256 KiB blocks: ~0.7 GB).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from kvstore_service import native

log = logging.getLogger(__name__)

ALIGN: Final[int] = native.DISK_RECORD_ALIGN  # 4 KiB: header block, payload padding, record offsets
FORMAT_VERSION: Final = 1
SCOPE_BYTES: Final = 16
MAX_KEY: Final[int] = native.DISK_MAX_KEY
MIN_SEGMENT_BYTES: Final = 64 << 10
IO_MODES: Final = {"staged": native.DISK_MODE_STAGED, "direct": native.DISK_MODE_DIRECT}

# magic, version, kind, segment, offset, records, CRC32C of the index entries, CRC32C of the bytes before it
_FOOTER = struct.Struct("<IHHQQQII")
_FOOTER_MAGIC: Final = 0x4644564B  # "KVDF"
_KIND_FOOTER: Final = 2
_KIND_CLEAR: Final = 3  # a clear marker: the same block, with the clear's generation in place of the record count
_INDEX_VERSION: Final = 2
# magic, version, entry bytes, segment, footer offset, records, CRC32C of the entries, the segment's newest
# clear marker (its generation; 0: none)
_INDEX_HEADER = struct.Struct("<8sIIQQQIQ")
_INDEX_MAGIC: Final = b"KVDINDEX"
_ENTRY = struct.Struct("<QQII16s64s")  # offset, payload length, payload CRC32C, key length, scope, key
_CRC = struct.Struct("<I")
_SEGMENT_FILE = re.compile(r"seg-([0-9a-f]{16})\.kvd")
_LOCK_FILE: Final = "lock"
_PROBE_FILE: Final = "probe.tmp"
_CATALOG_FILE: Final = "catalog"
# magic, version, entries, the last clear of everything (segment, offset), generation (clears so far); then
# entries, then CRC32C of it all
_CATALOG_HEADER = struct.Struct("<8sIIQQQ")
_CATALOG_MAGIC: Final = b"KVDCATLG"
_CATALOG_VERSION: Final = 2
_CATALOG_ENTRY = struct.Struct("<16sQQI")  # scope, its last clear (segment, offset), name length; the name follows
_NO_CLEAR: Final = (0, 0)  # a position before every record

Position = tuple[int, int]  # (segment, offset) of a record, or where the next one goes

# An index value packs (segment, offset / ALIGN, payload length, payload CRC32C) into one int.
_SEQ_SHIFT: Final = 104
_PAGE_SHIFT: Final = 72
_LEN_SHIFT: Final = 32

Entry = tuple[int, int, int, bytes, bytes]  # offset, payload length, payload CRC32C, scope, key


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pack(seq: int, offset: int, length: int, crc: int) -> int:
    return seq << _SEQ_SHIFT | (offset // ALIGN) << _PAGE_SHIFT | length << _LEN_SHIFT | crc


def _unpack(value: int) -> tuple[int, int, int, int]:
    return (value >> _SEQ_SHIFT, (value >> _PAGE_SHIFT & 0xFFFFFFFF) * ALIGN, value >> _LEN_SHIFT & (1 << 40) - 1,
            value & 0xFFFFFFFF)


def _segment_file(seq: int) -> str:
    return f"seg-{seq:016x}.kvd"


def _index_file(seq: int) -> str:
    return f"seg-{seq:016x}.idx"


class DiskDirectoryError(ValueError):
    """The disk tier's directory cannot be trusted or is in use: the daemon refuses to start."""


@dataclass(slots=True)
class DiskStats:
    """Counters since open. ``bytes``: disk space the segments take (counted against ``capacity_bytes``);
    ``hits``/``misses``: keys ``leading`` found / did not find; ``read_blocks``/``read_bytes``: blocks read
    and verified and their payload bytes; ``written``/``write_bytes``: blocks written, payload bytes;
    ``write_dropped``: blocks not written (queue full, no space to reclaim, tier disabled or closed, evicted from
    the pool before their seal: ``unwritten``);
    ``corrupt``: records that failed verification (dropped); ``errors``: failed I/O calls."""

    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    segments: int = 0
    hits: int = 0
    misses: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    written: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    write_dropped: int = 0
    queued_bytes: int = 0
    corrupt: int = 0
    errors: int = 0
    reclaimed_segments: int = 0
    direct_io: bool = False
    healthy: bool = True
    error: str = ""


@dataclass(slots=True, eq=False)
class _Segment:
    seq: int
    size: int = 0  # bytes of its records (and of its footer once sealed)
    sealed: bool = False
    keys: dict[bytes, list[bytes]] = field(default_factory=dict)  # scope -> keys written to it (some gone since)
    readers: int = 0  # read() calls reading it now: it is not reclaimed meanwhile
    cleared: int = 0  # the generation of its newest clear marker (0: none)


def _directory_problem(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to the daemon's uid {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _open_directory(path: str) -> int:
    """The directory (created 0700 if absent) as an fd, if it is safe to keep blocks in: a planted
    symbolic link or a directory others can write could feed us forged files or redirect our writes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    problem = _directory_problem(st)
    if problem:
        raise DiskDirectoryError(f"disk tier directory {path} {problem}: fix it (it must be a directory of the "
                                 "daemon's own, writable by it alone) or choose another --disk-path")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise DiskDirectoryError(f"disk tier directory {path} was replaced while it was opened")
    return fd


def _parse_footer(block: bytes, kind: int = _KIND_FOOTER) -> tuple[int, int, int, int] | None:
    """(segment, offset, records, entries CRC32C) of a valid footer block, else None; with `kind`
    _KIND_CLEAR, (segment, offset, generation, 0) of a valid clear marker."""
    magic, version, got_kind, seq, offset, records, entries_crc, crc = _FOOTER.unpack_from(block)
    if (magic != _FOOTER_MAGIC or version != FORMAT_VERSION or got_kind != kind
            or crc != native.crc32c(block[:_FOOTER.size - 4])):
        return None
    return seq, offset, records, entries_crc


def _footer_block(kind: int, seq: int, offset: int, count: int, entries_crc: int) -> bytes:
    footer = _FOOTER.pack(_FOOTER_MAGIC, FORMAT_VERSION, kind, seq, offset, count, entries_crc, 0)
    block = footer[:-4] + _CRC.pack(native.crc32c(footer[:-4]))
    return block + bytes(ALIGN - len(block))


class DiskTier:
    """Blocks in segment files under one directory; see the module docstring. Build with `open`."""

    def __init__(self, path: str, size: int, *, segment_bytes: int = 256 << 20, queue_bytes: int = 256 << 20,
                 threads: int = 2, io_mode: str = "staged") -> None:
        if segment_bytes < MIN_SEGMENT_BYTES or segment_bytes % ALIGN:
            raise ValueError(f"disk segment size must be a multiple of {ALIGN} of at least {MIN_SEGMENT_BYTES} bytes "
                             f"(got {segment_bytes})")
        if size < 2 * segment_bytes:
            raise ValueError(f"disk size {size} must hold at least two {segment_bytes}-byte segments")
        if not 1 <= threads <= 64:
            raise ValueError(f"disk I/O threads must be 1..64 (got {threads})")
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {sorted(IO_MODES)} (got {io_mode!r})")
        self.path = path
        self.segment_bytes = segment_bytes
        self.max_segments = size // segment_bytes
        self.queue_bytes = queue_bytes
        self.threads = threads
        self._mode = IO_MODES[io_mode]
        self._direct = 0  # os.O_DIRECT once probed
        self._mem_align = ALIGN
        self._lock = threading.Lock()  # the index, segments' keys and readers, counters, queue: never during I/O
        self._write_lock = threading.Lock()  # one write (or close) at a time: the active segment, rotation, files
        self._index: dict[bytes, dict[bytes, int]] = {}  # scope -> key -> _pack(...)
        self._segments: dict[int, _Segment] = {}  # by number: oldest first
        self._active: _Segment | None = None
        self._active_fd = -1
        self._active_entries: list[bytes] = []  # the active segment's index entries, packed
        self._unsynced: list[int] = []  # segments sealed since open, not flushed to stable storage yet
        self._next_seq = 1
        self._queued: dict[bytes, int] = {}  # scope + key -> bytes reserved by admit
        self._clear_all: Position = _NO_CLEAR  # records before it are dead: see Clear in the module docstring
        self._clears: dict[bytes, Position] = {}  # scope -> records of it before this are dead
        self._names: dict[bytes, str] = {}  # scope -> the namespace's name, as given to write
        # Clears so far: stamped into the catalog and, as a clear marker, into the active segment, so that a
        # catalog older than the segments (restored from before a clear) shows.
        self._generation = 0
        self._saved_generation = 0  # the catalog file's
        self._marker_due = False  # a clear's marker is still to be written
        self._catalog_lock = threading.Lock()  # one catalog file write at a time
        self._catalog_saved = b""  # the catalog as last written
        self._stats = DiskStats(capacity_bytes=self.max_segments * segment_bytes)
        self._dir_fd = -1
        self._lock_fd = -1
        self._closed = False
        self._block = mmap.mmap(-1, ALIGN)  # a page-aligned block for footers (O_DIRECT)

    @classmethod
    def open(cls, path: str, size: int, *, segment_bytes: int = 256 << 20, queue_bytes: int = 256 << 20,
             threads: int = 2, io_mode: str = "staged") -> DiskTier:
        """Open (or create) the tier in directory `path` holding up to `size` bytes of segments: checks
        the directory, loads the segments' index checkpoints and scans segments without one. Blocking.
        DiskDirectoryError (ValueError) for an unsafe or busy directory, ValueError for bad arguments;
        any other failure returns a disabled tier (``stats().healthy`` False). `io_mode`: 'staged' (each
        record through an aligned buffer: a copy, measured faster from a /dev/shm pool) or 'direct' (payload
        pages straight from/into memory where aligned for O_DIRECT, else staged)."""
        tier = cls(path, size, segment_bytes=segment_bytes, queue_bytes=queue_bytes, threads=threads,
                   io_mode=io_mode)
        try:
            tier._dir_fd = _open_directory(path)
            tier._take_lock()
            tier._probe_direct_io()
            tier._load()
        except OSError as e:
            tier._fail("opening it", e)
        return tier

    # -- the event loop's calls -------------------------------------------------------------------

    def leading(self, scope: bytes, keys: Sequence[bytes]) -> int:
        """How many of the leading keys are on disk (in memory; brief)."""
        found = 0
        with self._lock:
            index = self._index.get(scope) if self._stats.healthy and not self._closed else None
            if index:
                for key in keys:
                    if key not in index:
                        break
                    found += 1
            self._stats.hits += found
            self._stats.misses += len(keys) - found
        return found

    def admit(self, scope: bytes, keys: Sequence[bytes], length: int) -> list[int]:
        """Which of these blocks (`length` bytes each) to hand to `write`: those not on disk nor queued,
        while they fit in the write queue (the rest are dropped, counted). Reserves their room until
        `write` (or `cancel`) gets their keys. In memory; brief."""
        chosen: list[int] = []
        with self._lock:
            if not self._stats.healthy or self._closed:
                self._stats.write_dropped += len(keys)
                return chosen
            index = self._index.get(scope, {})
            for i, key in enumerate(keys):
                name = scope + key
                if key in index or name in self._queued:
                    continue
                if self._stats.queued_bytes + length > self.queue_bytes:
                    self._stats.write_dropped += 1
                    continue
                self._queued[name] = length
                self._stats.queued_bytes += length
                chosen.append(i)
        return chosen

    def cancel(self, scope: bytes, keys: Sequence[bytes]) -> None:
        """Release the queue room `admit` reserved for these keys (blocks that will not be written)."""
        with self._lock:
            for key in keys:
                self._stats.queued_bytes -= self._queued.pop(scope + key, 0)

    def unwritten(self, scope: bytes, key: bytes) -> None:
        """A block that will never be offered to `write` (evicted from the pool before its seal): a dropped
        write, unless the disk has its key already."""
        with self._lock:
            if key not in self._index.get(scope, ()):
                self._stats.write_dropped += 1

    def clear(self, scopes: Sequence[bytes] | None) -> dict[bytes, dict[bytes, int]]:
        """Drop the blocks of these namespaces (None: of every namespace): reads and lookups miss them from
        now on. Returns the keys dropped, by namespace. In memory; `save_catalog` makes it last across a
        restart (see Clear in the module docstring)."""
        with self._lock:
            at = self._position()
            if scopes is None:
                dropped, self._index = self._index, {}
                if dropped:
                    self._clear_all, self._clears = at, {}
            else:
                dropped = {scope: keys for scope in scopes if (keys := self._index.pop(scope, None))}
                for scope in dropped:  # (one without a block has no record to kill but those being written,
                    self._clears[scope] = at  # which the pool still holds: they stay, on disk too)
            if dropped:
                self._generation += 1
                self._marker_due = True
            return dropped

    def names(self) -> dict[bytes, str]:
        """The names of the namespaces with blocks on disk, where `write` was told them: scope -> name."""
        with self._lock:
            return dict(self._names)

    def stats(self) -> DiskStats:
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.blocks = sum(map(len, self._index.values()))
            s.bytes = sum(seg.size for seg in self._segments.values())
            s.segments = len(self._segments)
            s.direct_io = bool(self._direct)
        return s

    @property
    def healthy(self) -> bool:
        return self._stats.healthy

    # -- the worker threads' calls ----------------------------------------------------------------

    def write(self, scope: bytes, keys: Sequence[bytes], base: int, offsets: Sequence[int], length: int,
              crcs: Sequence[int], name: str = "") -> int:
        """Write the blocks at ``base + offsets[i]`` (``length`` bytes, CRC32C ``crcs[i]``) that are not
        on disk yet; blocking, for a worker thread (the blocks must not change until it returns).
        Returns how many it wrote; the others were on disk already or are dropped (counted): tier
        disabled, no space that could be reclaimed. Never raises for I/O failures (the tier disables
        itself); ValueError for malformed arguments. Releases the keys' `admit` reservations. `name`:
        the namespace's, saved in the catalog before its first record (see `names`)."""
        key_size = _check_batch(scope, keys, length, offsets, crcs)
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
                    self._stats.queued_bytes -= self._queued.pop(scope + key, 0)
                self._stats.written += written
                self._stats.write_bytes += written * length
                self._stats.write_dropped += dropped
                self._stats.write_seconds += time.perf_counter() - start
        return written

    def read(self, scope: bytes, keys: Sequence[bytes], base: int, offsets: Sequence[int],
             length: int) -> list[int | None]:
        """Read each key's block into ``base + offsets[i]`` and verify it; blocking, for a worker thread.
        Returns each block's CRC32C (verified), or None: not on disk (or not of this length), corrupt
        (dropped, counted), or the tier failed. Never raises for I/O failures; ValueError for
        malformed arguments."""
        key_size = _check_batch(scope, keys, length, offsets)
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

    def save_catalog(self) -> None:
        """Write the catalog (clears, names) if it changed, flushed, then a clear's marker into the active
        segment: a clear lasts from when this returns. Blocking, for a worker thread (it waits for a write
        under way). Never raises for I/O failures (the tier disables itself)."""
        try:
            self._write_catalog()
            with self._write_lock:
                if self._usable():
                    self._write_marker()
        except OSError as e:
            self._fail("writing the catalog", e)

    def close(self) -> None:
        """Seal the active segment (footer and index checkpoint) and release the directory. No
        `write`/`read` may run meanwhile; after it they find nothing."""
        with self._write_lock:
            if self._closed:
                return
            try:
                if self._stats.healthy:
                    self._write_catalog()
                    self._write_marker()
                if self._active is not None and self._stats.healthy:
                    self._seal_active()
                if self._stats.healthy:
                    self._write_catalog()  # (the clears that no segment needs any more left out)
                    self._flush()
            except OSError as e:
                self._fail("closing it", e)
            finally:
                with self._catalog_lock, self._lock:  # (a catalog write under way has finished)
                    self._closed = True
                if self._active_fd >= 0:
                    os.close(self._active_fd)
                    self._active_fd = -1
                for fd in (self._lock_fd, self._dir_fd):
                    if fd >= 0:
                        os.close(fd)
                self._lock_fd = self._dir_fd = -1
                self._block.close()

    # -- opening ----------------------------------------------------------------------------------

    def _take_lock(self) -> None:
        self._lock_fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                dir_fd=self._dir_fd)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise DiskDirectoryError(f"disk tier directory {self.path} is in use by another kvstore daemon: "
                                     "give each daemon its own --disk-path") from None

    def _probe_direct_io(self) -> None:
        """Whether the file system takes O_DIRECT, and the memory alignment it needs (the smallest of
        256..4096 that works); without O_DIRECT the tier runs with buffered I/O (logged)."""
        try:
            fd = os.open(_PROBE_FILE, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT,
                         0o600, dir_fd=self._dir_fd)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.warning("disk tier %s: the file system does not support O_DIRECT; using buffered I/O (the page "
                        "cache will hold copies of the blocks)", self.path)
            self._mem_align = 1
            return
        buf = mmap.mmap(-1, 2 * ALIGN)
        try:
            for align in (256, 512, 1024, 2048, ALIGN):
                with memoryview(buf) as view:
                    try:
                        os.pwrite(fd, view[align:align + ALIGN], 0)
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        continue
                self._direct, self._mem_align = os.O_DIRECT, align
                return
            log.warning("disk tier %s: O_DIRECT writes fail here; using buffered I/O", self.path)
            self._mem_align = 1
        finally:
            buf.close()
            os.close(fd)
            os.unlink(_PROBE_FILE, dir_fd=self._dir_fd)

    def _load(self) -> None:
        names = os.listdir(self._dir_fd)
        seqs = sorted(int(m.group(1), 16) for name in names if (m := _SEGMENT_FILE.fullmatch(name)))
        for name in names:  # leftovers: temporary files, index files of reclaimed segments
            stale = name.endswith(".tmp") or (name.endswith(".idx") and name[:-4] + ".kvd" not in names)
            if stale and (name.startswith("seg-") or name == _CATALOG_FILE + ".tmp"):
                os.unlink(name, dir_fd=self._dir_fd)
        catalog = self._read_catalog()
        scanned = 0
        for seq in seqs:
            scanned += self._load_segment(seq)
        newest = max((seg.cleared for seg in self._segments.values()), default=0)
        doubt = ("is damaged" if catalog is False else f"is missing beside {len(seqs)} segment(s)"
                 if catalog is None and seqs else f"is older than the segments (it knows {self._generation} "
                 f"clear(s), they {newest})" if self._generation < newest else "")
        if doubt:  # a clear may be missing from it: drop every block there is, and stamp that clear too
            log.warning("disk tier %s: the catalog (clears, names) %s: every block on disk is dropped, lest a "
                        "cleared one come back", self.path, doubt)
            self._clear_all, self._clears, self._names, self._index = (seqs[-1] + 1 if seqs else 1, 0), {}, {}, {}
            for seg in self._segments.values():
                seg.keys = {}
            self._generation, self._marker_due = max(self._generation, newest) + 1, True
        # Past every clear's position too: a record written from now on must come after them all.
        self._next_seq = max([seqs[-1] + 1 if seqs else 1] + [at[0] + 1 for at in self._clears.values()]
                             + [self._clear_all[0] + 1])
        self._names = {scope: name for scope, name in self._names.items() if scope in self._index}
        while len(self._segments) >= self.max_segments and self._reclaim_oldest():
            pass  # a smaller --disk-size than last time: keep room for a new segment
        self._write_catalog()  # (a damaged one replaced now: else a crash would drop this run's blocks too)
        self._write_marker()
        free = os.statvfs(self._dir_fd)
        have = free.f_bavail * free.f_frsize + sum(s.size for s in self._segments.values())
        if have < self._stats.capacity_bytes:
            log.warning("disk tier %s: the file system has room for %d bytes of segments, fewer than the %d "
                        "configured: the tier will be disabled when the disk fills up", self.path, have,
                        self._stats.capacity_bytes)
        log.info("disk tier %s: %d blocks in %d segments (%d scanned), O_DIRECT %s", self.path,
                 sum(map(len, self._index.values())), len(self._segments), scanned,
                 f"with {self._mem_align}-byte memory alignment" if self._direct else "not used")

    def _load_segment(self, seq: int) -> int:
        """Index one segment from its checkpoint, or by a scan (then sealed, torn tail cut). Returns 1
        if it was scanned."""
        loaded = self._read_index(seq)
        scanned = loaded is None
        if loaded is None:
            entries, end, sealed, cleared = self._scan(seq)
            if not entries and not cleared:
                self._remove_files(seq)
                return 1
            if not sealed:
                log.info("disk tier %s: segment %d was not sealed; %d records kept, cut at byte %d", self.path, seq,
                         len(entries), end)
            fd = os.open(_segment_file(seq), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | self._direct,
                         dir_fd=self._dir_fd)
            try:
                packed = [_ENTRY.pack(off, n, crc, len(key), scope, key) for off, n, crc, scope, key in entries]
                self._seal(seq, fd, end, packed, not sealed, cleared)
            finally:
                os.close(fd)
        else:
            entries, end, cleared = loaded
        seg = _Segment(seq, end + ALIGN, sealed=True, cleared=cleared)
        for off, length, crc, scope, key in entries:
            if (seq, off) < max(self._clear_all, self._clears.get(scope, _NO_CLEAR)):
                continue  # written before a clear of its namespace
            self._index.setdefault(scope, {})[key] = _pack(seq, off, length, crc)  # a later segment's wins
            seg.keys.setdefault(scope, []).append(key)
        self._segments[seq] = seg
        return int(scanned)

    def _read_catalog(self) -> bool | None:
        """Take the clears, names and generation of the catalog: True; None if there is none, False if it
        fails its check (`_load` then drops every block: a clear must never be undone)."""
        try:
            fd = os.open(_CATALOG_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        catalog = _parse_catalog(data)
        if catalog is None:
            return False
        self._clear_all, self._clears, self._names, self._generation = catalog
        self._saved_generation = self._generation
        self._catalog_saved = data
        return True

    def _read_index(self, seq: int) -> tuple[list[Entry], int, int] | None:
        """A segment's entries, footer offset and newest clear marker from its index file, if that is valid
        and matches the segment's footer; else None."""
        try:
            fd = os.open(_index_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        if len(data) < _INDEX_HEADER.size + _CRC.size:
            return None
        magic, version, entry_bytes, got_seq, footer_at, records, entries_crc, cleared = \
            _INDEX_HEADER.unpack_from(data)
        body = memoryview(data)[_INDEX_HEADER.size:-_CRC.size]
        if (magic != _INDEX_MAGIC or version != _INDEX_VERSION or entry_bytes != _ENTRY.size or got_seq != seq
                or len(body) != records * _ENTRY.size or _CRC.unpack_from(data, len(data) - _CRC.size)[0]
                != native.crc32c(memoryview(data)[:-_CRC.size]) or native.crc32c(body) != entries_crc):
            return None
        fd = os.open(_segment_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        try:
            block = os.pread(fd, ALIGN, footer_at)
        finally:
            os.close(fd)
        if len(block) < _FOOTER.size or _parse_footer(block) != (seq, footer_at, records, entries_crc):
            return None
        entries = [(off, n, crc, scope, key[:key_len])
                   for off, n, crc, key_len, scope, key in _ENTRY.iter_unpack(body)]
        return entries, footer_at, cleared

    def _scan(self, seq: int) -> tuple[list[Entry], int, bool, int]:
        """The records of a segment read from their headers: (entries, where they end, sealed, the
        generation of its newest clear marker)."""
        fd = os.open(_segment_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        entries: list[Entry] = []
        off = cleared = 0
        try:
            file_size = os.fstat(fd).st_size
            while off + ALIGN <= file_size:
                block = os.pread(fd, ALIGN, off)
                header = native.disk_parse_header(block) if len(block) == ALIGN else None
                if header is None:
                    marker = _parse_footer(block, _KIND_CLEAR) if len(block) == ALIGN else None
                    if marker is not None and marker[:2] == (seq, off):
                        cleared = max(cleared, marker[2])
                        off += ALIGN
                        continue
                    footer = _parse_footer(block) if len(block) == ALIGN else None
                    return entries, off, footer is not None and footer[:2] == (seq, off), cleared
                _, got_seq, at, length, crc, scope, key = header
                end = off + ALIGN + _pad(length)
                if got_seq != seq or at != off or end > file_size:
                    break
                entries.append((off, length, crc, scope, key))
                off = end
        finally:
            os.close(fd)
        return entries, off, False, cleared

    # -- writing ----------------------------------------------------------------------------------

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
        record = ALIGN + _pad(length)
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

    def _room(self, record: int) -> _Segment | None:
        """The active segment with room for one more record: a new one when it is full (sealing the old
        one and reclaiming the oldest segment if the tier is full), or None if none can be reclaimed."""
        seg = self._active
        if seg is not None and seg.size + record <= self.segment_bytes - ALIGN:
            return seg
        if seg is not None:
            self._seal_active()
        while len(self._segments) >= self.max_segments:
            if not self._reclaim_oldest():
                return None
        seq = self._next_seq
        fd = os.open(_segment_file(seq), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                     | self._direct, 0o600, dir_fd=self._dir_fd)
        try:
            os.posix_fallocate(fd, 0, self.segment_bytes)  # no space: fails here, not mid-record
        except OSError as e:
            os.close(fd)
            os.unlink(_segment_file(seq), dir_fd=self._dir_fd)
            raise OSError(e.errno, e.strerror, os.path.join(self.path, _segment_file(seq))) from e
        seg = _Segment(seq)
        with self._lock:  # (together, for _position)
            self._segments[seq] = seg
            self._active, self._next_seq = seg, seq + 1
        self._active_fd, self._active_entries = fd, []
        return seg

    def _write_records(self, seg: _Segment, scope: bytes, keys: Sequence[bytes], key_size: int, chosen: list[int],
                       base: int, offsets: Sequence[int], length: int, crcs: Sequence[int]) -> int:
        """Append these blocks to the active segment (one native call); index the ones written. An
        OSError for the first that failed."""
        n, record = len(chosen), ALIGN + _pad(length)
        with self._lock:  # (for _position: a clear from now on comes after these records)
            at = [seg.size + k * record for k in range(n)]
            seg.size += n * record
        sums = [crcs[i] for i in chosen]
        results = native.disk_write([self._active_fd] * n, at, [seg.seq] * n, base, [offsets[i] for i in chosen],
                                    length, sums, scope, b"".join([keys[i] for i in chosen]), key_size,
                                    self.threads, self._mode, self._mem_align)
        done = [k for k, rc in enumerate(results) if rc == 0]
        self._active_entries.extend(_ENTRY.pack(at[k], length, sums[k], key_size, scope, keys[chosen[k]])
                                    for k in done)
        with self._lock:
            cleared = max(self._clear_all, self._clears.get(scope, _NO_CLEAR))
            live = [k for k in done if (seg.seq, at[k]) >= cleared]  # (the others: a clear came meanwhile)
            index = self._index.setdefault(scope, {}) if live else {}
            seg_keys = seg.keys.setdefault(scope, []) if live else []
            for k in live:
                key = keys[chosen[k]]
                index[key] = _pack(seg.seq, at[k], length, sums[k])
                seg_keys.append(key)
        failed = next((rc for rc in results if rc != 0), 0)
        if failed:
            raise OSError(-failed, os.strerror(-failed), os.path.join(self.path, _segment_file(seg.seq)))
        return len(done)

    def _seal_active(self) -> None:
        seg, fd = self._active, self._active_fd
        assert seg is not None
        with self._lock:
            self._active = None
        self._active_fd = -1
        try:
            if self._active_entries or seg.cleared:
                self._seal(seg.seq, fd, seg.size, self._active_entries, True, seg.cleared)
                seg.size += ALIGN
                seg.sealed = True
        finally:
            os.close(fd)
        if not self._active_entries and not seg.cleared:  # nothing written to it
            with self._lock:
                del self._segments[seg.seq]
            self._remove_files(seg.seq)
        self._active_entries = []

    def _seal(self, seq: int, fd: int, end: int, packed: list[bytes], write_footer: bool, cleared: int) -> None:
        """Footer at `end` (unless one is there), the file cut after it, and the index checkpoint (with
        the segment's newest clear marker)."""
        entries = b"".join(packed)
        entries_crc = native.crc32c(entries)
        if write_footer:
            self._block[:] = _footer_block(_KIND_FOOTER, seq, end, len(packed), entries_crc)
            if os.pwrite(fd, self._block, end) != ALIGN:
                raise OSError(errno.EIO, "short write of a segment footer", _segment_file(seq))
        os.ftruncate(fd, end + ALIGN)
        self._unsynced.append(seq)  # flushed at close (not here: a flush costs as much as writing the segment)
        header = _INDEX_HEADER.pack(_INDEX_MAGIC, _INDEX_VERSION, _ENTRY.size, seq, end, len(packed), entries_crc,
                                    cleared)
        data = header + entries
        data += _CRC.pack(native.crc32c(data))
        tmp = _index_file(seq) + ".tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=self._dir_fd)
        with os.fdopen(out, "wb") as f:
            f.write(data)
        os.replace(tmp, _index_file(seq), src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def _write_marker(self) -> None:
        """A clear's marker (the generation of the catalog as saved) into the active segment, flushed: from
        then on a catalog older than it is known for one (see Clear in the module docstring). Under the
        write lock; left for the next write if no segment has room."""
        with self._lock:
            if not self._marker_due:
                return
            generation = self._saved_generation
        seg = self._room(ALIGN)
        if seg is None:
            return
        with self._lock:
            at = seg.size
            seg.size += ALIGN
            self._marker_due = generation < self._generation
        self._block[:] = _footer_block(_KIND_CLEAR, seg.seq, at, generation, 0)
        if os.pwrite(self._active_fd, self._block, at) != ALIGN:
            raise OSError(errno.EIO, "short write of a clear marker", _segment_file(seg.seq))
        os.fdatasync(self._active_fd)
        seg.cleared = generation

    def _position(self) -> Position:
        """Where the next record goes (under the lock): every record before it was placed before now."""
        seg = self._active
        return (seg.seq, seg.size) if seg is not None else (self._next_seq, 0)

    def _name(self, scope: bytes, name: str) -> None:
        """Save a namespace's name in the catalog (before its first record is written)."""
        with self._lock:
            if self._names.get(scope) == name:
                return
            self._names[scope] = name
        self._write_catalog()

    def _catalog(self) -> bytes:
        """The catalog as it is now (under the lock), without the clears no segment is left for."""
        oldest = min(self._segments, default=None)
        if oldest is None or oldest > self._clear_all[0]:
            self._clear_all = _NO_CLEAR
        self._clears = {scope: at for scope, at in self._clears.items() if oldest is not None and oldest <= at[0]}
        scopes = sorted(self._clears.keys() | self._names.keys())
        parts = [_CATALOG_HEADER.pack(_CATALOG_MAGIC, _CATALOG_VERSION, len(scopes), *self._clear_all,
                                      self._generation)]
        for scope in scopes:
            name = self._names.get(scope, "").encode()
            parts += [_CATALOG_ENTRY.pack(scope, *self._clears.get(scope, _NO_CLEAR), len(name)), name]
        data = b"".join(parts)
        return data + _CRC.pack(native.crc32c(data))

    def _write_catalog(self) -> None:
        """Replace the catalog file if the catalog changed: atomically, flushed (a clear must last)."""
        with self._catalog_lock:
            with self._lock:
                if self._closed or self._dir_fd < 0:
                    return
                data = self._catalog()
                generation = self._generation
            if data == self._catalog_saved:
                return
            tmp = _CATALOG_FILE + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self._dir_fd)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, _CATALOG_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            os.fsync(self._dir_fd)
            self._catalog_saved = data
            self._saved_generation = generation

    def _flush(self) -> None:
        """Make the segments sealed since open and their index files durable (the device's write cache)."""
        for seq in self._unsynced:
            if seq not in self._segments:
                continue  # reclaimed since
            for name in (_segment_file(seq), _index_file(seq)):
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
                    if value is not None and value >> _SEQ_SHIFT == victim.seq:
                        del index[key]  # type: ignore[union-attr]
                if index is not None and not index:
                    del self._index[scope]
            self._stats.reclaimed_segments += 1
        self._remove_files(victim.seq)
        return True

    def _remove_files(self, seq: int) -> None:
        for name in (_index_file(seq), _segment_file(seq)):
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass

    # -- reading ----------------------------------------------------------------------------------

    def _start_read(self, scope: bytes, keys: Sequence[bytes], length: int) -> list[tuple[int, int]]:
        """(i, location) of the keys on disk with blocks of this length; their segments pinned."""
        plan: list[tuple[int, int]] = []
        with self._lock:
            index = self._index.get(scope, {})
            for i, key in enumerate(keys):
                value = index.get(key)
                if value is not None and _unpack(value)[2] == length:
                    plan.append((i, value))
            for seq in {value >> _SEQ_SHIFT for _, value in plan}:
                self._segments[seq].readers += 1
        return plan

    def _read_records(self, scope: bytes, keys: Sequence[bytes], key_size: int, plan: list[tuple[int, int]],
                      base: int, offsets: Sequence[int], length: int) -> list[int]:
        fds: dict[int, int] = {}
        try:
            for seq in sorted({value >> _SEQ_SHIFT for _, value in plan}):
                fds[seq] = os.open(_segment_file(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | self._direct,
                                   dir_fd=self._dir_fd)
            where = [_unpack(value) for _, value in plan]
            return native.disk_read([fds[seq] for seq, _, _, _ in where], [off for _, off, _, _ in where],
                                    [seq for seq, _, _, _ in where], base, [offsets[i] for i, _ in plan], length,
                                    [crc for _, _, _, crc in where], scope, b"".join([keys[i] for i, _ in plan]),
                                    key_size, self.threads, self._mode, self._mem_align)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _finish_read(self, scope: bytes, keys: Sequence[bytes], length: int, plan: list[tuple[int, int]],
                     results: list[int] | None, out: list[int | None], seconds: float) -> None:
        """Unpin the segments; fill `out`; drop and count corrupt records; an I/O error disables."""
        corrupt = 0
        failed = 0
        with self._lock:
            for seq in {value >> _SEQ_SHIFT for _, value in plan}:
                self._segments[seq].readers -= 1
            index = self._index.get(scope, {})
            for (i, value), rc in zip(plan, results or (), strict=False):
                if rc == 0:
                    out[i] = value & 0xFFFFFFFF
                elif rc > 0:
                    corrupt += 1
                    if index.get(keys[i]) == value:
                        del index[keys[i]]
                else:
                    failed = failed or rc
            done = sum(v is not None for v in out)
            self._stats.read_blocks += done
            self._stats.read_bytes += done * length
            self._stats.corrupt += corrupt
            self._stats.read_seconds += seconds
        if corrupt:
            log.warning("disk tier %s: %d block(s) failed verification at a read and were dropped", self.path, corrupt)
        if failed:
            self._fail("a read", OSError(-failed, os.strerror(-failed), self.path))

    # -- faults -----------------------------------------------------------------------------------

    def _usable(self) -> bool:
        return self._stats.healthy and not self._closed

    def _fail(self, what: str, exc: OSError) -> None:
        """Disable the tier for good (the first failure is logged; later ones only counted)."""
        code = errno.errorcode.get(exc.errno or 0, "error")
        where = f" ({exc.filename})" if exc.filename else ""
        with self._lock:
            self._stats.errors += 1
            if not self._stats.healthy or self._closed:
                return
            self._stats.healthy = False
            self._stats.error = (f"{what} failed: {exc.strerror or exc} [{code}]{where}; the disk tier is disabled "
                                 "until the daemon restarts (the pool keeps serving)")
        log.error("disk tier %s: %s", self.path, self._stats.error)


def _parse_catalog(data: bytes) -> tuple[Position, dict[bytes, Position], dict[bytes, str], int] | None:
    """(the last clear of everything, clears by scope, names by scope, generation) of a valid catalog, else
    None."""
    if len(data) < _CATALOG_HEADER.size + _CRC.size or _CRC.unpack_from(data, len(data) - _CRC.size)[0] != \
            native.crc32c(memoryview(data)[:-_CRC.size]):
        return None
    magic, version, count, all_seq, all_off, generation = _CATALOG_HEADER.unpack_from(data)
    if magic != _CATALOG_MAGIC or version != _CATALOG_VERSION:
        return None
    clears: dict[bytes, Position] = {}
    names: dict[bytes, str] = {}
    at = _CATALOG_HEADER.size
    try:
        for _ in range(count):
            scope, seq, off, name_len = _CATALOG_ENTRY.unpack_from(data, at)
            at += _CATALOG_ENTRY.size + name_len
            if (seq, off) != _NO_CLEAR:
                clears[scope] = (seq, off)
            if name_len:
                names[scope] = data[at - name_len:at].decode()
    except (struct.error, UnicodeDecodeError):
        return None
    return ((all_seq, all_off), clears, names, generation) if at == len(data) - _CRC.size else None


def _check_batch(scope: bytes, keys: Sequence[bytes], length: int, offsets: Sequence[int],
                 crcs: Sequence[int] | None = None) -> int:
    """The keys' common length, after checking the arguments' shapes (ValueError: a caller's bug)."""
    if len(scope) != SCOPE_BYTES:
        raise ValueError(f"scope must be {SCOPE_BYTES} bytes (got {len(scope)})")
    if len(offsets) != len(keys) or (crcs is not None and len(crcs) != len(keys)):
        raise ValueError(f"{len(keys)} keys but {len(offsets)} offsets" + (f" and {len(crcs)} crcs" if crcs else ""))
    if length < 1:
        raise ValueError(f"block length must be positive (got {length})")
    key_size = len(keys[0]) if keys else 1
    if not 1 <= key_size <= MAX_KEY or any(len(key) != key_size for key in keys):
        raise ValueError(f"keys must all have one length of 1..{MAX_KEY} bytes")
    return key_size
