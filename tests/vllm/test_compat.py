"""What the connector does differently on vLLM 0.23 (client/vllm/compat.py), in the parts that need no
0.23: its block tables kept from the scheduler output, its KV tensors read as per-layer tuples, the
engines it refuses. The whole connector runs on 0.23's own scheduler in test_scheduler_loop.py."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm", reason="the connector needs vllm (see .ci/run)")

import torch  # noqa: E402
from support.vllm.kv_caches import SPEC, plan  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402

from kvstore_client.vllm import compat  # noqa: E402


def step(new=(), cached=(), resumed=(), finished=(), preempted=()) -> types.SimpleNamespace:
    """A scheduler output as 0.23 makes it: new requests' tables, cached requests' new blocks."""
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, block_ids=ids) for r, ids in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[r for r, _ in cached],
                                                    new_block_ids=[ids for _, ids in cached],
                                                    resumed_req_ids=set(resumed)),
        finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def test_block_tables_follow_what_the_scheduler_allocates() -> None:
    tables = compat.BlockTables()
    tables.update(step(new=[("a", ([1, 2],)), ("b", ([3],))]))
    assert tables.get_block_ids("a") == ([1, 2],) and tables.boundary_state_offloads is None
    tables.update(step(cached=[("a", ([7],)), ("b", None)]))  # a grows; b got no new block
    assert (tables.get_block_ids("a"), tables.get_block_ids("b")) == (([1, 2, 7],), ([3],))
    tables.update(step(preempted=["a"], finished=["b"]))
    assert tables.get_block_ids("a") is None and tables.get_block_ids("b") is None
    tables.update(step(cached=[("a", ([9, 4],))], resumed=["a"]))  # resumed: a table anew
    assert tables.get_block_ids("a") == ([9, 4],)


def test_kv_tensors_are_read_as_per_layer_tuples_with_blocks_first() -> None:
    blocks = 7
    cpu = torch.zeros(blocks, 2, 16, 16)  # 0.23's CPU layout: blocks, heads, tokens, K and V
    cuda_like = torch.zeros(2, blocks, 16, 2, 8)  # K and V stacked in front
    ascend = (torch.zeros(blocks, 16, 2, 8), torch.zeros(blocks, 16, 2, 8))
    out = compat.as_layer_tuples({"cpu": cpu, "cuda": cuda_like, "npu": ascend}, blocks)
    assert [t.shape[0] for t in out["cpu"]] == [blocks]
    assert [t.data_ptr() for t in out["cuda"]] == [cuda_like[0].data_ptr(), cuda_like[1].data_ptr()]
    assert out["npu"] == ascend


def test_on_the_0_23_generation_engines_it_cannot_serve_are_refused_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr(compat, "LAYOUTS", False)
    one_group = plan("LBHNC", 2)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert "unless PYTHONHASHSEED is an integer" in compat.unsupported(one_group)
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    assert "PYTHONHASHSEED" in compat.unsupported(one_group)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert compat.unsupported(one_group) == ""
    assert compat.namespace_parts() == ["hash_seed=0"]
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=32)
    hybrid = plan("LBHNC", 2, groups=[KVCacheGroupSpec(["a"], SPEC), KVCacheGroupSpec(["b"], window)])
    assert "one full-attention (or MLA) KV cache group is served" in compat.unsupported(hybrid)
    lora = types.SimpleNamespace(lora_request=object())
    assert compat.uncacheable(lora) and not compat.uncacheable(types.SimpleNamespace(lora_request=None))


def test_on_the_current_generation_nothing_is_refused_or_added(monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert compat.LAYOUTS and compat.unsupported(plan("LBHNC", 2)) == "" and compat.namespace_parts() == []
    assert not compat.uncacheable(types.SimpleNamespace(lora_request=object()))
