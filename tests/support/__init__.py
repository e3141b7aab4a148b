"""Helpers shared by the tests, and by the benchmarks that reuse them.

    blocks      key_of, content_of: block keys, and block contents derived from their keys
    engine      a torch engine (block_cache memory, one session); also a script
    shm_engine  a torch-free engine: KV memory in a sealed memfd, any region layout
    daemon      the daemon process, plus what tests read of it in /proc and of its pool file
    ports       free loopback ports for the servers tests start (below the ephemeral range)
    workers     random store/load/lookup workers that verify every loaded byte; also a script
    fuzz        hypothesis strategies, oracles and the target for fuzzing every RPC
    vllm/       run_engine.py (one vLLM engine per process) and tiny_model.py (an offline model)

Tests import these as `support.<module>`: pytest puts tests/ on sys.path (tests/ has no __init__.py,
so the default "prepend" import mode inserts it when it loads tests/conftest.py). The benchmarks put
tests/ on sys.path themselves. Nothing here imports from benchmarks/.

Scripts that need their siblings run as `python -m support.<module>` with `child_env()`; the vLLM
scripts import nothing from here and run by path (`VLLM_SCRIPTS / "run_engine.py"`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
VLLM_SCRIPTS = Path(__file__).resolve().parent / "vllm"


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: os.environ) with tests/ first on PYTHONPATH, so that a child Python process
    started with it can import `support` (e.g. `python -m support.engine`)."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), out.get("PYTHONPATH")]))
    return out
