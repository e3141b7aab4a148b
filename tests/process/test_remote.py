"""The remote cold tier (kvstore_service.tiers.remote) against real redis-server processes on loopback: one
server, and a 3-master cluster; corrupt and truncated values, a killed and a hung node, a slow store
under write-behind, credentials. Driven through the tiers' contract (tiers/base.py), as the daemon
drives it (support.tier_contract): blocks written behind from slots and waited for until released,
fetched into slots. Servers come from support.redis (skipped only where redis-server is missing and
not required; CI requires it)."""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import uvloop
from support.pki import make_pki
from support.ports import free_ports
from support.redis import RedisCluster, RedisServer, require_redis_server
from support.tier_contract import Slots, fetch, fetch_payloads, write_behind, write_payloads
from support.tier_contract import scope_of as tier_scope

from kvstore_service import native
from kvstore_service.threads import Threads
from kvstore_service.tiers.base import Forgotten, Scope
from kvstore_service.tiers.remote import RemoteTier
from kvstore_service.tiers.remote.breaker import Breaker
from kvstore_service.tiers.remote.codec import HEADER_BYTES, KEY_PREFIX, decode_value, encode_value, remote_key
from kvstore_service.tiers.remote.url import PASSWORD_ENV, parse_url, resolve_password

TENANT, NS = "acme", "llama-3-8b|bf16|tp1"
REMOTE = Threads(copy_threads=1).remote  # the daemon's remote-tier threads, for the tiers built here


def key_of(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"{salt}block{i}".encode()).digest()


