"""bench_vllm.py's engine runner (`Bench`) and its TTFT sections: 1 (restart hit vs cold, uniprocess),
5 (from the remote tier, `--remote`) and 6 (from the disk tier, `--disk`).

`Bench.engine` runs one engine process (`bench_vllm.py engine SPEC OUT`, see vllm_engine.py) and returns
its result; every section builds on it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_common import BENCH_DIR, TIMED_CONNECTOR, BenchDaemon, outputs, parse_bytes, pct, ttft_run
from vllm_lmcache import lmcache_env, side_by_side


class Bench:
    def __init__(self, args: argparse.Namespace, model: Path, daemon: BenchDaemon, workdir: Path) -> None:
        self.args = args
        self.model = model
        self.daemon = daemon
        self.workdir = workdir

    def connector(self) -> dict[str, Any]:
        return {"kv_connector": TIMED_CONNECTOR, "kv_connector_module_path": "timed_connector",
                "kv_role": "kv_both", "kv_connector_extra_config": {"socket": self.daemon.socket}}

    def plain_connector(self) -> dict[str, Any]:
        return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_client.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"socket": self.daemon.socket}}

    def engine(self, name: str, connector: bool | dict[str, Any], prompts: list[list[int]], mode: str,
               max_tokens: int, warmup: list[list[list[int]]], warmup_tokens: int, *, multiproc: bool = False,
               venv: Path | None = None, **extra: Any) -> dict[str, Any]:
        """Runs one engine process; returns its result, with its step samples under "steps" (timed connector).

        connector: True for the timed kvstore connector, False for none, or a kv_transfer_config.
        multiproc: VLLM_ENABLE_V1_MULTIPROCESSING=1 (engine core in a child process). venv: run the engine
        with that venv's python (the LMCache one)."""
        a = self.args
        timed = connector is True
        config = self.connector() if connector is True else (connector or None)
        spec = {"model": str(self.model), "dtype": a.dtype, "block_size": a.block_size,
                "max_model_len": a.max_model_len, "kv_cache_bytes": parse_bytes(a.kv_cache_bytes),
                "connector": config, "timed": timed, "prompts": prompts, "mode": mode,
                "max_tokens": max_tokens, "warmup": warmup, "warmup_tokens": warmup_tokens,
                "daemon_pid": self.daemon.process.proc.pid if self.daemon.process.proc else 0, **extra}
        spec_path, out_path = self.workdir / f"{name}.spec.json", self.workdir / f"{name}.json"
        steps_path, log_path = self.workdir / f"{name}.steps.json", self.workdir / f"{name}.log"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiproc else "0", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_DIR), os.environ.get("PYTHONPATH")])))
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        env["OMP_NUM_THREADS"] = str(a.engine_threads)
        if multiproc:
            # vLLM's CPU multiproc executor would otherwise bind its worker's OpenMP threads to every core
            # (OMP_NUM_THREADS=2 here), ignoring OMP_NUM_THREADS: keep --engine-threads, unbound, as uniprocess.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env["KVSTORE_BENCH_STEPS"] = str(steps_path)
        python = sys.executable
        if venv is not None:
            env.update(lmcache_env(venv))
            python = str(venv / "bin" / "python")
        work = f"{len(extra['rounds'])} rounds" if "rounds" in extra else f"{len(prompts)} prompts"
        what = "timed connector" if timed else config["kv_connector"] if config else "no connector"
        print(f"  engine {name} ({what}, {work}, {mode}{', multi-process' if multiproc else ''})", flush=True)
        t = time.perf_counter()
        with open(log_path, "wb") as log:
            rc = subprocess.call([python, str(BENCH_DIR / "bench_vllm.py"), "engine", str(spec_path),
                                  str(out_path)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        if rc != 0:
            raise RuntimeError(f"engine {name} failed ({rc}); log {log_path}:\n{log_path.read_text()[-4000:]}")
        result: dict[str, Any] = json.loads(out_path.read_text())
        result["wall_s"] = time.perf_counter() - t
        result["log"] = str(log_path)
        if timed:
            result["steps"] = json.loads(steps_path.read_text())
        return result

    def ttft(self, tokens: int) -> dict[str, Any]:
        """Section 1 for one prompt length: engines A (store), B (restart, hits) and C (cold), uniprocess."""
        a = self.args
        run = ttft_run("ttft", a.prompts, tokens)
        engine_a = self.engine(f"ttft{tokens}_a_store", True, **run)
        after_a = self.daemon.stats()
        engine_b = self.engine(f"ttft{tokens}_b_restart_hit", True, **run)
        after_b = self.daemon.stats()
        engine_c = self.engine(f"ttft{tokens}_c_cold", False, **run)
        hit = [r["ttft_s"] for r in engine_b["requests"]]
        cold = [r["ttft_s"] for r in engine_c["requests"]]
        cold_on = [r["ttft_s"] for r in engine_a["requests"]]
        expected = tokens - 1  # every prompt token but the last (vLLM computes that one)
        b_external = [r["external_prefix_cache_hits"] for r in engine_b["requests"]]
        b_cached = [r["num_cached_tokens"] for r in engine_b["requests"]]
        return {
            "prompt_tokens": tokens, "prompts": a.prompts,
            "hit_p50_ms": 1000 * pct(hit, 50), "cold_p50_ms": 1000 * pct(cold, 50),
            "cold_connector_p50_ms": 1000 * pct(cold_on, 50),
            "speedup_p50": pct(cold, 50) / pct(hit, 50),
            "speedup_vs_cold_connector_p50": pct(cold_on, 50) / pct(hit, 50),
            "hit_ms": [1000 * x for x in hit], "cold_ms": [1000 * x for x in cold],
            "cold_connector_ms": [1000 * x for x in cold_on],
            "hit_generate_ms": [1000 * r["generate_s"] for r in engine_b["requests"]],
            "cold_generate_ms": [1000 * r["generate_s"] for r in engine_c["requests"]],
            "expected_hit_tokens": expected,
            "b_external_hit_tokens": b_external,
            "b_cached_tokens": b_cached,
            "b_hits_as_expected": all(x == expected for x in b_external + b_cached),
            "b_local_hit_tokens": [r["prefix_cache_hits"] for r in engine_b["requests"]],
            "outputs_identical": (outputs(engine_a) == outputs(engine_b) == outputs(engine_c)),
            "hit_min_ms": 1000 * min(hit), "cold_min_ms": 1000 * min(cold),
            "c_cached_tokens": [r["num_cached_tokens"] for r in engine_c["requests"]],
            "daemon_after_a": after_a, "daemon_after_b": after_b,
            "engines": {"a": engine_a, "b": engine_b, "c": engine_c},
        }

    def remote_ttft(self, tokens: int) -> dict[str, Any]:
        """Section 5: node A's engine stores; on node B (another daemon, its pool empty) a fresh engine
        finds the prefixes only in the shared Redis store; engine C computes them (no connector)."""
        from support.ports import free_ports
        from support.redis import RedisServer

        a = self.args
        run = ttft_run("remote", a.prompts, tokens)
        store = RedisServer(self.workdir / "redis", free_ports(1)[0], maxmemory="4gb").start()
        url = f"redis://{store.address}"
        node_a = BenchDaemon(self.workdir / "node_a", a.pool_size, "--remote", url).start()
        node_b = BenchDaemon(self.workdir / "node_b", a.pool_size, "--remote", url).start()

        def connector(node: BenchDaemon) -> dict[str, Any]:
            return {**self.plain_connector(), "kv_connector_extra_config": {"socket": node.socket}}

        try:
            engine_a = self.engine(f"remote{tokens}_a_store", connector(node_a), **run)
            client = node_a.process.client()
            deadline = time.monotonic() + 60
            while (r := client.stats().remote).queued_blocks and time.monotonic() < deadline:
                time.sleep(0.1)
            client.close()
            engine_b = self.engine(f"remote{tokens}_b_remote_hit", connector(node_b), **run)
            client = node_b.process.client()
            remote_b = client.stats().remote
            client.close()
            engine_c = self.engine(f"remote{tokens}_c_cold", False, **run)
        finally:
            node_a.cleanup()
            node_b.cleanup()
            store.kill()
        hit = [x["ttft_s"] for x in engine_b["requests"]]
        cold = [x["ttft_s"] for x in engine_c["requests"]]
        return {"prompt_tokens": tokens, "prompts": a.prompts,
                "remote_hit_p50_ms": 1000 * pct(hit, 50), "cold_p50_ms": 1000 * pct(cold, 50),
                "speedup_p50": pct(cold, 50) / pct(hit, 50),
                "remote_hit_ms": [1000 * x for x in hit], "cold_ms": [1000 * x for x in cold],
                "b_external_hit_tokens": [x["external_prefix_cache_hits"] for x in engine_b["requests"]],
                "a_uploaded_blocks": r.uploaded, "b_remote_hits": remote_b.hits,
                "b_fetch_ms_mean": 1000 * remote_b.fetch_seconds_sum / max(1, remote_b.fetch_seconds_count),
                "outputs_identical": outputs(engine_a) == outputs(engine_b) == outputs(engine_c),
                "engines": {"a": engine_a, "b": engine_b, "c": engine_c}}

    def disk_ttft(self, tokens: int) -> dict[str, Any]:
        """Section 6: engine A stores through a daemon with a disk tier; the daemon restarts with an empty
        pool (--fresh): a fresh engine B finds the prefixes only on disk; engine C computes them."""
        a = self.args
        run = ttft_run("disk", a.prompts, tokens)
        disk_dir = Path(a.disk_dir or self.workdir) / f"disk-{os.getpid()}-{tokens}"
        node = BenchDaemon(self.workdir / "disk_node", a.pool_size, "--disk-path", str(disk_dir)).start()
        connector = {**self.plain_connector(), "kv_connector_extra_config": {"socket": node.socket}}
        try:
            engine_a = self.engine(f"disk{tokens}_a_store", connector, **run)
            client = node.process.client()
            deadline = time.monotonic() + 120
            while (d := client.stats().disk).queued_bytes and time.monotonic() < deadline:
                time.sleep(0.1)
            client.close()
            node.process.stop()
            node.process.start("--fresh")  # the pool starts empty; the disk keeps its segments
            engine_b = self.engine(f"disk{tokens}_b_disk_hit", connector, **run)
            client = node.process.client()
            disk_b = client.stats().disk
            client.close()
            engine_c = self.engine(f"disk{tokens}_c_cold", False, **run)
        finally:
            node.cleanup()
            subprocess.run(["rm", "-rf", str(disk_dir)], check=False)
        hit = [x["ttft_s"] for x in engine_b["requests"]]
        cold = [x["ttft_s"] for x in engine_c["requests"]]
        return {"prompt_tokens": tokens, "prompts": a.prompts, "disk_dir": str(disk_dir),
                "disk_hit_p50_ms": 1000 * pct(hit, 50), "cold_p50_ms": 1000 * pct(cold, 50),
                "speedup_p50": pct(cold, 50) / pct(hit, 50),
                "disk_hit_ms": [1000 * x for x in hit], "cold_ms": [1000 * x for x in cold],
                "b_external_hit_tokens": [x["external_prefix_cache_hits"] for x in engine_b["requests"]],
                "a_written_blocks": d.written, "b_disk_read_blocks": disk_b.read_blocks,
                "b_read_ms_per_block": 1000 * disk_b.read_seconds / max(1, disk_b.read_blocks),
                "outputs_identical": outputs(engine_a) == outputs(engine_b) == outputs(engine_c),
                "engines": {"a": engine_a, "b": engine_b, "c": engine_c}}


def ttft_sections(bench: Bench, args: argparse.Namespace, report: dict[str, Any],
                  workloads: dict[str, list[dict[str, Any]]]) -> None:
    """Sections 1 (and 4, --against-lmcache) for each prompt length."""
    report["ttft"] = []
    if args.against_lmcache is not None:
        report["side_by_side"] = []
    for tokens in args.prompt_tokens:
        print(f"1. TTFT after restart, {tokens}-token prompts", flush=True)
        t = bench.ttft(tokens)
        report["ttft"].append(t)
        workloads[f"restart hit (B) {tokens}"] = [t["engines"]["b"]["steps"]]
        workloads[f"cold + store (A) {tokens}"] = [t["engines"]["a"]["steps"]]
        if args.against_lmcache is not None:
            print(f"4. Side by side with LMCache MP, {tokens}-token prompts", flush=True)
            try:
                report["side_by_side"].append(side_by_side(bench, tokens, args.against_lmcache))
            except Exception as e:  # noqa: BLE001 - a failed comparison must not lose the rest
                print(f"  side by side at {tokens} tokens FAILED: {e}", flush=True)
                report["side_by_side"].append({"prompt_tokens": tokens, "prompts": args.prompts,
                                               "error": str(e)})


def remote_section(bench: Bench, tokens: int) -> dict[str, Any]:
    print(f"5. TTFT from the remote tier (node B) vs cold, {tokens}-token prompts", flush=True)
    t = bench.remote_ttft(tokens)
    print(f"  remote hit p50 {t['remote_hit_p50_ms']:.1f} ms, cold p50 {t['cold_p50_ms']:.1f} ms: "
          f"{t['speedup_p50']:.2f}x (target >= 3x); fetch {t['b_fetch_ms_mean']:.1f} ms per lookup; "
          f"outputs identical: {t['outputs_identical']}", flush=True)
    return t


def disk_section(bench: Bench, tokens: int) -> dict[str, Any]:
    print(f"6. TTFT from the disk tier (daemon restarted with an empty pool) vs cold, {tokens}-token prompts",
          flush=True)
    t = bench.disk_ttft(tokens)
    print(f"  disk hit p50 {t['disk_hit_p50_ms']:.1f} ms, cold p50 {t['cold_p50_ms']:.1f} ms: "
          f"{t['speedup_p50']:.2f}x (target >= 5x); read {t['b_read_ms_per_block']:.2f} ms per block; "
          f"outputs identical: {t['outputs_identical']}", flush=True)
    return t

