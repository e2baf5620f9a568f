"""`patchswarm tracker`: run the tracker service, with its metrics and the swarm page.

The `patchswarm` command finds this module by its path (node/cli's registry),
so node/ never imports tracker/; it exposes `COMMANDS` instead of using the
registry's decorator for the same reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from patchswarm.node.net.service import add_member_arguments, parse_region_rates, run_service

log = logging.getLogger("patchswarm.tracker")


def _notice_seeds(text: str) -> int:
    """--notice-seeds: a whole number >= 1, checked as the flag is read, so `patchswarm config check`
    refuses `notice-seeds = 0` with its line (it said ok, and the tracker refused to start)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, found {text!r}")
    return value


def _tracker_args(p: argparse.ArgumentParser) -> None:
    add_member_arguments(p, "127.0.0.1:7700")
    p.add_argument("--revocations", metavar="FILE", type=Path,
                   help="the swarm's signed revocation list (SWARM/revocations, from `swarm revoke` or "
                        "`swarm issue --rotate`): reread when it changes and handed to every member")
    p.add_argument("--notice-seeds", metavar="N", type=_notice_seeds, default=None,
                   help="nodes per region sent each manifest whole; the others get a hint and the manifest "
                        "from a peer (default 8)")
    p.add_argument("--wan-rates", type=parse_region_rates, metavar="REGION=MBIT,...",
                   help="each region's WAN link rate (Mbit/s, each way), told to every member: each chunk "
                        "crosses the regions from the fastest link to the slowest, on one plan for the whole "
                        "swarm; a node's own --wan-rates count only where the tracker gives none (default: none)")
    p.add_argument("--probe-reachability", action="store_true",
                   help="dial each node's address once when it joins; a node that cannot be reached there "
                        "(behind NAT) is listed without an address and told so, so peers do not dial it and "
                        "it dials them (nodes with --transport auto meet such nodes over WebRTC)")
    p.add_argument("--require-region", action="store_true",
                   help="refuse a node or origin whose certificate names no region (`swarm issue --region`); "
                        "without it such a member says its region in its Hello, as before. A certificate that "
                        "names a region is good for that region only, either way")


def cmd_tracker(args: argparse.Namespace) -> int:
    import trio

    from patchswarm.node.net.httpserve import Response
    from patchswarm.node.net.metrics import TrackerMetrics
    from patchswarm.tracker.page import page_html, swarm_view
    from patchswarm.tracker.server import Tracker

    options = {} if args.notice_seeds is None else {"notice_seeds": args.notice_seeds}
    if args.wan_rates is not None:
        options["wan_rates"] = args.wan_rates
    t = Tracker(args.creds, args.listen, revocations=args.revocations, probe=args.probe_reachability,
                require_region=args.require_region, **options)

    async def start(task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as n:
            await n.start(t.run)
            task_status.started(t.status)

    pages = {
        "/": lambda: Response(200, page_html(swarm_view(t.status())).encode(), "text/html; charset=utf-8"),
        "/swarm.json": lambda: Response(200, json.dumps(swarm_view(t.status())).encode(), "application/json"),
    }
    return run_service(f"tracker {t.creds.name}", start, args, TrackerMetrics(), pages,
                       reload=lambda: _reload(t, args))


def _reload(t, args: argparse.Namespace) -> None:
    """SIGHUP: read the configuration again; new WAN rates go to every member at once (a change
    of links without a restart, which would make every member join again). Settings read only
    at start are named in the log when they changed. UsageError (logged, nothing changed) where
    the file is now bad."""
    if args.config is None or getattr(args, "reread", None) is None:
        log.warning("SIGHUP: no --config file to read again; nothing changed")
        return
    again = args.reread()
    t.set_wan_rates(again.wan_rates)
    later = sorted(k.replace("_", "-") for k, v in vars(again).items()
                   if k not in ("wan_rates", "run", "argv", "reread") and v != getattr(args, k, None))
    if later:
        log.warning("SIGHUP: %s changed in %s; taken at the next start (only wan-rates is read again)",
                    ", ".join(later), args.config)
    if any(a == "--wan-rates" or a.startswith("--wan-rates=") for a in args.argv) or "PATCHSWARM_WAN_RATES" in os.environ:
        log.warning("SIGHUP: wan-rates comes from the command line or PATCHSWARM_WAN_RATES, which the file "
                    "does not override")


COMMANDS = [("tracker", "run the tracker: membership, peer lists, version announcements; "
                        "with --metrics, its metrics and a live swarm page at /", _tracker_args, cmd_tracker)]