def payload_of(i: int, size: int) -> bytes:
    seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
    return (seed * (size // len(seed) + 1))[:size]


def scope_of(size: int, tenant: str = TENANT, ns: str = NS) -> Scope:
    return tier_scope(tenant, ns, size)


async def offer(tier: RemoteTier, keys: list[bytes], payloads: list[bytes], tenant: str = TENANT,
                ns: str = NS) -> int:
    """Written behind and waited for (support.tier_contract.write_payloads): how many the tier took."""
    return await write_payloads(tier, tenant, ns, keys, payloads)


async def fetched(tier: RemoteTier, keys: list[bytes], size: int, tenant: str = TENANT, ns: str = NS,
                  room: int | None = None) -> list[bytes]:
    """The payloads of the leading run fetched (support.tier_contract.fetch_payloads)."""
    return await fetch_payloads(tier, tenant, ns, keys, size, room)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    require_redis_server()
    c = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


def raw_client(target: RedisServer | RedisCluster) -> redis.Redis | redis.RedisCluster:
    if isinstance(target, RedisCluster):
        return redis.RedisCluster(host="127.0.0.1", port=target.nodes[0].port)
    return redis.Redis(host="127.0.0.1", port=target.port, password=target.password)


async def store_and_drain(tier: RemoteTier, keys: list[bytes], payloads: list[bytes]) -> None:
    assert await offer(tier, keys, payloads) == len(keys)


# -- pure parts ----------------------------------------------------------------------------------

def test_remote_key_scheme() -> None:
    k = key_of(1)
    key = remote_key(TENANT, NS, k)
    assert key == remote_key(TENANT, NS, k)
    assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 48
    assert k.hex().encode()[:8] not in key  # the block hash is not in it
    assert b"{" not in key and b"}" not in key  # no hashtag: keys spread over the cluster's slots
    assert key.decode("ascii").isprintable()
    scopes = [("acme", "ns"), ("acme", "ns2"), ("acme2", "ns"), ("", "acmens"), ("acmens", ""), ("ac", "mens"),
              ("acme", ""), ("", ""), ("a\x00", "cme"), ("a", "\x00cme")]
    assert len({remote_key(t, n, k) for t, n in scopes}) == len(scopes)
    assert len({remote_key(TENANT, NS, key_of(i)) for i in range(1000)}) == 1000


def test_remote_keys_spread_over_slots(cluster: RedisCluster) -> None:
    slots = {cluster.keyslot(remote_key(TENANT, NS, key_of(i))) for i in range(64)}
    assert len(slots) > 50


def test_value_format() -> None:
    payload = payload_of(7, 100_000)
    key, other = remote_key(TENANT, NS, key_of(7)), remote_key(TENANT, NS, key_of(8))
    value = encode_value(key, payload)
    assert len(value) == HEADER_BYTES + len(payload) + 32 and value[:4] == b"KVSR"
    assert value[HEADER_BYTES:-32] == payload  # no secret, no encryption: the payload as it is, then its MAC
    assert bytes(decode_value(key, value) or b"") == payload
    assert encode_value(key, memoryview(payload)) == value
    assert bytes(decode_value(key, value, payload_bytes=len(payload)) or b"") == payload
    assert decode_value(key, value, payload_bytes=len(payload) - 1) is None  # not this namespace's block size
    assert decode_value(other, value) is None  # a value under another key than its own
    assert decode_value(key, value, tenant="other") is None  # another tenant's MAC key
    assert decode_value(key, encode_value(key, b"")) == b""
    for bad in (value[:-1], value + b"x", value[:HEADER_BYTES - 1], b"", b"KVSR", b"garbage" * 100,
                b"XXXX" + value[4:], value[:4] + b"\x03" + value[5:], value[:5] + b"\x02" + value[6:],  # magic,
                value[:-1] + bytes([value[-1] ^ 1]),  # version, mode; one bit of the MAC,
                value[:HEADER_BYTES + 9] + bytes([value[HEADER_BYTES + 9] ^ 1]) + value[HEADER_BYTES + 10:]):  # payload
        assert decode_value(key, bad) is None


def test_pool_seal_checksums_are_the_value_checksums() -> None:
    """The CRC32C the pool's seal computes (native.checksum_blocks over the pool), which write_behind is
    given, is the same function as the one fetch_verified yields for a value."""
    buf = bytearray(payload_of(3, 3 * 4096))
    anchor = ctypes.c_char.from_buffer(buf)
    sums = native.checksum_blocks(ctypes.addressof(anchor), [0, 4096, 8192], 4096)
    del anchor
    assert sums == [native.crc32c(buf[i:i + 4096]) for i in (0, 4096, 8192)]


def test_parse_url_and_masking() -> None:
    u = parse_url("redis+cluster://10.0.0.5:6379,10.0.0.6:6380,[::1]:7000,host")
    assert u.cluster and not u.tls and u.hosts == (("10.0.0.5", 6379), ("10.0.0.6", 6380), ("::1", 7000),
                                                  ("host", 6379))
    u = parse_url("rediss://alice:s%40cret@cache.example:6390/2")
    assert u.tls and not u.cluster and u.username == "alice" and u.password == "s@cret" and u.db == 2
    assert u.masked() == "rediss://alice:***@cache.example:6390/2"
    assert "s@cret" not in repr(u) and "cret" not in u.masked()
    assert parse_url("redis://:pw@h").masked() == "redis://:***@h:6379"
    assert parse_url("redis://h:1").masked(password=True) == "redis://:***@h:1"
    assert parse_url("rediss+cluster://h1,h2").tls
    for bad in ("http://h", "h:6379", "redis://", "redis://a,b", "redis+cluster://h/1", "redis://h:99999",
                "redis://h/x", "redis://h?ssl=1", "redis://h:port"):
        with pytest.raises(ValueError):
            parse_url(bad)
    with pytest.raises(ValueError) as e:
        parse_url("http://user:topsecret@h")
    assert "topsecret" not in str(e.value)


def test_password_sources(tmp_path: Path) -> None:
    secret_file = tmp_path / "password"
    secret_file.write_text("from-file\n")
    with_pw, without = parse_url("redis://u:from-url@h"), parse_url("redis://h")
    env = {PASSWORD_ENV: "from-env"}
    assert resolve_password(with_pw, "from-arg", secret_file, env) == "from-arg"
    assert resolve_password(with_pw, None, secret_file, env) == "from-file"
    assert resolve_password(with_pw, None, None, env) == "from-url"
    assert resolve_password(without, None, None, env) == "from-env"
    assert resolve_password(without, None, None, {}) is None


def test_breaker_states() -> None:
    b = Breaker(failures=2, open_s=0.2)
    b.failure(None)
    assert b.state == "closed" and b.allow()
    b.success()  # a success resets the count
    b.failure(None)
    b.failure(None)
    assert (b.state, b.opens, b.blocked(), b.allow()) == ("open", 1, True, False)
    time.sleep(0.25)
    assert not b.blocked() and b.allow() and b.state == "half-open"  # this caller probes
    assert not b.allow()  # the others wait for the probe
    b.failure(None)  # the probe failed: open again at once
    assert (b.state, b.opens, b.allow()) == ("open", 1, False)
    time.sleep(0.25)
    assert b.allow()
    time.sleep(0.25)
    assert b.allow()  # a probe that never reported is replaced
    b.success()
    assert (b.state, b.allow(), b.blocked()) == ("closed", True, False)


# -- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "loop"), [("single", "asyncio"), ("cluster", "asyncio"), ("cluster", "uvloop")])
def test_round_trip(kind: str, loop: str, request: pytest.FixtureRequest) -> None:
    """Byte-exact, in order, over one server and over a cluster; on the daemon's loop (uvloop) too. A
    namespace's blocks are of one size: a chain of 195 in one, and one namespace each of other sizes
    (from one byte to 3 MiB)."""
    target: RedisServer | RedisCluster = request.getfixturevalue("server" if kind == "single" else "cluster")
    url = f"redis://{target.address}" if isinstance(target, RedisServer) else target.url
    sizes = [1, 4096, 128 << 10, 1 << 20, 3 << 20] + [64 << 10] * 195
    keys = [key_of(i, kind + loop) for i in range(len(sizes))]
    payloads = [payload_of(i, size) for i, size in enumerate(sizes)]
    runs = [slice(i, i + 1) for i in range(5)] + [slice(5, None)]  # a namespace each

    async def main() -> None:
        tier = RemoteTier.from_url(url, executor=REMOTE, timeout_s=5.0)
        for n, run in enumerate(runs):
            ns, size = f"{NS}|{n}", sizes[run][0]
            assert await fetched(tier, keys[run], size, ns=ns) == []  # nothing there yet: a miss, no error
            assert await offer(tier, keys[run], payloads[run], ns=ns) == len(keys[run])
            assert await fetched(tier, keys[run], size, ns=ns) == payloads[run]  # byte-exact, in order
            assert await fetched(tier, keys[run], size, "other-tenant", ns) == []
            assert await fetched(tier, keys[run], size, ns="other-ns") == []
        s = tier.stats()
        assert (s.uploaded, s.upload_failed, s.errors, s.corrupt) == (len(keys), 0, 0, 0)
        assert s.bytes_up == sum(sizes) + (HEADER_BYTES + 32) * len(sizes) and s.bytes_down == sum(sizes)
        assert (s.hits, s.misses, s.fetches, s.fetch_seconds_count) == (len(keys), 3 * len(keys), 4 * len(runs),
                                                                         4 * len(runs))
        assert s.fetch_seconds_sum > 0 and (s.queued_blocks, s.queued_bytes, s.breaker) == (0, 0, "closed")
        assert s.url == url
        await tier.aclose(0)

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    if isinstance(target, RedisCluster):  # every node holds some of the blocks (no hashtag)
        assert all(int(n.cli("DBSIZE").strip()) > 0 for n in target.nodes)


def test_prefix_stops_at_first_miss(server: RedisServer) -> None:
    keys = [key_of(i) for i in range(40)]
    payloads = [payload_of(i, 1000) for i in range(40)]

    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE, fetch_batch=8)
        await store_and_drain(tier, keys[:25] + keys[26:], payloads[:25] + payloads[26:])  # no block 25
        assert await fetched(tier, keys, 1000) == payloads[:25]
        s = tier.stats()
        assert (s.hits, s.misses) == (25, 15)
        # Where the pool has fewer slots than the store has blocks, the fetch ends with the slots.
        assert await fetched(tier, keys, 1000, room=10) == payloads[:10]
        s = tier.stats()
        assert (s.hits, s.misses) == (25 + 10, 15 + 30)
        await tier.aclose(0)

    asyncio.run(main())


def test_write_behind_dedupes_and_close_drops(server: RedisServer) -> None:
    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE)
        payload = payload_of(0, 5000)
        assert await offer(tier, [key_of(0), key_of(0)], [payload, payload]) == 1  # one upload per key
        assert await fetched(tier, [key_of(0)], 5000) == [payload]
        slots = Slots.holding([b"x" * 100] * 3)
        with pytest.raises(ValueError):
            tier.write_behind(slots, scope_of(100), [key_of(1)], [], [], lambda i: None)
        taken, released = write_behind(tier, slots, scope_of(100), [key_of(i) for i in range(1, 4)], slots.offsets,
                                       slots.checksums())
        assert taken == 3 and released.order == []
        await tier.aclose(0)  # no drain: what was queued is dropped, counted, released
        assert sorted(released.order) == [0, 1, 2]
        assert await offer(tier, [key_of(9)], [b"y"]) == 0
        s = tier.stats()
        assert (s.uploaded, s.dropped_closed, s.queued_blocks, s.queued_bytes) == (1, 4, 0, 0)

    asyncio.run(main())


