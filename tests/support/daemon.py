"""The daemon process for tests and benchmarks, plus what they read of it (and of other processes)
in /proc and /dev/shm: mappings, open files, completion channels, memory use, its pool file's slots."""

from __future__ import annotations

import glob
import mmap
import os
import re
import struct
import time
from collections.abc import Callable, Iterator, Sequence

from kvstore_service import harness
from kvstore_service.pool import (
    POOL_HEADER,
    POOL_HEADER_BYTES,
    POOL_MAGIC,
    Segment,
    SlotHeader,
    SlotState,
    parse_slot_header,
)


class DaemonProcess(harness.DaemonProcess):
    """The daemon process, plus what tests and the soak read of it."""

    def memory_kib(self) -> dict[str, int]:
        """VmRSS and its parts (anonymous, shared memory) in KiB; the pool is mapped, so RssShmem grows
        as it fills; RssAnon is the daemon's own heap."""
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssShmem"):
                    out[name] = int(value.split()[0])
        return out

    def references(self, needles: Sequence[str]) -> list[str]:
        return references(self.pid, needles)


def references(pid: int, needles: Sequence[str]) -> list[str]:
    """Mappings and open files of process `pid` whose path contains one of `needles`."""
    found = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            found += [line.strip() for line in f if any(n in line for n in needles)]
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if any(n in target for n in needles):
                found.append(f"fd {fd} -> {target}")
    except FileNotFoundError:
        pass
    return found


def engine_needles(pids: Sequence[int]) -> list[str]:
    """What the KV memory of these worker processes looks like in the daemon's maps and fds."""
    return [f"memfd:kvstore-kv-{pid}-" for pid in pids]


def completion_channels(pid: int) -> int:
    """Completion channels process `pid` (the daemon) maps: one per session with KV memory."""
    return sum(1 for line in references(pid, ["memfd:kvstore-done"]) if not line.startswith("fd "))


def shm_files(pid: int) -> list[str]:
    """Files in /dev/shm named after process `pid` (engines keep their memory in memfds: none). The
    pid must stand as its own token: pool names carry random hex that may contain its digits."""
    token = re.compile(rf"(^|[^0-9a-f]){pid}($|[^0-9a-f])")
    return [p for p in glob.glob("/dev/shm/*") if token.search(os.path.basename(p))]



def pool_slots(path: str) -> Iterator[tuple[SlotHeader | None, int, int]]:
    """Every slot of every segment in use in a pool file, read from outside the daemon, whatever the
    headers say: (its header, None without a valid one; its payload's offset in the file; payload size)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as data:
        magic, _, _, _, segment_size, segments, data_offset = POOL_HEADER.unpack_from(data, 0)
        if magic != POOL_MAGIC:
            raise ValueError(f"{path} is not a kvstore pool")
        for index in range(segments):
            (payload_size,) = struct.unpack_from("<Q", data, POOL_HEADER_BYTES + 8 * index)
            if not payload_size:
                continue
            seg = Segment(index, data_offset + index * segment_size)
            seg.lay_out(payload_size, segment_size)
            for slot in range(seg.slots):
                yield parse_slot_header(data, seg.header_offset(slot)), seg.payload_offset(slot), payload_size


def sealed_blocks(path: str) -> Iterator[tuple[SlotHeader, int]]:
    """Each sealed block's header and payload offset in a pool file: the blocks a restarted daemon
    would recover (and then serve if their payloads still match the headers' checksums)."""
    for header, offset, _ in pool_slots(path):
        if header is not None and header.state == SlotState.SEALED:
            yield header, offset


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
