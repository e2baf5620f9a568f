"""Break the TCP connections between live members while versions spread, and look for what broke.

    nice -n 5 .venv/bin/python bench/conn_chaos.py [--nodes 5] [--versions 10] [--seed 1]
                                                  [--kill-every 0.2 1.0] [--publish-every 1 3]
                                                  [--download-limit RATE] [--dir DIR]

A hunt for races in session replacement (node/peers.py, node/dialer.py): a tracker, an
origin (--watch) and `--nodes` nodes run as real processes on loopback (tests/swarmlab.py);
`--versions` consecutive RL steps of the small synthetic model are published one after
another while, every `--kill-every` seconds (uniform between the two, seeded), established
TCP connections between members are killed with `ss -K` (root only): both ends see a reset,
reconnect at once, often dial each other at the same moment (crossing dials), and replace
sessions while Have, Incoming and Piece messages are in flight. Each kill is one of:

- member: every connection of one member (a node or the origin) to the others;
- pair: one connection between two members;
- again: the last kill's target again, 20-300 ms later (a reconnect killed while it greets).

Only sockets of this bench's processes, between their listen ports on 127.0.0.1, are
killed; the members' connections to the tracker are left alone. The kills stop once every
node holds the last version (or `--chaos-s` after the last publish), then the nodes must
converge within `--converge-s`.

Prints a table per member: the version it holds, whether its weights are the last
version's bit for bit (as a restart would read them: tests/swarmlab.py `load_weights`),
whether the versions it applied came in increasing order (its log), `sessions_replaced`
and `peers_dropped` from its status (the origin's replacements counted from its log), the
honest peers it dropped (a session it ended for a reason other than a killed connection:
a protocol error, invalid input, a budget, a stall), its ERROR lines, tracebacks, and
whether it still runs; then each of those in full. Exits 1 if a node did not reach the last
version bit-exact, a member exited, dropped an honest peer, or logged an ERROR or a
traceback. Logs stay in `--dir` when given.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from swarmlab import Proc, SwarmLab, load_weights, same_bits, write_checkpoint  # noqa: E402
from synthetic import rl_checkpoints, served  # noqa: E402

# Small pieces, as tests/test_swarm.py: each version spans many chunks, so many Haves,
# Incomings and Pieces are in flight when a connection breaks.
ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536"]
MAX_KILLS = 2000  # kill events per run, whatever the timing
USERS = re.compile(r"pid=(\d+)")
ERROR_LINE = re.compile(r"^\S+ \S+(?: \S+)? (ERROR|CRITICAL) ", re.M)
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
APPLIED = re.compile(r"applied version (\d+) \(")
REPLACED_LINE = "left: replaced by a newer connection of the same member"
LEFT = re.compile(r"^\S+ \S+(?: \S+)? WARNING (peer \S+ \([^)]*\) left: (.*))$", re.M)
# A session's end that a killed connection explains: the reset, EOF in the middle of a frame
# (what a killed connection may read once a send took its error), or a send on it. Any other
# reason a member gives for dropping a peer (protocol error, invalid input, over budget,
# stalled, misbehaved) is a fault in an honest swarm.
KILLED = ("connection lost", "could not send")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


@dataclasses.dataclass(frozen=True)
class Sock:
    local: tuple[str, int]
    peer: tuple[str, int]
    pid: int


def established() -> list[Sock]:
    """Established TCP sockets on this machine with their owning process (`ss -tnpH`)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, timeout=10).stdout
    socks = []
    for line in out.splitlines():
        f = line.split()
        if len(f) < 5:
            continue
        m = USERS.search(line)
        if m is None:
            continue
        local, peer = f[2].rsplit(":", 1), f[3].rsplit(":", 1)
        socks.append(Sock((local[0], int(local[1])), (peer[0], int(peer[1])), int(m.group(1))))
    return socks


