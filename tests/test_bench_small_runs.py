"""The benches behind this session's numbers, run small: bench/restart_cost.py and
bench/transport.py --pace-mbit print their tables from real runs (a store written and
loaded, a TLS pair paced over loopback)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> str:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_restart_cost_loads_a_written_store_and_prints_its_table(tmp_path):
    out = _run("bench/restart_cost.py", "--sizes", "0.01", "--repeat", "2", "--work", str(tmp_path))
    row = re.search(r"^\s+0\.01\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) ([\d.]+)$", out, re.M)
    assert row, out
    assert int(row.group(1)) == 10  # 0.01 GiB in 1 MiB chunks
    assert list(tmp_path.iterdir()) == []  # each store removed after its loads


def test_restart_cost_refuses_bad_sizes():
    r = subprocess.run([sys.executable, "bench/restart_cost.py", "--sizes", "two"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--sizes: expected GiB" in r.stderr


def test_paced_transport_reports_the_receivers_wake_ups():
    out = _run("bench/transport.py", "--mib", "1", "--piece-kib", "64", "--pace-mbit", "200",
               "--streams", "TLSSocketStream", "--repeat", "1")
    row = re.search(r"^\s+TLSSocketStream\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert row, out
    assert int(row.group(3)) >= 1 and int(row.group(4)) <= 30  # paced to 25 MB/s at most
    assert "sent in 8 KiB writes at 200 Mbit/s" in out
