"""The remote tier's throughput against the raw client it runs on, on real redis-server processes.

    python benchmarks/bench_remote.py [--target cluster|single|both] [--mib 256] [--rounds 5] [--kib 128,1024,4096]
        [--loop uvloop]
    python benchmarks/bench_remote.py --daemon [--target ...] [--mib 128] [--rounds 3]

For values of 128 KiB, 1 MiB and 4 MiB, in one run, on a 3-master cluster and/or one server on loopback
(started here, in a temp dir):

  * raw SET: redis-py pipelines of prebuilt values, batched as the tier batches uploads (32 MiB);
  * tier up: `RemoteTier.offer` of the same payloads, `--offer-mib` per call with the loop let run
    between calls, then `drain`, timed together: values authenticated (HMAC-SHA256 under a secret), and
    encrypted (AES-256-GCM, `--remote-encrypt`), two tiers with their own keys;
  * raw GET: pipelines of 16 keys (the tier's fetch batch), one batch after the other, every value kept
    (as `fetch` returns them all);
  * tier fetch: `RemoteTier.fetch` of the same number of blocks (pipelined GETs, MAC checked or
    decrypted, CRC32C taken), for each of the two tiers.

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
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster

from kvstore_client.shm import SharedKVMemory
from kvstore_service.harness import DaemonProcess
from kvstore_service.tiers.remote import RemoteTier
from kvstore_service.tiers.remote.codec import Keyring, encode_value
from kvstore_service.tiers.remote.store import RedisStore
from kvstore_service.tiers.remote.url import parse_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.redis import RedisCluster as ClusterProcs  # noqa: E402
from support.redis import RedisServer, free_ports, require_redis_server  # noqa: E402

SIZES = (128 << 10, 1 << 20, 4 << 20)
UPLOAD_BATCH = 32 << 20
FETCH_BATCH = 16
SECRET = os.urandom(48)
MODES = {"auth": Keyring(SECRET), "encrypted": Keyring(SECRET, encrypt=True)}
RATIOS = tuple((f"{what}, {mode}", raw, f"tier {what}, {mode}")
               for what, raw in (("up", "raw SET"), ("fetch", "raw GET")) for mode in MODES)


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


async def tier_up(tier: RemoteTier, keys: list[bytes], values: list[bytes], stream: int) -> float:
    """Offer `stream` bytes at a time (a store job's worth), letting the loop run between offers, as the
    daemon does; then drain. `stream` 0: offer everything at once, then drain."""
    t0 = time.perf_counter()
    per = max(1, stream // len(values[0])) if stream else len(keys)
    for i in range(0, len(keys), per):
        assert tier.offer("bench", "ns", keys[i:i + per], values[i:i + per]) == len(keys[i:i + per])
        await asyncio.sleep(0)
    await tier.drain()
    return time.perf_counter() - t0


async def tier_fetch(tier: RemoteTier, keys: list[bytes], size: int) -> float:
    t0 = time.perf_counter()
    got = await tier.fetch("bench", "ns", keys, payload_bytes=size)
    elapsed = time.perf_counter() - t0
    assert len(got) == len(keys), tier.stats()
    return elapsed


async def measure(url: str, client: Redis | RedisCluster, size: int, total: int, rounds: int,
                  stream: int) -> dict[str, float]:
    n = max(FETCH_BATCH, total // size)
    values = [os.urandom(size) for _ in range(n)]
    raw_keys = [b"raw:%d:%d" % (size, i) for i in range(n)]
    tier_keys = [b"%d:%d" % (size, i) for i in range(n)]
    tiers = {mode: RemoteTier(RedisStore(parse_url(url), None, 30.0), keyring=keyring,
                              queue_bytes=n * (size + 64), timeout_s=30.0, fetch_batch=FETCH_BATCH,
                              upload_batch_bytes=UPLOAD_BATCH) for mode, keyring in MODES.items()}
    times: dict[str, list[float]] = {"raw SET": [], "raw GET": []}
    for r in range(rounds + 1):  # interleaved: every contender once per round
        measured = {"raw SET": await raw_set(client, raw_keys, values)}
        for mode, tier in tiers.items():
            measured[f"tier up, {mode}"] = await tier_up(tier, tier_keys, values, stream)
        measured["raw GET"] = await raw_get(client, raw_keys, size)
        for mode, tier in tiers.items():
            measured[f"tier fetch, {mode}"] = await tier_fetch(tier, tier_keys, size)
        if r:  # the first round warms the servers' memory up
            for op, t in measured.items():
                times.setdefault(op, []).append(t)
    for tier in tiers.values():
        s = tier.stats()
        assert s.upload_failed == s.errors == s.corrupt == s.dropped_full == 0, s
        await tier.close()
    await client.flushall()
    gbs = {op: n * size / statistics.median(t) / 1e9 for op, t in times.items()}
    for name, raw, tier_op in RATIOS:
        gbs[name] = statistics.median(r / t for r, t in zip(times[raw], times[tier_op], strict=True))
    return gbs


class LastKeys:
    """Waits, without polling, until every server holds its last key of an upload: uploads go in order
    (one pipeline per node at a time), so then every key is in. Keyspace notifications of SETs on those
    keys: polling the store (or the daemon's Stats) every 0.5 ms took a sizeable share of the 2 cores
    the upload itself runs on, and raw SET has no such cost."""

    def __init__(self, subs: list[PubSub], conns: list[Redis]) -> None:
        self.subs, self.conns = subs, conns

    @classmethod
    async def subscribe(cls, client: Redis | RedisCluster, keys: list[bytes]) -> LastKeys:
        last: dict[tuple[str, int], bytes] = {}
        for key in keys:
            if isinstance(client, RedisCluster):
                node = client.get_node_from_key(key)
                last[node.host, node.port] = key
            else:
                kw = client.connection_pool.connection_kwargs
                last[kw["host"], kw["port"]] = key
        subs, conns = [], []
        for (host, port), key in last.items():
            conn = Redis(host=host, port=port)
            await conn.config_set("notify-keyspace-events", "K$")
            sub = conn.pubsub()
            await sub.subscribe(b"__keyspace@0__:" + key)
            subs.append(sub)
            conns.append(conn)
        return cls(subs, conns)

    async def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for sub in self.subs:
            while True:  # (the subscription's confirmation comes first: get_message gives None for it)
                msg = await sub.get_message(ignore_subscribe_messages=True, timeout=deadline - time.monotonic())
                if msg is not None and msg["type"] == "message" and msg["data"] == b"set":
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("an upload's last key never reached its server")
        for sub, conn in zip(self.subs, self.conns, strict=True):
            await sub.aclose()
            await conn.aclose()


async def through_daemons(url: str, client: Redis | RedisCluster, size: int, total: int, rounds: int,
                          workdir: Path, encrypt: bool) -> dict[str, float]:
    """Upload and fetch through two running daemons against raw SET/GET of the same values (one engine
    store job and one lookup per round, each on blocks of its own)."""
    n = total // size
    sets = [[os.urandom(32) for _ in range(n)] for _ in range(rounds + 1)]  # the first round warms up
    pool = str((rounds + 2) * total)
    secret = workdir / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    keyring = MODES["encrypted" if encrypt else "auth"]
    sealed = ["--remote-secret-file", str(secret)] + (["--remote-encrypt"] if encrypt else [])
    a = DaemonProcess(workdir / f"a{size}", pool, "64MiB", "--fresh", "--remote", url, "--remote-queue-bytes",
                      str(2 * total), "--remote-fetch-bytes", str(total), "--log-level", "WARNING", *sealed).start()
    b = DaemonProcess(workdir / f"b{size}", pool, "64MiB", "--fresh", "--remote", url, "--remote-fetch-bytes",
                      str(total), "--log-level", "WARNING", *sealed).start()
    memory = SharedKVMemory(n * size)
    times: dict[str, list[float]] = {"raw SET": [], "daemon up": [], "behind": [], "raw GET": [],
                                     "daemon fetch": []}
    try:
        ca, cb = a.client(timeout=120), b.client(timeout=120)
        session = ca.session("bench-remote", memory.memory_spec(n, [(0, size, size)]))
        engine_b = cb.session("bench-remote", memory.memory_spec(n, [(0, size, size)]))  # B knows the namespace
        for r, keys in enumerate(sets):
            memory.tensor.random_(0, 256)
            rkeys = keyring.remote_keys("", "bench-remote", keys)
            values = [encode_value(k, memory.tensor[i * size:(i + 1) * size].numpy(), "", keyring)
                      for i, k in enumerate(rkeys)]
            raw = [b"raw:" + k for k in rkeys]
            t_set = await raw_set(client, raw, values)
            uploaded = ca.stats().remote.uploaded
            last_keys = await LastKeys.subscribe(client, rkeys)
            t0 = time.perf_counter()
            job = session.store(keys, list(range(n)))
            assert session.wait([job], timeout=120)[job].ok
            t_commit = time.perf_counter()
            await last_keys.wait()
            t_up = time.perf_counter() - t0
            assert ca.stats().remote.uploaded == uploaded + n
            t_behind = time.perf_counter() - t_commit
            t_get = await raw_get(client, raw, keyring.value_bytes(size))
            t0 = time.perf_counter()
            assert engine_b.lookup(keys)[0] == n
            t_fetch = time.perf_counter() - t0
            if r:
                for op, t in zip(times, (t_set, t_up, t_behind, t_get, t_fetch), strict=True):
                    times[op].append(t)
        remote = ca.stats().remote
        assert remote.upload_failed == remote.dropped_full == remote.corrupt == 0, remote
        session.close()
        engine_b.close()
        ca.close()
        cb.close()
    finally:
        for daemon in (a, b):
            daemon.cleanup()
        memory.close()
        await client.flushall()
    gbs = {op: n * size / statistics.median(t) / 1e9 for op, t in times.items()}
    gbs["up"] = statistics.median(r / t for r, t in zip(times["raw SET"], times["daemon up"], strict=True))
    gbs["up behind"] = statistics.median(r / t for r, t in zip(times["raw SET"], times["behind"], strict=True))
    gbs["fetch"] = statistics.median(r / t for r, t in zip(times["raw GET"], times["daemon fetch"], strict=True))
    return gbs


async def run_daemons(name: str, url: str, client: Redis | RedisCluster, total: int, rounds: int,
                      workdir: Path, sizes: tuple[int, ...] = SIZES, encrypt: bool = False) -> list[float]:
    print(f"\n{name}, through daemons ({'encrypted' if encrypt else 'authenticated'}): {url}\n"
          "(GB/s of payload; ratio: daemon / raw)")
    print(f"{'value':>9} | {'raw SET':>7} {'daemon':>7} {'ratio':>5} {'behind':>7} {'ratio':>5} | "
          f"{'raw GET':>7} {'daemon':>7} {'ratio':>5}")
    ratios = []
    for size in sizes:
        g = await through_daemons(url, client, size, total, rounds, workdir, encrypt)
        ratios += [g["up behind"], g["fetch"]]
        print(f"{size >> 10:>5} KiB | {g['raw SET']:7.2f} {g['daemon up']:7.2f} {g['up']:5.2f} "
              f"{g['behind']:7.2f} {g['up behind']:5.2f} | "
              f"{g['raw GET']:7.2f} {g['daemon fetch']:7.2f} {g['fetch']:5.2f}", flush=True)
    await client.aclose()
    return ratios


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
    ap.add_argument("--offer-mib", type=int, default=8, help="MiB per offer call (0: all at once)")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--daemon", action="store_true", help="through running daemons, not the tier module")
    ap.add_argument("--encrypt", action="store_true", help="with --daemon: --remote-encrypt (else authenticated only)")
    args = ap.parse_args()
    print(f"loop: {args.loop}")
    (asyncio.run if args.loop == "asyncio" else uvloop.run)(main(args))


if __name__ == "__main__":
    cli()
