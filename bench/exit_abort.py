"""Hash a state on several threads, exit at once, many times under load: does any process abort?

    .venv/bin/python bench/exit_abort.py [--runs 60] [--loops 2] [--burners 2] [--threads N]

Why: `protocol/parallel.run_all` starts helper threads that may be scheduled only after the
caller ran every task and returned. A helper that still held the tasks then freed their
tensors while the interpreter finalized; torch releases the GIL in that free, and a thread
taking it back during finalization is ended by `pthread_exit`, whose unwinding through
torch's C++ frames aborts the process ("terminate called without an active exception",
exit -6). CI met it in tests/engines/sparse_follower.py after its work was done.

Each run is a fresh `python` that builds the small synthetic model (tests/synthetic.py) in
bf16, runs one forward pass, prints its `state_hash` (threads: as many as the cores are
worth, or `--threads`) and exits. `--loops` loops run side by side, `--runs` runs each,
beside `--burners` busy-looping processes that keep the cores contended (the scheduler then
starts helpers late, as under a test suite's load). Prints the runs, how many ended other
than 0, and the tail of each such run's output. Exits 1 if any did.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
sys.path.insert(0, {tests!r})
import torch
from synthetic import ModelSpec, TinyLM
from patchswarm.protocol.statehash import state_hash
torch.set_num_threads(1)
model = TinyLM(ModelSpec.of_size("small")).to(torch.bfloat16)
with torch.no_grad():
    model(torch.zeros(1, 4, dtype=torch.long))
print(state_hash(dict(model.state_dict()), threads={threads}))
"""


def one_loop(runs: int, code: str) -> list[tuple[int, str]]:
    """The (exit code, output tail) of each run that did not exit 0."""
    bad = []
    for _ in range(runs):
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            bad.append((p.returncode, (p.stdout + p.stderr)[-400:]))
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=60, help="runs per loop")
    ap.add_argument("--loops", type=int, default=2, help="loops side by side")
    ap.add_argument("--burners", type=int, default=2, help="busy-looping processes beside them")
    ap.add_argument("--threads", type=int, default=None, help="state_hash's threads (default: its own choice)")
    args = ap.parse_args()
    code = CHILD.format(tests=str(ROOT / "tests"), threads=args.threads)
    burn = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(args.loops) as pool:
            bad = [b for loop in pool.map(lambda _: one_loop(args.runs, code), range(args.loops)) for b in loop]
    finally:
        for p in burn:
            p.kill()
            p.wait()
    total = args.runs * args.loops
    print(f"{total} runs ({args.loops} loops of {args.runs}, {args.burners} burners, "
          f"threads {args.threads or 'auto'}) in {time.monotonic() - t0:.0f} s: {len(bad)} ended other than 0")
    for code_, tail in bad:
        print(f"--- exit {code_}\n{tail.rstrip()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
