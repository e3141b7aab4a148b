"""Tests of the block copy/checksum engine: native extension and pure-Python fallback, no mocks.

Memory comes from ctypes arrays; results are compared byte for byte with what Python slicing says
the copy must produce. Device paths are checked for argument validation and for a clean
RuntimeError where no driver/device exists; with a GPU they also do a real round trip.
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
from array import array
from collections.abc import Callable

import pytest

from kvstore_service import native

NATIVE = native._native
needs_native = pytest.mark.skipif(NATIVE is None, reason="native extension not built")

# Implementations of copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, threads).
COPY_IMPLS: dict[str, Callable[..., object]] = {"python": native._py_copy_blocks}
CHECKSUM_IMPLS: dict[str, Callable[..., list[int]]] = {"python": native._py_checksum_blocks}
CRC_IMPLS: dict[str, Callable[..., int]] = {"python": native._crc32c_py}
if NATIVE is not None:
    # The raw extension takes buffers only; lists in these tests are packed like the wrapper does.
    COPY_IMPLS["native"] = lambda sb, db, so, do, sz, t: NATIVE.copy_blocks(
        sb, db, native._as_u64(so), native._as_u64(do), native._as_u64(sz), t)
    CHECKSUM_IMPLS["native"] = lambda b, offs, size, t: native._u64_list(
        NATIVE.checksum_blocks(b, native._as_u64(offs), size, t))
    CRC_IMPLS["native"] = NATIVE.crc32c
    CRC_IMPLS["native-table"] = NATIVE.crc32c_portable


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
    """The C++ build is optional for installs, but a dev/CI environment with a compiler must have it."""
    if os.environ.get("KVSTORE_ALLOW_NO_NATIVE") or os.environ.get("KVSTORE_DISABLE_NATIVE"):
        pytest.skip("native extension explicitly optional here")
    assert native.NATIVE, f"kvstore_service._native missing: {native.features()['native_missing_reason']}"
    feats = native.features()
    assert feats["native"] is True and feats["checksum"] == "crc32c"
    assert feats["crc32c_impl"] in ("sse4.2-3way", "armv8-crc-3way", "table")
    for key in ("cpu_threads", "crc32c_hardware", "cuda_compiled", "cuda_available", "cuda_batch_memcpy",
                "acl_compiled", "acl_available", "acl_batch_memcpy"):
        assert key in feats


# ---- copies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(COPY_IMPLS))
@pytest.mark.parametrize("threads", [1, 2, 5, 16])
def test_random_scattered_copy_is_byte_exact(impl: str, threads: int) -> None:
    rng = random.Random(threads * 7919 + len(impl))
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
    COPY_IMPLS[impl](src.addr, dst.addr, array("Q", so), array("Q", do), array("Q", sizes), threads)
    assert src.read() == before_src
    assert dst.read() == expected_copy(before_src, before_dst, so, do, sizes)


@pytest.mark.parametrize("impl", sorted(COPY_IMPLS))
def test_copy_edges_at_every_alignment(impl: str) -> None:
    """Runs around the size where the native copy switches to streaming stores, at every
    destination misalignment: exact bytes inside, nothing touched outside."""
    src, dst = Mem(16384, seed=8), Mem(16384, seed=9)
    for size in (4095, 4096, 4097, 4096 + 127, 4096 + 129, 8191):
        for shift in range(0, 64, 3):
            before_src, before_dst = src.read(), dst.read()
            so, do = [shift + 5], [64 + shift]
            COPY_IMPLS[impl](src.addr, dst.addr, array("Q", so), array("Q", do), array("Q", [size]), 1)
            assert dst.read() == expected_copy(before_src, before_dst, so, do, [size]), (size, shift)


@pytest.mark.parametrize("impl", sorted(COPY_IMPLS))
def test_adjacent_blocks_coalesce_and_copy(impl: str) -> None:
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
    assert native._py_coalesce(list(so), list(do), list(sizes)) == runs
    before_src, before_dst = src.read(), dst.read()
    result = COPY_IMPLS[impl](src.addr, dst.addr, so, do, sizes, 2)
    assert result == len(runs)
    assert dst.read() == expected_copy(before_src, before_dst, list(so), list(do), list(sizes))


@pytest.mark.parametrize("impl", sorted(COPY_IMPLS))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_single_huge_run_split_across_threads(impl: str, threads: int) -> None:
    size = 8 * 1024 * 1024 + 4099  # not a multiple of the split granularity
    src, dst = Mem(size, seed=6), Mem(size + 64, seed=7)
    tail = dst.read(size)
    assert COPY_IMPLS[impl](src.addr, dst.addr + 64, [0], [0], [size - 64], threads) == 1
    assert dst.read(64, size - 64) == src.read(0, size - 64)
    assert dst.read(size) == tail  # nothing written past the run


def test_split_by_bytes_balances_one_run() -> None:
    parts = native._split_by_bytes([(0, 1000, 10_000_000)], 2)
    assert [sum(n for _, _, n in p) for p in parts] == [5_000_000, 5_000_000]
    assert parts[1][0] == (5_000_000, 5_001_000, 5_000_000)
    parts = native._split_by_bytes([(0, 0, 100), (1000, 1000, 50), (5000, 9000, 7)], 3)
    pieces = [piece for p in parts for piece in p]
    assert sum(n for _, _, n in pieces) == 157 and all(n > 0 for _, _, n in pieces)


@pytest.mark.parametrize("impl", sorted(COPY_IMPLS))
def test_zero_blocks_and_zero_sizes(impl: str) -> None:
    src, dst = Mem(4096, seed=8), Mem(4096, seed=9)
    before = dst.read()
    assert COPY_IMPLS[impl](src.addr, dst.addr, array("Q"), array("Q"), array("Q"), 4) == 0
    assert COPY_IMPLS[impl](src.addr, dst.addr, [0, 100], [0, 200], [0, 0], 1) == 0
    assert dst.read() == before
    native.copy_blocks(src.addr, dst.addr, [], [], [], 1)  # public wrapper, plain lists


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


@pytest.mark.parametrize("impl", sorted(COPY_IMPLS))
def test_invalid_arguments(impl: str) -> None:
    copy = COPY_IMPLS[impl]
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
    if impl == "native":
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


def test_crc32c_public_helper_and_continuation() -> None:
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"56789", native.crc32c(b"1234")) == 0xE3069283


@needs_native
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
    assert native._crc32c_py(data[:20000]) == NATIVE.crc32c(data[:20000])


@pytest.mark.parametrize("impl", sorted(CHECKSUM_IMPLS))
@pytest.mark.parametrize("threads", [1, 3])
def test_checksum_blocks_values_and_bit_flip(impl: str, threads: int) -> None:
    size, count = 4096 + 8, 12  # pure Python CRC is slow: keep blocks small
    mem = Mem(size * count + 100, seed=12)
    offsets = array("Q", (7 + i * size for i in reversed(range(count))))
    sums = CHECKSUM_IMPLS[impl](mem.addr, offsets, size, threads)
    assert sums == [native._crc32c_py(mem.read(off, size)) for off in offsets]
    # Flip one bit inside the block stored at offsets[4]: only that checksum changes.
    flip_at = offsets[4] + 1234
    mem.buf[flip_at] ^= 0x10
    flipped = CHECKSUM_IMPLS[impl](mem.addr, offsets, size, threads)
    assert [i for i in range(count) if flipped[i] != sums[i]] == [4]
    mem.buf[flip_at] ^= 0x10
    assert CHECKSUM_IMPLS[impl](mem.addr, offsets, size, threads) == sums


@pytest.mark.parametrize("impl", sorted(CHECKSUM_IMPLS))
def test_checksum_blocks_edge_cases(impl: str) -> None:
    mem = Mem(64, seed=13)
    assert CHECKSUM_IMPLS[impl](mem.addr, array("Q"), 16, 2) == []
    assert CHECKSUM_IMPLS[impl](mem.addr, [0, 8], 0, 1) == [0, 0]  # CRC32C of nothing
    with pytest.raises(OverflowError):
        CHECKSUM_IMPLS[impl](2**64 - 8, [0], 16, 1)
    with pytest.raises(ValueError, match="threads"):
        CHECKSUM_IMPLS[impl](mem.addr, [0], 16, 0)


@needs_native
@pytest.mark.parametrize("threads", [1, 4])
def test_native_checksum_matches_fallback_on_big_blocks(threads: int) -> None:
    size, count = 256 * 1024, 16
    mem = Mem(size * count, seed=14)
    offsets = array("Q", (i * size for i in range(count)))
    native_sums = native.checksum_blocks(mem.addr, offsets, size, threads)
    assert native_sums == [NATIVE.crc32c_portable(mem.read(off, size)) for off in offsets]
    assert native._py_checksum_blocks(mem.addr, offsets[:2], size, 1) == native_sums[:2]


@pytest.mark.parametrize("use_native", [True, False])
def test_write_slot_headers(use_native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot headers written in one batch parse back (pool.parse_slot_header) field by field, and a
    flipped byte invalidates only its own header."""
    if use_native and NATIVE is None:
        pytest.skip("native extension not built")
    if not use_native:
        monkeypatch.setattr(native, "_native", None)
    import mmap

    from kvstore_service.pool import SLOT_HEADER_BYTES, parse_slot_header

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


