"""The node daemon's side of cut-through, in process: what it tells its peers while a
chunk arrives (Incoming) and once it holds it (HaveOne), and to whom.

The peers are sessions whose message streams only record what they are sent."""

import dataclasses

import pytest
import torch
import trio
import trio.testing

from patchswarm.node.daemon import Node, NodeConfig
from patchswarm.node.peers import PeerDropped, Session
from patchswarm.node.store import ObjectStore
from patchswarm.node.net.trust import init_swarm, issue
from patchswarm.protocol import wire
from patchswarm.protocol.patch import diff
from patchswarm.protocol.picker import PiecePicker
from patchswarm.protocol.publication import manifest_of

KEY = (1, False)


@dataclasses.dataclass
class RecordingStream:
    sent: list = dataclasses.field(default_factory=list)

    async def send(self, msg) -> None:
        self.sent.append(msg)


def _node(tmp_path):
    init_swarm(tmp_path / "swarm")
    issue(tmp_path / "swarm", "n1", "node", tmp_path / "n1")
    node = Node(NodeConfig(tracker="127.0.0.1:9", creds=tmp_path / "n1", data_dir=tmp_path / "data",
                           listen="127.0.0.1:0", region="r1"))
    g = torch.Generator().manual_seed(5)
    base = {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16)}
    target = {"w": base["w"].clone()}
    target["w"].view(-1).view(torch.int16)[::2] += 1
    p = diff(base, target, chunk_bytes=200_000, segment_elements=1 << 16)
    m = manifest_of(p, swarm_id=node.swarm_id, version=1, created_at=0.0)
    node.data_dir.mkdir(parents=True)
    node.store = ObjectStore(node.data_dir / "objects")
    node.peers.store = node.store
    node.store.put_manifest(KEY, m, b"(envelope)")
    node.picker = PiecePicker(node.id, node.region, "r0")
    node.picker.add_object(KEY, len(m.chunks), now=0.0)
    node._wanted.add(KEY)
    return node, p.chunks


def _session(node, nursery, peer: str, role: str = "node", region: str = "r1") -> Session:
    s = Session(RecordingStream(), peer, role, region, "x:1", outbound=True)
    s.tasks = nursery
    node.peers.sessions[peer] = s
    node.picker.peer_joined(peer, "origin" if role == "origin" else "node", region)
    return s


def _sent(s: Session, kind) -> list:
    return [m for m in s.ms.sent if isinstance(m, kind)]


def test_incoming_then_haveone_go_each_to_the_peers_that_need_them(tmp_path):
    node, chunks = _node(tmp_path)
    data = chunks[0]
    assert len(data) > 2, "the chunk must come in at least two parts"
    half = len(data) // 2

    async def main():
        async with trio.open_nursery() as n:
            node._nursery = n
            up = _session(node, n, "up", region="r0")
            lacking = _session(node, n, "lacking")
            whole = _session(node, n, "whole")
            whole.have[KEY] = {0}  # announced the chunk whole already
            arriving = _session(node, n, "arriving")
            arriving.arriving[KEY] = {0}  # announced it is receiving it
            origin = _session(node, n, "origin", role="origin", region="r0")
            await node._on_piece(up, wire.Piece(1, False, 0, 0, len(data), data[:half]))
            await trio.testing.wait_all_tasks_blocked()
            assert [s.id for s in (up, lacking, whole, arriving, origin) if _sent(s, wire.Incoming)] == ["lacking"]
            late = _session(node, n, "late")  # connected while the chunk arrived: was not told
            # A told peer reconnects: its new session was not told either.
            await node._on_peer_close(lacking)
            del node.peers.sessions["lacking"]
            again = _session(node, n, "lacking")
            await node._on_piece(up, wire.Piece(1, False, 0, half, len(data), data[half:]))
            await trio.testing.wait_all_tasks_blocked()
            assert 0 in node.store.have(KEY)
            # The told peer already knows; the one that was receiving it gets the HaveOne,
            # as its own flow may still fail; whoever holds it whole, and the origin, do not.
            assert [s.id for s in (up, lacking, whole, arriving, origin, late)
                    if _sent(s, wire.HaveOne)] == ["arriving", "late"]
            assert _sent(again, wire.HaveOne) and not _sent(again, wire.Incoming)
            assert node._told.get(KEY, {}) == {}
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_chunk_that_fails_its_hash_drops_the_sender_and_is_not_kept(tmp_path):
    node, chunks = _node(tmp_path)
    bad = bytes(len(chunks[0]))

    async def main():
        async with trio.open_nursery() as n:
            node._nursery = n
            up = _session(node, n, "up", region="r0")
            with pytest.raises(PeerDropped, match="does not match its manifest"):
                await node._on_piece(up, wire.Piece(1, False, 0, 0, len(bad), bad))
            assert 0 not in node.store.have(KEY) and node.chunks_rejected == 1
            assert node.inflows.source(KEY, 0) is None
            n.cancel_scope.cancel()

    trio.run(main)
