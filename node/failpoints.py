"""Named places where a fault-injection test may hold the process, to kill it exactly there.

`PATCHSWARM_FAILPOINTS="NAME=sleep:SECONDS[,NAME=sleep:SECONDS...]"` makes
`hit(NAME)` log one warning line ("failpoint NAME: holding S s") and sleep,
so a test that reads the log knows the process is inside that step when it
sends SIGKILL, and can show in the log that the kill landed there. Without
the variable (production), `hit` is one dictionary lookup.

`hit` is for blocking code on worker threads (an apply, a base write, a
compaction, the origin's encode); `hold` is the same for trio code (an
upload, an ack) and sleeps only the calling task, never the event loop.
Must not change what any step does, only when.
"""

from __future__ import annotations

import logging
import os
import time

import trio

from patchswarm.protocol.errors import UsageError

ENV = "PATCHSWARM_FAILPOINTS"
log = logging.getLogger("patchswarm.failpoint")


def _parse(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, action = item.partition("=")
        kind, _, seconds = action.partition(":")
        try:
            if kind != "sleep":
                raise ValueError
            out[name] = float(seconds)
        except ValueError:
            raise UsageError(f"{ENV}: expected NAME=sleep:SECONDS, found {item!r}") from None
    return out


_points = _parse(os.environ.get(ENV, ""))


def hit(name: str) -> None:
    seconds = _points.get(name)
    if seconds is not None:
        log.warning("failpoint %s: holding %g s", name, seconds)
        time.sleep(seconds)


async def hold(name: str) -> None:
    """`hit` for a trio task: the same line, then a trio sleep (the loop and other tasks go on)."""
    seconds = _points.get(name)
    if seconds is not None:
        log.warning("failpoint %s: holding %g s", name, seconds)
        await trio.sleep(seconds)
