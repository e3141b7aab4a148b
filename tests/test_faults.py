"""Fault injection with real processes: engines and the daemon killed with SIGKILL mid-job.

The engines are torch-free workers from benchmarks/soak.py: random stores, loads and lookups whose
block contents derive from their keys, every loaded byte verified, every completed store expected
to hit later (nothing is evicted: the pools are large enough).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kvstore_client import KVStoreClient, KVStoreError  # noqa: E402
from soak import (  # noqa: E402
    ShmEngine,
    Worker,
    WorkerConfig,
    collect,
    content_of,
    engine_files,
    engine_needles,
    key_of,
    kill_mid_job,
    references,
    spawn_worker,
    wait_for,
    wait_ready,
)

KB = 1024


def test_engines_killed_mid_job_leave_nothing_behind(daemon) -> None:
    """Ten engine processes are killed with SIGKILL one after another, jobs and leases in flight,
    while another engine keeps working: the daemon drops their sessions, leases, jobs, mappings and
    shared-memory files; the survivor never sees a wrong byte nor loses a stored block."""
    client = daemon.client()
    survivor = Worker(WorkerConfig(daemon.socket, scope="survivor", read_scopes=("shared", "kill"), keys=128,
                                   block_bytes=16 * KB, jobs=1 << 62, seed=7))
    stop = threading.Event()
    thread = threading.Thread(target=survivor.run, args=(stop,))
    thread.start()
    in_flight: list[int] = []
    try:
        killed = kill_mid_job(daemon.socket, 10, random.Random(3), "--scope", "kill", "--keys", "64",
                              "--block-bytes", str(16 * KB), "--read-scopes", "shared,survivor",
                              before_kill=lambda: in_flight.append(client.stats().jobs_in_flight))
    finally:
        stop.set()
        thread.join(60)
    report = survivor.report
    assert sum(1 for n in in_flight if n) >= 5, f"too few kills landed while jobs ran: {in_flight}"

    # Only the survivor's session is left, with nothing pinned or running.
    assert wait_for(lambda: (lambda s: (s.engines, s.leases, s.jobs_in_flight) == (1, 0, 0))(client.stats())), \
        client.stats()
    assert wait_for(lambda: not any(engine_files(pid) for pid in killed), timeout=10), \
        [f for pid in killed for f in engine_files(pid)]
    assert references(daemon.proc.pid, engine_needles(killed)) == []

    assert report.corrupt == 0 and report.lost == 0, report
    assert report.stores > 0 and report.loaded_blocks > 0, report
    # Every block the survivor stored still loads byte-exact.
    stored = sorted(survivor.stored)[:32]
    done = survivor.engine.load(stored, list(range(len(stored))))
    assert done.blocks_ok == len(stored)
    assert survivor.engine.corrupt_blocks(stored, list(range(len(stored)))) == 0
    survivor.close()
    assert wait_for(lambda: client.stats().engines == 0)
    assert client.stats().corrupt_blocks == 0


def test_daemon_killed_mid_traffic_restarts_on_its_pool(daemon_factory) -> None:
    """The daemon is killed with SIGKILL twice while an engine process stores and loads 64 KiB blocks
    and another engine has a large store and a load in flight. Restarted on the same pool file, it
    serves every block whose store completed, byte-exact; a block torn by the kill is never served;
    the engines' sessions re-register on their own and work again."""
    daemon = daemon_factory(pool_size="160MiB").start()
    engine = ShmEngine.contiguous(daemon.socket, "restart", 96, 64 * KB)
    session = engine.session
    durable = [key_of("durable", i) for i in range(32)]
    assert engine.store(durable, list(range(32))).ok
    worker = spawn_worker(daemon.socket, "--until-eof", "--namespace", "restart", "--scope", "w", "--keys", "128",
                          "--block-bytes", str(64 * KB), "--read-scopes", "shared")
    try:
        wait_ready(worker)
        time.sleep(0.5)
        # In flight at the kill: a 3 MiB store and a load into other blocks.
        torn = [key_of("in-flight", i) for i in range(48)]
        engine.fill(torn, list(range(32, 80)))
        store_job = session.store(torn, list(range(32, 80)))
        load_ids = list(range(80, 96))
        engine.zero(load_ids)
        load_job = session.load(durable[:16], load_ids)
        time.sleep(0.002)
        daemon.kill()
        daemon.start()

        done = session.wait([store_job, load_job], timeout=30)  # finished or failed, never lost
        if done[load_job].ok:
            assert engine.corrupt_blocks(durable[:16], load_ids) == 0
        assert wait_for(lambda: session.connected and session.registrations == 2, timeout=20)

        client = daemon.client()
        assert client.stats().blocks >= 32
        assert session.lookup(durable)[0] == 32
        done_load = engine.load(durable, list(range(32, 64)))
        assert done_load.blocks_ok == 32 and engine.corrupt_blocks(durable, list(range(32, 64))) == 0
        # The store the kill interrupted: each of its blocks is whole or absent, and all are
        # present if it reported success.
        present = [k for k in torn if session.lookup([k])[0] == 1]
        if done[store_job].ok:
            assert present == torn
        if present:
            ids = list(range(32, 32 + len(present)))
            assert engine.load(present, ids).blocks_ok == len(present)
            assert engine.corrupt_blocks(present, ids) == 0

        time.sleep(0.5)  # the worker works on the new daemon, then it is killed again
        daemon.kill()
        daemon.start()
        assert wait_for(lambda: session.connected and session.registrations == 3, timeout=20)
        again = [key_of("after", i) for i in range(8)]
        assert engine.store(again, list(range(8))).ok
        assert engine.load(again, list(range(8, 16))).blocks_ok == 8
        assert engine.corrupt_blocks(again, list(range(8, 16))) == 0
        time.sleep(1.0)
    finally:
        report = collect(worker, timeout=120)
    # The worker ran through both kills: its jobs in flight failed, nothing it read was wrong, every
    # block it stored was still there, and it worked again after re-registering.
    assert report["corrupt"] == 0 and report["lost"] == 0, report
    assert report["registrations"] >= 3 and report["connected"], report
    assert report["ok_after_reregister"] > 0 and report["loaded_blocks"] > 0, report
    assert daemon.client().stats().corrupt_blocks == 0
    engine.close()


