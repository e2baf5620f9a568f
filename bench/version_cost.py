"""What one version costs at both ends, and how each cost grows with the model (issue 19).

For each served size (GiB of bf16, a Llama-shaped Hugging Face shard directory
written by this script), one run of real processes on loopback: a tracker, an
origin with `--watch`, and `--nodes` nodes. Version 0 is the keyframe the
nodes bootstrap from; each later version changes `--changed` of the bf16
elements (an fp32 update of the chosen elements, rounded to bf16, so each
changes its bits), or `--dense` of them in the dense variant. Per version:

- compare: a `torch.ne` over the two versions' bit views in this process,
  the floor any diff pays, measured in the same run as the yardstick;
- origin publish: the origin's own time for read, cast, compare, encode
  and persist (its log line), and its disk writes (/proc/PID/io);
- node fetch (announced -> all chunks held) and apply (decode, write, state
  hash, persist: the node's `applied` record), and its disk writes;
- publish -> applied on every node (the checkpoint renamed into the watched
  folder -> the last node's applied time, one clock);
- RSS: each process's VmRSS after the versions and VmHWM (its peak);
- with `--handoff`, one more node keeps a model directory and tells a
  command engine (`--on-version true`) of each version: the directory's
  write time and bytes, and publish -> engine told (issue 20's directory
  hand-off).

Prints one table per size, then each column's growth from the smallest to
the largest size as a log-log slope (1.0: linear in the model; 0: flat) and
the targets as ratios from the same run. A size costs about 1x its bytes
of memory in this process (plus its largest tensor) and 1x in each member;
check `free -g` first.

    .venv/bin/python bench/version_cost.py [--sizes 0.5,1,2] [--versions 4] [--nodes 2]
        [--changed 0.0066] [--dense 0.3] [--handoff] [--work DIR] [--json FILE]
    .venv/bin/python bench/version_cost.py --from-json FILE   # the report of a saved run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from patchswarm.node.checkpoint import save_state
from patchswarm.node.client import NodeClient
from patchswarm.node.net import trust

LISTENING = re.compile(r"listening on ([^\s,;\"]+)")
PUBLISHED = re.compile(r"published version (\d+) \((.*?)\) in ([\d.]+) s")
HIDDEN, FFN, VOCAB = 4096, 11008, 32000  # Llama-7B's shapes
TIMEOUT_S = 900.0


# ------------------------------------------------------------------ checkpoints


def llama_shaped(gib: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """bf16 tensors of Llama-7B's shapes summing to about `gib` GiB (embedding and head
    first, then as many layers as fit, at least one), with an HF shard layout."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    budget = int(gib * 2**30) // 2  # elements
    state = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN),
             "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
    left = budget - 2 * VOCAB * HIDDEN
    layers = max(1, round(left / per_layer))
    if left < per_layer // 2:  # too small for the embeddings: scale them down instead
        state = {"model.embed_tokens.weight": w(budget // (2 * HIDDEN), HIDDEN),
                 "lm_head.weight": w(budget // (2 * HIDDEN), HIDDEN),
                 "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
        layers = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{n}.weight"] = w(HIDDEN, HIDDEN)
        state[p + "mlp.gate_proj.weight"] = w(FFN, HIDDEN)
        state[p + "mlp.up_proj.weight"] = w(FFN, HIDDEN)
        state[p + "mlp.down_proj.weight"] = w(HIDDEN, FFN)
        state[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        state[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    # Shards of about 1 GiB, in name order, as HF writes them.
    layout, shard, filled = {}, 1, 0
    for name in sorted(state):
        n = state[name].numel() * 2
        if filled and filled + n > 2**30:
            shard, filled = shard + 1, 0
        layout[name] = shard
        filled += n
    total = shard
    return state, {n: f"model-{s:05d}-of-{total:05d}.safetensors" for n, s in layout.items()}


def step(state: dict[str, torch.Tensor], fraction: float, g: torch.Generator) -> tuple[int, float]:
    """Change about `fraction` of the elements in place as an fp32 update rounded to bf16
    would: the chosen elements move by ~3 % (several bf16 ulps), the rest stay. Returns
    the number of elements whose bits changed, and the yardstick: the time of a torch.ne
    over both versions' bit views, tensor by tensor (best of 2 each), so this process
    holds one tensor's previous version at a time, not a second state."""
    changed, compare = 0, 0.0
    for t in state.values():
        before = t.clone()
        flat = t.view(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randint(0, flat.numel(), (k,), generator=g)
        old = flat[idx].view(torch.int16)
        upd = flat[idx].float() * (1 + 0.03 * torch.randn(k, generator=g)) + 1e-4 * torch.randn(k, generator=g)
        flat[idx] = upd.to(torch.bfloat16)
        changed += int((flat[idx].view(torch.int16) != old).sum())
        best = math.inf
        for _ in range(2):
            t0 = time.perf_counter()
            torch.ne(before.view(torch.int16), t.view(torch.int16)).sum()
            best = min(best, time.perf_counter() - t0)
        compare += best
        del before
    return changed, compare


# ------------------------------------------------------------------ processes


class Member:
    def __init__(self, name: str, args: list, work: Path):
        self.name, self.log = name, work / f"{name}.log"
        self.data = work / name
        f = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "patchswarm.node.cli", *map(str, args)],
                                     stdout=f, stderr=subprocess.STDOUT)
        f.close()

    def wait_listening(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = LISTENING.search(self.log.read_text(errors="replace"))
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise SystemExit(f"{self.name} did not start")

    def io_written(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
        return 0

    def mem(self) -> tuple[int, int]:
        rss = hwm = 0
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
        return rss, hwm

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def run_size(gib: float, args, work: Path) -> dict:
    work.mkdir(parents=True)
    swarm = work / "swarm"
    trust.init_swarm(swarm)
    names = ["tracker", "origin"] + [f"n{i}" for i in range(args.nodes)] + (["h"] if args.handoff else [])
    for n in names:
        trust.issue(swarm, n, "tracker" if n == "tracker" else "origin" if n == "origin" else "node", work / "creds" / n)
    watch = work / "watch"
    watch.mkdir()
    state, layout = llama_shaped(gib)
    state_bytes = sum(t.numel() * 2 for t in state.values())
    members = []
    try:
        tracker = Member("tracker", ["tracker", "--creds", work / "creds/tracker", "--listen", "127.0.0.1:0"], work)
        members.append(tracker)
        taddr = tracker.wait_listening()
        origin = Member("origin", ["origin", "--tracker", taddr, "--creds", work / "creds/origin", "--key",
                                   swarm / "trainer.key", "--data-dir", work / "origin", "--watch", watch,
                                   "--served", "as-is", "--region", "r0"], work)
        members.append(origin)
        origin.wait_listening()
        nodes = []
        for i in range(args.nodes):
            n = Member(f"n{i}", ["node", "--tracker", taddr, "--creds", work / f"creds/n{i}", "--data-dir",
                                 work / f"n{i}", "--region", "r1"], work)
            members.append(n)
            nodes.append(n)
        handoff = None
        if args.handoff:  # the directory hand-off, with an engine that answers at once
            handoff = Member("h", ["node", "--tracker", taddr, "--creds", work / "creds/h", "--data-dir", work / "h",
                                   "--region", "r1", "--on-version", "true"], work)
            members.append(handoff)
        for n in nodes + ([handoff] if handoff else []):
            n.wait_listening()
        g = torch.Generator().manual_seed(1)
        rows = []
        for v in range(args.versions + 1):
            dense = args.dense if (args.dense and v == args.versions) else None
            changed, cmp_s = step(state, dense or args.changed, g) if v > 0 else (0, None)
            before = {m.name: m.io_written() for m in members}
            tmp = watch / f".v{v:04d}.partial"
            save_state(state, tmp, layout)
            (watch / f".v{v:04d}.partial").rename(watch / f"v{v:04d}")
            t_publish = time.time()
            for n in nodes:
                with NodeClient(n.data / "node.sock", connect_timeout=30) as c:
                    c.wait_version(v, TIMEOUT_S)
            statuses = []
            for n in nodes:
                with NodeClient(n.data / "node.sock") as c:
                    statuses.append(c.status())
            if handoff is not None:
                with NodeClient(handoff.data / "node.sock", connect_timeout=30) as c:
                    c.wait_version(v, TIMEOUT_S)
                    deadline = time.monotonic() + TIMEOUT_S
                    while (hs := c.status())["engine"]["version"] != v and time.monotonic() < deadline:
                        time.sleep(0.05)
            recs = [next((a for a in s["applied"] if a["version"] == v), None) for s in statuses]
            if None in recs:
                raise SystemExit(f"version {v}: a node has no applied record for it: "
                                 f"{[(s['version'], [a['version'] for a in s['applied']]) for s in statuses]}")
            text = origin.log.read_text(errors="replace")
            pub = [m for m in PUBLISHED.finditer(text) if int(m.group(1)) == v]
            patch_b = re.search(r"patch ([\d,]+) B", pub[-1].group(2)) if pub else None
            kf_b = re.search(r"keyframe ([\d,]+) B", pub[-1].group(2)) if pub else None
            after = {m.name: m.io_written() for m in members}
            node_w = max(after[n.name] - before[n.name] for n in nodes)
            rows.append({
                "version": v, "kind": "keyframe" if v == 0 else ("dense" if dense else "patch"),
                "changed": changed,
                "patch_B": int((patch_b or kf_b).group(1).replace(",", "")) if (patch_b or kf_b) else None,
                "compare_s": cmp_s,
                "origin_publish_s": float(pub[-1].group(3)) if pub else None,
                "origin_written_B": after["origin"] - before["origin"],
                "node_fetch_s": max(r.get("complete_at", r["applied_at"]) - r.get("announced_at", r["applied_at"])
                                    for r in recs),
                "node_apply_s": max(r["apply_s"] for r in recs),
                "node_written_B": node_w,
                "publish_to_applied_s": max(r["applied_at"] for r in recs) - t_publish,
            })
            if handoff is not None:
                rows[-1].update({"dir_write_s": hs["model_dir_write_s"],
                                 "dir_written_B": after["h"] - before["h"],
                                 "publish_to_engine_s": time.time() - t_publish if hs["engine"]["version"] == v
                                 else None})
            for old in sorted(watch.iterdir())[:-1]:  # keep the disk to two checkpoints
                shutil.rmtree(old, ignore_errors=True)
            print(f"  {gib:g} GiB v{v}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        mem = {m.name: m.mem() for m in members}
        return {"gib": gib, "state_bytes": state_bytes, "rows": rows,
                "node_rss": max(mem[n.name][0] for n in nodes), "node_hwm": max(mem[n.name][1] for n in nodes),
                "origin_rss": mem["origin"][0], "origin_hwm": mem["origin"][1]}
    finally:
        for m in reversed(members):
            m.stop()
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ report


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summary(res: dict) -> dict:
    patches = [r for r in res["rows"] if r["kind"] == "patch"]
    s = {k: _mean([r.get(k) for r in patches]) for k in
         ("patch_B", "compare_s", "origin_publish_s", "origin_written_B", "node_fetch_s", "node_apply_s",
          "node_written_B", "publish_to_applied_s", "dir_write_s", "dir_written_B", "publish_to_engine_s")}
    s.update({"state_GB": res["state_bytes"] / 1e9, "node_rss_x": res["node_rss"] / res["state_bytes"],
              "node_peak_x": res["node_hwm"] / res["state_bytes"],
              "origin_rss_x": res["origin_rss"] / res["state_bytes"],
              "origin_peak_x": res["origin_hwm"] / res["state_bytes"]})
    kf = res["rows"][0]
    s.update({"keyframe_publish_s": kf["origin_publish_s"], "keyframe_apply_s": kf["node_apply_s"]})
    dense = [r for r in res["rows"] if r["kind"] == "dense"]
    if dense:
        s.update({"dense_patch_B": dense[0]["patch_B"], "dense_apply_s": dense[0]["node_apply_s"],
                  "dense_compare_s": dense[0]["compare_s"]})
    return s


COLUMNS = [("state_GB", "state GB", "{:.2f}"), ("patch_B", "patch MB", "{:.2f}", 1e-6),
           ("compare_s", "cmp s", "{:.2f}"), ("origin_publish_s", "orig pub s", "{:.2f}"),
           ("origin_written_B", "orig wr MB", "{:.1f}", 1e-6), ("node_fetch_s", "fetch s", "{:.2f}"),
           ("node_apply_s", "apply s", "{:.2f}"), ("node_written_B", "node wr MB", "{:.1f}", 1e-6),
           ("publish_to_applied_s", "pub->all s", "{:.2f}"), ("node_peak_x", "node peak/state", "{:.2f}"),
           ("origin_rss_x", "orig rss/state", "{:.2f}"), ("origin_peak_x", "orig peak/state", "{:.2f}"),
           ("keyframe_publish_s", "kf pub s", "{:.1f}"), ("keyframe_apply_s", "kf apply s", "{:.1f}"),
           ("dir_write_s", "dir write s", "{:.2f}"), ("dir_written_B", "dir wr MB", "{:.0f}", 1e-6),
           ("publish_to_engine_s", "pub->engine s", "{:.2f}")]


def report(results: list[dict]) -> None:
    sums = [summary(r) for r in results]
    head = [c[1] for c in COLUMNS]
    print(" | ".join(head))
    for s in sums:
        cells = []
        for c in COLUMNS:
            v = s.get(c[0])
            cells.append("-" if v is None else c[2].format(v * (c[3] if len(c) > 3 else 1)))
        print(" | ".join(cells))
    if len(sums) > 1:
        a, b = sums[0], sums[-1]
        x = math.log(b["state_GB"] / a["state_GB"])
        print(f"\ngrowth from {a['state_GB']:.2f} to {b['state_GB']:.2f} GB (log-log slope; 1 = linear in the model):")
        for c in COLUMNS[1:]:
            if a.get(c[0]) and b.get(c[0]) and a[c[0]] > 0 and b[c[0]] > 0:
                print(f"  {c[1]:>16}: {math.log(b[c[0]] / a[c[0]]) / x:+.2f}")
    print("\ntargets (patch versions, mean; ratios within one run):")
    for s in sums:
        node_work = s["node_apply_s"] / s["compare_s"]
        written = s["node_written_B"] / s["patch_B"]
        pub = s["publish_to_applied_s"] / (3 * s["compare_s"] + s["node_fetch_s"])
        print(f"  {s['state_GB']:.2f} GB: node apply+verify+persist = {node_work:.1f}x compare (target <= 2); "
              f"node disk writes = {written:.1f}x patch (<= 2); publish->all applied = {pub:.2f}x "
              f"(3 x compare + fetch) (<= 1); node peak {s['node_peak_x']:.2f}x state (<= 1.25); "
              f"origin RSS {s['origin_rss_x']:.2f}x state (<= 1.3 beyond the caller's tensors: none here)")
        if s.get("publish_to_engine_s") is not None:
            bound = 1.5 * s["publish_to_applied_s"] + (s["dir_write_s"] or 0)
            print(f"           directory hand-off: publish->engine {s['publish_to_engine_s']:.2f} s = "
                  f"{s['publish_to_engine_s'] / bound:.2f}x (1.5 x publish->applied + one write of the state) "
                  f"(<= 1); {s['dir_written_B'] / 1e6:.0f} MB written per version")
        if "dense_patch_B" in s:
            print(f"           dense variant: patch {s['dense_patch_B'] / 1e6:.1f} MB, apply {s['dense_apply_s']:.2f} s, "
                  f"compare {s['dense_compare_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5,1,2", help="served sizes in GiB, comma-separated")
    ap.add_argument("--versions", type=int, default=4, help="patch versions after the keyframe")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--changed", type=float, default=0.0066, help="fraction of elements changed per version")
    ap.add_argument("--dense", type=float, default=0.0,
                    help="if > 0, the last version changes this fraction instead (the dense variant)")
    ap.add_argument("--handoff", action="store_true",
                    help="one more node with the directory hand-off (--on-version true: an engine that answers "
                         "at once): its write time, bytes and publish->engine")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None,
                    help="also write every size's measurements here as each size finishes")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="print the report of an earlier run's --json file instead of running")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(saved["header"])
        report(saved["results"])
        return
    root = Path(args.work or tempfile.mkdtemp(prefix="version-cost-"))
    results = []
    header = (f"{args.nodes} nodes, {args.versions} patch versions of {args.changed:.2%} changed"
              + (f", dense variant {args.dense:.0%}" if args.dense else ""))
    for gib in [float(x) for x in args.sizes.split(",")]:
        print(f"size {gib:g} GiB ...", file=sys.stderr, flush=True)
        results.append(run_size(gib, args, root / f"{gib:g}GiB"))
        if args.json:  # a long run's measurements survive whatever happens after them
            args.json.write_text(json.dumps({"header": f"{time.strftime('%Y-%m-%d %H:%M')}  {header}",
                                             "results": results}))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores; "
          f"{header}")
    report(results)


if __name__ == "__main__":
    main()
