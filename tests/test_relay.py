"""Serving a chunk while it still arrives (cut-through): PeerSet with Inflows.

A relay's PeerSet runs over an in-memory stream pair; the test plays the
requesting peer with a plain MessageStream and feeds the relay's Inflows by
hand, part by part, as the daemon does when pieces arrive from upstream.
"""

import os

import pytest
import trio
import trio.testing

from patchswarm.node.peers import PeerSet
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.relay import PARTIALS_KEPT, Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.node.net.transport import MessageStream, exchange_hello
from patchswarm.protocol import wire
from patchswarm.protocol.assembly import PART_BYTES
from patchswarm.protocol.errors import ProtocolError

KEY = (1, False)
UPSTREAM = "up"


async def _noop(s, msg) -> None:
    pass


class Relay:
    """The relay's PeerSet, a connected requester, and the chunks of one object."""

    def __init__(self, tmp_path, chunks: list[bytes]):
        self.chunks = chunks
        self.store = ObjectStore(tmp_path / "store")
        self.inflows = Inflows()
        self.peers = PeerSet("relay", self.store, TokenBucket(None), _noop, inflows=self.inflows)
        self.requester: MessageStream | None = None

    async def connect(self, nursery, name: str = "req") -> MessageStream:
        """Another requester connects (the first one is `self.requester`)."""
        a, b = trio.testing.memory_stream_pair()
        mine, theirs = MessageStream(a, name, "node"), MessageStream(b, "relay", "node")
        async with trio.open_nursery() as n:
            n.start_soon(exchange_hello, mine, wire.Hello("relay", "r1", "node", "x:1", []))
            n.start_soon(exchange_hello, theirs, wire.Hello(name, "r2", "node", "x:2", []))
        nursery.start_soon(self.peers.run, mine, False)
        await trio.testing.wait_all_tasks_blocked()  # the session is open (and said what it has)
        if self.requester is None:
            self.requester = theirs
        return theirs

    def run(self, scenario) -> None:
        """Connect, run `await scenario()` (or `scenario(nursery)` if it takes one), and stop the relay."""
        async def main():
            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    await self.connect(n)
                    await (scenario(n) if scenario.__code__.co_argcount else scenario())
                    n.cancel_scope.cancel()
        trio.run(main)

    def feed(self, chunk: int, start: int, end: int):
        """The upstream's part [start, end) of `chunk` arrives at the relay."""
        data = self.chunks[chunk]
        flow, _ = self.inflows.receive(UPSTREAM, KEY, chunk, len(data), start, len(data), data[start:end])
        return flow

    async def ask(self, chunk: int) -> None:
        await self.requester.send(wire.Request(KEY[0], KEY[1], chunk))

    async def pieces_until_quiet(self) -> list:
        """Every message the requester gets until the relay has nothing more to send now."""
        out = []
        while True:
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.05):
                out.append(await self.requester.receive())
                continue
            return out


def _parts(msgs, chunk):
    return [(m.offset, len(m.data)) for m in msgs if isinstance(m, wire.Piece) and m.chunk == chunk]


def test_a_chunk_is_served_while_it_arrives_and_its_last_part_after_verification(tmp_path):
    data = os.urandom(3 * PART_BYTES + 1000)
    r = Relay(tmp_path, [data])

    async def scenario():
        flow = r.feed(0, 0, PART_BYTES)
        await r.ask(0)
        got = await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)]  # before the relay holds the chunk
        r.feed(0, PART_BYTES, 3 * PART_BYTES)  # one part of twice the size from upstream
        got += await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES), (PART_BYTES, PART_BYTES), (2 * PART_BYTES, PART_BYTES)]
        r.feed(0, 3 * PART_BYTES, len(data))  # the chunk is whole, not yet verified
        assert await r.pieces_until_quiet() == []  # the completing part waits for the check
        r.inflows.finish(flow, ok=True)
        last = await r.pieces_until_quiet()
        assert _parts(last, 0) == [(3 * PART_BYTES, 1000)]
        got += last
        assert b"".join(m.data for m in got) == data
        assert all(m.total == len(data) for m in got)

    r.run(scenario)


