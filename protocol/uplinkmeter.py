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

What it is for: a member's share of the WAN plan follows its declared uplink
(protocol/responsibility.py `uplink_caps`, the node's --uplink-mbit), and a host whose uplink
is slower than it declared (a busier or throttled NIC) still holds its region up. The daemon
shows the estimate in its status and metrics and warns when it is under `SLOWER_THAN_DECLARED`
of the declared rate (`below_declared`), so the operator can declare what the host does.
The plan does not use the estimate: every member must plan with the same rates, and this one
is the node's own view (protocol/README.md, "Members' uplinks").
"""

from __future__ import annotations

import collections
import statistics

from .errors import UsageError

WINDOW_S = 0.5  # one sample's length: ~5 parts of 128 KiB at 10 Mbit/s, so a few seconds of relay give MIN_SAMPLES
# Sends waiting at once, on average over a window, for it to be a sample: more than one (one slow
# receiver keeps one waiting, ~1.0), with room for the moments between two parts (two connections
# held back measured ~1.9 over real sockets, tests/test_uplinkmeter.py).
SATURATED_SENDS = 1.5
MIN_SAMPLES = 4  # an estimate from fewer is noise (one burst, one stall)
KEEP = 32  # the samples the median is over: the last ~half minute of backed-up sending
SLOWER_THAN_DECLARED = 0.5  # an estimate under this fraction of the declared rate is worth a warning


class UplinkMeter:
    """Samples of this node's upload rate while its sends back up (see the module doc)."""

    def __init__(self, window_s: float = WINDOW_S, saturated_sends: float = SATURATED_SENDS,
                 min_samples: int = MIN_SAMPLES, keep: int = KEEP):
        if not window_s > 0 or not saturated_sends > 0 or min_samples < 1 or keep < min_samples:
            raise UsageError(f"UplinkMeter: expected window_s > 0, saturated_sends > 0 and "
                             f"1 <= min_samples <= keep, found {window_s}, {saturated_sends}, {min_samples}, {keep}")
        self.window_s = window_s
        self.saturated_sends = saturated_sends
        self.min_samples = min_samples
        self.samples: collections.deque[float] = collections.deque(maxlen=keep)  # bytes/s
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

    def estimate(self) -> float | None:
        """The upload rate in bytes/s while sends back up (the median of the samples), None
        with fewer than `min_samples`."""
        if len(self.samples) < self.min_samples:
            return None
        return statistics.median(self.samples)

    def estimate_mbit(self) -> float | None:
        e = self.estimate()
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
