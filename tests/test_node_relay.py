"""The node daemon's side of cut-through, in process: what the fetcher tells its peers while
a chunk arrives (Incoming) and once it holds it (HaveOne), and to whom.

The peers are sessions whose message streams only record what they are sent; what
each peer said of the chunk reaches the fetcher as the messages a peer would send."""


import pytest
import torch
import trio
import trio.testing

from memlink import fetcher_over, join_session, sent_of
from patchswarm.node.peers import PeerDropped, Session
from patchswarm.node.store import ObjectStore
from patchswarm.protocol import wire
from patchswarm.protocol.patch import diff
from patchswarm.protocol.picker import PiecePicker
from patchswarm.protocol.publication import manifest_of

KEY = (1, False)


def _fetcher(tmp_path):
    g = torch.Generator().manual_seed(5)
    base = {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16)}
    target = {"w": base["w"].clone()}
    target["w"].view(-1).view(torch.int16)[::2] += 1
    p = diff(base, target, chunk_bytes=200_000, segment_elements=1 << 16)
    m = manifest_of(p, swarm_id="sw", version=1, created_at=0.0)
    store = ObjectStore(tmp_path / "objects")
    store.put_manifest(KEY, m, b"(envelope)")
    picker = PiecePicker("n1", "r1", "r0")
    picker.add_object(KEY, len(m.chunks), now=0.0)
    return fetcher_over("n1", store, picker), p.chunks




async def _asked(fetcher, s: Session) -> None:
    """`s` says it holds chunk 0 and is asked for it (a part nobody asked for is ignored)."""
    fetcher.on_announce(s, wire.HaveOne(1, False, 0))
    await trio.testing.wait_all_tasks_blocked()
    assert wire.Request(1, False, 0) in sent_of(s, wire.Request)


