"""WAN bench: patchswarm, the patchswarm star and libtorrent moving one real patch over an emulated multi-region WAN.

Each system runs in a fresh `bench.netemu.Topology` (regions are bridges, each
host its own namespace, regions joined by a router whose per-region links are
tbf-limited both ways) and delivers the same payload: the patch between two
consecutive served bf16 checkpoints of a generated model (`bench.wan_runner.
make_payload`, cached under /tmp/patchswarm-wan-payload). One table: time until
every node holds the patch ("fetch"; patchswarm also reports "applied": until
every node runs the new version), the lower bound (`WanSpec.lower_bound_s`; for
patchswarm run with `--node-args "--download-limit X"`, at least the patch at X), WAN
bytes into each region ÷ patch, origin bytes out ÷ patch; then the scaling
rows (nodes per region at fixed WAN). A system that cannot run here (not
built, not installed) is listed as skipped with the reason.

Two conditions real fleets have (issue 26): `--region-mbit 100,50,20` gives
each region its own WAN rate (the tracker tells every patchswarm member
them, its `--wan-rates`; the system `patchswarm-blind` runs the plan without them), and
the system `patchswarm-faults` SIGKILLs one gateway of each remote region
`--kill-at` s after the announcement and restarts one at `--restart-at`;
`libtorrent-faults` does the same to the leechers of the same names (SIGKILL at
`--kill-at` s after `go`, the first restarted on its save dir at
`--restart-at`). Both add a per-region table (each region's time against its
own bound, its longest stall), and with faults each never-killed node's time
against the same system's run without them.

Declared uplinks: every patchswarm daemon is started with `--uplink-mbit`, its
host's link rate (`--lan-mbit`, or its `--slow-uplink` rate), so the plan gives a
slow member a smaller share; `--no-declare-uplinks` leaves them out (the plan
without them), for a side-by-side run of the same topology, and
`--slow-declares-lan` has the slow ones declare the LAN's rate (a host slower
than it says). Measured uplinks: members say what they measured while relaying
(protocol/uplinkmeter.py `reported_uplink`), which a version's plan takes only
once said; `--warmup` fetches one version untimed first and times the next.

Hosts behind NAT (issue 22): the system `patchswarm-nat` runs patchswarm on the
same topology with one remote region (`--nat-region`, default the last) behind
NAT (`netemu.WanSpec.nat_regions`: masquerade out, nothing new in); its nodes
run `--no-listen`, every node `--transport auto`, so they are reached over
WebRTC data channels signalled through the tracker (host candidates; peer-
reflexive through the NAT) and dial the others over TCP. Run beside
`patchswarm`, a table gives each region's time against the all-TCP run's.

"max stall s" is, per node, the longest it went without progress while it
lacked part of the patch, from the start of its fetch, on its own clock:
patchswarm, the longest gap between the node learning of the version (its
fetch of the patch starting) or a chunk arriving verified and the next chunk
doing so (the daemon's status `longest_wait_s`; a chunk is ~0.9 MB);
libtorrent, the longest gap between `go` or a piece passing its hash check
and the next piece doing so (piece_finished_alert timestamps; a piece is
--piece-kib, 64 KiB). A region's value is its worst node's.

"CPU busy" (patchswarm) is how busy the machine's cores were from the
announcement until the region's last node held everything (every process,
sampled at each status read): where it nears 100 %, the shared cores may be the
region's limit. In brackets, the part of it in the kernel (system, irq,
softirq): mostly the emulated links' packet work, which no nice value moves.
`--nice-regions 1,2` runs those regions' processes at nice 10, so the others go
first for the cores, as if they had their own: what the sharing costs a region.

Run (root): `python bench/wan.py [--regions 3] [--nodes 4] [--wan-mbit 100]
[--region-mbit R0,R1,..] [--lan-mbit 1000] [--systems libtorrent,patchswarm,star,...]
[--scaling 2,4,8]`; `python bench/wan.py --cleanup` removes namespaces a killed
run left (psw-*).
Importing this module does no work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench import netemu  # noqa: E402
from bench.wan_libtorrent import DEFAULT_PIECE_BYTES, LibtorrentRunner  # noqa: E402
from bench.wan_patchswarm import PatchswarmRunner, first_gateways  # noqa: E402
from bench.wan_runner import Faults, Payload, RunFailed, Runner, RunResult, SystemUnavailable, make_payload  # noqa: E402

SYSTEMS = ("libtorrent", "patchswarm", "star", "patchswarm-blind", "patchswarm-faults", "libtorrent-faults",
           "patchswarm-nat")
DEFAULT_SYSTEMS = SYSTEMS[:-1]  # the NAT variant runs when asked for (its WebRTC CPU is the 2-core box's limit)
TARGETS = "targets (issue 4): time <= 1.3 x bound; WAN in <= 1.15 x patch; origin out <= 1.5 x patch; >= 2x faster than libtorrent"


def make_runner(name: str, args: argparse.Namespace) -> Runner:
    faults = Faults(args.kill_at, args.restart_at) if name.endswith("-faults") else None
    if name in ("libtorrent", "libtorrent-faults"):
        return LibtorrentRunner(piece_bytes=args.piece_kib * 1024, unchoke_slots=args.unchoke_slots,
                                log_dir=args.logs, faults=faults, victims=first_gateways)
    if name in ("patchswarm", "star", "patchswarm-blind", "patchswarm-faults", "patchswarm-nat"):
        nat = args.regions - 1 if args.nat_region is None else args.nat_region
        return PatchswarmRunner(no_peers=name == "star", verbose=args.verbose, log_dir=args.logs,
                                chunk_bytes=None if args.chunk_kib is None else args.chunk_kib * 1024,
                                node_args=shlex.split(args.node_args), tell_rates=name != "patchswarm-blind",
                                faults=faults, nat_regions=(nat,) if name == "patchswarm-nat" else (),
                                declare_uplinks=not args.no_declare_uplinks, link_trace=args.link_trace,
                                link_trace_step_s=args.link_trace_ms / 1000,
                                slow_declares_lan=args.slow_declares_lan, warmup=args.warmup)
    raise ValueError(f"system: expected one of {SYSTEMS}, found {name!r}")


def format_regions(rows: list[RunResult]) -> str:
    """Per region: when its last node held everything, against that region's own bound."""
    head = ["system", "region", "WAN Mbit/s", "time s", "bound s", "time/bound", "max stall s", "WAN in/P", "CPU busy (kernel)"]
    lines = []
    for r in rows:
        for g in range(r.spec.regions):
            t = r.region_s(g)
            if t is None:
                continue
            stall = max((v for n, v in r.stall_s.items() if n.startswith(f"n{g}.")), default=None)
            lines.append([r.system, f"r{g}{' (origin)' if g == r.spec.origin_region else ''}",
                          f"{r.spec.region_wan_mbit(g):g}", f"{t:.2f}", f"{r.region_bound_s(g):.2f}",
                          f"{t / r.region_bound_s(g):.2f}", "-" if stall is None else f"{stall:.2f}",
                          f"{r.wan_in_over_patch[g]:.3f}", _busy(r, t)])
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*l) for l in lines)])


