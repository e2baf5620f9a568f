"""The demo's learning part without a swarm: the policy learns, the served bf16
patches are lossless and small, trajectories survive their wire form, the
worker reads only consistent weights and stops on a signal, the live view
renders in both modes and the figure is a valid PNG."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import msgpack
import pytest
import torch
from rich.console import Console

from patchswarm.node.demo import task
from patchswarm.node.demo.figure import write_figure
from patchswarm.node.demo.learner import Learner, run_offline
from patchswarm.node.demo.rollout_worker import rollout_records
from patchswarm.node.demo.view import DemoView, render, sparkline, summary_table
from patchswarm.protocol.errors import CorruptData, InvalidInput
from patchswarm.protocol.patch import Patch, apply

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
# The offline run (python -m patchswarm.node.demo.learner) measures full/patch at 15-17x
# for every step of 30; this bound leaves room for other torch builds.
MIN_FULL_OVER_PATCH = 12.0


@pytest.fixture(scope="module")
def offline():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers; also makes the run reproducible
    try:
        yield run_offline(steps=STEPS, workers=6, batch=16, lag=1, seed=0, keep_pairs=True)
    finally:
        torch.set_num_threads(threads)


def test_policy_learns_within_a_few_versions(offline):
    rewards = [r["reward"] for r in offline.rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.08, f"reward did not improve: first steps {rewards[:3]}, last {rewards[-3:]}"
    assert all(r["rollout_version"] == max(0, r["version"] - 2) for r in offline.rows)


def test_served_patches_are_lossless_and_small(offline):
    assert len(offline.pairs) == STEPS
    for base, target, data in offline.pairs:
        state = {k: v.clone() for k, v in base.items()}
        apply(state, Patch.from_bytes(data))
        for name, t in target.items():
            assert torch.equal(state[name].view(torch.int16), t.view(torch.int16)), name
        full = sum(t.numel() * t.element_size() for t in target.values())
        assert full / len(data) >= MIN_FULL_OVER_PATCH, f"patch {len(data):,} B vs checkpoint {full:,} B"
        assert all(t.dtype == torch.bfloat16 for t in target.values())


def test_unused_input_embedding_rows_do_not_move(offline):
    """A token no rollout has sampled gets no gradient in its input row, so the
    row keeps every bit (the rare non-digit a rollout does sample moves on
    with Adam's momentum: a few percent of the rows after 12 steps)."""
    base, target, _ = offline.pairs[-1]
    used = 2 + task.DIGITS
    moved = base["embed.weight"].view(torch.int16).ne(target["embed.weight"].view(torch.int16)).any(1)
    assert int(moved[used:].sum()) < 0.05 * (task.DEFAULT_SPEC.vocab - used)
    assert bool(moved[task.DIGIT0:used].all())


def test_score_is_verifiable_from_tokens():
    p = list(task.PROMPT)
    d = task.DIGIT0
    assert task.score(p + [d + i for i in range(task.GEN_LEN)]) == 1.0
    assert task.score(p + [d + 5] * task.GEN_LEN) == 0.0
    assert task.score(p + [d, d + 1, 500, d + 2, d + 3, d + 4, d + 5, d + 6]) == pytest.approx(5 / 7)


def test_trajectory_wire_form_round_trips_and_rejects_garbage():
    weights = task.served_state(task.Policy())
    trajs = task.rollout(weights, 4, seed=1)
    for t in trajs:
        back = task.decode_trajectory(task.encode_trajectory(t))
        assert back == t
        assert back["reward"] == task.score(back["tokens"])
    good = msgpack.unpackb(task.encode_trajectory(trajs[0]))
    bad = [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({**good, "v": 99}),
           msgpack.packb({**good, "tokens": good["tokens"][:-1]}),
           msgpack.packb({**good, "tokens": [9] + good["tokens"][1:]}),
           msgpack.packb({**good, "tokens": good["tokens"][:-1] + [10 ** 6]}),
           msgpack.packb({**good, "logprobs": good["logprobs"][:-1]})]
    for payload in bad:
        with pytest.raises(CorruptData):
            task.decode_trajectory(payload)


def test_learner_counts_staleness_and_skips_bad_records():
    weights = task.served_state(task.Policy())
    records, _ = rollout_records(weights, version=3, seed=7, n=8)
    recs = [{"payload": p, "policy_version": v, "node_id": f"n{i % 2}"} for i, (p, v, _) in enumerate(records)]
    recs.append({"payload": b"not a trajectory", "policy_version": 3, "node_id": "n0"})
    learner = Learner()
    m = learner.step(recs, version=5)
    assert (m["n"], m["bad_records"], m["staleness_max"], m["by_node"]) == (8, 1, 2, {"n0": 4, "n1": 4})
    assert m["reward_mismatch"] == 0
    assert learner.rewards() == [(1, m["reward_mean"])]
    with pytest.raises(InvalidInput):
        learner.step(recs[-1:], version=5)


def _worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "patchswarm.node.demo.rollout_worker", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_worker_gives_up_without_a_node(tmp_path):
    missing = _worker("--socket", str(tmp_path / "none.sock"), "--seed", "2", "--connect-timeout", "0.5")
    try:
        assert missing.wait(timeout=60) == 1
        assert "no node answers" in missing.stderr.read()
    finally:
        if missing.poll() is None:
            missing.kill()
            missing.wait(timeout=10)
        missing.stdout.close()
        missing.stderr.close()


@pytest.mark.slow
def test_workers_roll_out_each_version_through_a_real_node(tmp_path):
    """Tracker and node as processes, the origin in this process as a trainer
    embeds it, two workers: every trajectory of every version comes back
    tagged with the version that produced it; one worker stops after the
    final version on its own, the other on SIGTERM while it waits."""
    from swarmlab import SwarmLab

    from patchswarm.node.trainer.origin import SyncOrigin

    policy = task.Policy()  # untrained weights are enough: this is about the plumbing
    workers = []
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        node = lab.start_node("n1", region="r1", extra=["--sparse-handoff"])  # the workers follow by changes
        sock = str(node.socket)
        workers = [_worker("--socket", sock, "--seed", "3", "--batch", "8", "--until-version", "1"),
                   _worker("--socket", sock, "--seed", "4", "--batch", "8")]
        try:
            with SyncOrigin(tracker=lab.tracker_addr, creds=lab.creds("org", "origin"), key=lab.swarm / "trainer.key",
                            data_dir=tmp_path / "org", listen="127.0.0.1:0", region="r0") as origin:
                feed = origin.trajectories()
                got = []
                for _ in range(2):
                    v = origin.publish(task.master_state(policy))
                    got += feed.get_batch(16, timeout=90)
                    with torch.no_grad():
                        policy.head.weight[task.DIGIT0:].add_(0.05)  # the next version differs
                assert workers[0].wait(timeout=60) == 0
                workers[1].send_signal(signal.SIGTERM)  # it has submitted version 1: it is waiting for 2
                assert workers[1].wait(timeout=30) == 0
                got += feed.get_batch(16, timeout=1)  # nothing more comes
        finally:
            logs = []
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait(timeout=10)
                logs.append(w.stderr.read())
                w.stdout.close()
                w.stderr.close()
    assert v == 1
    assert "final version 1 done" in logs[0] and "stopped by signal" in logs[1], logs
    assert sorted(r.policy_version for r in got) == [0] * 16 + [1] * 16
    for r in got:
        t = task.decode_trajectory(r.payload)
        assert r.node_id == "n1" and t["reward"] == task.score(t["tokens"])


def _nodes(version: int) -> list[dict]:
    """Status dicts shaped like NodeClient.status() for six nodes in three regions."""
    return [{"node_id": f"node-{i}", "region": f"r{i // 2}", "version": version, "state_hash": "ab" * 32,
             "weights_path": f"/d{i}/weights.safetensors", "bytes_in": {"origin": 1000 * (i % 2),
             "same_region": 50_000 + i, "other_region": 20_000 * (i % 3)}, "spool": {"records": i, "bytes": 900 * i}}
            for i in range(6)]


def test_view_renders_live_on_a_terminal(offline):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system=None)
    with DemoView(console) as view:
        assert view.live
        view.update(_nodes(STEPS), offline.origin_stats, offline.rewards, note=f"step {STEPS}/{STEPS}")
    console.print(summary_table(_nodes(STEPS), offline.origin_stats, offline.rewards))
    text = out.getvalue()
    for needle in ("node-5", "r2", "same region", "full / sent", "keyframe", "reward", "summary", "mean patch"):
        assert needle in text, needle
    assert any(c in text for c in "▁▂▃▄▅▆▇█")