def test_payloads_are_sent_from_the_callers_memory_and_released_once(server: RedisServer) -> None:
    """No copy: a payload is read when its upload is sent, so the caller keeps it unchanged until the tier
    releases it, which it does exactly once per offered block, whatever became of it (uploaded, a
    duplicate, dropped for a full queue, dropped at close), and only after the server answered."""
    size = 64 << 10

    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE,
                                   queue_bytes=4 * (size + HEADER_BYTES + 32))
        memory = Slots.holding([payload_of(i, size) for i in range(6)])
        at, crcs, scope = memory.offsets, memory.checksums(), scope_of(size)
        keys = [key_of(i, "zero-copy") for i in range(6)]
        # 0..3 queued; 4 and 5 do not fit: dropped and released at once
        taken, released = write_behind(tier, memory, scope, keys, at, crcs)
        assert taken == 4 and sorted(released.order) == [4, 5]
        again, twice = write_behind(tier, memory, scope, keys[:1], at[:1], crcs[:1])
        assert again == 0 and twice.order == [0]  # a key already queued: released, not queued twice
        await released.wait()
        assert sorted(released.order) == [0, 1, 2, 3, 4, 5]
        assert await fetched(tier, keys[:4], size) == [payload_of(i, size) for i in range(4)]

        taken, late = write_behind(tier, memory, scope, [key_of(0, "late")], at[:1], crcs[:1])
        memory.view(at[0], 8)[:] = b"changed!"  # changed before its upload was sent: stored (and sealed) as it is then
        await late.wait()
        assert await fetched(tier, [key_of(0, "late")], size) == [memory.get(at[0])]

        taken, closed = write_behind(tier, memory, scope, [key_of(i, "closing") for i in range(3)], at[:3], crcs[:3])
        await tier.aclose(0)
        assert sorted(closed.order) == [0, 1, 2]
        s = tier.stats()
        assert (s.dropped_full, s.dropped_closed, s.queued_bytes) == (2, 3, 0)

    asyncio.run(main())


