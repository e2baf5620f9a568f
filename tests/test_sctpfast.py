"""node/net/sctpfast.py: aiortc's SCTP sped up must do what stock aiortc does.

Reassembly and received-TSN bookkeeping against aiortc's own code on random
arrival orders (hypothesis); then real peer connections on loopback: a
sped-up peer against a stock one both ways, and both sped up, with the
packets each receives reordered and some dropped, every byte arriving
bit-exactly and in order."""

from __future__ import annotations

import asyncio
import random

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("aiortc")

from aiortc import rtcsctptransport as sctpmod  # noqa: E402

from patchswarm.node.net import sctpfast  # noqa: E402
from patchswarm.node.net.transport import MessageStream  # noqa: E402
from patchswarm.node.net.webrtc import IceConfig, RTCLoop  # noqa: E402
from patchswarm.protocol import wire  # noqa: E402
from test_webrtc import exchange  # noqa: E402

LOOPBACK = IceConfig(host_addresses=("127.0.0.1",))
pytestmark = pytest.mark.skipif(not sctpfast.supported(), reason="aiortc version not one sctpfast was checked against")


def _chunks(sizes: list[int], first_tsn: int, unordered: set[int]) -> list:
    """DATA chunks of messages with `sizes` fragments each, on stream 0, TSNs from first_tsn."""
    out, tsn = [], first_tsn
    for seq, n in enumerate(sizes):
        for i in range(n):
            c = sctpmod.DataChunk()
            c.flags = (sctpmod.SCTP_DATA_FIRST_FRAG if i == 0 else 0) | (sctpmod.SCTP_DATA_LAST_FRAG if i == n - 1 else 0)
            if seq in unordered:
                c.flags |= sctpmod.SCTP_DATA_UNORDERED
            c.tsn, c.stream_id, c.stream_seq, c.protocol = tsn, 0, 0 if seq in unordered else seq, 53
            c.user_data = bytes([seq % 256, i % 256])
            out.append(c)
            tsn = (tsn + 1) % 2 ** 32
    return out


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
       first_tsn=st.sampled_from([0, 7, 2 ** 32 - 5]),  # 2**32 - 5: TSNs wrap inside the run
       unordered=st.sets(st.integers(0, 7), max_size=3),
       seed=st.integers(0, 2 ** 16), local_swaps=st.booleans())
def test_reassembly_delivers_what_aiortc_delivers_in_any_arrival_order(sizes, first_tsn, unordered, seed, local_swaps):
    # Only ordered messages reach a stream's sequence numbers: renumber them 0, 1, 2...
    chunks, seqs = _chunks(sizes, first_tsn, unordered), {}
    for c in chunks:
        if not c.flags & sctpmod.SCTP_DATA_UNORDERED:
            c.stream_seq = seqs.setdefault(c.user_data[0], len(seqs))
    rng = random.Random(seed)
    order = list(chunks)
    if local_swaps:  # what a network does: neighbours swapped
        for i in range(len(order) - 1):
            if rng.random() < 0.3:
                order[i], order[i + 1] = order[i + 1], order[i]
    else:
        rng.shuffle(order)
    stock, fast = sctpmod.InboundStream(), sctpfast._inbound_stream_class()()
    for c in order:
        stock.add_chunk(c)
        fast.add_chunk(c)
        assert list(fast.pop_messages()) == list(stock.pop_messages())
        assert [x.tsn for x in fast.reassembly] == [x.tsn for x in stock.reassembly]
        assert fast.sequence_number == stock.sequence_number


def _transport():
    from aiortc import RTCCertificate, RTCDtlsTransport, RTCIceGatherer, RTCIceTransport
    return sctpmod.RTCSctpTransport(RTCDtlsTransport(RTCIceTransport(RTCIceGatherer()),
                                                     [RTCCertificate.generateCertificate()]))


@settings(max_examples=200, deadline=None)
@given(start=st.sampled_from([100, 2 ** 32 - 3]),  # 2**32 - 3: TSNs wrap inside the run
       steps=st.lists(st.one_of(st.none(), st.integers(-3, 8)), min_size=1, max_size=40))
def test_received_tsns_are_booked_as_aiortc_books_them(start, steps):
    async def main():
        stock, fast = _transport(), _transport()
        assert sctpfast.speed_up(fast)
        for t in (stock, fast):
            t._last_received_tsn = start
        for step in steps:  # None: the next TSN in order; else ahead (a gap) or behind (a duplicate)
            base = stock._last_received_tsn
            tsn = (base + (1 if step is None else step)) % 2 ** 32
            assert fast._mark_received(tsn) == stock._mark_received(tsn)
            assert fast._last_received_tsn == stock._last_received_tsn
            assert fast._sack_misordered == stock._sack_misordered
            assert fast._sack_duplicates == stock._sack_duplicates

    asyncio.run(main())