def test_a_held_chunk_goes_out_while_an_arriving_one_waits(tmp_path):
    arriving, held = os.urandom(2 * PART_BYTES), os.urandom(2 * PART_BYTES + 5)
    r = Relay(tmp_path, [arriving, held])
    r.store.put_manifest(KEY, _manifest(r.chunks), b"envelope")
    r.store.put_chunk(KEY, 1, held)

    async def scenario():
        r.feed(0, 0, 10)
        await r.ask(0)
        await r.ask(1)
        got = await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, 10)]
        assert b"".join(m.data for m in got if isinstance(m, wire.Piece) and m.chunk == 1) == held

    r.run(scenario)


def test_a_failed_flow_continues_from_the_store_or_is_rejected(tmp_path):
    a, b = os.urandom(2 * PART_BYTES), os.urandom(2 * PART_BYTES)
    r = Relay(tmp_path, [a, b])
    r.store.put_manifest(KEY, _manifest(r.chunks), b"envelope")

    async def scenario():
        r.feed(0, 0, PART_BYTES)
        r.feed(1, 0, PART_BYTES)
        await r.ask(0)
        await r.ask(1)
        got = await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)] and _parts(got, 1) == [(0, PART_BYTES)]
        # Chunk 0 came whole from another peer meanwhile; chunk 1 has no other source.
        r.store.put_chunk(KEY, 0, a)
        r.inflows.drop_peer(UPSTREAM)
        got += await r.pieces_until_quiet()
        assert b"".join(m.data for m in got if isinstance(m, wire.Piece) and m.chunk == 0) == a
        rejects = [m for m in got if isinstance(m, wire.Reject)]
        assert [(m.chunk, m.reason) for m in rejects] == [(1, "stream aborted")]
        assert not r.peers.sessions["req"].serve_queue

    r.run(scenario)


def test_a_failed_flow_of_other_bytes_is_not_spliced_onto_the_held_chunk(tmp_path):
    """A hostile upstream, asked for a chunk, sends a first part that is not the chunk; the
    relay hands it on (unverified, as every part but the last) to a follower. The chunk then
    comes whole from an honest peer (an endgame copy) and the hostile's flow is cancelled.
    Before, the follower's answer went on from the store at the byte it had reached: the
    follower assembled the hostile's bytes and the held chunk's rest, which does not match
    its manifest, and dropped the honest relay as a sender of bad data. Now an answer goes on
    from another source only where that source's bytes are the ones already sent; else it is
    refused ("stream aborted"): the follower resumes elsewhere and blames nobody."""
    good = os.urandom(2 * PART_BYTES)
    r = Relay(tmp_path, [good, good])
    r.store.put_manifest(KEY, _manifest(r.chunks), b"envelope")

    async def scenario():
        r.inflows.receive(UPSTREAM, KEY, 0, len(good), 0, len(good), bytes(PART_BYTES))  # not the chunk
        r.feed(1, 0, PART_BYTES)  # this one's bytes are the chunk's
        await r.ask(0)
        await r.ask(1)
        got = await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)] and _parts(got, 1) == [(0, PART_BYTES)]
        r.store.put_chunk(KEY, 0, good)
        r.store.put_chunk(KEY, 1, good)
        r.inflows.discard(UPSTREAM, KEY, 0, keep=False)
        r.inflows.discard(UPSTREAM, KEY, 1, keep=False)
        got += await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)]
        assert [(m.chunk, m.reason) for m in got if isinstance(m, wire.Reject)] == [(0, "stream aborted")]
        assert b"".join(m.data for m in got if isinstance(m, wire.Piece) and m.chunk == 1) == good
        assert not r.peers.sessions["req"].serve_queue

    r.run(scenario)


