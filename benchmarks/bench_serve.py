"""`vllm serve` with and without the kvstore connector, measured by vLLM's own `vllm bench serve`.

    python benchmarks/bench_serve.py [--pairs 3] [--workloads restart,none,vllm] [--concurrency 1,4,16]
        [--prompts 32] [--input-len 1024] [--output-len 16] [--prefix-len 896] [--suffix-len 128]
        [--num-prefixes 4] [--model-size tiny]
        [--threads-bind CPUS|auto] [--kv-cache-bytes 512MiB] [--pool-size 2GiB] [--workdir DIR] [--json FILE]

vLLM's OpenAI server (`python -m kvstore_client.vllm.cpu_cli serve`, tests/support/vllm/serve.py) on a
random Llama built offline (tests/support/vllm/tiny_model.py; "tiny" by default, "bench" is ~100M
parameters), driven by vLLM's `bench serve` (`--backend vllm`, /v1/completions, greedy, EOS ignored,
no request-rate limit) at each `--concurrency`, on three workloads:

  none     no reuse: `random` prompts of --input-len tokens, new ones every run;
  vllm     full reuse inside vLLM: `prefix_repetition` (--num-prefixes prefixes of --prefix-len tokens,
           --suffix-len tokens each prompt's own), run once to warm the server up, then measured on
           the same prompts: vLLM's own prefix cache holds every prompt, the sidecar has nothing to add;
  restart  `random` prompts served once by a server X (the warm-up pass), X stopped, then the same
           prompts measured on a fresh server Y on the same daemon: Y's prefix cache is empty, so only
           the sidecar can serve them (without the connector, Y computes them all).

Configurations: "off" (no connector) and "on" (the connector, a fresh daemon per round), run as
interleaved pairs (off on off on ...): each pair measures both on the same requests, and the ratios
on/off are taken within a pair, then their median over the pairs. Every server gets the same OpenMP
thread binding (`--threads-bind`, VLLM_CPU_OMP_THREADS_BIND; default: the first CPU this process may
use): on CPU, vLLM reserves a core for a KV connector, so left to itself ("auto") it binds a server
with the connector differently from one without (on 2 cores: both cores against core 0). "off" runs
no warm-up server X (its Y is as fresh as "on"'s). Per configuration: req/s and TTFT mean / p50 (ms)
from `bench serve`'s results. The benchmark runs `bench serve` in its own process through the
launcher (`cpu_cli.main()` with the `bench serve ...` arguments, vLLM's CLI unchanged), so vLLM is
imported once, not once per run. Takes ~15-20 min with the defaults on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_common import parse_bytes  # (benchmarks/, the script's folder, is on sys.path)

BENCH_DIR = Path(__file__).resolve().parent
TESTS = BENCH_DIR.parent / "tests"  # the `support` package, shared with the tests
WORKLOADS = ("none", "vllm", "restart")
CONFIGS = ("off", "on")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Bench:
    def __init__(self, args: argparse.Namespace, model: Path, workdir: Path) -> None:
        self.args = args
        self.model = model
        self.workdir = workdir
        self.runs = 0
        # `bench serve`'s report goes here; kept open: vLLM's log handler keeps the stream it was set up with
        self.out = open(workdir / "bench-serve.out", "a")  # noqa: SIM115 - closed by close()

    def close(self) -> None:
        self.out.close()

    # -- one `vllm bench serve` run ----------------------------------------------------------

    def dataset(self, workload: str, seed: int) -> list[str]:
        a = self.args
        if workload == "vllm":
            return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_len),
                    "--prefix-repetition-suffix-len", str(a.suffix_len),
                    "--prefix-repetition-num-prefixes", str(a.num_prefixes),
                    "--prefix-repetition-output-len", str(a.output_len), "--seed", str(seed)]
        return ["--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
                str(a.output_len), "--random-range-ratio", "0", "--seed", str(seed)]

    def bench_serve(self, server: Any, workload: str, seed: int, concurrency: int) -> dict[str, Any]:
        """vLLM's `bench serve` through the launcher, in this process; its JSON result."""
        from kvstore_client.vllm import cpu_cli

        self.runs += 1
        name = f"run{self.runs:03d}-{workload}-c{concurrency}.json"
        argv = ["bench", "serve", "--backend", "vllm", "--base-url", server.url, "--model", str(self.model),
                "--tokenizer", str(self.model), "--endpoint", "/v1/completions", "--num-prompts",
                str(self.args.prompts), "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature",
                "0", "--ready-check-timeout-sec", "0", "--disable-tqdm", "--percentile-metrics", "ttft",
                "--metric-percentiles", "50", "--save-result", "--result-dir", str(self.workdir),
                "--result-filename", name, *self.dataset(workload, seed)]
        saved = sys.argv
        sys.argv = ["vllm", *argv]
        try:
            with contextlib.redirect_stdout(self.out):
                cpu_cli.main()
        finally:
            sys.argv = saved
        result = json.loads((self.workdir / name).read_text())
        if result["completed"] != self.args.prompts:
            raise RuntimeError(f"{name}: {result['completed']} of {self.args.prompts} requests completed")
        return result

    # -- one round: one configuration, every workload and concurrency ------------------------

    def server(self, name: str, connector: str | None) -> Any:
        from support.vllm.serve import VllmServer

        a = self.args
        return VllmServer(self.model, self.workdir / f"{name}.log", threads_bind=a.threads_bind,
                          kv_transfer_config=connector, max_model_len=a.max_model_len,
                          kv_cache_bytes=parse_bytes(a.kv_cache_bytes))

    def round(self, pair: int, config: str) -> dict[str, Any]:
        from support.daemon import DaemonProcess
        from support.vllm.serve import connector_config

        def seed(workload: str, concurrency: int) -> int:  # the same requests for both configurations of a pair
            return 1000 * pair + 100 * WORKLOADS.index(workload) + concurrency

        tag = f"p{pair}-{config}"
        results: dict[str, Any] = {}
        daemon = None
        try:
            connector = None
            if config == "on":
                daemon = DaemonProcess(self.workdir / f"daemon-{tag}", self.args.pool_size, "64MiB", "--fresh")
                daemon.start()
                connector = connector_config(daemon.socket)
            if daemon is not None and "restart" in self.args.workloads:
                with self.server(f"{tag}-x", connector) as x:  # the warm-up pass of the restart workload
                    for c in self.args.concurrency:
                        self.bench_serve(x, "restart", seed("restart", c), max(self.args.concurrency))
            with self.server(f"{tag}-y", connector) as y:
                binding = thread_binding(y.log)
                for c in self.args.concurrency:
                    for workload in self.args.workloads:
                        if workload == "vllm":  # the warm-up pass: afterwards vLLM's cache holds every prompt
                            self.bench_serve(y, workload, seed(workload, c), max(self.args.concurrency))
                        r = self.bench_serve(y, workload, seed(workload, c), c)
                        results[f"{workload}/c{c}"] = {"req_s": r["request_throughput"],
                                                       "ttft_mean_ms": r["mean_ttft_ms"],
                                                       "ttft_p50_ms": r["median_ttft_ms"]}
                metrics = y.metrics()
            out: dict[str, Any] = {"pair": pair, "config": config, "results": results, "thread_binding": binding,
                                   "external_prefix_cache_hits": metrics.get("vllm:external_prefix_cache_hits_total",
                                                                             0.0),
                                   "prefix_cache_hits": metrics.get("vllm:prefix_cache_hits_total", 0.0)}
            if daemon is not None:
                client = daemon.client()
                try:
                    s = client.stats()
                finally:
                    client.close()
                out["daemon"] = {"stored_blocks": s.stored_blocks, "loaded_blocks": s.loaded_blocks,
                                 "hits": s.hits, "misses": s.misses, "evictions": s.evictions,
                                 "failed_blocks": s.failed_blocks}
            return out
        finally:
            if daemon is not None:
                daemon.cleanup()


