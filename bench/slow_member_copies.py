"""How often a slow member of the origin's region relays more than its own share, over many seeds.

Runs the discrete-event swarm of tests/test_picker_swarm.py (one picker per node, wired together,
no sockets) on 3 regions x 4 nodes and 48 chunks, with n0.2's uplink declared slow, once per
seed, and counts the runs in which n0.2 sent more than one copy of its share chunks to each of
its three neighbours: the extra copies went across the WAN, through the uplink it relays its own
share with (bench/RESULTS.md, 2026-12-06).

Run: `python bench/slow_member_copies.py [--seeds N]`. Importing this module does no work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for p in (_ROOT, _ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

UPLINKS = ({"n0.0": 100, "n0.1": 100, "n0.2": 10, "n0.3": 100}, {"n0.2": 2, "n0.0": 100, "n0.1": 100, "n0.3": 100})


def count(seeds: int) -> tuple[int, int, list[tuple[int, float, int, int]]]:
    """(cases, cases with extra copies, (seed, its uplink, copies sent, share) of those)."""
    from test_picker_swarm import Swarm, layout_of

    extra = []
    for seed in range(seeds):
        for uplinks in UPLINKS:
            swarm = Swarm(layout_of(4, 4, 4), "r0", n_chunks=48, uplinks=uplinks, seed=seed).run()
            share = swarm.origin_sent_to.get("n0.2", 0)
            if swarm.sent_by["n0.2"] > 3 * share:
                extra.append((seed, uplinks["n0.2"], swarm.sent_by["n0.2"], share))
    return seeds * len(UPLINKS), len(extra), extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds: expected >= 1, found {args.seeds}")
    cases, n, extra = count(args.seeds)
    print(f"{n} of {cases} cases: the slow member sent more than 3 copies of its share "
          f"(seed, its Mbit/s, copies, share chunks): {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
