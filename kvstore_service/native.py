"""The native engine (csrc/): block copies, a chunk's transfer and its plan, checksums, slot headers.

The extension (``kvstore_service._native``, built from ``csrc/`` by setup.py, required) copies
with memcpy/streaming stores on several threads and checksums with hardware CRC32C, all with the
GIL released. It also owns the pool's slot-header layout (``SlotHeader`` in csrc/slot_headers.cpp):
``write_slot_headers`` and ``parse_slot_header`` are the only code that knows it.

A chunk's runs are planned in C (``plan_transfer``) and stay there: Python holds the plan as an opaque
``Runs`` and hands it back to the copy (``transfer``; the device backends' ``cuda_transfer`` /
``acl_transfer``). Offsets and sizes elsewhere are uint64 buffers (``array('Q')``, numpy uint64, bytes
of native uint64) or sequences of ints. Only plan_transfer knows the mappings: the copies reject just
64-bit overflow of base + offset + size (OverflowError).

This module loads the extension; the typed faces of its other units import it from here, with the
buffer conversions (``_native``, ``U64Array``, ``_as_u64``, ``_u64_list``): native_blocks.py (the
index's block records and LRU lists), native_disk.py (disk tier records), native_memory.py (populate,
interleave, guards), native_device.py (CUDA and Ascend copies, sticky device errors).
"""

from __future__ import annotations

import importlib
from array import array
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Final, Protocol, TypeAlias

try:
    _native: ModuleType = importlib.import_module("kvstore_service._native")
except ImportError as exc:
    raise ImportError(
        f"kvstore's native copy engine kvstore_service._native cannot be imported ({exc}). It is built from "
        "csrc/ when kvstore is installed: reinstall it (pip install ./client .) on a machine with a C++17 "
        "compiler and the Python development headers, and check the build output for errors."
    ) from exc

CHECKSUM_ALGORITHM: Final = "crc32c"

# The pool's slot-header geometry, from the engine that defines the layout.
SLOT_HEADER_BYTES: Final[int] = _native.SLOT_HEADER_BYTES  # stride of the headers in a segment
SLOT_MAGIC: Final[int] = _native.SLOT_MAGIC
SLOT_MAX_KEY: Final[int] = _native.SLOT_MAX_KEY

# What the copy functions accept for offsets and sizes (a string: array is not subscriptable at runtime).
U64Array: TypeAlias = "array[int] | bytes | bytearray | memoryview | Sequence[int]"

# (state, payload_len, checksum, generation, ns_hash, key) of a slot header.
SlotHeaderFields = tuple[int, int, int, int, bytes, bytes]


def copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array, sizes: U64Array,
                threads: int = 1, streaming: bool = True) -> int:
    """Copy ``sizes[i]`` bytes from ``src_base + src_offsets[i]`` to ``dst_base + dst_offsets[i]``.

    Blocks contiguous in both source and destination are merged into one run first; the runs are
    split across ``threads`` threads by bytes. Overlapping ranges are undefined (as with memcpy).
    ``streaming``: non-temporal stores (for a destination nothing reads soon: the pool). Returns the
    number of merged runs.
    """
    return int(_native.copy_blocks(src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes),
                                   threads, streaming))


# A checksum no block has (CRC32C is 32 bits): in `transfer`'s `expected`, "not known yet, not checked".
UNKNOWN_CHECKSUM: Final = (1 << 64) - 1


def check_job(keys: bytes, key_size: int, block_ids: U64Array, num_blocks: int, distinct_ids: bool) -> str:
    """What is wrong with a job's keys (packed, `key_size` bytes each) and engine block ids: an id outside
    0..num_blocks-1, duplicate keys, or (distinct_ids) duplicate ids; "" if nothing."""
    return str(_native.check_job(keys, key_size, _as_u64(block_ids), num_blocks, distinct_ids))


