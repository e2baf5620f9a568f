"""The swarm fetch policy, one PiecePicker at a time, without sockets.

Scenario tables drive single pickers with facts; one picker takes random facts
and keeps its contract (a property test). The WAN plan itself is tested in
test_responsibility.py, many pickers wired together in test_picker_swarm.py;
`python bench/picker.py` measures the picker's costs.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from patchswarm.protocol.errors import ProtocolError, UsageError
from patchswarm.protocol.picker import (BESIDE_PROBE, ENDGAME, ENDGAME_AFTER, MAX_COPIES, NODE, ORIGIN, ORIGIN_PIPELINE,
                                       PAST_ITS_TIMEOUT, PLANNED, REST, SHARE, SILENT, SLOW, SLOW_BESIDE_TYPICAL,
                                       SLOW_CHUNK_MIN_S, SLOW_CHUNK_S, STALLED, PiecePicker,
                                       Request)
from patchswarm.protocol.responsibility import balanced_owners, gateways, member_weight, region_order, upstream_regions

KEY = (7, False)  # a patch
KF = (7, True)  # a keyframe
OR = "origin"  # the origin's peer id


def make(me, members, *, origin_region="r0", n=16, connect=None, origin=True, seed=0,
         pipeline=4, takeover_after=2.0, key=KEY, now=0.0, priority=0, wan_pipeline=None, wan_gateways=None):
    """A picker for `me`, with members set, connected to `connect` (default:
    every other member) and the origin, holding one object with no chunks.
    Every member of a region is a gateway unless `wan_gateways` says otherwise
    (the scenario tables below are written for that)."""
    extra = {} if wan_pipeline is None else {"wan_pipeline": wan_pipeline}
    p = PiecePicker(me, members[me], origin_region, seed=seed, pipeline=pipeline,
                    takeover_after=takeover_after, wan_gateways=wan_gateways, **extra)
    p.set_members(members)
    for other in (connect if connect is not None else sorted(set(members) - {me})):
        p.peer_joined(other, NODE, members[other])
    if origin:
        p.peer_joined(OR, ORIGIN, origin_region)
    p.add_object(key, n, now=now, priority=priority)
    if origin:
        p.peer_has(OR, key, range(n))
    return p


def owned(node, members, n, key=KEY, origin_region="r0", k=None):
    """The chunks `node` must bring into its region (of `k` gateways; None: all)."""
    region = members[node]
    in_region = [m for m, r in members.items() if r == region]
    regions = set(members.values())
    classes = [(tuple(up), serves) for up, serves in
               (upstream_regions(key, c, region, regions, origin_region) for c in range(n))]
    owners = balanced_owners(key, n, gateways(key, in_region, k), classes)
    return {c for c in range(n) if owners[c] == node}


def find_chunk(pred, limit=500):
    c = next((c for c in range(limit) if pred(c)), None)
    assert c is not None, "no chunk satisfies the scenario; widen the search"
    return c


def asked(reqs):
    return {(r.peer, r.chunk) for r in reqs}


def test_only_the_gateway_crosses_the_wan_and_a_new_one_takes_over_when_it_leaves():
    # The origin's region (r9) has no members: r0 pulls from the origin across the WAN.
    region = {"a": "r0", "b": "r0", "c": "r0"}
    [gw] = gateways(KEY, region, 1)
    n = 12
    pickers = {m: make(m, region, n=n, pipeline=n, wan_pipeline=n, wan_gateways=1, origin_region="r9")
               for m in region}
    assert {r.chunk for r in pickers[gw].requests(0.0)} == set(range(n))  # every chunk, from the origin
    assert pickers[gw].responsible_for(KEY) == n
    for m in set(region) - {gw}:
        assert pickers[m].requests(0.0) == [] and pickers[m].responsible_for(KEY) == 0
    # The gateway leaves: the next one by weight brings everything in, at once.
    rest = {m: r for m, r in region.items() if m != gw}
    [next_gw] = gateways(KEY, rest, 1)
    p = pickers[next_gw]
    p.peer_left(gw)
    p.set_members(rest)
    reqs = p.requests(0.1)
    assert {r.chunk for r in reqs} == set(range(n)) and {r.peer for r in reqs} == {OR}


def test_in_the_origins_region_every_member_takes_its_share_from_the_origin():
    """Issue 26: with 2 gateways there, their uplinks carried the region's whole
    fan-out and its WAN copy, and the region took 1.80x its own bound."""
    members = {"a": "r0", "b": "r0", "c": "r0", "d": "r0", "x": "r1", "y": "r1", "z": "r1"}
    n = 32
    asked_origin = {}
    for m in ("a", "b", "c", "d"):
        p = make(m, members, n=n, pipeline=n, wan_gateways=2)
        reqs = p.requests(0.0)
        assert {r.peer for r in reqs} == {OR} and p.responsible_for(KEY) == len(reqs) == n // 4
        asked_origin[m] = {r.chunk for r in reqs}
    # Each chunk from the origin once, spread over the region's uplinks.
    assert sorted(c for cs in asked_origin.values() for c in cs) == list(range(n))
    # A remote region keeps the cap: 2 gateways cross the WAN.
    remote = {m: make(m, members, n=n, pipeline=n, wan_pipeline=n, wan_gateways=2, origin=False) for m in "xyz"}
    for p in remote.values():
        for m in ("a", "b", "c", "d"):
            p.peer_has(m, KEY, range(n))
    assert sum(1 for p in remote.values() if p.requests(0.0)) == 2


@pytest.mark.parametrize("bad", [{"r1": 0}, {"r1": -5}, {"r1": float("inf")}, {"r1": float("nan")},
                                 {"r1": "50"}, {"r1": True}, {1: 50}])
def test_wan_rates_must_be_positive_numbers(bad):
    with pytest.raises(UsageError, match="wan_rates"):
        PiecePicker("a", "r0", "r0", wan_rates=bad)


def test_wan_rates_message_names_the_first_three_bad_rates():
    with pytest.raises(UsageError) as raised:
        PiecePicker("a", "r0", "r0", wan_rates={f"r{i}": 0 for i in range(5)})
    assert "('r2', 0)]" in str(raised.value) and "r3" not in str(raised.value)


def test_with_wan_rates_the_fast_region_never_pulls_through_the_slow_one():
    """Issue 26: about half of the 50 Mbit/s region's chunks came through the 20 Mbit/s one."""
    rates = {"r0": 100, "r1": 50, "r2": 20}
    n = 32
    fast = make("a1", THREE, n=n, pipeline=n, wan_pipeline=n, origin=False)
    rated = PiecePicker("a1", "r1", "r0", pipeline=n, wan_pipeline=n, wan_gateways=None, wan_rates=rates)
    rated.set_members(THREE)
    for p in (fast, rated):
        if p is rated:
            for other in sorted(set(THREE) - {"a1"}):
                p.peer_joined(other, NODE, THREE[other])
            p.add_object(KEY, n, now=0.0)
        p.peer_has("a0", KEY, range(n))
        p.peer_has("a2", KEY, range(n))
    unrated_peers = Counter(r.peer for r in fast.requests(0.0))
    rated_peers = Counter(r.peer for r in rated.requests(0.0))
    assert unrated_peers["a2"] > 0  # the rendezvous chain sends some through r2
    assert set(rated_peers) == {"a0"} and rated.responsible_for(KEY) == rated_peers["a0"]


def test_wan_rates_that_arrive_mid_version_replan_every_chunk_at_once():
    """The tracker's rates reach a node that began fetching without them: its missing
    chunks are planned again at once, so it pulls as a node started with them does;
    a request already in flight stays and its answer counts."""
    rates = {"r0": 100, "r1": 50, "r2": 20}
    n = 32
    late = make("a1", THREE, n=n, pipeline=n, wan_pipeline=1, origin=False)
    late.peer_has("a0", KEY, range(n))
    late.peer_has("a2", KEY, range(n))
    first = late.requests(0.0)
    assert len(first) == 2  # one to each upstream region of the rendezvous chains
    assert {r.peer for r in first} == {"a0", "a2"}
    assert late.set_wan_rates(rates) and late.wan_rates == rates
    assert late.in_flight() == 2  # kept, not cancelled
    assert late.requests(0.0) == []  # a0's one WAN slot is taken; r2 is no longer upstream
    via_r2 = next(r for r in first if r.peer == "a2")
    late.chunk_received(KEY, via_r2.chunk, "a2")  # the old plan's chunk still counts
    via_r0 = next(r for r in first if r.peer == "a0")
    late.chunk_received(KEY, via_r0.chunk, "a0")
    fresh = PiecePicker("a1", "r1", "r0", pipeline=n, wan_pipeline=n, wan_gateways=None, wan_rates=rates)
    fresh.set_members(THREE)
    for other in sorted(set(THREE) - {"a1"}):
        fresh.peer_joined(other, NODE, THREE[other])
    fresh.add_object(KEY, n, now=0.0)
    fresh.peer_has("a0", KEY, range(n))
    fresh.peer_has("a2", KEY, range(n))
    planned = fresh.requests(0.0)
    assert {r.peer for r in planned} == {"a0"}
    share = {r.chunk for r in planned}
    rest = set()
    while reqs := late.requests(0.0):
        assert {r.peer for r in reqs} == {"a0"}  # never through the slow r2 again
        for r in reqs:
            late.chunk_received(KEY, r.chunk, r.peer)
            rest.add(r.chunk)
    assert rest == share - {via_r2.chunk, via_r0.chunk}  # the share of a node started with the rates


def test_set_wan_rates_says_whether_the_plan_changed_and_checks_the_rates():
    p = make("a1", THREE, n=8)
    assert not p.set_wan_rates(None) and not p.set_wan_rates({})
    assert p.set_wan_rates({"r1": 50, "r2": 20})
    assert not p.set_wan_rates({"r2": 20, "r1": 50.0})
    with pytest.raises(UsageError, match=r"wan_rates: expected region -> rate > 0, found \[\('r2', -1\)\]"):
        p.set_wan_rates({"r1": 50, "r2": -1})
    assert p.wan_rates == {"r1": 50, "r2": 20}  # a refused change leaves the plan as it was
    assert p.set_wan_rates(None) and p.wan_rates is None


def test_wan_gateways_must_be_positive():
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(UsageError, match="wan_gateways"):
            PiecePicker("a", "r0", "r0", wan_gateways=bad)


# --- single pickers: scenario tables -------------------------------------------

ONE_REGION = {"a": "r0", "b": "r0", "c": "r0"}


@pytest.mark.parametrize("me", sorted(ONE_REGION))
def test_single_region_only_the_responsible_node_asks_the_origin(me):
    n = 30
    p = make(me, ONE_REGION, n=n, pipeline=n)
    reqs = p.requests(0.0)
    assert {r.peer for r in reqs} == {OR}
    assert {r.chunk for r in reqs} == owned(me, ONE_REGION, n)
    assert p.responsible_for(KEY) == len(owned(me, ONE_REGION, n))


def test_single_region_others_wait_then_take_from_the_responsible_node():
    n = 30
    b = make("b", ONE_REGION, n=n, pipeline=n)
    b.requests(0.0)
    c = min(owned("a", ONE_REGION, n))
    assert b.requests(0.1) == []  # waits for a
    b.peer_has("a", KEY, [c])
    assert b.requests(0.2) == [Request("a", KEY, c)]  # same region, never the origin


THREE = {"a0": "r0", "b0": "r0", "a1": "r1", "b1": "r1", "a2": "r2"}


REMOTE_N = 32  # chunks of the object in the scenarios that use _remote_chunk


def _remote_chunk(me, second):
    """A chunk `me` (in r1) must bring in, whose order puts `second` right after r0."""
    mine = owned(me, THREE, REMOTE_N)
    return find_chunk(lambda c: c in mine and region_order(KEY, c, ["r1", "r2"], "r0")[1] == second, REMOTE_N)


@pytest.mark.parametrize("second, holders, expect", [
    # r1 right after r0: pulls from r0's nodes, never the origin
    ("r1", [], set()),
    ("r1", ["a0"], {"a0"}),
    ("r1", ["a0", "b0"], {"a0", "b0"}),
    ("r1", ["a0", "a2"], {"a0"}),  # r2 is downstream of r1 for this chunk
    ("r1", ["a2"], set()),
    # r1 after r2: only from r2 (the region just before it), never r0's nodes
    ("r2", ["a2"], {"a2"}),
    ("r2", ["a0", "a2"], {"a2"}),
    ("r2", ["a0"], set()),
    ("r2", [], set()),
])
def test_remote_responsible_node_sources_table(second, holders, expect):
    c = _remote_chunk("a1", second)
    got = set()
    for seed in range(6):  # ties go to either eligible peer: collect over seeds
        p = make("a1", THREE, n=REMOTE_N, seed=seed)
        for h in holders:
            p.peer_has(h, KEY, [c])
        got |= {r.peer for r in p.requests(0.0) if r.chunk == c}
    assert got == expect


