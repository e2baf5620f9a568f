"""`patchswarm tracker`: run the tracker service.

The `patchswarm` command finds this module by its path (node/cli's registry),
so node/ never imports tracker/; it exposes `COMMANDS` instead of using the
registry's decorator for the same reason.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from patchswarm.node.net.service import add_member_arguments, run_service


def _tracker_args(p: argparse.ArgumentParser) -> None:
    add_member_arguments(p, "127.0.0.1:7700")
    p.add_argument("--revocations", metavar="FILE", type=Path,
                   help="the swarm's signed revocation list (SWARM/revocations, from `swarm revoke` or "
                        "`swarm issue --rotate`): reread when it changes and handed to every member")


def cmd_tracker(args: argparse.Namespace) -> int:
    from patchswarm.tracker.server import Tracker

    t = Tracker(args.creds, args.listen, revocations=args.revocations)
    return run_service(f"tracker {t.creds.name}", t.run, args.verbose)


COMMANDS = [("tracker", "run the tracker: membership, peer lists, version announcements", _tracker_args, cmd_tracker)]
