"""In-memory links for PeerSet tests: a MessageStream pair after Hello over a trio
memory stream (no TLS: PeerSet only sees MessageStreams), one end of which can stop
taking bytes, and an object store holding given chunks of one object."""

from __future__ import annotations

import dataclasses
import hashlib

import trio
import trio.testing

from patchswarm.node.net.transport import MessageStream, exchange_hello
from patchswarm.node.store import ObjectStore
from patchswarm.protocol import wire
from patchswarm.protocol.manifest import Manifest

KEY = (1, False)


class Stallable:
    """A stream whose sends block for ever once `stalled` (a peer whose TCP window stays
    shut), and otherwise pass through."""

    def __init__(self, stream):
        self.stream = stream
        self.stalled = False

    async def send_all(self, data) -> None:
        if self.stalled:
            await trio.sleep_forever()
        await self.stream.send_all(data)

    async def receive_some(self, max_bytes=None):
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def connected_pair(on_receive=None) -> tuple[MessageStream, MessageStream, Stallable]:
    """(served end "req" as a PeerSet "srv" sees it, requester end, the served end's stream)."""
    a, b = trio.testing.memory_stream_pair()
    a = Stallable(a)
    served, requester = MessageStream(a, "req", "node"), MessageStream(b, "srv", "node", on_receive=on_receive)
    async with trio.open_nursery() as n:
        n.start_soon(exchange_hello, served, wire.Hello("srv", "r1", "node", "x:1", []))
        n.start_soon(exchange_hello, requester, wire.Hello("req", "r1", "node", "x:2", []))
    return served, requester, a


def manifest_of_chunks(chunks: list[bytes]) -> Manifest:
    return Manifest(swarm_id="sw", version=KEY[0], base_version=0, base_hash="blake3:" + "00" * 32,
                    target_hash="blake3:" + "11" * 32, tensors=[],
                    chunks=[(len(c), hashlib.sha256(c).digest()) for c in chunks], codec={"format": 1},
                    created_at=0.0)


def store_with(path, chunks: list[bytes]) -> ObjectStore:
    """A store holding every chunk of one object (KEY)."""
    store = ObjectStore(path)
    store.put_manifest(KEY, manifest_of_chunks(chunks), b"envelope")
    for i, c in enumerate(chunks):
        store.put_chunk(KEY, i, c)
    return store


@dataclasses.dataclass
class RecordingStream:
    """A session's stream that keeps what is sent to it (for tests of what a PeerSet sends)."""
    sent: list = dataclasses.field(default_factory=list)

    async def send(self, msg) -> None:
        self.sent.append(msg)


async def ignore(s, msg) -> None:
    """A PeerSet's on_message that takes every message and does nothing."""


def join_session(fetcher, nursery, peer: str, role: str = "node", region: str = "r1"):
    """A peer's session over a RecordingStream, registered with the fetcher's PeerSet as a
    connected member (its sends run in `nursery`)."""
    from patchswarm.node.peers import Session

    s = Session(RecordingStream(), peer, role, region, "x:1", outbound=True)
    s.tasks = nursery
    fetcher.peers.sessions[peer] = s
    fetcher.peer_joined(s)
    return s


def sent_of(s, kind) -> list:
    """The messages of type `kind` a RecordingStream session was sent, in order."""
    return [m for m in s.ms.sent if isinstance(m, kind)]


def fetcher_over(name: str, store, picker):
    """A Fetcher of member `name` (region r1) over `store`, with its own PeerSet and Inflows."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from patchswarm.node.fetcher import Fetcher
    from patchswarm.node.net.ratelimit import TokenBucket
    from patchswarm.node.peers import PeerSet
    from patchswarm.node.relay import Inflows
    from patchswarm.protocol.versions import VersionBook

    inflows = Inflows()
    peers = PeerSet(name, store, TokenBucket(None), ignore, inflows=inflows)
    book = VersionBook("sw", Ed25519PrivateKey.generate().public_key())
    return Fetcher(name, "r1", picker, peers, inflows, store, book, on_complete=lambda key: None)
