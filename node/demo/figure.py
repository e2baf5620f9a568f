"""The demo's figure: one PNG with three panels, drawn headless.

Owns `write_figure(path, rewards, origin_stats, nodes) -> Path`: reward over
training steps; bytes sent per version (patch, or keyframe for the first)
against the full bf16 checkpoint, log scale; bytes each node received by
source (origin / same region / other region), stacked. Inputs are the same
plain data as view.py takes. Must not talk to the swarm.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI boxes or over ssh

from matplotlib import pyplot as plt  # noqa: E402  (after the backend is chosen)

from .view import SOURCES, version_rows  # noqa: E402

SOURCE_COLORS = {"origin": "#d62728", "same_region": "#2ca02c", "other_region": "#1f77b4"}


def write_figure(path: str | os.PathLike, rewards: Sequence[tuple[int, float]], origin_stats: dict,
                 nodes: Sequence[dict]) -> Path:
    """Draw the three panels into `path` (PNG) and return it; written to a
    temporary name, then renamed, so a reader never sees half a file."""
    path = Path(path)
    fig, (ax_r, ax_v, ax_n) = plt.subplots(1, 3, figsize=(16, 4.6), dpi=100)
    try:
        _reward_panel(ax_r, rewards)
        _versions_panel(ax_v, origin_stats)
        _sources_panel(ax_n, nodes)
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path


def _reward_panel(ax, rewards: Sequence[tuple[int, float]]) -> None:
    ax.set_title("reward (fraction of ascending digit pairs)")
    ax.set_xlabel("training step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if rewards:
        ax.plot([s for s, _ in rewards], [r for _, r in rewards], marker="o", markersize=3)


def _versions_panel(ax, origin_stats: dict) -> None:
    rows = version_rows(origin_stats)
    ax.set_title("bytes per version vs full bf16 checkpoint")
    ax.set_xlabel("policy version")
    ax.set_ylabel("bytes (log)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    if not rows:
        return
    full = [(r["version"], r["full_bytes"]) for r in rows if r.get("full_bytes")]
    patches = [(r["version"], r["patch_bytes"]) for r in rows if r.get("patch_bytes")]
    keyframes = [(r["version"], r["keyframe_bytes"]) for r in rows
                 if r.get("patch_bytes") is None and r.get("keyframe_bytes")]
    if full:
        ax.plot(*zip(*full), color="black", linestyle="--", label="full bf16 checkpoint")
    if keyframes:
        ax.plot(*zip(*keyframes), "s", color="#ff7f0e", label="keyframe")
    if patches:
        ratios = sorted(r["ratio"] for r in rows if r.get("patch_bytes") and r["ratio"])
        note = f" (median 1/{ratios[len(ratios) // 2]:.0f} of the checkpoint)" if ratios else ""
        ax.plot(*zip(*patches), "o-", markersize=3, color="#1f77b4", label="patch" + note)
    sizes = [b for _, b in full + patches + keyframes]
    if sizes:
        ax.set_ylim(min(sizes) / 4, max(sizes) * 3)
    ax.legend(loc="upper right", fontsize=8)


def _sources_panel(ax, nodes: Sequence[dict]) -> None:
    ax.set_title("bytes received by each node, by source")
    ax.set_ylabel("bytes")
    ax.grid(alpha=0.3, axis="y")
    if not nodes:
        ax.text(0.5, 0.5, "no node data", ha="center", va="center", transform=ax.transAxes)
        return
    nodes = sorted(nodes, key=lambda s: (str(s.get("region")), str(s.get("node_id"))))
    labels = [f"{str(s.get('node_id', '?'))[:8]}\n{s.get('region', '?')}" for s in nodes]
    bottom = [0.0] * len(nodes)
    for k in SOURCES:
        vals = [float((s.get("bytes_in") or {}).get(k, 0)) for s in nodes]
        ax.bar(range(len(nodes)), vals, bottom=bottom, color=SOURCE_COLORS[k], label=k.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(nodes)), labels, fontsize=8)
    ax.legend(fontsize=8)
