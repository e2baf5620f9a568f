"""The WAN plan, without sockets: who is responsible for bringing each chunk into a region.

Rendezvous hashing per chunk (`responsible`), the order in which regions pass a
chunk on (`region_order`, `upstream_regions`), the gateways of a region and the
even share of each source's chunks among them (`gateways`, `balanced_owners`),
and `ResponsibilityMap` following membership. The picker that acts on this plan
is tested in test_picker.py.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.responsibility import (
    ResponsibilityMap, balanced_owners, check_wan_rates, gateway_limit, gateways, rate_classes, region_order,
    responsible, swarm_wan_rates, upstream_regions, uplink_caps,
)

KEY = (7, False)  # a patch
KF = (7, True)  # a keyframe



def test_responsible_is_highest_sha256_weight():
    members = ["a", "b", "node-3", "x"]
    for c in range(20):
        digests = {m: hashlib.sha256(f"{m}|7|0|{c}".encode()).digest() for m in members}
        assert responsible(KEY, c, members) == max(members, key=lambda m: digests[m])
        assert responsible(KEY, c, reversed(members)) == responsible(KEY, c, members)
    assert responsible(KEY, 0, []) is None
    assert responsible(KEY, 0, ["solo"]) == "solo"


def test_responsible_spreads_chunks_over_members():
    members = [f"n{i}" for i in range(4)]
    share = Counter(responsible(KEY, c, members) for c in range(400))
    assert set(share) == set(members)
    assert all(60 <= v <= 140 for v in share.values()), share


def test_keyframe_and_patch_of_same_version_differ():
    members = [f"n{i}" for i in range(4)]
    assert any(responsible(KEY, c, members) != responsible(KF, c, members) for c in range(20))


def test_region_order_origin_first_then_per_chunk_rendezvous():
    regions = ["r1", "r2", "r3", "r1"]
    seconds = Counter()
    for c in range(60):
        order = region_order(KEY, c, regions, "r0")
        assert order[0] == "r0" and sorted(order[1:]) == ["r1", "r2", "r3"]
        assert region_order(KEY, c, ["r3", "r0", "r2", "r1"], "r0") == order
        seconds[order[1]] += 1
    assert set(seconds) == {"r1", "r2", "r3"}  # remote regions split the pulling


@pytest.mark.parametrize("region, members, origin_region, expect", [
    # (my region, regions with members, origin region, (upstream, origin serves))
    ("r0", {"r0", "r1"}, "r0", ([], True)),  # the origin's region takes from the origin
    ("r0", {"r0"}, "r0", ([], True)),  # the only region
    ("r1", {"r1"}, "r0", (["r0"], True)),  # origin region without nodes: first region
    ("r1", {"r0", "r1"}, "r0", (["r0"], False)),  # origin region has nodes: take from them
])
def test_upstream_regions_table(region, members, origin_region, expect):
    for c in range(10):
        assert upstream_regions(KEY, c, region, members, origin_region) == expect


def test_upstream_regions_second_region_pulls_from_first():
    for c in range(30):
        order = region_order(KEY, c, ["r1", "r2"], "r0")
        first, second = order[1], order[2]
        assert upstream_regions(KEY, c, second, {"r1", "r2"}, "r0") == ([first], False)
        assert upstream_regions(KEY, c, first, {"r1", "r2"}, "r0") == (["r0"], True)
        assert upstream_regions(KEY, c, second, {"r0", "r1", "r2"}, "r0") == ([first], False)


@pytest.mark.parametrize("rates, expect", [
    (None, {"r1": 0, "r2": 0, "r3": 0}),  # no rates: one class, the rendezvous chain
    ({}, {"r1": 0, "r2": 0, "r3": 0}),
    ({"r1": 50, "r2": 20, "r3": 100}, {"r3": 0, "r1": 1, "r2": 2}),
    ({"r1": 100, "r2": 100, "r3": 20}, {"r1": 0, "r2": 0, "r3": 1}),  # equal rates share a class
    ({"r1": 100, "r2": 96, "r3": 94}, {"r1": 0, "r2": 0, "r3": 1}),  # within 5 % of the class's fastest
    ({"r1": 50, "r2": 20}, {"r1": 0, "r2": 1, "r3": 2}),  # unknown rate: last, relays to nobody
    ({"r1": 50, "r2": 20, "r3": 0}, {"r1": 0, "r2": 1, "r3": 2}),  # a zero is no rate
    ({"r1": 50}, {"r1": 0, "r2": 1, "r3": 1}),  # one known class: the unknown ones after it
    ({"r1": 100, "r2": 96}, {"r1": 0, "r2": 0, "r3": 1}),
    ({"r9": 50}, {"r1": 0, "r2": 0, "r3": 0}),  # rates only for regions not here: one class, 0
    ({"r1": 50.5, "r2": 20.25}, {"r1": 0, "r2": 1, "r3": 2}),  # rates as floats
    ({"r1": 0.5, "r2": 0.25, "r3": 0.125}, {"r1": 0, "r2": 1, "r3": 2}),  # in a unit where they are below 1
    ({"r1": 100, "r2": 95, "r3": 94.9}, {"r1": 0, "r2": 0, "r3": 1}),  # exactly RATE_TIE of the fastest: same class
])
def test_rate_classes_table(rates, expect):
    assert rate_classes(["r1", "r2", "r3"], rates) == expect


@pytest.mark.parametrize("origin", ["r0", "r9", "".join(["r", "2"])])
def test_region_order_names_every_region_once_after_the_origin(origin):
    """The origin's region sorting below or above the others, or named by an equal but
    distinct str (as read off the wire) among them: each region once, the origin first."""
    regions = ["r1", "r2", "r3"]
    for c in range(40):
        order = region_order(KEY, c, regions, origin)
        assert order[0] == origin and sorted(order) == sorted({origin, *regions})


def test_region_order_follows_three_rate_classes_for_every_chunk():
    rates = {"r1": 100, "r2": 50, "r3": 10}
    assert all(region_order(KEY, c, ["r3", "r2", "r1"], "r0", rates) == ["r0", "r1", "r2", "r3"] for c in range(40))


@pytest.mark.parametrize("n", [29, 31])
def test_classes_must_be_one_per_chunk(n):
    with pytest.raises(UsageError, match=f"one per chunk \\(30\\), found {n}"):
        balanced_owners(KEY, 30, ["a", "b"], [0] * n)
    with pytest.raises(UsageError, match=f"one per chunk \\(30\\), found {n}"):
        ResponsibilityMap(KEY, 30, ["a", "b"], classes=[0] * n)
    rmap = ResponsibilityMap(KEY, 30, ["a", "b"])
    with pytest.raises(UsageError, match=f"one per chunk \\(30\\), found {n}"):
        rmap.set_members(["a", "b"], [0] * n)


def test_a_refused_set_members_leaves_the_map_as_it_was():
    rmap = ResponsibilityMap(KEY, 30, ["a", "b"], classes=[0] * 30)
    before = [rmap.owner(c) for c in range(30)]
    for n in (29, 31):
        with pytest.raises(UsageError):
            rmap.set_members(["a", "b", "c"], [1] * n)
        assert [rmap.owner(c) for c in range(30)] == before
    rmap.set_members(["a", "b", "c"])  # and it goes on working with its classes
    fresh = ResponsibilityMap(KEY, 30, ["a", "b", "c"], classes=[0] * 30)
    assert [rmap.owner(c) for c in range(30)] == [fresh.owner(c) for c in range(30)]


def test_shares_stay_balanced_past_the_small_ints():
    """A version of 3000 chunks over 2 and 3 gateways (loads and caps above 256: ints
    compared by value, not identity)."""
    n = 3000
    for gws in (["a", "b"], ["a", "b", "c"]):
        owners = balanced_owners(KEY, n, gws, [0] * n)
        assert max(Counter(owners).values()) == -(-n // len(gws))
        rmap = ResponsibilityMap(KEY, n, gws, classes=[0] * n)
        assert [rmap.owner(c) for c in range(n)] == owners
        assert rmap.set_members(gws, [1] * n) == []  # another class name, the same split


@pytest.mark.parametrize("old, new", [
    ([1] * 15 + [0] * 15, [0] * 30),  # new classes that sort below the old ones
    ([0] * 30, [1] * 15 + [0] * 15),  # and above
    ([0, 1, 2] * 10, [2, 1, 0] * 10),
])
def test_set_members_with_new_classes_owns_as_a_fresh_map_would(old, new):
    members = ["a", "b", "c"]
    rmap = ResponsibilityMap(KEY, 30, members, classes=old)
    before = [rmap.owner(c) for c in range(30)]
    changed = rmap.set_members(members, new)
    fresh = ResponsibilityMap(KEY, 30, members, classes=new)
    assert [rmap.owner(c) for c in range(30)] == [fresh.owner(c) for c in range(30)]
    assert changed == [c for c in range(30) if before[c] != fresh.owner(c)]


def test_set_members_names_only_chunks_whose_owner_changed_when_names_are_new_strs():
    """Member ids arrive off the wire as new str objects each time: a chunk whose owner
    is the same member (an equal str) did not change owner."""
    def fresh(name):
        return "".join(list(name))  # equal, not the same object

    rmap = ResponsibilityMap(KEY, 60, ["a", "b", "c"])
    before = [rmap.owner(c) for c in range(60)]
    changed = rmap.set_members([fresh(m) for m in ("a", "b", "c", "d")])
    after = [rmap.owner(c) for c in range(60)]
    assert changed == [c for c in range(60) if before[c] != after[c]]
    assert 0 < len(changed) < 60  # "d" takes its share; most chunks keep their owner


# The fleet: the origin in r0 (100 Mbit/s), r1 at 50, r2 at 20. Each row: rates,
# then per region the regions it pulls chunks from (one per chunk; each of them for some).
@pytest.mark.parametrize("rates, upstream", [
    ({"r0": 100, "r1": 50, "r2": 20}, {"r1": {"r0"}, "r2": {"r1"}}),  # r1 fed directly; r2 via r1
    ({"r0": 100, "r1": 20, "r2": 50}, {"r2": {"r0"}, "r1": {"r2"}}),
    ({"r0": 20, "r1": 50, "r2": 100}, {"r2": {"r0"}, "r1": {"r2"}}),  # the origin's link is not ranked
    ({"r1": 50, "r2": 20}, {"r1": {"r0"}, "r2": {"r1"}}),  # the origin's region's rate need not be known
    # r1 and r3 at one rate split the pulling from r0 per chunk and relay to each other;
    # the slow r2 takes from whichever of them is last in the chunk's chain, never from r0
    ({"r0": 100, "r1": 100, "r2": 20, "r3": 100}, {"r1": {"r0", "r3"}, "r3": {"r0", "r1"}, "r2": {"r1", "r3"}}),
])
def test_unequal_rates_chain_fastest_first(rates, upstream):
    regions = set(upstream) | {"r0"}
    seen = {r: set() for r in upstream}
    for c in range(64):
        order = region_order(KEY, c, regions, "r0", rates)
        assert order[0] == "r0" and sorted(order) == sorted(regions)
        # Every region's upstream receives at least as fast as it does: nobody waits on
        # a slower link, and each chunk enters each region once, along one chain.
        known = [rates[r] for r in order[1:]]
        assert known == sorted(known, reverse=True)
        for region in upstream:
            got, origin_serves = upstream_regions(KEY, c, region, regions, "r0", rates)
            assert len(got) == 1 and not origin_serves
            seen[region].add(got[0])
    assert seen == upstream


def test_equal_rates_give_the_rendezvous_chain():
    for c in range(40):
        plain = region_order(KEY, c, ["r1", "r2", "r3"], "r0")
        assert region_order(KEY, c, ["r1", "r2", "r3"], "r0", {"r0": 100, "r1": 100, "r2": 100, "r3": 100}) == plain


@settings(max_examples=100, deadline=None)
@given(st.sets(st.sampled_from([f"n{i}" for i in range(8)])), st.integers(0, 60),
       st.one_of(st.none(), st.lists(st.sampled_from(["o", "r1", "r2"]), min_size=60, max_size=60)))
def test_balanced_owners_bounds_each_gateways_share_of_each_class(gws, n, classes):
    classes = None if classes is None else classes[:n]
    owners = balanced_owners(KEY, n, gws, classes)
    assert owners == balanced_owners(KEY, n, sorted(gws, reverse=True), classes)  # order-independent
    if not gws:
        assert owners == [None] * n
        return
    assert set(owners) <= gws
    cls = classes or [None] * n
    plain = [responsible(KEY, c, gws) for c in range(n)]
    plain_even = True
    for k in set(cls):
        chunks = [c for c in range(n) if cls[c] == k]
        base, extra = divmod(len(chunks), len(gws))
        # Every gateway's share of the class is floor(size / gateways) or one more, and as
        # many are one more as the division leaves over: shares differ by one at most.
        shares = sorted((Counter(owners[c] for c in chunks).get(g, 0) for g in gws), reverse=True)
        assert shares == [base + 1] * extra + [base] * (len(gws) - extra), (shares, len(chunks))
        drawn = sorted((Counter(plain[c] for c in chunks).get(g, 0) for g in gws), reverse=True)
        plain_even &= drawn == shares
    if plain_even:  # plain rendezvous drew even shares already: it stands
        assert owners == plain
    else:
        assert owners != plain


@pytest.mark.parametrize("n, k, shares", [(26, 4, [7, 7, 6, 6]), (9, 4, [3, 2, 2, 2]), (100, 16, [7] * 4 + [6] * 12),
                                          (3, 4, [1, 1, 1, 0]), (13, 2, [7, 6]), (24, 4, [6] * 4)])
def test_balanced_owners_leaves_no_gateway_the_remainder(n, k, shares):
    # A cap of ceil(n / k) alone gave 7/7/7/5 for 26 chunks over 4 gateways (the bench's patch in
    # the origin's region) and 3/3/3/0 for 9: the last gateway took what the others left.
    gws = [f"n0.{i}" for i in range(1, k + 1)]
    for v in range(20):
        owners = balanced_owners((v, False), n, gws)
        assert sorted((Counter(owners).get(g, 0) for g in gws), reverse=True) == shares, v


def test_balanced_owners_evens_out_a_lopsided_rendezvous_split():
    gws = {"n2.1", "n2.4"}
    # Objects where plain rendezvous gives one gateway 9 or more of 13 chunks.
    lopsided = [v for v in range(200)
                if max(Counter(responsible((v, False), c, gws) for c in range(13)).values()) >= 9]
    assert lopsided
    for v in lopsided:
        assert sorted(Counter(balanced_owners((v, False), 13, gws)).values()) == [6, 7]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.sampled_from([f"n{i}" for i in range(8)])), min_size=1, max_size=6))
def test_responsibility_map_tracks_membership(history):
    rmap = ResponsibilityMap(KEY, 40)
    before = [None] * 40
    for members in history:
        changed = rmap.set_members(members)
        now = balanced_owners(KEY, 40, members)
        assert [rmap.owner(c) for c in range(40)] == now
        assert changed == [c for c in range(40) if before[c] != now[c]]
        before = now


def test_responsibility_map_follows_new_classes():
    members = {"a", "b", "c"}
    first, second = ["o"] * 30, ["o", "r"] * 15
    rmap = ResponsibilityMap(KEY, 30, members, classes=first)
    assert [rmap.owner(c) for c in range(30)] == balanced_owners(KEY, 30, members, first)
    changed = rmap.set_members(members, second)
    now = balanced_owners(KEY, 30, members, second)
    assert [rmap.owner(c) for c in range(30)] == now
    assert changed == [c for c in range(30) if balanced_owners(KEY, 30, members, first)[c] != now[c]]
    assert rmap.set_members(members, second) == []
    with pytest.raises(UsageError, match="classes: expected one per chunk"):
        rmap.set_members(members, ["o"] * 29)


def test_gateways_are_the_top_k_by_weight_and_move_between_objects():
    members = [f"n{i}" for i in range(6)]
    for k in (1, 2, 5):
        gws = gateways(KEY, members, k)
        assert len(gws) == k and gws <= set(members)
        assert gws == gateways(KEY, reversed(members), k)  # order-independent
        ranked = sorted(members, key=lambda m: hashlib.sha256(f"{m}|7|0|gateway".encode()).digest(), reverse=True)
        assert gws == set(ranked[:k])
    assert gateways(KEY, members, None) == set(members)
    assert gateways(KEY, members[:2], 3) == set(members[:2])
    assert gateways(KEY, [], 2) == set()
    # Successive versions do not all load the same member's WAN link.
    assert len({frozenset(gateways((v, False), members, 1)) for v in range(30)}) > 3


@pytest.mark.parametrize("region, origin_region, k, expect", [
    # (my region, the origin's region, the swarm's cap, the cap in my region)
    ("r0", "r0", 2, None),  # the origin's region: every member pulls from the origin over its LAN
    ("r0", "r0", None, None),
    ("r0", "r0", 1, None),
    ("r1", "r0", 2, 2),  # a remote region crosses the WAN: capped
    ("r1", "r0", None, None),
    ("r1", "r9", 2, 2),  # the origin's region has no members: the first region pulls across the WAN, capped
    ("r1", None, 2, 2),  # the origin's region not yet known
])
def test_gateway_limit_table(region, origin_region, k, expect):
    """Issue 26: the origin's region, 1.80x its own bound with 2 gateways at a 200 Mbit/s LAN."""
    assert gateway_limit(region, origin_region, k) == expect


