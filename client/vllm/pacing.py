"""Every sleep and wait of the connector, in one place: how long a step waits for the sidecar, and why.

A step with nothing to compute while the connector waits on the sidecar (lookups, loads) waits for
progress: a job's completion in the session's channel, or, with the scheduler in the same process, a
lookup's reply. vLLM would spin such steps back to back, and the spinning thread holds the GIL and a
core that the lookup/submit threads and the daemon's copies need. The wait sleeps in slices (never
spins), ends at the first progress, and lasts at most IDLE_WAIT_MAX_S (a request arriving meanwhile
waits that long at most). With a load in flight it lasts up to IDLE_LOAD_WAIT_MAX_S: a load that
completes within the wait is reported in this step, and its request runs in the next one; reported a
step later, it would cost vLLM's engine core another idle step (a round trip to the worker and a 1 ms
sleep). A 2k-token prompt of the benchmark's model (48 MiB) loads in 3-16 ms on this project's 2-core
test machine.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore_client.client import Session
    from kvstore_client.protocol.completion import Completion
    from kvstore_client.vllm.plan import Lookup

PREEMPTION_WAIT_S = 30.0  # a preempted request's stores, before vLLM may reuse its blocks
IDLE_WAIT_MAX_S = 0.002
IDLE_LOAD_WAIT_MAX_S = 0.010
IDLE_SLICE_S = 0.0001
# A forward waiting for a layer of an early load (KVStoreConnectorMetadata.early) checks every:
EARLY_SLICE_S = 0.00005
# What cannot be seen from the worker's process (another process's lookups): a fixed sleep.
IDLE_WAIT_S = 0.0005
# vLLM's engine core in a process of its own with no other request: how long the scheduler waits for
# a new request's lookup reply before answering "ask again" (see engine_core_sleeps_when_idle). A
# lookup takes 0.3-1 ms alone, 2-3 ms while vLLM's worker process spins on its message queue.
LOOKUP_WAIT_S = 0.005


class ProcessConnectors:
    """The connector sides living in this process. With the scheduler here too (vLLM's uniprocess
    executor), a worker's idle wait also ends when a lookup reply arrives (`lookup_replied`, set by
    the session's background thread after each lookup)."""

    lookup_replied = threading.Event()
    schedulers = 0
    workers = 0


def engine_core_sleeps_when_idle() -> bool:
    """vLLM's engine core in a process of its own (EngineCoreProc: `vllm serve`, or LLM with
    VLLM_ENABLE_V1_MULTIPROCESSING=1, the default) sleeps 1 ms after a step that ran no model while
    requests remain (`_process_engine_step`), which is time enough for a lookup reply; in-process
    (InprocClient) it steps again at once."""
    return multiprocessing.current_process().name.startswith("EngineCore")


# -- the scheduler's side ------------------------------------------------------------------------


def wait_for_reply(state: Lookup) -> bool:
    """A new request's lookup, the only request of an engine core that sleeps when idle: wait here (at
    most LOOKUP_WAIT_S) rather than answer "ask again", which costs a round trip to the workers and a
    1 ms sleep; the load then starts this step. Call `expect_reply` before starting the lookup."""
    return ProcessConnectors.lookup_replied.wait(LOOKUP_WAIT_S) and state.replied


def expect_reply() -> None:
    ProcessConnectors.lookup_replied.clear()


def idle_wait(lookups: Iterable[Lookup], loads_in_flight: bool, core_sleeps_when_idle: bool) -> tuple[bool, bool]:
    """(wait, lookups) for a step with nothing to compute: whether the worker waits for progress, and
    whether lookup replies are awaited (the worker in this process wakes on them)."""
    replied = ProcessConnectors.lookup_replied
    if ProcessConnectors.workers and replied.is_set():
        replied.clear()  # replies from here on wake the wait; earlier ones are seen below
    waiting = False
    for state in lookups:
        if not state.read:
            if state.replied:
                return False, False  # a reply to read: the next step makes progress at once
            waiting = True
    if loads_in_flight:
        return True, waiting
    if waiting and (ProcessConnectors.workers or not core_sleeps_when_idle):
        return True, True
    return False, False  # nothing to wait for, or vLLM's engine core sleeps on its own


# -- the worker's side ---------------------------------------------------------------------------


def wait_for_progress(session: Session | None, jobs: bool, loads: bool, lookups: bool) -> list[Completion]:
    """An idle step (vLLM computes nothing) while lookups or loads are in flight: wait until a job of
    this session completes (asleep on the completion channel until the daemon posts) or, with the
    scheduler in this process, a lookup reply arrives (then checking the channel every IDLE_SLICE_S), at
    most IDLE_WAIT_MAX_S (IDLE_LOAD_WAIT_MAX_S with a load in flight); returns the completions seen.
    Sleeps, never spins: the GIL and the cores go to the lookup thread and the daemon's copies. A lookup
    reply in another process cannot be seen from here: IDLE_WAIT_S."""
    replied = ProcessConnectors.lookup_replied if lookups and ProcessConnectors.schedulers else None
    if session is None or not jobs:  # nothing to poll: one wait
        if replied is None:
            time.sleep(IDLE_WAIT_S)
        else:
            replied.wait(IDLE_WAIT_MAX_S)
        return []
    deadline = time.monotonic() + (IDLE_LOAD_WAIT_MAX_S if loads else IDLE_WAIT_MAX_S)
    while True:
        channel = session.channel
        seen = channel.posts() if channel is not None else 0  # before the poll: a post after it wakes us
        completions = session.poll()
        if completions:
            return completions
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return []
        if replied is not None:
            if replied.wait(min(IDLE_SLICE_S, remaining)):
                return []
        elif channel is not None:
            channel.wait_posted(seen, remaining)
        else:
            time.sleep(min(IDLE_SLICE_S, remaining))


def wait_for_jobs(session: Session, jobs: list[int], timeout_s: float) -> dict[int, Completion]:
    """The step waits until these jobs completed (raises TimeoutError after `timeout_s`): a preempted
    request's stores before vLLM may reuse its blocks (PREEMPTION_WAIT_S), the early loads a forward
    read, so that a failed one is reported with the step that used it (the session's timeout)."""
    return session.wait(jobs, timeout=timeout_s)


def wait_for_landing(session: Session, job: int, regions: int, deadline: float, timeout_s: float) -> tuple[bool, float]:
    """Before a layer of a forward: wait until an early load's first `regions` regions landed (or it
    finished). The forward's loads share one deadline, `timeout_s` from its first wait (`deadline` 0:
    none yet). Returns (landed, deadline); not landed: the load failed, its blocks are recomputed."""
    while session.progress(job) < regions and not session.finished(job):
        now = time.monotonic()
        if not deadline:
            deadline = now + timeout_s
        elif now > deadline:
            return False, deadline
        time.sleep(EARLY_SLICE_S)
    return True, deadline
