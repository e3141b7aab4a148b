"""The connector's planner (client/vllm/plan/): what it decides from plain data, in-process, with no
daemon and no vLLM. Requests and block tables are stand-ins with vLLM's attribute names; lookups are
answered by the test as the session's background thread would; `Outside` records what is sent."""

from __future__ import annotations

import types

from support.blocks import key_of

from kvstore_client.vllm.plan import Lookup, Planner, group_key

BLOCK = 16


class Outside:
    """Records the planner's decisions that leave it: leases given back, descriptions, pool questions."""

    def __init__(self) -> None:
        self.released: list[bytes] = []
        self.described: list[list[bytes]] = []
        self.asked: list[list[bytes]] = []
        self.epoch = 1

    def hash_tail(self, request, start: int, end: int) -> bytes:
        return key_of("tail", end - start)

    def pool_epoch(self) -> int:
        return self.epoch

    def release(self, lookup: Lookup) -> None:
        self.released.append(lookup.lease_id)

    def describe(self, request, keys: list[bytes]) -> None:
        self.described.append(keys)

    def ask_pool(self, rec, keys) -> None:
        self.asked.append(list(keys))


class Engine:
    """One request and what vLLM does around the planner's calls: schedules tokens, samples one token
    after each step that reaches the end of its tokens, hashes each block once it is full."""

    def __init__(self, planner: Planner, prompt_tokens: int, tables: tuple[list[int], ...] | None = None) -> None:
        self.planner = planner
        self.tables = tables or (list(range(100, 110)),)
        self.request = types.SimpleNamespace(
            request_id="r", num_prompt_tokens=prompt_tokens, num_tokens=prompt_tokens, num_computed_tokens=0,
            block_hashes=[key_of("plan", i) for i in range(prompt_tokens // BLOCK)])
        planner.on_new_request(self.request)

    def hit(self, hits: int, lease: bytes = b"lease") -> int:
        """Look the request up, the pool holding its first `hits` keys, and allocate: the tokens loaded."""
        r = self.request
        lookup = self.planner.match(r, 0)
        assert isinstance(lookup, Lookup)
        assert self.planner.answer(lookup, r, 0) == (None, False)  # vLLM asks again until the reply is in
        self.planner.lookup_keys(lookup, r)
        lookup.hits, lookup.lease_id, lookup.replied = hits, lease, True
        tokens, asynchronous = self.planner.match(r, 0)  # type: ignore[misc]
        assert asynchronous or tokens == 0
        if tokens:
            self.planner.allocated(r, self.tables, tokens)
            r.num_computed_tokens = tokens
        return tokens

    def step(self, scheduled: int, offers: dict | None = None) -> list[tuple[list[bytes], list[int], bool]]:
        r = self.request
        state = types.SimpleNamespace(get_block_ids=lambda req_id: self.tables, boundary_state_offloads=offers)
        stores, self.flush = self.planner.plan_stores({"r": scheduled}, state)
        r.num_computed_tokens += scheduled
        if r.num_computed_tokens == r.num_tokens:  # a token sampled
            r.num_tokens += 1
            if r.num_tokens % BLOCK == 0:
                r.block_hashes.append(key_of("plan", len(r.block_hashes)))
        return [(t.keys, t.block_ids, t.partial_tail) for t in stores]


def planner(spans=None, states=frozenset(), **kwargs) -> tuple[Planner, Outside]:
    outside = Outside()
    return Planner(BLOCK, spans, states, outside, **kwargs), outside


def test_full_blocks_are_stored_in_the_steps_that_complete_them() -> None:
    engine = Engine(planner()[0], 2 * BLOCK)
    keys = engine.request.block_hashes
    assert engine.step(2 * BLOCK) == [(keys[:2], [100, 101], False)]  # the prompt's blocks
    for _ in range(BLOCK - 1):  # decode steps that complete no block
        assert engine.step(1) == []
    assert engine.step(1) == [(keys[2:3], [102], False)]  # the output fills block 2
    assert engine.step(1) == []


def test_a_prompts_partial_tail_is_stored_once_then_the_block_it_grows_into() -> None:
    engine = Engine(planner()[0], 2 * BLOCK + 5)
    keys = list(engine.request.block_hashes)
    assert engine.step(2 * BLOCK) == [(keys[:2], [100, 101], False)]  # a chunk of the prompt: its full blocks
    assert engine.step(5) == [([key_of("tail", 5)], [102], True)]  # the rest: the partial tail alone
    for _ in range(BLOCK - 5 - 1):
        assert engine.step(1) == []
    assert engine.step(1) == [(engine.request.block_hashes[2:3], [102], False)]  # block 2, now full


def test_a_hit_becomes_a_load_of_its_blocks_and_every_token_but_the_last() -> None:
    plan, outside = planner()
    engine = Engine(plan, 4 * BLOCK)
    keys = list(engine.request.block_hashes)
    assert engine.hit(4) == 4 * BLOCK - 1  # vLLM computes at least the last token
    [load] = plan.take_loads()
    assert (load.keys, load.block_ids) == (keys, [100, 101, 102, 103])
    assert engine.step(1) == []  # loaded blocks are not stored again
    plan.loaded({"r"}, set(), set())
    assert outside.released == [b"lease"]  # the load is done: its lease goes back
    assert plan.finished("r") is False  # nothing stored: vLLM frees its blocks at once


def test_a_prompt_whose_blocks_vllm_holds_but_the_last_is_not_looked_up() -> None:
    """Loading the last block would save less than a block (vLLM recomputes its last token anyway):
    not worth a step, nor the lookup's (min_load_tokens, default one block)."""
    plan, outside = planner(offer_blocks_per_step=256)
    engine = Engine(plan, 4 * BLOCK)
    keys = engine.request.block_hashes
    assert plan.match(engine.request, 3 * BLOCK) == (0, False)  # at once: no lookup
    assert outside.asked == [keys[:3]]  # whether the pool holds vLLM's blocks (else they are offered)
    engine.request.num_computed_tokens = 3 * BLOCK
    assert engine.step(BLOCK) == [(keys[3:4], [103], False)]  # computed: stored (the pool keeps one copy)
    planned, _ = planner(min_load_tokens=0)  # every hit loads
    engine = Engine(planned, 4 * BLOCK)
    assert isinstance(planned.match(engine.request, 3 * BLOCK), Lookup)


def test_a_hit_that_saves_too_little_is_recomputed_and_not_stored_again() -> None:
    plan, outside = planner(min_load_tokens=2 * BLOCK)
    engine = Engine(plan, 4 * BLOCK + 5)
    r = engine.request
    lookup = plan.match(r, 2 * BLOCK)  # vLLM holds 2 blocks; the pool might save 2 more and the tail
    assert isinstance(lookup, Lookup)
    plan.lookup_keys(lookup, r)
    lookup.hits, lookup.lease_id, lookup.replied = 3, b"lease", True  # it holds one more block only
    assert plan.match(r, 2 * BLOCK) == (0, False)
    r.num_computed_tokens = 2 * BLOCK
    keys = r.block_hashes
    assert engine.step(2 * BLOCK) == [(keys[3:4], [103], False)]  # block 2 is in the pool: not stored again
    assert plan.finished("r") is True
    assert outside.released == [b"lease"]


def test_after_a_partial_hit_the_blocks_computed_next_are_stored() -> None:
    plan, _ = planner()
    engine = Engine(plan, 4 * BLOCK)
    keys = list(engine.request.block_hashes)
    assert engine.hit(2) == 2 * BLOCK
    assert engine.step(2 * BLOCK) == [(keys[2:4], [102, 103], False)]  # computed here: stored
    assert engine.step(1) == []
    assert plan.finished("r") is True  # vLLM keeps the blocks until the stores are done


def test_a_failed_load_recomputes_and_is_never_offered_again() -> None:
    plan, _ = planner()
    engine = Engine(plan, 4 * BLOCK)
    assert engine.hit(4)
    plan.take_loads()
    plan.loaded({"r"}, {101}, set())  # one of its blocks failed to load
    assert plan.match(engine.request, 0) == (0, False)


def test_leases_of_preempted_and_finished_requests_go_back_even_before_their_reply() -> None:
    plan, outside = planner()
    engine = Engine(plan, 4 * BLOCK)
    lookup = plan.match(engine.request, 0)
    assert isinstance(lookup, Lookup)
    plan.preempted(["r"])  # it starts over: looked up afresh when it is back
    assert outside.released == [b""] and not plan.lookups  # (its lease, when it comes: Outside.release's)
    assert isinstance(plan.match(engine.request, 0), Lookup)
    assert plan.finished("r") is False and len(outside.released) == 2


def test_blocks_vllm_holds_that_the_pool_lacks_are_offered_within_the_budget() -> None:
    plan, outside = planner(offer_blocks_per_step=2)
    engine = Engine(plan, 4 * BLOCK)
    engine.request.num_tokens += 1  # resumed with an output token: no partial tail to look up
    keys = list(engine.request.block_hashes)
    assert plan.match(engine.request, 4 * BLOCK) == (0, False)  # vLLM holds every full block ...
    assert outside.asked == [keys]  # ... does the pool?
    plan.stores.pool_holds(plan.reqs["r"], 4, 1)  # the reply: only the first
    assert engine.step(1) == [(keys[1:3], [101, 102], False)]  # two a step
    assert engine.step(1) == [(keys[3:4], [103], False)]
    assert engine.step(1) == []


def test_a_hybrids_windows_are_stored_per_group_and_flushed_when_vllm_frees_them() -> None:
    plan, _ = planner(spans=[0, 1])  # full attention and a one-block window
    tables = ([100, 101, 102], [200, 201, 202])
    engine = Engine(plan, 3 * BLOCK, tables)
    keys = engine.request.block_hashes
    [(stored, block_ids, tail)] = engine.step(2 * BLOCK)
    assert stored == [group_key(keys[0], 0), group_key(keys[0], 1), group_key(keys[1], 0), group_key(keys[1], 1)]
    assert (block_ids, tail) == ([100, 200, 101, 201], False)
    tables[1][0] = 0  # vLLM freed the window block out of its window
    engine.step(BLOCK)
    assert engine.flush == {"r"}  # its store must have read it before this step's forward


def test_a_hybrid_hit_loads_exactly_the_blocks_each_group_needs() -> None:
    plan, _ = planner(spans=[0, 1])
    tables = ([100, 101, 102, 103], [0, 0, 202, 203])  # vLLM holds a window group's last blocks only
    engine = Engine(plan, 4 * BLOCK + 1, tables)
    keys = engine.request.block_hashes
    assert engine.hit(4) == 4 * BLOCK  # whole blocks: every group serves the hit
    [load] = plan.take_loads()
    assert load.keys == [group_key(k, 0) for k in keys[:3]] + [group_key(keys[3], 0), group_key(keys[3], 1)]
    assert load.block_ids == [100, 101, 102, 103, 203]


def test_mamba_states_are_stored_as_vllm_offers_them_under_the_key_of_the_block_they_end() -> None:
    plan, _ = planner(spans=[0, 1], states=frozenset({1}))
    tables = ([100, 101], [0, 0])
    engine = Engine(plan, 2 * BLOCK, tables)
    keys = engine.request.block_hashes
    stored = engine.step(2 * BLOCK, offers={"r": [(1, 301, 2 * BLOCK), (1, 300, BLOCK + 3)]})
    assert stored == [([group_key(keys[0], 0), group_key(keys[1], 0)], [100, 101], False),
                      ([group_key(keys[1], 1)], [301], False)]  # (a state mid-block is no block's)