def test_values_as_stored(server: RedisServer) -> None:
    payloads = [payload_of(i, 64 << 10) for i in range(4)]
    keys = [key_of(i) for i in range(4)]

    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE)
        assert await offer(tier, keys, payloads) == 4
        assert await fetched(tier, keys, 64 << 10) == payloads
        raw = redis.asyncio.Redis(host="127.0.0.1", port=server.port)
        assert await raw.get(remote_key(TENANT, NS, keys[0])) == encode_value(remote_key(TENANT, NS, keys[0]),
                                                                              payloads[0], TENANT)
        await raw.aclose()
        await tier.aclose(0)

    asyncio.run(main())


def test_the_rest_of_the_contract_is_trivial(server: RedisServer) -> None:
    """What the store cannot tell without a round trip or does not own: `holds` is None (only a fetch
    tells), it names no namespace and announces no change, a Clear does not reach it, and a block never
    written is none of its drops. A namespace known by hash only (no name to key by) is neither stored
    nor fetched."""
    keys = [key_of(i, "trivial") for i in range(3)]
    payloads = [payload_of(i, 4096) for i in range(3)]

    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE)
        await store_and_drain(tier, keys, payloads)
        scope = scope_of(4096)
        assert tier.holds(scope, keys) is None
        assert tier.forget([scope.ns_hash]) == Forgotten({}, None) and tier.forget(None) == Forgotten({}, None)
        assert await fetched(tier, keys, 4096) == payloads  # not forgotten
        tier.unwritten(scope, keys)
        assert (tier.names(), tier.take_changes()) == ({}, [])
        nameless, memory = Scope(scope.ns_hash, "", 4096), Slots.holding(payloads)
        taken, released = write_behind(tier, memory, nameless, [key_of(9, "trivial")], memory.offsets[:1],
                                       memory.checksums()[:1])
        assert taken == 0 and released.order == [0]
        assert await fetch(tier, memory, nameless, keys, memory.offsets) == []
        s = tier.stats()
        assert (s.uploaded, s.hits, s.misses, s.fetches) == (3, 3, 0, 1)
        assert s.dropped_full + s.dropped_unhealthy + s.dropped_closed + s.upload_failed == 0
        await tier.aclose(0)

    asyncio.run(main())


