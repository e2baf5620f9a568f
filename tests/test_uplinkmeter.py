"""The uplink meter (protocol/uplinkmeter.py): samples of a member's upload rate while its sends
back up. Tables and a property test over invented timelines; one test over real sockets whose
readers are slow, where sends wait because the kernel's buffers are full."""

from __future__ import annotations

import socket

import hypothesis.strategies as st
import pytest
import trio
from hypothesis import given, settings

from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.uplinkmeter import MIN_SAMPLES, REPORT_EVERY_S, UplinkMeter, UplinkReport, reported_uplink
from patchswarm.tracker.core import UPLINK_CHANGE_S

PART = 128 << 10


def _parallel_sends(meter: UplinkMeter, t0: float, sends: int, each_s: float, nbytes: int) -> float:
    """`sends` sends that start at t0 and end each_s later, nbytes each; returns the end."""
    for _ in range(sends):
        meter.started(t0)
    for _ in range(sends):
        meter.finished(t0 + each_s, nbytes)
    return t0 + each_s


def test_sends_that_wait_together_are_samples_of_the_uplink():
    meter = UplinkMeter(window_s=1.0)
    t = 0.0
    for _ in range(6):  # three connections, each part waiting the whole second: 3 x 125 KB/s
        t = _parallel_sends(meter, t, 3, 1.0, 125_000)
    meter.started(t + 0.5)  # the next window closes
    assert list(meter.samples) == [375_000.0] * 5  # the first window's sends end at its close: they count in the next
    assert meter.estimate() == 375_000.0 and meter.estimate_mbit() == 3.0


def test_one_slow_receiver_is_not_a_slow_uplink():
    """One send waiting at a time fills one connection's buffer: the path to that peer, not the uplink."""
    meter = UplinkMeter(window_s=1.0)
    t = 0.0
    for _ in range(10):
        t = _parallel_sends(meter, t, 1, 1.0, 125_000)
    assert not meter.samples and meter.estimate() is None and meter.windows >= 9


def test_sends_across_the_wan_wait_on_the_regions_link_not_this_uplink():
    """bench/wan.py at 100/50/20 Mbit/s: a member of the 50 Mbit/s region relaying to the 20
    Mbit/s one measured 20.8 Mbit/s on a 100 Mbit/s uplink while those sends counted."""
    meter = UplinkMeter(window_s=1.0)
    t = 0.0
    for _ in range(8):  # two WAN sends waiting all the time: no sample
        for _ in range(2):
            meter.started(t, waits_count=False)
        for _ in range(2):
            meter.finished(t + 1.0, 125_000, waits_count=False)
        t += 1.0
    assert meter.estimate() is None
    for _ in range(8):  # two local sends waiting beside one WAN send: samples, the WAN bytes counted too
        meter.started(t, waits_count=False)
        _parallel_sends(meter, t, 2, 1.0, 100_000)
        meter.finished(t + 1.0, 50_000, waits_count=False)
        t += 1.0
    assert meter.estimate() == 250_000.0
    with pytest.raises(UsageError, match="none in progress"):
        meter.finished(t, 1, waits_count=False)


def test_sends_that_do_not_wait_give_no_estimate_and_idle_gaps_no_windows():
    meter = UplinkMeter(window_s=1.0)
    for i in range(20):  # a part every 2 s that leaves at once
        _parallel_sends(meter, 2.0 * i, 3, 0.001, PART)
    assert meter.estimate() is None
    assert meter.windows <= 20  # one per burst at most: the idle seconds between are no windows


def test_an_estimate_needs_min_samples_and_is_their_median():
    meter = UplinkMeter(window_s=1.0, min_samples=MIN_SAMPLES)
    t = 0.0
    rates = [100_000, 900_000, 200_000, 300_000, 250_000]
    for r in rates:
        t = _parallel_sends(meter, t, 2, 1.0, r // 2)
    meter.started(t + 0.1)
    assert len(meter.samples) == len(rates) - 1  # each window's bytes are the sends that ended in it
    assert meter.estimate() == 250_000.0  # median of 900k, 200k, 300k, 250k


@pytest.mark.parametrize("measured_rate, declared, warns", [
    (1_250_000, 100, True),   # 10 Mbit/s measured, 100 declared
    (6_250_000, 100, False),  # 50 of 100: not under a quarter
    (2_500_000, 100, True),  # 20 of 100
    (1_250_000, None, False),  # none declared
])
def test_below_declared_names_an_uplink_well_under_the_declared_one(measured_rate, declared, warns):
    meter = UplinkMeter(window_s=1.0)
    t = 0.0
    for _ in range(MIN_SAMPLES + 2):
        t = _parallel_sends(meter, t, 2, 1.0, measured_rate // 2)
    assert (meter.below_declared(declared) is not None) == warns


def test_misuse_is_refused():
    with pytest.raises(UsageError, match="none in progress"):
        UplinkMeter().finished(1.0, 10)
    with pytest.raises(UsageError, match="window_s > 0"):
        UplinkMeter(window_s=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.integers(1, 4), st.floats(0, 2.5), st.integers(0, 1 << 20)),
                max_size=30))
