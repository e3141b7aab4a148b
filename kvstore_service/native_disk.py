"""The disk tier's records (csrc/disk_io.cpp), typed: batches of records written, and read back verified.

A record is a header block and a block's payload, each padded to DISK_RECORD_ALIGN; the engine writes
and reads a batch of them on its own threads, the GIL released. kvstore_service/tiers/disk/ owns the
files they lie in.
"""

from __future__ import annotations

from array import array
from typing import Any, Final

from kvstore_service.native import U64Array, _as_u64, _native

# Disk tier records (csrc/disk_io.cpp defines the record header; kvstore_service/tiers/disk/format.py the files;
# both described in docs/formats.md).
DISK_RECORD_ALIGN: Final[int] = _native.DISK_RECORD_ALIGN  # header block size and payload padding (4 KiB)
DISK_MAX_KEY: Final[int] = _native.DISK_MAX_KEY
DISK_RECORD_MAGIC: Final[int] = _native.DISK_RECORD_MAGIC
DISK_RECORD_VERSION: Final[int] = _native.DISK_RECORD_VERSION
# disk_read results above 0: the record is not the one expected (corrupt, torn or overwritten).
DISK_CORRUPT_HEADER: Final[int] = _native.DISK_CORRUPT_HEADER
DISK_CORRUPT_PAYLOAD: Final[int] = _native.DISK_CORRUPT_PAYLOAD
DISK_SHORT_READ: Final[int] = _native.DISK_SHORT_READ
DISK_MODE_DIRECT: Final = 0  # payload pages straight from/into memory where aligned enough, else staged
DISK_MODE_STAGED: Final = 1  # every record through an aligned buffer (one memcpy of the payload)

# (kind, segment, offset, payload_len, payload_crc, scope, key) of a record header.
DiskHeaderFields = tuple[int, int, int, int, int, bytes, bytes]


def disk_write(fds: U64Array, file_offsets: U64Array, segments: U64Array, base: int, offsets: U64Array, length: int,
               crcs: U64Array, scope: bytes, keys: bytes, key_size: int, threads: int = 1,
               mode: int = DISK_MODE_STAGED, mem_align: int = DISK_RECORD_ALIGN) -> list[int]:
    """Write record i (a header, then the ``length`` bytes at ``base + offsets[i]`` whose CRC32C is
    ``crcs[i]``) to file ``fds[i]`` at ``file_offsets[i]`` (4 KiB aligned), for segment ``segments[i]``,
    on ``threads`` threads with the GIL released. ``keys``: packed, ``key_size`` bytes each;
    ``mem_align``: the file system's O_DIRECT memory alignment. Each record's result: 0, or -errno."""
    out = array("q")
    out.frombytes(_native.disk_write(_as_u64(fds), _as_u64(file_offsets), _as_u64(segments), base, _as_u64(offsets),
                                     length, _as_u64(crcs), scope, keys, key_size, threads, mode, mem_align))
    return out.tolist()


def disk_read(fds: U64Array, file_offsets: U64Array, segments: U64Array, base: int, offsets: U64Array, length: int,
              crcs: U64Array, scope: bytes, keys: bytes, key_size: int, threads: int = 1,
              mode: int = DISK_MODE_STAGED, mem_align: int = DISK_RECORD_ALIGN) -> list[int]:
    """Read record i into ``base + offsets[i]`` and verify it: its header must be the one disk_write
    wrote for these arguments, and its payload's CRC32C ``crcs[i]``. Each record's result: 0 verified,
    DISK_CORRUPT_HEADER / DISK_CORRUPT_PAYLOAD / DISK_SHORT_READ, or -errno. The bytes at the
    destination are undefined unless 0."""
    out = array("q")
    out.frombytes(_native.disk_read(_as_u64(fds), _as_u64(file_offsets), _as_u64(segments), base, _as_u64(offsets),
                                    length, _as_u64(crcs), scope, keys, key_size, threads, mode, mem_align))
    return out.tolist()


def disk_raw_io(fd: int, offset: int, count: int, size: int, write: bool, threads: int = 1) -> None:
    """``count`` sequential requests of ``size`` bytes (pwrite, or pread) at ``offset + i * size`` with the
    disk functions' threading and aligned buffers but no records: the file's own speed (benchmarks)."""
    _native.disk_raw_io(fd, offset, count, size, write, threads)


def disk_parse_header(data: Any, offset: int = 0) -> DiskHeaderFields | None:
    """The fields of the record header at ``data[offset:]``, or None if no valid one is there."""
    fields: DiskHeaderFields | None = _native.disk_parse_header(data, offset)
    return fields
