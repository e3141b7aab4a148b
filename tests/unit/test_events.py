"""Routers' events of the pool and the disk, in process: the index tells BlockEvents what it commits and
removes, the disk tier what it writes and drops; a block is announced once committed (or written to disk)
and described, a watcher gets a reset and the announced blocks, then the changes, and one that falls
behind is reset, never queued without bound. The descriptions outlive the daemon in a journal."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore_service import event_journal
from kvstore_service.event_journal import HEADER, Journal
from kvstore_service.events import PENDING_S, BlockEvents, cost
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
    """(reset, events) of a stream's next `count` batches."""
    return [(b.reset, b.events) for b in await batches(stream, count)]


async def batches(stream, count: int) -> list:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(count)]


def test_a_block_is_announced_once_committed_and_described_and_removed_when_it_goes(index) -> None:
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                               is_committed=index.is_committed)
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


def test_one_eviction_across_namespaces_removes_each_ones_blocks_oldest_first(index) -> None:
    """A store into a full pool evicts the least recently used blocks of every namespace of its block
    size in one pass: a watcher sees its announced ones removed, oldest first; a block evicted before
    it was described is never announced afterwards."""
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                               is_committed=index.is_committed)
        size = 64 * 1024
        a, b, c = (index.namespace(name, size) for name in "abc")
        old_a, old_b = keys_of(2, 1), keys_of(2, 2)
        events.describe(a.ns_hash, old_a, [b"a0", b"a1"])
        store(index, a, old_a)
        store(index, b, old_b)
        store(index, c, keys_of(4 * index.pool.slots_per_segment(size) - 4, 3))  # the pool is full
        stream = events.watch(a.ns_hash, batch=10, closed=lambda: False)
        assert [(reset, [e.key for e in got]) for reset, got in await take(stream, 1)] == [(True, old_a)]
        assert len(store(index, c, keys_of(4, 4))) == 4 and index.evictions == 4
        assert not any(index.lookup(ns, b"".join(keys), 32) for ns, keys in ((a, old_a), (b, old_b)))
        (_, got), = await take(stream, 1)
        assert [(e.removed, e.key) for e in got] == [(True, old_a[0]), (True, old_a[1])]
        events.describe(b.ns_hash, old_b, [b"b0", b"b1"])  # too late: those blocks are gone
        assert await take(events.watch(b.ns_hash, batch=10, closed=lambda: False), 1) == [(True, [])]
        assert a.counters.evictions == b.counters.evictions == 2

    asyncio.run(scenario())


def test_a_new_watcher_gets_the_announced_blocks_in_commit_order(index) -> None:
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                               is_committed=index.is_committed)
        ns = index.namespace("ns", 64 * 1024)
        keys = keys_of(5)
        events.describe(ns.ns_hash, keys, [b"x"] * 5)
        store(index, ns, keys[3:])
        store(index, ns, keys[:3])
        stream = events.watch(ns.ns_hash, batch=2, closed=lambda: False)
        batches = await take(stream, 3)
        assert [reset for reset, _ in batches] == [True, False, False]
        assert [e.key for _, got in batches for e in got] == keys[3:] + keys[:3]

        # A reset's snapshot is made a batch at a time: a block removed while it streams is left out,
        # and its removal follows.
        late = events.watch(ns.ns_hash, batch=2, closed=lambda: False)
        (reset, first), = await take(late, 1)
        assert reset and [e.key for e in first] == keys[3:]
        events.removed(ns.ns_hash, keys[1:2])
        rest = await take(late, 3)
        assert [(e.key, e.removed) for _, got in rest for e in got] == [
            (keys[0], False), (keys[2], False), (keys[1], True)]

    asyncio.run(scenario())