def test_remote_same_region_holder_beats_wan():
    c = _remote_chunk("a1", "r1")
    p = make("a1", THREE, n=REMOTE_N)
    p.peer_has("a0", KEY, [c])
    p.peer_has("b1", KEY, [c])
    assert asked(p.requests(0.0)) == {("b1", c)}


def test_remote_non_responsible_node_never_crosses_the_wan():
    c = _remote_chunk("a1", "r1")
    p = make("b1", THREE, n=REMOTE_N)
    p.peer_has("a0", KEY, [c])
    p.peer_has("a2", KEY, [c])
    assert all(r.chunk != c for r in p.requests(0.0))


def test_origin_region_without_nodes():
    members = {"a1": "r1", "a2": "r2"}
    c = find_chunk(lambda c: region_order(KEY, c, ["r1", "r2"], "r0")[1] == "r1")
    first = make("a1", members, n=c + 1)
    assert ("origin", c) in asked(first.requests(0.0))
    second = make("a2", members, n=c + 1)
    assert all(r.chunk != c for r in second.requests(0.0))  # not from the origin
    second.peer_has("a1", KEY, [c])
    assert ("a1", c) in asked(second.requests(0.1))


def test_single_node_is_responsible_for_everything():
    p = make("solo", {"solo": "r5"}, n=6, pipeline=6, wan_pipeline=6)  # alone, not in the origin's region
    assert asked(p.requests(0.0)) == {(OR, c) for c in range(6)}


def test_member_leaving_moves_its_share_at_once_and_releases_requests():
    members = {"a": "r0", "b": "r0"}
    n = 40
    b = make("b", members, n=n, pipeline=n)
    mine, theirs = owned("b", members, n), owned("a", members, n)
    first = b.requests(0.0)
    assert {r.chunk for r in first} == mine
    d = min(theirs)
    b.peer_has("a", KEY, [d])
    assert b.requests(0.0) == [Request("a", KEY, d)]
    assert b.in_flight("a") == 1
    b.peer_left("a")
    assert b.in_flight("a") == 0
    b.set_members({"b": "r0"})
    again = b.requests(0.0)  # no delay: the whole object is b's now
    assert {r.chunk for r in again} == theirs and {r.peer for r in again} == {OR}
    assert b.in_flight() == n


def test_an_objects_tie_break_order_is_a_permutation_and_its_inverse_and_the_collector_stays_on():
    """add_object pauses the cyclic collector while it builds a large object's state (a 500 GB
    keyframe's 500,000 chunks took 1.3 s here, half of it the collector's passes) and turns it on
    again; the per-node random order and its inverse still match."""
    import gc

    assert gc.isenabled()
    p = make("b1", {"b1": "r1", "b2": "r1"}, n=1000, origin_region="r1")
    obj = p._objects[KEY]
    assert sorted(obj.rank) == list(range(1000)) and obj.rank != list(range(1000))
    assert all(obj.chunk_of[obj.rank[c]] == c for c in range(1000))
    assert gc.isenabled()


def test_member_joining_takes_its_share():
    b = make("b", {"b": "r0"}, n=40, pipeline=1)
    b.set_members({"a": "r0", "b": "r0"})
    assert b.responsible_for(KEY) == len(owned("b", {"a": "r0", "b": "r0"}, 40))


def _received_all(p, reqs):
    for r in reqs:
        assert p.chunk_received(r.key, r.chunk, r.peer) == []


def test_takeover_only_after_the_delay_and_only_when_idle():
    members = {"a1": "r1", "b1": "r1", "a0": "r0"}
    n = 40
    own, stuck = owned("b1", members, n), owned("a1", members, n)  # a1 never delivers
    p = make("b1", members, n=n, takeover_after=2.0, now=10.0, pipeline=n, wan_pipeline=n)
    p.peer_has("a0", KEY, range(n))
    first = p.requests(10.0)
    assert own and stuck and asked(first) == {("a0", c) for c in own}
    assert p.next_wakeup(10.0) == 12.0
    _received_all(p, first[1:])
    # Chunks arriving in the region are progress: the clock restarts from there.
    assert p.requests(11.0) == [] and p.next_wakeup(11.0) == 13.0
    # Due now but not idle: only the answer in flight can start the takeover, so no wakeup
    # at `now` (a daemon sleeping until it would spin).
    assert p.requests(13.0) == [] and p.next_wakeup(13.0) is None
    assert p.requests(13.5) == []  # a stall long enough, but one request is still in flight
    _received_all(p, first[:1])
    assert p.requests(13.5) == [] and p.next_wakeup(13.5) == 15.5  # that arrival was progress too
    taken = p.requests(15.5)  # idle, and the region stalled for 2 s: a1's share, from a node peer
    assert asked(taken) == {("a0", c) for c in stuck}
    assert p.next_wakeup(15.5) is None  # the clock has run out: only facts matter now


@pytest.mark.parametrize("holders, expect", [
    (["a2"], {"a2"}),  # any region's node peer, even a downstream one
    (["a0", "a2"], {"a0", "a2"}),
    ([], {OR}),  # no node has it: the origin
])
def test_takeover_sources(holders, expect):
    members = {"a1": "r1", "b1": "r1", "a0": "r0", "a2": "r2"}
    c = min(owned("a1", members, 8))
    got = set()
    for seed in range(6):
        p = make("b1", members, n=8, takeover_after=1.0, seed=seed, pipeline=8, wan_pipeline=8)
        for h in holders:
            p.peer_has(h, KEY, [c])
        assert all(r.chunk != c for r in p.requests(0.0))
        _received_all(p, p.requests(0.0))
        assert all(r.chunk != c for r in p.requests(0.5))  # progress just now: no takeover yet
        got |= {r.peer for r in p.requests(1.5) if r.chunk == c}
    assert got == expect


def test_no_takeover_when_a_region_neighbour_has_it():
    members = {"a1": "r1", "b1": "r1", "c1": "r1", "a0": "r0"}
    c = min(owned("a1", members, 8))
    p = make("b1", members, n=8, takeover_after=0.0, pipeline=8)
    p.peer_has("c1", KEY, [c])  # c1 got it: take it from c1, not across the WAN
    assert ("c1", c) in asked(p.requests(5.0))



def test_requests_across_the_wan_are_few_per_region_at_a_time():
    """Chunks in flight over one WAN link share it: a node keeps wan_pipeline requests
    in flight per other region, so each crosses fast and can be relayed early."""
    members = {"b1": "r1", "a0": "r0"}
    n = 12
    p = make("b1", members, n=n, pipeline=8, wan_pipeline=1)
    p.peer_has("a0", KEY, range(n))
    first = p.requests(0.0)
    assert len(first) == 1 and first[0].peer in {"a0", OR}  # a0 and the origin share region r0
    assert p.requests(0.0) == []  # nothing more until it lands
    _received_all(p, first)
    assert len(p.requests(0.1)) == 1
    wide = make("b1", members, n=n, pipeline=8, wan_pipeline=3)
    wide.peer_has("a0", KEY, range(n))
    assert len(wide.requests(0.0)) == 3


def test_requests_across_the_wan_stack_on_one_connection():
    """Pieces on one connection are sent one after another, so two requests to one
    upstream peer arrive one whole chunk at a time; spread over two peers they
    would share the WAN link and both arrive late. Inside a region they spread."""
    members = {"b1": "r1", "a0": "r0", "c0": "r0", "d1": "r1"}
    for seed in range(5):
        p = make("b1", members, n=12, pipeline=4, wan_pipeline=3, connect=["a0", "c0"], origin=False, seed=seed)
        p.peer_has("a0", KEY, range(12))
        p.peer_has("c0", KEY, range(12))
        reqs = p.requests(0.0)
        assert len(reqs) == 3 and len({r.peer for r in reqs}) == 1, reqs
    local = make("b1", members, n=12, pipeline=4, connect=["d1"], origin=False)
    local.peer_joined("e1", NODE, "r1")
    local.peer_has("d1", KEY, range(12))
    local.peer_has("e1", KEY, range(12))
    assert Counter(r.peer for r in local.requests(0.0)) == {"d1": 4, "e1": 4}


@pytest.mark.parametrize("wan_pipeline", [1, 2, 3, 4])
@pytest.mark.parametrize("land", [1, 2])
def test_requests_in_flight_to_a_region_stay_at_wan_pipeline_as_answers_land(wan_pipeline, land):
    """Round after round, `land` answers arrive and the region's budget is refilled by just
    as many: never more than wan_pipeline in flight to r0 (the origin and a0 share it)."""
    members = {"b1": "r1", "a0": "r0"}
    n = 24
    p = make("b1", members, n=n, pipeline=8, wan_pipeline=wan_pipeline)
    p.peer_has("a0", KEY, range(n))
    inflight = p.requests(0.0)
    assert len(inflight) == wan_pipeline
    for step in range(1, 6):
        landed, inflight = inflight[:land], inflight[land:]
        _received_all(p, landed)
        new = p.requests(float(step))
        inflight += new
        assert len(new) == len(landed) and len(inflight) == wan_pipeline, (step, new, inflight)


def test_the_wan_budget_holds_for_a_region_named_by_equal_strs():
    p = PiecePicker("me", "r1", "r1", wan_pipeline=1)
    for peer in ("x", "y"):  # each region name its own str object, as read off the wire
        p.peer_joined(peer, NODE, "".join(["r", "2"]))
    p.add_object(KF, 4, now=0.0)
    for peer in ("x", "y"):
        p.peer_has(peer, KF, range(4))
    assert len(p.requests(0.0)) == 1


def test_a_relay_from_another_region_is_not_held_up_by_the_origins_link():
    members = {"a1": "r1", "a2": "r2"}
    # chunks a2 must bring from the origin's region, and ones it must relay from r1
    from_r0 = [c for c in range(64) if region_order(KEY, c, ["r1", "r2"], "r0")[1] == "r2"]
    from_r1 = [c for c in range(64) if region_order(KEY, c, ["r1", "r2"], "r0")[2] == "r2"]
    assert from_r0 and from_r1
    p = make("a2", members, n=64, pipeline=8, wan_pipeline=1)
    p.peer_has("a1", KEY, from_r1)
    got = p.requests(0.0)
    assert {r.peer for r in got} == {OR, "a1"} and len(got) == 2, got


def test_wan_pipeline_must_be_a_positive_int():
    for bad in (0, -1, 1.5, None):
        with pytest.raises(UsageError):
            PiecePicker("a", "r1", "r0", wan_pipeline=bad)

# --- endgame, priorities, pipeline, rarity, failures --------------------------


def test_endgame_duplicates_in_region_and_cancels():
    members = {"a": "r1", "b": "r1", "me": "r1"}
    p = make("me", members, origin_region="r0", n=2, origin=False, pipeline=2)
    p.peer_has("a", KEY, [0, 1])
    p.peer_has("b", KEY, [0, 1])
    reqs = p.requests(0.0)
    assert len(reqs) == 4  # two firsts, then a second copy of each from the other peer
    assert Counter(r.chunk for r in reqs) == {0: MAX_COPIES, 1: MAX_COPIES}
    assert len(asked(reqs)) == 4
    first = reqs[0]
    other = next(r for r in reqs if r.chunk == first.chunk and r.peer != first.peer)
    assert p.chunk_received(KEY, first.chunk, first.peer) == [other]
    assert p.in_flight() == 2
    assert p.requests(0.0) == []  # every copy allowed is out


def test_endgame_waits_until_every_missing_chunk_is_in_flight():
    p = make("me", {"a": "r1", "b": "r1", "me": "r1"}, origin_region="r0", n=2, origin=False)
    p.peer_has("a", KEY, [0])
    p.peer_has("b", KEY, [0])  # chunk 1: nobody has it yet
    assert [r.chunk for r in p.requests(0.0)] == [0]


def test_the_peer_that_delivered_gets_no_cancel_whatever_str_object_names_it():
    p = make("me", {"node-a": "r1", "node-b": "r1", "me": "r1"}, origin_region="r0", n=1, origin=False)
    p.peer_has("node-a", KEY, [0])
    p.peer_has("node-b", KEY, [0])
    assert asked(p.requests(0.0)) == {("node-a", 0), ("node-b", 0)}  # a first copy and the endgame's second
    assert p.chunk_received(KEY, 0, "".join(["node", "-a"])) == [Request("node-b", KEY, 0)]


def test_a_bad_announcement_names_its_first_five_bad_indices():
    p = make("me", {"me": "r0"})
    with pytest.raises(ProtocolError, match=r"found \[16, 17, 18, 19, 20\]$"):
        p.peer_has(OR, KEY, range(16, 30))


