"""A job's chunks: how a job is cut, and each chunk's byte runs planned on the event loop.

Jobs (jobs.py) runs the chunks: it asks the index for slots (store) or pinned blocks (load), plans
each chunk here (`plan_chunk`), and hands it to a copy thread, which only makes native calls.
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass

from kvstore_service import native, native_blocks
from kvstore_service.backends import TransferPlan
from kvstore_service.backends.base import ChecksumSample, ProgressWord
from kvstore_service.index import Block
from kvstore_service.sessions import EngineSession

# A job is copied in chunks: first one chunk per copy thread (FIRST_CHUNK_BYTES, at most
# FIRST_CHUNK_BLOCKS), started together once planned (~1-3 µs a block; jobs.py), then the rest in
# chunks the copy threads take from their queue as they come free, so that one that started late or
# copies slower (sharing its core with the loop) takes fewer. The first chunks last long enough for the
# loop to plan the next while they copy (64 MiB: ~6 ms at a CPU thread's ~10 GB/s, ~2.4 ms at half
# an H100's bus). Then each chunk is what is left over the threads (guided self-scheduling), at most
# CHUNK_BYTES / CHUNK_BLOCKS (the block cap bounds the loop's planning of one chunk, ~2 ms) and at
# least TAIL_CHUNK_BYTES: the chunks shrink towards the job's end, so the threads finish within a
# small chunk of each other. Each chunk costs a hand-off. A job of at most a first chunk per thread
# is cut in equal shares, one per thread (a 16-block store of 3 MiB blocks: two chunks of 8; a load
# up to the backend's whole_load_bytes is one chunk, see backends/cpu.py).
# Each choice won its A/B against the one before (2048 x 256 KiB jobs, the ledger of 2026-11-27):
# first chunks started together against a doubling ramp (CPU stores 0.75 -> 0.84 of the copy
# engine), shares capped at 64 MiB (H100 stores 0.61 -> 0.65 of the pinned copy, CPU even), chunks
# shrinking to 8 MiB at the end (CPU loads 0.73 -> 0.77, stores even).
FIRST_CHUNK_BYTES = 64 << 20
FIRST_CHUNK_BLOCKS = 256
MIN_SHARE_BYTES = 1 << 20  # a smaller job is one chunk: its copy is shorter than a hand-off
CHUNK_BYTES = 64 << 20
CHUNK_BLOCKS = 1024
TAIL_CHUNK_BYTES = 8 << 20


@dataclass(eq=False)
class Chunk:
    """Part of a job, planned on the event loop: its copy thread only makes native calls."""

    indexes: list[int]  # into the job's keys
    blocks: list[Block]
    plan: TransferPlan
    in_order: bool  # indexes are consecutive keys, in order (the usual case: handled by slices)
    check: ChecksumSample | None = None  # load: the blocks whose checksums are verified


def chunks(n: int, block_bytes: int, threads: int) -> list[range]:
    """A job of n blocks in chunks: equal shares, one per copy thread, for a small job; else a first
    chunk per thread, then chunks of what is left over the threads, between the tail and the cap."""
    most = max(1, min(CHUNK_BYTES // block_bytes, CHUNK_BLOCKS))
    first = max(1, min(FIRST_CHUNK_BYTES // block_bytes, FIRST_CHUNK_BLOCKS, most))
    if n <= threads * first:
        share = max(-(-n // threads), MIN_SHARE_BYTES // block_bytes, 1)
        return [range(s, min(s + share, n)) for s in range(0, n, share)]
    parts = [range(s, s + first) for s in range(0, threads * first, first)]
    least = max(1, min(TAIL_CHUNK_BYTES // block_bytes, most))
    start = threads * first
    while start < n:
        size = min(max(-(-(n - start) // threads), least), most)
        parts.append(range(start, min(start + size, n)))
        start += size
    return parts


def plan_chunk(session: EngineSession, block_ids: array[int], indexes: list[int], blocks: list[Block],
               pool_size: int) -> Chunk:
    """The byte runs of these blocks (of the job's keys `indexes`, in any order: a TP store's joined
    groups come first), in one native call (region-major; the copy coalesces adjacent runs): this
    engine's shard of each slot, and the engine addresses in its mapped memories. Every run is
    checked against the pool and its mapping there, before any byte moves (block ids were checked
    at submit, and every region against its memory at registration)."""
    layout = session.layout
    first = indexes[0]
    in_order = indexes == list(range(first, first + len(indexes)))
    ids = block_ids[first:first + len(indexes)] if in_order else array("Q", [block_ids[i] for i in indexes])
    runs = native.plan_transfer(native_blocks.block_offsets(blocks), ids, session.regions, layout.num_blocks, pool_size,
                                layout.shard * layout.block_bytes)
    return Chunk(indexes, blocks, TransferPlan(runs), in_order)


def load_check(blocks: list[Block], block_bytes: int, verify: float) -> ChecksumSample | None:
    """The blocks of a load whose checksums are verified (--verify-loads: all, or this share): every
    1/share-th block from a random start, so that each block is checked with that chance (drawn with
    random.sample, a 256-block chunk's sample took 8 µs of the loop, not 4)."""
    n, step = len(blocks), 1 / min(verify, 1.0)
    first = random.random() * step
    checked = [p for k in range(math.ceil((n - first) / step)) if (p := int(first + k * step)) < n]
    if not checked:
        return None
    # A block stored a moment ago may not have its checksum yet (None): nothing to check.
    unknown = native.UNKNOWN_CHECKSUM
    return ChecksumSample(
        array("Q", checked), array("Q", [blocks[k].offset for k in checked]), block_bytes,
        array("Q", [unknown if (c := blocks[k].checksum) is None else c for k in checked]))


def track_progress(session: EngineSession, job_id: int, plan: TransferPlan) -> None:
    """Set a whole load's plan (copied by one thread in layout order: runs are region-major, one per
    block) to report the regions' arrival in the engine's completion channel: the copy writes the
    channel's progress word itself (ProgressWord)."""
    plan.regions = len(session.layout.regions)
    plan.progress = ProgressWord(*session.channel.progress_target(job_id))