def test_streams_that_send_the_same_changes_share_one_batch(index) -> None:
    """Caught-up streams of a namespace get a change in the same batch object, which the transport
    encodes once (servicer.WatchBlocks); a stream that is behind gets its own."""
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                            is_committed=index.is_committed)
        ns = index.namespace("ns", 64 * 1024)
        keys = keys_of(3)
        streams = [events.watch(ns.ns_hash, batch=10, closed=lambda: False) for _ in range(3)]
        for stream in streams:
            assert await take(stream, 1) == [(True, [])]
        events.describe(ns.ns_hash, keys, [b"d"] * 3)
        store(index, ns, keys[:2])
        (a,), (b,) = await batches(streams[0], 1), await batches(streams[1], 1)
        assert a is b and [e.key for e in a.events] == keys[:2]
        store(index, ns, keys[2:])
        (c,), (a2,) = await batches(streams[2], 1), await batches(streams[0], 1)
        assert c is not a and [e.key for e in c.events] == keys  # the third read both changes at once
        assert [e.key for e in a2.events] == keys[2:]

    asyncio.run(scenario())


def test_a_watcher_that_falls_behind_is_reset_and_descriptions_are_bounded(index) -> None:
    async def scenario() -> None:
        keys = keys_of(8)
        entry = cost(keys[0], b"ab")  # (a description's bytes, its key's and ENTRY_BYTES)
        events = index.events = BlockEvents(max_bytes=5 * entry, max_description_bytes=4, max_queue=3,
                                            is_committed=index.is_committed)
        ns = index.namespace("ns", 64 * 1024)
        stream = events.watch(ns.ns_hash, batch=100, closed=lambda: False)
        assert await take(stream, 1) == [(True, [])]
        events.describe(ns.ns_hash, keys[:1], [b"12345"])  # over --max-event-description-bytes: dropped
        events.describe(ns.ns_hash, keys[1:], [b"ab"] * 7)  # 5 fit: the 2 oldest not stored yet go
        assert (events.stats.dropped, events.stats.bytes) == (1, 5 * entry)
        store(index, ns, keys)  # 5 announced while the watcher reads nothing: over its queue of 3
        (reset, got), = await take(stream, 1)
        assert reset and [e.key for e in got] == keys[3:] and events.stats.resyncs == 1

    asyncio.run(scenario())


def test_descriptions_of_blocks_never_stored_expire_and_leave_nothing_behind(index) -> None:
    events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                        is_committed=index.is_committed)
    ns = index.namespace("ns", 64 * 1024)
    keys = keys_of(4)
    events.describe(ns.ns_hash, keys, [b"meta"] * 4)  # the stores never come (the session went, say)
    assert events.stats.bytes == 4 * cost(keys[0], b"meta")
    events.expire(time.monotonic() + PENDING_S / 2)
    assert events.stats.bytes == 4 * cost(keys[0], b"meta")  # (not yet)
    events.expire(time.monotonic() + PENDING_S + 1)
    assert events.stats.bytes == 0 and events._namespaces == {}  # the namespace's event state too
    store(index, ns, keys)  # committed later: nothing to announce, nothing kept
    assert events.stats.bytes == 0


def test_one_tenants_descriptions_of_blocks_never_stored_cannot_keep_anothers_out(index) -> None:
    """At the budget, the oldest description still waiting for its block goes first, in any namespace:
    another tenant's stored blocks are still announced."""
    async def scenario() -> None:
        noisy, quiet = index.namespace("team-a\x00ns", 64 * 1024), index.namespace("team-b\x00ns", 64 * 1024)
        keys, theirs = keys_of(8, tag=1), keys_of(2, tag=2)
        events = index.events = BlockEvents(max_bytes=8 * cost(keys[0], b"meta"), max_description_bytes=64,
                                            max_queue=100, is_committed=index.is_committed)
        events.describe(noisy.ns_hash, keys, [b"meta"] * 8)  # the budget full of stores that never come
        stream = events.watch(quiet.ns_hash, batch=100, closed=lambda: False)
        assert await take(stream, 1) == [(True, [])]
        events.describe(quiet.ns_hash, theirs, [b"meta"] * 2)
        store(index, quiet, theirs)
        (reset, got), = await take(stream, 1)
        assert not reset and [e.key for e in got] == theirs and events.stats.dropped == 0

    asyncio.run(scenario())


