"""Declared uplinks (--uplink-mbit), from each node through the tracker to every member.

A node declares its uplink in its Hello (wire revision 5); the tracker puts it in
the node's peer entry; every node hands the uplinks of the entries it holds, and
its own, to its picker (`PiecePicker.set_members(..., uplinks=...)`), so every
member of a region plans with the same ones. Checked with the real tracker and
daemons over loopback TLS in one process (the picker's calls recorded), across
revisions (a tracker of revision 4 hears no uplink, so a node does not count its
own either); as real processes (`patchswarm status` shows a peer's uplink) in
tests/test_region_binding.py's real-node test, which starts the same daemons.
The wire is in tests/test_wire.py, the tracker's choices in tests/test_tracker.py
and tests/test_peersets.py.
"""

from __future__ import annotations

import argparse

import pytest
import trio

from patchswarm.node.daemon import Node, NodeConfig
from patchswarm.node.net import transport, trust
from patchswarm.node.net.service import parse_uplink
from patchswarm.protocol import wire
from patchswarm.protocol.assembly import part_bytes_for
from patchswarm.protocol.responsibility import SLOW_UPLINK, uplink_caps
from patchswarm.tracker import server

DECLARED = {"fast": 100.0, "slow": 10.0, "quiet": None}  # Mbit/s; quiet declares none


def _swarm(tmp_path):
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    for name, role in [("tracker", "tracker"), *((n, "node") for n in DECLARED)]:
        trust.issue(swarm, name, role, tmp_path / name)


def _recording(node: Node) -> list:
    """The `uplinks` of each call the node makes to its picker's set_members, in order."""
    calls = []
    real = node.picker.set_members

    def set_members(members, uplinks=None):
        calls.append(dict(uplinks or {}))
        return real(members, uplinks=uplinks)

    node.picker.set_members = set_members
    return calls