def test_unsupported_aiortc_is_left_stock(monkeypatch):
    async def main():
        t = _transport()
        monkeypatch.setattr(sctpfast, "SUPPORTED", ("0.1",))
        assert not sctpfast.supported() and not sctpfast.speed_up(t, receive_window=1 << 16)
        assert not {"_transmit", "_mark_received", "_receive_sack_chunk"} & set(vars(t))
        assert t._advertised_rwnd == 1 << 20  # aiortc's own

    asyncio.run(main())


def _disorder(sctp, rng: random.Random, drop: float, seen: dict):
    """Reorder the packets `sctp` receives (held a few at a time, shuffled) and drop
    some: what a WAN path may do, on loopback. Counts into `seen`. Returns `undo`, to
    run in the loop before the peers close: it puts the real handler back and delivers
    what is held (a flush task made as the loop closed never ran, and its coroutine was
    reported never awaited)."""
    real, held = sctp._handle_data, []
    loop = asyncio.get_running_loop()
    held_order: list[bytes] = []
    flushes: set[asyncio.Task] = set()
    on = [True]

    async def flush() -> None:
        batch = held[:]
        held.clear()
        rng.shuffle(batch)
        seen["reordered"] += batch != sorted(batch, key=held_order.index)
        for data in batch:
            await real(data)

    async def handle(data: bytes) -> None:
        if rng.random() < drop:
            seen["dropped"] += 1
            return
        held.append(data)
        held_order.append(data)
        del held_order[:-64]
        if len(held) == 1:
            loop.call_later(0.002, flush_later)
        elif len(held) >= 5:
            await flush()

    def flush_later() -> None:
        if on[0]:
            task = loop.create_task(flush())
            flushes.add(task)
            task.add_done_callback(flushes.discard)

    async def undo() -> None:
        on[0] = False
        sctp._handle_data = real
        await flush()
        while flushes:
            await asyncio.gather(*flushes)

    sctp._handle_data = handle
    return undo


async def _open_pair(rtc, fast_a: bool, fast_b: bool):
    """Two peers of `rtc` connected on loopback, and their open streams."""
    a, b = rtc.peer(fast_a), rtc.peer(fast_b)
    await a.accept_answer(await b.local_answer(await a.local_offer()))
    with trio.fail_after(20):
        sa, sb = await a.open(), await b.open()
    return a, b, sa, sb


async def _send_and_check(fast_a: bool, fast_b: bool, disorder: bool, total: int) -> None:
    rng = random.Random(f"{fast_a}{fast_b}{disorder}")
    msgs, size = [], 0
    while size < total:  # sizes around a packet's payload (1,172 B) and a channel message (64 KiB)
        n = rng.choice([1, 1172, 1173, 16 << 10, 65536, 200_001])
        msgs.append(wire.Piece(len(msgs), False, len(msgs), 0, n, rng.randbytes(n)))
        size += n
    async with RTCLoop(LOOPBACK) as rtc:
        a, b, sa, sb = await _open_pair(rtc, fast_a, fast_b)
        seen = {"dropped": 0, "reordered": 0}
        undos = [await rtc.run(_disorder_in_loop(peer, rng, 0.01, seen)) for peer in (a, b)] if disorder else []
        ma, mb = MessageStream(sa, "b", "node"), MessageStream(sb, "a", "node")
        got_b, got_a = await exchange(ma, mb, msgs, msgs[::-1], seconds=180)
        assert got_b == msgs and got_a == msgs[::-1]  # every byte, in order, both ways
        if disorder:
            assert seen["dropped"] and seen["reordered"], seen
        for undo in undos:
            await rtc.run(undo())
        await ma.aclose()
        await mb.aclose()


async def _disorder_in_loop(peer, rng, drop, seen):
    return _disorder(peer._pc.sctp, rng, drop, seen)


@pytest.mark.slow
@pytest.mark.parametrize("fast_a,fast_b", [(True, False), (False, True), (True, True)],
                         ids=["fast-to-stock", "stock-to-fast", "fast-to-fast"])
def test_a_sped_up_peer_and_a_stock_peer_exchange_bit_exactly(fast_a, fast_b):
    trio.run(_send_and_check, fast_a, fast_b, False, 4 << 20)


