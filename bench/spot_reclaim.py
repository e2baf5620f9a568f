"""Spot hosts reclaimed: how many acknowledged trajectories go with a node's disk.

    .venv/bin/python bench/spot_reclaim.py [--reclaims 6] [--drain-s 0,20] [--origin-pause 0.5] [--rounds 1]

A submit is acknowledged once the record is durable in the node's spool; the node
uploads it to the origin right after. A spot instance reclaimed gets a SIGTERM and
then its host, disk included, is gone. Per mode (each `--drain-s` value given to the
nodes; with several rounds the modes alternate): a tracker, an origin and two nodes,
one rollout worker per node (tests/swarmlab.py `Submitter`: batches of 1-7 records of
16-3000 B, as fast as the node acknowledges them). Each reclaim: the origin is paused
for `--origin-pause` s (SIGSTOP: a busy store or a slow link, so the spool holds what
the worker submits meanwhile; 0: no pause), one node gets SIGTERM, the origin goes on
(SIGCONT), the node's exit is awaited (at most 60 s), its data dir is deleted and a
fresh node of the same name starts in its place; its worker goes on against it. At the
end the workers stop, the spools drain and the origin's store is compared with what
the workers had acknowledged. Columns: acknowledged records, those the origin never got
(lost with a reclaimed disk), stored twice, and SIGTERM to exit per reclaim.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from swarmlab import Submitter, SwarmLab, dump, exactly_once, wait_spools_empty  # noqa: E402

STOP_WAIT_S = 60.0


def one_run(root: Path, drain_s: float, reclaims: int, pause: float, seed: int) -> dict:
    rng = random.Random(seed)
    stops: list[float] = []
    with SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin()
        nodes = [lab.start_node(f"n{i}", extra=["--drain-s", f"{drain_s:g}"]) for i in range(2)]
        stop = threading.Event()
        workers = [Submitter(p, stop, random.Random(seed * 10 + i)) for i, p in enumerate(nodes)]
        for w in workers:
            w.start()
        for _ in range(reclaims):
            time.sleep(rng.uniform(0.5, 1.5))
            node = rng.choice(nodes)
            if pause:
                origin.popen.send_signal(signal.SIGSTOP)
                time.sleep(pause)
            t0 = time.monotonic()
            node.popen.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            origin.popen.send_signal(signal.SIGCONT)
            try:
                node.popen.wait(timeout=STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - the host goes anyway: as a cloud would, after the notice
                node.popen.kill()
                node.popen.wait(timeout=10)
            stops.append(time.monotonic() - t0)
            shutil.rmtree(node.data_dir)  # the host and its disk are gone
            lab.restart(node)  # a new host in its place, the same identity
        time.sleep(1.0)
        stop.set()
        for w in workers:
            w.join(timeout=30)
        wait_spools_empty(lab, nodes)
        counts = exactly_once(dump(origin), workers)
    return {"acked": sum(len(w.acked) for w in workers), "lost": counts["acked_missing"],
            "twice": counts["stored_twice"], "stray": counts["stray"], "stops": stops}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reclaims", type=int, default=6)
    ap.add_argument("--drain-s", default="0,20", help="comma-separated --drain-s values, one mode each")
    ap.add_argument("--origin-pause", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    modes = [float(x) for x in args.drain_s.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="psw-spot-") as tmp:
        for r in range(args.rounds):
            for m, drain_s in enumerate(modes):
                res = one_run(Path(tmp) / f"r{r}m{m}", drain_s, args.reclaims, args.origin_pause, args.seed + r)
                rows.append((drain_s, res))
                print(f"  round {r + 1}, --drain-s {drain_s:g}: {res['acked']:,} acked, {res['lost']:,} lost, "
                      f"stops {', '.join(f'{s:.2f}' for s in res['stops'])} s", file=sys.stderr, flush=True)
    print(f"\n{args.reclaims} reclaims a run, the origin paused {args.origin_pause:g} s before each SIGTERM\n")
    print("| --drain-s | acked records | lost with a reclaimed disk | stored twice | SIGTERM to exit, median / max s |")
    print("|---|---|---|---|---|")
    for drain_s, res in rows:
        stops = res["stops"]
        print(f"| {drain_s:g} | {res['acked']:,} | {res['lost']:,} | {res['twice']:,} | "
              f"{statistics.median(stops):.2f} / {max(stops):.2f} |")
    bad = [res for _, res in rows if res["stray"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
