"""Tests of the native block copy/checksum engine and its slot headers, no mocks.

Memory comes from ctypes arrays; results are compared byte for byte with what Python slicing says
the copy must produce, checksums with a CRC32C written here in Python. Device paths are checked for
argument validation and for a clean RuntimeError where no driver/device exists; with a GPU they also
do a real round trip.
"""

from __future__ import annotations

import ctypes
import mmap
import random
import struct
import subprocess
import sys
from array import array
from collections.abc import Callable
from typing import Any

import pytest

from kvstore_service import native, native_device, native_memory
from kvstore_service.pool import SLOT_HEADER_BYTES, parse_slot_header

NATIVE = native._native
copy = native.copy_blocks
checksum = native.checksum_blocks
CRC_IMPLS: dict[str, Callable[..., int]] = {"native": NATIVE.crc32c, "native-table": NATIVE.crc32c_portable}


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c_reference(data: bytes) -> int:
    """CRC32C in plain Python (reflected 0x82F63B78, init/xorout ~0): the oracle for the engine."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


class Mem:
    """A C buffer with its address; `fill` puts deterministic random bytes in it."""

    def __init__(self, size: int, seed: int | None = None) -> None:
        self.size = size
        self.buf = (ctypes.c_ubyte * size)()
        self.addr = ctypes.addressof(self.buf)
        if seed is not None:
            data = random.Random(seed).randbytes(size)
            ctypes.memmove(self.addr, data, size)

    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        return ctypes.string_at(self.addr + offset, self.size - offset if n is None else n)


def expected_copy(src: bytes, dst: bytes, so: list[int], do: list[int], sizes: list[int]) -> bytes:
    out = bytearray(dst)
    for s, d, n in zip(so, do, sizes, strict=True):
        out[d:d + n] = src[s:s + n]
    return bytes(out)


# ---- the extension is there -------------------------------------------------------------------


def test_native_extension_built() -> None:
    feats = native.features()
    assert feats["checksum"] == "crc32c"
    assert feats["crc32c_impl"] in ("sse4.2-3way", "armv8-crc-3way", "table")
    for key in ("cpu_threads", "crc32c_hardware", "cuda_compiled", "cuda_available", "cuda_batch_memcpy",
                "acl_compiled", "acl_available", "acl_batch_memcpy"):
        assert key in feats


# ---- copies -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("threads", "streaming"), [(1, True), (2, True), (5, True), (16, True), (1, False),
                                                    (2, False)])
def test_random_scattered_copy_is_byte_exact(threads: int, streaming: bool) -> None:
    """Also with plain stores (streaming=False: loads up to 64 MiB into an engine, read at once by its next
    forward)."""
    rng = random.Random(threads * 7919 + 6)
    slot, slots = 64 * 1024, 96
    src, dst = Mem(slot * slots, seed=1), Mem(slot * slots, seed=2)
    count = 70
    src_ids, dst_ids = rng.sample(range(slots), count), rng.sample(range(slots), count)
    # Odd sizes and offsets inside the slot exercise unaligned memcpy; some sizes are zero.
    so, do, sizes = [], [], []
    for s_id, d_id in zip(src_ids, dst_ids, strict=True):
        n = rng.choice([0, 1, 63, 4096, 5000, slot // 2, slot - 17])
        so.append(s_id * slot + rng.randrange(0, slot - n + 1))
        do.append(d_id * slot + rng.randrange(0, slot - n + 1))
        sizes.append(n)
    before_src, before_dst = src.read(), dst.read()
    copy(src.addr, dst.addr, array("Q", so), array("Q", do), array("Q", sizes), threads, streaming)
    assert src.read() == before_src
    assert dst.read() == expected_copy(before_src, before_dst, so, do, sizes)


def test_copy_edges_at_every_alignment() -> None:
    """Runs around the size where the native copy switches to streaming stores, at every
    destination misalignment: exact bytes inside, nothing touched outside."""
    src, dst = Mem(16384, seed=8), Mem(16384, seed=9)
    for size in (4095, 4096, 4097, 4096 + 127, 4096 + 129, 8191):
        for shift in range(0, 64, 3):
            before_src, before_dst = src.read(), dst.read()
            so, do = [shift + 5], [64 + shift]
            copy(src.addr, dst.addr, array("Q", so), array("Q", do), array("Q", [size]), 1)
            assert dst.read() == expected_copy(before_src, before_dst, so, do, [size]), (size, shift)


def test_adjacent_blocks_coalesce_and_copy() -> None:
    block = 4096
    src, dst = Mem(block * 64, seed=3), Mem(block * 64, seed=4)
    # Blocks 10..19 -> 30..39 are contiguous on both sides (given shuffled); 40 -> 50 and 41 -> 60
    # are contiguous only in the source, so they stay separate runs.
    pairs = [(10 + i, 30 + i) for i in range(10)] + [(40, 50), (41, 60)]
    random.Random(5).shuffle(pairs)
    so = array("Q", (s * block for s, _ in pairs))
    do = array("Q", (d * block for _, d in pairs))
    sizes = array("Q", [block] * len(pairs))
    runs = native.coalesce_runs(so, do, sizes)
    assert runs == [(10 * block, 30 * block, 10 * block), (40 * block, 50 * block, block),
                    (41 * block, 60 * block, block)]
    before_src, before_dst = src.read(), dst.read()
    result = copy(src.addr, dst.addr, so, do, sizes, 2)
    assert result == len(runs)
    assert dst.read() == expected_copy(before_src, before_dst, list(so), list(do), list(sizes))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_single_huge_run_split_across_threads(threads: int) -> None:
    size = 8 * 1024 * 1024 + 4099  # not a multiple of the split granularity
    src, dst = Mem(size, seed=6), Mem(size + 64, seed=7)
    tail = dst.read(size)
    assert copy(src.addr, dst.addr + 64, [0], [0], [size - 64], threads) == 1
    assert dst.read(64, size - 64) == src.read(0, size - 64)
    assert dst.read(size) == tail  # nothing written past the run


def test_zero_blocks_and_zero_sizes() -> None:
    src, dst = Mem(4096, seed=8), Mem(4096, seed=9)
    before = dst.read()
    assert copy(src.addr, dst.addr, array("Q"), array("Q"), array("Q"), 4) == 0
    assert copy(src.addr, dst.addr, [0, 100], [0, 200], [0, 0], 1) == 0
    assert dst.read() == before
    assert copy(src.addr, dst.addr, [], [], [], 1) == 0  # plain lists


def test_public_wrapper_accepts_lists_bytes_and_numpy() -> None:
    src, dst = Mem(8192, seed=10), Mem(8192)
    native.copy_blocks(src.addr, dst.addr, [0], [4096], [4096])
    native.copy_blocks(src.addr, dst.addr, array("Q", [4096]).tobytes(), array("Q", [0]).tobytes(),
                       array("Q", [4096]).tobytes(), 2)
    assert dst.read(4096) == src.read(0, 4096) and dst.read(0, 4096) == src.read(4096)
    np = pytest.importorskip("numpy")
    dst2 = Mem(8192)
    native.copy_blocks(src.addr, dst2.addr, np.array([0, 4096], dtype=np.uint64),
                       np.array([4096, 0], dtype=np.int64), np.array([4096, 4096], dtype=np.uint64), 2)
    assert dst2.read() == dst.read()


def test_invalid_arguments() -> None:
    src, dst = Mem(4096), Mem(4096)
    with pytest.raises(ValueError, match="same length"):
        copy(src.addr, dst.addr, [0, 8], [0], [8, 8], 1)
    with pytest.raises(ValueError, match="same length"):
        copy(src.addr, dst.addr, [0], [0], [8, 8], 1)
    with pytest.raises(ValueError, match="64-bit"):
        copy(src.addr, dst.addr, array("I", [0]), array("Q", [0]), array("Q", [8]), 1)
    with pytest.raises(ValueError, match="64-bit"):
        copy(src.addr, dst.addr, array("d", [0.0]), array("Q", [0]), array("Q", [8]), 1)
    with pytest.raises(ValueError, match="64-bit"):
        copy(src.addr, dst.addr, b"\0" * 7, array("Q", [0]), array("Q", [8]), 1)
    with pytest.raises(ValueError, match="negative"):
        copy(src.addr, dst.addr, array("q", [-8]), array("Q", [0]), array("Q", [8]), 1)
    with pytest.raises(OverflowError):
        copy(2**64 - 16, dst.addr, [8], [0], [16], 1)
    with pytest.raises(OverflowError):
        copy(src.addr, dst.addr, [0], [2**64 - 8], [16], 1)
    with pytest.raises(TypeError, match="buffer"):
        NATIVE.copy_blocks(src.addr, dst.addr, [0], [0], [8])  # the raw extension wants buffers
    for threads in (0, -1, 100_000):
        with pytest.raises(ValueError, match="threads"):
            copy(src.addr, dst.addr, [0], [0], [8], threads)


# ---- checksums ----------------------------------------------------------------------------------

# RFC 3720 (iSCSI) appendix B.4 test vectors plus the usual check value.
CRC_VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("impl", sorted(CRC_IMPLS))
@pytest.mark.parametrize(("data", "expected"), CRC_VECTORS)
def test_crc32c_known_answers(impl: str, data: bytes, expected: int) -> None:
    assert CRC_IMPLS[impl](data, 0) == expected
    assert crc32c_reference(data) == expected


def test_crc32c_public_helper_and_continuation() -> None:
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"56789", native.crc32c(b"1234")) == 0xE3069283


def test_crc32c_copy_copies_and_checksums_in_one_pass() -> None:
    rng = random.Random(5)
    for n in (0, 1, 4095, 4096, 65536 + 7, 3 << 20):  # memcpy and streamed runs, one chunk and several
        data = rng.randbytes(n)
        dst = bytearray(n + 64)
        assert native.crc32c_copy(data, memoryview(dst)[3:]) == native.crc32c(data)
        assert dst[3:3 + n] == data and dst[:3] == bytes(3) and dst[3 + n:] == bytes(61)
    with pytest.raises(ValueError, match="dst holds 10 bytes, src has 11"):
        native.crc32c_copy(bytes(11), memoryview(bytearray(10)))


def test_crc32c_implementations_agree_on_random_data() -> None:
    # Lengths and start offsets around the 3-way lane sizes (3 x 256 and 3 x 8192 bytes) and the
    # 8-byte alignment prologue.
    rng = random.Random(11)
    data = rng.randbytes(3 * 8192 * 2 + 1000)
    for n in (1, 7, 8, 9, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 5, len(data) - 9):
        for start in (0, 1, 3, 8):
            chunk = data[start:start + n]
            want = NATIVE.crc32c_portable(chunk)
            assert NATIVE.crc32c(chunk) == want
            split = n // 3
            assert NATIVE.crc32c(chunk[split:], NATIVE.crc32c(chunk[:split])) == want
    assert crc32c_reference(data[:20000]) == NATIVE.crc32c(data[:20000])


@pytest.mark.parametrize("threads", [1, 3])
def test_checksum_blocks_values_and_bit_flip(threads: int) -> None:
    size, count = 4096 + 8, 12  # the Python reference CRC is slow: keep blocks small
    mem = Mem(size * count + 100, seed=12)
    offsets = array("Q", (7 + i * size for i in reversed(range(count))))
    sums = checksum(mem.addr, offsets, size, threads)
    assert sums == [crc32c_reference(mem.read(off, size)) for off in offsets]
    # Flip one bit inside the block stored at offsets[4]: only that checksum changes.
    flip_at = offsets[4] + 1234
    mem.buf[flip_at] ^= 0x10
    flipped = checksum(mem.addr, offsets, size, threads)
    assert [i for i in range(count) if flipped[i] != sums[i]] == [4]
    mem.buf[flip_at] ^= 0x10
    assert checksum(mem.addr, offsets, size, threads) == sums


def test_checksum_blocks_edge_cases() -> None:
    mem = Mem(64, seed=13)
    assert checksum(mem.addr, array("Q"), 16, 2) == []
    assert checksum(mem.addr, [0, 8], 0, 1) == [0, 0]  # CRC32C of nothing
    with pytest.raises(OverflowError):
        checksum(2**64 - 8, [0], 16, 1)
    with pytest.raises(ValueError, match="threads"):
        checksum(mem.addr, [0], 16, 0)


@pytest.mark.parametrize("threads", [1, 4])
def test_checksum_blocks_match_portable_crc_on_big_blocks(threads: int) -> None:
    size, count = 256 * 1024, 16
    mem = Mem(size * count, seed=14)
    offsets = array("Q", (i * size for i in range(count)))
    native_sums = native.checksum_blocks(mem.addr, offsets, size, threads)
    assert native_sums == [NATIVE.crc32c_portable(mem.read(off, size)) for off in offsets]


# ---- slot headers -------------------------------------------------------------------------------

# The slot header as the pool file stores it (SlotHeader in csrc/slot_headers.cpp, the one definition
# the code uses), pinned here: magic, state, payload_len, checksum, generation, ns_hash, key_len, key,
# then the CRC32C of those 116 bytes. A change that breaks this needs a new pool.POOL_VERSION.
PINNED_BODY = struct.Struct("<IIQQQ16sI64s")


def pinned_header(state: int, payload_len: int, checksum: int, generation: int, ns_hash: bytes, key: bytes,
                  magic: int = 0x4B565342, key_len: int | None = None) -> bytes:
    body = PINNED_BODY.pack(magic, state, payload_len, checksum, generation, ns_hash,
                            len(key) if key_len is None else key_len, key)
    return body + struct.pack("<I", crc32c_reference(body))


def test_slot_header_layout_c_and_python_agree() -> None:
    """The engine's headers parse in Python (pool.parse_slot_header) field by field and match the
    pinned format byte for byte (CRC32C included); headers packed in Python by that format parse
    back the same; any changed byte, a bad magic or an over-long key invalidates a header."""
    assert (native.SLOT_HEADER_BYTES, native.SLOT_MAGIC, native.SLOT_MAX_KEY) == (128, 0x4B565342, 64)
    assert SLOT_HEADER_BYTES == native.SLOT_HEADER_BYTES and PINNED_BODY.size + 4 <= SLOT_HEADER_BYTES
    rng = random.Random(21)
    n = 3
    for i, key_size in enumerate((1, 16, 33, 63, native.SLOT_MAX_KEY)):
        state = (2, 3, 0xFFFF_FFFF)[i % 3]
        payload_len = (4096, 2**64 - 1, 1 << 33)[i % 3]
        generation = rng.getrandbits(64)
        ns_hash, keys = rng.randbytes(16), rng.randbytes(n * key_size)
        sums = [rng.getrandbits(64) for _ in range(n)]
        data = bytearray(b"\xa5" * (SLOT_HEADER_BYTES * n))
        base = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
        offsets = [j * SLOT_HEADER_BYTES for j in range(n)]
        # C writes, Python reads, and the bytes are the pinned format.
        native.write_slot_headers(base, offsets, state, payload_len, generation, ns_hash, keys, key_size, sums)
        for j, off in enumerate(offsets):
            key = keys[j * key_size:(j + 1) * key_size]
            header = parse_slot_header(data, off)
            assert header is not None, (key_size, j)
            assert (header.state, header.payload_len, header.checksum, header.generation, header.ns_hash,
                    header.key) == (state, payload_len, sums[j], generation, ns_hash, key)
            raw = pinned_header(state, payload_len, sums[j], generation, ns_hash, key)
            assert bytes(data[off:off + len(raw)]) == raw
            assert data[off + len(raw):off + SLOT_HEADER_BYTES] == b"\xa5" * (SLOT_HEADER_BYTES - len(raw))
        # Python packs by the pinned format (at an odd offset), the engine reads.
        raw = pinned_header(state, payload_len, sums[0], generation, ns_hash, keys[:key_size])
        buf = bytearray(7) + bytearray(raw)
        assert native.parse_slot_header(buf, 7) == (state, payload_len, sums[0], generation, ns_hash, keys[:key_size])
        for k in range(len(raw)):  # every byte is covered: the CRC fails, or the CRC itself differs
            buf[7 + k] ^= 0x40
            assert native.parse_slot_header(buf, 7) is None, (key_size, k)
            buf[7 + k] ^= 0x40
    key = bytes(64)
    assert native.parse_slot_header(pinned_header(2, 1, 0, 1, bytes(16), key, magic=0x4B565343), 0) is None
    assert native.parse_slot_header(pinned_header(2, 1, 0, 1, bytes(16), key, key_len=65), 0) is None
    assert native.parse_slot_header(pinned_header(2, 1, 0, 1, bytes(16), key, key_len=64), 0) is not None
    with pytest.raises(ValueError, match="slot header"):
        native.parse_slot_header(bytes(SLOT_HEADER_BYTES), 9)
    with pytest.raises(ValueError, match="slot header"):
        native.parse_slot_header(bytes(SLOT_HEADER_BYTES), -1)
    with pytest.raises(ValueError, match="keys must be"):
        native.write_slot_headers(0, [0], 2, 1, 1, bytes(16), bytes(65), 65)
    with pytest.raises(ValueError, match="ns_hash"):
        native.write_slot_headers(0, [0], 2, 1, 1, bytes(15), bytes(16), 16)


def test_write_slot_headers() -> None:
    """Slot headers written in one batch parse back (pool.parse_slot_header) field by field, and a
    flipped byte invalidates only its own header."""
    n, key_size = 5, 32
    keys = random.Random(3).randbytes(n * key_size)
    ns_hash = bytes(range(16))
    offsets = [SLOT_HEADER_BYTES * (2 * i + 1) for i in range(n)]
    data = mmap.mmap(-1, SLOT_HEADER_BYTES * 2 * n)
    base = ctypes.addressof(ctypes.c_char.from_buffer(data))
    native.write_slot_headers(base, offsets, 2, 4096, 77, ns_hash, keys, key_size, [10 + i for i in range(n)])
    for i, offset in enumerate(offsets):
        header = parse_slot_header(data, offset)
        assert header is not None
        assert (header.state, header.payload_len, header.checksum, header.generation, header.ns_hash, header.key) == (
            2, 4096, 10 + i, 77, ns_hash, keys[i * key_size:(i + 1) * key_size])
        assert parse_slot_header(data, offset - SLOT_HEADER_BYTES) is None  # untouched bytes in between
    data[offsets[2] + 60] ^= 1
    assert parse_slot_header(data, offsets[2]) is None
    assert parse_slot_header(data, offsets[3]) is not None
    native.write_slot_headers(base, offsets[:1], 3, 4096, 78, ns_hash, keys[:key_size], key_size)  # no checksums
    header = parse_slot_header(data, offsets[0])
    assert header is not None and header.state == 3 and header.checksum == 0
    with pytest.raises(ValueError, match="keys must be"):
        native.write_slot_headers(base, offsets, 2, 4096, 1, ns_hash, keys[:-1], key_size)


def test_invalidate_slot_headers_voids_only_the_slots_named_and_checks_them_all_first() -> None:
    n, key_size = 6, 32
    keys = random.Random(4).randbytes(n * key_size)
    data = mmap.mmap(-1, SLOT_HEADER_BYTES * n)
    base = ctypes.addressof(ctypes.c_char.from_buffer(data))
    offsets = [SLOT_HEADER_BYTES * i for i in range(n)]
    native.write_slot_headers(base, offsets, 2, 4096, 1, bytes(16), keys, key_size)
    native.invalidate_slot_headers(base, [1, 4], n)
    assert [parse_slot_header(data, o) is not None for o in offsets] == [True, False, True, True, False, True]
    with pytest.raises(ValueError, match="slot 6 is past the segment's 6 slots"):
        native.invalidate_slot_headers(base, [0, 6], n)
    assert parse_slot_header(data, offsets[0]) is not None  # nothing written
    slots: list[Any] = []

    class Emptying:  # an __index__ that changes the list being read: a snapshot is read, not the list
        def __index__(self) -> int:
            slots.clear()
            return 0
    slots += [Emptying(), 2]
    native.invalidate_slot_headers(base, slots, n)
    assert [parse_slot_header(data, o) is not None for o in offsets] == [False, False, False, True, False, True]


def test_missing_extension_is_a_clear_import_error() -> None:
    """No pure-Python fallback: without the extension, importing the wrapper says how to get it."""
    code = """
