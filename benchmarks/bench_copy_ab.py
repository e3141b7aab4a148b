"""A/B of two daemons' bulk copies on one machine, rounds interleaved: the machine's noise (0.2 of the
copy engine from one round to the next on a 2-vCPU VM) hits both alike.

Two private daemons run at once, each with its own environment (`--a-env`, `--b-env`: e.g.
`PYTHONPATH=/tmp/old` for an older checkout's daemon, or `KVSTORE_VERIFY_LOADS=0`) and copy threads
(`--a-threads`, `--b-threads`). Each round stores (or loads) 512 MiB of blocks (2048 x 256 KiB, or
`--block-kib`) through A and through B, in alternating order, each paired with the limit copied right
before and right after it (as `kvstore bench`: the copy engine's contiguous copy on cpu, one pinned
host -> device copy with `--backend cuda`). Stores go into a cleared namespace, into slots used
before; loads read one of three stored jobs into scattered block ids. `full` is sustained stores into
a full pool: each round stores three new jobs back to back into a pool that holds three, so every
block evicts an old one while the seals of the last ones run (a busy engine's steady state).
Prints the median ratio of each and every round's.

`hit` is a vLLM-sized hit instead (`kvstore bench`'s small_load: `--hit-blocks` blocks of 32 layers x
K and V x 32 KiB, loaded into random block ids): the ratio is then its submit-to-completion time over
its copy's (lower is better), and the overhead over the copy is printed too.

    python benchmarks/bench_copy_ab.py store --rounds 20 --a-env PYTHONPATH=/tmp/old
    python benchmarks/bench_copy_ab.py hit --rounds 30 --a-env PYTHONPATH=/tmp/old
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore_client import KVStoreClient
from kvstore_service.bench import Run, SmallLoad, private_daemon, wait_sealed

JOB_BYTES = 512 << 20
BURST = 3  # `full`: stores back to back per round


@contextmanager
def daemon_run(env: dict[str, str], block_bytes: int, backend: str, threads: int, pool_bytes: int = 6 << 30,
               ) -> Iterator[tuple[KVStoreClient, Run, list[tuple[list[bytes], list[int]]]]]:
    """A daemon started with `env` added to ours, an engine session on it, and three stored jobs."""
    with private_daemon(pool_bytes, threads, env) as socket:
        client = KVStoreClient(socket)
        run = Run(client, backend, JOB_BYTES // block_bytes, block_bytes)
        try:
            warm = run.job()
            run.store(*warm)
            run.load(*warm)
            stored = [run.job() for _ in range(3)]
            for keys, ids in stored:
                run.store(keys, ids)
            yield client, run, stored
        finally:
            run.close()
            client.close()


@contextmanager
def hit_run(env: dict[str, str], blocks: int, backend: str, threads: int) -> Iterator[SmallLoad]:
    """A daemon started with `env` added to ours, and a vLLM-sized hit of `blocks` blocks stored in it."""
    with private_daemon(1 << 30, threads, env) as socket:
        client = KVStoreClient(socket)
        hit = SmallLoad(client, backend, blocks, 32, 32 << 10)
        try:
            hit.measure(3)  # warm
            yield hit
        finally:
            hit.close()
            client.close()


def hits(args: argparse.Namespace) -> None:
    """Each round loads the hit through A and B (alternating order), each after its copy's limit."""
    times: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    with (hit_run(parse_env(args.a_env), args.hit_blocks, args.backend, args.a_threads) as a,
          hit_run(parse_env(args.b_env), args.hit_blocks, args.backend, args.b_threads) as b):
        for i in range(args.rounds):
            for name, hit in (("A", a), ("B", b)) if i % 2 == 0 else (("B", b), ("A", a)):
                ids = hit.rng.sample(range(hit.cache_blocks), hit.blocks)
                limit = hit.copy_seconds(ids)
                times[name].append((hit.load_seconds(ids), limit))
    for name, env in (("A", args.a_env), ("B", args.b_env)):
        took = times[name]
        print(f"hit of {args.hit_blocks} blocks, {name} {' '.join(env) or '(as is)'}: median "
              f"{statistics.median(t / c for t, c in took):.2f}x its copy, overhead "
              f"{statistics.median((t - c) * 1e3 for t, c in took):.2f} ms, rounds "
              f"{[round(t / c, 2) for t, c in took]}")


def parse_env(pairs: list[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["store", "load", "hit", "full"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block-kib", type=int, default=256, help="block size (a job is 512 MiB of blocks)")
    parser.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--a-threads", type=int, default=2, help="daemon A's --copy-threads")
    parser.add_argument("--b-threads", type=int, default=2, help="daemon B's --copy-threads")
    parser.add_argument("--a-env", nargs="*", default=[], help="KEY=VALUE added to daemon A's environment")
    parser.add_argument("--b-env", nargs="*", default=[], help="KEY=VALUE added to daemon B's environment")
    parser.add_argument("--hit-blocks", type=int, default=16, help="blocks of a hit (128: 2048 tokens)")
    parser.add_argument("--pool-gib", type=int, default=6, help="GiB of pool per daemon (3 hold the jobs)")
    args = parser.parse_args()
    if args.mode == "hit":
        hits(args)
        return
    ratios: dict[str, list[float]] = {"A": [], "B": []}
    block_bytes = args.block_kib << 10
    pool_bytes = BURST * JOB_BYTES if args.mode == "full" else args.pool_gib << 30
    with (daemon_run(parse_env(args.a_env), block_bytes, args.backend, args.a_threads, pool_bytes) as a,
          daemon_run(parse_env(args.b_env), block_bytes, args.backend, args.b_threads, pool_bytes) as b):
        for i in range(args.rounds):
            for name, (client, run, stored) in (("A", a), ("B", b)) if i % 2 == 0 else (("B", b), ("A", a)):
                if args.mode == "full":  # (the seals run as they can, as under an engine's stores)
                    jobs = [run.job() for _ in range(BURST)]
                    before = run.limit_gbps()
                    start = time.perf_counter()
                    for keys, ids in jobs:
                        run.store(keys, ids)
                    gbps = BURST * run.total / (time.perf_counter() - start) / 1e9
                    wait_sealed(client)  # (the limit after, on a machine as quiet as the one before)
                    ratios[name].append(gbps / ((before + run.limit_gbps()) / 2))
                    continue
                wait_sealed(client)
                if args.mode == "store":
                    client.clear(run.session.namespace)
                    keys, ids = run.job()
                else:
                    keys, ids = stored[i % len(stored)][0], run.ids()
                before = run.limit_gbps()
                gbps = run.store(keys, ids) if args.mode == "store" else run.load(keys, ids)
                wait_sealed(client)  # (a limit copied beside a store's seals ran at ~0.7 of a quiet one's speed)
                after = run.limit_gbps()
                ratios[name].append(gbps / ((before + after) / 2))
    what = "pinned -> device copy" if args.backend != "cpu" else "copy engine"
    for name, env, threads in (("A", args.a_env, args.a_threads), ("B", args.b_env, args.b_threads)):
        print(f"{args.mode} {name} {' '.join(env) or '(as is)'}, {threads} copy threads: median "
              f"{statistics.median(ratios[name]):.3f} of the {what}, rounds {[round(r, 2) for r in ratios[name]]}")


if __name__ == "__main__":
    main()
