"""The connector's cost per forward step in the engine that hits (B), and its TTFT, A/B between two
checkouts, one run.

    python benchmarks/bench_per_step_ab.py --base /tmp/base-checkout [--tokens 2049 --prompts 12 --rounds 3]

`--base` is another checkout of this repository (e.g. `git worktree add /tmp/base HEAD~1`); its
`client/` is imported as `kvstore_client` in the "base" engines, the working tree's in the "new" ones.
The benchmark's engine A (timed connector, `bench_vllm.py`'s TTFT workload, single-process) stores the
prompts once; then fresh B engines, alternating base/new (the order flips each round), load them and
report the connector's time per forward step (`timed_connector.py`: the sum of every connector call
vLLM makes in the step). Same daemon and machine state for both: the figure to compare code changes by
on this noisy machine, where separate runs of `bench_vllm.py` differ by more than a change does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import bench_vllm as bv


def main() -> int:
    p = argparse.ArgumentParser(description="The connector's per-step cost in B, A/B between two checkouts")
    p.add_argument("--base", type=Path, required=True, help="another checkout of this repository")
    p.add_argument("--tokens", type=int, default=2049)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-ab-"))
    shim = work / "base"  # on PYTHONPATH in the base engines: kvstore_client -> the base checkout's client/
    shim.mkdir()
    (shim / "kvstore_client").symlink_to((a.base / "client").resolve())
    args = bv.parse_args(["--prompts", str(a.prompts)])
    sys.path.insert(0, str(bv.TESTS))
    from support.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(args.model_dir, size="bench")
    daemon = bv.BenchDaemon(work, args.pool_size).start()
    pythonpath = os.environ.get("PYTHONPATH", "")
    runs: dict[str, list[float]] = {"base": [], "new": []}
    ttfts: dict[str, list[float]] = {"base": [], "new": []}  # each engine's p50 TTFT on its hits
    try:
        bench = bv.Bench(args, model, daemon, work)
        run = bv.ttft_run("ab", a.prompts, a.tokens)
        bench.engine("a_store", True, **run)
        for r in range(a.rounds):
            for v in ("base", "new") if r % 2 == 0 else ("new", "base"):
                os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim) if v == "base" else "",
                                                                         pythonpath]))
                engine = bench.engine(f"b_{v}_{r}", True, **run)
                s = bv.step_summary([engine["steps"]])["forward"]
                runs[v].append(s["conn_p50_us"])
                ttfts[v].append(statistics.median(q["ttft_s"] for q in engine["requests"]) * 1e3)
                methods = ", ".join(f"{k} {m['p50_us']:.1f}" for k, m in s["methods_per_step"].items())
                print(f"{v} round {r}: TTFT p50 {ttfts[v][-1]:.1f} ms; connector p50 {s['conn_p50_us']:.1f} µs "
                      f"(scheduler {s['sched_p50_us']:.1f}, worker "
                      f"{s['worker_p50_us']:.1f}; {s['steps']} forward steps)\n    {methods}", flush=True)
    finally:
        os.environ["PYTHONPATH"] = pythonpath
        daemon.cleanup()
    for v, values in runs.items():
        print(f"{v}: connector p50 per run {[round(x, 1) for x in values]} µs, median {statistics.median(values):.1f}; "
              f"TTFT p50 per run {[round(x, 1) for x in ttfts[v]]} ms, median {statistics.median(ttfts[v]):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