def test_a_failed_flow_goes_on_from_another_flow_only_with_the_bytes_it_sent(tmp_path):
    """As above, with the chunk still arriving from a second peer when the first flow fails:
    followed only if its bytes so far are the ones sent (a peer's own, or a resumed copy of
    the same bytes), else refused."""
    good = os.urandom(2 * PART_BYTES)
    r = Relay(tmp_path, [good, good])

    async def scenario():
        r.inflows.receive(UPSTREAM, KEY, 0, len(good), 0, len(good), bytes(PART_BYTES))  # not the chunk
        r.feed(1, 0, PART_BYTES)
        await r.ask(0)
        await r.ask(1)
        got = await r.pieces_until_quiet()
        for c in (0, 1):  # an honest peer's copy, further along
            r.inflows.receive("honest", KEY, c, len(good), 0, len(good), good[:PART_BYTES + 10])
        r.inflows.drop_peer(UPSTREAM)
        got += await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)]
        assert [(m.chunk, m.reason) for m in got if isinstance(m, wire.Reject)] == [(0, "stream aborted")]
        assert _parts(got, 1) == [(0, PART_BYTES), (PART_BYTES, 10)]

    r.run(scenario)


def test_a_bad_chunk_is_never_handed_on_whole(tmp_path):
    data = os.urandom(PART_BYTES + 7)
    r = Relay(tmp_path, [data])

    async def scenario():
        r.feed(0, 0, PART_BYTES)
        await r.ask(0)
        got = await r.pieces_until_quiet()
        flow = r.feed(0, PART_BYTES, len(data))
        got += await r.pieces_until_quiet()
        r.inflows.finish(flow, ok=False)  # the daemon's hash check failed
        got += await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)]
        assert [m.reason for m in got if isinstance(m, wire.Reject)] == ["stream aborted"]

    r.run(scenario)


def test_cancel_stops_a_chunk_mid_stream_and_unknown_chunks_are_rejected(tmp_path):
    data = os.urandom(3 * PART_BYTES)
    r = Relay(tmp_path, [data])

    async def scenario():
        flow = r.feed(0, 0, PART_BYTES)
        await r.ask(0)
        got = await r.pieces_until_quiet()
        await r.requester.send(wire.Cancel(KEY[0], KEY[1], 0))
        await trio.testing.wait_all_tasks_blocked()
        assert not r.peers.sessions["req"].serve_queue
        r.feed(0, PART_BYTES, 2 * PART_BYTES)
        await r.ask(5)
        got += await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)]
        assert [(m.chunk, m.reason) for m in got if isinstance(m, wire.Reject)] == [(5, "not held")]
        assert flow._watchers == []  # the cancelled answer no longer follows the flow

    r.run(scenario)


def test_a_requester_leaving_mid_cut_through_releases_the_flow_and_the_others_get_it_whole(tmp_path):
    data = os.urandom(3 * PART_BYTES)
    r = Relay(tmp_path, [data])

    async def scenario(nursery):
        other = await r.connect(nursery, "req2")
        flow = r.feed(0, 0, PART_BYTES)
        await r.ask(0)
        await other.send(wire.Request(KEY[0], KEY[1], 0))
        got = await r.pieces_until_quiet()
        assert _parts(got, 0) == [(0, PART_BYTES)]
        assert len(flow._watchers) == 2
        await r.requester.stream.aclose()  # the first requester is gone mid-chunk
        await trio.testing.wait_all_tasks_blocked()
        assert not r.peers.connected("req") and r.peers.connected("req2")
        assert len(flow._watchers) == 1  # only the one still there follows the flow
        r.feed(0, PART_BYTES, len(data))
        r.inflows.finish(flow, ok=True)
        await trio.testing.wait_all_tasks_blocked()
        pieces = []
        while sum(len(p.data) for p in pieces) < len(data):
            pieces.append(await other.receive())
        assert b"".join(p.data for p in pieces) == data
        assert flow._watchers == []
        # what the leaver was sent, then the whole chunk to the other; nothing more to the leaver
        assert r.peers.bytes_out == PART_BYTES + len(data)

    r.run(scenario)


