"""gpu_device_checks.py's two-engine checks: `kill` (an engine SIGKILLed while its store waits on its step;
another engine stores and loads meanwhile) and `busy` (engine B's load latency, engine A idle vs running
50 ms steps that store every step). Their engine A runs as `gpu_device_checks.py victim|stepper`."""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from gpu_checks_common import MIB, SELF, daemon, device_used, result, say, wait_for

STEP_CYCLES = 100_000_000  # torch.cuda._sleep: ~50 ms on an H100 (cuda_engine's 200M is ~0.1 s)


# -- kill: an engine dies while the daemon polls its step --------------------------------------------


def victim(socket: str) -> None:
    """Engine A: a ~10 s kernel on its stream, then the step's record and a store that must wait for it."""
    import torch
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    from kvstore_client.device import order_before_copies

    engine = CudaEngine(socket, "victim", "LBNHC", num_blocks=256)
    torch.cuda._sleep(20_000_000_000)
    order_before_copies(engine.kv.device)
    engine.session.store([key_of("victim", i) for i in range(64)], list(range(64)))
    print("submitted", flush=True)
    time.sleep(120)


def check_kill() -> int:
    import torch
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    work = tempfile.mkdtemp(prefix="kvstore-kill-")
    d = daemon(work, "--copy-threads", "2")
    client = d.client()
    try:
        survivor = CudaEngine(d.socket, "survivor", "LBNHC")
        keys = [key_of("survivor", i) for i in range(8)]
        before = device_used()
        a = subprocess.Popen([sys.executable, SELF, "victim", d.socket], stdout=subprocess.PIPE, text=True)
        assert a.stdout is not None
        line = a.stdout.readline().strip()
        say(victim=line, victim_gpu_mib=(device_used() - before) // MIB)
        wait_for(lambda: client.stats().jobs_in_flight >= 1, 5, 0.01)  # its store arrived, and waits
        waiting = client.stats().jobs_in_flight
        latencies: list[float | None] = []
        killed_at = None
        started = time.monotonic()
        for _ in range(40):  # ~4 s of B's traffic: 0.5 s before the kill, the rest after
            if killed_at is None and time.monotonic() - started > 0.5:
                a.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
            t = time.monotonic()
            ok = survivor.store(keys, list(range(8))) == 8 and survivor.load(keys, list(range(32, 40))) == 8
            latencies.append(round(time.monotonic() - t, 4) if ok else None)
            time.sleep(0.1)
        a.wait(10)
        ended = wait_for(lambda: client.stats().engines == 1, 30)
        ended_after = round(time.monotonic() - (killed_at or 0), 2)
        returned = wait_for(lambda: device_used() <= before + 64 * MIB, 30)
        stats = client.stats()
        wrong = survivor.wrong_blocks(keys, list(range(32, 40)))
        survivor.close()
        say(victim_jobs_waiting_before_kill=waiting, survivor_latency_s=latencies,
            victim_session_ended=ended, seconds_from_kill_to_session_end=ended_after, gpu_memory_returned=returned,
            gpu_mib_over_before=(device_used() - before) // MIB, jobs_in_flight=stats.jobs_in_flight,
            engines=stats.engines, survivor_wrong_blocks=wrong, daemon_alive=d.alive())
        ok = (waiting >= 1 and None not in latencies and ended and returned and stats.jobs_in_flight == 0
              and not wrong and d.alive())
        return result(ok, "survivor kept working, the dead session ended, GPU memory returned" if ok else
                      "see the JSON above")
    finally:
        client.close()
        d.stop()
        shutil.rmtree(work, ignore_errors=True)
        del torch


# -- busy: engine B's load latency with engine A idle and running steps -------------------------------


def stepper(socket: str, seconds: str) -> None:
    """Engine A: 50 ms steps on its stream, each recorded and followed by a store of 8 blocks."""
    import torch
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    from kvstore_client.device import order_before_copies

    engine = CudaEngine(socket, "stepper", "LBNHC", num_blocks=512)
    print("ready", flush=True)
    end, step, jobs = time.monotonic() + float(seconds), 0, []
    while time.monotonic() < end:
        torch.cuda._sleep(STEP_CYCLES)
        order_before_copies(engine.kv.device)
        base = (step * 8) % 448
        jobs.append(engine.session.store([key_of("stepper", step * 8 + i) for i in range(8)],
                                         list(range(base, base + 8))))
        torch.cuda.current_stream().synchronize()  # the step's end, as vLLM waits for its sampled tokens
        step += 1
    done = engine.session.wait(jobs, timeout=30)
    print(json.dumps({"steps": step, "stores_ok": sum(r.blocks_ok for r in done.values())}), flush=True)
    engine.close()


def check_busy() -> int:
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    work = tempfile.mkdtemp(prefix="kvstore-busy-")
    d = daemon(work, "--copy-threads", "2")
    try:
        b = CudaEngine(d.socket, "loader", "LBNHC")
        keys = [key_of("loader", i) for i in range(8)]
        assert b.store(keys, list(range(8))) == 8

        def loads(n: int) -> list[float]:
            out = []
            for _ in range(n):
                t = time.monotonic()
                job = b.session.load(keys, list(range(32, 40)))  # nothing of B's own pending: pure daemon time
                assert b.session.wait([job], timeout=30)[job].blocks_ok == 8
                out.append(time.monotonic() - t)
                time.sleep(0.01)
            return out

        def summary(xs: list[float]) -> dict[str, float]:
            xs = sorted(xs)
            p99 = xs[int(0.99 * (len(xs) - 1))]
            return {"p50_ms": round(statistics.median(xs) * 1e3, 2), "p99_ms": round(p99 * 1e3, 2),
                    "max_ms": round(xs[-1] * 1e3, 2)}

        idle = summary(loads(60))
        a = subprocess.Popen([sys.executable, SELF, "stepper", d.socket, "6"], stdout=subprocess.PIPE, text=True)
        assert a.stdout is not None and a.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        busy = summary(loads(60))
        stepper_out = a.stdout.read().strip()
        a.wait(30)
        wrong = b.wrong_blocks(keys, list(range(32, 40)))
        b.close()
        say(idle=idle, busy=busy, stepper=stepper_out, wrong_blocks=wrong)
        # B waits for nothing of A's: busy p50 within 5 ms of idle (a 50 ms step held in front of B fails it).
        ok = not wrong and busy["p50_ms"] <= idle["p50_ms"] + 5 and '"stores_ok"' in stepper_out
        return result(ok, f"p50 idle {idle['p50_ms']} ms, busy {busy['p50_ms']} ms")
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)

