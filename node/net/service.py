"""Running a member as a service: logging, the common member arguments, clean stop on signals.

Shared by the node, the origin and the tracker (tracker/cli.py), so it lives
in the network layer everyone may import. Owns the log line format, running
`await start(task_status=...)` until SIGINT/SIGTERM, and turning a nursery's
exception group into the one error a person should see.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path


LOG_FORMAT = "%(asctime)s.%(msecs)03d {name} %(levelname)s %(message)s"


def setup_logging(name: str, verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format=LOG_FORMAT.format(name=name), datefmt="%H:%M:%S", force=True)


def add_member_arguments(p: argparse.ArgumentParser, listen_default: str) -> None:
    p.add_argument("--creds", metavar="OUT", required=True, type=Path,
                   help="credentials directory from `patchswarm swarm issue`")
    p.add_argument("--listen", metavar="HOST:PORT", default=listen_default,
                   help=f"address to accept connections on (default {listen_default}; port 0 picks one)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run_service(name: str, start, verbose: bool = False) -> int:
    """Run `await start(task_status=...)` until SIGINT/SIGTERM; 0 on a clean stop."""
    import trio

    setup_logging(name, verbose)
    log = logging.getLogger("patchswarm")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                await nursery.start(start)
                async for signum in signals:
                    log.info("stopping (%s)", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise _sole(group) from None
    return 0


def _sole(group: BaseExceptionGroup) -> BaseException:
    """The one real error inside nested nursery groups (what a person should see), else the group."""
    leaves = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group
