"""The restart matrix: every model class through `vllm serve` with the connector, against the same server
without it, across an engine restart, a daemon SIGKILL, a lost pool (disk tier kept), a mixed hit, concurrent
requests and another node over the remote tier (tests/support/vllm/restart_matrix.py says what each does).

    python benchmarks/restart_matrix.py [--models llama,gemma3,qwen3_next] [--concurrency 8] [--workdir DIR]
        [--json FILE]

Tiny random models built offline: a Llama (full attention), a Gemma-3-like model (sliding window + full) and
a Qwen3-Next-like model (linear attention + full), 32-token blocks (160 for the last: vLLM's size for
its Mamba pages); a redis-server on loopback for the
remote tier. Prints a row per scenario: how many prompts' tokens and logprobs equal the plain server's, the
tokens served from caches, blocks loaded, failed loads. Exits 1 if an answer differs or a load failed.
Takes ~15 min on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from support.ports import free_ports  # noqa: E402
from support.redis import RedisServer  # noqa: E402
from support.vllm.hybrid_models import DTYPES, build_hybrid_model  # noqa: E402
from support.vllm.restart_matrix import Matrix, table  # noqa: E402
from support.vllm.tiny_model import build_tiny_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,gemma3,qwen3_next")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="restart-matrix-"))
    redis = RedisServer(workdir / "redis", free_ports(1)[0]).start()
    results, wrong = {}, 0
    try:
        for name in args.models.split(","):
            if name == "llama":
                model, dtype = build_tiny_model(workdir / "models" / name), "float32"
            else:
                model, dtype = build_hybrid_model(workdir / "models" / name, name), DTYPES[name]
            matrix = Matrix(name, model, workdir / name, dtype=dtype, remote=f"redis://{redis.address}",
                            concurrency=args.concurrency)
            rows = results[name] = matrix.run()
            print(table(rows, name), flush=True)
            for r in rows:
                wrong += (not r["same_tokens"] == r["same_logprobs"] == r["answered"] == r["answers"]
                          or r["failed_loads"] > 0 or r["daemon_failed_loads"] > 0)
    finally:
        redis.kill()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
