"""What a valid member that reconnects in a loop costs a node, with and without its admission budget.

Real processes on loopback (tests/swarmlab.py): a tracker, an origin, and per row a
fresh victim node that fetches version 0 (a keyframe of `--mib` MiB of bf16) and then
serves it. Honest members (this process) each connect to the victim, take its Haves and
fetch every chunk of the keyframe, `--fetches` times one after another. Meanwhile, in rows
with an attack, `--attackers` processes holding one member's certificate ("mallory")
reconnect as fast as they can: TLS, Hello, read until the Haves have come, close, again
(a refusal: at once again, no backoff).

Columns: the victim's `--member-connections` (0: no limit) and whether mallory attacks; over
`--window` s of the attack alone, the victim's CPU (% of one core), mallory's connections per
second that became sessions (Hello and Haves), were refused (after TLS, before any Hello) or
were closed before TLS (the listener's slots before Hello full), and the victim's CPU per
handshake mallory got out of it; then the honest fetches' time (median and max, s) and the
victim's CPU meanwhile; and the victim's count of refusals (status peers_dropped).

With `--outsider`, mallory holds a certificate of another swarm's CA instead: a host outside
the swarm, every handshake of which fails. Its rows have the victim's own counts over the
window (status peers_dropped): failed handshakes ("refused") and connections closed before
TLS (its slots before Hello full) per second, and its CPU per such connection.

    .venv/bin/python bench/reconnect.py [--mib 64] [--fetches 8] [--attackers 1] [--window 5] [--rate R] [--pin] [--repeat 3] [--parallel 1] [--outsider]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from procstat import process_cpu_seconds  # noqa: E402
from swarmlab import SwarmLab, write_checkpoint  # noqa: E402

from patchswarm.node.net import trust  # noqa: E402
from patchswarm.node.net.admission import ADMISSIONS, CONNECTION_BURST  # noqa: E402
from patchswarm.node.net.transport import BEFORE_HELLO, CONNECTION_ERRORS, connect  # noqa: E402
from patchswarm.protocol import wire  # noqa: E402
from patchswarm.protocol.errors import PatchswarmError, PeerRefused  # noqa: E402

PIPELINE = 8  # requests in flight per honest fetch
HONEST_HOST = "127.0.0.2"  # another host than mallory's (127.0.0.1): its slots before Hello are its own


def _hello(name: str) -> wire.Hello:
    return wire.Hello(name, "r0", "node", "", [])


async def fetch_all(addr: str, victim: str, creds, name: str) -> tuple[float, int]:
    """Connect as `name`, take the Haves, fetch every chunk announced: (seconds, bytes)."""
    t0 = time.perf_counter()
    ms = await connect(addr, creds, {"node"}, _hello(name), expect_name=victim, local_address=HONEST_HOST)
    try:
        wanted: list[tuple[int, bool, int]] = []
        with trio.fail_after(30):
            while not wanted:
                msg = await ms.receive()
                if msg is None:
                    raise RuntimeError(f"{victim} closed {name}'s connection before its Haves")
                if isinstance(msg, wire.Have):
                    wanted = [(msg.version, msg.keyframe, i)
                              for i in wire.indices_from_bitfield(msg.chunks, 8 * len(msg.chunks))]
        left, got, queue = set(wanted), 0, list(wanted)
        with trio.fail_after(120):
            for key in queue[:PIPELINE]:
                await ms.send(wire.Request(*key))
            sent = min(PIPELINE, len(queue))
            while left:
                msg = await ms.receive()
                if msg is None:
                    raise RuntimeError(f"{victim} closed {name}'s connection with {len(left)} chunks to go")
                if isinstance(msg, wire.Piece):
                    got += len(msg.data)
                    if msg.offset + len(msg.data) == msg.total:
                        left.discard((msg.version, msg.keyframe, msg.chunk))
                        if sent < len(queue):
                            await ms.send(wire.Request(*queue[sent]))
                            sent += 1
        return time.perf_counter() - t0, got
    finally:
        await ms.aclose()


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of process `pid` on `cpus` (None: leave it)."""
    if cpus is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def attacker(addr: str, victim: str, creds_dir: str, stop, out, rate: float, cpus: set[int] | None,
             parallel: int) -> None:
    """One process of mallory: `parallel` loops that reconnect until `stop` is set (at most an
    hour), each at most `rate` connections a second (0: as fast as it can); puts its counts."""
    pin(os.getpid(), cpus)
    creds = trust.Credentials.load(Path(creds_dir))
    counts = {"admitted": 0, "refused": 0, "failed": 0}

    async def run() -> None:
        with trio.move_on_after(3600):
            async with trio.open_nursery() as n:
                for _ in range(parallel):
                    n.start_soon(loop)

    async def loop() -> None:
        start, tries = trio.current_time(), 0
        while not stop.is_set():
            if rate:
                tries += 1
                await trio.sleep_until(start + tries / rate)
            try:
                ms = await connect(addr, creds, {"node"}, _hello("mallory"), expect_name=victim)
            except PeerRefused:
                counts["refused"] += 1
                continue
            except (*CONNECTION_ERRORS, PatchswarmError):
                counts["failed"] += 1
                continue
            counts["admitted"] += 1
            try:
                with trio.move_on_after(2):
                    while not isinstance(msg := await ms.receive(), wire.Have) and msg is not None:
                        pass  # None: the victim closed it (replaced by mallory's next connection)
            except (*CONNECTION_ERRORS, PatchswarmError):
                pass
            await ms.aclose()

    trio.run(run)
    out.put(counts)


