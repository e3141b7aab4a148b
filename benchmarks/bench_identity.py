"""What the model identity costs at an engine's start (kvstore_client/identity.py): every weight file is
read whole once for its SHA-256, then its digest comes from the cache.

    python benchmarks/bench_identity.py [--gib 2] [--files 2] [--runs 3]

Writes `--files` weight files of `--gib` GiB in all (page-cached, as after vLLM loaded them), then,
interleaved for `--runs` runs: the same bytes only read (the limit: 8 MiB reads), the fingerprint
with an empty digest cache, and with the cache filled. Prints GB/s and what a 100 GB model's first
start would take at the digest's rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvstore_client.identity import fingerprint

CHUNK = 8 << 20


def read_all(files: list[Path]) -> None:
    buf = bytearray(CHUNK)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    size = int(args.gib * (1 << 30) / args.files)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "llama"}')
        block = os.urandom(CHUNK)
        files = []
        for i in range(args.files):
            path = model / f"model-{i:05d}.safetensors"
            with open(path, "wb") as f:
                for _ in range(size // CHUNK):
                    f.write(block)
            files.append(path)
        total = sum(f.stat().st_size for f in files)
        cache = Path(tmp) / "digests.json"
        os.environ["KVSTORE_DIGEST_CACHE"] = str(cache)
        read_s, cold_s, warm_s = [], [], []
        for _ in range(args.runs):
            read_s.append(timed(lambda: read_all(files)))
            cache.unlink(missing_ok=True)
            cold_s.append(timed(lambda: fingerprint(model)))
            warm_s.append(timed(lambda: fingerprint(model)))
        gb = total / 1e9
        read, cold, warm = (statistics.median(x) for x in (read_s, cold_s, warm_s))
        print(f"{gb:.2f} GB in {args.files} files, {args.runs} runs (medians)")
        print(f"read only (the limit): {gb / read:.2f} GB/s; first fingerprint: {gb / cold:.2f} GB/s "
              f"({cold / read:.2f}x the read); cached: {warm * 1e3:.1f} ms")
        print(f"a 100 GB model's first start at this rate: {100 / (gb / cold):.0f} s; later starts: "
              f"{warm * 1e3:.1f} ms for these {args.files} files")


if __name__ == "__main__":
    main()
