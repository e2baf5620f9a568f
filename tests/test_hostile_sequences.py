"""Messages a valid member may send that are each well formed but hostile in sequence or in
context (issue 21's review, continued): what the node daemon's fetcher and upload side do with
them, in process. The peers are sessions whose message streams record what they are sent; what
a peer says reaches the fetcher as the daemon hands it on (node/daemon.py `_on_message`)."""

from __future__ import annotations

import hashlib

import pytest
import trio
import trio.testing

from memlink import RecordingStream, fetcher_over, ignore, join_session, sent_of
from patchswarm.node.fetcher import Fetcher
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.peers import PeerSet, Session
from patchswarm.node.relay import Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.protocol import wire
from patchswarm.protocol.announce import INCOMING_TELLS
from patchswarm.protocol.errors import ProtocolError
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.picker import PiecePicker

KEY = (1, False)
CHUNK_BYTES = 1 << 20


def _chunk(c: int) -> bytes:
    return c.to_bytes(4, "big") * (CHUNK_BYTES // 4)


def _fetcher(tmp_path, n_chunks: int) -> Fetcher:
    store = ObjectStore(tmp_path / "objects")
    m = Manifest(swarm_id="sw", version=1, base_version=0, base_hash="blake3:" + "00" * 32,
                 target_hash="blake3:" + "11" * 32, tensors=[],
                 chunks=[(CHUNK_BYTES, hashlib.sha256(_chunk(c)).digest()) for c in range(n_chunks)],
                 codec={"format": 1}, created_at=0.0)
    store.put_manifest(KEY, m, b"(envelope)")
    picker = PiecePicker("me", "r1", "r1", seed=3, request_timeout=30.0)
    picker.add_object(KEY, n_chunks, now=0.0)
    return fetcher_over("me", store, picker)




def test_unasked_first_parts_open_no_flow_and_announce_nothing(tmp_path):
    """A member sends, unasked, one byte at offset 0 of every chunk of an object being fetched.
    Before: each opened a flow holding a buffer of the chunk's size (64 chunks: 64 MiB; a 2 GiB
    keyframe's: 2 GiB, per hostile member), the node told every peer `Incoming` and served
    whoever asked from those flows, which never moved: a follower's requests for them hung
    until its endgame or its request timeout (30 s). Now a part nobody asked of that peer is
    ignored."""
    n = 64
    fetcher = _fetcher(tmp_path, n)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            mallory = join_session(fetcher, nursery, "mallory")
            lacking = join_session(fetcher, nursery, "lacking")
            for c in range(n):
                await fetcher.on_piece(mallory, wire.Piece(1, False, c, 0, CHUNK_BYTES, b"x"))
            await trio.testing.wait_all_tasks_blocked()
            assert len(fetcher.inflows) == 0
            assert not sent_of(lacking, wire.Incoming)
            assert all(fetcher.inflows.source(KEY, c) is None for c in range(n))
            # An honest holder, asked, still delivers (the guard is per request, not per peer).
            fetcher.on_announce(lacking, wire.HaveOne(1, False, 0))
            await trio.testing.wait_all_tasks_blocked()
            assert wire.Request(1, False, 0) in sent_of(lacking, wire.Request)
            await fetcher.on_piece(lacking, wire.Piece(1, False, 0, 0, CHUNK_BYTES, _chunk(0)))
            assert 0 in fetcher.store.have(KEY)
            nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------- a chunk damaged on disk


async def _route(fetcher: Fetcher, s: Session, msg) -> None:
    """What the daemon hands the fetcher (node/daemon.py `_on_message`)."""
    if isinstance(msg, wire.Piece):
        await fetcher.on_piece(s, msg)
    elif isinstance(msg, (wire.Have, wire.HaveOne, wire.Incoming)):
        fetcher.on_announce(s, msg)
    elif isinstance(msg, wire.Reject):
        fetcher.on_reject(s, msg)


def _holder(tmp_path, name: str, n_chunks: int) -> PeerSet:
    """A member holding the whole object, as a node that fetched and verified it."""
    store = ObjectStore(tmp_path / name)
    chunks = [_chunk(c) for c in range(n_chunks)]
    store.write_object(KEY, b"(envelope)", chunks)
    store.adopt(KEY, Manifest(swarm_id="sw", version=1, base_version=0, base_hash="blake3:" + "00" * 32,
                              target_hash="blake3:" + "11" * 32, tensors=[],
                              chunks=[(len(c), hashlib.sha256(c).digest()) for c in chunks],
                              codec={"format": 1}, created_at=0.0))
    return PeerSet(name, store, TokenBucket(None), ignore, inflows=Inflows())


async def _link(nursery, me: PeerSet, other: PeerSet) -> None:
    """Connect `me` and `other` over a memory stream, Hellos exchanged, both sessions running."""
    from patchswarm.node.net.transport import MessageStream, exchange_hello
    a, b = trio.testing.memory_stream_pair()
    mine, theirs = MessageStream(a, other.me, "node"), MessageStream(b, me.me, "node")
    async with trio.open_nursery() as hello:
        hello.start_soon(exchange_hello, mine, wire.Hello(me.me, "r1", "node", "x:1", []))
        hello.start_soon(exchange_hello, theirs, wire.Hello(other.me, "r1", "node", "x:2", []))
    nursery.start_soon(me.run, mine, True)
    nursery.start_soon(other.run, theirs, False)


def test_a_chunk_damaged_on_disk_is_not_served_and_the_honest_sender_is_kept(tmp_path):
    """Bit rot: a chunk file changes on the holder's disk while it runs. Before, the holder
    served it as it read it, and the receiver, finding it did not match its manifest, dropped
    the holder (an honest member) as a sender of bad data. Now the holder checks each chunk it
    reads against its manifest: a damaged one is removed from its store (fetched again where it
    needs it) and the request answered with a Reject, so the receiver asks another holder."""
    fetcher = _fetcher(tmp_path, 1)
    me = fetcher.peers
    me._on_message = lambda s, msg: _route(fetcher, s, msg)
    me._on_open, me._on_close = fetcher.peer_joined, fetcher.peer_left
    rot = _holder(tmp_path, "rot", 1)
    path = next((tmp_path / "rot").glob("*/000000.chunk"))
    damaged = bytearray(path.read_bytes())
    damaged[12345] ^= 0x10
    path.write_bytes(bytes(damaged))

    async def main():
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(fetcher.run)
                await _link(nursery, me, rot)
                while "rot" in me.sessions and rot.store.have(KEY):  # until it is served, or the holder dropped
                    await trio.sleep(0.01)
                await trio.sleep(0.2)  # the answer (a Reject, or the damaged bytes) reaches the fetcher
                assert fetcher.chunks_rejected == 0 and "rot" in me.sessions  # the honest holder is kept
                assert rot.store.have(KEY) == set() and not path.exists()
                assert 0 not in fetcher.store.have(KEY)
                good = _holder(tmp_path, "good", 1)
                await _link(nursery, me, good)
                while 0 not in fetcher.store.have(KEY):
                    await trio.sleep(0.01)
                assert fetcher.store.get_chunk(KEY, 0) == _chunk(0)
                nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------- announcements that cancel the origin's copy


def test_a_member_announcing_a_chunk_again_and_again_cannot_keep_it_from_the_origin(tmp_path):
    """In the origin's region, a member's Incoming or HaveOne cancels this node's request to the
    origin for that chunk (no byte of it come yet), so the origin sends each chunk once. A member
    (any member: the region is its Hello's word) that announced the chunk ten times a second and
    never served it had every new request to the origin cancelled, and the chunk never came
    (60 s of it here: 300 requests to the origin, each cancelled). Now the origin's copy of a
    chunk is given up on a member's word once per fetch; the next request to the origin stays."""
    from patchswarm.protocol.picker import PiecePicker
    fetcher = _fetcher(tmp_path, 1)
    fetcher.picker = PiecePicker("me", "r1", "r1", seed=3, request_timeout=30.0, endgame_after=0.5)
    fetcher.picker.add_object(KEY, 1, now=0.0)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            origin = Session(RecordingStream(), "origin", "origin", "r1", "x:1", outbound=True)
            origin.tasks = nursery
            fetcher.peers.sessions["origin"] = origin
            fetcher.peer_joined(origin)
            fetcher.on_announce(origin, wire.Have(1, False, b"\x01"))
            mallory = join_session(fetcher, nursery, "mallory")
            for _ in range(600):
                await trio.sleep(0.1)
                fetcher.on_announce(mallory, wire.Incoming(1, False, 0))
                fetcher.on_announce(mallory, wire.HaveOne(1, False, 0))
            assert len(sent_of(origin, wire.Cancel)) <= 1
            assert fetcher.picker.sent_at("origin", KEY, 0) is not None  # asked, and left to answer
            await fetcher.on_piece(origin, wire.Piece(1, False, 0, 0, CHUNK_BYTES, _chunk(0)))
            assert 0 in fetcher.store.have(KEY)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# ---------------------------------------------------------------- Error messages


def test_a_peers_error_messages_are_logged_a_few_times_per_session_not_each(caplog):
    """No member sends a peer `Error` today; each one a node or the origin receives was logged as
    a warning, so a peer could write up to 4 KiB of log per message, as fast as its link allows.
    Now the first ERRORS_LOGGED of a session are warnings and the rest debug lines."""
    import logging

    from patchswarm.node.daemon import Node
    from patchswarm.node.peers import ERRORS_LOGGED
    from patchswarm.node.trainer.origin import Origin

    s = Session(RecordingStream(), "mallory", "node", "r1", "x:1", outbound=True)

    async def main():
        for handler in (Node._on_message, Origin._on_message):
            s.errors = 0
            caplog.clear()
            with caplog.at_level(logging.DEBUG):
                for i in range(1000):
                    await handler(object(), s, wire.Error("x" * 4000))
            warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warned) == ERRORS_LOGGED, handler

    trio.run(main)


