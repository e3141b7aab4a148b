"""Benchmark of the disk tier (kvstore_service/tiers/disk/) against raw O_DIRECT I/O of the same bytes.

For each block size (default 256 KiB and 2 MiB), on the file system of --dir, the contenders move the
same payload bytes, --total of them each, in rounds of --round bytes (written, then read back):

  * raw: sequential O_DIRECT pwrite, then pread, to a new preallocated file per round, on --threads
    threads (the native disk_raw_io: the engine's own threading, no GIL), in requests of a block and a
    4 KiB header (the tier's record size) from the engine's aligned buffers (the very buffers the
    staged tier moves its records through), no copy, no checksum, no Python: the limit;
  * raw-block: the same in block-sized requests (from other buffers), for reference;
  * staged (the tier's default): the round's blocks written behind (`DiskTier.write_behind`, the tiers'
    contract, as the daemon drives it: each call waited for until its blocks are released) from a real
    pool (/dev/shm, the daemon's default 64 MiB segments), --batch bytes per call, then fetched
    (`fetch_verified`) into other pool slots, verified (header and CRC32C), with --threads I/O threads,
    each record through an aligned buffer (a copy);
  * direct: the same with io_mode="direct": payload pages straight from/into the pool (the slots here
    are all aligned for O_DIRECT).

The tier's figures include everything it does: a header per block, segment files created and
preallocated, closed (footer, index file), the read fds opened. GB/s count the blocks' bytes only.

This VM's disk (virtio, Firecracker) makes a fair limit hard: its pace changes from minute to minute,
it stalls now and then (a 128 MiB round taking seconds, whoever runs it), and it runs at different
speeds from different memory (the same file region, single-threaded, from six 2 MiB buffers: one at
1.8 GB/s, five at 2.3). Hence: the rounds interleave the contenders (rotating their order); raw runs
from the same buffers as the staged tier; the ratio is given over the totals and as the median of
the rounds' ratios (tier round / the raw round next to it), which stalls do not move.
Run: python benchmarks/bench_disk.py --dir /var/tmp
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore_service import native, native_disk
from kvstore_service.pool import Pool, slots_per_segment
from kvstore_service.threads import Threads
from kvstore_service.tiers.base import Scope
from kvstore_service.tiers.disk import ALIGN, DiskTier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.tier_contract import Released  # noqa: E402

MB = 1 << 20
POOL_SEGMENT = 64 * MB  # the daemon's default --segment-size


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Blocks:
    """One round's source and destination slots of `block` bytes in a pool on /dev/shm."""

    def __init__(self, block: int, count: int) -> None:
        segments = 2 * -(-count // max(1, slots_per_segment(POOL_SEGMENT, block))) + 1
        fd, self.path = tempfile.mkstemp(prefix="kvstore-bench-disk-pool-", dir="/dev/shm")
        os.close(fd)
        self.pool = Pool(self.path, segments * POOL_SEGMENT, POOL_SEGMENT, fresh=True)
        self.src = self._slots(block, count)
        self.dst = self._slots(block, count)
        for off in self.src:
            ctypes.memmove(self.pool.base + off, os.urandom(block), block)
        self.crcs = native.checksum_blocks(self.pool.base, self.src, block, threads=2)

    def _slots(self, block: int, count: int) -> list[int]:
        offsets = [seg.payload_offset(s) for seg, slots in self.pool.allocate_many(block, count) for s in slots]
        assert len(offsets) == count
        return offsets

    def close(self) -> None:
        self.pool.close()
        os.unlink(self.path)


class Raw:
    """Requests of `request` bytes each to a new preallocated file each round (as the tier's segments)."""

    def __init__(self, folder: str, request: int, threads: int) -> None:
        self.path = tempfile.mkdtemp(prefix="kvstore-bench-raw-", dir=folder)
        self.request, self.threads = request, threads

    def round(self, r: int, count: int) -> tuple[float, float]:
        fd = os.open(os.path.join(self.path, f"round-{r}"), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.posix_fallocate(fd, 0, count * self.request)
            write = timed(lambda: native_disk.disk_raw_io(fd, 0, count, self.request, True, self.threads))
            read = timed(lambda: native_disk.disk_raw_io(fd, 0, count, self.request, False, self.threads))
        finally:
            os.close(fd)
        return write, read

    def close(self) -> None:
        shutil.rmtree(self.path)


def slots(offsets: Sequence[int]) -> Callable[[int, int], Sequence[int]]:
    """A fetch's `place`: these slots, in order."""
    return lambda first, count: offsets[first:first + count]


class Tier:
    """The disk tier through the tiers' contract (tiers/base.py), on an event loop of its own."""

    def __init__(self, folder: str, blocks: Blocks, block: int, total: int, threads: int, batch: int,
                 io_mode: str) -> None:
        self.path = tempfile.mkdtemp(prefix=f"kvstore-bench-disk-{io_mode}-", dir=folder)
        os.rmdir(self.path)  # the tier creates it (0700)
        self.tier = DiskTier.open(self.path, 2 * total + (1 << 30), threads=threads, io_mode=io_mode,
                                  queue_bytes=batch * block, executor=Threads(1).disk)
        assert self.tier.stats().healthy, self.tier.stats().error
        self.blocks, self.block, self.batch = blocks, block, batch
        self.loop = asyncio.new_event_loop()

    def round(self, r: int, count: int) -> tuple[float, float]:
        scope, pool, b, step = Scope(bytes(16), "", self.block), self.blocks.pool, self.blocks, self.batch
        keys = [(r << 32 | i).to_bytes(32, "little") for i in range(count)]

        async def write() -> None:
            for i in range(0, count, step):
                release = Released(len(keys[i:i + step]))
                n = self.tier.write_behind(pool, scope, keys[i:i + step], b.src[i:i + step], b.crcs[i:i + step],
                                           release)
                assert n == len(keys[i:i + step]), self.tier.stats()
                await release.wait()

        async def read() -> None:
            for i in range(0, count, step):
                got: list[int] = []
                async for crcs in self.tier.fetch_verified(pool, scope, keys[i:i + step], slots(b.dst[i:i + step])):
                    got += crcs
                assert got == b.crcs[i:i + step], self.tier.stats()

        written = self.tier.stats().written
        run = self.loop.run_until_complete
        times = timed(lambda: run(write())), timed(lambda: run(read()))
        assert self.tier.stats().written == written + count, self.tier.stats()
        base = pool.base
        assert ctypes.string_at(base + b.dst[-1], self.block) == ctypes.string_at(base + b.src[-1], self.block)
        return times

    def close(self) -> None:
        self.loop.run_until_complete(self.tier.aclose(0))
        self.loop.close()
        shutil.rmtree(self.path)


def bench_block(args: argparse.Namespace, block: int) -> None:
    total, round_bytes = parse_size(args.total), parse_size(args.round)
    count = round_bytes // block
    rounds = max(1, total // (count * block))
    batch = max(1, parse_size(args.batch) // block)
    blocks = Blocks(block, count)
    contenders: dict[str, Raw | Tier] = {}
    try:
        contenders["raw"] = Raw(args.dir, ALIGN + -(-block // ALIGN) * ALIGN, args.threads)
        contenders["raw-block"] = Raw(args.dir, block, args.threads)
        for mode in args.io_mode.split(","):
            contenders[mode] = Tier(args.dir, blocks, block, rounds * count * block, args.threads, batch, mode)
        names = list(contenders)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
                times[name].append(contenders[name].round(r, count))
    finally:
        for c in contenders.values():
            c.close()
        blocks.close()
    moved = rounds * count * block
    raw_w, raw_r = (sum(t[k] for t in times["raw"]) for k in (0, 1))
    aligned = sum(off % 4096 == 0 for off in blocks.src)
    print(f"{block >> 10} KiB blocks: {rounds} rounds of {count} blocks ({moved / 2**30:.2f} GiB per contender), "
          f"pool slots 4 KiB aligned: {aligned}/{count}")
    for name, runs in times.items():
        w, r = (sum(t[k] for t in runs) for k in (0, 1))
        line = f"  {name:>9}  write {moved / w / 1e9:5.2f} GB/s  read {moved / r / 1e9:5.2f} GB/s"
        if name != "raw":
            wr = statistics.median(raw[0] / t[0] for t, raw in zip(runs, times["raw"], strict=True))
            rr = statistics.median(raw[1] / t[1] for t, raw in zip(runs, times["raw"], strict=True))
            line += f"  / raw: write {raw_w / w:.2f} (rounds' median {wr:.2f})  read {raw_r / r:.2f} ({rr:.2f})"
        print(line, flush=True)
        if args.verbose:
            print("             rounds (write/read GB/s): "
                  + " ".join(f"{count * block / w / 1e9:.2f}/{count * block / r / 1e9:.2f}" for w, r in runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure")
    ap.add_argument("--total", default="2GiB", help="bytes written and read per contender and block size")
    ap.add_argument("--round", default="128MiB", help="bytes per round (contenders alternate between rounds)")
    ap.add_argument("--block-sizes", default="256KiB,2MiB")
    ap.add_argument("--threads", type=int, default=2, help="I/O threads (raw and tier)")
    ap.add_argument("--batch", default="32MiB", help="bytes per tier call (write_behind, fetch_verified)")
    ap.add_argument("--io-mode", default="staged,direct", help="tier contenders: staged, direct")
    ap.add_argument("--verbose", action="store_true", help="print every round's figures")
    args = ap.parse_args()
    print(f"dir {args.dir}, {args.threads} I/O threads, {args.batch} per tier call; GB/s of payload; "
          f"ratio: tier / raw")
    for block in map(parse_size, args.block_sizes.split(",")):
        bench_block(args, block)


if __name__ == "__main__":
    main()
