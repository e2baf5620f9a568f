"""A full disk on a node and on the origin, N trials per fault: the README's reliability rows.

Runs each scenario of tests/diskfaults.py (real processes on loopback, the
member's data dir on a small tmpfs filled at the step named, then freed) for
`--trials` trials and prints one row per fault: trials, survived (the member
stayed up, said so, and everything completed bit-exact), data lost (versions
not bit-exact plus trajectories missing or duplicated at the origin: must be
0) and leftovers (temporaries left under the data dirs). Needs root (mount).

    sudo nice -n 19 .venv/bin/python bench/disk_full.py --trials 3
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "tests"))  # the scenarios and the harness (tests/diskfaults.py, swarmlab.py)

import diskfaults  # noqa: E402
import smalldisk  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3, help="trials per fault (default 3)")
    ap.add_argument("--only", choices=sorted(diskfaults.SCENARIOS), action="append",
                    help="run only these faults (repeatable)")
    args = ap.parse_args(argv)
    why = smalldisk.available()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    command = "nice -n 19 .venv/bin/python bench/disk_full.py " + " ".join(map(shlex.quote, argv or sys.argv[1:]))
    rows, failed = [], 0
    for name in args.only or list(diskfaults.SCENARIOS):
        fn = diskfaults.SCENARIOS[name]
        survived = lost = left = 0
        fault, t0 = name, time.perf_counter()
        for trial in range(args.trials):
            with tempfile.TemporaryDirectory(prefix=f"disk-full-{name}-") as d:
                try:
                    out = fn(Path(d), trial)
                except Exception as e:  # a check inside the run failed, or the run itself: not survived
                    out = diskfaults.Outcome(name, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                fault = out.fault if out.fault != name else fault
                ok = out.survived and not out.lost and not out.duplicated and not out.leftovers
                survived += ok
                lost += out.lost + out.duplicated
                left += len(out.leftovers)
                failed += not ok
                print(f"  {name} trial {trial}: {'survived' if ok else 'FAILED'}"
                      f"{'' if ok else f' ({out.detail or out})'}", file=sys.stderr)
        rows.append((fault, args.trials, survived, lost, left, time.perf_counter() - t0))
    print(f"\n{time.strftime('%Y-%m-%d', time.gmtime())}, `{command}`\n")
    print("| fault | trials | survived | data lost | leftovers | s per trial |")
    print("|---|---|---|---|---|---|")
    for fault, trials, survived, lost, left, seconds in rows:
        print(f"| {fault} | {trials} | {survived} | {lost} | {left} | {seconds / trials:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