# -- bad values ----------------------------------------------------------------------------------

def test_corrupt_and_truncated_values_are_deleted_misses(cluster: RedisCluster) -> None:
    keys = [key_of(i, "corrupt") for i in range(8)]
    payloads = [payload_of(i, 32 << 10) for i in range(8)]
    raw = raw_client(cluster)
    rkeys = [remote_key(TENANT, NS, k) for k in keys]

    async def main() -> None:
        tier = RemoteTier.from_url(cluster.url, executor=REMOTE)
        await store_and_drain(tier, keys, payloads)
        raw.set(rkeys[1], b"garbage, not a kvstore value")
        assert await fetched(tier, keys, 32 << 10) == payloads[:1]
        assert raw.exists(rkeys[1]) == 0 and tier.stats().corrupt == 1

        value = raw.get(rkeys[3])
        assert isinstance(value, bytes)
        raw.set(rkeys[3], value[:-100])  # truncated
        assert await fetched(tier, keys[2:], 32 << 10) == payloads[2:3]
        assert raw.exists(rkeys[3]) == 0 and tier.stats().corrupt == 2

        flipped = bytearray(value)
        flipped[HEADER_BYTES + 1000] ^= 0x40  # one bit of the payload: only the MAC sees it
        raw.set(rkeys[5], bytes(flipped))
        assert await fetched(tier, keys[4:], 32 << 10) == payloads[4:5]
        assert raw.exists(rkeys[5]) == 0

        # A block of another size than the namespace's is not copied anywhere: corrupt too, and every
        # such value of the batch is deleted, not only the first.
        assert await fetched(tier, keys[6:], 16 << 10) == []
        assert raw.exists(rkeys[6]) == 0 and raw.exists(rkeys[7]) == 0 and tier.stats().corrupt == 5
        # A valid value under another block's key (a mixed-up reply, a copied key) is caught too.
        raw.set(rkeys[7], raw.get(rkeys[0]))
        assert await fetched(tier, keys[7:], 32 << 10) == [] and raw.exists(rkeys[7]) == 0
        s = tier.stats()
        assert (s.corrupt, s.errors, s.breaker) == (6, 0, "closed")
        await tier.aclose(0)

    asyncio.run(main())


# -- failures ------------------------------------------------------------------------------------

def chain_across_nodes(c: RedisCluster, dead: RedisServer, n: int, salt: str) -> tuple[list[bytes], int]:
    """`n` keys whose first few (at least 3) live on other nodes than `dead`, and the index of the first on it."""
    slot_map = c.slot_map()
    for attempt in range(100):
        keys = [key_of(i, f"{salt}{attempt}") for i in range(n)]
        owners = [c.node_of(remote_key(TENANT, NS, k), slot_map) for k in keys]
        if dead in owners and owners.index(dead) >= 3:
            return keys, owners.index(dead)
    raise AssertionError("no such chain")


