"""The index's bookkeeping per block, in process, with no copy running: what a job costs the event loop
besides its copies (issue 38: stores reach 0.92 of the copy engine only if this is ~1 us a block or less
while the copies run, where the same Python runs 2-3.5x slower than here).

Each round, on pools of 1 GiB in /dev/shm, 2048 blocks of 256 KiB in chunks of 256, as jobs.py cuts them:
  store  prepare_store + complete_store into free slots (the last round's blocks cleared)
  evict  the same into another pool, full: every slot by eviction
  seal   a seal's loop part, in batches of 128 (seals.py: hold, the batch's fields, seal)
  load   prepare_load + the checksum sample + complete_load
  clear  a Clear of the 2048 blocks
Prints the median per block of each. Compare two checkouts by running each (PYTHONPATH=<checkout>).

    python benchmarks/bench_index.py --rounds 30
"""

from __future__ import annotations

import argparse
import operator
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from kvstore_service import native_blocks
from kvstore_service.chunks import load_check
from kvstore_service.events import BlockEvents
from kvstore_service.index import Block, BlockIndex, Namespace
from kvstore_service.pool import Pool

BLOCK_BYTES = 256 << 10
BLOCKS = 2048
CHUNK = 256
SEAL_BATCH = 128
_key, _checksum = operator.attrgetter("key"), operator.attrgetter("checksum")


def store(index: BlockIndex, ns: Namespace, keys: list[bytes]) -> list[Block]:
    plans = [index.prepare_store(ns, keys[s:s + CHUNK]) for s in range(0, len(keys), CHUNK)]
    return [b for plan in plans for b in index.complete_store(plan.blocks, True)]


def store_into(index: BlockIndex, ns: Namespace, keys: list[bytes], stored: list[Block]) -> None:
    stored += store(index, ns, keys)


def seal(index: BlockIndex, blocks: list[Block]) -> None:
    for s in range(0, len(blocks), SEAL_BATCH):
        held = index.hold(blocks[s:s + SEAL_BATCH])
        native_blocks.block_offsets(held), native_blocks.block_offsets(held, headers=True), b"".join(map(_key, held))
        list(map(_checksum, held))
        index.seal(held, list(range(len(held))))


def load(index: BlockIndex, ns: Namespace, keys: list[bytes]) -> None:
    for s in range(0, len(keys), CHUNK):
        blocks = [b for b in index.prepare_load(ns, keys[s:s + CHUNK]) if b is not None]
        load_check(blocks, BLOCK_BYTES, 1 / 16)
        index.complete_load(blocks, [])


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e6 / BLOCKS  # us per block


def new_index(folder: str, name: str) -> BlockIndex:
    index = BlockIndex(Pool(os.path.join(folder, name), 1 << 30, 64 << 20, fresh=True))
    index.events = BlockEvents(1 << 20, 1024, 100, index.is_committed)  # as the daemon's: commits and removals are told
    return index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvstore-bench-index-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    roomy, full = new_index(folder, "roomy"), new_index(folder, "full")  # (two pools: one never full, one always)
    try:
        ns, full_ns = roomy.namespace("ns", BLOCK_BYTES), full.namespace("ns", BLOCK_BYTES)
        for _ in range(2 * full.pool.size // (BLOCKS * BLOCK_BYTES)):
            seal(full, store(full, full_ns, [os.urandom(32) for _ in range(BLOCKS)]))
        times: dict[str, list[float]] = {name: [] for name in ("store", "evict", "seal", "load", "clear")}
        for r in range(args.rounds + 3):  # (the first 3 not counted)
            keys, full_keys = [os.urandom(32) for _ in range(BLOCKS)], [os.urandom(32) for _ in range(BLOCKS)]
            stored: list[Block] = []
            evicted: list[Block] = []
            round_times = {
                "store": timed(store_into, roomy, ns, keys, stored),
                "seal": timed(seal, roomy, stored),
                "load": timed(load, roomy, ns, keys),
                "clear": timed(roomy.clear, ns),
                "evict": timed(store_into, full, full_ns, full_keys, evicted),
            }
            seal(full, evicted)
            assert full.evictions and len(evicted) == BLOCKS == len(stored)
            if r >= 3:
                for name, t in round_times.items():
                    times[name].append(t)
        for name, values in times.items():
            print(f"{name:6s} {statistics.median(values):.3f} us a block (median of {len(values)})")
    finally:
        roomy.pool.close()
        full.pool.close()
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
