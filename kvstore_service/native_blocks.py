"""The index's block records and LRU lists (csrc/block.cpp), typed: made, pinned and committed a batch at a time.

``kvstore_service.index.Block`` subclasses ``BlockRecord``; ``LruList`` links the records intrusively.
Each function here is one C call for a batch of blocks (a store's, a chunk's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from kvstore_service.native import _native

# The index's block record (csrc/block.cpp): kvstore_service.index.Block subclasses it and declares its
# fields (key, namespace, segment, slot, offset, header, state, pins, checksum, shards_in,
# shards_copying, tail, promoted): offset and header plain uint64s, the others object slots.
if TYPE_CHECKING:
    class BlockRecord:  # (no __slots__ here: mypy would then refuse the fields the subclass declares)
        pass

    _Record = TypeVar("_Record", bound=BlockRecord)

    class LruList(Generic[_Record]):
        """Blocks, least recently used first; a block is on one list at most (intrusive links)."""

        def append(self, blocks: list[_Record]) -> None:
            """Each block to the end (most recent), from wherever it was (this list, another, none)."""

        def touch(self, blocks: list[_Record]) -> None:
            """Those of the blocks on this list to its end; the others stay where they are."""

        def remove(self, blocks: list[_Record]) -> None:
            """Those of the blocks on this list off it."""

        def victims(self, n: int, committed: object, evictable: Callable[[_Record], bool]) -> list[_Record]:
            """Up to n blocks from the oldest, each unpinned in state `committed` (checked natively)
            or one for which evictable(block) is true (asked of the others only; it must only read)."""
            return []

        def __len__(self) -> int:
            return 0

        def __iter__(self) -> Iterator[_Record]:
            """Over a snapshot, oldest first."""
            return iter([])
else:
    BlockRecord, LruList = _native.BlockRecord, _native.LruList
    _Record = TypeVar("_Record")


def make_blocks(cls: type[_Record], keys: list[bytes], namespace: object, segment: int, slots: list[int],
                payload_base: int, payload_stride: int, header_base: int, header_stride: int,
                state: object) -> list[_Record]:
    """A block of `cls` in `state` for each key, in the slot beside it (of one segment): payload at
    payload_base + slot * payload_stride, header at header_base + slot * header_stride; no pins, no
    checksum, no shards, neither tail nor promoted. One C call for a store's thousands of blocks."""
    return list(_native.make_blocks(cls, keys, namespace, segment, slots, payload_base, payload_stride,
                                    header_base, header_stride, state))


def add_pins(blocks: Sequence[_Record], delta: int, doomed: object) -> list[_Record]:
    """Each block's pins += delta, in order; the blocks whose pins reached 0 in state `doomed`.
    ValueError (every change undone) if a block's pins would go below 0."""
    return list(_native.add_pins(blocks, delta, doomed))


def commit(blocks: list[_Record], writing: dict[bytes, _Record], committed: dict[bytes, _Record],
           state: object) -> list[_Record]:
    """Each block still in `writing` under its key moved to `committed` and set to `state`; those, in
    order (one C call for a store's chunk)."""
    return list(_native.commit(blocks, writing, committed, state))


def block_offsets(blocks: list[_Record], headers: bool = False) -> bytes:
    """The blocks' payload offsets in the pool (their slot headers' if `headers`) as native uint64s, as
    the copy and checksum calls take them (no int object made per block)."""
    return bytes(_native.block_offsets(blocks, headers))
