"""Routers' events through the real daemon: engines of a namespace watch the blocks one of them stored, in
the pool and on disk, and a restarted daemon announces what it recovered (tests/unit/test_events.py has
the rules in process)."""

from __future__ import annotations

import mmap
import signal
import threading

from support.blocks import key_of
from support.daemon import sealed_blocks, wait_for
from support.engine import Engine


def store_described(socket: str, namespace: str, keys: list, descriptions: list) -> Engine:
    """An engine that described and stored these blocks (ids 0..n-1), as the connector does."""
    engine = Engine(socket, namespace, 16, 64 * 1024)
    engine.session.describe_blocks(keys, descriptions)
    engine.fill(keys, list(range(len(keys))))
    job = engine.session.store(keys, list(range(len(keys))))
    assert engine.session.wait([job])[job].ok
    return engine


def test_engines_of_a_namespace_watch_the_blocks_one_of_them_stored(daemon) -> None:
    """Through the real daemon: A describes and stores; B, attached later, gets them in its reset; a clear
    removes them; B's stream ends with its session."""

    keys = [key_of("e", i) for i in range(6)]
    a = store_described(daemon.socket, "events-ns", keys, [b"desc-%d" % i for i in range(6)])
    b = Engine(daemon.socket, "events-ns", 16, 64 * 1024)
    got: list = []
    stop = threading.Event()

    def watch() -> None:
        for reset, events in b.session.watch_blocks(stop):
            got.append((reset, events))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert wait_for(lambda: sum(len(e) for _, e in got) >= 6, timeout=10)
    assert got[0][0] and [event for _, e in got for event in e] == [
        (False, k, b"desc-%d" % i, False) for i, k in enumerate(keys)]
    assert daemon.client().clear("events-ns") == 6
    assert wait_for(lambda: sum(len(e) for _, e in got) >= 12, timeout=10)
    assert sorted(k for _, e in got for removed, k, _, _ in e if removed) == sorted(keys)
    stats = daemon.client().stats()
    assert stats.events.sent >= 12 and stats.events.bytes == 0
    stop.set()
    b.close()  # the session ends: so does its stream
    thread.join(timeout=10)
    assert not thread.is_alive()
    a.close()


def test_watch_streams_are_bounded_per_session_and_per_uid(daemon_factory) -> None:
    import grpc
    import pytest

    from kvstore_client.protocol import kvstore_pb2 as pb

    daemon = daemon_factory("--max-watches-per-session", "2", "--max-watches-per-uid", "3").start()
    a = Engine(daemon.socket, "watch-ns", 4, 4096)
    b = Engine(daemon.socket, "watch-ns", 4, 4096)
    stub = daemon.client().stub

    def watch(engine: Engine) -> grpc.Call:
        call = stub.WatchBlocks(pb.WatchBlocksRequest(session_id=engine.session.session_id))
        next(call)  # (the reset: open)
        return call

    def refused(engine: Engine, words: str) -> None:
        with pytest.raises(grpc.RpcError) as info:
            watch(engine)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and words in info.value.details()

    streams = [watch(a), watch(a)]
    refused(a, "(--max-watches-per-session 2)")
    streams.append(watch(b))
    refused(b, "(--max-watches-per-uid 3)")
    streams.pop(0).cancel()  # one closes: its place is free
    assert wait_for(lambda: _opens(watch, b, streams), timeout=10)
    assert b.session.lookup([key_of("w", 0)])[0] == 0  # the daemon serves on
    for call in streams:
        call.cancel()
    a.close()
    b.close()


def _opens(watch, engine: Engine, streams: list) -> bool:
    import grpc

    try:
        streams.append(watch(engine))
    except grpc.RpcError:
        return False
    return True


