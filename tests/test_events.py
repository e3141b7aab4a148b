"""Routers' events of the pool, in process: the index tells BlockEvents what it commits and removes; a
block is announced once committed and described, a watcher gets a reset and the announced blocks, then
the changes, and one that falls behind is reset, never queued without bound."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.blocks import key_of
from support.daemon import wait_for
from support.engine import Engine

from kvstore_service.events import BlockEvents
from kvstore_service.index import BlockIndex
from kvstore_service.pool import Pool

MB = 1 << 20


@pytest.fixture
def index(tmp_path) -> BlockIndex:
    pool = Pool(str(tmp_path / "pool"), 4 * MB, MB, fresh=True)
    yield BlockIndex(pool)
    pool.close()


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def store(index: BlockIndex, ns, keys: list[bytes]) -> list:
    blocks = index.prepare_store(ns, keys).blocks
    return index.complete_store(blocks, ok=True)


async def take(stream, count: int) -> list[tuple[bool, list]]:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(count)]


def test_a_block_is_announced_once_committed_and_described_and_removed_when_it_goes(index) -> None:
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100)
        ns = index.namespace("ns", 64 * 1024)
        keys = keys_of(4)
        events.describe(ns.ns_hash, keys[:2], [b"d0", b"d1"])  # described before the store commits
        closed = asyncio.Event()
        stream = events.watch(ns.ns_hash, batch=10, closed=closed.is_set)
        assert await take(stream, 1) == [(True, [])]  # a reset, and nothing announced yet
        blocks = store(index, ns, keys)
        (reset, got), = await take(stream, 1)
        assert not reset and [(e.removed, e.key, e.description) for e in got] == [(False, keys[0], b"d0"),
                                                                                 (False, keys[1], b"d1")]
        events.describe(ns.ns_hash, keys[2:3], [b"d2"])  # described after: announced then
        (_, got), = await take(stream, 1)
        assert [(e.removed, e.key) for e in got] == [(False, keys[2])]
        index.clear(ns)  # the announced ones are removed; keys[3] was never announced
        (_, got), = await take(stream, 1)
        assert sorted((e.removed, e.key) for e in got) == [(True, k) for k in keys[:3]]
        assert events.stats.bytes == 0 and len(blocks) == 4
        closed.set()
        with pytest.raises(StopAsyncIteration):  # within CLOSED_CHECK_S
            await asyncio.wait_for(anext(stream), 5)

    asyncio.run(scenario())


def test_a_new_watcher_gets_the_announced_blocks_in_commit_order(index) -> None:
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100)
        ns = index.namespace("ns", 64 * 1024)
        keys = keys_of(5)
        events.describe(ns.ns_hash, keys, [b"x"] * 5)
        store(index, ns, keys[3:])
        store(index, ns, keys[:3])
        stream = events.watch(ns.ns_hash, batch=2, closed=lambda: False)
        batches = await take(stream, 3)
        assert [reset for reset, _ in batches] == [True, False, False]
        assert [e.key for _, got in batches for e in got] == keys[3:] + keys[:3]

    asyncio.run(scenario())


def test_a_watcher_that_falls_behind_is_reset_and_descriptions_are_bounded(index) -> None:
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=10, max_description_bytes=4, max_queue=3)
        ns = index.namespace("ns", 64 * 1024)
        stream = events.watch(ns.ns_hash, batch=100, closed=lambda: False)
        assert await take(stream, 1) == [(True, [])]
        keys = keys_of(8)
        events.describe(ns.ns_hash, keys[:1], [b"12345"])  # over --max-event-meta-bytes: dropped
        events.describe(ns.ns_hash, keys[1:], [b"ab"] * 7)  # 5 fit in 10 bytes, 2 dropped
        assert (events.stats.dropped, events.stats.bytes) == (3, 10)
        store(index, ns, keys)  # 5 announced while the watcher reads nothing: over its queue of 3
        (reset, got), = await take(stream, 1)
        assert reset and len(got) == 5 and events.stats.resyncs == 1

    asyncio.run(scenario())


def test_engines_of_a_namespace_watch_the_blocks_one_of_them_stored(daemon) -> None:
    """Through the real daemon: A describes and stores; B, attached later, gets them in its reset; a clear
    removes them; B's stream ends with its session."""

    a = Engine(daemon.socket, "events-ns", 16, 64 * 1024)
    keys = [key_of("e", i) for i in range(6)]
    a.session.describe_blocks(keys, [b"desc-%d" % i for i in range(6)])
    a.fill(keys, list(range(6)))
    job = a.session.store(keys, list(range(6)))
    assert a.session.wait([job])[job].ok
    b = Engine(daemon.socket, "events-ns", 16, 64 * 1024)
    got: list = []
    stop = threading.Event()

    def watch() -> None:
        for reset, events in b.session.watch_blocks(stop):
            got.append((reset, events))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert wait_for(lambda: sum(len(e) for _, e in got) >= 6, timeout=10)
    assert got[0][0] and [(r, k, d) for _, e in got for r, k, d in e] == [
        (False, k, b"desc-%d" % i) for i, k in enumerate(keys)]
    assert daemon.client().clear("events-ns") == 6
    assert wait_for(lambda: sum(len(e) for _, e in got) >= 12, timeout=10)
    assert sorted(k for _, e in got for removed, k, _ in e if removed) == sorted(keys)
    stats = daemon.client().stats()
    assert stats.events.sent >= 12 and stats.events.bytes == 0
    stop.set()
    b.close()  # the session ends: so does its stream
    thread.join(timeout=10)
    assert not thread.is_alive()
    a.close()
