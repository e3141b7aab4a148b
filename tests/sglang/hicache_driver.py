"""Drives SGLang's own HiCache controller on CPU with kvstore as its storage backend; run by SGLang's
venv python (tests/sglang/conftest.py), printing one JSON line.

    hicache_driver.py store|fetch --socket S --layout layer_first|page_first [--shm] [--prompts N]
                      [--salt X] [--seed K] [--follow]

SGLang's pools (`MHATokenToKVPool` on "cpu", `MHATokenToKVPoolHost`), its `HiCacheController` and its
backend factory (storage backend "dynamic", loading kvstore_client.sglang by module path), in a gloo
world of one. `store` fills host pages with bytes that follow from each page's key and has SGLang's
backup thread write them (`write_storage` -> `batch_set_v1`); `fetch`, in another process, has SGLang's
prefetch threads find and read them (`prefetch` -> `batch_exists` -> `batch_get_v1`) into fresh host
slots, and compares every byte; `--follow` fetches again on each line read from stdin (the daemon may
be gone or back meanwhile: SGLang's threads must live on).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Geometry:
    """A model's KV as one rank holds it, and SGLang's pools for it."""

    page: int = 4
    layers: int = 3
    heads: int = 2
    head_dim: int = 16
    device_tokens: int = 512


TINY = Geometry()
PROMPT_TOKENS = 64  # 16 pages


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["store", "fetch"])
    p.add_argument("--socket", required=True)
    p.add_argument("--layout", default="layer_first")
    p.add_argument("--shm", action="store_true", help='the host pool in SGLang\'s "allocator": "shm" memfd')
    p.add_argument("--v0", action="store_true", help="without interface_v1: SGLang's copying batch_set/batch_get")
    p.add_argument("--model", default="", help="SGLang's model path: its files are the identity (else one is named)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--salt", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--follow", action="store_true", help="fetch: again on each line read from stdin, until EOF")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from sglang.test.test_utils import published_topology

    extra = {"backend_name": "kvstore", "module_path": "kvstore_client.sglang", "class_name": "KVStoreHiCacheStorage",
             "interface_v1": 0 if args.v0 else 1, "socket": args.socket, "timeout_s": args.timeout,
             "tenant_salt": args.salt, "model_identity": "" if args.model else "tiny-test-model"}
    if args.shm:
        extra["allocator"] = "shm"
    kwargs = {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config": json.dumps(extra)}
    with published_topology(**kwargs):
        controller, host = build(args.layout, extra, model=args.model or "tiny-test-model")
        try:
            if args.mode == "store":
                print(json.dumps(store(controller, host, args)), flush=True)
            else:
                print(json.dumps(fetch(controller, host, args)), flush=True)
                while args.follow and sys.stdin.readline():
                    print(json.dumps(fetch(controller, host, args)), flush=True)
        finally:
            controller.storage_backend.close()
    os._exit(0)  # (SGLang's storage threads are not daemons)


def build(layout: str, extra: dict, allocator: str = "", storage: str = "dynamic", geometry: Geometry = TINY,
          model: str = "tiny-test-model"):
    """SGLang's device pool, host pool (in a memfd with allocator "shm") and HiCache controller, whose
    storage backend SGLang's factory makes ("dynamic": by the extra config's module path)."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.common import get_allocator_type
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    g = geometry
    device = MHATokenToKVPool(g.device_tokens, g.page, torch.bfloat16, g.heads, g.head_dim, g.layers, "cpu", False,
                              start_layer=0, end_layer=g.layers)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 4.0, 0, g.page, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=g.layers, write_back_staging=device.hicache_write_back_staging,
                                allocator_type=allocator or get_allocator_type())
    allocator_ = TokenToKVPoolAllocator(g.device_tokens, torch.bfloat16, "cpu", device, need_sort=False)
    controller = HiCacheController(allocator_, host, g.page, dist.group.WORLD, threading.Event(),
                                   write_policy="write_through", io_backend="direct", storage_backend=storage,
                                   model_name=model, prefetch_threshold=g.page,
                                   storage_backend_extra_config=dict(extra))
    return controller, host


def prompt(seed: int, i: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    return torch.randint(0, 30000, (PROMPT_TOKENS,), generator=g).tolist()


def page_content(key: str, host) -> torch.Tensor:
    """The bytes a page holds: they follow from its key alone."""
    dummy = host.get_dummy_flat_data_page()
    g = torch.Generator().manual_seed(int(key[:15], 16))
    return torch.randn(dummy.numel(), generator=g).to(dummy.dtype)


def hashes(tokens: list[int]) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=TINY.page)


def store(controller, host, args) -> dict:
    ids = []
    for i in range(args.prompts):
        tokens = prompt(args.seed, i)
        keys = hashes(tokens)
        indices = host.alloc(len(tokens))
        for n, key in enumerate(keys):
            host.set_from_flat_data_page(int(indices[n * TINY.page]), page_content(key, host))
        ids.append(controller.write_storage(indices, tokens, hash_value=keys))
    done = 0
    for _ in ids:
        op = controller.ack_backup_queue.get(timeout=60)
        done += op.completed_tokens
    return {"stored_tokens": done, "asked_tokens": args.prompts * PROMPT_TOKENS}


def fetch(controller, host, args) -> dict:
    hit_tokens, wrong_pages, started = 0, 0, time.monotonic()
    for i in range(args.prompts):
        tokens = prompt(args.seed, i)
        operation = controller.prefetch(f"req-{i}", tokens)
        hit = controller.prefetch_hit_queue.get(timeout=60)
        assert hit is operation
        if hit.storage_hit_count:
            # As SGLang's scheduler does: host slots for the hit, then the io thread reads into them.
            hit.host_indices = host.alloc(hit.storage_hit_count)
            host.kv_buffer.zero_()
            controller.prefetch_buffer.put(hit)
            landed = _acked_tokens(controller, hit)
            keys = hit.hash_value[: landed // TINY.page]
            for n, key in enumerate(keys):
                page = host.get_data_page(int(hit.host_indices[n * TINY.page]), flat=True)
                wrong_pages += not torch.equal(page.view(torch.uint8), page_content(key, host).view(torch.uint8))
            hit_tokens += landed
            host.free(hit.host_indices)
    seconds = time.monotonic() - started
    # The hybrid calls, as SGLang's hybrid controller makes them: a Mamba pool's pages too (not served).
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    keys = hashes(prompt(args.seed, 0))
    backend = controller.storage_backend
    mamba = PoolTransfer(PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hybrid = backend.batch_exists_v2(keys, [mamba])
    return {"hit_tokens": hit_tokens, "asked_tokens": args.prompts * PROMPT_TOKENS, "wrong_pages": wrong_pages,
            "seconds": round(seconds, 3), "v2_hit_pages": backend.batch_exists_v2(keys).kv_hit_pages,
            "hybrid_hit_pages": [hybrid.kv_hit_pages, hybrid.extra_pool_hit_pages],
            "hybrid_got": backend.batch_get_v2([mamba])}


def _acked_tokens(controller, operation) -> int:
    """Tokens the prefetch landed, by SGLang's acks (the last says completed_req)."""
    landed = 0
    while True:
        try:
            ack = controller.ack_prefetch_queue.get(timeout=60)
        except queue.Empty:
            sys.exit("no prefetch ack in 60 s")
        if ack.completed_tokens is not None:
            landed = ack.completed_tokens
        if ack.completed_req:
            return landed


if __name__ == "__main__":
    main()
