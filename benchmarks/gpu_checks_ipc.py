"""Bare torch CUDA IPC across PID namespaces (issue 62, N13): does a legacy CUDA IPC handle open in another PID
namespace, and does it matter whether exporter and importer have equal PIDs there? The earlier check ran every
process as PID 1 of its own namespace, where "invalid device context" is also what CUDA answers a process opening
its own handle (openucx/ucx#11603); LMCache#4551 reports handles working across namespaces with different PIDs.

An exporter (a tensor on GPU 0 holding a pattern, `_share_cuda_()`'s fields written to a file) and an importer
(`UntypedStorage._new_shared_cuda`, the pattern read back) each run under `unshare --pid --fork --mount-proc`:
- equal PIDs: both python processes PID 1 of their namespaces;
- different PIDs: the importer PID 2 (a shell is PID 1 and does not exec it);
- same namespace as a control: both in this one (opens, or the GPU does not support IPC at all).
The check passes when it ran every case; each case's outcome (opened and byte-exact, or the error) is logged
for the daemon's refusal to follow (kvstore_service/backends/cuda.py refuses another PID namespace today).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from gpu_checks_common import result, say

PATTERN_BYTES = 64 << 20


def exporter(handle_file: str, done_file: str) -> None:
    """Export a tensor holding a pattern; wait (at most 60 s) until the importer is done."""
    import torch

    data = torch.arange(PATTERN_BYTES // 4, dtype=torch.int32, device="cuda:0")
    torch.cuda.synchronize()
    fields = data.untyped_storage()._share_cuda_()
    encoded = [base64.b64encode(f).decode() if isinstance(f, bytes) else f for f in fields]
    with open(handle_file + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "fields": encoded}, f)
    os.replace(handle_file + ".tmp", handle_file)
    deadline = time.monotonic() + 60
    while not os.path.exists(done_file) and time.monotonic() < deadline:
        time.sleep(0.05)


def importer(handle_file: str, done_file: str) -> None:
    """Open the exported storage and compare the pattern; print one JSON line."""
    import torch

    out: dict[str, object] = {"pid": os.getpid()}
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(handle_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(handle_file) as f:
            shared = json.load(f)
        out["exporter_pid"] = shared["pid"]
        fields = [base64.b64decode(v) if i in (1, 4, 6) and isinstance(v, str) else v
                  for i, v in enumerate(shared["fields"])]
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        got = torch.empty(0, dtype=torch.int32, device="cuda:0").set_(storage, 0, (PATTERN_BYTES // 4,)).clone()
        expected = torch.arange(PATTERN_BYTES // 4, dtype=torch.int32, device="cuda:0")
        out["opened"] = True
        out["byte_exact"] = bool(torch.equal(got, expected))
    except Exception as e:  # noqa: BLE001 - the outcome is what the check reports
        out.update(opened=False, error=f"{type(e).__name__}: {e}"[:500])
    finally:
        open(done_file, "w").close()
    print(json.dumps(out), flush=True)


def _case(name: str, exporter_prefix: list[str], importer_prefix: list[str]) -> dict[str, object]:
    work = tempfile.mkdtemp(prefix=f"kvstore-ipc-{name}-")
    handle, done = os.path.join(work, "handle.json"), os.path.join(work, "done")
    me = [sys.executable, os.path.abspath(__file__)]
    try:
        exp = subprocess.Popen([*exporter_prefix, *me, "export", handle, done], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        imp = subprocess.run([*importer_prefix, *me, "import", handle, done], capture_output=True, text=True,
                             timeout=120)
        exp.wait(90)
        lines = [line for line in imp.stdout.splitlines() if line.startswith("{")]
        out = json.loads(lines[-1]) if lines else {"opened": False, "error": imp.stderr[-1500:]}
        if exp.returncode:
            out["exporter_error"] = (exp.stderr.read() if exp.stderr else "")[-1500:]
        out["case"] = name
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_ipc_pid_namespaces() -> int:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                           text=True) if unshare else None
    if unshare is None or probe is None or probe.returncode != 0:
        return result(None, f"unshare --pid not permitted here: {probe.stderr.strip() if probe else 'no unshare'}")
    ns = [unshare, "--pid", "--fork", "--mount-proc"]
    # `sh -c '"$@"; exit $?'`: the shell stays PID 1 (no exec of its last command), python is PID 2.
    pid_two = [*ns, "sh", "-c", '"$@"; exit $?', "sh"]
    cases = [_case("same-namespace", [], []), _case("equal-pids", ns, ns), _case("different-pids", ns, pid_two)]
    for case in cases:
        say(**case)
    ran = all("opened" in c for c in cases)
    summary = ", ".join(f"{c['case']}: {'opened' if c.get('opened') else 'failed'}"
                        f"{' byte-exact' if c.get('byte_exact') else ''}" for c in cases)
    return result(ran, summary)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "export":
        exporter(*args)
    elif mode == "import":
        importer(*args)
