"""Ordering device copies against the engine, in the daemon's job pipeline (no GPU: a fake backend
whose "engine records" complete when the test says so, as CUDA IPC events do when the engine's
stream reaches them):

* a job's copies start only once the records pending when it arrived are done, and never wait for
  a record made after it arrived; a job naming its own record (order_seq) waits for that one only,
  not for a later record the engine made before the job arrived;
* the wait is on the event loop, not in a copy thread: another engine's jobs copy meanwhile;
* an engine that dies (its session ends) or stalls (past the deadline) fails only its own jobs, and
  its session's end is not held up by them;
* each device has its own copy threads: a slow copy on one GPU does not hold another GPU's jobs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_core import BLOCK, NUM_BLOCKS, SLOTS, Core, FakeBackend, block_bytes, fill, keys_of, run

from kvstore_client.client import Session
from kvstore_client.protocol import PROTOCOL_VERSION
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol.completion import CompletionChannel
from kvstore_service import native_device
from kvstore_service.backends import Mapping, TransferPlan
from kvstore_service.daemon import Daemon
from kvstore_service.errors import KVError
from kvstore_service.registered_layout import Layout, Region
from kvstore_service.servicer import Servicer
from kvstore_service.sessions import EngineSession, Registration


class RecordingBackend(FakeBackend):
    """Each mapping's engine has records (ints) that are pending until `done` holds them; a new
    record is pending as soon as it is made. Copies on a device in `slow` wait for `slow_gate`."""

    name = "fakegpu"

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[int, list[int]] = {}  # mapping base -> the engine's records so far
        self.done: set[int] = set()
        self.queries = 0
        self.query_error: RuntimeError | None = None
        self.copied: list[tuple[int, float]] = []  # (device, when)
        self.slow: set[int] = set()
        self.slow_gate = threading.Event()
        self.seqs: list[int] = []  # the order_seq of each job, as it arrived

    def map(self, handle: bytes, size: int, device: int, fd: int | None) -> Mapping:
        mapping = super().map(handle, size, device, fd)
        mapping.device = device
        self.records[mapping.base] = []
        return mapping

    def record(self, mapping: Mapping, name: int) -> None:
        self.records[mapping.base].append(name)

    def order_pending(self, mapping: Mapping, seq: int = 0) -> list[int]:
        self.seqs.append(seq)
        records = self.records[mapping.base]
        return self.order_waiting(mapping, [records[seq - 1]] if seq > 0 else list(records))

    def order_waiting(self, mapping: Mapping, pending: list[int]) -> list[int]:
        self.queries += 1
        if self.query_error is not None:
            raise self.query_error
        return [r for r in pending if r not in self.done]

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        if mapping.device in self.slow:
            assert self.slow_gate.wait(10)
        self.copied.append((mapping.device, time.monotonic()))
        super().copy(mapping, pool_base, plan, to_engine)


async def engine(core: Core, device: int = 0) -> EngineSession:
    channel = CompletionChannel.create(SLOTS)
    core.channels.append(channel)
    layout = Layout(NUM_BLOCKS, (Region(0, BLOCK, BLOCK),))
    session = await core.sessions.register(
        Registration(PROTOCOL_VERSION, "engine", "ns", layout, "fakegpu", (b"",), (NUM_BLOCKS * BLOCK,), device,
                     SLOTS), fds=[os.dup(channel.fd)])
    assert isinstance(session, EngineSession)
    return session


def with_backend(tmp_path: Path, body, **settings: object) -> None:  # type: ignore[no-untyped-def]
    backend = RecordingBackend()

    async def wrapped(core: Core) -> None:
        core.backend = backend
        core.sessions._backends["fakegpu"] = backend
        await body(core, backend)

    run(tmp_path, wrapped, **settings)


async def outcome(session: EngineSession, job_id: int, timeout: float = 5.0) -> tuple[int, int] | None:
    """(blocks ok, failed) once the job completes, None if it has not within `timeout`."""
    end = time.monotonic() + timeout
    while True:
        done = session.channel.check(job_id)
        if done is not None:
            return done.blocks_ok, done.blocks_failed
        if time.monotonic() >= end:
            return None
        await asyncio.sleep(0.002)


async def error_of(core: Core, session: EngineSession, job_id: int) -> str:
    """The error of a finished job, as the session's next poll reports it (that poll takes the results)."""
    return next(r.error for r in await core.jobs.poll(session, 0) if r.job_id == job_id)


