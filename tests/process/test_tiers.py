"""Past one node: two daemons (two "nodes": own sockets, own pools) share one Redis store. Blocks an
engine stores on node A are written behind to the store; a lookup on node B that misses in its
empty pool brings them in before it answers, and B's engine loads them byte-exact. Every failure of
the store is a miss."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from support.blocks import key_of
from support.daemon import wait_for
from support.engine import Engine, lookup_and_load, store_blocks
from support.redis import RedisServer

NS = "model=org/shared-model;dtype=float16"
BLOCKS = 16  # (store_blocks: an engine of 16 blocks)
BLOCK_BYTES = 64 * 1024




def wait_uploaded(daemon, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (remote := daemon.client().stats().remote).uploaded < n or remote.queued_blocks:
        assert time.monotonic() < deadline, remote
        time.sleep(0.05)


def load_on(daemon, keys: list[bytes]) -> tuple[int, int]:
    """(leading hits of a lookup, blocks whose loaded bytes are wrong) for an engine on `daemon`."""
    return lookup_and_load(daemon.socket, NS, keys, BLOCK_BYTES)


@pytest.mark.parametrize("store", ["server", "fresh_cluster"])
def test_a_block_stored_on_one_node_is_loaded_on_another(daemon_factory, request, store: str) -> None:
    target = request.getfixturevalue(store)
    url = f"redis://{target.address}" if store == "server" else target.url
    node_a = daemon_factory("--remote", url).start()
    node_b = daemon_factory("--remote", url).start()
    keys = store_blocks(node_a.socket, NS, BLOCKS)
    wait_uploaded(node_a, BLOCKS)
    hits, wrong = load_on(node_b, keys + [key_of("never-stored", 0)])
    assert (hits, wrong) == (BLOCKS, 0)
    stats = node_b.client().stats()
    assert stats.remote.hits == BLOCKS and stats.blocks == BLOCKS  # promoted into B's pool
    assert stats.remote.uploaded == 0  # blocks fetched are not offered back
    assert load_on(node_b, keys) == (BLOCKS, 0) and node_b.client().stats().remote.hits == BLOCKS  # now local


def test_blocks_fetched_from_the_store_are_sealed_with_their_verified_checksums(daemon_factory, server) -> None:
    """Promoted blocks are sealed with the CRC32C their values carried (no second pass over their
    bytes): those checksums are right, since a restart of node B, with the store gone, verifies every
    recovered block against its bytes and serves them all, byte-exact."""
    url = f"redis://{server.address}"
    node_a, node_b = daemon_factory("--remote", url).start(), daemon_factory("--remote", url).start()
    keys = store_blocks(node_a.socket, NS, BLOCKS)
    wait_uploaded(node_a, BLOCKS)
    assert load_on(node_b, keys) == (BLOCKS, 0)
    client = node_b.client()
    assert wait_for(lambda: client.stats().unsealed_blocks == 0, timeout=20)
    server.kill()
    node_b.stop()
    node_b.start()
    assert wait_for(lambda: client.stats().blocks == BLOCKS, timeout=20)  # every one verified
    assert load_on(node_b, keys) == (BLOCKS, 0) and client.stats().remote.hits == 0


def test_a_block_stored_while_its_neighbours_are_promoted_ends_the_promotion_there(daemon_factory, server) -> None:
    """The pool takes fetched blocks up to the first key it already holds (a store got there first):
    those are promoted with their own checksums, the rest on a later lookup, every byte exact."""
    url = f"redis://{server.address}"
    node_a, node_b = daemon_factory("--remote", url).start(), daemon_factory("--remote", url).start()
    keys = store_blocks(node_a.socket, NS, BLOCKS)
    wait_uploaded(node_a, BLOCKS)
    engine = Engine(node_b.socket, NS, 1, BLOCK_BYTES)
    engine.fill(keys[5:6], [0])
    job = engine.session.store(keys[5:6], [0])
    assert engine.session.wait([job])[job].ok
    engine.close()
    hits, wrong = load_on(node_b, keys)
    assert hits >= 6 and wrong == 0
    assert load_on(node_b, keys) == (BLOCKS, 0)


def test_corrupt_and_truncated_values_are_misses(daemon_factory, server: RedisServer) -> None:
    from kvstore_service.tiers.remote.codec import remote_key

    url = f"redis://{server.address}"
    node_a, node_b = daemon_factory("--remote", url).start(), daemon_factory("--remote", url).start()
    keys = store_blocks(node_a.socket, NS, 8)
    wait_uploaded(node_a, 8)
    store = redis.Redis(host=server.address.split(":")[0], port=server.port)
    third, fifth = remote_key("", NS, keys[3]), remote_key("", NS, keys[5])
    value = bytearray(store.get(third))  # type: ignore[arg-type]
    value[-1] ^= 0xFF  # a flipped bit in the payload
    store.set(third, bytes(value))
    store.set(fifth, store.get(fifth)[:1000])  # type: ignore[index]  # truncated
    assert load_on(node_b, keys) == (3, 0)  # the leading run up to the corrupt block, byte-exact
    stats = node_b.client().stats()
    # Both bad values of the batch are deleted (not only the first), the good ones kept.
    assert stats.remote.corrupt == 2 and store.get(third) is None and store.get(fifth) is None
    assert store.get(remote_key("", NS, keys[4])) is not None
    assert stats.blocks == 3  # the slots the rest of the batch was copied into are free again
    node_b.client().clear()
    store.set(third, bytes(value[:24]) + bytes(len(value) - 24))  # a good header, the payload zeroed
    assert load_on(node_b, keys) == (3, 0) and node_b.client().stats().remote.corrupt == 3
    store.delete(third)
    assert load_on(node_b, keys) == (3, 0)
    store.close()


def test_a_dead_store_is_a_miss_and_the_node_keeps_serving(daemon_factory, server: RedisServer) -> None:
    node = daemon_factory("--remote", f"redis://{server.address}", "--remote-timeout-s", "0.5").start()
    local = store_blocks(node.socket, "local-ns", 4)
    server.kill()
    t0 = time.monotonic()
    assert load_on(node, [key_of(NS, i) for i in range(4)]) == (0, 0)
    assert time.monotonic() - t0 < 5
    assert node.client().lookup("local-ns", local) == 4
    stats = node.client().stats()
    assert stats.remote.errors + stats.remote.skipped > 0 and node.client().health() == "SERVING"


def test_a_bad_remote_url_refuses_the_start(daemon_factory) -> None:
    import subprocess
    import sys

    daemon = daemon_factory("--remote", "http://nowhere:1")
    out = subprocess.run([sys.executable, "-m", "kvstore_service", "serve", *daemon.args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--remote" in out.stderr, out.stderr


# -- the disk tier -------------------------------------------------------------------------------

DISK = ("--disk-size", "32MiB", "--disk-segment-size", "4MiB")


def wait_written(daemon, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (disk := daemon.client().stats().disk).written < n or disk.queued_bytes:
        assert time.monotonic() < deadline, disk
        time.sleep(0.05)


def test_blocks_evicted_from_the_pool_come_back_from_disk(daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), *DISK, pool_size="2MiB",
                            segment_size="1MiB").start()
    keys = store_blocks(daemon.socket, NS, BLOCKS)
    wait_written(daemon, BLOCKS)
    for n, other in enumerate(("other-1", "other-2"), 2):  # the pool holds ~28 blocks: these evict the first ones
        store_blocks(daemon.socket, other, BLOCKS)
        wait_written(daemon, n * BLOCKS)  # (blocks being written are pinned: the next store would find no room)
    stats = daemon.client().stats()
    assert stats.evictions >= BLOCKS and stats.disk.blocks == 3 * BLOCKS
    assert load_on(daemon, keys) == (BLOCKS, 0)  # promoted from disk before the lookup answered
    stats = daemon.client().stats()
    assert stats.disk.read_blocks >= BLOCKS and stats.disk.written == 3 * BLOCKS  # not written again


def test_a_restarted_daemon_with_an_empty_pool_finds_its_blocks_on_disk(daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), *DISK).start()
    keys = store_blocks(daemon.socket, NS, BLOCKS)
    wait_written(daemon, BLOCKS)
    daemon.stop()
    daemon.start("--fresh")  # the pool starts empty; the disk keeps its segments
    assert daemon.client().stats().blocks == 0
    assert load_on(daemon, keys) == (BLOCKS, 0)
    assert daemon.client().stats().disk.read_blocks == BLOCKS


def test_a_corrupt_record_on_disk_is_never_loaded(daemon_factory, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    daemon = daemon_factory("--disk-path", str(disk), *DISK).start()
    keys = store_blocks(daemon.socket, NS, 4)
    wait_written(daemon, 4)
    daemon.stop()
    (segment,) = disk.glob("seg-*.kvd")
    with open(segment, "r+b") as f:  # the first record: a 4 KiB header, then its payload
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    daemon.start("--fresh")
    hits, wrong = load_on(daemon, keys)
    stats = daemon.client().stats()
    assert wrong == 0 and hits < 4 and stats.disk.corrupt == 1


def test_an_unsafe_disk_directory_refuses_the_start(daemon_factory, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    daemon = daemon_factory("--disk-path", str(tmp_path / "link"), *DISK)
    out = subprocess.run([sys.executable, "-m", "kvstore_service", "serve", *daemon.args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--disk-path" in out.stderr, out.stderr
    assert not os.path.exists(daemon.socket)


def test_a_cleared_namespace_is_neither_promoted_nor_back_after_a_restart(daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), *DISK).start()
    keys = store_blocks(daemon.socket, NS, BLOCKS)
    other = store_blocks(daemon.socket, "other-ns", 4)
    wait_written(daemon, BLOCKS + 4)
    client = daemon.client()
    assert client.clear(NS) == BLOCKS  # each once: they were in the pool and on disk
    assert load_on(daemon, keys) == (0, 0)  # not promoted back from disk
    stats = client.stats()
    assert stats.disk.read_blocks == 0 and stats.disk.blocks == 4
    store_blocks(daemon.socket, NS, 4)  # the first 4 keys again, after the clear
    wait_written(daemon, BLOCKS + 8)
    daemon.stop()
    daemon.start("--fresh")  # the pool starts empty; the disk keeps its segments and the clear
    client = daemon.client()
    assert client.clear("other-ns") == 4  # blocks only on disk count too
    assert load_on(daemon, keys) == (4, 0)  # those stored after the clear, not the 12 others
    assert client.lookup("other-ns", other) == 0
    daemon.stop()
    daemon.start("--fresh")
    assert load_on(daemon, keys) == (4, 0) and daemon.client().lookup("other-ns", other) == 0


def test_a_tenant_cleared_after_a_restart_loses_its_blocks_on_disk(daemon_factory, tmp_path: Path) -> None:
    import json
    import os

    me = os.getuid()
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), *DISK, "--admin-uids", str(me), "--tenants",
                            json.dumps({"a": {"uids": [me]}, "b": {"uids": [me + 1]}})).start()
    keys = store_blocks(daemon.socket, NS, 8)  # in tenant a
    wait_written(daemon, 8)
    daemon.stop()
    daemon.start("--fresh")  # no namespace in the pool: the disk knows this one's name
    client = daemon.client()
    assert client.clear("", "b") == 0
    assert client.clear("", "a") == 8
    assert load_on(daemon, keys) == (0, 0)
    daemon.stop()
    daemon.start("--fresh")
    assert load_on(daemon, keys) == (0, 0) and daemon.client().stats().disk.blocks == 0


def test_blocks_evicted_before_their_seal_are_counted_as_dropped_writes(daemon_factory, tmp_path: Path) -> None:
    """Stores outrunning the seals in a 2 MiB pool: blocks evicted before their seal never reach the disk,
    and each is counted as a dropped write, so every stored block is written or counted."""
    import threading

    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), *DISK, pool_size="2MiB",
                            segment_size="1MiB").start()
    stored = [0, 0, 0]
    errors: list[BaseException] = []

    def store_for(t: int, seconds: float = 1.5) -> None:
        engine = Engine(daemon.socket, f"ns-{t}", 16, BLOCK_BYTES)
        try:
            deadline, n = time.monotonic() + seconds, 0
            while time.monotonic() < deadline:
                keys = [key_of(f"ns-{t}", n + i) for i in range(16)]
                engine.fill(keys, list(range(16)))
                job = engine.session.store(keys, list(range(16)))
                stored[t] += engine.session.wait([job])[job].blocks_ok
                n += 16
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            engine.close()

    threads = [threading.Thread(target=store_for, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    client = daemon.client()
    deadline = time.monotonic() + 20
    while (stats := client.stats()).unsealed_blocks or stats.disk.queued_bytes:  # seals and writes done
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    disk = stats.disk
    assert disk.healthy and stats.evictions > 0
    assert disk.write_dropped > 0  # (the write queue holds more than the pool: nothing else drops)
    assert disk.written + disk.write_dropped == sum(stored)


HYBRID = [0, 2]  # a Gemma-3-like model's KV cache groups: full attention and a 2-block sliding window


def hybrid_keys(blocks: int) -> list[bytes]:
    """A grouped lookup's keys: block by block, the full-attention group's key, then the window's."""
    return [key_of(f"{NS}/group-{g}", i) for i in range(blocks) for g in range(len(HYBRID))]


