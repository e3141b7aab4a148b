"""The shared store is not trusted: a third party that can write and read the real redis-server the
daemons use (and knows the key and value formats, the tenants, namespaces and prompts) can neither
get a block of its own served, nor find or read a tenant's blocks, without the secret
(--remote-secret-file). A secret it lacks keys every derivation; --remote-encrypt hides the payloads;
--remote with --tenants does not start without a secret."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from support.blocks import content_of, key_of
from support.daemon import wait_for
from support.engine import Engine, lookup_and_load, store_blocks
from support.redis import RedisServer
from support.tier_contract import fetch_payloads, write_payloads

from kvstore_service.config import Config, ConfigError
from kvstore_service.threads import Threads
from kvstore_service.tiers.remote import RemoteTier
from kvstore_service.tiers.remote.codec import Keyring, encode_value

REMOTE = Threads(copy_threads=1).remote  # the daemon's remote-tier threads, for the tiers built here

NS = "model=org/shared-model;dtype=float16"
BLOCKS = 16
BLOCK_BYTES = 64 * 1024


def wait_uploaded(daemon, n: int) -> None:
    assert wait_for(lambda: (r := daemon.client().stats().remote).uploaded >= n and not r.queued_blocks), \
        daemon.client().stats().remote


def load_on(daemon, keys: list[bytes]) -> tuple[int, int]:
    """(leading hits of a lookup, blocks whose loaded bytes are wrong) for an engine on `daemon`."""
    return lookup_and_load(daemon.socket, NS, keys, BLOCK_BYTES)


def secret_file(path: Path, secret: bytes | None = None) -> Path:
    path.write_bytes(secret if secret is not None else os.urandom(48))
    path.chmod(0o600)
    return path


def store_keys(store: redis.Redis) -> list[bytes]:
    return sorted(store.scan_iter(count=1000))


def contains_any_window(value: bytes, payloads: list[bytes], width: int = 64) -> bool:
    """Whether `value` holds any `width`-byte run of any payload (taken every 4 KiB)."""
    return any(p[i:i + width] in value for p in payloads for i in range(0, len(p) - width, 4096))


def test_a_third_party_gets_nothing_served_through_the_daemons(daemon_factory, server: RedisServer,
                                                               tmp_path: Path) -> None:
    """Planted values under the keys it can compute for the prompts (8), every upload overwritten (16)
    with values of its own making: node B serves none of them, it loads nothing but the truth."""
    url, secret = f"redis://{server.address}", str(secret_file(tmp_path / "secret"))
    node_a = daemon_factory("--remote", url, "--remote-secret-file", secret).start()
    node_b = daemon_factory("--remote", url, "--remote-secret-file", secret).start()
    store = redis.Redis(host="127.0.0.1", port=server.port)
    forged = [os.urandom(BLOCK_BYTES) for _ in range(BLOCKS)]

    # Planted: 8 prompts the tenant will run, their blocks computed from the tokens as the old scheme
    # allowed; with the keyring the attacker can build (no secret, or one of its own).
    planted = [key_of(NS, i) for i in range(8)]
    planted_at = set()
    for i, key in enumerate(planted):
        for ring in (Keyring(), Keyring(os.urandom(32))):
            rkey = ring.remote_keys("", NS, [key])[0]
            store.set(rkey, encode_value(rkey, forged[i], "", ring))
            planted_at.add(rkey)
    assert load_on(node_b, planted) == (0, 0)

    keys = store_blocks(node_a.socket, NS, BLOCKS)
    wait_uploaded(node_a, BLOCKS)
    values = {k: store.get(k) or b"" for k in store_keys(store)}
    assert len(values) == 2 * len(planted) + BLOCKS
    genuine = [v for k, v in values.items() if k not in planted_at]
    # Overwritten: every value in the store replaced by one the attacker makes under that very key:
    # sealed without the secret, with a secret of its own, or another block's genuine value (replayed).
    for n, rkey in enumerate(values):
        if n % 3 == 0:
            value = encode_value(rkey, forged[n % BLOCKS])
        elif n % 3 == 1:
            value = encode_value(rkey, forged[n % BLOCKS], "", Keyring(os.urandom(32)))
        else:
            value = genuine[n % len(genuine)]
            if value == values[rkey]:
                value = genuine[(n + 1) % len(genuine)]
        store.set(rkey, value)
    assert load_on(node_b, keys) == (0, 0)  # not one block served
    stats = node_b.client().stats()
    assert stats.blocks == 0 and stats.remote.hits == 0 and stats.remote.corrupt >= 1
    store.close()


def test_keys_are_not_recomputable_and_payloads_are_unreadable(daemon_factory, server: RedisServer,
                                                               tmp_path: Path) -> None:
    """With --remote-encrypt, what the store holds tells the attacker nothing: the keys of the prompts it
    guesses are not there (under any derivation it can run), no value holds a byte run of the KV, and
    the values of a block stored twice differ. The daemons still share every block."""
    url, secret = f"redis://{server.address}", str(secret_file(tmp_path / "secret"))
    node_a = daemon_factory("--remote", url, "--remote-secret-file", secret, "--remote-encrypt").start()
    node_b = daemon_factory("--remote", url, "--remote-secret-file", secret, "--remote-encrypt").start()
    store = redis.Redis(host="127.0.0.1", port=server.port)
    keys = store_blocks(node_a.socket, NS, BLOCKS)
    wait_uploaded(node_a, BLOCKS)
    rkeys = store_keys(store)
    assert len(rkeys) == BLOCKS
    for ring in (Keyring(), Keyring(os.urandom(32)), Keyring(os.urandom(32), encrypt=True)):
        guessed = ring.remote_keys("", NS, keys)
        assert store.exists(*guessed) == 0
    values = [store.get(k) or b"" for k in rkeys]
    payloads = [content_of(k, BLOCK_BYTES) for k in keys]
    assert not any(contains_any_window(v, payloads) for v in values)
    assert load_on(node_b, keys) == (BLOCKS, 0)  # byte-exact through the encryption

    # The same block stored again by another node: another value (a fresh key per value).
    before = dict(zip(rkeys, values, strict=True))
    node_c = daemon_factory("--remote", url, "--remote-secret-file", secret, "--remote-encrypt").start()
    engine = Engine(node_c.socket, NS, BLOCKS, BLOCK_BYTES)
    engine.fill(keys[:1], [0])
    job = engine.session.store(keys[:1], [0])
    assert engine.session.wait([job])[job].ok
    engine.close()
    wait_uploaded(node_c, 1)
    assert sum(store.get(k) != before[k] for k in rkeys) == 1
    store.close()


def test_without_encryption_the_payload_is_in_the_store(server: RedisServer, tmp_path: Path) -> None:
    """What --remote-encrypt is for: a secret alone authenticates, it does not hide."""
    payloads = [content_of(key_of("plain", i), BLOCK_BYTES) for i in range(2)]
    keys = [key_of("plain", i) for i in range(2)]

    async def main(encrypt: bool) -> bool:
        ring = Keyring(os.urandom(32), encrypt)
        tier = RemoteTier(RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE).store, executor=REMOTE,
                          keyring=ring)
        assert await write_payloads(tier, "acme", NS, keys, payloads) == 2
        assert await fetch_payloads(tier, "acme", NS, keys, BLOCK_BYTES) == payloads
        values = [await asyncio.to_thread(redis.Redis(port=server.port).get, k)
                  for k in ring.remote_keys("acme", NS, keys)]
        await tier.aclose(0)
        return any(contains_any_window(v or b"", payloads) for v in values)

    assert asyncio.run(main(encrypt=False))
    assert not asyncio.run(main(encrypt=True))


def test_values_do_not_cross_tenants_or_secrets(server: RedisServer) -> None:
    """A tenant's genuine value copied under another tenant's key is refused; a rotated secret finds
    nothing of the old one (its keys differ: plain misses, nothing counted corrupt)."""
    secret = os.urandom(32)
    key = key_of("cross", 0)
    payload = content_of(key, 4096)

    async def main() -> None:
        store = RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE).store
        tier = RemoteTier(store, executor=REMOTE, keyring=Keyring(secret))
        assert await write_payloads(tier, "team-b", NS, [key], [payload]) == 1
        assert await fetch_payloads(tier, "team-b", NS, [key], 4096) == [payload]
        raw = redis.asyncio.Redis(port=server.port)
        b_key, a_key = (Keyring(secret).remote_keys(t, NS, [key])[0] for t in ("team-b", "team-a"))
        assert a_key != b_key
        await raw.set(a_key, await raw.get(b_key))  # team-b's value planted as team-a's block
        assert await fetch_payloads(tier, "team-a", NS, [key], 4096) == [] and tier.stats().corrupt == 1
        assert await raw.exists(a_key) == 0  # deleted

        rotated = RemoteTier(RemoteTier.from_url(f"redis://{server.address}", executor=REMOTE).store, executor=REMOTE,
                             keyring=Keyring(os.urandom(32)))
        assert await fetch_payloads(rotated, "team-b", NS, [key], 4096) == []
        assert (rotated.stats().misses, rotated.stats().corrupt) == (1, 0)
        await raw.aclose()
        await rotated.aclose(0)
        await tier.aclose(0)

    asyncio.run(main())


def test_tenants_need_a_secret(tmp_path: Path) -> None:
    tenants = {"team-a": {"uids": [1000]}}
    with pytest.raises(ConfigError, match="--remote-secret-file"):
        Config.load(remote="redis://127.0.0.1:6379", tenants=tenants)
    with pytest.raises(ConfigError, match="--remote-encrypt needs --remote-secret-file"):
        Config.load(remote="redis://127.0.0.1:6379", remote_encrypt=True)
    good = secret_file(tmp_path / "secret")
    assert Config.load(remote="redis://h", tenants=tenants, remote_secret_file=str(good)).remote_secret_file


@pytest.mark.parametrize(("problem", "expect"), [
    ("tenants", "--remote with --tenants needs --remote-secret-file"),
    ("short", "want at least 32"),
    ("readable", "others may read it"),
    ("missing", "No such file"),
])
def test_a_bad_secret_refuses_the_start(daemon_factory, tmp_path: Path, problem: str, expect: str) -> None:
    args = ["--remote", "redis://127.0.0.1:1"]
    if problem == "tenants":
        args += ["--tenants", f'{{"t": {{"uids": [{os.getuid()}]}}}}']
    else:
        path = tmp_path / "secret"
        if problem != "missing":
            secret_file(path, os.urandom(16).hex()[:31].encode() if problem == "short" else None)
        if problem == "readable":
            path.chmod(0o644)
        args += ["--remote-secret-file", str(path)]
    daemon = daemon_factory(*args)
    out = subprocess.run([sys.executable, "-m", "kvstore_service", "serve", *daemon.args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and expect in out.stderr, out.stderr
    assert not Path(daemon.socket).exists()


def test_a_value_of_the_wrong_size_never_crosses_the_wire_whole(daemon_factory, server: RedisServer,
                                                                tmp_path: Path) -> None:
    """A writer without the secret replaces every value with 32 MiB: a fetching node reads at most one
    byte more than a value's size of each (GETRANGE), serves none of them, says so and deletes them."""
    url, secret = f"redis://{server.address}", str(secret_file(tmp_path / "secret"))
    node_a = daemon_factory("--remote", url, "--remote-secret-file", secret).start()
    node_b = daemon_factory("--remote", url, "--remote-secret-file", secret).start()
    store = redis.Redis(host="127.0.0.1", port=server.port)
    keys = store_blocks(node_a.socket, NS, 8)
    wait_uploaded(node_a, 8)
    for rkey in store_keys(store):
        store.set(rkey, os.urandom(32) * (1 << 20))
    sent = store.info("stats")["total_net_output_bytes"]
    assert load_on(node_b, keys) == (0, 0)
    sent = store.info("stats")["total_net_output_bytes"] - sent
    assert sent < 8 * (BLOCK_BYTES + 4096) + (1 << 20), f"{sent} bytes read from the store"
    # Every bad value of the batch is deleted, not only the first: the next fetch reads nothing of them.
    assert node_b.client().stats().remote.corrupt == 8 and store_keys(store) == []
    store.close()
