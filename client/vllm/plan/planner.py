"""The planner: a request's lookup turned into a hit and a load, each step's stores, the leases a
request's end gives back. vLLM's scheduler calls arrive through client/vllm/scheduler.py."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol

from kvstore_client.protocol.groups import needed_blocks
from kvstore_client.vllm.plan.keys import group_keys
from kvstore_client.vllm.plan.records import Lookup, Req, Transfer
from kvstore_client.vllm.plan.stores import Stores

log = logging.getLogger(__name__)

NO_MATCH = (0, False)
ASK_AGAIN = (None, False)  # vLLM asks again next step


class Outside(Protocol):
    """What the planner needs from outside itself: vLLM's hash of a partial block and the pool's epoch
    (read); leases, descriptions and pool questions (sent, off the engine's step)."""

    def hash_tail(self, request: Any, start: int, end: int) -> bytes: ...

    def pool_epoch(self) -> int: ...  # changes when the session re-registers: a new daemon may hold nothing

    def release(self, lookup: Lookup) -> None: ...  # its lease, also one whose reply is on its way

    def describe(self, request: Any, keys: list[bytes]) -> None: ...  # full blocks stored, for routers' events

    def ask_pool(self, rec: Req, keys: Sequence[bytes]) -> None: ...  # answered through pool_holds


class Planner:
    """`spans`: per KV cache group the blocks a hit needs before it (kvstore_client.protocol.groups), None
    for one full-attention group; `states`: the groups of Mamba states, stored as vLLM offers them."""

    def __init__(self, block_size: int, spans: list[int] | None, states: frozenset[int], outside: Outside, *,
                 load: bool = True, store: bool = True, offer_blocks_per_step: int = 0,
                 describe: bool = False, min_load_tokens: int | None = None) -> None:
        self.block_size = block_size
        # A load costs its request a step (it lands asynchronously); fewer tokens are cheaper to compute
        # in the step the request is scheduled anyway. None: one block.
        self.min_load_tokens = block_size if min_load_tokens is None else min_load_tokens
        self.spans = spans
        self.load = load
        self.outside = outside
        self.describe = describe
        self.reqs: dict[str, Req] = {}
        self.lookups: dict[str, Lookup] = {}
        self.loads: list[Transfer] = []  # planned, for the next step's metadata
        self.load_block_ids: dict[str, set[int]] = {}  # loads in flight
        self.lookup_errors = 0
        # No partial-tail keys and no offers for grouped keys (yet).
        offers = offer_blocks_per_step if store and spans is None else 0
        self.stores = Stores(block_size, spans, states, self.reqs, self.lookups, outside, offers, describe)
        # This step's stores and the requests to flush before its forward (Stores.plan): one call a step.
        self.plan_stores = self.stores.plan if store else _no_stores

    def on_new_request(self, request: Any) -> None:
        self.reqs[request.request_id] = Req(request)

    # -- lookups and hits ------------------------------------------------------------------------

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool] | Lookup:
        """vLLM's get_num_new_matched_tokens: the tokens the pool holds past vLLM's own hit, and that
        they load asynchronously; ASK_AGAIN while the lookup is on its way; or a new Lookup for the
        caller to start (then `answer`)."""
        req_id = request.request_id
        rec = self.reqs.get(req_id)
        if rec is None:
            rec = self.reqs[req_id] = Req(request)
        if not self.load or rec.load_failed:
            return NO_MATCH
        start = num_computed_tokens // self.block_size
        full = len(request.block_hashes)
        # The lookup covers the whole prompt (its full blocks and its partial tail) and is asked once
        # per request: vLLM's local hit (`start`) can move between calls while blocks churn, and a
        # lookup keyed on it would be asked afresh forever.
        state = self.lookups.get(req_id)
        if state is None or state.full != full:
            if state is not None:
                self.outside.release(state)
            tail = self.stores.has_tail(request, full)
            # The most the pool could save (its every block but the last token), against what a load is
            # worth: vLLM holding the prompt but its last block, a lookup would cost the request a step.
            end = min(request.num_tokens if tail else full * self.block_size, request.num_tokens - 1)
            if end - num_computed_tokens < max(self.min_load_tokens, 1):  # does the pool hold vLLM's blocks?
                self.stores.check_pool(rec, request, min(start, full))
                return NO_MATCH
            state = self.lookups[req_id] = Lookup(full, tail)
            return state
        return self.answer(state, request, num_computed_tokens)

    def lookup_keys(self, state: Lookup, request: Any) -> list[bytes]:
        """The keys a lookup asks for (on the session's background thread): its request's first
        `state.full` blocks and its prompt's partial tail."""
        hashes = request.block_hashes[: state.full]
        if self.spans is None:
            keys = list(hashes)
        else:  # whole blocks before the last token: a Mamba state is needed exactly there
            keys = group_keys(hashes[: (request.num_tokens - 1) // self.block_size], len(self.spans))
        if state.with_tail and (tail := self.stores.tail(request)) is not None:
            keys.append(tail[0])
            state.tail = tail[1]
        state.keys = keys
        return keys

    def forget_lookup(self, req_id: str) -> None:
        """A lookup that could not be started (the session is closed)."""
        del self.lookups[req_id]

    def answer(self, state: Lookup, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        start = num_computed_tokens // self.block_size
        if not state.read:
            if not state.replied:
                return ASK_AGAIN
            self._read(state, self.reqs[request.request_id], min(start, state.full))
        state.start = start
        cached = self._cached(state, start, request.num_tokens)
        if cached <= num_computed_tokens:
            return NO_MATCH
        if cached - num_computed_tokens < self.min_load_tokens:  # recomputed, but not stored again
            self._pool_holds(self.reqs[request.request_id], state, request)
            return NO_MATCH
        return cached - num_computed_tokens, True

    def _cached(self, state: Lookup, start: int, num_tokens: int) -> int:
        """Tokens a lookup's reply lets vLLM skip, from the first (vLLM's local hit: `start` blocks)."""
        if self.spans is None:
            # Every cached token but the last: vLLM computes at least one token (a full hit loads the
            # last block whole and recomputes only its final token).
            return min(state.cached_tokens(self.block_size), num_tokens - 1)
        # Several groups: the daemon answered with the blocks every group serves by vLLM's rule (whole
        # blocks, all but the last token at most: the lookup covered no more).
        return state.hits * self.block_size

    def _read(self, state: Lookup, rec: Req, local: int) -> None:
        """Take a lookup's reply (once); `local`: the blocks vLLM holds itself, offered to the pool where
        it lacks them."""
        state.read = True
        if state.error is not None:
            self.lookup_errors += 1
            log.warning("kvstore lookup failed (%s); recomputing", state.error)
        elif not state.unavailable:  # (the session says when the sidecar goes away and comes back)
            self.stores.pool_holds(rec, local, state.hits)

    # -- loads -----------------------------------------------------------------------------------

    def allocated(self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        """vLLM's update_state_after_alloc: pair the hit's keys with the blocks vLLM allocated; a load."""
        req_id = request.request_id
        state = self.lookups.get(req_id)
        rec = self.reqs.get(req_id)
        if state is None or rec is None:
            return
        count = -(-num_external_tokens // self.block_size)  # the last one may be loaded for part of its tokens
        self._plan_load(request, block_ids, state, count)
        # Loaded full blocks need no store; a loaded tail's block does once output tokens fill it.
        rec.stored_upto = max(rec.stored_upto, min(state.start + count, len(request.block_hashes)))
        self._pool_holds(rec, state, request)
        rec.store_at = self.stores.store_at(rec, state.start * self.block_size + num_external_tokens)

    def _pool_holds(self, rec: Req, state: Lookup, request: Any) -> None:
        """The pool holds the hit's blocks, also those vLLM computes rather than loads: none is stored again."""
        tail = state.tail > 0 and state.hits == len(state.keys)
        if self.spans is None:
            rec.stored_upto = max(rec.stored_upto, min(state.hits - tail, len(request.block_hashes)))
        if tail:
            rec.tail_done = True

    def _plan_load(self, request: Any, block_ids: tuple[list[int], ...], state: Lookup, count: int) -> None:
        """A load of the hit's first `count` blocks past vLLM's own, into the blocks vLLM allocated."""
        req_id = request.request_id
        if self.spans is None:
            ids = block_ids[0][state.start : state.start + count]
            keys = list(state.keys[state.start : state.start + count])
        else:  # each group's blocks the hit needs, those vLLM allocated (it holds none out of a window)
            groups = len(self.spans)
            keys, ids = [], []
            for g, i in needed_blocks(self.spans, state.start, state.start + count):
                if block_ids[g][i]:
                    keys.append(state.keys[i * groups + g])
                    ids.append(block_ids[g][i])
        self.loads.append(Transfer(req_id, keys, list(ids)))
        self.load_block_ids[req_id] = set(ids)
        if self.describe:  # (a daemon restarted since they were stored no longer knows them)
            self.outside.describe(request, keys)

    def take_loads(self) -> list[Transfer]:
        """The loads planned since the last step, for this step's metadata: theirs from now on."""
        loads, self.loads = self.loads, []
        return loads

    def loaded(self, req_ids: Iterable[str], invalid: set[int], failed: Collection[str]) -> None:
        """These requests' loads are done; `invalid`: blocks that failed to load, `failed`: requests
        whose loads failed (several KV cache groups); those requests recompute and are never offered a
        load again."""
        for req_id in req_ids:
            state = self.lookups.pop(req_id, None)
            if state is not None:
                self.outside.release(state)
            block_ids = self.load_block_ids.pop(req_id, None)
            if req_id in failed or (invalid and block_ids and not invalid.isdisjoint(block_ids)):
                rec = self.reqs.get(req_id)
                if rec is not None:
                    rec.load_failed = True

    # -- a request's life ------------------------------------------------------------------------

    def preempted(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:  # it starts over: look it up afresh when it is back
            state = self.lookups.pop(req_id, None)
            if state is not None:
                self.outside.release(state)

    def finished(self, req_id: str) -> bool:
        """vLLM's request_finished: True when vLLM must keep the blocks until the request's stores are done."""
        if self.lookups:  # empty in most steps: a hit's lookup ends with its load
            state = self.lookups.pop(req_id, None)
            if state is not None:
                self.outside.release(state)
        if self.load_block_ids:
            self.load_block_ids.pop(req_id, None)
        rec = self.reqs.pop(req_id, None)
        return rec is not None and rec.had_stores


def _no_stores(scheduled_tokens: dict[str, int], block_state: Any) -> tuple[list[Transfer], set[str]]:
    return [], set()
