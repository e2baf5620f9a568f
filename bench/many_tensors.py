"""What apply, state_hash and diff cost per tensor on states of very many small tensors.

A large fp8 MoE (Kimi-K2, DeepSeek-V3) has ~140k tensors counting its scale
tensors; there the per-tensor Python work of the codec, not its bytes, sets
each version's cost at every node. Each state here is `--counts` bf16 tensors
of `--elements` elements, named like such a model's experts
("model.layers.{i % 61}.mlp.experts.{i // 61}.w"); the target differs from
the base in ONE element. Per count, the minimum of `--rounds` rounds:

- hash: `statehash.state_hash(base)`;
- diff: `patch.diff(base, target)` (both states hashed inside, as the origin
  does when it has no hashes at hand);
- apply: `patch.apply(copy of base, patch)` (the copy made outside the timing);
- again: the next version's apply into the same state (the patch back to the
  base), as a node applies every version into one state: with `apply(views=)`
  (where the tree has it) the int views the first apply made are kept.

Columns: seconds, and microseconds per tensor; the "bytes" row: the patch's
size (`Patch.to_bytes`), and bytes per tensor. With `--compare DIR`, the same
measurements also run in a subprocess with DIR's `.venv/bin/python` (a second
worktree of another commit with its own `make .venv/.installed`, so it
imports that commit's code), alternating with this one round by round, and
the table shows both side by side with the ratio.

    .venv/bin/python bench/many_tensors.py [--counts 1000,20000,140000] [--rounds 3]
        [--elements 64] [--compare /work/wt/other] [--threads N]
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

OPS = ("hash", "diff", "apply", "again")


def make_states(count: int, elements: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(count)
    flat = torch.randn(count * elements, generator=g).to(torch.bfloat16)
    # Separate tensors, each with its own storage (as a state built tensor by tensor is).
    base = {f"model.layers.{i % 61}.mlp.experts.{i // 61}.w": flat[i * elements:(i + 1) * elements].clone()
            for i in range(count)}
    target = dict(base)
    name = sorted(base)[count // 2]
    t = base[name].clone()
    t[elements // 2] = t[elements // 2] + 1
    target[name] = t
    return base, target


def measure(count: int, elements: int, threads: int | None) -> dict[str, float]:
    from patchswarm.protocol import patch, statehash

    base, target = make_states(count, elements)
    out = {}
    t0 = time.perf_counter()
    h = statehash.state_hash(base, threads)
    out["hash"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = patch.diff(base, target)
    out["diff"] = time.perf_counter() - t0
    out["bytes"] = len(p.to_bytes())
    assert p.base_hash == h
    state = {k: v.clone() for k, v in base.items()}
    # The node keeps one cache of int views for its state across versions, where the code has
    # `apply(views=)`; in a tree without it, every version's apply views every tensor again.
    kept = {"views": {}} if "views" in inspect.signature(patch.apply).parameters else {}
    t0 = time.perf_counter()
    patch.apply(state, p, threads=threads, **kept)
    out["apply"] = time.perf_counter() - t0
    assert all(torch.equal(state[k], target[k]) for k in target)
    back = patch.diff(target, base)
    t0 = time.perf_counter()
    patch.apply(state, back, threads=threads, **kept)
    out["again"] = time.perf_counter() - t0
    assert all(torch.equal(state[k], base[k]) for k in base)
    return out


def _child(args) -> None:
    print(json.dumps(measure(args.count, args.elements, args.threads)))


def _run_other(tree: Path, count: int, args) -> dict[str, float]:
    cmd = [str(tree / ".venv/bin/python"), __file__, "--child", "--count", str(count),
           "--elements", str(args.elements)] + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1000,20000,140000")
    ap.add_argument("--elements", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compare", type=Path, default=None, help="a worktree with its own .venv: its code runs too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    counts = [int(c) for c in args.counts.split(",")]
    here = Path(__file__).resolve().parent.parent
    trees = [("this", here)] + ([("other", args.compare.resolve())] if args.compare else [])
    best: dict[tuple[str, int], dict[str, float]] = {}
    for count in counts:
        for _ in range(args.rounds):
            # Each round in a fresh process per tree, the trees alternating: the same load on both.
            for label, tree in trees:
                r = _run_other(tree, count, args)
                prev = best.setdefault((label, count), r)
                for op in OPS + ("bytes",):
                    prev[op] = min(prev[op], r[op])
    head = f"{'tensors':>8}  {'op':>5}"
    for label, tree in trees:
        head += f"  {label + ' s':>9}  {label + ' us/t':>11}"
    if args.compare:
        head += f"  {'other/this':>10}"
    print(f"# {args.elements} bf16 elements per tensor; min of {args.rounds} rounds; trees: "
          + ", ".join(f"{label}={tree}" for label, tree in trees))
    print(head)
    for count in counts:
        for op in OPS:
            line = f"{count:>8,}  {op:>5}"
            for label, _ in trees:
                s = best[(label, count)][op]
                line += f"  {s:>9.3f}  {s / count * 1e6:>11.1f}"
            if args.compare:
                line += f"  {best[('other', count)][op] / best[('this', count)][op]:>10.2f}"
            print(line)
        line = f"{count:>8,}  {'bytes':>5}"
        for label, _ in trees:
            b = best[(label, count)]["bytes"]
            line += f"  {b:>9,}  {b / count:>11.1f}"
        if args.compare:
            line += f"  {best[('other', count)]['bytes'] / best[('this', count)]['bytes']:>10.2f}"
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
