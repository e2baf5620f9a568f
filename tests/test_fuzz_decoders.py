"""Every decoder of outside bytes ends in a PatchswarmError or a valid result, within a memory
budget, for any input (issue 21). A few examples each here, to stay fast; bench/fuzz.py runs
many (bench/RESULTS.md has a run). The targets and inputs are tests/fuzzing.py's."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing import MEMORY_BUDGET, TARGETS, inputs, run, run_traced, seeds


@pytest.mark.parametrize("target", TARGETS)
def test_the_seeds_are_valid(target):
    """The mutated encodings start from valid ones (so mutations reach deep into each decoder)."""
    assert {run(target, s) for s in seeds(target)} == {"valid"}


@pytest.mark.parametrize("target", TARGETS)
def test_any_input_ends_cleanly_within_the_memory_budget(target):
    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=inputs(target))
    def check(data):
        tracemalloc.start()
        try:
            _, peak = run_traced(target, data)  # a crash propagates: hypothesis shrinks and reports it
        finally:
            tracemalloc.stop()
        assert peak < MEMORY_BUDGET, f"{target}: {peak} bytes traced for {len(data)} bytes of input"

    check()
