"""gpu_device_checks.py's shared pieces: the JSON and RESULT lines, the daemon, GPU memory in use, waiting."""

from __future__ import annotations

import json
import os
import time

SELF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_device_checks.py")  # its helper modes
MIB = 1 << 20


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
