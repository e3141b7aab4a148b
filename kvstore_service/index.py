"""Which key lives in which pool slot: the one owner and only writer of block and namespace state.

The event loop owns the index; nothing else touches its maps, and there are no locks. The rest of
the daemon keeps books through the verbs below, in the order vLLM's offload manager uses them:
`lookup`; `prepare_store` -> (copy) -> `complete_store`, later `hold` -> (checksum) -> `seal`;
`prepare_load` -> (copy) -> `complete_load`; `pin`/`unpin` for leases (`pin_present` while a lookup's
misses are promoted); `clear`; after a restart
`recover`, then `recovered` -> `hold` -> (checksum) -> `verify`.

A block is WRITING while its store copy runs (invisible to lookups and loads) and COMMITTED after.
Its slot header is written at its seal, with the checksum taken then, so only sealed blocks survive
a restart. A block found in the pool by `recover` is RECOVERED: as invisible as a WRITING one until
`verify` has compared its bytes with the checksum in its header; it then becomes COMMITTED, or it is
dropped if they differ. A store of its key meanwhile replaces it (the lookup missed it, after all).
Pinned blocks (leased, being loaded, sealed or verified) and WRITING blocks are never evicted; the
rest go least recently used first, per payload size; prompts' partial last blocks (tails) before
full ones: a tail serves only an exact repeat of its prompt, and measured on this index (benchmarks/
bench_tails.py) evicting tails first serves more of the prompts' tokens from a pool too small for
them. A block removed while pinned is DOOMED: its slot is freed at the last unpin.

Tensor parallelism: a namespace with `shards` > 1 keeps one slot per key holding every TP shard's
part (engine r writes part r). The block stays WRITING until every part is in, so one lookup answers
for all ranks and eviction, leases and Clear act on the whole group. A group some of whose parts
never came (a rank's store failed or its engine died) is evictable once no copy into it runs. Its
header, like any block's, is written at its seal, which follows its commit: a recovered slot holds a
whole group.
"""

from __future__ import annotations

import hashlib
import operator
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from itertools import chain, compress, groupby, repeat, takewhile
from typing import TYPE_CHECKING

from kvstore_client.protocol.groups import grouped_hit
from kvstore_service import native_blocks
from kvstore_service.keys import unpack_keys
from kvstore_service.pool import SLOT_HEADER_BYTES, Pool, SlotRef

if TYPE_CHECKING:
    from kvstore_service.events import BlockEvents

_first = operator.itemgetter(0)
_key = operator.attrgetter("key")
_segment = operator.attrgetter("segment")
_slot = operator.attrgetter("slot")
_namespace = operator.attrgetter("namespace")
_kind = operator.attrgetter("namespace", "state", "tail")
_is_block = partial(operator.is_not, None)


class BlockState(Enum):
    WRITING = "writing"  # its store copy runs; its slot header is invalid
    RECOVERED = "recovered"  # found in the pool after a restart; invisible until its checksum is verified
    COMMITTED = "committed"  # every byte is in (and verified if recovered); lookups and loads see it
    DOOMED = "doomed"  # removed while pinned; the slot is freed at the last unpin


