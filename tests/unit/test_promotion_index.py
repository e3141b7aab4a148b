"""The index's side of a promotion from a lower tier, as plain Python objects: a promoted key whose
recovered copy is not verified yet replaces it (as a store does), and a lookup's blocks pinned while
its misses are promoted are not evicted for them."""

from __future__ import annotations

from test_pool_index import BLOCK, MB, keys_of, reserve, stored_and_reattached

from kvstore_service.index import BlockIndex, BlockState
from kvstore_service.pool import Pool


def test_a_promotion_replaces_a_recovered_block_not_verified_yet(tmp_path) -> None:
    """It used to leave both: verifying the old one then put it back over the promoted one, whose slot
    was lost to the index (and a later eviction removed the wrong block)."""
    again, recovered, ns2 = stored_and_reattached(tmp_path)
    old = recovered.recovered()[0]
    held = recovered.hold(old)  # being verified
    promoted = recovered.reserve(ns2, keys_of(2))  # the lookup missed them: the disk tier has them
    assert [b.key for b in promoted] == keys_of(2) and all(b.state is BlockState.DOOMED for b in old)
    assert recovered.verify(held, [b.checksum for b in old]) == 0  # replaced meanwhile: not brought back
    assert recovered.complete_store(promoted, ok=True, all_shards=True) == promoted
    assert recovered.lookup(ns2, b"".join(keys_of(2)), 32) == promoted
    assert recovered.count == 2 and recovered.unverified_blocks == 0
    assert recovered.clear() == 2 and recovered.count == 0 and sum(s.used for s in again.segments) == 0
    again.close()


def test_blocks_pinned_for_a_promotion_are_not_evicted_for_it(tmp_path) -> None:
    pool = Pool(str(tmp_path / "pool"), 4 * MB, MB, fresh=True)
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    capacity = 4 * pool.slots_per_segment(BLOCK)
    prompt = keys_of(capacity)
    index.complete_store(reserve(index, ns, prompt[:4]), ok=True)  # the oldest: the lookup's own
    index.complete_store(reserve(index, ns, keys_of(capacity - 4, tag=1)), ok=True)  # the pool is full
    held = index.pin_present(ns, prompt)
    assert [b.key for b in held] == prompt[:4]
    promoted = index.reserve(ns, prompt[4:])
    assert len(promoted) == capacity - 4  # every other block evicted, not the lookup's
    index.complete_store(promoted, ok=True, all_shards=True)
    index.unpin(held)
    assert len(index.lookup(ns, b"".join(prompt), 32)) == capacity
    pool.close()