import sys
sys.modules["kvstore_service._native"] = None  # as if it were not built
try:
    import kvstore_service.native
except ImportError as exc:
    print(exc)
else:
    print("imported")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "kvstore_service._native" in proc.stdout and "C++17 compiler" in proc.stdout
    assert "reinstall" in proc.stdout


# ---- device paths -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cuda", "acl"])
def test_device_copy_validates_arguments_first(kind: str) -> None:
    device_copy = getattr(native_device, f"{kind}_copy_blocks")
    with pytest.raises(ValueError, match="direction"):
        device_copy(0, 0, [0], [0], [8], "sideways", 0)
    with pytest.raises(ValueError, match="same length"):
        device_copy(0, 0, [0, 8], [0], [8], "h2d", 0)
    with pytest.raises(OverflowError):
        device_copy(2**64 - 4, 0, [0], [0], [8], "d2h", 0)
    transfer = getattr(native_device, f"{kind}_transfer")  # a chunk's Runs: checked the same way, before any call
    with pytest.raises(TypeError, match="runs must be a Runs"):
        transfer(0, [0, 8], True, 0)
    with pytest.raises(OverflowError):
        transfer(2**64 - 4, native.runs_of([0], [0], [8]), False, 0)
    with pytest.raises(OverflowError, match="checksum"):
        transfer(2**64 - 4, native.runs_of([0], [0], [0]), True, 0, [0], 8)


