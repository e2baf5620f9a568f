"""Byte-rate caps for a member's swarm traffic (`--upload-limit`, `--download-limit`).

Owns `TokenBucket`: `await take(n)` returns once n bytes fit the rate. Takers
are served in arrival order; a take larger than the burst goes into debt and
waits it off, so big pieces pass at the right average rate. With no rate it
never waits. Uses trio's clock, so tests can drive it with a mock clock.
"""

from __future__ import annotations

import trio


class TokenBucket:
    def __init__(self, rate: float | None, burst: float | None = None):
        if rate is not None and rate <= 0:
            raise ValueError(f"rate: expected bytes per second > 0 or None, found {rate!r}")
        self.rate = rate
        # A quarter second of traffic: smooth enough not to hurt TCP, large enough for few wakeups.
        self.burst = burst if burst is not None else (max(rate / 4, 64 << 10) if rate else 0.0)
        self._tokens = self.burst
        self._stamp: float | None = None
        self._lock = trio.StrictFIFOLock()

    def _refill(self) -> None:
        now = trio.current_time()
        if self._stamp is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def take(self, n: int) -> None:
        if self.rate is None or n <= 0:
            return
        async with self._lock:
            self._refill()
            self._tokens -= n
            if self._tokens < 0:
                await trio.sleep(-self._tokens / self.rate)
                self._refill()
