"""This node's upload capacity, measured from its own chunk sends while they back up. Sans-IO.

Owns `UplinkMeter`. The daemon tells it when a send of chunk bytes to a peer starts and when it
ends (`started(now)`, `finished(now, nbytes)`); time is an argument, never read here.

A send waits while its connection's socket buffer is full: the bytes then leave no faster than
the path to that peer allows. One slow receiver fills its own connection's buffer only; where
more than one send waits at once on average over a window (`SATURATED_SENDS`), every connection
with bytes to go is held back together, and the node's own uplink is the likely limit. Such a
window's rate (bytes whose send finished in it, over its length) is one sample of the uplink
(none where no send finished: a part that outlasts the window counts in the next);
`estimate` is the median of the last `KEEP` samples, once there are `MIN_SAMPLES`. A node whose sends
never back up has no estimate: what it sent says only that its uplink is at least that fast.
Only sends to peers of the node's own region count as waiting (`waits_count`): a send across
the WAN waits on the region's link (bench/wan.py at 100/50/20 Mbit/s: a member of the 50 Mbit/s
region relaying to the 20 Mbit/s one measured 20.8 Mbit/s on a 100 Mbit/s uplink when they
counted); their bytes still count in the rate, since they leave through the same uplink.

What it is for: a member's share of the WAN plan follows its uplink (protocol/responsibility.py
`uplink_caps`), and a host whose uplink is far slower than it declared (a busier or throttled
NIC), or that declares none among faster ones, holds its region up. So a member tells the tracker
what `reported_uplink` makes of its declared rate and this estimate (the tracker passes it on
in its peer entry, so every member plans with the same value: protocol/README.md, "Members'
uplinks"), and the daemon shows the estimate in its status and metrics and warns when it is
under `SLOWER_THAN_DECLARED` of the declared rate (`below_declared`). Samples older than
`MAX_AGE_S` no longer count: a member planned as slow is sent little and rarely backs up again,
so without an end its old estimate would keep it slow after its link recovered.
"""

from __future__ import annotations

import collections
import math
import statistics

from .errors import UsageError

WINDOW_S = 0.5  # one sample's length: ~5 parts of 128 KiB at 10 Mbit/s, so a few seconds of relay give MIN_SAMPLES
# Sends waiting at once, on average over a window, for it to be a sample: more than one (one slow
# receiver keeps one waiting, ~1.0), with room for the moments between two parts (two connections
# held back measured ~1.9 over real sockets, tests/test_uplinkmeter.py).
SATURATED_SENDS = 1.5
MIN_SAMPLES = 4  # an estimate from fewer is noise (one burst, one stall)
KEEP = 32  # the samples the median is over: the last ~half minute of backed-up sending
# How long a sample counts: a member then planned as slow is planned on its declared rate again
# (or none) and measured in the next version it relays; a member that relays every version
# keeps its samples fresh.
MAX_AGE_S = 600.0
# A member says what it measured only under this fraction of its declared uplink (or, declaring
# none, of what its region's other nodes say), and warns of it (`below_declared`): healthy
# members measured down to 37 % of theirs where their neighbours' downlinks were the limit
# (`reported_uplink`; it was a warning under half, 2026-12-06, before that was seen).
SLOWER_THAN_DECLARED = 0.25
# A measured uplink once reported stands until the estimate moves off it by more than this
# factor: every report re-plans the member's region at every member.
REPORT_STEP = 1.25
# A member changes what it says at most this often (`UplinkReport`); the tracker takes at most one
# change per 10 s from a member (tracker/core.py UPLINK_CHANGE_S), so every change said is taken.
REPORT_EVERY_S = 12.0


