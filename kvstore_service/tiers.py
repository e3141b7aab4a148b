"""The tiers under the pool: where sealed blocks go behind the engines' backs, and where a lookup's
pool misses come from.

    sealed blocks ──offer (write-behind, bounded, drops counted)──> remote store (remote.py)
    Lookup: pool misses <──promote (fetch, verify, copy into fresh pool slots)── remote store

A lookup that misses in the pool asks the lower tier for the missing leading blocks and answers only
after those it got are committed in the pool, so loads stay pool-only and a hit is always loadable.
Every failure below is a miss (remote.py's failure model); the engine recomputes. Promoted blocks
are sealed like stored ones (a restarted daemon keeps them) and never offered back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from kvstore_service.index import Block, BlockIndex, Namespace
from kvstore_service.pool import Pool
from kvstore_service.remote import RemoteTier
from kvstore_service.tenants import split

log = logging.getLogger(__name__)


class Tiers:
    def __init__(self, pool: Pool, index: BlockIndex, executor: Executor, seal: Callable[[list[Block]], None],
                 remote: RemoteTier, max_fetch_bytes: int) -> None:
        self.pool = pool
        self.index = index
        self.executor = executor
        self.seal = seal  # queues blocks for their checksum and slot header (Jobs.queue_seal)
        self.remote = remote
        self.max_fetch_bytes = max_fetch_bytes
        self.promoted_blocks = 0
        # One promotion per namespace at a time: a second lookup of the same prefix waits, then
        # finds it in the pool instead of fetching it again.
        self._promoting: dict[bytes, asyncio.Lock] = {}

    def sealed(self, blocks: list[Block], checksums: list[int]) -> None:
        """Offer blocks just sealed (one namespace's) to the remote tier, with their checksums."""
        ns = blocks[0].namespace
        if not ns.name:
            return  # recovered by hash only: no name to key it by
        mine = [n for n, b in enumerate(blocks) if not b.promoted and self.index.present(b)]
        if not mine:
            return
        tenant, name = split(ns.name)
        self.remote.offer(tenant, name, [blocks[n].key for n in mine],
                          [self.pool.view(blocks[n].offset, ns.block_bytes) for n in mine],
                          checksums=[checksums[n] for n in mine])

    async def promote(self, ns: Namespace, keys: list[bytes]) -> int:
        """Bring the leading keys missing from the pool in from the remote tier, as far as it has
        them (at most max_fetch_bytes at once); returns how many were committed."""
        lock = self._promoting.setdefault(ns.ns_hash, asyncio.Lock())
        async with lock:
            start = self.index.leading(ns, keys)
            missing = keys[start:start + max(1, self.max_fetch_bytes // ns.block_bytes)]
            if not missing or not ns.name:
                return 0
            tenant, name = split(ns.name)
            payloads = await self.remote.fetch(tenant, name, missing, payload_bytes=ns.block_bytes)
            blocks = self.index.reserve(ns, missing[:len(payloads)])  # (a store may have brought some meanwhile)
            if not blocks:
                return 0
            ok = True
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, self._copy, blocks, payloads)
            except Exception:
                log.exception("copying %d fetched blocks into the pool failed", len(blocks))
                ok = False
            done = self.index.complete_store(blocks, ok, whole=True)
            for block in done:
                block.promoted = True
            if done:
                self.seal(done)
            self.promoted_blocks += len(done)
            return len(done)

    def _copy(self, blocks: list[Block], payloads: list[memoryview]) -> None:
        for block, payload in zip(blocks, payloads, strict=False):
            self.pool.view(block.offset, payload.nbytes)[:] = payload
