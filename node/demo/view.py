"""The demo's live view: what the swarm and the learner are doing, for people.

Owns rendering only. It takes plain data, so it runs and is tested without a
swarm: node status dicts (as `NodeClient.status()` returns them; `spool` is
read as {"records", "bytes"} when present), the origin's stats dict (as
`SyncOrigin.stats()` returns it: `versions` is a list of {version,
patch_bytes, keyframe_bytes, full_bytes, ...}) and the reward curve (a list
of (step, reward) pairs). Must not talk to nodes or the origin itself.

On a terminal it is a rich Live panel redrawn in place; otherwise (a pipe, a
CI log) it prints one plain line per new fact: a version published, a node
at a new version, a training step.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"
SOURCES = ("origin", "same_region", "other_region")


def sparkline(values: Sequence[float], width: int = 48, lo: float | None = None, hi: float | None = None) -> str:
    """Block characters for the last `width` values, scaled to [lo, hi]
    (the values' own range when not given)."""
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = hi - lo
    if span <= 0:
        return SPARK[len(SPARK) // 2] * len(vals)
    top = len(SPARK) - 1
    return "".join(SPARK[min(top, max(0, round((v - lo) / span * top)))] for v in vals)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} GB"  # unreachable; keeps type checkers calm


def _spool(st: dict) -> tuple[int | None, int | None]:
    sp = st.get("spool")
    if isinstance(sp, dict):
        return sp.get("records"), sp.get("bytes")
    return None, None


def version_rows(origin_stats: dict) -> list[dict]:
    """The origin's per-version rows, oldest first, with `ratio` = full / sent
    bytes (the patch, or the keyframe for the first version)."""
    rows = []
    for v in origin_stats.get("versions", []):
        sent = v.get("patch_bytes") if v.get("patch_bytes") is not None else v.get("keyframe_bytes")
        full = v.get("full_bytes")
        rows.append({**v, "sent_bytes": sent, "ratio": (full / sent) if sent and full else None})
    return sorted(rows, key=lambda r: r["version"])


def nodes_table(nodes: Iterable[dict]) -> Table:
    t = Table(title="nodes", expand=False)
    for col, just in (("node", "left"), ("region", "left"), ("version", "right"), ("from origin", "right"),
                      ("same region", "right"), ("other region", "right"), ("spool", "right")):
        t.add_column(col, justify=just)
    for st in sorted(nodes, key=lambda s: (str(s.get("region")), str(s.get("node_id")))):
        bi = st.get("bytes_in") or {}
        recs, nbytes = _spool(st)
        t.add_row(str(st.get("node_id", "?"))[:16], str(st.get("region", "?")), "-" if st.get("version") is None else str(st["version"]),
                  *(human_bytes(bi.get(k)) for k in SOURCES),
                  "-" if recs is None else f"{recs} rec / {human_bytes(nbytes)}")
    return t


def versions_table(origin_stats: dict, last: int = 8) -> Table:
    """The first version (the keyframe every node starts from) and the `last` latest."""
    t = Table(title="versions (patch vs full bf16 checkpoint)", expand=False)
    for col in ("version", "sent", "full checkpoint", "full / sent", "changed"):
        t.add_column(col, justify="right")
    rows = version_rows(origin_stats)
    for r in rows[:1] + rows[max(1, len(rows) - last):]:
        kind = "patch" if r.get("patch_bytes") is not None else "keyframe"
        changed = r.get("changed")
        params = r.get("params")
        frac = f"{100 * changed / params:.1f} %" if changed is not None and params else "-"
        t.add_row(str(r["version"]), f"{human_bytes(r['sent_bytes'])} {kind}", human_bytes(r.get("full_bytes")),
                  "-" if r["ratio"] is None else f"{r['ratio']:.1f}x", frac)
    return t


def reward_text(rewards: Sequence[tuple[int, float]]) -> Text:
    if not rewards:
        return Text("reward: waiting for the first batch")
    vals = [r for _, r in rewards]
    return Text.assemble(("reward ", "bold"), sparkline(vals, lo=0.0, hi=1.0),
                         f"  step {rewards[-1][0]}: {vals[-1]:.3f} (first {vals[0]:.3f}, best {max(vals):.3f})")


def render(nodes: Sequence[dict], origin_stats: dict, rewards: Sequence[tuple[int, float]], title: str = "") -> Group:
    """The whole panel as one rich renderable."""
    parts = [Text(title, style="bold")] if title else []
    return Group(*parts, reward_text(rewards), versions_table(origin_stats), nodes_table(nodes))


@dataclasses.dataclass
class _Seen:
    versions: set = dataclasses.field(default_factory=set)
    node_versions: dict = dataclasses.field(default_factory=dict)
    steps: int = 0


class DemoView:
    """`with DemoView() as view: view.update(nodes, origin_stats, rewards)`.

    `live=None` picks by the console: a rich Live panel on a terminal, plain
    lines otherwise."""

    def __init__(self, console: Console | None = None, live: bool | None = None, title: str = "patchswarm demo"):
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else live
        self.title = title
        self._live: Live | None = None
        self._seen = _Seen()

    def __enter__(self) -> "DemoView":
        if self.live:
            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, nodes: Sequence[dict], origin_stats: dict, rewards: Sequence[tuple[int, float]],
               note: str = "") -> None:
        if self._live is not None:
            self._live.update(render(nodes, origin_stats, rewards, f"{self.title}  {note}".strip()))
            return
        for line in self.new_lines(nodes, origin_stats, rewards):
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def new_lines(self, nodes: Sequence[dict], origin_stats: dict, rewards: Sequence[tuple[int, float]]) -> list[str]:
        """Plain lines for what changed since the last call (the non-terminal form)."""
        out = []
        for r in version_rows(origin_stats):
            if r["version"] in self._seen.versions:
                continue
            self._seen.versions.add(r["version"])
            kind = "patch" if r.get("patch_bytes") is not None else "keyframe"
            ratio = "" if r["ratio"] is None else f" (1/{r['ratio']:.1f} of the checkpoint)"
            out.append(f"version {r['version']} published: {kind} {r['sent_bytes']:,} B, "
                       f"full bf16 checkpoint {r.get('full_bytes', 0):,} B{ratio}")
        for st in nodes:
            nid, v = st.get("node_id"), st.get("version")
            if v is None or self._seen.node_versions.get(nid) == v:
                continue
            self._seen.node_versions[nid] = v
            bi = st.get("bytes_in") or {}
            recs, _ = _spool(st)
            out.append(f"node {nid} ({st.get('region')}) at version {v}: bytes in "
                       + ", ".join(f"{k.replace('_', ' ')} {bi.get(k, 0):,}" for k in SOURCES)
                       + ("" if recs is None else f"; spool {recs} records"))
        for step, reward in list(rewards)[self._seen.steps:]:
            out.append(f"step {step}: reward {reward:.3f}")
        self._seen.steps = len(rewards)
        return out


