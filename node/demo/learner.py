"""The trainer's side of the demo, and the same RL loop run in one process.

Owns `Learner` (the fp32 master policy, its optimizer and the reward curve:
`state_dict()` to publish, `step(records, version)` to learn from a batch of
trajectory records as the origin hands them out) and `run_offline` (the demo's
loop without a swarm: simulated workers roll out with the served bf16 copy of
a version `lag` behind, every new version is diffed against the previous one
with the real codec). `python -m patchswarm.node.demo.learner` prints that run as a table:
the reward curve, the patch against the bf16 checkpoint per version, and the
CPU seconds of a train step and of a rollout batch.

Must not do network I/O; the orchestrator wires `Learner` to `SyncOrigin`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from typing import Iterable

import torch

from patchswarm.protocol.errors import CorruptData, InvalidInput
from patchswarm.protocol.patch import diff, keyframe

from . import task


def _field(rec, name: str):
    return rec[name] if isinstance(rec, dict) else getattr(rec, name)


class Learner:
    """fp32 master policy + RL optimizer; one `step` per batch of records.

    Records are the origin's trajectory records (attributes or dict keys
    `payload` bytes, `policy_version`, `node_id`). Payloads that do not decode
    as trajectories are counted in the metrics (`bad_records`) and skipped."""

    def __init__(self, spec: task.PolicySpec = task.DEFAULT_SPEC, rl: task.RLConfig = task.DEFAULT_RL,
                 pre: task.Pretraining = task.DEFAULT_PRETRAINING, seed: int = 0):
        self.spec, self.rl = spec, rl
        self.model = task.pretrained_policy(spec, pre, seed)
        self.optimizer = task.make_optimizer(self.model, rl)
        self.history: list[dict] = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights (a copy), for `origin.publish`."""
        return task.master_state(self.model)

    def step(self, records: Iterable, version: int) -> dict:
        """Train on `records`; `version` is the latest version published (the
        one the records' staleness is counted from). Returns the metrics of
        `task.train_step` plus step, version, staleness_mean/max, bad_records
        and by_node (node id -> trajectories used)."""
        trajs, versions, nodes, bad = [], [], Counter(), 0
        for rec in records:
            try:
                trajs.append(task.decode_trajectory(_field(rec, "payload"), self.spec))
            except CorruptData:
                bad += 1
                continue
            versions.append(int(_field(rec, "policy_version")))
            nodes[str(_field(rec, "node_id"))] += 1
        if not trajs:
            raise InvalidInput(f"learner step: expected at least one valid trajectory, found none ({bad} bad records)")
        m = task.train_step(self.model, self.optimizer, trajs, self.rl)
        stale = [version - v for v in versions]
        m.update(step=len(self.history) + 1, version=version, staleness_mean=sum(stale) / len(stale),
                 staleness_max=max(stale), bad_records=bad, by_node=dict(nodes))
        self.history.append(m)
        return m

    def rewards(self) -> list[tuple[int, float]]:
        """(step, mean reward of the batch it trained on), for the view and the figure."""
        return [(m["step"], m["reward_mean"]) for m in self.history]


@dataclasses.dataclass
class OfflineRun:
    rows: list[dict]  # one per training step; see run_offline
    origin_stats: dict  # shaped like SyncOrigin.stats()["versions"], for view.py and figure.py
    rewards: list[tuple[int, float]]
    pairs: list[tuple[dict, dict, bytes]]  # (base served, target served, patch bytes) when keep_pairs


@dataclasses.dataclass
class _Record:
    payload: bytes
    policy_version: int
    node_id: str


def _bits_changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    return sum(int(torch.ne(a[k].view(torch.int16), b[k].view(torch.int16)).sum()) for k in b)


