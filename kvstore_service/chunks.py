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

# A job is copied in chunks that double from FIRST_CHUNK_BYTES (at least FIRST_CHUNK_BLOCKS) up to
# CHUNK_BYTES / CHUNK_BLOCKS, and end with one equal share of what is left per copy thread: a small
# first chunk starts the copying after little planning (~2 µs a block), and the threads finish
# together (a 16-block store of 3 MiB blocks: two chunks of 8 on two threads; a load up to the
# backend's whole_load_bytes is one chunk, see backends/cpu.py). Every chunk costs a
# hand-off to a copy thread and back (~0.5 ms on a busy 2-vCPU VM); the block cap bounds the time
# the event loop spends planning one chunk (~2 ms).
FIRST_CHUNK_BYTES = 16 << 20
FIRST_CHUNK_BLOCKS = 64
MIN_SHARE_BYTES = 1 << 20  # a smaller job is one chunk: its copy is shorter than a hand-off
CHUNK_BYTES = 128 << 20
CHUNK_BLOCKS = 1024


@dataclass(eq=False)
class Chunk:
    """Part of a job, planned on the event loop: its copy thread only makes native calls."""

    indexes: list[int]  # into the job's keys
    blocks: list[Block]
    plan: TransferPlan
    check: ChecksumSample | None = None  # load: the blocks verified before the copy


def chunks(n: int, block_bytes: int, threads: int) -> list[range]:
    """A job of n blocks in chunks: doubling from the first chunk's size up to the cap, then, once
    what is left fits in one chunk per copy thread, an equal share per thread."""
    most = max(1, min(CHUNK_BYTES // block_bytes, CHUNK_BLOCKS))
    ramp = min(most, max(FIRST_CHUNK_BYTES // block_bytes, FIRST_CHUNK_BLOCKS))
    parts, start = [], 0
    while n - start > threads * ramp:
        parts.append(range(start, start + ramp))
        start += ramp
        ramp = min(most, 2 * ramp)
    share = max(-(-(n - start) // threads), MIN_SHARE_BYTES // block_bytes)
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
    checked = [k for k in range(len(blocks)) if verify >= 1 or random.random() < verify]
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
