"""The pool and the index as plain Python objects (no daemon, no gRPC): slot reservation in bulk,
prefix lookups over packed keys, headers that survive a re-attach."""

from __future__ import annotations

import pytest

from kvstore_service.index import KEYS_PER_UNPACK, BlockIndex, unpack_keys
from kvstore_service.pool import SEALED, STORED, Pool, SlotRef, sealed_blocks

MB = 1 << 20
BLOCK = 256 * 1024


@pytest.fixture
def pool(tmp_path) -> Pool:
    p = Pool(str(tmp_path / "pool"), 4 * MB, MB, fresh=True)  # 4 segments of 3 slots of 256 KiB
    yield p
    p.close()


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


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
    pool.release(SlotRef(seg.index, slots[0]))
    assert pool.allocate_many(BLOCK, 5) == [(seg, [slots[0]])]


def test_begin_stores_offsets_and_commit(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    blocks = index.begin_stores(ns, keys_of(5))
    assert [b.key for b in blocks] == keys_of(5) and len({b.ref for b in blocks}) == 5
    assert [b.offset for b in blocks] == [pool.payload_offset(b.ref) for b in blocks]
    assert [b.header for b in blocks] == [pool.header_offset(b.ref) for b in blocks]
    assert all(index.by_segment[b.segment][b.slot] is b for b in blocks)
    index.drop(blocks[1])  # dropped while it was written: commit leaves it out
    assert index.commit(blocks) == [blocks[0]] + blocks[2:]
    assert set(ns.entries) == {b.key for b in blocks} - {blocks[1].key} and not ns.writing
    assert list(index.lru[BLOCK]) == [blocks[0]] + blocks[2:]  # oldest first


def test_begin_stores_evicts_then_reports_full(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    capacity = 4 * pool.slots_per_segment(BLOCK)
    first = index.begin_stores(ns, keys_of(capacity, 1))
    assert len(first) == capacity
    assert index.begin_stores(ns, keys_of(2, 2)) == []  # all WRITING: nothing to evict
    index.commit(first)
    index.pin(first[0])
    second = index.begin_stores(ns, keys_of(2, 3))
    assert len(second) == 2 and index.evictions == 2
    assert index.present(first[0]) and not index.present(first[1])  # pinned skipped, LRU order


def test_prefix_over_packed_keys(pool: Pool) -> None:
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    keys = keys_of(5)
    blocks = index.begin_stores(ns, keys)
    index.commit(blocks[:4])
    assert index.prefix(ns, b"".join(keys), 32) == blocks[:4]  # the 5th is still being written
    assert index.prefix(ns, b"".join([keys[0], keys_of(1, 9)[0], keys[1]]), 32) == blocks[:1]
    assert index.prefix(ns, b"", 32) == []


@pytest.mark.parametrize("count", [0, 1, KEYS_PER_UNPACK - 1, KEYS_PER_UNPACK, 3 * KEYS_PER_UNPACK + 5])
@pytest.mark.parametrize("key_size", [16, 32, 64])
def test_unpack_keys_in_batches_and_tail(count: int, key_size: int) -> None:
    keys = [bytes([i % 251]) * key_size for i in range(count)]
    assert list(unpack_keys(b"".join(keys), key_size)) == keys


def test_headers_survive_reattach(tmp_path) -> None:
    path = str(tmp_path / "pool")
    pool = Pool(path, 4 * MB, MB, fresh=True)
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    blocks = index.begin_stores(ns, keys_of(3))
    stored, sealed = blocks[0], blocks[1]  # blocks[2]: bytes never all in, header never written
    for state, block, checksum in ((STORED, stored, None), (SEALED, sealed, [1234])):
        pool.write_headers([block.header], state, BLOCK, pool.next_generation(), ns.ns_hash, block.key, 32,
                           checksum)
    pool.close()
    assert [(h.key, h.checksum) for h, _ in sealed_blocks(path)] == [(sealed.key, 1234)]
    again = Pool(path, 4 * MB, MB)
    recovered = BlockIndex(again)
    assert again.reattached and recovered.recover() == 2
    ns2 = next(iter(recovered.namespaces.values()))
    got = {b.key: b.checksum for b in ns2.entries.values()}
    assert got == {stored.key: None, sealed.key: 1234}
    again.close()