def test_completed_store_survives_an_immediate_daemon_kill(daemon_factory) -> None:
    """KVStore._run publishes a store's completion before it checksums the blocks and seals their
    slot headers (index.seal), and only sealed blocks are recovered: a daemon killed right after
    a large store completed comes back without the blocks the engine was told are stored."""
    daemon = daemon_factory(pool_size="128MiB").start()
    engine = ShmEngine.contiguous(daemon.socket, "sealed", 96, 512 * KB)
    session = engine.session
    try:
        keys = [key_of("sealed", i) for i in range(96)]
        assert engine.store(keys, list(range(96))).ok  # 48 MiB
        daemon.kill()
        daemon.start()
        assert wait_for(lambda: session.connected, timeout=20)
        present = sum(session.lookup([k])[0] for k in keys)
        assert present == len(keys), f"{len(keys) - present} of {len(keys)} completed blocks lost"
        assert engine.load(keys[:16], list(range(16))).blocks_ok == 16
        assert engine.corrupt_blocks(keys[:16], list(range(16))) == 0
    finally:
        engine.close()


def test_deduplicated_store_is_durable(daemon_factory) -> None:
    """A store of a key that another store is still writing reports the block ok at once
    (core.submit: `if self.index.contains(ns, key): job.ok[i] = True`), before the bytes are
    committed. Killing the daemon in that window loses a block whose store completed (and a copy
    error in the first job would too). Timing-dependent: the first job is made large, and the test
    skips if it never catches the window."""
    daemon = daemon_factory(pool_size="128MiB").start()
    engine = ShmEngine.contiguous(daemon.socket, "dedupe", 100, 512 * KB)
    session = engine.session
    try:
        for attempt in range(4):
            keys = [key_of(f"dedupe{attempt}", i) for i in range(96)]
            engine.fill(keys, list(range(96)))
            first = session.store(keys, list(range(96)))  # ~48 MiB to copy and checksum
            second = session.store(keys[-1:], [99])  # its last key again
            assert session.wait([second])[second].ok
            if session.channel is None or session.channel.check(first) is not None:
                session.wait([first])
                continue  # the first store had already finished: missed the window
            daemon.kill()
            daemon.start()
            assert wait_for(lambda: session.connected, timeout=20)
            assert session.lookup(keys[-1:])[0] == 1, "a block whose store completed is gone after a restart"
            return
        pytest.skip("the first store always finished before the second one")
    finally:
        engine.close()


@pytest.mark.parametrize("which", ["kv-memory", "completion-channel"])
def test_engine_truncating_its_files_cannot_crash_the_daemon(daemon, which: str) -> None:
    """The daemon maps files an engine owns; the engine can shrink them afterwards. The next copy
    (or completion) then touches pages past the end of the file: SIGBUS kills the daemon and every
    engine's session with it. A bad client must not take the daemon down."""
    engine = ShmEngine.contiguous(daemon.socket, "truncate", 4, 4 * KB)
    session = engine.session
    assert session.channel is not None
    os.truncate(engine.path if which == "kv-memory" else session.channel.path, 0)
    # From here on this process must not touch the truncated mapping either: results come by RPC.
    session.store([key_of("t", 0)], [0])
    deadline = time.monotonic() + 10
    finished = []
    while not finished and time.monotonic() < deadline and daemon.proc.poll() is None:
        try:
            finished = list(session.results(wait_ms=200).jobs)  # the job fails or succeeds
        except KVStoreError:
            break
    try:
        serving = daemon.client(timeout=5).health() == "SERVING"
    except KVStoreError:
        serving = False
    assert serving, f"the daemon died (exit {daemon.proc.wait(10)})"
    engine.close()


def test_closed_session_ends_its_attach_stream(daemon) -> None:
    """Session.close() unregisters, but the daemon keeps the Attach stream open (Servicer.Attach
    awaits only the daemon's own shutdown) and the client never cancels it: each closed session
    leaves a stream on the daemon and a blocked thread in the engine until the process exits."""
    client = KVStoreClient(daemon.socket)
    session = client.session("close")
    session.close()
    assert wait_for(lambda: not session._attach_thread.is_alive(), timeout=5), "the Attach stream is still open"
    client.close()


def test_worker_content_matches_key(daemon) -> None:
    """The workers' verification can fail: a block overwritten after its load counts as corrupt."""
    worker = Worker(WorkerConfig(daemon.socket, scope="self-check", jobs=60, seed=1))
    report = worker.run()
    assert report.corrupt == 0 and report.stores > 0
    key = sorted(worker.stored)[0]
    worker.engine.write(0, content_of(key, worker.config.block_bytes)[::-1])
    assert worker.engine.corrupt_blocks([key], [0]) == 1
    worker.close()
