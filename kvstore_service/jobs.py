"""Store and load jobs: plan on the event loop -> copy in a thread -> complete -> publish -> seal.

Its work runs on the daemon's threads (threads.py), and so do the device calls of sessions (`device_call`). A
job is cut into chunks; for each chunk the loop asks the index for slots (store) or pinned blocks
(load), plans the byte runs, and hands the chunk to one of the `--copy-threads` copy threads, which
only make native calls. While chunks copy, the loop plans the next ones; two chunks in flight keep a
device's DMA busy while the other one's completion is handled (one chunk at a time on all cores
cost a third of the CUDA path's speed on an H100). The loop then completes each chunk in the index
and publishes the job's completion to the engine's shared-memory channel. A job whose every block
landed intact is posted there by the copy thread that finishes its last chunk, before the loop's
bookkeeping (`_copy_ended` says why); a store's commit is queued on the loop before that post.

Stored blocks then wait in a queue to be sealed (seals.py: their checksums taken when no copy is in
flight, and written into their slot headers); the Seals also verify the blocks recovered after a restart.
How a job is cut into chunks, and each chunk's byte runs, is chunks.py's.

Device jobs are ordered against the engine first (CUDA: its IPC events): when a job arrives, the
backend notes which of the engine's ordering records it must follow are still pending
(`order_pending`: the record the job names by its `order_seq`, or without one every record), and the
loop polls them from the host (`order_waiting`) before it plans the job, with a deadline
(ORDER_WAIT_S) and for no longer than the session lives. No copy thread waits on an engine: one that
died or stalls fails its own jobs, and its session's end is not held up by them. Each device has its
own copy threads (`--copy-threads` per device), so one GPU's copies never queue behind another's.

No engine learns that a job ended while a copy of it may still touch the engine's memory: a job the
client gives up on at its deadline (`expires_ns`) starts no copy after it, and a store copied past it
is not committed (the engine may have reused its blocks); a stopping daemon first drains (`drain`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from array import array
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from kvstore_service import native, native_device
from kvstore_service.chunks import CHUNK_BLOCKS, Chunk, chunks, load_check, plan_chunk, track_progress
from kvstore_service.config import Config
from kvstore_service.errors import KVError, invalid
from kvstore_service.index import Block, BlockIndex
from kvstore_service.keys import PackedKeys
from kvstore_service.metrics import Metrics
from kvstore_service.pool import Pool
from kvstore_service.seals import Seals
from kvstore_service.sessions import EngineSession
from kvstore_service.threads import Threads

log = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_JOB_ID = (1 << 64) - 1  # the completion word holds job_id + 1
# The longest a job waits for the engine's work recorded before it (a step's forward; a long prefill
# takes seconds): beyond it the engine's stream is taken as stalled and the job fails. The poll
# interval starts short (a load usually waits for the step just launched) and backs off.
ORDER_WAIT_S = 60.0
ORDER_POLL_FIRST_S = 0.0002
ORDER_POLL_MAX_S = 0.002
# The longest the loop waits for free copy threads to take up a job's first chunks before it plans
# on (Threads.start). A thread woken while the loop goes on in Python waits for the GIL (a bulk
# load's first copies started 1.5-5 ms after their hand-off), and one woken while the loop and the
# other copy hold both vCPUs queues behind them: handed off together and seen taken up, both start
# ~1 ms after the job's arrival (2-vCPU VM; loads 0.77 -> 0.83 of the copy engine, ledger 2026-11-27).
HANDOFF_WAIT_S = 0.002
# Finished jobs kept per session for the Poll RPC (the shared-memory channel is the main path):
# the oldest go first when nobody polls.
RESULTS_KEPT = 1024


@dataclass(frozen=True, slots=True)
class JobResult:
    """What the Poll RPC reports of a finished job: no keys, no blocks."""

    job_id: int
    is_store: bool
    blocks: int
    failed: tuple[int, ...]  # indexes of the blocks that failed
    error: str


@dataclass(eq=False)
class Job:
    job_id: int
    is_store: bool
    session: EngineSession
    keys: PackedKeys  # (a chunk's unpacked when it is planned)
    block_ids: array[int]  # ('Q')
    ok: list[bool]
    partial_tail: bool = False  # store: the last key is a prompt's partial last block
    # store: keys another job is writing; this job is done when those are (dedupe without lying)
    waits: list[tuple[int, asyncio.Future[bool]]] = field(default_factory=list)
    error: str = ""
    submitted: float = field(default_factory=time.monotonic)
    order: list[int] = field(default_factory=list)  # the engine's records still pending at arrival
    copy_seconds: float = 0.0
    copied_bytes: int = 0
    ordered: float = 0.0  # when the engine's records were done (monotonic)
    copies: list[tuple[float, float]] = field(default_factory=list)  # each chunk's copy: (start, end)
    # Chunks handed to copy threads and not done, plus 1 while the loop plans. The thread that brings
    # it to 0 wakes the loop (`copied`) and posts the completion if every block landed intact
    # (`_copy_ended`): once per job, not once per chunk, as each wake cost the loop a resumption and a
    # copy thread its vCPU (a bulk load's loop CPU 4.5 -> 3.2 ms; a store's commits likewise all at
    # once after its last copy, `_land_store`: stores 0.83 -> 0.88 of the copy engine, ledger 2026-12-01).
    copying: int = 1
    intact: bool = True  # no chunk's copy failed, and (a load) none found a corrupt block
    posted: bool = False
    copied: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    lane: Executor | None = None  # the copy threads its chunks went to
    chunks: list[tuple[Chunk, Future[list[int]]]] = field(default_factory=list)  # each with its copy
    stored: list[Block] = field(default_factory=list)  # a store: the blocks it committed
    # CLOCK_MONOTONIC ns (every process of the node reads the same clock) after which the client
    # takes the job as failed: no copy starts later, a store copied later is not committed. 0: none.
    expires_ns: int = 0


@dataclass(eq=False)
class EngineJobs:
    """The jobs of one engine session: kept by Jobs for as long as the session object lives."""

    running: dict[int, Job] = field(default_factory=dict)  # completion slot -> unfinished job
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    results: deque[JobResult] = field(default_factory=lambda: deque(maxlen=RESULTS_KEPT))  # for Poll
    results_ready: asyncio.Event = field(default_factory=asyncio.Event)


class Jobs:
    def __init__(self, config: Config, pool: Pool, index: BlockIndex, metrics: Metrics,
                 fatal: Callable[[native_device.StickyDeviceError], None], threads: Threads) -> None:
        self.config = config
        self.fatal = fatal  # a device is unusable for the whole process: the daemon must restart
        self.pool = pool
        self.index = index
        self.metrics = metrics
        # Copies of each device on its lane, CPU jobs and seals on the shared one; device calls apart.
        self.threads = threads
        self._of: weakref.WeakKeyDictionary[EngineSession, EngineJobs] = weakref.WeakKeyDictionary()
        self.order_wait_s = ORDER_WAIT_S
        self.failed_blocks = 0
        self.failed_load_blocks = 0
        self.store_failures_pool_full = 0
        self._corrupt_loads = 0  # blocks that failed their checksum at a load
        self._store_waiters: dict[tuple[Block, int], list[asyncio.Future[bool]]] = {}  # (block, shard)
        self._copies: Counter[Executor] = Counter()  # chunks handed to each lane's copy threads, not finished
        self._landing = threading.Lock()  # Job.copying and the channels' posts, from the loop and copy threads
        self._draining = False
        # Seals run on the shared copy threads: they yield to the copies made there, by the host's cores.
        self.seals = Seals(config, pool, index, self.threads, lambda: self._copies[threads.shared])
        self.queue_seal = self.seals.queue  # (the tiers queue promoted blocks too)
        self.verify_recovered = self.seals.verify_recovered  # once after a restart

    @property
    def corrupt_blocks(self) -> int:
        """Blocks that failed their checksum: at a load, or when verified after a restart."""
        return self._corrupt_loads + self.seals.corrupt_blocks

    @property
    def unsealed_blocks(self) -> int:
        return self.seals.unsealed_blocks

    @property
    def on_sealed(self) -> Callable[[list[Block], list[int]], None] | None:
        """Called on the loop with blocks just sealed and their checksums (the lower tiers take them)."""
        return self.seals.on_sealed

    @on_sealed.setter
    def on_sealed(self, fn: Callable[[list[Block], list[int]], None] | None) -> None:
        self.seals.on_sealed = fn

    async def device_call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking device call in a thread and await it."""
        try:
            return await self.threads.device_call(fn, *args)
        except native_device.StickyDeviceError as e:
            self.fatal(e)
            raise

    # -- submit and poll -------------------------------------------------------------------------

    def submit(self, session: EngineSession, job_id: int, keys: Sequence[bytes], block_ids: array[int] | Sequence[int],
               is_store: bool, partial_tail: bool = False, order_seq: int = 0, expires_ns: int = 0) -> Job:
        if self._draining:
            raise KVError("UNAVAILABLE", "the daemon is stopping: no job starts (the engine recomputes)")
        packed = PackedKeys.of(keys)
        if not isinstance(block_ids, array):
            try:
                block_ids = array("Q", block_ids)
            except OverflowError:
                bad = next(i for i in block_ids if not 0 <= i < 1 << 64)
                raise invalid(f"block id {bad} is outside the registered cache "
                              f"(0..{session.layout.num_blocks - 1})") from None
        if len(packed) != len(block_ids):
            raise invalid(f"{len(packed)} keys but {len(block_ids)} block ids")
        if not packed:
            raise invalid("a job needs at least one block")
        # (A store may read one engine block under two keys; a load must not write one twice.)
        problem = native.check_job(packed.packed, packed.size, block_ids, session.layout.num_blocks,
                                   distinct_ids=not is_store)
        if problem:
            raise invalid(problem)
        if job_id >= MAX_JOB_ID:
            raise invalid(f"job id {job_id} is too large (max {MAX_JOB_ID - 1})")
        slot = job_id % session.channel.slots
        session_jobs = self._jobs_of(session)
        if slot in session_jobs.running and not session_jobs.running[slot].posted:
            raise KVError("RESOURCE_EXHAUSTED",
                          f"job {job_id}: completion slot busy ({len(session_jobs.running)} jobs in flight, "
                          f"{session.channel.slots} slots); wait for completions")
        if len(session_jobs.running) >= self.config.max_inflight_jobs:
            raise KVError("RESOURCE_EXHAUSTED", f"{len(session_jobs.running)} jobs in flight (--max-inflight-jobs "
                          f"{self.config.max_inflight_jobs}); wait for completions")

        job = Job(job_id, is_store, session, packed, block_ids, [False] * len(packed), partial_tail,
                  expires_ns=expires_ns)
        job.order = self._order_pending(job, order_seq)  # now, at arrival: the records the job must follow
        session_jobs.running[slot] = job
        task = asyncio.get_running_loop().create_task(self._run(job))
        session_jobs.tasks.add(task)
        task.add_done_callback(session_jobs.tasks.discard)
        return job

    async def poll(self, session: EngineSession, wait_ms: int) -> list[JobResult]:
        """Results of the jobs finished since the last poll (the newest RESULTS_KEPT)."""
        session_jobs = self._jobs_of(session)
        if not session_jobs.results and wait_ms > 0:
            session_jobs.results_ready.clear()
            try:
                await asyncio.wait_for(session_jobs.results_ready.wait(), wait_ms / 1000)
            except TimeoutError:
                pass
        results = list(session_jobs.results)
        session_jobs.results.clear()
        return results

    async def settle(self, session: EngineSession) -> None:
        """A session ends: wait for its jobs' copies (they use its mapping) and completions."""
        session_jobs = self._of.get(session)
        if session_jobs is not None and session_jobs.tasks:
            await asyncio.gather(*session_jobs.tasks, return_exceptions=True)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not finished, of every session."""
        return sum(len(session_jobs.running) for session_jobs in self._of.values())

    def _jobs_of(self, session: EngineSession) -> EngineJobs:
        session_jobs = self._of.get(session)
        if session_jobs is None:
            session_jobs = self._of[session] = EngineJobs()
        return session_jobs

    # -- ordering against the engine -------------------------------------------------------------

    def _order_pending(self, job: Job, seq: int) -> list[int]:
        session = job.session
        try:
            return session.backend.order_pending(session.mappings[0], seq)
        except RuntimeError as e:  # cannot tell when the engine's writes are done: copying would be unordered
            job.error = f"cannot order the copy after the engine's work: {e}"
            if isinstance(e, native_device.StickyDeviceError):
                self.fatal(e)
            return []

    async def _wait_for_engine(self, job: Job) -> bool:
        """Poll, on the loop, until the engine's records pending at the job's arrival are done. False
        (job.error says why) when the session ends first (the engine died or left), after
        order_wait_s (its stream stalls), or when a query fails."""
        session, pending = job.session, job.order
        deadline = time.monotonic() + self.order_wait_s
        delay = ORDER_POLL_FIRST_S
        while pending:
            if self._draining:
                job.error = "cancelled: the daemon is stopping"
                return False
            if session.closed:
                job.error = "the session ended before the engine's work this job must follow was done"
                return False
            if time.monotonic() >= deadline:
                job.error = (f"the engine's work recorded before this job was not done within {self.order_wait_s:g} s "
                             "(its stream is stalled?)")
                return False
            await asyncio.sleep(delay)
            delay = min(2 * delay, ORDER_POLL_MAX_S)
            try:
                pending = session.backend.order_waiting(session.mappings[0], pending)
            except RuntimeError as e:
                job.error = f"cannot order the copy after the engine's work: {e}"
                if isinstance(e, native_device.StickyDeviceError):
                    self.fatal(e)
                return False
        return not job.error

    def _lane(self, session: EngineSession) -> Executor:
        """The copy threads of the session's device; the shared ones for copies by the host's cores
        (CPU), and once shutting down (they refuse new work: no copy may start while the pool closes)."""
        if self._draining or session.backend.copies_on_host:
            return self.threads.shared
        return self.threads.lane(session.backend.name, session.mappings[0].device)

    # -- the pipeline ----------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        try:
            if await self._wait_for_engine(job):
                job.ordered = time.monotonic()
                await self._transfer(job)
            else:
                self._publish(job)  # every block failed
        except Exception as e:  # a bug: still tell the engine, never leave the job pending forever
            log.exception("job %d failed", job.job_id)
            if self._jobs_of(job.session).running.get(job.job_id % job.session.channel.slots) is job:
                job.error = f"internal error: {e}"
                job.ok = [False] * len(job.ok)
                self._publish(job)

    async def _transfer(self, job: Job) -> None:
        """Plan and copy chunk by chunk: the copy threads move the first chunks while this loop
        plans the next ones, then it completes them all at once after the last (`Job.copied` says why;
        a store's are completed by `_land_store`, queued before its post)."""
        job.lane = self._lane(job.session)
        await self._start_copies(job, job.lane)
        await job.copied
        stored = job.stored if job.is_store else self._complete_chunks(job)
        if job.copies:
            job.copy_seconds = max(end for _, end in job.copies) - min(start for start, _ in job.copies)
        for i, waiter in job.waits:
            job.ok[i] = await waiter
        self._publish(job)
        if stored:
            self.queue_seal(stored)

    def _land_store(self, job: Job) -> None:
        """Loop, queued by the copy thread that ended a store's last chunk, before it posts: the
        store's blocks committed (`Job.stored`), then its task woken for the rest."""
        try:
            job.stored = self._complete_chunks(job)
        except Exception as e:  # a bug: _run reports the job failed
            if not job.copied.done():
                job.copied.set_exception(e)
            return
        _resolve(job.copied)

    def _complete_chunks(self, job: Job) -> list[Block]:
        """Loop, once every chunk's copy ended: complete each; returns the blocks a store committed."""
        lane = job.lane
        assert lane is not None
        stored: list[Block] = []
        # Taken off the job: each copy's done callback holds the job, a cycle that kept the job's blocks,
        # keys and plans alive until the next collection (serve.py's GC_YOUNG_THRESHOLD says what it cost).
        copies, job.chunks = job.chunks, []
        self._copies[lane] -= len(copies)
        if lane is self.threads.shared and not self._copies[lane]:
            self.seals.no_copies()
        for chunk, copying in copies:
            try:
                corrupt = copying.result()
            except (Expired, CancelledError) as e:  # past its deadline, or cancelled by a drain: never copied
                job.error = str(e) or "cancelled: the daemon is stopping"
                corrupt = None
            except Exception as e:  # every block of the chunk failed; never report it as success
                log.exception("job %d copy failed", job.job_id)
                job.error = f"copy failed: {e}"
                corrupt = None
                if isinstance(e, native_device.StickyDeviceError):
                    self.fatal(e)
            if corrupt is not None:
                job.copied_bytes += chunk.plan.total_bytes
            try:
                if job.is_store:
                    stored += self._complete_store(job, chunk, ok=corrupt is not None)
                else:
                    self._complete_load(job, chunk, corrupt)
            except Exception as e:  # a bug: this chunk's blocks fail, the job's other chunks still complete
                log.exception("job %d: completing blocks %d-%d failed", job.job_id, chunk.indexes[0],
                              chunk.indexes[-1])
                job.error = f"internal error: {e}"
                for i in chunk.indexes:
                    job.ok[i] = False
        return stored

    async def _start_copies(self, job: Job, lane: Executor) -> None:
        """Plan the job's chunks and hand each to the copy threads, each with its copy into `Job.chunks`
        (chunks.py says how it is cut)."""
        copies = job.chunks
        loop = asyncio.get_running_loop()
        n, block_bytes = len(job.keys), job.session.layout.block_bytes
        whole = not job.is_store and n <= CHUNK_BLOCKS and n * block_bytes <= job.session.backend.whole_load_bytes
        parts = [range(n)] if whole else chunks(n, block_bytes, self.config.copy_threads)
        # The first chunks, one per free copy thread, are handed off together once planned, and the
        # loop sees them taken up before it plans on (HANDOFF_WAIT_S says why).
        lead = min(self.config.copy_threads, len(parts)) if len(parts) > 1 else 0
        held: list[Chunk] = []
        for k, part in enumerate(parts):
            if self._draining:  # the rest is cancelled: it never starts
                job.error = "cancelled: the daemon is stopping"
                break
            try:
                chunk = self._prepare_store(job, part) if job.is_store else self._prepare_load(job, part)
            except Exception as e:  # a bug: the chunks planned still copy and complete, the rest fail
                log.exception("job %d: planning blocks %d-%d failed", job.job_id, part.start, part.stop - 1)
                job.error = f"internal error: {e}"
                break
            if chunk is not None:
                with self._landing:
                    job.copying += 1
                if whole:
                    track_progress(job.session, job.job_id, chunk.plan)
                self._copies[lane] += 1
                if k < lead and self._copies[lane] <= self.config.copy_threads:
                    held.append(chunk)
                else:
                    copies.append((chunk, lane.submit(self._copy, job, chunk)))
            if held and k + 1 == lead:
                self._start_held(job, lane, held)
                held = []
            if k + 1 < len(parts):
                await asyncio.sleep(0)  # serve other requests between chunks of a large job
        if held:  # (planning stopped early)
            self._start_held(job, lane, held)
        for _, copying in copies:
            copying.add_done_callback(partial(self._copy_ended, job, loop))
        self._copy_ended(job, loop)  # (planning is done; job.error if a block is missing)

    def _start_held(self, job: Job, lane: Executor, held: list[Chunk]) -> None:
        started = Threads.start(lane, [partial(self._copy, job, c) for c in held], wait_s=HANDOFF_WAIT_S)
        job.chunks[:0] = zip(held, started, strict=True)

    def _prepare_store(self, job: Job, part: range) -> Chunk | None:
        """Slots for the chunk's new keys; keys present already are done, keys another job is
        writing are done when that job's copy is."""
        shard = job.session.layout.shard
        tails = 1 if job.partial_tail and part.stop == len(job.keys) else 0
        plan = self.index.prepare_store(job.session.namespace, job.keys[part.start:part.stop], shard, tails)
        for i in plan.present:
            job.ok[part.start + i] = True
        for i, block in plan.in_flight:
            future = asyncio.get_running_loop().create_future()
            self._store_waiters.setdefault((block, shard), []).append(future)
            job.waits.append((part.start + i, future))
        if plan.refused:
            self.store_failures_pool_full += plan.refused
            job.error = "pool full: every block is pinned or being copied"
        if not plan.blocks:
            return None
        indexes = [part.start + i for i in plan.reserved]
        try:
            return plan_chunk(job.session, job.block_ids, indexes, plan.blocks, self.pool.size)
        except Exception:  # (a bug) the slots reserved are freed, not left being written forever
            self.index.complete_store(plan.blocks, False, shard)
            raise

    def _prepare_load(self, job: Job, part: range) -> Chunk | None:
        """Pin the chunk's present blocks; an absent one fails."""
        found = self.index.prepare_load(job.session.namespace, job.keys[part.start:part.stop])
        blocks: list[Block] = list(filter(None, found))
        indexes = list(part)
        if len(blocks) < len(found):
            job.error = "block not in the pool"
            indexes = [i for i, block in zip(part, found, strict=True) if block is not None]
        if not blocks:
            return None
        try:
            chunk = plan_chunk(job.session, job.block_ids, indexes, blocks, self.pool.size)
            if self.config.verify_loads > 0:
                chunk.check = load_check(blocks, job.session.namespace.block_bytes, self.config.verify_loads)
        except Exception:  # (a bug) the blocks pinned are let go, not pinned forever
            self.index.unpin(blocks)
            raise
        return chunk

    def _copy(self, job: Job, chunk: Chunk) -> list[int]:
        """Copy thread: one chunk in one backend call (a store's blocks get their slot headers at
        their seal). A load's checksum sample is verified in the pool (backends' `transfer`), and
        the positions of the blocks that fail are returned. No Python per block here: the event loop
        holds the GIL while it plans."""
        session = job.session
        start = time.monotonic()
        _check_expiry(job)
        corrupt = session.backend.transfer(session.mappings[0], self.pool.base, chunk.plan, not job.is_store,
                                           chunk.check)
        job.copies.append((start, time.monotonic()))
        if job.is_store:  # read after the client gave up: the engine may have reused those blocks
            _check_expiry(job)
        return corrupt

    def _copy_ended(self, job: Job, loop: asyncio.AbstractEventLoop, copy: Future[list[int]] | None = None) -> None:
        """A chunk was copied (on its copy thread; `copy` its result), or the loop planned the last
        chunk. The last of them wakes the loop (`Job.copied`) and posts the completion if every block
        landed intact, and (a load) was found, or (a store) none waits for another store's copy.

        So a job's completion reaches the engine when its last chunk lands, not when the loop wakes to
        complete it (0.15-0.3 ms later on our 2-vCPU VM, then its bookkeeping: 16-block hits 1.62x ->
        1.44x their copy's time). A store's commit is queued on the loop before its post: whatever
        the engine asks after it sees the post reaches the loop behind it (every request's handler
        runs from the loop's queue), so it finds the blocks (a block a Clear took while it was copied
        is then reported stored, as if cleared just after). A missing or corrupt block, a failed
        copy, a refused slot: the loop posts, in _publish."""
        with self._landing:
            if copy is not None and (copy.cancelled() or copy.exception() is not None or copy.result()):
                job.intact = False
            job.copying -= 1
            if job.copying:
                return
            if job.is_store:
                loop.call_soon_threadsafe(self._land_store, job)
            if job.intact and not job.error and not job.waits:
                job.posted = True  # (first: whoever sees the post sees the job posted)
                job.session.channel.post(job.job_id, len(job.ok), 0)
        if not job.is_store:  # (a load commits nothing: posted first, the engine wakes before the loop)
            loop.call_soon_threadsafe(_resolve, job.copied)

    def _complete_store(self, job: Job, chunk: Chunk, ok: bool) -> list[Block]:
        """Every byte of the chunk is in the pool (if ok): its blocks become visible. Returns the
        blocks committed."""
        ns, shard = job.session.namespace, job.session.layout.shard
        committed = self.index.complete_store(chunk.blocks, ok, shard)
        if ns.shards > 1:
            # This part is in while its group is (other shards may still be on their way).
            for i, block in zip(chunk.indexes, chunk.blocks, strict=True):
                job.ok[i] = ok and self.index.present(block)
        elif len(committed) == len(chunk.blocks):
            _mark_ok(job, chunk)
        else:
            done = set(committed)
            for i, block in zip(chunk.indexes, chunk.blocks, strict=True):
                job.ok[i] = block in done
        if self._store_waiters:
            for i, block in zip(chunk.indexes, chunk.blocks, strict=True):
                for waiter in self._store_waiters.pop((block, shard), ()):
                    waiter.set_result(job.ok[i])
        return committed

    def _complete_load(self, job: Job, chunk: Chunk, corrupt: list[int] | None) -> None:
        """The chunk landed, but for the `corrupt` blocks (None: its copy failed, all did)."""
        if corrupt is None:
            self.index.unpin(chunk.blocks)
            return
        _mark_ok(job, chunk)
        if corrupt:
            self._corrupt_loads += len(corrupt)
            job.error = f"{len(corrupt)} block(s) failed their checksum and were dropped"
            for k in corrupt:
                job.ok[chunk.indexes[k]] = False
        self.index.complete_load(chunk.blocks, [chunk.blocks[k] for k in corrupt])

    def _publish(self, job: Job) -> None:
        """Event loop: the job is done for the engine; write its completion."""
        session = job.session
        failed = () if all(job.ok) else tuple(i for i, ok in enumerate(job.ok) if not ok)
        self.failed_blocks += len(failed)
        if not job.is_store:
            self.failed_load_blocks += len(failed)
        self.metrics.observe_job(job.is_store, time.monotonic() - job.submitted, job.copy_seconds,
                                 job.copied_bytes)
        session_jobs = self._jobs_of(session)
        slot = job.job_id % session.channel.slots
        if session_jobs.running.get(slot) is job:  # (a job posted by its copy thread may have a successor there)
            del session_jobs.running[slot]
        with self._landing:  # (decided under the lock: a copy thread may be posting it right now)
            if not job.posted:
                job.posted = True
                session.channel.post(job.job_id, len(job.ok) - len(failed), len(failed))
        session_jobs.results.append(JobResult(job.job_id, job.is_store, len(job.ok), failed, job.error))
        session_jobs.results_ready.set()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", _timeline(job))

    async def drain(self, timeout_s: float) -> bool:
        """The daemon stops: no job starts and no chunk not yet copying will; those copying finish and
        every job's completion is posted (the cancelled ones failed). False if copies still run after
        `timeout_s`: then no engine may be told, as they may still write into its memory."""
        self._draining = True
        for session_jobs in self._of.values():
            for job in session_jobs.running.values():
                for _, copying in job.chunks:
                    copying.cancel()  # (only one not started yet is cancelled)
        tasks = [task for session_jobs in self._of.values() for task in session_jobs.tasks]
        if not tasks:
            return True
        _, running = await asyncio.wait(tasks, timeout=timeout_s)
        return not running

    async def shutdown(self) -> None:
        """Seal what is queued (a restarted daemon can then verify it), then stop the threads.
        Recovered blocks not verified yet keep their headers: the next daemon verifies them."""
        self._draining = True
        await self.seals.drain()
        self.threads.close_copies()


class Expired(Exception):
    pass


def _check_expiry(job: Job) -> None:
    if job.expires_ns and time.monotonic_ns() >= job.expires_ns:
        raise Expired("expired: the client gave up on the job (the daemon was stalled past its deadline)")


def _mark_ok(job: Job, chunk: Chunk) -> None:
    """Every block of the chunk is done: in one slice when its keys are in order (a store's chunks
    were marked a block at a time: Python per block, on the loop, while the copies run)."""
    if chunk.in_order:
        first, n = chunk.indexes[0], len(chunk.indexes)
        job.ok[first:first + n] = [True] * n
    else:
        for i in chunk.indexes:
            job.ok[i] = True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # (cancelled: the daemon is stopping)
        future.set_result(None)


def _timeline(job: Job) -> str:
    """Where a finished job's time went, in ms after its submit (DEBUG log): what the daemon adds to
    its copies is the time before the first copy starts, between copies, and after the last one."""
    def ms(t: float) -> str:
        return f"{(t - job.submitted) * 1e3:.2f}"
    now = time.monotonic()
    what = f"job {job.job_id} {'store' if job.is_store else 'load'} of {len(job.keys)} blocks"
    if not job.copies:
        return f"{what}: no copy, published {ms(now)} ms after submit"
    starts, ends = sorted(s for s, _ in job.copies), sorted(e for _, e in job.copies)
    busy = sum(e - s for s, e in job.copies) * 1e3
    # (The arrival on the monotonic clock, which the client's process shares: its submit and wake-up.)
    return (f"{what}, {job.copied_bytes >> 20} MiB in {len(job.copies)} chunks; ms after submit: ordered "
            f"{ms(job.ordered)}, copies start {', '.join(map(ms, starts))}, end {', '.join(map(ms, ends))}; "
            f"published {ms(now)}; copy threads busy {busy:.2f} ms; submitted at {job.submitted:.6f}")
