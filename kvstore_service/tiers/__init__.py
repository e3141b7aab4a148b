"""The tiers under the pool: where sealed blocks go behind the engines' backs, and where a lookup's
pool misses come from.

    sealed blocks ──write (write-behind, bounded, drops counted)──> disk (disk.py)
                  ──offer (write-behind, bounded, drops counted)──> remote store (remote.py)
    Lookup: pool misses <──promote: disk first, then the remote store (verified, copied into fresh slots)

A block goes to disk once sealed (its CRC32C is known; it stays pinned while written), so evicting it
from the pool later costs nothing: it is on disk already (one evicted before its seal never is: counted
as a dropped write). A Clear drops blocks from the disk too, for good (`clear_disk`). A lookup that
misses in the pool asks the tiers for the missing leading blocks, in order, and answers only after those
it got are committed in the pool, so loads stay pool-only and a hit is always loadable. Every failure
below is a miss; the engine recomputes. Promoted blocks are sealed like stored ones and never written
down again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore_service.disk import DiskTier
from kvstore_service.index import Block, BlockIndex, BlockState, Namespace
from kvstore_service.pool import Pool
from kvstore_service.remote import RemoteTier
from kvstore_service.tenants import split

log = logging.getLogger(__name__)


class Tiers:
    def __init__(self, pool: Pool, index: BlockIndex, seal: Callable[[list[Block]], None],
                 max_fetch_bytes: int, disk: DiskTier | None = None, remote: RemoteTier | None = None) -> None:
        self.pool = pool
        self.index = index
        self.seal = seal  # queues blocks for their checksum and slot header (Jobs.queue_seal)
        self.max_fetch_bytes = max_fetch_bytes
        self.disk = disk
        self.remote = remote
        # Disk calls block on I/O (the native engine has its own threads): they get threads of their own.
        self.disk_io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-disk") if disk else None
        if disk is not None:
            index.on_evict = self._evicted
        self.promoted_blocks = 0
        self._writes: set[asyncio.Task[None]] = set()
        # One promotion per namespace at a time: a second lookup of the same prefix waits, then
        # finds it in the pool instead of fetching it again.
        self._promoting: dict[bytes, asyncio.Lock] = {}

    # -- down: sealed blocks -----------------------------------------------------------------------

    def sealed(self, blocks: list[Block], checksums: list[int]) -> None:
        """Blocks just sealed (one namespace's), with their checksums: to disk, and to the remote store."""
        ns = blocks[0].namespace
        mine = [n for n, b in enumerate(blocks) if not b.promoted and self.index.present(b)]
        if not mine:
            return
        if self.disk is not None:
            keys = [blocks[n].key for n in mine]
            chosen = [mine[i] for i in self.disk.admit(ns.ns_hash, keys, ns.block_bytes)]
            if chosen:
                held = self.index.hold([blocks[n] for n in chosen])  # (all present: this runs on the loop)
                task = asyncio.get_running_loop().create_task(self._write(held, [checksums[n] for n in chosen]))
                self._writes.add(task)
                task.add_done_callback(self._writes.discard)
        if self.remote is not None and ns.name:  # (a namespace recovered by hash only has no name to key by)
            tenant, name = split(ns.name)
            held = self.index.hold([blocks[n] for n in mine])  # sent from their slots: pinned until sent
            self.remote.offer(tenant, name, [b.key for b in held],
                              [self.pool.view(b.offset, ns.block_bytes) for b in held],
                              release=lambda i: self.index.unpin((held[i],)))

    async def _write(self, blocks: list[Block], checksums: list[int]) -> None:
        assert self.disk is not None
        ns = blocks[0].namespace
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.disk_io, self.disk.write, ns.ns_hash, [b.key for b in blocks], self.pool.base,
                [b.offset for b in blocks], ns.block_bytes, checksums, ns.name)
        except Exception:  # (I/O failures disable the tier inside; this is a bug)
            log.exception("writing %d blocks to disk failed", len(blocks))
        finally:
            self.index.unpin(blocks)

    def _evicted(self, block: Block) -> None:
        """A block evicted before its seal never reaches the disk (only sealed blocks are written: the
        record needs the checksum): a dropped write, counted. Not kept from eviction until written
        instead: the pool turns over within a seal's delay (up to a second) only when stores outrun the
        seals, and pinning those blocks would then refuse the stores themselves."""
        if block.checksum is None and block.state is BlockState.COMMITTED and not block.promoted:
            assert self.disk is not None
            self.disk.unwritten(block.namespace.ns_hash, block.key)

    def clear_disk(self, scopes: list[bytes] | None) -> tuple[int, asyncio.Task[None] | None]:
        """Drop these namespaces' blocks (None: every namespace's) from the disk: lookups miss them at once,
        and the clear is written down (the catalog, on the disk threads) so that a restart does not bring
        them back. Returns how many of them the pool does not hold (call it before the pool's clear, which
        counts the others), and the catalog's write to await before the clear is answered (if any)."""
        assert self.disk is not None
        dropped = self.disk.clear(scopes)
        saved = None
        if dropped:
            saved = asyncio.get_running_loop().create_task(self._save_catalog())
            self._writes.add(saved)  # (close waits for it)
            saved.add_done_callback(self._writes.discard)
        count = 0
        for scope, keys in dropped.items():
            ns = self.index.namespaces.get(scope)
            pool = (ns._committed.keys() | ns._writing.keys() | ns._recovered.keys()) if ns is not None else set()
            count += len(keys.keys() - pool)
        return count, saved

    async def _save_catalog(self) -> None:
        assert self.disk is not None
        try:
            await asyncio.get_running_loop().run_in_executor(self.disk_io, self.disk.save_catalog)
        except Exception:  # (I/O failures disable the tier inside; this is a bug)
            log.exception("writing the disk tier's catalog failed")

    # -- up: a lookup's misses ---------------------------------------------------------------------

    async def promote(self, ns: Namespace, keys: list[bytes]) -> int:
        """Bring the leading keys missing from the pool in from the disk, then from the remote store, as
        far as they have them (at most max_fetch_bytes at once); returns how many were committed."""
        lock = self._promoting.setdefault(ns.ns_hash, asyncio.Lock())
        async with lock:
            start = self.index.leading(ns, keys)
            missing = keys[start:start + max(1, self.max_fetch_bytes // ns.block_bytes)]
            done = 0
            if missing and self.disk is not None:
                done = await self._from_disk(ns, missing)
            if done < len(missing) and self.remote is not None and ns.name:
                done += await self._from_remote(ns, missing[done:])
            return done

    async def _from_disk(self, ns: Namespace, keys: list[bytes]) -> int:
        assert self.disk is not None
        n = self.disk.leading(ns.ns_hash, keys)
        blocks = self.index.reserve(ns, keys[:n])  # (a store may have brought some meanwhile)
        if not blocks:
            return 0
        sums: list[int | None] = [None] * len(blocks)
        try:
            sums = await asyncio.get_running_loop().run_in_executor(
                self.disk_io, self.disk.read, ns.ns_hash, [b.key for b in blocks], self.pool.base,
                [b.offset for b in blocks], ns.block_bytes)
        except Exception:
            log.exception("reading %d blocks from disk failed", len(blocks))
        good = next((i for i, s in enumerate(sums) if s is None), len(sums))
        self.index.complete_store(blocks[good:], False, whole=True)
        return self._committed(blocks[:good], sums[:good])

    async def _from_remote(self, ns: Namespace, keys: list[bytes]) -> int:
        """Each fetched batch is verified as it is copied into slots reserved for it (one pass) while
        the next batch is fetched."""
        assert self.remote is not None
        tenant, name = split(ns.name)
        reserved: list[Block] = []

        def place(first: int, count: int) -> list[memoryview]:
            blocks = self.index.reserve(ns, keys[first:first + count])  # (a store may have brought some)
            reserved.extend(blocks)
            return [self.pool.view(b.offset, ns.block_bytes) for b in blocks]
        done = 0
        try:
            async with contextlib.aclosing(self.remote.fetch_batches(tenant, name, keys, ns.block_bytes,
                                                                     place)) as batches:
                async for batch in batches:
                    blocks = reserved[:len(batch)]
                    del reserved[:len(batch)]
                    done += self._committed(blocks, [crc for _, crc in batch])
        finally:  # the rest of the last batch: corrupt, or its fetch was cut short
            self.index.complete_store(reserved, False, whole=True)
        return done

    def _committed(self, blocks: list[Block], checksums: Sequence[int | None]) -> int:
        """Promoted blocks are in: committed, and queued for their seal with the checksums their tier
        verified (the seal then only writes their slot headers: no second pass over the bytes)."""
        for block, checksum in zip(blocks, checksums, strict=True):
            block.checksum = checksum
        done = self.index.complete_store(blocks, True, whole=True)
        for block in done:
            block.promoted = True
        if done:
            self.seal(done)
        self.promoted_blocks += len(done)
        return len(done)

    # -- the end ---------------------------------------------------------------------------------

    async def close(self, drain_s: float) -> None:
        """Finish the disk writes under way and seal the disk's segments; upload what is queued for
        up to `drain_s`."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self.disk is not None:
            assert self.disk_io is not None
            await asyncio.get_running_loop().run_in_executor(self.disk_io, self.disk.close)
            self.disk_io.shutdown(wait=True)
        if self.remote is not None:
            await self.remote.close(drain_s=drain_s)
