"""PeerSets: each member's peer set, and the deltas that keep what it was sent equal to it.

A model member applies exactly what the tracker would send (the full set when
it joins, then every flushed PeerDelta addressed to it) and must always end
up with `view(member)`; the sets must hold what the WAN plan needs (the whole
region, a bounded sample elsewhere, the gateways); a change must reach only
the members whose set it changes.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.peersets import PeerSets, apply_delta
from patchswarm.protocol.responsibility import gateways, uplink_caps


class Members:
    """The model: what each member holds, from what it was sent."""

    def __init__(self, sets: PeerSets):
        self.sets = sets
        self.held: dict[str, dict[str, dict]] = {}
        self.received: dict[str, int] = {}  # deltas per member in the last flush

    def join(self, member, role="node", region="r0", addr=None, uplink=None):
        self.sets.join(member, role, region, addr or f"{member}:1", uplink)
        self.held[member] = {e["id"]: e for e in self.sets.full(member)}

    def leave(self, member):
        self.sets.leave(member)
        self.held.pop(member, None)

    def flush(self):
        self.received = {}
        for members, delta in self.sets.flush():
            assert delta.add or delta.remove
            for m in members:
                assert m in self.held, f"a delta for {m}, which is not a member"
                self.received[m] = self.received.get(m, 0) + 1
                held = apply_delta(self.held[m], delta)
                held.pop(m, None)  # a member ignores itself, as the node daemon does
                self.held[m] = held
        return self.received

    def check(self):
        for m, held in self.held.items():
            assert held == {e["id"]: e for e in self.sets.view(m)}, m


def region_gateways(sets: PeerSets, key, there) -> set[str]:
    """The gateways the nodes of a region compute (responsibility.gateways), from the uplinks
    their peer entries carry."""
    uplinks = {m: sets.entries[m]["uplink"] for m in there if "uplink" in sets.entries[m]}
    return gateways(key, there, sets.max_gateways, uplink_caps(there, uplinks))


def check_sets(sets: PeerSets, key=None):
    """What the WAN plan and the dialer need, and the bounds."""
    regions = {}
    for m, e in sets.entries.items():
        if e["role"] == "node":
            regions.setdefault(e["region"], set()).add(m)
    origins = {m for m, e in sets.entries.items() if e["role"] == "origin"}
    for m, e in sets.entries.items():
        seen = {x["id"] for x in sets.view(m)}
        assert origins - {m} <= seen
        if e["role"] == "origin":
            assert seen == origins - {m}
            continue
        region = e["region"]
        assert regions[region] - {m} <= seen  # the whole region: the plan needs it
        for u, there in regions.items():
            if u == region:
                continue
            got = seen & there
            assert len(got) == min(sets.other_peers, len(there)), (m, u, got)
            if key is not None and m in region_gateways(sets, key, regions[region]):
                assert region_gateways(sets, key, there) <= got, (m, u)
    if key is not None:
        for region, there in regions.items():
            assert sets.gateways(region) == region_gateways(sets, key, there)


def test_a_joining_node_sees_its_region_a_sample_of_others_and_the_origin():
    sets = PeerSets(other_peers=3, seed=1)
    ms = Members(sets)
    ms.join("origin", "origin", "r0")
    for r in range(3):
        for i in range(10):
            ms.join(f"n{r}.{i}", region=f"r{r}")
    ms.flush()
    view = {e["id"]: e for e in sets.view("n1.4")}
    assert {m for m in view if m.startswith("n1.")} == {f"n1.{i}" for i in range(10)} - {"n1.4"}
    assert len([m for m in view if m.startswith("n0.")]) == 3
    assert len([m for m in view if m.startswith("n2.")]) == 3
    assert view["origin"] == {"id": "origin", "region": "r0", "addr": "origin:1", "role": "origin"}
    check_sets(sets)
    ms.check()


def test_a_new_same_region_peer_reaches_its_region_and_takes_its_share_of_samplers():
    sets = PeerSets(other_peers=3, seed=2)
    ms = Members(sets)
    for r in range(4):
        for i in range(20):
            ms.join(f"n{r}.{i}", region=f"r{r}")
    ms.flush()
    ms.join("n2.new", region="r2")
    got = ms.flush()
    assert {m for m in got if m.startswith("n2.") and m != "n2.new"} == {f"n2.{i}" for i in range(20)}
    # Elsewhere only the members that now sample the newcomer instead of a busier node of r2.
    others = {m for m in got if not m.startswith("n2.")}
    assert others == {m for m in ms.held if "n2.new" in ms.held[m] and not m.startswith("n2.")}
    assert 1 <= len(others) <= 3 * 60 / 21 + 1
    assert all("n2.new" in ms.held[f"n2.{i}"] for i in range(20))
    ms.check()


def test_a_leaving_node_is_replaced_in_the_samples_that_held_it():
    sets = PeerSets(other_peers=3, seed=3)
    ms = Members(sets)
    for r in range(3):
        for i in range(12):
            ms.join(f"n{r}.{i}", region=f"r{r}")
    ms.flush()
    holders = [m for m in ms.held if not m.startswith("n1.") and "n1.5" in ms.held[m]]
    assert holders
    ms.leave("n1.5")
    got = ms.flush()
    assert set(got) == {f"n1.{i}" for i in range(12)} - {"n1.5"} | set(holders)
    for m in holders:
        assert len([x for x in ms.held[m] if x.startswith("n1.")]) == 3
    check_sets(sets)
    ms.check()


def test_a_reconnect_with_the_same_entry_changes_nothing_and_a_new_address_reaches_who_knows_it():
    sets = PeerSets(seed=4)
    ms = Members(sets)
    for r in range(2):
        for i in range(6):
            ms.join(f"n{r}.{i}", region=f"r{r}")
    ms.flush()
    assert sets.join("n0.1", "node", "r0", "n0.1:1") is False
    assert ms.flush() == {}
    ms.join("n0.1", addr="n0.1:2")
    knows = {m for m in ms.held if m != "n0.1" and "n0.1" in ms.held[m]}
    got = ms.flush()
    assert set(got) == knows  # and not n0.1 itself: its full set already holds the change
    assert all(ms.held[m]["n0.1"]["addr"] == "n0.1:2" for m in knows)
    ms.check()


def test_gateways_of_the_current_object_know_each_other():
    sets = PeerSets(other_peers=3, gateways=2, seed=5)
    ms = Members(sets)
    for r in range(4):
        for i in range(15):
            ms.join(f"n{r}.{i}", region=f"r{r}")
    ms.flush()
    for v in range(1, 4):
        sets.set_object((v, False))
        got = ms.flush()
        # only gateways' sets changed (a few of them may have held the new ones already)
        gws = set().union(*(sets.gateways(f"r{r}") for r in range(4)))
        assert set(got) <= gws
        check_sets(sets, (v, False))
        ms.check()
    # a gateway leaving: its region's next one is known to the other gateways at once
    g = sorted(sets.gateways("r2"))[0]
    ms.leave(g)
    ms.flush()
    check_sets(sets, (3, False))
    ms.check()


def test_origin_changes_reach_everyone():
    sets = PeerSets(seed=6)
    ms = Members(sets)
    for i in range(5):
        ms.join(f"n{i}", region=f"r{i % 2}")
    ms.flush()
    ms.join("origin", "origin", "r0")
    assert set(ms.flush()) == {f"n{i}" for i in range(5)}
    ms.leave("origin")
    assert set(ms.flush()) == {f"n{i}" for i in range(5)}
    ms.check()


def test_a_change_costs_the_members_it_affects_not_the_fleet():
    """8 regions of 100: one leave reaches its region and about the few that sampled it."""
    sets = PeerSets(other_peers=3, gateways=2, seed=7)
    ms = Members(sets)
    for r in range(8):
        for i in range(100):
            ms.join(f"n{r}.{i}", region=f"r{r}")
    sets.set_object((1, False))
    ms.flush()
    for i in range(0, 100, 10):
        ms.leave(f"n3.{i}")
        got = ms.flush()
        assert len(got) <= 100 + 60, len(got)  # the region + its samplers (~21 on average)
    check_sets(sets, (1, False))
    ms.check()


def test_samplers_stay_balanced_under_churn():
    """Two random choices keep how many members sample a node near the mean, newcomers included."""
    sets = PeerSets(other_peers=3, seed=8)
    rng = random.Random(8)
    ms = Members(sets)
    for r in range(4):
        for i in range(50):
            ms.join(f"n{r}.{i}", region=f"r{r}")
    for step in range(400):  # churn: a random node leaves, a new one joins its region
        leaver = rng.choice(sorted(ms.held))
        region = sets.region_of(leaver)
        ms.leave(leaver)
        ms.join(f"x{step}", region=region)
    counts = [len(sets._holders[m]) for m in ms.held]
    mean = 3 * 150 / 50
    assert max(counts) <= 2 * mean + 2, (max(counts), mean)
    assert min(counts) >= 1


UPLINKS = [None, None, 10, 100, 100.0, 1000]  # Mbit/s, drawn by index: slow, even, fast, none


@st.composite
def histories(draw):
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["join", "join", "join", "leave", "move", "readdr", "reuplink", "object",
                                     "flush"]))
        ops.append((kind, draw(st.integers(0, 15)), draw(st.integers(0, 3)), draw(st.integers(0, 5))))
    return ops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.integers(1, 4), st.integers(0, 2), st.integers(0, 1000))
def test_property_deltas_keep_every_member_at_its_set(ops, other_peers, gw, seed):
    gw = min(gw, other_peers)
    sets = PeerSets(other_peers=other_peers, gateways=gw, seed=seed)
    ms = Members(sets)
    key = None
    for kind, m, region, v in ops:
        name = "o" if m == 15 else f"n{m}"
        role = "origin" if m == 15 else "node"
        uplink = UPLINKS[v]
        if kind in ("join", "move") or (kind in ("readdr", "reuplink") and name not in sets):
            ms.join(name, role, f"r{region}", uplink=uplink)
        elif kind == "readdr":
            ms.join(name, role, sets.region_of(name), addr=f"{name}:{v + 2}",
                    uplink=sets.entries[name].get("uplink"))
        elif kind == "reuplink":  # the same member again, declaring another uplink (or none)
            ms.join(name, role, sets.region_of(name), addr=sets.entries[name]["addr"], uplink=uplink)
        elif kind == "leave":
            ms.leave(name)
        elif kind == "object":
            key = (v, False)
            sets.set_object(key)
        else:
            ms.flush()
            ms.check()
            check_sets(sets, key if gw else None)
    ms.flush()
    ms.check()
    check_sets(sets, key if gw else None)


@pytest.mark.parametrize("kwargs", [dict(other_peers=0), dict(other_peers=2, gateways=3), dict(gateways=-1)])
def test_bad_limits_are_refused(kwargs):
    with pytest.raises(UsageError):
        PeerSets(**kwargs)


def test_unknown_role_is_refused():
    with pytest.raises(UsageError):
        PeerSets().join("t", "tracker", "r0", "t:1")


# --- declared uplinks ------------------------------------------------------------


def test_an_entry_carries_an_uplink_only_where_one_was_declared_and_a_change_is_a_change():
    sets = PeerSets(other_peers=3, gateways=2, seed=1)
    ms = Members(sets)
    ms.join("n1", uplink=100)
    ms.join("n2")
    assert sets.entries["n1"]["uplink"] == 100 and "uplink" not in sets.entries["n2"]
    ms.flush()
    assert not sets.join("n1", "node", "r0", "n1:1", 100)  # the same again: nothing to tell
    assert sets.join("n1", "node", "r0", "n1:1", 10)  # a new uplink reaches its region, like a new address
    assert ms.flush()["n2"] == 1  # (n1 finds itself in its region's delta, and ignores it)
    ms.check()
    assert ms.held["n2"]["n1"]["uplink"] == 10
    assert sets.join("n1", "node", "r0", "n1:1", None)  # and declaring none again
    ms.flush()
    ms.check()
    assert "uplink" not in ms.held["n2"]["n1"]


def test_a_slow_member_is_no_gateway_while_enough_others_are():
    """One member of four declares 10 Mbit/s among 100: for no object is it one of the two
    gateways, as the nodes' own plan has it; declaring 100 again makes it one for some."""
    sets = PeerSets(other_peers=3, gateways=2, seed=2)
    for i in range(4):
        sets.join(f"a{i}", "node", "ra", f"a{i}:1", 10 if i == 0 else 100)
        sets.join(f"b{i}", "node", "rb", f"b{i}:1", 100)
    chosen = set()
    for v in range(40):
        sets.set_object((v, False))
        assert "a0" not in sets.gateways("ra")
        check_sets(sets, (v, False))
    sets.join("a0", "node", "ra", "a0:1", 100)  # its region re-ranks at once
    for v in range(40, 80):
        sets.set_object((v, False))
        chosen |= sets.gateways("ra")
        check_sets(sets, (v, False))
    assert "a0" in chosen