def test_a_sender_restarting_a_chunk_it_was_asked_for_makes_the_node_announce_it_a_bounded_number_of_times(tmp_path):
    """A member asked for a chunk answers with its first part (one byte at offset 0) again and
    again. Each restart is taken as a new answer (an honest one follows a Cancel crossed by the
    old answer), so it opened a new flow, and the node told every peer that lacks the chunk
    `Incoming` again, each time: one ~40-byte Piece made N small messages (one per peer), and
    at 2**17 restarts a minute (~90 KB/s from the attacker) every peer found this honest node
    past its announcements budget (node/peers.py) and dropped it. Now a peer is told that the
    chunk is arriving here at most INCOMING_TELLS times a session (an honest restart is told
    again), then no more unless this node refused it the chunk since (protocol/announce.py)."""
    fetcher = _fetcher(tmp_path, 1)
    restarts = 200

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            mallory = join_session(fetcher, nursery, "mallory")
            bystander = join_session(fetcher, nursery, "bystander")
            fetcher.on_announce(mallory, wire.HaveOne(1, False, 0))
            await trio.testing.wait_all_tasks_blocked()
            assert wire.Request(1, False, 0) in sent_of(mallory, wire.Request)
            for _ in range(restarts):
                await fetcher.on_piece(mallory, wire.Piece(1, False, 0, 0, CHUNK_BYTES, b"x"))
            await trio.testing.wait_all_tasks_blocked()
            assert sent_of(bystander, wire.Incoming) == [wire.Incoming(1, False, 0)] * INCOMING_TELLS
            # Refused the chunk since, a peer hears of it again (it stopped counting this node a holder).
            bystander.refuse(KEY, 0, "stream aborted")
            await fetcher.on_piece(mallory, wire.Piece(1, False, 0, 0, CHUNK_BYTES, b"x"))
            await trio.testing.wait_all_tasks_blocked()
            assert len(sent_of(bystander, wire.Incoming)) == INCOMING_TELLS + 1
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_member_repeating_a_whole_have_hands_the_picker_each_chunk_once(tmp_path, monkeypatch):
    """A member sends its Have of an object again and again (a node sends one per object per
    session; the origin's may cross its session's first). Each was expanded and handed to the
    picker whole, which walks every chunk: 2.6 ms per Have of a 16,384-chunk object (2 KB on
    the wire, measured), so the 2**17 announcements a minute one peer may send kept the
    node's event loop busy ~5.7 s per second from ~4.5 MB/s. Now each session's Haves of an
    object are OR-ed together and only chunks new to it reach the picker (a few numpy
    operations on the bitfield); whatever it announced before still counts."""
    from patchswarm.protocol.piecestate import ObjectState

    n = 4096
    fetcher = _fetcher(tmp_path, n)
    handed = []
    add_holders = ObjectState.add_holders

    def counting(self, peer, chunks, *args, **kwargs):
        chunks = list(chunks)
        handed.append(len(chunks))
        return add_holders(self, peer, chunks, *args, **kwargs)

    monkeypatch.setattr(ObjectState, "add_holders", counting)
    half = wire.Have(1, False, wire.bitfield_from_indices(range(0, n, 2), n))
    full = wire.Have(1, False, wire.bitfield_from_indices(range(n), n))

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            mallory = join_session(fetcher, nursery, "mallory")
            for msg in [half] * 50 + [full] * 50:
                fetcher.on_announce(mallory, msg)
            assert sum(handed) == n  # each chunk once: half of them, then the other half
            assert all(fetcher.picker.announced("mallory", KEY, c) for c in range(n))
            with pytest.raises(ProtocolError, match="bitfield"):  # still checked against the manifest
                fetcher.on_announce(mallory, wire.Have(1, False, full.chunks + b"\0"))
            nursery.cancel_scope.cancel()

    trio.run(main)
