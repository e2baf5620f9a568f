"""Was a patchswarm node ever left with nothing asked? Read from the daemons' debug logs of a WAN bench run.

A node that goes without a chunk arriving ("max stall s" in `bench/wan.py`)
is either waiting on requests in flight (links or CPU slow) or has asked
nobody while it lacks chunks: the stall issue 26 is about (a live holder
not asked). This reads the fetcher's debug lines of each `n*.log` under a
`bench/wan.py -v --logs DIR` run's folder (`request chunk C of v1 patch from
P`, `chunk C of v1 patch from P ...`) and prints per node, from its
announcement of the version until it holds every chunk: the longest time
with no chunk requested and not yet arrived, and the longest gap between
arrivals (the "stall"). Approximate by construction: a request cancelled
(its peer died) is counted as in flight until the chunk arrives from
anyone, so the first figure is a lower bound, and a node re-asking at once
(as it should) shows 0.

Run: `python bench/wan_asked.py LOGS/'patchswarm kill@1s,restart@3s-3x4-1' [--version 1]` (a folder per
run: -1, -2, ...; `bench/wan.py` prints each run's).
Reads files only; importing this module does no work.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path


def read_log(lines, version: int = 1) -> tuple[int, int | None, float, float]:
    """(chunks held, chunks of the patch, longest with nothing asked, longest gap between arrivals)."""
    announced = re.compile(rf"version {version} announced: patch, (\d+) chunks")
    asked_re = re.compile(rf"DEBUG request chunk (\d+) of v{version} patch ")
    got_re = re.compile(rf"DEBUG chunk (\d+) of v{version} patch from ")
    n = None
    asked: set[int] = set()
    have: set[int] = set()
    idle_from = last = 0.0
    unasked = gap = 0.0
    for line in lines:
        if n is None:
            m = announced.search(line)
            if m:
                n, idle_from = int(m.group(1)), _time(line)
                last = idle_from
            continue
        if len(have) == n:
            break
        if m := asked_re.search(line):
            if not asked - have:
                unasked = max(unasked, _time(line) - idle_from)
            asked.add(int(m.group(1)))
        elif m := got_re.search(line):
            t = _time(line)
            have.add(int(m.group(1)))
            gap, last = max(gap, t - last), t
            if not asked - have:
                idle_from = t
    return len(have), n, unasked, gap


def _time(line: str) -> float:
    return datetime.datetime.fromisoformat(line.split(" ", 1)[0]).timestamp()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--version", type=int, default=1)
    a = ap.parse_args(argv)
    logs = sorted(a.folder.glob("n*.log"))
    if not logs:
        print(f"{a.folder}: expected node logs n*.log, found none", file=sys.stderr)
        return 2
    print(f"{'node':>18}  {'chunks':>7}  {'longest nothing asked s':>23}  {'longest gap s':>13}")
    for f in logs:
        with open(f, errors="replace") as lines:
            held, n, unasked, gap = read_log(lines, a.version)
        if n is None:
            continue
        print(f"{f.stem:>18}  {f'{held}/{n}':>7}  {unasked:>23.3f}  {gap:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
