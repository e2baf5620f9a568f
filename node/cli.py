"""The `patchswarm` command line: one function per subcommand, registered in `COMMANDS`.

Owns argument parsing, what people see (one summary line, a rich table,
progress bars only on a terminal) and exit codes: 0 ok, 1 for any deliberate
patchswarm error or OS error (one line `patchswarm: <message>` on stderr, no
traceback), 2 for usage errors from argparse. Must not hold codec logic
(protocol/) or file-format logic (node/checkpoint.py).

Adding a subcommand: write `def _x_args(p)` that adds its arguments and
`@command("x", "help", _x_args) def cmd_x(args) -> int`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Iterator

from protocol.errors import BaseMismatch, PatchswarmError, UsageError

PROG = "patchswarm"
EMPTY_BASE = "-"


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register the decorated `run(args) -> int` as subcommand `name`."""

    def register(run: Callable[[argparse.Namespace], int]):
        if name in COMMANDS:
            raise UsageError(f"subcommand {name!r}: registered twice")
        COMMANDS[name] = Command(name, help, configure, run)
        return run

    return register


# ------------------------------------------------------------------ helpers


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
    from protocol.patch import Patch

    data = Path(path).read_bytes()
    return Patch.from_bytes(data), len(data)


# ------------------------------------------------------------------ commands


def _diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", metavar="BASE", help=f"base checkpoint (.safetensors or shard directory); {EMPTY_BASE!r} for a keyframe")
    p.add_argument("target", metavar="TARGET", help="target checkpoint (.safetensors or shard directory)")
    p.add_argument("-o", "--output", metavar="PATCH", required=True, help="patch file to write")


@command("diff", "write the patch that turns BASE into TARGET", _diff_args)
def cmd_diff(args: argparse.Namespace) -> int:
    from node.checkpoint import load_state, write_bytes_atomic
    from protocol.patch import diff, keyframe

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
    ratio = f"{full / len(data):.1f}x smaller" if data else "n/a"
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
    from node.checkpoint import check_destination, load_state, save_state
    from protocol.patch import apply
    from protocol.statehash import state_hash

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


def _demo_args(p: argparse.ArgumentParser) -> None:
    from node.demo.run import add_arguments

    add_arguments(p)


@command("demo", "train a small policy with RL across a local multi-region swarm: tracker, 6 nodes, workers", _demo_args)
def cmd_demo(args: argparse.Namespace) -> int:
    from node.demo.run import run

    return run(args)


def _swarm_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="swarm_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="create a swarm: trainer key and CA", description="create a swarm: trainer key and CA")
    init.add_argument("dir", metavar="DIR", help="swarm directory to create (refuses to overwrite keys)")
    iss = sub.add_parser("issue", help="issue a member certificate signed by the swarm CA",
                         description="issue a member certificate signed by the swarm CA")
    iss.add_argument("dir", metavar="DIR", help="swarm directory (from `swarm init`)")
    iss.add_argument("name", metavar="NAME", help="member name (DNS name, certificate CN)")
    iss.add_argument("--role", required=True, choices=["tracker", "origin", "node"], help="member role")
    iss.add_argument("-o", "--output", metavar="OUT", required=True, help="credentials directory to write")


@command("swarm", "manage swarm trust: `swarm init DIR`, `swarm issue DIR NAME --role R -o OUT`", _swarm_args)
def cmd_swarm(args: argparse.Namespace) -> int:
    from node import trust

    if args.swarm_command == "init":
        trust.init_swarm(args.dir)
        print(f"{args.dir}: new swarm, wrote {trust.TRAINER_KEY}, {trust.TRAINER_PUB}, {trust.CA_KEY}, {trust.CA_CRT}")
        return 0
    if args.swarm_command == "issue":
        paths = trust.issue(args.dir, args.name, args.role, args.output)
        print(f"{args.output}: issued {args.name!r} ({args.role}), wrote {paths['crt'].name}, {paths['key'].name}, "
              f"{trust.CA_CRT}, {trust.TRAINER_PUB}")
        return 0
    raise UsageError(f"swarm: unknown action {args.swarm_command!r}")


# ------------------------------------------------------------------ entry


def _register_swarm_commands() -> None:
    from node.cli_swarm import SWARM_COMMANDS

    for name, help, configure, run in SWARM_COMMANDS:
        if name not in COMMANDS:
            COMMANDS[name] = Command(name, help, configure, run)


def build_parser() -> argparse.ArgumentParser:
    _register_swarm_commands()
    parser = argparse.ArgumentParser(prog=PROG, description="Lossless sparse patches of model weights.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for c in COMMANDS.values():
        p = sub.add_parser(c.name, help=c.help, description=c.help)
        c.configure(p)
        p.set_defaults(run=c.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (PatchswarmError, OSError) as e:
        print(f"{PROG}: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
