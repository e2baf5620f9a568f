"""`patchswarm demo`: the RL loop across a local swarm (node/demo/, behind the `demo` extra)."""

from __future__ import annotations

import argparse
import importlib.util

from patchswarm.node.cli import command
from patchswarm.protocol.errors import UsageError


def _demo_args(p: argparse.ArgumentParser) -> None:
    from patchswarm.node.demo.run import add_arguments

    add_arguments(p)


@command("demo", "train a small policy with RL across a local multi-region swarm: tracker, 6 nodes, workers", _demo_args)
def cmd_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("demo: needs the demo extra: pip install 'patchswarm[demo]' (make demo installs it)")
    from patchswarm.node.demo.run import run

    return run(args)
