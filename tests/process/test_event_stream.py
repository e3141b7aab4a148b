"""Routers' events through the real daemon: engines of a namespace watch the blocks one of them stored, in
the pool and on disk, and a restarted daemon announces what it recovered (tests/unit/test_events.py has
the rules in process)."""

from __future__ import annotations

import signal
import threading

from support.blocks import key_of
from support.daemon import wait_for
from support.engine import Engine


def test_engines_of_a_namespace_watch_the_blocks_one_of_them_stored(daemon) -> None:
    """Through the real daemon: A describes and stores; B, attached later, gets them in its reset; a clear
    removes them; B's stream ends with its session."""

    a = Engine(daemon.socket, "events-ns", 16, 64 * 1024)
    keys = [key_of("e", i) for i in range(6)]
    a.session.describe_blocks(keys, [b"desc-%d" % i for i in range(6)])
    a.fill(keys, list(range(6)))
    job = a.session.store(keys, list(range(6)))
    assert a.session.wait([job])[job].ok
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


def watched(socket: str, until) -> dict[tuple[bytes, bool], bytes]:
    """What a new engine's stream announces, (key, on disk) -> description, once `until(it)` holds (10 s)."""
    engine = Engine(socket, "tiers-ns", 16, 64 * 1024)
    held: dict[tuple[bytes, bool], bytes] = {}
    stop = threading.Event()

    def watch() -> None:
        for reset, events in engine.session.watch_blocks(stop):
            if reset:
                held.clear()
            for removed, key, description, on_disk in events:
                if removed:
                    held.pop((key, on_disk), None)
                else:
                    held[(key, on_disk)] = description

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    wait_for(lambda: until(held), timeout=10)
    stop.set()
    engine.close()  # (ends the stream)
    thread.join(5)
    return dict(held)


def test_disk_blocks_are_announced_and_a_killed_daemons_blocks_come_back_announced(daemon_factory, tmp_path) -> None:
    """A with the disk tier: a described block is announced in the pool and, once written behind, on disk.
    After a SIGKILL the next daemon announces the recovered blocks (pool, once verified; disk) to an engine
    that only watches: nobody stores them again."""
    daemon = daemon_factory("--disk-path", str(tmp_path / "disk"), "--disk-size", "32MiB",
                            "--disk-segment-size", "4MiB").start()
    a = Engine(daemon.socket, "tiers-ns", 16, 64 * 1024)
    keys = [key_of("t", i) for i in range(6)]
    descriptions = [b"desc-%d" % i for i in range(6)]
    a.session.describe_blocks(keys, descriptions)
    a.fill(keys, list(range(6)))
    job = a.session.store(keys, list(range(6)))
    assert a.session.wait([job])[job].ok
    both = {(k, disk): d for k, d in zip(keys, descriptions, strict=True) for disk in (False, True)}
    assert watched(daemon.socket, lambda held: held == both) == both

    daemon.stop(signal.SIGKILL)
    daemon.start()
    assert watched(daemon.socket, lambda held: held == both) == both
    assert daemon.client().clear("tiers-ns") == 6  # the pool's and the disk's copies: both announced removed
    assert watched(daemon.socket, lambda held: not held) == {}
