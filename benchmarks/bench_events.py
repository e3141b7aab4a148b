"""Routers' KV events (docs/vllm.md, "Routers"): what the daemon sustains and what the connector adds per step.

    python benchmarks/bench_events.py [--blocks 10000] [--rounds 3]

1. Daemon: a real daemon; engine A describes and stores `--blocks` blocks of 16 KiB in jobs of 64, while
   engine B watches the namespace's stream: blocks announced per second from A's first store to B's last
   event, against A's stores alone (no description, no watcher) in the same round. Then an engine attaches
   afresh: the reset's replay of every block, per second. Rounds alternate between a daemon that journals
   the descriptions (the default, event_journal.py) and one that does not (--event-journal off).
2. Fan-out, in process: a change of 64 described blocks sent to N caught-up streams of a namespace as
   WatchBlocks sends it (the message made, then serialized per stream as gRPC does): the batch encoded
   once for all streams (servicer.block_events) against once per stream (as before 2026-12-07).
3. Connector: per engine step, `take_events` with nothing new (most steps) and with 16 blocks announced
   (decoded into vLLM's BlockStored), and the scheduler's cost to queue a 16-block description (the
   encoding runs on the session's background thread, off the step). Medians of 2000 steps.

Prints a table; `--json FILE` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.engine import Engine  # noqa: E402

from kvstore_service.harness import DaemonProcess  # noqa: E402

BLOCK = 16 * 1024
JOB = 64
ENGINE_BLOCKS = 256


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:012d}".encode().ljust(32, b".") for i in range(n)]


def store_all(engine: Engine, keys: list[bytes], describe: bool) -> None:
    """Store `keys` in jobs of JOB; with `describe`, each job's blocks described first on the session's
    background thread, as the connector does (a 128-token block's description is ~600 bytes)."""
    jobs = []
    for i in range(0, len(keys), JOB):
        chunk = keys[i:i + JOB]
        if describe:
            engine.session.run_in_background(engine.session.describe_blocks, chunk, [b"x" * 600] * len(chunk))
        jobs.append(engine.session.store(chunk, [j % ENGINE_BLOCKS for j in range(len(chunk))]))
        if len(jobs) >= 8:
            engine.session.wait(jobs)
            jobs = []
    engine.session.wait(jobs)


def daemon_round(socket: str, blocks: int, n: int) -> dict[str, float]:
    plain = Engine(socket, f"plain-{n}", ENGINE_BLOCKS, BLOCK)
    t = time.perf_counter()
    store_all(plain, keys_of(f"p{n}", blocks), describe=False)
    plain_s = time.perf_counter() - t
    plain.close()
    a, b = Engine(socket, f"ev-{n}", ENGINE_BLOCKS, BLOCK), Engine(socket, f"ev-{n}", ENGINE_BLOCKS, BLOCK)
    seen = [0]
    done = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        for _, events in b.session.watch_blocks(stop):
            seen[0] += len(events)
            if seen[0] >= blocks:
                done.set()

    threading.Thread(target=watch, daemon=True).start()
    time.sleep(0.2)  # the reset (empty) is in
    t = time.perf_counter()
    store_all(a, keys_of(f"e{n}", blocks), describe=True)
    done.wait(120)
    live_s = time.perf_counter() - t
    stop.set()
    c = Engine(socket, f"ev-{n}", ENGINE_BLOCKS, BLOCK)
    replayed = [0]
    t = time.perf_counter()
    for _, events in c.session.watch_blocks(threading.Event()):
        replayed[0] += len(events)
        if replayed[0] >= blocks:
            break
    replay_s = time.perf_counter() - t
    for e in (a, b, c):
        e.close()
    return {"announced_per_s": blocks / live_s, "stores_alone_blocks_per_s": blocks / plain_s,
            "ratio": plain_s / live_s, "replay_per_s": blocks / replay_s}


def connector_steps(steps: int = 2000) -> dict[str, float]:
    import msgspec

    from kvstore_client.vllm.events import Announcer

    class Quiet:  # a session that never connects: the announcer's thread idles
        connected = False

    announcer = Announcer(Quiet(), 128, None)  # type: ignore[arg-type]
    description = msgspec.msgpack.encode((b"p" * 32, list(range(128)), None, None, None))
    empty, full = [], []
    for i in range(steps):
        t = time.perf_counter_ns()
        announcer.take()
        empty.append(time.perf_counter_ns() - t)
        announcer._translate(False, [(False, f"{i:08d}".encode().ljust(32, b"k") + bytes([j]), description, False)
                                     for j in range(16)])
        t = time.perf_counter_ns()
        announcer.take()
        full.append(time.perf_counter_ns() - t)
    announcer.close()
    return {"take_empty_us": statistics.median(empty) / 1000, "take_16_us": statistics.median(full) / 1000,
            "translate_note": "decoding runs on the announcer's thread, not in the step"}


def fanout(streams: int, shared: bool, changes: int = 40, per: int = 64) -> float:
    """ms of the event loop to send one change of `per` blocks to `streams` caught-up streams."""
    import asyncio
    import os

    from kvstore_service.events import Batch, BlockEvents
    from kvstore_service.index import BlockIndex
    from kvstore_service.pool import Pool
    from kvstore_service.servicer import block_events

    async def run(pool: Pool) -> float:
        index = BlockIndex(pool)
        events = index.events = BlockEvents(max_bytes=256 << 20, max_description_bytes=512, max_queue=1 << 16,
                                            is_committed=index.is_committed)
        ns = index.namespace("ns", 1024)
        watches = [events.watch(ns.ns_hash, 1000, lambda: False) for _ in range(streams)]
        for watch in watches:
            await anext(watch)  # the reset
        spent = 0.0
        for _ in range(changes):
            keys = [os.urandom(32) for _ in range(per)]
            events.describe(ns.ns_hash, keys, [os.urandom(120) for _ in keys])
            index.complete_store(index.prepare_store(ns, keys).blocks, ok=True)
            t = time.perf_counter()
            for watch in watches:
                batch = await anext(watch)
                block_events(batch if shared else Batch(batch.reset, batch.events)).SerializeToString()
            spent += time.perf_counter() - t
        return spent / changes * 1e3

    with tempfile.TemporaryDirectory() as tmp:
        pool = Pool(f"{tmp}/pool", 256 << 20, 4 << 20, fresh=True)
        try:
            return asyncio.run(run(pool))
        finally:
            pool.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    report: dict[str, Any] = {"rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        daemons = {"journal": DaemonProcess(f"{tmp}/j", "1GiB"), "no journal": DaemonProcess(f"{tmp}/n", "1GiB")}
        try:
            daemons["journal"].start()
            daemons["no journal"].start("--event-journal", "off")
            for n in range(args.rounds):
                for name, daemon in daemons.items():
                    report["rounds"].append({"daemon": name, **daemon_round(daemon.socket, args.blocks, n)})
        finally:
            for daemon in daemons.values():
                daemon.stop()
    report["fanout"] = [{"streams": n, "per_stream_ms": fanout(n, False), "shared_ms": fanout(n, True)}
                        for n in (1, 16, 64) for _ in range(3)]
    report["connector"] = connector_steps()
    rounds = report["rounds"]
    print(f"{'daemon':>10} {'announced/s':>12} {'stores alone/s':>15} {'ratio':>6} {'replay/s':>10}")
    for r in rounds:
        print(f"{r['daemon']:>10} {r['announced_per_s']:>12.0f} {r['stores_alone_blocks_per_s']:>15.0f} "
              f"{r['ratio']:>6.2f} {r['replay_per_s']:>10.0f}")
    for name in ("journal", "no journal"):
        mine = [r for r in rounds if r["daemon"] == name]
        print(f"{name}: median announced/s {statistics.median(r['announced_per_s'] for r in mine):.0f}, "
              f"ratio {statistics.median(r['ratio'] for r in mine):.2f} of the stores alone")
    for f in report["fanout"]:
        print(f"fan-out to {f['streams']:>2} streams: a 64-block change {f['per_stream_ms']:.2f} ms encoded per "
              f"stream, {f['shared_ms']:.2f} ms shared ({f['per_stream_ms'] / f['shared_ms']:.1f}x)")
    c = report["connector"]
    print(f"connector per step: take_events {c['take_empty_us']:.2f} us with nothing new, "
          f"{c['take_16_us']:.2f} us with 16 blocks (target p50 <= 50 us)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
