"""bench_vllm.py's sections 3 (throughput at 0% reuse, connector off/on engines alternating) and 3b (the
same inside one connector engine, its lookups and stores switched off/on round by round)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from vllm_common import pct, random_prompts, spread

if TYPE_CHECKING:
    from vllm_ttft import Bench


def throughput(bench: Bench) -> dict[str, Any]:
    a = bench.args
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(a.repeats):
        prompts = random_prompts(2000 + r, a.tput_prompts, a.tput_tokens)
        for mode in ("off", "on"):
            warmup = [random_prompts(3000 + 2 * r + (mode == "on"), 2, a.tput_tokens)]
            before, cpu = bench.daemon.stats(), bench.daemon.cpu_s()
            res = bench.engine(f"tput_{r}_{mode}", mode == "on", prompts=prompts, mode="batch",
                               max_tokens=a.tput_output, warmup=warmup, warmup_tokens=4)
            after = bench.daemon.stats()
            res["daemon_cpu_s"] = bench.daemon.cpu_s() - cpu  # the whole engine run, start to exit
            b = res["batch"]
            res["tokens_per_s"] = (b["prompt_tokens"] + b["output_tokens"]) / b["generate_s"]
            res["tokens_per_cpu_s"] = (b["prompt_tokens"] + b["output_tokens"]) / b["cpu_s"]
            res["output_tokens_per_s"] = b["output_tokens"] / b["generate_s"]
            res["daemon_stored_blocks"] = after["stored_blocks"] - before["stored_blocks"]
            runs[mode].append(res)
    off = [x["tokens_per_s"] for x in runs["off"]]
    on = [x["tokens_per_s"] for x in runs["on"]]
    off_cpu = [x["tokens_per_cpu_s"] for x in runs["off"]]
    on_cpu = [x["tokens_per_cpu_s"] for x in runs["on"]]
    pair_ratios = [y / x for x, y in zip(off, on, strict=True)]
    return {
        "workload": f"{a.tput_prompts} x {a.tput_tokens} prompt tokens + {a.tput_output} output tokens, batch",
        "tokens_per_s_off": spread(off), "tokens_per_s_on": spread(on),
        "cost_pct_median": 100 * (1 - pct(on, 50) / pct(off, 50)),
        "cost_pct_pairwise_median": 100 * (1 - pct(pair_ratios, 50)),
        "cost_pct_mean": 100 * (1 - statistics.fmean(on) / statistics.fmean(off)),
        "pair_ratios_on_over_off": pair_ratios,
        "tokens_per_engine_cpu_s_off": spread(off_cpu), "tokens_per_engine_cpu_s_on": spread(on_cpu),
        "engine_cpu_cost_pct_median": 100 * (1 - pct(on_cpu, 50) / pct(off_cpu, 50)),
        "daemon_cpu_s_on": [x["daemon_cpu_s"] for x in runs["on"]],
        "daemon_cpu_s_off": [x["daemon_cpu_s"] for x in runs["off"]],
        "external_hit_tokens_on": [x["hits"]["external_prefix_cache_hits"] for x in runs["on"]],
        "local_hit_tokens": [x["hits"]["prefix_cache_hits"] for x in runs["off"] + runs["on"]],
        "stored_blocks_on": [x["daemon_stored_blocks"] for x in runs["on"]],
        "runs": runs,
    }


def ab(bench: Bench) -> dict[str, Any]:
    """Inside one connector engine: rounds with the connector's lookups+stores off / on, alternating."""
    a = bench.args
    rounds = [{"active": active, "prompts": random_prompts(4000 + 2 * r + active, a.ab_prompts, a.tput_tokens)}
              for r in range(a.ab_repeats) for active in (False, True)]
    warmup = [random_prompts(3999, 2, a.tput_tokens)]
    res = bench.engine("ab", True, prompts=[], mode="ab", max_tokens=a.tput_output, warmup=warmup,
                       warmup_tokens=4, rounds=rounds)
    by = {flag: [r for r in res["rounds"] if r["active"] == flag] for flag in (False, True)}
    tps = {flag: [r["tokens"] / r["generate_s"] for r in rs] for flag, rs in by.items()}
    cpu = {flag: [r["tokens"] / r["cpu_s"] for r in rs] for flag, rs in by.items()}
    pairs = [on["tokens"] / on["generate_s"] / (off["tokens"] / off["generate_s"])
             for off, on in zip(by[False], by[True], strict=True)]
    return {
        "workload": f"{a.ab_prompts} x {a.tput_tokens} prompt tokens + {a.tput_output} output tokens, batch; "
                    f"{a.ab_repeats} x (inactive, active) rounds in one engine",
        "tokens_per_s_inactive": spread(tps[False]), "tokens_per_s_active": spread(tps[True]),
        "cost_pct_median": 100 * (1 - pct(tps[True], 50) / pct(tps[False], 50)),
        "cost_pct_pairwise_median": 100 * (1 - pct(pairs, 50)),
        "pair_ratios_active_over_inactive": pairs,
        "tokens_per_engine_cpu_s_inactive": spread(cpu[False]), "tokens_per_engine_cpu_s_active": spread(cpu[True]),
        "engine_cpu_cost_pct_median": 100 * (1 - pct(cpu[True], 50) / pct(cpu[False], 50)),
        "daemon_cpu_s_active": [r["daemon_cpu_s"] for r in by[True]],
        "engine": res,
    }
