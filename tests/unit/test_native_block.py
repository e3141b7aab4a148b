"""The index's native pieces as a spec: blocks made in a batch (`native_blocks.make_blocks`), the intrusive LRU
lists (`native_blocks.LruList`) the index keeps them on, pins and commits over many blocks; and the packed keys
a job unpacks a chunk at a time."""

from __future__ import annotations

import gc
import sys
import weakref
from array import array

import pytest

from kvstore_service import native_blocks
from kvstore_service.index import Block, BlockState, Namespace
from kvstore_service.keys import PackedKeys


def make(keys: list[bytes], ns: Namespace | None = None, first_slot: int = 0) -> list[Block]:
    ns = ns or Namespace("n", b"h" * 16, 4096)
    slots = list(range(first_slot, first_slot + len(keys)))
    return native_blocks.make_blocks(Block, keys, ns, 3, slots, 1 << 20, 4096, 512, 128, BlockState.WRITING)


def test_made_blocks_have_their_slots_addresses_and_the_defaults_of_a_new_block() -> None:
    ns = Namespace("n", b"h" * 16, 4096)
    blocks = make([b"a", b"b"], ns, first_slot=5)
    b = blocks[1]
    assert (b.key, b.namespace, b.segment, b.slot) == (b"b", ns, 3, 6)
    assert (b.offset, b.header) == ((1 << 20) + 6 * 4096, 512 + 6 * 128)
    assert (b.state, b.pins, b.checksum, b.shards_in, b.shards_copying, b.tail, b.promoted) == (
        BlockState.WRITING, 0, None, 0, 0, False, False)
    assert type(b) is Block and b.ref == (3, 6)
    b.pins += 1
    assert (b.pins, blocks[0].pins) == (1, 0)
    with pytest.raises(AttributeError):
        b.other = 1  # type: ignore[attr-defined]


def test_made_blocks_match_blocks_made_one_by_one() -> None:
    ns = Namespace("n", b"h" * 16, 4096)
    one = Block(b"k", ns, 3, 7, (1 << 20) + 7 * 4096, 512 + 7 * 128)
    made = make([b"k"], ns, first_slot=7)[0]
    fields = ("key", "namespace", "segment", "slot", "offset", "header", "state", "pins", "checksum", "shards_in",
              "shards_copying", "tail", "promoted")
    assert [getattr(one, f) for f in fields] == [getattr(made, f) for f in fields]


def test_make_blocks_refuses_what_is_not_a_block_type_or_a_pair_of_equal_lists() -> None:
    with pytest.raises(TypeError, match="BlockRecord"):
        native_blocks.make_blocks(object, [b"k"], None, 0, [0], 0, 1, 0, 1, None)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="one length"):
        native_blocks.make_blocks(Block, [b"k", b"l"], None, 0, [0], 0, 1, 0, 1, None)
    with pytest.raises(OverflowError):
        native_blocks.make_blocks(Block, [b"k"], None, 0, [-1], 0, 1, 0, 1, None)
    with pytest.raises(OverflowError, match="overflow 64 bits"):  # (wrapped, it would name another slot's bytes)
        native_blocks.make_blocks(Block, [b"k"], None, 0, [1 << 44], 4096, 1 << 20, 0, 128, None)


def test_a_namespace_and_its_blocks_are_collected_together() -> None:
    ns = Namespace("n", b"h" * 16, 4096)
    marker = weakref.ref(counters := type("Counters", (), {})())
    ns.counters = counters  # type: ignore[assignment]
    for block in make([b"a", b"b"]) + [Block(b"c", ns, 0, 0, 0, 0)]:
        block.namespace = ns
        ns._committed[block.key] = block
    del ns, counters, block
    gc.collect()
    assert marker() is None


def test_lru_list_keeps_blocks_oldest_first_and_moves_them_on_append_and_touch() -> None:
    a, b, c, d = make([b"a", b"b", b"c", b"d"])
    lru: native_blocks.LruList[Block] = native_blocks.LruList()
    lru.append([a, b, c])
    assert list(lru) == [a, b, c] and len(lru) == 3
    lru.touch([a, d])  # d is on no list: left off
    assert list(lru) == [b, c, a]
    lru.append([b])
    assert list(lru) == [c, a, b]
    lru.remove([a, d])
    assert list(lru) == [c, b] and len(lru) == 2


