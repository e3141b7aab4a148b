"""The native engine's CUDA block copies, in one process, against one contiguous copy (run on a GPU).

A pinned host buffer (cuMemHostRegister, as the daemon pins its pool) and a device buffer; for each
block size, `--mib` MiB of blocks at random, scattered block ids on both sides are copied:

  * contiguous: the same bytes as one run (the PCIe limit the daemon's figures are measured against),
  * batch: one call, one run per block through cuMemcpyBatchAsync,
  * per-run: one call, one cuMemcpyAsync per block,
  * batch on N threads: the blocks split between N threads, a call each (the daemon's copy threads).

Each call spreads its runs over `features()["cuda_copy_streams"]` streams (KVSTORE_CUDA_COPY_STREAMS).

Both directions: d2h is a store, h2d a load. Prints GB/s and the ratio to the contiguous copy of the
same round (median of --rounds). Run: python benchmarks/bench_cuda_copy.py
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import random
import statistics
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvstore_service import native, native_device

SIZES_KIB = [4, 16, 64, 256, 1024, 2048]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="bytes copied per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="copy threads for the threaded row")
    parser.add_argument("--sizes-kib", type=int, nargs="*", default=SIZES_KIB)
    args = parser.parse_args()

    total = args.mib << 20
    span = 2 * total  # blocks land at scattered ids in a buffer twice the copied bytes
    host = mmap.mmap(-1, span)
    host_base = ctypes.addressof(ctypes.c_char.from_buffer(host))
    host.write(b"\x01" * span)
    native_device.cuda_host_register(host_base, span, 0)
    dev = torch.empty(span, dtype=torch.uint8, device="cuda")
    dev_base = dev.data_ptr()
    pool = ThreadPoolExecutor(max_workers=args.threads)
    print(f"{torch.cuda.get_device_name(0)}, {args.mib} MiB per copy, median of {args.rounds} rounds, "
          f"{native.features()['cuda_copy_streams']} streams per call")
    print(f"{'block':>8} {'dir':>4} {'contig GB/s':>11} {'batch':>7} {'per-run':>7} {'batch x' + str(args.threads):>9}")
    try:
        for kib in args.sizes_kib:
            for direction in ("d2h", "h2d"):
                bases = (dev_base, host_base) if direction == "d2h" else (host_base, dev_base)
                med = measure(kib << 10, total, span, bases, direction, pool, args)
                print(f"{kib:>6}K {direction:>4} {med['contig']:>11.1f} {med['batch']:>7.2f} {med['per-run']:>7.2f} "
                      f"{med['threaded']:>9.2f}", flush=True)
    finally:
        pool.shutdown()
        torch.cuda.synchronize()
        native_device.cuda_host_unregister(host_base, 0)


def measure(size: int, total: int, span: int, bases: tuple[int, int], direction: str, pool: ThreadPoolExecutor,
            args: argparse.Namespace) -> dict[str, float]:
    """Median GB/s of the contiguous copy and the other copies' ratios to it, round by round."""
    n = total // size
    src_base, dst_base = bases
    src = array("Q", [i * size for i in random.sample(range(span // size), n)])
    dst = array("Q", [i * size for i in random.sample(range(span // size), n)])
    sizes = array("Q", [size] * n)

    def copy(lo: int, hi: int, batch: bool) -> None:
        native_device.cuda_copy_blocks(src_base, dst_base, src[lo:hi], dst[lo:hi], sizes[lo:hi], direction, 0,
                                       allow_batch=batch)

    def contiguous() -> None:
        native_device.cuda_copy_blocks(src_base, dst_base, array("Q", [0]), array("Q", [0]), array("Q", [total]),
                                       direction, 0)

    def threaded() -> None:
        step = -(-n // args.threads)
        for f in [pool.submit(copy, lo, min(n, lo + step), True) for lo in range(0, n, step)]:
            f.result()

    for warm in (contiguous, lambda: copy(0, n, True), lambda: copy(0, n, False), threaded):
        warm()
    rows: dict[str, list[float]] = {"contig": [], "batch": [], "per-run": [], "threaded": []}
    for _ in range(args.rounds):
        limit = timed(contiguous)
        rows["contig"].append(total / limit / 1e9)
        rows["batch"].append(limit / timed(lambda: copy(0, n, True)))
        rows["per-run"].append(limit / timed(lambda: copy(0, n, False)))
        rows["threaded"].append(limit / timed(threaded))
    return {k: statistics.median(v) for k, v in rows.items()}


if __name__ == "__main__":
    main()
