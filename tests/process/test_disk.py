"""The disk tier (kvstore_service/tiers/disk/): real segment files in temp dirs, a real pool as the memory
blocks are written from and fetched into. Driven through the tiers' contract (tiers/base.py), as `Tiers`
drives it (support.tier_contract), each call run on the test's event loop until done: blocks written
behind and waited for until the tier released every one, fetched into fresh pool slots."""

from __future__ import annotations

import asyncio
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
from collections.abc import Awaitable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import takewhile
from pathlib import Path
from typing import TypeVar

import pytest
from support.tier_contract import Slots, fetch, write, write_behind

from kvstore_service import native, native_disk
from kvstore_service.pool import Pool
from kvstore_service.stats import DiskStats
from kvstore_service.threads import Threads
from kvstore_service.tiers.base import Scope
from kvstore_service.tiers.disk import ALIGN, DiskDirectoryError, DiskTier
from kvstore_service.tiers.disk.format import parse_catalog

KB, MB = 1 << 10, 1 << 20
SCOPE = bytes(range(16))
OTHER_SCOPE = bytes(16)
DISK = Threads(copy_threads=1).disk  # the daemon's disk threads: the tiers' I/O runs there
T = TypeVar("T")


def keys_of(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:06d}".encode().ljust(32, b".") for i in range(n)]


def content(key: bytes, length: int) -> bytes:
    return random.Random(key).randbytes(length)


def record_bytes(length: int) -> int:
    return ALIGN + (length + ALIGN - 1) // ALIGN * ALIGN


class Memory:
    """Blocks in a real pool: the source of writes and the destination of fetches."""

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


class Disk:
    """A DiskTier driven through the tiers' contract, each call run on the test's loop until done."""

    def __init__(self, tier: DiskTier, mem: Memory, loop: asyncio.AbstractEventLoop) -> None:
        self.tier, self.mem, self.loop = tier, mem, loop
        self.taken = 0  # how many blocks the last `write` had taken

    def run(self, work: Awaitable[T]) -> T:
        return self.loop.run_until_complete(work)

    def write(self, keys: list[bytes], length: int, scope: bytes = SCOPE, name: str = "") -> int:
        """Write each key's content behind from pool slots, waited for until every block was released. Returns
        how many were written (the stats' count; `taken`: how many the tier took): the others were on disk
        or queued already, or dropped (counted)."""
        offsets, crcs = self.mem.store(keys, length)
        before = self.tier.stats().written
        self.taken = self.run(write(self.tier, self.mem.pool, Scope(scope, name, length), keys, offsets, crcs))
        written = self.tier.stats().written - before
        assert written <= self.taken
        return written

    def fetch(self, keys: list[bytes], length: int, scope: bytes = SCOPE, into: list[int] | None = None) -> list[bytes]:
        """The leading run of `keys` on disk: each block's bytes as fetched into fresh pool slots (`into`:
        these), checked against the CRC32C the tier verified."""
        offsets = self.mem.slots(len(keys), length) if into is None else into
        crcs = self.run(fetch(self.tier, self.mem.pool, Scope(scope, "", length), keys, offsets))
        return [self.mem.get(offset, length) for offset in offsets[:len(crcs)]]

    def read_each(self, keys: list[bytes], length: int, scope: bytes = SCOPE) -> list[bytes | None]:
        """Each key's bytes, or None where the disk has none (absent, of another length, corrupt): fetches of
        the leading run, each from the key after the one where the last one ended."""
        slots = self.mem.slots(len(keys), length)
        out: list[bytes | None] = []
        while len(out) < len(keys):
            out += self.fetch(keys[len(out):], length, scope, slots[len(out):])
            if len(out) < len(keys):
                out.append(None)
        return out

    def holds(self, keys: list[bytes], scope: bytes = SCOPE) -> Collection[bytes]:
        return self.tier.holds(Scope(scope, "", 0), keys)

    def leading(self, keys: list[bytes], scope: bytes = SCOPE) -> int:
        """How many of the leading keys are on disk, by `holds` (not counted as hits or misses)."""
        held = self.holds(keys, scope)
        return sum(1 for _ in takewhile(held.__contains__, keys))

    def forget(self, scopes: list[bytes] | None) -> dict[bytes, Collection[bytes]]:
        """`forget`, and its catalog save awaited (as the daemon answers a Clear): the keys dropped, by scope."""
        async def clear() -> dict[bytes, Collection[bytes]]:
            forgotten = self.tier.forget(scopes)
            assert (forgotten.saved is None) == (not forgotten.keys)  # saved when something was dropped
            if forgotten.saved is not None:
                await forgotten.saved
            return dict(forgotten.keys)
        return self.run(clear())

    def stats(self) -> DiskStats:
        return self.tier.stats()

    def close(self) -> None:
        self.run(self.tier.aclose(0))


