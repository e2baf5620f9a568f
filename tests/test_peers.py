"""PeerSet session bookkeeping: one session per peer id, open/close reported in order.

Runs over in-memory stream pairs (no TLS: PeerSet only sees MessageStreams).
"""

import trio
import trio.testing

from patchswarm.node.peers import PeerSet
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.store import ObjectStore
from patchswarm.node.net.transport import MessageStream
from patchswarm.protocol import wire


def _stream(stream, peer: str) -> MessageStream:
    ms = MessageStream(stream, peer, "node")
    ms.hello = wire.Hello(peer, "r0", "node", "127.0.0.1:1", [])
    return ms


async def _noop(s, msg) -> None:
    pass


def test_replaced_session_reports_close_before_the_new_open(tmp_path):
    """Both ends dialed at once; 'b' first registered its own outbound session, then the
    rule (keep the connection dialed by the smaller id, 'a') replaces it. The old
    session's late close must not report 'a' gone while the new session is live."""
    events: list[tuple[str, int]] = []
    ids: dict[int, int] = {}

    def tag(s) -> int:
        return ids.setdefault(id(s), len(ids))

    async def on_open(s):
        events.append(("open", tag(s)))

    async def on_close(s):
        events.append(("close", tag(s)))

    async def main():
        peers = PeerSet("b", ObjectStore(tmp_path / "store"), TokenBucket(None), _noop,
                        on_open=on_open, on_close=on_close)
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

    async def on_open(s):
        events.append(("open", s.outbound))

    async def on_close(s):
        events.append(("close", s.outbound))

    async def main():
        peers = PeerSet("b", ObjectStore(tmp_path / "store"), TokenBucket(None), _noop,
                        on_open=on_open, on_close=on_close)
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


def test_the_owner_closes_a_session_with_a_reason(tmp_path, caplog):
    """Session.close(reason) from outside the session (the daemon's failed send, the origin's
    failed store): the session ends now, the connection closes, the peer is reported gone once,
    and the log says why."""
    closed = []

    async def on_close(s):
        closed.append(s.close_reason)

    async def main():
        peers = PeerSet("b", ObjectStore(tmp_path / "store"), TokenBucket(None), _noop, on_close=on_close)
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