class UplinkMeter:
    """Samples of this node's upload rate while its sends back up (see the module doc)."""

    def __init__(self, window_s: float = WINDOW_S, saturated_sends: float = SATURATED_SENDS,
                 min_samples: int = MIN_SAMPLES, keep: int = KEEP, max_age_s: float = MAX_AGE_S):
        if not window_s > 0 or not saturated_sends > 0 or min_samples < 1 or keep < min_samples \
                or not max_age_s > 0:
            raise UsageError(f"UplinkMeter: expected window_s > 0, saturated_sends > 0, "
                             f"1 <= min_samples <= keep and max_age_s > 0, found {window_s}, {saturated_sends}, "
                             f"{min_samples}, {keep}, {max_age_s}")
        self.window_s = window_s
        self.saturated_sends = saturated_sends
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        self.samples: collections.deque[float] = collections.deque(maxlen=keep)  # bytes/s
        self._taken_at: collections.deque[float] = collections.deque(maxlen=keep)  # each sample's window end
        self.windows = 0  # windows closed with a send in them (samples or not)
        self._start: float | None = None  # the open window's start
        self._at = 0.0  # when `_open` last changed (or the window began)
        self._open = 0  # sends in progress whose waiting counts
        self._uncounted = 0  # ... whose waiting does not (across the WAN)
        self._busy = 0.0  # sends in progress integrated over the open window (send-seconds)
        self._bytes = 0  # bytes whose send finished in the open window

    def started(self, now: float, waits_count: bool = True) -> None:
        """A send of chunk bytes began. `waits_count` False: its waiting says nothing of this
        node's uplink (a peer across the WAN, whose link is the region's, slower than the
        host's uplink); its bytes still count in the rate."""
        self._advance(now)
        self._open += waits_count
        self._uncounted += not waits_count

    def finished(self, now: float, nbytes: int, waits_count: bool = True) -> bool:
        """A send begun with `started` (the same `waits_count`) ended, `nbytes` of it sent (0 if
        it failed). True if a new sample was taken (a window closed backed up)."""
        if (self._open if waits_count else self._uncounted) <= 0:
            raise UsageError("UplinkMeter.finished: expected a send started before, found none in progress")
        taken = self._advance(now)
        if waits_count:
            self._open -= 1
        else:
            self._uncounted -= 1
        self._bytes += nbytes
        return taken

    def estimate(self, now: float | None = None) -> float | None:
        """The upload rate in bytes/s while sends back up (the median of the samples), None
        with fewer than `min_samples`. With `now`, samples older than `max_age_s` are dropped first."""
        if now is not None:
            while self._taken_at and self._taken_at[0] < now - self.max_age_s:
                self._taken_at.popleft()
                self.samples.popleft()
        if len(self.samples) < self.min_samples:
            return None
        return statistics.median(self.samples)

    def estimate_mbit(self, now: float | None = None) -> float | None:
        e = self.estimate(now)
        return None if e is None else round(e * 8 / 1e6, 3)

    def below_declared(self, declared_mbit: float | None) -> float | None:
        """The estimate in Mbit/s where it is under `SLOWER_THAN_DECLARED` of `declared_mbit`, else None."""
        e = self.estimate_mbit()
        if e is None or declared_mbit is None or e >= SLOWER_THAN_DECLARED * declared_mbit:
            return None
        return e

    def _advance(self, now: float) -> bool:
        """Close the windows that ended by `now`; True if one of them was a sample."""
        if self._start is None:
            self._start = self._at = now
            return False
        taken = False
        end = self._start + self.window_s
        while now >= end:
            self._busy += self._open * (end - self._at)
            if self._busy or self._bytes:
                self.windows += 1
                if self._bytes and self._busy >= self.saturated_sends * self.window_s:
                    self.samples.append(self._bytes / self.window_s)
                    self._taken_at.append(end)
                    taken = True
            self._busy, self._bytes = 0.0, 0
            self._start = self._at = end
            if not self._open and not self._uncounted:  # idle: the next window starts now
                self._start = self._at = now
                break
            end = self._start + self.window_s
        self._busy += self._open * (now - self._at)
        self._at = now
        return taken


def reported_uplink(declared: float | None, measured: float | None, last: float | None = None,
                    others: float | None = None) -> float | None:
    """The uplink (Mbit/s) a member tells the tracker, which passes it on to every member for the
    plan (None: none, counted as its region's median): its `declared` one (--uplink-mbit) unless
    its `measured` estimate is under `SLOWER_THAN_DECLARED` of it, then the estimate. A member that declares
    none compares the estimate with `others` (the upper median of what the other nodes of its
    region say) instead, and says nothing where they say nothing.

    Why only far under, and never above: a member measures only while its sends back up, which
    says what it did, not what its NIC can. Where its neighbours' downlinks are the limit (the
    origin's region, whose downlinks also carry the origin's sends) healthy 100 Mbit/s members
    measured 37-94 Mbit/s (bench/RESULTS.md, 2026-12-07), so a smaller gap is the measuring's own
    error, and said as is it would mark a healthy member slow or skew every share. A member at a
    tenth of its region's rate measures 8.4-9.4 Mbit/s of 10. `last`: what this member said
    before; a measured value stays while the estimate is within `REPORT_STEP` of it, so a noisy
    estimate does not re-plan the region at every member each time it moves."""
    reference = declared if declared is not None else others
    if measured is None or reference is None or measured >= SLOWER_THAN_DECLARED * reference:
        return declared
    if last is not None and last != declared and last / REPORT_STEP <= measured <= last * REPORT_STEP:
        return last
    return float(f"{measured:.3g}")


class UplinkReport:
    """What this member says its uplink is (`reported_uplink` of its declared rate and its
    meter's estimate), changed at most once per `REPORT_EVERY_S`; `value` is what it says now."""

    def __init__(self, declared: float | None, every_s: float = REPORT_EVERY_S):
        self.declared = declared
        self.value = declared
        self.every_s = every_s
        self._at = -math.inf  # when `value` last changed

    def update(self, now: float, measured: float | None, others: float | None = None) -> bool:
        """Take the meter's estimate (Mbit/s, None: none) and what the region's other nodes say
        (`reported_uplink`); True when `value` changed."""
        value = reported_uplink(self.declared, measured, self.value, others)
        if value == self.value or now - self._at < self.every_s:
            return False
        self.value, self._at = value, now
        return True