def test_fallback_selected_by_environment() -> None:
    """A process with KVSTORE_DISABLE_NATIVE=1 runs the Python path end to end and says so once."""
    code = """
import ctypes, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from kvstore_service import native
assert native.NATIVE is False and native.features()["native"] is False
a = ctypes.create_string_buffer(b"A" * 4096 + b"B" * 4096, 8192); b = ctypes.create_string_buffer(8192)
native.copy_blocks(ctypes.addressof(a), ctypes.addressof(b), [4096, 0], [0, 4096], [4096, 4096], 2)
assert b.raw == b"B" * 4096 + b"A" * 4096
native.copy_blocks(ctypes.addressof(a), ctypes.addressof(b), [4095], [0], [2], 1)
assert b.raw[:3] == b"ABB"
print("sums", native.checksum_blocks(ctypes.addressof(a), [4090], 9, 1), native.crc32c(b"123456789"))
"""
    env = dict(os.environ, KVSTORE_DISABLE_NATIVE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("native copy engine unavailable") == 1
    expected = native._crc32c_py(b"AAAAAABBB")
    assert f"sums [{expected}] {0xE3069283}" in proc.stdout


# ---- device paths -------------------------------------------------------------------------------


def _device_impls() -> list[str]:
    return ["cuda", "acl"] if NATIVE is not None else []


@needs_native
@pytest.mark.parametrize("kind", _device_impls())
def test_device_copy_validates_arguments_first(kind: str) -> None:
    copy = getattr(native, f"{kind}_copy_blocks")
    with pytest.raises(ValueError, match="direction"):
        copy(0, 0, [0], [0], [8], "sideways", 0)
    with pytest.raises(ValueError, match="same length"):
        copy(0, 0, [0, 8], [0], [8], "h2d", 0)
    with pytest.raises(OverflowError):
        copy(2**64 - 4, 0, [0], [0], [8], "d2h", 0)


@needs_native
def test_cuda_raises_cleanly_without_driver() -> None:
    feats = native.features()
    if feats["cuda_available"]:
        pytest.skip("a CUDA device is present")
    assert feats["cuda_error"]
    mem = Mem(4096)
    with pytest.raises(RuntimeError, match="CUDA"):
        native.cuda_copy_blocks(mem.addr, 0x1000, [0], [0], [4096], "h2d", 0)
    with pytest.raises(RuntimeError, match="CUDA"):
        native.cuda_host_register(mem.addr, 4096)
    with pytest.raises(RuntimeError, match="CUDA"):
        native.cuda_host_unregister(mem.addr)


@needs_native
def test_acl_raises_cleanly_without_runtime() -> None:
    feats = native.features()
    if feats["acl_available"]:
        pytest.skip("an Ascend runtime is present")
    mem = Mem(4096)
    match = "not compiled" if not feats["acl_compiled"] else "Ascend|acl"
    with pytest.raises(RuntimeError, match=match):
        native.acl_copy_blocks(mem.addr, 0x1000, [0], [0], [4096], "h2d", 0)
    with pytest.raises(RuntimeError, match=match):
        native.acl_host_register(mem.addr, 4096)


def test_device_functions_need_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_native", None)
    with pytest.raises(RuntimeError, match="native extension"):
        native.cuda_copy_blocks(0, 0, [0], [0], [8], "h2d", 0)


@needs_native
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
        native.cuda_host_register(host.addr, host.size)
        ids = random.Random(18).sample(range(count * 2), count)
        host_offs = [i * block for i in range(count)]
        dev_offs = [i * block for i in ids]
        sizes = [block] * count
        native.cuda_copy_blocks(host.addr, dev_ptr.value, host_offs, dev_offs, sizes, "h2d", 0,
                                allow_batch=allow_batch)
        native.cuda_copy_blocks(dev_ptr.value, back.addr, dev_offs, host_offs, sizes, "d2h", 0,
                                allow_batch=allow_batch)
        assert back.read() == host.read()
        native.cuda_host_unregister(host.addr)
    finally:
        cuda.cuMemFree_v2(dev_ptr)
