"""gpu_device_checks.py's checks of what only a GPU node can settle (issue "Device paths, third review"):

- `nonroot`: the chart's default, a daemon running as uid 10001 against a root engine: store and load
  byte-exact, in order (CUDA IPC handles and torch's 0600 reference-counter files cross uids here);
- `sigterm`: the daemon SIGTERMed while a load copies: it drains and exits 0, the load's blocks come back
  exact (or, reported failed, are never written afterwards) and no byte lands outside them (sentinels);
- `kernel`: the opt-in copy kernel (KVSTORE_CUDA_COPY_KERNEL=1) on engine IPC memory, byte-exact; then a
  sticky fault in that daemon: it exits 75, as documented;
- `bigpool`: a pool of up to 64 GiB registered (pinned in segment pieces) at the first engine's mapping,
  and a 32 GiB engine cache opened by IPC, its last blocks stored and loaded exact; times of both.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

from gpu_checks_common import MIB, daemon, result, say

DAEMON_UID = 10001  # the chart's securityContext.runAsUser


def _engine_round(socket: str, namespace: str, blocks: int, num_blocks: int = 64, first: int = 0) -> dict[str, object]:
    """A root engine stores `blocks` blocks (written late, behind a slow kernel) at ids first.., loads them
    into the next ids, and counts the wrong ones; `exact`: every block stored and loaded, none wrong."""
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    engine = CudaEngine(socket, namespace, "LBNHC", num_blocks=num_blocks)
    try:
        keys = [key_of(namespace, i) for i in range(blocks)]
        stored_ids, loaded_ids = list(range(first, first + blocks)), list(range(first + blocks, first + 2 * blocks))
        stored = engine.store(keys, stored_ids)
        loaded = engine.load(keys, loaded_ids)
        wrong = engine.wrong_blocks(keys, loaded_ids)
        return {"stored": stored, "loaded": loaded, "wrong": wrong, "exact": stored == loaded == blocks and not wrong}
    finally:
        engine.close()


def check_nonroot() -> int:
    if os.geteuid() != 0:
        return result(None, "needs root: the engine is root, the daemon uid 10001")
    from kvstore_client.errors import KVStoreError
    from kvstore_service.harness import DaemonProcess

    work = tempfile.mkdtemp(prefix="kvstore-nonroot-")
    os.chmod(work, 0o755)
    home = os.path.join(work, "daemon")
    os.mkdir(home)
    os.chown(home, DAEMON_UID, DAEMON_UID)
    d = DaemonProcess(home, "1GiB", "32MiB", "--devices", "cuda", env={"HOME": home},
                      pool_path=f"/dev/shm/kvstore-nonroot-{os.getpid()}", uid=DAEMON_UID)
    try:
        d.start(timeout=120)
        say(daemon_uid=os.stat(f"/proc/{d.pid}").st_uid)
        try:
            out = _engine_round(d.socket, "nonroot", 16)
        except KVStoreError as e:
            say(registration=str(e)[:500])
            return result(False, f"a root engine's registration with a uid-{DAEMON_UID} daemon failed: {e}"[:300])
        say(**out)
        return result(bool(out["exact"]), f"uid-{DAEMON_UID} daemon, root engine: stored {out['stored']}, "
                                          f"loaded {out['loaded']}, wrong {out['wrong']}")
    finally:
        d.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def check_sigterm() -> int:
    import torch
    from support.blocks import key_of
    from support.cuda_engine import CudaEngine

    work = tempfile.mkdtemp(prefix="kvstore-sigterm-")
    d = daemon(work, "--copy-threads", "2")
    try:
        engine = CudaEngine(d.socket, "sigterm", "LBNHC", num_blocks=512)
        keys = [key_of("sigterm", i) for i in range(192)]
        stored = engine.store(keys, list(range(192)))
        sentinels = list(range(192, 256)) + list(range(448, 512))
        engine.write_late(list(range(192, 512)), None)  # -1 everywhere the load may land, and around it
        torch.cuda.synchronize()
        loaded_ids = list(range(256, 448))
        job = engine.session.load(keys, loaded_ids)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        try:
            done = engine.session.wait([job], timeout=60)[job]
            outcome = f"ok {done.blocks_ok}, failed {done.blocks_failed}"
        except Exception as e:  # the session ended with the daemon before the job's result came
            done, outcome = None, f"{type(e).__name__}: {e}"[:200]
        rc = d.proc.wait(60)
        torch.cuda.synchronize()
        snapshot = engine.kv.clone()
        time.sleep(1.0)
        torch.cuda.synchronize()
        late_writes = not torch.equal(snapshot, engine.kv)
        untouched = all(bool((v[b].view(torch.int16) == -1).all()) for v in engine.views for b in sentinels)
        exact = done is not None and done.blocks_ok == len(keys) and not engine.wrong_blocks(keys, loaded_ids)
        say(stored=stored, load=outcome, daemon_rc=rc, exact=exact, late_writes=late_writes,
            sentinels_untouched=untouched)
        ok = rc == 0 and not late_writes and untouched and (exact or done is None or done.blocks_failed > 0)
        return result(ok, f"SIGTERM mid-load: daemon rc {rc}, load {outcome}, exact {exact}, "
                          f"late writes {late_writes}, sentinels untouched {untouched}")
    finally:
        d.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def check_kernel() -> int:
    from gpu_checks_daemon import check_fatal

    from kvstore_service import native

    os.environ["KVSTORE_CUDA_COPY_KERNEL"] = "1"  # (read by the native module at import: the daemons inherit it)
    if not native.features().get("cuda_copy_kernel"):
        return result(None, f"no copy kernel in this build: {native.features()}")
    work = tempfile.mkdtemp(prefix="kvstore-kernel-")
    d = daemon(work, "--devices", "cuda")
    try:
        out = _engine_round(d.socket, "kernel", 32)
        log = d.log.read_text()
        say(**out, fell_back="falls back" in log or "copy engines" in log)
    finally:
        d.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    if not out["exact"]:
        return result(False, f"copy kernel on IPC memory: {out}")
    say(injected="a sticky fault in the kernel daemon's context")
    return check_fatal()  # (its daemon inherits KVSTORE_CUDA_COPY_KERNEL=1): must exit 75


def check_bigpool() -> int:
    st = os.statvfs("/dev/shm")
    room = st.f_bavail * st.f_frsize
    size = min(64 << 30, (room - (2 << 30)) // (1 << 30) << 30)
    if size < 8 << 30:
        return result(None, f"/dev/shm has {room // MIB} MiB free: too little for a large pool")
    from kvstore_service.harness import DaemonProcess

    work = tempfile.mkdtemp(prefix="kvstore-bigpool-")
    d = DaemonProcess(work, str(size), "64MiB", "--devices", "cuda", "--populate-first", str(size))
    started = time.monotonic()
    try:
        d.start(timeout=240)  # (the whole pool faulted in before it serves: the registration then pins it all)
        up = time.monotonic() - started
        num_blocks = (32 << 30) // (4 * 16384)  # a 32 GiB engine cache of 64 KiB blocks
        started = time.monotonic()
        out = _engine_round(d.socket, "bigpool", 8, num_blocks=num_blocks, first=num_blocks - 16)
        first_round = time.monotonic() - started
        log = d.log.read_text()
        pinned = "could not pin" not in log
        say(pool_gib=size >> 30, daemon_up_s=round(up, 1), register_and_round_s=round(first_round, 1),
            pinned=pinned, **out)
        ok = pinned and bool(out["exact"])
        return result(ok, f"{size >> 30} GiB pool pinned {pinned} (daemon up {up:.1f} s; the first engine's "
                          f"registration and round {first_round:.1f} s); a 32 GiB cache's last blocks: {out}")
    finally:
        d.cleanup()
        shutil.rmtree(work, ignore_errors=True)
