"""The daemon's core as a spec, in process: sessions, leases and the job pipeline around a real pool
and index, with a fake device backend (engine memory in a plain buffer) and no gRPC."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import random
import re
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvstore_client.protocol import PROTOCOL_VERSION
from kvstore_client.protocol.completion import Completion, CompletionChannel
from kvstore_service import jobs as jobs_module
from kvstore_service import native, native_device
from kvstore_service import seals as seals_module
from kvstore_service.backends import Backend, Mapping, TransferPlan
from kvstore_service.backends.cpu import CpuBackend
from kvstore_service.chunks import CHUNK_BLOCKS, CHUNK_BYTES, TAIL_CHUNK_BYTES, Chunk, chunks, load_check
from kvstore_service.config import Config
from kvstore_service.daemon import Daemon
from kvstore_service.errors import KVError
from kvstore_service.index import Block
from kvstore_service.jobs import RESULTS_KEPT, Job, Jobs
from kvstore_service.peercred import PeerCred
from kvstore_service.registered_layout import Layout, Region
from kvstore_service.sessions import EngineSession, Registration, Session
from kvstore_service.threads import Threads

BLOCK = 64 << 10
NUM_BLOCKS = 32
SLOTS = 4096


class FakeBackend(Backend):
    """Engine memory is a buffer of ours; copies are the native engine's. `gate` holds copies back,
    `load_gate` only loads."""

    name = "fake"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.load_gate = threading.Event()
        self.load_gate.set()
        self.loads_waiting = 0  # copies that found load_gate closed
        self.copies_waiting = 0  # copies that found gate closed
        self.unmapped: list[Mapping] = []
        self.device_seconds = 0.0  # how long opening or closing engine memory takes (a device call)
        self.broken: native_device.StickyDeviceError | None = None  # raised by every copy once set
        self.loads: list[tuple[int, bool]] = []  # (bytes, whole) of each load plan copied

    def map(self, handle: bytes, size: int, device: int, fd: int | None) -> Mapping:
        time.sleep(self.device_seconds)
        buffer = (ctypes.c_char * size)()
        return Mapping(ctypes.addressof(buffer), size, handle=buffer)

    def unmap(self, mapping: Mapping) -> None:
        time.sleep(self.device_seconds)
        self.unmapped.append(mapping)

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        if not self.gate.is_set():
            self.copies_waiting += 1
        if to_engine and not self.load_gate.is_set():
            self.loads_waiting += 1
        assert self.gate.wait(10) and (not to_engine or self.load_gate.wait(10))
        if self.broken is not None:
            raise self.broken
        if to_engine:
            self.loads.append((plan.total_bytes, plan.progress is not None))
        CpuBackend.copy(self, mapping, pool_base, plan, to_engine)  # type: ignore[arg-type]  # (the native copy)


class Core:
    def __init__(self, tmp_path: Path, pool_blocks: int = 64, **settings: object) -> None:
        segment = 1 << 20
        per_segment = segment // (BLOCK + 4096)
        chosen = {"copy_threads": 2, "verify_loads": 0, "fresh": True, **settings}
        self.config = Config(pool_path=str(tmp_path / "pool"), pool_size=-(-pool_blocks // per_segment) * segment,
                             segment_size=segment, **chosen)
        self.backend = FakeBackend()
        self.fatal: list[native_device.StickyDeviceError] = []
        # The daemon's own composition (its constructor), with the fake device backend beside the cpu one.
        self.daemon = Daemon(self.config, self.fatal.append, Threads(self.config.copy_threads), {"fake": self.backend})
        self.pool, self.index, self.jobs, self.sessions = (self.daemon.pool, self.daemon.index, self.daemon.jobs,
                                                           self.daemon.sessions)
        self.channels: list[CompletionChannel] = []

    async def engine(self, namespace: str = "ns", regions: int = 1, slots: int = SLOTS) -> EngineSession:
        """An engine whose block b is BLOCK bytes at b * BLOCK, described as `regions` equal runs."""
        channel = CompletionChannel.create(slots)
        self.channels.append(channel)
        part = BLOCK // regions
        layout = Layout(NUM_BLOCKS, tuple(Region(r * part, BLOCK, part) for r in range(regions)))
        session = await self.sessions.register(
            Registration(PROTOCOL_VERSION, "engine", namespace, layout, "fake", (b"",), (NUM_BLOCKS * BLOCK,), 0,
                         slots),
            fds=[os.dup(channel.fd)])
        assert isinstance(session, EngineSession)
        return session

    async def lookup_session(self, namespace: str = "ns") -> Session:
        return await self.sessions.register(Registration(PROTOCOL_VERSION, "scheduler", namespace))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.daemon.threads.close()
        self.pool.close()


def run(tmp_path: Path, body: Callable[[Core], Awaitable[None]], **settings: object) -> None:
    core = Core(tmp_path, **settings)

    async def main() -> None:
        try:
            await body(core)
        finally:
            await core.jobs.shutdown()

    try:
        asyncio.run(main())
    finally:
        core.close()


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def memory(session: EngineSession) -> ctypes.Array[ctypes.c_char]:
    return session.mappings[0].handle  # type: ignore[return-value]


def fill(session: EngineSession, block_id: int, byte: int) -> None:
    ctypes.memset(session.mappings[0].base + block_id * BLOCK, byte, BLOCK)


def block_bytes(session: EngineSession, block_id: int) -> bytes:
    return bytes(memory(session)[block_id * BLOCK:(block_id + 1) * BLOCK])


async def wait_done(session: EngineSession, job_id: int) -> Completion:
    """The job's completion from the shared-memory channel, the loop running meanwhile."""
    for _ in range(2000):
        done = session.channel.check(job_id)
        if done is not None:
            return done
        await asyncio.sleep(0.005)
    raise AssertionError(f"job {job_id} never finished")