def test_endgame_never_crosses_the_wan():
    c = _remote_chunk("a1", "r1")
    p = make("a1", THREE, n=REMOTE_N, pipeline=4)
    p.peer_has("a0", KEY, range(c + 1))
    p.peer_has("b0", KEY, range(c + 1))
    reqs = p.requests(0.0)
    assert reqs and Counter(r.chunk for r in reqs).most_common(1)[0][1] == 1


def test_priorities_fill_the_earlier_version_first():
    p = PiecePicker("me", "r0", "r0", pipeline=4)
    p.peer_joined(OR, ORIGIN, "r0")
    later, earlier = (9, False), (8, False)
    p.add_object(later, 10, priority=9, now=0.0)
    p.add_object(earlier, 3, priority=8, now=0.0)
    for key in (later, earlier):
        p.peer_has(OR, key, range(10 if key == later else 3))
    reqs = p.requests(0.0)
    assert [r.key for r in reqs] == [earlier] * 3 + [later]


def test_pipeline_limit_per_peer():
    p = make("me", {"me": "r0"}, n=10, pipeline=3)
    reqs = p.requests(0.0)
    assert len(reqs) == 3 and p.in_flight(OR) == 3
    assert p.requests(0.0) == []
    p.chunk_received(KEY, reqs[0].chunk, OR)
    more = p.requests(0.0)
    assert len(more) == 1 and not asked(more) & asked(reqs)


@pytest.mark.parametrize("cap", [1, 2, 5])
def test_max_inflight_bounds_the_requests_to_all_peers_together(cap):
    """A node whose own downlink is the limit (`max_inflight`, sized by the fetcher from its
    download limit) asks no more of everyone together, whatever each peer's pipeline; an
    answer that lands frees one request; None lifts the bound."""
    members = {"me": "r0", "a": "r0", "b": "r0"}
    p = make("me", members, n=16, pipeline=4)
    p.max_inflight = cap
    for q in ("a", "b"):
        p.peer_has(q, KEY, range(16))
    first = p.requests(0.0)
    assert len(first) == cap and p.in_flight() == cap and p.requests(0.0) == []
    p.chunk_received(KEY, first[0].chunk, first[0].peer, 1.0)
    assert len(p.requests(1.0)) == 1 and p.in_flight() == cap
    p.max_inflight = None
    assert p.in_flight() + len(p.requests(1.0)) == 8  # a and b, 4 each (the origin comes after them)


def test_max_inflight_leaves_a_snubbed_peers_probe_out_of_the_count():
    """The probe to a snubbed member (here of the one chunk only it holds) is not counted
    against the downlink, and is still sent when the others fill it: counted, a probe that
    is not answered would hold the only request of a node at one."""
    p = _beside_a_silent_member(n=8, held=range(7), max_inflight=1)
    [first] = p.requests(0.0)
    assert first.peer == "m"  # a neighbour, before the origin
    assert p.expired(5.0) == [first] and p.snubbed("m")
    p.peer_has("m", KEY, [7])  # a chunk only it holds: asked of it alone, its probe
    again = p.requests(5.0)
    assert sorted((r.peer, r.chunk == 7) for r in again) == [("m", True), (OR, False)]
    assert p.requests(5.0) == []
    p.chunk_received(KEY, next(r.chunk for r in again if r.peer == OR), OR, 6.0)
    assert [r.peer for r in p.requests(6.0)] == [OR]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_max_inflight_is_checked(bad):
    with pytest.raises(UsageError, match="max_inflight: expected None or an int >= 1"):
        PiecePicker("me", "r0", "r0", max_inflight=bad)
    p = PiecePicker("me", "r0", "r0")
    with pytest.raises(UsageError, match="max_inflight"):
        p.max_inflight = bad


def test_fewest_in_flight_peer_gets_the_request():
    members = {"me": "r1", "a": "r1", "b": "r1"}
    p = make("me", members, origin_region="r0", n=8, origin=False, pipeline=4)
    p.peer_has("a", KEY, range(8))
    p.peer_has("b", KEY, range(8))
    reqs = p.requests(0.0)
    assert Counter(r.peer for r in reqs) == {"a": 4, "b": 4}


@pytest.mark.parametrize("seed", range(8))
def test_a_chunk_two_hold_goes_to_the_one_with_fewer_in_flight(seed):
    # b holds every chunk, a only the one both hold: rarest first gives b the other three, so
    # the shared chunk goes to a (4 slots free against b's 1), whatever the tie-break seed;
    # then the endgame asks b for a second copy.
    p = make("me", {"me": "r1", "a": "r1", "b": "r1"}, origin_region="r0", n=4, origin=False, seed=seed)
    p.peer_has("b", KEY, range(4))
    p.peer_has("a", KEY, [3])
    reqs = p.requests(0.0)
    assert asked(reqs[:3]) == {("b", 0), ("b", 1), ("b", 2)}
    assert [(r.peer, r.chunk) for r in reqs[3:]] == [("a", 3), ("b", 3)]


def test_rarest_first():
    members = {"me": "r1", "a": "r1", "b": "r1", "c": "r1"}
    p = make("me", members, origin_region="r0", n=6, origin=False, pipeline=1)
    p.peer_has("a", KEY, range(6))
    p.peer_has("b", KEY, [0, 1, 2, 3, 5])
    p.peer_has("c", KEY, [0, 1, 2, 3])
    reqs = p.requests(0.0)  # rarity: chunk 4 -> 1 holder, 5 -> 2, the others 3
    assert reqs[:2] == [Request("a", KEY, 4), Request("b", KEY, 5)]
    assert len(reqs) == 3 and reqs[2].peer == "c" and reqs[2].chunk in {0, 1, 2, 3}


def test_seeds_start_different_nodes_on_different_chunks():
    starts = set()
    for seed in range(8):
        p = make("me", {"me": "r0"}, n=64, pipeline=1, seed=seed)
        starts.add(p.requests(0.0)[0].chunk)
        again = make("me", {"me": "r0"}, n=64, pipeline=1, seed=seed)
        assert again.requests(0.0)[0].chunk in starts  # same seed, same choice
    assert len(starts) >= 5


def test_chunk_failed_is_not_asked_again_for_the_same_word():
    members = {"me": "r1", "a": "r1", "b": "r1"}
    p = make("me", members, origin_region="r0", n=1, origin=False, pipeline=1)
    p.peer_has("a", KEY, [0])
    assert p.requests(0.0) == [Request("a", KEY, 0)]
    p.chunk_failed(KEY, 0, "a")
    assert p.in_flight() == 0 and p.requests(0.0) == []  # a was the only holder
    p.peer_has("b", KEY, [0])
    assert p.requests(0.0) == [Request("b", KEY, 0)]
    p.chunk_failed(KEY, 0, "b")
    p.peer_has("a", KEY, [0])  # a repeats the same word: nothing new, not asked
    assert p.requests(0.0) == []
    assert p.missing(KEY) == 1 and not p.complete(KEY)


def test_failed_wan_source_is_replaced_by_takeover():
    # Only the region just before mine is a WAN source: when its holder fails, a farther
    # region's holder is asked once my region has stalled (takeover), not at once.
    c = _remote_chunk("a1", "r2")
    p = make("a1", THREE, n=REMOTE_N, origin=False)
    p.peer_has("a2", KEY, [c])
    p.peer_has("a0", KEY, [c])
    assert asked(p.requests(0.0)) == {("a2", c)}
    p.chunk_failed(KEY, c, "a2")
    assert p.requests(1.0) == []
    assert asked(p.requests(2.0)) == {("a0", c)}


@pytest.mark.parametrize("holders, expect", [
    (["a1", "z2"], {"a1"}),  # same-region node peer
    (["z2"], {"z2"}),  # else another region's node peer
    ([], {OR}),  # else the origin
])
def test_keyframe_sources(holders, expect):
    members = {"me": "r1", "a1": "r1", "z2": "r2"}
    p = make("me", members, n=1, key=KF)
    for h in holders:
        p.peer_has(h, KF, [0])
    assert {r.peer for r in p.requests(0.0)} == expect
    assert p.next_wakeup(0.0) is None  # keyframes wait for nobody


def test_have_before_add_object_is_kept():
    p = PiecePicker("me", "r0", "r0")
    p.peer_joined(OR, ORIGIN, "r0")
    p.peer_has(OR, KEY, range(5))
    p.add_object(KEY, 4, have=[0, 1], now=0.0)  # index 4 is out of range: dropped
    assert {r.chunk for r in p.requests(0.0)} == {2, 3}


def test_remove_object_cancels_in_flight():
    p = make("me", {"me": "r0"}, n=5, pipeline=2)
    reqs = p.requests(0.0)
    assert sorted(p.remove_object(KEY)) == sorted(reqs)
    assert p.in_flight() == 0 and p.remove_object(KEY) == []


def test_complete_object_and_late_facts():
    p = make("me", {"me": "r0"}, n=2, pipeline=2)
    for r in p.requests(0.0):
        p.chunk_received(r.key, r.chunk, r.peer)
    assert p.complete(KEY) and p.missing(KEY) == 0
    assert p.chunk_received(KEY, 0, OR) == []  # a late duplicate is harmless
    p.peer_has(OR, KEY, [1])
    assert p.requests(1.0) == [] and p.next_wakeup(1.0) is None


@pytest.mark.parametrize("call, exc", [
    (lambda p: p.peer_has("stranger", KEY, [0]), UsageError),
    (lambda p: p.peer_has(OR, KEY, [16]), ProtocolError),
    (lambda p: p.peer_joined(OR, ORIGIN, "r0"), UsageError),
    (lambda p: p.peer_joined("x", "seeder", "r0"), UsageError),
    (lambda p: p.add_object(KEY, 3, now=0.0), UsageError),
    (lambda p: p.add_object((1, 0), 3, now=0.0), UsageError),
    (lambda p: p.add_object((1, False, 0), 3, now=0.0), UsageError),
    (lambda p: p.peer_joined("".join(["m", "e"]), NODE, "r0"), UsageError),  # me, as a str read off the wire
    (lambda p: p.add_object((2, False), 3, have=[3], now=0.0), UsageError),
    (lambda p: p.chunk_received(KEY, -1, OR), UsageError),
    (lambda p: p.missing((99, False)), UsageError),
    (lambda p: p.set_members({"me": "elsewhere"}), UsageError),
])
def test_misuse_and_bad_facts_raise(call, exc):
    p = make("me", {"me": "r0"})
    with pytest.raises(exc):
        call(p)


def test_constructor_rejects_bad_limits():
    with pytest.raises(UsageError):
        PiecePicker("me", "r0", "r0", pipeline=0)
    with pytest.raises(UsageError):
        PiecePicker("me", "r0", "r0", takeover_after=-1.0)
    for bad in (0, -1.0):
        with pytest.raises(UsageError, match="request_timeout"):
            PiecePicker("me", "r0", "r0", request_timeout=bad)


# --- requests in flight: when they were sent, when they run out ----------------


def _neighbour_and_origin(timeout=10.0):
    """me alone responsible in r0 (a neighbour a that is not a member), both holding chunk 0 of 1."""
    p = PiecePicker("me", "r0", "r0", request_timeout=timeout)
    p.peer_joined("a", NODE, "r0")
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, 1, now=0.0)
    p.peer_has("a", KEY, [0])
    p.peer_has(OR, KEY, [0])
    return p


def test_a_request_unanswered_in_time_expires_once_and_goes_to_another_holder():
    p = _neighbour_and_origin()
    assert p.requests(1.0) == [Request("a", KEY, 0)]  # the neighbour first; the origin is never an endgame copy
    assert p.sent_at("a", KEY, 0) == 1.0 and p.next_wakeup(1.0) == 11.0
    assert p.expired(10.9) == [] and p.in_flight() == 1
    assert p.expired(11.0) == [Request("a", KEY, 0)]  # the caller cancels it
    assert p.expired(50.0) == [] and p.in_flight() == 0 and p.sent_at("a", KEY, 0) is None
    assert p.requests(11.0) == [Request(OR, KEY, 0)]  # never the one that let it run out
    assert p.expired(21.0) == [Request(OR, KEY, 0)]
    assert p.requests(21.0) == [] and p.next_wakeup(21.0) is None  # nobody left to ask


def test_without_a_timeout_requests_never_expire():
    p = _neighbour_and_origin(timeout=None)
    assert p.requests(0.0) and p.next_wakeup(0.0) is None and p.expired(1e9) == []


def test_an_answer_in_time_does_not_expire():
    p = _neighbour_and_origin()
    [r] = p.requests(0.0)
    assert p.chunk_received(r.key, r.chunk, r.peer) == []
    assert p.expired(100.0) == [] and p.next_wakeup(100.0) is None


# --- what peers said: held whole, arriving, refused; kept until fetched ----------


