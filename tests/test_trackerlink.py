"""node/net/trackerlink.py: what a member says when it loses the tracker (over memory streams, not TLS)."""

import logging

import pytest
import trio
import trio.testing

from patchswarm.node.net import trackerlink
from patchswarm.node.net.trackerlink import TrackerLink
from patchswarm.node.net.transport import MessageStream, exchange_hello
from patchswarm.protocol import wire


@pytest.mark.parametrize("stopping", [True, False, "draining"])
def test_a_tracker_lost_as_the_member_stops_is_no_warning(monkeypatch, caplog, stopping):
    """The tracker closes its connection in the same moment as this member is told to stop
    (a demo's or a fleet's shutdown signals both): the loss, read before the stop's cancel
    reached the link, was logged as a WARNING ("lost the tracker ...; reconnecting") on every
    such shutdown (`make demo`'s node logs). Now it is INFO; a loss while the member runs on
    is still a WARNING. "draining": the member is stopping but uploads its spool first (node
    daemon's drain, which sets `stopping`); the loss comes before any cancel, and a demo's
    shutdown logged it as a WARNING again until the drain told the link."""
    far = []

    async def fake_connect(addr, creds, roles, hello):  # the Hellos exchanged, over memory
        a, b = trio.testing.memory_stream_pair()
        near, tracker = MessageStream(a, "tracker1", "tracker"), MessageStream(b, "n1", "node")
        async with trio.open_nursery() as n:
            n.start_soon(exchange_hello, near, hello)
            n.start_soon(exchange_hello, tracker, wire.Hello("tracker1", "r0", "tracker", "", []))
        far.append(b)
        return near

    async def nothing(msg):
        pass

    monkeypatch.setattr(trackerlink, "connect", fake_connect)
    link = TrackerLink("127.0.0.1:1", None, lambda: wire.Hello("n1", "r0", "node", "", []), nothing)

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(link.run)
                await trio.testing.wait_all_tasks_blocked()
                link.stopping = stopping == "draining"
                far[0].send_stream.close()  # the tracker stopped: EOF ...
                if stopping is not True:
                    await trio.testing.wait_all_tasks_blocked()
                n.cancel_scope.cancel()  # ... as this member stops, or later

    with caplog.at_level("INFO", logger="patchswarm.tracker-link"):
        trio.run(main)
    [lost] = [r for r in caplog.records if r.getMessage().startswith("lost the tracker")]
    assert lost.levelno == (logging.INFO if stopping else logging.WARNING), lost.getMessage()
    assert ("reconnecting" in lost.getMessage()) is not bool(stopping)
    assert "tracker closed the connection" in lost.getMessage()
