"""Fault injection with real processes: engines and the daemon killed with SIGKILL mid-job.

The engines are torch-free workers (support.workers, also run by benchmarks/soak.py): random stores,
loads and lookups whose block contents derive from their keys, every loaded byte verified, every
completed store expected to hit later (nothing is evicted: the pools are large enough).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time

import pytest
from support.blocks import content_of, key_of
from support.daemon import DaemonProcess, completion_channels, engine_needles, references, shm_files, wait_for
from support.shm_engine import ShmEngine
from support.workers import Worker, WorkerConfig, collect, kill_mid_job, spawn_worker, wait_ready

from kvstore_client import KVStoreClient
from kvstore_client.protocol import memfd

KB = 1024


def test_engines_killed_mid_job_leave_nothing_behind(daemon_factory) -> None:
    """Ten engine processes are killed with SIGKILL one after another, jobs and leases in flight,
    while another engine keeps working: the daemon drops their sessions, leases, jobs, and lets go
    of their memory (their memfds vanish from its maps and fds; nothing was ever in /dev/shm); the
    survivor never sees a wrong byte nor loses a stored block."""
    daemon = daemon_factory(pool_size="128MiB").start()
    client = daemon.client()
    # 256 KiB blocks keep the daemon copying most of the time, so the kills land mid-job.
    survivor = Worker(WorkerConfig(daemon.socket, scope="survivor", read_scopes=("shared", "kill"), keys=96,
                                   block_bytes=256 * KB, jobs=1 << 62, seed=7))
    stop = threading.Event()
    thread = threading.Thread(target=survivor.run, args=(stop,))
    thread.start()
    mine = engine_needles([os.getpid()])
    assert references(daemon.proc.pid, mine), "the daemon's maps do not show the survivor's memory"
    in_flight: list[int] = []
    try:
        killed = kill_mid_job(daemon.socket, 10, random.Random(3), "--scope", "kill", "--keys", "48",
                              "--block-bytes", str(256 * KB), "--read-scopes", "shared,survivor",
                              before_kill=lambda: in_flight.append(max(client.stats().jobs_in_flight
                                                                       for _ in range(5))))
    finally:
        stop.set()
        thread.join(60)
    report = survivor.report
    assert any(in_flight), f"no kill landed while the daemon had jobs in flight: {in_flight}"

    # Only the survivor's session is left, with nothing pinned or running.
    assert wait_for(lambda: (lambda s: (s.engines, s.leases, s.jobs_in_flight) == (1, 0, 0))(client.stats())), \
        client.stats()
    assert wait_for(lambda: not references(daemon.proc.pid, engine_needles(killed)), timeout=10), \
        references(daemon.proc.pid, engine_needles(killed))
    assert completion_channels(daemon.proc.pid) == 1  # the survivor's
    assert not any(shm_files(pid) for pid in killed)

    assert report.corrupt == 0 and report.lost == 0, report
    assert report.stores > 0 and report.loaded_blocks > 0, report
    # Every block the survivor stored still loads byte-exact.
    stored = sorted(survivor.stored)[:32]
    done = survivor.engine.load(stored, list(range(len(stored))))
    assert done.blocks_ok == len(stored)
    assert survivor.engine.corrupt_blocks(stored, list(range(len(stored)))) == 0
    survivor.close()
    assert wait_for(lambda: client.stats().engines == 0)
    assert wait_for(lambda: not references(daemon.proc.pid, mine) and not completion_channels(daemon.proc.pid))
    assert client.stats().corrupt_blocks == 0


def test_daemon_killed_mid_traffic_restarts_on_its_pool(daemon_factory) -> None:
    """The daemon is killed with SIGKILL twice, with an engine's large store and load in flight, while
    an engine process stores and loads 64 KiB blocks around the kills. Restarted on the same pool
    file, it serves every block whose store completed and was sealed, byte-exact; a block torn by the
    kill is never served; the engines' sessions re-register on their own and work again. (A completed
    store survives a kill only once sealed: its slot header is written then, with its checksum. The
    worker counts every completed store it cannot find later as lost, so it is paused, SIGSTOP, while
    its blocks' seals finish before each kill, and resumed after the restart.)"""
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
        os.kill(worker.pid, signal.SIGSTOP)
        _sealed(daemon)
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
        _verified(daemon)  # (the worker would count a block not verified yet as lost)
        os.kill(worker.pid, signal.SIGCONT)

        done = session.wait([store_job, load_job], timeout=30)  # finished or failed, never lost
        if done[load_job].ok:
            assert engine.corrupt_blocks(durable[:16], load_ids) == 0
        assert wait_for(lambda: session.connected and session.registrations == 2, timeout=20)

        client = daemon.client()
        assert client.stats().blocks >= 32
        assert wait_for(lambda: session.lookup(durable)[0] == 32)  # (once verified)
        done_load = engine.load(durable, list(range(32, 64)))
        assert done_load.blocks_ok == 32 and engine.corrupt_blocks(durable, list(range(32, 64))) == 0
        # The store the kill interrupted (and never sealed, even if it reported success): each of
        # its blocks is whole or absent.
        present = [k for k in torn if session.lookup([k])[0] == 1]
        if present:
            ids = list(range(32, 32 + len(present)))
            assert engine.load(present, ids).blocks_ok == len(present)
            assert engine.corrupt_blocks(present, ids) == 0

        time.sleep(0.5)  # the worker works on the new daemon, then it is killed again
        os.kill(worker.pid, signal.SIGSTOP)
        _sealed(daemon)
        daemon.kill()
        daemon.start()
        _verified(daemon)  # (the worker would count a block not verified yet as lost)
        os.kill(worker.pid, signal.SIGCONT)
        assert wait_for(lambda: session.connected and session.registrations == 3, timeout=20)
        again = [key_of("after", i) for i in range(8)]
        assert engine.store(again, list(range(8))).ok
        assert engine.load(again, list(range(8, 16))).blocks_ok == 8
        assert engine.corrupt_blocks(again, list(range(8, 16))) == 0
        time.sleep(1.0)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        report = collect(worker, timeout=120)
    # The worker ran through both kills: its jobs in flight failed, nothing it read was wrong, every
    # block it stored was still there, and it worked again after re-registering.
    assert report["corrupt"] == 0 and report["lost"] == 0, report
    assert report["registrations"] >= 3 and report["connected"], report
    assert report["ok_after_reregister"] > 0 and report["loaded_blocks"] > 0, report
    assert daemon.client().stats().corrupt_blocks == 0
    engine.close()