@pytest.mark.slow
@pytest.mark.parametrize("fast_a,fast_b", [(True, False), (True, True)], ids=["fast-with-stock", "fast-to-fast"])
def test_reordered_and_lossy_packets_still_arrive_bit_exactly_in_order(fast_a, fast_b):
    trio.run(_send_and_check, fast_a, fast_b, True, 1 << 20)


def _spied(sack_every: int):
    """A sped-up transport whose sent chunks are recorded instead of sent."""
    t = _transport()
    sent: list = []

    async def send_chunk(chunk) -> None:
        sent.append(chunk)

    t._send_chunk = send_chunk
    assert sctpfast.speed_up(t, sack_every=sack_every)
    t._last_received_tsn = 41
    return t, sent


def _queued(t, n: int) -> None:
    """n datagrams waiting in the ICE connection's queue, as after a batched read."""
    queue = t.transport.transport._connection._queue
    while not queue.empty():
        queue.get_nowait()
    for _ in range(n):
        queue.put_nowait((b"\x17", 1))


def test_one_sack_answers_a_queued_run_of_packets():
    async def main():
        t, sent = _spied(sack_every=4)
        for left in (5, 4, 3):  # three packets handled, more queued behind each
            _queued(t, left)
            t._sack_needed = True
            await t._send_sack()
        assert sent == []
        _queued(t, 2)
        t._sack_needed = True
        await t._send_sack()  # the 4th packet: at most sack_every before a SACK
        assert [type(c).__name__ for c in sent] == ["SackChunk"]
        for left in (1, 0):
            _queued(t, left)
            t._sack_needed = True
            await t._send_sack()
        assert len(sent) == 2  # the last of the run (nothing queued) is acknowledged at once
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(sent) == 2  # and the flush scheduled for the deferred ones finds nothing owed

    asyncio.run(main())


def test_gaps_and_duplicates_are_acknowledged_at_once():
    async def main():
        for field, value in (("_sack_misordered", {45}), ("_sack_duplicates", [40])):
            t, sent = _spied(sack_every=8)
            _queued(t, 5)
            setattr(t, field, value)
            t._sack_needed = True
            await t._send_sack()
            assert len(sent) == 1, field  # RFC 9260 6.7: a gap or duplicate is reported at once

    asyncio.run(main())


def test_a_deferred_sack_is_sent_on_the_next_turn_when_the_run_ends_without_data():
    async def main():
        t, sent = _spied(sack_every=8)
        _queued(t, 1)  # what is queued turns out not to be a DATA packet: no _send_sack follows
        t._sack_needed = True
        await t._send_sack()
        assert sent == []
        for _ in range(3):
            await asyncio.sleep(0)
        assert [type(c).__name__ for c in sent] == ["SackChunk"] and not t._sack_needed

    asyncio.run(main())


def test_one_sack_per_packet_when_asked():
    async def main():
        t, sent = _spied(sack_every=1)
        for left in (3, 2, 1):
            _queued(t, left)
            t._sack_needed = True
            await t._send_sack()
        assert len(sent) == 3

    asyncio.run(main())


def test_a_sped_up_sender_refills_what_one_sack_frees():
    async def main():
        t, sent = _spied(sack_every=sctpfast.SACK_EVERY)
        for tsn in range(40):
            c = sctpmod.DataChunk()
            c.tsn, c.user_data = tsn, bytes(sctpmod.USERDATA_MAX_LENGTH)
            # what aiortc's _send sets on each chunk it queues
            c._abandoned = c._acked = c._in_flight = c._retransmit = False
            c._book_size, c._expiry, c._max_retransmits = len(c.user_data), None, None
            c._misses, c._sent_count, c._sent_time = 0, 0, None
            t._outbound_queue.append(c)
        t._cwnd = 100 * sctpmod.USERDATA_MAX_LENGTH  # the window is open; the burst rule decides
        await t._transmit()
        # One SACK of a sped-up receiver frees up to SACK_EVERY packets: all go back in flight.
        assert len(sent) == sctpfast.MAX_BURST >= sctpfast.SACK_EVERY
        t._t3_cancel()

    asyncio.run(main())


