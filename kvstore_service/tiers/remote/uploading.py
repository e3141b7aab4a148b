"""The remote tier's write-behind: blocks queued as views of their slots (never copies), within
``queue_bytes``, and uploaded by one task, a batch at a time: wrapped (a MAC, or an encryption) on the
tier's threads, then sent in one store call; each block's slot is released once that call returned.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

from kvstore_service.threads import Threads
from kvstore_service.tiers.remote.calls import StoreCalls
from kvstore_service.tiers.remote.codec import Buffer, bytes_view

log = logging.getLogger("kvstore_service.tiers.remote")


class _Upload(NamedTuple):
    """A queued block: its value is wrapped from ``payload`` (a view of the caller's memory) when it is sent."""

    tenant: str
    payload: memoryview
    release: Callable[[], None]  # the caller's memory is no longer read
    size: int  # value bytes


class Uploading(StoreCalls):
    """`_offer`: `RemoteTier.write_behind`'s queue, and the task that empties it."""

    queue_bytes: int
    upload_batch_bytes: int
    _queue: OrderedDict[bytes, _Upload]
    _in_flight: dict[bytes, int]  # key -> value bytes, being uploaded
    _bytes: int  # queued + in flight
    _wake: asyncio.Event
    _idle: asyncio.Event
    _uploader: asyncio.Task[None] | None
    _closed: bool

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


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("remote tier: the upload task died; restarted on the next offer", exc_info=task.exception())