class Chaos(threading.Thread):
    """Kills connections between `members` (name -> Proc) every `every` s until `stop` is set."""

    def __init__(self, members: dict[str, Proc], rng: random.Random, every: tuple[float, float], stop: threading.Event):
        super().__init__(daemon=True)
        self.members, self.rng, self.every, self.stop = members, rng, every, stop
        self.events = 0
        self.killed = 0  # connections (both ends of one count once)
        self.by_kind: dict[str, int] = {"member": 0, "pair": 0, "again": 0}
        self.killed_of: dict[str, int] = {n: 0 for n in members}
        self.errors: list[str] = []
        self._last_pairs: set[tuple[str, str]] = set()  # the members whose connection the last kill broke

    def _connections(self) -> dict[tuple, tuple[str, str]]:
        """Connections between members, as {(endpoint, endpoint) sorted: (name, name)}: both
        sockets owned by member processes, one end on a member's listen port, on loopback."""
        pids = {p.popen.pid: n for n, p in self.members.items() if p.alive()}
        ports = {port_of(p.addr) for p in self.members.values()}
        socks = [s for s in established() if s.pid in pids and s.local[0] == "127.0.0.1" and s.peer[0] == "127.0.0.1"]
        owner = {s.local: pids[s.pid] for s in socks}
        out = {}
        for s in socks:
            if s.peer in owner and (s.local[1] in ports or s.peer[1] in ports):
                out[tuple(sorted((s.local, s.peer)))] = tuple(sorted((owner[s.local], owner[s.peer])))
        return out

    def _kill(self, conns: list[tuple]) -> int:
        """Kill these connections (each end); returns how many had a socket destroyed."""
        if not conns:
            return 0
        terms = " or ".join(f"( src {a[0]}:{a[1]} and dst {b[0]}:{b[1]} ) or ( src {b[0]}:{b[1]} and dst {a[0]}:{a[1]} )"
                            for a, b in conns)
        r = subprocess.run(["ss", "-K", "-tnH", "state", "established", f"( {terms} )"],
                           capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            self.errors.append(r.stderr.strip())
        gone = set()
        for line in r.stdout.splitlines():
            f = line.split()
            if len(f) >= 4:
                a, b = f[2].rsplit(":", 1), f[3].rsplit(":", 1)
                gone.add(tuple(sorted(((a[0], int(a[1])), (b[0], int(b[1]))))))
        return len(gone & set(conns))

    def once(self) -> None:
        kind = self.rng.choices(["member", "pair", "again"], [4, 4, 2])[0]
        if kind == "again" and self._last_pairs:
            time.sleep(self.rng.uniform(0.02, 0.3))  # the reconnects of the last kill are greeting now
        conns = self._connections()
        if not conns:
            return
        if kind == "again" and self._last_pairs:
            chosen = [c for c, v in conns.items() if v in self._last_pairs]  # new ports, same members
        elif kind == "pair":
            chosen = [self.rng.choice(sorted(conns))]
        else:
            kind = "member"
            name = self.rng.choice(sorted({n for v in conns.values() for n in v}))
            chosen = [c for c, v in conns.items() if name in v]
        n = self._kill(chosen)
        if kind != "again":
            self._last_pairs = {conns[c] for c in chosen}
        self.events += 1
        self.by_kind[kind] += 1
        self.killed += n
        for c in chosen:
            for name in conns[c]:
                self.killed_of[name] += 1

    def run(self) -> None:
        while not self.stop.is_set() and self.events < MAX_KILLS:
            if self.stop.wait(self.rng.uniform(*self.every)):
                break
            try:
                self.once()
            except Exception as e:  # the bench's own fault: noted, reported, the run goes on
                self.errors.append(f"{type(e).__name__}: {e}")


def log_findings(p: Proc) -> tuple[list[str], list[str]]:
    """(ERROR/CRITICAL lines, tracebacks) in a member's log."""
    text = p.text()
    errors = [m.group(0) + text[m.end():].split("\n", 1)[0] for m in ERROR_LINE.finditer(text)]
    tracebacks = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if TRACEBACK.search(line):
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "|", "+", "\t")) or not re.match(r"^\d{4}-", lines[j])):
                j += 1
            start = max(0, i - 1)
            tracebacks.append("\n".join(lines[start:j]))
    return errors, tracebacks


