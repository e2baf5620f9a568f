"""`patchswarm config check FILE`: is this a valid TOML file for a service, before the service reads it.

Owns the command; the rules (keys are the service's flags, values pass its
flags' own checks) are node/net/config.py's. The service comes from the file's
`service = "..."` line or `--service`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from patchswarm.node.cli import command
from patchswarm.node.net import config
from patchswarm.protocol.errors import UsageError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["check"], help="check: report unknown keys and bad values with their line")
    p.add_argument("file", type=Path, metavar="FILE", help="the TOML file")
    p.add_argument("--service", help="the service it is for (default: the file's `service = ...`)")


@command("config", "check a service's TOML configuration file (unknown keys, bad values, with line numbers)",
         _config_args)
def cmd_config(args: argparse.Namespace) -> int:
    from patchswarm.node.cli import build_parser

    parser = build_parser()
    services = sorted(name for name, p in parser.subcommands.items() if config.is_layered(p))
    service = args.service or config.file_service(args.file)
    if service is None:
        problems = config.check_file(parser.subcommands[services[0]], services[0], args.file)
        syntax = [p for p in problems if "not TOML" in p.message or "cannot read" in p.message]
        if syntax:
            for p in syntax:
                print(p)
            return 1
        raise UsageError(f"{args.file}: say which service it is for: a `service = \"...\"` line or --service "
                         f"(one of {', '.join(services)})")
    if service not in services:
        raise UsageError(f"{args.file}: expected a service among {', '.join(services)}, found {service!r}")
    problems = config.check_file(parser.subcommands[service], service, args.file)
    for p in problems:
        print(p)
    if not problems:
        print(f"{args.file}: ok for `patchswarm {service}`")
    return 1 if problems else 0