class Watcher:
    """A new engine's stream of the namespace: `held`, (key, on disk) -> description, as it announces them
    (stored, removed, reset) until `close`."""

    def __init__(self, socket: str, namespace: str = "tiers-ns") -> None:
        self.engine = Engine(socket, namespace, 16, 64 * 1024)
        self.held: dict[tuple[bytes, bool], bytes] = {}
        self.removed: list[tuple[bytes, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        for reset, events in self.engine.session.watch_blocks(self._stop):
            if reset:
                self.held.clear()
            for removed, key, description, on_disk in events:
                if removed:
                    self.held.pop((key, on_disk), None)
                    self.removed.append((key, on_disk))
                else:
                    self.held[(key, on_disk)] = description

    def wait(self, until) -> dict[tuple[bytes, bool], bytes]:
        wait_for(lambda: until(self.held), timeout=10)
        return dict(self.held)

    def close(self) -> None:
        self._stop.set()
        self.engine.close()  # (ends the stream)
        self._thread.join(5)


def watched(socket: str, until) -> dict[tuple[bytes, bool], bytes]:
    """What a new engine's stream announces once `until(it)` holds (10 s)."""
    watcher = Watcher(socket)
    try:
        return watcher.wait(until)
    finally:
        watcher.close()


def test_disk_blocks_are_announced_and_a_killed_daemons_blocks_come_back_announced(daemon_factory, tmp_path) -> None:
    """A with the disk tier: a described block is announced in the pool and, once written behind, on disk.
    After a SIGKILL the next daemon announces the recovered blocks (pool, once verified; disk) to an engine
    that only watches: nobody stores them again."""
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), "--disk-size", "32MiB",
                            "--disk-segment-size", "4MiB").start()
    keys = [key_of("t", i) for i in range(6)]
    descriptions = [b"desc-%d" % i for i in range(6)]
    store_described(daemon.socket, "tiers-ns", keys, descriptions)
    both = {(k, disk): d for k, d in zip(keys, descriptions, strict=True) for disk in (False, True)}
    assert watched(daemon.socket, lambda held: held == both) == both

    daemon.stop(signal.SIGKILL)
    daemon.start()
    assert watched(daemon.socket, lambda held: held == both) == both
    assert daemon.client().clear("tiers-ns") == 6  # the pool's and the disk's copies: both announced removed
    assert watched(daemon.socket, lambda held: not held) == {}


def test_evicted_and_corrupt_blocks_are_announced_removed(daemon_factory) -> None:
    """A block that fails its checksum at a load is dropped and announced removed at once; blocks the pool
    evicts for another namespace's stores are announced removed, the engine's stream told each."""
    daemon = daemon_factory("--verify-loads", "1", pool_size="8MiB", segment_size="4MiB").start()
    keys = [key_of("v", i) for i in range(8)]
    a = store_described(daemon.socket, "tiers-ns", keys, [b"d%d" % i for i in range(8)])
    watcher = Watcher(daemon.socket)
    try:
        assert len(watcher.wait(lambda held: len(held) == 8)) == 8
        assert wait_for(lambda: len(list(sealed_blocks(daemon.pool_path))) == 8, timeout=10)
        offset = next(off for header, off in sealed_blocks(daemon.pool_path) if header.key == keys[2])
        with open(daemon.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
            data[offset + 100] ^= 0xFF
        job = a.session.load(keys, list(range(8, 16)))
        assert a.session.wait([job])[job].blocks_failed == 1
        assert set(watcher.wait(lambda held: len(held) == 7)) == {(k, False) for k in keys if k != keys[2]}
        assert watcher.removed == [(keys[2], False)]

        other = Engine(daemon.socket, "other-ns", 64, 64 * 1024)
        for round_ in range(3):  # 192 blocks: more than the pool's two segments hold
            more = [key_of(f"o{round_}", i) for i in range(64)]
            other.fill(more, list(range(64)))
            job = other.session.store(more, list(range(64)))
            assert other.session.wait([job])[job].ok
        assert watcher.wait(lambda held: not held) == {}
        assert sorted(watcher.removed) == sorted((k, False) for k in keys)
        assert daemon.client().stats().evictions >= 7
    finally:
        watcher.close()
