"""Fuzzing of every RPC of the daemon with hypothesis: malformed and adversarial requests.

    python benchmarks/fuzz.py [--cases 100000] [--seed N] [--json F]

The long version of tests/process/test_fuzz.py: the same strategies, oracles and target (tests/support/fuzz.py,
which describes the cases and the properties checked), run for `--cases` random cases against one
real daemon process (restarted if it dies). Prints the cases run, a status histogram per RPC, daemon
crashes (must be 0), property violations (each kind once, with an example) and the final check.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # for `support`, shared with the tests

from support.daemon import DaemonProcess  # noqa: E402
from support.fuzz import Case, Target, any_case, final_check, run_case  # noqa: E402

# -- the long run -----------------------------------------------------------------------------------


@dataclass
class Run:
    cases: int = 0
    crashes: int = 0
    violations: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)


def fuzz(t: Target, run: Run, cases: int, seed: int | None, restart: Callable[[], None]) -> None:
    """Run `cases` random cases in batches; a violation is counted (first example kept), not raised."""
    batch = 1000

    def one(case: Case) -> None:
        problems = run_case(t, case)
        run.cases += 1
        for p in problems:
            what, _, reason = p.partition(" | ")
            kind = f"{'raw ' if case.raw is not None else ''}{case.method}: {reason.split(':')[0][:80]}"
            run.violations[kind] += 1
            run.examples.setdefault(kind, p[:600])
        if not t.alive():
            run.crashes += 1
            restart()

    while run.cases < cases:
        n = min(batch, cases - run.cases)
        test = settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                        suppress_health_check=list(HealthCheck))(given(any_case)(one))
        if seed is not None:
            test = _seeded(test, seed + run.cases)
        before = run.cases
        test()
        if run.cases == before:  # hypothesis found nothing new to try
            break
        print(f"{run.cases} cases, {sum(run.violations.values())} violations, {run.crashes} crashes", flush=True)


def _seeded(test: Callable[[], None], seed: int) -> Callable[[], None]:
    from hypothesis import seed as hseed

    return hseed(seed)(test)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="kvstore-fuzz-")
    daemon = DaemonProcess(workdir, "64MiB", "1MiB").start()
    t = Target(daemon.socket, daemon.pool_path, daemon.alive, workdir)
    run = Run()
    started = time.monotonic()

    def restart() -> None:
        print(f"daemon died:\n{daemon.log_tail(20)}", flush=True)
        daemon.kill()
        daemon.start()

    try:
        fuzz(t, run, a.cases, a.seed, restart)
        final = final_check(t)
    finally:
        t.close()
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.monotonic() - started
    print(f"\ncases run: {run.cases} in {seconds:.0f}s ({run.cases / seconds:.0f}/s)")
    print("statuses:")
    for (method, code), n in sorted(t.statuses.items()):
        print(f"  {method:<18} {code:<20} {n}")
    print(f"crashes: {run.crashes} ({'ok' if run.crashes == 0 else 'FAIL'})")
    print(f"property violations: {sum(run.violations.values())}")
    for kind, n in run.violations.most_common():
        print(f"  {n:>6} x {kind}\n           e.g. {run.examples[kind][:300]}")
    print(f"final check: {'ok' if not final else final}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "cases": run.cases, "seconds": round(seconds, 1), "crashes": run.crashes,
            "statuses": {f"{m} {c}": n for (m, c), n in sorted(t.statuses.items())},
            "violations": dict(run.violations), "examples": run.examples, "final_check": final}, indent=2))
    sys.exit(0 if run.crashes == 0 and not run.violations and not final else 1)


if __name__ == "__main__":
    main()
