"""What routers learn of the node's blocks: per namespace, the blocks committed to the pool and removed,
and those the disk tier holds and drops, in order, for every engine of the namespace to announce as its
own CPU and STORAGE tiers (vLLM's KV events; the connector turns these into BlockStored and BlockRemoved
of either medium).

A block is announced once it is committed (loadable) and described: an engine that stores a block also
sends what an event needs (token ids, parent hash, extra keys: `describe`, opaque bytes here), which the
daemon keeps while the block lives in the pool or on disk, within --max-event-bytes (each entry counted
with its key and ENTRY_BYTES of bookkeeping, once per medium). A block on disk is announced as such once
described and written there (`disk_changed`, told each housekeeping tick), so a block the pool evicts
stays announced on disk. The descriptions are also kept in a journal beside the pool (event_journal.py):
a restarted daemon reads it back (`restore`), and announces each block as soon as it is verified in the
pool or found on disk. A description whose block is not committed within PENDING_S (a store that
never came) is dropped, and under the budget the oldest such go first, whichever namespace they are in: a
tenant describing blocks it never stores cannot keep another's announced. A namespace with nothing
described and no subscriber is forgotten. A subscriber (an engine's scheduler) gets a reset and the
namespace's announced blocks first, then the changes; one that falls more than --max-event-queue events
behind is reset again (its queue never grows past that). Streams that are caught up get the same changes
in the same order: the batch one sends is the same object for the others of its namespace that send those
events next (`Batch`), so the transport encodes a change once, not once per stream.

The index calls `committed` and `removed` (on the event loop, as every index change), the daemon
`disk_changed`; nothing here writes block state.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from typing import Any

from kvstore_service.event_journal import Journal, Written
from kvstore_service.stats import EventStats

# Pending descriptions (of blocks not committed yet) kept at most this long a list per namespace, and
# this long: a store is committed within the connector's preemption wait (30 s) or never.
MAX_PENDING = 1 << 16
PENDING_S = 60.0
# What an entry costs beside its description: its key, an ordered dict's node and slot, a tuple.
ENTRY_BYTES = 160
CLOSED_CHECK_S = 1.0  # a watch notices its session ended within this


@dataclass(slots=True)
class Event:
    removed: bool  # False: stored (committed and described)
    key: bytes
    description: bytes = b""  # STORED: the engine's description of the block
    disk: bool = False  # the disk tier's copy, else the pool's


@dataclass(slots=True, eq=False)
class Batch:
    """Events a stream sends at once: after a `reset`, the namespace's announced blocks, else changes."""

    reset: bool
    events: list[Event]
    encoded: Any = None  # the transport's message, made by the first stream that sends the batch

    def same(self, events: list[Event]) -> bool:
        return len(events) == len(self.events) and all(a is b for a, b in zip(events, self.events, strict=True))


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
    on_disk: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)  # key -> description, announced on disk
    subscribers: set[Subscriber] = field(default_factory=set)
    sent: Batch | None = None  # the changes a stream sent last, for the others to send as they are

    def changes(self, events: list[Event]) -> Batch:
        if self.sent is None or not self.sent.same(events):
            self.sent = Batch(False, events)
        return self.sent

    @property
    def idle(self) -> bool:
        return not (self.announced or self.pending or self.on_disk or self.subscribers)

    def description(self, key: bytes) -> bytes | None:
        return self.announced.get(key) or self.pending.get(key) or self.on_disk.get(key)


def cost(key: bytes, meta: bytes) -> int:
    """What an entry counts against --max-event-bytes."""
    return len(key) + len(meta) + ENTRY_BYTES


