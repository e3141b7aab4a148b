"""The remote tier's fetches: the leading run of a request's keys read back in pipelined batches (the next
batch's GETs under way while one is verified), each value verified as it is copied into its place (on
the tier's threads for a large batch); a value that fails verification is deleted from the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Final, TypeAlias, TypeVar

from kvstore_service.threads import Threads
from kvstore_service.tiers.remote.calls import StoreCalls

log = logging.getLogger("kvstore_service.tiers.remote")

T = TypeVar("T")

# Where a fetch copies its payloads: called on the loop with (first, count), the keys[first:first + count]
# of a batch that arrived; returns a writable view per key, in order, as many as it takes (fewer: the
# batch ends there). The pool's slots (base.Place), as views.
_Views: TypeAlias = Callable[[int, int], Sequence[memoryview]]
_VERIFY_IN_THREAD_BYTES: Final = 1 << 20  # a fetched batch at least this big is verified off the loop


class Fetching(StoreCalls):
    """`_fetch_batches`: `RemoteTier.fetch_verified`'s reads and verification."""

    fetch_batch: int
    fetch_batch_bytes: int
    _fetch_seconds: float
    _spare_reads: set[asyncio.Future[Any]]  # batches fetched ahead, not needed

    async def _fetch_batches(self, tenant: str, namespace: str, keys: Sequence[bytes], payload_bytes: int,
                             place: _Views) -> AsyncGenerator[list[int]]:
        """`fetch_verified` of the payloads of `payload_bytes` under these names: the CRC32Cs of each
        batch copied to its places, up to the first absent, failed or corrupt block."""
        if not keys:
            return
        self._counts["fetches"] += 1
        found, asked, start = 0, False, time.monotonic()
        ahead: asyncio.Future[Any] | None = None
        try:
            if not self.breaker.allow():
                self._counts["skipped"] += len(keys)
                return
            asked = True
            rkeys = self.keyring.remote_keys(tenant, namespace, keys)
            # (batches of at most fetch_batch_bytes: the caller copies one as the next comes)
            size = max(1, min(self.fetch_batch, self.fetch_batch_bytes // payload_bytes))
            chunks = [rkeys[i:i + size] for i in range(0, len(rkeys), size)]
            value_bytes = self.keyring.value_bytes(payload_bytes)
            reading = asyncio.ensure_future(self._get(chunks[0], value_bytes))
            for n, chunk in enumerate(chunks):
                values, ahead = await reading, None
                if n + 1 < len(chunks):
                    ahead = reading = asyncio.ensure_future(self._get(chunks[n + 1], value_bytes))
                good = await self._verify(tenant, chunk, values, payload_bytes, place, n * size)
                found += len(good)
                self._counts["bytes_down"] += sum(payload.nbytes for payload, _ in good)
                if good:
                    yield [crc for _, crc in good]
                if len(good) < len(chunk):
                    break
        finally:
            if ahead is not None:  # past the first miss: let it finish (cancelling a pipeline drops its connection)
                self._spare_reads.add(ahead)
                ahead.add_done_callback(self._spare_reads.discard)
            if asked:  # (the caller's time between batches included: the latency its lookup sees)
                self._fetch_seconds += time.monotonic() - start
                self._counts["fetch_seconds_count"] += 1
            self._counts["hits"] += found
            self._counts["misses"] += len(keys) - found

    async def _get(self, keys: list[bytes], value_bytes: int) -> list[bytes | BaseException | None]:
        return await self._call(self.store.get_many(keys, value_bytes), len(keys))

    async def _verify(self, tenant: str, keys: list[bytes], values: list[bytes | BaseException | None],
                      payload_bytes: int, place: _Views, first: int) -> list[tuple[memoryview, int]]:
        """The payloads (and CRC32C) of the leading valid values, copied to their places (keys[i] is the
        request's key first + i); a value that fails verification is deleted."""
        present: list[bytes] = []
        for value in values:
            if not isinstance(value, bytes):
                break
            present.append(value)
        places = place(first, len(present)) if present else []
        present = present[:len(places)]
        good = await self._verifying(sum(map(len, present)), self._open_leading, tenant, keys, present,
                                     payload_bytes, places)
        if len(good) < len(present):  # present[len(good)] is corrupt; of the rest, those that do not open too
            rest = range(len(good) + 1, len(values))
            others = await self._verifying(sum(len(v) for v in values[rest.start:] if isinstance(v, bytes)),
                                           self._unopened, tenant, keys, values, rest, payload_bytes)
            bad = [len(good), *others]
            self._counts["corrupt"] += len(bad)
            log.warning("remote store: %d values (the first under %r) failed verification (corrupt, or not "
                        "wrapped with this daemon's secret) and were deleted", len(bad), keys[len(good)][:24])
            await self._call(self._delete([keys[i] for i in bad]), len(bad))
        return good

    async def _verifying(self, nbytes: int, verify: Callable[..., T], *args: Any) -> T:
        """verify(*args), on the remote threads where it checks enough bytes to hold the loop up."""
        if nbytes >= _VERIFY_IN_THREAD_BYTES:
            return await Threads.run(self._threads, verify, *args)
        return verify(*args)

    def _open_leading(self, tenant: str, keys: Sequence[bytes], values: Sequence[bytes], payload_bytes: int,
                      places: Sequence[memoryview]) -> list[tuple[memoryview, int]]:
        """The leading values that open (a prefix of `keys`), each copied to its place."""
        good = []
        for i, value in enumerate(values):
            opened = self.keyring.unwrap(tenant, keys[i], value, payload_bytes, places[i])
            if opened is None:
                break
            good.append(opened)
        return good

    def _unopened(self, tenant: str, keys: Sequence[bytes], values: Sequence[bytes | BaseException | None],
                  indexes: range, payload_bytes: int) -> list[int]:
        """Of these values, the indexes of those read that do not open (corrupt: to delete)."""
        read = [(i, v) for i in indexes if isinstance(v := values[i], bytes)]
        return [i for i, v in read if self.keyring.unwrap(tenant, keys[i], v, payload_bytes, None) is None]

    async def _delete(self, keys: list[bytes]) -> list[BaseException | None]:
        await self.store.delete(keys)
        return [None] * len(keys)