def test_every_member_of_the_origins_region_takes_an_even_share_from_the_origin():
    members = [f"n{i}" for i in range(4)]
    owners = balanced_owners(KEY, 48, gateways(KEY, members, gateway_limit("r0", "r0", 2)))
    assert Counter(owners) == {m: 12 for m in members}  # each chunk once, spread over every uplink


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.sampled_from([f"n{i}" for i in range(8)])), min_size=1, max_size=6),
       st.sampled_from([1, 2, 3]))
def test_responsibility_map_with_gateways_tracks_membership(history, k):
    rmap = ResponsibilityMap(KEY, 40, max_gateways=k)
    before = [None] * 40
    for members in history:
        changed = rmap.set_members(members)
        gws = gateways(KEY, members, k)
        assert rmap.gateways == gws and rmap.members == members
        now = balanced_owners(KEY, 40, gws)
        assert [rmap.owner(c) for c in range(40)] == now
        assert changed == [c for c in range(40) if before[c] != now[c]]
        before = now


@pytest.mark.parametrize("tracker, own, expect", [
    ({"r0": 100, "r1": 50}, None, ({"r0": 100, "r1": 50}, False)),  # the tracker's, to every member
    ({"r0": 100, "r1": 50}, {"r0": 100, "r1": 50.0}, ({"r0": 100, "r1": 50}, False)),
    ({"r0": 100, "r1": 50}, {"r0": 100, "r1": 20}, ({"r0": 100, "r1": 50}, True)),  # the tracker's win; warn
    ({"r0": 100, "r1": 50}, {"r0": 100}, ({"r0": 100, "r1": 50}, True)),
    (None, {"r0": 100, "r1": 20}, ({"r0": 100, "r1": 20}, False)),  # no rates from the tracker: the node's own
    ({}, {"r0": 100}, ({"r0": 100}, False)),
    (None, None, (None, False)),
])
def test_a_member_plans_with_the_trackers_wan_rates_and_its_own_only_where_the_tracker_gives_none(tracker, own, expect):
    assert swarm_wan_rates(tracker, own) == expect