def test_property_samples_never_exceed_the_bytes_sent_and_the_estimate_is_among_them(bursts):
    meter = UplinkMeter(window_s=0.5, min_samples=2)
    t, total = 0.0, 0
    for gap, sends, each_s, nbytes in bursts:
        t = _parallel_sends(meter, t + gap, sends, each_s, nbytes)
        total += sends * nbytes
    meter.started(t + 10.0)  # close every window
    assert all(s >= 0 for s in meter.samples)
    assert sum(meter.samples) * 0.5 <= total
    e = meter.estimate()
    assert e is None or min(meter.samples) <= e <= max(meter.samples)


def test_real_sockets_with_slow_readers_measure_what_they_take():
    """Two peers read 32 KiB every 20 ms each over real sockets with small buffers: the sender's
    parts wait on full buffers, two at once, and the meter's estimate is the rate they took."""
    meter = UplinkMeter(window_s=0.25, min_samples=4)
    received = [0, 0]

    async def main():
        pairs = []
        for _ in range(2):
            a, b = socket.socketpair()
            for s in (a, b):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
            pairs.append((trio.SocketStream(trio.socket.from_stdlib_socket(a)),
                          trio.SocketStream(trio.socket.from_stdlib_socket(b))))
        part = b"x" * PART

        async def sender(stream):
            while True:
                meter.started(trio.current_time())
                sent = 0
                try:
                    await stream.send_all(part)
                    sent = len(part)
                finally:
                    meter.finished(trio.current_time(), sent)

        async def reader(stream, i):
            while True:
                received[i] += len(await stream.receive_some(32 << 10))
                await trio.sleep(0.02)

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                for i, (a, b) in enumerate(pairs):
                    n.start_soon(sender, a)
                    n.start_soon(reader, b, i)
                await trio.sleep(0.5)  # the buffers fill
                start, got0 = trio.current_time(), sum(received)
                while meter.estimate() is None or len(meter.samples) < 8:
                    await trio.sleep(0.05)
                rate = (sum(received) - got0) / (trio.current_time() - start)
                n.cancel_scope.cancel()
        for a, b in pairs:
            await a.aclose()
            await b.aclose()
        return rate

    rate = trio.run(main)
    assert 0.5 * rate <= meter.estimate() <= 2.0 * rate, (meter.estimate(), rate, list(meter.samples))


def test_samples_older_than_max_age_no_longer_count():
    """A member planned as slow rarely backs up again: its estimate must end, or it stays slow."""
    meter = UplinkMeter(window_s=1.0, max_age_s=100.0)
    t = 0.0
    for _ in range(MIN_SAMPLES + 1):
        t = _parallel_sends(meter, t, 2, 1.0, 125_000)
    meter.started(t + 0.1)
    meter.finished(t + 0.2, 0)
    assert meter.estimate(now=t + 50) == 250_000.0
    assert meter.estimate(now=t + 97.0) is not None  # its samples, of windows ending at 2-5 s, are 97-100 s old
    assert meter.estimate(now=t + 97.5) is None  # the first aged out: fewer than MIN_SAMPLES
    assert meter.estimate(now=t + 200) is None and not meter.samples
    assert meter.estimate_mbit(now=t + 200) is None


@pytest.mark.parametrize("declared, measured, last, others, said", [
    (100.0, None, None, None, 100.0),    # nothing measured: what is declared
    (100.0, 37.0, None, None, 100.0),    # a healthy member whose neighbours' downlinks were the limit
    (100.0, 24.0, None, None, 24.0),     # under a quarter: the measurement
    (100.0, 9.437, None, None, 9.44),    # three significant digits
    (100.0, 9.437, None, 5.0, 9.44),     # with a declared rate the others' do not count
    (100.0, 9.9, 9.44, None, 9.44),      # within REPORT_STEP of what was said: unchanged
    (100.0, 7.0, 9.44, None, 7.0),       # further: the new value
    (100.0, 80.0, 9.44, None, 100.0),    # recovered: the declared rate again
    (None, None, None, None, None),      # nothing declared nor measured
    (None, 9.437, None, None, None),     # none declared and no other says one: nothing to compare with
    (None, 93.6, None, 100.0, None),     # none declared, as fast as the others say: none (counts as the median)
    (None, 9.437, None, 100.0, 9.44),    # under a quarter of what the others say
    (None, 9.437, 9.44, None, None),     # no other says one now: nothing to compare with
    (None, 9.437, 9.44, 30.0, None),     # the others are slow too: none
    (10.0, 40.0, None, None, 10.0),      # a measurement never raises what is said
])
def test_reported_uplink_lowers_a_rate_only_where_measured_far_under_it(declared, measured, last, others, said):
    assert reported_uplink(declared, measured, last, others) == said


def test_uplink_report_changes_at_most_once_per_report_every_s():
    said = UplinkReport(100.0)
    assert said.value == 100.0 and not said.update(0.0, None) and not said.update(1.0, 30.0)
    assert said.update(2.0, 9.437) and said.value == 9.44  # the first change goes at once
    assert not said.update(2.0 + REPORT_EVERY_S - 0.1, 90.0) and said.value == 9.44  # too soon after it
    assert said.update(2.0 + REPORT_EVERY_S, 90.0) and said.value == 100.0
    assert REPORT_EVERY_S > UPLINK_CHANGE_S  # so the tracker takes every change a member says
