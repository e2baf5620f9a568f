"""The demo end to end, as a newcomer runs it: `python -m patchswarm.node.cli demo` as a subprocess.

A short run on a small swarm (a tracker, 3 nodes in 2 regions, 3 workers as
processes, the origin inside the trainer) must pass its own checks, and
what it wrote (summary.json, the nodes' weights files, the figure) must say
the same; SIGINT in the middle of a run must stop every child process and
exit 130 without a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # real processes

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4  # with seed 0 the reward of step 4 is above step 1's (0.47 -> 0.50); every run of it is the same


def _demo(out: Path, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "patchswarm.node.cli", "demo", "--out", str(out), *args], cwd=ROOT,
                            stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})


def _stop(p: subprocess.Popen) -> None:
    """After a failed assert: stop the demo as a person would (Ctrl-C), so it stops its children."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()  # its children get SIGTERM from the kernel (the demo sets PR_SET_PDEATHSIG)
            p.wait(timeout=30)


def _processes_naming(text: str, but: int | None = None) -> list[str]:
    """Command lines of live processes that mention `text` (the run dir is in every child's
    arguments), except this one and `but`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in (os.getpid(), but):
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((line for line in (d / "status").read_text().splitlines() if line.startswith("State:")), "")
        except OSError:
            continue  # it ended while we looked
        if text in cmd and "Z" not in state.split()[1:2]:
            found.append(f"{d.name}: {cmd}")
    return found


def test_short_demo_learns_and_moves_every_version_and_trajectory(tmp_path):
    out = tmp_path / "run"
    p = _demo(out, "--steps", str(STEPS), "--nodes", "3", "--regions", "2", "--seed", "0")
    try:
        text, _ = p.communicate(timeout=240)
    finally:
        _stop(p)
    assert p.returncode == 0, text
    assert "Traceback" not in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and all(c["ok"] for c in summary["checks"]), summary["checks"]

    # every node applied every version, and holds the last one bit for bit
    final = summary["final_version"]
    assert final == STEPS
    assert [n["node_id"] for n in summary["nodes"]] == ["node-0", "node-1", "node-2"]
    assert sorted({n["region"] for n in summary["nodes"]}) == ["r1", "r2"]
    import msgpack

    from patchswarm.node.net.trust import Credentials
    from patchswarm.node.persistence import read_current
    from patchswarm.protocol.manifest import decode_manifest

    # What the origin published last (its durable record is its base plus these objects).
    envelope = (out / "origin" / "objects" / f"v{final:010d}-patch" / "manifest").read_bytes()
    published = decode_manifest(msgpack.unpackb(envelope)[0])
    for n in summary["nodes"]:
        assert set(range(final + 1)) <= set(n["applied"]) and n["version"] == final, n
        c = Credentials.load(out / "creds" / n["node_id"])
        w = read_current(out / n["node_id"], c.swarm_id(), c.trainer_public_key())  # base + chain, each verified
        assert w.version == final and w.state_hash == published.target_hash
        assert {k: (t.dtype, tuple(t.shape)) for k, t in w.state.items()} == {
            name: (torch.bfloat16, tuple(shape)) for name, dtype, shape in published.tensors}

    # the trainer received every trajectory the workers submitted
    t = summary["trajectories"]
    per_version = 3 * 16
    assert t["submitted_by_workers"] == t["spooled_by_nodes"] == t["received_by_origin"] == t["read_by_trainer"]
    assert t["trained_on"] == STEPS * per_version and t["stale"] == 0
    for n in summary["nodes"]:
        assert n["spool"]["appended_total"] == n["spool"]["acked_total"] == STEPS * 16 and n["spool"]["records"] == 0

    # the reward at the end is better than at the start
    rewards = [r for _, r in summary["rewards"]]
    assert len(rewards) == STEPS and rewards[-1] > rewards[0], rewards

    # a patch per version after the keyframe, each far smaller than the checkpoint
    versions = summary["versions"]
    assert [v["version"] for v in versions] == list(range(final + 1))
    assert versions[0]["keyframe_bytes"] and versions[0]["patch_bytes"] is None
    assert all(v["patch_bytes"] and v["patch_bytes"] * 5 < v["full_bytes"] for v in versions[1:])

    figure = Path(summary["figure"])
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(figure) in text
    assert str(out) in text and "checks" in text
    assert not _processes_naming(str(out))


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds leftover processes through /proc")
def test_sigint_mid_run_stops_every_child_and_exits_130(tmp_path):
    out = tmp_path / "run"
    log_path = tmp_path / "demo.out"
    with open(log_path, "w") as log:
        p = _demo(out, "--steps", "200", "--nodes", "2", "--regions", "1", stdout=log)
    try:
        deadline = time.monotonic() + 180
        while "step 1: reward" not in log_path.read_text():
            assert p.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"no training step within 180 s:\n{log_path.read_text()}"
            time.sleep(0.2)
        children = _processes_naming(str(out), but=p.pid)
        assert len(children) == 5, children  # tracker, 2 nodes, 2 workers
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=90) == 130
    finally:
        _stop(p)
    text = log_path.read_text()
    assert "Traceback" not in text and "interrupted (SIGINT)" in text, text
    assert not _processes_naming(str(out))
    for f in (out / "logs").glob("*.log"):  # each child stopped on its SIGTERM, cleanly
        assert "Traceback" not in f.read_text(), f
    assert "stopped by signal" in (out / "logs" / "worker-0.log").read_text()
    assert "stopping (SIGTERM)" in (out / "logs" / "node-0.log").read_text()


def test_refuses_a_run_dir_with_files_in_it(tmp_path):
    (tmp_path / "old.txt").write_text("an earlier run")
    r = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", "demo", "--out", str(tmp_path), "--steps", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1
    assert "expected a new or empty directory" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.txt"]
