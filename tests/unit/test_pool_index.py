"""The pool and the index as plain Python objects (no daemon, no gRPC): slot reservation in bulk,
prefix lookups over packed keys, sealed headers that survive a re-attach and recovered blocks that
stay unseen until verified."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess

import pytest
from support.daemon import sealed_blocks

from kvstore_client.protocol import MAX_KEY
from kvstore_service import native
from kvstore_service.index import Block, BlockIndex, BlockState, Namespace
from kvstore_service.keys import KEYS_PER_UNPACK, unpack_keys
from kvstore_service.pool import Pool, SlotState

MB = 1 << 20
BLOCK = 256 * 1024


@pytest.fixture
def pool(tmp_path) -> Pool:
    p = Pool(str(tmp_path / "pool"), 4 * MB, MB, fresh=True)  # 4 segments of 3 slots of 256 KiB
    yield p
    p.close()


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def resident_pages(pool: Pool, segment: int) -> int:
    """Pages of one segment in memory (mincore)."""
    page = 4096
    size = pool.segment_size
    out = (ctypes.c_ubyte * (size // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(pool.base + pool.segments[segment].offset, size, out) == 0
    return sum(b & 1 for b in out)


@pytest.fixture
def shm_path() -> str:
    """A pool file in /dev/shm, where the daemon's lives (on tmpfs a page is resident once faulted in)."""
    path = f"/dev/shm/kvstore-test-pool-{secrets.token_hex(4)}"
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_a_new_pool_serves_its_first_segments_and_grows_as_the_rest_are_faulted_in(shm_path: str) -> None:
    """populate_first: the segments faulted in at once are the only ones handed out; `populate_next` faults
    the next ones in (their pages resident before they are usable) and `add_ready` adds them."""
    pool = Pool(shm_path, 8 * MB, MB, fresh=True, populate_first=3 * MB)
    try:
        per_segment = pool.slots_per_segment(BLOCK)
        assert (pool.ready_bytes, pool.capacity) == (3 * MB, 8 * MB)
        assert resident_pages(pool, 2) == MB // 4096 and resident_pages(pool, 3) == 0
        assert sum(len(slots) for _, slots in pool.allocate_many(BLOCK, 100)) == 3 * per_segment  # no more
        grown = pool.populate_next(4)
        assert sorted(grown) == [3, 4, 5, 6] and all(resident_pages(pool, s) == MB // 4096 for s in grown)
        assert resident_pages(pool, 7) == 0 and pool.ready_bytes == 3 * MB  # (not usable until added)
        pool.add_ready(grown)
        assert pool.ready_bytes == 7 * MB
        assert sum(len(slots) for _, slots in pool.allocate_many(BLOCK, 100)) == 4 * per_segment
        pool.add_ready(pool.populate_next(4))  # (one left)
        assert pool.ready_bytes == pool.capacity and not pool.unready
    finally:
        pool.close()
    again = Pool(shm_path, 8 * MB, MB, populate_first=MB)  # re-attached: all of it is there
    assert again.reattached and again.ready_bytes == again.capacity
    again.close()


def test_a_pool_that_cannot_grow_says_so_and_keeps_what_is_ready(tmp_path) -> None:
    """A shared-memory mount filled by others after the start: the next segments cannot be faulted in, and
    that is an OSError naming the pool (never a SIGBUS on a first touch); they stay unready."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; CI runs as root")
    mount = tmp_path / "shm"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "none", str(mount)], check=True)
    try:
        pool = Pool(str(mount / "pool"), 6 * MB, MB, fresh=True, populate_first=2 * MB)
        (mount / "other").write_bytes(b"x" * (5 * MB))  # another process's file takes the room
        with pytest.raises(OSError, match="pool .* faulting"):
            pool.populate_next(4)
        assert pool.ready_bytes == 2 * MB and len(pool.unready) == 4
        pool.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_allocate_many_spans_segments_and_stops_when_full(pool: Pool) -> None:
    per_segment = pool.slots_per_segment(BLOCK)
    taken = pool.allocate_many(BLOCK, per_segment + 1)
    assert [len(slots) for _, slots in taken] == [per_segment, 1]  # a full segment, then one slot of the next
    assert taken[0][0] is not taken[1][0]
    assert len(set(taken[0][1])) == per_segment
    more = pool.allocate_many(BLOCK, 100)
    assert sum(len(slots) for _, slots in more) == 4 * per_segment - per_segment - 1  # what is left, no more
    assert pool.allocate_many(BLOCK, 1) == []
    seg, slots = taken[0]
    pool.release(seg.index, slots[:1])
    assert pool.allocate_many(BLOCK, 5) == [(seg, [slots[0]])]


def reserve(index: BlockIndex, ns, keys: list[bytes]) -> list[Block]:
    plan = index.prepare_store(ns, keys)
    assert not plan.present and not plan.in_flight
    assert plan.reserved == list(range(len(plan.blocks)))
    return plan.blocks


def test_prepare_store_offsets_and_complete(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    blocks = reserve(index, ns, keys_of(5))
    assert [b.key for b in blocks] == keys_of(5) and len({b.ref for b in blocks}) == 5
    assert [b.offset for b in blocks] == [pool.payload_offset(b.ref) for b in blocks]
    assert [b.header for b in blocks] == [pool.header_offset(b.ref) for b in blocks]
    assert index.lookup(ns, b"".join(keys_of(5)), 32) == []  # WRITING: invisible
    index.clear(ns)  # (committed blocks only: nothing to drop)
    assert index.complete_store(blocks, ok=True) == blocks
    held = index.hold(blocks)
    assert held == blocks and all(b.pins == 1 for b in blocks)  # no slot reused while checksummed
    index.seal(held, [7] * 5)
    assert [b.checksum for b in blocks] == [7] * 5 and all(b.pins == 0 for b in blocks)
    assert index.lookup(ns, b"".join(keys_of(5)), 32) == blocks


def test_prepare_store_sorts_present_in_flight_and_new(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    done = reserve(index, ns, keys_of(2))
    index.complete_store(done, ok=True)
    writing = reserve(index, ns, keys_of(1, 5))
    plan = index.prepare_store(ns, [keys_of(2)[1], keys_of(1, 5)[0], keys_of(1, 6)[0]])
    assert plan.present == [0] and plan.in_flight == [(1, writing[0])] and plan.reserved == [2]
    assert plan.refused == 0


def test_failed_store_frees_its_slots(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    blocks = reserve(index, ns, keys_of(3))
    assert index.complete_store(blocks, ok=False) == [] and index.count == 0 and ns.blocks == 0
    assert len(reserve(index, ns, keys_of(3))) == 3


def test_prepare_store_evicts_then_refuses(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    capacity = 4 * pool.slots_per_segment(BLOCK)
    first = reserve(index, ns, keys_of(capacity, 1))
    assert len(first) == capacity
    full = index.prepare_store(ns, keys_of(2, 2))
    assert full.blocks == [] and full.refused == 2  # all WRITING: nothing to evict
    index.complete_store(first, ok=True)
    index.pin([first[0]])
    second = reserve(index, ns, keys_of(2, 3))
    assert len(second) == 2 and index.evictions == 2 and ns.counters.evictions == 2
    found = index.lookup(ns, first[0].key + first[1].key, 32)
    assert found == [first[0]]  # pinned skipped, LRU order


def test_a_store_into_a_full_pool_evicts_the_least_recently_used_past_the_held_ones(
        pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oldest blocks held for their seal stay; the store takes the next oldest, in LRU order,
    looking at each block once (one eviction at a time passed the held ones for every slot)."""
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    capacity = 4 * pool.slots_per_segment(BLOCK)
    first = reserve(index, ns, keys_of(capacity, 1))
    index.complete_store(first, ok=True)
    held = index.hold(first[:3])  # being sealed: pinned, their recency untouched
    looked: list[Block] = []
    evictable = index._evictable
    monkeypatch.setattr(index, "_evictable", lambda b: looked.append(b) or evictable(b))
    second = reserve(index, ns, keys_of(4, 2))
    assert len(second) == 4 and index.evictions == 4
    assert all(index.present(b) for b in held) and not any(index.present(b) for b in first[3:7])
    assert all(index.present(b) for b in first[7:])
    assert len(looked) == len(set(map(id, looked))) == 3  # the 3 held, once each (unpinned committed ones: inline)

    index.seal(held, None)


def test_a_store_of_another_block_size_empties_the_oldest_segments_it_needs(pool: Pool) -> None:
    """Segments hold one block size each: a namespace of another size takes whole segments, the
    least recently used first, and uses every slot of one before it empties the next."""
    index = BlockIndex(pool)
    small, big = index.namespace("small", BLOCK // 2), index.namespace("big", BLOCK)
    per_segment = pool.slots_per_segment(BLOCK // 2)
    old = reserve(index, small, keys_of(4 * per_segment, 1))
    index.complete_store(old, ok=True)
    index.pin(old[per_segment:2 * per_segment])  # the second segment's blocks: in use
    stored = reserve(index, big, keys_of(pool.slots_per_segment(BLOCK) + 1, 2))
    assert len(stored) == pool.slots_per_segment(BLOCK) + 1
    assert index.evictions == 2 * per_segment  # two segments: the first and the third
    assert [index.present(b) for b in old[::per_segment]] == [False, True, False, True]


def test_load_pins_and_drops_corrupt_blocks(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    blocks = reserve(index, ns, keys_of(3))
    index.complete_store(blocks, ok=True)
    found = index.prepare_load(ns, keys_of(3) + keys_of(1, 9))
    assert found == [*blocks, None] and all(b.pins == 1 for b in blocks)
    index.complete_load(blocks, corrupt=[blocks[1]])
    assert all(b.pins == 0 for b in blocks) and ns.counters.loaded_blocks == 2
    assert index.lookup(ns, b"".join(keys_of(3)), 32) == [blocks[0]]  # the corrupt one is gone
    assert index.count == 2


def test_block_removed_while_pinned_is_freed_at_last_unpin(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    blocks = reserve(index, ns, keys_of(1))
    index.complete_store(blocks, ok=True)
    index.pin(blocks)  # a lease
    index.prepare_load(ns, keys_of(1))
    index.complete_load(blocks, corrupt=blocks)  # DOOMED: still leased
    segment = pool.segments[blocks[0].segment]
    assert index.count == 0 and index.lookup(ns, keys_of(1)[0], 32) == [] and segment.used == 1
    index.unpin(blocks)  # the lease goes: now the slot is free
    assert segment.used == 0


def test_lookup_over_packed_keys(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    keys = keys_of(5)
    blocks = reserve(index, ns, keys)
    index.complete_store(blocks[:4], ok=True)
    assert index.lookup(ns, b"".join(keys), 32) == blocks[:4]  # the 5th is still being written
    assert index.lookup(ns, b"".join([keys[0], keys_of(1, 9)[0], keys[1]]), 32) == blocks[:1]
    assert index.lookup(ns, b"", 32) == []
    assert (ns.counters.hits, ns.counters.misses) == (5, 3)


def test_a_grouped_lookup_answers_vllms_hybrid_hit_and_returns_exactly_its_blocks(pool: Pool) -> None:
    """Keys of 3 groups per block (full attention, a 2-block window, a Mamba state): the hit is the longest
    every group serves, and only the blocks it needs are returned (to lease)."""
    index = BlockIndex(pool)
    ns = index.namespace("ns", 4096)
    keys = keys_of(3 * 6)  # blocks 0..5, [full, window, state] each
    present = [3 * i for i in range(6)] + [3 * 2 + 1, 3 * 3 + 1, 3 * 3 + 2, 3 * 5 + 2]  # windows 2-3, states 3, 5
    blocks = reserve(index, ns, [keys[k] for k in present])
    index.complete_store(blocks, ok=True)
    by_key = {b.key: b for b in blocks}
    hit, held = index.lookup_groups(ns, b"".join(keys), 32, [0, 2, 1])
    # A hit of 6 needs the state at block 5 (present) and the window's blocks 4, 5 (absent); of 4, the
    # window's 2, 3 and the state at 3: all there.
    assert hit == 4
    assert held == [by_key[keys[k]] for k in (0, 3, 6, 7, 9, 10, 11)]
    assert index.lookup_groups(ns, b"".join(keys[:6]), 32, [0, 2, 1]) == (0, [])  # no state at block 1
    assert index.lookup_groups(ns, b"", 32, [0, 2, 1]) == (0, [])


@pytest.mark.parametrize("count", [0, 1, KEYS_PER_UNPACK - 1, KEYS_PER_UNPACK, 3 * KEYS_PER_UNPACK + 5])
@pytest.mark.parametrize("key_size", [16, 32, 64])
def test_unpack_keys_in_batches_and_tail(count: int, key_size: int) -> None:
    keys = [bytes([i % 251]) * key_size for i in range(count)]
    assert list(unpack_keys(b"".join(keys), key_size)) == keys


def seal(pool: Pool, index: BlockIndex, blocks: list[Block]) -> list[int]:
    """What Jobs does at a seal: checksum the held blocks and write their headers."""
    held = index.hold(blocks)
    sums = native.checksum_blocks(pool.base, [b.offset for b in held], held[0].namespace.block_bytes)
    pool.write_headers([b.header for b in held], SlotState.SEALED, held[0].namespace.block_bytes,
                       pool.next_generation(), held[0].namespace.ns_hash, b"".join(b.key for b in held),
                       len(held[0].key), sums)
    index.seal(held, sums)
    return sums


def reattach(path: str) -> tuple[Pool, BlockIndex, Namespace]:
    """The pool file opened again by a restarted daemon, its index recovered from the headers."""
    pool = Pool(path, 4 * MB, MB)
    index = BlockIndex(pool)
    assert pool.reattached
    index.recover()
    return pool, index, next(iter(index.namespaces.values()))


def stored_and_reattached(tmp_path) -> tuple[Pool, BlockIndex, Namespace]:
    """Two blocks stored and sealed in namespace "ns", then the pool reattached (see reattach)."""
    path = str(tmp_path / "pool")
    pool = Pool(path, 4 * MB, MB, fresh=True)
    index = BlockIndex(pool)
    blocks = reserve(index, index.namespace("ns", BLOCK), keys_of(2))
    index.complete_store(blocks, ok=True)
    seal(pool, index, blocks)
    pool.close()
    return reattach(path)


def verify(pool: Pool, index: BlockIndex) -> int:
    """What Jobs does after a restart: checksum the recovered blocks; how many were dropped."""
    dropped = 0
    for blocks in index.recovered():
        held = index.hold(blocks)
        dropped += index.verify(held, native.checksum_blocks(pool.base, [b.offset for b in held], BLOCK))
    return dropped


def test_only_sealed_blocks_survive_reattach(tmp_path) -> None:
    """A slot's header is written at the block's seal, with its checksum: a block committed but not
    sealed when the daemon died has no header and is not recovered; nor is a STORED header (state 3)
    that daemons before verified restarts wrote without a checksum."""
    path = str(tmp_path / "pool")
    pool = Pool(path, 4 * MB, MB, fresh=True)
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    blocks = reserve(index, ns, keys_of(4))  # blocks[3]: bytes never all in
    index.complete_store(blocks[:3], ok=True)
    sums = seal(pool, index, blocks[1:2])  # blocks[0]: committed, not sealed
    legacy = blocks[2]
    pool.write_headers([legacy.header], 3, BLOCK, pool.next_generation(), ns.ns_hash, legacy.key, 32)
    assert [pool.read_header(b.ref) is not None for b in blocks] == [False, True, True, False]
    pool.close()
    assert [(h.key, h.checksum) for h, _ in sealed_blocks(path)] == [(blocks[1].key, sums[0])]
    again, recovered, ns2 = reattach(path)
    assert recovered.count == 1 and recovered.unverified_blocks == 1
    (found,) = recovered.recovered()[0]
    assert (found.key, found.checksum, found.state) == (blocks[1].key, sums[0], BlockState.RECOVERED)
    assert again.read_header(blocks[2].ref) is None  # the legacy header is invalidated, its slot free
    again.close()


def test_recovered_blocks_are_unseen_until_verified_and_dropped_if_altered(tmp_path) -> None:
    path = str(tmp_path / "pool")
    pool = Pool(path, 4 * MB, MB, fresh=True)
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    keys = keys_of(4)
    blocks = reserve(index, ns, keys)
    for n, block in enumerate(blocks):
        ctypes.memset(pool.base + block.offset, n + 1, BLOCK)
    index.complete_store(blocks, ok=True)
    seal(pool, index, blocks)
    pool.close()
    with open(path, "r+b") as f:  # the daemon is down: one byte of blocks 1 and 3 altered
        for block in (blocks[1], blocks[3]):
            f.seek(block.offset + 1000)
            f.write(b"\xff")
    again, recovered, ns2 = reattach(path)
    assert recovered.count == 4 and ns2.blocks == 4
    assert recovered.lookup(ns2, b"".join(keys), 32) == [] and (ns2.counters.hits, ns2.counters.misses) == (0, 4)
    assert recovered.prepare_load(ns2, keys) == [None] * 4
    assert verify(again, recovered) == 2
    assert recovered.unverified_blocks == 0 and recovered.count == 2
    assert [b.key for b in recovered.prepare_load(ns2, keys) if b is not None] == [keys[0], keys[2]]
    assert again.read_header(blocks[1].ref) is None and again.read_header(blocks[3].ref) is None
    again.close()
    _, third, ns3 = reattach(path)  # a later restart finds the good ones only
    assert third.count == 2 and verify(third.pool, third) == 0
    assert len(third.lookup(ns3, b"".join(keys[:1]), 32)) == 1
    third.pool.close()


def test_a_store_replaces_a_recovered_block_not_verified_yet(tmp_path) -> None:
    """A lookup missed the recovered block, so the engine stores it again: the new copy goes to a new
    slot and the recovered one is dropped, at once or, if it is being verified, when that ends."""
    again, recovered, ns2 = stored_and_reattached(tmp_path)
    old = recovered.recovered()[0]
    held = recovered.hold(old[1:])  # block 1 is being verified
    ns2 = recovered.namespace("ns", BLOCK)  # an engine registers the namespace
    plan = recovered.prepare_store(ns2, keys_of(2))
    assert plan.reserved == [0, 1] and old[1].ref not in {b.ref for b in plan.blocks}
    assert not recovered.present(old[0]) and not recovered.present(old[1])
    assert old[1].state is BlockState.DOOMED and again.segments[old[1].segment].used == 3  # held
    assert recovered.verify(held, [old[1].checksum]) == 0  # replaced meanwhile: not brought back
    assert again.segments[old[1].segment].used == 2 and recovered.count == 2 and recovered.unverified_blocks == 0
    recovered.complete_store(plan.blocks, ok=True)
    assert recovered.lookup(ns2, b"".join(keys_of(2)), 32) == plan.blocks
    again.close()


def test_recovered_blocks_are_evicted_and_cleared_unless_held(tmp_path) -> None:
    path = str(tmp_path / "pool")
    pool = Pool(path, 4 * MB, MB, fresh=True)
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    capacity = 4 * pool.slots_per_segment(BLOCK)
    blocks = reserve(index, ns, keys_of(capacity))
    index.complete_store(blocks, ok=True)
    seal(pool, index, blocks)
    pool.close()
    again, recovered, ns2 = reattach(path)
    held = recovered.hold(recovered.recovered()[0][:2])
    fresh = recovered.prepare_store(ns2, keys_of(2, tag=1))  # the pool is full: the oldest unheld go
    assert len(fresh.blocks) == 2 and recovered.evictions == 2 and held[0].state is BlockState.RECOVERED
    recovered.complete_store(fresh.blocks, ok=True)
    assert recovered.clear(ns2) == capacity - 2  # the held ones stay
    assert recovered.verify(held, [b.checksum for b in held]) == 0
    assert recovered.lookup(ns2, held[0].key + held[1].key, 32) == held
    again.close()


def test_slot_headers_hold_the_longest_key_the_protocol_allows() -> None:
    """The key limit is the protocol's; the slot header (the native engine's layout) must fit it."""
    assert native.SLOT_MAX_KEY == MAX_KEY


# -- TP shards: one slot per key holds every rank's part ---------------------------------------------


def test_a_sharded_block_is_visible_only_once_every_shard_is_in(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("tp2", BLOCK, shards=2)
    keys = keys_of(3)
    rank0 = index.prepare_store(ns, keys, shard=0)
    assert rank0.reserved == [0, 1, 2] and len({b.ref for b in rank0.blocks}) == 3
    rank1 = index.prepare_store(ns, keys, shard=1)  # joins the same slots
    assert rank1.reserved == [0, 1, 2] and rank1.blocks == rank0.blocks
    again = index.prepare_store(ns, keys[:1], shard=0)  # rank 0 again while its copy runs: wait for it
    assert again.in_flight == [(0, rank0.blocks[0])] and not again.blocks
    assert index.complete_store(rank0.blocks, ok=True, shard=0) == []  # rank 1's parts are missing
    assert index.lookup(ns, b"".join(keys), 32) == []
    assert index.prepare_store(ns, keys[:1], shard=0).present == [0]  # this part is in
    assert index.complete_store(rank1.blocks, ok=True, shard=1) == rank0.blocks
    assert index.lookup(ns, b"".join(keys), 32) == rank0.blocks
    assert index.count == 3 and ns.counters.stored_blocks == 3  # one block per key, not per rank


def test_a_group_missing_a_shard_is_evicted_and_cleared_but_never_seen(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("tp2", BLOCK, shards=2)
    partial = index.prepare_store(ns, keys_of(2, tag=1), shard=0).blocks
    index.complete_store(partial, ok=True, shard=0)  # rank 1 never stores these
    failed = index.prepare_store(ns, keys_of(1, tag=2), shard=1).blocks
    index.complete_store(failed, ok=False, shard=1)  # nothing of it is in: its slot is free at once
    assert index.count == 2
    # The pool fills up: the partial groups go first (oldest), complete ones are stored.
    capacity = 4 * pool.slots_per_segment(BLOCK)
    keys = keys_of(capacity, tag=3)
    for shard in (0, 1):
        plan = index.prepare_store(ns, keys, shard=shard)
        assert plan.refused == 0
        index.complete_store(plan.blocks, ok=True, shard=shard)
    assert index.evictions == 2 and index.count == capacity
    assert len(index.lookup(ns, b"".join(keys), 32)) == capacity
    # Clear drops a partial group too (no copy into it runs).
    index.clear(ns)
    partial = index.prepare_store(ns, keys_of(1, tag=4), shard=1).blocks
    index.complete_store(partial, ok=True, shard=1)
    joined = index.prepare_store(ns, keys_of(1, tag=4), shard=0).blocks  # a copy into it runs: kept
    assert index.clear(ns) == 0 and index.count == 1
    index.complete_store(joined, ok=True, shard=0)
    assert index.clear(ns) == 1 and index.count == 0


def test_a_sharded_group_is_sealed_and_recovered_as_one_block(tmp_path) -> None:
    """A group's slot gets its header at its seal, after its last part is in: a restarted daemon
    recovers whole groups only, verified over every part, and the engines' registration names the
    recovered namespace's shards."""
    path = str(tmp_path / "pool")
    pool = Pool(path, 4 * MB, MB, fresh=True)
    index = BlockIndex(pool)
    ns = index.namespace("tp2", BLOCK, shards=2)
    keys = keys_of(3)
    groups = index.prepare_store(ns, keys, shard=0).blocks
    index.prepare_store(ns, keys, shard=1)
    index.complete_store(groups, ok=True, shard=0)
    assert index.complete_store(groups[:2], ok=True, shard=1) == groups[:2]  # group 2 misses part 1
    seal(pool, index, groups[:2])
    pool.close()
    again, recovered, ns2 = reattach(path)
    assert ns2.shards == 0 and recovered.count == 2 and verify(again, recovered) == 0
    assert recovered.namespace("tp2", BLOCK, shards=2) is ns2 and ns2.shards == 2
    assert recovered.lookup(ns2, b"".join(keys), 32) == [ns2._committed[k] for k in keys[:2]]
    again.close()


def test_sharded_namespaces_keep_their_shard_count(pool: Pool) -> None:
    index = BlockIndex(pool)
    index.namespace("tp2", BLOCK, shards=2)
    with pytest.raises(ValueError, match="in 2 shard"):
        index.namespace("tp2", BLOCK, shards=4)


def test_tails_are_evicted_before_full_blocks(pool: Pool) -> None:
    """A prompt's partial last block serves only an exact repeat of the prompt: under pressure it goes
    before any full block, however recently used (benchmarks/bench_tails.py measured the policy)."""
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    capacity = 4 * pool.slots_per_segment(BLOCK)
    tail_keys = keys_of(2, tag=1)
    for key in tail_keys:  # two prompts: one full block and its tail each
        plan = index.prepare_store(ns, [b"full" + key[4:], key], tails=1)
        assert [b.tail for b in plan.blocks] == [False, True]
        index.complete_store(plan.blocks, ok=True)
    index.pin(index.lookup(ns, b"".join(tail_keys), 32))  # the tails are the most recently used...
    index.unpin(ns._committed[k] for k in tail_keys)
    fill = index.prepare_store(ns, keys_of(capacity - 4 + 2, tag=2))  # ... yet they go first
    assert fill.refused == 0 and index.evictions == 2
    index.complete_store(fill.blocks, ok=True)
    assert index.lookup(ns, b"".join(tail_keys), 32) == []
    assert all(b"full" + k[4:] in ns._committed for k in tail_keys)
