"""bench_vllm.py's shared pieces: paths, small statistics, prompts, CPU time, and the benchmark's daemon.

Nothing here imports kvstore or vLLM at module level: the engine processes import this module too, and the
LMCache engines run in a venv without kvstore."""

from __future__ import annotations

import os
import random
import statistics
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
TESTS = REPO / "tests"  # the `support` package, shared with the tests
VOCAB = range(3, 2000)  # the bench tokenizer has 2048 ids; 0-2 are special
TIMED_CONNECTOR = "TimedKVStoreConnector"


# -- small statistics ---------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Percentile q (0..100) with linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": pct(values, 50), "mean": statistics.fmean(values) if values else float("nan"),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values, default=float("nan")), "max": max(values, default=float("nan")), "n": len(values)}


def parse_bytes(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * factor)
    return int(t)


def random_prompts(seed: int | str, count: int, tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(VOCAB, k=tokens) for _ in range(count)]


def ttft_run(seed: str, count: int, tokens: int) -> dict[str, Any]:
    """The TTFT workload's engine arguments: `count` prompts of `tokens` tokens named by `seed` (one per
    section and length: no shared prefixes), one at a time, one output token each. Warm-up: another
    prompt twice (cold or a pool hit, then a local prefix hit): every path measured is warm."""
    w = random_prompts(f"{seed}-warmup-{tokens}", 1, tokens)
    return dict(prompts=random_prompts(f"{seed}-{tokens}", count, tokens), mode="sequential", max_tokens=1,
                warmup=[w, w], warmup_tokens=1)


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def outputs(result: dict[str, Any]) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["requests"]]


class BenchDaemon:
    """The benchmark's daemon (a `kvstore_service.harness.DaemonProcess`), plus what the report reads of it.

    kvstore is imported here, not at module level: vLLM's multi-process engines (CPU: spawn) re-import this
    module, and the LMCache engines run it in a venv without kvstore."""

    def __init__(self, workdir: Path, pool_size: str, *extra: str) -> None:
        from kvstore_service.harness import DaemonProcess

        self.process = DaemonProcess(workdir, pool_size, "64MiB", "--fresh", *extra)
        self.socket = self.process.socket

    def start(self) -> BenchDaemon:
        self.process.start()
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def cleanup(self) -> None:
        self.process.cleanup()

    def stats(self) -> dict[str, int]:
        client = self.process.client()
        try:
            s = client.stats()
        finally:
            client.close()
        names = ("blocks", "hits", "misses", "stored_blocks", "loaded_blocks", "evictions", "failed_blocks",
                 "store_failures_pool_full", "engines", "leases", "jobs_in_flight")
        return {n: int(getattr(s, n)) for n in names}

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)