def summary_table(nodes: Sequence[dict], origin_stats: dict, rewards: Sequence[tuple[int, float]]) -> Table:
    """The end-of-run table: learning, bytes per version, where each node's bytes came from."""
    rows = version_rows(origin_stats)
    patches = [r for r in rows if r.get("patch_bytes") is not None]
    t = Table(title="patchswarm demo: summary", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    if rewards:
        t.add_row("reward (first step → last step)", f"{rewards[0][1]:.3f} → {rewards[-1][1]:.3f}")
        t.add_row("training steps", str(len(rewards)))
    t.add_row("versions published", str(len(rows)))
    if patches:
        full = patches[-1].get("full_bytes") or 0
        sent = sum(r["patch_bytes"] for r in patches)
        t.add_row("full bf16 checkpoint", human_bytes(full))
        t.add_row("mean patch", f"{human_bytes(sent / len(patches))} (1/{full * len(patches) / sent:.1f})")
    total = {k: sum((st.get("bytes_in") or {}).get(k, 0) for st in nodes) for k in SOURCES}
    all_in = sum(total.values())
    for k in SOURCES:
        share = f" ({100 * total[k] / all_in:.0f} %)" if all_in else ""
        t.add_row(f"node bytes in from {k.replace('_', ' ')}", human_bytes(total[k]) + share)
    return t
