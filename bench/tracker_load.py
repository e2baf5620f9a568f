"""Tracker under load: N members over real TLS sessions, with churn, heartbeats and version notices.

For each tracker implementation (`new`: tracker/ of this tree; `main`: the
tracker/server.py of `--baseline-rev`, run against this tree's other modules,
so only the tracker's own algorithm differs) and each N, one run:

1. a tracker process (this script, `--serve`), measured from inside: its CPU
   time (getrusage), VmRSS / VmHWM, members, bytes pushed by message type;
2. `--generators` load-generator processes (`--generate`), each holding
   N / generators member sessions: mutual TLS 1.3 with certificates issued
   by the swarm CA (node/net/trust.py, issued once and cached under --work),
   the real Hello exchange, a Heartbeat every `--heartbeat` s per member;
   members join at `--ramp-rate` a second in all until N are in;
3. a window of `--window` s: churn (each generator closes a random member's
   session and opens a session for an absent identity, `--churn` of the
   members a minute in all), heartbeats, and an origin process
   (`--announce`) announcing a signed patch manifest of `--manifest-chunks`
   chunks every `--announce-every` s.

Columns: members reached; tracker CPU in % of one core over the window and per
member-second; bytes of peer lists and deltas pushed per membership change
(a join or a leave, each joiner's own full list included; counted by the
tracker for `new`, so joins still arriving from the ramp count, and by the
generators for `main`); join -> first
peer list (TCP connect to PeerList received, joins during the window), and
the tracker's part of it (its TCP accept to the list written or queued, from
its status); version
notice fan-out (announce sent to VersionNotice or VersionHint received: median
member, last member, the worst version; the load's members do not pass
manifests on, so this is the tracker's part) and the tracker's bytes of notices
and hints per version; tracker RSS at the end and its peak; the
longest single collection of the garbage collector inside the window (wall);
and one complete collection asked of the tracker after the window (wall and
CPU seconds, objects it kept): the pause that grows with the fleet, which the
tracker's schedule runs rarely (tracker/collector.py). Each simulated member
dials from its own loopback address, as fleet hosts each have their own.
All processes share this machine: the load average is printed with the
table, and the tracker's CPU is its own (getrusage), not wall time. `--pin`
gives the tracker a core of its own and the load processes the others.

    .venv/bin/python bench/tracker_load.py [--members 1000,3000,10000,3000x24] [--impl new,main]
        [--regions 8] [--window 60] [--churn 0.01] [--heartbeat 2] [--generators 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE_REV = "398a1c5"  # main before the sans-IO tracker: full member list to every member per change
TARGETS = ("targets (issue 24): <= 50 % of one core at 10k, 1 %/min churn, 2 s heartbeats; bytes per change "
           "grow with the region, not the fleet; join -> peer list <= 1 s; notice to the last of 10k <= 1 s")


def _name(i: int) -> str:
    return f"m{i:05d}"


def _source(i: int) -> str:
    """Member i's own loopback address to dial from: in a fleet every host has its own, and the
    tracker budgets connections before Hello per source address."""
    return f"127.3.{i // 250}.{i % 250 + 1}"


# ------------------------------------------------------------------ credentials


def ensure_creds(work: Path, count: int) -> Path:
    """A swarm with a tracker, an origin and `count` node identities (issued once, kept)."""
    from patchswarm.node.net import trust

    swarm = work / "swarm"
    if not (swarm / "ca.crt").exists():
        trust.init_swarm(swarm)
    creds = work / "creds"
    creds.mkdir(exist_ok=True)
    for name, role in [("tracker", "tracker"), ("origin", "origin")]:
        if not (creds / name / f"{name}.crt").exists():
            trust.issue(swarm, name, role, creds / name)
    t0, made = time.monotonic(), 0
    for i in range(count):
        d = creds / _name(i)
        if not (d / f"{_name(i)}.crt").exists():
            trust.issue(swarm, _name(i), "node", d)
            made += 1
    if made:
        print(f"issued {made} node certificates in {time.monotonic() - t0:.1f} s (node/net/trust.issue)", flush=True)
    return creds


# ------------------------------------------------------------------ the tracker process


def _load_tracker(impl: str, rev: str):
    if impl == "new":
        from patchswarm.tracker.server import Tracker
        return Tracker
    source = subprocess.run(["git", "show", f"{rev}:tracker/server.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="tracker-baseline-")) / "tracker_main.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("tracker_main", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tracker_main"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Tracker


def _proc_status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _gc_clock():
    """(Seconds this process has spent in the cyclic garbage collector so far, the longest
    single collection since the last call in wall seconds), from a callable:
    a tracker holding 10,000 sessions keeps millions of objects, and each full collection
    walks all of them."""
    import gc

    spent, started, longest = [0.0], [0.0, 0.0], [0.0]

    def callback(phase, info):
        if phase == "start":
            started[:] = [time.thread_time(), time.monotonic()]
        else:
            spent[0] += time.thread_time() - started[0]
            longest[0] = max(longest[0], time.monotonic() - started[1])

    def read():
        out, longest[0] = (spent[0], longest[0]), 0.0
        return out

    gc.callbacks.append(callback)
    return read


def serve_main(args) -> None:
    import trio

    from patchswarm.node.net import transport

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    Tracker = _load_tracker(args.impl, args.baseline_rev)
    pushed: dict[str, int] = {}
    if args.impl != "new":  # the baseline sends through MessageStream.send: count there
        original = transport.MessageStream.send

        async def counting_send(self, msg):
            before = self.counters.sent
            await original(self, msg)
            pushed[type(msg).__name__] = pushed.get(type(msg).__name__, 0) + self.counters.sent - before

        transport.MessageStream.send = counting_send
    status_file = open(args.status, "a", buffering=1)
    gc_time = _gc_clock()

    complete = [False]  # SIGUSR2: one complete collection, timed (the pause that grows with the fleet)
    signal.signal(signal.SIGUSR2, lambda *_: complete.__setitem__(0, True))

    async def main():
        t = Tracker(Path(args.creds) / "tracker", "127.0.0.1:0")
        async with trio.open_nursery() as nursery:
            await nursery.start(t.run)
            joins_seen = -1.0
            while True:
                if complete[0] and getattr(t, "collector", None):
                    complete[0] = False
                    t.collector.collect_all(trio.current_time(), len(t.members))
                ru = resource.getrusage(resource.RUSAGE_SELF)
                sent = dict(t.sent) if args.impl == "new" else dict(pushed)
                status_file.write(json.dumps({
                    "addr": t.listen_addr, "t": time.monotonic(), "cpu": ru.ru_utime + ru.ru_stime,
                    "members": len(t.members), "sent": sent, **_proc_status(), **dict(zip(("gc", "gc_pause"), gc_time())),
                    "changes": t.core.changes if args.impl == "new" else None,
                    "drops": dict(t.core.drops) if args.impl == "new" else {},
                    "fulls": getattr(getattr(t, "collector", None), "fulls", 0),
                    "joins": [w for at, w in getattr(t, "joins", ()) if at > joins_seen],
                    "last_full": getattr(getattr(t, "collector", None), "last_full", None)}) + "\n")
                joins_seen = max([joins_seen, *(at for at, _ in getattr(t, "joins", ()))])
                await trio.sleep(0.5)

    if os.environ.get("TRACKER_LOAD_PROFILE"):  # cProfile the window (SIGUSR1) into this file (at SIGTERM)
        import cProfile

        prof = cProfile.Profile()
        signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
        signal.signal(signal.SIGTERM, lambda *_: (prof.disable(), prof.dump_stats(os.environ["TRACKER_LOAD_PROFILE"]),
                                                  os._exit(0)))
    trio.run(main)


# ------------------------------------------------------------------ a load generator process


def _peek(body: bytes) -> tuple[str, object]:
    """A frame's message type (and a VersionNotice's version) without decoding the rest."""
    import msgpack

    u = msgpack.Unpacker(raw=False)
    u.feed(body)
    u.read_map_header()
    u.unpack()
    kind = u.unpack()
    if kind in ("VersionNotice", "VersionHint"):
        u.unpack()
        return kind, u.unpack()
    return kind, None


def generate_main(args) -> None:
    import trio

    from patchswarm.node.net import trust
    from patchswarm.node.net.transport import CONNECTION_ERRORS, connect
    from patchswarm.protocol import wire
    from patchswarm.protocol.errors import PatchswarmError

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    first, last = map(int, args.ids.split(":"))
    pool = list(range(first, last))
    rng = random.Random(first)
    active: dict[int, trio.CancelScope] = {}
    connecting: set[int] = set()
    joined_at: dict[int, float] = {}
    heartbeat = wire.encode(wire.Heartbeat([]))
    result = {"join_latency": [], "notices": {}, "joins": 0, "leaves": 0, "failed_joins": 0,
              "peer_msgs": 0, "peer_bytes": 0, "lost": 0, "lost_why": {}, "failed_why": {}}
    beat_failed: dict[int, str] = {}
    # Handshakes in flight per generator: more only queue up on this shared machine's CPU and
    # time out (connect gives up after 10 s); a join's latency is measured from its own connect.
    handshakes = trio.CapacityLimiter(8)
    contexts: dict[int, object] = {}
    measuring = [False]

    def context(i: int):
        if i not in contexts:
            contexts[i] = trust.client_context(trust.Credentials.load(Path(args.creds) / _name(i)))
        return contexts[i]

    async def member(i: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        name = _name(i)
        hello = wire.Hello(name, f"r{i % args.regions}", "node", f"127.1.{i // 250}.{i % 250 + 1}:7000", [])
        connecting.add(i)
        try:
            async with handshakes:
                t0 = time.monotonic()
                ms = await connect(args.tracker, trust.Credentials.load(Path(args.creds) / name), {"tracker"}, hello,
                                   ssl_context=context(i), local_address=_source(i))
        except (*CONNECTION_ERRORS, PatchswarmError) as e:
            result["failed_joins"] += 1
            why = type(e).__name__
            result["failed_why"][why] = result["failed_why"].get(why, 0) + 1
            task_status.started(False)
            return
        finally:
            connecting.discard(i)
        frames = ms._conn._frames  # it may hold what arrived with the tracker's Hello (the PeerList)
        with trio.CancelScope() as scope:
            active[i] = scope
            task_status.started(True)
            async with trio.open_nursery() as n:
                n.start_soon(beat, ms, scope, i)
                got_list = False
                try:
                    while True:
                        while (body := frames.next_body()) is not wire.NEED_DATA and body is not wire.CLOSED:
                            kind, version = _peek(body)
                            now = time.monotonic()
                            if kind in ("PeerList", "PeerDelta"):
                                if not got_list:
                                    got_list = True
                                    joined_at[i] = now
                                    if measuring[0]:
                                        result["join_latency"].append(now - t0)
                                if measuring[0]:
                                    result["peer_msgs"] += 1
                                    result["peer_bytes"] += len(body) + 4
                            elif kind in ("VersionNotice", "VersionHint") and measuring[0] and got_list:
                                # with the time this member got its list: a member that joined after
                                # the announcement was handed the notice as a retained manifest
                                result["notices"].setdefault(str(version), []).append((now, joined_at[i]))
                        data = await ms.stream.receive_some()
                        if not data:
                            break
                        frames.receive_data(data)
                    why = "closed by the tracker"
                except (*CONNECTION_ERRORS, PatchswarmError) as e:
                    why = type(e).__name__
                n.cancel_scope.cancel()
        if active.get(i) is scope:  # not ended by `leave`
            del active[i]
            result["lost"] += 1
            if scope.cancelled_caught:
                why = beat_failed.pop(i, "cancelled")
            result["lost_why"][why] = result["lost_why"].get(why, 0) + 1
        with trio.CancelScope(shield=True):
            await ms.aclose()

    async def beat(ms, scope, i) -> None:
        await trio.sleep(rng.random() * args.heartbeat)
        try:
            while True:
                with trio.fail_after(10):
                    await ms.stream.send_all(heartbeat)
                await trio.sleep(args.heartbeat)
        except CONNECTION_ERRORS as e:
            beat_failed[i] = f"heartbeat: {type(e).__name__}"
            scope.cancel()

    async def leave(i: int) -> None:
        scope = active.pop(i)
        scope.cancel()

    async def ramp(nursery) -> None:
        """Join the first `active` identities at the ramp rate; retry the ones that failed."""
        todo = pool[:args.active]
        gap = 1.0 / args.ramp_rate
        deadline = time.monotonic() + len(todo) * gap * 3 + 120
        while time.monotonic() < deadline:
            missing = [i for i in todo if i not in active and i not in connecting]
            if not missing and not connecting:
                return
            for i in missing:
                nursery.start_soon(member, i)
                await trio.sleep(gap)
            await trio.sleep(0.5)

    async def churn(nursery, seconds: float) -> None:
        rate = args.churn * args.active / 60.0  # leaves (and as many joins) per second
        end = time.monotonic() + seconds
        next_at = time.monotonic() + rng.expovariate(rate) if rate > 0 else end
        while True:
            await trio.sleep_until(trio.current_time() + max(0.0, min(next_at, end) - time.monotonic()))
            if time.monotonic() >= end:
                return
            if active:
                i = rng.choice(sorted(active))
                await leave(i)
                result["leaves"] += 1
            absent = [j for j in pool if j not in active and j not in connecting]
            if absent:
                nursery.start_soon(member, rng.choice(absent))
                result["joins"] += 1
            next_at += rng.expovariate(rate)

    async def collect() -> None:
        """A generator holds thousands of sessions too: it collects garbage on the tracker's
        schedule (tracker/collector.py), so that its own full collections do not delay the
        joins and notices it times."""
        from patchswarm.tracker.collector import CollectorSchedule

        collector = CollectorSchedule()
        collector.start(trio.current_time())
        while True:
            await trio.sleep_until(collector.due(trio.current_time()))
            collector.tick(trio.current_time(), len(active))

    async def main():
        stdin = trio.wrap_file(sys.stdin)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            await ramp(nursery)
            print(json.dumps({"ready": len(active)}), flush=True)
            line = await stdin.readline()
            seconds = float(line.split()[1])
            measuring[0] = True
            await churn(nursery, seconds)
            measuring[0] = False
            await trio.sleep(3.0)  # notices and lists still on their way
            result["active"] = len(active)
            print(json.dumps({"result": result}), flush=True)
            await stdin.readline()
            nursery.cancel_scope.cancel()

    trio.run(main)


# ------------------------------------------------------------------ the origin process


def announce_main(args) -> None:
    import hashlib

    import trio
    from cryptography.hazmat.primitives import serialization

    from patchswarm.node.net import trust
    from patchswarm.node.net.transport import connect
    from patchswarm.protocol import wire
    from patchswarm.protocol.manifest import Manifest, sign_manifest

    creds = trust.Credentials.load(Path(args.creds) / "origin")
    key = serialization.load_pem_private_key((Path(args.swarm) / "trainer.key").read_bytes(), password=None)

    def envelope(version: int) -> bytes:
        chunks = [(4 << 20, hashlib.sha256(b"%d.%d" % (version, c)).digest()) for c in range(args.manifest_chunks)]
        m = Manifest(swarm_id=creds.swarm_id(), version=version, base_version=version - 1,
                     base_hash="blake3:" + "0" * 64, target_hash="blake3:" + "%064x" % version,
                     tensors=[["w", "bf16", [args.manifest_chunks, 2 << 20]]], chunks=chunks,
                     codec={"format": 2}, created_at=time.time())
        return sign_manifest(m, key)

    async def main():
        ms = await connect(args.tracker, creds, {"tracker"}, wire.Hello("origin", "r0", "origin", "127.0.0.1:1", []))
        stdin = trio.wrap_file(sys.stdin)
        sent = {}
        async with trio.open_nursery() as n:
            async def drain():
                while await ms.receive() is not None:
                    pass

            async def beat():
                while True:
                    await ms.send(wire.Heartbeat([]))
                    await trio.sleep(2.0)

            n.start_soon(drain)
            n.start_soon(beat)
            print(json.dumps({"ready": 1}), flush=True)
            line = await stdin.readline()
            seconds = float(line.split()[1])
            end = time.monotonic() + seconds
            version = 0
            size = 0
            while time.monotonic() + args.announce_every / 2 < end:
                await trio.sleep(args.announce_every / 2)
                version += 1
                e = envelope(version)
                size = len(e)
                sent[str(version)] = time.monotonic()
                await ms.send(wire.Announce(e))
                await trio.sleep(args.announce_every / 2)
            print(json.dumps({"result": {"sent": sent, "manifest_bytes": size}}), flush=True)
            await stdin.readline()
            n.cancel_scope.cancel()

    trio.run(main)


# ------------------------------------------------------------------ the run


class Child:
    def __init__(self, argv: list[str], log: Path, cpus: set[int] | None = None):
        self.log = open(log, "ab")
        self.p = subprocess.Popen([sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, cwd=ROOT, text=True, bufsize=1)
        if cpus:
            os.sched_setaffinity(self.p.pid, cpus)

    def read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.p.stdout.readline()
        return json.loads(line) if line else None

    def tell(self, line: str) -> None:
        try:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()


def _statuses(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _last_status(path: Path) -> dict | None:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else None


def _wait_status(path: Path, pred, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = _last_status(path)
        if s is not None and pred(s):
            return s
        time.sleep(0.25)
    return _last_status(path)


def _peer_bytes(s: dict) -> int:
    return s["sent"].get("PeerList", 0) + s["sent"].get("PeerDelta", 0)


def run_one(args, impl: str, n: int, regions: int, creds: Path) -> dict:
    work = Path(args.work) / f"{impl}-{n}x{regions}"
    work.mkdir(parents=True, exist_ok=True)
    status = work / "status.jsonl"
    status.unlink(missing_ok=True)
    row = {"impl": impl, "n": n, "regions": regions}
    # --pin: the tracker alone on the first core, as on a host of its own; the load on the rest
    cores = sorted(os.sched_getaffinity(0))
    tracker_cpus, load_cpus = ({cores[0]}, set(cores[1:])) if args.pin and len(cores) > 1 else (None, None)
    tracker = Child(["--serve", "--impl", impl, "--creds", str(creds), "--status", str(status),
                     "--baseline-rev", args.baseline_rev], work / "tracker.log", tracker_cpus)
    children = [tracker]
    try:
        s = _wait_status(status, lambda s: True, 30)
        if s is None:
            raise RuntimeError(f"the tracker did not start; see {work / 'tracker.log'}")
        addr = s["addr"]
        spare = max(20, int(n * args.churn * args.window / 60 * 3))
        per = n // args.generators
        gens, start = [], 0
        for g in range(args.generators):
            active = per + (1 if g < n % args.generators else 0)
            pool = active + spare // args.generators + 1
            gens.append(Child(["--generate", "--tracker", addr, "--creds", str(creds), "--ids", f"{start}:{start + pool}",
                               "--active", str(active), "--regions", str(regions),
                               "--ramp-rate", str(args.ramp_rate / args.generators),
                               "--heartbeat", str(args.heartbeat), "--churn", str(args.churn)],
                              work / f"gen{g}.log", load_cpus))
            start += pool
        children += gens
        origin = Child(["--announce", "--tracker", addr, "--creds", str(creds), "--swarm", str(Path(args.work) / "swarm"),
                        "--announce-every", str(args.announce_every), "--manifest-chunks", str(args.manifest_chunks)],
                       work / "origin.log", load_cpus)
        children.append(origin)
        t_ramp = time.monotonic()
        ramp_limit = n / args.ramp_rate * 3 + 150
        ready = 0
        for c in [*gens, origin]:
            msg = c.read(max(1.0, t_ramp + ramp_limit - time.monotonic()))
            ready += (msg or {}).get("ready", 0)
        s0 = _wait_status(status, lambda s: s["members"] >= n + 1, 20)
        row["ramp_s"] = time.monotonic() - t_ramp
        row["reached"] = s0["members"] - 1
        time.sleep(2.0)
        s0 = _last_status(status)
        if os.environ.get("TRACKER_LOAD_PROFILE"):
            os.kill(tracker.p.pid, signal.SIGUSR1)
        for c in [*gens, origin]:
            c.tell(f"go {args.window}")
        results = [c.read(args.window + 120) for c in gens]
        origin_result = origin.read(30)
        s1 = _last_status(status)
        results = [r["result"] for r in results if r]
        dt = s1["t"] - s0["t"]
        changes = sum(r["joins"] + r["leaves"] for r in results)
        row["members_end"] = s1["members"] - 1
        row["cpu_pct"] = 100 * (s1["cpu"] - s0["cpu"]) / dt
        row["cpu_us_per_member_s"] = 1e6 * (s1["cpu"] - s0["cpu"]) / dt / max(1, row["reached"])
        row["gc_pct"] = 100 * (s1.get("gc", 0) - s0.get("gc", 0)) / dt
        row["gc_pause"] = max((x.get("gc_pause", 0.0) for x in _statuses(status) if s0["t"] < x["t"] <= s1["t"]),
                              default=None)  # the longest single collection in the window
        row["changes"] = changes
        if s1.get("changes") is not None:  # the tracker's own count: ramp stragglers' joins are changes too
            changes = s1["changes"] - s0["changes"]
            row["changes"] = changes
        row["bytes_per_change"] = (_peer_bytes(s1) - _peer_bytes(s0)) / changes if changes else None
        lat = sorted(x for r in results for x in r["join_latency"])
        row["join_p50"] = statistics.median(lat) if lat else None
        row["join_max"] = lat[-1] if lat else None
        row["joins_measured"] = len(lat)
        own = sorted(w for x in _statuses(status) if s0["t"] < x["t"] <= s1["t"] for w in x.get("joins", ()))
        row["tracker_join_p50"] = statistics.median(own) if own else None
        row["tracker_join_max"] = own[-1] if own else None
        row["failed_joins"] = sum(r["failed_joins"] for r in results)
        row["lost"] = sum(r["lost"] for r in results)
        for key in ("lost_why", "failed_why"):
            row[key] = {}
            for r in results:
                for k, v in r[key].items():
                    row[key][k] = row[key].get(k, 0) + v
        fan = []
        if origin_result:
            sent = origin_result["result"]["sent"]
            row["manifest_bytes"] = origin_result["result"]["manifest_bytes"]
            for v, t in sent.items():
                got = sorted(x - t for r in results for x, joined in r["notices"].get(v, []) if joined < t)
                if got:
                    fan.append((statistics.median(got), got[-1], len(got)))
        versions = len(origin_result["result"]["sent"]) if origin_result else 0
        notice_bytes = sum(s1["sent"].get(k, 0) - s0["sent"].get(k, 0) for k in ("VersionNotice", "VersionHint"))
        row["notice_bytes_per_version"] = notice_bytes / versions if versions else None
        row["notice_p50"] = statistics.median(f[0] for f in fan) if fan else None
        row["notice_last"] = statistics.median(f[1] for f in fan) if fan else None
        row["notice_worst"] = max(f[1] for f in fan) if fan else None
        row["notice_reached"] = min(f[2] for f in fan) if fan else 0
        if impl == "new":  # after the window, so that its pause is in no latency above
            os.kill(tracker.p.pid, signal.SIGUSR2)
            done = _wait_status(status, lambda s: s["fulls"] > s1["fulls"], 60)
            row["full"] = done.get("last_full") if done else None
        row["rss"] = s1.get("VmRSS")
        row["hwm"] = s1.get("VmHWM")
        row["drops"] = s1.get("drops")
    finally:
        for c in children[1:]:
            c.tell("stop")
        time.sleep(0.5)
        for c in reversed(children):
            c.stop()
    return row


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _complete(full: dict | None) -> str:
    """The complete collection asked for after the window: wall (CPU) seconds / objects kept."""
    if not full:
        return "-"
    return f"{full['pause_s']:.3f} ({full['cpu_s']:.3f}) / {full['objects']:,}"


def format_table(rows: list[dict]) -> str:
    head = ("impl    members regions  reached  cpu%  gc%  µs/member·s  bytes/change  join→list p50/max s  "
            "tracker's part p50/max s  notice p50/last/worst s  reach  notice MB/version  RSS/peak MB  lost  gc max s  complete s (cpu) / objects")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:6s} {r['n']:8d} {r['regions']:7d}  {r['error']}")
            continue
        lines.append(
            f"{r['impl']:6s} {r['n']:8d} {r['regions']:7d} {r['reached']:8d} {_f(r['cpu_pct'], '5.1f')} {_f(r.get('gc_pct'), '4.1f')} "
            f"{_f(r['cpu_us_per_member_s'], '12.1f')} "
            f"{_f(r['bytes_per_change'], '13,.0f')}  {_f(r['join_p50'], '8.3f')}/{_f(r['join_max'], '<8.3f')}   "
            f"{_f(r.get('tracker_join_p50'), '13.3f')}/{_f(r.get('tracker_join_max'), '<9.3f')} "
            f"{_f(r['notice_p50'], '6.3f')}/{_f(r['notice_last'], '.3f')}/{_f(r['notice_worst'], '<6.3f')}  "
            f"{r['notice_reached']:6d}  {_f(r.get('notice_bytes_per_version') and r['notice_bytes_per_version'] / 1e6, '17.3f')} "
            f"{_f((r['rss'] or 0) / 2**20, '5.0f')}/{_f((r['hwm'] or 0) / 2**20, '<5.0f')} "
            f"{r['lost']:5d}  {_f(r.get('gc_pause'), '7.3f')}  {_complete(r.get('full'))}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default="1000,3000,10000",
                    help="member counts; NxR runs N members in R regions instead of --regions")
    ap.add_argument("--impl", default="new,main", help="new (this tree), main (--baseline-rev's tracker/server.py)")
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--regions", type=int, default=8)
    ap.add_argument("--window", type=float, default=60.0, help="measured seconds per run, after the ramp")
    ap.add_argument("--churn", type=float, default=0.01, help="share of the members replaced per minute")
    ap.add_argument("--heartbeat", type=float, default=2.0)
    ap.add_argument("--generators", type=int, default=4)
    ap.add_argument("--ramp-rate", type=float, default=200.0, help="joins per second until N are in")
    ap.add_argument("--announce-every", type=float, default=15.0)
    ap.add_argument("--manifest-chunks", type=int, default=1000)
    ap.add_argument("--pin", action="store_true",
                    help="the tracker alone on the first core, generators and origin on the others")
    ap.add_argument("--work", default="/tmp/patchswarm-tracker-load")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--creds", "--status", "--tracker", "--ids", "--swarm"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--active", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_main(args)
    if args.generate:
        return generate_main(args)
    if args.announce:
        return announce_main(args)

    runs = [(int(x.split("x")[0]), int(x.split("x")[1]) if "x" in x else args.regions) for x in args.members.split(",")]
    sizes = [n for n, _ in runs]
    impls = args.impl.split(",")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    spare = max(20, int(max(sizes) * args.churn * args.window / 60 * 3))
    creds = ensure_creds(work, max(sizes) + spare + args.generators * 2)
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline_rev], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"{args.regions} regions unless NxR, churn {args.churn:.0%}/min, heartbeat {args.heartbeat:g} s, window "
          f"{args.window:g} s, {args.generators} generators{', tracker pinned to a core of its own' if args.pin else ''}; "
          f"main = {rev}", flush=True)
    rows = []
    for n, regions in runs:
        for impl in impls:
            try:
                row = run_one(args, impl, n, regions, creds)
            except Exception as e:  # one failed run must not lose the others' rows
                row = {"impl": impl, "n": n, "regions": regions, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}; manifest "
          f"{next((r['manifest_bytes'] for r in rows if r.get('manifest_bytes')), 0):,} B per notice")
    print(format_table(rows))
    print(TARGETS)


if __name__ == "__main__":
    main()
