"""Run a real vLLM engine (CPU) on a list of prompts and write the results as JSON.

Meant to be run by tests in a SUBPROCESS (one engine per process)::

    python tests/support/vllm/run_engine.py --model DIR --prompts prompts.json \
        --out result.json [--connector-config JSON|@file] [--max-tokens N] \
        [--mode batch|sequential] [--rounds N] [--reset-prefix-cache] [--multiproc] \
        [--hold-file PATH] [--round-gate DIR] [--block-size 128] [--max-model-len 1024] [--kv-cache-bytes N] \
        [--lora NAME=PATH]

``prompts.json`` is a JSON list; each entry is a text (str), a list of token
ids, or a dict passed to vLLM as-is (e.g. ``{"prompt_token_ids": [...],
"cache_salt": "s"}``).

Generation is greedy (temperature 0, ignore_eos by default so every request
produces exactly ``--max-tokens`` tokens).  ``--mode sequential`` runs one
``LLM.generate`` call per prompt (per-request timing and metric deltas);
``--mode batch`` submits all prompts of a round in one call.  ``--lora NAME=PATH`` serves every
prompt with that LoRA adapter (vLLM's LoRA enabled, rank up to 8).  ``--rounds N``
repeats the prompt list N times in the same engine; ``--reset-prefix-cache``
empties vLLM's local prefix cache before every round after the first, so any
cache hit in later rounds must come from the KV connector.  ``--hold-file PATH``
writes ``--out`` and then keeps the engine (and its connector) alive until PATH
exists (at most ``--hold-timeout`` s), e.g. to run a second engine meanwhile.

Output JSON (see ``run()``): ``requests`` (flat list over rounds, each with
``round``, ``index``, ``prompt_token_ids``, ``output_token_ids``,
``output_text``, ``num_cached_tokens`` (local + external prefix-cache hits,
as reported by ``RequestOutput.num_cached_tokens``), ``kv_transfer_params``
(the dict the connector's ``request_finished`` returned), ``finish_reason``
and, in sequential mode, ``generate_s`` and ``metrics_delta``), ``rounds``
(per-round timing and metric deltas), ``kv_cache`` (the KV cache config's blocks and groups,
in-process only), ``metrics`` (final Prometheus counters,
e.g. ``vllm:external_prefix_cache_hits``), and ``timing``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024

# Counters worth reporting per request / round (all Prometheus counters are
# kept in the final snapshot; these are the ones diffed).
DELTA_PREFIXES = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:num_preemptions",
    "vllm:generation_tokens",
)


def _parse_json_arg(value: str | None) -> Any:
    if value is None:
        return None
    if value.startswith("@"):
        return json.loads(Path(value[1:]).read_text())
    return json.loads(value)


def _set_env(multiproc: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiproc else "0"


def _to_prompt(entry: Any) -> Any:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        return {"prompt_token_ids": [int(t) for t in entry]}
    if isinstance(entry, dict):
        return entry
    raise TypeError(f"unsupported prompt entry: {entry!r}")


def _metric_key(name: str, labels: dict[str, str]) -> str:
    shown = {k: v for k, v in labels.items() if k not in ("model_name", "engine")}
    if not shown:
        return name
    inner = ",".join(f"{k}={v}" for k, v in sorted(shown.items()))
    return f"{name}{{{inner}}}"


def _counters(llm: Any) -> dict[str, float]:
    """Snapshot of all counter metrics (summed over engines)."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            key = _metric_key(metric.name, metric.labels)
            out[key] = out.get(key, 0) + metric.value
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        key: after[key] - before.get(key, 0)
        for key in sorted(after)
        if key.startswith(DELTA_PREFIXES) and after[key] - before.get(key, 0) != 0
    }


def _request_result(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "request_id": output.request_id,
        "prompt_token_ids": list(output.prompt_token_ids or []),
        "num_prompt_tokens": len(output.prompt_token_ids or []),
        "output_token_ids": list(completion.token_ids),
        "output_text": completion.text,
        "finish_reason": completion.finish_reason,
        "num_cached_tokens": output.num_cached_tokens,
        "kv_transfer_params": output.kv_transfer_params,
        # The sampled tokens' logprobs (with --logprobs): finer than the tokens to tell KV apart.
        "logprobs": [next(iter(step.values())).logprob for step in completion.logprobs or ()],
    }


def _pass_gate(gate: Path, done_round: int, timeout: float) -> None:
    """Tell the caller round `done_round` is done; wait for its go-ahead."""
    (gate / f"done-{done_round}").touch()
    deadline = time.monotonic() + timeout
    while not (gate / f"go-{done_round}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate}/go-{done_round} did not appear")
        time.sleep(0.05)


