"""threads.py, the one module that hands work to threads: a job's first chunks start at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvstore_service.threads import Threads


def test_start_returns_once_a_thread_has_taken_the_work_up_or_after_its_wait() -> None:
    async def main() -> None:
        lane = ThreadPoolExecutor(max_workers=1)
        began: list[str] = []
        release = threading.Event()

        def work(tag: str) -> str:
            began.append(tag)
            release.wait(10)
            return tag
        first = Threads.start(lane, work, "first", wait_s=10)
        assert began == ["first"]  # taken up before start returned
        waited = time.monotonic()
        second = Threads.start(lane, work, "second", wait_s=0.05)  # the lane's only thread is busy
        assert began == ["first"] and 0.05 <= time.monotonic() - waited < 5
        release.set()
        assert (await first, await second) == ("first", "second")
        lane.shutdown()
    asyncio.run(main())