@pytest.mark.parametrize("said, expect", [
    ([], (False, False)),
    (["have"], (True, True)),
    (["incoming"], (True, False)),  # served as it arrives, not held whole
    (["incoming", "have"], (True, True)),
    (["have", "incoming"], (True, True)),  # an Incoming after it held the chunk changes nothing
    (["have", "refused"], (False, False)),  # a Reject withdraws what it said
    (["incoming", "refused"], (False, False)),
    (["have", "refused", "incoming"], (True, False)),  # it is receiving the chunk again
    (["have", "refused", "have"], (True, True)),
    (["have", "left"], (False, False)),  # a peer that left holds nothing; a new session starts afresh
])
@pytest.mark.parametrize("added_first", [True, False])  # the object fetched, or not yet
def test_announced_and_holds_whole_table(said, expect, added_first):
    p = PiecePicker("me", "r0", "r0")
    p.peer_joined("a", NODE, "r0")
    if added_first:
        p.add_object(KEY, 4, now=0.0)
    for word in said:
        if word == "have":
            p.peer_has("a", KEY, [2])
        elif word == "incoming":
            p.peer_has("a", KEY, [2], whole=False)
        elif word == "refused":
            p.chunk_refused(KEY, 2, "a")
        else:
            p.peer_left("a")
            p.peer_joined("a", NODE, "r0")
    if not added_first:
        p.add_object(KEY, 4, now=0.0)
    assert (p.announced("a", KEY, 2), p.holds_whole("a", KEY, 2)) == expect
    assert (p.announced("a", KEY, 1), p.holds_whole("a", KEY, 1)) == (False, False)


def _both_chunks_asked_of_one_neighbour() -> PiecePicker:
    p = PiecePicker("me", "r0", "r0")
    p.peer_joined("a", NODE, "r0")
    p.add_object(KEY, 2, now=0.0)
    p.peer_has("a", KEY, [0, 1])
    assert asked(p.requests(0.0)) == {("a", 0), ("a", 1)}
    return p


def test_a_refusing_peer_is_asked_again_as_soon_as_it_announces_the_chunk_again():
    p = _both_chunks_asked_of_one_neighbour()
    p.chunk_refused(KEY, 0, "a")
    assert p.requests(0.5) == [] and p.in_flight() == 1  # refused, and nothing new said
    p.peer_has("a", KEY, [0])  # says it again (got it meanwhile): asked at once
    assert p.requests(0.5) == [Request("a", KEY, 0)]


def test_a_lost_request_is_released_without_blame_and_the_peer_asked_again():
    """`request_lost` (a resumed chunk that did not verify: its first bytes came from
    another peer) releases the request and leaves the peer a source, unlike a failure."""
    p = _both_chunks_asked_of_one_neighbour()
    p.request_lost(KEY, 0, "a")
    assert p.in_flight() == 1 and p.requests(0.1) == [Request("a", KEY, 0)]
    p.request_lost(KEY, 1, "b")  # not in flight to that peer: nothing changes
    p.chunk_received(KEY, 1, "a")
    p.request_lost(KEY, 1, "a")  # held already: nothing changes
    assert p.in_flight() == 1 and p.missing(KEY) == 1
    p.chunk_failed(KEY, 0, "a")  # a failure, by contrast, is not asked again
    assert p.requests(0.2) == [] and p.in_flight() == 0


@pytest.mark.parametrize("again", ["whole", "arriving"])
def test_a_broken_relay_does_not_keep_a_neighbour_from_being_asked(again):
    """The stall of issue 26: a neighbour relays a chunk it is receiving from its
    region's gateway; the gateway dies, so the neighbour refuses the chunk
    mid-stream; it later gets the chunk anew (Incoming, then HaveOne). The node
    must ask it in the very next step, not after the 2 s takeover delay."""
    members = {"me": "r1", "gw": "r1", "nb": "r1", "x": "r0"}
    c = find_chunk(lambda c: c not in owned("me", members, 8, k=None), 8)  # me waits for its region
    p = make("me", members, n=8, pipeline=1, origin=False, takeover_after=2.0)
    p.peer_has("nb", KEY, [c], whole=False)  # nb's first part arrived: it relays as it comes
    assert (("nb", c)) in asked(p.requests(0.0))
    t = 0.1
    p.chunk_refused(KEY, c, "nb")  # nb's own source (the gateway) died: "stream aborted"
    p.peer_left("gw")
    assert ("nb", c) not in asked(p.requests(t))
    t += 0.3
    p.peer_has("nb", KEY, [c], whole=again == "whole")  # nb got it anew
    assert ("nb", c) in asked(p.requests(t))  # one step, no 2 s fallback
    assert t < 2.0


def test_a_request_that_expired_is_asked_again_once_the_peer_holds_it_whole():
    members = {"me": "r1", "nb": "r1"}
    p = PiecePicker("me", "r1", "r0", request_timeout=1.0)
    p.set_members(members)
    p.peer_joined("nb", NODE, "r1")
    p.add_object(KEY, 1, now=0.0)
    p.peer_has("nb", KEY, [0], whole=False)
    assert p.requests(0.0) == [Request("nb", KEY, 0)]
    assert p.expired(1.0) == [Request("nb", KEY, 0)]
    p.peer_has("nb", KEY, [0], whole=False)  # the same word again: nothing new
    assert p.requests(1.0) == []
    p.peer_has("nb", KEY, [0])  # whole now
    assert p.requests(1.1) == [Request("nb", KEY, 0)]


def test_a_gateway_whose_session_closes_leaves_the_plan_at_once_and_comes_back_on_reconnect():
    """The tracker lists a killed gateway until its heartbeat times out (10 s):
    its share moves when its session closes, not then."""
    members = {"a": "r1", "b": "r1", "x": "r0"}
    n = 24
    p = make("b", members, n=n, pipeline=n, wan_pipeline=n, origin=False, connect=["a", "x"])
    p.peer_has("x", KEY, range(n))
    mine, theirs = owned("b", members, n), owned("a", members, n)
    assert theirs and {r.chunk for r in p.requests(0.0)} == mine
    p.peer_left("a")  # killed; the tracker still lists it
    again = p.requests(0.01)
    assert {r.chunk for r in again} == theirs and {r.peer for r in again} == {"x"}
    assert p.responsible_for(KEY) == n
    p.set_members(members)  # the tracker's next list, still with a: a stays out
    assert p.responsible_for(KEY) == n
    p.peer_joined("a", NODE, "r1")  # restarted and connected: back in the plan
    assert p.responsible_for(KEY) == len(mine)


def test_what_peers_said_survives_an_object_leaving_the_plan_and_coming_back():
    p = PiecePicker("me", "r0", "r0", pipeline=1)
    p.peer_joined("a", NODE, "r0")
    p.add_object(KEY, 3, now=0.0)
    p.peer_has("a", KEY, [0, 2])
    p.peer_has("a", KEY, [1], whole=False)
    [r] = p.requests(0.0)
    assert p.chunk_received(r.key, r.chunk, "a") == []
    assert p.remove_object(KEY) == []
    p.add_object(KEY, 3, have=[r.chunk], now=1.0)
    left = {0, 1, 2} - {r.chunk}
    assert {c for c in left if p.announced("a", KEY, c)} == left
    assert {c for c in left if p.holds_whole("a", KEY, c)} == left - {1}
    assert p.requests(1.0)[0].peer == "a"


def test_objects_wait_for_the_origins_region_and_facts_wait_for_objects():
    p = PiecePicker("me", "r1", None)
    p.peer_joined("a", NODE, "r1")
    p.peer_has("a", KEY, [0, 1])  # before anything is known: kept
    with pytest.raises(UsageError, match="origin's region"):
        p.add_object(KEY, 2, now=0.0)
    p.set_origin_region("r0")
    p.set_origin_region("r2")  # the first word stands
    assert p.origin_region == "r0"
    p.add_object(KEY, 2, now=0.0)
    assert asked(p.requests(0.0)) == {("a", 0), ("a", 1)}


def test_facts_below_the_forgotten_versions_are_dropped_and_ignored():
    p = PiecePicker("me", "r0", "r0")
    p.peer_joined("a", NODE, "r0")
    p.peer_has("a", (3, False), [0])
    p.peer_has("a", (5, False), [0])
    p.forget_below(5)
    p.peer_has("a", (4, False), [0])  # said later, still below: ignored
    assert not p.announced("a", (3, False), 0) and not p.announced("a", (4, False), 0)
    assert p.announced("a", (5, False), 0)


def test_takeover_takes_at_most_pipeline_per_idle_round():
    members = {"a1": "r1", "b1": "r1"}
    stuck = owned("a1", members, 40)
    p = make("b1", members, n=40, origin_region="r1", takeover_after=1.0, pipeline=3)
    for _ in range(40):  # b1's own share, from the origin
        _received_all(p, p.requests(0.0))
    assert p.missing(KEY) == len(stuck) and p.requests(0.5) == []
    first = p.requests(1.0)
    assert len(first) == 3 and {r.chunk for r in first} <= stuck
    assert p.requests(1.0) == []  # not idle while those are out
    _received_all(p, first)
    assert len(p.requests(1.0)) == 3


def test_an_idle_round_takes_over_at_most_pipeline_chunks_over_all_objects():
    # Two objects, every chunk stuck (the origin's region is mine, the origin not connected), and
    # two other regions' nodes hold them all, with 6 free slots between them: still 3 a round.
    members = {"a1": "r1", "b1": "r1", "x2": "r2", "x3": "r3"}
    p = make("b1", members, n=40, origin_region="r1", takeover_after=1.0, pipeline=3, wan_pipeline=3, origin=False)
    p.add_object((8, False), 40, now=0.0)
    for key in (KEY, (8, False)):
        for peer in ("x2", "x3"):
            p.peer_has(peer, key, range(40))
    assert p.requests(0.0) == []
    taken = p.requests(1.0)
    assert len(taken) == 3 and {r.why for r in taken} == {STALLED}


@pytest.mark.parametrize("pipeline, first_n", [(2, 1), (3, 1), (3, 2), (4, 1), (4, 3)])
def test_an_idle_round_takes_over_pipeline_chunks_when_the_first_object_has_fewer(pipeline, first_n):
    # The first object has first_n (< pipeline) stuck chunks, the next 40: the round takes all of
    # the first's and tops up from the next to exactly `pipeline`, no more.
    members = {"a1": "r1", "b1": "r1", "x2": "r2", "x3": "r3"}
    p = make("b1", members, n=first_n, origin_region="r1", takeover_after=1.0, pipeline=pipeline,
             wan_pipeline=pipeline, origin=False)
    p.add_object((8, False), 40, now=0.0)
    for key, n in ((KEY, first_n), ((8, False), 40)):
        for peer in ("x2", "x3"):
            p.peer_has(peer, key, range(n))
    assert p.requests(0.0) == []
    taken = p.requests(1.0)
    assert len(taken) == pipeline and Counter(r.key for r in taken) == {KEY: first_n, (8, False): pipeline - first_n}


# --- one picker under random facts --------------------------------------------

PEERS = {"o": (ORIGIN, "r0"), "x1": (NODE, "r1"), "y1": (NODE, "r1"), "x0": (NODE, "r0"),
         "y0": (NODE, "r0"), "x2": (NODE, "r2"), "z1": (NODE, "r1")}
OBJECTS = {KEY: 12, (8, False): 5, KF: 6}
fact = st.one_of(
    st.tuples(st.just("join"), st.sampled_from(sorted(PEERS))),
    st.tuples(st.just("leave"), st.sampled_from(sorted(PEERS))),
    st.tuples(st.just("has"), st.sampled_from(sorted(PEERS)), st.sampled_from(sorted(OBJECTS)),
              st.lists(st.integers(0, 11), max_size=6), st.booleans()),
    st.tuples(st.just("recv"), st.integers(0, 50)),
    st.tuples(st.just("fail"), st.integers(0, 50)),
    st.tuples(st.just("refuse"), st.integers(0, 50)),
    st.tuples(st.just("members"), st.sets(st.sampled_from(["x1", "y1", "x0", "y0", "x2", "z1"])),
              st.dictionaries(st.sampled_from(["me", "x1", "y1", "x0", "y0", "x2", "z1"]),
                              st.sampled_from([1.0, 10.0, 100.0]), max_size=7)),  # declared uplinks
    st.tuples(st.just("requests"), st.floats(0, 1)),  # seconds the clock moves on first
    st.tuples(st.just("expire"), st.floats(0, 3)),
    st.tuples(st.just("part"), st.sampled_from(sorted(PEERS))),
)
TIMEOUT = 2.0
SNUB = 1.5  # below TIMEOUT: a node peer's requests mostly go by its snub, the origin's by the timeout


def _check_sources(p: PiecePicker) -> None:
    """Each missing chunk's sources are exactly its holders at the best tier (not failed), as a
    full ranking gives them, however facts and snubs moved them incrementally."""
    for obj in p._objects.values():
        tier_of = p._tiers.tier_of(obj)
        for c in obj.missing:
            best, srcs = obj.best_holders(c, tier_of, p._peers)
            assert obj.sources.get(c, set()) == srcs and obj.tier.get(c, best) == best, (obj.key, c)
            assert obj.ready(c) == (c in obj.ready_of.get(next(iter(srcs)), ()) if srcs else False), (obj.key, c)


