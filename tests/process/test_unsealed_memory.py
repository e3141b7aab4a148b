"""KV memory in a memfd its owner can still shrink (SGLang's shared host pool is made so): the daemon
maps it guarded (kvstore_service/backends/cpu.py, csrc/guard.cpp). Blocks move byte-exact; an owner that
shrinks it under a copy fails its own jobs from then on, and the daemon, other engines and their blocks
live on."""

from __future__ import annotations

import os

import pytest
from support.blocks import key_of
from support.shm_engine import ShmEngine

BLOCK = 64 * 1024
REGIONS = [(0, BLOCK // 2, BLOCK // 2), (8 * BLOCK, BLOCK // 2, BLOCK // 2)]  # (two runs a block, far apart)


def test_blocks_move_byte_exact_through_an_unsealed_memfd(daemon) -> None:
    engine = ShmEngine(daemon.socket, "unsealed", 16, REGIONS, sealed=False)
    sealed = ShmEngine(daemon.socket, "unsealed", 16, REGIONS)
    try:
        keys = [key_of("unsealed", i) for i in range(8)]
        assert engine.store(keys, list(range(8))).ok
        assert engine.load(keys, list(range(8, 16))).ok
        assert engine.corrupt_blocks(keys, list(range(8, 16))) == 0
        # The same namespace and bytes as an engine whose memory the daemon maps.
        assert sealed.load(keys, list(range(8))).ok
        assert sealed.corrupt_blocks(keys, list(range(8))) == 0
    finally:
        engine.close()
        sealed.close()


@pytest.mark.parametrize("first", ["store", "load"])
def test_an_owner_that_shrinks_its_memory_fails_its_jobs_and_nothing_else(daemon, first: str) -> None:
    other = ShmEngine.contiguous(daemon.socket, "others", 8, BLOCK)
    engine = ShmEngine.contiguous(daemon.socket, "shrinks", 16, BLOCK, sealed=False)
    try:
        theirs = [key_of("others", i) for i in range(4)]
        assert other.store(theirs, [0, 1, 2, 3]).ok
        keys = [key_of("shrinks", i) for i in range(8)]
        assert engine.store(keys[:4], [0, 1, 2, 3]).ok
        engine.mm.close()
        os.ftruncate(engine.fd, 2 * BLOCK)  # blocks 2.. are gone from under the daemon
        # A copy past the end: the daemon's mapping faults there (SIGBUS), the guard maps zeros over it,
        # and the job fails (a store keeps nothing).
        job = (engine.session.store(keys[4:], [8, 9, 10, 11]) if first == "store"
               else engine.session.load(keys[:4], [8, 9, 10, 11]))
        assert not engine.session.wait([job], 10).popitem()[1].ok
        assert daemon.alive()
        assert daemon.client().lookup("shrinks", keys) == 4
        # Every job of that memory fails from then on, inside the new end too: the daemon no longer sees it.
        assert not engine.session.wait([engine.session.load(keys[:2], [0, 1])], 10).popitem()[1].ok
        assert os.fstat(engine.fd).st_size == 2 * BLOCK
        assert other.load(theirs, [4, 5, 6, 7]).ok
        assert other.corrupt_blocks(theirs, [4, 5, 6, 7]) == 0
    finally:
        engine.mm = None  # (closed above)
        engine.session.close()
        engine.client.close()
        os.close(engine.fd)
        other.close()
