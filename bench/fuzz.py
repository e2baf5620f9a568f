"""Fuzz every decoder of outside bytes for a stated number of examples and print a table.

    .venv/bin/python bench/fuzz.py --examples 20000 [--targets patch,wire]

Targets and inputs are tests/fuzzing.py's (patch, manifest, wire frames, local-socket
frames, trajectory segments and batches). Per target: examples run, clean errors (a
PatchswarmError), valid results, crashes (any other exception: must be 0, the first
few are printed), the largest traced peak of one input (tracemalloc: Python and numpy
allocations) and the largest input. Exits 1 if anything crashed or went past
tests/fuzzing.py's MEMORY_BUDGET.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from fuzzing import MEMORY_BUDGET, TARGETS, inputs, run_traced  # noqa: E402


def fuzz(target: str, examples: int, seed: int) -> dict:
    counts = collections.Counter()
    worst = {"peak": 0, "size": 0}
    crashes: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(data=inputs(target))
    def one(data):
        try:
            outcome, peak = run_traced(target, data)
        except Exception as e:  # noqa: BLE001 - what the fuzzer is here to find
            outcome, peak = "crash", 0
            if len(crashes) < 5:
                crashes.append(f"{type(e).__name__}: {str(e)[:160]} (input {data[:60].hex()}..., {len(data)} B)")
        counts[outcome] += 1
        worst["peak"] = max(worst["peak"], peak)
        worst["size"] = max(worst["size"], len(data))

    import random
    random.seed(seed)
    start = time.perf_counter()
    tracemalloc.start()
    try:
        one()
    finally:
        tracemalloc.stop()
    return {"target": target, "examples": sum(counts.values()), "errors": counts["error"], "valid": counts["valid"],
            "crashes": counts["crash"], "peak": worst["peak"], "max_input": worst["size"],
            "seconds": time.perf_counter() - start, "crash_lines": crashes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=20000, help="examples per target")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [fuzz(t, args.examples, args.seed) for t in args.targets.split(",")]
    print(f"{'decoder':<11} {'examples':>8} {'clean errors':>12} {'valid':>6} {'crashes':>7} {'peak MiB':>8} "
          f"{'max input B':>11} {'s':>6}")
    for r in rows:
        print(f"{r['target']:<11} {r['examples']:>8} {r['errors']:>12} {r['valid']:>6} {r['crashes']:>7} "
              f"{r['peak'] / 2**20:>8.2f} {r['max_input']:>11} {r['seconds']:>6.0f}")
    bad = False
    for r in rows:
        for line in r["crash_lines"]:
            print(f"crash in {r['target']}: {line}")
        bad |= r["crashes"] > 0 or r["peak"] > MEMORY_BUDGET
    print(f"memory budget per input: {MEMORY_BUDGET >> 20} MiB traced")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