@settings(max_examples=150, deadline=None)
@given(st.lists(fact, max_size=60), st.integers(1, 3), st.integers(0, 99), st.sampled_from(["r1", "r0"]),
       st.sampled_from([None, SNUB]), st.booleans(), st.sampled_from([None, 1, 2]))
# A refused chunk announced again (arriving) may be asked again: the model once kept it failed for good
@example(facts=[("join", "o"), ("has", "o", KEY, [0], False), ("requests", 0.0), ("refuse", 0),
                ("has", "o", KEY, [0], False), ("requests", 0.0)], pipeline=1, seed=0, region="r1", snub_after=None,
         everyone_first=False, max_inflight=None)
# A snubbed peer that leaves and joins again is still snubbed; a part ends it
@example(facts=[("join", "x1"), ("has", "x1", KEY, [0, 1], True), ("requests", 0.0), ("expire", 2.0),
                ("leave", "x1"), ("join", "x1"), ("has", "x1", KEY, [0, 1], True), ("requests", 0.0),
                ("part", "x1"), ("requests", 0.0)], pipeline=3, seed=0, region="r1", snub_after=SNUB,
         everyone_first=False, max_inflight=None)
def test_property_random_facts_keep_the_contract(facts, pipeline, seed, region, snub_after, everyone_first,
                                                 max_inflight):
    """In r0, the origin's region, with the daemon's `origin_pipeline`: requests the picker
    withdraws (moved to the origin, `pick_rest`) leave the model's requests in flight. With
    `snub_after`: a node peer that held requests and sent no part (`part`: `peer_sent`) for
    that long loses them all at once, then holds at most one until a part comes, also
    across a new session; each chunk's sources stay its best holders. `everyone_first`: every
    peer joins and announces some chunks (seeded) before the facts, which alone seldom get a
    node peer asked; after them, 3 s pass a second at a time, and parts come from two peers.
    `max_inflight`: a round asks peers not snubbed only while fewer than that are in flight
    to them (a snub that ends may leave more, never a round)."""
    in_origin_region = {"origin_pipeline": ORIGIN_PIPELINE, "endgame_after": ENDGAME_AFTER} if region == "r0" else {}
    p = PiecePicker("me", region, "r0", seed=seed, pipeline=pipeline, takeover_after=1.0, request_timeout=TIMEOUT,
                    snub_after=snub_after, max_inflight=max_inflight, **in_origin_region)
    for key, n in OBJECTS.items():
        p.add_object(key, n, priority=key[0], now=0.0)
    joined, holds, mine, sent = set(), {}, {k: set() for k in OBJECTS}, {}  # sent: request -> when
    said = {}  # (peer, key) -> chunk -> "whole" / "arriving": what the peer says now
    failed = set()  # (peer, key, chunk) not to be asked again until the peer's word on it changes
    # A node peer's silence: when its last part came, and when it was last asked with nothing in
    # flight (either of two times where a round both withdrew and asked: their order is the picker's).
    last_part, busy_since, snubbed = {}, {}, set()
    members = set()
    clock = 0.0
    if everyone_first:
        rng = random.Random(seed)
        prelude = [("join", peer) for peer in sorted(PEERS)]
        prelude += [("has", peer, key, sorted(rng.sample(range(n), rng.randint(1, n))), rng.random() < 0.8)
                    for peer in sorted(PEERS) for key, n in OBJECTS.items()]
        facts = prelude + facts
    # Then time passes: requests run out, peers are snubbed; parts come from two of them.
    for f in facts + [("expire", 1.0), ("requests", 0.0)] * 3 + [("part", "x1"), ("part", "y0"), ("requests", 0.0)]:
        if f[0] == "join" and f[1] not in joined:
            p.peer_joined(f[1], *PEERS[f[1]])
            joined.add(f[1])
        elif f[0] == "leave":
            p.peer_left(f[1])
            joined.discard(f[1])
            sent = {r: t for r, t in sent.items() if r.peer != f[1]}
            holds = {k: v for k, v in holds.items() if k[0] != f[1]}
            said = {k: v for k, v in said.items() if k[0] != f[1]}
            failed = {x for x in failed if x[0] != f[1]}
            last_part.pop(f[1], None)
            busy_since.pop(f[1], None)
        elif f[0] == "part" and f[1] in joined:
            p.peer_sent(f[1], clock)
            last_part[f[1]] = clock
            snubbed.discard(f[1])
        elif f[0] == "has" and f[1] in joined:
            chunks = [c for c in f[3] if c < OBJECTS[f[2]]]
            p.peer_has(f[1], f[2], chunks, whole=f[4])
            holds.setdefault((f[1], f[2]), set()).update(chunks)
            now_said = said.setdefault((f[1], f[2]), {})
            for c in chunks:
                word = "whole" if f[4] or now_said.get(c) == "whole" else "arriving"
                if word != now_said.get(c):  # its word changed (after a refusal, or arriving -> whole):
                    failed.discard((f[1], f[2], c))  # a failed request's answer may differ now
                now_said[c] = word
        elif f[0] in ("recv", "fail", "refuse") and sent:
            r = sorted(sent)[f[1] % len(sent)]
            if f[0] == "recv":
                cancels = p.chunk_received(r.key, r.chunk, r.peer, clock)
                copies = {o for o in sent if (o.key, o.chunk) == (r.key, r.chunk)}
                assert set(cancels) == copies - {r}
                for o in copies:
                    del sent[o]
                mine[r.key].add(r.chunk)
            else:
                if f[0] == "fail":
                    p.chunk_failed(r.key, r.chunk, r.peer)
                else:
                    p.chunk_refused(r.key, r.chunk, r.peer)
                    said.get((r.peer, r.key), {}).pop(r.chunk, None)
                del sent[r]
                failed.add((r.peer, r.key, r.chunk))
        elif f[0] == "members":
            p.set_members({m: PEERS[m][1] for m in f[1]} | {"me": region}, f[2])
            members = set(f[1])
            snubbed &= members | joined  # remembered for members and connected peers only
        elif f[0] == "requests":
            clock += f[1]
            asked = p.requests(clock)
            busy_before = {r.peer for r in sent}
            if max_inflight is not None:
                before = sum(r.peer not in snubbed for r in sent)
                assert sum(r.peer not in snubbed for r in asked) <= max(0, max_inflight - before), (before, asked)
            for r in p.withdrawn():  # moved to the origin: the request was in flight, now it is not
                assert r in sent and r.peer != "o" and r not in asked
                del sent[r]
            for r in asked:
                assert r.peer in joined
                assert r.chunk in holds.get((r.peer, r.key), ()), f"{r.peer} lacks {r}"
                assert r.chunk not in mine[r.key] and r not in sent
                assert (r.peer, r.key, r.chunk) not in failed, f"{r} was asked again"
                assert p.sent_at(r.peer, r.key, r.chunk) == clock
                if not any(q.peer == r.peer for q in sent):
                    old = busy_since.get(r.peer, (-math.inf,))
                    busy_since[r.peer] = (old[0], clock) if r.peer in busy_before else (clock,)
                sent[r] = clock
        elif f[0] == "expire":
            clock += f[1]
            late = p.expired(clock)
            silent = set()
            for peer in {r.peer for r in sent}:
                if snub_after is None or PEERS[peer][0] != NODE:
                    continue
                due = [max(last_part.get(peer, -math.inf), b) + snub_after for b in busy_since[peer]]
                if max(due) <= clock:
                    silent.add(peer)
                elif min(due) <= clock:  # either: which, the picker's order in that round decided
                    theirs = {r for r in sent if r.peer == peer}
                    if p.snubbed(peer) if peer not in snubbed else {r for r in late if r.peer == peer} == theirs:
                        silent.add(peer)
                    else:
                        busy_since[peer] = busy_since[peer][-1:]
            assert late == sorted(r for r, t in sent.items() if r.peer in silent or t + TIMEOUT <= clock)
            assert silent <= {q for q in joined if p.snubbed(q)}
            snubbed |= silent
            for r in late:
                del sent[r]
                failed.add((r.peer, r.key, r.chunk))
        assert p.in_flight() == len(sent)
        for peer in PEERS:
            assert p.in_flight(peer) == sum(r.peer == peer for r in sent) <= (1 if peer in snubbed else pipeline)
            assert p.snubbed(peer) == (peer in snubbed), peer
        _check_sources(p)
        for key, n in OBJECTS.items():
            assert p.missing(key) == n - len(mine[key])
            for peer in joined:
                for c in set(range(n)) - mine[key]:
                    word = said.get((peer, key), {}).get(c)
                    assert (p.announced(peer, key, c), p.holds_whole(peer, key, c)) == \
                        (word is not None, word == "whole"), (peer, key, c, word)


def test_coordinated_keyframe_follows_the_wan_plan():
    """The first version's keyframe, which every member bootstraps from, is fetched like a patch:
    only the responsible node asks the origin for each chunk."""
    key = (0, True)
    members = {"a": "r0", "b": "r0", "c": "r0"}
    asked_origin = Counter()
    for me in members:
        p = PiecePicker(me, "r0", "r0", seed=1, pipeline=12)
        p.set_members(members)
        p.add_object(key, 12, now=0.0, coordinated=True)
        p.peer_joined("origin", ORIGIN, "r0")
        p.peer_has("origin", key, range(12))
        for r in p.requests(0.0):
            assert r.peer == "origin"
            asked_origin[r.chunk] += 1
    assert sorted(asked_origin) == list(range(12)) and set(asked_origin.values()) == {1}
    # Uncoordinated (the default for keyframes), every node asks the origin at once.
    p = PiecePicker("a", "r0", "r0", seed=1)
    p.set_members(members)
    p.add_object(key, 12, now=0.0)
    p.peer_joined("origin", ORIGIN, "r0")
    p.peer_has("origin", key, range(12))
    assert len(p.requests(0.0)) == p.pipeline


def test_slow_but_moving_region_is_not_taken_over():
    """A responsible node that keeps bringing chunks over a slow WAN is left to it; one that stalls is not."""
    members = {"a1": "r1", "b1": "r1", "a0": "r0"}
    n = 40
    own, theirs = owned("b1", members, n), sorted(owned("a1", members, n))
    p = make("b1", members, n=n, takeover_after=2.0, now=0.0, pipeline=n, wan_pipeline=n)
    p.peer_has("a0", KEY, range(n))
    _received_all(p, p.requests(0.0))  # b1's own share is done: b1 is idle from here on
    t = 0.0
    for c in theirs[:4]:  # a1 delivers one chunk every 1.5 s: slow, but moving
        t += 1.5
        p.peer_has("a1", KEY, [c])
        got = p.requests(t)
        assert asked(got) == {("a1", c)}, "take it from the neighbour, never across the WAN"
        _received_all(p, got)
        assert p.requests(t) == []  # the daemon asks again after every fact
    assert p.requests(t + 1.9) == []  # quiet for less than 2 s: still no takeover
    taken = p.requests(t + 2.1)  # a1 stalled: take over its remaining share, pipeline at a time
    assert taken and asked(taken) <= {("a0", c) for c in theirs[4:]}


# --- the origin's region: shares taken over, requests to the origin, late endgame (issue 26) ---

R0 = {"a": "r0", "b": "r0", "c": "r0", "d": "r0"}


def _origin_region(me="a", n=16, origin_pipeline=2, pipeline=4, **kw):
    p = PiecePicker(me, "r0", "r0", seed=1, pipeline=pipeline, wan_gateways=2, origin_pipeline=origin_pipeline, **kw)
    p.set_members(R0)
    for other in sorted(set(R0) - {me}):
        p.peer_joined(other, NODE, "r0")
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, n, now=0.0)
    p.peer_has(OR, KEY, range(n))
    return p


def _receive_own_share(p, me, n, chunk_s=0.1):
    """`me` asks the origin for its share and has it, each chunk `chunk_s` after its request."""
    for c in sorted(owned(me, R0, n)):
        for r in p.requests(0.0):
            p.chunk_received(r.key, r.chunk, r.peer, now=chunk_s)
    assert not owned(me, R0, n) - {c for c in range(n) if c not in p._objects[KEY].missing}


def test_in_the_origins_region_at_most_origin_pipeline_requests_go_to_the_origin():
    """One arriving and one queued behind it: what a member has asked for and not started
    is one chunk (before: 4, the picker's pipeline, so a share taken over collided)."""
    p = _origin_region(origin_pipeline=2, pipeline=4)
    reqs = p.requests(0.0)
    assert len(reqs) == 2 and {r.peer for r in reqs} == {OR} and {r.chunk for r in reqs} <= owned("a", R0, 16)
    unset = _origin_region(origin_pipeline=None, pipeline=4)
    assert len(unset.requests(0.0)) == 4  # without it, the picker's pipeline


