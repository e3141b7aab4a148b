"""The remote tier's throughput against the raw client it runs on, on real redis-server processes.

    python benchmarks/bench_remote.py [--target cluster|single|both] [--mib 256] [--rounds 5] [--kib 128,1024,4096]
        [--loop uvloop]
    python benchmarks/bench_remote.py --daemon [--target ...] [--mib 128] [--rounds 3]

For values of 128 KiB, 1 MiB and 4 MiB, in one run, on a 3-master cluster and/or one server on loopback
(started here, in a temp dir):

  * raw SET: redis-py pipelines of prebuilt values, batched as the tier batches uploads (32 MiB);
  * tier up: `RemoteTier.write_behind` (the tiers' contract, as the daemon drives it) of the same
    payloads from slots in memory, `--offer-mib` per call with the loop let run between calls, until
    every block is released (uploaded), timed together: values authenticated (HMAC-SHA256 under a
    secret), and encrypted (AES-256-GCM, `--remote-encrypt`), two tiers with their own keys;
  * raw GET: pipelines of 16 keys (the tier's fetch batch), one batch after the other, every value kept
    (as a fetch keeps them all);
  * tier fetch: `RemoteTier.fetch_verified` of the same number of blocks into slots (pipelined GETs, MAC
    checked or decrypted, CRC32C taken as each is copied to its slot), for each of the two tiers.

With `--daemon`, through running daemons instead (`kvstore serve --remote URL --remote-secret-file F`, plus
`--remote-encrypt` with `--encrypt`; one CPU engine):

  * upload: a store job of `--mib` into daemon A, timed until A's Stats say every block is uploaded,
    from the job's submission ("daemon": engine -> pool copy, seal checksums, write-behind) and from its
    completion ("behind": the write-behind alone, seal checksums included), against raw SET of the
    same values (their bytes taken from the engine's memory);
  * fetch: a lookup of those keys on daemon B (its own empty pool, same store), timed until it answers
    with every block a hit (pipelined GETs, verification, copies into B's pool), against raw GET of the
    same keys.

`--mib` of payload per measurement. Each round runs all of them back to back on the same keys (overwritten,
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
from remote_common import FETCH_BATCH, MODES, SIZES, UPLOAD_BATCH, raw_get, raw_set
from remote_daemons import run_daemons

from kvstore_service.threads import Threads
from kvstore_service.tiers.remote import RemoteTier
from kvstore_service.tiers.remote.store import RedisStore
from kvstore_service.tiers.remote.url import parse_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.ports import free_ports  # noqa: E402
from support.redis import RedisCluster as ClusterProcs  # noqa: E402
from support.redis import RedisServer, require_redis_server  # noqa: E402
from support.tier_contract import Released, Slots, scope_of  # noqa: E402

RATIOS = tuple((f"{what}, {mode}", raw, f"tier {what}, {mode}")
               for what, raw in (("up", "raw SET"), ("fetch", "raw GET")) for mode in MODES)


async def tier_up(tier: RemoteTier, keys: list[bytes], src: Slots, crcs: list[int], stream: int) -> float:
    """Write `stream` bytes at a time behind (a store job's worth), letting the loop run between calls, as
    the daemon does; until every block is released. `stream` 0: everything in one call."""
    t0 = time.perf_counter()
    scope, released = scope_of("bench", "ns", src.size), Released(len(keys))
    per = max(1, stream // src.size) if stream else len(keys)
    for i in range(0, len(keys), per):
        taken = tier.write_behind(src, scope, keys[i:i + per], src.offsets[i:i + per], crcs[i:i + per], released)
        assert taken == len(keys[i:i + per])
        await asyncio.sleep(0)
    await released.wait()
    return time.perf_counter() - t0


async def tier_fetch(tier: RemoteTier, keys: list[bytes], dst: Slots) -> float:
    t0 = time.perf_counter()
    got = 0
    async for crcs in tier.fetch_verified(dst, scope_of("bench", "ns", dst.size), keys,
                                          lambda first, count: dst.offsets[first:first + count]):
        got += len(crcs)
    elapsed = time.perf_counter() - t0
    assert got == len(keys), tier.stats()
    return elapsed


async def measure(url: str, client: Redis | RedisCluster, size: int, total: int, rounds: int,
                  stream: int) -> dict[str, float]:
    n = max(FETCH_BATCH, total // size)
    values = [os.urandom(size) for _ in range(n)]
    src, dst = Slots.holding(values), Slots(n, size)  # the pool's slots: written behind from, fetched into
    crcs = src.checksums()
    raw_keys = [b"raw:%d:%d" % (size, i) for i in range(n)]
    tier_keys = [b"%d:%d" % (size, i) for i in range(n)]
    tiers = {mode: RemoteTier(RedisStore(parse_url(url), None, 30.0), keyring=keyring,
                              queue_bytes=n * (size + 64), timeout_s=30.0, fetch_batch=FETCH_BATCH,
                              upload_batch_bytes=UPLOAD_BATCH, executor=Threads(1).remote)
             for mode, keyring in MODES.items()}
    times: dict[str, list[float]] = {"raw SET": [], "raw GET": []}
    for r in range(rounds + 1):  # interleaved: every contender once per round
        measured = {"raw SET": await raw_set(client, raw_keys, values)}
        for mode, tier in tiers.items():
            measured[f"tier up, {mode}"] = await tier_up(tier, tier_keys, src, crcs, stream)
        measured["raw GET"] = await raw_get(client, raw_keys, size)
        for mode, tier in tiers.items():
            measured[f"tier fetch, {mode}"] = await tier_fetch(tier, tier_keys, dst)
        if r:  # the first round warms the servers' memory up
            for op, t in measured.items():
                times.setdefault(op, []).append(t)
    for tier in tiers.values():
        s = tier.stats()
        assert s.upload_failed == s.errors == s.corrupt == s.dropped_full == 0, s
        await tier.aclose(0)
    await client.flushall()
    gbs = {op: n * size / statistics.median(t) / 1e9 for op, t in times.items()}
    for name, raw, tier_op in RATIOS:
        gbs[name] = statistics.median(r / t for r, t in zip(times[raw], times[tier_op], strict=True))
    return gbs


async def run_target(name: str, url: str, client: Redis | RedisCluster, total: int, rounds: int,
                     stream: int, sizes: tuple[int, ...] = SIZES) -> list[float]:
    ratios = []
    print(f"\n{name}: {url}\n(GB/s of payload; ratio: tier / raw)")
    print(f"{'value':>9} | {'raw SET':>7} {'auth up':>7} {'ratio':>5} {'enc up':>7} {'ratio':>5} | "
          f"{'raw GET':>7} {'auth':>7} {'ratio':>5} {'enc':>7} {'ratio':>5}")
    for size in sizes:
        g = await measure(url, client, size, total, rounds, stream)
        ratios += [g[name] for name, _, _ in RATIOS]
        print(f"{size >> 10:>5} KiB | {g['raw SET']:7.2f} {g['tier up, auth']:7.2f} {g['up, auth']:5.2f} "
              f"{g['tier up, encrypted']:7.2f} {g['up, encrypted']:5.2f} | {g['raw GET']:7.2f} "
              f"{g['tier fetch, auth']:7.2f} {g['fetch, auth']:5.2f} {g['tier fetch, encrypted']:7.2f} "
              f"{g['fetch, encrypted']:5.2f}", flush=True)
    await client.aclose()
    return ratios


async def main(args: argparse.Namespace) -> None:
    require_redis_server()
    total, stream = args.mib << 20, args.offer_mib << 20
    sizes = tuple(kib << 10 for kib in args.kib)
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-remote-") as tmp:
        if args.target in ("cluster", "both"):
            procs = ClusterProcs(Path(tmp) / "cluster", maxmemory="4gb").start()
            try:
                client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in procs.nodes])
                name = "3-master cluster"
                ratios += (await run_daemons(name, procs.url, client, total, args.rounds, Path(tmp), sizes,
                                             args.encrypt)
                           if args.daemon else
                           await run_target(name, procs.url, client, total, args.rounds, stream, sizes))
            finally:
                procs.stop()
        if args.target in ("single", "both"):
            server = RedisServer(Path(tmp) / "single", free_ports(1)[0], maxmemory="4gb").start()
            try:
                url = f"redis://{server.address}"
                client = Redis(host="127.0.0.1", port=server.port)
                ratios += (await run_daemons("one server", url, client, total, args.rounds, Path(tmp), sizes,
                                             args.encrypt)
                           if args.daemon else
                           await run_target("one server", url, client, total, args.rounds, stream, sizes))
            finally:
                server.kill()
    print(f"\nworst tier/raw ratio {min(ratios):.2f} (target >= 0.8)")


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["cluster", "single", "both"], default="both")
    ap.add_argument("--mib", type=int, default=256, help="payload MiB per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kib", type=lambda v: [int(k) for k in v.split(",")], default=[s >> 10 for s in SIZES],
                    help="value sizes in KiB, comma-separated (default: 128,1024,4096)")
    ap.add_argument("--offer-mib", type=int, default=8, help="MiB per write_behind call (0: all at once)")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--daemon", action="store_true", help="through running daemons, not the tier module")
    ap.add_argument("--encrypt", action="store_true", help="with --daemon: --remote-encrypt (else authenticated only)")
    args = ap.parse_args()
    print(f"loop: {args.loop}")
    (asyncio.run if args.loop == "asyncio" else uvloop.run)(main(args))


if __name__ == "__main__":
    cli()
