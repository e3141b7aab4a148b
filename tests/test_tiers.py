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
from support.engine import Engine, store_blocks
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
    engine = Engine(daemon.socket, NS, len(keys), BLOCK_BYTES)
    try:
        hits, lease = engine.session.lookup(keys, lease=True)
        if hits:
            job = engine.session.load(keys[:hits], list(range(hits)))
            assert engine.session.wait([job])[job].ok
        if lease:
            engine.session.release_lease(lease)
        return hits, engine.verify(keys[:hits], list(range(hits)))
    finally:
        engine.close()


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


def test_corrupt_and_truncated_values_are_misses(daemon_factory, server: RedisServer) -> None:
    from kvstore_service.remote import remote_key

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
    remote = node_b.client().stats().remote
    assert remote.corrupt == 1 and store.get(third) is None  # deleted
    node_b.client().clear()
    store.set(third, bytes(value[:24]) + bytes(len(value) - 24))  # a good header, the payload zeroed
    assert load_on(node_b, keys) == (3, 0) and node_b.client().stats().remote.corrupt == 2
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
    for other in ("other-1", "other-2"):  # the pool holds ~28 blocks: these evict the first ones
        store_blocks(daemon.socket, other, BLOCKS)
    wait_written(daemon, 3 * BLOCKS)
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