def test_a_job_copies_once_the_records_before_it_are_done_and_not_a_later_one(tmp_path: Path) -> None:
    async def body(core: Core, backend: RecordingBackend) -> None:
        a = await engine(core)
        fill(a, 0, 0x5A)
        backend.record(a.mappings[0], 1)  # the step that writes block 0
        core.jobs.submit(a, 1, keys_of(1), [0], True)
        backend.record(a.mappings[0], 2)  # the next step, recorded after the job arrived: never done
        assert await outcome(a, 1, timeout=0.2) is None and backend.copied == []  # record 1 still runs
        backend.done.add(1)
        assert await outcome(a, 1) == (1, 0)  # record 2 is not waited for
        assert len(backend.copied) == 1
        assert await outcome(a, 2, timeout=0) is None
        # Records done before the job arrived: it copies at once, asking nothing more.
        backend.done.add(2)
        queries = backend.queries
        core.jobs.submit(a, 2, keys_of(1, tag=1), [0], True)
        assert await outcome(a, 2) == (1, 0) and backend.queries == queries + 1

    with_backend(tmp_path, body)


def test_a_job_naming_its_record_waits_for_it_and_not_for_a_later_pending_one(tmp_path: Path) -> None:
    """The engine recorded 1 (this step's forward), submitted a store and a load carrying order_seq 1,
    then recorded 2 (the next step's forward) before they reached the daemon: they copy once record 1
    is done, with record 2 still running. A job without a number (0) waits for both, as before."""
    async def body(core: Core, backend: RecordingBackend) -> None:
        a = await engine(core)
        fill(a, 0, 0x5A)
        backend.record(a.mappings[0], 1)
        backend.record(a.mappings[0], 2)  # made before the jobs arrive, never done here
        core.jobs.submit(a, 1, keys_of(1), [0], True, order_seq=1)
        core.jobs.submit(a, 2, keys_of(1, tag=1), [0], True)  # an older client: no number
        assert await outcome(a, 1, timeout=0.2) is None and backend.copied == []  # record 1 still runs
        backend.done.add(1)
        assert await outcome(a, 1) == (1, 0)  # record 2 is not waited for
        assert await outcome(a, 2, timeout=0.2) is None  # it is for the job without a number
        core.jobs.submit(a, 3, keys_of(1), [7], False, order_seq=1)  # a load after its step's record
        assert await outcome(a, 3) == (1, 0) and block_bytes(a, 7) == bytes([0x5A]) * BLOCK
        assert backend.seqs == [1, 0, 1] and await outcome(a, 2, timeout=0) is None
        backend.done.add(2)
        assert await outcome(a, 2) == (1, 0)

    with_backend(tmp_path, body)