def test_cuda_raises_cleanly_without_driver() -> None:
    feats = native.features()
    if feats["cuda_available"]:
        pytest.skip("a CUDA device is present")
    assert feats["cuda_error"]
    mem = Mem(4096)
    with pytest.raises(RuntimeError, match="CUDA"):
        native_device.cuda_copy_blocks(mem.addr, 0x1000, [0], [0], [4096], "h2d", 0)
    with pytest.raises(RuntimeError, match="CUDA"):
        native_device.cuda_transfer(mem.addr, native.runs_of([0], [0x1000], [4096]), True, 0)
    with pytest.raises(RuntimeError, match="CUDA"):
        native_device.cuda_host_register(mem.addr, 4096)
    with pytest.raises(RuntimeError, match="CUDA"):
        native_device.cuda_host_unregister(mem.addr)


def test_acl_raises_cleanly_without_runtime() -> None:
    feats = native.features()
    if feats["acl_available"]:
        pytest.skip("an Ascend runtime is present")
    mem = Mem(4096)
    match = "not compiled" if not feats["acl_compiled"] else "Ascend|acl"
    with pytest.raises(RuntimeError, match=match):
        native_device.acl_copy_blocks(mem.addr, 0x1000, [0], [0], [4096], "h2d", 0)
    with pytest.raises(RuntimeError, match=match):
        native_device.acl_transfer(mem.addr, native.runs_of([0], [0x1000], [4096]), True, 0)
    with pytest.raises(RuntimeError, match=match):
        native_device.acl_host_register(mem.addr, 4096)