def seen(got: list) -> list[tuple[bool, bytes, bool]]:
    return [(e.removed, e.key, e.disk) for e in got]


def test_a_block_on_disk_is_announced_as_such_and_stays_announced_when_the_pool_drops_it(index) -> None:
    """The disk tier's blocks are a medium of their own (vLLM's STORAGE): announced once described and
    written there, kept while the pool evicts or clears its copy, removed when the disk drops them (a key
    at a time, or every block of a namespace at a clear)."""
    async def scenario() -> None:
        events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                            is_committed=index.is_committed)
        on_disk: set[bytes] = set()
        events.disk_holds = lambda ns_hash, keys: on_disk & set(keys)
        ns = index.namespace("ns", 64 * 1024)
        keys = keys_of(4)
        stream = events.watch(ns.ns_hash, batch=10, closed=lambda: False)
        assert await take(stream, 1) == [(True, [])]
        events.describe(ns.ns_hash, keys[:3], [b"d0", b"d1", b"d2"])
        store(index, ns, keys[:3])
        (_, got), = await take(stream, 1)
        assert seen(got) == [(False, k, False) for k in keys[:3]]

        on_disk.update(keys[:2])
        events.disk_changed([(ns.ns_hash, k, True) for k in keys[:2]] + [(ns.ns_hash, keys[3], True)])
        (_, got), = await take(stream, 1)  # (keys[3]: written but never described, so not announced)
        assert seen(got) == [(False, keys[0], True), (False, keys[1], True)] and got[0].description == b"d0"
        index.clear(ns)  # the pool's copies go; the disk's stay announced, with their descriptions
        (_, got), = await take(stream, 1)
        assert sorted(seen(got)) == [(True, k, False) for k in sorted(keys[:3])]
        late = events.watch(ns.ns_hash, batch=10, closed=lambda: False)
        (reset, got), = await take(late, 1)
        assert reset and seen(got) == [(False, keys[0], True), (False, keys[1], True)]

        on_disk.add(keys[3])  # on disk already when described: announced there at once
        events.describe(ns.ns_hash, keys[3:], [b"d3"])
        (_, got), = await take(stream, 1)
        assert seen(got) == [(False, keys[3], True)]
        events.disk_changed([(ns.ns_hash, keys[0], False)])  # reclaimed
        events.disk_changed([(ns.ns_hash, b"", False)])  # the namespace cleared on disk
        (_, got), = await take(stream, 1)
        assert seen(got) == [(True, keys[0], True), (True, keys[1], True), (True, keys[3], True)]
        assert events.stats.bytes == cost(keys[3], b"d3")  # (keys[3]'s pool description waits for its store)

    asyncio.run(scenario())


def test_a_restarted_daemon_announces_its_recovered_blocks_from_the_journal(index, tmp_path) -> None:
    """The descriptions are journaled beside the pool: the next daemon reads them back and announces a block
    on disk at once and one recovered in the pool once it is verified (committed), with no engine storing
    again. A record cut by a kill ends the read; the journal is rewritten with what is held."""
    async def scenario() -> None:
        path = str(tmp_path / "pool.events")
        ns = index.namespace("ns", 64 * 1024)
        keys = keys_of(4)
        before = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                             is_committed=index.is_committed, journal=Journal(path, MB))
        assert before.restore() == 0
        before.describe(ns.ns_hash, keys[:3], [b"d0", b"d1", b"d2"])
        before.describe(ns.ns_hash, keys[3:], [b"d3"])
        with open(path, "ab") as f:  # killed mid-write
            f.write(event_journal.encode([(ns.ns_hash, keys_of(1, 9)[0], b"cut")])[:-1])

        verified: set[bytes] = set()
        after = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                            is_committed=lambda ns_hash, key: key in verified, journal=Journal(path, MB))
        after.disk_holds = lambda ns_hash, held: {keys[2]} & set(held)
        assert after.restore() == 4
        stream = after.watch(ns.ns_hash, batch=10, closed=lambda: False)
        (reset, got), = await take(stream, 1)
        assert reset and seen(got) == [(False, keys[2], True)] and got[0].description == b"d2"
        verified.update(keys[:2])
        after.committed(ns.ns_hash, keys[:2])  # (what the index tells it as it verifies recovered blocks)
        (_, got), = await take(stream, 1)
        assert seen(got) == [(False, keys[0], False), (False, keys[1], False)]
        assert sorted(k for _, k, _ in Journal(path, MB).read(64)) == sorted(keys)  # (the cut record gone)

    asyncio.run(scenario())


