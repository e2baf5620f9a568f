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
    assert schedule.tick(15.0) is None  # the growth is counted when it is frozen, not at every tick
    assert schedule.tick(20.0) == "full"  # frozen, counted, found beyond the quarter
    assert schedule.status()["full_collections"] == 1
    del keep


def members(count: int, objects_each: int = 50) -> list:
    """Long-lived state for `count` members: `objects_each` tracked objects apiece."""
    return [[[] for _ in range(objects_each - 1)] for _ in range(count)]


def beyond_growth(schedule) -> int:
    """Objects that are more than the quarter + 100,000 the schedule lets the frozen heap grow."""
    return int(gc.get_freeze_count() * schedule.growth) + 150_000


def test_a_heap_that_grows_with_the_load_sets_off_no_full_collection(schedule):
    fleet = members(2000)
    schedule.collect_all(10.0, load=2000)  # measures a member's cost: 50 objects
    assert schedule.status()["last_full"]["load"] == 2000
    fleet += members(beyond_growth(schedule) // 50)  # the fleet grows, every new object alive
    for t in (20.0, 30.0, 40.0):
        assert schedule.tick(t, load=len(fleet)) == "freeze"
    # the same growth without the load to explain it is taken for garbage
    assert schedule.tick(50.0, load=2000) == "full"
    del fleet


def test_garbage_the_load_does_not_explain_sets_off_a_full_collection(schedule):
    fleet = members(2000)
    schedule.collect_all(10.0, load=2000)
    batch = beyond_growth(schedule) * 6 // 10 // 3  # a cycle of two in a tuple: 60 % of what sets one off

    def leavers():
        pairs = [(Node(), Node()) for _ in range(batch)]
        for a, b in pairs:
            a.other, b.other = b, a
        return pairs

    first = leavers()
    refs = [weakref.ref(a) for a, _ in first[:100]]
    assert schedule.tick(20.0, load=2000) == "freeze"  # alive now: frozen
    del first  # members that left, their cycles behind them, frozen: still counted
    assert all(ref() is not None for ref in refs)
    second = leavers()
    assert schedule.tick(30.0, load=2000) == "full"  # 120 %, with the same load
    assert all(ref() is None for ref in refs)
    assert schedule.status()["last_full"]["unreachable"] >= 2 * batch
    del fleet, second


def test_a_load_that_falls_costs_no_full_collection_while_the_heap_stays_alive(schedule):
    fleet = members(beyond_growth(schedule) // 50)
    schedule.collect_all(10.0, load=len(fleet))
    # no load left to explain them, but the last complete collection found them all alive: the
    # schedule never expects less than that, or it would collect at every tick
    for t in (20.0, 30.0, 40.0):
        assert schedule.tick(t, load=0) == "freeze"
    assert schedule.status()["full_collections"] == 1
    del fleet


def test_ticks_between_freezes_do_not_count_the_frozen_heap(schedule, monkeypatch):
    """Counting frozen objects walks every one of them: it is done once per freeze, not per tick
    (the tracker ticks for every membership change)."""
    counted = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: counted.append(1) or real())
    for t in range(1, 10):
        assert schedule.tick(float(t), load=10) is None
    schedule.status()
    assert counted == []
    assert schedule.tick(10.0, load=10) == "freeze" and len(counted) == 1


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
