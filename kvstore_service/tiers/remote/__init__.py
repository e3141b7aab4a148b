"""A shared cold tier on Redis/Valkey: blocks written behind to a remote store, fetched back on a miss.

    tier = RemoteTier.from_url("redis+cluster://10.0.0.5:6379,10.0.0.6:6379", executor=threads.remote)
    tier.write_behind(pool, scope, keys, offsets, checksums, release)  # on the loop; never waits for the store
    async for crcs in tier.fetch_verified(pool, scope, keys, place): ...  # the leading run, verified, in place
    await tier.aclose(drain_s)                                          # uploads what it can, then closes

That is the tiers' contract (tiers/base.py), the tier's only face: `Tiers` drives it, and so do the
tests. A namespace is keyed by its `Scope`'s name ("tenant/namespace"; one known by hash only is not
stored nor fetched), and every value of it holds a payload of its ``block_bytes``. The rest of the
contract is trivial here: the store cannot tell what it holds without a round trip (`holds`: None),
lists no namespaces (`names`), is not this node's to announce (`take_changes`), and a Clear does not
reach it (`forget`). Its parts: keys and values (`Keyring`, codec.py; the bytes in docs/formats.md),
store URLs and credentials (url.py), the store and its Redis/Valkey adapter (store.py), the circuit
breaker (breaker.py). Capacity and eviction belong to the server (``maxmemory`` + ``allkeys-lru``): the
tier never deletes a valid value.

Failure model: the store is a cache, so every failure is a miss and none reaches the caller.
- Write-behind: ``write_behind`` queues a view of each block's slot, never a copy: an upload task wraps
  them a batch at a time and sends them in pipelined batches, each value in pieces (header, payload,
  MAC), straight from the caller's memory (the daemon's pool slots, pinned until ``release`` says the
  tier is done with them: once the server answered); encrypted values leave from their ciphertext, a
  copy made as the batch is wrapped. Queued and in-flight bytes stay within ``queue_bytes``. A full
  queue, an open breaker or a closed tier drops the block (counted); a failed upload is counted, not
  retried.
- Reads: ``fetch_verified`` pipelines GETs (grouped by cluster node, so a dead node fails only its own
  keys) in batches of ``fetch_batch`` keys (fewer when that exceeds ``fetch_batch_bytes``) and stops at
  the first miss; each batch is verified as it is copied into its places. A value that fails
  verification (magic, version, mode, lengths, the scope's block size, its MAC or AEAD tag) is deleted,
  counted as corrupt, and is a miss.
- Every store call (one batch) is bounded by ``timeout_s``; an error or timeout fails the keys of that
  call (misses, or dropped uploads), counted as errors/timeouts.
- Circuit breaker: ``breaker_failures`` failed calls in a row open it. While open (``breaker_s``) fetches
  return nothing without asking the store and uploads are dropped; then one call probes the store:
  success closes the breaker, failure opens it again.
- Nothing blocks the event loop on the store: all store I/O is asyncio. Wrapping an upload batch (a MAC or
  an encryption of each payload) runs on the tier's ``executor`` (the daemon's `Threads.remote`); so does
  opening a fetched batch of 1 MiB or more (its MAC or decryption, and a CRC32C: the pool's seal checksum
  of the block).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import Any, Final, NamedTuple, TypeAlias, TypeVar

from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore_service.stats import RemoteStats
from kvstore_service.tenants import split
from kvstore_service.threads import Threads
from kvstore_service.tiers.base import Forgotten, Memory, Place, Scope
from kvstore_service.tiers.remote.breaker import Breaker
from kvstore_service.tiers.remote.codec import PUBLIC, Buffer, Keyring, bytes_view
from kvstore_service.tiers.remote.store import RedisStore, RemoteStore
from kvstore_service.tiers.remote.url import parse_url, resolve_password

log = logging.getLogger(__name__)

T = TypeVar("T")
# Where a fetch copies its payloads: called on the loop with (first, count), the keys[first:first + count]
# of a batch that arrived; returns a writable view per key, in order, as many as it takes (fewer: the
# batch ends there). The pool's slots (base.Place), as views.
_Views: TypeAlias = Callable[[int, int], Sequence[memoryview]]
_VERIFY_IN_THREAD_BYTES: Final = 1 << 20  # a fetched batch at least this big is verified off the loop

# -- the tier ------------------------------------------------------------------------------------

_COUNTERS = tuple(f.name for f in dataclasses.fields(RemoteStats)
                  if f.name not in ("url", "breaker", "breaker_opens", "fetch_seconds_sum", "queued_blocks",
                                    "queued_bytes", "queue_limit_bytes"))


class _Upload(NamedTuple):
    """A queued block: its value is wrapped from ``payload`` (a view of the caller's memory) when it is sent."""

    tenant: str
    payload: memoryview
    release: Callable[[], None]  # the caller's memory is no longer read
    size: int  # value bytes


class RemoteTier:
    """Write-behind and prefix fetch over a `RemoteStore`, through the tiers' contract; see the module
    docstring for the failure model. Use it from one event loop (the daemon's): nothing in it is
    thread-safe."""

    def __init__(self, store: RemoteStore, *, executor: Executor, url: str = "", keyring: Keyring = PUBLIC,
                 queue_bytes: int = 256 << 20, timeout_s: float = 1.0, breaker_s: float = 10.0,
                 breaker_failures: int = 3, fetch_batch: int = 16, fetch_batch_bytes: int = 16 << 20,
                 upload_batch_bytes: int = 32 << 20) -> None:
        self.store, self.url, self.keyring = store, url, keyring
        self._threads = executor  # wrapping and opening values (the daemon's; it stops them after `close`)
        self.queue_bytes, self.timeout_s = queue_bytes, timeout_s
        self.fetch_batch, self.upload_batch_bytes = max(1, fetch_batch), upload_batch_bytes
        self.fetch_batch_bytes = fetch_batch_bytes
        self.breaker = Breaker(breaker_failures, breaker_s)
        self._queue: OrderedDict[bytes, _Upload] = OrderedDict()
        self._in_flight: dict[bytes, int] = {}  # key -> value bytes, being uploaded
        self._bytes = 0  # queued + in flight
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._fetch_seconds = 0.0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._uploader: asyncio.Task[None] | None = None
        self._spare_reads: set[asyncio.Future[Any]] = set()  # batches fetched ahead, not needed
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, executor: Executor, password: str | None = None,
                 password_file: str | os.PathLike[str] | None = None, tls_ca_file: str | None = None,
                 timeout_s: float = 1.0, secret_file: str | os.PathLike[str] | None = None, encrypt: bool = False,
                 **options: int | float) -> RemoteTier:
        """A tier on the Redis/Valkey store at ``url``, its keys and values derived and checked with the secret in
        ``secret_file`` (`Keyring`; encrypted too with ``encrypt``), wrapping and opening values on ``executor``
        (the daemon's `Threads.remote`); ``options`` are the constructor's. Connects lazily (an unreachable
        store is a miss, not an error here); ValueError for a bad URL or secret file."""
        parsed = parse_url(url)
        keyring = Keyring.from_file(secret_file, encrypt) if secret_file is not None else Keyring(b"", encrypt)
        secret = resolve_password(parsed, password, password_file)
        store = RedisStore(parsed, secret, timeout_s, tls_ca_file)
        masked = parsed.masked(secret is not None)
        if keyring.authenticated:
            log.info("remote tier: %s; keys derived from the secret, values %s", masked,
                     "encrypted (AES-256-GCM)" if encrypt else "authenticated (HMAC-SHA256)")
        else:
            log.warning("remote tier: %s without a secret (--remote-secret-file): whoever can write the store can "
                        "plant blocks, whoever can read it reads them (see Security in README)", masked)
        return cls(store, executor=executor, url=masked, keyring=keyring, timeout_s=timeout_s,
                   **options)  # type: ignore[arg-type]

    # -- the tiers' contract (tiers/base.py) --

    def write_behind(self, memory: Memory, scope: Scope, keys: Sequence[bytes], offsets: Sequence[int],
                     checksums: Sequence[int], release: Callable[[int], None]) -> int:
        """Queue these blocks' slots for upload, never a copy (a value carries its own MAC: the checksums
        are not needed). Each slot is read until ``release(i)`` (once per block, when it is uploaded,
        failed, dropped or skipped; maybe before this returns). Never waits. Returns how many were newly
        queued: keys already queued or uploading are skipped; when the queue is full, or the breaker open,
        the rest are dropped (counted). A namespace known by hash only has no name to key by: nothing is
        taken. ValueError where `offsets` are not one per key."""
        if not scope.name:
            for i in range(len(keys)):
                release(i)
            return 0
        tenant, name = split(scope.name)
        return self._offer(tenant, name, keys, [memory.view(offset, scope.block_bytes) for offset in offsets],
                           release)

    async def fetch_verified(self, memory: Memory, scope: Scope, keys: Sequence[bytes],
                             place: Place) -> AsyncGenerator[list[int]]:
        """The leading run of `keys` in the store, a batch at a time, each copied into the slots `place`
        gives as it is verified (one pass over the bytes) and yielded as its CRC32Cs (verified: the pool's
        seal checksum of the block); a value of another size than the scope's is corrupt. The next
        batch's GETs are under way while one is verified and handed over; a batch past the first miss is
        fetched for nothing, at most one. Never raises for store failures."""
        if not scope.name:
            return
        tenant, name = split(scope.name)

        def views(first: int, count: int) -> list[memoryview]:
            return [memory.view(offset, scope.block_bytes) for offset in place(first, count)]
        async with contextlib.aclosing(self._fetch_batches(tenant, name, keys, scope.block_bytes, views)) as batches:
            async for batch in batches:
                yield batch

    def holds(self, scope: Scope, keys: Sequence[bytes]) -> None:
        """Not known without asking the store (a round trip): only a fetch tells."""
        return None

    def unwritten(self, scope: Scope, keys: Sequence[bytes]) -> None:
        """Not counted: the store's dropped uploads are counted by cause (queue full, unhealthy, closed)."""

    def forget(self, scopes: Sequence[bytes] | None) -> Forgotten:
        """Nothing: the store's keys cannot be listed by namespace, and its values age out under the
        server's eviction; a Clear does not reach it."""
        return Forgotten({}, None)

    def names(self) -> dict[bytes, str]:
        return {}  # (the store's keys cannot be listed by namespace)

    def take_changes(self) -> list[tuple[bytes, bytes, bool]]:
        return []  # (shared by nodes: not this node's blocks to announce)

    def stats(self) -> RemoteStats:
        c = self._counts
        return RemoteStats(url=self.url, breaker=self.breaker.state, breaker_opens=self.breaker.opens,
                           fetch_seconds_sum=self._fetch_seconds, queued_blocks=len(self._queue) + len(self._in_flight),
                           queued_bytes=self._bytes, queue_limit_bytes=self.queue_bytes,
                           **{k: c[k] for k in _COUNTERS})

    async def aclose(self, drain_s: float) -> None:
        """Stop: upload what is queued for up to ``drain_s``, drop the rest (counted), close the store."""
        if drain_s > 0 and not self._idle.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_s):
                    await self._idle.wait()
        self._closed = True
        self._counts["dropped_closed"] += len(self._queue) + len(self._in_flight)
        if self._uploader is not None:
            self._uploader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._uploader
            self._uploader = None
        await asyncio.gather(*self._spare_reads, return_exceptions=True)
        self._drop_queue()
        self._idle.set()
        await self.store.close()

    # -- write-behind --

    def _offer(self, tenant: str, namespace: str, keys: Sequence[bytes], payloads: Sequence[Buffer],
               release: Callable[[int], None]) -> int:
        """`write_behind` of these payloads (views of the caller's memory, unchanged until released)."""
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys but {len(payloads)} offsets")
        if self._closed or self.breaker.blocked():
            self._counts["dropped_closed" if self._closed else "dropped_unhealthy"] += len(keys)
            for i in range(len(keys)):
                release(i)
            return 0
        queued = 0
        for i, rkey in enumerate(self.keyring.remote_keys(tenant, namespace, keys)):
            payload = bytes_view(payloads[i])
            size = self.keyring.value_bytes(payload.nbytes)
            if rkey in self._queue or rkey in self._in_flight:
                release(i)
                continue
            if self._bytes + size > self.queue_bytes:  # later blocks of a chain are useless without this one
                self._counts["dropped_full"] += len(keys) - i
                for j in range(i, len(keys)):
                    release(j)
                break
            self._queue[rkey] = _Upload(tenant, payload, partial(release, i), size)
            self._bytes += size
            queued += 1
        if queued:
            self._idle.clear()
            self._wake.set()
            if self._uploader is None or self._uploader.done():  # first use, or it died (logged)
                self._uploader = asyncio.get_running_loop().create_task(self._upload_loop(), name="remote-upload")
                self._uploader.add_done_callback(_log_death)
        return queued

    async def _upload_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                if not self.breaker.allow():
                    self._counts["dropped_unhealthy"] += len(self._queue)
                    self._drop_queue()
                    break
                await self._upload(self._take_batch())
            if not self._queue and not self._in_flight:
                self._idle.set()

    def _take_batch(self) -> list[tuple[bytes, _Upload]]:
        batch: list[tuple[bytes, _Upload]] = []
        size = 0
        # (payload bytes count: 32 values of 1 MiB are one batch, not 31 and a straggler)
        while self._queue and (not batch or size + next(iter(self._queue.values())).payload.nbytes
                               <= self.upload_batch_bytes):
            key, upload = self._queue.popitem(last=False)
            batch.append((key, upload))
            self._in_flight[key] = upload.size
            size += upload.payload.nbytes
        return batch

    async def _upload(self, batch: list[tuple[bytes, _Upload]]) -> None:
        try:  # (wrapped off the loop: a MAC or an encryption is a pass over the payload)
            values = await Threads.run(self._threads, self._wrap, batch)
            results = await self._call(self.store.put_many(values), len(batch))
        finally:
            for key, upload in batch:
                self._bytes -= self._in_flight.pop(key)
                upload.release()  # answered (every byte sent) or failed: the payload is not read again
        for (_, upload), result in zip(batch, results, strict=True):
            if result is not None:
                self._counts["upload_failed"] += 1
                continue
            self._counts["uploaded"] += 1
            self._counts["bytes_up"] += upload.size

    def _wrap(self, batch: list[tuple[bytes, _Upload]]) -> list[tuple[bytes, Sequence[Buffer]]]:
        return [(key, self.keyring.wrap(u.tenant, key, u.payload)) for key, u in batch]

    def _drop_queue(self) -> None:
        for upload in self._queue.values():
            self._bytes -= upload.size
            upload.release()
        self._queue.clear()

    # -- fetch --

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

    async def _call(self, op: Awaitable[list[T]], n: int) -> list[T | BaseException]:
        """Await one store call under the timeout; count its failures and tell the breaker."""
        results: list[T | BaseException]
        try:
            async with asyncio.timeout(self.timeout_s):
                results = list(await op)
        except Exception as e:  # TimeoutError included: a failed call fails each of its keys
            results = [e] * n
        failed = [r for r in results if isinstance(r, BaseException)]
        self._counts["errors"] += len(failed)
        self._counts["timeouts"] += sum(isinstance(r, (TimeoutError, RedisTimeoutError)) for r in failed)
        if failed:
            log.debug("remote store: %d of %d keys failed: %r", len(failed), n, failed[0])
            self.breaker.failure(failed[0])
        else:
            self.breaker.success()
        return results



def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("remote tier: the upload task died; restarted on the next offer", exc_info=task.exception())

