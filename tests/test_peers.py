"""PeerSet session bookkeeping: one session per peer id, open/close reported in order.

Runs over in-memory stream pairs (no TLS: PeerSet only sees MessageStreams).
"""

import os

import pytest
import trio
import trio.testing

from memlink import KEY, connected_pair, store_with
from patchswarm.node.peers import CROSSING_SECONDS, REPLACED, SEND_TIMEOUT, PeerSet
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.store import ObjectStore
from patchswarm.node.net.transport import MessageStream, exchange_hello
from patchswarm.protocol import wire
from patchswarm.protocol.assembly import PART_BYTES
from patchswarm.protocol.picker import NODE, PiecePicker


def _stream(stream, peer: str) -> MessageStream:
    ms = MessageStream(stream, peer, "node")
    ms.hello = wire.Hello(peer, "r0", "node", "127.0.0.1:1", [])
    return ms


async def _noop(s, msg) -> None:
    pass


def _peers_b(tmp_path, on_open=None, on_close=None) -> PeerSet:
    """Member "b"'s PeerSet over an empty store, reporting sessions to the callbacks given."""
    return PeerSet("b", ObjectStore(tmp_path / "store"), TokenBucket(None), _noop, on_open=on_open, on_close=on_close)


def _recording(events: list, label, picker: PiecePicker | None = None):
    """on_open / on_close that append ("open" | "close", label(session)) to `events` and,
    with a picker, tell it the peer joined or left (as the daemon does)."""
    def on_open(s):
        events.append(("open", label(s)))
        if picker is not None:
            picker.peer_joined(s.id, NODE, s.region)

    def on_close(s):
        events.append(("close", label(s)))
        if picker is not None:
            picker.peer_left(s.id)

    return on_open, on_close


def test_replaced_session_reports_close_before_the_new_open(tmp_path):
    """Both ends dialed at once; 'b' first registered its own outbound session, then the
    rule (keep the connection dialed by the smaller id, 'a') replaces it. The old
    session's late close must not report 'a' gone while the new session is live."""
    events: list[tuple[str, int]] = []
    ids: dict[int, int] = {}

    def tag(s) -> int:
        return ids.setdefault(id(s), len(ids))

    async def main():
        peers = _peers_b(tmp_path, *_recording(events, tag))
        out_local, out_remote = trio.testing.memory_stream_pair()
        in_local, in_remote = trio.testing.memory_stream_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, _stream(out_local, "a"), True)
                await trio.testing.wait_all_tasks_blocked()
                assert events == [("open", 0)]
                nursery.start_soon(peers.run, _stream(in_local, "a"), False)
                await trio.testing.wait_all_tasks_blocked()
                assert events == [("open", 0), ("close", 0), ("open", 1)]
                assert peers.connected("a") and not peers.sessions["a"].outbound
                await in_remote.aclose()  # the kept connection ends
                await out_remote.aclose()
        assert events == [("open", 0), ("close", 0), ("open", 1), ("close", 1)]
        assert not peers.connected("a")

    trio.run(main)


def test_a_duplicate_that_loses_is_closed_and_reports_nothing(tmp_path):
    events = []

    async def main():
        peers = _peers_b(tmp_path, *_recording(events, lambda s: s.outbound))
        in_local, in_remote = trio.testing.memory_stream_pair()
        out_local, out_remote = trio.testing.memory_stream_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, _stream(in_local, "a"), False)
                await trio.testing.wait_all_tasks_blocked()
                # b's own dial arrives second and loses: run returns at once.
                await peers.run(_stream(out_local, "a"), True)
                assert events == [("open", False)]
                assert peers.connected("a") and not peers.sessions["a"].outbound
                await in_remote.aclose()
        assert events == [("open", False), ("close", False)]

    trio.run(main)


def test_a_member_that_dials_again_replaces_its_half_open_session(tmp_path):
    """After a network blip the member's old connection is half-open here (nothing sent on it,
    so nothing failed) and it dials again. Before: the old session was kept and every new
    connection closed, so the member was locked out for as long as the stale one lasted."""
    events: list = []

    async def main():
        peers = _peers_b(tmp_path, *_recording(events, lambda s: s.outbound))
        old_local, _old_remote = trio.testing.memory_stream_pair()  # the far end never closes it
        new_local, new_remote = trio.testing.memory_stream_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, _stream(old_local, "z"), False)
                await trio.testing.wait_all_tasks_blocked()
                old = peers.sessions["z"]
                nursery.start_soon(peers.run, _stream(new_local, "z"), False)
                await trio.testing.wait_all_tasks_blocked()
                assert peers.sessions["z"] is not old and old.closed and old.close_reason == REPLACED
                assert events == [("open", False), ("close", False), ("open", False)]
                assert peers.replaced == 1
                await new_remote.aclose()
        assert events[-1] == ("close", False) and not peers.connected("z")

    trio.run(main)


