"""A stand-in vLLM engine on a CUDA GPU, for the GPU tests: its KV cache is laid out as vLLM 0.32 lays
it out on CUDA, and a block's bytes derive from its key, so any process can verify them.

One int8 allocation per engine; each layer's view is made with `torch.as_strided`, as vLLM's
`create_kv_cache_views` does, a logical [block, head, token, content] bf16 view of pages stored
token-major ([N, H, C], FlashAttention's default) in the layer-major LBNHC layout (one run per layer
and block) or the cross-layer BLNHC one (a block's pages of all layers side by side, one run). Either
way a block's bytes are its pages in layer order, so the two layouts share blocks.

Writes go the way a model's do: on a side stream, behind a slow kernel, joined into the current
stream, then `order_before_copies` and the job, with no host sync: the daemon copies the right bytes
only if its copy stream waits on the engine's event.

    python -m support.cuda_engine --socket S --namespace NS --layout L store --count N
    python -m support.cuda_engine --socket S --namespace NS hammer   (copies until killed)

(with tests/ on PYTHONPATH: `support.child_env()`). Prints one JSON line per milestone.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvstore_client import KVStoreClient
from kvstore_client.device import export_kv_memory, order_before_copies
from support.blocks import content_of, key_of

TOKENS, HEADS, CONTENT = 16, 8, 64  # one page: [N, H, C] bf16, 16 KiB
PAGE_BYTES = TOKENS * HEADS * CONTENT * 2
SLOW_KERNEL_CYCLES = 200_000_000  # ~0.1 s on an H100: the writes land long after the job is submitted


class CudaEngine:
    def __init__(self, socket: str, namespace: str, layout: str, layers: int = 4, num_blocks: int = 64) -> None:
        if layout not in ("LBNHC", "BLNHC"):
            raise ValueError(f"layout {layout}: LBNHC or BLNHC")
        self.layers, self.num_blocks = layers, num_blocks
        self.block_bytes = layers * PAGE_BYTES
        self.kv = torch.zeros(layers * num_blocks * PAGE_BYTES, dtype=torch.int8, device="cuda")
        page = PAGE_BYTES // 2  # in bf16 elements
        flat = self.kv.view(torch.bfloat16)
        if layout == "LBNHC":
            block_stride, layer_offset = page, num_blocks * page
            regions = [(i * num_blocks * PAGE_BYTES, PAGE_BYTES, PAGE_BYTES) for i in range(layers)]
        else:
            block_stride, layer_offset = layers * page, page
            regions = [(0, self.block_bytes, self.block_bytes)]
        self.views = [torch.as_strided(flat, (num_blocks, HEADS, TOKENS, CONTENT),
                                       (block_stride, CONTENT, HEADS * CONTENT, 1), i * layer_offset)
                      for i in range(layers)]
        self.client = KVStoreClient(socket)
        self.session = self.client.session(namespace, export_kv_memory([self.kv], num_blocks, regions))
        self.side = torch.cuda.Stream()

    def pages(self, keys: list[bytes]) -> list[torch.Tensor]:
        """Layer i's logical [len(keys), H, N, C] view of the blocks the keys name."""
        raw = torch.frombuffer(bytearray(b"".join(content_of(k, self.block_bytes) for k in keys)), dtype=torch.int8)
        blocks = raw.view(len(keys), self.layers, TOKENS, HEADS, CONTENT * 2).cuda()
        return [blocks[:, i].view(torch.bfloat16).permute(0, 2, 1, 3) for i in range(self.layers)]

    def write_late(self, block_ids: list[int], pages: list[torch.Tensor] | None) -> int:
        """Write the blocks (their pages, or -1 bytes) on the side stream behind a slow kernel, join
        the side stream into the current one, record the ordering event and return its sequence
        number (the job's order_seq); the host does not wait.
        (Plain copies and fills per block: indexing with a tensor of ids may synchronize the host,
        which would wait out the slow kernel before the job is even submitted.)"""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(SLOW_KERNEL_CYCLES)
            for i, view in enumerate(self.views):
                for j, b in enumerate(block_ids):
                    if pages is None:
                        view[b].view(torch.int16).fill_(-1)
                    else:
                        view[b].copy_(pages[i][j])
        torch.cuda.current_stream().wait_stream(self.side)
        return order_before_copies(self.kv.device)

    def store(self, keys: list[bytes], block_ids: list[int]) -> int:
        seq = self.write_late(block_ids, self.pages(keys))
        job = self.session.store(keys, block_ids, order_seq=seq)
        return self.session.wait([job], timeout=60)[job].blocks_ok

    def load(self, keys: list[bytes], block_ids: list[int]) -> int:
        seq = self.write_late(block_ids, None)  # a preempted request's last writes, still running
        job = self.session.load(keys, block_ids, order_seq=seq)
        return self.session.wait([job], timeout=60)[job].blocks_ok

    def wrong_blocks(self, keys: list[bytes], block_ids: list[int]) -> list[int]:
        """The block ids whose bytes (every layer's page) are not their key's."""
        torch.cuda.synchronize()
        ids = torch.tensor(block_ids, device="cuda")
        want = self.pages(keys)
        return [block_ids[j] for j in range(len(keys))
                if not all(torch.equal(v[ids[j]].view(torch.int16), w[j].view(torch.int16))
                           for v, w in zip(self.views, want, strict=True))]

    def close(self) -> None:
        self.session.close()  # before the memory goes: the daemon unmaps first
        self.client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--namespace", default="gpu")
    parser.add_argument("--layout", default="LBNHC")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("mode", choices=["store", "hammer"])
    args = parser.parse_args()
    engine = CudaEngine(args.socket, args.namespace, args.layout, args.layers, args.num_blocks)
    half = args.num_blocks // 2
    if args.mode == "store":
        keys = [key_of(args.namespace, i) for i in range(args.count)]
        print(json.dumps({"stored": engine.store(keys, list(range(args.count)))}), flush=True)
        engine.close()
        return
    # hammer: store half the cache (copied once, present after) and load it into the other half, until killed
    keys = [key_of("hammer", i) for i in range(half)]
    rounds = 0
    while True:
        job = engine.session.store(keys, list(range(half)))
        engine.session.wait([job], timeout=60)
        job = engine.session.load(keys, list(range(half, 2 * half)))
        engine.session.wait([job], timeout=60)
        rounds += 1
        if rounds == 1:
            print(json.dumps({"ready": True}), flush=True)


if __name__ == "__main__":
    main()
