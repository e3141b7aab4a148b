"""The seals of stored blocks and the verification of recovered ones: checksums taken after the copies.

Stored blocks wait in a queue to be sealed: their checksums taken and written into their slot
headers, so that loads and a restarted daemon can verify them. A slot gets its header only there,
so a restarted daemon recovers sealed blocks only: one killed before a seal loses that block, whole
(its store was reported done, but it is a cache). Nobody waits on a seal, so seals yield to the
copies made by the host's cores (CPU sessions', on the same shared copy threads): they run when none
is in flight, or once the oldest has waited SEAL_DEFER_S. A burst of stores runs at copy speed; under
stores without pause seals take their share. A device's copies are its DMA engines': seals run
beside them (on an H100 host, sealing only between GPU copies held stores to 0.2 of the bus until
sealed).

After a restart, the blocks recovered from the pool are verified in the background, batch by batch
on the copy threads: a block becomes visible once its bytes match the checksum in its header, and
one that differs is dropped and counted in `corrupt_blocks`.

Jobs (jobs.py) owns the Seals: it queues the blocks its stores committed, says how many host copies
are in flight (`copies`) and when none is left (`no_copies`), and drains the seals at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections import deque
from collections.abc import Callable
from typing import cast

from kvstore_service import native, native_blocks
from kvstore_service.config import Config
from kvstore_service.index import Block, BlockIndex
from kvstore_service.pool import Pool, SlotState
from kvstore_service.threads import Threads

log = logging.getLogger(__name__)

# Seals (and the verification of recovered blocks) go to the copy threads in batches of at most this
# many bytes, so a copy that arrives meanwhile waits for one short batch at most (~1.5 ms on one
# thread); after SEAL_DEFER_S seals no longer yield to copies. A batch of 16 MiB on each copy thread
# rather than 32 MiB at a time on all of them: 3 x 512 MiB stores sealed 7-12% sooner (the threads no
# longer wait for the loop between batches), a 16 MiB load arriving meanwhile as fast (2-vCPU VM).
SEAL_BATCH_BYTES = 16 << 20
SEAL_DEFER_S = 1.0
_key, _checksum = operator.attrgetter("key"), operator.attrgetter("checksum")


class Seals:
    def __init__(self, config: Config, pool: Pool, index: BlockIndex, threads: Threads,
                 copies: Callable[[], int]) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.threads = threads
        self.copies = copies  # chunks handed to the shared copy threads, not finished (Jobs')
        self.corrupt_blocks = 0  # recovered blocks that failed their checksum
        self._to_seal: deque[tuple[float, list[Block]]] = deque()  # (queued at, blocks of one namespace)
        self._sealer: asyncio.Task[None] | None = None
        # Called on the loop with blocks just sealed and their checksums (the lower tiers take them).
        self.on_sealed: Callable[[list[Block], list[int]], None] | None = None
        self._no_copies = asyncio.Event()
        self._draining = False
        self._sealing = 0  # blocks of the batches being sealed
        self._verifier: asyncio.Task[None] | None = None

    def no_copies(self) -> None:
        """The last copy in flight finished: a seal waiting for it may run."""
        self._no_copies.set()

    # -- sealing ---------------------------------------------------------------------------------

    @property
    def unsealed_blocks(self) -> int:
        """Stored blocks waiting for their seal (some may be gone from the pool meanwhile)."""
        return self._sealing + sum(len(blocks) for _, blocks in self._to_seal)

    def queue(self, blocks: list[Block]) -> None:
        self._to_seal.append((time.monotonic(), blocks))
        if self._sealer is None or self._sealer.done():
            self._sealer = asyncio.get_running_loop().create_task(self._seal_queued())

    async def _seal_queued(self) -> None:
        """Seal the queue a batch at a time, up to one batch per shared copy thread at once, each
        checksummed on its thread: the loop hands off the next batch while the others are checksummed,
        so no thread waits for the loop between two."""
        sealing: set[asyncio.Task[None]] = set()
        while self._to_seal or sealing:
            if not self._to_seal or len(sealing) >= self.threads.copy_threads:
                sealing = await _one_ended(sealing)
                continue
            queued, blocks = self._to_seal[0]
            wait = queued + SEAL_DEFER_S - time.monotonic()
            if self.copies() and wait > 0 and not self._draining:
                self._no_copies.clear()
                try:
                    await asyncio.wait_for(self._no_copies.wait(), wait)
                except TimeoutError:
                    pass
                continue
            batch = max(1, SEAL_BATCH_BYTES // blocks[0].namespace.block_bytes)
            if len(blocks) > batch:
                self._to_seal[0] = (queued, blocks[batch:])
                blocks = blocks[:batch]
            else:
                self._to_seal.popleft()
            held = self.index.hold(blocks)
            if held:
                self._sealing += len(held)
                sealing.add(asyncio.get_running_loop().create_task(self._seal(held)))

    async def _seal(self, blocks: list[Block]) -> None:
        """Checksum committed, held blocks of one namespace in the pool and seal the checksums into
        their slot headers."""
        ns = blocks[0].namespace
        offsets = native_blocks.block_offsets(blocks)  # (C-level: a seal's loop time is thousands of blocks')
        headers = native_blocks.block_offsets(blocks, headers=True)
        keys = b"".join(map(_key, blocks))
        generation = self.pool.next_generation()

        known = list(map(_checksum, blocks))  # promoted blocks: verified by their tier already

        def checksum_and_seal() -> list[int]:
            if None in known:
                sums = native.checksum_blocks(self.pool.base, offsets, ns.block_bytes)
            else:
                sums = cast(list[int], known)
            self.pool.write_headers(headers, SlotState.SEALED, ns.block_bytes, generation, ns.ns_hash, keys,
                                    len(blocks[0].key), sums)
            return sums

        checksums = None
        try:
            checksums = await Threads.run(self.threads.shared, checksum_and_seal)
        except Exception:
            log.exception("checksum failed; %d blocks will not survive a restart", len(blocks))
        finally:
            self._sealing -= len(blocks)
        self.index.seal(blocks, checksums)
        if checksums is not None and self.on_sealed is not None:
            self.on_sealed(blocks, checksums)

    # -- verifying recovered blocks --------------------------------------------------------------

    def verify_recovered(self) -> None:
        """Event loop, once after a restart: check the blocks recovered from the pool in the
        background. Lookups miss them until they are verified."""
        recovered = self.index.recovered()
        if recovered:
            self._verifier = asyncio.get_running_loop().create_task(self._verify(recovered))

    async def _verify(self, recovered: list[list[Block]]) -> None:
        """Checksum the recovered blocks of each namespace in batches, as seals: up to one per copy
        thread at once, each on its thread. The index makes those that match their headers' checksums
        visible and drops the others."""
        verifying: set[asyncio.Task[None]] = set()
        try:
            for blocks in recovered:
                batch = max(1, SEAL_BATCH_BYTES // blocks[0].namespace.block_bytes)
                for start in range(0, len(blocks), batch):
                    if len(verifying) >= self.threads.copy_threads:
                        verifying = await _one_ended(verifying)
                    held = self.index.hold(blocks[start:start + batch])
                    if held:
                        verifying.add(asyncio.get_running_loop().create_task(self._verify_batch(held)))
            while verifying:
                verifying = await _one_ended(verifying)
        finally:  # (cancelled: the daemon is stopping)
            for task in verifying:
                task.cancel()

    async def _verify_batch(self, blocks: list[Block]) -> None:
        offsets = native_blocks.block_offsets(blocks)
        checksums = None
        try:
            checksums = await Threads.run(self.threads.shared, native.checksum_blocks, self.pool.base, offsets,
                                          blocks[0].namespace.block_bytes)
        except Exception:
            log.exception("checksum failed; %d recovered blocks dropped unverified", len(blocks))
        corrupt = self.index.verify(blocks, checksums)
        if corrupt:
            self.corrupt_blocks += corrupt
            log.warning("%d recovered blocks failed their checksum and were dropped", corrupt)

    async def drain(self) -> None:
        """Shutting down: seal what is queued without yielding to copies (a restarted daemon can then
        verify it). Recovered blocks not verified yet keep their headers: the next daemon verifies them."""
        self._draining = True
        self._no_copies.set()
        if self._verifier is not None:
            self._verifier.cancel()
        if self._sealer is not None:
            await self._sealer


async def _one_ended(tasks: set[asyncio.Task[None]]) -> set[asyncio.Task[None]]:
    """Wait until one of the tasks ends, raising what it raised (a bug, as when batches ran one at a
    time); returns the others."""
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        task.result()
    return pending