def test_a_dial_of_ours_older_than_a_crossing_is_replaced_by_the_members_dial(tmp_path):
    """This node ('b') dialed 'z' long ago; 'z' dials now, so 'z' lost that connection. Both
    dialing at once (within CROSSING_SECONDS) keeps the smaller id's dial, as before
    (tests/test_peers.py); past it, the member's new connection replaces the stale one."""
    events: list = []

    async def main():
        peers = _peers_b(tmp_path, *_recording(events, lambda s: s.outbound))
        out_local, _out_remote = trio.testing.memory_stream_pair()
        young_local, young_remote = trio.testing.memory_stream_pair()
        late_local, late_remote = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peers.run, _stream(out_local, "z"), True)
            await trio.testing.wait_all_tasks_blocked()
            mine = peers.sessions["z"]
            await peers.run(_stream(young_local, "z"), False)  # a crossing: 'b' < 'z', b's dial stays
            assert peers.sessions["z"] is mine and peers.replaced == 0
            await trio.sleep(CROSSING_SECONDS + 1)
            nursery.start_soon(peers.run, _stream(late_local, "z"), False)
            await trio.testing.wait_all_tasks_blocked()
            assert mine.closed and not peers.sessions["z"].outbound and peers.replaced == 1
            await late_remote.aclose()
        assert events == [("open", True), ("close", True), ("open", False), ("close", False)]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_owner_closes_a_session_with_a_reason(tmp_path, caplog):
    """Session.close(reason) from outside the session (the daemon's failed send, the origin's
    failed store): the session ends now, the connection closes, the peer is reported gone once,
    and the log says why."""
    closed = []

    def on_close(s):
        closed.append(s.close_reason)

    async def main():
        peers = _peers_b(tmp_path, on_close=on_close)
        local, remote = trio.testing.memory_stream_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, _stream(local, "a"), True)
                await trio.testing.wait_all_tasks_blocked()
                s = peers.sessions["a"]
                s.close("could not send a Request (broken)")
                s.close("a second reason")  # the first one stands
                await trio.testing.wait_all_tasks_blocked()
                assert not peers.connected("a") and s.closed
                assert await remote.receive_some() == b""  # the connection is closed
        assert closed == ["could not send a Request (broken)"]

    with caplog.at_level("WARNING", logger="patchswarm.peers"):
        trio.run(main)
    assert "left: could not send a Request (broken)" in caplog.text


def test_a_peer_that_takes_no_bytes_for_send_timeout_is_dropped(tmp_path):
    """A requester whose connection stops taking bytes (a stalled TCP window) while a piece
    is going out: after SEND_TIMEOUT on the (mock) clock the session ends and the peer is
    reported gone, instead of holding its serve task and the upload limit for ever."""
    closed = []

    def on_close(s):
        closed.append((s.id, s.close_reason, trio.current_time()))

    async def main():
        peers = PeerSet("srv", store_with(tmp_path / "store", [os.urandom(3 * PART_BYTES)]), TokenBucket(None),
                        _noop, on_close=on_close)
        served, requester, link = await connected_pair()
        with trio.fail_after(10 * SEND_TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, served, False)
                assert isinstance(await requester.receive(), wire.Have)
                link.stalled = True  # from now on nothing the server sends gets through
                start = trio.current_time()
                await requester.send(wire.Request(KEY[0], KEY[1], 0))
                while peers.connected("req"):
                    await trio.sleep(1)
        return start

    start = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    [(peer, reason, when)] = closed
    assert peer == "req" and reason == f"took no bytes for {SEND_TIMEOUT:.0f} s"
    assert when - start == pytest.approx(SEND_TIMEOUT, abs=1.0)


class _Through(trio.abc.Stream):
    """A stream that passes everything through to `inner` (the tests' wrappers change one call)."""

    def __init__(self, inner):
        self.inner = inner

    async def send_all(self, data):
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self):
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self):
        await self.inner.aclose()


class _SlowClose(_Through):
    """A stream whose close takes a while (a TLS close_notify to a peer that reads slowly:
    MessageStream.aclose gives it up to a second)."""

    async def aclose(self):
        with trio.CancelScope(shield=True):
            await trio.sleep(0.2)
        await self.inner.aclose()


