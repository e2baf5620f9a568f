"""protocol/piecestate.py on its own: the counts and the pending announcements the picker's
tests (test_picker.py) reach only through its policy."""

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from patchswarm.protocol.piecestate import MAX_UNKNOWN_INDICES, ObjectState, PeerState, PendingFacts

KEY = (3, False)


def test_waiting_counts_missing_chunks_neither_ready_nor_in_flight():
    obj = ObjectState(KEY, 9, {8}, priority=0, added_at=0.0, rng=random.Random(1), coordinated=False)
    assert obj.waiting() == 8
    obj.add_holders("a", [0, 1, 2], whole=True, fixed=0, tier_at=None, in_region=True)
    assert (obj.n_ready, obj.waiting()) == (3, 5)


def bits_of(bitfield: bytes, n_chunks: int) -> set[int]:
    """The chunks a Have bitfield says, bit i of byte i // 8 counted from the least significant."""
    return {c for c in range(min(n_chunks, 8 * len(bitfield))) if bitfield[c // 8] >> (c % 8) & 1}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=24), max_size=4), st.lists(st.integers(0, 300), max_size=8), st.integers(0, 200))
@example([b"\x01" * 100, b"\x02" * 101], [], 1000)  # a longer bitfield after a long one: grown to its length
def test_unknown_object_bitfields_are_or_ed_and_cut_to_the_chunk_count(bitfields, singles, n_chunks):
    pending = PendingFacts()
    for bitfield in bitfields:
        pending.add_unknown("a", KEY, bitfield, [], whole=True)
    pending.add_unknown("a", KEY, None, singles, whole=True)
    pending.add_unknown("b", KEY, None, singles, whole=False)
    expected = set(singles).union(*(bits_of(b, n_chunks) for b in bitfields))
    facts = pending.take(KEY, n_chunks)
    assert facts["a"] == (expected, set())
    assert facts["b"] == (set(), set(singles))
    assert pending.take(KEY, n_chunks) == {}


def test_unknown_single_chunks_are_bounded_per_peer():
    pending = PendingFacts()
    pending.add_unknown("a", KEY, None, range(MAX_UNKNOWN_INDICES + 5), whole=True)
    assert len(pending.take(KEY, 1 << 20)["a"][0]) == MAX_UNKNOWN_INDICES


def test_a_holder_that_left_starts_afresh_when_it_comes_back():
    peers = {"a": PeerState("node", "r1")}
    obj = ObjectState(KEY, 8, set(), priority=0, added_at=0.0, rng=random.Random(1), coordinated=False)
    obj.add_holders("a", [0], whole=False, fixed=0, tier_at=None, in_region=True)  # arriving
    obj.add_holders("a", [1], whole=True, fixed=0, tier_at=None, in_region=True)
    obj.withdraw("a", 1)
    assert not obj.holds_whole("a", 0) and not obj.announced("a", 1)
    obj.forget_holder("a", lambda c, info: 0, peers)
    obj.add_holders("a", [0, 1], whole=True, fixed=0, tier_at=None, in_region=True)
    assert obj.holds_whole("a", 0) and obj.holds_whole("a", 1)
    assert obj.facts() == {"a": ({0, 1}, set())}


@pytest.mark.parametrize("kept", ["known", "unknown"])
def test_only_facts_below_the_floor_are_dropped(kept):
    pending = PendingFacts()
    pending.forget_below(5)
    for version in (4, 5, 6):
        if kept == "known":
            pending.add("a", (version, False), [0], whole=True)
        else:
            pending.add_unknown("a", (version, False), None, [0], whole=True)
    assert [pending.take((v, False), 1) for v in (4, 5, 6)] == [{}, {"a": ({0}, set())}, {"a": ({0}, set())}]


def test_an_announcement_repeating_a_chunk_still_adds_the_others():
    obj = ObjectState(KEY, 8, set(), priority=0, added_at=0.0, rng=random.Random(1), coordinated=False)
    obj.add_holders("a", [0], whole=True, fixed=0, tier_at=None, in_region=True)
    obj.add_holders("a", [0, 1], whole=True, fixed=0, tier_at=None, in_region=True)
    assert obj.sources == {0: {"a"}, 1: {"a"}} and obj.ready_of == {"a": {0, 1}}


def test_a_failed_holder_back_after_leaving_is_no_source_of_that_chunk_only():
    peers = {"a": PeerState("node", "r1")}
    obj = ObjectState(KEY, 8, set(), priority=0, added_at=0.0, rng=random.Random(1), coordinated=False)
    obj.add_holders("a", [0], whole=True, fixed=0, tier_at=None, in_region=True)
    obj.failed[0] = {"a"}  # a request to it for chunk 0 failed (as the picker records it)
    obj.forget_holder("a", lambda c, info: 0, peers)
    obj.add_holders("a", [0, 1], whole=True, fixed=0, tier_at=None, in_region=True)
    assert obj.holders[0] == obj.holders[1] == {"a"}
    assert obj.sources == {1: {"a"}}


@pytest.mark.parametrize("kept", ["known", "unknown"])
def test_pending_objects_are_bounded_oldest_out(kept):
    pending = PendingFacts(max_objects=2)

    def announce(version: int) -> None:
        if kept == "known":
            pending.add("a", (version, False), [0], whole=True)
        else:
            pending.add_unknown("a", (version, False), None, [0], whole=True)

    announce(1)
    announce(2)
    announce(1)  # an object already kept pushes nothing out
    announce(3)  # a third one pushes out the oldest
    assert pending.take((1, False), 1) == {}
    assert pending.take((2, False), 1) == pending.take((3, False), 1) == {"a": ({0}, set())}


@pytest.mark.parametrize("kept", ["known", "unknown"])
def test_one_peer_s_announcements_push_out_only_its_own(kept):
    """Objects announced before they are fetched were kept up to `max_objects`, the oldest
    pushed out first whoever announced it: a member announcing that many objects pushed out
    the others' facts. Before a node knows any manifest (a fresh node), every version counts
    as near (wire.unknown_kept), so a member's Haves of 64 invented versions pushed out the
    origin's Have of the version the node bootstraps from, which the origin does not send
    again: the node did not know the origin held it. Now each peer's facts are bounded by
    themselves, its oldest out first."""
    pending = PendingFacts(max_objects=4)

    def announce(peer: str, version: int) -> None:
        if kept == "known":
            pending.add(peer, (version, False), [0], whole=True)
        else:
            pending.add_unknown(peer, (version, False), None, [0], whole=True)

    announce("origin", 0)
    for version in range(100, 164):
        announce("mallory", version)
    assert pending.take((0, False), 1) == {"origin": ({0}, set())}
    kept_of_mallory = [v for v in range(100, 164) if pending.take((v, False), 1)]
    assert kept_of_mallory == list(range(160, 164))
    announce("origin", 1)
    pending.peer_left("origin")  # what a peer leaves behind goes with it
    assert pending.take((1, False), 1) == {}