def test_a_slow_member_leaving_or_joining_re_ranks_its_region_and_gateways_learn_of_it():
    sets = PeerSets(other_peers=3, gateways=2, seed=3)
    ms = Members(sets)
    for i in range(5):
        ms.join(f"a{i}", region="ra", uplink=100)
        ms.join(f"b{i}", region="rb", uplink=100)
    key = (7, False)
    sets.set_object(key)
    ms.flush()
    g = sorted(sets.gateways("ra"))[0]
    ms.join(g, region="ra", uplink=5)  # a gateway declares a slow uplink: another takes its place
    assert g not in sets.gateways("ra")
    ms.flush()
    ms.check()
    check_sets(sets, key)
    for other in sets.gateways("rb"):  # the other region's gateways know the new one
        assert sets.gateways("ra") <= set(ms.held[other])


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text("abcdef", min_size=1, max_size=4),
                       st.none() | st.sampled_from([1, 5, 10, 50, 100, 100.0, 1000]), min_size=1, max_size=12),
       st.integers(0, 3), st.integers(0, 50), st.lists(st.text("abcdef", min_size=1, max_size=4), max_size=4))
def test_property_the_trackers_gateways_are_the_nodes_gateways(uplinks, k, version, leaving):
    """On random regions with random declared uplinks, before and after members leave:
    PeerSets.gateways(region) == responsibility.gateways(key, members, k, uplink_caps(...))."""
    sets = PeerSets(other_peers=3, gateways=k, seed=version)
    for m, up in uplinks.items():
        sets.join(m, "node", "r", f"{m}:1", up)
    key = (version, version % 2 == 0)
    sets.set_object(key)

    def expected():
        declared = {m: up for m, up in uplinks.items() if up is not None}
        return gateways(key, uplinks, k, uplink_caps(uplinks, declared))

    if k:
        assert sets.gateways("r") == expected()
    for m in leaving:
        sets.leave(m)
        uplinks.pop(m, None)
        if uplinks and k:
            assert sets.gateways("r") == expected()
