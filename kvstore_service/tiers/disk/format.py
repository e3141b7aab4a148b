"""The disk tier's bytes: segment files (records, footers, clear markers), segment index checkpoints,
the catalog, and the file names. Described once, in docs/formats.md ("Disk tier"); this file (and
RecordHeader in csrc/disk_io.cpp, which writes and checks the record headers) is their one code
definition. Pure: encodes and parses, never touches a file.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from typing import Final

from kvstore_service import native, native_disk

ALIGN: Final[int] = native_disk.DISK_RECORD_ALIGN  # 4 KiB: header block, payload padding, record offsets
FORMAT_VERSION: Final = 1
SCOPE_BYTES: Final = 16
MAX_KEY: Final[int] = native_disk.DISK_MAX_KEY
MIN_SEGMENT_BYTES: Final = 64 << 10
IO_MODES: Final = {"staged": native_disk.DISK_MODE_STAGED, "direct": native_disk.DISK_MODE_DIRECT}

# magic, version, kind, segment, offset, records, CRC32C of the index entries, CRC32C of the bytes before it
FOOTER = struct.Struct("<IHHQQQII")
FOOTER_MAGIC: Final = 0x4644564B  # "KVDF"
KIND_FOOTER: Final = 2
KIND_CLEAR: Final = 3  # a clear marker: the same block, with the clear's generation in place of the record count
INDEX_VERSION: Final = 2
# magic, version, entry bytes, segment, footer offset, records, CRC32C of the entries, the segment's newest
# clear marker (its generation; 0: none)
INDEX_HEADER = struct.Struct("<8sIIQQQIQ")
INDEX_MAGIC: Final = b"KVDINDEX"
ENTRY = struct.Struct("<QQII16s64s")  # offset, payload length, payload CRC32C, key length, scope, key
CRC = struct.Struct("<I")
SEGMENT_FILE = re.compile(r"seg-([0-9a-f]{16})\.kvd")
CATALOG_FILE: Final = "catalog"
# magic, version, entries, the last clear of everything (segment, offset), generation (clears so far); then
# entries, then CRC32C of it all
CATALOG_HEADER = struct.Struct("<8sIIQQQ")
CATALOG_MAGIC: Final = b"KVDCATLG"
CATALOG_VERSION: Final = 2
CATALOG_ENTRY = struct.Struct("<16sQQI")  # scope, its last clear (segment, offset), name length; the name follows
NO_CLEAR: Final = (0, 0)  # a position before every record

Position = tuple[int, int]  # (segment, offset) of a record, or where the next one goes

# An index value packs (segment, offset / ALIGN, payload length, payload CRC32C) into one int.
SEQ_SHIFT: Final = 104
PAGE_SHIFT: Final = 72
LEN_SHIFT: Final = 32

Entry = tuple[int, int, int, bytes, bytes]  # offset, payload length, payload CRC32C, scope, key


def pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_location(seq: int, offset: int, length: int, crc: int) -> int:
    return seq << SEQ_SHIFT | (offset // ALIGN) << PAGE_SHIFT | length << LEN_SHIFT | crc


def unpack_location(value: int) -> tuple[int, int, int, int]:
    return (value >> SEQ_SHIFT, (value >> PAGE_SHIFT & 0xFFFFFFFF) * ALIGN, value >> LEN_SHIFT & (1 << 40) - 1,
            value & 0xFFFFFFFF)


def segment_file(seq: int) -> str:
    return f"seg-{seq:016x}.kvd"


def index_file(seq: int) -> str:
    return f"seg-{seq:016x}.idx"



def parse_footer(block: bytes, kind: int = KIND_FOOTER) -> tuple[int, int, int, int] | None:
    """(segment, offset, records, entries CRC32C) of a valid footer block, else None; with `kind`
    KIND_CLEAR, (segment, offset, generation, 0) of a valid clear marker."""
    magic, version, got_kind, seq, offset, records, entries_crc, crc = FOOTER.unpack_from(block)
    if (magic != FOOTER_MAGIC or version != FORMAT_VERSION or got_kind != kind
            or crc != native.crc32c(block[:FOOTER.size - 4])):
        return None
    return seq, offset, records, entries_crc


def footer_block(kind: int, seq: int, offset: int, count: int, entries_crc: int) -> bytes:
    footer = FOOTER.pack(FOOTER_MAGIC, FORMAT_VERSION, kind, seq, offset, count, entries_crc, 0)
    block = footer[:-4] + CRC.pack(native.crc32c(footer[:-4]))
    return block + bytes(ALIGN - len(block))



def encode_index(seq: int, end: int, packed: list[bytes], cleared: int) -> tuple[bytes, int]:
    """A closed segment's index checkpoint (footer at `end`, these packed entries, its newest clear marker)
    and the CRC32C of its entries (the footer's)."""
    entries = b"".join(packed)
    entries_crc = native.crc32c(entries)
    header = INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, ENTRY.size, seq, end, len(packed), entries_crc, cleared)
    data = header + entries
    return data + CRC.pack(native.crc32c(data)), entries_crc