def test_wan_rates_are_checked_wherever_they_come_from():
    with pytest.raises(UsageError, match=r"wan_rates: expected region -> rate > 0, found \[\('r1', -1\)\]"):
        swarm_wan_rates({"r1": -1}, None)
    assert check_wan_rates({}) is None and check_wan_rates({"r0": 5}) == {"r0": 5}


# ---------------------------------------------------------------- declared uplinks


@pytest.mark.parametrize("uplinks, expect", [
    (None, None),
    ({}, None),
    ({"a": 100, "b": 100, "c": 100, "d": 100}, None),  # even: the plan as without uplinks
    ({"a": 100, "b": 100, "c": 100, "d": 10}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.1}),
    ({"d": 10, "a": 100, "b": 100}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.1}),  # c declared none: the median
    ({"d": 10}, None),  # alone, its own rate is the median
    ({"a": 1000, "b": 100, "c": 100, "d": 100}, None),  # a claim above the others gains nothing
    ({"a": 100, "b": 100, "c": 50, "d": 50}, {"a": 1.0, "b": 1.0, "c": 0.5, "d": 0.5}),  # the upper median
    ({"a": 10, "b": 100}, {"a": 0.1, "b": 1.0, "c": 1.0, "d": 1.0}),
    ({"a": 100, "zz": 1}, None),  # a non-member's rate counts for nothing
    ({"a": 100, "b": None, "c": 100, "d": 10}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.1}),  # None: undeclared
])
def test_uplink_caps_table(uplinks, expect):
    assert uplink_caps(["a", "b", "c", "d"], uplinks) == expect


