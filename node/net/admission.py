"""Which authenticated member may open a connection to this one now: a budget of connections per member.

Owns `MemberAdmission`: a token bucket of connections per member id, the name
in the member's CA-signed certificate (never its address: members move between
hosts, and many share one NAT). The listener (node/net/transport.py `serve`)
asks right after the TLS handshake, the first moment the name is known, and
before the Hello exchange, the Haves and the session: a refused connection
costs its handshake and a 100-byte Error, nothing of the session, and the
Error comes REFUSAL_HOLD (1 s) later, so a member that loops gets few
handshakes a second out of the listener (node/net/transport.py).

Why: a member with valid credentials could reconnect in a loop, and each
connection cost the node the Hello exchange, a Have per object held (a
bitfield each), an `Incoming` per chunk arriving, and the session's setup and
teardown in the fetcher and picker (node/README.md, "A member that
reconnects in a loop", has the measurement). The tracker has had the same budget for joins since issue 21
(tracker/core.py `JOIN_BUDGET`); this is the member's side.

A refusal takes no token, so a member refused while over budget is admitted
again as soon as one token has come back: after a burst of `burst`
connections, one every 60 / `per_minute` seconds. Pure: the caller passes
the time; no I/O, no clock.
"""

from __future__ import annotations

from patchswarm.protocol.errors import BudgetExceeded, UsageError

ADMISSIONS = "connections per minute"  # the budget's name, for counters and logs
# An honest member connects once per peer it keeps, and again after a failure: its dialer
# waits REDIAL_AFTER (1 s) after a session ends and backs off after failed dials
# (node/dialer.py), and the tracker allows 10 joins in a row and 10 a minute for the same
# reasons. More than that from one certificate is a loop, not a network blip.
CONNECTION_BURST = 10
CONNECTIONS_PER_MINUTE = 10.0
PRUNE_AT = 1024  # members remembered before full buckets are forgotten


class MemberAdmission:
    """Token buckets of connections per member: `burst` at most, refilled at `per_minute`."""

    def __init__(self, burst: int = CONNECTION_BURST, per_minute: float = CONNECTIONS_PER_MINUTE):
        if burst < 1 or not per_minute > 0:
            raise UsageError(f"admission: expected burst >= 1 and a rate > 0 a minute, found {burst} and {per_minute}")
        self.burst = float(burst)
        self.rate = per_minute / 60.0
        self._buckets: dict[str, tuple[float, float]] = {}  # member -> (tokens, at)
        self._prune_at = PRUNE_AT

    def _tokens(self, member: str, now: float) -> float:
        tokens, at = self._buckets.get(member, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - at) * self.rate)

    def admit(self, member: str, now: float) -> None:
        """Take one connection of `member`'s budget, or raise BudgetExceeded saying when the
        next one comes back (a refusal takes nothing)."""
        tokens = self._tokens(member, now)
        if tokens < 1.0 - 1e-9:  # the bucket is left as it was: the refusal takes nothing, in time or tokens
            raise BudgetExceeded(ADMISSIONS, f"member {member!r}: expected at most {self.burst:.0f} connections in a "
                                             f"row and {self.rate * 60:g} a minute, found one more; the next is "
                                             f"admitted in {self.wait(member, now):.1f} s")
        self._buckets[member] = (max(0.0, tokens - 1.0), now)
        if len(self._buckets) >= self._prune_at:
            self.prune(now)
            self._prune_at = max(PRUNE_AT, 2 * len(self._buckets))  # amortized O(1) per admission

    def wait(self, member: str, now: float) -> float:
        """Seconds until `member` may connect again (0: now)."""
        return max(0.0, (1.0 - self._tokens(member, now)) / self.rate)

    def prune(self, now: float) -> None:
        """Forget members whose bucket is full again (they are as good as new)."""
        for m in [m for m in self._buckets if self._tokens(m, now) >= self.burst]:
            del self._buckets[m]

    def __len__(self) -> int:
        return len(self._buckets)
