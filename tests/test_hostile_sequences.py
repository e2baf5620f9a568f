"""Messages a valid member may send that are each well formed but hostile in sequence or in
context (issue 21's review, continued): what the node daemon's fetcher and upload side do with
them, in process. The peers are sessions whose message streams record what they are sent; what
a peer says reaches the fetcher as the daemon hands it on (node/daemon.py `_on_message`)."""

from __future__ import annotations

import dataclasses
import hashlib

import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.fetcher import Fetcher
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.peers import PeerSet, Session
from patchswarm.node.relay import Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.protocol import wire
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.picker import PiecePicker
from patchswarm.protocol.versions import VersionBook

KEY = (1, False)
CHUNK_BYTES = 1 << 20


@dataclasses.dataclass
class RecordingStream:
    sent: list = dataclasses.field(default_factory=list)

    async def send(self, msg) -> None:
        self.sent.append(msg)


async def _noop(s, msg) -> None:
    pass


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
    inflows = Inflows()
    peers = PeerSet("me", store, TokenBucket(None), _noop, inflows=inflows)
    book = VersionBook("sw", Ed25519PrivateKey.generate().public_key())
    return Fetcher("me", "r1", picker, peers, inflows, store, book, on_complete=lambda key: None)


def _session(fetcher: Fetcher, nursery, peer: str) -> Session:
    s = Session(RecordingStream(), peer, "node", "r1", "x:1", outbound=True)
    s.tasks = nursery
    fetcher.peers.sessions[peer] = s
    fetcher.peer_joined(s)
    return s


def _sent(s: Session, kind) -> list:
    return [m for m in s.ms.sent if isinstance(m, kind)]


def test_unasked_first_parts_open_no_flow_and_announce_nothing(tmp_path):
    """A member sends, unasked, one byte at offset 0 of every chunk of an object being fetched.
    Before: each opened a flow holding a buffer of the chunk's size (64 chunks: 64 MiB; a 2 GiB
    keyframe's: 2 GiB, per hostile member), the node told every peer `Incoming` and served
    whoever asked from those flows, which never moved: each such follower waited out its
    request timeout (30 s) for every chunk. Now a part nobody asked of that peer is ignored."""
    n = 64
    fetcher = _fetcher(tmp_path, n)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            mallory = _session(fetcher, nursery, "mallory")
            lacking = _session(fetcher, nursery, "lacking")
            for c in range(n):
                await fetcher.on_piece(mallory, wire.Piece(1, False, c, 0, CHUNK_BYTES, b"x"))
            await trio.testing.wait_all_tasks_blocked()
            assert len(fetcher.inflows) == 0
            assert not _sent(lacking, wire.Incoming)
            assert all(fetcher.inflows.source(KEY, c) is None for c in range(n))
            # An honest holder, asked, still delivers (the guard is per request, not per peer).
            fetcher.on_announce(lacking, wire.HaveOne(1, False, 0))
            await trio.testing.wait_all_tasks_blocked()
            assert wire.Request(1, False, 0) in _sent(lacking, wire.Request)
            await fetcher.on_piece(lacking, wire.Piece(1, False, 0, 0, CHUNK_BYTES, _chunk(0)))
            assert 0 in fetcher.store.have(KEY)
            nursery.cancel_scope.cancel()

    trio.run(main)
