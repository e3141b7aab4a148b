"""A new pool's start-up against the memory's speed: the daemon faults a fresh pool's first --populate-first
bytes in before it serves and the rest while it serves (csrc/populate.cpp, `--populate-threads`).
Interleaved rounds of:

- bare: MADV_POPULATE_WRITE over a fresh memfd of the same size on one thread, and on N threads (the limit);
- the pool set up in this process (`Pool(..., fresh=True)`: file, populate, header);
- the daemon process from its start until health says SERVING (Python's start and imports included), and
  until its whole pool is ready (stats' ready_bytes);
- with `--huge DIR` (a hugetlbfs mount, or a tmpfs mounted with huge=always): the pool set up, and the
  daemon started, on 2 MiB pages there.

    python benchmarks/bench_startup.py [--gib 4] [--rounds 3] [--threads N] [--huge DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from kvstore_service import native_memory
from kvstore_service.harness import DaemonProcess
from kvstore_service.pool import Pool


def bare(size: int, threads: int) -> float:
    fd = os.memfd_create("kvstore-bench-populate")
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        anchor = ctypes.c_char.from_buffer(mm)
        started = time.perf_counter()
        assert native_memory.populate(ctypes.addressof(anchor), size, threads) == 0
        seconds = time.perf_counter() - started
        del anchor
        mm.close()
        return seconds
    finally:
        os.close(fd)


def pool(size: int, threads: int, folder: str) -> float:
    path = os.path.join(folder, "pool")
    started = time.perf_counter()
    p = Pool(path, size, 64 << 20, fresh=True, populate_threads=threads)  # (populate_first None: all of it)
    seconds = time.perf_counter() - started
    p.close()
    os.unlink(path)
    return seconds


def daemon(size: int, threads: int, folder: str, pool_dir: str | None = None) -> tuple[float, float]:
    """(seconds to SERVING, seconds until the whole pool is ready)."""
    d = DaemonProcess(folder, str(size), "64MiB", "--fresh", "--populate-threads", str(threads),
                      pool_path=os.path.join(pool_dir, "pool") if pool_dir else None)
    started = time.perf_counter()
    d.start(timeout=600)
    serving = time.perf_counter() - started
    client = d.client()
    while (stats := client.stats()).ready_bytes < stats.capacity_bytes:
        time.sleep(0.01)
    ready = time.perf_counter() - started
    d.cleanup()
    return serving, ready


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--huge", help="a folder on huge pages (hugetlbfs, or tmpfs with huge=always)")
    args = p.parse_args()
    size = int(args.gib * (1 << 30)) // (64 << 20) * (64 << 20)
    n = args.threads
    def started(pool_dir: str | None = None) -> Callable[[str], dict[str, float]]:
        def run(tmp: str) -> dict[str, float]:
            serving, ready = daemon(size, n, tmp, pool_dir)
            where = " on huge pages" if pool_dir else ""
            return {f"daemon start{where} to SERVING, {n} threads": serving,
                    f"daemon start{where} to all ready, {n} threads": ready}
        return run

    runs: dict[str, Callable[[str], dict[str, float]]] = {
        "bare 1": lambda tmp: {"bare populate, 1 thread": bare(size, 1)},
        "bare n": lambda tmp: {f"bare populate, {n} threads": bare(size, n)},
        "pool n": lambda tmp: {f"pool set up (all of it), {n} threads": pool(size, n, tmp)},
        "pool 1": lambda tmp: {"pool set up (all of it), 1 thread": pool(size, 1, tmp)},
        "daemon": started(),
    }
    if args.huge:
        runs["pool huge"] = lambda tmp: {f"pool set up on huge pages, {n} threads": pool(size, n, args.huge)}
        runs["daemon huge"] = started(args.huge)
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        names = list(runs)[r % len(runs):] + list(runs)[: r % len(runs)]
        for name in names:
            with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
                for what, seconds in runs[name](tmp).items():
                    times.setdefault(what, []).append(seconds)
    limit = statistics.median(times[f"bare populate, {n} threads"])
    print(f"{size / 2**30:.1f} GiB, {args.rounds} interleaved rounds, {n} threads on {os.cpu_count()} cores")
    for name, seconds in times.items():
        s = statistics.median(seconds)
        print(f"{name:40s} {s:6.2f} s  {size / s / 1e9:5.2f} GB/s  x the bare {n}-thread populate: {s / limit:4.2f}"
              f"  (runs {', '.join(f'{x:.2f}' for x in seconds)})")


if __name__ == "__main__":
    main()
