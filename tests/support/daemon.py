"""The daemon process for tests and benchmarks, plus what they read of it (and of other processes)
in /proc and /dev/shm: mappings, open files, completion channels, memory use."""

from __future__ import annotations

import glob
import os
import re
import time
from collections.abc import Callable, Sequence

from kvstore_service import harness


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



def wait_for(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
