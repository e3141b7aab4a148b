"""The session's shared-memory completion channel: how a client learns that jobs finished, with no RPC.

The client creates it (a sealed memfd, passed at registration); the daemon maps it and, when job `j`
finishes, writes into slot `j % slots`: first the block counts, then `seq = j + 1`. A reader that
sees `seq == j + 1` knows job `j` is done (x86-64 keeps stores in order; the daemon writes each
slot from one thread). A client never has more than `slots` unfinished jobs, so a slot is reused
only after its job was seen.

A load copied region by region (RegisterResponse.progress_load_bytes) also writes, while it copies,
`progress = (j + 1) << 16 | regions landed` (the job id tags it: a slot's last job left its own).

    header (64 bytes): magic "KVSDONE1", u32 version, u32 slots
    slot i (24 bytes): u64 seq, u32 blocks_ok, u32 blocks_failed, u64 progress
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass

from kvstore_client.protocol import memfd

MAGIC = b"KVSDONE1"
VERSION = 2
HEADER = struct.Struct("<8sII")
HEADER_BYTES = 64
SLOT = struct.Struct("<QIIQ")
PROGRESS = struct.Struct("<Q")
PROGRESS_BITS = 16  # regions landed, below the job's tag
MAX_PROGRESS = (1 << PROGRESS_BITS) - 1
_TAG_MASK = (1 << (64 - PROGRESS_BITS)) - 1


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
    """Created by the client (`create`), mapped by the daemon from the descriptor (`attach`)."""

    def __init__(self, fd: int, slots: int, mm: mmap.mmap) -> None:
        self.fd = fd
        self.slots = slots
        self._mm = mm

    @classmethod
    def create(cls, slots: int) -> CompletionChannel:
        fd = memfd.create("kvstore-done", channel_bytes(slots))
        mm = mmap.mmap(fd, channel_bytes(slots), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        HEADER.pack_into(mm, 0, MAGIC, VERSION, slots)
        return cls(fd, slots, mm)

    @classmethod
    def attach(cls, fd: int, slots: int) -> CompletionChannel:
        """Daemon side: map a client's channel; it must be sealed (see memfd.py). Takes the fd."""
        try:
            memfd.check_sealed(fd, channel_bytes(slots), "the completion channel")
            mm = mmap.mmap(fd, channel_bytes(slots), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, file_slots = HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION or file_slots != slots:
            mm.close()
            raise ValueError(f"not a version-{VERSION} completion channel of {slots} slots")
        return cls(-1, slots, mm)

    def _offset(self, job_id: int) -> int:
        return HEADER_BYTES + SLOT.size * (job_id % self.slots)

    def post(self, job_id: int, blocks_ok: int, blocks_failed: int) -> None:
        """Daemon side: publish a finished job (counts first, the sequence word last)."""
        offset = self._offset(job_id)
        struct.pack_into("<II", self._mm, offset + 8, blocks_ok, blocks_failed)
        struct.pack_into("<Q", self._mm, offset, job_id + 1)

    def post_progress(self, job_id: int, regions: int) -> None:
        """Daemon side: the first `regions` regions of a load job have landed."""
        tag = (job_id + 1) & _TAG_MASK
        PROGRESS.pack_into(self._mm, self._offset(job_id) + 16, tag << PROGRESS_BITS | min(regions, MAX_PROGRESS))

    def progress_target(self, job_id: int) -> tuple[int, int]:
        """Daemon side, for a copy that posts a load's progress itself: the address of the job's
        progress word (valid while the channel is open) and the word with no region landed."""
        anchor = ctypes.c_char.from_buffer(self._mm)  # (an export of the mapping: released right away)
        address = ctypes.addressof(anchor) + self._offset(job_id) + 16
        del anchor
        return address, ((job_id + 1) & _TAG_MASK) << PROGRESS_BITS

    def check(self, job_id: int) -> Completion | None:
        """Client side: the completion of `job_id`, or None while it runs."""
        seq, blocks_ok, blocks_failed, _ = SLOT.unpack_from(self._mm, self._offset(job_id))
        if seq != job_id + 1:
            return None
        return Completion(job_id, blocks_ok, blocks_failed)

    def progress(self, job_id: int) -> int:
        """Client side: regions of load `job_id` landed so far (0 before its copy reports any)."""
        (word,) = PROGRESS.unpack_from(self._mm, self._offset(job_id) + 16)
        if word >> PROGRESS_BITS != (job_id + 1) & _TAG_MASK:
            return 0
        return word & MAX_PROGRESS

    def close(self) -> None:
        self._mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
