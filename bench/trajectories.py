"""End-to-end trajectory benchmark: rollout workers -> node spools -> origin store, as real processes.

Starts a tracker, an origin and 4 nodes (`python -m patchswarm.node.cli ...`, through
tests/swarmlab.py, imported from tests/) on loopback, then for each payload
size runs a rollout fleet for a fixed time and measures end to end:

- rec/s, MB/s: records whose submit was acknowledged, divided by the time from
  the first submit until the origin holds every one of them durably (every
  node's spool reports 0 unacknowledged records: a record leaves the spool
  only on the origin's ack, which follows its fdatasync). So a backlog the
  uploaders have not cleared when the submitters stop counts against the rate.
- p50/p99 ms: submit latency as the worker sees it (acknowledged by the node:
  fsynced to its spool).
- drain s: how long after the submitters stopped the origin took to catch up.
- naive: the same kind of records written and fdatasynced one at a time to one
  file by one thread, on the same disk, in the same run (the floor).
- us/rec: CPU time (all threads, kernel included, from /proc) per record of
  the 4 node daemons together, the origin and the workers: steadier than rates
  on a shared machine, and the number that says which process a record costs.
- cores: what those processes used together, and the rest of the machine
  (other users, this script) beside them; ours + rest near the core count
  means the CPU, not the disk, was the limit.
- check: the origin's store (read with node.trajstore.TrajectoryReader) gained
  exactly as many records per node as the workers had acknowledged.

The fleet: each node is a GPU host running `--procs` rollout worker processes
(default 8: one per GPU) with `--threads` threads each; every worker submits
one trajectory per call as soon as the previous one is acknowledged (a closed
loop: an upper bound on offered load, as when many short episodes finish at
once). `--per-call 8` submits 8 records per call instead, as a worker that
hands in a GRPO group (the samples of one prompt finish together) would.
Payloads are half random, half zeros (lz4 finds something, not everything),
distinct per record. `--record-ids` gives each record a client record id (its
stamp and the row's start): the spools keep the identities and the nodes upload each
record's key, which the origin's store deduplicates by (node/trainer/README.md,
"Record keys"); compare its origin us/rec with a run without.

    .venv/bin/python bench/trajectories.py [--seconds 8] [--repeat 2] [--sizes 1KiB,16KiB,1MiB] [--record-ids]

Many uploaders into one origin (`--uploaders 64`): instead of node daemons,
`--uploader-procs` processes hold `--uploaders` node sessions to the origin in
all, each over its own mutual-TLS connection with its own node certificate,
and send what a node's uploader (node/uploader.py) sends: `Trajectories`
batches of `--batch-records` records (encode_batch), at most UPLOAD_WINDOW
unacknowledged, the next as soon as one is acked, for `--seconds`. That is
the origin's ingest with the spools taken out (a node's own cost per record
is the table above): rec/s and MB/s acknowledged (an ack follows the store's
fdatasync), ack latency p50/p99, the origin's CPU per record and cores, and
the check that the store gained exactly the acknowledged records per node.

    .venv/bin/python bench/trajectories.py --uploaders 64,128 [--sizes 1KiB,16KiB] [--batch-records 64]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import procstat  # noqa: E402

SIZES = {"1KiB": 1 << 10, "16KiB": 16 << 10, "1MiB": 1 << 20}
NODES = 4
POLICY_VERSION = 1
POLL_SECONDS = 0.05  # how often the drain is checked: the end time is late by at most this
POOL_BYTES = 256 << 10  # distinct payloads per worker: more than lz4's 64 KiB window apart


# ================================================================ the rollout worker (a child process)


def payload_pool(size: int, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    half = size // 2
    return [rnd.randbytes(half) + bytes(size - half) for _ in range(max(2, -(-POOL_BYTES // size)))]


def worker_main(socket_path: str, worker: int, threads: int) -> None:
    """Serve commands from stdin (one JSON line per row), answer one JSON line each.

    Command: {"size", "seconds", "start" (wall clock), "per_call"}. Each thread
    opens its own NodeClient and submits until start + seconds."""
    from patchswarm.node.client import NodeClient, NodeError

    for line in sys.stdin:
        cmd = json.loads(line)
        size, per_call, with_ids = cmd["size"], cmd["per_call"], cmd.get("record_ids", False)
        pool = payload_pool(size, worker * 7919 + size)
        lat: list[float] = []
        acked, errors = [0], []
        lock = threading.Lock()

        def run(t: int) -> None:
            n = 0
            mine = []
            with NodeClient(socket_path) as client:
                while time.time() < cmd["start"]:
                    time.sleep(0.001)
                stop = cmd["start"] + cmd["seconds"]
                while time.time() < stop:
                    batch = []
                    for _ in range(per_call):
                        n += 1
                        stamp = f"{worker:04d}{t:02d}{n:010d}".encode()  # 16 bytes: unique per record
                        item = (stamp + pool[n % len(pool)][16:], POLICY_VERSION, None)
                        # the stamp repeats in every row: the row's start makes the id new
                        batch.append((*item, stamp + b"@%.6f" % cmd["start"]) if with_ids else item)
                    t0 = time.perf_counter()
                    try:
                        client.submit_many(batch, timeout=60)
                    except NodeError as e:
                        errors.append(str(e)[:200])
                        break
                    mine.append(time.perf_counter() - t0)
            with lock:
                lat.extend(mine)
                acked[0] += len(mine) * per_call

        ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        print(json.dumps({"acked": acked[0], "lat": [round(x, 6) for x in lat], "errors": errors}), flush=True)


# ================================================================ measuring


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds; 0 once it is gone."""
    return procstat.process_cpu_seconds(pid) or 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def naive_floor(directory: Path, size: int, seconds: float) -> tuple[int, float, list[float]]:
    """One thread: frame one record, write it, fdatasync, next."""
    from patchswarm.protocol.trajectory import Record, encode_entry, encode_record, segment_header

    pool = payload_pool(size, 1)
    path = directory / "naive.seg"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, segment_header())
    lat, n, t0 = [], 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            rec = Record("naive", "r0", n, POLICY_VERSION, time.time(), pool[n % len(pool)], None)
            os.write(fd, encode_entry(encode_record(rec)))
            os.fdatasync(fd)
            lat.append(time.perf_counter() - t)
            n += 1
    finally:
        os.close(fd)
        path.unlink()
    return n, time.perf_counter() - t0, lat


