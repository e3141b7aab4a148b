"""What routers learn of the pool: per namespace, the blocks committed and removed, in order, for every
engine of the namespace to announce as its own CPU tier (vLLM's KV events; the connector turns these
into BlockStored and BlockRemoved).

A block is announced once it is committed (loadable) and described: an engine that stores a block also
sends what an event needs (token ids, parent hash, extra keys: `describe`, opaque bytes here), which the
daemon keeps while the block lives, within --max-event-bytes. A subscriber (an engine's scheduler) gets a
reset and the namespace's announced blocks first, then the changes; one that falls more than
--max-event-queue events behind is reset again (its queue never grows past that).

The index calls `committed` and `removed` (on the event loop, as every index change); nothing here writes
block state.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from kvstore_service.stats import EventStats

# Pending descriptions (of blocks not committed yet) kept at most this long a list per namespace.
MAX_PENDING = 1 << 16
CLOSED_CHECK_S = 1.0  # a watch notices its session ended within this


@dataclass(slots=True)
class Event:
    removed: bool  # False: stored (committed and described)
    key: bytes
    description: bytes = b""  # STORED: the engine's description of the block


@dataclass(eq=False)
class Subscriber:
    """One engine's stream: a bounded queue of events; `reset` set when it must start over."""

    limit: int
    queue: list[Event] = field(default_factory=list)
    reset: bool = True
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, event: Event, stats: EventStats) -> None:
        if self.reset:
            return  # the snapshot it gets next has it
        if len(self.queue) >= self.limit:
            self.queue.clear()
            self.reset = True
            stats.resyncs += 1
        else:
            self.queue.append(event)
        self.wake.set()


@dataclass(eq=False)
class _Namespace:
    announced: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)  # key -> description, in commit order
    pending: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)  # described, not committed yet
    subscribers: set[Subscriber] = field(default_factory=set)


class BlockEvents:
    def __init__(self, max_bytes: int, max_description_bytes: int, max_queue: int,
                 is_committed: Callable[[bytes, bytes], bool]) -> None:
        self.max_bytes = max_bytes
        # The index's answer (namespace hash, key): is the block committed? A block described after its
        # commit is announced at once. (The index is asked rather than mirrored: a set of every committed
        # key cost each store and eviction a C call per key, and memory per block.)
        self.is_committed = is_committed
        self.max_description_bytes = max_description_bytes
        self.max_queue = max_queue
        self.stats = EventStats()
        self._namespaces: dict[bytes, _Namespace] = {}

    def _ns(self, ns_hash: bytes) -> _Namespace:
        ns = self._namespaces.get(ns_hash)
        if ns is None:
            ns = self._namespaces[ns_hash] = _Namespace()
        return ns

    # -- from engines -----------------------------------------------------------------------------

    def describe(self, ns_hash: bytes, keys: Iterable[bytes], descriptions: Iterable[bytes]) -> None:
        """An engine's descriptions of blocks it stores (or holds): announced once committed."""
        ns = self._ns(ns_hash)
        for key, meta in zip(keys, descriptions, strict=True):
            if key in ns.announced or key in ns.pending or not meta:
                continue
            while self.stats.bytes + len(meta) > self.max_bytes and ns.pending:  # a store that never came
                self.stats.bytes -= len(ns.pending.popitem(last=False)[1])
            if len(meta) > self.max_description_bytes or self.stats.bytes + len(meta) > self.max_bytes:
                self.stats.dropped += 1
                continue
            self.stats.bytes += len(meta)
            if self.is_committed(ns_hash, key):
                self._announce(ns, key, meta)
            else:
                ns.pending[key] = meta
                if len(ns.pending) > MAX_PENDING:  # described, never stored: the oldest go
                    self.stats.bytes -= len(ns.pending.popitem(last=False)[1])

    # -- from the index -----------------------------------------------------------------------------

    def committed(self, ns_hash: bytes, keys: Iterable[bytes]) -> None:
        ns = self._namespaces.get(ns_hash)
        if ns is None or not ns.pending:  # no description waits for a commit (no router listens, say)
            return
        for key in keys:
            meta = ns.pending.pop(key, None)
            if meta is not None:  # (never announced: describe skips announced keys)
                self._announce(ns, key, meta)

    def removed(self, ns_hash: bytes, keys: Iterable[bytes]) -> None:
        ns = self._namespaces.get(ns_hash)
        if ns is None or not ns.announced:  # nothing announced (no router listens, say)
            return
        for key in keys:
            meta = ns.announced.pop(key, None)
            if meta is None:
                continue
            self.stats.bytes -= len(meta)
            event = Event(True, key)
            for sub in ns.subscribers:
                sub.push(event, self.stats)

    def _announce(self, ns: _Namespace, key: bytes, meta: bytes) -> None:
        ns.announced[key] = meta
        event = Event(False, key, meta)
        for sub in ns.subscribers:
            sub.push(event, self.stats)

    # -- to engines --------------------------------------------------------------------------------

    async def watch(self, ns_hash: bytes, batch: int,
                    closed: Callable[[], bool]) -> AsyncIterator[tuple[bool, list[Event]]]:
        """(reset, events) batches for one subscriber until `closed()` (checked at least every
        CLOSED_CHECK_S): after a reset, every block announced so far (in commit order), then the changes."""
        ns = self._ns(ns_hash)
        sub = Subscriber(self.max_queue)
        ns.subscribers.add(sub)
        try:
            while not closed():
                if sub.reset:
                    sub.reset = False
                    sub.queue.clear()
                    snapshot = [Event(False, k, m) for k, m in ns.announced.items()]
                    for i in range(0, max(len(snapshot), 1), batch):
                        self.stats.sent += len(snapshot[i:i + batch])
                        yield i == 0, snapshot[i:i + batch]
                    continue
                if not sub.queue:
                    sub.wake.clear()
                    try:
                        await asyncio.wait_for(sub.wake.wait(), CLOSED_CHECK_S)
                    except TimeoutError:
                        pass
                    continue
                events, sub.queue = sub.queue[:batch], sub.queue[batch:]
                self.stats.sent += len(events)
                yield False, events
        finally:
            ns.subscribers.discard(sub)