def test_the_order_seq_travels_from_the_client_to_the_job() -> None:
    """Session.store/load -> TransferRequest.order_seq (on the wire) -> the server -> Daemon.submit ->
    Jobs.submit; a call without one sends 0."""
    got: list[tuple[bool, int]] = []  # (is_store, order_seq) as Jobs.submit receives them
    daemon = Daemon.__new__(Daemon)
    daemon.sessions = SimpleNamespace(engine=lambda session: session)  # type: ignore[assignment]

    def submit(engine: object, job_id: int, keys: list[bytes], block_ids: object, is_store: bool,
               partial_tail: bool = False, order_seq: int = 0, expires_ns: int = 0) -> Any:
        got.append((is_store, order_seq))
        return SimpleNamespace(job_id=job_id)

    daemon.jobs = SimpleNamespace(submit=submit)  # type: ignore[assignment]
    servicer = Servicer.__new__(Servicer)
    servicer._daemon = daemon
    servicer.tenancy = SimpleNamespace(check_session=lambda owner, context: None)  # type: ignore[assignment]
    daemon.session = lambda session_id: SimpleNamespace(owner=None)  # type: ignore[method-assign]

    def call(is_store: bool) -> Any:
        def rpc(request: pb.TransferRequest, timeout: float) -> pb.TransferResponse:
            wire = pb.TransferRequest.FromString(request.SerializeToString())
            return servicer.submit(wire, None, is_store)
        return rpc

    session = Session.__new__(Session)
    session.client = SimpleNamespace(stub=SimpleNamespace(Store=call(True), Load=call(False)),  # type: ignore[assignment]
                                     timeout=1.0, target="localhost:1")  # (TCP: gRPC, no <socket>.jobs)
    session.registrations = 1
    session.memory, session.session_id, session.slots = object(), b"s" * 16, 8  # type: ignore[assignment]
    session._job_ids, session._pending, session._done = itertools.count(1), {}, []
    session._lock, session._connected, session._submits = threading.Lock(), threading.Event(), queue.SimpleQueue()
    session._connected.set()
    session.store(keys_of(2), [0, 1], order_seq=7)
    session.load(keys_of(2), [2, 3], order_seq=8)
    session.store(keys_of(1), [4])  # an older caller: no record named
    session._submits.put(None)
    session._send_loop()
    assert got == [(True, 7), (False, 8), (True, 0)]


def test_the_wait_holds_no_copy_thread(tmp_path: Path) -> None:
    """One copy thread: engine A's job waits for A's step, engine B's jobs copy meanwhile."""
    async def body(core: Core, backend: RecordingBackend) -> None:
        a, b = await engine(core), await engine(core)
        backend.record(a.mappings[0], 1)
        core.jobs.submit(a, 1, keys_of(1), [0], True)
        fill(b, 3, 0x33)
        for job in range(1, 4):
            core.jobs.submit(b, job, keys_of(1, tag=10 + job), [3], True)
            assert await outcome(b, job) == (1, 0)
        assert await outcome(a, 1, timeout=0) is None
        backend.done.add(1)
        assert await outcome(a, 1) == (1, 0)

    with_backend(tmp_path, body, copy_threads=1)


def test_a_dead_engines_waiting_jobs_fail_and_its_session_ends(tmp_path: Path) -> None:
    """The engine died mid-step: its record never completes. Ending its session (its Attach stream
    closed) releases the wait at once; its memory is unmapped; the other engine keeps working."""
    async def body(core: Core, backend: RecordingBackend) -> None:
        dead, alive = await engine(core), await engine(core)
        backend.record(dead.mappings[0], 1)
        core.jobs.submit(dead, 1, keys_of(4), [0, 1, 2, 3], True)
        core.jobs.submit(dead, 2, keys_of(4, tag=1), [4, 5, 6, 7], False)
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await asyncio.wait_for(core.sessions.end(dead), timeout=2)
        assert time.monotonic() - started < 0.5, "the session's end waited for the dead engine's step"
        assert [m.base for m in backend.unmapped] == [dead.mappings[0].base]
        results = await core.jobs.poll(dead, 0)
        finished = {r.job_id: (r.blocks - len(r.failed), len(r.failed)) for r in results}
        assert finished == {1: (0, 4), 2: (0, 4)} and "session ended" in next(r.error for r in results if r.job_id == 1)
        assert backend.copied == []  # nothing of the dead engine's was copied
        fill(alive, 0, 0x11)
        core.jobs.submit(alive, 1, keys_of(1, tag=2), [0], True)
        assert await outcome(alive, 1) == (1, 0)
        core.jobs.submit(alive, 2, keys_of(1, tag=2), [9], False)
        assert await outcome(alive, 2) == (1, 0) and block_bytes(alive, 9) == bytes([0x11]) * BLOCK

    with_backend(tmp_path, body)


