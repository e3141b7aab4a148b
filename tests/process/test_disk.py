"""The disk tier (kvstore_service/tiers/disk/): real segment files in temp dirs, a real pool as the memory
blocks are written from and read into."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_service import native
from kvstore_service.pool import Pool
from kvstore_service.threads import Threads
from kvstore_service.tiers.disk import ALIGN, DiskDirectoryError, DiskTier
from kvstore_service.tiers.disk.format import parse_catalog

KB, MB = 1 << 10, 1 << 20
SCOPE = bytes(range(16))
OTHER_SCOPE = bytes(16)
DISK = Threads(copy_threads=1).disk  # the daemon's disk threads (the blocking calls tested here do not use them)


def keys_of(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:06d}".encode().ljust(32, b".") for i in range(n)]


def content(key: bytes, length: int) -> bytes:
    return random.Random(key).randbytes(length)


def record_bytes(length: int) -> int:
    return ALIGN + (length + ALIGN - 1) // ALIGN * ALIGN


class Memory:
    """Blocks in a real pool: the source of writes and the destination of reads."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def slots(self, n: int, length: int) -> list[int]:
        offsets = [seg.payload_offset(slot) for seg, slots in self.pool.allocate_many(length, n) for slot in slots]
        assert len(offsets) == n, "test pool too small"
        return offsets

    def store(self, keys: list[bytes], length: int) -> tuple[list[int], list[int]]:
        """Slots holding each key's content, and their CRC32Cs."""
        offsets = self.slots(len(keys), length)
        for key, off in zip(keys, offsets, strict=True):
            ctypes.memmove(self.pool.base + off, content(key, length), length)
        return offsets, native.checksum_blocks(self.pool.base, offsets, length)

    def get(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.pool.base + offset, length)


@pytest.fixture
def mem() -> Iterator[Memory]:
    path = f"/dev/shm/kvstore-test-disk-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = Pool(path, 96 * MB, 8 * MB, fresh=True)
    yield Memory(pool)
    pool.close()
    os.unlink(path)


@pytest.fixture
def tiers() -> Iterator[list[DiskTier]]:
    opened: list[DiskTier] = []
    yield opened
    for tier in opened:
        tier.close()


def open_tier(tiers: list[DiskTier], path: Path, size: int = 64 * MB, **kwargs: object) -> DiskTier:
    kwargs.setdefault("segment_bytes", 2 * MB)
    tier = DiskTier.open(str(path), size, executor=DISK, **kwargs)  # type: ignore[arg-type]
    tiers.append(tier)
    return tier


def write_keys(tier: DiskTier, mem: Memory, keys: list[bytes], length: int, scope: bytes = SCOPE,
               name: str = "") -> int:
    offsets, crcs = mem.store(keys, length)
    return tier.write(scope, keys, mem.pool.base, offsets, length, crcs, name)


def read_keys(tier: DiskTier, mem: Memory, keys: list[bytes], length: int,
              scope: bytes = SCOPE) -> list[bytes | None]:
    """Each key's bytes as read from disk into fresh pool slots, or None."""
    offsets = mem.slots(len(keys), length)
    got = tier.read(scope, keys, mem.pool.base, offsets, length)
    out: list[bytes | None] = []
    for crc, off in zip(got, offsets, strict=True):
        data = None if crc is None else mem.get(off, length)
        if data is not None:
            assert native.crc32c(data) == crc
        out.append(data)
    return out


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.kvd"))


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("io_mode", ["staged", "direct"])
@pytest.mark.parametrize("length", [256 * KB, 300_000, 5000, 2 * MB])
def test_write_read_round_trip_is_byte_exact(tmp_path: Path, mem: Memory, tiers: list[DiskTier], io_mode: str,
                                             length: int) -> None:
    tier = open_tier(tiers, tmp_path / "disk", segment_bytes=8 * MB, io_mode=io_mode)
    keys = keys_of(6)
    assert write_keys(tier, mem, keys, length) == 6
    assert tier.leading(SCOPE, keys) == 6
    assert read_keys(tier, mem, keys, length) == [content(k, length) for k in keys]
    s = tier.stats()
    assert (s.blocks, s.written, s.write_bytes, s.read_blocks, s.read_bytes) == (6, 6, 6 * length, 6, 6 * length)
    assert s.healthy and s.error == "" and s.corrupt == 0 and s.errors == 0
    assert s.direct_io  # ext4 and tmpfs both take O_DIRECT here


