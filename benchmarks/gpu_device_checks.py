"""The GPU checks of benchmarks/gpu_checks.sh that are not pytest tests: each prints JSON lines and a
last line `RESULT PASS|FAIL|SKIP <why>`. Run with tests/ on PYTHONPATH, from the repository root:

    python benchmarks/gpu_device_checks.py kill     an engine SIGKILLed while its store waits on its step;
                                                   another engine stores and loads meanwhile
    python benchmarks/gpu_device_checks.py busy     load latency of engine B, engine A idle vs running 50 ms
                                                   steps that store every step (two engines, two streams)
    python benchmarks/gpu_device_checks.py pidns    daemon and two engines in three PID namespaces, both
                                                   engines PID 1: each registration refused naming hostPID
    python benchmarks/gpu_device_checks.py fatal    a sticky CUDA error in the daemon: it exits 75
    python benchmarks/gpu_device_checks.py ipcpid   bare torch CUDA IPC across PID namespaces, equal and
                                                   different PIDs (gpu_checks_ipc.py)
    python benchmarks/gpu_device_checks.py nonroot|sigterm|kernel|bigpool
                                                   a uid-10001 daemon with a root engine; SIGTERM mid-load;
                                                   the copy kernel on IPC memory, then a fault; a 64 GiB pool
                                                   and a 32 GiB IPC cache (gpu_checks_hardware.py)

Engines are tests/support/cuda_engine.py's (vLLM 0.32's CUDA layout; writes land late, behind a slow
kernel on a side stream, with no host sync, so wrong ordering shows as wrong bytes).
"""

from __future__ import annotations

import os
import sys

# The checks' modules sit next to this file: on sys.path even with PYTHONSAFEPATH=1 (gpu_checks.sh sets it).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)

from gpu_checks_common import result  # noqa: E402
from gpu_checks_daemon import check_fatal, check_pidns, pid_engine  # noqa: E402
from gpu_checks_engines import check_busy, check_kill, stepper, victim  # noqa: E402
from gpu_checks_hardware import check_bigpool, check_kernel, check_nonroot, check_sigterm  # noqa: E402
from gpu_checks_ipc import check_ipc_pid_namespaces  # noqa: E402


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
    return {"kill": check_kill, "busy": check_busy, "pidns": check_pidns, "fatal": check_fatal,
            "ipcpid": check_ipc_pid_namespaces, "nonroot": check_nonroot, "sigterm": check_sigterm,
            "kernel": check_kernel, "bigpool": check_bigpool}[mode]()


if __name__ == "__main__":
    sys.exit(main())
