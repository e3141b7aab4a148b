"""The block descriptions, kept in a file beside the pool so that a restarted daemon announces the blocks
it recovers (pool and disk) to routers at once, not when an engine next stores them (events.py).

The file is a header, then records appended as engines describe blocks: (namespace hash, key,
description). Removals are not written: `rewrite` replaces the file with the descriptions still held once
it has grown past twice their bytes (and JOURNAL_SLACK), so it stays within about twice --max-event-bytes.
It is written on the event loop with plain writes (a tmpfs file beside the pool: no flush to a disk), and
never fsynced: a daemon killed mid-write leaves a cut record, where `read` stops. A file that is not ours
(another header, another uid's or writable by others, as the pool file: in a world-writable /dev/shm it
could carry forged descriptions), or larger than `max_bytes`, is ignored, and a write that fails turns the
journal off (logged once): announcements then wait for engines, as without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import struct
from collections.abc import Iterable, Iterator

from kvstore_service.config import Config

log = logging.getLogger(__name__)

HEADER = b"KVSEVJ1\n"
_RECORD = struct.Struct("<16sBI")  # namespace hash, key length, description length
JOURNAL_SLACK = 1 << 20  # bytes a journal may grow past twice its live descriptions before a rewrite
MAX_KEY = 64

Entry = tuple[bytes, bytes, bytes]  # (namespace hash, key, description)


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
    return b"".join(_RECORD.pack(ns, len(key), len(meta)) + key + meta for ns, key, meta in entries)


class Journal:
    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes  # a file larger than this is not read
        self.size = 0
        self._fd = -1

    def read(self, max_description_bytes: int) -> Iterator[Entry]:
        """The records of the file left by the previous daemon, up to the first cut or invalid one."""
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
            if st.st_size > self.max_bytes:
                log.warning("block descriptions %s: %d bytes, over %d: not read", self.path, st.st_size,
                            self.max_bytes)
                return
            data = f.read()
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
            self._write(encode(entries))

    def rewrite(self, entries: Iterable[Entry]) -> None:
        """Replace the file with these entries (the descriptions held now); the journal is on from here."""
        tmp = f"{self.path}.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):  # (one a kill left; created anew: never someone else's)
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                data = HEADER + encode(entries)
                _write_all(fd, data)
                os.replace(tmp, self.path)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            self._off("rewriting", e)
            return
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.size = fd, len(data)

    def due(self, live_bytes: int) -> bool:
        """Whether the file has grown enough past the descriptions held (`live_bytes`) to be rewritten."""
        return self._fd >= 0 and self.size > 2 * live_bytes + JOURNAL_SLACK

    def close(self) -> None:
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # (a write to tmpfs is whole; a disk's may be short)
        view = view[os.write(fd, view):]
