"""bench/reliability.py's kill scenarios, two kills each, so the bench cannot rot (issue 21).

The same functions the bench runs at its defaults (50 kills mid-apply, 20
mid-upload, 10 mid-publish, 10 of the tracker): each kill must land where
its failpoint says (the log shows it), and every member must come back with
bit-exact weights, every acked trajectory stored exactly once, nothing left
behind.
"""

from __future__ import annotations

import pytest

from bench.reliability import TRIALS, checkpoints, run

pytestmark = pytest.mark.slow  # real processes

KILLS = 2


@pytest.fixture(scope="module")
def ckpts():
    return checkpoints(KILLS)


@pytest.mark.parametrize("scenario", list(TRIALS))
def test_kills_land_where_meant_and_lose_nothing(tmp_path, ckpts, scenario):
    out = run(scenario, tmp_path, KILLS, ckpts=ckpts)
    assert out.failures == [], out.failures
    assert (out.trials, out.landed, out.survived) == (KILLS, KILLS, KILLS), out
    assert out.lost == 0 and out.leftovers == 0, out
