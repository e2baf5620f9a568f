"""Run one blocking job on a thread of its own at a lower CPU priority, from trio.

Owns the one place a node's bulk CPU work (decoding and applying a version)
leaves the event loop. Why a thread of its own rather than
`trio.to_thread.run_sync`: Linux schedules threads one by one, so a nice
value set on a thread applies to it alone, and threads it starts (the
decode and state-hash helpers, protocol/parallel.py) inherit it. trio's
worker threads are cached and reused, and an unprivileged process cannot
raise a thread's priority back, so lowering one of them would leave a slow
thread behind for the spool and the weights writer. This thread lives and
dies inside the call.

Why lower at all: while a node applies a version, its peers are still
fetching that version's chunks from it. Serving them is the swarm's critical
path; the node's own apply is not (the version is held and verified either
way). On a host whose cores are shared with the serving loop (or with other
daemons, as in the WAN bench), an apply at equal priority takes CPU the
serving loop needs and every peer waits for it.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

import outcome
import trio

T = TypeVar("T")

APPLY_NICE = 10  # CFS weight 110 vs 1024: the loop gets ~90 % of a contended core


def _lower_this_thread(nice: int) -> None:
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        # On Linux PRIO_PROCESS with a thread id names that thread alone.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except OSError:
        pass  # not permitted here (e.g. a sandbox): run at the process's priority


async def run_low_priority(fn: Callable[[], T], nice: int = APPLY_NICE, name: str = "patchswarm-apply") -> T:
    """Run `fn()` on a new thread `nice` steps below the process's priority; return or raise its outcome.

    Not cancellable once started, like `trio.to_thread.run_sync`: the work
    mutates state in place and must finish (or roll back) before the caller
    moves on.
    """
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    result: list[outcome.Outcome] = []

    def body() -> None:
        _lower_this_thread(nice)
        result.append(outcome.capture(fn))
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    with trio.CancelScope(shield=True):
        await done.wait()
    thread.join()
    return result[0].unwrap()
