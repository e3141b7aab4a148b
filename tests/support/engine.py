"""A stand-in engine process for tests: a shared-memory KV cache whose block contents are derived
from their keys, so any process can verify bytes it did not write.

    python -m support.engine --socket S --namespace NS store|load|hammer ...   (prints one JSON line)

(with tests/ on PYTHONPATH: `support.child_env()`). Keys and contents come from `support.blocks`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

from kvstore_client import KVStoreClient
from kvstore_client.shm import block_cache
from support.blocks import content_of, key_of


def content_tensor(key: bytes, size: int) -> torch.Tensor:
    """`content_of(key, size)` as a uint8 tensor."""
    return torch.frombuffer(bytearray(content_of(key, size)), dtype=torch.uint8)


class Engine:
    def __init__(self, socket: str, namespace: str, num_blocks: int, block_bytes: int) -> None:
        self.client = KVStoreClient(socket)
        self.memory, spec = block_cache(num_blocks, block_bytes)
        self.blocks = self.memory.tensor.view(num_blocks, block_bytes)
        self.block_bytes = block_bytes
        self.session = self.client.session(namespace, spec)

    def fill(self, keys: list[bytes], block_ids: list[int]) -> None:
        for key, b in zip(keys, block_ids, strict=True):
            self.blocks[b].copy_(content_tensor(key, self.block_bytes))

    def verify(self, keys: list[bytes], block_ids: list[int]) -> int:
        """Number of blocks whose bytes differ from what their key says."""
        return sum(not torch.equal(self.blocks[b], content_tensor(k, self.block_bytes))
                   for k, b in zip(keys, block_ids, strict=True))

    def close(self) -> None:
        self.session.close()
        self.memory.close()


def store_blocks(socket: str, namespace: str, n: int, block_bytes: int = 64 * 1024) -> list[bytes]:
    """Store n blocks of known content in a namespace, from an engine that then goes away."""
    engine = Engine(socket, namespace, 16, block_bytes)
    keys = [key_of(namespace, i) for i in range(n)]
    engine.fill(keys, list(range(n)))
    job = engine.session.store(keys, list(range(n)))
    assert engine.session.wait([job])[job].ok
    engine.close()
    return keys


def lookup_and_load(socket: str, namespace: str, keys: list[bytes], block_bytes: int) -> tuple[int, int]:
    """(leading hits of a lookup, blocks whose loaded bytes are wrong) for a fresh engine of `namespace`."""
    engine = Engine(socket, namespace, len(keys), block_bytes)
    try:
        hits, lease = engine.session.lookup(keys, lease=True)
        if hits:
            job = engine.session.load(keys[:hits], list(range(hits)))
            assert engine.session.wait([job])[job].ok
        if lease:
            engine.session.release_lease(lease)
        return hits, engine.verify(keys[:hits], list(range(hits)))
    finally:
        engine.close()


def kvstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `kvstore` command, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "kvstore_service", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--namespace", default="test-ns")
    p.add_argument("--seed", default="s")
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=128)
    p.add_argument("--block-bytes", type=int, default=64 * 1024)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--hang", action="store_true", help="after submitting, sleep (to be killed)")
    p.add_argument("mode", choices=["store", "load", "hammer"])
    a = p.parse_args()
    engine = Engine(a.socket, a.namespace, a.num_blocks, a.block_bytes)
    keys = [key_of(a.seed, i) for i in range(a.count)]
    rng = random.Random(os.getpid())
    out: dict = {"pid": os.getpid()}
    if a.mode == "store":
        ids = rng.sample(range(a.num_blocks), a.count)
        engine.fill(keys, ids)
        job = engine.session.store(keys, ids)
        if a.hang:
            print(json.dumps({"submitted": job, "pid": os.getpid()}), flush=True)
            time.sleep(600)
        out["completion"] = engine.session.wait([job])[job].blocks_ok
    elif a.mode == "load":
        hits, _ = engine.session.lookup(keys)
        ids = rng.sample(range(a.num_blocks), hits)
        job = engine.session.load(keys[:hits], ids)
        done = engine.session.wait([job])[job]
        out.update(hits=hits, loaded=done.blocks_ok, corrupt=engine.verify(keys[:hits], ids))
    else:  # hammer: random stores, loads, lookups of a shared key space, every load verified
        stored = loaded = corrupt = 0
        for _ in range(a.rounds):
            chosen = rng.sample(range(a.count), min(16, a.count))
            ks = [keys[i] for i in chosen]
            ids = rng.sample(range(a.num_blocks), len(ks))
            if rng.random() < 0.5:
                engine.fill(ks, ids)
                job = engine.session.store(ks, ids)
                stored += engine.session.wait([job])[job].blocks_ok
            else:
                present = [k for k in ks if engine.session.lookup([k])[0] == 1]
                if present:
                    ids = ids[: len(present)]
                    engine.blocks[ids] = 0
                    job = engine.session.load(present, ids)
                    done = engine.session.wait([job])[job]
                    loaded += done.blocks_ok
                    if done.blocks_failed == 0:
                        corrupt += engine.verify(present, ids)
        out.update(stored=stored, loaded=loaded, corrupt=corrupt)
    engine.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
