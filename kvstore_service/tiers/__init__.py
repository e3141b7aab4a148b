"""The tiers under the pool: where sealed blocks go behind the engines' backs, and where a lookup's
pool misses come from.

    sealed blocks ──write_behind (bounded, drops counted)──> disk (tiers/disk/)
                  ──write_behind (bounded, drops counted)──> remote store (tiers/remote/)
    Lookup: pool misses <──promote: disk first, then the remote store (verified, copied into fresh slots)

A block goes to disk once sealed (its CRC32C is known; it stays pinned while written), so evicting it
from the pool later costs nothing: it is on disk already (one evicted before its seal never is: counted
as a dropped write, `unwritten`). A Clear drops blocks from the tiers too (`forget`: the disk's for
good; the remote store's age out there). A lookup that misses in the pool asks the tiers for the blocks
its best hit needs (`promote`: the leading run of a plain lookup; per group, by vLLM's hit rule, for a
grouped one), in order, and answers only after those it got are committed in the pool, so loads stay
pool-only and a hit is always loadable. Every failure below is a miss; the engine recomputes. Promoted
blocks are sealed like stored ones and never written down again. Both tiers are driven through one
contract (base.py), their only face, and only this class meets the index, through its verbs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from itertools import groupby

from kvstore_client.protocol.groups import grouped_hit
from kvstore_service.index import Block, BlockIndex, BlockState, Namespace
from kvstore_service.pool import Pool
from kvstore_service.stats import DiskStats, RemoteStats
from kvstore_service.tiers.base import Scope, Tier
from kvstore_service.tiers.disk import DiskTier
from kvstore_service.tiers.remote import RemoteTier


def scope_of(ns: Namespace) -> Scope:
    return Scope(ns.ns_hash, ns.name, ns.block_bytes)


def missing_keys(keys: list[bytes], spans: Sequence[int], pooled: set[bytes], held: set[bytes] | None,
                 absent: set[bytes]) -> list[bytes]:
    """The keys that the best hit of a lookup (`grouped_hit` on its `keys` and `spans`) needs and the pool
    lacks, in the hit's order, each once. A key is present where it is `pooled`, or `held` by a tier (None:
    a tier cannot tell, so maybe) and not found `absent` from every tier since."""
    def present(k: int) -> bool:
        key = keys[k]
        return key in pooled or (key not in absent and (held is None or key in held))
    _, needed = grouped_hit(spans, len(keys), present)
    return list(dict.fromkeys(keys[k] for k in needed if keys[k] not in pooled))


class Tiers:
    def __init__(self, pool: Pool, index: BlockIndex, seal: Callable[[list[Block]], None],
                 max_fetch_bytes: int, disk: DiskTier | None = None, remote: RemoteTier | None = None) -> None:
        self.pool = pool
        self.index = index
        self.seal = seal  # queues blocks for their checksum and slot header (Jobs.queue_seal)
        self.max_fetch_bytes = max_fetch_bytes
        self.disk = disk
        self.remote = remote
        self.tiers: list[Tier] = [t for t in (disk, remote) if t is not None]  # the order a lookup asks them in
        if self.tiers:
            index.on_evict = self._evicted
        self.promoted_blocks = 0
        # One promotion per namespace at a time: a second lookup of the same prefix waits, then
        # finds it in the pool instead of fetching it again.
        self._promoting: dict[bytes, asyncio.Lock] = {}

    def stats(self) -> tuple[DiskStats, RemoteStats]:
        """The disk's and the remote store's (empty where there is none)."""
        return (self.disk.stats() if self.disk is not None else DiskStats(),
                self.remote.stats() if self.remote is not None else RemoteStats())

    def take_changes(self) -> list[tuple[bytes, bytes, bool]]:
        """The blocks the tiers of this node (the disk) wrote and dropped since last asked, for the routers'
        events (base.py)."""
        return [change for tier in self.tiers for change in tier.take_changes()]

    # -- down: sealed blocks -----------------------------------------------------------------------

    def sealed(self, blocks: list[Block], checksums: list[int]) -> None:
        """Blocks just sealed (one namespace's), with their checksums: written behind to every tier, each
        block pinned until that tier is done with its slot."""
        mine = [n for n, b in enumerate(blocks) if not b.promoted and self.index.present(b)]
        if not mine:
            return
        scope = scope_of(blocks[0].namespace)
        for tier in self.tiers:
            held = self.index.hold([blocks[n] for n in mine])  # (all present: this runs on the loop)
            tier.write_behind(self.pool, scope, [b.key for b in held], [b.offset for b in held],
                              [checksums[n] for n in mine], self._unpinner(held))

    def _unpinner(self, held: list[Block]) -> Callable[[int], None]:
        """A tier's `release`: block i is unpinned."""
        return lambda i: self.index.unpin((held[i],))

    def _evicted(self, blocks: list[Block]) -> None:
        """A block evicted before its seal never reaches the tiers (only sealed blocks are written: the
        record needs the checksum): a dropped write, told to each (`unwritten`). Not kept from eviction
        until written instead: the pool turns over within a seal's delay (up to a second) only when stores
        outrun the seals, and pinning those blocks would then refuse the stores themselves."""
        unsealed = [b for b in blocks if b.checksum is None and b.state is BlockState.COMMITTED and not b.promoted]
        for ns, run in groupby(unsealed, lambda b: b.namespace):
            scope, keys = scope_of(ns), [b.key for b in run]
            for tier in self.tiers:
                tier.unwritten(scope, keys)

    def names(self) -> dict[bytes, str]:
        """The names of the namespaces the tiers hold blocks of, where they know them: ns_hash -> name (after
        a restart, a namespace may be known only there)."""
        names: dict[bytes, str] = {}
        for tier in self.tiers:
            names.update(tier.names())
        return names

    def forget(self, scopes: list[bytes] | None) -> tuple[int, asyncio.Task[None] | None]:
        """Drop these namespaces' blocks (None: every namespace's) from the tiers (`forget`: the disk's, for
        good: a restart does not bring them back). Returns how many of them the pool does not hold (call it
        before the pool's clear, which counts the others), and the disk catalog's write to await before the
        clear is answered (if any)."""
        count = 0
        saved = None
        for tier in self.tiers:
            forgotten = tier.forget(scopes)
            saved = saved or forgotten.saved
            for scope, keys in forgotten.keys.items():
                count += len(keys) - self.index.keys_held(scope, keys)
        return count, saved

    # -- up: a lookup's misses ---------------------------------------------------------------------

    async def promote(self, ns: Namespace, keys: list[bytes], spans: Sequence[int] = ()) -> int:
        """Bring in the keys of a lookup that its best hit needs and the pool lacks: from the disk, then from
        the remote store, in the hit's order, at most max_fetch_bytes in all. Returns how many were committed.

        `spans`: a grouped lookup's (kvstore_client.protocol.groups: keys interleaved block by block), or
        none for one full-attention group (a plain lookup: the hit is the leading run of keys). The hit is
        vLLM's rule (`grouped_hit`, the one the grouped lookup answers by) with a key present where the pool
        holds it or a tier may: the best hit the pool and the tiers can serve, so a window's blocks before
        its span, and the blocks past a gap, are never fetched. Whether a tier may hold a key is its
        `holds` (the disk knows from memory: then the plan is exact at once); where a tier cannot tell
        (the remote store: a round trip), every key may be there, and the promotion learns otherwise by
        fetching: each pass fetches the needed keys the pool lacks, in order, up to the first one no tier
        has (a tier's fetch is its leading run: the next tier goes on from there), marks that one absent and
        plans again (a full-attention gap ends the hit there, a window's gap moves the window before it;
        blocks fetched for the longer hit stay in the pool, unneeded). It ends when the hit's keys are all in,
        the budget is spent, or a pass got nothing because the pool refused a slot (full of pinned blocks,
        or a store is writing the key). Each pass learns an absent key or commits a block, costs
        O(blocks x groups) on the loop (`grouped_hit`) and yields it.

        One promotion per namespace at a time (a pass holds its lock): a second lookup of the same prefix
        waits, then finds it in the pool instead of fetching it again. The lookup's blocks in the pool are
        pinned meanwhile: the promotion's evictions must not take them."""
        if not keys or self.index.leading(ns, keys) == len(keys):
            return 0  # (every key is in the pool: nothing to plan)
        spans = spans or (0,)
        scope = scope_of(ns)
        budget = max(1, self.max_fetch_bytes // ns.block_bytes)
        lock = self._promoting.setdefault(ns.ns_hash, asyncio.Lock())
        absent: set[bytes] = set()  # keys the plan needed that no tier gave
        pinned: list[Block] = []
        promoted = 0
        try:
            while promoted < budget:
                async with lock:
                    self.index.unpin(pinned)
                    pinned = self.index.pin_present(ns, keys)
                    missing = missing_keys(keys, spans, {b.key for b in pinned}, self._held(scope, keys), absent)
                    todo = missing[:budget - promoted]
                    if not todo:
                        break
                    got, refused = await self._fetch_all(ns, todo)
                promoted += got
                if got == len(missing) or (refused and not got):
                    break
                if got < len(todo) and not refused:
                    absent.add(todo[got])  # in no tier (or corrupt in each): the hit ends before it
                await asyncio.sleep(0)
        finally:
            self.index.unpin(pinned)
        return promoted

    def _held(self, scope: Scope, keys: list[bytes]) -> set[bytes] | None:
        """The keys some tier holds, by their `holds`; None where a tier cannot tell (any key may be there)."""
        held: set[bytes] = set()
        for tier in self.tiers:
            some = tier.holds(scope, keys)
            if some is None:
                return None
            held.update(some)
        return held

    async def _fetch_all(self, ns: Namespace, keys: list[bytes]) -> tuple[int, bool]:
        """The leading run of `keys` the tiers have between them, in order: each tier from where the one
        before stopped. Returns (how many were committed, whether the pool refused a slot)."""
        done = 0
        refused = False
        for tier in self.tiers:
            got, refused = await self._fetch(tier, ns, keys[done:])
            done += got
            if refused or done >= len(keys):
                break
        return done, refused

    async def _fetch(self, tier: Tier, ns: Namespace, keys: list[bytes]) -> tuple[int, bool]:
        """Each batch is verified as it is copied into slots reserved for it; committed as it comes.
        Returns (how many were committed, whether the pool had fewer slots than the tier had blocks)."""
        reserved: list[Block] = []
        refused = False

        def place(first: int, count: int) -> list[int]:
            nonlocal refused
            blocks = self.index.reserve(ns, keys[first:first + count])  # (a store may have brought some)
            refused = refused or len(blocks) < count
            reserved.extend(blocks)
            return [b.offset for b in blocks]
        done = 0
        try:
            async with contextlib.aclosing(tier.fetch_verified(self.pool, scope_of(ns), keys, place)) as batches:
                async for checksums in batches:
                    blocks = reserved[:len(checksums)]
                    del reserved[:len(checksums)]
                    done += self._committed(blocks, checksums)
        finally:  # the rest of the last batch: corrupt, or its fetch was cut short
            self.index.complete_store(reserved, False, all_shards=True)
        return done, refused

    def _committed(self, blocks: list[Block], checksums: Sequence[int]) -> int:
        """Promoted blocks are in: committed, and queued for their seal with the checksums their tier
        verified (the seal then only writes their slot headers: no second pass over the bytes)."""
        done = self.index.complete_promotion(blocks, checksums)
        if done:
            self.seal(done)
        self.promoted_blocks += len(done)
        return len(done)

    # -- the end ---------------------------------------------------------------------------------

    async def close(self, drain_s: float) -> None:
        """Finish the disk writes under way and close the disk's segments; upload what is queued for
        up to `drain_s`."""
        for tier in self.tiers:
            await tier.aclose(drain_s)