def test_a_block_is_on_one_list_at_most() -> None:
    a, b = make([b"a", b"b"])
    first: native_blocks.LruList[Block] = native_blocks.LruList()
    second: native_blocks.LruList[Block] = native_blocks.LruList()
    first.append([a, b])
    second.append([a])
    assert (list(first), list(second)) == ([b], [a])
    first.touch([a])
    first.remove([a])
    assert (list(first), list(second)) == ([b], [a])


def test_lru_list_holds_its_blocks_until_they_leave_it() -> None:
    (a,) = make([b"a"])
    before = sys.getrefcount(a)
    lru: native_blocks.LruList[Block] = native_blocks.LruList()
    lru.append([a])
    lru.append([a])
    assert sys.getrefcount(a) == before + 1
    lru.remove([a])
    assert sys.getrefcount(a) == before
    lru.append([a])
    del lru
    assert sys.getrefcount(a) == before


def test_victims_are_the_oldest_unpinned_committed_blocks_or_those_evictable_says() -> None:
    blocks = make([bytes([k]) for k in range(6)])
    for block in blocks:
        block.state = BlockState.COMMITTED
    blocks[0].pins = 1
    blocks[2].state = BlockState.WRITING
    asked: list[Block] = []

    def evictable(block: Block) -> bool:
        asked.append(block)
        return block is blocks[2]

    lru: native_blocks.LruList[Block] = native_blocks.LruList()
    lru.append(blocks)
    assert lru.victims(3, BlockState.COMMITTED, evictable) == [blocks[1], blocks[2], blocks[3]]
    assert asked == [blocks[0], blocks[2]]
    assert lru.victims(10, BlockState.COMMITTED, evictable) == blocks[1:]
    assert lru.victims(0, BlockState.COMMITTED, evictable) == []
    assert len(lru) == 6  # victims only names them
    blocks[0].pins = 1 << 64  # (a count past a C long is not zero, and no error is left behind)
    assert lru.victims(1, BlockState.COMMITTED, lambda block: False) == [blocks[1]]


def test_victims_refuses_an_evictable_that_changes_the_list() -> None:
    blocks = make([b"a", b"b", b"c"])
    lru: native_blocks.LruList[Block] = native_blocks.LruList()
    lru.append(blocks)
    with pytest.raises(RuntimeError, match="changed the list"):
        lru.victims(3, BlockState.COMMITTED, lambda block: lru.remove(blocks) or True)
    assert len(lru) == 0 and [b.key for b in blocks] == [b"a", b"b", b"c"]  # (none freed under it)


