"""Rate limits on trio's mock clock: `TokenBucket` itself, and both places it caps
traffic (the upload side serving pieces in PeerSet, the download side reading a
MessageStream). Times are the mock clock's, so every expected time is exact arithmetic
on the rate and burst, never a measurement of how fast this machine is; the real
processes' rates are in tests/test_swarm.py.
"""

import os

import pytest
import trio
import trio.testing

from memlink import connected_pair, store_with
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.peers import PeerSet
from patchswarm.protocol import wire
from patchswarm.protocol.assembly import PART_BYTES

KIB = 1 << 10


def run_mock(fn):
    """Run `await fn()` on a mock clock that jumps ahead whenever every task sleeps."""
    async def main():
        with trio.fail_after(10_000):  # mock seconds: a hung take fails instead of hanging
            return await fn()
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_without_a_rate_nothing_waits():
    async def go():
        b = TokenBucket(None)
        for _ in range(10):
            await b.take(1 << 40)
        return trio.current_time()
    assert run_mock(go) == 0 and TokenBucket(None).burst == 0


@pytest.mark.parametrize("rate", [0, -1.0])
def test_a_rate_must_be_positive(rate):
    with pytest.raises(ValueError, match="expected bytes per second > 0"):
        TokenBucket(rate)


@pytest.mark.parametrize("rate, burst", [(1 << 20, 256 * KIB), (100 * KIB, 64 * KIB), (10 * KIB, 64 * KIB)])
def test_default_burst_is_a_quarter_second_and_at_least_64_kib(rate, burst):
    assert TokenBucket(rate).burst == burst


def test_the_burst_passes_at_once_and_the_rest_at_the_rate():
    async def go():
        b = TokenBucket(1000, burst=500)
        await b.take(500)
        t_burst = trio.current_time()
        await b.take(300)
        t_next = trio.current_time()
        for _ in range(7):
            await b.take(100)
        return t_burst, t_next, trio.current_time()
    t_burst, t_next, t_end = run_mock(go)
    assert t_burst == 0
    assert t_next == pytest.approx(0.3)
    assert t_end == pytest.approx(1.0)  # 1500 bytes, 500 of them burst, at 1000 B/s


def test_a_take_larger_than_the_burst_waits_off_its_debt():
    async def go():
        b = TokenBucket(1000, burst=100)
        await b.take(2100)  # 2000 bytes more than the burst
        first = trio.current_time()
        await b.take(100)  # nothing was left over: a full 0.1 s more
        return first, trio.current_time()
    first, second = run_mock(go)
    assert first == pytest.approx(2.0) and second == pytest.approx(2.1)


def test_idle_time_refills_at_most_the_burst():
    async def go():
        b = TokenBucket(1000, burst=100)
        await b.take(100)
        await trio.sleep(60)  # idle: 60000 bytes' worth of time, but the bucket holds 100
        t0 = trio.current_time()
        await b.take(600)
        return trio.current_time() - t0
    assert run_mock(go) == pytest.approx(0.5)


def test_zero_and_negative_takes_are_free():
    async def go():
        b = TokenBucket(1000, burst=1)
        await b.take(0)
        await b.take(-5)
        await b.take(1)
        return trio.current_time()
    assert run_mock(go) == 0


def test_concurrent_takers_are_served_in_arrival_order_at_the_shared_rate():
    async def go():
        b = TokenBucket(1000, burst=100)
        done = []

        async def taker(name, n):
            await b.take(n)
            done.append((name, round(trio.current_time(), 6)))

        async with trio.open_nursery() as n:
            for i, size in enumerate([300, 100, 200]):
                n.start_soon(taker, i, size)
                await trio.testing.wait_all_tasks_blocked()  # arrival order is start order
        return done
    # 600 bytes in all, 100 of them burst: the last one is done at 0.5 s; a small late
    # taker does not overtake a large early one
    assert run_mock(go) == [(0, 0.2), (1, 0.3), (2, 0.5)]


# ---------------------------------------------------------------- the two places that use it


async def _noop(s, msg) -> None:
    pass


def test_the_upload_limit_paces_the_pieces_a_member_serves(tmp_path):
    data = os.urandom(8 * PART_BYTES + 123)
    rate, burst = 256 * KIB, 64 * KIB
    peers = PeerSet("srv", store_with(tmp_path, [data]), TokenBucket(rate, burst), _noop)

    async def go():
        async with trio.open_nursery() as n:
            served, requester, _ = await connected_pair()
            n.start_soon(peers.run, served, False)
            await requester.send(wire.Request(1, False, 0))
            got, times = 0, []
            while got < len(data):
                msg = await requester.receive()
                if isinstance(msg, wire.Piece):
                    got += len(msg.data)
                    times.append(trio.current_time())
            n.cancel_scope.cancel()
        return times
    times = run_mock(go)
    # each part waits until it fits: the last one is out when everything past the burst has
    # passed at the rate (a part is taken whole before it is sent)
    assert times[-1] == pytest.approx((len(data) - burst) / rate)
    assert peers.bytes_out == len(data)


def test_the_download_limit_paces_what_a_member_reads():
    rate, burst = 128 * KIB, 64 * KIB
    payload = os.urandom(PART_BYTES)
    count = 6

    async def go():
        b = TokenBucket(rate, burst)
        sender, reader, _ = await connected_pair(on_receive=b.take)
        before = reader.counters.received
        t0 = trio.current_time()
        for i in range(count):
            await sender.send(wire.Piece(1, False, i, 0, len(payload), payload))
        for _ in range(count):
            assert isinstance(await reader.receive(), wire.Piece)
        return trio.current_time() - t0, reader.counters.received - before
    elapsed, wire_bytes = run_mock(go)
    # every byte read is taken from the bucket before it is parsed: the frames (payload plus
    # headers) past the burst pass at the rate, and the hellos already spent part of it
    assert wire_bytes > count * len(payload)
    assert (wire_bytes - burst) / rate <= elapsed + 1e-9
    assert elapsed == pytest.approx((wire_bytes - burst) / rate, rel=0.02)