def test_a_stalled_engine_fails_its_job_at_the_deadline(tmp_path: Path) -> None:
    async def body(core: Core, backend: RecordingBackend) -> None:
        core.jobs.order_wait_s = 0.2
        a = await engine(core)
        backend.record(a.mappings[0], 1)
        core.jobs.submit(a, 1, keys_of(2), [0, 1], True)
        assert await outcome(a, 1, timeout=0.1) is None
        assert await outcome(a, 1, timeout=2) == (0, 2)
        assert "not done within 0.2 s" in await error_of(core, a, 1) and backend.copied == []
        assert core.index.prepare_load(a.namespace, keys_of(2)) == [None, None]  # nothing was stored

    with_backend(tmp_path, body)


def test_a_failed_query_fails_the_job_and_a_sticky_one_is_fatal(tmp_path: Path) -> None:
    async def body(core: Core, backend: RecordingBackend) -> None:
        a = await engine(core)
        backend.record(a.mappings[0], 1)
        backend.query_error = RuntimeError("cuEventQuery on the engine's event failed: CUDA_ERROR_X (400)")
        core.jobs.submit(a, 1, keys_of(1), [0], True)  # fails at arrival
        assert await outcome(a, 1) == (0, 1) and "(400)" in await error_of(core, a, 1)
        backend.query_error = None
        core.jobs.submit(a, 2, keys_of(1), [0], True)
        await asyncio.sleep(0.01)
        backend.query_error = native_device.StickyDeviceError("cuEventQuery failed (700)", 700, 0)  # while it polls
        assert await outcome(a, 2) == (0, 1)
        assert [e.code for e in core.fatal] == [700] and backend.copied == []

    with_backend(tmp_path, body)


def test_each_device_has_its_own_copy_threads(tmp_path: Path) -> None:
    """GPU 0's copies are stuck (slow DMA); GPU 1's jobs still copy, on GPU 1's own threads."""
    async def body(core: Core, backend: RecordingBackend) -> None:
        backend.slow = {0}
        gpu0, gpu1 = await engine(core, device=0), await engine(core, device=1)
        for job in (1, 2):
            core.jobs.submit(gpu0, job, keys_of(1, tag=job), [job], True)
        await asyncio.sleep(0.05)
        core.jobs.submit(gpu1, 1, keys_of(1, tag=9), [0], True)
        assert await outcome(gpu1, 1) == (1, 0)  # both of GPU 0's threads are busy
        assert await outcome(gpu0, 1, timeout=0) is None
        backend.slow_gate.set()
        assert await outcome(gpu0, 1) == (1, 0) and await outcome(gpu0, 2) == (1, 0)
        assert [d for d, _ in backend.copied] == [1, 0, 0]

    with_backend(tmp_path, body, copy_threads=2)


def test_device_memory_has_its_own_limit_per_device_and_the_host_limits_leave_it_out(tmp_path: Path) -> None:
    """Device KV caches map no host memory: --max-memory-per-uid and --max-session-memory (here below one
    engine's 2 MiB) do not refuse them; --max-device-memory counts the sessions on each device apart."""
    async def body(core: Core, backend: RecordingBackend) -> None:
        first, second = await engine(core, device=0), await engine(core, device=0)
        with pytest.raises(KVError, match=r"fakegpu device 0's sessions address 4194304 bytes already, with this "
                           r"layout's 2097152 more than --max-device-memory 4194304") as refused:
            await engine(core, device=0)
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert len(backend.unmapped) == 1  # (the refused registration's mapping was given back)
        other = await engine(core, device=1)
        assert {s.mappings[0].device for s in (first, second, other)} == {0, 1}

    with_backend(tmp_path, body, max_memory_per_uid=1 << 20, max_session_memory=1 << 20,
                 max_device_memory=4 << 20)
