"""Benchmark of the block copy engine against a plain memcpy of the same bytes.

Copies `--blocks` blocks of `--block-size` bytes between random, scattered block ids of two
buffers (anonymous mmap, or /dev/shm files with --shm), and compares:

  * one contiguous memcpy of the same total bytes (ctypes.memmove, best of --repeat),
  * the native copy_blocks with 1 and 2 threads (and with plain stores instead of streaming ones),
  * CRC32C checksums of the same blocks with 1 and 2 threads, and of one block in cache.

Prints a table with time, GB/s and the ratio to memcpy. Run: python benchmarks/bench_copy.py
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import random
import tempfile
import time
from array import array
from collections.abc import Callable

from kvstore_service import native


class Region:
    """A page-aligned buffer (anonymous mmap or a /dev/shm file) with its address, pre-faulted."""

    def __init__(self, size: int, shm: bool) -> None:
        self._fd = -1
        if shm:
            self._fd, path = tempfile.mkstemp(prefix="kvstore-bench-", dir="/dev/shm")
            os.unlink(path)
            os.ftruncate(self._fd, size)
            self.mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED)
        else:
            self.mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)
        # Touch every page so page faults are not part of the first measurement.
        chunk = os.urandom(1 << 20)
        for off in range(0, size, len(chunk)):
            n = min(len(chunk), size - off)
            ctypes.memmove(self.addr + off, chunk, n)

    def close(self) -> None:
        del self._anchor
        self.mm.close()
        if self._fd >= 0:
            os.close(self._fd)


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=256 * 1024)
    parser.add_argument("--slots", type=int, default=0, help="block slots per buffer (default 2 x blocks)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shm", action="store_true", help="use /dev/shm files instead of anonymous mmap")
    args = parser.parse_args()

    blocks, size = args.blocks, args.block_size
    slots = args.slots or 2 * blocks
    total = blocks * size
    src, dst = Region(slots * size, args.shm), Region(slots * size, args.shm)
    rng = random.Random(0)
    src_offs = array("Q", (i * size for i in rng.sample(range(slots), blocks)))
    dst_offs = array("Q", (i * size for i in rng.sample(range(slots), blocks)))
    sizes = array("Q", [size] * blocks)
    seq_offs = array("Q", (i * size for i in range(blocks)))

    feats = native.features()
    print(f"{blocks} blocks x {size // 1024} KiB = {total / 2**20:.0f} MiB at random ids of {slots} slots, "
          f"{'/dev/shm' if args.shm else 'anonymous mmap'}; best of {args.repeat}")
    print(f"crc32c={feats['crc32c_impl']} cpus={os.cpu_count()}")

    rows: list[tuple[str, float, int]] = []  # name, seconds, bytes

    def run(name: str, fn: Callable[[], object], nbytes: int = total) -> None:
        fn()  # warm-up (threads, caches)
        rows.append((name, best_of(args.repeat, fn), nbytes))

    run("memcpy, one contiguous range", lambda: ctypes.memmove(dst.addr, src.addr, total))
    for threads in (1, 2):
        run(f"native copy_blocks, {threads} thread(s)",
            lambda t=threads: native.copy_blocks(src.addr, dst.addr, src_offs, dst_offs, sizes, t))
    run("native copy_blocks, 2 threads, plain stores (small loads)",
        lambda: native.copy_blocks(src.addr, dst.addr, src_offs, dst_offs, sizes, 2, False))
    run("native copy_blocks, sequential ids (1 run), 2 threads",
        lambda: native.copy_blocks(src.addr, dst.addr, seq_offs, seq_offs, sizes, 2))
    for threads in (1, 2):
        run(f"native checksum_blocks, {threads} thread(s)",
            lambda t=threads: native.checksum_blocks(src.addr, src_offs, size, t))
    # Pure CRC speed with the data in cache: one block checksummed over and over.
    reps = 64
    one = array("Q", [src_offs[0]] * reps)
    run("native crc32c, 1 thread, block in cache", lambda: native.checksum_blocks(src.addr, one, size, 1),
        nbytes=reps * size)

    base_rate = rows[0][2] / rows[0][1]
    print(f"\n{'what':<58} {'ms':>9} {'GB/s':>8} {'x memcpy':>9}")
    for name, secs, nbytes in rows:
        rate = nbytes / secs
        print(f"{name:<58} {secs * 1e3:>9.2f} {rate / 1e9:>8.2f} {rate / base_rate:>9.2f}")
    src.close()
    dst.close()


if __name__ == "__main__":
    main()
