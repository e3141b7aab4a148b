"""Where a copy job's time goes: the daemon's timeline of each job (its DEBUG log: when the job was
ordered after the engine, when each chunk's copy started and ended, when it was published) beside
what the client saw (submit to completion; its submit -> the job's arrival and the publish -> its
wake-up, on the monotonic clock both processes share) and the limit measured right before it (as
`kvstore bench`: the copy engine's contiguous copy on cpu, one pinned host -> device copy on a device).

Jobs: 2048 x 256 KiB stores and loads (`--blocks`, `--block-kib`), a 2048-token hit and a 16-block
hit of a vLLM-sized layout (32 layers, K and V regions of 32 KiB per block).

Each job's CPU in the daemon too (/proc schedstat): its event loop's and its other threads' (the copy
threads, mostly). On a machine of few cores the copies and the loop share them: what the loop spends
is taken from the copies (a loop at 8-15 ms a store, when a cycle kept jobs alive and it faulted in
fresh pages, against 2-3 ms: `cpu-probes-s31-2026-12-02.log`).

    python benchmarks/bench_timeline.py --backend cuda --rounds 5
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from functools import partial

from kvstore_client import KVStoreClient
from kvstore_service.bench import Run, SmallLoad, private_daemon, run_job, wait_sealed


def timelines(log: str, seen: int) -> tuple[list[str], int]:
    """The job timelines the daemon logged after the first `seen` of them."""
    deadline = time.monotonic() + 2
    while True:
        with open(log) as f:
            lines = [line.split("kvstore_service.jobs: ", 1)[-1].strip() for line in f if " job " in line
                     and "ms after submit" in line]
        if len(lines) > seen or time.monotonic() > deadline:
            return lines[seen:], len(lines)
        time.sleep(0.01)


def daemon_pid(socket: str) -> int:
    """The daemon serving this socket (its command line names it)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if socket.encode() in f.read():
                    return int(entry)
        except (OSError, ValueError):
            continue
    raise RuntimeError(f"no process serves {socket}")


def thread_cpu(pid: int) -> dict[int, int]:
    """Nanoseconds on a CPU so far, per thread of the process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except OSError:  # (a thread that just ended)
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--copy-threads", type=int, default=2)
    args = parser.parse_args()
    block_bytes = args.block_kib << 10
    with private_daemon(6 << 30, args.copy_threads, log_level="DEBUG") as socket:
        log, seen = os.path.join(os.path.dirname(socket), "daemon.log"), 0
        pid = daemon_pid(socket)
        client = KVStoreClient(socket)
        run = Run(client, args.backend, args.blocks, block_bytes)

        def show(what: str, limit_gbps: float, job: Callable[[], float], nbytes: int) -> None:
            """Run the job (it returns its seconds), then print its timeline beside the client's."""
            nonlocal seen
            before = thread_cpu(pid)
            submitted = time.monotonic()
            took = job()
            woke = time.monotonic()
            after = thread_cpu(pid)
            used = {tid: (after[tid] - before.get(tid, 0)) / 1e6 for tid in after}
            loop = used.pop(pid, 0.0)
            lines, seen = timelines(log, seen)
            print(f"{what}: client {took * 1e3:.2f} ms, limit {nbytes / limit_gbps / 1e6:.2f} ms "
                  f"({nbytes / took / 1e9 / limit_gbps:.2f} of it); daemon CPU: loop {loop:.2f} ms, other threads "
                  f"{sum(used.values()):.2f} ms")
            for line in lines:
                print("   ", line)
                found = re.search(r"published ([\d.]+);.* submitted at ([\d.]+)", line)
                if found:
                    published, arrived = float(found[1]), float(found[2])
                    print(f"    client: submit -> arrival {(arrived - submitted) * 1e3:.2f} ms, published -> woke "
                          f"{(woke - arrived) * 1e3 - published:.2f} ms")

        def seconds(job: Callable[[list[bytes], list[int]], float], keys: list[bytes], ids: list[int]) -> float:
            return run.total / job(keys, ids) / 1e9  # (Run's jobs return GB/s)

        warm = run.job()
        run.store(*warm)
        run.load(*warm)
        _, seen = timelines(log, seen)
        for _ in range(args.rounds):  # as `kvstore bench`: into slots used before (fresh pool pages would fault)
            keys, ids = run.job()
            wait_sealed(client)
            client.clear(run.session.namespace)
            limit = run.limit_gbps()
            show("store", limit, partial(seconds, run.store, keys, ids), run.total)
            wait_sealed(client)
            limit = run.limit_gbps()
            show("load", limit, partial(seconds, run.load, keys, run.ids()), run.total)
        for name, blocks in (("hit of 2048 tokens", 128), ("hit of 256 tokens", 16)):
            hit = SmallLoad(client, args.backend, blocks, 32, 32 << 10)
            run_job(hit.session, partial(hit.session.load, hit.keys, hit.rng.sample(range(hit.cache_blocks), blocks)))
            _, seen = timelines(log, seen)  # (its store and a first load)
            try:
                for _ in range(args.rounds):
                    ids = hit.rng.sample(range(hit.cache_blocks), hit.blocks)
                    copy = hit.copy_seconds(ids)
                    show(name, hit.total / copy / 1e9, partial(run_job, hit.session,
                                                               partial(hit.session.load, hit.keys, ids)), hit.total)
            finally:
                hit.close()
        run.close()
        client.close()


if __name__ == "__main__":
    main()