class Disks:
    """The tiers a test opens over its pool, on its loop; those left open are closed at its end."""

    def __init__(self, mem: Memory, loop: asyncio.AbstractEventLoop) -> None:
        self.mem, self.loop = mem, loop
        self.opened: list[Disk] = []

    def open(self, path: Path, size: int = 64 * MB, **kwargs: object) -> Disk:
        kwargs.setdefault("segment_bytes", 2 * MB)
        kwargs.setdefault("executor", DISK)
        disk = Disk(DiskTier.open(str(path), size, **kwargs), self.mem, self.loop)  # type: ignore[arg-type]
        self.opened.append(disk)
        return disk

    def crash(self, disk: Disk) -> None:
        """As if the process died now: nothing closed or flushed, the tier dropped unclosed (its lock released)."""
        for fd in (disk.tier._lock_fd, disk.tier._active_fd, disk.tier._dir_fd):
            if fd >= 0:
                os.close(fd)
        self.opened.remove(disk)


@pytest.fixture
def mem() -> Iterator[Memory]:
    path = f"/dev/shm/kvstore-test-disk-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = Pool(path, 96 * MB, 8 * MB, fresh=True)
    yield Memory(pool)
    pool.close()
    os.unlink(path)


@pytest.fixture
def disks(mem: Memory) -> Iterator[Disks]:
    loop = asyncio.new_event_loop()
    opened = Disks(mem, loop)
    yield opened
    for disk in opened.opened:
        disk.close()
    loop.close()


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.kvd"))


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("io_mode", ["staged", "direct"])
@pytest.mark.parametrize("length", [256 * KB, 300_000, 5000, 2 * MB])
def test_write_fetch_round_trip_is_byte_exact(tmp_path: Path, disks: Disks, io_mode: str, length: int) -> None:
    disk = disks.open(tmp_path / "disk", segment_bytes=8 * MB, io_mode=io_mode)
    keys = keys_of(6)
    assert disk.write(keys, length) == 6 and disk.taken == 6
    assert disk.holds(keys) == set(keys)
    assert disk.fetch(keys, length) == [content(k, length) for k in keys]
    s = disk.stats()
    assert (s.blocks, s.written, s.write_bytes, s.read_blocks, s.read_bytes) == (6, 6, 6 * length, 6, 6 * length)
    assert (s.hits, s.misses, s.queued_bytes) == (6, 0, 0)
    assert s.healthy and s.error == "" and s.corrupt == 0 and s.errors == 0
    assert s.direct_io  # ext4 and tmpfs both take O_DIRECT here


def test_blocks_at_misaligned_and_aligned_pool_addresses(tmp_path: Path, disks: Disks) -> None:
    """Pool payloads are 256-byte aligned only: every alignment class round-trips in both modes."""
    memory = Slots(1, 16 * MB)  # one buffer, the blocks placed in it by hand
    length = 64 * KB + 100
    for io_mode in ("staged", "direct"):
        disk = disks.open(tmp_path / io_mode, io_mode=io_mode)
        keys = keys_of(8, io_mode)
        src = [i * 256 * KB + 256 * i for i in range(8)]  # 0, 256, 512, ... past a page
        for key, off in zip(keys, src, strict=True):
            memory.buf[off:off + length] = content(key, length)
        crcs = native.checksum_blocks(memory.base, src, length)
        scope = Scope(SCOPE, "", length)
        assert disk.run(write(disk.tier, memory, scope, keys, src, crcs)) == 8 and disk.stats().written == 8
        dst = [8 * MB + i * 256 * KB + 256 * (7 - i) for i in range(8)]
        assert disk.run(fetch(disk.tier, memory, scope, keys, dst)) == crcs
        assert all(memory.buf[d:d + length] == content(k, length) for k, d in zip(keys, dst, strict=True))


def test_write_skips_keys_on_disk_and_duplicates(tmp_path: Path, disks: Disks) -> None:
    disk = disks.open(tmp_path / "disk")
    keys = keys_of(4)
    assert disk.write(keys[:2], 64 * KB) == 2
    assert disk.write(keys + keys[2:3], 64 * KB) == 2 and disk.taken == 2  # 2 on disk, keys[2] twice
    assert disk.stats().written == 4 and disk.stats().write_dropped == 0
    assert disk.leading(keys) == 4


def test_a_fetch_brings_the_leading_run_per_scope_counted(tmp_path: Path, disks: Disks) -> None:
    disk = disks.open(tmp_path / "disk")
    keys = keys_of(5)
    disk.write([keys[0], keys[1], keys[3]], 16 * KB)
    assert disk.fetch(keys, 16 * KB) == [content(k, 16 * KB) for k in keys[:2]]
    assert disk.fetch(keys, 16 * KB, scope=OTHER_SCOPE) == []
    assert disk.fetch(keys[3:], 16 * KB) == [content(keys[3], 16 * KB)]
    s = disk.stats()
    assert (s.hits, s.misses) == (3, 3 + 5 + 1)
    assert disk.holds(keys) == {keys[0], keys[1], keys[3]} and disk.holds(keys, OTHER_SCOPE) == set()
    assert (disk.stats().hits, disk.stats().misses) == (3, 9)  # (`holds` is not counted)


