"""threads.py, the one module that hands work to threads: a job's first chunks start at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from kvstore_service.threads import Threads


def test_start_returns_once_threads_have_taken_the_calls_up_or_after_its_wait() -> None:
    lane = ThreadPoolExecutor(max_workers=2)
    began: list[str] = []
    release = threading.Event()

    def work(tag: str) -> str:
        began.append(tag)
        release.wait(10)
        return tag
    first = Threads.start(lane, [partial(work, "a"), partial(work, "b")], wait_s=10)
    assert sorted(began) == ["a", "b"]  # both taken up before start returned
    waited = time.monotonic()
    second = Threads.start(lane, [partial(work, "c")], wait_s=0.05)  # both threads are busy
    assert "c" not in began and 0.05 <= time.monotonic() - waited < 5
    release.set()
    assert [f.result(10) for f in first + second] == ["a", "b", "c"]
    lane.shutdown()
