"""Fabricated patches (tests/hostile_patches.py) end in a clean error within a memory budget.

Budget: every case's patch is at most ~1 MB and its base is one 16 KB tensor
(or none); decoding it may allocate at most BUDGET (traced numpy and Python
allocations, and growth of the peak RSS), whatever sizes it declares.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_patches import CASES, write_cases  # noqa: E402

FIXED = ("class_of_holes", "rice_count", "repeated_pieces")

BUDGET = 64 << 20


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    write_cases(folder)
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("hostile_patches.py")), str(folder)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("case", FIXED)
def test_a_fabricated_patch_is_refused_cleanly_within_the_budget(measured, case):
    got = measured[case]
    assert got["bytes"] < 1 << 20
    assert got["outcome"].startswith("clean "), got
    assert got["traced_peak"] < BUDGET, got
    assert got["rss_growth"] < BUDGET, got


def test_a_rice_blob_is_refused_before_its_declared_count_is_allocated():
    from patchswarm.protocol import ricecode
    from patchswarm.protocol.errors import CorruptData

    tracemalloc.start()
    try:
        with pytest.raises(CorruptData, match="at least a bit per value"):
            ricecode.unpack(b"\x00" * 16, 1 << 27, 0)  # 1 GiB of uint64 if it were trusted
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert ricecode.unpack(b"\x00", 8, 0).tolist() == [0] * 8  # 8 zeros fill one byte exactly