class Attack:
    """`n` processes of mallory against one victim, started and stopped together."""

    def __init__(self, lab: SwarmLab, v, victim: str, n: int, rate: float, cpus: set[int] | None, parallel: int,
                 creds: str | None = None):
        ctx = multiprocessing.get_context("spawn")
        self.out, self.stop = ctx.Queue(), ctx.Event()
        creds = creds or str(lab.creds("mallory", "node"))
        self.procs = [ctx.Process(target=attacker, args=(v.addr, victim, creds, self.stop, self.out, rate, cpus,
                                                                parallel))
                      for _ in range(n)]

    def __enter__(self) -> "Attack":
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.counts = {"admitted": 0, "refused": 0, "failed": 0}
        for _ in self.procs:
            for k, n in self.out.get(timeout=60).items():
                self.counts[k] += n
        for p in self.procs:
            p.join(10)


def _refusals(v) -> tuple[int, int]:
    """The victim's failed handshakes and connections closed before TLS so far (its status)."""
    dropped = v.status()["peers_dropped"]
    return dropped.get("refused", 0), dropped.get(BEFORE_HELLO, 0)


def row(lab: SwarmLab, index: int, limit: int, attackers: int, fetches: int, honest: list, window: float,
        rate: float, cpus: tuple[set[int], set[int]] | None, parallel: int, outsider: str | None = None) -> dict:
    """One row: a fresh victim at version 0; `window` s of the attack alone (or of nothing), then
    the honest fetches with the attack going on (or without). `outsider`: mallory's credentials
    are these (another swarm's), not a member's."""
    name = f"victim{index}"
    v = lab.start_node(name, region="r0", extra=["--member-connections", str(limit)])
    try:
        lab.wait_version([v], 0, timeout=300)
        time.sleep(1.0)  # its own fetch and apply settle
        pin(v.popen.pid, cpus and cpus[0])
        others = cpus and cpus[1]
        with Attack(lab, v, name, attackers, rate, others, parallel, outsider) as alone:
            time.sleep(1.0)  # the attackers' processes start (and, limited, use up the burst)
            cpu0, t0, seen0 = process_cpu_seconds(v.popen.pid), time.monotonic(), _refusals(v)
            time.sleep(window)
            alone_cpu = process_cpu_seconds(v.popen.pid) - cpu0
            seen = [b - a for a, b in zip(seen0, _refusals(v))]
            span = time.monotonic() - t0
            alone_span = span + 1.0
        times = []

        async def fetch_rounds() -> None:
            for i in range(fetches):
                times.append((await fetch_all(v.addr, name, honest[i % len(honest)], f"honest{i % len(honest)}"))[0])

        with Attack(lab, v, name, attackers, rate, others, parallel, outsider):
            if attackers:
                time.sleep(1.0)
            cpu0, t0 = process_cpu_seconds(v.popen.pid), time.monotonic()
            trio.run(fetch_rounds)
            fetch_cpu = (process_cpu_seconds(v.popen.pid) - cpu0) / (time.monotonic() - t0)
        st = v.status()
        c = alone.counts
        return {"limit": limit, "attack": bool(attackers), "median": statistics.median(times), "max": max(times),
                "alone_cpu": 100 * alone_cpu / window, "fetch_cpu": 100 * fetch_cpu,
                "sessions_s": c["admitted"] / alone_span, "refused_s": c["refused"] / alone_span,
                "failed_s": c["failed"] / alone_span,
                "ms_per_conn": 1000 * alone_cpu / max(1, (c["admitted"] + c["refused"]) * window / alone_span),
                "dropped": st["peers_dropped"].get(ADMISSIONS, 0), "replaced": st.get("sessions_replaced", 0),
                "tls_failed_s": seen[0] / span, "before_tls_s": seen[1] / span,
                "ms_per_outsider_conn": 1000 * alone_cpu / max(1, seen[0] + seen[1])}
    finally:
        lab.kill(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="the served state's size (bf16)")
    ap.add_argument("--fetches", type=int, default=8, help="honest fetches of the whole keyframe per row")
    ap.add_argument("--attackers", type=int, default=1, help="mallory's processes in a row with an attack")
    ap.add_argument("--window", type=float, default=5.0, help="seconds of the attack alone, measured")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="connections a second per mallory process (default 0: as fast as it can)")
    ap.add_argument("--pin", action="store_true",
                    help="the victim on CPU 0, everything else (mallory, the honest fetches) on the other CPUs, so "
                         "that the attacker's own work does not take the victim's core")
    ap.add_argument("--parallel", type=int, default=1, help="connections each mallory process makes at once")
    ap.add_argument("--limit", type=int, default=CONNECTION_BURST, help="the limited rows' --member-connections")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row")
    ap.add_argument("--outsider", action="store_true",
                    help="mallory holds a certificate of another swarm's CA: every handshake fails")
    a = ap.parse_args()
    cpus = None
    if a.pin:
        rest = os.sched_getaffinity(0) - {0}
        cpus = ({0}, rest)
        os.sched_setaffinity(0, rest)
    g = torch.Generator().manual_seed(0)
    n = a.mib << 19  # bf16 elements
    state = {f"layer{i}.weight": torch.randn(n // 16, generator=g).to(torch.bfloat16) for i in range(16)}
    with tempfile.TemporaryDirectory() as d, SwarmLab(Path(d)) as lab:
        lab.start_tracker()
        watch = Path(d) / "watch"
        lab.start_origin(region="r0", watch=watch, extra=["--chunk-bytes", str(1 << 20)])
        write_checkpoint(watch, "step0000.safetensors", state)
        honest = [trust.Credentials.load(lab.creds(f"honest{i}", "node")) for i in range(4)]
        outsider = None
        if a.outsider:  # the member budget is asked after TLS: it never meets an outsider
            trust.init_swarm(Path(d) / "elsewhere")
            trust.issue(Path(d) / "elsewhere", "mallory", "node", Path(d) / "outsider")
            outsider = str(Path(d) / "outsider")
            configs = [(a.limit, a.attackers), (a.limit, 0)]
        else:
            configs = [(0, 0), (0, a.attackers), (a.limit, a.attackers), (a.limit, 0)]
        runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
        for rep in range(a.repeat):  # interleaved, so a neighbour's load on the machine falls on every row
            for i, (limit, attackers) in enumerate(configs):
                runs[(limit, attackers)].append(row(lab, rep * len(configs) + i, limit, attackers, a.fetches, honest,
                                                    a.window, a.rate, cpus, a.parallel, outsider))
                print(f"  {limit, attackers}: {runs[(limit, attackers)][-1]}", file=sys.stderr)
    how = (f"{a.rate:g} times a second each" if a.rate else "as fast as they can") + \
        (f", {a.parallel} connections at once each" if a.parallel > 1 else "")
    med = statistics.median
    who = (f"an outsider (another swarm's certificate): {a.attackers} process(es) dialing {how}" if a.outsider
           else f"mallory: {a.attackers} process(es) reconnecting {how}")
    print(f"\n{a.mib} MiB keyframe (1 MiB chunks); {who}"
          f"{'; the victim pinned to CPU 0, the rest to the others' if a.pin else ''}; per run {a.window:g} s of "
          f"the attack alone, then {a.fetches} honest fetches of the whole keyframe, one after another, with it; "
          f"{a.repeat} runs per row, interleaved: medians of the runs (max: of all fetches)")
    if a.outsider:  # the victim's own counts; the member budget never meets an outsider: no limit column
        heads = ["attack", "victim CPU %, attack alone", "victim's failed handshakes / closed before TLS per s",
                 "victim CPU ms per outsider connection (either kind)"]
        counts = ("tls_failed_s", "before_tls_s")
        per_key, per_fmt = "ms_per_outsider_conn", ".2f"
    else:
        heads = ["member-connections", "attack", "victim CPU %, attack alone",
                 "mallory's sessions / refusals / closed before TLS per s", "victim CPU ms per mallory handshake"]
        counts = ("sessions_s", "refused_s", "failed_s")
        per_key, per_fmt = "ms_per_conn", ".1f"
    tail = [] if a.outsider else ["refused (victim's count, all runs)"]
    print(" | ".join([*heads, "honest fetch median / max s", "victim CPU % while fetching", *tail]))
    for (limit, attackers), rs in runs.items():
        cells = [] if a.outsider else [str(limit or "no limit")]
        cells += ["yes" if attackers else "no", f"{med(r['alone_cpu'] for r in rs):.0f}",
                  " / ".join(f"{med(r[k] for r in rs):.1f}" for k in counts),
                  f"{med(r[per_key] for r in rs):{per_fmt}}" if attackers else "-",
                  f"{med(r['median'] for r in rs):.2f} / {max(r['max'] for r in rs):.2f}",
                  f"{med(r['fetch_cpu'] for r in rs):.0f}"]
        if not a.outsider:
            cells.append(f"{sum(r['dropped'] for r in rs):,}")
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