def parse_index(data: bytes, seq: int) -> tuple[list[Entry], int, int, int, int] | None:
    """(entries, footer offset, records, entries CRC32C, newest clear marker) of a valid index checkpoint of
    segment `seq`, else None (the footer it names is still to be checked against it)."""
    if len(data) < INDEX_HEADER.size + CRC.size:
        return None
    magic, version, entry_bytes, got_seq, footer_at, records, entries_crc, cleared = INDEX_HEADER.unpack_from(data)
    body = memoryview(data)[INDEX_HEADER.size:-CRC.size]
    if (magic != INDEX_MAGIC or version != INDEX_VERSION or entry_bytes != ENTRY.size or got_seq != seq
            or len(body) != records * ENTRY.size or CRC.unpack_from(data, len(data) - CRC.size)[0]
            != native.crc32c(memoryview(data)[:-CRC.size]) or native.crc32c(body) != entries_crc):
        return None
    entries = [(off, n, crc, scope, key[:key_len]) for off, n, crc, key_len, scope, key in ENTRY.iter_unpack(body)]
    return entries, footer_at, records, entries_crc, cleared


def encode_catalog(clear_all: Position, clears: dict[bytes, Position], names: dict[bytes, str],
                   generation: int) -> bytes:
    scopes = sorted(clears.keys() | names.keys())
    parts = [CATALOG_HEADER.pack(CATALOG_MAGIC, CATALOG_VERSION, len(scopes), *clear_all, generation)]
    for scope in scopes:
        name = names.get(scope, "").encode()
        parts += [CATALOG_ENTRY.pack(scope, *clears.get(scope, NO_CLEAR), len(name)), name]
    data = b"".join(parts)
    return data + CRC.pack(native.crc32c(data))


def parse_catalog(data: bytes) -> tuple[Position, dict[bytes, Position], dict[bytes, str], int] | None:
    """(the last clear of everything, clears by scope, names by scope, generation) of a valid catalog, else
    None."""
    if len(data) < CATALOG_HEADER.size + CRC.size or CRC.unpack_from(data, len(data) - CRC.size)[0] != \
            native.crc32c(memoryview(data)[:-CRC.size]):
        return None
    magic, version, count, all_seq, all_off, generation = CATALOG_HEADER.unpack_from(data)
    if magic != CATALOG_MAGIC or version != CATALOG_VERSION:
        return None
    clears: dict[bytes, Position] = {}
    names: dict[bytes, str] = {}
    at = CATALOG_HEADER.size
    try:
        for _ in range(count):
            scope, seq, off, name_len = CATALOG_ENTRY.unpack_from(data, at)
            at += CATALOG_ENTRY.size + name_len
            if (seq, off) != NO_CLEAR:
                clears[scope] = (seq, off)
            if name_len:
                names[scope] = data[at - name_len:at].decode()
    except (struct.error, UnicodeDecodeError):
        return None
    return ((all_seq, all_off), clears, names, generation) if at == len(data) - CRC.size else None




def check_batch(scope: bytes, keys: Sequence[bytes], length: int, offsets: Sequence[int] | None = None,
                 crcs: Sequence[int] | None = None) -> int:
    """The keys' common length, after checking the arguments' shapes (ValueError: a caller's bug); the
    offsets and CRCs, where given, one per key."""
    if len(scope) != SCOPE_BYTES:
        raise ValueError(f"scope must be {SCOPE_BYTES} bytes (got {len(scope)})")
    if offsets is not None and len(offsets) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(offsets)} offsets")
    if crcs is not None and len(crcs) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(crcs)} checksums")
    if length < 1:
        raise ValueError(f"block length must be positive (got {length})")
    key_size = len(keys[0]) if keys else 1
    if not 1 <= key_size <= MAX_KEY or any(len(key) != key_size for key in keys):
        raise ValueError(f"keys must all have one length of 1..{MAX_KEY} bytes")
    return key_size
