"""A page hit through SGLang's HiCache controller: kvstore (zero-copy from SGLang's shared host pool,
and through the staging area) against SGLang's own file backend (HiCacheFile, on /dev/shm: its best
case), and against the copy the hit needs at the copy engine's speed, measured in the same run.

    python benchmarks/bench_sglang.py --sglang-python .sglang-venv/bin/python [--rounds 8] [--tokens 768]

This venv starts a daemon and measures the limit (copy_engine_gbps: the native copy engine's contiguous
copy of the hit's bytes, two threads); benchmarks/sglang_hits.py, in SGLang's venv (.ci/sglang-venv),
times the hits, one round per line, each round between two limits. Prints each hit's time, as a ratio to
the copy it needs (bytes / copy_engine_gbps, the round's limits' mean) and to the file backend's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from kvstore_service.bench_limits import Memcpy
from kvstore_service.harness import DaemonProcess

WORKER = Path(__file__).with_name("sglang_hits.py")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang-python", required=True)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=768)
    p.add_argument("--layout", default="page_first")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as files:
        daemon = DaemonProcess(tmp, "2GiB", "64MiB").start()
        worker = subprocess.Popen([args.sglang_python, str(WORKER), "--socket", daemon.socket, "--file-dir", files,
                                   "--tokens", str(args.tokens), "--layout", args.layout],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert worker.stdin is not None and worker.stdout is not None
        try:
            hit = json.loads(worker.stdout.readline())
            ruler = Memcpy(hit["bytes"])
            rounds, limits = [], []
            for _ in range(args.rounds + 1):  # (the first round warms every path: not counted)
                before = ruler.gbps(1, copy_engine=True)
                worker.stdin.write("\n")
                worker.stdin.flush()
                rounds.append(json.loads(worker.stdout.readline()))
                limits.append((before + ruler.gbps(1, copy_engine=True)) / 2)
            rounds, limits = rounds[1:], limits[1:]
        finally:
            worker.kill()
            daemon.cleanup()
    print(f"hit: {args.tokens} tokens, {hit['pages']} pages, {hit['bytes'] / 2**20:.0f} MiB ({args.layout}); "
          f"{args.rounds} interleaved rounds")
    print(f"copy_engine_gbps: median {statistics.median(limits):.2f} (min {min(limits):.2f}, max {max(limits):.2f})")
    for name in rounds[0]:
        times = [r[name] for r in rounds]
        vs_copy = [t / (hit["bytes"] / (g * 1e9)) for t, g in zip(times, limits, strict=True)]
        vs_file = [r[name] / r["sglang_file"] for r in rounds]
        print(f"{name:18s} hit ms: median {statistics.median(times) * 1e3:7.1f} (min {min(times) * 1e3:6.1f})  "
              f"x the copy: {statistics.median(vs_copy):5.2f}  x sglang_file: {statistics.median(vs_file):5.2f}")


if __name__ == "__main__":
    main()