def run_offline(steps: int = 30, workers: int = 6, batch: int = 16, lag: int = 1, seed: int = 0,
                keep_pairs: bool = False, learner: Learner | None = None) -> OfflineRun:
    """The demo's RL loop in one process. Version 0 is the pretrained policy
    (the origin numbers versions from 0 too);
    at each step every simulated worker rolls out `batch` trajectories with the
    served bf16 weights of the version `lag` behind the latest, the learner
    trains on all of them, and the new served state is diffed against the
    previous one.

    Row keys: step, version (published after the step), rollout_version,
    reward, patch_bytes, full_bytes, ratio (full / patch), changed_frac,
    train_cpu_s, rollout_cpu_s (mean per worker batch), diff_cpu_s."""
    learner = learner or Learner(seed=seed)
    served = [task.served_state(learner.model)]
    full = sum(t.numel() * t.element_size() for t in served[0].values())
    params = sum(t.numel() for t in served[0].values())
    versions = [{"version": 0, "patch_bytes": None, "keyframe_bytes": len(keyframe(served[0]).to_bytes()),
                 "full_bytes": full, "changed": None, "params": params}]
    rows, pairs = [], []
    for step in range(1, steps + 1):
        latest = versions[-1]["version"]
        rv = max(0, latest - lag)
        weights = served[rv - latest + len(served) - 1]  # served[-1] is `latest`
        records, ro_cpu = [], 0.0
        for w in range(workers):
            t0 = time.process_time()
            trajs = task.rollout(weights, batch, seed=(seed * 1000 + w) * 1_000_003 + rv)
            ro_cpu += time.process_time() - t0
            records += [_Record(task.encode_trajectory(t), rv, f"w{w}") for t in trajs]
        t0 = time.process_time()
        m = learner.step(records, latest)
        t1 = time.process_time()
        new = task.served_state(learner.model)
        data = diff(served[-1], new).to_bytes()
        t2 = time.process_time()
        changed = _bits_changed(served[-1], new)
        if keep_pairs:
            pairs.append((served[-1], new, data))
        served = (served + [new])[-(lag + 1):]
        versions.append({"version": latest + 1, "patch_bytes": len(data), "keyframe_bytes": None,
                         "full_bytes": full, "changed": changed, "params": params})
        rows.append({"step": step, "version": latest + 1, "rollout_version": rv, "reward": m["reward_mean"],
                     "patch_bytes": len(data), "full_bytes": full, "ratio": full / len(data),
                     "changed_frac": changed / params, "train_cpu_s": t1 - t0,
                     "rollout_cpu_s": ro_cpu / workers, "diff_cpu_s": t2 - t1})
    return OfflineRun(rows, {"versions": versions}, learner.rewards(), pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patchswarm.node.demo.learner", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16, help="rollouts per worker per version")
    ap.add_argument("--lag", type=int, default=1, help="workers roll out this many versions behind the latest")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--figure", help="also write the demo figure (PNG) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.process_time()
    learner = Learner(seed=args.seed)
    warm = time.process_time() - t0
    run = run_offline(args.steps, args.workers, args.batch, args.lag, args.seed, learner=learner)
    print(f"policy: {sum(t.numel() for t in learner.model.parameters()):,} params, {task.DEFAULT_SPEC}; "
          f"{task.DEFAULT_RL}; warm-up {warm:.1f} CPU s")
    print(f"{'step':>4} {'ver':>4} {'reward':>6} {'changed%':>8} {'patch B':>9} {'full B':>9} {'full/patch':>10} "
          f"{'train s':>7} {'rollout s':>9} {'diff s':>6}")
    for r in run.rows:
        print(f"{r['step']:>4} {r['version']:>4} {r['reward']:>6.3f} {100 * r['changed_frac']:>8.1f} "
              f"{r['patch_bytes']:>9,} {r['full_bytes']:>9,} {r['ratio']:>10.1f} {r['train_cpu_s']:>7.3f} "
              f"{r['rollout_cpu_s']:>9.3f} {r['diff_cpu_s']:>6.3f}")
    first = sum(r["reward"] for r in run.rows[:3]) / min(3, len(run.rows))
    last = sum(r["reward"] for r in run.rows[-3:]) / min(3, len(run.rows))
    ratios = sorted(r["ratio"] for r in run.rows)
    print(f"reward (mean of first 3 steps -> last 3): {first:.3f} -> {last:.3f}; full/patch min {ratios[0]:.1f}, "
          f"median {ratios[len(ratios) // 2]:.1f}; keyframe {run.origin_stats['versions'][0]['keyframe_bytes']:,} B "
          f"(CPU seconds, torch threads 1; rollout s is one worker's batch of {args.batch})")
    if args.figure:
        from .figure import write_figure
        print(f"figure: {write_figure(args.figure, run.rewards, run.origin_stats, [])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