class StoreCounter:
    """Counts the origin's stored records per node, reading only what is new each time."""

    def __init__(self, directory: Path):
        from patchswarm.node.trainer.trajstore import TrajectoryReader

        self.cursor = TrajectoryReader(directory).cursor()
        self.by_node: collections.Counter = collections.Counter()

    def update(self) -> collections.Counter:
        while batch := self.cursor.read(4096):
            self.by_node.update(r.node_id for r in batch)
        return collections.Counter(self.by_node)


# ================================================================ the fleet


class Fleet:
    """The swarm's processes and the worker processes, for the whole run."""

    def __init__(self, root: Path, procs: int, threads: int):
        sys.path.insert(0, str(ROOT / "tests"))
        from swarmlab import SwarmLab  # the test harness: starts real processes, stops them on close

        self.lab = SwarmLab(root)
        self.lab.start_tracker()
        self.origin = self.lab.start_origin()
        self.nodes = [self.lab.start_node(f"n{i}", region=f"r{i % 2}") for i in range(NODES)]
        self.workers: list[tuple[str, subprocess.Popen]] = []
        for i, node in enumerate(self.nodes):
            for k in range(procs):
                p = subprocess.Popen([sys.executable, __file__, "--worker", str(node.socket), str(i * 100 + k),
                                      str(threads)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
                self.workers.append((node.name, p))
        self._wait_connected()
        self.store = StoreCounter(self.origin.data_dir / "trajectories")
        # One connection per node for the drain polls (a new connection per poll costs the node).
        self._status_clients = [n.client() for n in self.nodes]

    def _wait_connected(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while not any(p["role"] == "origin" for p in node.status()["peers"]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} did not connect to the origin in {timeout} s:\n{node.text()[-2000:]}")
                time.sleep(0.1)

    def spool_records(self) -> int:
        return sum(c.status()["spool"]["records"] for c in self._status_clients)

    def cpu(self) -> dict[str, float]:
        return {"nodes": sum(_cpu_seconds(n.popen.pid) for n in self.nodes),
                "origin": _cpu_seconds(self.origin.popen.pid),
                "workers": sum(_cpu_seconds(p.pid) for _, p in self.workers),
                "machine": procstat.machine_busy_seconds()}

    def row(self, size: int, seconds: float, per_call: int, drain_timeout: float, record_ids: bool = False) -> dict:
        before = self.store.update()
        start = time.time() + 0.5
        for _, p in self.workers:
            p.stdin.write(json.dumps({"size": size, "seconds": seconds, "start": start, "per_call": per_call,
                                      "record_ids": record_ids}) + "\n")
            p.stdin.flush()
        while time.time() < start:
            time.sleep(0.001)
        cpu0, t0, load0 = self.cpu(), time.time(), os.getloadavg()[0]
        results = collections.Counter()
        lat: list[float] = []
        errors: list[str] = []
        for name, p in self.workers:
            r = json.loads(p.stdout.readline())
            results[name] += r["acked"]
            lat.extend(r["lat"])
            errors.extend(r["errors"])
        t_stop = time.time()
        deadline = time.monotonic() + drain_timeout
        while self.spool_records():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the origin did not receive everything within {drain_timeout} s of the stop")
            time.sleep(POLL_SECONDS)
        t_end = time.time()
        cpu1, load1 = self.cpu(), os.getloadavg()[0]
        after = self.store.update()
        gained = after - before
        wall = t_end - t0
        acked = sum(results.values())
        ours = sum(cpu1[k] - cpu0[k] for k in ("nodes", "origin", "workers"))
        return {
            "acked": acked, "wall": wall, "drain": t_end - t_stop, "lat": lat, "errors": errors,
            "rate": acked / wall, "mbps": acked * size / wall / 1e6,
            "us_per_rec": {k: (cpu1[k] - cpu0[k]) / max(acked, 1) * 1e6 for k in ("nodes", "origin", "workers")},
            "cores": ours / wall, "rest": ((cpu1["machine"] - cpu0["machine"]) - ours) / wall,
            "load": (load0, load1),
            "ok": dict(gained) == dict(results) and not errors,
            "gained": dict(gained), "expected": dict(results),
        }

    def close(self) -> None:
        for c in getattr(self, "_status_clients", []):
            c.close()
        for _, p in self.workers:
            try:
                p.stdin.close()
            except OSError:
                pass
        for _, p in self.workers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.lab.close()


# ================================================================ many uploaders into one origin


def uploaders_main(origin_addr: str, creds_dir: str, names: list[str], batch_records: int) -> None:
    """Hold one session per name to the origin; per JSON command on stdin, upload
    batches for the time given and answer one JSON line (acked per name, ack latencies)."""
    import trio

    from patchswarm.node.net.transport import CONNECTION_ERRORS, connect
    from patchswarm.node.net.trust import Credentials, client_context
    from patchswarm.node.uploader import UPLOAD_WINDOW
    from patchswarm.protocol import wire
    from patchswarm.protocol.trajectory import Record, encode_batch

    async def main():
        sessions = {}
        for name in names:
            creds = Credentials.load(Path(creds_dir) / name)
            ctx = client_context(creds)
            # Wire revision 2: these sessions keep 4 batches in flight each, more than the origin's
            # 64 intake slots at 64+ sessions; they wait in their sockets (as nodes of revision 2)
            # instead of being answered TrajectoriesBusy, which this generator does not resend.
            ctx.set_alpn_protocols(["patchswarm/2"])
            sessions[name] = await connect(origin_addr, creds, {"origin"}, wire.Hello(name, "r1", "node", "", []),
                                           ssl_context=ctx)
        print(json.dumps({"ready": len(sessions)}), flush=True)
        stdin = trio.wrap_file(sys.stdin)
        seq = collections.Counter()
        while line := await stdin.readline():
            cmd = json.loads(line)
            size, start, stop = cmd["size"], cmd["start"], cmd["start"] + cmd["seconds"]
            acked, lat, errors = collections.Counter(), [], []

            async def upload(name: str, ms) -> None:
                pool = payload_pool(size, zlib.crc32(name.encode()))
                window = trio.Semaphore(UPLOAD_WINDOW)
                sent_at: dict[int, tuple[float, int]] = {}  # first seq of a batch -> (sent, records)

                async def read_acks():
                    while (msg := await ms.receive()) is not None:
                        if isinstance(msg, wire.TrajectoriesAck):
                            got = set(msg.seqs)
                            for s0 in [s0 for s0 in sent_at if s0 in got]:
                                t, n = sent_at.pop(s0)
                                lat.append(time.perf_counter() - t)
                                acked[name] += n
                                window.release()

                async with trio.open_nursery() as n:
                    n.start_soon(read_acks)
                    await trio.sleep(max(0.0, start - time.time()))
                    try:
                        while time.time() < stop:
                            await window.acquire()
                            first = seq[name] + 1
                            batch = [Record(name, "r1", first + i, POLICY_VERSION, time.time(),
                                            f"{first + i:016d}".encode() + pool[(first + i) % len(pool)][16:])
                                     for i in range(batch_records)]
                            seq[name] += batch_records
                            sent_at[first] = (time.perf_counter(), batch_records)
                            await ms.send(wire.Trajectories(encode_batch(batch)))
                        with trio.move_on_after(120):
                            while sent_at:
                                await trio.sleep(0.01)
                    except CONNECTION_ERRORS as e:
                        errors.append(f"{name}: {type(e).__name__}")
                    n.cancel_scope.cancel()

            async with trio.open_nursery() as n:
                for name, ms in sessions.items():
                    n.start_soon(upload, name, ms)
            print(json.dumps({"acked": dict(acked), "lat": [round(x, 6) for x in lat], "errors": errors}), flush=True)

    trio.run(main)


def run_uploaders(args, sizes) -> None:
    """The origin under `--uploaders` concurrent node sessions (see the module doc)."""
    from patchswarm.node.net import trust

    sys.path.insert(0, str(ROOT / "tests"))
    from swarmlab import SwarmLab

    counts = [int(x) for x in str(args.uploaders).split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-uploaders-", dir=args.dir))
    print(f"# one origin, {'/'.join(map(str, counts))} node sessions from {args.uploader_procs} processes, "
          f"{args.batch_records} records per batch, {args.seconds:g} s per row; {os.cpu_count()} CPUs; data in {root}",
          flush=True)
    print(f"{'uploaders':>9} {'size':>6} {'run':>3} {'load1':>5} {'records':>9} {'rec/s':>7} {'MB/s':>7} "
          f"{'ack p50 ms':>10} {'p99 ms':>7} | {'origin us/rec':>13} {'origin cores':>12} {'machine':>7} | check", flush=True)
    lab = SwarmLab(root)
    try:
        lab.start_tracker()
        origin = lab.start_origin()
        store = StoreCounter(origin.data_dir / "trajectories")
        for count in counts:
            names = [f"u{count}-{i:04d}" for i in range(count)]
            for name in names:
                trust.issue(lab.swarm, name, "node", root / "creds" / name)
            procs = []
            for g in range(args.uploader_procs):
                mine = names[g::args.uploader_procs]
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--uploader-proc", origin.addr, str(root / "creds"),
                     ",".join(mine), str(args.batch_records)],
                    cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            try:
                ready = sum(json.loads(p.stdout.readline())["ready"] for p in procs)
                assert ready == count, f"{ready} of {count} sessions connected"
                for run in range(args.repeat):
                    for label, size in sizes:
                        before = store.update()
                        start = time.time() + 0.5
                        for p in procs:
                            p.stdin.write(json.dumps({"size": size, "seconds": args.seconds, "start": start}) + "\n")
                            p.stdin.flush()
                        while time.time() < start:
                            time.sleep(0.001)
                        cpu0, busy0, t0, load0 = _cpu_seconds(origin.popen.pid), procstat.machine_busy_seconds(), time.time(), \
                            os.getloadavg()[0]
                        acked, lat, errors = collections.Counter(), [], []
                        for p in procs:
                            r = json.loads(p.stdout.readline())
                            acked.update(r["acked"])
                            lat.extend(r["lat"])
                            errors.extend(r["errors"])
                        wall = time.time() - t0
                        cpu = _cpu_seconds(origin.popen.pid) - cpu0
                        busy = procstat.machine_busy_seconds() - busy0
                        gained = store.update() - before
                        total = sum(acked.values())
                        ok = dict(gained) == dict(acked) and not errors
                        check = "ok" if ok else f"MISMATCH stored {sum(gained.values())} acked {total} {errors[:2]}"
                        print(f"{count:>9} {label:>6} {run:>3} {load0:5.2f} {total:>9} {total / wall:>7.0f} "
                              f"{total * size / wall / 1e6:>7.1f} {pct(lat, 0.5) * 1e3:>10.1f} {pct(lat, 0.99) * 1e3:>7.1f} | "
                              f"{cpu / max(total, 1) * 1e6:>13.1f} {cpu / wall:>12.2f} {busy / wall:>7.2f} | {check}",
                              flush=True)
            finally:
                for p in procs:
                    p.stdin.close()
                for p in procs:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
        print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    finally:
        lab.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


# ================================================================ main


HEADER = (f"{'size':>6} {'run':>3} {'load1':>5} {'records':>8} {'rec/s':>7} {'MB/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'drain s':>7} | {'naive/s':>7} {'nMB/s':>6} {'np50ms':>6} {'x naive':>7} | "
          f"{'us/rec node':>11} {'origin':>6} {'worker':>6} | {'cores ours':>10} {'rest':>5} | check")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="submitting time per row")
    ap.add_argument("--naive-seconds", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=2, help="rows per size (interleaved: all sizes, then again)")
    ap.add_argument("--sizes", default="1KiB,16KiB,1MiB")
    ap.add_argument("--procs", type=int, default=8, help="rollout worker processes per node")
    ap.add_argument("--threads", type=int, default=1, help="submitting threads per worker process")
    ap.add_argument("--per-call", type=int, default=1, help="records per submit call")
    ap.add_argument("--record-ids", action="store_true",
                    help="a client record id per record: identities in the spools, keys to the origin")
    ap.add_argument("--dir", default=None, help="where the swarm's data dirs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the data dirs and logs")
    ap.add_argument("--uploaders", default=None,
                    help="node sessions uploading into one origin, e.g. 64,128 (instead of the node fleet)")
    ap.add_argument("--uploader-procs", type=int, default=4, help="processes holding those sessions")
    ap.add_argument("--batch-records", type=int, default=64, help="records per Trajectories batch")
    ap.add_argument("--worker", nargs=3, metavar=("SOCKET", "ID", "THREADS"), help=argparse.SUPPRESS)
    ap.add_argument("--uploader-proc", nargs=4, metavar=("ORIGIN", "CREDS", "NAMES", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return
    if args.uploader_proc:
        uploaders_main(args.uploader_proc[0], args.uploader_proc[1], args.uploader_proc[2].split(","),
                       int(args.uploader_proc[3]))
        return
    sizes = [(n, SIZES[n]) for n in args.sizes.split(",")]
    if args.uploaders:
        run_uploaders(args, sizes)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-trajectories-", dir=args.dir))
    print(f"# {NODES} nodes x {args.procs} worker processes x {args.threads} threads, {args.per_call} record(s) "
          f"per submit{', with record ids' if args.record_ids else ''}, {args.seconds:g} s per row; {os.cpu_count()} CPUs; data in {root}", flush=True)
    fleet = None
    try:
        fleet = Fleet(root, args.procs, args.threads)
        fleet.row(1024, 1.0, 1, 60)  # warm-up: connections, first segment files, imports
        print(f"# pids (for py-spy): origin {fleet.origin.popen.pid}, nodes "
              f"{' '.join(str(n.popen.pid) for n in fleet.nodes)}", flush=True)
        print(HEADER, flush=True)
        for run in range(args.repeat):
            for name, size in sizes:
                n, nsecs, nlat = naive_floor(root, size, args.naive_seconds)
                r = fleet.row(size, args.seconds, args.per_call, drain_timeout=600, record_ids=args.record_ids)
                u = r["us_per_rec"]
                check = "ok" if r["ok"] else f"MISMATCH stored {r['gained']} acked {r['expected']} {r['errors'][:2]}"
                print(f"{name:>6} {run:>3} {r['load'][0]:5.2f} {r['acked']:>8} {r['rate']:>7.0f} {r['mbps']:>7.1f} "
                      f"{pct(r['lat'], 0.5) * 1e3:>7.2f} {pct(r['lat'], 0.99) * 1e3:>7.2f} {r['drain']:>7.2f} | "
                      f"{n / nsecs:>7.0f} {n * size / nsecs / 1e6:>6.1f} {pct(nlat, 0.5) * 1e3:>6.2f} "
                      f"{r['rate'] / (n / nsecs):>7.1f} | {u['nodes']:>11.0f} {u['origin']:>6.0f} {u['workers']:>6.0f} | "
                      f"{r['cores']:>10.2f} {r['rest']:>5.2f} | {check}", flush=True)
        print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    finally:
        if fleet is not None:
            fleet.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
