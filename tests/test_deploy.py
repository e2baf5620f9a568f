"""deploy/: the service definitions name real subcommands and flags, and the image copies real paths.

Docker and Kubernetes do not run here; what can be checked without them is that
every command line they would run parses with the real CLI.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from patchswarm.node.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _systemd_commands():
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text()
        env = dict(re.findall(r"^Environment=(\w+)=(\S+)$", text, re.M))
        (line,) = re.findall(r"^ExecStart=(.+)$", text, re.M)
        argv = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line))
        assert argv[0].endswith("/patchswarm"), unit
        yield unit.name, argv[1:]


def _kubernetes_commands():
    for manifest in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for m in re.finditer(r"args:\s*(\[[^\]]*\])", manifest.read_text()):
            args = re.findall(r'"([^"]*)"', m.group(1))
            yield manifest.name, [re.sub(r"\$\((\w+)\)", "x:1", a) for a in args]


@pytest.mark.parametrize("where, argv", [*_systemd_commands(), *_kubernetes_commands()])
def test_service_command_lines_parse(where, argv):
    args = build_parser().parse_args(argv)
    assert args.command in ("tracker", "origin", "node"), where


def test_dockerfile_copies_what_exists():
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in src.split():
            assert (DEPLOY.parent / path).exists(), path
