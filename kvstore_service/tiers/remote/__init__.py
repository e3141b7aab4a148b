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
breaker (breaker.py), the calls to the store under its timeout and breaker (calls.py), the uploads of
the blocks written behind (uploading.py) and the fetches (fetching.py). Capacity and eviction belong to
the server (``maxmemory`` + ``allkeys-lru``): the tier never deletes a valid value.

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
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from kvstore_service.stats import RemoteStats
from kvstore_service.tenants import split
from kvstore_service.tiers.base import Forgotten, Memory, Place, Scope
from kvstore_service.tiers.remote.breaker import Breaker
from kvstore_service.tiers.remote.codec import PUBLIC, Keyring
from kvstore_service.tiers.remote.fetching import Fetching
from kvstore_service.tiers.remote.store import RedisStore, RemoteStore
from kvstore_service.tiers.remote.uploading import Uploading
from kvstore_service.tiers.remote.url import parse_url, resolve_password

log = logging.getLogger(__name__)

# -- the tier ------------------------------------------------------------------------------------

_COUNTERS = tuple(f.name for f in dataclasses.fields(RemoteStats)
                  if f.name not in ("url", "breaker", "breaker_opens", "fetch_seconds_sum", "queued_blocks",
                                    "queued_bytes", "queue_limit_bytes"))


class RemoteTier(Uploading, Fetching):
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
        self._queue = OrderedDict()  # key -> a block queued (see Uploading)
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
