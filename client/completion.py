"""The session's shared-memory completion channel: how a client learns that jobs finished, with no RPC.

The client creates the file and names it at registration; the daemon maps it and, when job `j`
finishes, writes into slot `j % slots`: first the block counts, then `seq = j + 1`. A reader that
sees `seq == j + 1` knows job `j` is done (x86-64 keeps stores in order; the daemon writes each
slot from one thread). A client never has more than `slots` unfinished jobs, so a slot is reused
only after its job was seen.

    header (64 bytes): magic "KVSDONE1", u32 version, u32 slots
    slot i (16 bytes): u64 seq, u32 blocks_ok, u32 blocks_failed
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

MAGIC = b"KVSDONE1"
VERSION = 1
HEADER = struct.Struct("<8sII")
HEADER_BYTES = 64
SLOT = struct.Struct("<QII")


@dataclass(frozen=True, slots=True)
class Completion:
    job_id: int
    blocks_ok: int
    blocks_failed: int

    @property
    def ok(self) -> bool:
        return self.blocks_failed == 0


def channel_bytes(slots: int) -> int:
    return HEADER_BYTES + SLOT.size * slots


class CompletionChannel:
    def __init__(self, path: str, slots: int, create: bool) -> None:
        self.path = path
        self.slots = slots
        size = channel_bytes(slots)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"completion file {path} is smaller than {slots} slots")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if create:
            HEADER.pack_into(self._mm, 0, MAGIC, VERSION, slots)
        else:
            magic, version, file_slots = HEADER.unpack_from(self._mm, 0)
            if magic != MAGIC or version != VERSION or file_slots != slots:
                self._mm.close()
                raise ValueError(f"{path} is not a version-{VERSION} completion channel of {slots} slots")

    def _offset(self, job_id: int) -> int:
        return HEADER_BYTES + SLOT.size * (job_id % self.slots)

    def post(self, job_id: int, blocks_ok: int, blocks_failed: int) -> None:
        """Daemon side: publish a finished job (counts first, the sequence word last)."""
        offset = self._offset(job_id)
        struct.pack_into("<II", self._mm, offset + 8, blocks_ok, blocks_failed)
        struct.pack_into("<Q", self._mm, offset, job_id + 1)

    def check(self, job_id: int) -> Completion | None:
        """Client side: the completion of `job_id`, or None while it runs."""
        seq, blocks_ok, blocks_failed = SLOT.unpack_from(self._mm, self._offset(job_id))
        if seq != job_id + 1:
            return None
        return Completion(job_id, blocks_ok, blocks_failed)

    def close(self) -> None:
        self._mm.close()