def test_incoming_then_haveone_go_each_to_the_peers_that_need_them(tmp_path):
    fetcher, chunks = _fetcher(tmp_path)
    data = chunks[0]
    assert len(data) > 2, "the chunk must come in at least two parts"
    half = len(data) // 2

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            up = join_session(fetcher, n, "up", region="r0")
            await _asked(fetcher, up)
            lacking = join_session(fetcher, n, "lacking")
            whole = join_session(fetcher, n, "whole")
            fetcher.on_announce(whole, wire.HaveOne(1, False, 0))  # announced the chunk whole already
            arriving = join_session(fetcher, n, "arriving")
            fetcher.on_announce(arriving, wire.Incoming(1, False, 0))  # announced it is receiving it
            origin = join_session(fetcher, n, "origin", role="origin", region="r0")
            await fetcher.on_piece(up, wire.Piece(1, False, 0, 0, len(data), data[:half]))
            await trio.testing.wait_all_tasks_blocked()
            assert [s.id for s in (up, lacking, whole, arriving, origin) if sent_of(s, wire.Incoming)] == ["lacking"]
            late = join_session(fetcher, n, "late")  # connected while the chunk arrived: was not told
            # A told peer reconnects: its new session was not told either.
            fetcher.peer_left(lacking)
            del fetcher.peers.sessions["lacking"]
            again = join_session(fetcher, n, "lacking")
            await fetcher.on_piece(up, wire.Piece(1, False, 0, half, len(data), data[half:]))
            await trio.testing.wait_all_tasks_blocked()
            assert 0 in fetcher.store.have(KEY)
            # The told peer already knows; the one that was receiving it gets the HaveOne,
            # as its own flow may still fail; whoever holds it whole, and the origin, do not.
            assert [s.id for s in (up, lacking, whole, arriving, origin, late)
                    if sent_of(s, wire.HaveOne)] == ["arriving", "late"]
            assert sent_of(again, wire.HaveOne) and not sent_of(again, wire.Incoming)
            assert fetcher._told.get(KEY, {}) == {}
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_peer_that_refused_the_chunk_hears_of_it_again(tmp_path):
    """A Reject withdraws what the peer said of the chunk: it is told Incoming and HaveOne as
    one that never had it, until it announces the chunk again."""
    fetcher, chunks = _fetcher(tmp_path)
    data = chunks[0]

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            up = join_session(fetcher, n, "up", region="r0")
            await _asked(fetcher, up)
            refused, again = join_session(fetcher, n, "refused"), join_session(fetcher, n, "again")
            for s in (refused, again):
                fetcher.on_announce(s, wire.HaveOne(1, False, 0))
                fetcher.on_reject(s, wire.Reject(1, False, 0, "not held"))
            fetcher.on_announce(again, wire.Incoming(1, False, 0))  # receiving it now
            await fetcher.on_piece(up, wire.Piece(1, False, 0, 0, len(data), data[:1]))
            await fetcher.on_piece(up, wire.Piece(1, False, 0, 1, len(data), data[1:]))
            await trio.testing.wait_all_tasks_blocked()
            assert sent_of(refused, wire.Incoming) and not sent_of(refused, wire.HaveOne)  # told
            assert not sent_of(again, wire.Incoming) and sent_of(again, wire.HaveOne)  # its flow may fail
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_chunk_that_fails_its_hash_drops_the_sender_and_is_not_kept(tmp_path):
    fetcher, chunks = _fetcher(tmp_path)
    bad = bytes(len(chunks[0]))

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            up = join_session(fetcher, n, "up", region="r0")
            await _asked(fetcher, up)
            with pytest.raises(PeerDropped, match="does not match its manifest"):
                await fetcher.on_piece(up, wire.Piece(1, False, 0, 0, len(bad), bad))
            assert 0 not in fetcher.store.have(KEY) and fetcher.chunks_rejected == 1
            assert fetcher.inflows.source(KEY, 0) is None
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_reject_past_the_objects_end_drops_the_peer(tmp_path):
    """Such a Reject answers no request; it used to reach the picker as a misuse and end the daemon."""
    fetcher, chunks = _fetcher(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            up = join_session(fetcher, n, "up", region="r0")
            with pytest.raises(PeerDropped, match="which has"):
                fetcher.on_reject(up, wire.Reject(1, False, len(chunks), "not held"))
            n.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("prefix_ok", [True, False])
def test_a_chunk_whose_transfer_broke_is_asked_of_the_next_holder_from_where_it_broke(tmp_path, prefix_ok):
    """Issue 26: the bytes that came before the sender died are kept, and only the rest is
    asked of the next holder (RequestRest), so they do not cross the WAN twice. If the
    resumed chunk fails its check, the fault may be the dead sender's: the next holder is
    not dropped, and the chunk is asked of it again whole."""
    fetcher, chunks = _fetcher(tmp_path)
    data = chunks[0]
    half = len(data) // 2

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            up = join_session(fetcher, n, "up", region="r0")
            fetcher.on_announce(up, wire.HaveOne(1, False, 0))
            await trio.testing.wait_all_tasks_blocked()
            assert wire.Request(1, False, 0) in sent_of(up, wire.Request)
            first = data[:half] if prefix_ok else bytes(half)
            await fetcher.on_piece(up, wire.Piece(1, False, 0, 0, len(data), first))
            fetcher.peer_left(up)  # it died mid-chunk
            del fetcher.peers.sessions["up"]
            nxt = join_session(fetcher, n, "next", region="r0")
            fetcher.on_announce(nxt, wire.HaveOne(1, False, 0))
            await trio.testing.wait_all_tasks_blocked()
            assert [m for m in sent_of(nxt, wire.RequestRest) if m.chunk == 0] == [wire.RequestRest(1, False, 0, half)]
            assert not [m for m in sent_of(nxt, wire.Request) if m.chunk == 0]
            await fetcher.on_piece(nxt, wire.Piece(1, False, 0, half, len(data), data[half:]))
            await trio.testing.wait_all_tasks_blocked()
            if prefix_ok:
                assert 0 in fetcher.store.have(KEY) and fetcher.store.get_chunk(KEY, 0) == data
                assert fetcher.bytes_in["other_region"] == len(data) - half  # what the next holder sent
            else:
                assert 0 not in fetcher.store.have(KEY) and fetcher.chunks_rejected == 1
                assert "next" in fetcher.peers.sessions and fetcher.inflows.partial(KEY, 0) == 0
                assert [m for m in sent_of(nxt, wire.Request) if m.chunk == 0] == [wire.Request(1, False, 0)]
            n.cancel_scope.cancel()

    trio.run(main)