def namespace_hash(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


@dataclass(slots=True)
class NamespaceCounters:
    hits: int = 0
    misses: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    evictions: int = 0


@dataclass(slots=True, eq=False)
class Namespace:
    name: str  # "" when recovered from the pool (headers carry the hash only) until an engine names it
    ns_hash: bytes
    block_bytes: int  # of a whole block: every shard's part
    shards: int = 1  # 0: recovered from the pool, unknown until an engine registers
    counters: NamespaceCounters = field(default_factory=NamespaceCounters)
    # Written by BlockIndex only.
    _committed: dict[bytes, Block] = field(default_factory=dict)
    _writing: dict[bytes, Block] = field(default_factory=dict)
    _recovered: dict[bytes, Block] = field(default_factory=dict)

    @property
    def blocks(self) -> int:
        return len(self._committed) + len(self._writing) + len(self._recovered)


class Block(native_blocks.BlockRecord):
    """A key's slot in the pool. Its fields live in a native record (csrc/block.cpp): a store makes
    thousands of blocks in one `native_blocks.make_blocks` call each (a dataclass's Python __init__ per
    block took a third of a store's bookkeeping). Identity is equality, as for any object."""

    __slots__ = ()
    key: bytes
    namespace: Namespace
    segment: int
    slot: int
    offset: int  # of the payload in the pool file
    header: int  # of the slot header in the pool file
    state: BlockState
    pins: int
    checksum: int | None  # None until taken at the seal; recovered: from the slot header
    # Sharded namespaces, while WRITING: bit r set when shard r's part is in / being copied.
    shards_in: int
    shards_copying: int
    tail: bool  # a prompt's partial last block: evicted before full blocks
    promoted: bool  # brought in from a lower tier (not offered back to it)

    def __init__(self, key: bytes, namespace: Namespace, segment: int, slot: int, offset: int, header: int,
                 state: BlockState = BlockState.WRITING, pins: int = 0, checksum: int | None = None) -> None:
        self.key, self.namespace, self.segment, self.slot, self.offset, self.header = (
            key, namespace, segment, slot, offset, header)
        self.state, self.pins, self.checksum = state, pins, checksum
        self.shards_in = self.shards_copying = 0
        self.tail = self.promoted = False

    def __repr__(self) -> str:
        return (f"Block(key={self.key.hex()}, segment={self.segment}, slot={self.slot}, state={self.state.name}, "
                f"pins={self.pins})")

    @property
    def ref(self) -> SlotRef:
        return SlotRef(self.segment, self.slot)


def _map_of(ns: Namespace, state: BlockState) -> dict[bytes, Block]:
    """The map of the namespace that present blocks in this state live in."""
    if state is BlockState.COMMITTED:
        return ns._committed
    return ns._recovered if state is BlockState.RECOVERED else ns._writing


def _consume(calls: Iterable[object]) -> None:
    """Run a map's calls in C (no Python code per item)."""
    deque(calls, maxlen=0)


@dataclass(slots=True)
class StorePlan:
    """What `prepare_store` decided for each key of a chunk (indexes into the keys given)."""

    present: list[int]  # already committed: nothing to copy
    in_flight: list[tuple[int, Block]]  # being written by another store: wait for it
    reserved: list[int]  # a fresh WRITING slot each (in `blocks`): copy these
    blocks: list[Block]
    refused: int  # no slot could be freed (every block pinned or being written)


class BlockIndex:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.namespaces: dict[bytes, Namespace] = {}
        self.count = 0
        self.evictions = 0
        self._lru: dict[int, native_blocks.LruList[Block]] = {}  # payload size -> committed blocks, oldest first
        self._tails: dict[int, native_blocks.LruList[Block]] = {}  # ... the tails among them: evicted first
        self._by_segment: dict[int, dict[int, Block]] = {}
        # Told of the blocks evicted (not of those cleared or replaced): the disk tier counts the ones
        # evicted before their seal, which never reach it (tiers/).
        self.on_evict: Callable[[list[Block]], None] | None = None
        # Told of every block committed and every committed block removed, in order (routers' events).
        self.events: BlockEvents | None = None

    # -- namespaces ------------------------------------------------------------------------------

    def namespace(self, name: str, block_bytes: int, shards: int = 1) -> Namespace:
        """The namespace, created on first use; its block size and shards are fixed from then on."""
        ns_hash = namespace_hash(name)
        ns = self.namespaces.get(ns_hash)
        if ns is None:
            return self.namespaces.setdefault(ns_hash, Namespace(name, ns_hash, block_bytes, shards))
        if ns.block_bytes != block_bytes or ns.shards not in (0, shards):
            raise ValueError(f"namespace {name!r} holds {ns.block_bytes}-byte blocks in {ns.shards} shard(s), "
                             f"this layout has {block_bytes}-byte blocks in {shards}")
        if not ns.name:  # recovered from the pool by hash only
            ns.name, ns.shards = name, shards
        return ns

    def find_namespace(self, name: str) -> Namespace | None:
        return self.namespaces.get(namespace_hash(name))

    def forget_empty(self, in_use: set[Namespace]) -> int:
        """Drop the namespaces that hold no block and that no session uses. Returns how many."""
        empty = [h for h, ns in self.namespaces.items() if not ns.blocks and ns not in in_use]
        for ns_hash in empty:
            del self.namespaces[ns_hash]
        return len(empty)

    # -- lookups and pins ------------------------------------------------------------------------

    def lookup(self, ns: Namespace, keys: bytes, key_size: int) -> list[Block]:
        """The blocks of the leading keys (packed, `key_size` bytes each) that are all committed.
        Iterators chained in C, no Python code per key: a 1000-key lookup is on the RPC's latency."""
        found: list[Block] = list(takewhile(_is_block, map(ns._committed.get, unpack_keys(keys, key_size))))  # type: ignore[arg-type]
        ns.counters.hits += len(found)
        ns.counters.misses += len(keys) // key_size - len(found)
        return found

    def lookup_groups(self, ns: Namespace, keys: bytes, key_size: int, spans: Sequence[int]) -> tuple[int, list[Block]]:
        """A grouped lookup (kvstore_client.protocol.groups): the blocks of the longest hit every group
        can serve, and the blocks it needs, block by block."""
        found = list(map(ns._committed.get, unpack_keys(keys, key_size)))
        n, needed = grouped_hit(spans, len(found), lambda k: found[k] is not None)
        blocks: list[Block] = [found[k] for k in needed]  # type: ignore[misc]
        ns.counters.hits += len(blocks)
        ns.counters.misses += len(found) - len(blocks)
        return n, blocks

    def is_committed(self, ns_hash: bytes, key: bytes) -> bool:
        """The namespace (by hash) holds this key committed (no hit or miss counted; routers' events)."""
        ns = self.namespaces.get(ns_hash)
        return ns is not None and key in ns._committed

    def leading(self, ns: Namespace, keys: list[bytes]) -> int:
        """How many of the leading keys are committed (no hit or miss counted)."""
        return sum(1 for _ in takewhile(ns._committed.__contains__, keys))

    def pin_present(self, ns: Namespace, keys: list[bytes]) -> list[Block]:
        """Pin the committed blocks of these keys (a lookup's, while its misses are promoted: the
        promotion's evictions must not take the blocks it is completing); returns them, to unpin."""
        held: list[Block] = list(filter(_is_block, map(ns._committed.get, keys)))  # type: ignore[arg-type]
        self.pin(held)
        return held

    def pin(self, blocks: list[Block]) -> None:
        """Keep blocks of one namespace from eviction (a lease, a load), most recently used from now."""
        if not blocks:
            return
        native_blocks.add_pins(blocks, 1, BlockState.DOOMED)
        size = blocks[0].namespace.block_bytes
        for lru in (self._lru.get(size), self._tails.get(size)):
            if lru is not None:
                lru.touch(blocks)  # (those on it)

    def unpin(self, blocks: Sequence[Block]) -> None:
        doomed = native_blocks.add_pins(blocks, -1, BlockState.DOOMED)
        if doomed:
            self._free(doomed)

    def _make_recent(self, block: Block) -> None:
        """Put the block at the end (most recent) of its LRU list, whether it is on it or not."""
        self._list_of(block.namespace.block_bytes, block.tail).append([block])

    def _list_of(self, payload_size: int, tail: bool) -> native_blocks.LruList[Block]:
        lists = self._tails if tail else self._lru
        lru = lists.get(payload_size)
        if lru is None:
            lru = lists[payload_size] = native_blocks.LruList()
        return lru

    # -- stores ----------------------------------------------------------------------------------

    def prepare_store(self, ns: Namespace, keys: list[bytes], shard: int = 0, tails: int = 0) -> StorePlan:
        """Sort a chunk's keys: present, being written by another store, or new; reserve a WRITING
        slot for each new key (evicting if needed) until the pool runs out. The last `tails` keys
        are prompts' partial last blocks."""
        if ns._recovered:  # (only until the blocks recovered at a restart are verified)
            for key in ns._recovered.keys() & keys:
                self._discard(ns._recovered[key])  # replaced by this store: lookups missed it
        plan = self._prepare_shard_store(ns, keys, 1 << shard) if ns.shards > 1 else self._prepare(ns, keys)
        if tails:
            for i, block in zip(plan.reserved, plan.blocks, strict=True):
                block.tail = i >= len(keys) - tails
        return plan

    def _prepare(self, ns: Namespace, keys: list[bytes]) -> StorePlan:
        present: list[int] = []
        in_flight: list[tuple[int, Block]] = []
        committed, writing = ns._committed, ns._writing
        if committed.keys().isdisjoint(keys) and writing.keys().isdisjoint(keys):  # the usual case, in C
            new = list(range(len(keys)))
            blocks = self._reserve(ns, keys)
        else:
            new = []
            for i, key in enumerate(keys):
                if key in committed:
                    present.append(i)
                elif key in writing:
                    in_flight.append((i, writing[key]))
                else:
                    new.append(i)
            blocks = self._reserve(ns, [keys[i] for i in new])
        return StorePlan(present, in_flight, new[:len(blocks)], blocks, len(new) - len(blocks))

    def _prepare_shard_store(self, ns: Namespace, keys: list[bytes], bit: int) -> StorePlan:
        """As prepare_store, for one shard's part of each key's group: a key whose group is being
        written is joined (this part copied into the group's slot) unless this part is in already
        (present) or being copied (in flight)."""
        present: list[int] = []
        in_flight: list[tuple[int, Block]] = []
        joined: list[int] = []
        new: list[int] = []
        committed, writing = ns._committed, ns._writing
        for i, key in enumerate(keys):
            block = writing.get(key)
            if key in committed or (block is not None and block.shards_in & bit):
                present.append(i)
            elif block is None:
                new.append(i)
            elif block.shards_copying & bit:
                in_flight.append((i, block))
            else:
                block.shards_copying |= bit  # (not evictable from now on)
                joined.append(i)
        blocks = [writing[keys[i]] for i in joined] + self._reserve(ns, [keys[i] for i in new])
        for block in blocks[len(joined):]:
            block.shards_copying = bit
        reserved = joined + new[:len(blocks) - len(joined)]
        return StorePlan(present, in_flight, reserved, blocks, len(joined) + len(new) - len(blocks))

    def _reserve(self, ns: Namespace, keys: list[bytes]) -> list[Block]:
        """A WRITING slot for each key (the first ones when the pool runs out): free slots, then
        those of the least recently used blocks. A slot's header stays invalid until its bytes are
        in: a crash mid-copy drops it."""
        blocks = self._place(ns, keys)
        if len(blocks) < len(keys):
            self._evict(self._victims(ns.block_bytes, len(keys) - len(blocks)))
            blocks += self._place(ns, keys[len(blocks):])
        while len(blocks) < len(keys) and self._empty_segment(ns.block_bytes):  # none of this size left
            placed = self._place(ns, keys[len(blocks):])
            if not placed:
                break
            blocks += placed
        ns._writing.update(zip(keys, blocks, strict=False))  # blocks: the first keys
        self.count += len(blocks)
        return blocks

    def _place(self, ns: Namespace, keys: list[bytes]) -> list[Block]:
        """Blocks for the first keys in free slots, as many as there are: made natively, a segment's
        at a time (this runs for every stored block)."""
        blocks: list[Block] = []
        for seg, slots in self.pool.allocate_many(ns.block_bytes, len(keys)):
            new = native_blocks.make_blocks(
                Block, keys[len(blocks):len(blocks) + len(slots)], ns, seg.index, slots, seg.payload_base,
                seg.payload_stride, seg.offset, SLOT_HEADER_BYTES, BlockState.WRITING)
            self._by_segment.setdefault(seg.index, {}).update(zip(slots, new, strict=True))
            blocks += new
        return blocks

    def _victims(self, payload_size: int, n: int) -> list[Block]:
        """The n least recently used evictable blocks of this size (tails first), in one pass over
        the LRU lists. (One eviction at a time passed the blocks pinned at their head, a seal's, once
        per eviction: a full pool under stores looked at ~20 blocks per slot, 13 ms per 2048 blocks.)"""
        victims: list[Block] = []
        for lru in (self._tails.get(payload_size), self._lru.get(payload_size)):
            if lru is not None and len(victims) < n:
                victims += lru.victims(n - len(victims), BlockState.COMMITTED, self._evictable)
        return victims

    def reserve(self, ns: Namespace, keys: list[bytes]) -> list[Block]:
        """WRITING slots for whole blocks that a lower tier holds (promotion): for the leading keys
        absent from the namespace (as far as the pool has room); commit them with
        `complete_store(blocks, ok, all_shards=True)`."""
        committed, writing = ns._committed, ns._writing
        absent = list(takewhile(lambda k: k not in committed and k not in writing, keys))
        if ns._recovered:  # an unverified copy is replaced by the tier's verified one, as by a store
            for key in ns._recovered.keys() & absent:
                self._discard(ns._recovered[key])
        blocks = self._reserve(ns, absent)
        if ns.shards > 1:
            for block in blocks:
                block.shards_copying = (1 << ns.shards) - 1  # every part at once
        return blocks

    def complete_promotion(self, blocks: list[Block], checksums: Sequence[int | None]) -> list[Block]:
        """These `reserve`d blocks are in, verified by their tier with these checksums: committed (as
        `complete_store(blocks, True, all_shards=True)`) and marked promoted (never written down again). Returns
        the committed ones; queue them for their seal, which then only writes their slot headers."""
        for block, checksum in zip(blocks, checksums, strict=True):
            block.checksum = checksum
        done = self.complete_store(blocks, True, all_shards=True)
        for block in done:
            block.promoted = True
        return done

    def keys_held(self, ns_hash: bytes, keys: Iterable[bytes]) -> int:
        """How many of these keys the namespace (by hash; none if unknown) holds, in any state."""
        ns = self.namespaces.get(ns_hash)
        if ns is None:
            return 0
        return len(set(keys) & (ns._committed.keys() | ns._writing.keys() | ns._recovered.keys()))

    def complete_store(self, blocks: list[Block], ok: bool, shard: int = 0, all_shards: bool = False) -> list[Block]:
        """The copy of these blocks (of one namespace) ended. If `ok`, every byte is in the pool: they
        are committed (lookups and loads see them; their headers wait for their seal). Returns the
        committed ones; a block dropped while it was written is not among them (its slot is free
        already), nor is any block of a failed copy. Sharded: a group is committed when its last
        part is in (`all_shards`: these copies held every shard's part, as a promotion's do)."""
        if not blocks:
            return []
        ns = blocks[0].namespace
        if ns.shards > 1:
            return self._complete_shard_store(blocks, ok, (1 << ns.shards) - 1 if all_shards else 1 << shard)
        if not ok:
            self._drop(list(compress(blocks, self.present_all(blocks))))
            return []
        done = native_blocks.commit(blocks, ns._writing, ns._committed, BlockState.COMMITTED)
        if self.events is not None:
            self.events.committed(ns.ns_hash, map(_key, done))
        tail = done[-1] if done and done[-1].tail else None  # (a chunk's tail is its last block)
        self._list_of(ns.block_bytes, False).append(done[:-1] if tail else done)
        if tail is not None:
            self._make_recent(tail)
        ns.counters.stored_blocks += len(done)
        return done

    def _complete_shard_store(self, blocks: list[Block], ok: bool, bits: int) -> list[Block]:
        ns = blocks[0].namespace
        full = (1 << ns.shards) - 1
        done: list[Block] = []
        for block in blocks:
            if not self.present(block):
                continue  # dropped while copied
            block.shards_copying &= ~bits
            if ok:
                block.shards_in |= bits
            if block.shards_in == full:
                done.append(block)
            elif not block.shards_copying:
                if block.shards_in:  # waiting for the other shards: evictable meanwhile, as recent
                    self._make_recent(block)
                else:
                    self._drop([block])
        for block in done:
            del ns._writing[block.key]
            block.state = BlockState.COMMITTED
            ns._committed[block.key] = block
            self._make_recent(block)
        if self.events is not None:
            self.events.committed(ns.ns_hash, map(_key, done))
        ns.counters.stored_blocks += len(done)
        return done

    def hold(self, blocks: list[Block]) -> list[Block]:
        """Those of these blocks still present, pinned (their slots must not be reused while their
        checksums are taken): `seal` them if committed, `verify` them if recovered."""
        held = list(compress(blocks, self.present_all(blocks)))
        native_blocks.add_pins(held, 1, BlockState.DOOMED)  # (not touched: a seal is no use)
        return held

    def seal(self, blocks: list[Block], checksums: list[int] | None) -> None:
        """Their checksums are taken and sealed into their slot headers (None: that failed, and they
        have no header). Unpins them; a block dropped meanwhile gets its header invalidated (its slot
        was still ours)."""
        present = self.present_all(blocks)
        for block in compress(blocks, map(operator.not_, present)):
            self.pool.invalidate(block.ref)
        if checksums is not None:  # (C-level: thousands of blocks)
            _consume(map(setattr, compress(blocks, present), repeat("checksum"), compress(checksums, present)))
        self.unpin(blocks)

    def recovered(self) -> list[list[Block]]:
        """The recovered blocks not verified yet, a list per namespace, oldest first."""
        return [list(ns._recovered.values()) for ns in self.namespaces.values() if ns._recovered]

    @property
    def unverified_blocks(self) -> int:
        """Recovered blocks waiting for `verify` (invisible meanwhile)."""
        return sum(len(ns._recovered) for ns in self.namespaces.values())

    def verify(self, blocks: list[Block], checksums: list[int] | None) -> int:
        """The checksums of these held, recovered blocks, taken now (None: that failed). A block
        whose bytes match the checksum taken when it was stored becomes visible (committed); the
        others are dropped and their headers invalidated. Unpins them. Returns how many differed."""
        corrupt = 0
        for n, block in enumerate(blocks):
            if not self.present(block):  # replaced by a store, evicted or cleared meanwhile
                continue
            if checksums is not None and checksums[n] == block.checksum:
                del block.namespace._recovered[block.key]
                block.state = BlockState.COMMITTED
                block.namespace._committed[block.key] = block
                if self.events is not None:
                    self.events.committed(block.namespace.ns_hash, (block.key,))
            else:
                if checksums is not None:
                    corrupt += 1
                self._discard(block)
        self.unpin(blocks)
        return corrupt

    # -- loads -----------------------------------------------------------------------------------

    def prepare_load(self, ns: Namespace, keys: list[bytes]) -> list[Block | None]:
        """The committed block of each key, pinned until `complete_load`; None where absent."""
        blocks = list(map(ns._committed.get, keys))
        self.pin(list(filter(None, blocks)))
        return blocks

    def complete_load(self, blocks: list[Block], corrupt: list[Block]) -> None:
        """The copy of these blocks ended; `corrupt` ones failed their checksum and are removed."""
        for block in corrupt:
            self._discard(block)
        if blocks:
            ns, loaded = blocks[0].namespace, len(blocks) - len(corrupt)
            ns.counters.loaded_blocks += loaded
            ns.counters.loaded_bytes += loaded * ns.block_bytes // max(ns.shards, 1)  # this shard's part of each
        self.unpin(blocks)

    # -- removal ---------------------------------------------------------------------------------

    def clear(self, ns: Namespace | None = None) -> int:
        """Drop every unpinned committed or recovered block and every group missing parts that no
        copy writes into (of one namespace). Returns how many."""
        namespaces = [ns] if ns is not None else list(self.namespaces.values())
        victims = [b for n in namespaces for b in chain(n._committed.values(), n._writing.values(),
                                                        n._recovered.values())
                   if self._evictable(b)]
        self._drop(victims)
        return len(victims)

    def present(self, block: Block) -> bool:
        """The block is still in the index (not dropped, evicted or replaced)."""
        return _map_of(block.namespace, block.state).get(block.key) is block

    def present_all(self, blocks: list[Block]) -> list[bool]:
        """`present` of each of these blocks of one namespace: with no Python code per block while
        they are committed (a seal asks for thousands; one call each took a third of its loop time)."""
        if not blocks:
            return []
        found = list(map(operator.is_, map(blocks[0].namespace._committed.get, map(_key, blocks)), blocks))
        if all(found):
            return found
        return [f or self.present(b) for f, b in zip(found, blocks, strict=True)]

    def _drop(self, blocks: list[Block]) -> None:
        """Remove unpinned blocks and free their slots."""
        self._unlist(blocks)
        self._free(blocks)

    def _discard(self, block: Block) -> None:
        """Remove a bad or replaced block at once; its slot is freed when the last pin goes."""
        if not self.present(block):
            return
        if block.pins == 0:
            self._drop([block])
            return
        self._unlist([block])
        self.pool.invalidate(block.ref)  # a restart must not bring it back
        block.state = BlockState.DOOMED

    def _unlist(self, blocks: list[Block]) -> None:
        """Take present blocks out of their namespaces' maps and LRU lists. An eviction or a clear
        removes thousands: in runs of one namespace, state and list (LRU order makes them long), with
        C-level loops; one call per block cost a full pool's stores more than their own blocks did."""
        removed: dict[Namespace, list[bytes]] = {}  # committed keys, for the routers' events
        for (ns, state, tail), run in groupby(blocks, _kind):
            gone = list(run)
            keys = list(map(_key, gone))
            _consume(map(_map_of(ns, state).__delitem__, keys))
            lru = (self._tails if tail else self._lru).get(ns.block_bytes)
            if lru is not None:
                lru.remove(gone)
            if state is BlockState.COMMITTED:
                removed.setdefault(ns, []).extend(keys)
        self.count -= len(blocks)
        if self.events is not None:
            for ns, keys in removed.items():
                self.events.removed(ns.ns_hash, keys)

    def _free(self, blocks: list[Block]) -> None:
        for segment, run in groupby(sorted(blocks, key=_segment), _segment):
            slots = list(map(_slot, run))
            _consume(map(self._by_segment[segment].__delitem__, slots))
            self.pool.release(segment, slots)

    def _evictable(self, block: Block) -> bool:
        """Committed or recovered and unpinned, or a group missing parts that no copy writes into."""
        if block.state is BlockState.WRITING:
            return block.shards_in != 0 and block.shards_copying == 0
        return block.state is not BlockState.DOOMED and block.pins == 0

    def _evict(self, blocks: list[Block]) -> None:
        for ns, run in groupby(blocks, _namespace):  # (LRU order: long runs)
            ns.counters.evictions += len(list(run))
        self.evictions += len(blocks)
        if self.on_evict is not None:
            self.on_evict(blocks)
        self._drop(blocks)

    def _empty_segment(self, payload_size: int) -> bool:
        """Empty the segment of the least recently used block of another size whose blocks are all
        evictable, for blocks of this size (the caller fills all its slots before it asks again).
        False if there is none."""
        for size, other in chain(self._tails.items(), self._lru.items()):
            if size == payload_size:
                continue
            for block in other:
                segment = self._by_segment.get(block.segment, {})
                if all(self._evictable(b) for b in segment.values()):
                    self._evict(list(segment.values()))
                    return True
        return False

    # -- restart ---------------------------------------------------------------------------------

    def recover(self) -> int:
        """Rebuild the index from a re-attached pool's slot headers (oldest first, for LRU). The
        blocks are RECOVERED: unseen until `verify` checked them against their headers' checksums."""
        found = sorted(self.pool.recover(), key=lambda item: item[1].generation)
        for ref, header in found:
            ns = self.namespaces.get(header.ns_hash)
            if ns is None:
                ns = self.namespaces[header.ns_hash] = Namespace("", header.ns_hash, header.payload_len, shards=0)
            block = Block(header.key, ns, ref.segment, ref.slot, self.pool.payload_offset(ref),
                          self.pool.header_offset(ref), BlockState.RECOVERED, 0, header.checksum)
            ns._recovered[block.key] = block
            self.count += 1
            self._by_segment.setdefault(block.segment, {})[block.slot] = block
            self._list_of(ns.block_bytes, False).append([block])
        return len(found)
