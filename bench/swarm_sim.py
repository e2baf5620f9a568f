"""A fleet-scale swarm simulation: the real tracker peer sets, dialer choice and piece pickers over modelled links.

No sockets and no processes: the membership comes from the tracker's own
`PeerSets` (protocol/peersets.py, the sets each member is told), each node's
connections from the dialer's rule (node/dialer.py `rank`: up to
SAME_REGION_PEERS of its region, every other-region entry it was told, the
origin; a connection either side wanted is one both use), and one
`PiecePicker` (protocol/picker.py) per node decides every request, as the
daemon's fetcher does. The origin holds every chunk and answers every request.

The network is modelled per link, each serving its transfers in order at its
rate: every host has an uplink and a downlink at `--lan-gbps`; every region a
WAN egress and ingress at its own rate (`--wan-gbps`, heterogeneous). A chunk
sent from a to b at t reserves each link on its path (a's uplink, b's
downlink, and across regions a's region's egress and b's region's ingress)
from when that link is free, and arrives when the last of them is done, plus
one-way latency (`--lan-ms`, `--wan-ms`) on top of the request's own trip.
A cut-through store-and-forward model: it ignores TCP dynamics and keeps a
cancelled endgame copy's reservation (endgame never crosses the WAN).
A node announces a chunk (HaveOne) to its connected peers on arrival; pickers
that learned something are asked for requests at most once per `--tick-ms`.

Prints, per region: its WAN rate, its nodes, when its last node held the
whole patch, its bound (patch / the slowest of a host link, the region's
ingress and the origin region's egress), the ratio, and the WAN bytes that
entered it over the patch; and for the fleet: time to every member against
the WAN bound (the slowest region's), origin bytes out over the patch.

    .venv/bin/python bench/swarm_sim.py [--members 1000,10000] [--regions 8]
        [--wan-gbps 10,5,2,1,10,0.5,3,1] [--lan-gbps 25] [--patch-mib 256] [--chunks 64]
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from patchswarm.node.dialer import SAME_REGION_PEERS, rank  # noqa: E402
from patchswarm.protocol.peersets import NODE, ORIGIN, PeerSets  # noqa: E402
from patchswarm.protocol.picker import WAN_GATEWAYS, PiecePicker  # noqa: E402

KEY = (1, False)  # a patch
OR = "origin"
TARGETS = "targets (issue 24): at 10,000 members every member holds the version within 1.3x the WAN bound; origin out <= 1.1x the patch"


def build_swarm(members: int, regions: int, seed: int) -> tuple[dict[str, str], dict[str, set[str]], PeerSets]:
    """Nodes (id -> region) spread evenly over `regions`, and each one's connections."""
    sets = PeerSets(gateways=WAN_GATEWAYS or 0, seed=seed)
    sets.join(OR, ORIGIN, "r0", "origin:7000")
    layout = {f"n{r}.{i:05d}": f"r{r}" for i in range(members // regions + 1) for r in range(regions)}
    layout = dict(list(layout.items())[:members])
    for node, region in layout.items():
        sets.join(node, NODE, region, f"{node}:7000")
    sets.set_object(KEY)
    sets.flush()
    links: dict[str, set[str]] = defaultdict(set)
    for node, region in layout.items():
        view = sets.view(node)
        same = sorted((e["id"] for e in view if e["role"] == NODE and e["region"] == region),
                      key=lambda p: rank(node, p))[:SAME_REGION_PEERS]
        other = [e["id"] for e in view if e["role"] == NODE and e["region"] != region]
        for p in [*same, *other, OR]:
            links[node].add(p)
            links[p].add(node)
    return layout, links, sets


class Network:
    """Links that serve transfers in order at their rates (see the module doc)."""

    def __init__(self, region_of: dict[str, str], lan: float, wan: dict[str, float], lan_s: float, wan_s: float):
        self.region_of, self.lan, self.wan, self.lan_s, self.wan_s = region_of, lan, wan, lan_s, wan_s
        self.free: dict[tuple, float] = defaultdict(float)
        self.wan_in: dict[str, int] = defaultdict(int)
        self.wan_out: dict[str, int] = defaultdict(int)
        self.sent: dict[str, int] = defaultdict(int)

    def transfer(self, src: str, dst: str, size: int, now: float) -> float:
        """When a chunk of `size` bytes asked for at `now` by `dst` is whole at `dst`."""
        ra, rb = self.region_of[src], self.region_of[dst]
        lat = self.lan_s if ra == rb else self.wan_s
        start = now + lat  # the request's trip
        hops = [(("up", src), self.lan), (("down", dst), self.lan)]
        if ra != rb:
            hops += [(("out", ra), self.wan[ra]), (("in", rb), self.wan[rb])]
            self.wan_out[ra] += size
            self.wan_in[rb] += size
        self.sent[src] += size
        done = start
        for link, rate in hops:
            t = max(start, self.free[link]) + size / rate
            self.free[link] = t
            done = max(done, t)
        return done + lat


def simulate(members: int, args) -> dict:
    wall0, cpu0 = time.monotonic(), time.process_time()
    wan_gbps = [float(x) for x in args.wan_gbps.split(",")]
    regions = args.regions
    wan = {f"r{r}": wan_gbps[r % len(wan_gbps)] * 1e9 / 8 for r in range(regions)}
    lan = args.lan_gbps * 1e9 / 8
    patch = args.patch_mib << 20
    size = patch // args.chunks
    layout, links, _ = build_swarm(members, regions, args.seed)
    region_of = {**layout, OR: "r0"}
    net = Network(region_of, lan, wan, args.lan_ms / 1e3, args.wan_ms / 1e3)
    by_region: dict[str, list[str]] = defaultdict(list)
    for node, region in layout.items():
        by_region[region].append(node)
    pickers: dict[str, PiecePicker] = {}
    for i, (node, region) in enumerate(layout.items()):
        p = PiecePicker(node, region, "r0", seed=args.seed * 1_000_003 + i)
        # The picker's member set is the node's peer set: its region, its samples, the gateways.
        known = {q: region_of[q] for q in links[node] if q != OR}
        known.update((q, region) for q in by_region[region])
        known[node] = region
        p.set_members(known)
        for q in sorted(links[node]):
            p.peer_joined(q, ORIGIN if q == OR else NODE, region_of[q])
        p.add_object(KEY, args.chunks, now=0.0)
        if OR in links[node]:
            p.peer_has(OR, KEY, range(args.chunks))
        pickers[node] = p
    setup_s = time.monotonic() - wall0

    tick = args.tick_ms / 1e3
    events: list[tuple[float, int, str, str, int]] = []  # (time, seq, node, peer, chunk)
    seq = 0
    have: dict[str, set[int]] = {n: set() for n in layout}
    cancelled: set[tuple[str, str, int]] = set()
    done_at: dict[str, float] = {}
    wake: dict[str, float] = {}
    dirty = set(layout)
    now = 0.0
    requests = 0
    while len(done_at) < len(layout):
        for node in sorted(dirty):
            p = pickers[node]
            for r in p.requests(now):
                requests += 1
                seq += 1
                heapq.heappush(events, (net.transfer(r.peer, node, size, now), seq, node, r.peer, r.chunk))
            if node not in done_at:
                w = p.next_wakeup(now)
                if w is not None and w < wake.get(node, float("inf")):
                    wake[node] = w
        dirty.clear()
        due = [*wake.values(), *([events[0][0]] if events else [])]
        if not due:
            missing = {n: pickers[n].missing(KEY) for n in layout if n not in done_at}
            raise RuntimeError(f"deadlock at t={now:.3f}: nobody can request; {len(missing)} nodes missing chunks")
        now = max(now + tick, min(due))
        for node in [n for n, w in wake.items() if w <= now]:
            del wake[node]
            dirty.add(node)
        while events and events[0][0] <= now:
            t, _, node, peer, c = heapq.heappop(events)
            if (node, peer, c) in cancelled:
                cancelled.discard((node, peer, c))
                continue
            p = pickers[node]
            for x in p.chunk_received(KEY, c, peer):
                cancelled.add((node, x.peer, x.chunk))
            dirty.add(node)
            if c in have[node]:
                continue
            have[node].add(c)
            if len(have[node]) == args.chunks:
                done_at[node] = t
            for q in links[node]:
                if q != OR and q not in done_at:
                    pickers[q].peer_has(node, KEY, [c])
                    dirty.add(q)
    rows = []
    w0 = wan["r0"]
    for r in range(regions):
        region = f"r{r}"
        nodes = by_region.get(region)
        if not nodes:
            continue
        bound = patch / (lan if region == "r0" else min(lan, wan[region], w0))
        last = max(done_at[n] for n in nodes)
        rows.append({"region": region, "wan_gbps": wan[region] * 8 / 1e9, "nodes": len(nodes), "last_s": last,
                     "bound_s": bound, "ratio": last / bound, "wan_in_over_patch": net.wan_in[region] / patch,
                     "wan_out_over_patch": net.wan_out[region] / patch})
    everyone = max(done_at.values())
    bound = max(r["bound_s"] for r in rows)
    return {"members": members, "regions": regions, "rows": rows, "everyone_s": everyone, "bound_s": bound,
            "ratio": everyone / bound, "origin_out_over_patch": net.sent[OR] / patch, "requests": requests,
            "setup_s": setup_s, "wall_s": time.monotonic() - wall0, "cpu_s": time.process_time() - cpu0}


def format_result(res: dict, args) -> str:
    lines = [f"{res['members']} members in {res['regions']} regions, patch {args.patch_mib} MiB in {args.chunks} "
             f"chunks, host links {args.lan_gbps:g} Gbit/s, latency {args.lan_ms:g} ms / {args.wan_ms:g} ms (LAN/WAN)",
             "region  WAN Gbit/s   nodes   last s  bound s  last/bound  WAN in/patch  WAN out/patch"]
    for r in res["rows"]:
        lines.append(f"{r['region']:6s} {r['wan_gbps']:11.1f} {r['nodes']:7d} {r['last_s']:8.2f} {r['bound_s']:8.2f} "
                     f"{r['ratio']:11.2f} {r['wan_in_over_patch']:13.2f} {r['wan_out_over_patch']:14.2f}")
    lines.append(f"every member: {res['everyone_s']:.2f} s; WAN bound (slowest region) {res['bound_s']:.2f} s; "
                 f"ratio {res['ratio']:.2f}; origin out {res['origin_out_over_patch']:.2f}x the patch; "
                 f"{res['requests']:,} requests; simulated in {res['wall_s']:.0f} s wall ({res['setup_s']:.0f} s setup), "
                 f"{res['cpu_s']:.0f} s CPU")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default="1000,10000")
    ap.add_argument("--regions", type=int, default=8)
    ap.add_argument("--wan-gbps", default="10,5,2,1,10,0.5,3,1", help="per region (r0 holds the origin), cycled")
    ap.add_argument("--lan-gbps", type=float, default=25.0, help="every host's uplink and downlink")
    ap.add_argument("--lan-ms", type=float, default=0.2)
    ap.add_argument("--wan-ms", type=float, default=30.0)
    ap.add_argument("--patch-mib", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--tick-ms", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    for n in [int(x) for x in args.members.split(",")]:
        print(format_result(simulate(n, args), args), flush=True)
    print(TARGETS)


if __name__ == "__main__":
    main()