def _kv_cache(llm: Any) -> dict[str, Any] | None:
    """The KV cache config vLLM's scheduler runs with: its blocks and its groups (kind, block size,
    sliding window, layers). Only in-process (without --multiproc); None otherwise."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return None
    config = core.scheduler.kv_cache_config
    groups = [{"kind": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
               "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None), "layers": len(g.layer_names)}
              for g in config.kv_cache_groups]
    return {"num_blocks": config.num_blocks, "groups": groups}


def _lora(spec: str | None, llm_kwargs: dict[str, Any]) -> Any:
    """--lora NAME=PATH as vLLM's LoRARequest, LoRA enabled in the engine's arguments."""
    if not spec:
        return None
    from vllm.lora.request import LoRARequest

    name, path = spec.split("=", 1)
    llm_kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    return LoRARequest(name, 1, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    from vllm import LLM, SamplingParams

    t_imported = time.perf_counter()
    prompts = [_to_prompt(p) for p in json.loads(Path(args.prompts).read_text())]
    kv_transfer_config = _parse_json_arg(args.connector_config)
    llm_kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        enable_prefix_caching=True,
        seed=args.seed,
        disable_log_stats=False,  # needed for llm.get_metrics()
    )
    if kv_transfer_config is not None:
        llm_kwargs["kv_transfer_config"] = kv_transfer_config
    lora = _lora(args.lora, llm_kwargs)
    llm_kwargs.update(_parse_json_arg(args.llm_kwargs) or {})

    llm = LLM(**llm_kwargs)
    t_engine = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            logprobs=0 if args.logprobs else None)

    requests: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    for round_idx in range(args.rounds):
        if round_idx > 0 and args.round_gate:
            _pass_gate(Path(args.round_gate), round_idx - 1, args.hold_timeout)
        if round_idx > 0 and args.reset_prefix_cache:
            if not llm.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache() failed")
        round_before = _counters(llm)
        t_round = time.perf_counter()
        if args.mode == "batch":
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
            for index, output in enumerate(outputs):
                requests.append({"round": round_idx, "index": index, **_request_result(output)})
        else:
            for index, prompt in enumerate(prompts):
                before = _counters(llm)
                t_req = time.perf_counter()
                (output,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
                generate_s = time.perf_counter() - t_req
                requests.append(
                    {
                        "round": round_idx,
                        "index": index,
                        **_request_result(output),
                        "generate_s": generate_s,
                        "metrics_delta": _delta(before, _counters(llm)),
                    }
                )
        rounds.append(
            {
                "round": round_idx,
                "generate_s": time.perf_counter() - t_round,
                "metrics_delta": _delta(round_before, _counters(llm)),
            }
        )

    metrics = _counters(llm)
    t_done = time.perf_counter()
    result = {
        "config": dict(vars(args)),
        "llm_kwargs": dict(llm_kwargs),
        "requests": requests,
        "rounds": rounds,
        "metrics": metrics,
        "kv_cache": _kv_cache(llm),
        "timing": {
            "import_s": t_imported - t_start,
            "engine_start_s": t_engine - t_imported,
            "generate_s": t_done - t_engine,
            "total_s": t_done - t_start,
        },
    }
    if args.hold_file:
        # Keep the engine (and its connector) alive until the caller says so.
        write_result(Path(args.out), result)
        deadline = time.monotonic() + args.hold_timeout
        while not Path(args.hold_file).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"--hold-file {args.hold_file} did not appear")
            time.sleep(0.05)
        result["timing"]["held_s"] = time.perf_counter() - t_done
    return result


def write_result(out: Path, result: dict[str, Any]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON file with a list")
    p.add_argument("--out", required=True, help="result JSON file")
    p.add_argument(
        "--connector-config",
        help="kv_transfer_config as JSON, or @file containing JSON",
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=128, help="multiple of 32")
    p.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprobs", action="store_true", help="record the sampled tokens' logprobs")
    p.add_argument("--mode", choices=("batch", "sequential"), default="batch")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="reset vLLM's local prefix cache before each round after the first",
    )
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--lora", help="NAME=PATH: serve every prompt with this LoRA adapter")
    p.add_argument("--llm-kwargs", help="extra LLM(...) kwargs as JSON, or @file with JSON")
    p.add_argument(
        "--hold-file",
        help="after generating (and writing --out), keep the engine alive until this file exists",
    )
    p.add_argument("--hold-timeout", type=float, default=600.0, help="seconds to wait for --hold-file")
    p.add_argument("--round-gate", help="directory: after round r, create done-r there and wait for go-r")
    p.add_argument(
        "--multiproc",
        action="store_true",
        help="VLLM_ENABLE_V1_MULTIPROCESSING=1 (EngineCore + worker processes)",
    )
    args = p.parse_args(argv)
    if args.block_size % 32:
        p.error("--block-size must be a multiple of 32 on the CPU backend")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _set_env(args.multiproc)
    write_result(Path(args.out), run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