def _hits(session, keys: list[bytes]) -> int:
    return sum(session.lookup([k])[0] for k in keys)


def _sealed(daemon) -> None:
    """Wait until no job runs and every stored block is sealed: from then on every completed store
    survives a daemon kill. Twice, a moment apart: a paused worker's last RPC may still be landing."""
    client = daemon.client()

    def settled() -> bool:
        stats = client.stats()
        return stats.unsealed_blocks == 0 and stats.jobs_in_flight == 0

    try:
        assert wait_for(settled, timeout=30)
        time.sleep(0.3)
        assert wait_for(settled, timeout=30)
    finally:
        client.close()


def _verified(daemon) -> None:
    """Wait until the restarted daemon verified every block it recovered (lookups miss them until then)."""
    client = daemon.client()
    try:
        assert wait_for(lambda: client.stats().unverified_blocks == 0, timeout=30)
    finally:
        client.close()


def _recovered(daemon, session, keys: list[bytes]) -> list[bytes]:
    """Of `keys`, all the pool held, those a restarted daemon serves once it verified every block it
    recovered (they stay unseen until then): the lookup hits, when they match its block count."""
    client = daemon.client()
    try:
        assert wait_for(lambda: session.connected and _hits(session, keys) == client.stats().blocks, timeout=20)
    finally:
        client.close()
    return [k for k in keys if session.lookup([k])[0]]


def test_completed_store_survives_a_daemon_kill_once_sealed(daemon_factory) -> None:
    """A slot gets its header only at the block's seal, with the checksum a restarted daemon verifies
    (seals wait for idle copy threads, after the store's completion). A daemon killed right after a
    large store completed may lose the blocks not sealed yet, each whole: a lost block is not served,
    a recovered one loads byte-exact. Once `unsealed_blocks` is 0, every block the engine was told is
    stored survives a kill."""
    daemon = daemon_factory(pool_size="128MiB").start()
    engine = ShmEngine.contiguous(daemon.socket, "sealed", 192, 512 * KB)
    session = engine.session
    try:
        keys = [key_of("sealed", i) for i in range(96)]
        assert engine.store(keys[:48], list(range(48))).ok  # 24 MiB
        daemon.kill()
        daemon.start()
        present = _recovered(daemon, session, keys[:48])
        assert engine.load(keys[:48], list(range(96, 144))).blocks_ok == len(present)
        ids = [96 + keys.index(k) for k in present]
        assert engine.corrupt_blocks(present, ids) == 0
        assert all(engine.read(96 + i) == bytes(512 * KB) for i, k in enumerate(keys[:48]) if k not in present)

        assert engine.store(keys, list(range(96))).ok  # what was lost, stored again, and 24 MiB more
        _sealed(daemon)
        daemon.kill()
        daemon.start()
        assert _recovered(daemon, session, keys) == keys, "a block whose store completed and was sealed is gone"
        assert engine.load(keys, list(range(96, 192))).blocks_ok == len(keys)
        assert engine.corrupt_blocks(keys, list(range(96, 192))) == 0
    finally:
        engine.close()


