"""Every thread the daemon hands work to: the one place its thread pools are made and stopped.

    copy lanes    --copy-threads per device (backend, index), made on first use; the shared lane runs
                  CPU copies (jobs.py), seals and the verification of recovered blocks (seals.py)
    device calls  device work that may block for long: runtime init, pinning the pool, opening or
                  closing an engine's IPC memory (jobs.py `Jobs.device_call`, for sessions.py too)
    disk I/O      the disk tier's opening, reads, writes and catalog saves (tiers/disk; the native
                  engine moves a call's records on threads of its own besides)
    remote        the remote tier's wrapping of an upload batch (a MAC or an encryption) and opening of
                  a large fetched batch (tiers/remote)
    populate      a new pool's growth while the daemon serves: one step of segments at a time (the native
                  populate runs --populate-threads threads of its own)
    journal       a rewrite of the block descriptions' journal (event_journal.py): the file read back, what
                  is still held kept (the one thread that reads the loop's maps: key lookups, never iterated)

The event loop owns all state; a thread gets a self-contained piece of work (a planned chunk, a
batch to checksum, one device call, one disk read or write, one batch to wrap or open) and hands its
result back. Jobs, the tiers and the events submit work here, and the daemon's start (the pool set up
and pinned, the disk tier opened); no other module of the daemon makes a thread (tests/unit/test_layering.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

_T = TypeVar("_T")
DEVICE_CALL_THREADS = 4
DISK_THREADS = 2
# The remote tier's threads: as many as asyncio's default executor has (ThreadPoolExecutor's default
# size, min(32, CPUs + 4)); the tier ran there before (asyncio.to_thread).
REMOTE_THREADS: int | None = None


class Threads:
    def __init__(self, copy_threads: int) -> None:
        self.copy_threads = copy_threads
        # Copy threads run at the default priority: at nice 10 (the loop gets a core at once) stores
        # lost more than loads gained (2-vCPU VM: stores 0.93 -> 0.85, loads 0.80 -> 0.81 of the copy
        # engine), and a thread cannot move between the two without CAP_SYS_NICE.
        self.shared = ThreadPoolExecutor(max_workers=copy_threads, thread_name_prefix="kvstore-copy")
        # Device calls get threads of their own, so that they neither block the loop nor wait behind copies.
        self._device_calls = ThreadPoolExecutor(max_workers=DEVICE_CALL_THREADS, thread_name_prefix="kvstore-device")
        self._lanes: dict[tuple[str, int], ThreadPoolExecutor] = {}
        self._disk: ThreadPoolExecutor | None = None
        self._remote: ThreadPoolExecutor | None = None
        self.populate = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-populate")
        self.journal = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-journal")

    def lane(self, backend: str, device: int) -> Executor:
        """The copy threads of this device: one GPU's copies never queue behind another's."""
        key = (backend, device)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = ThreadPoolExecutor(
                max_workers=self.copy_threads, thread_name_prefix=f"kvstore-copy-{backend}{device}")
        return lane

    @staticmethod
    def run(threads: Executor, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """Start `fn` on these threads now; await the future for its result."""
        return asyncio.get_running_loop().run_in_executor(threads, fn, *args)

    @staticmethod
    def start(threads: Executor, calls: list[Callable[[], _T]], wait_s: float) -> list[Future[_T]]:
        """Submit each call, then wait (the GIL released, at most `wait_s` in all) until threads have
        taken them all up. A woken thread needs the GIL before its native call releases it: while the
        loop goes on in Python it got it only after 1-5 ms on our 2-vCPU VM."""
        taken = [threading.Event() for _ in calls]

        def take(call: Callable[[], _T], event: threading.Event) -> _T:
            event.set()
            return call()
        futures = [threads.submit(take, call, event) for call, event in zip(calls, taken, strict=True)]
        deadline = time.monotonic() + wait_s
        for event in taken:
            event.wait(max(0.0, deadline - time.monotonic()))
        return futures

    def device_call(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        return self.run(self._device_calls, fn, *args)

    @property
    def disk(self) -> Executor:
        """The disk tier's threads (DiskTier's `executor`), made on first use."""
        if self._disk is None:
            self._disk = ThreadPoolExecutor(max_workers=DISK_THREADS, thread_name_prefix="kvstore-disk")
        return self._disk

    @property
    def remote(self) -> Executor:
        """The remote tier's threads (RemoteTier's `executor`), made on first use."""
        if self._remote is None:
            self._remote = ThreadPoolExecutor(max_workers=REMOTE_THREADS, thread_name_prefix="kvstore-remote")
        return self._remote

    def close_copies(self) -> None:
        """Wait for the copies, seals and device calls under way; refuse new ones."""
        self.shared.shutdown(wait=True)
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
        self._device_calls.shutdown(wait=True)

    def close(self) -> None:
        """Every thread stopped, after the work under way."""
        self.close_copies()
        for tier in (self._disk, self._remote, self.populate, self.journal):
            if tier is not None:
                tier.shutdown(wait=True)