def test_inflows_restart_ignore_stale_parts_and_pick_the_furthest(tmp_path):
    flows = Inflows()
    data = bytes(range(256)) * 4
    f1, first = flows.receive("p", KEY, 0, len(data), 0, len(data), data[:100])
    assert first
    f2, first = flows.receive("q", KEY, 0, len(data), 0, len(data), data[:300])
    assert not first and flows.source(KEY, 0) is f2
    flows.discard("q", KEY, 0)
    assert f2.failed and flows.source(KEY, 0) is f1
    # The rest of a discarded flow is ignored; asked again, it starts over at offset 0.
    assert flows.receive("q", KEY, 0, len(data), 300, len(data), data[300:400]) == (None, False)
    f3, first = flows.receive("p", KEY, 0, len(data), 0, len(data), data[:50])
    assert f1.failed and f3 is not f1 and first  # the only live flow of that chunk again
    flows.drop_object(KEY)
    assert len(flows) == 0 and flows.source(KEY, 0) is None


def _manifest(chunks):
    import hashlib

    from patchswarm.protocol.manifest import Manifest
    return Manifest(swarm_id="sw", version=1, base_version=0, base_hash="blake3:" + "00" * 32,
                    target_hash="blake3:" + "11" * 32, tensors=[],
                    chunks=[(len(c), hashlib.sha256(c).digest()) for c in chunks], codec={"format": 1}, created_at=0.0)


def test_an_empty_chunk_is_answered_with_one_empty_part(tmp_path):
    r = Relay(tmp_path, [b"", os.urandom(10)])
    r.store.put_manifest(KEY, _manifest(r.chunks), b"envelope")
    r.store.put_chunk(KEY, 0, b"")

    async def scenario():
        await r.ask(0)
        got = [m for m in await r.pieces_until_quiet() if isinstance(m, wire.Piece)]
        assert [(m.chunk, m.offset, m.total, m.data) for m in got] == [(0, 0, 0, b"")]
        assert not r.peers.sessions["req"].serve_queue

    r.run(scenario)


def test_a_request_for_the_rest_is_answered_from_its_offset_held_or_arriving(tmp_path):
    """Issue 26: a peer whose transfer of a chunk broke asks the next holder for the rest
    only (RequestRest), so what crossed the link already does not cross it again."""
    held, arriving = os.urandom(2 * PART_BYTES + 9), os.urandom(2 * PART_BYTES)
    r = Relay(tmp_path, [held, arriving])
    r.store.put_manifest(KEY, _manifest(r.chunks), b"envelope")
    r.store.put_chunk(KEY, 0, held)

    async def scenario():
        await r.requester.send(wire.RequestRest(KEY[0], KEY[1], 0, PART_BYTES + 3))
        got = await r.pieces_until_quiet()
        assert _parts(got, 0) == [(PART_BYTES + 3, PART_BYTES), (2 * PART_BYTES + 3, 6)]
        assert b"".join(m.data for m in got if isinstance(m, wire.Piece)) == held[PART_BYTES + 3:]
        flow = r.feed(1, 0, 10)
        await r.requester.send(wire.RequestRest(KEY[0], KEY[1], 1, 20))  # beyond what arrived: waits
        assert await r.pieces_until_quiet() == []
        r.feed(1, 10, PART_BYTES)
        got = await r.pieces_until_quiet()
        assert _parts(got, 1) == [(20, PART_BYTES - 20)]
        r.feed(1, PART_BYTES, len(arriving))
        r.inflows.finish(flow, ok=True)
        got += await r.pieces_until_quiet()
        assert b"".join(m.data for m in got if isinstance(m, wire.Piece)) == arriving[20:]
        # An offset at or past the chunk's end is refused, and never queued.
        await r.requester.send(wire.RequestRest(KEY[0], KEY[1], 0, len(held)))
        got = await r.pieces_until_quiet()
        assert [(m.chunk, m.reason) for m in got if isinstance(m, wire.Reject)] == [(0, f"offset {len(held)} is not within the chunk")]
        assert not r.peers.sessions["req"].serve_queue

    r.run(scenario)


