"""Late joiners: what they take from the origin, in waves after a keyframe no running node fetched.

    .venv/bin/python bench/late_joiners.py [--joiners 4] [--upload-limit 4M] [--mib 48] [--modes keep,no-keep]

Per mode (`keep`: nodes as they start by default; `no-keep`: every node with
--no-keep-keyframe, as before 2026-12-07): a tracker, an origin (`--upload-limit`, 64 KiB
chunks) and two nodes of region r0 running from version 0. Versions (`states`): random
bf16 weights, half their elements drawn again at version 1 and the other half at 2 (each
patch cheaper than a keyframe, the two together dearer: version 2 comes with a keyframe,
which the running nodes skip for its patch), then sparse steps. Wave 1: `--joiners` nodes
of region r1 start together at version 3 and catch up
through keyframe 2. Five versions later (past every node's 4-version window), wave 2: as
many nodes of region r2 start together. Per wave: the bytes each joiner needs (the keyframe
and the patches after it, all joiners together), what the origin sent them (a multiple of
one joiner's need: 1.00 is each byte once), what came from nodes, and the time from the
wave's start to its last node at the latest version, process starts included. Loopback:
only the origin's uplink is limited.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from swarmlab import SwarmLab, load_weights, same_bits, write_checkpoint  # noqa: E402

KEYFRAME_AT = 2
WAVE1_AT = 3
WAVE2_AT = 8  # five versions after wave 1: past the joiners' and the running nodes' window of 4


def states(mib: float) -> list[dict[str, torch.Tensor]]:
    """Served bf16 versions of about `mib` MiB: random weights (0.02 scale), half of every
    tensor's elements drawn again at version 1 and the other half at 2, then 0.75 % of the
    elements moved 1-2 ulp per version (the change rate of tests/synthetic.py's scaled
    versions)."""
    g = torch.Generator().manual_seed(11)
    rows = max(1, round(mib * (1 << 20) / (4096 * 2 * 4)))
    state = {f"layers.{i}.weight": (torch.randn(rows, 4096, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)}
    out = [{k: t.clone() for k, t in state.items()}]
    halves = {k: torch.rand(t.shape, generator=g) < 0.5 for k, t in state.items()}
    for v in range(1, WAVE2_AT + 1):
        for k, t in state.items():
            if v <= KEYFRAME_AT:
                fresh = (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
                pick = halves[k] if v == 1 else ~halves[k]
                t[pick] = fresh[pick]
            else:
                flat = t.view(torch.int16).view(-1)
                pos = torch.randint(0, flat.numel(), (int(flat.numel() * 0.0075),), generator=g).unique()
                flat[pos] += torch.randint(1, 3, (len(pos),), generator=g, dtype=torch.int16)
        out.append({k: t.clone() for k, t in state.items()})
    return out


def published(origin, version: int) -> dict[str, int]:
    """The objects the origin's log says it published at `version`: kind -> bytes."""
    m = re.search(rf"published version {version} \(([^;]+);", origin.text())
    assert m, origin.text()[-2000:]
    return {kind: int(size.replace(",", "")) for kind, size in re.findall(r"(patch|keyframe) ([\d,]+) B", m.group(1))}


def wave(lab: SwarmLab, region: str, n: int, version: int, extra: list[str], expect) -> tuple[list, float]:
    t0 = time.monotonic()
    nodes = lab.start_nodes([(f"{region}j{i}", region) for i in range(n)], extra=extra)
    statuses = lab.wait_version(nodes, version, timeout=600)
    elapsed = time.monotonic() - t0
    for p in nodes:
        assert same_bits(load_weights(p), expect), f"{p.name} differs from version {version}"
        assert re.search(rf"applied version {KEYFRAME_AT} \(keyframe", p.text()), f"{p.name} skipped the keyframe"
    return statuses, elapsed


def one_mode(root: Path, mode: str, joiners: int, upload_limit: str, mib: float) -> list[dict]:
    extra = ["--no-keep-keyframe"] if mode == "no-keep" else []
    all_states = states(mib)
    watch = root / "watch"
    rows = []
    with SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, wait=False,
                                  extra=["--chunk-bytes", "65536", "--upload-limit", upload_limit])
        running = lab.start_nodes([("r0n0", "r0"), ("r0n1", "r0")], starting=[origin], extra=extra)

        def publish_to(version: int, nodes: list) -> None:
            for v in range(len(published_versions), version + 1):
                write_checkpoint(watch, f"step{v:04d}.safetensors", all_states[v])
                lab.wait_version(nodes, v, timeout=300)
                published_versions.append(published(origin, v))

        published_versions: list[dict[str, int]] = []
        publish_to(WAVE1_AT, running)
        assert "keyframe" in published_versions[KEYFRAME_AT], published_versions
        assert all(re.search(rf"applied version {KEYFRAME_AT} \(patch", p.text()) for p in running)
        members = list(running)
        for region, at in (("r1", WAVE1_AT), ("r2", WAVE2_AT)):
            publish_to(at, members)
            need = published_versions[KEYFRAME_AT]["keyframe"] + sum(
                published_versions[v]["patch"] for v in range(KEYFRAME_AT + 1, at + 1))
            statuses, elapsed = wave(lab, region, joiners, at, extra, all_states[at])
            from_origin = sum(s["bytes_in"]["origin"] for s in statuses)
            from_nodes = sum(s["bytes_in"]["same_region"] + s["bytes_in"]["other_region"] for s in statuses)
            rows.append({"mode": mode, "wave": f"{region} at v{at}", "need": need, "from_origin": from_origin,
                         "from_nodes": from_nodes, "elapsed": elapsed,
                         "kept": sum(s["kept_keyframe"] == KEYFRAME_AT for s in statuses)})
            print(f"  {mode}, {region}: origin {from_origin / need:.2f}x, nodes {from_nodes / need:.2f}x, "
                  f"{elapsed:.1f} s", file=sys.stderr, flush=True)
            members += [p for p in lab.procs if p.name.startswith(region)]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--joiners", type=int, default=4, help="nodes per wave (default 4)")
    ap.add_argument("--upload-limit", default="4M", help="the origin's --upload-limit (default 4M: bytes/s)")
    ap.add_argument("--modes", default="keep,no-keep", help="comma-separated: keep, no-keep")
    ap.add_argument("--mib", type=float, default=48.0,
                    help="the served state's size (default 48 MiB: ~50 keyframe chunks)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or any(m not in ("keep", "no-keep") for m in modes) or args.joiners < 1:
        ap.error("--modes: expected keep and/or no-keep; --joiners: at least 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psw-joiners-") as tmp:
        for mode in modes:
            rows += one_mode(Path(tmp) / mode, mode, args.joiners, args.upload_limit, args.mib)
    print(f"\n{args.joiners} joiners a wave, a {args.mib:g} MiB bf16 state, keyframe at v{KEYFRAME_AT}, "
          f"origin --upload-limit {args.upload_limit}; need: keyframe + patches after it, per joiner\n")
    print("| mode | wave | need per joiner B | from the origin (x need) | from nodes (x need) | "
          "joiners keeping the keyframe | wave's time s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        origin, nodes = r["from_origin"], r["from_nodes"]
        print(f"| {r['mode']} | {r['wave']} | {r['need']:,} | {origin:,} ({origin / r['need']:.2f}) | "
              f"{nodes:,} ({nodes / r['need']:.2f}) | {r['kept']} | {r['elapsed']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