def _busy(r: RunResult, until_s: float) -> str:
    """The machine's CPU busy in a region's window, and (in brackets) busy in the kernel."""
    busy, kernel = r.busy_share(until_s), r.busy_share(until_s, kernel=True)
    return "-" if busy is None else f"{100 * busy:.0f} % ({100 * kernel:.0f} %)"


def nat_comparison(tcp: RunResult, nat: RunResult) -> str:
    """Each region's time with one region behind NAT against the same topology all on TCP."""
    head = ["region", "all-TCP s", "NAT run s", "ratio"]
    lines = []
    for g in range(tcp.spec.regions):
        a, b = tcp.region_s(g), nat.region_s(g)
        if a is None or b is None:
            continue
        tag = " (origin)" if g == tcp.spec.origin_region else " (NAT)" if g in nat.spec.nat_regions else ""
        lines.append([f"r{g}{tag}", f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}"])
    lines.append(["all", f"{tcp.seconds:.2f}", f"{nat.seconds:.2f}", f"{nat.seconds / tcp.seconds:.2f}"])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*l) for l in lines)])


def fault_comparison(clean: RunResult, faulty: RunResult) -> str:
    """Each node that was never killed: its time with the faults against without (the same system)."""
    ratios = {n: t / clean.per_node_s[n] for n, t in faulty.per_node_s.items() if n in clean.per_node_s}
    worst = max(ratios, key=ratios.get)
    return (f"faults vs none, nodes never killed: slowest {faulty.seconds:.2f} s vs {clean.seconds:.2f} s; "
            f"per node worst {ratios[worst]:.2f}x ({worst}), median {sorted(ratios.values())[len(ratios) // 2]:.2f}x; "
            f"longest stall {max(faulty.stall_s.values(), default=0):.2f} s "
            f"(without faults {max(clean.stall_s.values(), default=0):.2f} s)")


