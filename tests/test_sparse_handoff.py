"""The sparse hand-off end to end, as real processes on loopback: tracker, origin (--watch), a node,
and a separate process holding a torch model that follows the node's versions by changes alone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from patchswarm.protocol.statehash import state_hash
from swarmlab import ROOT, SwarmLab, write_checkpoint
from synthetic import rl_checkpoints, served

pytestmark = pytest.mark.slow  # real processes

HERE = Path(__file__).resolve().parent
VERSIONS = 10


def test_a_process_holding_a_model_follows_ten_versions_by_sparse_changes_alone(tmp_path):
    checkpoints = rl_checkpoints("small", 1e-5, VERSIONS)
    watch = tmp_path / "watch"
    out = tmp_path / "follower.json"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=["--chunk-bytes", "32768"], wait=False)
        (node,) = lab.start_nodes([("n0", "r0")], starting=[origin], extra=["--sparse-handoff"])
        write_checkpoint(watch, "step0000.safetensors", checkpoints[0])
        lab.wait_version([node], 0)
        log = tmp_path / "follower.log"
        with open(log, "wb") as f:
            follower = subprocess.Popen(
                [sys.executable, str(HERE / "engines" / "sparse_follower.py"), "--socket", str(node.socket),
                 "--until", str(VERSIONS), "--out", str(out), "--deadline", "240"],
                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "at version 0 " not in log.read_text():  # bootstrapped: from here on, changes only
                assert follower.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            for v in range(1, VERSIONS + 1):
                write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
                (st,) = lab.wait_version([node], v, timeout=120)
            follower.wait(timeout=240)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait(timeout=10)
        assert follower.returncode == 0, log.read_text()
        changes = sorted(p.name for p in (node.data_dir / "changes").iterdir())
    r = json.loads(out.read_text())
    expect = state_hash(served(checkpoints[VERSIONS], torch.bfloat16))
    assert r["version"] == VERSIONS and r["node_hash"] == st["state_hash"] == expect
    assert r["model_hash"] == expect, "the model's parameters are not the origin's last version"
    assert r["bootstraps"] == 1 and r["versions"][0] == 0, r  # one read of the weights file, at version 0, then changes
    assert r["versions"][-1] == VERSIONS and r["in_place"] and r["finite"], r
    assert changes and all(n.endswith(".chg") for n in changes), changes  # kept, bounded by the node's window
