"""Block copies and checksums for the daemon: the native engine, or a pure-Python fallback.

The native extension (``kvstore_service._native``, built from ``csrc/`` by setup.py) copies with
memcpy on several threads and checksums with hardware CRC32C, all with the GIL released. When it
is missing (the build is optional) or disabled with ``KVSTORE_DISABLE_NATIVE=1``, the same
functions run in Python: ``ctypes.memmove`` (which releases the GIL) on a thread pool for copies.

Checksums are CRC32C on every path (``CHECKSUM_ALGORITHM``), so a pool written by one build
verifies with any other: the fallback uses the ``crc32c`` or ``google-crc32c`` package when one is
installed (both native code) and a pure-Python table loop otherwise. That last one is slow
(~10 MB/s) but computes the same values; a warning says so when it is first used.

Offsets and sizes are uint64 buffers (``array('Q')``, numpy uint64, bytes of native uint64) or
sequences of ints. Keeping every block inside its mapping is the caller's job: nothing here knows
the mappings' sizes; only 64-bit overflow of base + offset + size is rejected (OverflowError).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

CHECKSUM_ALGORITHM = "crc32c"

# What the copy functions accept for offsets and sizes.
U64Array = array | bytes | bytearray | memoryview | Sequence[int]

_native: ModuleType | None
if os.environ.get("KVSTORE_DISABLE_NATIVE", "").strip().lower() in ("1", "true", "yes", "on"):
    _native, _NATIVE_MISSING = None, "disabled by KVSTORE_DISABLE_NATIVE"
else:
    try:
        from kvstore_service import _native  # type: ignore[attr-defined,no-redef]

        _NATIVE_MISSING = ""
    except ImportError as exc:
        _native, _NATIVE_MISSING = None, str(exc)

NATIVE: bool = _native is not None

_U64_MAX = (1 << 64) - 1
_MAX_THREADS = 256  # same limit as the native engine
_MIN_BYTES_PER_THREAD = 256 * 1024  # below this a thread costs more than it saves (as native)

# ---- public API ---------------------------------------------------------------------------------


def copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array, sizes: U64Array,
                threads: int = 1) -> None:
    """Copy ``sizes[i]`` bytes from ``src_base + src_offsets[i]`` to ``dst_base + dst_offsets[i]``.

    Blocks contiguous in both source and destination are merged into one run first; the runs are
    split across ``threads`` threads by bytes. Overlapping ranges are undefined (as with memcpy).
    """
    if _native is not None:
        _native.copy_blocks(src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes),
                            threads)
    else:
        _fallback_notice()
        _py_copy_blocks(src_base, dst_base, src_offsets, dst_offsets, sizes, threads)


def checksum_blocks(base: int, offsets: U64Array, size: int, threads: int = 1) -> list[int]:
    """CRC32C of each ``size``-byte block at ``base + offsets[i]``."""
    if _native is not None:
        return _u64_list(_native.checksum_blocks(base, _as_u64(offsets), size, threads))
    _fallback_notice()
    return _py_checksum_blocks(base, offsets, size, threads)


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``crc`` (a previous result, 0 to start)."""
    if _native is not None:
        return int(_native.crc32c(data, crc))
    return _crc32c_fallback()(data, crc)


def write_slot_headers(base: int, offsets: U64Array, state: int, payload_len: int, generation: int, ns_hash: bytes,
                       keys: bytes, key_size: int, checksums: U64Array | None = None) -> None:
    """Write the pool slot header (layout: ``pool.SLOT_BODY`` + its CRC32C) of block i at
    ``base + offsets[i]``; ``keys`` holds the blocks' keys packed, ``key_size`` bytes each."""
    if _native is not None:
        _native.write_slot_headers(base, _as_u64(offsets), state, payload_len, generation, ns_hash, keys, key_size,
                                   None if checksums is None else _as_u64(checksums))
        return
    from kvstore_service.pool import MAX_KEY, slot_header_bytes

    where = _u64_values(offsets, "offsets")
    if len(ns_hash) != 16:
        raise ValueError(f"ns_hash must be 16 bytes (got {len(ns_hash)})")
    if not 1 <= key_size <= MAX_KEY or len(keys) != len(where) * key_size:
        raise ValueError(
            f"keys must be {len(where)} keys of 1..{MAX_KEY} bytes (got {len(keys)} bytes, key_size {key_size})")
    sums = [0] * len(where) if checksums is None else _u64_values(checksums, "checksums")
    if len(sums) != len(where):
        raise ValueError(f"{len(where)} offsets but {len(sums)} checksums")
    for i, offset in enumerate(where):
        header = slot_header_bytes(state, payload_len, sums[i], generation, ns_hash,
                                   keys[i * key_size:(i + 1) * key_size])
        ctypes.memmove(base + offset, header, len(header))


def coalesce_runs(src_offsets: U64Array, dst_offsets: U64Array,
                  sizes: U64Array) -> list[tuple[int, int, int]]:
    """The merged ``(src_offset, dst_offset, size)`` runs a copy of these blocks executes."""
    if _native is not None:
        return list(_native.coalesce_runs(_as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes)))
    return _py_coalesce(*_validated(0, 0, src_offsets, dst_offsets, sizes))


