"""What a restart of the disk tier needs besides the segments: the clears (as positions), the namespaces'
names and the generation (how many clears there have been). Its bytes: docs/formats.md ("Disk tier").

A clear is recorded as a position, the (segment, offset) where the next record would go: a record of
that namespace before it was written before the clear and is dead. Positions only grow (segments are
numbered in write order, records appended), so one position per namespace (and one for a clear of
everything) says it all, whatever the checkpoints and scans find later. A clear's position is dropped
once no segment at or before it is left (reclaimed): it can match nothing.

The in-memory state is guarded by the tier's lock (the caller holds it); `lock` is this catalog's own,
held while its file is written (one write at a time), taken before the tier's.
"""

from __future__ import annotations

import os
import threading

from kvstore_service.tiers.disk.format import CATALOG_FILE, NO_CLEAR, Position, encode_catalog, parse_catalog


class Catalog:
    def __init__(self) -> None:
        self.clear_all: Position = NO_CLEAR  # records before it are dead
        self.clears: dict[bytes, Position] = {}  # scope -> records of it before this are dead
        self.names: dict[bytes, str] = {}  # scope -> the namespace's name, as given to write
        # Clears so far: stamped into the catalog and, as a clear marker, into the active segment, so that a
        # catalog older than the segments (restored from before a clear) shows.
        self.generation = 0
        self.saved_generation = 0  # the catalog file's
        self.marker_due = False  # a clear's marker is still to be written
        self.lock = threading.Lock()  # one catalog file write at a time
        self.saved = b""  # the catalog as last written

    def cleared(self, scope: bytes) -> Position:
        """The records of this namespace before this position are dead."""
        return max(self.clear_all, self.clears.get(scope, NO_CLEAR))

    def record_clear(self, scopes: list[bytes] | None, at: Position) -> None:
        """These namespaces (None: every one) were cleared at `at` (the next record's position)."""
        if scopes is None:
            self.clear_all, self.clears = at, {}
        else:
            for scope in scopes:
                self.clears[scope] = at
        self.generation += 1
        self.marker_due = True

    def name(self, scope: bytes, name: str) -> bool:
        """Keep a namespace's name; whether it is new (the file is then to be written)."""
        if self.names.get(scope) == name:
            return False
        self.names[scope] = name
        return True

    def encode(self, oldest: int | None) -> bytes:
        """The catalog as it is now, without the clears no segment is left for (`oldest`: the oldest
        segment's number, None if there is none)."""
        if oldest is None or oldest > self.clear_all[0]:
            self.clear_all = NO_CLEAR
        self.clears = {scope: at for scope, at in self.clears.items() if oldest is not None and oldest <= at[0]}
        return encode_catalog(self.clear_all, self.clears, self.names, self.generation)

    def read(self, dir_fd: int) -> bool | None:
        """Take the clears, names and generation of the catalog file: True; None if there is none, False if
        it fails its check (the tier then drops every block: a clear must never be undone)."""
        try:
            fd = os.open(CATALOG_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        catalog = parse_catalog(data)
        if catalog is None:
            return False
        self.clear_all, self.clears, self.names, self.generation = catalog
        self.saved_generation = self.generation
        self.saved = data
        return True

    def save(self, dir_fd: int, data: bytes, generation: int) -> None:
        """Replace the catalog file with `data` if it changed: atomically, flushed (a clear must last).
        Under `lock`."""
        if data == self.saved:
            return
        tmp = CATALOG_FILE + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, CATALOG_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
        self.saved = data
        self.saved_generation = generation