class BlockEvents:
    def __init__(self, max_bytes: int, max_description_bytes: int, max_queue: int,
                 is_committed: Callable[[bytes, bytes], bool], journal: Journal | None = None) -> None:
        self.max_bytes = max_bytes
        # The index's answer (namespace hash, key): is the block committed? A block described after its
        # commit is announced at once. (The index is asked rather than mirrored: a set of every committed
        # key cost each store and eviction a C call per key, and memory per block.)
        self.is_committed = is_committed
        self.max_description_bytes = max_description_bytes
        self.max_queue = max_queue
        # Which of these keys (namespace hash, keys) the disk tier holds, once there is one (the daemon sets it).
        self.disk_holds: Callable[[bytes, Sequence[bytes]], Collection[bytes]] | None = None
        self.journal = journal
        self.stats = EventStats()
        self._namespaces: dict[bytes, _Namespace] = {}
        # Every pending description in the order it came: (when, namespace hash, key). An entry whose
        # description was committed or dropped meanwhile is skipped when it comes up.
        self._pending_order: deque[tuple[float, bytes, bytes]] = deque()

    def _ns(self, ns_hash: bytes) -> _Namespace:
        ns = self._namespaces.get(ns_hash)
        if ns is None:
            ns = self._namespaces[ns_hash] = _Namespace()
        return ns

    # -- from engines -----------------------------------------------------------------------------

    def describe(self, ns_hash: bytes, keys: Iterable[bytes], descriptions: Iterable[bytes]) -> None:
        """An engine's descriptions of blocks it stores (or holds): announced once committed."""
        ns = self._ns(ns_hash)
        now = time.monotonic()
        kept: dict[bytes, bytes] = {}
        for key, meta in zip(keys, descriptions, strict=True):
            if key in ns.announced or key in ns.pending or not meta:
                continue
            if len(meta) > self.max_description_bytes or not self._make_room(key, meta):
                self.stats.dropped += 1
                continue
            kept[key] = meta
            if self.is_committed(ns_hash, key):
                self._announce(ns, key, meta)
            else:
                ns.pending[key] = meta
                self._pending_order.append((now, ns_hash, key))
                if len(ns.pending) > MAX_PENDING:  # described, never stored: the oldest go
                    old, old_meta = ns.pending.popitem(last=False)
                    self.stats.bytes -= cost(old, old_meta)
        if kept and self.disk_holds is not None:
            for key in self.disk_holds(ns_hash, list(kept)):
                self._announce_on_disk(ns, key, kept[key])
        if kept and self.journal is not None:
            self.journal.append((ns_hash, key, meta) for key, meta in kept.items())
        self._forget_if_idle(ns_hash, ns)

    def _make_room(self, key: bytes, meta: bytes) -> bool:
        """Counts an entry against --max-event-bytes, first dropping pending descriptions (stores that never
        came, in any namespace) where it would not fit; False (nothing counted) if it still does not."""
        while self.stats.bytes + cost(key, meta) > self.max_bytes and self._drop_oldest_pending():
            pass
        if self.stats.bytes + cost(key, meta) > self.max_bytes:
            return False
        self.stats.bytes += cost(key, meta)
        return True

    def expire(self, now: float | None = None) -> None:
        """Housekeeping: descriptions waiting longer than PENDING_S for their block's commit go, and
        the namespaces left with nothing are forgotten."""
        deadline = (time.monotonic() if now is None else now) - PENDING_S
        while self._pending_order and self._pending_order[0][0] <= deadline:
            self._drop_oldest_pending()
        for ns_hash, ns in list(self._namespaces.items()):
            self._forget_if_idle(ns_hash, ns)

    async def rewrite_journal(self, off_loop: Callable[..., Awaitable[Written]]) -> None:
        """Housekeeping: the journal, once it has outgrown the descriptions held, rewritten with them, by
        `off_loop` (the journal thread), then put in place here (all of it on the loop, a rewrite at the
        default 64 MiB had stalled every RPC for 0.2-0.3 s)."""
        journal = self.journal
        if journal is None or journal.rewriting or not journal.due(self.stats.bytes):
            return
        journal.begin_rewrite()
        records = journal.read(self.max_description_bytes, upto=journal.size)  # (read on the thread, as it writes)
        journal.install(await off_loop(journal.write_new, records, self.holds))

    def holds(self, ns_hash: bytes, key: bytes, meta: bytes) -> bool:
        """Whether this block's description is held (in the pool, pending or on disk). Safe on any thread:
        a few lookups, each atomic under the GIL; no map is iterated."""
        ns = self._namespaces.get(ns_hash)
        return ns is not None and meta in (ns.announced.get(key), ns.pending.get(key), ns.on_disk.get(key))

    def restore(self) -> int:
        """At start: the descriptions the previous daemon kept, described again (a block recovered in the
        pool is announced once verified, one on disk at once); the journal then rewritten with what is
        held and kept from here. Returns how many were read."""
        if self.journal is None:
            return 0
        journal, self.journal = self.journal, None  # (not appended to while read)
        entries = list(journal.read(self.max_description_bytes))  # (read once: the rewrite keeps from these)
        for ns_hash, run in groupby(entries, key=itemgetter(0)):  # (a namespace's in a row: one describe each)
            described = list(run)
            self.describe(ns_hash, [key for _, key, _ in described], [meta for _, _, meta in described])
        self.journal = journal
        journal.rewrite(entries, self.holds)
        return len(entries)

    def _drop_oldest_pending(self) -> bool:
        """Drops the oldest pending description still waiting, anywhere; False if there is none."""
        while self._pending_order:
            _, ns_hash, key = self._pending_order.popleft()
            ns = self._namespaces.get(ns_hash)
            meta = ns.pending.pop(key, None) if ns is not None else None
            if meta is not None:
                self.stats.bytes -= cost(key, meta)
                return True
        return False

    def _forget_if_idle(self, ns_hash: bytes, ns: _Namespace) -> None:
        if ns.idle and self._namespaces.get(ns_hash) is ns:
            del self._namespaces[ns_hash]

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
        self._remove(ns_hash, keys, disk=False)

    def _remove(self, ns_hash: bytes, keys: Iterable[bytes], disk: bool) -> None:
        """Announced blocks of one medium gone: their descriptions dropped there, their removal streamed."""
        ns = self._namespaces.get(ns_hash)
        held = None if ns is None else ns.on_disk if disk else ns.announced
        if not held:  # nothing announced (no router listens, say)
            return
        assert ns is not None
        for key in keys:
            meta = held.pop(key, None)
            if meta is not None:
                self.stats.bytes -= cost(key, meta)
                self._push(ns, Event(True, key, disk=disk))
        self._forget_if_idle(ns_hash, ns)

    def _announce(self, ns: _Namespace, key: bytes, meta: bytes) -> None:
        ns.announced[key] = meta
        self._push(ns, Event(False, key, meta))

    def _push(self, ns: _Namespace, event: Event) -> None:
        for sub in ns.subscribers:
            sub.push(event, self.stats)

    # -- from the disk tier -----------------------------------------------------------------------

    def disk_changed(self, changes: Sequence[tuple[bytes, bytes, bool]]) -> None:
        """Blocks the disk tier wrote (True) or dropped (False) since it was last asked: (namespace hash,
        key, written), in order; a key b"" stands for every block of its namespace (a namespace b"": of every
        one). A written block is announced on disk if described."""
        for ns_hash, key, written in changes:
            if written:
                ns = self._namespaces.get(ns_hash)
                if ns is not None and (meta := ns.description(key)) is not None:
                    self._announce_on_disk(ns, key, meta)
            elif key:
                self._remove(ns_hash, (key,), disk=True)
            else:  # every block of the namespace (b"": of every namespace): a clear, a disk that failed
                for each in [ns_hash] if ns_hash else list(self._namespaces):
                    if (ns := self._namespaces.get(each)) is not None:
                        self._remove(each, list(ns.on_disk), disk=True)

    def _announce_on_disk(self, ns: _Namespace, key: bytes, meta: bytes) -> None:
        if key in ns.on_disk:
            return
        if not self._make_room(key, meta):
            self.stats.dropped += 1
            return
        ns.on_disk[key] = meta
        self._push(ns, Event(False, key, meta, disk=True))

    # -- to engines --------------------------------------------------------------------------------

    async def watch(self, ns_hash: bytes, batch: int, closed: Callable[[], bool]) -> AsyncIterator[Batch]:
        """Batches for one subscriber until `closed()` (checked at least every
        CLOSED_CHECK_S): after a reset, every block announced so far (in commit order), then the changes."""
        ns = self._ns(ns_hash)
        sub = Subscriber(self.max_queue)
        ns.subscribers.add(sub)
        try:
            while not closed():
                if sub.reset:
                    sub.reset = False
                    sub.queue.clear()
                    # The snapshot's keys now, each batch's events made as it goes (a namespace of
                    # millions of blocks is not copied whole per reset); a block removed meanwhile is
                    # left out, and its removal follows in the queue.
                    pooled, on_disk = list(ns.announced), list(ns.on_disk)  # (the pool's, then the disk's)
                    n = len(pooled)
                    for i in range(0, max(n + len(on_disk), 1), batch):
                        events = [Event(False, k, m) for k in pooled[i:i + batch]
                                  if (m := ns.announced.get(k)) is not None]
                        events += [Event(False, k, m, disk=True) for k in on_disk[max(i - n, 0):max(i + batch - n, 0)]
                                   if (m := ns.on_disk.get(k)) is not None]
                        self.stats.sent += len(events)
                        yield Batch(i == 0, events)
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
                yield ns.changes(events)
        finally:
            ns.subscribers.discard(sub)
            self._forget_if_idle(ns_hash, ns)
