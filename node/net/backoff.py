"""Retry delays with jitter, so a fleet that lost the same peer does not retry in lockstep.

Owns `Backoff` (capped exponential growth, each delay drawn from the upper half
of the current step: "equal jitter") and `jittered(delay)` for callers that keep
their own growth rule. Must not sleep: callers own the clock and the waiting.

Why jitter: when the tracker restarts, every member loses it in the same
instant; with fixed delays they all retry at the same instants, and the new
tracker takes the whole fleet's TLS handshakes at once, step after step.
Drawing each delay from [step/2, step] spreads each step's retries over half
its length while keeping the growth (a retry never comes sooner than half the
step).
"""

from __future__ import annotations

import random

JITTER_LOW = 0.5  # a delay is drawn from [JITTER_LOW * step, step]


def jittered(delay: float, rng: random.Random | None = None) -> float:
    """`delay` scaled by a factor drawn from [JITTER_LOW, 1]."""
    return delay * (rng or random).uniform(JITTER_LOW, 1.0)


class Backoff:
    """Delays that double from `low` up to `high`, each one jittered; `reset()` after a success."""

    def __init__(self, low: float, high: float, rng: random.Random | None = None):
        if not 0 < low <= high:
            raise ValueError(f"backoff: expected 0 < low <= high, found low={low}, high={high}")
        self.low, self.high = low, high
        self._rng = rng or random.Random()
        self._step = low

    def next(self) -> float:
        """The delay before the next try; the step doubles (capped) for the one after."""
        delay = jittered(self._step, self._rng)
        self._step = min(self.high, self._step * 2)
        return delay

    def reset(self) -> None:
        self._step = self.low
