"""The native chunk path: plan_transfer (a chunk's runs over the registered regions, bounds-checked
before anything moves, held natively as Runs) and transfer (checksum sample, copy and progress word in
one call)."""

from __future__ import annotations

import ctypes
from array import array

import pytest

from kvstore_service import native

BLOCK = 64  # bytes of a region's part of a block


def buffer(size: int, fill: int = 0) -> tuple[ctypes.Array[ctypes.c_char], int]:
    buf = (ctypes.c_char * size)()
    ctypes.memset(buf, fill, size)
    return buf, ctypes.addressof(buf)


def regions_of(base: int, size: int, count: int, num_blocks: int) -> array[int]:
    """`count` regions back to back in one mapping: region r's block b at base + r * num_blocks * BLOCK + b * BLOCK."""
    out = array("Q")
    for r in range(count):
        out.extend((base + r * num_blocks * BLOCK, BLOCK, BLOCK, base, base + size))
    return out


def test_the_plan_is_region_major_with_the_shard_offset_and_every_run_in_bounds() -> None:
    engine, base = buffer(2 * 8 * BLOCK)
    runs = native.plan_transfer([1000, 5000], [3, 6], regions_of(base, len(engine), 2, 8), 8, 1 << 20,
                                shard_offset=7)
    assert (runs.blocks, len(runs), runs.total_bytes) == (2, 4, 4 * BLOCK)
    pool_offsets, addresses, sizes = native.columns(runs)
    assert list(pool_offsets) == [1007, 5007, 1007 + BLOCK, 5007 + BLOCK]
    assert list(addresses) == [base + 3 * BLOCK, base + 6 * BLOCK, base + 11 * BLOCK, base + 14 * BLOCK]
    assert list(sizes) == [BLOCK] * 4


def test_the_plan_refuses_a_run_outside_the_engine_memory_the_pool_or_the_cache() -> None:
    engine, base = buffer(8 * BLOCK)
    regions = regions_of(base, len(engine), 1, 8)
    with pytest.raises(ValueError, match="block id 8 is outside the registered cache"):
        native.plan_transfer([0], [8], regions, 8, 1 << 20)
    short = array("Q", regions)
    short[4] = base + 4 * BLOCK  # the mapping ends half way
    with pytest.raises(ValueError, match="block 1 .id 5., region 0: .* outside the engine memory"):
        native.plan_transfer([0, BLOCK], [1, 5], short, 8, 1 << 20)
    with pytest.raises(ValueError, match="outside the pool"):
        native.plan_transfer([(1 << 20) - BLOCK + 1], [0], regions, 8, 1 << 20)
    with pytest.raises(ValueError, match="5 values per region"):
        native.plan_transfer([0], [0], regions[:4], 8, 1 << 20)
    with pytest.raises(ValueError, match="1 slot offsets but 2 block ids"):
        native.plan_transfer([0], [0, 1], regions, 8, 1 << 20)


