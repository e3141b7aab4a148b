"""bench_remote.py's shared pieces: value sizes and batches, the sealing keys, and the raw client's SET and
GET pipelines every tier figure is measured against."""

from __future__ import annotations

import os
import time

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from kvstore_service.tiers.remote.codec import Keyring

SIZES = (128 << 10, 1 << 20, 4 << 20)
UPLOAD_BATCH = 32 << 20
FETCH_BATCH = 16
SECRET = os.urandom(48)
MODES = {"auth": Keyring(SECRET), "encrypted": Keyring(SECRET, encrypt=True)}


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
