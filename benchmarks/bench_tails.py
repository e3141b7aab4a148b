"""How the pool should rank prompts' partial tails against full blocks: measured on the daemon's own index.

    python benchmarks/bench_tails.py [--requests 20000] [--seeds 3]

A request is a document's chain of full blocks (shared by every request on that document) and a partial
tail (its question: shared only by exact repeats). Requests pick documents and questions with Zipf
popularity; each one looks its chain up (with a lease, as the connector does), loads what it found
and stores the rest, on a real BlockIndex over a real Pool smaller than the working set. The figure is
the share of prompt tokens served from the pool, for each policy:

- plain LRU: tails are ranked like full blocks;
- tails first: tails are evicted before any full block (the daemon's policy; the store marks them).

(Making a request's chain recent in reverse order, so that its end goes first, as vLLM's own prefix
cache frees blocks, changed the figure by under 1 point here: not done.)
"""

from __future__ import annotations

import argparse
import hashlib
import random
import tempfile
from pathlib import Path

from kvstore_service.index import BlockIndex
from kvstore_service.pool import Pool

BLOCK_TOKENS = 128
SLOT = 64 << 10


def zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights)[0]


def key(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def run(policy: str, requests: int, seed: int, pool_blocks: int) -> float:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        pool = Pool(str(Path(tmp) / "pool"), pool_blocks * (SLOT + 4096), 1 << 20, fresh=True)
        index = BlockIndex(pool)
        ns = index.namespace("sim", SLOT)
        served = total = 0
        for _ in range(requests):
            doc, question = zipf(rng, 200), zipf(rng, 8)
            chain = [key(doc, i) for i in range(2 + doc % 6)]
            tail_tokens = 1 + (doc * 31 + question * 7) % (BLOCK_TOKENS - 1)
            keys = [*chain, key(doc, "tail", question)]
            tokens = [BLOCK_TOKENS] * len(chain) + [tail_tokens]
            total += sum(tokens)
            found = index.lookup(ns, b"".join(keys), 32)
            index.pin(found)  # the lease
            served += sum(tokens[: len(found)])
            plan = index.prepare_store(ns, keys[len(found):], tails=1 if policy == "tails first" else 0)
            index.complete_store(plan.blocks, ok=True)
            index.unpin(found)
        pool.close()
    return served / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    policies = ("plain LRU", "tails first")
    print(f"{'pool blocks':>12}" + "".join(f"{o:>13}" for o in policies) + "   (prompt tokens served from the pool)")
    for pool_blocks in (100, 200, 400, 800):
        cells = []
        for policy in policies:
            shares = [run(policy, a.requests, seed, pool_blocks) for seed in range(a.seeds)]
            cells.append(f"{100 * sum(shares) / len(shares):12.1f}%")
        print(f"{pool_blocks:>12}" + "".join(cells))


if __name__ == "__main__":
    main()
