"""benchmarks/bench_sglang.py's worker, run by SGLang's venv python: one prompt's pages kept by HiCache
storage backends behind SGLang's own controllers (kvstore zero-copy and staged; SGLang's file backend),
then, a round per line read from stdin, a page hit through each controller (prefetch -> batch_exists ->
read into fresh host slots -> acks), in an order rotated each round. Prints one JSON line per round:
seconds per backend.

    sglang_hits.py --socket S --file-dir D [--tokens 768] [--layout page_first]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang"))
from hicache_driver import Geometry, _acked_tokens, build  # noqa: E402

# Per TP rank of an 8B Llama-like model at TP 1: 32 layers of 8 KV heads of 128, bf16: 128 KiB a token.
GEOMETRY = Geometry(page=64, layers=32, heads=8, head_dim=128, device_tokens=2048)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--file-dir", required=True)
    p.add_argument("--tokens", type=int, default=768)
    p.add_argument("--layout", default="page_first")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.test.test_utils import published_topology

    ours = {"backend_name": "kvstore", "module_path": "kvstore_client.sglang", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "socket": args.socket, "model_identity": "bench-model"}
    tokens = torch.randint(0, 30000, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    keys = get_storage_hash_str(tokens, None, page_size=GEOMETRY.page)
    with published_topology(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(ours)):
        backends = {
            "kvstore_zero_copy": build(args.layout, ours, "shm", geometry=GEOMETRY),
            "kvstore_staged": build(args.layout, ours, "default", geometry=GEOMETRY),
            "sglang_file": build(args.layout, {"file_storage_path": args.file_dir}, "default", storage="file",
                                 geometry=GEOMETRY),
        }
        for controller, host in backends.values():
            keep(controller, host, tokens, keys)
        print(json.dumps({"bytes": args.tokens * host.get_size_per_token(), "pages": len(keys)}), flush=True)
        names = list(backends)
        for n, _ in enumerate(iter(sys.stdin.readline, "")):
            order = names[n % len(names):] + names[: n % len(names)]
            print(json.dumps({name: hit_seconds(*backends[name], tokens, f"r{n}-{name}") for name in order}),
                  flush=True)
    os._exit(0)  # (SGLang's storage threads are not daemons)


def keep(controller, host, tokens: list[int], keys: list[str]) -> None:
    indices = host.alloc(len(tokens))
    host.kv_buffer.view(torch.int16).random_()  # (any bytes: the hit is timed, not checked)
    controller.write_storage(indices, tokens, hash_value=keys)
    op = controller.ack_backup_queue.get(timeout=120)
    assert op.completed_tokens == len(tokens), f"kept {op.completed_tokens} of {len(tokens)} tokens"
    host.free(indices)


def hit_seconds(controller, host, tokens: list[int], rid: str) -> float:
    """From SGLang's prefetch call to its last ack: every page found and read into fresh host slots."""
    started = time.perf_counter()
    operation = controller.prefetch(rid, tokens)
    hit = controller.prefetch_hit_queue.get(timeout=60)
    assert hit is operation and hit.storage_hit_count == len(tokens), f"{rid}: hit {hit.storage_hit_count}"
    hit.host_indices = host.alloc(hit.storage_hit_count)
    controller.prefetch_buffer.put(hit)
    landed = _acked_tokens(controller, hit)
    seconds = time.perf_counter() - started
    assert landed == len(tokens), f"{rid}: landed {landed}"
    host.free(hit.host_indices)
    return seconds


if __name__ == "__main__":
    main()