def test_transfer_copies_both_ways_and_names_the_blocks_that_fail_their_checksum() -> None:
    num_blocks, count = 4, 3
    engine, base = buffer(count * num_blocks * BLOCK, 0x11)
    pool, pool_base = buffer(num_blocks * count * BLOCK)
    for k in range(num_blocks * count * BLOCK):
        pool[k] = bytes([k // BLOCK % 251 + 1])
    slots = [k * count * BLOCK for k in range(num_blocks)]
    plan = native.plan_transfer(slots, [2, 0, 3, 1], regions_of(base, len(engine), count, num_blocks), num_blocks,
                                len(pool))
    sums = native.checksum_blocks(pool_base, slots, count * BLOCK)
    expected = array("Q", [sums[1] ^ 1, native.UNKNOWN_CHECKSUM, sums[3]])  # block 1 corrupt, 2 unknown
    corrupt = native.transfer(pool_base, plan, to_engine=True, check=[1, 2, 3],
                              check_offsets=[slots[1], slots[2], slots[3]], check_size=count * BLOCK,
                              expected=expected)
    assert corrupt == [1]
    for k, block_id in enumerate([2, 0, 3, 1]):
        for r in range(count):
            got = ctypes.string_at(base + (r * num_blocks + block_id) * BLOCK, BLOCK)
            if k != 1:  # (a chunked load's corrupt block may land: its job names it failed)
                assert got == ctypes.string_at(pool_base + slots[k] + r * BLOCK, BLOCK), (k, r)
    ctypes.memset(pool, 0, len(pool))
    assert native.transfer(pool_base, plan, to_engine=False, threads=2) == []
    assert ctypes.string_at(pool_base + slots[1], BLOCK) == ctypes.string_at(base, BLOCK)  # engine block 0
    assert ctypes.string_at(pool_base + slots[0], BLOCK) == ctypes.string_at(base + 2 * BLOCK, BLOCK)


@pytest.mark.parametrize("shift", [0, 8, 13])
def test_a_chunked_load_checksums_its_sample_as_it_copies_the_shard_it_reads(shift: int) -> None:
    """A block of two shards, this engine's the second: its payload's CRC covers both, read once, the copied
    part on the way (long runs: the three-lane copy; odd lengths and alignments: its head and tail)."""
    part = 3 * 8192 * 2 + 40 + shift  # one region's part of a block, in this shard
    num_blocks, count = 3, 2
    payload = 2 * count * part  # both shards
    engine, base = buffer(count * num_blocks * part + 64)
    base += shift  # (unaligned engine addresses)
    pool, pool_base = buffer(num_blocks * payload)
    ctypes.memmove(pool, bytes(range(256)) * (len(pool) // 256) + bytes(len(pool) % 256), len(pool))
    slots = [k * payload for k in range(num_blocks)]
    regions = array("Q")
    for r in range(count):
        regions.extend((base + r * num_blocks * part, part, part, base, base + count * num_blocks * part))
    plan = native.plan_transfer(slots, [1, 2, 0], regions, num_blocks, len(pool), shard_offset=count * part)
    sums = native.checksum_blocks(pool_base, slots, payload)

    def load() -> list[int]:
        return native.transfer(pool_base, plan, to_engine=True, check=[0, 2],
                               check_offsets=[slots[0], slots[2]], check_size=payload,
                               expected=array("Q", [sums[0], sums[2]]))
    assert load() == []
    for k, block_id in enumerate([1, 2, 0]):
        for r in range(count):
            assert (ctypes.string_at(base + (r * num_blocks + block_id) * part, part)
                    == ctypes.string_at(pool_base + slots[k] + (count + r) * part, part)), (k, r)
    pool[slots[0] + payload - 1] = b"\xff"  # in the shard it copies
    pool[slots[2] + 5] = b"\xff"  # in the other shard's part, which it only reads
    assert load() == [0, 2]


def test_a_sample_whose_payload_does_not_hold_the_runs_of_its_block_is_verified_before_the_copy() -> None:
    engine, base = buffer(2 * BLOCK)
    pool, pool_base = buffer(4 * BLOCK, 0x42)
    plan = native.plan_transfer([0, BLOCK], [0, 1], regions_of(base, len(engine), 1, 2), 2, len(pool))
    elsewhere = 2 * BLOCK  # (the checked bytes are not the block's)
    wrong = native.checksum_blocks(pool_base, [elsewhere], BLOCK)[0] ^ 1
    assert native.transfer(pool_base, plan, to_engine=True, check=[1], check_offsets=[elsewhere],
                           check_size=BLOCK, expected=[wrong]) == [1]
    assert ctypes.string_at(base, BLOCK) == bytes([0x42]) * BLOCK
    assert ctypes.string_at(base + BLOCK, BLOCK) == bytes(BLOCK)  # not copied


def test_a_whole_load_verifies_before_it_copies_and_posts_the_regions_landed_in_the_progress_word() -> None:
    num_blocks, count = 2, 3
    engine, base = buffer(count * num_blocks * BLOCK)
    pool, pool_base = buffer(num_blocks * count * BLOCK, 0x42)
    word = (ctypes.c_uint64 * 1)()
    plan = native.plan_transfer([0, count * BLOCK], [0, 1], regions_of(base, len(engine), count, num_blocks),
                                num_blocks, len(pool))
    wrong = native.checksum_blocks(pool_base, [count * BLOCK], count * BLOCK)[0] ^ 1
    assert native.transfer(pool_base, plan, to_engine=True, streaming=False,
                           progress=ctypes.addressof(word), progress_word=7 << 16, check=[1],
                           check_offsets=[count * BLOCK], check_size=count * BLOCK, expected=[wrong]) == [1]
    assert word[0] == 7 << 16 | count
    for r in range(count):  # block 0 landed; block 1, which failed its checksum, not a byte of it
        assert ctypes.string_at(base + r * num_blocks * BLOCK, BLOCK) == bytes([0x42]) * BLOCK
        assert ctypes.string_at(base + (r * num_blocks + 1) * BLOCK, BLOCK) == bytes(BLOCK)


def test_runs_without_some_blocks_keep_the_others_region_major() -> None:
    runs = native.runs_of([0, 10, 20, 30, 40, 50], [100, 110, 120, 130, 140, 150], [1, 2, 3, 4, 5, 6], blocks=3)
    rest = runs.without(array("Q", [1]))
    assert (rest.blocks, rest.total_bytes) == (2, 1 + 3 + 4 + 6)
    assert [list(c) for c in native.columns(rest)] == [[0, 20, 30, 50], [100, 120, 130, 150], [1, 3, 4, 6]]
    assert runs.without(array("Q", [0, 1, 2])).blocks == 0 and len(runs) == 6  # (the original is unchanged)
    with pytest.raises(ValueError, match="position 3 is not among 3 blocks"):
        runs.without(array("Q", [3]))


def test_transfer_validates_its_arguments_first() -> None:
    with pytest.raises(ValueError, match="not whole regions of 2 blocks"):
        native.runs_of([0, 8, 16], [0, 8, 16], [8, 8, 8], blocks=2)
    with pytest.raises(ValueError, match="same length"):
        native.runs_of([0], [0, 8], [8])
    with pytest.raises(TypeError, match="runs must be a Runs"):
        native.transfer(0, [0, 8], True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a position among 1 blocks"):
        native.transfer(0, native.runs_of([0], [0], [8]), True, check=[1], check_offsets=[0], check_size=8,
                        expected=[0])
    with pytest.raises(OverflowError):
        native.transfer(2**64 - 4, native.runs_of([0], [0], [8]), True)