async def finish(jobs: Jobs, session: EngineSession, job_id: int, keys: list[bytes], block_ids: list[int],
                 is_store: bool) -> tuple[int, int]:
    """Submit a job and wait for its completion in the shared-memory channel, then for the daemon's
    bookkeeping of it (a completion may be posted before): (blocks ok, failed)."""
    jobs.submit(session, job_id, keys, block_ids, is_store)
    done = await wait_done(session, job_id)
    await jobs.settle(session)
    return done.blocks_ok, done.blocks_failed


# -- jobs -----------------------------------------------------------------------------------------


def test_store_then_load_into_other_blocks_is_byte_exact(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        writer, reader = await core.engine(), await core.engine()
        for b in range(8):
            fill(writer, b, 0x10 + b)
        assert await finish(core.jobs, writer, 1, keys_of(8), list(range(8)), True) == (8, 0)
        await asyncio.sleep(0.05)  # the seal runs after the completion
        assert await finish(core.jobs, reader, 1, keys_of(8), list(range(31, 23, -1)), False) == (8, 0)
        for b in range(8):
            assert block_bytes(reader, 31 - b) == bytes([0x10 + b]) * BLOCK
        assert block_bytes(reader, 0) == bytes(BLOCK)  # nothing outside the loaded blocks
        ns = writer.namespace
        assert (ns.counters.stored_blocks, ns.counters.loaded_blocks) == (8, 8)
        assert all(b.checksum is not None for b in core.index.prepare_load(ns, keys_of(8)))

    run(tmp_path, body)


def test_store_of_present_keys_copies_nothing_and_succeeds(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine = await core.engine()
        assert await finish(core.jobs, engine, 1, keys_of(4), [0, 1, 2, 3], True) == (4, 0)
        before = engine.namespace.counters.stored_blocks
        assert await finish(core.jobs, engine, 2, keys_of(4), [4, 5, 6, 7], True) == (4, 0)
        assert engine.namespace.counters.stored_blocks == before and core.index.count == 4

    run(tmp_path, body)


def test_a_finished_jobs_timeline_is_logged_at_debug(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Where a job's time went (what the daemon adds to its copies), for `bench_timeline.py`."""
    async def body(core: Core) -> None:
        engine = await core.engine()
        with caplog.at_level(logging.DEBUG, logger="kvstore_service.jobs"):
            before = time.monotonic()
            assert await finish(core.jobs, engine, 1, keys_of(8), list(range(8)), True) == (8, 0)
            after = time.monotonic()
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("job 1 store of 8 blocks"))
        found = re.search(r"in (\d+) chunks; ms after submit: ordered ([\d.]+), copies start ([\d., ]+), "
                          r"end ([\d., ]+); published ([\d.]+); copy threads busy ([\d.]+) ms; submitted at ([\d.]+)",
                          line)
        assert found, line
        n, ordered, published = int(found[1]), float(found[2]), float(found[5])
        starts, ends = ([float(t) for t in found[k].split(", ")] for k in (3, 4))
        assert len(starts) == len(ends) == n >= 1
        assert ordered <= min(starts) <= min(ends) <= max(ends) <= published
        assert before <= float(found[7]) <= after  # the monotonic clock, which clients share (bench_timeline.py)

    run(tmp_path, body)


def test_a_waiting_client_sleeps_until_the_daemon_posts() -> None:
    """wait_posted sleeps in the kernel (a futex on the channel's posts word) and wakes at the post,
    long before its timeout; a post it has not seen yet ends it at once."""
    client = CompletionChannel.create(8)
    daemon = CompletionChannel.attach(os.dup(client.fd), 8)  # the daemon's own mapping of the memfd
    try:
        seen = client.posts()
        poster = threading.Timer(0.2, daemon.post, (5, 3, 0))
        poster.start()
        started = time.monotonic()
        client.wait_posted(seen, 60.0)
        assert time.monotonic() - started < 30  # woken by the post, not by the timeout
        poster.join()
        assert client.check(5) == Completion(5, 3, 0) and client.posts() == seen + 1
        started = time.monotonic()
        client.wait_posted(seen, 60.0)  # posted since `seen`: no sleep
        assert time.monotonic() - started < 30
        # A job the client fails itself (a refusal, a lost daemon) wakes its waiters too, with no post.
        waker = threading.Timer(0.2, client.wake)
        waker.start()
        started = time.monotonic()
        client.wait_posted(client.posts(), 60.0)
        assert time.monotonic() - started < 30
        waker.join()
    finally:
        daemon.close()
        client.close()


def test_a_job_is_cut_so_every_copy_thread_starts_at_once_and_they_finish_together() -> None:
    def sizes(n: int, block_bytes: int, threads: int = 2) -> list[int]:
        parts = chunks(n, block_bytes, threads)
        assert [b for p in parts for b in p] == list(range(n))  # every block once, in order
        return [len(p) for p in parts]

    mib = 1 << 20
    assert sizes(16, 3 * mib) == [8, 8]  # a 2k-token prompt of the benchmark's model: one chunk per thread
    assert sizes(16, 3 * mib, threads=4) == [4, 4, 4, 4]
    assert sizes(1, 3 * mib) == [1]
    assert sizes(3, 64 << 10) == [3]  # smaller than a hand-off is worth: one chunk
    # The benchmark's job: a first chunk per thread (little planning before each starts), then the rest in
    # chunks of what is left over the threads, at most CHUNK_BYTES, which the threads take as they come
    # free: shrinking towards the end (to TAIL_CHUNK_BYTES), so that the threads finish together.
    assert sizes(2048, 256 << 10) == [256] * 7 + [128, 64, 32, 32] and CHUNK_BYTES == 64 << 20
    assert TAIL_CHUNK_BYTES == 32 * (256 << 10)
    # Small blocks: the block cap (CHUNK_BLOCKS) holds the loop's planning of one chunk.
    assert sizes(8192, 64 << 10) == [256, 256] + [1024] * 6 + [768, 384, 192, 128, 64] and CHUNK_BLOCKS == 1024
    assert sizes(512, 256 << 10) == [256, 256]  # a first chunk per thread is all: equal shares


def test_a_loads_checksum_sample_checks_each_block_with_the_share_asked() -> None:
    blocks = [Block(bytes([k]), None, 0, k, k * BLOCK, 0, checksum=k) for k in range(10)]  # type: ignore[arg-type]
    everything = load_check(blocks, BLOCK, 1.0)
    assert everything is not None and list(everything.positions) == list(range(10))
    assert list(everything.offsets) == [k * BLOCK for k in range(10)] and list(everything.expected) == list(range(10))
    random.seed(7)
    counts = [0] * 10
    draws = 20000
    for _ in range(draws):
        sample = load_check(blocks, BLOCK, 0.25)
        positions = [] if sample is None else list(sample.positions)
        assert positions == sorted(set(positions)) and all(0 <= p < 10 for p in positions)
        for p in positions:
            counts[p] += 1
    assert all(abs(c / draws - 0.25) < 0.02 for c in counts), counts  # every block, not just the first ones
    one_block = blocks[:1]  # a share below one block: checked with that chance
    assert abs(sum(load_check(one_block, BLOCK, 0.3) is not None for _ in range(draws)) / draws - 0.3) < 0.02


def test_a_load_up_to_the_backends_whole_load_bytes_goes_whole_to_one_copy_thread(tmp_path: Path) -> None:
    """(The CPU backend writes such a load with plain stores: the engine's next forward reads it.)"""
    async def body(core: Core) -> None:
        engine = await core.engine()
        core.backend.whole_load_bytes = 16 * BLOCK
        assert await finish(core.jobs, engine, 1, keys_of(32), list(range(32)), True) == (32, 0)
        assert await finish(core.jobs, engine, 2, keys_of(16), list(range(16, 32)), False) == (16, 0)
        assert core.backend.loads == [(16 * BLOCK, True)]
        core.backend.loads.clear()
        assert await finish(core.jobs, engine, 3, keys_of(32), list(range(32)), False) == (32, 0)
        assert sorted(core.backend.loads) == [(16 * BLOCK, False)] * 2  # in chunks over both copy threads
        core.backend.loads.clear()
        core.backend.whole_load_bytes = 32 * BLOCK  # the same job, now whole: one chunk, one thread
        assert await finish(core.jobs, engine, 4, keys_of(32), list(range(32)), False) == (32, 0)
        assert core.backend.loads == [(32 * BLOCK, True)]

    run(tmp_path, body)


def test_a_whole_load_reports_each_region_as_it_lands(tmp_path: Path) -> None:
    """A whole load is copied with the engine's completion channel as its progress word: the copy posts each
    region's arrival there (the vLLM connector lets a forward read it layer by layer; the order of the
    posts and the bytes is native.transfer's spec); a load copied in chunks reports only its completion."""
    async def body(core: Core) -> None:
        engine = await core.engine(regions=4)
        for b in range(8):
            ctypes.memset(engine.mappings[0].base + b * BLOCK, 0x30 + b, BLOCK)
        assert await finish(core.jobs, engine, 1, keys_of(8), list(range(8)), True) == (8, 0)
        core.backend.whole_load_bytes = 8 * BLOCK
        assert await finish(core.jobs, engine, 2, keys_of(8), list(range(16, 24)), False) == (8, 0)
        assert core.backend.loads == [(8 * BLOCK, True)]
        assert engine.channel.progress(2) == 4
        assert engine.channel.progress(2 + SLOTS) == 0  # the same slot, another job: not its progress
        assert all(block_bytes(engine, 16 + b) == bytes([0x30 + b]) * BLOCK for b in range(8))
        core.backend.whole_load_bytes = 0
        assert await finish(core.jobs, engine, 3, keys_of(8), list(range(24, 32)), False) == (8, 0)
        assert engine.channel.progress(3) == 0 and core.backend.loads[1:] == [(8 * BLOCK, False)]

    run(tmp_path, body)


def test_store_of_a_key_being_written_finishes_with_that_copy(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        a, b = await core.engine(), await core.engine()
        core.backend.gate.clear()
        core.jobs.submit(a, 1, keys_of(2), [0, 1], True)
        await asyncio.sleep(0.05)
        core.jobs.submit(b, 1, keys_of(2), [2, 3], True)  # same keys, while a's copy is held back
        await asyncio.sleep(0.05)
        assert a.channel.check(1) is None and b.channel.check(1) is None
        core.backend.gate.set()
        for session in (a, b):
            while session.channel.check(1) is None:
                await asyncio.sleep(0.005)
            assert session.channel.check(1).blocks_ok == 2  # type: ignore[union-attr]
        assert core.index.count == 2

    run(tmp_path, body)


def test_seals_yield_to_copies_and_shutdown_seals_what_is_queued(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        core.backend.copies_on_host = True  # (as the CPU backend's: on the shared copy threads, beside seals)
        engine = await core.engine()
        await finish(core.jobs, engine, 1, keys_of(2), [0, 1], True)
        await asyncio.sleep(0.05)
        assert all(b.checksum is not None for b in core.index.lookup(engine.namespace, b"".join(keys_of(2)), 32))
        core.backend.load_gate.clear()
        core.jobs.submit(engine, 2, keys_of(3, 1), [6, 7, 8], True)
        core.jobs.submit(engine, 3, keys_of(1), [4], False)  # copied after the store, held: a copy in flight
        while engine.channel.check(2) is None:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        stored = core.index.lookup(engine.namespace, b"".join(keys_of(3, 1)), 32)
        assert len(stored) == 3 and all(b.checksum is None for b in stored)  # the seal waits for the copy
        core.backend.load_gate.set()
        while engine.channel.check(3) is None:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert all(b.checksum is not None for b in stored)
        core.backend.load_gate.clear()
        core.jobs.submit(engine, 4, keys_of(2, 2), [9, 10], True)
        core.jobs.submit(engine, 5, keys_of(1), [4], False)
        while engine.channel.check(4) is None:
            await asyncio.sleep(0.005)
        core.backend.load_gate.set()
        await core.jobs.shutdown()  # seals what is queued
        assert all(b.checksum is not None for b in core.index.lookup(engine.namespace, b"".join(keys_of(2, 2)), 32))

    run(tmp_path, body)


def test_seals_run_beside_a_devices_copies(tmp_path: Path) -> None:
    """A device's copies are its DMA engines' and run on its own copy threads: a store's seal does
    not wait for them (on a GPU host it waited, and stores reached 0.2 of the bus until sealed)."""
    async def body(core: Core) -> None:
        engine = await core.engine()
        assert not core.backend.copies_on_host
        await finish(core.jobs, engine, 1, keys_of(1), [4], True)
        core.backend.load_gate.clear()
        core.jobs.submit(engine, 2, keys_of(3, 1), [6, 7, 8], True)
        core.jobs.submit(engine, 3, keys_of(1), [4], False)  # held: a device copy in flight
        stored = []
        for _ in range(60):  # (well within SEAL_DEFER_S, after which a seal waits no longer)
            await asyncio.sleep(0.005)
            stored = core.index.lookup(engine.namespace, b"".join(keys_of(3, 1)), 32)
            if len(stored) == 3 and all(b.checksum is not None for b in stored):
                break
        assert core.backend.loads_waiting == 1 and engine.channel.check(3) is None  # the load still held
        assert len(stored) == 3 and all(b.checksum is not None for b in stored)  # sealed meanwhile
        core.backend.load_gate.set()
        await wait_done(engine, 3)

    run(tmp_path, body)



def test_seals_and_verifications_checksum_a_batch_on_each_copy_thread_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store's blocks are sealed in batches (SEAL_BATCH_BYTES), one per copy thread at once, each on
    its thread: while some are checksummed the loop hands off the next, no thread waits for it. After
    a restart the recovered blocks are verified likewise."""
    running, most = 0, 0
    lock = threading.Lock()
    checksum_blocks = native.checksum_blocks

    def slow_checksums(*args: object) -> bytes:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        return checksum_blocks(*args)  # type: ignore[arg-type]

    async def store(core: Core) -> None:
        engine = await core.engine()
        assert await finish(core.jobs, engine, 1, keys_of(20), list(range(20)), True) == (20, 0)
        while core.jobs.unsealed_blocks:
            await asyncio.sleep(0.005)
        stored = core.index.lookup(engine.namespace, b"".join(keys_of(20)), 32)
        assert len(stored) == 20 and all(b.checksum is not None for b in stored)

    async def verify(core: Core) -> None:
        assert core.index.unverified_blocks == 20
        core.jobs.verify_recovered()
        while core.index.unverified_blocks:
            await asyncio.sleep(0.005)
        assert core.index.count == 20 and core.jobs.corrupt_blocks == 0

    monkeypatch.setattr(seals_module, "SEAL_BATCH_BYTES", 3 * BLOCK)  # 7 batches
    monkeypatch.setattr(native, "checksum_blocks", slow_checksums)
    run(tmp_path, store)
    assert most == 2  # --copy-threads 2
    most = 0
    run(tmp_path, verify, fresh=False)  # the same pool, re-attached
    assert most == 2


def test_pool_full_fails_the_blocks_that_got_no_slot(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine = await core.engine()
        capacity = len(core.pool.segments) * core.pool.slots_per_segment(BLOCK)
        lookup = await core.lookup_session()
        assert await finish(core.jobs, engine, 1, keys_of(capacity), list(range(capacity)), True) == (capacity, 0)
        await asyncio.sleep(0.05)
        hits, _ = core.sessions.lookup(lookup, "", b"".join(keys_of(capacity)), 32, True, 60_000)
        assert hits == capacity  # all leased: nothing can be evicted
        assert await finish(core.jobs, engine, 2, keys_of(3, 1), [0, 1, 2], True) == (0, 3)
        assert core.jobs.store_failures_pool_full == 3
        result = (await core.jobs.poll(engine, 0))[-1]
        assert result.failed == (0, 1, 2) and "pool full" in result.error

    run(tmp_path, body, pool_blocks=30)


def test_a_load_that_landed_whole_is_posted_by_its_copy_thread_before_the_loop_wakes(tmp_path: Path) -> None:
    """The engine sees a load done as its last chunk lands, while the loop is still busy; a client
    with one completion slot may submit its next job at once (the slot is free once posted)."""
    async def body(core: Core) -> None:
        engine = await core.engine(slots=1)
        await finish(core.jobs, engine, 1, keys_of(20), list(range(20)), True)
        await core.jobs.poll(engine, 0)
        for whole_load_bytes, copies in ((20 * BLOCK, 1), (0, 2)):  # a whole load; chunks on both threads
            core.backend.whole_load_bytes = whole_load_bytes
            core.backend.load_gate.clear()
            core.backend.loads_waiting = 0
            job = core.jobs.submit(engine, 2, keys_of(20), list(range(12, 32)), False)
            while job.copying != copies or core.backend.loads_waiting != copies:  # planned, copies at the gate
                await asyncio.sleep(0.001)
            core.backend.load_gate.set()
            deadline = time.monotonic() + 10
            while engine.channel.check(2) is None and time.monotonic() < deadline:
                time.sleep(0.001)  # the loop is held here: only a copy thread can post
            assert engine.channel.check(2) == Completion(2, 20, 0)
            assert job.posted and core.jobs._jobs_of(engine).running[0] is job  # its bookkeeping still to come
            core.jobs.submit(engine, 3, keys_of(2), [0, 1], False)  # the same slot: not refused
            assert await wait_done(engine, 3) == Completion(3, 2, 0)
            results = await core.jobs.poll(engine, 100)
            assert [(r.job_id, r.failed) for r in results] == [(2, ()), (3, ())]
            assert core.jobs.in_flight == 0

    run(tmp_path, body)


def test_a_store_that_landed_whole_is_posted_by_its_copy_thread_and_a_load_after_it_finds_it(tmp_path: Path) -> None:
    """The engine sees a store done as its last chunk lands, while the loop is still busy: the blocks
    are committed after the post, but the commit was queued on the loop first, so a load the engine
    submits once it sees the post finds every block."""
    async def body(core: Core) -> None:
        engine = await core.engine()
        core.backend.gate.clear()
        job = core.jobs.submit(engine, 1, keys_of(20), list(range(20)), True)
        deadline = time.monotonic() + 10
        while core.backend.copies_waiting != 2 and time.monotonic() < deadline:  # planned, both copies at the gate
            await asyncio.sleep(0.001)
        assert job.copying == 2
        core.backend.gate.set()
        deadline = time.monotonic() + 10
        while engine.channel.check(1) is None and time.monotonic() < deadline:
            time.sleep(0.001)  # the loop is held here: only a copy thread can post
        assert engine.channel.check(1) == Completion(1, 20, 0) and job.posted
        assert core.index.leading(engine.namespace, keys_of(20)) == 0  # not committed yet: the loop was held
        stored = [block_bytes(engine, b) for b in range(20)]
        core.jobs.submit(engine, 2, keys_of(20), list(range(12, 32)), False)
        assert await wait_done(engine, 2) == Completion(2, 20, 0)
        assert [block_bytes(engine, 12 + i) for i in range(20)] == stored

    run(tmp_path, body)


def test_a_load_missing_a_block_is_posted_by_the_loop(tmp_path: Path) -> None:
    """Only a load whose every block was found and landed intact is posted by its copy thread."""
    async def body(core: Core) -> None:
        engine = await core.engine()
        await finish(core.jobs, engine, 1, keys_of(2), [0, 1], True)
        core.backend.load_gate.clear()
        core.jobs.submit(engine, 2, [keys_of(2)[0], keys_of(1, 7)[0]], [5, 6], False)
        while core.backend.loads_waiting == 0:
            await asyncio.sleep(0.001)
        core.backend.load_gate.set()
        time.sleep(0.2)  # the loop held: the copy lands, nobody posts
        assert engine.channel.check(2) is None
        assert await wait_done(engine, 2) == Completion(2, 1, 1)

    run(tmp_path, body)


def test_load_of_an_absent_key_fails_that_block_only(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine = await core.engine()
        await finish(core.jobs, engine, 1, keys_of(2), [0, 1], True)
        keys = [keys_of(2)[0], keys_of(1, 7)[0], keys_of(2)[1]]
        assert await finish(core.jobs, engine, 2, keys, [5, 6, 7], False) == (2, 1)
        result = (await core.jobs.poll(engine, 0))[-1]
        assert result.failed == (1,) and result.error == "block not in the pool"

    run(tmp_path, body)


def test_corrupt_block_is_dropped_on_load_not_delivered(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine = await core.engine()
        fill(engine, 0, 0xAB)
        fill(engine, 1, 0xCD)
        await finish(core.jobs, engine, 1, keys_of(2), [0, 1], True)
        await asyncio.sleep(0.05)
        (victim,) = core.index.prepare_load(engine.namespace, keys_of(1))
        assert victim is not None
        core.index.complete_load([victim], [])
        ctypes.memset(core.pool.base + victim.offset, 0, 1)  # one byte flipped in the pool
        fill(engine, 5, 0x11)
        assert await finish(core.jobs, engine, 2, keys_of(2), [5, 6], False) == (1, 1)
        assert block_bytes(engine, 5) == bytes([0x11]) * BLOCK  # never overwritten with bad bytes
        assert block_bytes(engine, 6) == bytes([0xCD]) * BLOCK
        assert core.jobs.corrupt_blocks == 1 and core.index.count == 1

    run(tmp_path, body, verify_loads=1.0)


def test_submit_refuses_what_cannot_be_copied(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine = await core.engine()
        cases = [
            (keys_of(2), [0], "2 keys but 1 block ids"),
            ([], [], "at least one block"),
            (keys_of(1), [NUM_BLOCKS], f"block id {NUM_BLOCKS} is outside the registered cache"),
            (keys_of(1), [-1], "block id -1 is outside"),
            (keys_of(1), [2**70], f"block id {2**70} is outside"),
            (keys_of(1) * 2, [0, 1], "duplicate keys"),
        ]
        for keys, ids, words in cases:
            with pytest.raises(KVError, match=words):
                core.jobs.submit(engine, 1, keys, ids, True)
        with pytest.raises(KVError, match="duplicate block ids in one load"):
            core.jobs.submit(engine, 1, keys_of(2), [3, 3], False)
        assert await finish(core.jobs, engine, 2, keys_of(2, 9), [3, 3], True) == (2, 0)  # one block, two keys
        core.backend.gate.clear()
        core.jobs.submit(engine, 5, keys_of(1), [0], True)
        with pytest.raises(KVError, match="completion slot busy") as info:
            core.jobs.submit(engine, 5 + SLOTS, keys_of(1, 1), [1], True)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        core.backend.gate.set()

    run(tmp_path, body)


def test_finished_jobs_nobody_polls_keep_memory_flat(tmp_path: Path) -> None:
    """The Poll RPC's results are bounded and hold no keys or blocks: memory stays flat."""

    async def burst(core: Core, engine: EngineSession, first: int, n: int) -> None:
        for job_id in range(first, first + n):
            await finish(core.jobs, engine, job_id, keys_of(16, job_id % 200), list(range(16)), False)

    async def body(core: Core) -> None:
        engine = await core.engine()
        tracemalloc.start()
        await burst(core, engine, 0, RESULTS_KEPT)
        gc.collect()
        before = tracemalloc.take_snapshot()
        await burst(core, engine, RESULTS_KEPT, 2 * RESULTS_KEPT)
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        assert grown < 100_000, f"{grown} bytes more after {2 * RESULTS_KEPT} unpolled jobs"
        results = await core.jobs.poll(engine, 0)  # the newest RESULTS_KEPT, no more
        assert [r.job_id for r in results] == list(range(2 * RESULTS_KEPT, 3 * RESULTS_KEPT))
        assert all(r.failed == tuple(range(16)) for r in results)  # nothing was stored: every load failed
        assert await core.jobs.poll(engine, 0) == []

    run(tmp_path, body)


def test_a_finished_job_leaves_no_cycle_its_blocks_and_plans_are_freed_as_it_ends(tmp_path: Path) -> None:
    """A finished job's chunks, plans and blocks are freed by reference counting, not by the next
    collection: the daemon collects once a second, and a second of stores kept alive made the loop
    fault in fresh pages for every new block (serve.py, GC_YOUNG_THRESHOLD)."""
    async def body(core: Core) -> None:
        engine = await core.engine()
        gc.collect()
        gc.disable()
        try:
            assert await finish(core.jobs, engine, 1, keys_of(20), list(range(20)), True) == (20, 0)
            assert await finish(core.jobs, engine, 2, keys_of(20), list(range(12, 32)), False) == (20, 0)
            gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection would free, kept in gc.garbage to look at
            gc.collect()
            cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, Job | Chunk | Block)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert cyclic == []

    run(tmp_path, body)



def test_a_bug_while_planning_a_chunk_fails_its_blocks_and_leaves_none_being_written_or_pinned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A job of two chunks (16 + 4 blocks) whose second chunk's plan raises: the first is copied and
    completes, the second's blocks fail, and no slot is left being written (a later store of those
    keys would wait for it forever) nor any block pinned (never evictable again)."""
    def second_plan_fails(real: Callable[..., Chunk]) -> Callable[..., Chunk]:
        calls = 0

        def plan(*args: object) -> Chunk:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("a planning bug")
            return real(*args)
        return plan

    async def body(core: Core) -> None:
        engine = await core.engine()
        ns = engine.namespace
        assert chunks(20, BLOCK, 2) == [range(0, 16), range(16, 20)]
        with monkeypatch.context() as patched:
            patched.setattr(jobs_module, "plan_chunk", second_plan_fails(jobs_module.plan_chunk))
            assert await finish(core.jobs, engine, 1, keys_of(20), list(range(20)), True) == (16, 4)
        result = (await core.jobs.poll(engine, 0))[-1]
        assert result.failed == (16, 17, 18, 19) and result.error == "internal error: a planning bug"
        assert not ns._writing and len(ns._committed) == 16
        assert await finish(core.jobs, engine, 2, keys_of(20), list(range(20)), True) == (20, 0)

        with monkeypatch.context() as patched:
            patched.setattr(jobs_module, "plan_chunk", second_plan_fails(jobs_module.plan_chunk))
            assert await finish(core.jobs, engine, 3, keys_of(20), list(range(12, 32)), False) == (16, 4)
        assert [block.pins for block in ns._committed.values()] == [0] * 20
        assert core.index.clear(ns) == 20  # (a pinned block is not cleared)

    with caplog.at_level(logging.ERROR, logger="kvstore_service.jobs"):
        run(tmp_path, body)
    assert [r.getMessage() for r in caplog.records] == ["job 1: planning blocks 16-19 failed",
                                                        "job 3: planning blocks 16-19 failed"]


def test_a_bug_while_completing_a_chunk_fails_its_blocks_and_the_jobs_other_chunks_still_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A load of two chunks (16 + 4 blocks) whose first chunk's completion raises: the second's blocks
    are still let go, and no copy stays counted in flight (seals would wait SEAL_DEFER_S for it)."""
    async def body(core: Core) -> None:
        core.backend.copies_on_host = True  # (as the CPU backend's: on the shared copy threads, beside seals)
        engine = await core.engine()
        assert await finish(core.jobs, engine, 1, keys_of(20), list(range(20)), True) == (20, 0)
        await asyncio.sleep(0.05)
        real, calls = core.index.complete_load, 0

        def complete_load(blocks: list[Block], corrupt: list[Block]) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a completion bug")
            real(blocks, corrupt)

        monkeypatch.setattr(core.index, "complete_load", complete_load)
        # (Its bytes landed: its copy thread posted it before the loop's bookkeeping.)
        assert await finish(core.jobs, engine, 2, keys_of(20), list(range(12, 32)), False) == (20, 0)
        result = (await core.jobs.poll(engine, 0))[-1]
        assert result.failed == tuple(range(16)) and result.error == "internal error: a completion bug"
        blocks = core.index.lookup(engine.namespace, b"".join(keys_of(20)), 32)
        assert [block.pins for block in blocks[16:]] == [0] * 4
        assert await finish(core.jobs, engine, 3, keys_of(2, 1), [0, 1], True) == (2, 0)
        await asyncio.sleep(0.3)  # (< SEAL_DEFER_S)
        assert all(b.checksum is not None for b in core.index.lookup(engine.namespace, b"".join(keys_of(2, 1)), 32))

    with caplog.at_level(logging.ERROR, logger="kvstore_service.jobs"):
        run(tmp_path, body)
    assert [r.getMessage() for r in caplog.records] == ["job 2: completing blocks 0-15 failed"]

# -- sessions and leases --------------------------------------------------------------------------


def test_a_lookup_session_cannot_run_jobs(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        lookup = await core.lookup_session()
        assert type(lookup) is Session
        with pytest.raises(KVError, match="lookup-only") as info:
            core.sessions.engine(lookup)
        assert info.value.code == "FAILED_PRECONDITION"

    run(tmp_path, body)


def test_registration_refusals(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        with pytest.raises(KVError, match=f"this daemon speaks 2 to {PROTOCOL_VERSION}"):
            await core.sessions.register(Registration(PROTOCOL_VERSION + 1, "e", "ns"))
        with pytest.raises(KVError, match="namespace is empty"):
            await core.sessions.register(Registration(PROTOCOL_VERSION, "e", ""))
        with pytest.raises(KVError, match="needs 1 shared-memory descriptor"):
            one_block = Layout(1, (Region(0, BLOCK, BLOCK),))
            await core.sessions.register(Registration(PROTOCOL_VERSION, "e", "ns", one_block, "fake", (b"",), (BLOCK,),
                                                      0, 16))
        await core.engine("other")
        with pytest.raises(KVError, match="layout mismatch"):
            await core.sessions.register(Registration(PROTOCOL_VERSION, "e", "other",
                                                Layout(1, (Region(0, 2 * BLOCK, 2 * BLOCK),)), "fake", (b"",),
                                                (2 * BLOCK,), 0, 16), fds=[os.dup(core.channels[0].fd)])
        assert len(core.sessions.by_id) == 1

    run(tmp_path, body)


def test_max_sessions(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        await core.lookup_session()
        await core.lookup_session()
        with pytest.raises(KVError, match="already has 2 sessions") as info:
            await core.lookup_session()
        assert info.value.code == "RESOURCE_EXHAUSTED"

    run(tmp_path, body, max_sessions=2)


def test_a_lease_keeps_its_blocks_from_eviction_until_released(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine, scheduler = await core.engine(), await core.lookup_session()
        capacity = len(core.pool.segments) * core.pool.slots_per_segment(BLOCK)
        await finish(core.jobs, engine, 1, keys_of(4), [0, 1, 2, 3], True)
        await asyncio.sleep(0.05)
        hits, lease = core.sessions.lookup(scheduler, "", b"".join(keys_of(4)), 32, True, 60_000)
        assert hits == 4 and lease
        await finish(core.jobs, engine, 2, keys_of(capacity, 1), list(range(capacity)), True)  # evicts others
        assert core.sessions.lookup(scheduler, "", b"".join(keys_of(4)), 32, False, 0)[0] == 4
        core.sessions.release_lease(scheduler, lease)
        with pytest.raises(KVError, match="unknown or expired lease"):
            core.sessions.release_lease(scheduler, lease)
        await finish(core.jobs, engine, 3, keys_of(capacity, 2), list(range(capacity)), True)
        assert core.sessions.lookup(scheduler, "", b"".join(keys_of(4)), 32, False, 0)[0] == 0

    run(tmp_path, body, pool_blocks=30)


def test_leases_expire(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine, scheduler = await core.engine(), await core.lookup_session()
        await finish(core.jobs, engine, 1, keys_of(2), [0, 1], True)
        core.sessions.lookup(scheduler, "", b"".join(keys_of(2)), 32, True, 1)
        await asyncio.sleep(0.01)
        assert core.sessions.expire_leases() == 1 and core.sessions.lease_expiries == 1
        assert not scheduler.leases

    run(tmp_path, body)


def test_ending_a_session_waits_for_its_copies_then_unmaps(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine, scheduler = await core.engine(), await core.lookup_session()
        await finish(core.jobs, engine, 1, keys_of(2), [0, 1], True)
        core.sessions.lookup(scheduler, "", b"".join(keys_of(2)), 32, True, 60_000)
        core.backend.gate.clear()
        core.jobs.submit(engine, 2, keys_of(2), [4, 5], False)
        ending = asyncio.ensure_future(core.sessions.end(engine))
        await asyncio.sleep(0.05)
        assert not ending.done() and not core.backend.unmapped  # the load still uses the mapping
        core.backend.gate.set()
        await ending
        assert core.backend.unmapped == engine.mappings and engine.session_id not in core.sessions.by_id
        await core.sessions.end(scheduler)
        assert [b.pins for b in core.index.prepare_load(engine.namespace, keys_of(2)) if b] == [1, 1]  # ours only
        with pytest.raises(KVError, match="unknown or ended session"):
            core.sessions.get(scheduler.session_id)

    run(tmp_path, body)


def test_slow_device_calls_never_stall_other_sessions(tmp_path: Path) -> None:
    """Opening and closing an engine's memory (a device call: IPC open, torch's deleter syncing the
    device) runs off the event loop: another session's lookups keep answering meanwhile."""

    async def lookups_while(core: Core, scheduler: Session, work: asyncio.Future[object]) -> float:
        slowest = 0.0
        while not work.done():
            t0 = time.monotonic()
            core.sessions.lookup(scheduler, "", b"".join(keys_of(4)), 32, False, 0)
            await asyncio.sleep(0.01)
            slowest = max(slowest, time.monotonic() - t0)
        return slowest

    async def body(core: Core) -> None:
        engine, scheduler = await core.engine(), await core.lookup_session()
        await finish(core.jobs, engine, 1, keys_of(4), [0, 1, 2, 3], True)
        core.backend.device_seconds = 0.5
        started = time.monotonic()
        registering = asyncio.ensure_future(core.engine())
        assert await lookups_while(core, scheduler, registering) < 0.25
        second = registering.result()
        assert time.monotonic() - started >= 0.5 and isinstance(second, EngineSession)
        ending = asyncio.ensure_future(core.sessions.end(second))
        assert await lookups_while(core, scheduler, ending) < 0.25
        assert core.backend.unmapped == second.mappings

    run(tmp_path, body)


def test_every_limit_on_what_a_client_sends_is_enforced(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        with pytest.raises(KVError, match="namespace is 1025 bytes, more than --max-namespace-bytes 1024"):
            await core.lookup_session("n" * 1025)
        engine, scheduler = await core.engine(), await core.lookup_session()
        await finish(core.jobs, engine, 1, keys_of(1), [0], True)
        with pytest.raises(KVError, match="lease_ttl_ms 600001 is longer than --max-lease-ttl-s 600"):
            core.sessions.lookup(scheduler, "", keys_of(1)[0], 32, True, 600_001)
        for _ in range(3):
            core.sessions.lookup(scheduler, "", keys_of(1)[0], 32, True, 60_000)
        with pytest.raises(KVError, match="holds 3 leases .--max-leases-per-session 3.") as info:
            core.sessions.lookup(scheduler, "", keys_of(1)[0], 32, True, 60_000)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        peer = PeerCred(pid=1, uid=4242, gid=4242)
        for _ in range(2):
            await core.sessions.register(Registration(PROTOCOL_VERSION, "e", "ns", owner="uid:4242"), peer)
        with pytest.raises(KVError, match="uid:4242 already has 2 sessions .--max-sessions-per-uid 2.") as info:
            await core.sessions.register(Registration(PROTOCOL_VERSION, "e", "ns", owner="uid:4242"), peer)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        await core.sessions.register(Registration(PROTOCOL_VERSION, "e", "ns", owner="uid:4343"),
                                     PeerCred(pid=2, uid=4343, gid=1))

    run(tmp_path, body, max_leases_per_session=3, max_sessions_per_uid=2)


def test_empty_namespaces_without_sessions_are_forgotten(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine = await core.engine("full")
        await finish(core.jobs, engine, 1, keys_of(1), [0], True)
        idle = await core.engine("idle")
        await core.sessions.end(idle)
        used = await core.engine("used")
        assert core.index.forget_empty({engine.namespace, used.namespace}) == 1  # "idle" only
        assert core.index.find_namespace("idle") is None and core.index.find_namespace("used") is not None
        await core.sessions.end(engine)
        assert core.index.forget_empty(set()) == 1  # "used"; "full" keeps its block
        assert core.index.find_namespace("full") is not None

    run(tmp_path, body)


def test_a_sticky_device_error_fails_the_job_and_asks_the_daemon_to_restart(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        engine = await core.engine()
        core.backend.broken = native_device.StickyDeviceError("CUDA_ERROR_ILLEGAL_ADDRESS", 700, 0)
        assert await finish(core.jobs, engine, 1, keys_of(2), [0, 1], True) == (0, 2)
        assert [e.code for e in core.fatal] == [700]
        assert core.index.count == 0  # nothing half-stored stays

    run(tmp_path, body)


def test_a_registration_whose_caller_gives_up_completes_and_is_reaped(tmp_path: Path) -> None:
    """A slow device call outlives a Register RPC that timed out: the mapping is not leaked, the
    session (never attached) is reaped like any other and its memory unmapped."""

    async def body(core: Core) -> None:
        core.backend.device_seconds = 0.3
        registering = asyncio.ensure_future(core.engine())
        await asyncio.sleep(0.05)
        registering.cancel()
        await asyncio.sleep(0.5)
        (session,) = core.sessions.by_id.values()
        assert isinstance(session, EngineSession) and not session.attached
        core.backend.device_seconds = 0.0
        await core.sessions.reap_unattached()
        assert core.backend.unmapped == session.mappings and not core.sessions.by_id

    run(tmp_path, body, attach_timeout_s=0.1)


def test_lookup_rules(tmp_path: Path) -> None:
    async def body(core: Core) -> None:
        scheduler = await core.lookup_session("mine")
        with pytest.raises(KVError, match="only look up its own namespace"):
            core.sessions.lookup(scheduler, "theirs", b"", 32, False, 0)
        with pytest.raises(KVError, match="a lease needs a session"):
            core.sessions.lookup(None, "mine", b"", 32, True, 0)
        assert core.sessions.lookup(None, "nobody", keys_of(1)[0], 32, False, 0) == (0, b"")

    run(tmp_path, body)
