"""A job's chunks: how a job is cut, and each chunk's byte runs planned on the event loop.

Jobs (jobs.py) runs the chunks: it asks the index for slots (store) or pinned blocks (load), plans
each chunk here (`plan_chunk`), and hands it to a copy thread, which only makes native calls.
"""

from __future__ import annotations

import functools
import random
from array import array
from dataclasses import dataclass

from kvstore_service import native
from kvstore_service.backends import TransferPlan
from kvstore_service.backends.base import ChecksumSample, ProgressWord
from kvstore_service.index import Block
from kvstore_service.sessions import EngineSession

# A job is copied in chunks: first one chunk per copy thread (FIRST_CHUNK_BYTES, at most
# FIRST_CHUNK_BLOCKS), each started as soon as planned (~1-3 µs a block), then what is left
# in equal shares, at least one per thread (a 16-block store of 3 MiB blocks: two chunks of 8 on two
# threads; a load up to the backend's whole_load_bytes is one chunk, see backends/cpu.py). The
# first chunks last long enough for the loop to plan the next while they copy (64 MiB: ~6 ms at a
# CPU thread's ~10 GB/s, ~2.4 ms at half an H100's bus). Shares are at most CHUNK_BYTES /
# CHUNK_BLOCKS: the block cap bounds the loop's planning of one chunk (~2 ms); the byte cap lets
# the copy threads take the rest chunk by chunk from their queue, so that one that started late or
# copies slower takes fewer, and the last chunk's completion is short. Each chunk costs a hand-off.
# 2048 blocks of 256 KiB, A/B of interleaved rounds (benchmarks/results/README.md): first chunks
# started together against a doubling ramp of seven chunks, CPU: stores 0.75 -> 0.84 of the copy
# engine, loads 0.67 -> 0.74; shares capped at 64 MiB (8 chunks) against 256 MiB (4 chunks): on an
# H100 stores 0.61 -> 0.65, loads 0.64 -> 0.66 of the pinned copy (H200: 0.55 -> 0.61, 0.59 ->
# 0.61), CPU even (stores 0.88 / 0.89, loads 0.76 / 0.74, 20 rounds). The first chunks waited for
# each other while clients polled for completions (a thread woken while the loop planned waited
# ~3 ms for a core); since they sleep on a futex (client.py wait()), each starting at once: loads
# 0.72 -> 0.79 and 0.74 -> 0.78, stores even (0.84 / 0.85).
FIRST_CHUNK_BYTES = 64 << 20
FIRST_CHUNK_BLOCKS = 256
MIN_SHARE_BYTES = 1 << 20  # a smaller job is one chunk: its copy is shorter than a hand-off
CHUNK_BYTES = 64 << 20
CHUNK_BLOCKS = 1024


@dataclass(eq=False)
class Chunk:
    """Part of a job, planned on the event loop: its copy thread only makes native calls."""

    indexes: list[int]  # into the job's keys
    blocks: list[Block]
    plan: TransferPlan
    check: ChecksumSample | None = None  # load: the blocks verified before the copy


def chunks(n: int, block_bytes: int, threads: int) -> list[range]:
    """A job of n blocks in chunks: a first chunk per copy thread, when enough is left after them,
    then equal shares (one per thread, more when a share would pass the cap)."""
    most = max(1, min(CHUNK_BYTES // block_bytes, CHUNK_BLOCKS))
    first = max(1, min(FIRST_CHUNK_BYTES // block_bytes, FIRST_CHUNK_BLOCKS, most))
    start = threads * first if n > 2 * threads * first else 0
    parts = [range(s, s + first) for s in range(0, start, first)]
    left = n - start
    pieces = max(threads, -(-left // most))
    share = max(-(-left // pieces), MIN_SHARE_BYTES // block_bytes, 1)
    return parts + [range(s, min(s + share, n)) for s in range(start, n, share)]


def plan_chunk(session: EngineSession, block_ids: list[int], indexes: list[int], blocks: list[Block],
         pool_size: int) -> Chunk:
    """The byte runs of these blocks, in one native call (region-major; the copy coalesces
    adjacent runs): this engine's shard of each slot, and the engine addresses in its mapped
    memories. Every run is checked against the pool and its mapping there, before any byte moves
    (block ids were checked at submit, and every region against its memory at registration)."""
    layout = session.layout
    regions = array("Q")
    for r in layout.regions:
        mapping = session.mappings[r.memory]
        regions.extend((mapping.base + r.offset, r.block_stride, r.block_bytes, mapping.base,
                        mapping.base + mapping.size))
    pool_offsets, engine_addresses, sizes = native.plan_transfer(
        array("Q", [b.offset for b in blocks]), array("Q", [block_ids[i] for i in indexes]), regions,
        layout.num_blocks, pool_size, layout.shard * layout.block_bytes)
    return Chunk(indexes, blocks, TransferPlan(pool_offsets, engine_addresses, sizes))


def load_check(blocks: list[Block], block_bytes: int, verify: float) -> ChecksumSample | None:
    """The blocks of a load to verify before its copy (--verify-loads: all, or this share at random)."""
    n = len(blocks)
    share = n * min(verify, 1.0)  # whole blocks, and the fraction left with that chance
    checked = sorted(random.sample(range(n), int(share) + (random.random() < share % 1)))
    if not checked:
        return None
    # A block stored a moment ago may not have its checksum yet (None): nothing to check.
    unknown = native.UNKNOWN_CHECKSUM
    return ChecksumSample(
        array("Q", checked), array("Q", [blocks[k].offset for k in checked]), block_bytes,
        array("Q", [unknown if (c := blocks[k].checksum) is None else c for k in checked]))


def copy_whole(session: EngineSession, job_id: int, plan: TransferPlan) -> None:
    """A load copied whole: by one thread, region by region (runs are region-major, one per block),
    reporting each region's arrival in the engine's completion channel (the CPU engine writes the
    channel's progress word itself, see ProgressWord)."""
    channel = session.channel
    plan.regions = len(session.layout.regions)
    address, word = channel.progress_target(job_id)
    plan.progress = ProgressWord(address, word, functools.partial(channel.post_progress, job_id))
