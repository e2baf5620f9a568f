"""Retry delays: doubling to a cap, each drawn from the upper half of its step, spread across a fleet."""

from __future__ import annotations

import random

import pytest

from patchswarm.node.net.backoff import JITTER_LOW, Backoff, jittered


def test_steps_double_to_the_cap_and_each_delay_lies_in_the_upper_half_of_its_step():
    b = Backoff(0.5, 10.0, random.Random(1))
    steps = [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    for step in steps:
        d = b.next()
        assert JITTER_LOW * step <= d <= step
    b.reset()
    assert JITTER_LOW * 0.5 <= b.next() <= 0.5


def test_a_fleet_that_failed_together_retries_spread_out():
    """1000 members that lost the tracker at the same instant: their first retries do not coincide,
    and they cover the step's upper half rather than bunching in one corner of it."""
    delays = [Backoff(0.5, 10.0, random.Random(seed)).next() for seed in range(1000)]
    assert len({round(d, 6) for d in delays}) > 990
    assert min(delays) < 0.26 and max(delays) > 0.49
    third = sorted(delays)[333], sorted(delays)[666]
    assert 0.3 < third[0] < 0.36 and 0.39 < third[1] < 0.45


def test_jittered_scales_within_bounds():
    rng = random.Random(7)
    assert all(JITTER_LOW * 3.0 <= jittered(3.0, rng) <= 3.0 for _ in range(200))


@pytest.mark.parametrize("low, high", [(0, 1), (2, 1), (-1, 3)])
def test_rejects_bounds_that_cannot_grow(low, high):
    with pytest.raises(ValueError, match="low"):
        Backoff(low, high)