def _max_time(owners, caps):
    loads = Counter(owners)
    return max(loads[g] / caps[g] for g in caps)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 200), st.lists(st.sampled_from([1.0, 0.9, 0.5, 0.3, 0.1, 0.02]), min_size=2, max_size=8),
       st.integers(0, 50))
def test_balanced_owners_by_caps_ends_every_gateways_relay_as_early_as_any_split_could(n, cap_list, version):
    """Each gateway's relay takes its share over its cap: no chunk moved from one gateway to
    another would end the slowest sooner, and every chunk has one owner."""
    gws = [f"g{i}" for i in range(len(cap_list))]
    caps = dict(zip(gws, cap_list))
    owners = balanced_owners((version, False), n, gws, caps=caps)
    assert None not in owners and len(owners) == n
    loads = Counter(owners)
    for g in gws:
        for h in gws:
            if loads[g]:  # moving one of g's to h leaves g's time or raises h's past the max
                assert max((loads[g] - 1) / caps[g], (loads[h] + 1) / caps[h]) >= _max_time(owners, caps) * (1 - 1e-9) \
                    or g == h
    assert sum(loads.values()) == n


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 120), st.integers(2, 9), st.integers(0, 50), st.lists(st.integers(0, 3), max_size=120))
def test_balanced_owners_with_even_caps_is_the_plan_without_caps(n, k, version, raw):
    """Members that declared one rate (or 1.0 each) are planned exactly as undeclared ones."""
    gws = [f"m{i}" for i in range(k)]
    classes = [raw[c] if c < len(raw) else 0 for c in range(n)]
    assert balanced_owners((version, False), n, gws, classes, caps={g: 1.0 for g in gws}) == \
        balanced_owners((version, False), n, gws, classes)


