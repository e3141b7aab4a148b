"""No engine learns that a job ended while the daemon may still touch the job's blocks: the engine
reuses them at once (vLLM recomputes into a failed load's blocks, and frees a finished or preempted
request's). A stopping daemon finishes or cancels its copies before its sessions end; a job the
client gives up on (`give_up_s`) is never copied after it. The drained load and the jobs given up
on fail against the daemon before these rules (fb939e3): it told first and copied after."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.blocks import key_of
from support.daemon import wait_for
from support.shm_engine import ShmEngine

MB = 1 << 20
BLOCK_BYTES = 2 * MB


def _snapshot(engine: ShmEngine, blocks: range) -> bytes:
    return bytes(engine.mm[blocks.start * BLOCK_BYTES: blocks.stop * BLOCK_BYTES])


def _exited(daemon, timeout: float = 30.0) -> int:
    return daemon.proc.wait(timeout)


def test_a_stopping_daemon_finishes_a_load_before_the_engine_learns_it_ended(daemon_factory) -> None:
    daemon = daemon_factory(pool_size="1GiB", segment_size="64MiB").start()
    n = 320  # 640 MiB: SIGTERM arrives while it copies
    engine = ShmEngine.contiguous(daemon.socket, "drain", 2 * n, BLOCK_BYTES)
    try:
        keys = [key_of("drain", i) for i in range(n)]
        assert engine.store(keys, list(range(n))).ok
        targets = range(n, 2 * n)
        engine.zero(targets)
        job = engine.session.load(keys, list(targets))
        time.sleep(0.01)
        os.kill(daemon.pid, signal.SIGTERM)
        completion = engine.session.wait([job], timeout=30)[job]
        seen = _snapshot(engine, targets)  # what the engine has when it learns the load ended
        assert _exited(daemon) == 0
        assert _snapshot(engine, targets) == seen, "the daemon wrote into the engine after its load ended"
        # Chunks copying finished, those not started were cancelled (reported failed, never copied).
        assert completion.blocks_ok + completion.blocks_failed == n
        if completion.ok:
            assert engine.corrupt_blocks(keys, list(targets)) == 0
    finally:
        engine.close()


def test_a_stopping_daemon_finishes_a_store_before_the_engine_reuses_its_blocks(daemon_factory) -> None:
    daemon = daemon_factory(pool_size="1GiB", segment_size="64MiB").start()
    n = 320
    engine = ShmEngine.contiguous(daemon.socket, "drain", n, BLOCK_BYTES)
    try:
        keys = [key_of("drain-store", i) for i in range(n)]
        engine.fill(keys, range(n))
        job = engine.session.store(keys, list(range(n)))
        time.sleep(0.01)
        os.kill(daemon.pid, signal.SIGTERM)
        completion = engine.session.wait([job], timeout=30)[job]
        other = [key_of("reused", i) for i in range(n)]
        engine.fill(other, range(n))  # the engine reuses the blocks as soon as it learns the store ended
        assert _exited(daemon) == 0
        daemon.start()
        assert _reconnected(engine)
        client = daemon.client()
        assert wait_for(lambda: client.stats().unverified_blocks == 0, timeout=30)  # served once verified
        client.close()
        present = [k for k in keys if engine.session.lookup([k])[0]]
        if completion.ok:
            assert present == keys
        ids = list(range(len(present)))
        if present:
            assert engine.load(present, ids).ok
        assert engine.corrupt_blocks(present, ids) == 0, "the pool serves bytes the engine wrote after the store"
    finally:
        engine.close()


def _reconnected(engine: ShmEngine) -> bool:
    return wait_for(lambda: engine.session.connected, timeout=20)


@pytest.mark.parametrize("is_store", [False, True], ids=["load", "store"])
def test_a_job_given_up_on_is_never_copied_after(daemon, is_store: bool) -> None:
    """The daemon frozen (SIGSTOP) past the client's give-up, resumed after the engine reused the blocks:
    a load does not land on them, a store does not commit what the engine wrote there since."""
    engine = ShmEngine.contiguous(daemon.socket, "frozen", 8, 256 * 1024)
    session = engine.session
    try:
        keys = [key_of("frozen", i) for i in range(4)]
        if not is_store:
            assert engine.store(keys, [0, 1, 2, 3]).ok
        blocks = [4, 5, 6, 7]
        engine.fill(keys, blocks)  # a store's source; a load's target (any bytes)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            job = (session.store if is_store else session.load)(keys, blocks, give_up_s=1.0)
            with pytest.raises(TimeoutError):
                session.wait([job], timeout=1.0)  # the engine gives up and reuses the blocks
            reused = [key_of("reused", i) for i in range(4)]
            engine.fill(reused, blocks)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        completion = session.wait([job], timeout=15)[job]
        assert not completion.ok
        assert engine.corrupt_blocks(reused, blocks) == 0, "the daemon wrote into blocks the engine gave up"
        if is_store:
            assert session.lookup(keys)[0] == 0, "a store copied after its expiry was committed"
        assert daemon.alive()
    finally:
        engine.close()


def test_a_job_whose_submit_was_not_confirmed_stays_pending_until_it_is_surely_over(daemon) -> None:
    """A submit the daemon did not answer in time (frozen) is not reported failed while the daemon may
    still take it: it ends when the daemon posts it or, given up on, once its expiry passed."""
    engine = ShmEngine.contiguous(daemon.socket, "unconfirmed", 4, 256 * 1024, timeout=0.5)
    session = engine.session
    try:
        keys = [key_of("unconfirmed", i) for i in range(2)]
        engine.fill(keys, [0, 1])
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            waited = session.store(keys, [0, 1])  # no give-up: waits for the daemon's word
            given_up = session.store(keys, [2, 3], give_up_s=2.0)
            time.sleep(1.2)  # the submit's timeout (0.5 s) passed: the outcome is unknown
            assert not session.finished(waited) and not session.finished(given_up)
            assert session.wait([given_up], timeout=3)[given_up].blocks_failed  # surely over: failed
            assert not session.finished(waited)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert session.wait([waited], timeout=15)[waited].ok  # the daemon took it
        assert session.lookup(keys)[0] == 2
    finally:
        engine.close()