def test_killed_node_misses_opens_breaker_then_recovers(fresh_cluster: RedisCluster) -> None:
    c = fresh_cluster
    victim = c.nodes[1]
    keys, first = chain_across_nodes(c, victim, 60, "kill")
    payloads = [payload_of(i, 16 << 10) for i in range(len(keys))]

    async def main() -> None:
        tier = RemoteTier.from_url(c.url, executor=REMOTE, timeout_s=1.0, breaker_s=1.0, breaker_failures=2,
                                   fetch_batch=64)
        await store_and_drain(tier, keys, payloads)
        victim.kill()

        t0 = time.monotonic()
        got = await fetched(tier, keys, 16 << 10)
        assert time.monotonic() - t0 < 1.5  # bounded by the timeout
        assert got == payloads[:first]  # the prefix before the dead node's first key
        assert tier.stats().errors > 0
        await fetched(tier, keys, 16 << 10)
        s = tier.stats()
        assert (s.breaker, s.breaker_opens) == ("open", 1)

        t0 = time.monotonic()  # open: nothing is asked, nothing is queued
        assert await fetched(tier, keys, 16 << 10) == []
        assert await offer(tier, [key_of(999, "kill")], [b"z" * 100]) == 0
        assert time.monotonic() - t0 < 0.1
        s = tier.stats()
        assert (s.skipped, s.dropped_unhealthy) == (len(keys), 1)

        victim.start()  # same port and directory: same nodes.conf, the same cluster member (now empty)
        await asyncio.to_thread(c.wait_ok)
        await asyncio.sleep(1.1)  # breaker_s: the next call probes
        assert await fetched(tier, keys[:first], 16 << 10) == payloads[:first]
        assert tier.stats().breaker == "closed"
        await store_and_drain(tier, keys, payloads)  # uploads work again, the restarted node's keys too
        assert await fetched(tier, keys, 16 << 10) == payloads
        s = tier.stats()
        assert (s.breaker, s.breaker_opens, s.upload_failed) == ("closed", 1, 0)
        await tier.aclose(0)

    asyncio.run(main())


def test_hung_node_is_bounded_by_the_timeout(fresh_cluster: RedisCluster) -> None:
    c = fresh_cluster
    victim = c.nodes[2]
    keys, first = chain_across_nodes(c, victim, 60, "hang")
    payloads = [payload_of(i, 8 << 10) for i in range(len(keys))]

    async def main() -> None:
        tier = RemoteTier.from_url(c.url, executor=REMOTE, timeout_s=0.5, breaker_s=30.0, breaker_failures=1,
                                   fetch_batch=64)
        await store_and_drain(tier, keys, payloads)
        victim.pause()
        try:
            # The node stays paused: a fetch that waited for it would never return, one that timed out
            # call after call (60 keys) would take 30 s. It waits for one timeout (0.5 s); the bound
            # leaves a loaded machine room.
            t0 = time.monotonic()
            got = await asyncio.wait_for(fetched(tier, keys, 8 << 10), 3.0)
            assert time.monotonic() - t0 >= 0.45
            assert len(got) <= first and got == payloads[:len(got)]
            s = tier.stats()
            assert (s.breaker, s.timeouts > 0) == ("open", True)
            # The open breaker answers at once: no request goes to the node, none times out.
            t0 = time.monotonic()
            assert await fetched(tier, keys, 8 << 10) == []
            assert time.monotonic() - t0 < 0.05
            assert tier.stats().timeouts == s.timeouts
        finally:
            victim.resume()
        await tier.aclose(0)

    asyncio.run(main())


def test_unreachable_store_is_a_miss() -> None:
    port = free_ports(1)[0]  # nothing listens there

    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://127.0.0.1:{port}", executor=REMOTE, timeout_s=0.5, breaker_failures=2)
        assert await fetched(tier, [key_of(0)], 10) == []
        assert await offer(tier, [key_of(1)], [b"x" * 10]) == 1  # (waited for: released once it failed)
        s = tier.stats()
        assert (s.upload_failed, s.errors, s.breaker, s.queued_bytes) == (1, 2, "open", 0)
        await tier.aclose(0)

    asyncio.run(main())