@pytest.mark.parametrize("stored", ["every block", "the window's last blocks"])
def test_a_grouped_lookup_promotes_from_disk_exactly_the_blocks_its_hit_needs(daemon_factory, tmp_path: Path,
                                                                              stored: str) -> None:
    """A hybrid model's prompt of 16 blocks on disk, the pool empty after a restart. Its grouped lookup
    hits all 16 blocks and brings in what that hit needs: every full-attention block and the window's
    last 2 blocks, never the window's older ones. (The promotion took the keys as one flat run: it
    brought all 32 blocks where the window had them all, and hit nothing where it had only its last ones,
    vLLM having freed the older ones before they were stored.)"""
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), *DISK).start()
    keys = hybrid_keys(BLOCKS)
    kept = keys if stored == "every block" else [k for n, k in enumerate(keys) if n % 2 == 0 or n >= 2 * BLOCKS - 8]
    engine = Engine(daemon.socket, NS, len(kept), BLOCK_BYTES)
    engine.fill(kept, list(range(len(kept))))
    job = engine.session.store(kept, list(range(len(kept))))
    assert engine.session.wait([job])[job].ok
    engine.close()
    wait_written(daemon, len(kept))
    daemon.stop()
    daemon.start("--fresh")  # the pool starts empty; the disk keeps its segments
    needed = keys[0:2 * BLOCKS:2] + keys[2 * BLOCKS - 3:2 * BLOCKS:2]  # every full block, the window's last 2
    engine = Engine(daemon.socket, NS, len(needed), BLOCK_BYTES)
    try:
        hits, lease = engine.session.lookup(keys, lease=True, group_spans=HYBRID)
        assert hits == BLOCKS
        stats = daemon.client().stats()
        assert stats.blocks == stats.disk.read_blocks == len(needed) == BLOCKS + 2  # nothing else promoted
        job = engine.session.load(needed, list(range(len(needed))))
        assert engine.session.wait([job])[job].ok
        assert engine.verify(needed, list(range(len(needed)))) == 0
        engine.session.release_lease(lease)
    finally:
        engine.close()


