"""Several KV cache groups (vLLM's hybrid allocator) in one lookup: the key layout and vLLM's hit rule.

A grouped lookup sends every group's key of each block, block by block ([block 0 of group 0, of group 1,
..., block 1 of group 0, ...]) and one span per group: 0 for full attention (a hit needs every block
before it), n > 0 for a group that needs only the n blocks before the hit (a sliding window of n blocks;
1 for a Mamba or linear-attention state, which exists at exactly the hit). The daemon answers with the
longest hit every group can serve and leases exactly the blocks it needs (LookupRequest.group_spans).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

# Group spans a lookup may send: groups per block, and a window's blocks.
MAX_GROUPS = 64
MAX_SPAN = 1 << 20


def check_spans(spans: Sequence[int], keys: int) -> str:
    """Why `spans` cannot describe `keys` keys ("" if they can)."""
    if len(spans) > MAX_GROUPS:
        return f"{len(spans)} group spans; at most {MAX_GROUPS}"
    if any(s < 0 or s > MAX_SPAN for s in spans):
        return f"group spans must be in [0, {MAX_SPAN}] (0: full attention); got {list(spans)}"
    if keys % len(spans):
        return f"{keys} keys are not whole blocks of {len(spans)} groups"
    return ""


def hit_blocks(spans: Sequence[int], start: int, end: int, present: Callable[[int, int], bool]) -> int:
    """vLLM's hit rule for several KV cache groups (HybridKVCacheCoordinator.find_longest_cache_hit): the
    largest n <= end such that every full-attention group (span 0) has blocks [start, n) and every other
    group the `span` blocks before n (those from `start` on: vLLM holds the rest), iterated to the fixed
    point, as one group's shorter hit shortens the others'. `present(g, i)`: group g's block i is in the
    pool. Returns `start` where nothing past it hits.

    Each group's block is asked about at most once, so O(blocks x groups) whatever the gaps: a full group
    keeps the run [start, edge) it found present, a window the run [edge, n) (n only ever shrinks, so
    neither is asked again; a gap is never asked again either, as n ends at or before it)."""
    n = end
    edge = [start if not span else end for span in spans]
    changed = True
    while changed and n > start:
        changed = False
        for g, span in enumerate(spans):
            e = edge[g]
            if not span:  # full attention stops at its first gap
                while e < n and present(g, e):
                    e += 1
                if e < n:
                    n, changed = e, True
            else:  # a window ends just before its last gap
                e, first = min(e, n), max(start, n - span)
                while e > first and present(g, e - 1):
                    e -= 1
                if e > first:
                    n = e = e - 1
                    changed = True
            edge[g] = e
    return max(n, start)


def needed_blocks(spans: Sequence[int], start: int, n: int) -> Iterator[tuple[int, int]]:
    """(group, block) of every block a hit of `n` blocks past `start` needs, block by block."""
    firsts = [_first(span, start, n) for span in spans]
    for i in range(start, n):
        for g, first in enumerate(firsts):
            if i >= first:
                yield g, i


def _first(span: int, start: int, n: int) -> int:
    return start if not span else max(start, n - span)


def grouped_hit(spans: Sequence[int], keys: int, present: Callable[[int], bool]) -> tuple[int, list[int]]:
    """`hit_blocks` and `needed_blocks` over a grouped lookup's `keys` keys (interleaved block by block, from
    block 0): (the hit in blocks, the positions in the key list of the keys it needs, block by block).
    `present(k)`: the key at position k is there."""
    groups = len(spans)
    n = hit_blocks(spans, 0, keys // groups, lambda g, i: present(i * groups + g))
    return n, [i * groups + g for g, i in needed_blocks(spans, 0, n)]