@pytest.mark.slow
def test_a_sped_up_receiver_sends_fewer_sacks_than_packets():
    async def main():
        counts = {}
        for fast in (False, True):
            async with RTCLoop(LOOPBACK) as rtc:
                a, b, sa, sb = await _open_pair(rtc, True, fast)
                seen = {"data": 0, "sack": 0}
                await rtc.run(_count_in_loop(b._pc.sctp, seen))
                ma, mb = MessageStream(sa, "b", "node"), MessageStream(sb, "a", "node")
                msgs = [wire.Piece(i, False, i, 0, 65536, bytes([i]) * 65536) for i in range(64)]
                got, _ = await exchange(ma, mb, msgs, [], seconds=60)
                assert got == msgs
                counts[fast] = dict(seen)
                await ma.aclose()
                await mb.aclose()
        stock, fast = counts[False], counts[True]
        assert stock["sack"] >= 0.9 * stock["data"], stock  # aiortc: one per packet
        assert fast["sack"] <= 0.6 * fast["data"], fast  # bursts answered by one SACK

    trio.run(main)


async def _count_in_loop(sctp, seen) -> None:
    real_handle, real_send = sctp._handle_data, sctp._send_chunk

    async def handle(data: bytes) -> None:
        seen["data"] += 1
        await real_handle(data)

    async def send_chunk(chunk) -> None:
        seen["sack"] += isinstance(chunk, sctpmod.SackChunk)
        await real_send(chunk)

    sctp._handle_data, sctp._send_chunk = handle, send_chunk


def _in_flight(t, count: int, first_tsn: int = 1000) -> None:
    """`count` full DATA chunks sent and unacknowledged, the window exactly full."""
    for tsn in range(first_tsn, first_tsn + count):
        c = sctpmod.DataChunk()
        c.tsn, c.user_data = tsn, bytes(sctpmod.USERDATA_MAX_LENGTH)
        c._abandoned = c._acked = c._retransmit = False
        c._in_flight, c._book_size, c._expiry, c._max_retransmits = True, len(c.user_data), None, None
        c._misses, c._sent_count, c._sent_time = 0, 1, 0.0
        t._sent_queue.append(c)
    t._flight_size = t._cwnd = count * sctpmod.USERDATA_MAX_LENGTH
    t._last_sacked_tsn = t._advanced_peer_ack_tsn = first_tsn - 1  # (aiortc's start values are random)


@pytest.mark.parametrize("fast", [False, True], ids=["stock", "sped-up"])
def test_slow_start_grows_by_what_a_stretched_sack_acknowledges(fast):
    async def main():
        t = _transport()
        sent = []

        async def send_chunk(chunk) -> None:
            sent.append(chunk)

        t._send_chunk = send_chunk
        if fast:
            assert sctpfast.speed_up(t)
        mtu = sctpmod.USERDATA_MAX_LENGTH
        _in_flight(t, 8)
        t._ssthresh = 1 << 20  # slow start
        sack = sctpmod.SackChunk()
        sack.cumulative_tsn, sack.advertised_rwnd = 1007, 1 << 20  # the 8 packets, one SACK
        await t._receive_sack_chunk(sack)
        # aiortc: one packet's growth per SACK; sped up: the 8 acknowledged, as 8 SACKs would give.
        assert t._cwnd == 8 * mtu + (8 * mtu if fast else mtu)
        assert sent == []  # nothing queued to send
        t._t3_cancel()

    asyncio.run(main())


def test_stretched_growth_stays_within_the_peer_window_and_out_of_recovery():
    async def main():
        mtu = sctpmod.USERDATA_MAX_LENGTH
        t, _ = _spied(sack_every=sctpfast.SACK_EVERY)  # its INIT ACK is recorded, not sent
        init = sctpmod.InitChunk()
        init.advertised_rwnd, init.outbound_streams, init.inbound_streams, init.initial_tsn = 12 * mtu, 65535, 65535, 0
        init.initiate_tag, init.params = 1, []
        await t._receive_chunk(init)  # the sped-up handler records the peer's window from INIT
        _in_flight(t, 8)
        t._ssthresh = 1 << 20
        sack = sctpmod.SackChunk()
        sack.cumulative_tsn, sack.advertised_rwnd = 1007, 1 << 20
        await t._receive_sack_chunk(sack)
        assert t._cwnd == 12 * mtu  # the peer announced 12 packets' room
        t._t3_cancel()

        t, _ = _spied(sack_every=sctpfast.SACK_EVERY)
        _in_flight(t, 8)
        t._ssthresh, t._fast_recovery_exit = 1 << 20, 2000  # in fast recovery aiortc does not grow
        sack = sctpmod.SackChunk()
        sack.cumulative_tsn, sack.advertised_rwnd = 1007, 1 << 20
        await t._receive_sack_chunk(sack)
        assert t._cwnd == 8 * mtu
        t._t3_cancel()

    asyncio.run(main())