PROMPT = 29  # blocks of one prompt
SLOT_BLOCK = 100 * 1024  # 40 of these fill a 4 MiB pool segment


def store_prompt(daemon, name: str) -> list[bytes]:
    """A prompt's 29 blocks stored by an engine that then goes away."""
    engine = Engine(daemon.socket, NS, PROMPT, SLOT_BLOCK)
    try:
        keys = [key_of(name, i) for i in range(PROMPT)]
        engine.fill(keys, list(range(PROMPT)))
        job = engine.session.store(keys, list(range(PROMPT)))
        assert engine.session.wait([job])[job].ok
        return keys
    finally:
        engine.close()


@pytest.mark.parametrize("pool_holds", ["its last blocks", "its last blocks and a middle run"])
def test_a_restarted_daemon_serves_a_whole_prompt_from_its_pool_and_disk(daemon_factory, tmp_path: Path,
                                                                         pool_holds: str) -> None:
    """A pool of 40 blocks, prompts of 29, every block on disk: after a restart the pool holds some of
    a prompt's blocks (recovered) and the disk all of them. The first lookup of that prompt gets all 29:
    the promotion neither evicts the prompt's own blocks from the pool nor stops at one it finds there
    (it used to hit 18 of 29, and 10 with a run in the middle, as a fresh engine's first prompt did)."""
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), *DISK, pool_size="4MiB",
                            segment_size="4MiB").start()
    client = daemon.client()
    first = store_prompt(daemon, "first")
    wait_written(daemon, PROMPT)
    store_prompt(daemon, "second")  # the pool keeps the first prompt's last 11 blocks
    wait_written(daemon, 2 * PROMPT)
    if pool_holds == "its last blocks and a middle run":
        assert client.lookup(NS, first[5:10]) == 5  # promoted, in place of the second prompt's oldest
    assert wait_for(lambda: client.stats().unsealed_blocks == 0)
    daemon.stop()
    daemon.start()  # the pool re-attached: its blocks recovered
    assert wait_for(lambda: client.stats().unverified_blocks == 0)
    assert client.stats().blocks == 40
    assert load_on_blocks(daemon, first) == (PROMPT, 0)


def load_on_blocks(daemon, keys: list[bytes]) -> tuple[int, int]:
    """As load_on, for prompts of SLOT_BLOCK-byte blocks."""
    return lookup_and_load(daemon.socket, NS, keys, SLOT_BLOCK)