def test_a_peer_that_reconnects_while_its_old_connection_closes_is_reported_gone_first(tmp_path):
    """The session owner's record of connected peers (the daemon's picker, here a real one)
    must see the old session gone before the new one opens. Before: the closed session left
    `sessions` and was reported gone only after its connection had closed, so a peer that
    reconnected within that time was reported open while still recorded, and the picker's
    UsageError ("already connected") ended the node (a WAN bench run, 2026-12-05)."""
    picker = PiecePicker("b", "r0", "r0")
    events = []

    async def main():
        peers = _peers_b(tmp_path, *_recording(events, lambda s: s.outbound, picker))
        old_local, old_remote = trio.testing.memory_stream_pair()
        new_local, new_remote = trio.testing.memory_stream_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, _stream(_SlowClose(old_local), "a"), False)
                await trio.testing.wait_all_tasks_blocked()
                await old_remote.aclose()  # the peer's process died; its old connection is closing
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(peers.run, _stream(new_local, "a"), True)  # and it is back
                await trio.testing.wait_all_tasks_blocked()
                assert events == [("open", False), ("close", False), ("open", True)]
                assert peers.connected("a") and picker.in_flight("a") == 0
                await new_remote.aclose()
        assert events[-1] == ("close", True) and not peers.connected("a")

    trio.run(main)


class _GreetingUnderWay(_Through):
    """A connection whose first write once `armed` is under way until `done` is set and then
    completes whatever was cancelled meanwhile, as a TLS write that reached the socket does
    (its last checkpoint is cancel-shielded: node/net/tlsstream.py)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.armed, self.held = False, 0
        self.done = trio.Event()

    async def send_all(self, data):
        if self.armed and not self.held:
            self.held += 1
            with trio.CancelScope(shield=True):
                await self.done.wait()
        await self.inner.send_all(data)


def test_a_session_replaced_while_its_greeting_goes_out_is_never_reported_open(tmp_path):
    """'srv' dialed 'req' and its session was sending its Have when req's own dial came in
    and replaced it (both dialed at once; the smaller id's dial is kept). The old session's
    Have then completed. Before: it went on to report 'req' open after the new session had,
    so the picker's UsageError ("already connected") ended the node (a WAN bench run,
    2026-12-06: n0.3 exited, n2.1 dropped the connection's handler)."""
    picker = PiecePicker("srv", "r1", "r1")
    events = []

    async def main():
        peers = PeerSet("srv", store_with(tmp_path / "store", [b"x" * 100]), TokenBucket(None), _noop,
                        on_open=None, on_close=None)
        peers._on_open, peers._on_close = _recording(events, lambda s: s.outbound, picker)
        a, b = trio.testing.memory_stream_pair()
        greeting = _GreetingUnderWay(a)
        dialed, far_end = MessageStream(greeting, "req", "node"), MessageStream(b, "srv", "node")
        async with trio.open_nursery() as n:
            n.start_soon(exchange_hello, dialed, wire.Hello("srv", "r1", "node", "x:1", []))
            n.start_soon(exchange_hello, far_end, wire.Hello("req", "r1", "node", "x:2", []))
        greeting.armed = True
        served, requester, _ = await connected_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, dialed, True)
                try:
                    await trio.testing.wait_all_tasks_blocked()
                    assert greeting.held == 1 and events == []  # its Have is under way
                    nursery.start_soon(peers.run, served, False)  # replaces it
                    await trio.testing.wait_all_tasks_blocked()
                    assert events[-1:] == [("open", False)] and peers.replaced == 1
                finally:
                    greeting.done.set()  # the replaced session's Have completes
                await trio.testing.wait_all_tasks_blocked()
                # The replaced session was never open, so it was reported neither open nor gone.
                assert events == [("open", False)] and not peers.sessions["req"].outbound
                await requester.aclose()
        assert events == [("open", False), ("close", False)] and not peers.connected("req")

    trio.run(main)