@pytest.mark.parametrize("allow_batch", [True, False])
def test_cuda_round_trip_on_gpu(allow_batch: bool) -> None:
    """Host -> GPU -> host through scattered blocks; runs only where a CUDA device exists."""
    if not native.features()["cuda_available"]:
        pytest.skip("no CUDA device")
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx, dev_ptr = ctypes.c_void_p(), ctypes.c_uint64()
    assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    block, count = 64 * 1024, 32
    assert cuda.cuMemAlloc_v2(ctypes.byref(dev_ptr), ctypes.c_size_t(block * count * 2)) == 0
    try:
        host, back = Mem(block * count, seed=17), Mem(block * count)
        native_device.cuda_host_register(host.addr, host.size)
        ids = random.Random(18).sample(range(count * 2), count)
        host_offs = [i * block for i in range(count)]
        dev_offs = [i * block for i in ids]
        sizes = [block] * count
        sums = native_device.cuda_copy_blocks(host.addr, dev_ptr.value, host_offs, dev_offs, sizes, "h2d", 0,
                                              allow_batch=allow_batch, checksum_base=host.addr,
                                              checksum_offsets=host_offs[::5], checksum_size=block)
        assert sums == native.checksum_blocks(host.addr, host_offs[::5], block)  # taken while it copied
        native_device.cuda_copy_blocks(dev_ptr.value, back.addr, dev_offs, host_offs, sizes, "d2h", 0,
                                       allow_batch=allow_batch)
        assert back.read() == host.read()
        native_device.cuda_host_unregister(host.addr)
    finally:
        cuda.cuMemFree_v2(dev_ptr)


