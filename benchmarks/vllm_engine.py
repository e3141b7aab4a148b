"""bench_vllm.py's engine process (`bench_vllm.py engine SPEC OUT`): one vLLM LLM, its warm-up, then the
measured prompts (sequential TTFT requests, one batch, or the in-engine A/B rounds); writes OUT as JSON.

Imports only vLLM (and `timed_connector` for the timed connector): in `--against-lmcache` runs it runs in
the LMCache venv, which has neither kvstore nor this repository's packages."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from vllm_common import proc_cpu_s


def _counters(llm: Any) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0.0) + metric.value
    return out


def _hits(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits", "vllm:prompt_tokens")
    return {n.removeprefix("vllm:"): after.get(n, 0.0) - before.get(n, 0.0) for n in names}


def engine_main(spec_path: str, out_path: str) -> int:
    """Runs inside the engine process: one LLM, warm-up, then the measured prompts."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    recorder = None
    if spec.get("timed"):  # only then: the LMCache engines run in a venv without kvstore
        import timed_connector

        recorder = timed_connector.RECORDER
        recorder.set_phase("start")
    t_import = time.perf_counter()
    kwargs: dict[str, Any] = dict(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                                  block_size=spec["block_size"], kv_cache_memory_bytes=spec["kv_cache_bytes"],
                                  enforce_eager=True, enable_prefix_caching=True, seed=0,
                                  disable_log_stats=False)  # log stats: RequestOutput.metrics, get_metrics()
    if spec["connector"] is not None:
        kwargs["kv_transfer_config"] = spec["connector"]
    llm = LLM(**kwargs)
    t_engine = time.perf_counter()

    def params(max_tokens: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    if recorder is not None:
        recorder.set_phase("warmup")
    for batch in spec["warmup"]:
        llm.generate([{"prompt_token_ids": p} for p in batch], params(spec["warmup_tokens"]), use_tqdm=False)
    if recorder is not None:
        recorder.set_phase("measure")
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    result: dict[str, Any] = {"requests": []}
    before = _counters(llm)
    if spec["mode"] == "sequential":
        for prompt in prompts:
            req_before = _counters(llm)
            t = time.perf_counter()
            (out,) = llm.generate([prompt], params(spec["max_tokens"]), use_tqdm=False)
            generate_s = time.perf_counter() - t
            m = out.metrics
            ttft = m.first_token_latency if m is not None and m.first_token_latency else generate_s
            # Engine-core timestamps: queued -> scheduled (includes the sidecar lookup and load) -> first token.
            phases = {"queued_to_scheduled_s": m.scheduled_ts - m.queued_ts,
                      "scheduled_to_token_s": m.first_token_ts - m.scheduled_ts} if m is not None else {}
            result["requests"].append({"ttft_s": ttft, "generate_s": generate_s, **phases,
                                       "num_cached_tokens": out.num_cached_tokens,
                                       "prompt_tokens": len(out.prompt_token_ids or []),
                                       "output_token_ids": list(out.outputs[0].token_ids),
                                       **_hits(req_before, _counters(llm))})
    elif spec["mode"] == "ab":
        # One connector engine, rounds alternating the connector's lookups+stores on and off (fresh prompts).
        assert recorder is not None
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler  # uniproc: its Scheduler
        full = sched.settings
        result["rounds"] = []
        for rnd in spec["rounds"]:
            sched.settings = full if rnd["active"] else dataclasses.replace(full, store=False, load=False)
            recorder.set_phase("measure" if rnd["active"] else "measure_inactive")
            round_prompts = [{"prompt_token_ids": p} for p in rnd["prompts"]]
            t, cpu, daemon_cpu = time.perf_counter(), time.process_time(), proc_cpu_s(spec["daemon_pid"])
            outs = llm.generate(round_prompts, params(spec["max_tokens"]), use_tqdm=False)
            generate_s = time.perf_counter() - t
            tokens = sum(len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids) for o in outs)
            result["rounds"].append({"active": rnd["active"], "generate_s": generate_s, "tokens": tokens,
                                     "cpu_s": time.process_time() - cpu,
                                     "daemon_cpu_s": proc_cpu_s(spec["daemon_pid"]) - daemon_cpu,
                                     "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)})
        sched.settings = full
    else:
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params(spec["max_tokens"]), use_tqdm=False)
        generate_s = time.perf_counter() - t
        result["batch"] = {"generate_s": generate_s, "cpu_s": time.process_time() - cpu,
                           "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs),
                           "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                           "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}
    result["hits"] = _hits(before, _counters(llm))
    if recorder is not None:
        recorder.set_phase("end")
    t_done = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # connectors shut down (the timed one dumps its samples)
    result["timing"] = {"import_s": t_import - t0, "engine_start_s": t_engine - t_import,
                        "run_s": t_done - t_engine, "shutdown_s": time.perf_counter() - t_done}
    Path(out_path).write_text(json.dumps(result))
    return 0
