"""bench_vllm.py's report: section 2's per-step summary of the timed connector's samples, and the printed
tables of every section."""

from __future__ import annotations

import statistics
from typing import Any

from vllm_common import pct


def step_summary(steps_files: list[dict[str, Any]]) -> dict[str, Any]:
    """Connector µs per step vs step ms, over the "measure" phase of one or more engines."""
    rows: dict[str, dict[str, list[float]]] = {k: {"conn_us": [], "sched_us": [], "worker_us": [], "step_ms": [],
                                                   "calls": []} for k in ("forward", "empty", "all")}
    per_method: dict[str, list[dict[str, int]]] = {k: [] for k in rows}
    overhead_ns = 0
    for data in steps_files:
        s = data["steps"]
        overhead_ns = max(overhead_ns, data["timer_overhead_ns"])
        for i in range(len(s["t_ns"]) - 1):  # sample i: one step, timed until the next one starts
            if s["phase"][i] != "measure" or s["phase"][i + 1] != "measure":
                continue
            kind = "forward" if s["tokens"][i] > 0 else "empty"
            for k in (kind, "all"):
                rows[k]["conn_us"].append((s["sched_ns"][i] + s["worker_ns"][i]) / 1000)
                rows[k]["sched_us"].append(s["sched_ns"][i] / 1000)
                rows[k]["worker_us"].append(s["worker_ns"][i] / 1000)
                rows[k]["step_ms"].append((s["t_ns"][i + 1] - s["t_ns"][i]) / 1e6)
                rows[k]["calls"].append(s["calls"][i])
                per_method[k].append(s["by_method"][i])
    out: dict[str, Any] = {"timer_overhead_ns_per_call": overhead_ns}
    for k, r in rows.items():
        n = len(r["conn_us"])
        names = sorted({name for step in per_method[k] for name in step})
        methods = {}
        for name in names:
            us = [step.get(name, 0) / 1000 for step in per_method[k]]
            methods[name] = {"mean_us": statistics.fmean(us), "p50_us": pct(us, 50), "p99_us": pct(us, 99),
                             "max_us": max(us)}
        out[k] = {"steps": n,
                  "conn_p50_us": pct(r["conn_us"], 50), "conn_p99_us": pct(r["conn_us"], 99),
                  "conn_max_us": max(r["conn_us"], default=float("nan")),
                  "sched_p50_us": pct(r["sched_us"], 50), "worker_p50_us": pct(r["worker_us"], 50),
                  "step_p50_ms": pct(r["step_ms"], 50), "step_p99_ms": pct(r["step_ms"], 99),
                  "calls_p50": pct(r["calls"], 50),
                  "conn_share_pct": 100 * sum(r["conn_us"]) / (1000 * sum(r["step_ms"])) if n else 0.0,
                  "total_step_ms": sum(r["step_ms"]),
                  "methods_per_step": dict(sorted(methods.items(), key=lambda kv: -kv[1]["mean_us"]))}
    return out


# -- report -------------------------------------------------------------------------------------


def _line(label: str, value: str, target: str = "") -> None:
    print(f"  {label:<52} {value:>22}  {target}")


def _rate_line(label: str, d: dict[str, Any]) -> None:
    _line(f"{label} (median, mean ± sd, n={d['n']})", f"{d['median']:.0f} ({d['mean']:.0f} ± {d['stdev']:.0f})",
          f"min {d['min']:.0f} max {d['max']:.0f}")


def print_report(report: dict[str, Any]) -> None:
    print("\n=== kvstore vLLM connector benchmark ===")
    cfg = report["config"]
    print(f"  model bench (~100M), {cfg['dtype']}, block {cfg['block_size']}, kv cache {cfg['kv_cache_bytes']}, "
          f"max_model_len {cfg['max_model_len']}, engine threads {cfg['engine_threads']}")
    for t in report.get("ttft", []):
        _print_ttft(t, report)
    if report.get("steps"):
        _print_steps(report["steps"])
    if report.get("throughput"):
        _print_throughput(report["throughput"])
    if report.get("ab"):
        _print_ab(report["ab"])
    if report.get("side_by_side"):
        _print_side_by_side(report["side_by_side"], report.get("ttft", []))
    print(f"\n  wall time of the whole benchmark: {report['wall_s']:.0f} s (files in {report['workdir']})")


