"""The remote tier's throughput against the raw client it runs on, on real redis-server processes.

    python benchmarks/bench_remote.py [--target cluster|single|both] [--mib 256] [--rounds 5] [--loop uvloop]

For values of 128 KiB, 1 MiB and 4 MiB, in one run, on a 3-master cluster and/or one server on loopback
(started here, in a temp dir):

  * raw SET: redis-py pipelines of prebuilt values, batched as the tier batches uploads (32 MiB);
  * tier up: `RemoteTier.offer` of the same payloads (copy + CRC32C + header), `--offer-mib` per call
    with the loop let run between calls, then `drain`, timed together; again with the payloads' CRC32C
    given to `offer` (as the daemon's seal checksums can be), so that only the copy is left;
  * raw GET: pipelines of 16 keys (the tier's fetch batch), one batch after the other, every value kept
    (as `fetch` returns them all);
  * tier fetch: `RemoteTier.fetch` of the same number of blocks (pipelined GETs + verification).

`--mib` of payload per measurement. Each round runs all four back to back on the same keys (overwritten,
so the servers' memory is warm after the first, unmeasured, round); the figures are medians over
`--rounds`: GB/s of payload, and the tier/raw ratio of each round (target >= 0.8). On the daemon's
event loop (uvloop) unless `--loop asyncio`. Everything shares 2 cores here: expect noise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvloop
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from kvstore_service import native
from kvstore_service.remote import RemoteTier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.redis import RedisCluster as ClusterProcs  # noqa: E402
from support.redis import RedisServer, free_ports, require_redis_server  # noqa: E402

SIZES = (128 << 10, 1 << 20, 4 << 20)
UPLOAD_BATCH = 32 << 20
FETCH_BATCH = 16
RATIOS = (("up", "raw SET", "tier up"), ("up, CRC given", "raw SET", "tier up, CRC given"),
          ("fetch", "raw GET", "tier fetch"))


async def raw_set(client: Redis | RedisCluster, keys: list[bytes], values: list[bytes]) -> float:
    t0 = time.perf_counter()
    per_batch = max(1, UPLOAD_BATCH // len(values[0]))
    for i in range(0, len(keys), per_batch):
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys[i:i + per_batch], values[i:i + per_batch], strict=True):
            pipe.set(k, v)
        await pipe.execute()
    return time.perf_counter() - t0


async def raw_get(client: Redis | RedisCluster, keys: list[bytes], size: int) -> float:
    """Keeps every value until the end, as `fetch` returns them all (the daemon then copies them)."""
    t0 = time.perf_counter()
    got = []
    for i in range(0, len(keys), FETCH_BATCH):
        pipe = client.pipeline(transaction=False)
        for k in keys[i:i + FETCH_BATCH]:
            pipe.get(k)
        got += await pipe.execute()
    elapsed = time.perf_counter() - t0
    assert len(got) == len(keys) and all(len(v) == size for v in got)
    return elapsed


async def tier_up(tier: RemoteTier, keys: list[bytes], values: list[bytes], stream: int,
                  crcs: list[int] | None = None) -> float:
    """Offer `stream` bytes at a time (a store job's worth), letting the loop run between offers, as the
    daemon does; then drain. `stream` 0: offer everything at once, then drain. With `crcs`, the payloads'
    CRC32C are given (as the daemon's seal checksums can be)."""
    t0 = time.perf_counter()
    per = max(1, stream // len(values[0])) if stream else len(keys)
    for i in range(0, len(keys), per):
        part = None if crcs is None else crcs[i:i + per]
        assert tier.offer("bench", "ns", keys[i:i + per], values[i:i + per], part) == len(keys[i:i + per])
        await asyncio.sleep(0)
    await tier.drain()
    return time.perf_counter() - t0


async def tier_fetch(tier: RemoteTier, keys: list[bytes], size: int) -> float:
    t0 = time.perf_counter()
    got = await tier.fetch("bench", "ns", keys, payload_bytes=size)
    elapsed = time.perf_counter() - t0
    assert len(got) == len(keys)
    return elapsed


async def measure(url: str, client: Redis | RedisCluster, size: int, total: int, rounds: int,
                  stream: int) -> dict[str, float]:
    n = max(FETCH_BATCH, total // size)
    values = [os.urandom(size) for _ in range(n)]
    raw_keys = [b"raw:%d:%d" % (size, i) for i in range(n)]
    tier_keys = [b"%d:%d" % (size, i) for i in range(n)]
    tier = RemoteTier.from_url(url, queue_bytes=n * (size + 64), timeout_s=30.0, fetch_batch=FETCH_BATCH,
                               upload_batch_bytes=UPLOAD_BATCH)
    crcs = [native.crc32c(v) for v in values]
    times: dict[str, list[float]] = {"raw SET": [], "tier up": [], "tier up, CRC given": [], "raw GET": [],
                                     "tier fetch": []}
    for r in range(rounds + 1):
        measured = [await raw_set(client, raw_keys, values), await tier_up(tier, tier_keys, values, stream),
                    await tier_up(tier, tier_keys, values, stream, crcs),
                    await raw_get(client, raw_keys, size), await tier_fetch(tier, tier_keys, size)]
        if r:  # the first round warms the servers' memory up
            for op, t in zip(times, measured, strict=True):
                times[op].append(t)
    s = tier.stats()
    assert s.upload_failed == s.errors == s.corrupt == s.dropped_full == 0, s
    await tier.close()
    await client.flushall()
    gbs = {op: n * size / statistics.median(t) / 1e9 for op, t in times.items()}
    for name, raw, tier_op in RATIOS:
        gbs[name] = statistics.median(r / t for r, t in zip(times[raw], times[tier_op], strict=True))
    return gbs


async def run_target(name: str, url: str, client: Redis | RedisCluster, total: int, rounds: int,
                     stream: int) -> list[float]:
    ratios = []
    print(f"\n{name}: {url}\n(GB/s of payload; ratio: tier / raw)")
    print(f"{'value':>9} | {'raw SET':>7} {'tier up':>7} {'ratio':>5} {'+CRC':>7} {'ratio':>5} | "
          f"{'raw GET':>7} {'fetch':>7} {'ratio':>5}")
    for size in SIZES:
        g = await measure(url, client, size, total, rounds, stream)
        ratios += [g[name] for name, _, _ in RATIOS]
        print(f"{size >> 10:>5} KiB | {g['raw SET']:7.2f} {g['tier up']:7.2f} {g['up']:5.2f} "
              f"{g['tier up, CRC given']:7.2f} {g['up, CRC given']:5.2f} | "
              f"{g['raw GET']:7.2f} {g['tier fetch']:7.2f} {g['fetch']:5.2f}", flush=True)
    await client.aclose()
    return ratios


async def main(args: argparse.Namespace) -> None:
    require_redis_server()
    total, stream = args.mib << 20, args.offer_mib << 20
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-remote-") as tmp:
        if args.target in ("cluster", "both"):
            procs = ClusterProcs(Path(tmp) / "cluster", maxmemory="4gb").start()
            try:
                client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in procs.nodes])
                ratios += await run_target("3-master cluster", procs.url, client, total, args.rounds, stream)
            finally:
                procs.stop()
        if args.target in ("single", "both"):
            server = RedisServer(Path(tmp) / "single", free_ports(1)[0], maxmemory="4gb").start()
            try:
                url = f"redis://{server.address}"
                ratios += await run_target("one server", url, Redis(host="127.0.0.1", port=server.port), total,
                                           args.rounds, stream)
            finally:
                server.kill()
    print(f"\nworst tier/raw ratio {min(ratios):.2f} (target >= 0.8)")


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["cluster", "single", "both"], default="both")
    ap.add_argument("--mib", type=int, default=256, help="payload MiB per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--offer-mib", type=int, default=8, help="MiB per offer call (0: all at once)")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = ap.parse_args()
    print(f"loop: {args.loop}")
    (asyncio.run if args.loop == "asyncio" else uvloop.run)(main(args))


if __name__ == "__main__":
    cli()
