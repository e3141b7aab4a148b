"""The restart matrix: one model through `vllm serve` with the connector, against the same server without it,
across every way an engine can meet its blocks again. Used by tests/vllm/test_restart_matrix.py (a slice) and
benchmarks/restart_matrix.py (all of it, every model class).

Prompts straddle block boundaries (k*block-1, k*block, k*block+1 tokens) in two families that share prefixes.
A scenario asks every prompt once at concurrency 1, vLLM's own prefix cache emptied first (so hits come
from the pool), and compares token ids and logprobs with the server without the connector:

- `restart`: a new engine on the kept daemon;
- `daemon-kill`: the daemon SIGKILLed and restarted on its pool under a running engine;
- `disk`: the daemon restarted with its pool lost (`--fresh`), its disk tier kept;
- `mixed`: vLLM's own cache holds each prompt's first blocks (a shorter prompt asked first), the pool the rest;
- `concurrent`: the prompts many times over, `concurrency` at a time: every request answered, no failed block;
- `remote`: an engine on another node (its own daemon and empty pool) over the remote tier.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from support.daemon import DaemonProcess, wait_for
from support.vllm.serve import VllmServer, connector_config, first_cpu

SCENARIOS = ("restart", "daemon-kill", "disk", "mixed", "concurrent", "remote")
MAX_TOKENS = 6
EXTERNAL = "vllm:external_prefix_cache_hits_total"  # prompt tokens the connector served


# vLLM raises a linear-attention hybrid's attention block to hold a Mamba state's page (160 tokens for the
# tiny Qwen3-Next-like model): its prompts straddle that block's boundaries.
BLOCKS = {"qwen3_next": 160}
SIZES = {"qwen3_next": (3, 4)}  # the k of each family (k*block tokens, +-1): within max_model_len 1024


def make_prompts(block: int, sizes: tuple[int, int] = (4, 6)) -> list[list[int]]:
    """Two families of prompts of k*block-1, k*block and k*block+1 tokens, each sharing k-1 blocks."""
    prompts = []
    for family, k in enumerate(sizes):
        prefix = random.Random(family).choices(range(3, 2000), k=(k - 1) * block)
        for n in (k * block - 1, k * block, k * block + 1):
            prompts.append(prefix + random.Random(100 * family + n).choices(range(3, 2000), k=n - len(prefix)))
    return prompts


def ask(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    """Greedy token ids, their logprobs and the prompt tokens served from caches (vLLM's or the pool)."""
    reply = server.post("/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                                            "logprobs": 0})
    choice = reply["choices"][0]
    details = reply["usage"].get("prompt_tokens_details") or {}
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"],
            "cached": details.get("cached_tokens") or 0, "finish": choice["finish_reason"]}


def reset(server: VllmServer) -> None:
    """Empty vLLM's own prefix cache (not the pool): the next hits come from the connector."""
    server.post("/reset_prefix_cache", {})


class Matrix:
    """One model's matrix: its reference answers, a daemon with a disk tier (and the remote tier at
    `remote`, a redis URL), and the scenarios' rows."""

    def __init__(self, name: str, model: Path, workdir: Path, *, dtype: str, remote: str | None = None,
                 concurrency: int = 8) -> None:
        self.model, self.workdir, self.dtype = model, workdir, dtype
        self.block = BLOCKS.get(name, 32)
        self.remote, self.concurrency = remote, concurrency
        self.prompts = make_prompts(self.block, SIZES.get(name, (4, 6)))
        tiers = ["--disk-path", str(workdir / "disk"), "--disk-size", "256MiB", "--disk-segment-size", "8MiB",
                 *(["--remote", remote] if remote else [])]
        self.daemon = DaemonProcess(workdir / "node-a", "256MiB", "8MiB", *tiers)
        # The server without the connector: each prompt computed whole (cold); the prompts in the fill's
        # order (replay); each again from its own prefix cache (warm).
        self.cold: list[dict[str, Any]] = []
        self.replay: list[dict[str, Any]] = []
        self.warm: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self._seen: dict[Path, dict[str, float]] = {}  # each server's counters at its last row

    def server(self, name: str, daemon: DaemonProcess | None) -> VllmServer:
        config = connector_config(daemon.socket) if daemon else None
        return VllmServer(self.model, self.workdir / f"{name}.log", "--dtype", self.dtype, threads_bind=first_cpu(),
                          kv_transfer_config=config, block_size=self.block, kv_cache_bytes=64 << 20,
                          env={"VLLM_SERVER_DEV_MODE": "1"})

    def run(self, scenarios: Sequence[str] = SCENARIOS) -> list[dict[str, Any]]:
        with self.server("reference", None) as plain:
            for prompt in self.prompts:
                reset(plain)
                self.cold.append(ask(plain, prompt))
            reset(plain)
            self.replay = [ask(plain, p) for p in self.prompts]
            self.warm = [ask(plain, p) for p in self.prompts]
        self.daemon.start()
        try:
            with self.server("fill", self.daemon) as fill:
                self.row("fill", fill, [ask(fill, p) for p in self.prompts])
            self._drain(self.daemon)
            with self.server("engine", self.daemon) as engine:
                for scenario in scenarios:
                    if scenario != "remote":
                        getattr(self, scenario.replace("-", "_"))(engine)
            if "remote" in scenarios and self.remote:
                self.remote_node()
        finally:
            self.daemon.cleanup()
        return self.rows

    def expected(self, scenario: str, i: int, cached: int) -> dict[str, Any]:
        """The plain server's answer to prompt i with the same history: the fill's own, or the blocks the fill
        computed (the plain server's own cache after the same prompts), or none. A linear-attention state
        resumed mid-prompt gives other low bits than one computed in one pass, in vLLM alone too: the pool
        must hand back the one the fill computed."""
        if scenario == "fill":
            return self.replay[i]
        return self.warm[i] if cached == self.warm[i]["cached"] else self.cold[i]

    def restart(self, engine: VllmServer) -> None:
        self.row("restart", engine, self.each(engine))

    def daemon_kill(self, engine: VllmServer) -> None:
        self.daemon.kill()
        self.daemon.start()
        self._reconnected(engine)
        self.row("daemon-kill", engine, self.each(engine))

    def disk(self, engine: VllmServer) -> None:
        self.daemon.stop()
        self.daemon.start("--fresh")
        self._reconnected(engine)
        self.row("disk", engine, self.each(engine), disk=self.daemon.client().stats().disk.read_blocks)

    def mixed(self, engine: VllmServer) -> None:
        answers, pool_tokens = [], 0.0
        for prompt in self.prompts:
            reset(engine)
            ask(engine, prompt[: 2 * self.block + 1])  # vLLM's cache now holds the first two blocks
            before = engine.metrics().get(EXTERNAL, 0.0)
            answers.append(ask(engine, prompt))
            pool_tokens += engine.metrics().get(EXTERNAL, 0.0) - before
        self.row("mixed", engine, answers, pool_tokens=pool_tokens)  # of the full prompts' cached tokens

    def concurrent(self, engine: VllmServer) -> None:
        reset(engine)
        prompts = self.prompts * 4
        with ThreadPoolExecutor(self.concurrency) as pool:
            answers = list(pool.map(lambda p: ask(engine, p), prompts))
        self.row("concurrent", engine, answers)

    def remote_node(self) -> None:
        other = DaemonProcess(self.workdir / "node-b", "256MiB", "8MiB", "--remote", str(self.remote)).start()
        try:
            with self.server("remote", other) as engine:
                self.row("remote", engine, [ask(engine, p) for p in self.prompts], other,
                         remote_hits=other.client().stats().remote.hits)
        finally:
            other.cleanup()

    def each(self, engine: VllmServer) -> list[dict[str, Any]]:
        answers = []
        for prompt in self.prompts:
            reset(engine)
            answers.append(ask(engine, prompt))
        return answers

    def row(self, scenario: str, server: VllmServer, answers: list[dict[str, Any]],
            daemon: DaemonProcess | None = None, **extra: Any) -> None:
        n = len(self.prompts)
        expected = [self.expected(scenario, j % n, a["cached"]) for j, a in enumerate(answers)]
        metrics, seen = server.metrics(), self._seen.get(server.log, {})
        self._seen[server.log] = metrics
        stats = (daemon or self.daemon).client().stats()

        def delta(name: str) -> float:  # this scenario's part of a server's counter
            return metrics.get(name, 0.0) - seen.get(name, 0.0)

        self.rows.append({
            "scenario": scenario,
            "answers": len(answers),  # each prompt once, or (concurrent) several times in turn
            "same_tokens": sum(a["tokens"] == e["tokens"] for a, e in zip(answers, expected, strict=True)),
            "same_logprobs": sum(a["logprobs"] == e["logprobs"] for a, e in zip(answers, expected, strict=True)),
            "differ": sorted({j % n for j, (a, e) in enumerate(zip(answers, expected, strict=True))
                              if (a["tokens"], a["logprobs"]) != (e["tokens"], e["logprobs"])}),
            "logprob_gap": max(abs(x - y) for a, e in zip(answers, expected, strict=True)
                               for x, y in zip(a["logprobs"], e["logprobs"], strict=True)),
            "answered": sum(a["finish"] == "length" and len(a["tokens"]) == MAX_TOKENS for a in answers),
            "prompt_tokens": [len(p) for p in self.prompts],
            "cached_tokens": [a["cached"] for a in answers[:n]],
            "external_tokens": delta(EXTERNAL),
            "loaded_blocks": delta("vllm:kvstore_loaded_blocks_total"),
            "failed_loads": delta("vllm:kvstore_load_failed_blocks_total"),
            "daemon_failed_loads": stats.failed_load_blocks,
            **extra,
        })

    def _reconnected(self, engine: VllmServer) -> None:
        client = self.daemon.client()
        if not wait_for(lambda: client.stats().engines >= 1, timeout=60):
            raise RuntimeError(f"the engine did not come back to the daemon:\n{engine.log_tail()}")
        client.close()

    def _drain(self, daemon: DaemonProcess) -> None:
        """Wait until the daemon's write-behind tiers hold what its pool holds."""
        client = daemon.client()

        def drained() -> bool:
            stats = client.stats()
            blocks = stats.blocks
            return stats.disk.written >= blocks and (not self.remote or stats.remote.uploaded >= blocks)

        if not wait_for(drained, timeout=60):
            raise RuntimeError(f"the daemon's tiers did not drain: {client.stats()}")
        client.close()


def table(rows: list[dict[str, Any]], name: str) -> str:
    lines = []
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in ("scenario", "answers", "same_tokens", "same_logprobs",
                                                            "answered", "prompt_tokens", "cached_tokens")}
        lines.append(f"{name:12} {r['scenario']:12} tokens {r['same_tokens']}/{r['answers']} "
                     f"logprobs {r['same_logprobs']}/{r['answers']} cached {r['cached_tokens']} of "
                     f"{r['prompt_tokens']} {json.dumps(extra)}")
    return "\n".join(lines)