def test_inflows_keep_a_broken_flows_bytes_and_resume_from_them(tmp_path):
    flows = Inflows()
    data = os.urandom(1000)
    flows.receive("p", KEY, 0, len(data), 0, len(data), data[:300])
    flows.receive("q", KEY, 0, len(data), 0, len(data), data[:100])
    assert flows.partial(KEY, 0) == 0  # nothing kept while the flows live
    flows.drop_peer("q")
    flows.drop_peer("p")
    assert flows.partial(KEY, 0) == 300  # the most of it, whichever flow failed last
    assert flows.resume("r", KEY, 0) == 300 and flows.partial(KEY, 0) == 0
    assert flows.resume("s", KEY, 0) == 0  # taken once
    # Not followed until a part of the rest comes: r may be waiting on this very node.
    assert flows.source(KEY, 0) is None and flows.arriving() == []
    got, first = flows.receive("r", KEY, 0, len(data), 300, len(data), data[300:400])
    assert first and flows.source(KEY, 0) is got and flows.arriving() == [(KEY, 0)]
    assert got.start == 300 and got.asm.forwardable == 400  # served onward, its kept bytes first
    got, _ = flows.receive("r", KEY, 0, len(data), 400, len(data), data[400:])
    assert got.asm.complete and bytes(got.asm.data()) == data
    flows.finish(got, ok=True)
    assert flows.partial(KEY, 0) == 0 and len(flows) == 0
    # A whole chunk that failed its check is not kept; neither are more than PARTIALS_KEPT.
    bad, _ = flows.receive("p", KEY, 1, len(data), 0, len(data), data)
    flows.finish(bad, ok=False)
    assert flows.partial(KEY, 1) == 0
    for c in range(PARTIALS_KEPT + 1):
        flows.receive("p", KEY, c, len(data), 0, len(data), data[:c + 1])
    flows.drop_peer("p")
    assert flows.partial(KEY, 0) == 0 and flows.partial(KEY, PARTIALS_KEPT) == PARTIALS_KEPT + 1
    flows.drop_object(KEY)
    assert flows.partial(KEY, PARTIALS_KEPT) == 0
    flows.receive("p", KEY, 0, len(data), 0, len(data), data[:10])
    flows.discard("p", KEY, 0, keep=False)  # an endgame copy cancelled: the chunk came whole
    assert flows.partial(KEY, 0) == 0


def test_a_cancelled_answers_late_parts_do_not_break_the_resumed_flow_from_the_same_peer(tmp_path):
    """The requester cancelled a chunk from the relay part-way (2 parts in: kept to resume
    from), then asked the relay again for the rest (RequestRest), while the parts of the
    cancelled answer were still on the way: they arrive before the answer, one before the
    resumed flow opened (ignored) and the rest after. Before: the first late part after it
    opened did not continue it, and the ProtocolError dropped an honest peer (the connection
    chaos bench, bench/conn_chaos.py, seed 9: 'expected the part at offset 327680, found
    offset 458752'). Now the parts before the answer's first are ignored, and the chunk
    arrives whole from the answer."""
    chunk = os.urandom(6 * PART_BYTES)
    r = Relay(tmp_path, [chunk])
    r.store.put_manifest(KEY, _manifest(r.chunks), b"envelope")
    r.store.put_chunk(KEY, 0, chunk)
    mine = Inflows()  # the requester's
    arrived = []

    def take(m):
        flow, _ = mine.receive("relay", KEY, 0, len(chunk), m.offset, m.total, m.data)
        arrived.append(m.offset if flow is not None else None)
        return flow

    async def piece():
        while not isinstance(m := await r.requester.receive(), wire.Piece):
            pass  # the relay's Have
        return m

    async def scenario():
        await r.ask(0)
        await trio.testing.wait_all_tasks_blocked()  # the whole answer is on the way
        for _ in range(2):
            take(await piece())
        mine.discard("relay", KEY, 0)  # cancelled (a timeout, a snub, the origin's turn)
        await r.requester.send(wire.Cancel(KEY[0], KEY[1], 0))
        take(await piece())  # a late part: no flow, ignored
        offset = mine.resume("relay", KEY, 0)  # asked again for the rest
        assert offset == 2 * PART_BYTES
        await r.requester.send(wire.RequestRest(KEY[0], KEY[1], 0, offset))
        flow = None
        for m in await r.pieces_until_quiet():
            if isinstance(m, wire.Piece):
                flow = take(m) or flow
        assert arrived == [0, PART_BYTES, None, None, None, None, *(k * PART_BYTES for k in range(2, 6))]
        assert flow.asm.complete and bytes(flow.asm.data()) == chunk

    r.run(scenario)


