"""The GPU checks of benchmarks/gpu_checks.sh that are not pytest tests: each prints JSON lines and a
last line `RESULT PASS|FAIL|SKIP <why>`. Run with tests/ on PYTHONPATH, from the repository root:

    python benchmarks/gpu_device_checks.py kill     an engine SIGKILLed while its store waits on its step;
                                                   another engine stores and loads meanwhile
    python benchmarks/gpu_device_checks.py busy     load latency of engine B, engine A idle vs running 50 ms
                                                   steps that store every step (two engines, two streams)
    python benchmarks/gpu_device_checks.py pidns    daemon and two engines in three PID namespaces, both
                                                   engines PID 1: byte-exact, with the late-write ordering
    python benchmarks/gpu_device_checks.py fatal    a sticky CUDA error in the daemon: it exits 75

Engines are tests/support/cuda_engine.py's (vLLM 0.32's CUDA layout; writes land late, behind a slow
kernel on a side stream, with no host sync, so wrong ordering shows as wrong bytes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SELF = os.path.abspath(__file__)
MIB = 1 << 20
STEP_CYCLES = 100_000_000  # torch.cuda._sleep: ~50 ms on an H100 (cuda_engine's 200M is ~0.1 s)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def result(ok: bool | None, why: str) -> int:
    print(f"RESULT {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {why}", flush=True)
    return 0 if ok is not False else 1


def daemon(workdir: str, *extra: str, pool: str = "1GiB"):  # type: ignore[no-untyped-def]
    from kvstore_service.harness import DaemonProcess

    return DaemonProcess(workdir, pool, "32MiB", *extra).start()


def device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(interval)
    return True


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


# -- pidns: separate PID namespaces, equal engine PIDs -------------------------------------------------


def pid_engine(socket: str, name: str, other: str) -> None:
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    engine = CudaEngine(socket, "pidns", "LBNHC" if name == "a" else "BLNHC")
    mine = [key_of(f"pidns-{name}", i) for i in range(16)]
    out: dict[str, object] = {"name": name, "pid": os.getpid()}
    out["stored"] = engine.store(mine, list(range(16)))  # late writes: wrong bytes if unordered
    out["loaded_own"] = engine.load(mine, list(range(16, 32)))
    out["own_wrong"] = engine.wrong_blocks(mine, list(range(16, 32)))
    theirs = [key_of(f"pidns-{other}", i) for i in range(16)]
    for _ in range(100):  # the other engine's blocks, once they are in
        if engine.session.lookup(theirs)[0] == 16:
            break
        time.sleep(0.1)
    out["loaded_other"] = engine.load(theirs, list(range(32, 48)))
    out["other_wrong"] = engine.wrong_blocks(theirs, list(range(32, 48)))
    print(json.dumps(out), flush=True)
    engine.close()


def check_pidns() -> int:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                           text=True) if unshare else None
    if probe is None or probe.returncode != 0:
        return result(None, f"unshare --pid not permitted here: {probe.stderr.strip() if probe else 'no unshare'}")
    from kvstore_client import KVStoreClient

    work = tempfile.mkdtemp(prefix="kvstore-pidns-")
    sock = os.path.join(work, "kvstore.sock")
    pool = f"/dev/shm/kvstore-pidns-{os.getpid()}"
    ns = [unshare, "--pid", "--fork", "--mount-proc"]
    with open(os.path.join(work, "daemon.log"), "w") as log:
        dproc = subprocess.Popen([*ns, sys.executable, "-m", "kvstore_service", "serve", "--socket", sock,
                                  "--pool-path", pool, "--pool-size", "512MiB", "--segment-size", "32MiB"],
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        client = KVStoreClient(sock, timeout=1.0)
        up = wait_for(lambda: os.path.exists(sock) and _healthy(client), 60, 0.1)
        client.close()
        if not up:
            return result(False, "daemon in its PID namespace did not start: " + open(log.name).read()[-2000:])
        engines = [subprocess.Popen([*ns, sys.executable, SELF, "pid-engine", sock, n, o], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for n, o in (("a", "b"), ("b", "a"))]
        outs = [e.communicate(timeout=120) for e in engines]
        results = []
        for (stdout, stderr), e in zip(outs, engines, strict=True):
            line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
            results.append(json.loads(line) if line.startswith("{") else {"rc": e.returncode, "err": stderr[-1500:]})
        for r in results:
            say(**r)
        ok = all(r.get("stored") == 16 and r.get("loaded_own") == 16 and r.get("loaded_other") == 16
                 and r.get("own_wrong") == [] and r.get("other_wrong") == [] for r in results)
        pids = [r.get("pid") for r in results]
        say(engine_pids=pids, equal_pids=len(set(pids)) == 1, daemon_alive=dproc.poll() is None)
        return result(ok and dproc.poll() is None, f"engine PIDs {pids}, byte-exact with ordering: {ok}")
    finally:
        dproc.send_signal(signal.SIGTERM)
        try:
            dproc.wait(15)
        except subprocess.TimeoutExpired:
            dproc.kill()
        for path in (pool,):
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(work, ignore_errors=True)


def _healthy(client) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(client.health() == "SERVING")
    except Exception:
        return False


# -- fatal: a sticky CUDA error makes the daemon exit 75 ----------------------------------------------

# The daemon, plus a thread that, once the flag file exists, writes through a wild device pointer with
# a torch kernel in the daemon's (primary) CUDA context: CUDA_ERROR_ILLEGAL_ADDRESS (700), sticky.
POISONED_DAEMON = r"""
import os, runpy, sys, threading, time
flag = sys.argv.pop(1)
def poison():
    while not os.path.exists(flag):
        time.sleep(0.05)
    import torch
    print("poisoning the CUDA context", flush=True)
    storage = torch._C._construct_storage_from_data_pointer(0x7F0000000000, torch.device("cuda", 0), 1 << 20)
    wild = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage)
    wild.fill_(1)
    try:
        torch.cuda.synchronize()
    except Exception as e:
        print("poisoned:", e, flush=True)
