"""What the planner keeps per request and hands the worker. Defaults are class attributes: making a
record sets one or two attributes (cheaper right after a forward pass, with cold caches)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Transfer:
    """A store or load job for the worker: the pool's keys and the engine's block ids, pairwise."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    partial_tail: bool = False  # store: the last key is the prompt's partial last block


class Lookup:
    """One request's lookup, and its own future: the session's background thread fills in the reply and
    sets `replied` last; the planner reads it once (`read`). A lookup released before its reply came is
    `dropped`: the background thread then gives its lease back (Scheduler.release decides who)."""

    keys: Sequence[bytes] = ()  # looked up: the full blocks' keys, then the partial tail's key if any
    tail = 0  # tokens of the tail key (0: none)
    hits = 0  # leading keys present (several KV cache groups: blocks of the hit every group serves)
    lease_id = b""
    error: BaseException | None = None
    unavailable = False  # the sidecar was not connected: nothing looked up
    replied = False
    read = False
    dropped = False
    start = 0  # vLLM's local hit (blocks) when the planner last answered: the load starts there

    def __init__(self, full: int, with_tail: bool) -> None:
        self.full = full  # the request's full blocks when it was looked up
        self.with_tail = with_tail  # its prompt's partial tail is looked up too

    def cached_tokens(self, block_size: int) -> int:
        """Tokens the present keys hold."""
        if self.tail and self.hits == len(self.keys):
            return (self.hits - 1) * block_size + self.tail
        return self.hits * block_size


class Req:
    """What the planner keeps per request, in one place (one dict operation per request and step)."""

    stored_upto = -1  # blocks already sent for store (-1: not known yet)
    had_stores = False  # stores were planned: vLLM keeps its blocks until they are done
    load_failed = False  # its load failed: recompute, never offer again
    tail_done = False  # its prompt's partial tail is stored, or was in the pool
    store_at = 0  # computed tokens before which it has nothing new to store (Stores.plan's lower bound)
    # Blocks vLLM had locally when it was scheduled (`local`), of which the pool holds the first
    # `pool_has` (-1: not known): the rest is offered to the pool (Stores.offers).
    local = 0
    pool_has = -1
    # Sliding-window blocks and Mamba states stored, (group, block index, block id): vLLM frees such a block
    # once out of its window (a state once the next is computed), without telling the connector, and may
    # reuse it in the next forward (see Stores.volatile_freed).
    volatile: list[tuple[int, int, int]] | None = None

    def __init__(self, request: Any) -> None:
        self.request = request