def test_inflows_a_resumed_flow_starts_again_where_its_answer_begins(tmp_path):
    """Late parts of a cancelled answer that happen to continue a resumed flow are taken
    (the same peer's bytes of the same chunk); the answer's first part, at the flow's start,
    then begins it again from there, as a first part at offset 0 does for a flow not
    resumed. A part at any other offset, once the answer has begun, is a protocol error."""
    flows = Inflows()
    data = os.urandom(1000)
    old, _ = flows.receive("p", KEY, 0, len(data), 0, len(data), data[:300])
    flows.discard("p", KEY, 0)
    assert flows.resume("p", KEY, 0) == 300
    late, _ = flows.receive("p", KEY, 0, len(data), 300, len(data), data[300:400])  # late, continues it
    flows.receive("p", KEY, 0, len(data), 400, len(data), data[400:500])
    assert late.asm.received == 500
    got, _ = flows.receive("p", KEY, 0, len(data), 300, len(data), data[300:600])  # the answer begins
    assert got is not late and late.failed and got.start == 300 and got.asm.received == 600
    assert flows.source(KEY, 0) is got
    with pytest.raises(ProtocolError, match="expected the part at offset 600, found offset 700"):
        flows.receive("p", KEY, 0, len(data), 700, len(data), data[700:])
    assert flows.resume("q", KEY, 0) == 600  # the bytes kept again
    got, _ = flows.receive("q", KEY, 0, len(data), 600, len(data), data[600:])
    assert got.asm.complete and bytes(got.asm.data()) == data


def test_a_peer_that_connects_while_a_chunk_arrives_is_told_it_is_coming(tmp_path):
    """Issue 26: a gateway restarted mid-version takes its share back; told only what is held,
    it would fetch across the WAN a chunk its region is receiving at that moment."""
    data = os.urandom(2 * PART_BYTES)
    r = Relay(tmp_path, [data, data])

    async def scenario(nursery):
        r.feed(1, 0, PART_BYTES)
        late = await r.connect(nursery, "late")
        got = []
        while True:
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.05):
                got.append(await late.receive())
                continue
            break
        assert [m for m in got if isinstance(m, wire.Incoming)] == [wire.Incoming(KEY[0], KEY[1], 1)]
        await late.send(wire.Request(KEY[0], KEY[1], 1))
        await trio.testing.wait_all_tasks_blocked()
        first = await late.receive()
        assert (first.chunk, first.offset, first.data) == (1, 0, data[:PART_BYTES])

    r.run(scenario)


def test_two_holders_of_a_prefix_never_wait_on_each_other(tmp_path):
    """The relay resumed the chunk from the requester, which asks the relay for the rest in
    turn: refused at once (before, each waited on the other until the 30 s request timeout)."""
    data = os.urandom(2 * PART_BYTES)
    r = Relay(tmp_path, [data])

    async def scenario():
        r.feed(0, 0, PART_BYTES)
        r.inflows.drop_peer(UPSTREAM)  # the relay's source died part-way
        assert r.inflows.resume("req", KEY, 0) == PART_BYTES  # it asks the requester for the rest
        await r.requester.send(wire.RequestRest(KEY[0], KEY[1], 0, PART_BYTES // 2))
        got = await r.pieces_until_quiet()
        assert [(type(m).__name__, m.chunk) for m in got] == [("Reject", 0)]

    r.run(scenario)
