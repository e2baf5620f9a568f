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
from patchswarm.protocol.uplinkmeter import MIN_SAMPLES, UplinkMeter

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
    (6_250_000, 100, False),  # 50 of 100: not under half
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