def test_blocks_at_misaligned_and_aligned_pool_addresses(tmp_path: Path, tiers: list[DiskTier]) -> None:
    """Pool payloads are 256-byte aligned only: every alignment class round-trips in both modes."""
    import mmap as mmap_module

    buf = mmap_module.mmap(-1, 16 * MB)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    length = 64 * KB + 100
    for io_mode in ("staged", "direct"):
        tier = open_tier(tiers, tmp_path / io_mode, io_mode=io_mode)
        keys = keys_of(8, io_mode)
        src = [i * 256 * KB + 256 * i for i in range(8)]  # 0, 256, 512, ... past a page
        for key, off in zip(keys, src, strict=True):
            buf[off:off + length] = content(key, length)
        crcs = native.checksum_blocks(base, src, length)
        assert tier.write(SCOPE, keys, base, src, length, crcs) == 8
        dst = [8 * MB + i * 256 * KB + 256 * (7 - i) for i in range(8)]
        assert tier.read(SCOPE, keys, base, dst, length) == crcs
        assert all(buf[d:d + length] == content(k, length) for k, d in zip(keys, dst, strict=True))


def test_write_skips_keys_on_disk_and_duplicates(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, tmp_path / "disk")
    keys = keys_of(4)
    assert write_keys(tier, mem, keys[:2], 64 * KB) == 2
    assert write_keys(tier, mem, keys + keys[2:3], 64 * KB) == 2  # 2 on disk, keys[2] twice
    assert tier.stats().written == 4 and tier.stats().write_dropped == 0
    assert tier.leading(SCOPE, keys) == 4


def test_leading_counts_the_leading_run_per_scope(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, tmp_path / "disk")
    keys = keys_of(5)
    write_keys(tier, mem, [keys[0], keys[1], keys[3]], 16 * KB)
    assert tier.leading(SCOPE, keys) == 2
    assert tier.leading(OTHER_SCOPE, keys) == 0
    assert tier.leading(SCOPE, keys[3:]) == 1
    s = tier.stats()
    assert (s.hits, s.misses) == (3, 3 + 5 + 1)


def test_read_of_absent_keys_or_another_length_is_none(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, tmp_path / "disk")
    keys = keys_of(3)
    write_keys(tier, mem, keys[:2], 16 * KB)
    got = read_keys(tier, mem, keys, 16 * KB)
    assert got[:2] == [content(k, 16 * KB) for k in keys[:2]] and got[2] is None
    assert read_keys(tier, mem, keys[:1], 32 * KB) == [None]
    assert read_keys(tier, mem, keys[:1], 16 * KB, scope=OTHER_SCOPE) == [None]
    assert tier.stats().corrupt == 0


def test_malformed_arguments_are_value_errors(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, tmp_path / "disk")
    with pytest.raises(ValueError, match="scope"):
        tier.write(b"short", [b"k"], mem.pool.base, [0], 4096, [0])
    with pytest.raises(ValueError, match="one length"):
        tier.write(SCOPE, [b"k", b"kk"], mem.pool.base, [0, 4096], 4096, [0, 0])
    with pytest.raises(ValueError, match="offsets"):
        tier.read(SCOPE, [b"k"], mem.pool.base, [], 4096)
    with pytest.raises(ValueError, match="segment size"):
        DiskTier.open(str(tmp_path / "x"), 64 * MB, executor=DISK, segment_bytes=1000)
    with pytest.raises(ValueError, match="two"):
        DiskTier.open(str(tmp_path / "x"), 3 * MB, executor=DISK, segment_bytes=2 * MB)


# -- write-behind queue ------------------------------------------------------------------------------


def test_admit_bounds_the_queue_and_write_releases_it(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, tmp_path / "disk", queue_bytes=3 * 64 * KB)
    keys = keys_of(5)
    chosen = tier.admit(SCOPE, keys, 64 * KB)
    assert chosen == [0, 1, 2]
    assert tier.admit(SCOPE, keys[:3], 64 * KB) == []  # queued already: neither chosen nor dropped
    s = tier.stats()
    assert (s.queued_bytes, s.write_dropped) == (3 * 64 * KB, 2)
    assert write_keys(tier, mem, keys[:2], 64 * KB) == 2
    assert tier.stats().queued_bytes == 64 * KB
    tier.cancel(SCOPE, keys[2:3])
    assert tier.stats().queued_bytes == 0
    assert tier.admit(SCOPE, keys, 64 * KB) == [2, 3, 4]  # keys 0 and 1 are on disk now


# -- restart ------------------------------------------------------------------------------------------


