"""WebRTC data channels (node/net/webrtc.py) on loopback, in one process: wire messages
through `MessageStream` exactly as over TLS, split and reassembled, with backpressure."""

from __future__ import annotations

import random

import pytest
import trio

from patchswarm.protocol import wire
from patchswarm.node.net.transport import MessageStream
from patchswarm.node.net.webrtc import MESSAGE_BYTES, IceConfig, RTCLoop, sdp_candidates, sdp_fingerprints

pytest.importorskip("aiortc")

LOOPBACK = IceConfig(host_addresses=("127.0.0.1",))
OPEN_SECONDS = 20


async def pair(rtc: RTCLoop):
    """Two connected peers of `rtc`, the SDP carried by hand (what the tracker relays)."""
    a, b = rtc.peer(), rtc.peer()
    offer = await a.local_offer()
    answer = await b.local_answer(offer)
    await a.accept_answer(answer)
    with trio.fail_after(OPEN_SECONDS):
        sa, sb = await a.open(), await b.open()
    return a, b, sa, sb


def test_no_ice_server_unless_configured():
    assert IceConfig().servers() == []  # [] and not None: None is aiortc's public STUN default
    servers = IceConfig(stun="10.0.0.1:3478", turn="10.0.0.2:3478", turn_user="u", turn_password="p").servers()
    assert [s.urls for s in servers] == ["stun:10.0.0.1:3478", "turn:10.0.0.2:3478"]
    assert (servers[1].username, servers[1].credential) == ("u", "p")


def test_offer_has_loopback_host_candidates_only_and_a_fingerprint():
    async def main():
        async with RTCLoop(LOOPBACK) as rtc:
            peer = rtc.peer()
            sdp = await peer.local_offer()
            await peer.aclose()
        cands = sdp_candidates(sdp)
        assert cands and {(addr, typ) for addr, _, typ in cands} == {("127.0.0.1", "host")}
        fps = sdp_fingerprints(sdp)
        assert fps and all(alg.startswith("sha-") and len(v.split(":")) >= 32 for alg, v in fps)

    trio.run(main)


def _pieces(rng: random.Random, n: int) -> list[wire.Piece]:
    out = []
    for i in range(n):
        # Log-uniform sizes from 0 B to 4x a data-channel message: most frames fit one
        # message, many are split across several, some end exactly on a boundary.
        size = rng.choice([0, 1, MESSAGE_BYTES - 9, MESSAGE_BYTES, 3 * MESSAGE_BYTES + 1,
                           int(2 ** rng.uniform(0, 18))])
        out.append(wire.Piece(i, bool(i & 1), i % 97, 0, size, rng.randbytes(size)))
    return out


@pytest.mark.slow
async def exchange(ma: MessageStream, mb: MessageStream, to_b: list, to_a: list, seconds: float) -> tuple[list, list]:
    """A Hello and then `to_b` from ma to mb, and `to_a` the other way, at once; what each end received."""
    got_b, got_a = [], []

    async def send(ms, msgs):
        await ms.send(wire.Hello("x", "r", "node", "", []))
        for m in msgs:
            await ms.send(m)

    async def receive(ms, into, n):
        assert isinstance(await ms.receive(), wire.Hello)
        while len(into) < n:
            into.append(await ms.receive())

    with trio.fail_after(seconds):
        async with trio.open_nursery() as n:
            n.start_soon(send, ma, to_b)
            n.start_soon(send, mb, to_a)
            n.start_soon(receive, mb, got_b, len(to_b))
            n.start_soon(receive, ma, got_a, len(to_a))
    return got_b, got_a


def test_loopback_pair_exchanges_1000_messages_both_ways_bit_exactly():
    rng = random.Random(22)
    to_b, to_a = _pieces(rng, 1000), _pieces(rng, 1000)

    async def main():
        async with RTCLoop(LOOPBACK) as rtc:
            a, b, sa, sb = await pair(rtc)
            ma, mb = MessageStream(sa, "b", "node"), MessageStream(sb, "a", "node")
            got_b, got_a = await exchange(ma, mb, to_b, to_a, seconds=240)
            assert got_b == to_b and got_a == to_a
            assert a.path() == b.path() == "direct"
            await ma.aclose()
            with trio.fail_after(10):
                assert await mb.receive() is None  # the other end sees a clean close
            await mb.aclose()

    trio.run(main)


def test_a_changed_fingerprint_fails_the_dtls_handshake():
    """What makes a signed fingerprint worth signing: DTLS accepts only the certificate the SDP names."""
    async def main():
        async with RTCLoop(LOOPBACK) as rtc:
            a, b = rtc.peer(), rtc.peer()
            offer = await a.local_offer()
            answer = await b.local_answer(offer)
            (alg, fp), = sdp_fingerprints(answer)[:1]
            other = ":".join("00" for _ in fp.split(":"))
            forged = answer.replace(fp, other).replace(fp.lower(), other)
            assert forged != answer
            await a.accept_answer(forged)
            with pytest.raises((ConnectionError, trio.TooSlowError)):
                with trio.fail_after(OPEN_SECONDS):
                    await a.open()
            await a.aclose()
            await b.aclose()

    trio.run(main)


def test_a_peer_cannot_make_a_data_channel_buffer_more_than_its_cap(monkeypatch):
    """A TCP peer that sends while this member does not read fills the kernel's socket buffer
    and then waits. A data channel has no such bound: aiortc hands on every message as it
    arrives, and the stream queued each for its reader, without limit. Pulled pieces are
    bounded by the requests in flight, but a hostile member pushes whatever it likes (Cancels
    for nothing cost no budget) while the reader is slower than the link or waits (the
    download limit, a manifest checked in a thread): the queue grew by what the link carries
    until the process ran out of memory. Now a stream holding more than MAX_UNREAD bytes
    nobody has read fails like a broken connection, and the member's session ends."""
    from patchswarm.node.net import webrtc

    cap = 1 << 20
    monkeypatch.setattr(webrtc, "MAX_UNREAD", cap)

    async def main():
        async with RTCLoop(LOOPBACK) as rtc:
            a, b, sa, sb = await pair(rtc)
            most = 0

            async def push():
                with pytest.raises(trio.BrokenResourceError):
                    with trio.fail_after(30):
                        while True:  # until b gives up on the channel
                            await sa.send_all(bytes(webrtc.MESSAGE_BYTES))

            async with trio.open_nursery() as n:
                n.start_soon(push)
                with trio.fail_after(10):  # before the cap: it grew by whatever the link carried
                    while sb._ended is None:
                        most = max(most, sum(map(len, sb._chunks)))
                        await trio.sleep(0.005)
            assert most <= cap + webrtc.MESSAGE_BYTES and "not read" in sb._ended
            with pytest.raises(trio.BrokenResourceError):
                await sb.receive_some()
            await a.aclose()
            await b.aclose()

    trio.run(main)
