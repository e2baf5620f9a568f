"""The emulated WAN (bench/netemu.py) and the WAN bench's systems on a small topology.

Needs root and network namespaces: skipped with the reason otherwise. A
`patchswarm node` that does not start (`--help` failing) fails the patchswarm test.
2 regions x 2 nodes, 20 Mbit/s WAN, a small real patch, version 0 pre-placed
on every node (the runner fails a run that fetched anything for it): well
under a minute.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from aptinstall import ensure_command
from bench import netemu

pytestmark = pytest.mark.slow  # real processes

REASON = netemu.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated WAN unavailable: {REASON}")

WAN_MBIT, LAN_MBIT = 20.0, 200.0
SMALL = netemu.WanSpec(regions=2, nodes_per_region=2, wan_mbit=WAN_MBIT, lan_mbit=LAN_MBIT)


@pytest.fixture(scope="module")
def payload():
    from bench.wan_runner import make_payload

    return make_payload("tiny", lr=1e-2, seed=0)


def _ours(topo: netemu.Topology) -> list[str]:
    return sorted(set(netemu.leftover_namespaces()) & set(topo.namespaces))


@needs_netns
def test_cross_region_tcp_is_held_to_the_wan_rate_and_everything_is_torn_down():
    with netemu.Topology(SMALL) as topo:
        assert len(_ours(topo)) == 1 + 2 + 2 + 4      # router, regions, origin + tracker, nodes
        assert len(topo.namespaces) == 9
        a, b = topo.nodes_in(0)[0], topo.nodes_in(1)[0]
        before = topo.counters()
        wan_rate = netemu.tcp_throughput(topo, a, b, 5_000_000)
        moved = topo.counters() - before
        lan_rate = netemu.tcp_throughput(topo, a, topo.nodes_in(0)[1], 10_000_000)
        procs = topo.processes
    wan_bytes = WAN_MBIT * 1e6 / 8
    assert 0.5 * wan_bytes < wan_rate < 2.0 * wan_bytes, f"cross-region {wan_rate * 8 / 1e6:.1f} Mbit/s"
    assert lan_rate > 3 * wan_rate, f"same-region {lan_rate * 8 / 1e6:.1f} vs cross {wan_rate * 8 / 1e6:.1f} Mbit/s"
    # The payload crossed into region 1 once, with headers (< 10 %), and nothing went into region 0
    # beyond ACKs.
    assert 5_000_000 <= moved.wan_in[1] < 5_500_000
    assert moved.wan_in[0] < 0.05 * 5_000_000
    assert all(p.poll() is not None for p in procs)
    assert _ours(topo) == []


@needs_netns
def test_namespaces_and_processes_go_on_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with netemu.Topology(netemu.WanSpec(regions=2, nodes_per_region=1)) as topo:
            sleeper = topo.spawn(topo.nodes[0], ["sleep", "60"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert _ours(topo) == []


@needs_netns
@pytest.mark.parametrize("idle_restart", [True, False])
def test_hosts_keep_or_drop_tcp_slow_start_after_idle(idle_restart):
    import subprocess

    with netemu.Topology(netemu.WanSpec(regions=1, nodes_per_region=1, idle_restart=idle_restart)) as topo:
        for h in topo.hosts:
            out = subprocess.run(["ip", "netns", "exec", h.netns, "cat", "/proc/sys/net/ipv4/tcp_slow_start_after_idle"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
            assert out == ("1" if idle_restart else "0"), h.name


@needs_netns
def test_processes_of_nice_regions_run_at_nice_10_and_the_others_at_ours():
    import os
    import subprocess

    show = ["python3", "-c", "import os; print(os.nice(0))"]
    with netemu.Topology(netemu.WanSpec(regions=2, nodes_per_region=1, nice_regions=(1,))) as topo:
        procs = {h.region: topo.spawn(h, show, stdout=subprocess.PIPE, text=True) for h in topo.nodes}
        seen = {r: int(p.communicate(timeout=10)[0]) for r, p in procs.items()}
    assert seen == {0: os.nice(0), 1: os.nice(0) + netemu.NICE}
    with pytest.raises(ValueError, match="nice_regions"):
        netemu.WanSpec(regions=2, nice_regions=(2,))


@needs_netns
def test_hosts_take_the_named_congestion_control_or_the_kernels():
    import subprocess

    def seen(spec):
        with netemu.Topology(spec) as topo:
            return {subprocess.run(["ip", "netns", "exec", h.netns, "cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
                                   capture_output=True, text=True, timeout=10, check=True).stdout.strip()
                    for h in topo.hosts}

    assert seen(netemu.WanSpec(regions=1, nodes_per_region=1, tcp_congestion="reno")) == {"reno"}
    assert seen(netemu.WanSpec(regions=1, nodes_per_region=1)) == {netemu.default_congestion_control()}
    with pytest.raises(ValueError, match="tcp_congestion: expected one of the kernel's"):
        netemu.WanSpec(regions=1, tcp_congestion="no-such-algorithm")


@needs_netns
def test_the_link_trace_counts_a_transfer_as_its_two_links_did():
    from bench.linktrace import LinkTrace, rate_table

    with netemu.Topology(netemu.WanSpec(regions=1, nodes_per_region=2, lan_mbit=LAN_MBIT)) as topo:
        a, b = topo.nodes_in(0)
        trace = LinkTrace({h.name: (h.netns, h.iface) for h in (a, b)}, sample_s=0.005)
        before = topo.counters()
        trace.start()
        netemu.tcp_throughput(topo, a, b, 5_000_000)
        trace.stop()
        moved = topo.counters() - before
    sent = [tx for _, _, tx in trace.samples[a.name]]
    got = [rx for _, rx, _ in trace.samples[b.name]]
    assert len(sent) > 10 and sent == sorted(sent) and got == sorted(got)
    # What the trace saw move is what the links' own counters say moved (its window is inside theirs).
    assert 5_000_000 <= sent[-1] - sent[0] <= moved.host_tx[a.name]
    assert 5_000_000 <= got[-1] - got[0] <= moved.host_rx[b.name]
    # Over both hosts' samples: under load one host's sampling may begin or end a bin later than
    # the other's (with the suite beside it, the table once lost 70 kB of what b's link took).
    t0 = min(trace.samples[h.name][0][0] for h in (a, b))
    span = max(trace.samples[h.name][-1][0] for h in (a, b)) - t0
    table = rate_table(trace.samples, [(a.name, "tx"), (b.name, "rx")], t0, span + 0.05, 0.05)
    total_tx, total_rx = (float(x) * 1e6 for x in table.splitlines()[-1].split()[1:])
    assert abs(total_tx - (sent[-1] - sent[0])) <= 0.005e6  # (MB, two decimals)
    assert abs(total_rx - (got[-1] - got[0])) <= 0.005e6


def test_the_rate_table_gives_mbit_per_interval_from_the_counters():
    from bench.linktrace import rate_table

    # 1 MB every 0.1 s on x's uplink from t=100 (80 Mbit/s); y's downlink is first sampled at 100.25 (40 Mbit/s):
    # nothing of it before, and the interval that sample falls in counts from it.
    samples = {"x": [(100.0 + k * 0.05, 0, k * 500_000) for k in range(9)],
               "y": [(100.25 + k * 0.05, k * 250_000, 0) for k in range(4)]}
    table = rate_table(samples, [("x", "tx"), ("y", "rx")], t0=100.0, until_s=0.4, step_s=0.1)
    head, *rows, totals = table.splitlines()
    assert head.split() == ["s", "x", "tx", "y", "rx"]
    assert [r.split() for r in rows] == [["0.10", "80.0", "-"], ["0.20", "80.0", "-"],
                                         ["0.30", "80.0", "20.0"], ["0.40", "80.0", "40.0"]]
    assert totals.split() == ["MB", "4.00", "0.75"]  # all y's samples saw: 0.25 MB of it in its first interval
    with pytest.raises(ValueError, match="step_s"):
        rate_table(samples, [("x", "tx")], t0=100.0, until_s=0.4, step_s=0)


@needs_netns
def test_cleanup_removes_leftovers_by_prefix():
    topo = netemu.Topology(netemu.WanSpec(regions=1, nodes_per_region=1), prefix="psw-leftover-")
    topo.__enter__()                 # never closed: what a SIGKILLed run leaves
    left = _ours(topo)
    assert left
    assert sorted(netemu.cleanup("psw-leftover-")) == sorted(left)
    assert _ours(topo) == []


def test_lower_bound_is_the_slowest_link():
    spec = netemu.WanSpec(regions=3, nodes_per_region=4, wan_mbit=100, lan_mbit=1000)
    assert spec.lower_bound_s(12_500_000) == pytest.approx(1.0)           # WAN: 12.5 MB/s
    one_region = netemu.WanSpec(regions=1, nodes_per_region=4, wan_mbit=100, lan_mbit=1000)
    assert one_region.lower_bound_s(125_000_000) == pytest.approx(1.0)    # no WAN crossing: LAN
    slow_lan = netemu.WanSpec(regions=2, nodes_per_region=1, wan_mbit=100, lan_mbit=50)
    assert slow_lan.lower_bound_s(6_250_000) == pytest.approx(1.0)


def test_per_region_rates_give_per_region_bounds():
    spec = netemu.WanSpec(regions=3, nodes_per_region=4, lan_mbit=1000, region_mbit=(100, 50, 20))
    p = 12_500_000  # 1 s at 100 Mbit/s
    assert [spec.region_bound_s(p, r) for r in range(3)] == pytest.approx([0.1, 2.0, 5.0])
    assert spec.lower_bound_s(p) == pytest.approx(5.0)  # the slowest region's
    slow_origin = netemu.WanSpec(regions=2, nodes_per_region=1, region_mbit=(20, 100))
    assert slow_origin.region_bound_s(p, 1) == pytest.approx(5.0)  # every byte leaves region 0
    with pytest.raises(ValueError, match="region_mbit"):
        netemu.WanSpec(regions=3, region_mbit=(100, 50))


def test_a_download_limit_in_the_node_args_bounds_the_run():
    """`--node-args "--download-limit X"` (patchswarm only): the run's bound and every region's
    are at least the patch at X, where the links alone gave 1.83 s for a 300K-limited 76 s."""
    from bench.wan_patchswarm import download_limit
    from bench.wan_runner import RunResult

    assert download_limit(["--download-limit", "300K"]) == 300e3
    assert download_limit(["-v", "--download-limit=2M"]) == 2e6
    assert download_limit(["--upload-limit", "1M"]) is None
    spec = netemu.WanSpec(regions=2, nodes_per_region=1, wan_mbit=100, lan_mbit=1000)
    p = 12_500_000  # 1 s over the 100 Mbit/s WAN
    limited = RunResult("patchswarm", spec, p, 50.0, {}, None, node_download_bps=300e3)
    assert limited.bound_s == pytest.approx(p / 300e3) == limited.region_bound_s(0) == limited.region_bound_s(1)
    plain = RunResult("libtorrent", spec, p, 5.0, {}, None)
    assert plain.bound_s == pytest.approx(1.0) and plain.region_bound_s(0) == pytest.approx(0.1)


def test_nat_regions_exclude_the_origins():
    assert netemu.WanSpec(regions=3, nat_regions=(2,)).nat_regions == (2,)
    with pytest.raises(ValueError, match="nat_regions"):
        netemu.WanSpec(regions=3, nat_regions=(0,))   # the origin's region
    with pytest.raises(ValueError, match="nat_regions"):
        netemu.WanSpec(regions=3, nat_regions=(3,))


_LISTEN = "import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], 5301)); s.listen(8); time.sleep(60)"


@pytest.fixture
def nft():
    """The masquerade of a region behind NAT needs nftables: installed if missing."""
    return ensure_command("nft", "nftables")


@needs_netns
def test_a_region_behind_nat_lets_out_what_its_hosts_start_and_nothing_in(nft):
    import sys

    with netemu.Topology(netemu.WanSpec(regions=2, nodes_per_region=1, nat_regions=(1,))) as topo:
        public, natted = topo.nodes_in(0)[0], topo.nodes_in(1)[0]
        for h in (public, natted):
            topo.spawn(h, [sys.executable, "-c", _LISTEN, h.ip])
        netemu.wait_listening(topo, natted, public.ip, 5301, 10)     # out of the NAT: fine
        netemu.wait_listening(topo, topo.nodes_in(1)[0], natted.ip, 5301, 10)  # its own listener is up
        with pytest.raises(netemu.TopologyError, match="nothing listens"):
            netemu.wait_listening(topo, public, natted.ip, 5301, 3)  # into it: dropped


@needs_netns
def test_libtorrent_baseline_delivers_and_the_counters_see_it(payload):
    pytest.importorskip("libtorrent", reason="libtorrent (dev extra) is not installed")
    from bench.wan_libtorrent import LibtorrentRunner

    with netemu.Topology(SMALL) as topo:
        r = LibtorrentRunner().run(topo, payload, limit_s=60)
    assert set(r.per_node_s) == {h.name for h in topo.nodes}
    assert r.seconds >= 0.5 * r.bound_s
    # Region 1 had to take the whole patch over its WAN link at least once; the origin sent it at least once.
    assert r.moved.wan_in[1] >= payload.patch_bytes
    assert r.moved.host_tx["origin"] >= payload.patch_bytes


@needs_netns
def test_patchswarm_crosses_the_wan_about_once(payload):
    from bench.wan_patchswarm import PatchswarmRunner, unavailable_reason

    why = unavailable_reason()
    assert why is None, why  # the daemon exists: a CLI that cannot start it is a failure, not a skip
    with netemu.Topology(SMALL) as topo:
        # 16 KiB chunks: the small patch in several chunks, so the remote nodes split the WAN work.
        r = PatchswarmRunner(chunk_bytes=16 << 10, link_trace=1, link_trace_step_s=0.05).run(topo, payload, limit_s=50)
    assert set(r.per_node_s) == {h.name for h in topo.nodes}      # every node reached version 1 (hash checked)
    # The link trace of region 1: its nodes' downlinks and uplinks (no origin there), one line per
    # 50 ms through the fetch and a line of totals, which hold at least the patch between them.
    head, *lines, totals = r.link_table.splitlines()[1:]
    assert head.split() == ["s", "wan1", "tx", "n1.1", "rx", "n1.2", "rx", "n1.1", "tx", "n1.2", "tx"]
    assert len(lines) >= r.seconds / 0.05
    assert float(totals.split()[1]) * 1e6 >= payload.patch_bytes  # into the region across its WAN link
    assert sum(float(x) for x in totals.split()[2:4]) * 1e6 >= payload.patch_bytes
    assert 0 < r.seconds <= r.applied_s                         # every chunk held before the version applied
    assert any("swarm patch" in n for n in r.notes)
    # The remote region took the patch across its WAN link about once (headers included), and the
    # origin sent it about once: its region's nodes forward it, the remote one fetches from them.
    assert payload.patch_bytes <= r.moved.wan_in[1] <= 1.3 * payload.patch_bytes, r.moved
    assert r.moved.host_tx["origin"] <= 1.5 * payload.patch_bytes, r.moved
    # The machine's CPU was sampled through the fetch: each region's window has a busy share,
    # up to the kernel's tick (whole jiffies per core) over that short a window.
    for g in range(SMALL.regions):
        window = r.region_s(g)
        share, in_kernel = r.busy_share(window), r.busy_share(window, kernel=True)
        assert 0 < share <= 1.0 + 2 / (os.sysconf("SC_CLK_TCK") * window), (g, window, share, r.busy[:5])
        assert 0 <= in_kernel <= share, (g, share, in_kernel)


def test_busy_share_reads_the_machine_samples_from_the_announcement():
    from bench.wan_runner import RunResult

    # Samples at wall 9, 11, 12, 14 s; busy CPU-s since boot 100, 102, 104, 107, of them in the
    # kernel 50, 51, 51, 53 (2 cores).
    samples = [(9.0, 100.0, 50.0), (11.0, 102.0, 51.0), (12.0, 104.0, 51.0), (14.0, 107.0, 53.0)]

    def announced_at(t0: float) -> RunResult:
        return RunResult("x", SMALL, 1, 4.0, {}, None, busy=[(t - t0, b, k) for t, b, k in samples], cores=2)

    r = announced_at(10.0)                 # between two samples: busy 101 there, 50.5 in the kernel
    assert r.busy_share(3.0) == pytest.approx(4.5 / (2 * 3.0))    # between the samples at 2 and 4 s
    assert r.busy_share(3.0, kernel=True) == pytest.approx(1.5 / (2 * 3.0))
    assert r.busy_share(4.0) == pytest.approx(6.0 / 8.0)
    assert r.busy_share(4.0, kernel=True) == pytest.approx(2.5 / 8.0)
    assert r.busy_share(0.5) == pytest.approx(0.5)              # from the announcement to the first sample
    assert r.busy_share(4.5) is None and r.busy_share(4.5, kernel=True) is None
    assert announced_at(8.0).busy_share(1.5) is None and announced_at(15.0).busy_share(0.5) is None  # no sample before / after


def test_the_region_table_gives_the_kernels_part_of_the_cpu_busy_in_brackets():
    from bench.netemu import Counters
    from bench.wan import format_regions
    from bench.wan_runner import RunResult

    moved = Counters(wan_in=(0, 1), wan_out=(1, 0), host_tx={}, host_rx={})
    r = RunResult("patchswarm", SMALL, 1, 2.0, {"n0.1": 1.0, "n1.1": 2.0}, moved, cores=2,
                  busy=[(-1.0, 0.0, 0.0), (2.0, 4.8, 1.2)])
    lines = format_regions([r]).splitlines()
    assert lines[0].split()[-3:] == ["CPU", "busy", "(kernel)"]
    # r0's window, 1 s: 1.6 CPU-s busy of 2 cores, 0.4 in the kernel
    assert lines[1].endswith("80 % (20 %)") and lines[2].endswith("80 % (20 %)"), lines


@needs_netns
def test_patchswarm_with_a_region_behind_nat_delivers_over_webrtc(payload, nft):
    pytest.importorskip("aiortc")
    from bench.wan_patchswarm import PatchswarmRunner

    spec = dataclasses.replace(SMALL, nat_regions=(1,))
    with netemu.Topology(spec) as topo:
        r = PatchswarmRunner(chunk_bytes=16 << 10, nat_regions=(1,)).run(topo, payload, limit_s=120)
    assert set(r.per_node_s) == {h.name for h in topo.nodes}      # every node reached version 1 (hash checked)
    ways = next(n for n in r.notes if n.startswith("node chunk bytes in by transport"))
    # The two NATed nodes reach each other, and the others reach them, only over WebRTC.
    assert "webrtc direct" in ways, ways
    assert float(ways.split("webrtc direct ")[1].split(",")[0]) > 0, ways


def test_fault_schedule_kills_every_victim_then_restarts_the_first():
    from bench.wan_runner import Faults

    assert Faults(1.0, 3.0).events(["n1.2", "n2.0"]) == [(1.0, "kill", "n1.2"), (1.0, "kill", "n2.0"),
                                                         (3.0, "restart", "n1.2")]
    assert Faults(1.0).events(["n1.2"]) == [(1.0, "kill", "n1.2")]
    assert Faults(0.5, 0.2).events(["a"]) == [(0.2, "restart", "a"), (0.5, "kill", "a")]  # as given, in time order


def test_kept_logs_take_a_folder_per_run_and_never_replace_one(tmp_path):
    """Issue 26 (f): the second run of a system overwrote the first's logs, so a slow run's cause was lost."""
    from bench.wan_runner import keep_logs

    kept = []
    for run in ("first", "second"):
        logs = tmp_path / f"work-{run}"
        logs.mkdir()
        (logs / "n1.1.log").write_text(run)
        kept.append(keep_logs(tmp_path / "out", logs, "patchswarm-3x4"))
    assert [k.name for k in kept] == ["patchswarm-3x4-1", "patchswarm-3x4-2"]
    assert [(k / "n1.1.log").read_text() for k in kept] == ["first", "second"]
    assert keep_logs(None, tmp_path / "work-first", "x") is None


def test_libtorrent_stall_is_the_longest_gap_between_pieces_from_the_start():
    pytest.importorskip("libtorrent", reason="libtorrent (dev extra) is not installed")
    from bench.wan_libtorrent_peer import PieceGaps

    g = PieceGaps(10.0)
    for t in (10.4, 10.5, 11.2, 11.1, 11.3):   # alerts of one batch may be out of order
        g.piece_at(t)
    assert g.longest == pytest.approx(0.7)
    assert PieceGaps(5.0).longest == 0.0


@needs_netns
def test_libtorrent_with_a_leecher_killed_and_restarted_delivers_to_the_others(payload):
    pytest.importorskip("libtorrent", reason="libtorrent (dev extra) is not installed")
    from bench.wan_libtorrent import LibtorrentRunner
    from bench.wan_runner import Faults

    slow = netemu.WanSpec(regions=2, nodes_per_region=2, wan_mbit=2.0, lan_mbit=LAN_MBIT)  # the patch: ~0.5 s
    with netemu.Topology(slow) as topo:
        r = LibtorrentRunner(faults=Faults(0.1, 0.3), victims=lambda t: [t.nodes_in(1)[0].name]).run(
            topo, payload, limit_s=60)
        victim = topo.nodes_in(1)[0].name
    assert set(r.per_node_s) == {h.name for h in topo.nodes} - {victim}   # times over the leechers never killed
    assert set(r.stall_s) == set(r.per_node_s)
    assert all(0 <= s <= r.seconds for s in r.stall_s.values())
    assert any(f"restarted and complete: {{'{victim}'" in n for n in r.notes), r.notes


def test_asked_report_finds_a_node_that_asked_nobody_while_lacking_chunks():
    from bench.wan_asked import read_log

    def at(s: float, text: str) -> str:
        return f"2026-12-04T18:00:{s:06.3f}+00:00 node n1.2 {text}"

    lines = [at(0.0, "INFO version 1 announced: patch, 3 chunks, 9 bytes"),
             at(0.1, "DEBUG request chunk 0 of v1 patch from n1.1"),
             at(0.5, "DEBUG chunk 0 of v1 patch from n1.1 (node, region r1), 3 B, 0.4 s after the request"),
             at(1.5, "DEBUG request chunk 1 of v1 patch from n1.3"),     # 1.0 s with nothing asked
             at(1.6, "DEBUG request chunk 2 of v1 patch from n1.3"),
             at(1.7, "DEBUG chunk 1 of v1 patch from n1.3 (node, region r1), 3 B, 0.2 s after the request"),
             at(3.7, "DEBUG chunk 2 of v1 patch from n1.3 (node, region r1), 3 B, 2.1 s after the request"),
             at(9.0, "DEBUG request chunk 0 of v2 patch from n1.3")]
    held, n, unasked, gap = read_log(lines)
    assert (held, n) == (3, 3)
    assert unasked == pytest.approx(1.0)    # the stall of issue 26: lacking chunks, asking nobody
    assert gap == pytest.approx(2.0)        # waiting on a request in flight: a gap, not unasked


def test_every_patchswarm_daemon_declares_its_links_uplink_unless_told_not_to():
    """bench/wan.py: each daemon's --uplink-mbit is its host's link rate, or its --slow-uplink rate;
    --no-declare-uplinks leaves the flag out (the plan without uplinks, for side-by-side runs)."""
    from bench.wan import make_runner, parse_args
    from bench.wan_patchswarm import uplink_args

    spec = dataclasses.replace(SMALL, slow_uplinks=(("n0.1", 10.0),))
    assert uplink_args(spec, "n0.0") == ["--uplink-mbit", f"{LAN_MBIT:g}"]
    assert uplink_args(spec, "n0.1") == ["--uplink-mbit", "10"]
    assert uplink_args(spec, "n0.1", declare=False) == []
    assert make_runner("patchswarm", parse_args(["--slow-uplink", "n0.1=10"])).declare_uplinks
    assert not make_runner("patchswarm", parse_args(["--no-declare-uplinks"])).declare_uplinks