def test_reopen_loads_checkpoints_and_finds_everything(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path = tmp_path / "disk"
    tier = open_tier(tiers, path)
    keys, other = keys_of(20), keys_of(3, "o")
    write_keys(tier, mem, keys, 200 * KB)
    write_keys(tier, mem, other, 200 * KB, scope=OTHER_SCOPE)
    tier.close()
    segs = segment_files(path)
    assert len(segs) >= 3 and all(p.with_suffix(".idx").exists() for p in segs)
    tier = open_tier(tiers, path)
    assert tier.leading(SCOPE, keys) == 20 and tier.leading(OTHER_SCOPE, other) == 3
    assert read_keys(tier, mem, keys, 200 * KB) == [content(k, 200 * KB) for k in keys]
    assert read_keys(tier, mem, other, 200 * KB, scope=OTHER_SCOPE) == [content(k, 200 * KB) for k in other]
    assert write_keys(tier, mem, keys_of(2, "new"), 200 * KB) == 2  # new writes go to a new segment
    assert len(segment_files(path)) == len(segs) + 1


def test_reopen_without_checkpoints_scans_the_segments(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path = tmp_path / "disk"
    tier = open_tier(tiers, path)
    keys = keys_of(15)
    write_keys(tier, mem, keys, 200 * KB)
    tier.close()
    for idx in path.glob("*.idx"):
        idx.unlink()
    (path / segment_files(path)[0].with_suffix(".idx").name).write_bytes(b"garbage")  # an invalid one
    tier = open_tier(tiers, path)
    assert tier.leading(SCOPE, keys) == 15
    assert read_keys(tier, mem, keys, 200 * KB) == [content(k, 200 * KB) for k in keys]
    assert all(p.with_suffix(".idx").stat().st_size > 100 for p in segment_files(path))  # rewritten


WRITER = textwrap.dedent("""
    import ctypes, mmap, os, random, sys, time
    from kvstore_service import native
    from kvstore_service.threads import Threads
    from kvstore_service.tiers.disk import DiskTier

    path, count, length, then = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tier = DiskTier.open(path, 4 << 30, executor=Threads(1).disk,
                         segment_bytes=8 << 20)  # nothing reclaimed in the test's time
    buf = mmap.mmap(-1, max(count, 4) * length)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))

    def write(first, n):
        keys = [f"k{i:06d}".encode().ljust(32, b".") for i in range(first, first + n)]
        for k, key in enumerate(keys):
            buf[k * length:(k + 1) * length] = random.Random(key).randbytes(length)
        crcs = native.checksum_blocks(base, [k * length for k in range(n)], length)
        assert tier.write(bytes(range(16)), keys, base, [k * length for k in range(n)], length, crcs) == n

    write(0, count)
    print("written", flush=True)
    if then == "sleep":
        time.sleep(60)  # killed here: the active segment is never closed
    i = count
    while True:  # killed in the middle of these writes
        write(i, 4)
        i += 4
""")


def run_writer(tmp_path: Path, path: Path, count: int, length: int, then: str, after_s: float = 0.0) -> None:
    """A tier in another process that writes `count` blocks, then sleeps or writes on, SIGKILLed."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    child = subprocess.Popen([sys.executable, str(script), str(path), str(count), str(length), then], cwd=tmp_path,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "written"
        time.sleep(after_s)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_writer_killed_mid_write_keeps_what_it_wrote(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path, length, count = tmp_path / "disk", 100 * KB, 10
    run_writer(tmp_path, path, count, length, "write on", after_s=0.3)
    tier = open_tier(tiers, path, size=4 << 30, segment_bytes=8 * MB)
    keys = keys_of(20000)
    found = tier.leading(SCOPE, keys)
    assert found >= count  # all it reported written, and whatever else was whole
    # (A fast moment writes more in 0.3 s than the test pool holds: the first 900 are read back.)
    got = read_keys(tier, mem, keys[:min(found, 900)], length)
    # Every block read is byte-exact (read_keys checks the CRC); a record whose header made it but whose
    # payload did not would be None (dropped) rather than served.
    assert all(g is None or g == content(k, length) for g, k in zip(got, keys, strict=False))
    assert got[:count] == [content(k, length) for k in keys[:count]]
    assert tier.stats().healthy


def test_killed_writer_then_torn_tail_serves_only_complete_records(tmp_path: Path, mem: Memory,
                                                                  tiers: list[DiskTier]) -> None:
    path, length, count = tmp_path / "disk", 100 * KB, 10
    run_writer(tmp_path, path, count, length, "sleep")
    [seg] = segment_files(path)
    assert not seg.with_suffix(".idx").exists()  # never closed
    record = record_bytes(length)
    os.truncate(seg, (count - 1) * record + ALIGN + 5000)  # the last record torn mid-payload
    keys = keys_of(count)
    tier = open_tier(tiers, path, segment_bytes=8 * MB)
    assert tier.leading(SCOPE, keys) == count - 1
    got = read_keys(tier, mem, keys, length)
    assert got[:-1] == [content(k, length) for k in keys[:-1]] and got[-1] is None
    assert seg.stat().st_size == (count - 1) * record + ALIGN  # cut after the last whole record, then closed
    assert tier.stats().corrupt == 0
    tier.close()
    tier = open_tier(tiers, path, segment_bytes=8 * MB)  # from the checkpoint written when it was closed
    assert tier.leading(SCOPE, keys) == count - 1


def test_torn_header_in_the_active_segment_ends_the_scan(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 50 * KB
    tier = open_tier(tiers, path, segment_bytes=8 * MB)
    keys = keys_of(6)
    write_keys(tier, mem, keys, length)
    # As if the process died now: no close (the tier is dropped unclosed, its lock released).
    for fd in (tier._lock_fd, tier._active_fd, tier._dir_fd):
        os.close(fd)
    tiers.remove(tier)
    [seg] = segment_files(path)
    with open(seg, "r+b") as f:  # record 4's header half-written
        f.seek(4 * record_bytes(length) + 40)
        f.write(bytes(60))
    tier = open_tier(tiers, path, segment_bytes=8 * MB)
    assert tier.leading(SCOPE, keys) == 4
    assert read_keys(tier, mem, keys[:4], length) == [content(k, length) for k in keys[:4]]


# -- corruption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["payload", "header", "payload end"])
def test_corrupt_record_is_detected_at_read_dropped_and_counted(tmp_path: Path, mem: Memory, tiers: list[DiskTier],
                                                               where: str) -> None:
    path, length = tmp_path / "disk", 300_000
    tier = open_tier(tiers, path, segment_bytes=8 * MB)
    keys = keys_of(4)
    write_keys(tier, mem, keys, length)
    [seg] = segment_files(path)
    at = 2 * record_bytes(length) + {
        "payload": ALIGN + 12345, "header": 60, "payload end": ALIGN + length - 1}[where]
    with open(seg, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    got = read_keys(tier, mem, keys, length)
    assert got[2] is None
    assert [got[i] for i in (0, 1, 3)] == [content(keys[i], length) for i in (0, 1, 3)]
    s = tier.stats()
    assert (s.corrupt, s.blocks, s.healthy) == (1, 3, True)
    assert tier.leading(SCOPE, keys) == 2  # dropped from the index
    assert read_keys(tier, mem, keys[2:3], length) == [None]
    assert tier.stats().corrupt == 1


# -- space ------------------------------------------------------------------------------------------


def test_reclaim_drops_the_oldest_segment_when_full(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 200 * KB
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)  # 3 segments of 9 records
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    first, second, rest = keys_of(per_segment, "a"), keys_of(per_segment, "b"), keys_of(2 * per_segment, "c")
    for batch in (first, second, rest):
        assert write_keys(tier, mem, batch, length) == len(batch)
    s = tier.stats()
    assert s.reclaimed_segments == 1 and s.segments == 3 and s.bytes <= s.capacity_bytes
    assert tier.leading(SCOPE, first) == 0 and tier.leading(SCOPE, second) == per_segment
    assert read_keys(tier, mem, first[:1], length) == [None]
    assert not (path / "seg-0000000000000001.kvd").exists() and not (path / "seg-0000000000000001.idx").exists()
    assert read_keys(tier, mem, rest, length) == [content(k, length) for k in rest]


def test_reclaim_skips_a_segment_being_read(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 200 * KB
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    first, second, third = keys_of(per_segment, "a"), keys_of(per_segment, "b"), keys_of(per_segment, "c")
    for batch in (first, second, third):
        write_keys(tier, mem, batch, length)
    tier._segments[1].readers += 1  # a read of the oldest segment in progress
    try:
        assert write_keys(tier, mem, keys_of(1, "d"), length) == 1
    finally:
        tier._segments[1].readers -= 1
    assert tier.leading(SCOPE, first) == per_segment and tier.leading(SCOPE, second) == 0
    assert write_keys(tier, mem, keys_of(per_segment, "e"), length) == per_segment  # now the oldest goes
    assert tier.leading(SCOPE, first) == 0


def test_a_smaller_size_at_reopen_reclaims_the_oldest(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 200 * KB
    tier = open_tier(tiers, path, size=20 * MB, segment_bytes=2 * MB)
    keys = keys_of(40)
    write_keys(tier, mem, keys, length)
    tier.close()
    tier = open_tier(tiers, path, size=4 * MB, segment_bytes=2 * MB)
    assert tier.stats().segments == 1  # room left for one new segment
    assert tier.leading(SCOPE, keys) == 0 and tier.leading(SCOPE, keys[-1:]) == 1


# -- clears -----------------------------------------------------------------------------------------


def crash(tier: DiskTier, tiers: list[DiskTier]) -> None:
    """As if the process died now: nothing closed or flushed, the tier dropped unclosed (its lock released)."""
    for fd in (tier._lock_fd, tier._active_fd, tier._dir_fd):
        if fd >= 0:
            os.close(fd)
    tiers.remove(tier)


@pytest.mark.parametrize("restart", ["close", "crash"])
def test_a_cleared_namespace_stays_cleared_across_restarts(tmp_path: Path, mem: Memory, tiers: list[DiskTier],
                                                           restart: str) -> None:
    path, length = tmp_path / "disk", 64 * KB
    tier = open_tier(tiers, path)
    keys, other = keys_of(12), keys_of(5, "o")
    write_keys(tier, mem, keys, length, name="tenant\x1fns")
    write_keys(tier, mem, other, length, scope=OTHER_SCOPE)
    dropped = tier.clear([SCOPE])
    assert list(dropped) == [SCOPE] and sorted(dropped[SCOPE]) == sorted(keys)
    assert tier.leading(SCOPE, keys[:1]) == 0 and read_keys(tier, mem, keys[:1], length) == [None]
    assert tier.leading(OTHER_SCOPE, other) == 5
    again = keys[:3] + keys_of(4, "new")  # written after the clear (3 of them under cleared keys)
    assert write_keys(tier, mem, again, length) == len(again)
    tier.save_catalog()
    if restart == "close":  # one segment, its checkpoint holding the cleared records too
        tier.close()
    else:  # the segment not closed: scanned
        crash(tier, tiers)
    tier = open_tier(tiers, path)
    assert [tier.leading(SCOPE, [k]) for k in keys[3:]] == [0] * 9
    assert tier.leading(SCOPE, again) == len(again)
    assert read_keys(tier, mem, again, length) == [content(k, length) for k in again]
    assert tier.leading(OTHER_SCOPE, other) == 5 and tier.stats().blocks == len(again) + 5
    assert tier.names() == {SCOPE: "tenant\x1fns"}


def test_a_clear_of_everything_lasts_and_later_writes_stay(tmp_path: Path, mem: Memory,
                                                          tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 200 * KB
    tier = open_tier(tiers, path)
    first, other = keys_of(20), keys_of(3, "o")  # 20 records: over three segments
    write_keys(tier, mem, first, length)
    write_keys(tier, mem, other, length, scope=OTHER_SCOPE)
    assert {scope: len(keys) for scope, keys in tier.clear(None).items()} == {SCOPE: 20, OTHER_SCOPE: 3}
    assert tier.stats().blocks == 0 and tier.leading(SCOPE, first) == 0
    later = keys_of(5, "later")
    assert write_keys(tier, mem, later, length) == 5
    tier.save_catalog()
    crash(tier, tiers)
    tier = open_tier(tiers, path)
    assert tier.stats().blocks == 5 and tier.leading(SCOPE, later) == 5
    assert tier.leading(SCOPE, first[:1]) == 0 and tier.leading(OTHER_SCOPE, other[:1]) == 0


def test_records_a_write_placed_before_a_clear_are_not_kept(tmp_path: Path, mem: Memory, tiers: list[DiskTier],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path, length = tmp_path / "disk", 64 * KB
    tier = open_tier(tiers, path)
    keys = keys_of(6)
    write_keys(tier, mem, keys[:1], length)
    real = native.disk_write

    def clear_meanwhile(*args: object, **kwargs: object) -> bytes:
        tier.clear([SCOPE])  # while the records are written: their places were taken before it
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "disk_write", clear_meanwhile)
    assert write_keys(tier, mem, keys[1:], length) == 5  # written, but not kept
    monkeypatch.undo()
    assert tier.leading(SCOPE, keys[:1]) == 0 and [tier.leading(SCOPE, [k]) for k in keys] == [0] * 6
    assert write_keys(tier, mem, keys[2:4], length) == 2  # after the clear: kept
    tier.save_catalog()
    tier.close()
    tier = open_tier(tiers, path)
    assert [tier.leading(SCOPE, [k]) for k in keys] == [0, 0, 1, 1, 0, 0]


def test_a_damaged_catalog_drops_every_block(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 64 * KB
    tier = open_tier(tiers, path)
    keys = keys_of(5)
    write_keys(tier, mem, keys, length, name="ns")  # (the catalog is written: a name)
    tier.close()
    data = bytearray((path / "catalog").read_bytes())
    data[30] ^= 1
    (path / "catalog").write_bytes(bytes(data))
    tier = open_tier(tiers, path)
    assert tier.stats().blocks == 0 and tier.leading(SCOPE, keys) == 0  # a clear may have been lost: none served
    later = keys_of(2, "later")
    assert write_keys(tier, mem, later, length) == 2
    crash(tier, tiers)
    tier = open_tier(tiers, path)  # the catalog was rewritten at the open, with that clear of everything
    assert tier.leading(SCOPE, keys) == 0 and tier.leading(SCOPE, later) == 2


@pytest.mark.parametrize("restart", ["close", "crash"])
@pytest.mark.parametrize("catalog", ["deleted", "rolled back"])
@pytest.mark.parametrize("active", [True, False], ids=["clear in a written segment", "clear after a restart"])
def test_a_deleted_or_rolled_back_catalog_brings_nothing_cleared_back(
        tmp_path: Path, mem: Memory, tiers: list[DiskTier], restart: str, catalog: str, active: bool) -> None:
    """The catalog is replaced while the daemon is down: deleted, or restored from before the clear (a
    backup, a file system rolled back). The segments still hold the cleared records; none is served. The
    clear's marker in the segments (and, for a missing catalog, the segments alone) give it away: every
    block is dropped, again at each later open with that catalog, while blocks written since are kept."""
    path, length = tmp_path / "disk", 64 * KB
    tier = open_tier(tiers, path)
    keys, other = keys_of(12), keys_of(5, "o")
    write_keys(tier, mem, keys, length, name="tenant\x1fns")
    write_keys(tier, mem, other, length, scope=OTHER_SCOPE)
    before = (path / "catalog").read_bytes()
    if not active:  # the segments closed, no segment open when the clear comes
        tier.close()
        tier = open_tier(tiers, path)
    assert sorted(tier.clear([SCOPE])[SCOPE]) == sorted(keys)
    tier.save_catalog()
    if restart == "close":
        tier.close()
    else:
        crash(tier, tiers)

    for _ in range(2):  # and once more, the catalog rewritten at the first open replaced again
        if catalog == "deleted":
            (path / "catalog").unlink()
        else:
            (path / "catalog").write_bytes(before)
        tier = open_tier(tiers, path)
        assert [tier.leading(SCOPE, [k]) for k in keys] == [0] * 12
        assert read_keys(tier, mem, keys, length) == [None] * 12
        assert tier.stats().blocks == 0  # in doubt, the other namespace's blocks go too
        tier.close()

    tier = open_tier(tiers, path)  # its own catalog: blocks written from now on stay
    later = keys_of(3, "later")
    assert write_keys(tier, mem, later, length) == 3
    tier.close()
    tier = open_tier(tiers, path)
    assert tier.leading(SCOPE, later) == 3 and tier.leading(SCOPE, keys) == 0


def test_an_untouched_catalog_keeps_what_was_not_cleared(tmp_path: Path, mem: Memory,
                                                          tiers: list[DiskTier]) -> None:
    """The checks that catch a catalog replaced do not fire on restarts with the right one: clears (their
    markers in closed, scanned and reclaimed segments) and the blocks they left."""
    path, length = tmp_path / "disk", 200 * KB
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)
    keys, other = keys_of(4), keys_of(3, "o")
    write_keys(tier, mem, keys, length)
    write_keys(tier, mem, other, length, scope=OTHER_SCOPE)
    tier.clear([OTHER_SCOPE])
    tier.save_catalog()
    tier.close()
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)
    assert tier.leading(SCOPE, keys) == 4 and tier.leading(OTHER_SCOPE, other) == 0
    tier.clear([OTHER_SCOPE])  # nothing of it on disk: no clear to record
    write_keys(tier, mem, other, length, scope=OTHER_SCOPE)
    tier.clear([OTHER_SCOPE])
    tier.save_catalog()
    crash(tier, tiers)  # the marker's segment scanned
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)
    assert tier.leading(SCOPE, keys) == 4 and tier.leading(OTHER_SCOPE, other) == 0
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    for batch in range(3):  # every segment with a marker reclaimed
        write_keys(tier, mem, keys_of(per_segment, f"b{batch}-"), length)
    tier.close()
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)
    assert tier.leading(SCOPE, keys_of(per_segment, "b2-")) == per_segment


def test_clears_and_names_go_with_the_segments_they_concern(tmp_path: Path, mem: Memory,
                                                            tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 200 * KB
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)  # 3 segments of 9 records
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    write_keys(tier, mem, keys_of(3, "o"), length, scope=OTHER_SCOPE, name="other")
    tier.clear([OTHER_SCOPE])
    tier.save_catalog()
    all_cleared, clears, names, _ = parse_catalog((path / "catalog").read_bytes()) or ((0, 0), {}, {}, 0)
    assert list(clears) == [OTHER_SCOPE] and names == {OTHER_SCOPE: "other"}
    for batch in range(3):  # the segment of the clear (the first) is reclaimed
        write_keys(tier, mem, keys_of(per_segment, f"b{batch}-"), length)
    assert tier.stats().reclaimed_segments == 1
    tier.close()
    assert parse_catalog((path / "catalog").read_bytes()) == ((0, 0), {}, {OTHER_SCOPE: "other"}, 1)
    tier = open_tier(tiers, path, size=6 * MB, segment_bytes=2 * MB)
    assert tier.names() == {}  # no block of it left
    tier.close()
    assert parse_catalog((path / "catalog").read_bytes()) == ((0, 0), {}, {}, 1)


def test_unwritten_counts_a_dropped_write_unless_on_disk(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, tmp_path / "disk")
    keys = keys_of(2)
    write_keys(tier, mem, keys[:1], 64 * KB)
    tier.unwritten(SCOPE, keys[0])
    assert tier.stats().write_dropped == 0
    tier.unwritten(SCOPE, keys[1])
    assert tier.stats().write_dropped == 1


# -- faults -----------------------------------------------------------------------------------------


def assert_disabled(tier: DiskTier, mem: Memory, keys: list[bytes], length: int, code: str) -> None:
    s = tier.stats()
    assert not s.healthy and code in s.error and "disabled" in s.error and s.errors >= 1
    dropped = s.write_dropped
    assert write_keys(tier, mem, keys_of(2, "after"), length) == 0
    assert tier.stats().write_dropped == dropped + 2
    assert tier.read(SCOPE, keys, mem.pool.base, mem.slots(len(keys), length), length) == [None] * len(keys)
    assert tier.leading(SCOPE, keys) == 0
    assert tier.admit(SCOPE, keys_of(1, "more"), length) == []


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_disables_the_tier(small_tmpfs: Path, mem: Memory, tiers: list[DiskTier],
                                     caplog: pytest.LogCaptureFixture) -> None:
    length = 200 * KB
    tier = open_tier(tiers, small_tmpfs / "disk", size=64 * MB, segment_bytes=2 * MB)
    keys = keys_of(60)
    written = sum(write_keys(tier, mem, keys[i:i + 5], length) for i in range(0, 60, 5))  # no exception
    assert 0 < written < 60
    assert tier.leading(SCOPE, keys) == 0  # disabled: serves nothing
    assert "ENOSPC" in tier.stats().error
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1  # one line
    assert_disabled(tier, mem, keys, length, "ENOSPC")


def test_directory_removed_while_running_disables_the_tier(tmp_path: Path, mem: Memory,
                                                            tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 200 * KB
    tier = open_tier(tiers, path)
    keys = keys_of(5)
    write_keys(tier, mem, keys, length)
    shutil.rmtree(path)
    more = keys_of(30, "m")
    assert write_keys(tier, mem, more, length) < 30  # the next segment cannot be created
    assert_disabled(tier, mem, keys, length, "ENOENT")


def test_read_error_disables_the_tier(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    path, length = tmp_path / "disk", 64 * KB
    tier = open_tier(tiers, path)
    keys = keys_of(3)
    write_keys(tier, mem, keys, length)
    [seg] = segment_files(path)
    seg.unlink()
    assert read_keys(tier, mem, keys, length) == [None, None, None]
    assert_disabled(tier, mem, keys, length, "ENOENT")


def test_write_io_error_disables_the_tier(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    tier = open_tier(tiers, tmp_path / "disk")
    keys = keys_of(3)
    write_keys(tier, mem, keys[:1], 64 * KB)
    readonly = os.open(os.devnull, os.O_RDONLY)
    os.dup2(readonly, tier._active_fd)  # the segment's fd now refuses writes (EBADF)
    os.close(readonly)
    assert write_keys(tier, mem, keys[1:], 64 * KB) == 0
    assert_disabled(tier, mem, keys, 64 * KB, "EBADF")


def test_unwritable_directory_at_open_gives_a_disabled_tier(tmp_path: Path, mem: Memory,
                                                            tiers: list[DiskTier]) -> None:
    (tmp_path / "file").write_text("")
    tier = open_tier(tiers, tmp_path / "file" / "disk")
    assert not tier.stats().healthy and "opening it failed" in tier.stats().error
    assert_disabled(tier, mem, keys_of(1), 4096, "")


# -- the directory --------------------------------------------------------------------------------


def test_directory_is_created_private(tmp_path: Path, tiers: list[DiskTier]) -> None:
    path = tmp_path / "a" / "disk"
    open_tier(tiers, path)
    assert path.is_dir() and path.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("problem", ["symlink", "foreign owner", "group writable", "world writable", "a file"])
def test_unsafe_directory_is_refused(tmp_path: Path, problem: str) -> None:
    path = tmp_path / "disk"
    if problem == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
    elif problem == "a file":
        path.write_text("")
    else:
        path.mkdir(mode=0o700)
        if problem == "foreign owner":
            if os.geteuid() != 0:
                pytest.skip("chown to another uid needs root")
            os.chown(path, 12345, 12345)
        else:
            path.chmod(0o770 if problem == "group writable" else 0o707)
    expected = {"symlink": "symbolic link", "foreign owner": "belongs to uid 12345", "a file": "not a directory",
                "group writable": "written by others", "world writable": "written by others"}[problem]
    with pytest.raises(DiskDirectoryError, match=expected):
        DiskTier.open(str(path), 64 * MB, executor=DISK, segment_bytes=2 * MB)


def test_a_directory_in_use_is_refused(tmp_path: Path, tiers: list[DiskTier]) -> None:
    open_tier(tiers, tmp_path / "disk")
    with pytest.raises(DiskDirectoryError, match="in use"):
        DiskTier.open(str(tmp_path / "disk"), 64 * MB, executor=DISK, segment_bytes=2 * MB)


# -- threads ----------------------------------------------------------------------------------------


def test_concurrent_writes_reads_and_lookups(tmp_path: Path, mem: Memory, tiers: list[DiskTier]) -> None:
    length = 64 * KB
    tier = open_tier(tiers, tmp_path / "disk", size=16 * MB, segment_bytes=1 * MB)  # reclaims as it goes
    batches = [keys_of(8, f"t{t}b{b}-") for t in range(3) for b in range(12)]
    prepared = [(keys, *mem.store(keys, length)) for keys in batches]
    dst = [mem.slots(8, length) for _ in range(3)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(t: int) -> None:
        for keys, offsets, crcs in prepared[t * 12:(t + 1) * 12]:
            tier.write(SCOPE, keys, mem.pool.base, offsets, length, crcs)

    def reader(t: int) -> None:
        try:
            while not stop.is_set():
                keys = prepared[random.randrange(len(prepared))][0]
                got = tier.read(SCOPE, keys, mem.pool.base, dst[t], length)
                for key, crc, off in zip(keys, got, dst[t], strict=True):
                    assert crc is None or mem.get(off, length) == content(key, length)
        except BaseException as e:  # reported below
            errors.append(e)

    readers = [threading.Thread(target=reader, args=(t,)) for t in range(3)]
    writers = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    for th in readers + writers:
        th.start()
    for th in writers:
        th.join()
    for _ in range(100):
        tier.leading(SCOPE, batches[-1])
    stop.set()
    for th in readers:
        th.join()
    assert not errors
    s = tier.stats()
    assert s.healthy and s.corrupt == 0 and s.written + s.write_dropped == 3 * 12 * 8
    assert s.reclaimed_segments > 0 and s.bytes <= s.capacity_bytes


# -- the native records ---------------------------------------------------------------------------------


def test_native_read_reports_short_files_and_foreign_records(tmp_path: Path, mem: Memory) -> None:
    length = 10_000
    offsets, crcs = mem.store(keys_of(2), length)
    fd = os.open(tmp_path / "records", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        at = [0, record_bytes(length)]
        keys = b"".join(keys_of(2))
        assert native.disk_write([fd, fd], at, [7, 7], mem.pool.base, offsets, length, crcs, SCOPE, keys, 32) == [0, 0]
        header = native.disk_parse_header(os.pread(fd, ALIGN, at[1]))
        assert header == (1, 7, at[1], length, crcs[1], SCOPE, keys_of(2)[1])
        dst = mem.slots(2, length)

        def read(segment: int = 7, scope: bytes = SCOPE, key_bytes: bytes = keys, sums: list[int] = crcs) -> list[int]:
            return native.disk_read([fd, fd], at, [segment] * 2, mem.pool.base, dst, length, sums, scope, key_bytes, 32)

        assert read() == [0, 0]
        assert read(segment=8) == [native.DISK_CORRUPT_HEADER] * 2  # another segment's file
        assert read(scope=OTHER_SCOPE) == [native.DISK_CORRUPT_HEADER] * 2
        assert read(key_bytes=keys[32:] + keys[:32]) == [native.DISK_CORRUPT_HEADER] * 2  # records swapped
        os.truncate(tmp_path / "records", at[1] + ALIGN + 100)
        assert read() == [0, native.DISK_SHORT_READ]
        os.pwrite(fd, b"\xff", ALIGN + 5)  # a payload byte of record 0
        assert read()[0] == native.DISK_CORRUPT_PAYLOAD
        assert native.disk_parse_header(bytes(ALIGN)) is None
    finally:
        os.close(fd)


def test_native_raw_io_round_trip(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "raw", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        native.disk_raw_io(fd, 0, 5, 2 * ALIGN, True, threads=2)
        assert os.fstat(fd).st_size == 10 * ALIGN
        native.disk_raw_io(fd, 0, 5, 2 * ALIGN, False, threads=2)
        with pytest.raises(OSError):
            native.disk_raw_io(-1, 0, 1, ALIGN, False)
        with pytest.raises(ValueError):
            native.disk_raw_io(fd, 1, 1, ALIGN, False)
    finally:
        os.close(fd)
