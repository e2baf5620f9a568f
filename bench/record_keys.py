"""The origin's trajectory store with record keys and without: ingest CPU per record, the open
(index rebuild) per record, and the key index's memory (node/trainer/README.md, "Record keys").

In process, one store on this disk: `--batches` appends of `--batch` records of `--size`
bytes from 4 node ids, one append at a time (so a group commit holds one batch), each
record with a key or none; then the store is closed and opened again (the scan that rebuilds
both dedup indexes). CPU is this process's (all threads), so the disk's waits do not count.

    .venv/bin/python bench/record_keys.py [--batches 400] [--batch 64] [--size 1024] [--window 1048576]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _run(directory: Path, keyed: bool, args) -> dict:
    from patchswarm.node.trainer.trajstore import TrajectoryStore
    from patchswarm.protocol.trajectory import Record, record_key

    payload = os.urandom(args.size // 2) + bytes(args.size - args.size // 2)
    batches = []
    for b in range(args.batches):
        node = f"n{b % 4}"
        batches.append([Record(node, "r1", b * args.batch + i, 1, 1.0, payload,
                               key=record_key(b"%s/%d" % (node.encode(), b * args.batch + i)) if keyed else None)
                        for i in range(args.batch)])
    n = args.batches * args.batch
    async with await TrajectoryStore.open(directory, id_window=args.window) as st:
        c0, t0 = _cpu(), time.perf_counter()
        for batch in batches:
            await st.append(batch)
        ingest_cpu, ingest_wall = _cpu() - c0, time.perf_counter() - t0
        keys = st.summary()["record_keys"]
    c0, t0 = _cpu(), time.perf_counter()
    async with await TrajectoryStore.open(directory, id_window=args.window) as st:
        open_cpu, open_wall = _cpu() - c0, time.perf_counter() - t0
        # the rebuilt index holds the newest window (in memory, up to a seal's worth more)
        rebuilt = st.summary()["record_keys"]
        assert st.summary()["records"] == n and rebuilt == min(keys, args.window), (rebuilt, keys)
    return {"records": n, "ingest_us": ingest_cpu / n * 1e6, "ingest_wall_us": ingest_wall / n * 1e6,
            "open_us": open_cpu / n * 1e6, "open_wall_s": open_wall, "keys": rebuilt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    print(f"# {args.batches} appends of {args.batch} records of {args.size} B, window {args.window}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'keys':>5} {'run':>3} {'records':>8} {'ingest us/rec cpu':>17} {'wall':>6} {'open us/rec cpu':>15} "
          f"{'open s':>6} {'keys rebuilt':>12}", flush=True)
    for run in range(args.repeat):
        for keyed in (False, True):
            d = Path(tempfile.mkdtemp(prefix="bench-record-keys-", dir=args.dir))
            try:
                r = trio.run(_run, d, keyed, args)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            print(f"{'yes' if keyed else 'no':>5} {run:>3} {r['records']:>8} {r['ingest_us']:>17.1f} "
                  f"{r['ingest_wall_us']:>6.1f} {r['open_us']:>15.2f} {r['open_wall_s']:>6.2f} {r['keys']:>12}", flush=True)
    print(f"# peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"load after {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