async def _until(what, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not what():
            await trio.sleep(0.05)


def _run_swarm(tmp_path, check) -> None:
    _swarm(tmp_path)

    async def main():
        with trio.fail_after(60):
            await swarm()

    async def swarm():
        async with trio.open_nursery() as n:
            tracker = server.Tracker(tmp_path / "tracker", "127.0.0.1:0")
            await n.start(tracker.run)
            nodes, calls = {}, {}
            for name, up in DECLARED.items():
                nodes[name] = Node(NodeConfig(tracker.listen_addr, tmp_path / name, tmp_path / f"{name}-data",
                                              "127.0.0.1:0", "r0", uplink_mbit=up))
                calls[name] = _recording(nodes[name])
                await n.start(nodes[name].run)
            await check(tracker, nodes, calls)
            n.cancel_scope.cancel()

    trio.run(main)


def test_every_node_plans_with_every_declared_uplink_and_shows_its_peers(tmp_path):
    """Three nodes of one region, one slow, one fast, one declaring none: each node's picker is
    given the same map {fast: 100, slow: 10} (its own from --uplink-mbit, the others' from the
    tracker's entries), and its status shows its own and each connected peer's."""
    want = {m: up for m, up in DECLARED.items() if up is not None}

    async def check(tracker, nodes, calls):
        await _until(lambda: all(c and c[-1] == want for c in calls.values()), 30)
        assert {m["id"]: m.get("uplink") for m in tracker.status()["members"]} == DECLARED
        for name, node in nodes.items():
            await _until(lambda: len(node.status()["peers"]) == 2, 30)  # the region's nodes dial each other
            st = node.status()
            assert st["uplink_mbit"] == DECLARED[name]
            assert st["part_bytes"] == part_bytes_for(DECLARED[name])  # the parts it sends
            assert st["slow_neighbours"] == ["slow"]  # 10 of the median 100: planned slow, on every node
            assert st["uplink_measured_mbit"] is None  # nothing sent yet, so nothing backed up
            assert {p["id"]: p.get("uplink") for p in st["peers"]} == {m: up for m, up in DECLARED.items()
                                                                       if m != name}

    _run_swarm(tmp_path, check)


def test_a_tracker_of_revision_4_hears_no_uplink_and_no_node_counts_its_own(tmp_path, monkeypatch):
    """A tracker of revision 4 selects it in ALPN: the nodes' Hellos leave their uplinks out (it
    would refuse the field), it tells no one any, and a node plans with none, its own included
    (else it alone would plan with an uplink the others never heard of)."""
    def revision_4(creds):
        ctx = trust.server_context(creds)
        ctx.set_alpn_protocols(["patchswarm/4", "patchswarm/3", "patchswarm/2"])
        return ctx

    monkeypatch.setattr(transport, "server_context", revision_4)

    async def check(tracker, nodes, calls):
        await _until(lambda: all(len(node.dialer.members) == 2 for node in nodes.values()), 30)
        await _until(lambda: all(c for c in calls.values()), 30)
        assert all(node.tracker.stream.wire_revision == "patchswarm/4" for node in nodes.values())
        assert {m["id"]: m.get("uplink") for m in tracker.status()["members"]} == dict.fromkeys(DECLARED)
        assert all(c[-1] == {} for c in calls.values()), calls

    _run_swarm(tmp_path, check)


def _measure(node: Node, mbit: float) -> None:
    """Feed the node's uplink meter six half-second windows, just past, in which two sends waited
    at once and carried `mbit` Mbit/s together (what backed-up relaying to neighbours gives)."""
    meter, t = node.peers.uplink, trio.current_time() - 5.0
    for _ in range(6):
        meter.started(t)
        meter.started(t)
        for _ in range(2):
            meter.finished(t + meter.window_s, int(mbit * 1e6 / 8 * meter.window_s / 2))
        t += meter.window_s
    meter.started(t + 0.1)  # closes the last window
    meter.finished(t + 0.2, 0)


@pytest.mark.parametrize("revision", [None, "patchswarm/5"])
def test_a_node_that_measures_a_slow_uplink_says_so_and_every_node_plans_with_it(tmp_path, monkeypatch, revision):
    """"fast" declares 100 Mbit/s but measures 9.44 while its sends back up (a busier NIC): it says
    9.44 in its heartbeats (wire revision 6), the tracker passes it on, and every node's picker
    plans with {fast: 9.44, slow: 10}, its own included; status and the tracker show it; then
    "quiet", which declares none, measures 2 Mbit/s against the others' 10 and says that. With
    a tracker of revision 5, which reads no uplink in a heartbeat, every node plans on what the
    Hellos said, "fast" and "quiet" included."""
    from patchswarm.node import daemon
    from patchswarm.node.net import trackerlink

    monkeypatch.setattr(daemon, "UPLINK_CHECK_S", 0.1)
    monkeypatch.setattr(trackerlink, "HEARTBEAT_SECONDS", 0.2)
    if revision is not None:
        def older(creds):
            ctx = trust.server_context(creds)
            ctx.set_alpn_protocols([revision, "patchswarm/4", "patchswarm/3", "patchswarm/2"])
            return ctx
        monkeypatch.setattr(transport, "server_context", older)
    declared = {m: up for m, up in DECLARED.items() if up is not None}
    want = {**declared, "fast": 9.44} if revision is None else declared

    async def check(tracker, nodes, calls):
        await _until(lambda: all(c and c[-1] == declared for c in calls.values()), 30)
        _measure(nodes["fast"], 9.437)
        await _until(lambda: nodes["fast"].status()["uplink_measured_mbit"] is not None, 10)
        await _until(lambda: all(c[-1] == want for c in calls.values()), 10)
        st = nodes["fast"].status()
        assert (st["uplink_mbit"], st["uplink_said_mbit"]) == (100.0, want["fast"])  # what the tracker has
        said = {m["id"]: m.get("uplink") for m in tracker.status()["members"]}
        assert said == {**DECLARED, "fast": want["fast"]}
        await trio.sleep(0.5)  # and it stays so (the node says it in each heartbeat)
        assert all(c[-1] == want for c in calls.values())
        caps = uplink_caps(nodes, want)
        slow = sorted(m for m in nodes if caps and caps[m] < SLOW_UPLINK)
        assert slow == ([] if revision is None else ["slow"])  # fast and slow alike now: 9.44 and 10 of 10
        assert all(node.status()["slow_neighbours"] == slow for node in nodes.values())
        # "quiet" declares none: it measures 2 Mbit/s, under a quarter of what the others say (the
        # upper median of 9.44 and 10), and says so.
        _measure(nodes["quiet"], 2.0)
        told = {**want, "quiet": 2.0} if revision is None else want
        await _until(lambda: nodes["quiet"].uplink_said.value == 2.0, 10)
        await _until(lambda: all(c[-1] == told for c in calls.values()), 10)
        assert nodes["quiet"].status()["uplink_said_mbit"] == told.get("quiet")

    _run_swarm(tmp_path, check)


@pytest.mark.parametrize("text, value", [("100", 100.0), ("2.5", 2.5), ("none", None), ("", None),
                                         (str(wire.MAX_UPLINK_MBIT), float(wire.MAX_UPLINK_MBIT))])
def test_uplink_mbit_takes_a_rate_or_none(text, value):
    assert parse_uplink(text) == value


@pytest.mark.parametrize("text", ["0", "-5", "nan", "inf", "fast", str(wire.MAX_UPLINK_MBIT + 1)])
def test_uplink_mbit_refuses_what_is_no_rate_saying_what_it_expected(text):
    with pytest.raises(argparse.ArgumentTypeError, match=rf"expected Mbit/s in \(0, {wire.MAX_UPLINK_MBIT}\], found"):
        parse_uplink(text)