def run_one(spec: netemu.WanSpec, runner, payload: Payload, limit_s: float, check_links: bool) -> RunResult:
    """One system on a fresh topology of `spec` (built and torn down here)."""
    with netemu.Topology(spec) as topo:
        if check_links:
            _print_link_check(topo)
        return runner.run(topo, payload, limit_s)


def _print_link_check(topo: netemu.Topology) -> None:
    """Measure one cross-region TCP transfer so the table's limits are seen to hold."""
    remote = [h for h in topo.nodes if h.region != topo.spec.origin_region]
    if not remote:
        return
    nbytes = int(topo.spec.region_wan_mbit(remote[0].region) * 1e6 / 8)
    rate = netemu.tcp_throughput(topo, topo.origin, remote[0], nbytes)
    print(f"link check: one TCP flow origin -> {remote[0].name} (other region): "
          f"{rate * 8 / 1e6:.1f} Mbit/s of payload over a {topo.spec.region_wan_mbit(remote[0].region):g} Mbit/s "
          f"WAN link", flush=True)


def median_run(runs: list[RunResult]) -> RunResult:
    """The run with the median time (the lower middle one for an even count), bytes included."""
    return sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]


def format_table(rows: list[RunResult], regions: int) -> str:
    head = ["system", "nodes", "fetch s", "bound s", "fetch/bound", "applied s",
            *[f"WAN in r{r}/P" for r in range(regions)], "max WAN in/P", "origin out/P"]
    lines = []
    for r in rows:
        wan = r.wan_in_over_patch
        remote = [w for i, w in enumerate(wan) if i != r.spec.origin_region] or wan
        lines.append([r.system, f"{r.spec.regions}x{r.spec.nodes_per_region}", f"{r.seconds:.2f}", f"{r.bound_s:.2f}",
                      f"{r.time_over_bound:.2f}", "-" if r.applied_s is None else f"{r.applied_s:.2f}",
                      *[f"{w:.3f}" for w in wan], f"{max(remote):.3f}",
                      f"{r.origin_out_over_patch:.3f}"])
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*l) for l in lines)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regions", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=4, help="nodes per region (default 4)")
    ap.add_argument("--wan-mbit", type=float, default=100.0, help="each region's WAN link, each way")
    ap.add_argument("--lan-mbit", type=float, default=1000.0, help="each host's link, each way")
    ap.add_argument("--wan-delay-ms", type=float, default=0.0, help="one-way delay per WAN link (needs sch_netem)")
    ap.add_argument("--region-mbit", default="", metavar="R0,R1,...",
                    help="each region's own WAN rate, Mbit/s each way (instead of --wan-mbit); the patchswarm "
                         "tracker tells every member them (--wan-rates); add patchswarm-blind to --systems for the rate-blind plan")
    ap.add_argument("--nice-regions", default="", metavar="R,...",
                    help="these regions' processes run at nice 10, so the others go first for the shared cores")
    ap.add_argument("--slow-uplink", default="", metavar="NODE=MBIT,...",
                    help="these nodes' uplinks at MBIT Mbit/s instead of --lan-mbit (e.g. n0.2=10: one member of "
                         "the origin's region a slower or busier machine); downlinks stay at --lan-mbit")
    ap.add_argument("--no-declare-uplinks", action="store_true",
                    help="patchswarm/star: daemons declare no uplink (by default each declares its link's rate, "
                         "--uplink-mbit: --lan-mbit, or its --slow-uplink rate), for side-by-side runs")
    ap.add_argument("--slow-declares-lan", action="store_true",
                    help="patchswarm/star: --slow-uplink nodes declare --lan-mbit (a host slower or busier than it "
                         "says), so only what they measure can tell the plan")
    ap.add_argument("--warmup", action="store_true",
                    help="patchswarm: fetch one version untimed first, so the uplinks members measure while relaying "
                         "it (and say to the tracker) are in the timed version's plan")
    ap.add_argument("--kill-at", type=float, default=1.0,
                    help="*-faults: SIGKILL one gateway per remote region (libtorrent: the leecher of the same "
                         "name) this many s after the announcement (libtorrent: after `go`)")
    ap.add_argument("--restart-at", type=float, default=3.0,
                    help="*-faults: restart the first remote region's killed node then (< 0: never)")
    ap.add_argument("--no-idle-restart", action="store_true",
                    help="hosts tuned as WAN data movers (net.ipv4.tcp_slow_start_after_idle=0), for every system")
    ap.add_argument("--tcp-cc", default="", metavar="NAME",
                    help="every host's TCP congestion control (default: the kernel's, named in the topology line)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"any of {','.join(SYSTEMS)}")
    ap.add_argument("--nat-region", type=int, help="patchswarm-nat: the region behind NAT (default: the last)")
    ap.add_argument("--scaling", default="2,4,8", help="nodes per region for the scaling rows ('' for none)")
    ap.add_argument("--model", default="medium", help="tests/synthetic.py model size for the payload")
    ap.add_argument("--lr", type=float, default=1e-2, help="RL step learning rate (sets the patch size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=float, default=300.0, help="per run")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; the row is the median run")
    ap.add_argument("--piece-kib", type=int, default=DEFAULT_PIECE_BYTES // 1024, help="libtorrent piece size")
    ap.add_argument("--chunk-kib", type=int, help="patchswarm/star: the origin's chunk size (default: its own)")
    ap.add_argument("--node-args", default="", metavar="ARGS",
                    help="patchswarm/star: extra flags for every `patchswarm node`, e.g. '--apply-nice 0'")
    ap.add_argument("--unchoke-slots", type=int, default=8, help="libtorrent unchoke slots (-1: everyone)")
    ap.add_argument("--link-trace", type=int, metavar="REGION",
                    help="patchswarm: sample every host's link and every WAN link during the fetch "
                         "(bench/linktrace.py) and print, per interval, this region's hosts' links and what feeds "
                         "the region (the origin's uplink, or the region's WAN link); with --logs, all of them "
                         "go to link-trace.json")
    ap.add_argument("--link-trace-ms", type=float, default=100.0, help="--link-trace's interval (default 100 ms)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--cleanup", action="store_true", help="remove leftover psw-* namespaces and exit")
    ap.add_argument("--logs", type=Path,
                    help="keep every process's log under LOGS/<system>-<R>x<N>-<K>/, a folder per run (K = 1, 2, ...: "
                         "the first not there yet)")
    ap.add_argument("-v", "--verbose", action="store_true", help="daemons log at debug level")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = netemu.unavailable_reason()
    if reason:
        print(f"bench/wan.py: {reason}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so every `finally` tears its topology down.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.cleanup:
        gone = netemu.cleanup()
        print(f"removed {len(gone)} namespaces" + (f": {' '.join(gone)}" if gone else ""))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    if args.restart_at is not None and args.restart_at < 0:
        args.restart_at = None
    runners = {s: make_runner(s, args) for s in systems}
    region_mbit = tuple(float(x) for x in args.region_mbit.split(",") if x)
    try:
        spec = netemu.WanSpec(args.regions, args.nodes, max(region_mbit, default=args.wan_mbit), args.lan_mbit,
                              args.wan_delay_ms, idle_restart=not args.no_idle_restart, region_mbit=region_mbit,
                              tcp_congestion=args.tcp_cc,
                              nice_regions=tuple(int(x) for x in args.nice_regions.split(",") if x),
                              slow_uplinks=_slow_uplinks(args.slow_uplink))
    except ValueError as e:
        print(f"bench/wan.py: {e}", file=sys.stderr)
        return 2
    if args.link_trace is not None and not 0 <= args.link_trace < spec.regions:
        print(f"--link-trace: expected a region in 0..{spec.regions - 1}, found {args.link_trace}", file=sys.stderr)
        return 2
    if not args.link_trace_ms > 0:
        print(f"--link-trace-ms: expected > 0, found {args.link_trace_ms}", file=sys.stderr)
        return 2
    t = time.monotonic()
    payload = make_payload(args.model, args.lr, args.seed)
    print(f"payload: patch of {payload.label}: {payload.patch_bytes:,} bytes ({time.monotonic() - t:.1f} s to load/make)")
    wan_text = ("/".join(f"{x:g}" for x in spec.region_mbit) if spec.region_mbit else f"{spec.wan_mbit:g}")
    print(f"topology: {spec.regions} regions x {spec.nodes_per_region} nodes, WAN {wan_text} Mbit/s "
          f"each way per region, LAN {spec.lan_mbit:g} Mbit/s, WAN delay {spec.wan_delay_ms:g} ms; TCP "
          f"{'kernel default (slow start after idle)' if spec.idle_restart else 'tcp_slow_start_after_idle=0 on every host'}"
          f", congestion control {spec.tcp_congestion or netemu.default_congestion_control() + ' (the kernel default)'}"
          + (f"; processes of regions {','.join(map(str, spec.nice_regions))} at nice {netemu.NICE}"
             if spec.nice_regions else "")
          + (f"; slow uplinks {', '.join(f'{n} {m:g} Mbit/s' for n, m in spec.slow_uplinks)}"
             if spec.slow_uplinks else "")
          + ("; patchswarm daemons declare no uplink" if args.no_declare_uplinks
             else "; patchswarm daemons declare the LAN's rate, the slow ones too" if args.slow_declares_lan
             else "; patchswarm daemons declare their uplinks (--uplink-mbit)"), flush=True)

    sizes = [args.nodes] + [int(n) for n in args.scaling.split(",") if n and int(n) != args.nodes]
    rows: list[RunResult] = []
    skipped: dict[str, str] = {}
    notes: list[tuple[str, str]] = []        # (row name, text)
    for name, runner in list(runners.items()):
        why = runner.available()
        if why:
            skipped[name] = why
            del runners[name]
    check_links = True
    try:
        for n in sizes:
            for name, runner in runners.items():
                s = dataclasses.replace(spec, nodes_per_region=n, nat_regions=getattr(runner, "nat_regions", ()))
                tries: list[RunResult] = []
                for _ in range(args.repeat):
                    try:
                        tries.append(run_one(s, runner, payload, args.limit_s, check_links))
                    except SystemUnavailable as e:
                        skipped[f"{name} {s.regions}x{n}"] = str(e)
                        break
                    except (RunFailed, netemu.TopologyError) as e:
                        print(f"{name} {s.regions}x{n}: FAILED: {e}{_logs_note(runner)}", flush=True)
                        continue
                    finally:
                        check_links = False
                    t = tries[-1]
                    applied = "" if t.applied_s is None else f", applied {t.applied_s:.2f} s"
                    print(f"  {name} {s.regions}x{n}: fetch {t.seconds:.2f} s (bound {t.bound_s:.2f} s){applied}; "
                          f"WAN in/P {' '.join(f'{w:.2f}' for w in t.wan_in_over_patch)}, "
                          f"origin out/P {t.origin_out_over_patch:.2f}{_logs_note(runner)}", flush=True)
                    if t.link_table:
                        print(t.link_table, flush=True)
                if tries:
                    r = median_run(tries)
                    rows.append(r)
                    row_name = f"{r.system} {s.regions}x{n}"
                    notes += [(row_name, x) for x in r.notes]
                    notes.append((row_name, "WAN out of each region / P: " + ", ".join(
                        f"r{i} {b / r.patch_bytes:.2f}" for i, b in enumerate(r.moved.wan_out))))
                    if len(tries) > 1:
                        notes.append((row_name, f"median of {len(tries)} runs; times "
                                      + ", ".join(f"{t.seconds:.2f}" for t in tries) + " s"))
                        if s.regions > 1:  # the region rows are the median run's: each region's spread
                            notes += [(row_name, f"r{g} per run: " + ", ".join(
                                f"{t.region_s(g):.2f}" for t in tries if t.region_s(g) is not None) + " s")
                                for g in range(s.regions)]
    except KeyboardInterrupt:
        print("interrupted; namespaces and processes torn down", file=sys.stderr)
        return 130

    print()
    main_rows = [r for r in rows if r.spec.nodes_per_region == args.nodes]
    print(format_table(main_rows, spec.regions))
    if spec.region_mbit or any(s.endswith("-faults") for s in runners):
        print("\nper region: when its last node held everything, against its own bound")
        print(format_regions(main_rows))
    tcp = next((r for r in main_rows if r.system == "patchswarm"), None)
    for nat in (r for r in main_rows if r.spec.nat_regions):
        if tcp is not None:
            print(f"\n{nat.system} against patchswarm all on TCP: each region's time (announced -> its last "
                  f"node holds everything)")
            print(nat_comparison(tcp, nat))
    for faulty in (r for r in main_rows if " kill@" in r.system):
        clean = next((r for r in main_rows if r.system == faulty.system.split(" kill@")[0]), None)
        if clean is not None:
            notes.append((faulty.system, fault_comparison(clean, faulty)))
    scaling = [int(n) for n in args.scaling.split(",") if n]
    if scaling:
        order = {name: i for i, name in enumerate(systems)}
        rows_s = sorted((r for r in rows if r.spec.nodes_per_region in scaling),
                        key=lambda r: (order.get(r.system, 99), r.spec.nodes_per_region))
        print(f"\nscaling: nodes per region {args.scaling} at WAN {spec.wan_mbit:g} Mbit/s")
        print(format_table(rows_s, spec.regions))
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}")
    where: dict[str, list[str]] = {}
    for row_name, text in notes:
        where.setdefault(text, []).append(row_name)
    for text, names in where.items():
        print(f"note: {', '.join(names)}: {text}")
    print(f"P = patch bytes ({payload.patch_bytes:,}); fetch = the version announced -> the last node holds every "
          f"chunk, verified (what the bound and libtorrent's 'done' measure); applied = -> the last node runs it "
          f"(patch applied, state hash checked, weights file replaced; CPU); WAN in = bytes the router sent into a "
          f"region, link-layer (headers included); max WAN in = over the regions other than the origin's; {TARGETS}")
    if args.json:
        args.json.write_text(json.dumps([_row_json(r) for r in rows], indent=1) + "\n")
    return 0 if rows or not systems else 1


def _slow_uplinks(text: str) -> tuple[tuple[str, float], ...]:
    """`--slow-uplink n0.2=10,n1.1=20` as WanSpec.slow_uplinks."""
    out = []
    for item in (x for x in text.split(",") if x):
        name, sep, mbit = item.partition("=")
        try:
            out.append((name, float(mbit)))
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"--slow-uplink: expected NODE=MBIT[,NODE=MBIT...], found {text!r}")
    return tuple(out)


def _logs_note(runner) -> str:
    """Where the run just ended kept its logs (`--logs`), for its line."""
    kept = getattr(runner, "last_logs", None)
    return "" if kept is None else f"; logs {kept}"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _row_json(r: RunResult) -> dict:
    return {"system": r.system, "regions": r.spec.regions, "nodes_per_region": r.spec.nodes_per_region,
            "wan_mbit": r.spec.wan_mbit, "lan_mbit": r.spec.lan_mbit, "patch_bytes": r.patch_bytes,
            "seconds": r.seconds, "applied_s": r.applied_s, "bound_s": r.bound_s, "per_node_s": r.per_node_s,
            "wan_in": list(r.moved.wan_in), "wan_out": list(r.moved.wan_out),
            "origin_out": r.moved.host_tx["origin"], "notes": r.notes}


if __name__ == "__main__":
    sys.exit(main())