class Runs(Protocol):
    """A chunk's byte runs, held by the native engine (``_native.Runs``): `blocks` blocks' runs, region-major
    (region r's run of block k is run ``r * blocks + k``). Made by ``plan_transfer`` (bounds-checked) or,
    for tests and diagnostics, by ``runs_of``; copied by ``transfer`` and the device transfers."""

    @property
    def blocks(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

    def __len__(self) -> int: ...

    def without(self, positions: U64Array, /) -> Runs:
        """The runs of every block but those at these positions."""
        ...

    def columns(self) -> bytes: ...


def plan_transfer(slot_offsets: U64Array, block_ids: U64Array, regions: U64Array, num_blocks: int, pool_size: int,
                  shard_offset: int = 0) -> Runs:
    """The byte runs of a chunk's blocks in one call, region-major. Block k's slot payload is at pool
    offset ``slot_offsets[k]`` (this engine's part of it ``shard_offset`` bytes in), its engine block
    id ``block_ids[k]``; ``regions`` holds five values per region: the address of its block 0, its
    stride and block bytes, and the mapping ``[lo, hi)`` it lies in. Every run is checked against
    ``pool_size`` and its mapping, and every id against ``num_blocks``, before anything is returned
    (ValueError naming the block)."""
    runs: Runs = _native.plan_transfer(_as_u64(slot_offsets), _as_u64(block_ids), _as_u64(regions), num_blocks,
                                       pool_size, shard_offset)
    return runs


def runs_of(pool_offsets: U64Array, engine_addresses: U64Array, sizes: U64Array, blocks: int | None = None) -> Runs:
    """Runs from arrays, `blocks` per region (None: one region, a block per run); not bounds-checked: for
    tests and diagnostics (the daemon plans with plan_transfer)."""
    runs: Runs = _native.Runs(_as_u64(pool_offsets), _as_u64(engine_addresses), _as_u64(sizes), blocks)
    return runs


def columns(runs: Runs) -> tuple[array[int], array[int], array[int]]:
    """``(pool_offsets, engine_addresses, sizes)`` of the runs, for tests and diagnostics."""
    values = array("Q")
    values.frombytes(runs.columns())
    n = len(runs)
    return values[:n], values[n:2 * n], values[2 * n:]


def transfer(pool_base: int, runs: Runs, to_engine: bool, threads: int = 1, streaming: bool = True,
             progress: int = 0, progress_word: int = 0, check: U64Array | None = None,
             check_offsets: U64Array | None = None, check_size: int = 0, expected: U64Array | None = None) -> list[int]:
    """A chunk of a job in one native call, the GIL released throughout: its runs go pool -> engine if
    ``to_engine``. First the blocks at positions ``check`` are verified: the CRC32C of ``check_size``
    bytes at ``pool_base + check_offsets[i]`` must be ``expected[i]`` (UNKNOWN_CHECKSUM: not checked); a
    block that differs is corrupt and none of its runs is copied. With ``progress`` (an address: a
    completion channel's progress word) the copy goes in layout order on this thread, a group of
    regions of at least 256 KiB a block at a time, and stores ``progress_word | regions landed`` there
    after each; else the runs are coalesced and copied on ``threads`` threads. Returns the corrupt positions."""
    return _u64_list(_native.transfer(pool_base, runs, to_engine, threads, streaming, progress, progress_word,
                                      None if check is None else _as_u64(check),
                                      None if check_offsets is None else _as_u64(check_offsets), check_size,
                                      None if expected is None else _as_u64(expected)))


def _u64_list(data: bytes) -> list[int]:
    """Native-endian uint64 values, as the native engine returns them."""
    out = array("Q")
    out.frombytes(data)
    return out.tolist()


def checksum_blocks(base: int, offsets: U64Array, size: int, threads: int = 1) -> list[int]:
    """CRC32C of each ``size``-byte block at ``base + offsets[i]``."""
    return _u64_list(_native.checksum_blocks(base, _as_u64(offsets), size, threads))


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``crc`` (a previous result, 0 to start)."""
    return int(_native.crc32c(data, crc))


def crc32c_copy(src: bytes | memoryview, dst: memoryview) -> int:
    """Copy ``src`` into ``dst`` (at least as long) and return its CRC32C, both in one pass."""
    return int(_native.crc32c_copy(src, dst))


def write_slot_headers(base: int, offsets: U64Array, state: int, payload_len: int, generation: int, ns_hash: bytes,
                       keys: bytes, key_size: int, checksums: U64Array | None = None) -> None:
    """Write the pool slot header of block i at ``base + offsets[i]``; ``keys`` holds the blocks'
    keys packed, ``key_size`` (1..SLOT_MAX_KEY) bytes each; ``checksums`` None means 0."""
    _native.write_slot_headers(base, _as_u64(offsets), state, payload_len, generation, ns_hash, keys, key_size,
                               None if checksums is None else _as_u64(checksums))


def invalidate_slot_headers(base: int, slots: list[int], count: int) -> None:
    """Void the header of each slot of a segment whose `count` headers start at `base` (its magic
    zeroed: a recovery finds no block there). Every slot is checked against `count` first."""
    _native.invalidate_slot_headers(base, slots, count)


def parse_slot_header(data: Any, offset: int) -> SlotHeaderFields | None:
    """The fields of the slot header at ``data[offset:]`` (any buffer, e.g. an mmap), or None if
    none is valid there (never written, torn, invalidated). ValueError past the buffer's end."""
    fields: SlotHeaderFields | None = _native.parse_slot_header(data, offset)
    return fields


def coalesce_runs(src_offsets: U64Array, dst_offsets: U64Array,
                  sizes: U64Array) -> list[tuple[int, int, int]]:
    """The merged ``(src_offset, dst_offset, size)`` runs a copy of these blocks executes."""
    return list(_native.coalesce_runs(_as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes)))


def features() -> dict[str, Any]:
    """What the engine can do here: CRC implementation, CUDA/Ascend compiled in and available."""
    return dict(_native.features())


def _as_u64(values: U64Array) -> Any:
    """Pass buffers through to the extension (it validates them); pack int sequences as array('Q')."""
    if isinstance(values, (array, bytes, bytearray, memoryview)):
        return values
    try:
        memoryview(values)  # type: ignore[arg-type]  # numpy arrays and other buffer exporters
        return values
    except TypeError:
        return array("Q", values)
