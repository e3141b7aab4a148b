"""The block descriptions, kept in a file beside the pool so that a restarted daemon announces the blocks
it recovers (pool and disk) to routers at once, not when an engine next stores them (events.py).

The file is a header, then records appended as engines describe blocks: (namespace hash, key,
description). Removals are not written: `rewrite` replaces the file with the descriptions still held once
it has grown past twice their bytes (and JOURNAL_SLACK), so it stays within about twice --max-event-bytes.
Appends are written on the event loop with plain writes (a tmpfs file beside the pool: no flush to a disk).
A rewrite runs on the journal thread (threads.py): it reads the file back and keeps the records whose
description is still held (asking the loop's maps one key at a time, never iterating them), then the loop
puts the new file in place with what was appended meanwhile. Nothing is fsynced: a daemon killed
mid-write leaves a cut record, where `read` stops (or a temp file, replaced by the next rewrite). A file
that is not ours (another header, another uid's or writable by others, as the pool file: in a
world-writable /dev/shm it could carry forged descriptions), or larger than `max_bytes`, is ignored, and a
write that fails turns the journal off (logged once): announcements then wait for engines, as without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator

from kvstore_service.config import Config

log = logging.getLogger(__name__)

HEADER = b"KVSEVJ1\n"
_RECORD = struct.Struct("<16sBI")  # namespace hash, key length, description length
JOURNAL_SLACK = 1 << 20  # bytes a journal may grow past twice its live descriptions before a rewrite
# A rewrite writes its records this many at a time: the thread never holds the GIL for a whole file's
# encoding (one 230k-record join held it ~30 ms; the loop waits for the GIL meanwhile). What it keeps
# meanwhile is bytes, which the collector does not track: tuples kept that long set off full
# collections (~35 ms each, in the GIL).
REWRITE_BATCH = 4096
MAX_KEY = 64

Entry = tuple[bytes, bytes, bytes]  # (namespace hash, key, description)
Written = tuple[int, int] | OSError  # a rewrite's new file (its descriptor, its bytes), or why there is none
Holds = Callable[[bytes, bytes, bytes], bool]  # whether (namespace hash, key, description) is still held


def journal_of(config: Config) -> Journal | None:
    """Where the block descriptions are kept across restarts (--event-journal); a fresh pool starts without."""
    if config.event_journal == "off":
        return None
    path = config.event_journal or f"{config.pool_path}.events"
    if config.fresh:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return Journal(path, 2 * int(config.max_event_bytes) + 2 * JOURNAL_SLACK)


def encode(entries: Iterable[Entry]) -> bytes:
    return b"".join(_record(ns, key, meta) for ns, key, meta in entries)


def _record(ns: bytes, key: bytes, meta: bytes) -> bytes:
    return _RECORD.pack(ns, len(key), len(meta)) + key + meta


class Journal:
    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes  # a file larger than this is not read
        self.size = 0
        self._fd = -1
        self._since: list[bytes] | None = None  # what was appended while a rewrite is under way
        self._closed = False  # closed (the daemon stops) or turned off: a rewrite under way is dropped

    def read(self, max_description_bytes: int, upto: int | None = None) -> Iterator[Entry]:
        """The file's records (at start, the previous daemon's: all of it, if not over max_bytes; in a rewrite,
        its first `upto` bytes), up to the first cut or invalid one."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("block descriptions %s not read (%s): recovered blocks are announced when stored again",
                        self.path, e)
            return
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                log.warning("block descriptions %s: not a private file of the daemon's uid; not read", self.path)
                return
            if upto is None and st.st_size > self.max_bytes:  # (a rewrite reads its own file's first `upto` bytes)
                log.warning("block descriptions %s: %d bytes, over %d: not read", self.path, st.st_size,
                            self.max_bytes)
                return
            data = f.read(-1 if upto is None else upto)
        if not data.startswith(HEADER):
            if data:
                log.warning("block descriptions %s: not a journal of ours; not read", self.path)
            return
        at = len(HEADER)
        while at + _RECORD.size <= len(data):
            ns, key_len, meta_len = _RECORD.unpack_from(data, at)
            start = at + _RECORD.size
            end = start + key_len + meta_len
            if not 0 < key_len <= MAX_KEY or meta_len > max_description_bytes or end > len(data):
                break  # (cut by a kill mid-write, or damaged: what follows is not trusted)
            yield ns, data[start:start + key_len], data[start + key_len:end]
            at = end
        if at != len(data):
            log.warning("block descriptions %s: %d bytes after the last whole record ignored", self.path,
                        len(data) - at)

    def append(self, entries: Iterable[Entry]) -> None:
        if self._fd >= 0:
            data = encode(entries)
            self._write(data)
            if self._since is not None:
                self._since.append(data)

    def rewrite(self, entries: Iterable[Entry], holds: Holds) -> None:
        """The file replaced by these of its entries still held, here and now (at start: the entries
        `restore` read); the journal is on from here."""
        self.begin_rewrite()
        self.install(self.write_new(entries, holds))

    def begin_rewrite(self) -> None:
        """A rewrite starts (on the loop): what is appended from now on also goes into the new file."""
        self._since = []

    def write_new(self, entries: Iterable[Entry], holds: Holds) -> Written:
        """The journal thread: these entries (the file's, `read` up to its size at begin_rewrite) whose
        description `holds` still holds, each block once, written to a new temp file beside the journal.
        Touches nothing the loop writes; `holds` only looks keys up."""
        seen: set[bytes] = set()  # (namespace hash + key: bytes, which the collector does not track)
        tmp = f"{self.path}.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):  # (one a kill left; created anew: never someone else's)
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, HEADER)
                size, batch = len(HEADER), []  # (records as bytes, which the collector does not track either)
                for ns, key, meta in entries:
                    if ns + key not in seen and holds(ns, key, meta):
                        seen.add(ns + key)
                        batch.append(_record(ns, key, meta))
                    if len(batch) == REWRITE_BATCH:
                        size += _write_all(fd, b"".join(batch))
                        batch.clear()
                size += _write_all(fd, b"".join(batch))
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            return e
        return fd, size

    def install(self, written: Written) -> None:
        """On the loop: the new file (write_new's) takes the journal's place, with what was appended since
        begin_rewrite; the journal is on from here."""
        since, self._since = self._since or [], None
        if isinstance(written, OSError):
            self._off("rewriting", written)
            return
        fd, size = written
        if self._closed:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(f"{self.path}.tmp")
            return
        try:
            data = b"".join(since)
            _write_all(fd, data)
            os.replace(f"{self.path}.tmp", self.path)
        except OSError as e:
            os.close(fd)
            self._off("rewriting", e)
            return
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.size = fd, size + len(data)

    @property
    def rewriting(self) -> bool:
        return self._since is not None

    def due(self, live_bytes: int) -> bool:
        """Whether the file has grown enough past the descriptions held (`live_bytes`) to be rewritten."""
        return self._fd >= 0 and self.size > 2 * live_bytes + JOURNAL_SLACK

    def close(self) -> None:
        self._closed = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write(self, data: bytes) -> None:
        try:
            _write_all(self._fd, data)
            self.size += len(data)
        except OSError as e:
            self._off("writing", e)

    def _off(self, what: str, e: OSError) -> None:
        log.error("block descriptions %s: %s failed (%s); no longer kept for a restart (--event-journal names "
                  "another file, 'off' none)", self.path, what, e)
        self.close()


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:  # (a write to tmpfs is whole; a disk's may be short)
        view = view[os.write(fd, view):]
    return len(data)
