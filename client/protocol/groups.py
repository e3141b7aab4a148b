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
    pool. Returns `start` where nothing past it hits."""
    n = end
    changed = True
    while changed and n > start:
        changed = False
        for g, span in enumerate(spans):
            missing = [i for i in range(_first(span, start, n), n) if not present(g, i)]
            if missing:  # full attention stops at its first gap; a window ends just before its last one
                n = missing[0] if not span else missing[-1]
                changed = True
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
