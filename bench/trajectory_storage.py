"""Microbench of the trajectory storage layers, side by side in one run.

Rows: the naive floor (one record written and fdatasynced at a time), the node
spool's append with 1/16/64 concurrent submitters, the same 64 submitters
while an uploader drains the spool into a store on the same disk (all but the
network), the origin store's append of decoded batches from 1 and 4 nodes, and
the batch codec. "cpu us/rec" is process CPU time (all threads, kernel
included) per record: steadier than rates on a shared machine. Payloads
are half random, half zeros (lz4 finds something, not everything).

    .venv/bin/python bench/trajectory_storage.py [--seconds 1.5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patchswarm.node.spool import TrajectorySpool  # noqa: E402
from patchswarm.node.trainer.trajstore import TrajectoryStore  # noqa: E402
from patchswarm.protocol.trajectory import (MAX_BATCH_BYTES, Record, decode_batch, encode_batch, encode_entry,  # noqa: E402
                                 encode_record, segment_header)

SIZES = [("1KiB", 1 << 10), ("16KiB", 16 << 10), ("1MiB", 1 << 20)]


def payload(size: int) -> bytes:
    return os.urandom(size // 2) + bytes(size - size // 2)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def row(name, size_name, conc, n, secs, nbytes, lat=None, fsyncs=None, cpu=None):
    lat = lat or []
    cpu_us = f"{cpu / n * 1e6:8.1f}" if cpu is not None and n else "       -"
    per = f"{n / fsyncs:8.1f}" if fsyncs else "       -"
    p50 = f"{pct(lat, 0.5) * 1e3:8.2f}" if lat else "       -"
    p99 = f"{pct(lat, 0.99) * 1e3:8.2f}" if lat else "       -"
    print(f"{name:<22} {size_name:>6} {conc:>5} {n:>8} {n / secs:>10.0f} {nbytes / secs / 1e6:>8.1f} {p50} {p99} {per} {cpu_us}",
          flush=True)


def naive(directory: Path, size: int, seconds: float):
    path = directory / "naive.seg"
    body = encode_record(Record("node-1", "r1", 0, 1, time.time(), payload(size), None))
    entry = encode_entry(body)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, segment_header())
    lat, n, t0, c0 = [], 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        os.write(fd, entry)
        os.fdatasync(fd)
        lat.append(time.perf_counter() - t)
        n += 1
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    os.close(fd)
    path.unlink()
    return n, secs, n * size, lat, n, cpu


async def spool_run(directory: Path, size: int, conc: int, seconds: float, drain: bool):
    """Submitters append one record per call; with `drain`, an uploader moves
    batches into a TrajectoryStore on the same disk (spool -> encode_batch ->
    decode_batch -> store.append -> spool.ack: everything but the network)."""
    sp = await TrajectorySpool.open(directory / "spool", "node-1", "r1", max_bytes=1 << 40)
    st = await TrajectoryStore.open(directory / "store") if drain else None
    data = payload(size)
    lat: list[float] = []
    stop = trio.current_time() + seconds

    async def submitter():
        while trio.current_time() < stop:
            t = time.perf_counter()
            await sp.append([(data, 1, None)], timeout=30)
            lat.append(time.perf_counter() - t)

    async def uploader():
        while True:
            batch = await sp.next_batch(4096, MAX_BATCH_BYTES)
            await sp.ack(await st.append(decode_batch(encode_batch(batch))))

    t0, c0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as n:
        if drain:
            n.start_soon(uploader)
        async with trio.open_nursery() as subs:
            for _ in range(conc):
                subs.start_soon(submitter)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        n.cancel_scope.cancel()
    fsyncs = sp.log.fsyncs
    await sp.aclose()
    if st is not None:
        await st.aclose()
    shutil.rmtree(directory)
    return len(lat), secs, len(lat) * size, lat, fsyncs, cpu


async def store_run(directory: Path, size: int, nodes: int, seconds: float):
    """Store append alone: decoded batches (the codec rows time decode_batch)."""
    st = await TrajectoryStore.open(directory)
    per_batch = max(1, min(4096, MAX_BATCH_BYTES // (size + 200)))
    templates = [decode_batch(encode_batch([Record(f"node-{k}", "r1", i, 1, time.time(), payload(size), None)
                                            for i in range(per_batch)])) for k in range(nodes)]
    stored, lat = [0], []
    stop = trio.current_time() + seconds

    async def node(k):
        template = templates[k]
        seq = 0
        while trio.current_time() < stop:
            batch = [dataclasses.replace(r, seq=seq + i) for i, r in enumerate(template)]
            t = time.perf_counter()
            await st.append(batch)
            lat.append(time.perf_counter() - t)
            stored[0] += per_batch
            seq += per_batch

    t0, c0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as n:
        for k in range(nodes):
            n.start_soon(node, k)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    fsyncs = st.log.fsyncs
    await st.aclose()
    shutil.rmtree(directory)
    return stored[0], secs, stored[0] * size, lat, fsyncs, cpu


def codec(size: int, seconds: float):
    per_batch = max(1, min(4096, MAX_BATCH_BYTES // (size + 200)))
    batch = [Record("node-1", "r1", i, 1, time.time(), payload(size), None) for i in range(per_batch)]
    out = []
    for fn, arg in ((encode_batch, batch), (decode_batch, encode_batch(batch))):
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds / 2:
            fn(arg)
            n += per_batch
        out.append((n, time.perf_counter() - t0, time.process_time() - c0))
    return out, len(encode_batch(batch)) / sum(len(r.payload) for r in batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="per row")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo, same disk)")
    ap.add_argument("--sizes", default="1KiB,16KiB,1MiB")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-traj-", dir=args.dir or Path(__file__).resolve().parents[1]))
    sizes = [(n, s) for n, s in SIZES if n in args.sizes.split(",")]
    print(f"{'layer':<22} {'size':>6} {'conc':>5} {'records':>8} {'rec/s':>10} {'MB/s':>8} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'rec/sync':>8} {'cpu us/rec':>8}")
    try:
        for name, size in sizes:
            secs = args.seconds if size < (1 << 20) else args.seconds * 1.5
            row("naive write+fsync", name, 1, *naive(base, size, secs))
            for conc in (1, 16, 64):
                row("spool append", name, conc, *trio.run(spool_run, base / "s", size, conc, secs, False))
            row("spool->store, no net", name, 64, *trio.run(spool_run, base / "s", size, 64, secs, True))
            for nodes in (1, 4):
                row("store append(batch)", name, nodes, *trio.run(store_run, base / "o", size, nodes, secs))
            (enc, dec), ratio = codec(size, secs)
            row("encode_batch", name, 1, enc[0], enc[1], enc[0] * size, cpu=enc[2])
            row("decode_batch", name, 1, dec[0], dec[1], dec[0] * size, cpu=dec[2])
            print(f"{'':<22} {name:>6} batch bytes / payload bytes = {ratio:.3f}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
