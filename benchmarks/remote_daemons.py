"""bench_remote.py `--daemon`: the remote tier through two running daemons (upload from daemon A's store
job, fetch by daemon B's lookup) against raw SET/GET of the same values."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from remote_common import MODES, SECRET, SIZES, raw_get, raw_set

from kvstore_client.shm import SharedKVMemory
from kvstore_service.harness import DaemonProcess
from kvstore_service.tiers.remote.codec import encode_value


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

