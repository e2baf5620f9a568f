"""`Wakeup`: a level-triggered flag a loop of the daemon sleeps on, with a deadline.

Owns nothing else. Each of the daemon's loops (fetching, applying, dialing,
uploading) waits on one: a fact that may give the loop work sets it from
anywhere (no await), and the loop runs again at once, or when its timeout
runs out. Must not carry data: the loop looks at the state it owns.
"""

from __future__ import annotations

import trio


class Wakeup:
    """`set()` from anywhere; `await wait(timeout)` returns once set (then clears) or after `timeout`."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> None:
        with trio.move_on_after(max(0.0, timeout)):
            await self._event.wait()
        self._event = trio.Event()