def test_a_member_done_with_its_share_takes_over_one_of_the_busiest_members_share():
    """Issue 26 (bench/RESULTS.md, 2026-12-05): the shares are static and the members' flows
    from the origin are not equally fast; the origin's last 0.2-0.5 s served only the slowest
    member's rest, through its downlink, while the others' uplinks idled."""
    n = 16
    p = _origin_region(n=n)
    _receive_own_share(p, "a", n)
    # b has had half its share whole (announced), c and d nothing yet.
    b_share = sorted(owned("b", R0, n))
    p.peer_has("b", KEY, b_share[: len(b_share) // 2])
    taken = []
    for _ in range(3):  # one chunk per round, up to the origin's slots
        taken += [r for r in p.requests(0.0) if r.peer == OR]
    assert len(taken) == 1  # one at a time: only with nothing in flight to the origin
    for r in taken:
        owner = next(m for m in "bcd" if r.chunk in owned(m, R0, n))
        assert owner in "cd"  # not b, which is further along
        assert r.why == SHARE  # what the fetcher's debug line says of it
    # Where a chunk from the origin comes fast against how late members hear of each other
    # (TAKEOVER_MIN_CHUNK_S; at 1 Gbit/s taking over cost the origin 4-14 % more bytes): no take-over.
    fast = _origin_region(n=n)
    _receive_own_share(fast, "a", n, chunk_s=0.01)
    fast.peer_has("b", KEY, b_share[: len(b_share) // 2])
    assert all(r.peer != OR for r in fast.requests(0.0))
    # Without origin_pipeline the plan's shares stand: a waits for its neighbours.
    fixed = _origin_region(n=n, origin_pipeline=None)
    _receive_own_share(fixed, "a", n)
    assert fixed.requests(0.0) == []


def test_no_share_is_taken_over_while_ones_own_has_chunks_to_ask_for():
    p = _origin_region(n=16, origin_pipeline=2, pipeline=4)
    first = p.requests(0.0)
    p.chunk_received(KEY, first[0].chunk, OR)
    again = p.requests(0.0)
    assert again and all(r.chunk in owned("a", R0, 16) for r in first + again)


def test_a_chunk_a_member_announced_is_never_taken_from_the_origin():
    n = 16
    p = _origin_region(n=n)
    _receive_own_share(p, "a", n)
    for m in "bcd":  # every other member is receiving its whole share
        p.peer_has(m, KEY, owned(m, R0, n), whole=False)
    assert all(r.peer != OR for r in p.requests(0.0))


def test_a_share_with_one_chunk_left_is_left_to_its_owner():
    """Its owner's next request, queued at the origin, is that chunk: taking it would
    make the origin send it twice."""
    n = 16
    p = _origin_region(n=n)
    _receive_own_share(p, "a", n)
    for m in "bcd":
        rest = sorted(owned(m, R0, n))
        p.peer_has(m, KEY, rest[:-1])  # all but one chunk of each share whole
    assert all(r.peer != OR for r in p.requests(0.0))


def _fanning_out(n=16, chunk_s=0.3, whole=True, **kw):
    """Member a holds its share; every other chunk is at its owner, whole or arriving (the
    origin has sent the region all of it, or is sending its last): a's first round, which
    asks the owners for all of them."""
    p = _origin_region(n=n, pipeline=8, endgame_after=ENDGAME_AFTER, **kw)
    _receive_own_share(p, "a", n, chunk_s=chunk_s)
    for m in "bcd":
        p.peer_has(m, KEY, owned(m, R0, n), whole=whole)
    return p, p.requests(0.0)


def _moves(chunk, lacking):
    """a is the member of highest plan weight among it and `lacking` (the others that lack the chunk)."""
    return max(["a", *lacking], key=lambda m: member_weight(m, KEY, chunk)) == "a"


@pytest.mark.parametrize("whole", [True, False])
def test_once_the_origin_is_sending_its_last_a_fanned_out_chunk_s_rest_comes_from_it(whole):
    """Issue 26 (bench/RESULTS.md, 2026-12-05): the region's last 0.1-0.2 s was one or two
    members' uplinks fanning out the origin's last chunks to three others while the origin
    idled. Once no chunk is left for the origin to start, the member of highest weight
    among those that lack a chunk takes its rest from the origin; the source keeps the
    other copies."""
    n = 16
    p, first = _fanning_out(n, whole=whole)
    source = {r.chunk: r.peer for r in first if r.peer != OR}
    [moved] = [r for r in first if r.peer == OR]  # one at a time (the origin's slot), in the same round:
    assert moved.why == REST and {r.why for r in first if r.peer != OR} == {PLANNED}
    assert moved.chunk not in source and p.withdrawn() == []  # its request to the source never went out
    source[moved.chunk] = next(m for m in "bcd" if moved.chunk in owned(m, R0, n))
    assert set(source) == p._objects[KEY].missing | {moved.chunk}
    expected = {c for c, src in source.items() if _moves(c, set("bcd") - {src})}
    assert moved.chunk in expected and len(expected) >= 2  # the hashes of this table: a moves two
    assert p.requests(0.1) == []  # nothing more while that rest is in flight
    p.chunk_received(KEY, moved.chunk, OR, now=0.05)  # a rest comes fast: not a chunk's time from the origin
    [again] = p.requests(0.05)
    assert again.peer == OR and again.chunk in expected - {moved.chunk}
    assert p.withdrawn() == [Request(source[again.chunk], KEY, again.chunk)] and p.withdrawn() == []


def test_no_rest_from_the_origin_while_it_still_sends_or_where_the_source_serves_one():
    n = 16
    # One chunk of each other share not announced yet: the origin has yet to send it (and
    # its owner has asked for it: a share's last chunk is left to its owner).
    busy = _origin_region(n=n, pipeline=8)
    _receive_own_share(busy, "a", n, chunk_s=0.3)
    for m in "bcd":
        busy.peer_has(m, KEY, sorted(owned(m, R0, n))[:-1])
    assert all(r.peer != OR for r in busy.requests(0.0) + busy.requests(0.0)) and busy.withdrawn() == []
    # Every other member holds everything whole: each source serves a alone.
    alone = _origin_region(n=n)
    _receive_own_share(alone, "a", n, chunk_s=0.3)
    for m in "bcd":
        alone.peer_has(m, KEY, set(range(n)) - owned("a", R0, n))
    assert all(r.peer != OR for r in alone.requests(0.0)) and all(r.peer != OR for r in alone.requests(0.0))
    # Chunks from the origin that come fast (a 1 Gbit/s LAN: 0.02-0.10 s), even where shares are
    # taken over (0.1 s): nothing moves. Nor without origin_pipeline.
    for p, _ in (_fanning_out(n, chunk_s=0.1), _fanning_out(n, origin_pipeline=None)):
        assert all(r.peer != OR for r in p.requests(0.0)) and p.withdrawn() == []


def test_outside_the_origins_region_no_share_is_taken_over():
    members = {**R0, "x": "r1", "y": "r1"}
    p = PiecePicker("x", "r1", "r0", seed=1, pipeline=4, wan_gateways=2, origin_pipeline=2)
    p.set_members(members)
    for other in ("a", "b", "y"):
        p.peer_joined(other, NODE, members[other])
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, 16, now=0.0)
    p.peer_has(OR, KEY, range(16))
    mine = owned("x", members, 16, k=2)
    assert {r.chunk for r in p.requests(0.0)} <= mine  # the WAN plan's share only, never another's


def test_endgame_waits_endgame_after_seconds_before_a_second_copy():
    """Where the LAN is the limit, an immediate second copy took the links the last chunks
    needed: 1.2-2.1 MB more into each member of the origin's region at 100 Mbit/s."""
    members = {"a": "r1", "b": "r1", "me": "r1"}
    p = PiecePicker("me", "r1", "r0", pipeline=2, wan_gateways=None, endgame_after=0.5)
    p.set_members(members)
    for m in ("a", "b"):
        p.peer_joined(m, NODE, "r1")
    p.add_object(KEY, 2, now=0.0)
    p.peer_has("a", KEY, [0, 1])
    p.peer_has("b", KEY, [0, 1])
    first = p.requests(0.0)
    assert len(first) == 2 and len({r.chunk for r in first}) == 2  # one copy of each
    assert p.requests(0.3) == [] and p.next_wakeup(0.3) == 0.5
    second = p.requests(0.5)
    assert Counter(r.chunk for r in first + second) == {0: MAX_COPIES, 1: MAX_COPIES}
    assert {r.why for r in first} == {PLANNED} and {r.why for r in second} == {ENDGAME}
    assert Request("a", KEY, 0, ENDGAME) == Request("a", KEY, 0)  # the rule is not the request's identity


@pytest.mark.parametrize("bad", [{"origin_pipeline": 0}, {"origin_pipeline": 1.5}, {"endgame_after": -1},
                                 {"endgame_after": float("nan")}])
def test_origin_pipeline_and_endgame_after_are_checked(bad):
    with pytest.raises(UsageError, match=next(iter(bad))):
        PiecePicker("a", "r0", "r0", **bad)


def test_a_member_asks_the_origin_in_plan_weight_order_and_its_next_chunks_are_never_taken_over():
    """The collision the order prevents: at a 1 Gbit/s LAN, with shares taken over in a
    per-node random order, the origin sent 1.29-1.52x the patch (bench/RESULTS.md,
    2026-12-05): the member that took over a chunk its owner had asked for got it whole
    before either heard of the other."""
    from patchswarm.protocol.responsibility import member_weight

    n = 16
    owner = _origin_region(me="b", n=n)
    by_weight = sorted(owned("b", R0, n), key=lambda c: member_weight("b", KEY, c), reverse=True)
    assert [r.chunk for r in owner.requests(0.0)] == by_weight[:2]
    p = _origin_region(n=n)
    _receive_own_share(p, "a", n)
    for m in "cd":  # c and d have all of their shares whole: only b's can be taken over
        p.peer_has(m, KEY, owned(m, R0, n))
    taken = [r.chunk for r in p.requests(0.0) if r.peer == OR]
    assert len(taken) == 1 and taken[0] in by_weight[2:]


# --- declared uplinks: a neighbour with a slow uplink (issue 26's slow member) ---

SLOW_D = {"a": 100, "b": 100, "c": 100, "d": 10}  # d's uplink: a tenth of the others'


def test_a_slow_neighbour_is_asked_only_for_what_no_other_neighbour_holds():
    members = {"a": "r1", "b": "r1", "c": "r1", "me": "r1"}
    p = make("me", members, origin_region="r0", n=4, origin=False, pipeline=4)
    p.set_members(members, {"a": 100, "b": 10, "c": 100, "me": 100})
    assert p.slow_neighbours == ["b"]
    p.peer_has("b", KEY, [0, 1, 2])  # the slow one first, with the most free slots
    p.peer_has("a", KEY, [0, 1])
    reqs = p.requests(0.0)
    assert {(r.chunk, r.peer) for r in reqs if r.chunk in (0, 1)} == {(0, "a"), (1, "a")}
    assert (2, "b") in {(r.chunk, r.peer) for r in reqs}  # only b has it: b it is
    # No second copy from the slow one in the endgame: a copy through its uplink comes after the first.
    assert all(r.peer != "b" or r.chunk == 2 for r in reqs)
    # Undeclared again: b is a neighbour like the others, asked as it has free slots.
    p2 = make("me", members, origin_region="r0", n=4, origin=False, pipeline=4)
    p2.peer_has("b", KEY, [0, 1, 2])
    p2.peer_has("a", KEY, [0, 1])
    assert {r.peer for r in p2.requests(0.0)} == {"a", "b"}


def test_uplinks_told_mid_version_move_the_slow_members_share_at_once():
    n = 26
    p = _origin_region(me="a", n=n, origin_pipeline=None, pipeline=32)
    before = {r.chunk for r in p.requests(0.0)}
    assert before == owned("a", R0, n)
    p.set_members(R0, SLOW_D)
    owners = balanced_owners(KEY, n, sorted(R0), caps={"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.1})
    mine = {c for c in range(n) if owners[c] == "a"}
    assert "d" not in owners and mine > before
    assert {r.chunk for r in p.requests(0.0)} == mine - before  # the rest of its new share, from the origin


@pytest.mark.parametrize("wan_slots, expect", [
    (2, [("a", 1), ("a", 3)]),                      # the slow member's chunk waits, though rarest
    (8, [("a", 1), ("a", 3), ("b", 2), ("d", 0)]),  # and is asked last where slots are left
])
def test_across_the_wan_a_chunk_only_a_slow_member_holds_comes_after_the_others(wan_slots, expect):
    """A remote gateway asked the origin's region's slow member first for its own share chunk
    (the rarest), taking part of the uplink that member relays that chunk to its neighbours
    through; a fast neighbour holds it soon after. In a 3x4 swarm simulation the slow member sent
    a fourth copy, across the WAN, in 22 of 80 cases; 5 now (bench/slow_member_copies.py)."""
    members = {"a": "r0", "b": "r0", "c": "r0", "d": "r0", "x": "r1"}
    p = make("x", members, n=8, origin=False, pipeline=8, wan_pipeline=wan_slots)
    p.set_members(members, {"a": 100, "b": 100, "c": 100, "d": 10, "x": 100})
    for m, chunks in {"d": [0], "a": [1, 3], "b": [1, 2], "c": [2, 3]}.items():
        p.peer_has(m, KEY, chunks)
    assert [(r.peer, r.chunk) for r in p.requests(0.0)] == expect


def test_a_slow_member_takes_over_no_share_of_another():
    """Its uplink would hold the region up relaying what it took; it has no share of its own
    (a tenth of the others' rate) and waits for its neighbours."""
    n = 16
    for slow in (True, False):
        p = _origin_region(me="d", n=n)
        p.set_members(R0, SLOW_D if slow else {"d": 100})
        p.origin_chunk_s = 0.1  # chunks from the origin are slow enough to take over (none of its own)
        if slow:
            assert p.responsible_for(KEY) == 0
        else:
            _receive_own_share(p, "d", n)
        took = [r for r in p.requests(0.0) if r.peer == OR]
        assert [r.why for r in took] == ([] if slow else [SHARE])
    with pytest.raises(UsageError, match="uplinks"):
        p.set_members(R0, {"d": 0})
    with pytest.raises(UsageError, match="uplinks"):
        p.set_members(R0, {"d": float("nan")})


def test_a_request_expires_at_the_time_next_wakeup_names():
    """`next_wakeup` named `sent + request_timeout` while `expired` compared `sent` with
    `now - request_timeout`; in floating point the two differ (0.005 + 30 - 30 < 0.005), so a
    fetcher woken at the named time found nothing expired, was woken again at once, and spun
    (for ever on trio's MockClock, which moves only when every task waits)."""
    p = PiecePicker("me", "r1", "r1", seed=0, request_timeout=30.0)
    p.peer_joined("a", NODE, "r1")
    p.add_object(KEY, 1, now=0.0)
    p.peer_has("a", KEY, [0])
    [r] = p.requests(0.005)
    wake = p.next_wakeup(0.005)
    assert [(x.peer, x.key, x.chunk) for x in p.expired(wake)] == [(r.peer, r.key, r.chunk)]


# --- a peer that holds requests and sends nothing: snubbed ------------------------------


def _beside_a_silent_member(n=8, snub_after=5.0, slow_chunk_s=None, held=None, max_inflight=None):
    """me and m, members of the origin's region r0, with the daemon's settings: m announces
    every chunk (so, a neighbour, it is asked before the origin) and is asked first. `held`:
    the chunks both announce, if not all."""
    p = PiecePicker("me", "r0", "r0", seed=1, request_timeout=30.0, origin_pipeline=ORIGIN_PIPELINE,
                    endgame_after=ENDGAME_AFTER, snub_after=snub_after, slow_chunk_s=slow_chunk_s,
                    max_inflight=max_inflight)
    p.set_members({"me": "r0", "m": "r0"})
    p.peer_joined("m", NODE, "r0")
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, n, now=0.0)
    p.peer_has(OR, KEY, range(n) if held is None else held)
    p.peer_has("m", KEY, range(n) if held is None else held)
    return p


def test_a_member_silent_for_snub_after_loses_all_its_requests_at_once_and_its_share():
    """The hostile-peer hunt's member (protocol/README.md, "The longest a node sits"): it held
    `pipeline` requests, each given up only at `request_timeout` (30 s). Snubbed once it has
    held requests for `snub_after` with no part: all of them come back at once, its share of
    the plan is me's, and the origin, before it now, is asked at once."""
    p = _beside_a_silent_member()
    share = p.responsible_for(KEY)
    first = p.requests(0.0)
    assert {r.peer for r in first} == {"m"} and len(first) == 4 and share < 8
    assert p.next_wakeup(0.0) == 5.0
    assert p.expired(4.99) == [] and not p.snubbed("m")
    assert p.expired(5.0) == sorted(first)  # all at once; the caller cancels them
    assert p.snubbed("m") and p.in_flight("m") == 0 and p.responsible_for(KEY) == 8
    again = p.requests(5.0)
    assert {r.peer for r in again} == {OR} and len(again) == ORIGIN_PIPELINE  # not m: it is after the origin
    assert p.expired(34.9) == []  # nothing of m's left; the origin's go at `request_timeout` (35.0)
    for r in again:
        p.chunk_received(r.key, r.chunk, r.peer, 5.1)
    assert {r.peer for r in p.requests(5.1)} == {OR}


def test_a_part_ends_the_snub_and_the_member_is_back_in_the_plan_with_its_pipeline():
    p = _beside_a_silent_member()
    share = p.responsible_for(KEY)
    p.requests(0.0)
    p.expired(5.0)
    p.requests(5.0)
    p.peer_sent("m", 6.0)  # a slow member after all: a part of a request of mine came
    assert not p.snubbed("m") and p.responsible_for(KEY) == share
    back = p.requests(6.0)
    assert [r.peer for r in back] == ["m"] * 4  # a neighbour again, before the origin
    assert p.next_wakeup(6.0) == 11.0  # its silence counts from the part, not from before it
    p.peer_sent("m", 9.0)
    assert p.next_wakeup(9.0) == 14.0 and p.expired(13.99) == []


def test_a_snubbed_members_share_goes_to_the_other_members_and_comes_back_with_a_part():
    """As when a member's session closes (`peer_left`): out of the region's plan at once, its
    share re-planned over the others; back in when a part comes from it."""
    members = {"me": "r0", "w": "r0", "m": "r0"}
    n = 48
    p = PiecePicker("me", "r0", "r0", seed=2, snub_after=5.0)
    p.set_members(members)
    for peer in ("w", "m"):
        p.peer_joined(peer, NODE, "r0")
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, n, now=0.0)
    p.peer_has(OR, KEY, range(n))
    p.peer_has("m", KEY, range(n))
    assert p.responsible_for(KEY) == len(owned("me", members, n)) < n // 2
    assert {r.peer for r in p.requests(0.0)} == {"m"}
    p.expired(5.0)
    without_m = {"me": "r0", "w": "r0"}
    assert p.responsible_for(KEY) == len(owned("me", without_m, n))
    assert {r.chunk for r in p.requests(5.0) if r.peer == OR} <= owned("me", without_m, n)
    p.peer_sent("m", 6.0)
    assert p.responsible_for(KEY) == len(owned("me", members, n))


def test_a_peer_freshly_asked_is_not_judged_on_its_silence_while_it_had_nothing_of_mine():
    p = PiecePicker("me", "r1", "r0", snub_after=5.0)
    p.peer_joined("a", NODE, "r1")
    p.add_object(KEY, 2, now=0.0)
    p.peer_has("a", KEY, [0])
    [r] = p.requests(0.0)
    p.peer_sent("a", 0.5)
    p.chunk_received(r.key, r.chunk, "a", 0.5)
    p.peer_has("a", KEY, [1])  # 20 s later it has the next chunk: asked at once
    assert p.requests(20.0) == [Request("a", KEY, 1)]
    assert p.next_wakeup(20.0) == 25.0 and p.expired(24.9) == [] and not p.snubbed("a")
    assert p.expired(25.0) == [Request("a", KEY, 1)] and p.snubbed("a")


@pytest.mark.parametrize("asked_at, part_at", [(0.005, None), (0.1, 0.1 + 0.2), (1.1, 3.3)])
def test_a_snub_expires_at_the_time_next_wakeup_names(asked_at, part_at):
    """As for `request_timeout`: `expired` compares the very sum `next_wakeup` names, so a
    fetcher woken then finds the requests expired and does not spin on trio's MockClock."""
    p = PiecePicker("me", "r1", "r0", snub_after=5.0)
    p.peer_joined("a", NODE, "r1")
    p.add_object(KEY, 2, now=0.0)
    p.peer_has("a", KEY, [0, 1])
    asked = p.requests(asked_at)
    if part_at is not None:
        p.peer_sent("a", part_at)
    wake = p.next_wakeup(part_at or asked_at)
    assert wake == (part_at or asked_at) + 5.0
    assert p.expired(wake) == sorted(asked) and p.snubbed("a")


def test_a_snubbed_peer_gets_one_probe_at_a_time_only_where_no_better_holder_is_and_a_better_one_is_asked_beside_it():
    """A keyframe (any holder): m in my region and the origin hold chunks 0-2. Once m is
    snubbed it ranks after the origin, and it is asked, one at a time, for what only it holds
    (chunk 3, which it announces then; not those it sat on, until its word on them changes). A
    holder that announces that chunk later is asked at once, beside the probe, which stays:
    the first copy in cancels the other."""
    p = PiecePicker("me", "r1", "r0", snub_after=5.0, pipeline=4, wan_pipeline=4)
    p.peer_joined("m", NODE, "r1")
    p.peer_joined(OR, ORIGIN, "r0")
    p.peer_joined("x", NODE, "r2")
    p.add_object(KF, 4, now=0.0)
    p.peer_has("m", KF, range(3))
    p.peer_has(OR, KF, range(3))
    assert asked(p.requests(0.0)) == {("m", c) for c in range(3)}  # a neighbour before the origin
    assert len(p.expired(5.0)) == 3
    p.peer_has("m", KF, [3])
    probe = p.requests(5.0)
    assert asked(probe) == {(OR, 0), (OR, 1), (OR, 2), ("m", 3)}
    assert p.requests(5.0) == [] and p.in_flight("m") == 1
    p.peer_has("x", KF, [3])  # another region's node has it: before a snubbed neighbour
    beside = p.requests(5.1)
    assert [(r.peer, r.chunk, r.why) for r in beside] == [("x", 3, BESIDE_PROBE)] and p.in_flight("m") == 1
    assert p.chunk_received(KF, 3, "x", 5.2) == [Request("m", KF, 3)]  # the probe is cancelled


def test_an_unanswered_probe_is_given_up_after_snub_after_too():
    p = PiecePicker("me", "r1", "r0", snub_after=5.0, pipeline=2)
    p.peer_joined("m", NODE, "r1")
    p.add_object(KF, 3, now=0.0)
    p.peer_has("m", KF, range(3))
    first = p.requests(0.0)
    assert len(first) == 2 and p.expired(5.0) == sorted(first)
    [probe] = p.requests(5.0)  # only m holds the third: asked alone (those it sat on: not until its word changes)
    assert p.next_wakeup(5.0) == 10.0 and p.expired(10.0) == [probe] and p.snubbed("m")
    assert p.requests(10.0) == []


def test_a_snub_lasts_across_a_new_session_and_is_forgotten_with_the_membership():
    """A member that closes its session is dialed again (node/dialer.py): a new session is no
    part, so it comes back snubbed. Once neither a member nor connected, it is forgotten."""
    p = _beside_a_silent_member()
    p.requests(0.0)
    p.expired(5.0)
    p.peer_left("m")
    p.peer_joined("m", NODE, "r0")
    p.peer_has("m", KEY, range(8))
    assert p.snubbed("m") and p.responsible_for(KEY) == 8
    assert {r.peer for r in p.requests(6.0)} == {OR}
    p.peer_left("m")
    p.set_members({"me": "r0"})  # the tracker dropped it
    p.set_members({"me": "r0", "m": "r0"})
    assert not p.snubbed("m")


def test_the_origin_is_never_snubbed():
    """The origin holds every chunk and is the last source: a slow origin is waited for (up to
    `request_timeout`), never ranked after anyone."""
    p = PiecePicker("me", "r0", "r0", snub_after=5.0)
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, 2, now=0.0)
    p.peer_has(OR, KEY, [0, 1])
    assert len(p.requests(0.0)) == 2
    assert p.next_wakeup(0.0) is None and p.expired(1000.0) == [] and not p.snubbed(OR)


def test_snub_after_is_checked():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(UsageError, match="snub_after"):
            PiecePicker("me", "r0", "r0", snub_after=bad)


# --- a peer that drips, or refuses before its snub: snubbed too ------------------------------


def _beside_a_dripping_member(n=8):
    return _beside_a_silent_member(n, slow_chunk_s=SLOW_CHUNK_S)


MIB = 1 << 20


@pytest.mark.parametrize("part_bytes, every, slow, early", [
    # a part of each answer every `every` s -> snubbed as slow at `snub_after`? Or, not snubbed,
    # its requests given up then, since at its rate they would come whole only past their
    # 30 s timeout? (1 MiB chunks)
    (1, 4.9, True, False),  # a byte: 5 million s a chunk
    (64 << 10, 4.9, True, False),  # 78 s a chunk, over SLOW_CHUNK_S
    (64 << 10, 3.8, True, False),  # 61 s
    (64 << 10, 3.7, False, True),  # 59 s: not demoted; given up at 5 s, not at the 30 s timeout
    (64 << 10, 2.6, False, True),  # 41 s: the busy honest member of SNUB_AFTER's comment, likewise
    (64 << 10, 1.6, False, False),  # 26 s: comes whole before its timeout: waited for
    (256 << 10, 4.9, False, False),  # 20 s
])
def test_a_member_that_drips_parts_is_snubbed_as_slow_at_snub_after(part_bytes, every, slow, early):
    p = _beside_a_dripping_member()
    first = p.requests(0.0)
    assert {r.peer for r in first} == {"m"} and len(first) == 4
    for t in (every, 2 * every):
        for r in first:
            got = int(t / every) * part_bytes
            p.peer_sent("m", t, r.key, r.chunk, got=got, left=MIB - got)
        if t < 5.0:  # its snub or its requests' early end at 5 s, or its silence after the last part
            assert p.expired(t) == [] and p.next_wakeup(t) == (5.0 if slow or early else t + 5.0)
    now = max(2 * every, 5.0)
    gone = p.expired(now)
    assert gone == (sorted(first) if slow or early else [])
    assert {r.why for r in gone} <= {PAST_ITS_TIMEOUT if early else ""}
    assert p.snub_reason("m") == (SLOW if slow else None)
    if slow:
        assert {r.peer for r in p.requests(now)} == {OR}  # after the origin now
        p.peer_sent("m", 11.0)  # a part: no end to a snub as slow
        assert p.snub_reason("m") == SLOW
    elif early:  # those chunks from the origin (its pipeline's worth now); m, not demoted, asked for others
        asked = p.requests(now)
        from_origin = {r.chunk for r in asked if r.peer == OR}
        assert from_origin and from_origin <= {r.chunk for r in first}
        assert {r.chunk for r in asked if r.peer == "m"}.isdisjoint(r.chunk for r in first)
    else:
        assert p.next_wakeup(now) == 2 * every + 5.0  # its silence from the last part, as before


def test_a_request_past_its_timeout_at_its_rate_is_judged_from_when_its_answer_began():
    """Served in order, a request queued behind another is judged from the later of when it was
    asked and the peer's last whole chunk to me, not from when it was asked: m sends its first
    answer whole at 2 s, then the second at a rate that makes it whole at 2 + 40 s."""
    p = PiecePicker("me", "r0", "r0", seed=1, pipeline=2, request_timeout=30.0, snub_after=5.0,
                    slow_chunk_s=SLOW_CHUNK_S)
    p.set_members({"me": "r0", "m": "r0"})
    p.peer_joined("m", NODE, "r0")
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, 2, now=0.0)
    p.peer_has(OR, KEY, range(2))
    p.peer_has("m", KEY, range(2))
    a, b = p.requests(0.0)
    assert {a.peer, b.peer} == {"m"}
    p.peer_sent("m", 2.0, a.key, a.chunk, got=MIB, left=0)
    p.chunk_received(KEY, a.chunk, "m", 2.0)
    p.peer_sent("m", 6.0, b.key, b.chunk, got=MIB // 10, left=MIB - MIB // 10)  # 10 % in 4 s: 40 s a chunk
    assert p.expired(6.9) == [] and p.next_wakeup(6.0) == 7.0  # 5 s after its answer began
    assert p.expired(7.0) == [Request("m", KEY, b.chunk)] and not p.snubbed("m")
    assert p.expired(7.0) == []


def test_the_origins_requests_go_by_their_timeout_only():
    p = PiecePicker("me", "r0", "r0", seed=1, request_timeout=30.0, snub_after=5.0, slow_chunk_s=SLOW_CHUNK_S)
    p.set_members({"me": "r0"})
    p.peer_joined(OR, ORIGIN, "r0")
    p.add_object(KEY, 1, now=0.0)
    p.peer_has(OR, KEY, [0])
    (r,) = p.requests(0.0)
    p.peer_sent(OR, 6.0, r.key, r.chunk, got=1, left=MIB - 1)
    assert p.expired(29.9) == [] and p.next_wakeup(6.0) == 30.0
    assert p.expired(30.0) == [r]


def test_a_slow_snub_ends_with_a_whole_chunk_from_the_peer():
    p = _beside_a_dripping_member()
    first = p.requests(0.0)
    p.peer_sent("m", 4.9, first[0].key, first[0].chunk, got=1, left=MIB - 1)
    assert p.expired(5.0) == sorted(first) and p.snub_reason("m") == SLOW
    p.peer_sent("m", 6.0)  # a part ends a snub for silence, not this one
    assert p.snubbed_peers() == {"m"}
    p.chunk_received(KEY, 7, "m", 9.0)  # a whole chunk from it (its probe, or a copy) ends it
    assert not p.snubbed("m") and p.snub_reason("m") is None


def _judging_by_answers(slow_chunk_min_s=SLOW_CHUNK_MIN_S):
    """me in r0 (the origin's region) beside x and m of r0 and w of r1, with the daemon's slow rules."""
    p = PiecePicker("me", "r0", "r0", seed=1, request_timeout=30.0, snub_after=5.0, slow_chunk_s=SLOW_CHUNK_S,
                    slow_chunk_min_s=slow_chunk_min_s)
    p.set_members({"me": "r0", "x": "r0", "m": "r0", "w": "r1"})
    for peer, region in (("x", "r0"), ("m", "r0"), ("w", "r1")):
        p.peer_joined(peer, NODE, region)
    p.peer_joined(OR, ORIGIN, "r0")
    return p


def _answers(p, peer, key, seconds, n, start=0.0):
    """`peer` alone holds keyframe `key`'s n chunks and serves me each `seconds` after the one before."""
    p.add_object(key, n, now=start)
    p.peer_has(peer, key, range(n))
    t = start
    while not p.complete(key):
        asked = [r for r in p.requests(t) if r.key == key]
        assert asked and {r.peer for r in asked} == {peer}
        for r in asked:
            t += seconds
            p.chunk_received(key, r.chunk, peer, t)
    p.remove_object(key)
    return t


def test_the_slow_threshold_follows_the_nodes_typical_answer_on_each_side_of_the_wan():
    """A member is slow at SLOW_BESIDE_TYPICAL times the median of my last answers from that side of
    the WAN (each from when its peer began serving it), within [slow_chunk_min_s, slow_chunk_s];
    before any answer, at slow_chunk_min_s. Without slow_chunk_min_s: slow_chunk_s alone."""
    p = _judging_by_answers()
    assert SLOW_CHUNK_MIN_S == 10.0 and SLOW_BESIDE_TYPICAL == 4.0 and SLOW_CHUNK_S == 60.0
    assert p.slow_threshold("m") == p.slow_threshold("w") == 10.0 and p.slow_threshold("nobody") is None
    t = _answers(p, "x", (1, True), 0.5, 16)
    assert p.slow_threshold("m") == 10.0  # 4 x 0.5 s is under the floor
    t = _answers(p, "x", (2, True), 5.0, 16, t)
    assert p.slow_threshold("m") == 20.0 and p.slow_threshold("w") == 10.0  # the WAN's side: no answer yet
    t = _answers(p, "x", (3, True), 25.0, 9, t)  # 9 of the last 16 took 25 s: the median
    assert p.slow_threshold("m") == 60.0  # 100 s, capped
    _answers(p, "w", (4, True), 3.0, 16, t)
    assert p.slow_threshold("w") == 12.0 and p.slow_threshold("m") == 60.0
    assert _judging_by_answers(None).slow_threshold("m") == SLOW_CHUNK_S
    with pytest.raises(UsageError):
        PiecePicker("me", "r0", "r0", slow_chunk_s=SLOW_CHUNK_S, slow_chunk_min_s=61.0)
    with pytest.raises(UsageError):
        PiecePicker("me", "r0", "r0", slow_chunk_min_s=10.0)  # no slow_chunk_s


@pytest.mark.parametrize("typical, slow", [
    (0.5, True),  # my answers come in 0.5 s: a chunk in 26 s at m's rate is slow (over 10 s)
    (5.0, True),  # in 5 s: over 20 s
    (8.0, False),  # in 8 s (a region where every member serves that slowly): under 32 s, waited for
])
def test_a_member_is_slow_beside_the_answers_the_node_gets_elsewhere(typical, slow):
    """m sends a 64 KiB part of each 1 MiB answer every 1.6 s: 26 s a chunk, under SLOW_CHUNK_S."""
    p = _judging_by_answers()
    t = _answers(p, "x", (1, True), typical, 16)
    p.add_object(KEY, 8, now=t)
    p.peer_has("m", KEY, range(8))
    p.peer_has(OR, KEY, range(8))
    first = [r for r in p.requests(t) if r.peer == "m"]
    assert len(first) == 4
    for r in first:
        p.peer_sent("m", t + 1.6, r.key, r.chunk, got=64 << 10, left=MIB - (64 << 10))
        p.peer_sent("m", t + 3.2, r.key, r.chunk, got=128 << 10, left=MIB - (128 << 10))
    assert p.expired(t + 4.99) == []
    gone = p.expired(t + 5.0)
    assert gone == (sorted(first) if slow else []) and p.snub_reason("m") == (SLOW if slow else None)
    if slow:  # its requests asked of the origin, before it now
        assert {r.peer for r in p.requests(t + 5.0) if r.chunk in {q.chunk for q in first}} == {OR}


@pytest.mark.parametrize("x_every, m_slow", [
    (1.6, False),  # x serves as slowly as m (the node's own downlink the limit): neither is slow
    (0.1, True),  # x's answers take 1.6 s at its rate: m's 26 s is slow beside them
])
def test_a_member_is_slow_only_beside_what_the_others_serve_now(x_every, m_slow):
    """No answer has come yet. m and x, both holding every chunk, each send me a 64 KiB part of
    their answer every `x_every` s (m: every 1.6 s, a 1 MiB chunk in 26 s)."""
    p = _judging_by_answers()
    p.add_object(KEY, 8, now=0.0)
    for peer in ("m", "x"):
        p.peer_has(peer, KEY, range(8))
    first = p.requests(0.0)
    assert {r.peer for r in first} == {"m", "x"}
    for r in first:
        every = 1.6 if r.peer == "m" else x_every
        for t in (every, 2 * every):
            got = (64 << 10) * round(t / every)
            p.peer_sent(r.peer, t, r.key, r.chunk, got=got, left=MIB - got)
    p.expired(5.0)
    assert p.snub_reason("m") == (SLOW if m_slow else None) and p.snub_reason("x") is None
    assert p.slow_threshold("m") == (60.0 if not m_slow else 10.0)


def test_a_slow_rule_needs_byte_counts_and_is_off_without_slow_chunk_s():
    p = _beside_a_silent_member()  # no slow_chunk_s
    first = p.requests(0.0)
    for r in first:
        p.peer_sent("m", 4.9, r.key, r.chunk, got=1, left=MIB - 1)
    assert p.expired(4.9) == [] and p.next_wakeup(4.9) == 5.0
    # Not snubbed; its requests, due whole only past their timeout, are given up all the same.
    gone = p.expired(5.0)
    assert gone == sorted(first) and {r.why for r in gone} == {PAST_ITS_TIMEOUT}
    assert not p.snubbed("m") and p.snubbed_peers() == set()
    with pytest.raises(UsageError):
        PiecePicker("me", "r0", "r0", slow_chunk_s=0.0)
    q = _beside_a_dripping_member()
    r = q.requests(0.0)[0]
    with pytest.raises(UsageError):
        q.peer_sent("m", 1.0, r.key, r.chunk, got=-1, left=0)


@pytest.mark.parametrize("timed, gap, snubbed_at_5", [
    (True, 0.0, True),  # refused at 4.9 s, announced again, asked again at once: snubbed at 5 s
    (True, 5.0, False),  # asked again only after `snub_after`: judged afresh
    (False, 0.0, False),  # a Reject told without its time: its silence began anew (the old loop)
])
def test_a_reject_is_no_part_the_silence_goes_on_into_the_next_request(timed, gap, snubbed_at_5):
    p = PiecePicker("me", "r0", "r0", seed=1, pipeline=1, request_timeout=30.0, snub_after=5.0)
    p.set_members({"me": "r0", "m": "r0"})
    p.peer_joined("m", NODE, "r0")
    p.add_object(KEY, 2, now=0.0)
    p.peer_has("m", KEY, [0, 1])
    [r] = p.requests(0.0)
    p.chunk_refused(r.key, r.chunk, "m", 4.9 if timed else None)
    p.peer_has("m", KEY, [r.chunk])  # it says it has it again
    [again] = p.requests(4.9 + gap)
    assert again.peer == "m"
    assert (p.expired(5.0 + gap) != []) == snubbed_at_5
    assert p.snub_reason("m") == (SILENT if snubbed_at_5 else None)