@pytest.mark.parametrize("n, caps, shares", [
    (26, [1, 1, 1, 0.1], [9, 9, 8, 0]),  # a tenth of the rate: no chunk (even: 7/7/6/6)
    (48, [1, 1, 1, 0.1], [16, 16, 15, 1]),
    (48, [1, 1, 0.5, 0.5], [16, 16, 8, 8]),
    (9, [1, 0.01, 0.01, 0.01], [9, 0, 0, 0]),
    (3, [0.1, 0.1, 0.1], [1, 1, 1]),
])
def test_balanced_owners_shares_by_caps_table(n, caps, shares):
    gws = [f"g{i}" for i in range(len(caps))]
    loads = Counter(balanced_owners(KEY, n, gws, caps=dict(zip(gws, caps))))
    assert sorted((loads[g] for g in gws), reverse=True) == sorted(shares, reverse=True)
    for g, c in zip(gws, caps):  # the slowest takes the fewest
        assert all(loads[g] <= loads[h] for h, d in zip(gws, caps) if d > c)


def test_gateways_skip_slow_members_while_enough_others_are_left():
    members = ["a", "b", "c", "d"]
    for version in range(20):
        key = (version, False)
        assert gateways(key, members, 2, {"a": 0.1, "b": 0.1, "c": 1.0, "d": 1.0}) == {"c", "d"}
        three_slow = gateways(key, members, 2, {"a": 0.1, "b": 0.1, "c": 0.1, "d": 1.0})
        assert "d" in three_slow and len(three_slow) == 2  # the best of the slow ones fill in
        assert gateways(key, members, 2, None) == gateways(key, members, 2, {m: 1.0 for m in members})
        assert gateways(key, members, None, {"a": 0.1}) == set(members)  # the origin's region: all


def test_responsibility_map_follows_new_caps():
    m = ResponsibilityMap(KEY, 26, ["a", "b", "c", "d"])
    assert Counter(m.owner(c) for c in range(26))["d"] > 0
    moved = m.set_members(["a", "b", "c", "d"], caps={"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.1})
    assert moved and all(m.owner(c) != "d" for c in range(26))
    assert m.set_members(["a", "b", "c", "d"], caps={"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.1}) == []
    back = m.set_members(["a", "b", "c", "d"])
    assert sorted(back) == sorted(moved)
    assert [m.owner(c) for c in range(26)] == balanced_owners(KEY, 26, ["a", "b", "c", "d"])
