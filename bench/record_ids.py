"""What record ids cost the node: the index's memory and time per identity, and a spool's append with and without ids.

Rows:
- index: `--window` identities (default the spool's, 2^20) added 8 at a time
  (as 8-record submits land), three windows' worth so the window is full and
  forgetting; then memory per remembered identity (tracemalloc: numpy's arrays
  are counted), the time of a lookup that hits and one that misses, and of the
  seals (merges, which the spool runs in a worker thread).
- append: `--conc` concurrent submitters of one 1 KiB record per call into a
  spool, for `--seconds`, without ids and with a random 16-byte id each (what
  node/client.py sends); process CPU per record, all threads.
- reopen: a spool whose `ids` file holds a full window, opened (its recovery).

    .venv/bin/python bench/record_ids.py [--window 1048576] [--seconds 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patchswarm.node.recordids import DEFAULT_WINDOW, RecordIdIndex  # noqa: E402
from patchswarm.node.spool import IDS_NAME, TrajectorySpool  # noqa: E402
from patchswarm.protocol.trajectory import record_key  # noqa: E402


def index_row(window: int) -> None:
    keys = [os.urandom(16) for _ in range(3 * window)]
    tracemalloc.start()
    index = RecordIdIndex(window)
    t, seals = time.perf_counter(), []
    for i in range(0, len(keys), 8):
        index.add(keys[i:i + 8], range(i, i + 8))
        if index.seal_due():  # the spool runs this part in a worker thread
            s = time.perf_counter()
            index.seal()
            seals.append(time.perf_counter() - s)
    add_us = (time.perf_counter() - t - sum(seals)) / len(keys) * 1e6
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    hits, misses = keys[-window // 2:][:20000], [os.urandom(16) for _ in range(20000)]
    t = time.perf_counter()
    assert all(index.get(k) is not None for k in hits)
    hit_us = (time.perf_counter() - t) / len(hits) * 1e6
    t = time.perf_counter()
    assert not any(index.get(k) is not None for k in misses)
    miss_us = (time.perf_counter() - t) / len(misses) * 1e6
    print(f"index  window {window:,}: {len(index):,} remembered, {now / len(index):.1f} B/identity now, "
          f"peak {peak / 2**20:.1f} MiB; add {add_us:.2f} us/identity on the loop, get hit {hit_us:.2f} us, "
          f"miss {miss_us:.2f} us; {len(seals)} seals (worker thread) of {max(seals) * 1e3:.0f} ms at most, "
          f"{sum(seals) / len(keys) * 1e6:.2f} us/identity")


async def append_row(directory: Path, conc: int, seconds: float, ids: bool) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    sp = await TrajectorySpool.open(directory, "n1", "r1", max_bytes=8 << 30)
    n = 0
    body = os.urandom(512) + bytes(512)

    rids = iter([os.urandom(16) for _ in range(int(seconds * 50000))])  # the client's work, not the node's

    async def submitter(deadline):
        nonlocal n
        while time.monotonic() < deadline:
            item = (body, 1, None, next(rids)) if ids else (body, 1, None)
            await sp.append([item], 10)
            n += 1

    c0, t0 = time.process_time(), time.monotonic()
    async with trio.open_nursery() as nursery:
        for _ in range(conc):
            nursery.start_soon(submitter, t0 + seconds)
    cpu = time.process_time() - c0
    secs = time.monotonic() - t0
    await sp.aclose()
    print(f"append {'with ids   ' if ids else 'without ids'} x{conc}: {n / secs:8.0f} rec/s, "
          f"{cpu / n * 1e6:6.1f} cpu us/rec")


async def reopen_row(directory: Path, window: int) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    sp = await TrajectorySpool.open(directory, "n1", "r1", id_window=window, segment_bytes=4 << 20)
    for i in range(0, window, 4096):  # a window's worth, acknowledged: their segments go to the ids file
        await sp.append([(b"x", 1, None, os.urandom(16)) for _ in range(4096)], 10)
        await sp.ack([r.seq for r in sp.pending(max_records=1 << 16)])
    await sp.aclose()
    size = (directory / IDS_NAME).stat().st_size
    t = time.perf_counter()
    sp = await TrajectorySpool.open(directory, "n1", "r1", id_window=window)
    took = time.perf_counter() - t
    held = len(sp.ids)
    await sp.aclose()
    print(f"reopen ids file {size / 2**20:.1f} MiB ({held:,} identities): {took:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--seconds", type=float, default=2.0, help="per append row")
    ap.add_argument("--conc", type=int, default=16, help="concurrent submitters in the append rows")
    ap.add_argument("--dir", default=None, help="where the spools go (default: a temp dir under the repo)")
    a = ap.parse_args()
    assert len(record_key(b"x")) == 16
    index_row(a.window)
    root = Path(a.dir or tempfile.mkdtemp(prefix=".bench-ids-", dir=Path(__file__).resolve().parents[1]))
    try:
        for ids in (False, True, False, True):
            trio.run(append_row, root / "spool", a.conc, a.seconds, ids)
        trio.run(reopen_row, root / "reopen", a.window)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