def test_a_fetch_misses_absent_keys_another_length_and_another_scope(tmp_path: Path, disks: Disks) -> None:
    disk = disks.open(tmp_path / "disk")
    keys = keys_of(3)
    disk.write(keys[:2], 16 * KB)
    assert disk.read_each(keys, 16 * KB) == [content(k, 16 * KB) for k in keys[:2]] + [None]
    assert disk.fetch(keys[:1], 32 * KB) == []
    assert disk.fetch(keys[:1], 16 * KB, scope=OTHER_SCOPE) == []
    assert disk.stats().corrupt == 0


def test_malformed_arguments_are_value_errors(tmp_path: Path, mem: Memory, disks: Disks) -> None:
    """A caller's bug, raised before anything is taken or asked."""
    disk = disks.open(tmp_path / "disk")

    def release(i: int) -> None:
        raise AssertionError("nothing is taken")

    tier, pool, scope = disk.tier, mem.pool, Scope(SCOPE, "", 4096)
    with pytest.raises(ValueError, match="scope"):
        tier.write_behind(pool, Scope(b"short", "", 4096), [b"k"], [0], [0], release)
    with pytest.raises(ValueError, match="one length"):
        tier.write_behind(pool, scope, [b"k", b"kk"], [0, 4096], [0, 0], release)
    with pytest.raises(ValueError, match="offsets"):
        tier.write_behind(pool, scope, [b"k"], [], [], release)
    with pytest.raises(ValueError, match="checksums"):
        tier.write_behind(pool, scope, [b"k"], [0], [], release)
    with pytest.raises(ValueError, match="block length"):
        tier.write_behind(pool, Scope(SCOPE, "", 0), [b"k"], [0], [0], release)
    with pytest.raises(ValueError, match="scope"):
        disk.run(fetch(tier, pool, Scope(b"short", "", 4096), [b"k"], [0]))
    with pytest.raises(ValueError, match="one length"):
        disk.run(fetch(tier, pool, scope, [b"k", b"kk"], [0, 4096]))
    s = disk.stats()
    assert (s.queued_bytes, s.write_dropped, s.hits, s.misses) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="segment size"):
        DiskTier.open(str(tmp_path / "x"), 64 * MB, executor=DISK, segment_bytes=1000)
    with pytest.raises(ValueError, match="two"):
        DiskTier.open(str(tmp_path / "x"), 3 * MB, executor=DISK, segment_bytes=2 * MB)


# -- write-behind queue ------------------------------------------------------------------------------


def test_write_behind_bounds_the_queue_and_releases_each_block_once(tmp_path: Path, mem: Memory,
                                                                    disks: Disks) -> None:
    disk = disks.open(tmp_path / "disk", queue_bytes=3 * 64 * KB)
    keys = keys_of(5)
    offsets, crcs = mem.store(keys, 64 * KB)
    scope = Scope(SCOPE, "", 64 * KB)

    async def main() -> None:
        taken, released = write_behind(disk.tier, mem.pool, scope, keys, offsets, crcs)
        assert taken == 3 and released.order == [3, 4]  # no room for 3 and 4: dropped, released at once
        again, twice = write_behind(disk.tier, mem.pool, scope, keys[:3], offsets[:3], crcs[:3])
        assert again == 0 and twice.order == [0, 1, 2]  # queued already: neither taken nor dropped
        s = disk.stats()
        assert (s.queued_bytes, s.write_dropped, s.written) == (3 * 64 * KB, 2, 0)  # (nothing written yet)
        await released.wait()
        assert released.order == [3, 4, 0, 1, 2]  # each once, those taken when written
        s = disk.stats()
        assert (s.queued_bytes, s.write_dropped, s.written) == (0, 2, 3)
        taken, released = write_behind(disk.tier, mem.pool, scope, keys, offsets, crcs)
        assert taken == 2 and released.order == [0, 1, 2]  # keys 0..2 are on disk now
        await released.wait()
        assert disk.stats().written == 5

    disk.run(main())


# -- restart ------------------------------------------------------------------------------------------


def test_reopen_loads_checkpoints_and_finds_everything(tmp_path: Path, disks: Disks) -> None:
    path = tmp_path / "disk"
    disk = disks.open(path)
    keys, other = keys_of(20), keys_of(3, "o")
    disk.write(keys, 200 * KB)
    disk.write(other, 200 * KB, scope=OTHER_SCOPE)
    disk.close()
    segs = segment_files(path)
    assert len(segs) >= 3 and all(p.with_suffix(".idx").exists() for p in segs)
    disk = disks.open(path)
    assert disk.leading(keys) == 20 and disk.leading(other, OTHER_SCOPE) == 3
    assert disk.fetch(keys, 200 * KB) == [content(k, 200 * KB) for k in keys]
    assert disk.fetch(other, 200 * KB, scope=OTHER_SCOPE) == [content(k, 200 * KB) for k in other]
    assert disk.write(keys_of(2, "new"), 200 * KB) == 2  # new writes go to a new segment
    assert len(segment_files(path)) == len(segs) + 1