def features() -> dict[str, Any]:
    """What the engine can do here: native or not, CRC implementation, CUDA/Ascend availability."""
    info: dict[str, Any] = dict(_native.features()) if _native is not None else {}
    info["native"] = NATIVE
    info["native_missing_reason"] = _NATIVE_MISSING
    info["checksum"] = CHECKSUM_ALGORITHM
    if _native is None:
        info["crc32c_impl"] = _crc32c_fallback_name()
    return info


# Device paths: only in the native engine (see csrc/cuda_copy.cpp and csrc/acl_copy.cpp).


def cuda_copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array,
                     sizes: U64Array, direction: str, device: int, stream: int = 0,
                     allow_batch: bool = True) -> None:
    """Copy between GPU memory and host memory ('h2d', 'd2h', 'd2d') and wait for completion."""
    _require_native("cuda_copy_blocks").cuda_copy_blocks(
        src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes), direction, device,
        stream, allow_batch)


def cuda_host_register(addr: int, size: int, device: int = 0) -> None:
    """Pin host memory (e.g. the pool) for fast asynchronous GPU copies."""
    _require_native("cuda_host_register").cuda_host_register(addr, size, device)


def cuda_host_unregister(addr: int, device: int = 0) -> None:
    _require_native("cuda_host_unregister").cuda_host_unregister(addr, device)


def acl_copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array,
                    sizes: U64Array, direction: str, device: int, stream: int = 0,
                    allow_batch: bool = True) -> None:
    """Ascend counterpart of cuda_copy_blocks (unverified on hardware)."""
    _require_native("acl_copy_blocks").acl_copy_blocks(
        src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes), direction, device,
        stream, allow_batch)


def acl_host_register(addr: int, size: int, device: int = 0) -> int:
    """aclrtHostRegister(MAPPED); returns the device-side address of the host range."""
    return int(_require_native("acl_host_register").acl_host_register(addr, size, device))


def acl_host_unregister(addr: int, device: int = 0) -> None:
    _require_native("acl_host_unregister").acl_host_unregister(addr, device)


# ---- helpers --------------------------------------------------------------------------------------

_notice_lock = threading.Lock()
_notice_done = False


def _fallback_notice() -> None:
    global _notice_done
    if _notice_done:
        return
    with _notice_lock:
        if not _notice_done:
            _notice_done = True
            log.warning("native copy engine unavailable (%s); using the slower Python fallback "
                        "with %s checksums", _NATIVE_MISSING, _crc32c_fallback_name())


def _require_native(name: str) -> ModuleType:
    if _native is None:
        raise RuntimeError(f"{name} needs the native extension kvstore_service._native ({_NATIVE_MISSING})")
    return _native


def _as_u64(values: U64Array) -> Any:
    """Pass buffers through to the extension (it validates them); pack int sequences as array('Q')."""
    if isinstance(values, (array, bytes, bytearray, memoryview)):
        return values
    try:
        memoryview(values)  # type: ignore[arg-type]  # numpy arrays and other buffer exporters
        return values
    except TypeError:
        return array("Q", values)


def _u64_list(raw: bytes) -> list[int]:
    out = array("Q")
    out.frombytes(raw)
    return out.tolist()


def _u64_values(values: U64Array, name: str) -> list[int]:
    """Same acceptance rules as the extension: 64-bit integer buffers, raw bytes, or int sequences."""
    try:
        view = memoryview(values)  # type: ignore[arg-type]
    except TypeError:
        return array("Q", values).tolist()  # type: ignore[arg-type]  # OverflowError on negatives
    fmt = view.format.lstrip("@=<")
    if view.itemsize == 8 and fmt in ("Q", "L", "N", "q", "l", "n"):
        ints = view.cast("B").cast(fmt).tolist()
    elif view.itemsize == 1 and fmt in ("B", "b", "c") and view.nbytes % 8 == 0:
        ints = view.cast("B").cast("Q").tolist()
    else:
        raise ValueError(f"{name} must hold 64-bit unsigned integers (itemsize 8, e.g. array('Q')); "
                         f"got format {view.format!r} with itemsize {view.itemsize}")
    if fmt in ("q", "l", "n"):
        for i, v in enumerate(ints):
            if v < 0:
                raise ValueError(f"{name}[{i}] is negative")
    return ints


def _check_threads(threads: int) -> None:
    if not 1 <= threads <= _MAX_THREADS:
        raise ValueError(f"threads must be between 1 and {_MAX_THREADS} (got {threads})")


def _validated(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array,
               sizes: U64Array) -> tuple[list[int], list[int], list[int]]:
    src = _u64_values(src_offsets, "src_offsets")
    dst = _u64_values(dst_offsets, "dst_offsets")
    size = _u64_values(sizes, "sizes")
    if not len(src) == len(dst) == len(size):
        raise ValueError(f"src_offsets, dst_offsets and sizes must have the same length "
                         f"(got {len(src)}, {len(dst)}, {len(size)})")
    for i, (s, d, n) in enumerate(zip(src, dst, size, strict=True)):
        if src_base + s + n > _U64_MAX or dst_base + d + n > _U64_MAX:
            raise OverflowError(f"block {i}: base + offset + size overflows the address space")
    return src, dst, size


