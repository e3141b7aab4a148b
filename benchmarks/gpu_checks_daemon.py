"""gpu_device_checks.py's checks of the daemon process: `pidns` (daemon and two engines in three PID
namespaces, both engines PID 1: CUDA IPC does not open across them, so each registration must be
refused naming the fix, and the daemon keep serving; the engines run as `gpu_device_checks.py
pid-engine`) and `fatal` (a sticky CUDA error in the daemon: it exits 75)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from gpu_checks_common import SELF, result, say, wait_for

# -- pidns: separate PID namespaces, equal engine PIDs -------------------------------------------------


def pid_engine(socket: str, name: str) -> None:
    """An engine in a PID namespace of its own registers its CUDA cache: the daemon (in another one)
    must refuse it, naming the fix, since legacy CUDA IPC handles do not open across PID namespaces."""
    from support.cuda_engine import CudaEngine

    from kvstore_client.errors import KVStoreError

    out: dict[str, object] = {"name": name, "pid": os.getpid()}
    try:
        engine = CudaEngine(socket, "pidns", "LBNHC" if name == "a" else "BLNHC")
    except KVStoreError as e:
        out.update(code=e.code.name, error=str(e))
    else:
        out["registered"] = True
        engine.close()
    print(json.dumps(out), flush=True)


def check_pidns() -> int:
    """Daemon and two engines in three PID namespaces (both engines PID 1): each registration is
    refused with FAILED_PRECONDITION naming hostPID, and the daemon keeps serving."""
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
    client = KVStoreClient(sock, timeout=1.0)
    try:
        up = wait_for(lambda: os.path.exists(sock) and _healthy(client), 60, 0.1)
        if not up:
            return result(False, "daemon in its PID namespace did not start: " + open(log.name).read()[-2000:])
        engines = [subprocess.Popen([*ns, sys.executable, SELF, "pid-engine", sock, n], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for n in ("a", "b")]
        outs = [e.communicate(timeout=120) for e in engines]
        results = []
        for (stdout, stderr), e in zip(outs, engines, strict=True):
            line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
            results.append(json.loads(line) if line.startswith("{") else {"rc": e.returncode, "err": stderr[-1500:]})
        for r in results:
            say(**r)
        refused = all(r.get("code") == "FAILED_PRECONDITION" and "hostPID" in str(r.get("error")) for r in results)
        serving = dproc.poll() is None and _healthy(client)
        say(engine_pids=[r.get("pid") for r in results], refused_naming_hostPID=refused, daemon_serving=serving)
        return result(refused and serving, f"both registrations refused naming hostPID: {refused}, "
                                           f"daemon serving after: {serving}")
    finally:
        client.close()
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