def test_reopen_without_checkpoints_scans_the_segments(tmp_path: Path, disks: Disks) -> None:
    path = tmp_path / "disk"
    disk = disks.open(path)
    keys = keys_of(15)
    disk.write(keys, 200 * KB)
    disk.close()
    for idx in path.glob("*.idx"):
        idx.unlink()
    (path / segment_files(path)[0].with_suffix(".idx").name).write_bytes(b"garbage")  # an invalid one
    disk = disks.open(path)
    assert disk.leading(keys) == 15
    assert disk.fetch(keys, 200 * KB) == [content(k, 200 * KB) for k in keys]
    assert all(p.with_suffix(".idx").stat().st_size > 100 for p in segment_files(path))  # rewritten


WRITER = textwrap.dedent("""
    import asyncio, ctypes, mmap, random, sys
    from kvstore_service import native
    from kvstore_service.threads import Threads
    from kvstore_service.tiers.base import Scope
    from kvstore_service.tiers.disk import DiskTier

    path, count, length, then = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tier = DiskTier.open(path, 4 << 30, executor=Threads(1).disk,
                         segment_bytes=8 << 20)  # nothing reclaimed in the test's time
    buf = mmap.mmap(-1, max(count, 4) * length)


    class Memory:  # (the tiers' view of the pool)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))

        def view(self, offset, size):
            return memoryview(buf)[offset:offset + size]


    async def write(first, n):
        keys = [f"k{i:06d}".encode().ljust(32, b".") for i in range(first, first + n)]
        for k, key in enumerate(keys):
            buf[k * length:(k + 1) * length] = random.Random(key).randbytes(length)
        offsets = [k * length for k in range(n)]
        crcs = native.checksum_blocks(Memory.base, offsets, length)
        released = []
        done = asyncio.Event()

        def release(i):
            released.append(i)
            if len(released) == n:
                done.set()

        assert tier.write_behind(Memory(), Scope(bytes(range(16)), "", length), keys, offsets, crcs, release) == n
        await done.wait()
        assert tier.stats().written == first + n


    async def main():
        await write(0, count)
        print("written", flush=True)
        if then == "sleep":
            await asyncio.sleep(60)  # killed here: the active segment is never closed
        i = count
        while True:  # killed in the middle of these writes
            await write(i, 4)
            i += 4


    asyncio.run(main())
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


def test_writer_killed_mid_write_keeps_what_it_wrote(tmp_path: Path, disks: Disks) -> None:
    path, length, count = tmp_path / "disk", 100 * KB, 10
    run_writer(tmp_path, path, count, length, "write on", after_s=0.3)
    disk = disks.open(path, size=4 << 30, segment_bytes=8 * MB)
    keys = keys_of(20000)
    found = disk.leading(keys)
    assert found >= count  # all it reported written, and whatever else was whole
    # (A fast moment writes more in 0.3 s than the test pool holds: the first 900 are read back.)
    got = disk.read_each(keys[:min(found, 900)], length)
    # Every block fetched is byte-exact (its CRC32C checked); a record whose header made it but whose
    # payload did not would be None (dropped) rather than served.
    assert all(g is None or g == content(k, length) for g, k in zip(got, keys, strict=False))
    assert got[:count] == [content(k, length) for k in keys[:count]]
    assert disk.stats().healthy


def test_killed_writer_then_torn_tail_serves_only_complete_records(tmp_path: Path, disks: Disks) -> None:
    path, length, count = tmp_path / "disk", 100 * KB, 10
    run_writer(tmp_path, path, count, length, "sleep")
    [seg] = segment_files(path)
    assert not seg.with_suffix(".idx").exists()  # never closed
    record = record_bytes(length)
    os.truncate(seg, (count - 1) * record + ALIGN + 5000)  # the last record torn mid-payload
    keys = keys_of(count)
    disk = disks.open(path, segment_bytes=8 * MB)
    assert disk.leading(keys) == count - 1 and disk.holds(keys) == set(keys[:-1])
    got = disk.read_each(keys, length)
    assert got[:-1] == [content(k, length) for k in keys[:-1]] and got[-1] is None
    assert seg.stat().st_size == (count - 1) * record + ALIGN  # cut after the last whole record, then closed
    assert disk.stats().corrupt == 0
    disk.close()
    disk = disks.open(path, segment_bytes=8 * MB)  # from the checkpoint written when it was closed
    assert disk.leading(keys) == count - 1


def test_torn_header_in_the_active_segment_ends_the_scan(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 50 * KB
    disk = disks.open(path, segment_bytes=8 * MB)
    keys = keys_of(6)
    disk.write(keys, length)
    disks.crash(disk)  # as if the process died now
    [seg] = segment_files(path)
    with open(seg, "r+b") as f:  # record 4's header half-written
        f.seek(4 * record_bytes(length) + 40)
        f.write(bytes(60))
    disk = disks.open(path, segment_bytes=8 * MB)
    assert disk.leading(keys) == 4
    assert disk.fetch(keys, length) == [content(k, length) for k in keys[:4]]


# -- corruption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["payload", "header", "payload end"])
def test_corrupt_record_is_detected_at_a_fetch_dropped_and_counted(tmp_path: Path, disks: Disks, where: str) -> None:
    path, length = tmp_path / "disk", 300_000
    disk = disks.open(path, segment_bytes=8 * MB)
    keys = keys_of(4)
    disk.write(keys, length)
    [seg] = segment_files(path)
    at = 2 * record_bytes(length) + {
        "payload": ALIGN + 12345, "header": 60, "payload end": ALIGN + length - 1}[where]
    with open(seg, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    assert disk.fetch(keys, length) == [content(k, length) for k in keys[:2]]  # it ends at the corrupt one
    got = disk.read_each(keys, length)
    assert got[2] is None
    assert [got[i] for i in (0, 1, 3)] == [content(keys[i], length) for i in (0, 1, 3)]
    s = disk.stats()
    assert (s.corrupt, s.blocks, s.healthy) == (1, 3, True)
    assert disk.leading(keys) == 2 and disk.holds(keys) == {keys[0], keys[1], keys[3]}  # dropped from the index
    assert disk.fetch(keys[2:3], length) == []
    assert disk.stats().corrupt == 1


# -- space ------------------------------------------------------------------------------------------


def test_reclaim_drops_the_oldest_segment_when_full(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 200 * KB
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)  # 3 segments of 9 records
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    first, second, rest = keys_of(per_segment, "a"), keys_of(per_segment, "b"), keys_of(2 * per_segment, "c")
    for batch in (first, second, rest):
        assert disk.write(batch, length) == len(batch)
    s = disk.stats()
    assert s.reclaimed_segments == 1 and s.segments == 3 and s.bytes <= s.capacity_bytes
    assert disk.leading(first) == 0 and disk.leading(second) == per_segment
    assert disk.fetch(first[:1], length) == []
    assert not (path / "seg-0000000000000001.kvd").exists() and not (path / "seg-0000000000000001.idx").exists()
    assert disk.fetch(rest, length) == [content(k, length) for k in rest]


def test_reclaim_skips_a_segment_being_read(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 200 * KB
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    first, second, third = keys_of(per_segment, "a"), keys_of(per_segment, "b"), keys_of(per_segment, "c")
    for batch in (first, second, third):
        disk.write(batch, length)
    disk.tier._segments[1].readers += 1  # a fetch's read of the oldest segment in progress
    try:
        assert disk.write(keys_of(1, "d"), length) == 1
    finally:
        disk.tier._segments[1].readers -= 1
    assert disk.leading(first) == per_segment and disk.leading(second) == 0
    assert disk.write(keys_of(per_segment, "e"), length) == per_segment  # now the oldest goes
    assert disk.leading(first) == 0


def test_a_smaller_size_at_reopen_reclaims_the_oldest(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 200 * KB
    disk = disks.open(path, size=20 * MB, segment_bytes=2 * MB)
    keys = keys_of(40)
    disk.write(keys, length)
    disk.close()
    disk = disks.open(path, size=4 * MB, segment_bytes=2 * MB)
    assert disk.stats().segments == 1  # room left for one new segment
    assert disk.leading(keys) == 0 and disk.leading(keys[-1:]) == 1


# -- clears -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("restart", ["close", "crash"])
def test_a_cleared_namespace_stays_cleared_across_restarts(tmp_path: Path, disks: Disks, restart: str) -> None:
    path, length = tmp_path / "disk", 64 * KB
    disk = disks.open(path)
    keys, other = keys_of(12), keys_of(5, "o")
    disk.write(keys, length, name="tenant\x1fns")
    disk.write(other, length, scope=OTHER_SCOPE)
    dropped = disk.forget([SCOPE])
    assert list(dropped) == [SCOPE] and sorted(dropped[SCOPE]) == sorted(keys)
    assert disk.leading(keys[:1]) == 0 and disk.fetch(keys[:1], length) == []
    assert disk.leading(other, OTHER_SCOPE) == 5
    again = keys[:3] + keys_of(4, "new")  # written after the clear (3 of them under cleared keys)
    assert disk.write(again, length) == len(again)
    if restart == "close":  # one segment, its checkpoint holding the cleared records too
        disk.close()
    else:  # the segment not closed: scanned
        disks.crash(disk)
    disk = disks.open(path)
    assert disk.holds(keys[3:]) == set()
    assert disk.leading(again) == len(again)
    assert disk.fetch(again, length) == [content(k, length) for k in again]
    assert disk.leading(other, OTHER_SCOPE) == 5 and disk.stats().blocks == len(again) + 5
    assert disk.tier.names() == {SCOPE: "tenant\x1fns"}


def test_a_clear_of_everything_lasts_and_later_writes_stay(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 200 * KB
    disk = disks.open(path)
    first, other = keys_of(20), keys_of(3, "o")  # 20 records: over three segments
    disk.write(first, length)
    disk.write(other, length, scope=OTHER_SCOPE)
    assert {scope: len(keys) for scope, keys in disk.forget(None).items()} == {SCOPE: 20, OTHER_SCOPE: 3}
    assert disk.stats().blocks == 0 and disk.leading(first) == 0
    later = keys_of(5, "later")
    assert disk.write(later, length) == 5
    disks.crash(disk)
    disk = disks.open(path)
    assert disk.stats().blocks == 5 and disk.leading(later) == 5
    assert disk.leading(first[:1]) == 0 and disk.leading(other[:1], OTHER_SCOPE) == 0


def test_records_a_write_placed_before_a_clear_are_not_kept(tmp_path: Path, disks: Disks,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path, length = tmp_path / "disk", 64 * KB
    disk = disks.open(path)
    keys = keys_of(6)
    disk.write(keys[:1], length)
    real = native_disk.disk_write
    forgotten = []

    def clear_meanwhile(*args: object, **kwargs: object) -> bytes:
        """While the records are written (their places were taken before it), a Clear on the loop."""
        if not forgotten:
            done = threading.Event()

            def clear() -> None:
                forgotten.append(disk.tier.forget([SCOPE]))
                done.set()

            disk.loop.call_soon_threadsafe(clear)
            assert done.wait(10)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native_disk, "disk_write", clear_meanwhile)
    assert disk.write(keys[1:], length) == 5  # written, but not kept
    monkeypatch.undo()
    [clear] = forgotten
    assert list(clear.keys) == [SCOPE] and clear.saved is not None
    disk.run(clear.saved)
    assert disk.holds(keys) == set() and disk.fetch(keys, length) == []
    assert disk.write(keys[2:4], length) == 2  # after the clear: kept
    disk.close()
    disk = disks.open(path)
    assert disk.holds(keys) == {keys[2], keys[3]}


def test_a_damaged_catalog_drops_every_block(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 64 * KB
    disk = disks.open(path)
    keys = keys_of(5)
    disk.write(keys, length, name="ns")  # (the catalog is written: a name)
    disk.close()
    data = bytearray((path / "catalog").read_bytes())
    data[30] ^= 1
    (path / "catalog").write_bytes(bytes(data))
    disk = disks.open(path)
    assert disk.stats().blocks == 0 and disk.leading(keys) == 0  # a clear may have been lost: none served
    later = keys_of(2, "later")
    assert disk.write(later, length) == 2
    disks.crash(disk)
    disk = disks.open(path)  # the catalog was rewritten at the open, with that clear of everything
    assert disk.leading(keys) == 0 and disk.leading(later) == 2


@pytest.mark.parametrize("restart", ["close", "crash"])
@pytest.mark.parametrize("catalog", ["deleted", "rolled back"])
@pytest.mark.parametrize("active", [True, False], ids=["clear in a written segment", "clear after a restart"])
def test_a_deleted_or_rolled_back_catalog_brings_nothing_cleared_back(
        tmp_path: Path, disks: Disks, restart: str, catalog: str, active: bool) -> None:
    """The catalog is replaced while the daemon is down: deleted, or restored from before the clear (a
    backup, a file system rolled back). The segments still hold the cleared records; none is served. The
    clear's marker in the segments (and, for a missing catalog, the segments alone) give it away: every
    block is dropped, again at each later open with that catalog, while blocks written since are kept."""
    path, length = tmp_path / "disk", 64 * KB
    disk = disks.open(path)
    keys, other = keys_of(12), keys_of(5, "o")
    disk.write(keys, length, name="tenant\x1fns")
    disk.write(other, length, scope=OTHER_SCOPE)
    before = (path / "catalog").read_bytes()
    if not active:  # the segments closed, no segment open when the clear comes
        disk.close()
        disk = disks.open(path)
    assert sorted(disk.forget([SCOPE])[SCOPE]) == sorted(keys)
    if restart == "close":
        disk.close()
    else:
        disks.crash(disk)

    for _ in range(2):  # and once more, the catalog rewritten at the first open replaced again
        if catalog == "deleted":
            (path / "catalog").unlink()
        else:
            (path / "catalog").write_bytes(before)
        disk = disks.open(path)
        assert disk.holds(keys) == set()
        assert disk.read_each(keys, length) == [None] * 12
        assert disk.stats().blocks == 0  # in doubt, the other namespace's blocks go too
        disk.close()

    disk = disks.open(path)  # its own catalog: blocks written from now on stay
    later = keys_of(3, "later")
    assert disk.write(later, length) == 3
    disk.close()
    disk = disks.open(path)
    assert disk.leading(later) == 3 and disk.leading(keys) == 0


def test_an_untouched_catalog_keeps_what_was_not_cleared(tmp_path: Path, disks: Disks) -> None:
    """The checks that catch a catalog replaced do not fire on restarts with the right one: clears (their
    markers in closed, scanned and reclaimed segments) and the blocks they left."""
    path, length = tmp_path / "disk", 200 * KB
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)
    keys, other = keys_of(4), keys_of(3, "o")
    disk.write(keys, length)
    disk.write(other, length, scope=OTHER_SCOPE)
    disk.forget([OTHER_SCOPE])
    disk.close()
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)
    assert disk.leading(keys) == 4 and disk.leading(other, OTHER_SCOPE) == 0
    assert disk.forget([OTHER_SCOPE]) == {}  # nothing of it on disk: no clear to record
    disk.write(other, length, scope=OTHER_SCOPE)
    disk.forget([OTHER_SCOPE])
    disks.crash(disk)  # the marker's segment scanned
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)
    assert disk.leading(keys) == 4 and disk.leading(other, OTHER_SCOPE) == 0
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    for batch in range(3):  # every segment with a marker reclaimed
        disk.write(keys_of(per_segment, f"b{batch}-"), length)
    disk.close()
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)
    assert disk.leading(keys_of(per_segment, "b2-")) == per_segment


def test_clears_and_names_go_with_the_segments_they_concern(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 200 * KB
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)  # 3 segments of 9 records
    per_segment = (2 * MB - ALIGN) // record_bytes(length)
    disk.write(keys_of(3, "o"), length, scope=OTHER_SCOPE, name="other")
    assert disk.tier.names() == {OTHER_SCOPE: "other"}
    disk.forget([OTHER_SCOPE])
    all_cleared, clears, names, _ = parse_catalog((path / "catalog").read_bytes()) or ((0, 0), {}, {}, 0)
    assert list(clears) == [OTHER_SCOPE] and names == {OTHER_SCOPE: "other"}
    for batch in range(3):  # the segment of the clear (the first) is reclaimed
        disk.write(keys_of(per_segment, f"b{batch}-"), length)
    assert disk.stats().reclaimed_segments == 1
    disk.close()
    assert parse_catalog((path / "catalog").read_bytes()) == ((0, 0), {}, {OTHER_SCOPE: "other"}, 1)
    disk = disks.open(path, size=6 * MB, segment_bytes=2 * MB)
    assert disk.tier.names() == {}  # no block of it left
    disk.close()
    assert parse_catalog((path / "catalog").read_bytes()) == ((0, 0), {}, {}, 1)


def test_unwritten_counts_a_dropped_write_unless_on_disk(tmp_path: Path, disks: Disks) -> None:
    disk = disks.open(tmp_path / "disk")
    keys, scope = keys_of(2), Scope(SCOPE, "", 64 * KB)
    disk.write(keys[:1], 64 * KB)
    disk.tier.unwritten(scope, keys[:1])
    assert disk.stats().write_dropped == 0
    disk.tier.unwritten(scope, keys)
    assert disk.stats().write_dropped == 1


# -- faults -----------------------------------------------------------------------------------------


def assert_disabled(disk: Disk, keys: list[bytes], length: int, code: str) -> None:
    s = disk.stats()
    assert not s.healthy and code in s.error and "disabled" in s.error and s.errors >= 1
    dropped = s.write_dropped
    assert disk.write(keys_of(2, "after"), length) == 0 and disk.taken == 0
    assert disk.stats().write_dropped == dropped + 2
    assert disk.read_each(keys, length) == [None] * len(keys)
    assert disk.holds(keys) == set()


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


def test_disk_full_disables_the_tier(small_tmpfs: Path, disks: Disks, caplog: pytest.LogCaptureFixture) -> None:
    length = 200 * KB
    disk = disks.open(small_tmpfs / "disk", size=64 * MB, segment_bytes=2 * MB)
    keys = keys_of(60)
    written = sum(disk.write(keys[i:i + 5], length) for i in range(0, 60, 5))  # no exception
    assert 0 < written < 60
    assert disk.holds(keys) == set() and disk.fetch(keys, length) == []  # disabled: serves nothing
    assert "ENOSPC" in disk.stats().error
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1  # one line
    assert_disabled(disk, keys, length, "ENOSPC")


def test_directory_removed_while_running_disables_the_tier(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 200 * KB
    disk = disks.open(path)
    keys = keys_of(5)
    disk.write(keys, length)
    shutil.rmtree(path)
    more = keys_of(30, "m")
    assert disk.write(more, length) < 30  # the next segment cannot be created
    assert_disabled(disk, keys, length, "ENOENT")


def test_read_error_disables_the_tier(tmp_path: Path, disks: Disks) -> None:
    path, length = tmp_path / "disk", 64 * KB
    disk = disks.open(path)
    keys = keys_of(3)
    disk.write(keys, length)
    [seg] = segment_files(path)
    seg.unlink()
    assert disk.fetch(keys, length) == []
    assert_disabled(disk, keys, length, "ENOENT")


def test_write_io_error_disables_the_tier(tmp_path: Path, disks: Disks) -> None:
    disk = disks.open(tmp_path / "disk")
    keys = keys_of(3)
    disk.write(keys[:1], 64 * KB)
    readonly = os.open(os.devnull, os.O_RDONLY)
    os.dup2(readonly, disk.tier._active_fd)  # the segment's fd now refuses writes (EBADF)
    os.close(readonly)
    assert disk.write(keys[1:], 64 * KB) == 0
    assert_disabled(disk, keys, 64 * KB, "EBADF")


def test_unwritable_directory_at_open_gives_a_disabled_tier(tmp_path: Path, disks: Disks) -> None:
    (tmp_path / "file").write_text("")
    disk = disks.open(tmp_path / "file" / "disk")
    assert not disk.stats().healthy and "opening it failed" in disk.stats().error
    assert_disabled(disk, keys_of(1), 4096, "")


# -- the directory --------------------------------------------------------------------------------


def test_directory_is_created_private(tmp_path: Path, disks: Disks) -> None:
    path = tmp_path / "a" / "disk"
    disks.open(path)
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


def test_a_directory_in_use_is_refused(tmp_path: Path, disks: Disks) -> None:
    disks.open(tmp_path / "disk")
    with pytest.raises(DiskDirectoryError, match="in use"):
        DiskTier.open(str(tmp_path / "disk"), 64 * MB, executor=DISK, segment_bytes=2 * MB)


# -- threads ----------------------------------------------------------------------------------------


def test_concurrent_writes_fetches_and_lookups(tmp_path: Path, mem: Memory, disks: Disks) -> None:
    """Writes behind, fetches and `holds` at once: the I/O on six threads (writes one at a time, reads
    beside them and each other), the lookups on the loop meanwhile."""
    length = 64 * KB
    io = ThreadPoolExecutor(6)
    disk = disks.open(tmp_path / "disk", size=16 * MB, segment_bytes=1 * MB, executor=io)  # reclaims as it goes
    batches = [keys_of(8, f"t{t}b{b}-") for t in range(3) for b in range(12)]
    prepared = [(keys, *mem.store(keys, length)) for keys in batches]
    dst = [mem.slots(8, length) for _ in range(3)]
    scope = Scope(SCOPE, "", length)
    stop = asyncio.Event()
    fetched = [0]

    async def writer(t: int) -> None:
        for keys, offsets, crcs in prepared[t * 12:(t + 1) * 12]:
            await write(disk.tier, mem.pool, scope, keys, offsets, crcs)

    async def reader(t: int) -> None:
        while not stop.is_set():
            keys = prepared[random.randrange(len(prepared))][0]
            crcs = await fetch(disk.tier, mem.pool, scope, keys, dst[t])  # (each checked against its CRC32C)
            for key, off in zip(keys, dst[t][:len(crcs)], strict=False):
                assert mem.get(off, length) == content(key, length)
            fetched[0] += len(crcs)
            await asyncio.sleep(0)  # (a fetch of nothing on disk does not wait)

    async def main() -> None:
        readers = [asyncio.create_task(reader(t)) for t in range(3)]
        await asyncio.gather(*(writer(t) for t in range(3)))
        for _ in range(100):
            disk.holds(batches[-1])
            await asyncio.sleep(0)
        stop.set()
        await asyncio.gather(*readers)

    try:
        disk.run(main())
    finally:
        disk.close()
        disks.opened.remove(disk)  # (closed before its threads stop, as the daemon does)
        io.shutdown()
    s = disk.stats()
    assert s.healthy and s.corrupt == 0 and s.written + s.write_dropped == 3 * 12 * 8
    assert s.reclaimed_segments > 0 and s.bytes <= s.capacity_bytes
    assert fetched[0] > 0 and s.read_blocks == fetched[0]


# -- the native records ---------------------------------------------------------------------------------


def test_native_read_reports_short_files_and_foreign_records(tmp_path: Path, mem: Memory) -> None:
    length = 10_000
    offsets, crcs = mem.store(keys_of(2), length)
    fd = os.open(tmp_path / "records", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        at = [0, record_bytes(length)]
        keys = b"".join(keys_of(2))
        assert native_disk.disk_write([fd, fd], at, [7, 7], mem.pool.base, offsets, length, crcs, SCOPE, keys,
                                      32) == [0, 0]
        header = native_disk.disk_parse_header(os.pread(fd, ALIGN, at[1]))
        assert header == (1, 7, at[1], length, crcs[1], SCOPE, keys_of(2)[1])
        dst = mem.slots(2, length)

        def read(segment: int = 7, scope: bytes = SCOPE, key_bytes: bytes = keys, sums: list[int] = crcs) -> list[int]:
            return native_disk.disk_read([fd, fd], at, [segment] * 2, mem.pool.base, dst, length, sums, scope,
                                         key_bytes, 32)

        assert read() == [0, 0]
        assert read(segment=8) == [native_disk.DISK_CORRUPT_HEADER] * 2  # another segment's file
        assert read(scope=OTHER_SCOPE) == [native_disk.DISK_CORRUPT_HEADER] * 2
        assert read(key_bytes=keys[32:] + keys[:32]) == [native_disk.DISK_CORRUPT_HEADER] * 2  # records swapped
        os.truncate(tmp_path / "records", at[1] + ALIGN + 100)
        assert read() == [0, native_disk.DISK_SHORT_READ]
        os.pwrite(fd, b"\xff", ALIGN + 5)  # a payload byte of record 0
        assert read()[0] == native_disk.DISK_CORRUPT_PAYLOAD
        assert native_disk.disk_parse_header(bytes(ALIGN)) is None
    finally:
        os.close(fd)


def test_native_raw_io_round_trip(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "raw", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        native_disk.disk_raw_io(fd, 0, 5, 2 * ALIGN, True, threads=2)
        assert os.fstat(fd).st_size == 10 * ALIGN
        native_disk.disk_raw_io(fd, 0, 5, 2 * ALIGN, False, threads=2)
        with pytest.raises(OSError):
            native_disk.disk_raw_io(-1, 0, 1, ALIGN, False)
        with pytest.raises(ValueError):
            native_disk.disk_raw_io(fd, 1, 1, ALIGN, False)
    finally:
        os.close(fd)