def _py_coalesce(src: list[int], dst: list[int], sizes: list[int]) -> list[tuple[int, int, int]]:
    """Sort by source, drop empty blocks, merge runs contiguous on both sides (as the extension)."""
    runs = sorted((r for r in zip(src, dst, sizes, strict=True) if r[2]), key=lambda r: r[0])
    merged: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        if merged:
            ps, pd, pn = merged[-1]
            if ps + pn == s and pd + pn == d:
                merged[-1] = (ps, pd, pn + n)
                continue
        merged.append((s, d, n))
    return merged


def _split_by_bytes(runs: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut runs into `parts` lists of nearly equal bytes (64-byte granularity), like the extension."""
    total = sum(n for _, _, n in runs)
    share = (total // parts + 63) & ~63
    bounds = [min(total, share * (t + 1)) for t in range(parts)]
    bounds[-1] = total
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    pos = t = 0
    for s, d, n in runs:
        off = 0
        while off < n:
            while pos >= bounds[t] and t + 1 < parts:
                t += 1
            take = min(n - off, bounds[t] - pos)
            out[t].append((s + off, d + off, take))
            off += take
            pos += take
    return out


_executors: dict[int, ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()


def _executor(workers: int) -> ThreadPoolExecutor:
    with _executors_lock:
        pool = _executors.get(workers)
        if pool is None:
            pool = _executors[workers] = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-copy")
        return pool


def _parallel(parts: int, fn: Callable[[int], None]) -> None:
    """fn(0..parts-1); part 0 on the calling thread like the extension."""
    if parts <= 1:
        fn(0)
        return
    futures = [_executor(parts - 1).submit(fn, t) for t in range(1, parts)]
    fn(0)
    for f in futures:
        f.result()


def _py_copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array,
                    sizes: U64Array, threads: int = 1) -> int:
    """Fallback copy: ctypes.memmove (GIL released) per run piece on a thread pool. Returns #runs."""
    _check_threads(threads)
    runs = _py_coalesce(*_validated(src_base, dst_base, src_offsets, dst_offsets, sizes))
    total = sum(n for _, _, n in runs)
    parts = max(1, min(threads, total // _MIN_BYTES_PER_THREAD))
    lists = _split_by_bytes(runs, parts)

    def work(t: int) -> None:
        for s, d, n in lists[t]:
            ctypes.memmove(dst_base + d, src_base + s, n)

    _parallel(parts, work)
    return len(runs)


def _py_checksum_blocks(base: int, offsets: U64Array, size: int, threads: int = 1) -> list[int]:
    _check_threads(threads)
    offs = _u64_values(offsets, "offsets")
    if not 0 <= size <= _U64_MAX:
        raise OverflowError("size must be an int in [0, 2**64)")
    for i, off in enumerate(offs):
        if base + off + size > _U64_MAX:
            raise OverflowError(f"block {i}: checksum base + offset + size overflows the address space")
    crc = _crc32c_fallback()
    sums = [0] * len(offs)
    # Threads only help when the CRC code releases the GIL (the packages do; pure Python does not).
    parts = 1
    if crc is not _crc32c_py:
        parts = max(1, min(threads, len(offs), len(offs) * size // _MIN_BYTES_PER_THREAD))

    def work(t: int) -> None:
        for i in range(len(offs) * t // parts, len(offs) * (t + 1) // parts):
            sums[i] = crc(memoryview((ctypes.c_char * size).from_address(base + offs[i])).cast("B"), 0)

    _parallel(parts, work)
    return sums


# ---- CRC32C without the extension -----------------------------------------------------------------


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _make_table()


def _crc32c_py(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Pure-Python CRC32C (reflected 0x82F63B78, init/xorout ~0); slow but always available."""
    table = _TABLE
    crc ^= 0xFFFFFFFF
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


_crc_impl: tuple[str, Callable[[Any, int], int]] | None = None


def _load_crc32c_fallback() -> tuple[str, Callable[[Any, int], int]]:
    try:
        import crc32c as crc32c_pkg  # the 'crc32c' PyPI package (hardware accelerated, releases the GIL)

        return "crc32c package", lambda data, crc=0: int(crc32c_pkg.crc32c(data, crc))
    except ImportError:
        pass
    try:
        import google_crc32c  # the 'google-crc32c' PyPI package

        return "google-crc32c package", lambda data, crc=0: int(google_crc32c.extend(crc, bytes(data)))
    except ImportError:
        pass
    log.warning("no native CRC32C available (kvstore extension not built, no 'crc32c' or 'google-crc32c' "
                "package): checksums run in pure Python at roughly 10 MB/s")
    return "pure Python", _crc32c_py


def _crc32c_fallback() -> Callable[[Any, int], int]:
    global _crc_impl
    if _crc_impl is None:
        _crc_impl = _load_crc32c_fallback()
    return _crc_impl[1]


def _crc32c_fallback_name() -> str:
    _crc32c_fallback()
    assert _crc_impl is not None
    return _crc_impl[0]
