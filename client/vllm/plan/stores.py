"""Which blocks to store, step by step: full blocks as a forward completes them, a prompt's partial tail
in the step that finishes the prompt, sliding-window blocks and Mamba states before vLLM reuses them,
and blocks vLLM holds that the pool lacks (offers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore_client.vllm.plan.keys import group_key, group_keys
from kvstore_client.vllm.plan.records import Lookup, Req, Transfer

if TYPE_CHECKING:
    from kvstore_client.vllm.plan.planner import Outside

# Keys the pool holds as far as this planner knows (the last key of each prefix it stored, found, or
# offered), kept until the session re-registers (a new daemon may have an empty pool): at most this
# many, oldest dropped first.
KNOWN_KEYS = 65536


class Stores:
    def __init__(self, block_size: int, spans: list[int] | None, states: frozenset[int], reqs: dict[str, Req],
                 lookups: dict[str, Lookup], outside: Outside, offer_blocks_per_step: int, describe: bool) -> None:
        self.block_size = block_size
        self.spans = spans
        self.states = states
        self.reqs = reqs  # the planner's
        self.lookups = lookups  # the planner's: a tail's key is the one its lookup hashed
        self.outside = outside
        self.offer_blocks_per_step = offer_blocks_per_step
        self.describe = describe
        self.known: dict[bytes, None] = {}  # see KNOWN_KEYS
        self.known_epoch = 0
        self.offers: list[Req] = []  # requests with blocks to offer (appended by the background thread too)

    def plan(self, scheduled_tokens: dict[str, int], block_state: Any) -> tuple[list[Transfer], set[str]]:
        """This step's stores, and the requests whose stores must finish before its forward (flush):
        `block_state` is vLLM's (get_block_ids, boundary_state_offloads)."""
        stores: list[Transfer] = []
        flush: set[str] = set()
        if block_state is None:
            return stores, flush
        reqs = self.reqs
        for req_id, scheduled in scheduled_tokens.items():
            rec = reqs.get(req_id)
            if rec is None:
                continue
            if rec.volatile and self.volatile_freed(rec, block_state):
                flush.add(req_id)
            if rec.request.num_computed_tokens + scheduled >= rec.store_at:
                self._plan_request(rec, scheduled, block_state, stores)
        if self.states and block_state.boundary_state_offloads:
            self._plan_states(block_state.boundary_state_offloads, stores)
        if self.offers:
            self._plan_offers(block_state, stores)
        return stores, flush

    def volatile_freed(self, rec: Req, block_state: Any) -> bool:
        """Whether vLLM freed a sliding-window block of the request's stores (it left the window) this step:
        another request may be given it, so the stores must have read it before this step's forward. Then
        the request's stores so far are waited for: forget them."""
        ids = block_state.get_block_ids(rec.request.request_id)
        volatile = rec.volatile
        assert volatile is not None
        if ids is not None and all(i < len(ids[g]) and ids[g][i] == b for g, i, b in volatile):
            return False
        rec.volatile = None
        return True

    def _plan_request(self, rec: Req, scheduled: int, block_state: Any, stores: list[Transfer]) -> None:
        """The blocks of a request whose KV this step's forward completes: full blocks (most steps:
        none new), and the prompt's partial tail in the step that finishes the prompt."""
        request, size = rec.request, self.block_size
        computed = request.num_computed_tokens
        first = rec.stored_upto
        if first < 0:  # blocks vLLM had cached locally when the request arrived
            first = rec.stored_upto = computed // size
        done = (computed + scheduled) // size
        prompt = request.num_prompt_tokens
        tail = computed < prompt <= computed + scheduled and prompt % size != 0 and not rec.tail_done
        if done <= first and not tail:
            rec.store_at = self.store_at(rec, computed + scheduled)
            return
        done = min(done, len(request.block_hashes))  # ... and hashed
        req_id = request.request_id
        ids = block_state.get_block_ids(req_id)
        if ids is None:
            return
        if self.spans is not None:
            keys, block_ids = self._group_blocks(rec, ids, first, done)
        else:
            keys = list(request.block_hashes[first:done])
            block_ids = list(ids[0][first:done])
        tail_key = self.tail_key(request) if tail else None
        if tail_key is not None:
            keys.append(tail_key)
            block_ids.append(ids[0][prompt // size])
            rec.tail_done = True
        if keys:
            stores.append(Transfer(req_id, keys, block_ids, tail_key is not None))
            rec.had_stores = True
            if self.describe:
                self.outside.describe(request, keys[:len(keys) - (tail_key is not None)])
            if done > first:
                self.remember(request.block_hashes[done - 1])
        rec.stored_upto = max(first, done)
        rec.store_at = self.store_at(rec, computed + scheduled)

    def _group_blocks(self, rec: Req, ids: tuple[list[int], ...], first: int,
                      done: int) -> tuple[list[bytes], list[int]]:
        """Keys and block ids of blocks [first, done) in every group (all in vLLM's tables: they were just
        computed); the sliding-window ones are remembered as volatile. Mamba states are not per block: see
        _plan_states."""
        assert self.spans is not None
        groups = len(self.spans)
        keys = group_keys(rec.request.block_hashes[first:done], groups)
        out_keys, block_ids = [], []
        for i in range(first, done):
            for g, span in enumerate(self.spans):
                block = ids[g][i] if i < len(ids[g]) else 0
                if not block or g in self.states:
                    continue
                out_keys.append(keys[(i - first) * groups + g])
                block_ids.append(block)
                if span:
                    _volatile(rec, g, i, block)
        return out_keys, block_ids

    def _plan_states(self, offers: dict[str, list[tuple[int, int, int]]], stores: list[Transfer]) -> None:
        """Stores of the Mamba states vLLM offers (boundary_state_offloads: group, block id, tokens before
        it), each under the key of the block it ends: computed by this step's forward and held by vLLM
        only until the next (a flush)."""
        size = self.block_size
        for req_id, offered in offers.items():
            rec = self.reqs.get(req_id)
            if rec is None:
                continue
            hashes = rec.request.block_hashes
            keys, block_ids = [], []
            for g, block, tokens in offered:
                i = tokens // size - 1
                if g not in self.states or tokens % size or not 0 <= i < len(hashes):
                    continue
                keys.append(group_key(hashes[i], g))
                block_ids.append(block)
                _volatile(rec, g, i, block)
            if keys:
                stores.append(Transfer(req_id, keys, block_ids))
                rec.had_stores = True
                if self.describe:
                    self.outside.describe(rec.request, keys)

    def store_at(self, rec: Req, computed: int) -> int:
        """With `computed` tokens computed: the count (a step's tokens included) that completes the
        request's next block to store, its next full block or its prompt's partial tail. Below it
        _plan_request has nothing to do (most steps)."""
        size, prompt = self.block_size, rec.request.num_prompt_tokens
        next_block = (rec.stored_upto + 1) * size
        if computed < prompt and prompt % size and not rec.tail_done:
            return min(next_block, prompt)
        return next_block

    # -- a prompt's partial tail -----------------------------------------------------------------

    def has_tail(self, request: Any, full: int) -> bool:
        """A fresh prompt (one key space: no groups) of `full` full blocks has a partial last block."""
        end = request.num_prompt_tokens
        return (self.spans is None and request.num_tokens == end
                and 0 < end - full * self.block_size < self.block_size)

    def tail(self, request: Any) -> tuple[bytes, int] | None:
        """(key, tokens) of a fresh prompt's partial last block: the hash vLLM's block hasher would give
        it (Outside.hash_tail). Its token tuple is shorter than a full block's, so it never equals one's key."""
        full = len(request.block_hashes)
        if not self.has_tail(request, full):
            return None  # no partial tail, or not a fresh prompt (resumed with output tokens)
        start, end = full * self.block_size, request.num_prompt_tokens
        return self.outside.hash_tail(request, start, end), end - start

    def tail_key(self, request: Any) -> bytes | None:
        """The key of the prompt's partial last block: the one its lookup hashed, if it had one."""
        state = self.lookups.get(request.request_id)
        if state is not None and state.read and state.tail:
            return state.keys[-1]
        tail = self.tail(request)
        return tail[0] if tail is not None else None

    # -- offers: blocks vLLM holds and the pool lacks --------------------------------------------

    def knows(self, key: bytes) -> bool:
        epoch = self.outside.pool_epoch()
        if self.known_epoch != epoch:  # a new daemon: forget
            self.known.clear()
            self.known_epoch = epoch
        return key in self.known

    def remember(self, key: bytes) -> None:
        known = self.known
        known[key] = None
        if len(known) > KNOWN_KEYS:
            del known[next(iter(known))]

    def check_pool(self, rec: Req, request: Any, local: int) -> None:
        """vLLM serves the request's first `local` blocks itself: unless the planner knows the pool
        holds them, ask (Outside.ask_pool, answered through pool_holds) and offer what it lacks."""
        if not self.offer_blocks_per_step or not local or rec.pool_has >= 0 or rec.local:
            return
        keys = request.block_hashes[:local]
        rec.local = local
        if self.knows(keys[-1]):
            rec.pool_has = local
            return
        self.outside.ask_pool(rec, keys)

    def pool_holds(self, rec: Req, local: int, hits: int) -> None:
        rec.local = local
        rec.pool_has = hits
        if hits < local and self.offer_blocks_per_step:
            self.offers.append(rec)

    def _plan_offers(self, block_state: Any, stores: list[Transfer]) -> None:
        """Stores of blocks vLLM served from its own cache that the pool lacks: for requests scheduled
        this step (their block ids are at hand), at most `offer_blocks_per_step` blocks in all."""
        budget = self.offer_blocks_per_step
        keep: list[Req] = []
        for rec in self.offers:
            req_id = rec.request.request_id
            if self.reqs.get(req_id) is not rec:
                continue  # finished: its blocks are vLLM's again
            ids = block_state.get_block_ids(req_id)
            if ids is None or not budget:
                keep.append(rec)
                continue
            first = rec.pool_has
            end = min(rec.local, first + budget)
            keys: list[bytes] = list(rec.request.block_hashes[first:end])
            stores.append(Transfer(req_id, keys, list(ids[0][first:end])))
            if self.describe:
                self.outside.describe(rec.request, keys)
            self.remember(keys[-1])
            rec.had_stores = True
            rec.pool_has = end
            budget -= end - first
            if end < rec.local:
                keep.append(rec)
        self.offers = keep


def _volatile(rec: Req, g: int, i: int, block: int) -> None:
    if rec.volatile is None:
        rec.volatile = []
    rec.volatile.append((g, i, block))