def test_deduplicated_store_waits_for_the_bytes_and_is_sealed(daemon_factory) -> None:
    """A store of a key that another store is still writing waits for that block's bytes
    (prepare_store reports it in flight; the job waits for that copy) and reports the block ok: a
    store's blocks are committed together once its last chunk lands, so the first store is done
    (posted before, by its last copy thread) when the second is. The block then loads byte-exact,
    and the first store's seal covers it: once the seals are done it survives a daemon kill."""
    daemon = daemon_factory(pool_size="256MiB").start()
    engine = ShmEngine.contiguous(daemon.socket, "dedupe", 200, 512 * KB)
    session = engine.session
    try:
        keys = [key_of("dedupe", i) for i in range(192)]
        engine.fill(keys, list(range(192)))
        first = session.store(keys, list(range(192)))  # ~96 MiB in 6 chunks
        second = session.store(keys[:1], [199])  # its first key again
        assert session.wait([second])[second].ok
        assert session.channel is not None and session.channel.check(first) is not None, \
            "the second store was reported before the first one's bytes landed"
        assert session.wait([first])[first].ok
        engine.zero([198])
        load = session.load(keys[:1], [198])
        assert session.wait([load])[load].ok and engine.corrupt_blocks(keys[:1], [198]) == 0
        _sealed(daemon)
        daemon.kill()
        daemon.start()
        assert _recovered(daemon, session, keys) == keys, "a sealed block is gone after a restart"
    finally:
        engine.close()


@pytest.mark.parametrize("which", ["kv-memory", "completion-channel"])
def test_engine_cannot_shrink_memory_the_daemon_maps(daemon, which: str) -> None:
    """The daemon maps memory an engine owns; if the engine could shrink it, the next copy (or
    completion) would touch pages past its end and SIGBUS would kill the daemon with every session.
    Both memfds are sealed: the engine's truncate fails, and the daemon goes on serving."""
    engine = ShmEngine.contiguous(daemon.socket, "truncate", 4, 4 * KB)
    session = engine.session
    assert session.channel is not None
    with pytest.raises(PermissionError):
        os.ftruncate(engine.fd if which == "kv-memory" else session.channel.fd, 0)
    keys = [key_of("t", 0)]
    assert engine.store(keys, [0]).ok
    assert engine.load(keys, [1]).blocks_ok == 1 and engine.corrupt_blocks(keys, [1]) == 0
    assert daemon.proc.poll() is None
    engine.close()


def test_parked_handshakes_cannot_lock_engines_out(tmp_path) -> None:
    """Every handshake on <socket>.cred parks its descriptors in the daemon for 30 s (TOKEN_TTL_S),
    with no limit on how many: one local client that handshakes in a loop and never registers fills
    the daemon's descriptor table. Then the descriptors of real engines are dropped on receipt
    (recv_fds ignores MSG_CTRUNC), Register fails ("needs 2 descriptors, got 0"; INTERNAL when the
    daemon cannot even import a module), and gRPC stops accepting connections. The daemon runs here
    with 256 descriptors so that 200 handshakes suffice."""
    daemon = DaemonProcess(str(tmp_path), "64MiB", "4MiB", max_open_files=256).start()
    try:
        for _ in range(200):
            fds = [memfd.create("kvstore-flood", 4096) for _ in range(2)]
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(5)
                    sock.connect(daemon.socket + ".cred")
                    socket.send_fds(sock, [os.urandom(16)], fds)
                    sock.recv(1)
            except OSError:
                pass  # refusing the flood is fine
            finally:
                for fd in fds:
                    os.close(fd)
        engine = ShmEngine.contiguous(daemon.socket, "after-flood", 4, 4 * KB, timeout=5)
        keys = [key_of("flood", 0)]
        assert engine.store(keys, [0]).ok
        engine.close()
    finally:
        daemon.cleanup()


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