def test_a_rewrite_runs_off_the_loop_and_keeps_what_was_appended_meanwhile(index, tmp_path, monkeypatch) -> None:
    """The journal thread reads the file back and keeps what is still held while the loop goes on describing:
    the new file holds both, each block once (though the file outgrew what a restart reads: the rewrite
    brings it back); a daemon that stops meanwhile keeps the old file, and no temp file is left."""
    monkeypatch.setattr(event_journal, "JOURNAL_SLACK", 0)
    path = tmp_path / "pool.events"
    events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                        is_committed=index.is_committed, journal=Journal(str(path), 1024))
    events.restore()
    ns = index.namespace("ns", 64 * 1024)
    keys = keys_of(40)
    events.describe(ns.ns_hash, keys, [b"old"] * 40)
    store(index, ns, keys)
    index.clear(ns)  # (gone: the file has outgrown what is held)
    events.describe(ns.ns_hash, keys[:2], [b"old", b"new"])  # (block 0's record twice in the file, block 1's stale)

    async def meanwhile(write, *args):  # the journal thread's turn: the loop describes more first
        events.describe(ns.ns_hash, keys[2:3], [b"late"])
        return await asyncio.to_thread(write, *args)

    asyncio.run(events.rewrite_journal(meanwhile))
    assert list(Journal(str(path), MB).read(64)) == [(ns.ns_hash, keys[0], b"old"), (ns.ns_hash, keys[1], b"new"),
                                                     (ns.ns_hash, keys[2], b"late")]
    before = path.read_bytes()
    events.describe(ns.ns_hash, keys[3:8], [b"more"] * 5)
    index.clear(ns)

    async def stopped(write, *args):  # the daemon stops while the thread writes
        events.journal.close()
        return await asyncio.to_thread(write, *args)

    asyncio.run(events.rewrite_journal(stopped))
    assert path.read_bytes().startswith(before) and not (tmp_path / "pool.events.tmp").exists()


def test_the_journal_is_rewritten_when_it_outgrows_what_is_held_and_ignores_what_is_not_its_own(
        index, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(event_journal, "JOURNAL_SLACK", 0)
    path = tmp_path / "pool.events"
    path.write_bytes(b"not a journal")
    events = index.events = BlockEvents(max_bytes=MB, max_description_bytes=64, max_queue=100,
                                        is_committed=index.is_committed, journal=Journal(str(path), MB))
    assert events.restore() == 0 and path.read_bytes() == HEADER  # (another file: not read, replaced)
    ns = index.namespace("ns", 64 * 1024)
    keys = keys_of(8)
    events.describe(ns.ns_hash, keys, [b"meta"] * 8)
    store(index, ns, keys)
    index.clear(ns)
    assert path.stat().st_size > len(HEADER) and events.stats.bytes == 0
    asyncio.run(events.rewrite_journal(asyncio.to_thread))  # (housekeeping) the file held only blocks gone
    assert path.read_bytes() == HEADER

    too_big = Journal(str(path), len(HEADER) - 1)
    assert list(too_big.read(64)) == []
    events.describe(ns.ns_hash, keys[:1], [b"meta"])
    path.chmod(0o622)  # writable by others (a planted file in /dev/shm, say): forged descriptions are not read
    assert list(Journal(str(path), MB).read(64)) == []
    path.chmod(0o600)
    assert list(Journal(str(path), MB).read(64)) == [(ns.ns_hash, keys[0], b"meta")]
