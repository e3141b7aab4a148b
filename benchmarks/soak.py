"""Soak test: a real daemon, engine processes doing random store/load/lookup, faults injected.

    python benchmarks/soak.py [--engines 4] [--jobs 10000] [--kill-engines 100] [--kill-daemon N] [--json F]

Phase 1 runs `--engines` worker processes of `--jobs` operations each (stores, loads, lookups, some
under a lease) while `--kill-engines` extra workers are started and killed with SIGKILL mid-job one
after another. Every loaded block is verified by its engine: block contents derive from keys, so
any process can check bytes it did not write. Afterwards the daemon must hold no engine, lease,
job, mapping or shared-memory file of any worker. Phase 2 (with `--kill-daemon N`) runs the workers
again and kills the daemon with SIGKILL N times, restarting it on the same pool file: stores that
completed and were sealed before a kill must still load byte-exact, and the workers re-register
alone. (Before each kill the workers are paused until the daemon's seals are done: a store
completed but not sealed yet is lost at a kill, whole and never served, which the workers would
count as lost.)

`corrupt` counts blocks whose bytes differ from their key's content (or a count the daemon got
wrong); `lost` counts blocks whose store completed but that later missed although nothing was
evicted. Both must be 0. The engine, the workers and the daemon's /proc checks live in tests/support/
(`support.shm_engine`, `support.workers`, `support.daemon`), shared with tests/process/test_faults.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # for `support`, shared with the tests

from support.daemon import DaemonProcess, completion_channels, engine_needles, shm_files, wait_for  # noqa: E402
from support.workers import collect, kill_mid_job, spawn_worker, wait_ready  # noqa: E402

from kvstore_client import KVStoreClient  # noqa: E402

# -- soak ----------------------------------------------------------------------------------------


def _sum(reports: list[dict], name: str) -> int:
    return sum(int(r[name]) for r in reports)


def _worker_args(a: argparse.Namespace, index: int) -> list[str]:
    scopes = ",".join(["shared", "kill"] + [f"own{i}" for i in range(a.engines) if i != index])
    return ["--scope", f"own{index}", "--read-scopes", scopes, "--keys", str(a.keys), "--jobs", str(a.jobs),
            "--block-bytes", str(a.block_bytes), "--seed", str(a.seed * 1000 + index + 1)]


def _idle(client: KVStoreClient) -> bool:
    stats = client.stats()
    return stats.engines == 0 and stats.leases == 0 and stats.jobs_in_flight == 0


def _leak_check(daemon: DaemonProcess, client: KVStoreClient, killed: list[int]) -> dict:
    """After every worker ended: no session, lease or job left, no memory of a killed worker still
    mapped or open in the daemon, no completion channel left, nothing of theirs in /dev/shm."""
    settled = wait_for(lambda: _idle(client))
    stats = client.stats()
    wait_for(lambda: not daemon.references(engine_needles(killed)) and not completion_channels(daemon.pid),
             timeout=10)
    return {"settled": settled, "engines": stats.engines, "leases": stats.leases,
            "jobs_in_flight": stats.jobs_in_flight, "leaked_mappings": len(daemon.references(engine_needles(killed))),
            "leaked_channels": completion_channels(daemon.pid),
            "leaked_files": sum(len(shm_files(pid)) for pid in killed)}


def soak(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    workdir = tempfile.mkdtemp(prefix="kvstore-soak-")
    needed = (a.engines * a.keys + 64 + 256) * a.block_bytes
    pool = max(64 << 20, 2 * needed + (8 << 20))
    daemon = DaemonProcess(workdir, str(pool), "4MiB").start()
    client = KVStoreClient(daemon.socket)
    result: dict = {"engines": a.engines, "jobs_per_engine": a.jobs, "kill_engines": a.kill_engines,
                    "kill_daemon": a.kill_daemon, "pool_bytes": pool}
    try:
        shm_before = sorted(glob.glob("/dev/shm/kvstore-*"))
        result["rss_kib_before"] = daemon.memory_kib()
        samples: list[int] = []  # RssAnon every half second: flat, or growing with the work done?
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.5):
                samples.append(daemon.memory_kib()["RssAnon"])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        workers = [spawn_worker(daemon.socket, *_worker_args(a, i)) for i in range(a.engines)]
        for w in workers:
            wait_ready(w)
        killed = kill_mid_job(daemon.socket, a.kill_engines, rng, "--scope", "kill", "--keys", "128",
                              "--block-bytes", str(a.block_bytes), "--read-scopes", "shared")
        reports = [collect(w) for w in workers]
        sampling.set()
        sampler.join()
        result["phase1_seconds"] = round(time.monotonic() - started, 1)
        # RssAnon at 0, 25, 50, 75 and 100 % of phase 1
        result["rss_anon_kib_during"] = [samples[round(f * (len(samples) - 1))] for f in (0, .25, .5, .75, 1)] \
            if samples else []
        result["leaks"] = _leak_check(daemon, client, killed)
        stats = client.stats()
        result["rss_kib_after"] = daemon.memory_kib()
        result["phase1"] = _summarize(reports, stats)
        shm_after = sorted(glob.glob("/dev/shm/kvstore-*"))
        result["shm_files_before"] = len(shm_before)
        result["shm_files_after"] = len(shm_after)
        ours = {daemon.pool_path, f"{daemon.pool_path}.events"}  # (the pool and its descriptions' journal)
        result["shm_files_new"] = sorted(set(shm_after) - set(shm_before) - ours)

        if a.kill_daemon:
            # The workers run until every kill is done and they worked a while on the last daemon.
            started = time.monotonic()
            workers = [spawn_worker(daemon.socket, *_worker_args(a, i), "--until-eof") for i in range(a.engines)]
            for w in workers:
                wait_ready(w)
            for _ in range(a.kill_daemon):
                time.sleep(rng.uniform(0.5, 2.0))
                # A completed store survives a kill once sealed (its slot header is written then, with
                # its checksum), and the workers count every completed store they miss later as lost:
                # pause them while the seals finish, kill, restart, resume. Jobs in flight still run
                # into the kill (the workers' stores are paused between RPCs, not the daemon's copies).
                for w in workers:
                    os.kill(w.pid, signal.SIGSTOP)
                probe = KVStoreClient(daemon.socket)
                for _ in range(2):  # twice, a moment apart: a paused worker's last RPC may still be landing
                    wait_for(lambda probe=probe: (s := probe.stats()).unsealed_blocks == 0 and not s.jobs_in_flight,
                             timeout=30)
                    time.sleep(0.3)
                probe.close()
                daemon.kill()
                daemon.start()
                probe = KVStoreClient(daemon.socket)  # recovered blocks are missed until verified
                wait_for(lambda probe=probe: probe.stats().unverified_blocks == 0, timeout=60)
                probe.close()
                for w in workers:
                    os.kill(w.pid, signal.SIGCONT)
            time.sleep(8.0)  # reconnect backoff is at most 5 s, then traffic on the last daemon
            reports = [collect(w) for w in workers]
            client.close()
            client = KVStoreClient(daemon.socket)
            stats = client.stats()
            result["phase2_seconds"] = round(time.monotonic() - started, 1)
            result["daemon_kills"] = a.kill_daemon
            result["phase2"] = _summarize(reports, stats)
            result["phase2"]["min_registrations"] = min(r["registrations"] for r in reports)
            result["phase2"]["all_connected"] = all(r["connected"] for r in reports)
            result["phase2"]["ok_after_reregister"] = _sum(reports, "ok_after_reregister")
            result["phase2"]["leaks"] = _leak_check(daemon, client, [])
        result["daemon_alive"] = daemon.alive()
    finally:
        client.close()
        daemon.cleanup()
    phases = [result[p] for p in ("phase1", "phase2") if p in result]
    leaks = [result["leaks"]] + [p["leaks"] for p in phases if "leaks" in p]
    result["ok"] = (all(p["corrupt"] == 0 and p["lost"] == 0 for p in phases) and result["daemon_alive"]
                    and all(x["settled"] and not (x["leaked_files"] or x["leaked_mappings"] or x["leaked_channels"])
                            for x in leaks))
    return result


def _summarize(reports: list[dict], stats) -> dict:
    names = ("ops", "stores", "stored_blocks", "loads", "loaded_blocks", "missed_blocks", "lookups", "leases",
             "corrupt", "lost", "lost_excused", "lost_after_inflight_dedupe", "failed_jobs", "rpc_errors")
    out = {n: _sum(reports, n) for n in names}
    out.update(daemon_blocks=stats.blocks, daemon_evictions=stats.evictions,
               daemon_corrupt_blocks=stats.corrupt_blocks, daemon_failed_blocks=stats.failed_blocks)
    return out


def print_table(result: dict) -> None:
    rows: list[tuple[str, object]] = [
        ("engines x ops", f"{result['engines']} x {result['jobs_per_engine']}"),
        ("pool bytes", result["pool_bytes"]),
    ]
    for phase in ("phase1", "phase2"):
        if phase not in result:
            continue
        p = result[phase]
        rows += [(f"{phase} {k}", v) for k, v in p.items() if k != "leaks"]
        rows.append((f"{phase} seconds", result[f"{phase}_seconds"]))
    rows += [(f"leaks {k}", v) for k, v in result["leaks"].items()]
    if "phase2" in result:
        rows += [("daemon kills", result["daemon_kills"])]
        rows += [(f"phase2 leaks {k}", v) for k, v in result["phase2"]["leaks"].items()]
    rows += [("engines killed", result["kill_engines"]),
             ("daemon RSS KiB before", result["rss_kib_before"]), ("daemon RSS KiB after", result["rss_kib_after"]),
             ("daemon RssAnon KiB during phase 1", result["rss_anon_kib_during"]),
             ("/dev/shm kvstore files before", result["shm_files_before"]),
             ("/dev/shm kvstore files after", result["shm_files_after"]),
             ("new /dev/shm files left", len(result["shm_files_new"])), ("daemon alive", result["daemon_alive"]),
             ("OK", result["ok"])]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--jobs", type=int, default=10000, help="operations per engine process")
    p.add_argument("--kill-engines", type=int, default=100, help="engine processes killed mid-job (phase 1)")
    p.add_argument("--kill-daemon", type=int, default=0, help="daemon SIGKILLs + restarts (phase 2)")
    p.add_argument("--keys", type=int, default=256, help="own keys per engine")
    p.add_argument("--block-bytes", type=int, default=16 * 1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args()
    result = soak(a)
    print_table(result)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
