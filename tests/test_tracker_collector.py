"""tracker/collector.py: full collections on the tracker's schedule, and nothing left uncollected."""

import gc
import weakref

import pytest

from patchswarm.tracker.collector import NO_AUTOMATIC_FULL, CollectorSchedule


class Node:
    pass


def cycle() -> weakref.ref:
    """A two-object cycle no one references; a weak reference to one of them."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def schedule():
    s = CollectorSchedule(freeze_every=10.0, full_every=100.0)
    before = gc.get_threshold()
    s.start(0.0)
    try:
        yield s
    finally:
        s.stop()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_cpython_runs_no_full_collection_of_its_own_while_the_schedule_runs(schedule):
    young0, young1, full = gc.get_threshold()
    assert full == NO_AUTOMATIC_FULL
    assert (young0, young1) != (0, 0)  # young generations still collected automatically


def test_a_young_cycle_is_freed_at_the_next_freeze(schedule):
    ref = cycle()
    gc.collect(1)  # promoted as far as automatic collections take it
    assert schedule.tick(5.0) is None
    assert schedule.tick(10.0) == "freeze"
    assert ref() is None


def test_a_cycle_that_was_frozen_alive_is_freed_by_the_next_full_collection(schedule):
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    assert schedule.tick(10.0) == "freeze"  # alive now: frozen
    del a, b
    for t in (20.0, 30.0, 90.0):
        assert schedule.tick(t) == "freeze"
        assert ref() is not None, "frozen objects are not scanned until the full collection"
    assert schedule.tick(100.0) == "full"
    assert ref() is None
    assert schedule.status()["full_collections"] == 1


def test_frozen_growth_brings_the_full_collection_forward(schedule):
    schedule.tick(10.0)
    grow = int(gc.get_freeze_count() * schedule.growth) + 100_000
    keep = [[Node()] for _ in range(grow // 2 + 1000)]  # two tracked objects each: above a quarter + 100k
    assert schedule.tick(20.0) == "freeze"  # the growth is seen once it is frozen
    assert schedule.tick(30.0) == "full"
    del keep


def test_due_says_when_the_next_collection_is(schedule):
    assert schedule.due(0.0) == 10.0
    schedule.tick(10.0)
    assert schedule.due(10.0) == 20.0


def test_two_schedules_share_one_takeover():
    before = gc.get_threshold()
    first, second = CollectorSchedule(), CollectorSchedule()
    first.start(0.0)
    second.start(0.0)
    first.stop()
    assert gc.get_threshold()[2] == NO_AUTOMATIC_FULL  # the second still runs
    second.stop()
    assert gc.get_threshold() == before
    first.stop()  # a second stop changes nothing
    assert gc.get_threshold() == before


def test_a_stopped_schedule_collects_nothing():
    s = CollectorSchedule()
    assert s.tick(1e9) is None


@pytest.mark.parametrize("freeze_every, full_every", [(0.0, 10.0), (20.0, 10.0), (-1.0, 10.0)])
def test_periods_are_checked(freeze_every, full_every):
    with pytest.raises(ValueError, match="freeze_every"):
        CollectorSchedule(freeze_every, full_every)
