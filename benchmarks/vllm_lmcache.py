"""bench_vllm.py's section 4 (`--against-lmcache VENV`): the TTFT workload side by side with LMCache's
multiprocess server ("LMCache MP"), both systems in vLLM's multi-process mode (see bench_vllm.py's
docstring for the setup and the venv)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_common import outputs, parse_bytes, pct, proc_cpu_s, ttft_run

if TYPE_CHECKING:
    from vllm_ttft import Bench


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


class LMCacheServer:
    """LMCache's multiprocess server (`--against-lmcache VENV`) on a free loopback port: L1 in a named
    shared-memory pool, engine-driven transfer (the engines' workers copy through that pool)."""

    def __init__(self, venv: Path, workdir: Path, name: str, chunk_size: int, l1_gib: float) -> None:
        from support.ports import free_port  # (bench_vllm puts tests/ on sys.path)

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



def side_by_side(bench: Bench, tokens: int, venv: Path) -> dict[str, Any]:
    """The TTFT workload (A stores, fresh B hits) for kvstore and for LMCache MP, both multi-process.
    Both A engines store first; then `--sbs-rounds` rounds of one fresh B engine each, the order
    flipping every round, so that both systems' hits are measured across the same stretch of this
    shared machine's drifting speed (its one-token forward varies by tens of ms within minutes)."""
    a = bench.args
    run = dict(ttft_run("sbs", a.prompts, tokens), multiproc=True)  # not the uniprocess runs' prompts
    ours_a = bench.engine(f"sbs{tokens}_kvstore_a_store", bench.plain_connector(), **run)
    server = LMCacheServer(venv, bench.workdir, f"sbs{tokens}_lmcache_server", a.block_size,
                           parse_bytes(a.pool_size) / (1 << 30))
    ours_b: list[dict[str, Any]] = []
    lm_b: list[dict[str, Any]] = []
    idle_cpu_s = {"lmcache_server_during_ours": 0.0, "daemon_during_lmcache": 0.0}  # the other's server
    try:
        server.start()
        assert server.proc is not None
        lm_a = bench.engine(f"sbs{tokens}_lmcache_a_store", server.connector(), venv=venv, **run)
        for r in range(a.sbs_rounds):
            for ours in (True, False) if r % 2 == 0 else (False, True):
                pid = server.proc.pid if ours else bench.daemon.pid
                cpu = proc_cpu_s(pid)
                if ours:
                    ours_b.append(bench.engine(f"sbs{tokens}_kvstore_b_hit_{r}", bench.plain_connector(), **run))
                else:
                    lm_b.append(bench.engine(f"sbs{tokens}_lmcache_b_hit_{r}", server.connector(), venv=venv,
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