def thread_binding(log: Path) -> str:
    """What the worker's OpenMP threads were bound to, as vLLM logs it ("core ids=[0]")."""
    found = re.findall(r"core ids=(\[[^\]]*\])", log.read_text(errors="replace"))
    return found[-1] if found else "?"


# -- report ------------------------------------------------------------------------------------


def summarize(rounds: list[dict[str, Any]], pairs: int, keys: list[str]) -> dict[str, Any]:
    by = {(r["pair"], r["config"]): r["results"] for r in rounds}
    out: dict[str, Any] = {}
    for key in keys:
        rows = []
        for p in range(pairs):
            off, on = by[(p, "off")][key], by[(p, "on")][key]
            rows.append({"off": off, "on": on, "ratio": {m: on[m] / off[m] if off[m] else float("nan")
                                                         for m in ("req_s", "ttft_mean_ms", "ttft_p50_ms")}})
        median = {m: statistics.median(row["ratio"][m] for row in rows) for m in ("req_s", "ttft_mean_ms",
                                                                                  "ttft_p50_ms")}
        out[key] = {"pairs": rows, "median_ratio": median}
    return out


def print_report(summary: dict[str, Any], rounds: list[dict[str, Any]]) -> None:
    print()
    print("per configuration: req/s, TTFT mean / p50 (ms); ratio on/off within the pair")
    header = (f"{'workload':<9}{'conc':>5}{'pair':>5} | {'off req/s':>9} {'TTFT mean':>9} {'p50':>7} | "
              f"{'on req/s':>9} {'TTFT mean':>9} {'p50':>7} | {'req/s':>6} {'mean':>6} {'p50':>6}")
    print(header)
    print("-" * len(header))
    for key, s in summary.items():
        workload, c = key.split("/c")
        for p, row in enumerate(s["pairs"]):
            off, on, ratio = row["off"], row["on"], row["ratio"]
            print(f"{workload:<9}{c:>5}{p:>5} | {off['req_s']:>9.2f} {off['ttft_mean_ms']:>9.1f} "
                  f"{off['ttft_p50_ms']:>7.1f} | {on['req_s']:>9.2f} {on['ttft_mean_ms']:>9.1f} "
                  f"{on['ttft_p50_ms']:>7.1f} | {ratio['req_s']:>6.2f} {ratio['ttft_mean_ms']:>6.2f} "
                  f"{ratio['ttft_p50_ms']:>6.2f}")
        m = s["median_ratio"]
        print(f"{workload:<9}{c:>5}{'med':>5} | {'':>27} | {'':>27} | {m['req_s']:>6.2f} {m['ttft_mean_ms']:>6.2f} "
              f"{m['ttft_p50_ms']:>6.2f}")
    print()
    for r in rounds:
        extra = f", daemon {r['daemon']}" if "daemon" in r else ""
        print(f"pair {r['pair']} {r['config']:>3}: worker threads bound to {r['thread_binding']}, "
              f"vLLM prefix-cache hits {r['prefix_cache_hits']:.0f} tokens, external (sidecar) "
              f"{r['external_prefix_cache_hits']:.0f}{extra}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="off/on pairs, interleaved")
    p.add_argument("--workloads", type=lambda text: [w for w in ("restart", "none", "vllm") if w in text.split(",")],
                   default=["restart", "none", "vllm"], help=f"comma-separated, of {','.join(WORKLOADS)}")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="comma-separated")
    p.add_argument("--prompts", type=int, default=32, help="requests per `bench serve` run")
    p.add_argument("--input-len", type=int, default=1024, help="none, restart: prompt tokens")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=896, help="vllm: shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=128, help="vllm: each prompt's own tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="vllm: distinct prefixes")
    p.add_argument("--model-size", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", default="512MiB", help="each server's KV cache")
    p.add_argument("--pool-size", default="2GiB", help="the daemon's pool")
    p.add_argument("--threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND for every server (default: the first CPU we may use; "
                        "'auto': vLLM's own choice, which differs with and without a connector)")
    p.add_argument("--model-dir", help="where the model is built (default: a temp dir)")
    p.add_argument("--workdir", help="server logs and `bench serve` results (default: a temp dir, removed)")
    p.add_argument("--json", help="write every number to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(TESTS))
    from support.vllm.serve import first_cpu
    from support.vllm.tiny_model import build_tiny_model

    if args.threads_bind is None:
        args.threads_bind = first_cpu()
    temp = None if args.workdir else tempfile.mkdtemp(prefix="bench-serve-")
    workdir = Path(args.workdir or temp or ".")
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(Path(args.model_dir or workdir) / f"model-{args.model_size}", size=args.model_size)
    print(f"bench_serve: model {args.model_size}, {args.pairs} pairs, concurrency {args.concurrency}, "
          f"{args.prompts} requests a run, input {args.input_len} / output {args.output_len} tokens, "
          f"prefix_repetition {args.num_prefixes} x {args.prefix_len} + {args.suffix_len}, "
          f"VLLM_CPU_OMP_THREADS_BIND={args.threads_bind}", flush=True)
    bench = Bench(args, model, workdir)
    rounds = []
    started = time.monotonic()
    try:
        for pair in range(args.pairs):
            for config in CONFIGS:
                t0 = time.monotonic()
                rounds.append(bench.round(pair, config))
                print(f"pair {pair} {config}: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        bench.close()
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    keys = [f"{w}/c{c}" for w in WORKLOADS if w in args.workloads for c in args.concurrency]
    summary = summarize(rounds, args.pairs, keys)
    print_report(summary, rounds)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
