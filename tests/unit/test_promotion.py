"""A lookup's promotion from the tiers (Tiers.promote) as plain Python objects: a real pool and index
under a tier held in a dict. A grouped lookup (several KV cache groups: keys block by block, a span per
group) brings in exactly what its best hit needs, by vLLM's rule: every full-attention block before the
hit, a window's blocks just before it, a state at it; never a window's older blocks. A tier that can tell
what it holds (the disk) is planned for at once; one that cannot (the remote store) is learned by
fetching, and the hit comes out the same."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator, Sequence

import pytest

from kvstore_service.index import BlockIndex, Namespace
from kvstore_service.pool import Pool
from kvstore_service.tiers import Tiers
from kvstore_service.tiers.base import Forgotten, Memory, Place, Scope

MB = 1 << 20
BLOCK = 16 * 1024
BLOCKS = 8  # blocks of a prompt


def key(g: int, i: int) -> bytes:
    """Group g's key of block i."""
    return bytes([g, i]) * 16


def grouped(groups: int, blocks: int = BLOCKS) -> list[bytes]:
    """A grouped lookup's keys: block by block, every group's key of each."""
    return [key(g, i) for i in range(blocks) for g in range(groups)]


class DictTier:
    """A tier holding blocks in a dict; `tells`: whether it answers `holds` (as the disk does) or not (as
    the remote store: only a fetch tells)."""

    def __init__(self, keys: Sequence[bytes], tells: bool) -> None:
        self.blocks = set(keys)
        self.tells = tells
        self.fetched: list[bytes] = []

    async def fetch_verified(self, memory: Memory, scope: Scope, keys: Sequence[bytes],
                             place: Place) -> AsyncGenerator[list[int]]:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        offsets = place(0, n) if n else []
        for k, offset in zip(keys, offsets, strict=False):
            memory.view(offset, scope.block_bytes)[:] = k * (scope.block_bytes // len(k))
        self.fetched += keys[:len(offsets)]
        if offsets:
            yield [0] * len(offsets)

    def holds(self, scope: Scope, keys: Sequence[bytes]) -> set[bytes] | None:
        return self.blocks & set(keys) if self.tells else None

    def write_behind(self, *args: object) -> int:
        return 0

    def forget(self, scopes: Sequence[bytes] | None) -> Forgotten:
        return Forgotten({}, None)


@pytest.fixture
def pool(tmp_path) -> Iterator[Pool]:
    p = Pool(str(tmp_path / "pool"), 4 * MB, MB, fresh=True)
    yield p
    p.close()


def promote(pool: Pool, tier_keys: Sequence[bytes], keys: list[bytes], spans: Sequence[int], tells: bool,
            fetch_bytes: int = 64 * MB) -> tuple[BlockIndex, Namespace, DictTier, int]:
    """An empty pool under a tier holding `tier_keys`; a lookup of `keys` promoted."""
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    tiers = Tiers(pool, index, lambda blocks: None, fetch_bytes)
    tier = DictTier(tier_keys, tells)
    tiers.tiers = [tier]  # type: ignore[list-item]
    promoted = asyncio.run(tiers.promote(ns, keys, spans))
    return index, ns, tier, promoted


def in_pool(index: BlockIndex, ns: Namespace, keys: list[bytes]) -> set[bytes]:
    return {k for k in keys if index.is_committed(ns.ns_hash, k)}


@pytest.mark.parametrize("tells", [True, False], ids=["tier-tells", "fetch-tells"])
def test_a_window_group_promotes_only_the_blocks_before_the_hit(pool: Pool, tells: bool) -> None:
    """Full attention and a 2-block window, both on the tier: the hit is every block, and only the
    window's last 2 come up with the full-attention ones (a flat leading run took all 16)."""
    keys = grouped(2)
    index, ns, tier, promoted = promote(pool, keys, keys, [0, 2], tells)
    needed = [key(0, i) for i in range(BLOCKS)] + [key(1, 6), key(1, 7)]
    assert promoted == len(needed) and in_pool(index, ns, keys) == set(needed)
    assert sorted(tier.fetched) == sorted(needed)
    assert index.lookup_groups(ns, b"".join(keys), 32, [0, 2])[0] == BLOCKS


@pytest.mark.parametrize("tells", [True, False], ids=["tier-tells", "fetch-tells"])
def test_a_window_without_its_old_blocks_still_hits_everything(pool: Pool, tells: bool) -> None:
    """The window's blocks before its span are nowhere (vLLM freed them before they were stored): a flat
    leading run stopped at the first of them, block 0, and hit nothing."""
    keys = grouped(2)
    stored = [key(0, i) for i in range(BLOCKS)] + [key(1, i) for i in range(4, BLOCKS)]
    index, ns, _, promoted = promote(pool, stored, keys, [0, 2], tells)
    assert promoted == BLOCKS + 2 and in_pool(index, ns, keys) == {*stored[:BLOCKS], key(1, 6), key(1, 7)}
    assert index.lookup_groups(ns, b"".join(keys), 32, [0, 2])[0] == BLOCKS


@pytest.mark.parametrize("tells", [True, False], ids=["tier-tells", "fetch-tells"])
def test_a_full_attention_gap_moves_the_window_before_it(pool: Pool, tells: bool) -> None:
    """Full-attention block 5 is nowhere: the hit is 5 blocks, and the window's blocks 3 and 4 come up
    (not 6 and 7, which a hit of 8 would have needed)."""
    keys = grouped(2)
    stored = [k for k in keys if k != key(0, 5)]
    index, ns, _, promoted = promote(pool, stored, keys, [0, 2], tells)
    assert in_pool(index, ns, keys) == {*(key(0, i) for i in range(5)), key(1, 3), key(1, 4)} and promoted == 7
    assert index.lookup_groups(ns, b"".join(keys), 32, [0, 2])[0] == 5


def test_a_state_missing_at_the_end_shortens_the_hit_to_the_last_state(pool: Pool) -> None:
    """A Mamba group (span 1): states stored only at blocks 3 and 5. The hit ends at the last state, 6
    blocks, and needs no other state; a tier that tells brings exactly those, one that does not learns
    by fetching, bringing full-attention blocks 6 and 7 first (the hit it tried before knowing)."""
    keys = grouped(2)
    stored = [key(0, i) for i in range(BLOCKS)] + [key(1, 3), key(1, 5)]
    needed = {*(key(0, i) for i in range(6)), key(1, 5)}
    index, ns, tier, promoted = promote(pool, stored, keys, [0, 1], tells=True)
    assert in_pool(index, ns, keys) == needed and promoted == 7
    assert index.lookup_groups(ns, b"".join(keys), 32, [0, 1])[0] == 6
    index.clear()
    index, ns, tier, promoted = promote(pool, stored, keys, [0, 1], tells=False)
    assert in_pool(index, ns, keys) == needed | {key(0, 6), key(0, 7)} and key(1, 3) not in tier.fetched
    assert index.lookup_groups(ns, b"".join(keys), 32, [0, 1])[0] == 6


@pytest.mark.parametrize("tells", [True, False], ids=["tier-tells", "fetch-tells"])
def test_a_plain_lookup_promotes_its_leading_run_past_blocks_the_pool_holds(pool: Pool, tells: bool) -> None:
    """No spans: one full-attention group, as before. The leading run the tier has, skipping the key the
    pool holds already, up to the first the tier lacks."""
    keys = [key(0, i) for i in range(BLOCKS)]
    index = BlockIndex(pool)
    ns = index.namespace("ns", BLOCK)
    index.complete_store(index.reserve(ns, keys[2:3]), True, all_shards=True)
    tiers = Tiers(pool, index, lambda blocks: None, 64 * MB)
    tier = DictTier(keys[:6], tells)
    tiers.tiers = [tier]  # type: ignore[list-item]
    assert asyncio.run(tiers.promote(ns, keys)) == 5
    assert tier.fetched == keys[:2] + keys[3:6]
    assert len(index.lookup(ns, b"".join(keys), 32)) == 6


@pytest.mark.parametrize("tells", [True, False], ids=["tier-tells", "fetch-tells"])
def test_the_fetch_budget_bounds_a_grouped_promotion_in_the_hits_order(pool: Pool, tells: bool) -> None:
    """max_fetch_bytes of 5 blocks: the first 5 keys the hit needs, block by block."""
    keys = grouped(2)
    index, ns, _, promoted = promote(pool, keys, keys, [0, 2], tells, fetch_bytes=5 * BLOCK)
    assert promoted == 5 and in_pool(index, ns, keys) == {key(0, i) for i in range(5)}
