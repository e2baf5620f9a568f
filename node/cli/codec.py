"""`patchswarm diff | apply | inspect`: the offline codec on checkpoint files.

Owns what people see of it (one summary line, a rich table, progress bars only
on a terminal). Must not hold codec logic (protocol/) or file-format logic
(node/checkpoint.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Iterator

from patchswarm.node.cli import command
from patchswarm.protocol.errors import BaseMismatch

EMPTY_BASE = "-"


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None] | None]:
    """A `progress(done, total)` callable drawing a rich bar on stderr, or None when stderr is not a TTY."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _read_patch(path: str):
    from patchswarm.protocol.patch import Patch

    data = Path(path).read_bytes()
    return Patch.from_bytes(data), len(data)


def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", metavar="BASE", help=f"base checkpoint (.safetensors or shard directory); {EMPTY_BASE!r} for a keyframe")
    p.add_argument("target", metavar="TARGET", help="target checkpoint (.safetensors or shard directory)")
    p.add_argument("-o", "--output", metavar="PATCH", required=True, help="patch file to write")


@command("diff", "write the patch that turns BASE into TARGET", _diff_args)
def cmd_diff(args: argparse.Namespace) -> int:
    from patchswarm.node.checkpoint import load_state, write_bytes_atomic
    from patchswarm.protocol.patch import diff, keyframe

    target, layout = load_state(args.target)
    with progress_bar("diff") as progress:
        if args.base == EMPTY_BASE:
            patch = keyframe(target, layout=layout, progress=progress)
        else:
            base, _ = load_state(args.base)
            patch = diff(base, target, layout=layout, progress=progress)
        data = patch.to_bytes()
    s = patch.stats()
    write_bytes_atomic(args.output, data)
    full = _state_bytes(target)
    pct = 100.0 * s["changed"] / s["params"] if s["params"] else 0.0
    if not data or not full:
        ratio = "n/a"
    elif len(data) <= full:
        ratio = f"{full / len(data):.1f}x smaller"
    else:  # a tiny or wholly new target: the table and hashes outweigh the tensors
        ratio = f"{len(data) / full:.1f}x larger"
    print(f"{args.output}: {patch.kind}, {s['changed']:,} of {s['params']:,} params changed ({pct:.3f}%), "
          f"{len(data):,} bytes, {ratio} than target ({full:,} bytes)")
    return 0


def _apply_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", metavar="BASE", help=f"base checkpoint; {EMPTY_BASE!r} (empty) for a keyframe")
    p.add_argument("patch", metavar="PATCH", help="patch file")
    p.add_argument("-o", "--output", metavar="OUT", required=True,
                   help="checkpoint to write: a .safetensors file, or a directory when the patch has a shard layout")


@command("apply", "apply PATCH to BASE and write the result to OUT", _apply_args)
def cmd_apply(args: argparse.Namespace) -> int:
    from patchswarm.node.checkpoint import check_destination, load_state, save_state
    from patchswarm.protocol.patch import apply
    from patchswarm.protocol.statehash import state_hash

    state = {} if args.base == EMPTY_BASE else load_state(args.base)[0]
    patch, _ = _read_patch(args.patch)
    check_destination(args.output, patch.layout)
    if patch.base_hash is not None:
        found = state_hash(state)
        if found != patch.base_hash:
            raise BaseMismatch(f"wrong base: patch expects state hash {patch.base_hash}, BASE has {found}")
    with progress_bar("apply") as progress:
        apply(state, patch, progress=progress)
    save_state(state, args.output, patch.layout)
    shape = "directory" if patch.layout is not None else "file"
    print(f"{args.output}: wrote {len(state)} tensors ({_state_bytes(state):,} bytes, {shape}), state hash {patch.target_hash}")
    return 0


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("patch", metavar="PATCH", help="patch file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


@command("inspect", "describe a patch file", _inspect_args)
def cmd_inspect(args: argparse.Namespace) -> int:
    patch, size = _read_patch(args.patch)
    s = patch.stats()
    info = {
        "kind": patch.kind,
        "base_hash": patch.base_hash,
        "target_hash": patch.target_hash,
        "tensors": s["tensors"],
        "params": s["params"],
        "changed": s["changed"],
        "bytes": size,
        "position_bytes": s["position_bytes"],
        "value_bytes": s["value_bytes"],
        "full_bytes": s["full_bytes"],
        "chunks": s["chunks"],
        "full_tensors": len(patch.full),
        "removed_tensors": len(patch.removed),
        "shards": None if patch.layout is None else len(set(patch.layout.values())),
    }
    if args.json:
        print(json.dumps(info))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=args.patch, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", justify="right", overflow="fold")
    for key, value in info.items():
        if isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        table.add_row(key, "-" if value is None else str(value))
    if s["params"]:
        table.add_row("changed %", f"{100.0 * s['changed'] / s['params']:.3f}")
    Console().print(table)
    return 0