def honest_drops(p: Proc) -> list[str]:
    """Peers a member dropped for a reason other than a killed connection."""
    return [m.group(1) for m in LEFT.finditer(p.text()) if not m.group(2).startswith(KILLED)]


def applied_in_order(p: Proc) -> tuple[bool, list[int]]:
    versions = [int(v) for v in APPLIED.findall(p.text())]
    return all(a < b for a, b in zip(versions, versions[1:])), versions


def wait_all(nodes: list[Proc], version: int, timeout: float) -> bool:
    """Whether every node's status says `version` within `timeout` s (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(status_or_none(p).get("version") == version for p in nodes):
            return True
        time.sleep(0.5)
    return False


def status_or_none(p: Proc) -> dict:
    try:
        return p.status()
    except Exception:
        return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kill-every", type=float, nargs=2, default=(0.2, 1.0), metavar=("MIN", "MAX"),
                    help="seconds between kills, uniform between the two (default 0.2 1.0)")
    ap.add_argument("--publish-every", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN", "MAX"),
                    help="seconds after a version is published before the next (default 1 3)")
    ap.add_argument("--chaos-s", type=float, default=60.0, help="kills stop this long after the last publish at most")
    ap.add_argument("--converge-s", type=float, default=120.0, help="then every node must hold the last version")
    ap.add_argument("--download-limit", metavar="RATE",
                    help="each node's --download-limit (e.g. 2M): its peers' sends back up, so a session is "
                         "more often replaced while a write of it is under way, as over a WAN")
    ap.add_argument("--dir", type=Path, help="keep the swarm's files and logs here")
    args = ap.parse_args()
    if not 2 <= args.nodes <= 16 or not 1 <= args.versions <= 50:
        ap.error("--nodes 2-16, --versions 1-50")
    lo, hi = args.kill_every
    if not 0.05 <= lo <= hi <= 30:
        ap.error("--kill-every MIN MAX: 0.05 <= MIN <= MAX <= 30")
    rng = random.Random(args.seed)
    root = args.dir or Path(tempfile.mkdtemp(prefix="conn_chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    print(f"conn_chaos: {args.nodes} nodes, {args.versions} versions, seed {args.seed}, "
          f"kill every {lo}-{hi} s, node download limit {args.download_limit or 'none'}, files in {root}; started {started}", flush=True)
    states = rl_checkpoints("small", 1e-5, args.versions - 1)
    watch = root / "watch"
    stop = threading.Event()
    t0 = time.monotonic()
    with SwarmLab(root) as lab:
        tracker = lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS)
        limit = [] if args.download_limit is None else ["--download-limit", args.download_limit]
        nodes = [lab.start_node(f"n{i}", region=f"r{i % 2}", extra=limit) for i in range(args.nodes)]
        for p in nodes:
            lab.wait_log(p, "joined the swarm via tracker")
        members = {"origin": origin, **{p.name: p for p in nodes}}
        chaos = Chaos(members, random.Random(rng.random()), (lo, hi), stop)
        chaos_started = False
        for v in range(args.versions):
            write_checkpoint(watch, f"step{v:04d}.safetensors", states[v])
            lab.wait_log(origin, rf"published version {v} \(", timeout=120)
            if not chaos_started:  # once version 0 is out: the keyframe spreads under fire too
                chaos.start()
                chaos_started = True
            if v + 1 < args.versions:
                time.sleep(rng.uniform(*args.publish_every))
        last = args.versions - 1
        published_at = time.monotonic()
        reached_under_chaos = wait_all(nodes, last, args.chaos_s)
        stop.set()
        chaos.join(timeout=30)
        chaos_s = time.monotonic() - published_at
        converged = reached_under_chaos or wait_all(nodes, last, args.converge_s)
        time.sleep(2.0)  # sessions settle; late errors reach the logs
        expect = served(states[last], torch.bfloat16)
        rows, failures = [], []
        for p in [tracker, origin, *nodes]:
            st = status_or_none(p) if p in nodes else {}
            errors, tracebacks = log_findings(p)
            drops = honest_drops(p)
            in_order, applied = applied_in_order(p)
            alive = p.alive()
            row = {"member": p.name, "alive": "yes" if alive else f"exited {p.popen.returncode}",
                   "errors": errors, "tracebacks": tracebacks, "drops": drops}
            if p in nodes:
                try:
                    exact = same_bits(load_weights(p), expect)
                except Exception as e:
                    exact = False
                    failures.append(f"{p.name}: weights unreadable ({e})")
                row.update(version=st.get("version"), exact=exact, in_order=in_order, applied=len(applied),
                           replaced=st.get("sessions_replaced"), dropped=st.get("peers_dropped"),
                           peers=len(st.get("peers", [])))
                if st.get("version") != last or not exact:
                    failures.append(f"{p.name}: version {st.get('version')}, bit-exact {exact}")
                if not in_order:
                    failures.append(f"{p.name}: applied out of order {applied}")
            elif p is origin:
                row.update(replaced=p.text().count(REPLACED_LINE))
            if not alive:
                failures.append(f"{p.name} exited ({p.popen.returncode})")
            if errors or tracebacks or drops:
                failures.append(f"{p.name}: {len(errors)} ERROR lines, {len(tracebacks)} tracebacks, "
                                f"{len(drops)} honest peers dropped")
            rows.append(row)
    elapsed = time.monotonic() - t0

    print(f"\nrun: seed {args.seed}, started {started}, {elapsed:.0f} s; kills: {chaos.events} "
          f"({', '.join(f'{k} {n}' for k, n in chaos.by_kind.items())}), connections killed {chaos.killed}; "
          f"kills went on {chaos_s:.0f} s after the last publish; last version {last} "
          f"{'reached under kills' if reached_under_chaos else 'reached after kills stopped' if converged else 'NOT reached'}")
    print("\n| member | alive | version | bit-exact | applied in order (count) | conns killed | sessions_replaced "
          "| peers_dropped | peers now | honest peers dropped | ERROR lines | tracebacks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    yes = {True: "yes", False: "NO", None: "-"}
    for r in rows:
        dropped = r.get("dropped")
        dropped = "-" if dropped is None else (", ".join(f"{k} {n}" for k, n in sorted(dropped.items())) or "0")
        order = f"{yes[r['in_order']]} ({r['applied']})" if "in_order" in r else "-"
        print(f"| {r['member']} | {r['alive']} | {r.get('version', '-')} | {yes[r.get('exact')]} | {order} | "
              f"{chaos.killed_of.get(r['member'], '-')} | {r.get('replaced', '-')} | {dropped} | {r.get('peers', '-')} | "
              f"{len(r['drops'])} | {len(r['errors'])} | {len(r['tracebacks'])} |")
    for r in rows:
        for e in r["errors"]:
            print(f"\n{r['member']} ERROR: {e}")
        for d in r["drops"]:
            print(f"\n{r['member']} dropped an honest peer: {d}")
        for tb in r["tracebacks"]:
            print(f"\n{r['member']} traceback:\n{tb}")
    if chaos.errors:
        print(f"\nthe bench's own kill errors ({len(chaos.errors)}): {chaos.errors[:5]}")
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        return 1
    print("\nOK: every node holds the last version bit-exact, no member exited or dropped an honest peer, no ERROR or traceback logged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