class _ReadUnderWay(_Through):
    """A connection whose reads, once `armed`, are under way until `arrived` is set and then
    complete whatever was cancelled meanwhile, as a read of a message already in (trio's
    MessageStream yields once per message and does not lose it to a cancel); its close takes
    until `closed` is set (a TLS close_notify to a peer that reads slowly)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.armed = False
        self.arrived, self.closed = trio.Event(), trio.Event()

    async def receive_some(self, max_bytes=None):
        if not self.armed:
            return await self.inner.receive_some(max_bytes)
        with trio.CancelScope(shield=True):
            await self.arrived.wait()
            return await self.inner.receive_some(max_bytes)

    async def aclose(self):
        with trio.CancelScope(shield=True):
            await self.closed.wait()
        await self.inner.aclose()


async def _hello_pair(wrap=lambda stream: stream) -> tuple[MessageStream, MessageStream]:
    """(member "req" as a PeerSet "srv" sees it, over `wrap` of one end; req's end), after Hello."""
    a, b = trio.testing.memory_stream_pair()
    served, requester = MessageStream(wrap(a), "req", "node"), MessageStream(b, "srv", "node")
    async with trio.open_nursery() as n:
        n.start_soon(exchange_hello, served, wire.Hello("srv", "r1", "node", "x:1", []))
        n.start_soon(exchange_hello, requester, wire.Hello("req", "r1", "node", "x:2", []))
    return served, requester


def test_a_message_read_as_its_session_is_replaced_goes_nowhere(tmp_path):
    """A member's Have was being read on its old session when its new connection replaced
    that session, whose close then took a while. Before: the read completed (not lost to the
    cancel), and the Have went to the owner for a peer it had just been told was gone: the
    picker's UsageError ("has not joined") failed the connection's handler (a WAN bench run,
    2026-12-06, n0.4). Now what a closed session reads goes nowhere."""
    picker = PiecePicker("srv", "r1", "r1")
    events, announced = [], []

    async def on_message(s, msg):  # as the daemon's: an announcement goes to the picker
        announced.append(msg)
        picker.peer_has(s.id, (msg.version, msg.keyframe), [0])

    async def main():
        peers = PeerSet("srv", ObjectStore(tmp_path / "store"), TokenBucket(None), on_message)
        peers._on_open, peers._on_close = _recording(events, lambda s: s.ms is old, picker)
        streams = []
        old, old_far = await _hello_pair(lambda st: streams.append(_ReadUnderWay(st)) or streams[-1])
        new, new_far = await _hello_pair()
        slow = streams[0]
        slow.armed = True
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, old, False)
                try:
                    await trio.testing.wait_all_tasks_blocked()
                    assert events == [("open", True)]
                    await old_far.send(wire.Have(KEY[0], KEY[1], wire.bitfield_from_indices([0], 1)))
                    nursery.start_soon(peers.run, new, False)  # replaces it, and waits for its close
                    await trio.testing.wait_all_tasks_blocked()
                    assert events == [("open", True), ("close", True)] and peers.replaced == 1
                    slow.arrived.set()  # the old session's read completes
                    await trio.testing.wait_all_tasks_blocked()
                    assert announced == []  # it went nowhere
                finally:
                    slow.arrived.set()
                    slow.closed.set()
                await trio.testing.wait_all_tasks_blocked()
                assert events == [("open", True), ("close", True), ("open", False)]
                await new_far.aclose()
        assert events[-1] == ("close", False) and not peers.connected("req")

    trio.run(main)


@pytest.mark.parametrize("tail, reason, kind", [
    (b"\x00\x00\x01\x00" + b"h" * 100, "connection lost (it ended inside a frame)", None),
    (b"\x00\x00\x00\x02\xc1\xc1", "protocol error", "protocol error"),  # a whole frame, not msgpack
])
def test_a_peer_whose_stream_ends_inside_a_frame_is_a_lost_connection(tmp_path, caplog, tail, reason, kind):
    """A member killed while it sent a frame leaves its connection ending mid-frame (its kernel
    sends a FIN). Before: counted in peers_dropped as a "protocol error" (the chaos bench's kills
    did so), which sent an operator looking for a bad peer; now a lost connection, like a reset.
    A whole frame that does not decode is still a protocol error."""
    closed = []

    async def main():
        peers = _peers_b(tmp_path, on_close=lambda s: closed.append(s.close_reason))
        served, requester = await _hello_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, served, False)
                await trio.testing.wait_all_tasks_blocked()
                await requester.stream.send_all(tail)
                await requester.stream.aclose()
        return peers

    with caplog.at_level("WARNING", logger="patchswarm.peers"):
        peers = trio.run(main)
    [why] = closed
    assert why.startswith(reason), why
    assert dict(peers.dropped) == ({kind: 1} if kind else {})
    assert f"left: {why}" in caplog.text


@pytest.mark.parametrize("uplink_mbit, part", [(None, PART_BYTES), (100, PART_BYTES), (1000, 256 << 10),
                                               (10_000, 1 << 20)])
def test_a_held_chunk_goes_out_in_parts_sized_to_the_declared_uplink(tmp_path, uplink_mbit, part):
    """The served parts of a 3 MiB + 5 chunk: each of the member's part size but the last,
    in order, and whole together (the receiver assembles any sizes)."""
    data = os.urandom((3 << 20) + 5)

    async def main():
        peers = PeerSet("srv", store_with(tmp_path / "store", [data]), TokenBucket(None), _noop)
        peers.declared_uplink_mbit = uplink_mbit
        assert peers.part_bytes == part
        served, requester, _ = await connected_pair()
        got = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.run, served, False)
                assert isinstance(await requester.receive(), wire.Have)
                await requester.send(wire.Request(KEY[0], KEY[1], 0))
                while sum(len(p.data) for p in got) < len(data):
                    got.append(await requester.receive())
                nursery.cancel_scope.cancel()
        return got

    got = trio.run(main)
    assert [p.offset for p in got] == list(range(0, len(data), part))
    assert all(len(p.data) == part for p in got[:-1]) and b"".join(bytes(p.data) for p in got) == data