def test_check_job_names_what_is_wrong_with_a_jobs_keys_and_ids() -> None:
    """Keys (packed) are compared whole where their first 8 bytes tie; ids against the cache and each other."""
    def check(keys: list[bytes], ids: Any, num_blocks: int, distinct_ids: bool) -> str:
        return native.check_job(b"".join(keys), len(keys[0]), ids, num_blocks, distinct_ids)

    same_start = [b"x" * 8 + bytes([i]) * 24 for i in range(50)]
    assert check(same_start, list(range(50)), 50, True) == ""
    assert check(same_start + same_start[7:8], list(range(51)), 51, True) == "duplicate keys in one request"
    assert check([b"ab", b"ac"], [0, 1], 2, True) == ""
    assert check([b"a", b"b"], [1, 1], 2, False) == ""  # a store may read one block twice
    assert "duplicate block ids" in check([b"a", b"b"], [1, 1], 2, True)
    assert check([b"a"], [2], 2, True) == "block id 2 is outside the registered cache (0..1)"
    rng = random.Random(5)  # thousands of keys and ids, one repeat anywhere, as Python's sets see it
    for n in (1, 2, 3000):
        keys, ids = [rng.randbytes(32) for _ in range(n)], array("Q", rng.sample(range(4 * n), n))
        assert check(keys, ids, 4 * n, True) == ""
        i, j = sorted(rng.sample(range(n + 1), 2)) if n > 1 else (0, 1)
        assert check(keys[:j] + [keys[i]] + keys[j:], array("Q", range(n + 1)), n + 1, True) == \
            "duplicate keys in one request"
        assert "duplicate block ids" in check(keys + [rng.randbytes(32)], ids + ids[i:i + 1], 4 * n, True)
    with pytest.raises(ValueError, match="are not keys of 2 bytes"):
        native.check_job(b"abc", 2, [0], 2, True)
    assert "duplicate block ids" in check([b"a", b"b"], array("Q", [1, 1]), 2, True)  # (the daemon's)
    with pytest.raises(TypeError, match="integer"):
        check([b"a"], [0.0], 2, True)
    for num_blocks in (-1, 1 << 64):  # (not taken modulo 2**64: -1 would let every id through)
        with pytest.raises(OverflowError, match="num_blocks"):
            check([b"a"], [5], num_blocks, True)


@pytest.mark.parametrize("threads", [1, 3])
def test_populate_faults_every_page_in_on_its_threads(threads: int) -> None:
    """A fresh pool's pages are faulted in before the daemon serves (csrc/populate.cpp); a range not a
    multiple of its 64 MiB steps is covered to its last page."""
    import os

    size = (64 << 20) * 2 + 5 * mmap.PAGESIZE
    fd = os.memfd_create("kvstore-test-populate")
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        resident = (ctypes.c_ubyte * (size // mmap.PAGESIZE))()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(base, size, resident) == 0 and sum(b & 1 for b in resident) == 0
        assert native_memory.populate(base, size, threads) == 0
        assert libc.mincore(base, size, resident) == 0 and all(b & 1 for b in resident)
        with pytest.raises(ValueError, match="page-aligned"):
            native_memory.populate(base + 1, 4096, 1)
    finally:
        os.close(fd)
