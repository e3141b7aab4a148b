"""vLLM's hit rule for several KV cache groups (kvstore_client.protocol.groups), the one piece of code the
connector's planner, the daemon's grouped lookup and the promotion from the tiers share: the longest hit
is the largest n every group serves, found asking about each group's block at most once."""

from __future__ import annotations

import random

from kvstore_client.protocol.groups import grouped_hit, hit_blocks, needed_blocks


def longest_hit(spans: list[int], start: int, end: int, present: set[tuple[int, int]]) -> int:
    """The rule as its definition: the largest n <= end whose every group has the blocks it needs."""
    for n in range(end, start, -1):
        if all((g, i) in present for g, i in needed_blocks(spans, start, n)):
            return n
    return start


def test_the_hit_is_the_largest_every_group_serves_and_each_block_is_asked_once() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        groups, blocks = rng.randint(1, 4), rng.randint(0, 16)
        spans = [rng.choice((0, 0, 1, 2, 3, 5)) for _ in range(groups)]
        density = rng.random()
        present = {(g, i) for g in range(groups) for i in range(blocks) if rng.random() < density}
        start = rng.randint(0, blocks)
        end = rng.randint(start, blocks)
        asked: list[tuple[int, int]] = []

        def ask(g: int, i: int, present=present, asked=asked) -> bool:
            asked.append((g, i))
            return (g, i) in present
        assert hit_blocks(spans, start, end, ask) == longest_hit(spans, start, end, present), (spans, start, end)
        assert len(asked) == len(set(asked)) <= groups * (end - start), (spans, asked)  # O(blocks x groups)


def test_a_window_gap_walking_down_block_by_block_stays_linear() -> None:
    """The adversarial case for a fixed-point iteration that rescans: a 2-block window whose every other
    block is missing, over a full-attention group that has everything, shortens the hit one gap at a time."""
    blocks = 4000
    asked = 0

    def present(g: int, i: int) -> bool:
        nonlocal asked
        asked += 1
        return g == 0 or i % 2 == 0 or i < 10

    assert hit_blocks([0, 2], 0, blocks, present) == 11
    assert asked <= 2 * blocks


def test_a_grouped_hit_over_interleaved_keys() -> None:
    """Keys block by block ([block 0 of group 0, of group 1, block 1 of group 0, ...]): the hit and the
    positions in the key list of the keys it needs."""
    present = {0, 2, 4, 5, 6, 7, 8}  # group 0 has blocks 0..4, group 1 blocks 2, 3, 4 (not 0, 1)
    assert grouped_hit([0, 2], 10, present.__contains__) == (4, [0, 2, 4, 5, 6, 7])  # a window needs 2, 3
    assert grouped_hit([0, 0], 10, present.__contains__) == (0, [])  # full attention needs block 0
    assert grouped_hit([0, 1], 10, present.__contains__) == (4, [0, 2, 4, 6, 7])  # the state at block 3
