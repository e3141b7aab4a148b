"""The connector's time per engine step, each hook and each side, under vLLM's real scheduler: no model.

    python benchmarks/bench_connector_steps.py [--steps 400 --running 16 --prompt-tokens 192 --reuse 0.5]

The scheduler-loop harness (tests/support/vllm/scheduler_loop.py: vLLM's v1 Scheduler, both connector roles,
a real daemon, KV memory from vLLM's allocator on CPU, a stand-in forward) runs a steady mixed workload:
`--running` requests decoding, each replaced when it finishes by a new prompt, which with probability `--reuse`
repeats an earlier one (vLLM's small KV cache has evicted most of them: the pool serves them, a load). Every
connector hook vLLM calls is timed (the scheduler's, and the worker's per-step calls); the table gives p50/p99
per call and the sum per step of each side, over `--steps` steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups", "take_events")
WORKER_HOOKS = ("handle_preemptions", "bind_connector_metadata", "has_connector_metadata", "start_load_kv",
                "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results",
                "get_block_ids_with_load_errors", "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
                "build_connector_worker_meta", "clear_connector_metadata")


def timed(obj: object, names: tuple[str, ...], side: str, calls: list[tuple[str, str, float]]) -> None:
    """Wrap each method of `obj` named in `names`: every call appends (side, name, seconds) to `calls`."""
    for name in names:
        real = getattr(obj, name)

        def wrapper(*args: Any, _real: Any = real, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _real(*args)
            finally:
                calls.append((side, _name, time.perf_counter() - start))

        setattr(obj, name, wrapper)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--running", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=192)
    p.add_argument("--reuse", type=float, default=0.5, help="share of new prompts that repeat an earlier one")
    a = p.parse_args()
    from support.daemon import DaemonProcess
    from support.vllm.scheduler_loop import BLOCK, Loop

    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-steps-"))
    daemon = DaemonProcess(tmp / "daemon", "256MiB", "4MiB").start()
    rng = random.Random(0)
    per_request = -(-(a.prompt_tokens + 128) // BLOCK)
    # A KV cache a little larger than the running requests need: earlier prompts are evicted, the pool serves them.
    loop = Loop(daemon.socket, tmp / "loop", num_blocks=a.running * per_request + 4 * per_request,
                max_batched_tokens=2048)
    calls: list[tuple[str, str, float]] = []
    timed(loop.connector, SCHEDULER_HOOKS, "scheduler", calls)
    timed(loop.worker, WORKER_HOOKS, "worker", calls)
    prompts: list[list[int]] = []
    made = 0

    def add() -> None:
        nonlocal made
        if prompts and rng.random() < a.reuse:
            tokens = rng.choice(prompts)
        else:
            tokens = [rng.randrange(10, 1000) for _ in range(a.prompt_tokens + rng.randrange(BLOCK))]
            prompts.append(tokens)
        loop.add(f"r{made}", tokens, max_tokens=rng.randrange(16, 128))
        made += 1

    per_step: dict[str, list[float]] = defaultdict(list)
    jobs, first = [0, 0], 0  # load and store jobs; the first measured call
    try:
        for step in range(a.warmup + a.steps):
            while loop.scheduler.get_num_unfinished_requests() < a.running:
                add()
            mark = len(calls)
            if step == a.warmup:
                first = mark
            loop.step()
            if step < a.warmup:
                continue
            for side in ("scheduler", "worker"):
                per_step[side].append(sum(dt for s, _, dt in calls[mark:] if s == side))
            loads, stores = loop.jobs[-1]
            jobs[0] += len(loads)
            jobs[1] += len(stores)
    finally:
        loop.close()
        daemon.cleanup()
    by_hook: dict[tuple[str, str], list[float]] = defaultdict(list)
    for side, name, dt in calls[first:]:
        by_hook[side, name].append(dt)
    print(f"{a.steps} steps ({a.warmup} warmup), {a.running} running, prompts {a.prompt_tokens} tokens, reuse "
          f"{a.reuse}: {made} requests, {jobs[0]} load and {jobs[1]} store jobs in the measured steps")
    print(f"{'hook':<38}{'calls':>8}{'p50 us':>10}{'p99 us':>10}")
    for (side, name), values in sorted(by_hook.items()):
        print(f"{side[0]}: {name:<35}{len(values):>8}{1e6 * pct(values, 0.5):>10.1f}{1e6 * pct(values, 0.99):>10.1f}")
    for side, values in per_step.items():
        print(f"{'per step, ' + side + ' side':<38}{len(values):>8}{1e6 * statistics.median(values):>10.1f}"
              f"{1e6 * pct(values, 0.99):>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
