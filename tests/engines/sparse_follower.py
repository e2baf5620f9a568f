"""An engine that keeps a torch model in memory and follows a node by sparse changes, for tests.

    python tests/engines/sparse_follower.py --socket S --until V --out F [--size small] [--deadline 300]

Builds the synthetic transformer (tests/synthetic.py) in bf16, takes its
parameters as the tensors to follow (`model.state_dict()` shares their
memory), bootstraps once from the node's weights file, then for each new
version calls `NodeClient.follow`, which writes the changes into the
parameters in place. Stops at version V and writes one JSON object to F: the
versions it went through, how many bootstraps, the state hash of the model's
parameters (computed here), whether every parameter kept its storage, and a
forward pass's finiteness.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for synthetic
from synthetic import ModelSpec, TinyLM  # noqa: E402

from patchswarm.node.client import NodeClient, NodeError, NodeUnavailable  # noqa: E402
from patchswarm.protocol.statehash import state_hash  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="small")
    ap.add_argument("--deadline", type=float, default=300.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = TinyLM(ModelSpec.of_size(args.size)).to(torch.bfloat16)
    tensors = dict(model.state_dict())
    storage = {k: v.data_ptr() for k, v in tensors.items()}
    t_end = time.monotonic() + args.deadline
    seen, handoff_s = [], []
    with NodeClient(args.socket) as c:
        at = None
        while at is None or at[0] < args.until:
            if time.monotonic() > t_end:
                print(f"follower: deadline at {at}", file=sys.stderr)
                return 1
            if at is not None:
                try:
                    c.wait_version(at[0] + 1, 5.0)
                except NodeError as e:
                    if e.code == "timeout":
                        continue
                    raise
            t0 = time.perf_counter()
            at = c.follow(tensors, *(at or (None,)))
            handoff_s.append(time.perf_counter() - t0)
            seen.append(at[0])
            print(f"follower: at version {at[0]} in {handoff_s[-1]:.3f} s", file=sys.stderr, flush=True)
        with torch.no_grad():
            logits = model(torch.zeros(1, 4, dtype=torch.long))
        params = dict(model.state_dict())
        result = {"versions": seen, "bootstraps": c.bootstraps, "version": at[0], "node_hash": at[1],
                  "model_hash": state_hash(params), "in_place": all(params[k].data_ptr() == p for k, p in storage.items())
                  and set(params) == set(tensors), "finite": bool(torch.isfinite(logits).all()), "handoff_s": handoff_s}
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NodeUnavailable as e:
        print(f"follower: {e}", file=sys.stderr)
        sys.exit(1)