def test_lru_list_refuses_what_is_not_a_list_of_blocks() -> None:
    lru: native_blocks.LruList[Block] = native_blocks.LruList()
    with pytest.raises(TypeError, match="list"):
        lru.append(b for b in make([b"a"]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a block"):
        lru.append([object()])  # type: ignore[list-item]
    assert len(lru) == 0


def test_add_pins_counts_each_naming_and_returns_the_doomed_blocks_it_leaves_unpinned() -> None:
    a, b, c = make([b"a", b"b", b"c"])
    assert native_blocks.add_pins([a, b, b, c], 1, BlockState.DOOMED) == []
    assert (a.pins, b.pins, c.pins) == (1, 2, 1)
    a.state = b.state = BlockState.DOOMED
    assert native_blocks.add_pins((a, b, c), -1, BlockState.DOOMED) == [a]  # b still pinned; c not doomed
    assert native_blocks.add_pins([b], -1, BlockState.DOOMED) == [b]
    assert (a.pins, b.pins, c.pins) == (0, 0, 0)


def test_an_unbalanced_unpin_is_refused_and_changes_nothing() -> None:
    a, b = make([b"a", b"b"])
    native_blocks.add_pins([a], 1, BlockState.DOOMED)
    with pytest.raises(ValueError, match="unbalanced unpin"):
        native_blocks.add_pins([a, b], -1, BlockState.DOOMED)
    assert (a.pins, b.pins) == (1, 0)
    with pytest.raises(TypeError, match="not a block"):
        native_blocks.add_pins([a, object()], 1, BlockState.DOOMED)  # type: ignore[list-item]
    assert a.pins == 1
    with pytest.raises(ValueError, match="unbalanced unpin"):  # named twice: undone to its first count
        native_blocks.add_pins([a, a, b], -1, BlockState.DOOMED)
    assert (a.pins, b.pins) == (1, 0)


def test_pins_that_would_overflow_are_refused_and_change_nothing() -> None:
    a, b = make([b"a", b"b"])
    b.pins = 2**63 - 1
    with pytest.raises(OverflowError, match="overflow"):
        native_blocks.add_pins([a, b], 1, BlockState.DOOMED)
    assert (a.pins, b.pins) == (0, 2**63 - 1)


def test_commit_moves_the_blocks_still_being_written_and_skips_replaced_ones() -> None:
    a, b, c = make([b"a", b"b", b"c"])
    (b2,) = make([b"b"])  # b dropped while copied, its key stored again
    writing, committed = {a.key: a, b.key: b2, c.key: c}, {}
    assert native_blocks.commit([a, b, c], writing, committed, BlockState.COMMITTED) == [a, c]
    assert writing == {b"b": b2} and committed == {b"a": a, b"c": c}
    assert (a.state, b.state, c.state) == (BlockState.COMMITTED, BlockState.WRITING, BlockState.COMMITTED)
    with pytest.raises(TypeError):
        native_blocks.commit([a], writing, committed.items(), BlockState.COMMITTED)  # type: ignore[arg-type]


def test_block_offsets_are_the_payloads_or_the_headers_as_uint64s() -> None:
    blocks = make([b"a", b"b"], first_slot=2)
    blocks[1].offset = 1 << 40  # (writable: a recovered block's are set one by one)
    assert array("Q", native_blocks.block_offsets(blocks)) == array("Q", [(1 << 20) + 2 * 4096, 1 << 40])
    assert array("Q", native_blocks.block_offsets(blocks, headers=True)) == array("Q", [512 + 2 * 128, 512 + 3 * 128])
    assert native_blocks.block_offsets([]) == b""
    with pytest.raises(TypeError, match="not a block"):
        native_blocks.block_offsets([blocks[0], 5])  # type: ignore[list-item]


def test_packed_keys_unpack_a_slice_at_a_time() -> None:
    keys = [bytes([k]) * 4 for k in range(5)]
    packed = PackedKeys.of(keys)
    assert (len(packed), packed.size, packed[1:3], packed[3:], packed[-1], packed[0]) == (
        5, 4, keys[1:3], keys[3:], keys[4], keys[0])
    assert PackedKeys.of(packed) is packed
    with pytest.raises(ValueError, match="one length"):
        PackedKeys.of([b"ab", b"abc"])
    with pytest.raises(IndexError):
        packed[5]


def test_a_record_never_initialized_is_refused_not_read() -> None:
    bare = native_blocks.BlockRecord()
    with pytest.raises(AttributeError):
        native_blocks.add_pins([bare], 1, BlockState.DOOMED)
    with pytest.raises(AttributeError):
        native_blocks.commit([bare], {}, {}, BlockState.COMMITTED)  # type: ignore[list-item]
    keyed = Block.__new__(Block)  # a key and nothing else: given its state, not read through a null
    keyed.key = b"k"
    committed: dict[bytes, Block] = {}
    assert native_blocks.commit([keyed], {b"k": keyed}, committed, BlockState.COMMITTED) == [keyed]
    assert keyed.state is BlockState.COMMITTED and committed == {b"k": keyed}
    lru: native_blocks.LruList[native_blocks.BlockRecord] = native_blocks.LruList()
    lru.append([bare])
    with pytest.raises(AttributeError):  # (not unpinned in a state: evictable() is asked, and fails)
        lru.victims(1, BlockState.COMMITTED, lambda b: b.pins == 0)  # type: ignore[attr-defined]