threading.Thread(target=poison, daemon=True).start()
sys.argv = ["kvstore_service", *sys.argv[1:]]
runpy.run_module("kvstore_service", run_name="__main__", alter_sys=True)
"""


def check_fatal() -> int:
    import torch
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    if not hasattr(torch._C, "_construct_storage_from_data_pointer"):
        return result(None, "this torch cannot build a storage at a wild pointer")
    from kvstore_client import KVStoreClient

    work = tempfile.mkdtemp(prefix="kvstore-fatal-")
    sock, flag = os.path.join(work, "kvstore.sock"), os.path.join(work, "poison")
    pool = f"/dev/shm/kvstore-fatal-{os.getpid()}"
    log = open(os.path.join(work, "daemon.log"), "w+")
    dproc = subprocess.Popen([sys.executable, "-c", POISONED_DAEMON, flag, "serve", "--socket", sock, "--pool-path",
                              pool, "--pool-size", "256MiB", "--segment-size", "32MiB", "--devices", "cuda"],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        client = KVStoreClient(sock, timeout=1.0)
        up = wait_for(lambda: os.path.exists(sock) and _healthy(client), 60, 0.1)
        client.close()
        if not up:
            return result(False, "daemon did not start")
        engine = CudaEngine(sock, "fatal", "LBNHC")
        keys = [key_of("fatal", i) for i in range(8)]
        first = engine.store(keys, list(range(8)))
        open(flag, "w").close()
        time.sleep(2)
        try:
            job = engine.session.load(keys, list(range(16, 24)))
            engine.session.wait([job], timeout=20)
        except Exception as e:  # the daemon is gone
            say(engine_saw=f"{type(e).__name__}: {e}"[:300])
        try:
            rc = dproc.wait(30)
        except subprocess.TimeoutExpired:
            rc = None
        log.seek(0)
        text = log.read()
        sticky = [line for line in text.splitlines() if "sticky" in line.lower() or "poisoned" in line]
        say(first_store_ok=first, daemon_rc=rc, log_lines=sticky[-5:])
        return result(rc == 75, f"daemon exit code {rc} (75 expected)")
    finally:
        if dproc.poll() is None:
            dproc.kill()
        log.close()
        if os.path.exists(pool):
            os.unlink(pool)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "victim":
        victim(*args)
        return 0
    if mode == "stepper":
        stepper(*args)
        return 0
    if mode == "pid-engine":
        pid_engine(*args)
        return 0
    import torch

    if not torch.cuda.is_available():
        return result(None, f"no CUDA GPU visible to torch {torch.__version__}")
    return {"kill": check_kill, "busy": check_busy, "pidns": check_pidns, "fatal": check_fatal}[mode]()


if __name__ == "__main__":
    sys.exit(main())