def _print_ttft(t: dict[str, Any], report: dict[str, Any]) -> None:
    print(f"\n1. TTFT, {t['prompts']} x {t['prompt_tokens']}-token prompts, one at a time")
    _line("p50 TTFT, sidecar hit after restart (B)", f"{t['hit_p50_ms']:.1f} ms", f"min {t['hit_min_ms']:.1f}")
    _line("p50 TTFT, cold, no connector (C)", f"{t['cold_p50_ms']:.1f} ms", f"min {t['cold_min_ms']:.1f}")
    _line("p50 TTFT, cold, connector on, miss + store (A)", f"{t['cold_connector_p50_ms']:.1f} ms")
    ok = "met" if t["speedup_p50"] >= 5 else "NOT met"
    _line("speedup p50 cold (C) / hit (B)", f"{t['speedup_p50']:.1f}x", f"target >= 5x: {ok}")
    ok = "yes" if t["b_hits_as_expected"] else "NO"
    _line("tokens loaded per request in B: external hits", _span(t["b_external_hit_tokens"]),
          f"expected {t['expected_hit_tokens']}: {ok}")
    _line("tokens loaded per request in B: num_cached_tokens", _span(t["b_cached_tokens"]))
    _line("local prefix-cache hit tokens in B", f"{sum(t['b_local_hit_tokens']):.0f}")
    _line("first tokens identical in A, B and C", str(t["outputs_identical"]))
    b = t["engines"]["b"]["requests"]
    if b and "scheduled_to_token_s" in b[0]:
        _line("B p50: queued->scheduled / scheduled->1st token",
              f"{1000 * pct([r['queued_to_scheduled_s'] for r in b], 50):.1f} / "
              f"{1000 * pct([r['scheduled_to_token_s'] for r in b], 50):.1f} ms")
    wait = report.get("steps", {}).get("workloads", {}).get(f"restart hit (B) {t['prompt_tokens']}", {}).get("empty")
    if wait:
        _line("B: engine steps spent waiting (lookup, load) per request",
              f"{wait['total_step_ms'] / t['prompts']:.1f} ms")


def _span(values: list[float]) -> str:
    lo, hi = min(values, default=float("nan")), max(values, default=float("nan"))
    return f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"


def _print_side_by_side(rows: list[dict[str, Any]], ttft: list[dict[str, Any]]) -> None:
    n = rows[0]["prompts"]
    print(f"\n4. Side by side with LMCache MP: TTFT after restart, {n} prompts one at a time, max_tokens=1, "
          "both multi-process (VLLM_ENABLE_V1_MULTIPROCESSING=1), plain KVStoreConnector vs LMCacheMPConnector, "
          f"VLLM_CPU_OMP_THREADS_BIND={rows[0].get('vllm_cpu_omp_threads_bind', '?')}")
    cold = {t["prompt_tokens"]: t["cold_p50_ms"] for t in ttft}
    print(f"  {'tokens':>7}{'ours hit p50':>14}{'LMCache hit p50':>17}{'ours/LMC':>10}{'loaded ours':>13}"
          f"{'loaded LMC':>12}{'cold p50 (C)':>14}{'A ours / LMC':>17}  identical  LMC transfer")
    for r in rows:
        if "error" in r:
            print(f"  {r['prompt_tokens']:>7}  FAILED: {r['error'].splitlines()[0]}")
            continue
        o, m = r["kvstore"], r["lmcache"]
        c = cold.get(r["prompt_tokens"], float("nan"))
        print(f"  {r['prompt_tokens']:>7}{o['hit_p50_ms']:>11.1f} ms{m['hit_p50_ms']:>14.1f} ms"
              f"{r['ratio_hit_p50_kvstore_over_lmcache']:>10.2f}{_span(o['b_external_hit_tokens']):>13}"
              f"{_span(m['b_external_hit_tokens']):>12}{c:>11.0f} ms"
              f"{o['cold_connector_p50_ms']:>8.0f} / {m['cold_connector_p50_ms']:.0f}"
              f"  {str(r['outputs_identical']):>9}  {r['lmcache_transfer']}")
    print("  (hit p50 over every B engine's requests; loaded = external prefix-cache hit tokens per request in B; "
          "expected for ours: tokens - 1; A = cold + store, connector on)")
    for r in rows:
        if "error" in r:
            continue
        o, m = r["kvstore"], r["lmcache"]
        rounds = " / ".join(f"{x:.1f}/{y:.1f}={z:.2f}" for x, y, z in zip(
            o["round_hit_p50_ms"], m["round_hit_p50_ms"], r["round_ratios"], strict=True))
        cpu = r["other_server_cpu_s"]
        q = f"{o['b_queued_to_scheduled_p50_ms']:.1f} / {m['b_queued_to_scheduled_p50_ms']:.1f}"
        print(f"  {r['prompt_tokens']:>7}: per round (ours/LMC p50 ms = ratio, alternating order) {rounds}; p50 "
              f"queued->scheduled {q} ms, "
              f"scheduled->token {o['b_scheduled_to_token_p50_ms']:.1f} / {m['b_scheduled_to_token_p50_ms']:.1f} ms; "
              f"idle CPU of the other's server during B: LMCache {cpu['lmcache_server_during_ours']:.2f} s, "
              f"kvstore {cpu['daemon_during_lmcache']:.2f} s")