def test_write_behind_under_a_slow_store_stays_bounded(server: RedisServer) -> None:
    block, limit = 128 << 10, 1 << 20
    payload = payload_of(0, block)

    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE, queue_bytes=limit, timeout_s=0.3,
                                   breaker_s=0.5, breaker_failures=2, upload_batch_bytes=2 * block)
        memory = Slots.holding([payload] * 4)
        crcs = memory.checksums()
        sleeper = subprocess.Popen(["redis-cli", "-p", str(server.port), "DEBUG", "SLEEP", "1.5"],
                                   stdout=subprocess.DEVNULL)
        await asyncio.sleep(0.1)  # the server sleeps now: nothing it is sent is answered
        worst, peak, i = 0.0, 0, 0
        writes = []
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            keys = [key_of(i + j, "slow") for j in range(4)]
            t0 = time.perf_counter()
            writes.append(write_behind(tier, memory, scope_of(block), keys, memory.offsets, crcs)[1])
            worst = max(worst, time.perf_counter() - t0)
            peak = max(peak, tier.stats().queued_bytes)
            i += 4
            await asyncio.sleep(0.01)
        s = tier.stats()
        assert peak <= limit and worst < 0.05, (peak, worst)
        assert s.dropped_full > 0 and s.upload_failed > 0 and s.timeouts > 0
        assert s.dropped_full + s.dropped_unhealthy + s.upload_failed + s.uploaded + s.queued_blocks == i
        await asyncio.to_thread(sleeper.wait, 10)
        for released in writes:  # every block let go of, once
            await released.wait()
            assert sorted(released.order) == [0, 1, 2, 3]
        assert tier.stats().queued_blocks == 0
        await asyncio.sleep(0.6)  # past breaker_s: the next upload probes and closes it
        keys = [key_of(i, "after") for i in range(4)]
        await store_and_drain(tier, keys, [payload] * 4)
        assert await fetched(tier, keys, block) == [payload] * 4
        assert tier.stats().breaker == "closed"
        await tier.aclose(0)

    asyncio.run(main())


# -- credentials ---------------------------------------------------------------------------------

def test_credentials_from_url_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    require_redis_server()
    secret = "pw-" + os.urandom(8).hex()
    s = RedisServer(tmp_path / "auth", free_ports(1)[0], password=secret).start()
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret + "\n")
    caplog.set_level(logging.DEBUG, logger="kvstore_service.tiers.remote")

    async def round_trip(tier: RemoteTier, i: int) -> list[bytes]:
        await offer(tier, [key_of(i, "auth")], [payload_of(i, 1000)])
        got = await fetched(tier, [key_of(i, "auth")], 1000)
        await tier.aclose(0)
        return got

    async def main() -> None:
        tier = RemoteTier.from_url(f"redis://:{secret}@{s.address}", executor=REMOTE)
        assert await round_trip(tier, 0) == [payload_of(0, 1000)]
        assert tier.stats().url == f"redis://:***@{s.address}"
        assert await round_trip(RemoteTier.from_url(f"redis://{s.address}", executor=REMOTE,
                                                    password_file=secret_file), 1) \
            == [payload_of(1, 1000)]
        monkeypatch.setenv(PASSWORD_ENV, secret)
        tier = RemoteTier.from_url(f"redis://{s.address}", executor=REMOTE)
        assert await round_trip(tier, 2) == [payload_of(2, 1000)]
        assert tier.stats().url == f"redis://:***@{s.address}"
        monkeypatch.delenv(PASSWORD_ENV)
        wrong = RemoteTier.from_url(f"redis://:wrong-{secret}@{s.address}", executor=REMOTE, breaker_failures=10)
        assert await round_trip(wrong, 3) == []  # refused: a miss and a failed upload, never an exception
        st = wrong.stats()
        assert st.upload_failed == 1 and st.errors == 2

    try:
        asyncio.run(main())
    finally:
        s.kill()
    assert caplog.records and not any(secret in r.getMessage() for r in caplog.records)


def test_tls(tmp_path: Path) -> None:
    require_redis_server()
    pki = make_pki(tmp_path)
    tls = (str(pki["server_path"]), str(tmp_path / "server_key.pem"), str(pki["ca_path"]))
    s = RedisServer(tmp_path / "tls", free_ports(1)[0], tls=tls).start()
    keys, payloads = [key_of(i, "tls") for i in range(3)], [payload_of(i, 50_000) for i in range(3)]

    async def main() -> None:
        tier = RemoteTier.from_url(f"rediss://{s.address}", executor=REMOTE, tls_ca_file=str(pki["ca_path"]))
        await store_and_drain(tier, keys, payloads)
        assert await fetched(tier, keys, 50_000) == payloads
        await tier.aclose(0)
        untrusted = RemoteTier.from_url(f"rediss://{s.address}",
                                        executor=REMOTE)  # the system's CAs do not know this one
        assert await fetched(untrusted, keys, 50_000) == [] and untrusted.stats().errors == 3
        await untrusted.aclose(0)
        plain = RemoteTier.from_url(f"redis://{s.address}", executor=REMOTE, timeout_s=0.5)
        assert await fetched(plain, keys, 50_000) == []
        await plain.aclose(0)

    try:
        asyncio.run(main())
    finally:
        s.kill()