def test_view_degrades_to_plain_lines_off_a_terminal(offline):
    out = io.StringIO()
    view = DemoView(Console(file=out, force_terminal=False, width=200))
    assert not view.live
    with view:
        view.update(_nodes(STEPS), offline.origin_stats, offline.rewards)
        first = out.getvalue()
        view.update(_nodes(STEPS), offline.origin_stats, offline.rewards)
        assert out.getvalue() == first  # nothing new, nothing printed
        stats = {"versions": offline.origin_stats["versions"]
                 + [{"version": STEPS + 1, "patch_bytes": 1000, "keyframe_bytes": None, "full_bytes": 2000}]}
        view.update(_nodes(STEPS + 1), stats, offline.rewards + [(STEPS + 1, 0.9)])
    lines = out.getvalue().splitlines()
    assert "\x1b[" not in out.getvalue()
    assert sum(line.startswith("version ") for line in lines) == STEPS + 2  # versions 0..STEPS + 1
    assert sum(line.startswith("node node-3 (r1) at version") for line in lines) == 2
    assert lines[-1] == f"step {STEPS + 1}: reward 0.900"
    assert any(line.startswith(f"version {STEPS + 1} published: patch 1,000 B") for line in lines)


def test_sparkline_scales_to_the_given_range():
    assert sparkline([0.0, 0.5, 1.0], lo=0.0, hi=1.0) == "▁▅█"
    assert sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=10)) == 10


def test_figure_is_a_png_with_three_panels(offline, tmp_path):
    path = write_figure(tmp_path / "demo.png", offline.rewards, offline.origin_stats, _nodes(STEPS))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 3 * img.shape[0] // 2
    assert not list(tmp_path.glob(".*.tmp"))
    Console(file=io.StringIO()).print(render(_nodes(0), {}, []))  # an empty run renders too
    write_figure(tmp_path / "empty.png", [], {}, [])