def _print_steps(s: dict[str, Any]) -> None:
    print("\n2. Connector time per engine step (sum of all connector calls; timer cost "
          f"~{s['timer_overhead_ns_per_call']} ns/call included)")
    print(f"  {'workload / steps':<34}{'n':>6}{'p50 µs':>9}{'p99 µs':>9}{'sched':>8}{'worker':>8}"
          f"{'calls':>7}{'step p50':>11}{'share':>8}")
    for workload, summary in s["workloads"].items():
        for kind in ("forward", "empty"):
            r = summary[kind]
            if not r["steps"]:
                continue
            print(f"  {workload + ' / ' + kind:<34}{r['steps']:>6}{r['conn_p50_us']:>9.1f}{r['conn_p99_us']:>9.1f}"
                  f"{r['sched_p50_us']:>8.1f}{r['worker_p50_us']:>8.1f}{r['calls_p50']:>7.0f}"
                  f"{r['step_p50_ms']:>8.2f} ms{r['conn_share_pct']:>7.2f}%")
    main = s["workloads"].get("throughput (on)", {}).get("forward")
    if main:
        ok = "met" if main["conn_p50_us"] <= 50 else "NOT met"
        _line("p50 per forward step, throughput workload", f"{main['conn_p50_us']:.1f} µs", f"target <= 50: {ok}")
    for workload, summary in s["workloads"].items():
        for kind in ("forward", "empty"):
            r = summary[kind]
            if not r["steps"] or workload.startswith("cold + store (A)"):
                continue
            print(f"  per step, {workload} / {kind}: method  mean / p50 / p99 / max µs")
            for name, m in list(r["methods_per_step"].items())[:8]:
                print(f"    {name:<34}{m['mean_us']:>9.1f}{m['p50_us']:>9.1f}{m['p99_us']:>9.1f}"
                      f"{m['max_us']:>10.1f}")


def _print_throughput(p: dict[str, Any]) -> None:
    print(f"\n3. Throughput, 0% reuse: {p['workload']}")
    for mode in ("off", "on"):
        _rate_line(f"tokens/s connector {mode}", p[f"tokens_per_s_{mode}"])
    ok = "met" if p["cost_pct_median"] < 3 else "NOT met"
    _line("connector cost, 1 - median(on)/median(off)", f"{p['cost_pct_median']:+.1f} %", f"target < 3%: {ok}")
    _line("connector cost, median of per-pair ratios", f"{p['cost_pct_pairwise_median']:+.1f} %")
    _line("pairs on/off", " ".join(f"{x:.3f}" for x in p["pair_ratios_on_over_off"]))
    for mode in ("off", "on"):
        d = p[f"tokens_per_engine_cpu_s_{mode}"]
        _line(f"tokens per engine CPU-second, connector {mode} (median)", f"{d['median']:.0f}",
              f"min {d['min']:.0f} max {d['max']:.0f}")
    _line("engine CPU cost, 1 - median(on)/median(off)", f"{p['engine_cpu_cost_pct_median']:+.1f} %")
    _line("daemon CPU s per run, on (off)", " ".join(f"{x:.1f}" for x in p["daemon_cpu_s_on"])
          + " (" + " ".join(f"{x:.1f}" for x in p["daemon_cpu_s_off"]) + ")")
    _line("blocks stored per on-run; external hits", f"{p['stored_blocks_on']}; {p['external_hit_tokens_on']}")


def _print_ab(ab: dict[str, Any]) -> None:
    print(f"\n3b. Same engine, connector lookups+stores inactive / active: {ab['workload']}")
    for flag in ("inactive", "active"):
        _rate_line(f"tokens/s {flag}", ab[f"tokens_per_s_{flag}"])
    _line("cost, 1 - median(active)/median(inactive)", f"{ab['cost_pct_median']:+.1f} %")
    _line("cost, median of per-pair ratios", f"{ab['cost_pct_pairwise_median']:+.1f} %")
    _line("pairs active/inactive", " ".join(f"{x:.3f}" for x in ab["pair_ratios_active_over_inactive"]))
    _line("engine CPU cost, 1 - median(active)/median(inactive)", f"{ab['engine_cpu_cost_pct_median']:+.1f} %")
    _line("daemon CPU s per active round", " ".join(f"{x:.2f}" for x in ab["daemon_cpu_s_active"]))

