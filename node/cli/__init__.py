"""The `patchswarm` command line: one registry of subcommands, and the entry point.

Owns parsing, dispatch and exit codes: 0 ok, 1 for any deliberate patchswarm
error or OS error (one line `patchswarm: <message>` on stderr, no traceback),
2 for usage errors from argparse. The commands live in modules by topic
(`MODULES`, imported when the parser is built): codec tools (codec.py), the
demo (demo.py), swarm credentials (swarm.py), the tracker (tracker/cli.py,
named by path so that node/ never imports tracker/), the member services and
their status (services.py).

Adding a subcommand: in one of those modules, write `def _x_args(p)` that adds
its arguments and `@command("x", "help", _x_args) def cmd_x(args) -> int`; a
module that cannot import this one (the tracker's) exposes `COMMANDS`, a list
of (name, help, configure, run).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import sys
from typing import Callable

from patchswarm.node.net import config as layers
from patchswarm.node.net.service import package_version
from patchswarm.node.net.transport import one_line
from patchswarm.protocol.errors import PatchswarmError, UsageError

PROG = "patchswarm"
MODULES = ("patchswarm.node.cli.codec", "patchswarm.node.cli.demo", "patchswarm.node.cli.swarm",
           "patchswarm.tracker.cli", "patchswarm.node.cli.services", "patchswarm.node.cli.config")


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    if name in COMMANDS and COMMANDS[name].run is not run:
        raise UsageError(f"subcommand {name!r}: registered twice")
    COMMANDS[name] = Command(name, help, configure, run)


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register the decorated `run(args) -> int` as subcommand `name`."""

    def decorate(run: Callable[[argparse.Namespace], int]):
        register(name, help, configure, run)
        return run

    return decorate


def build_parser() -> argparse.ArgumentParser:
    for name in MODULES:
        for entry in getattr(importlib.import_module(name), "COMMANDS", ()):
            register(*entry)
    parser = argparse.ArgumentParser(prog=PROG, description="Lossless sparse patches of model weights, "
                                                            "spread by a region-aware swarm.")
    version = f"{PROG} {package_version()}"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.subcommands = {}
    for c in COMMANDS.values():
        p = sub.add_parser(c.name, help=c.help, description=c.help)
        c.configure(p)
        if layers.is_layered(p):
            p.add_argument("--version", action="version", version=version)
        p.set_defaults(run=c.run)
        parser.subcommands[c.name] = p
    return parser


def parse(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """The arguments of one invocation; a service's flags layered as flag > environment > file > default."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, layered = _layered_parser()
    args = parser.parse_args(argv)
    p = layered.get(args.command)
    if p is not None:
        try:
            layers.resolve(p, args.command, args, os.environ if environ is None else environ)
        except layers.ConfigError as e:
            p.error("\n  ".join(["bad configuration:", *map(str, e.problems)]))
        args.argv = argv
        args.reread = functools.partial(reread, args)  # for a service's SIGHUP (tracker/ may not import this)
    return args


def reread(args: argparse.Namespace) -> argparse.Namespace:
    """A service's arguments read again from the same command line, with its --config file
    and the environment as they are now (what a service re-reads on SIGHUP). UsageError,
    naming every problem, where the file is now bad; nothing exits."""
    parser, layered = _layered_parser()
    again = parser.parse_args(args.argv)  # the command line parsed once already: it parses again
    try:
        layers.resolve(layered[again.command], again.command, again, os.environ)
    except layers.ConfigError as e:
        raise UsageError("; ".join(["bad configuration", *map(str, e.problems)])) from None
    again.argv, again.reread = args.argv, args.reread
    return again


def _layered_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = build_parser()
    layered = {name: p for name, p in parser.subcommands.items() if layers.is_layered(p)}
    for p in layered.values():
        layers.prepare(p)
    return parser, layered


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.run(args)
    except (PatchswarmError, OSError) as e:
        print(f"{PROG}: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
