"""The session's shared-memory completion channel: how a client learns that jobs finished, with no RPC.

The client creates it (a sealed memfd, passed at registration); the daemon maps it and, when job `j`
finishes, writes into slot `j % slots`: first the block counts, then `seq = j + 1`. A reader that
sees `seq == j + 1` knows job `j` is done (x86-64 keeps stores in order; the daemon writes each
slot from one thread). A client never has more than `slots` unfinished jobs, so a slot is reused
only after its job was seen.

A load copied region by region (RegisterResponse.progress_load_bytes) also writes, while it copies,
`progress = (j + 1) << 16 | regions landed` (the job id tags it: a slot's last job left its own).

After each post the daemon bumps the header's `posts` word and wakes the futex on it, so a client
that waits for jobs (`wait_posted`) sleeps in the kernel and wakes at the post, instead of polling
and taking cores from the copies. (An older daemon does not: the wait then ends at its timeout.)

    header (64 bytes): magic "KVSDONE1", u32 version, u32 slots, u32 posts
    slot i (24 bytes): u64 seq, u32 blocks_ok, u32 blocks_failed, u64 progress
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import time
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
POSTS = struct.Struct("<I")
POSTS_OFFSET = 16

# futex(2) on the posts word: shared, not FUTEX_PRIVATE_FLAG, as two processes map it.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
POLL_S = 0.001  # a waiter's sleep where no post can wake it (no futex here, or the channel closed)
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex(address: int, op: int, value: int, timeout: _Timespec | None = None) -> None:
    """futex(2) on the u32 at `address` (its result unused: a wait that ends early is checked again)."""
    assert _SYS_FUTEX is not None, "no futex syscall number for this machine: callers check first"
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(op), ctypes.c_uint(value),
                  None if timeout is None else ctypes.byref(timeout), None, ctypes.c_int(0))


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
        self._posts_address = self._address(POSTS_OFFSET)

    def _address(self, offset: int) -> int:
        """The address of a byte of the mapping (valid while the channel is open)."""
        anchor = ctypes.c_char.from_buffer(self._mm)  # (an export of the mapping: released right away)
        address = ctypes.addressof(anchor) + offset
        del anchor
        return address

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
        (posts,) = POSTS.unpack_from(self._mm, POSTS_OFFSET)
        POSTS.pack_into(self._mm, POSTS_OFFSET, (posts + 1) & 0xFFFFFFFF)
        self.wake()

    def wake(self) -> None:
        """Wake every thread asleep in `wait_posted`: at each post, and client side when the client
        itself fails a job (a refused submit, a lost daemon)."""
        if _SYS_FUTEX is not None and not self._mm.closed:
            _futex(self._posts_address, _FUTEX_WAKE, 0x7FFFFFFF)

    def progress_target(self, job_id: int) -> tuple[int, int]:
        """Daemon side, for a copy that posts a load's progress itself: the address of the job's
        progress word (valid while the channel is open) and the word with no region landed."""
        return self._address(self._offset(job_id) + 16), ((job_id + 1) & _TAG_MASK) << PROGRESS_BITS

    def posts(self) -> int:
        """Client side: the daemon's count of posts so far (mod 2**32), for `wait_posted`; 0 once
        closed (a re-registration replaced the channel)."""
        return 0 if self._mm.closed else int(POSTS.unpack_from(self._mm, POSTS_OFFSET)[0])

    def wait_posted(self, seen: int, timeout: float) -> None:
        """Client side: sleep until the daemon posts after `posts()` returned `seen`, or for
        `timeout` seconds (returns at once if it has posted since; may return early)."""
        if _SYS_FUTEX is None or self._mm.closed:
            time.sleep(min(timeout, POLL_S))  # nothing to sleep on: poll
            return
        _futex(self._posts_address, _FUTEX_WAIT, seen, _Timespec(int(timeout), int(timeout % 1 * 1e9)))

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
