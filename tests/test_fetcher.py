"""The fetcher's requests in flight, in process, on trio's mock clock: a request the picker
says has timed out is cancelled, and the chunk is asked of another holder.

The peers are sessions whose message streams only record what they are sent."""

import dataclasses
import logging
import hashlib
import os

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.fetcher import Fetcher
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.net.transport import MessageStream, exchange_hello
from patchswarm.node.peers import PeerSet, Session
from patchswarm.node.relay import Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.protocol import wire
from patchswarm.protocol.assembly import PART_BYTES
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.picker import SLOW, PiecePicker
from patchswarm.protocol.versions import VersionBook

KEY = (1, False)
TIMEOUT = 30.0


@dataclasses.dataclass
class RecordingStream:
    sent: list = dataclasses.field(default_factory=list)

    async def send(self, msg) -> None:
        self.sent.append((trio.current_time(), msg))


async def _noop(s, msg) -> None:
    pass


def _fetcher(tmp_path, **picker_kw) -> Fetcher:
    store = ObjectStore(tmp_path / "objects")
    m = Manifest(swarm_id="sw", version=1, base_version=0, base_hash="blake3:" + "00" * 32,
                 target_hash="blake3:" + "11" * 32, tensors=[], chunks=[(10, bytes(32))], codec={"format": 1},
                 created_at=0.0)
    store.put_manifest(KEY, m, b"(envelope)")
    picker = PiecePicker("me", "r1", "r1", seed=3, request_timeout=picker_kw.pop("request_timeout", TIMEOUT), **picker_kw)
    picker.add_object(KEY, 1, now=0.0)
    inflows = Inflows()
    peers = PeerSet("me", store, TokenBucket(None), _noop, inflows=inflows)
    book = VersionBook("sw", Ed25519PrivateKey.generate().public_key())
    return Fetcher("me", "r1", picker, peers, inflows, store, book, on_complete=lambda key: None)


def _session(fetcher, nursery, peer: str, role: str = "node", says=wire.HaveOne) -> Session:
    """A peer of my region connects and says `says` of chunk 0 (HaveOne: it holds it;
    Incoming: it is arriving at it; None: nothing)."""
    s = Session(RecordingStream(), peer, role, "r1", "x:1", outbound=True)
    s.tasks = nursery
    fetcher.peers.sessions[peer] = s
    fetcher.peer_joined(s)
    if says is not None:
        fetcher.on_announce(s, says(KEY[0], KEY[1], 0))
    return s


def _sent(s: Session, kind) -> list[float]:
    return [t for t, m in s.ms.sent if isinstance(m, kind)]


async def _neighbour_then_origin(fetcher, nursery) -> tuple[Session, Session]:
    """The fetcher running, a neighbour "a" and the origin connect, both holding chunk 0: the
    neighbour is asked first; the origin (never asked for an endgame copy) only once it fails."""
    await nursery.start(fetcher.run)
    first, second = _session(fetcher, nursery, "a"), _session(fetcher, nursery, "origin", role="origin")
    await trio.testing.wait_all_tasks_blocked()
    assert len(_sent(first, wire.Request)) == 1 and not _sent(second, wire.Request)
    return first, second


def test_a_request_that_times_out_is_cancelled_and_asked_of_another_holder(tmp_path):
    fetcher = _fetcher(tmp_path)

    async def main():
        start = trio.current_time()
        async with trio.open_nursery() as n:
            first, second = await _neighbour_then_origin(fetcher, n)
            await trio.sleep(TIMEOUT - 1)  # neither answers
            assert not _sent(first, wire.Cancel) and not _sent(second, wire.Request)
            await trio.sleep(2)
            [cancelled_at] = _sent(first, wire.Cancel)
            [asked_at] = _sent(second, wire.Request)
            assert cancelled_at - start == asked_at - start == TIMEOUT
            await trio.sleep(10 * TIMEOUT)  # the second one times out too: nobody is left to ask
            assert len(_sent(first, wire.Request)) == len(_sent(second, wire.Request)) == 1
            assert len(_sent(second, wire.Cancel)) == 1 and fetcher.picker.in_flight() == 0
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


SNUB = 5.0


@pytest.mark.parametrize("part_at", [None, 4.0])
def test_a_neighbour_that_sends_no_part_is_snubbed_and_the_origin_asked_at_snub_after(tmp_path, caplog, part_at):
    """A member that announces a chunk and never answers held the request until the 30 s
    timeout; now until it has sent no part for `snub_after` (counted from its last part: the
    fetcher reports each one). The origin is then asked for what is missing, from the bytes
    kept; the log says it once."""
    fetcher = _fetcher(tmp_path, snub_after=SNUB)

    async def main():
        start = trio.current_time()
        async with trio.open_nursery() as n:
            a, origin = await _neighbour_then_origin(fetcher, n)
            if part_at is not None:
                await trio.sleep(part_at)
                await fetcher.on_piece(a, wire.Piece(KEY[0], KEY[1], 0, 0, 10, b"01234"))  # half the chunk
            quiet_from = part_at or 0.0
            await trio.sleep(quiet_from + SNUB - 0.1 - (trio.current_time() - start))
            assert not _sent(a, wire.Cancel) and not fetcher.picker.snubbed("a")
            await trio.sleep(0.2)
            [cancelled_at] = _sent(a, wire.Cancel)
            [ask] = [(t, m) for t, m in origin.ms.sent if isinstance(m, (wire.Request, wire.RequestRest))]
            assert cancelled_at - start == ask[0] - start == quiet_from + SNUB
            assert ask[1] == (wire.Request(KEY[0], KEY[1], 0) if part_at is None else wire.RequestRest(KEY[0], KEY[1], 0, 5))
            assert fetcher.picker.snubbed("a") and fetcher.snubs == 1
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    said = [r.getMessage() for r in caplog.records if "sent no part" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("peer a sent no part for 5.0 s while it held 1 of my requests")


def test_a_neighbour_that_drips_parts_is_snubbed_as_slow_and_the_origin_asked_for_the_rest(tmp_path, caplog):
    """A member that sends a byte of its answer every 4.9 s is never silent: the request waited
    for the 30 s timeout. The fetcher tells the picker each part's bytes, and at `snub_after`
    the chunk would take the member 49 s at its rate, over `slow_chunk_s` (40 s here): it is
    snubbed as slow, and the origin is asked for the rest (from the bytes kept); its next part
    does not end the snub. The status counts it apart from a silent peer's."""
    fetcher = _fetcher(tmp_path, snub_after=SNUB, slow_chunk_s=40.0)

    async def main():
        start = trio.current_time()
        async with trio.open_nursery() as n:
            a, origin = await _neighbour_then_origin(fetcher, n)
            await trio.sleep(4.9)
            await fetcher.on_piece(a, wire.Piece(KEY[0], KEY[1], 0, 0, 10, b"0"))  # a byte of ten
            await trio.sleep(0.05)
            assert not _sent(a, wire.Cancel) and not fetcher.picker.snubbed("a")
            await trio.sleep(0.1)
            [cancelled_at] = _sent(a, wire.Cancel)
            [ask] = [(t, m) for t, m in origin.ms.sent if isinstance(m, (wire.Request, wire.RequestRest))]
            assert cancelled_at - start == ask[0] - start == SNUB
            assert ask[1] == wire.RequestRest(KEY[0], KEY[1], 0, 1)
            assert fetcher.picker.snub_reason("a") == SLOW and (fetcher.slow_snubs, fetcher.snubs) == (1, 0)
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    said = [r.getMessage() for r in caplog.records if "too slowly" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("peer a served too slowly (a chunk would take it 40 s or more)")


def test_a_request_due_whole_only_past_its_timeout_is_given_up_at_snub_after(tmp_path, caplog):
    """A member sends 2 of a chunk's 10 bytes in its first 4.9 s: at that rate the chunk comes
    whole at 24.5 s, within `slow_chunk_s` (40 s here), so the member is not snubbed, but past
    the request's timeout (20 s here), which gives it up anyway. The request is given up at
    `snub_after` instead, the origin asked for the rest; the log says why, the status counts it."""
    fetcher = _fetcher(tmp_path, snub_after=SNUB, slow_chunk_s=40.0, request_timeout=20.0)

    async def main():
        start = trio.current_time()
        async with trio.open_nursery() as n:
            a, origin = await _neighbour_then_origin(fetcher, n)
            await trio.sleep(4.9)
            await fetcher.on_piece(a, wire.Piece(KEY[0], KEY[1], 0, 0, 10, b"01"))  # 2 bytes of ten
            await trio.sleep(0.05)
            assert not _sent(a, wire.Cancel)
            await trio.sleep(0.1)
            [cancelled_at] = _sent(a, wire.Cancel)
            [ask] = [(t, m) for t, m in origin.ms.sent if isinstance(m, (wire.Request, wire.RequestRest))]
            assert cancelled_at - start == ask[0] - start == SNUB
            assert ask[1] == wire.RequestRest(KEY[0], KEY[1], 0, 2)
            assert not fetcher.picker.snubbed("a") and fetcher.given_up_early == 1
            assert (fetcher.slow_snubs, fetcher.snubs) == (0, 0)
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    said = [r.getMessage() for r in caplog.records if "only after its" in r.getMessage()]
    assert said == ["peer a would deliver chunk 0 of v1 patch only after its 20 s timeout at its rate so far; "
                    "asking elsewhere for the rest"]


def test_a_neighbour_whose_relay_broke_is_asked_again_the_moment_it_has_the_chunk(tmp_path):
    """Issue 26: a relay refused mid-stream (its own source died) must not keep the node
    from asking it once it holds the chunk; before, only the 2 s takeover or a new
    connection did."""
    fetcher = _fetcher(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            s = _session(fetcher, n, "a", says=wire.Incoming)  # a relays it as it arrives
            await trio.testing.wait_all_tasks_blocked()
            assert len(_sent(s, wire.Request)) == 1
            fetcher.on_reject(s, wire.Reject(KEY[0], KEY[1], 0, "stream aborted"))
            await trio.sleep(1.0)
            assert len(_sent(s, wire.Request)) == 1  # refused, and nothing new said
            fetcher.on_announce(s, wire.HaveOne(KEY[0], KEY[1], 0))  # it got the chunk anew
            await trio.testing.wait_all_tasks_blocked()
            first, again = _sent(s, wire.Request)
            assert again - first == 1.0  # at once, on the announcement
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_peer_refused_a_chunk_hears_once_it_is_held_though_it_was_told_it_was_coming(tmp_path):
    """Issue 26 (bench/RESULTS.md, 2026-12-05): a relay whose source died refused its
    followers the rest of the chunk; told `Incoming` before, they were not told `HaveOne`
    once it fetched the chunk whole, never asked it again, and waited 2 s for takeover."""
    data = os.urandom(2 * PART_BYTES)
    store = ObjectStore(tmp_path / "objects")
    m = Manifest(swarm_id="sw", version=1, base_version=0, base_hash="blake3:" + "00" * 32,
                 target_hash="blake3:" + "11" * 32, tensors=[], chunks=[(len(data), hashlib.sha256(data).digest())],
                 codec={"format": 1}, created_at=0.0)
    store.put_manifest(KEY, m, b"(envelope)")
    picker = PiecePicker("me", "r1", "r1", seed=3, request_timeout=TIMEOUT)
    picker.add_object(KEY, 1, now=0.0)
    inflows = Inflows()

    def on_open(s):
        fetcher.peer_joined(s)

    peers = PeerSet("me", store, TokenBucket(None), _noop, on_open=on_open, inflows=inflows)
    book = VersionBook("sw", Ed25519PrivateKey.generate().public_key())
    fetcher = Fetcher("me", "r1", picker, peers, inflows, store, book, on_complete=lambda key: None)

    async def heard(stream) -> list:
        out = []
        while True:
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.05):
                out.append(await stream.receive())
                continue
            return out

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            up = _session(fetcher, n, "up")  # holds the chunk: asked for it
            a, b = trio.testing.memory_stream_pair()
            mine, follower = MessageStream(a, "b", "node"), MessageStream(b, "me", "node")
            async with trio.open_nursery() as hello:
                hello.start_soon(exchange_hello, mine, wire.Hello("me", "r1", "node", "x:1", []))
                hello.start_soon(exchange_hello, follower, wire.Hello("b", "r1", "node", "x:2", []))
            n.start_soon(peers.run, mine, False)
            await trio.testing.wait_all_tasks_blocked()
            await fetcher.on_piece(up, wire.Piece(KEY[0], KEY[1], 0, 0, len(data), data[:PART_BYTES]))
            assert await heard(follower) == [wire.Incoming(KEY[0], KEY[1], 0)]
            del peers.sessions["up"]  # its source dies part-way: the bytes are kept
            fetcher.peer_left(up)
            await follower.send(wire.RequestRest(KEY[0], KEY[1], 0, PART_BYTES))
            assert [type(x).__name__ for x in await heard(follower)] == ["Reject"]  # nothing moving here
            again = _session(fetcher, n, "again")  # another holder: asked for the rest
            await trio.testing.wait_all_tasks_blocked()
            [ask] = [x for _, x in again.ms.sent if isinstance(x, wire.RequestRest)]
            assert ask.offset == PART_BYTES
            await fetcher.on_piece(again, wire.Piece(KEY[0], KEY[1], 0, PART_BYTES, len(data), data[PART_BYTES:]))
            assert store.have(KEY) == {0}
            assert await heard(follower) == [wire.HaveOne(KEY[0], KEY[1], 0)]  # it may ask here again
            n.cancel_scope.cancel()

    trio.run(main)


def _member_brings_it(fetcher, nursery, peer: str = "a") -> Session:
    """A member of my region connects and says chunk 0 is arriving at it."""
    return _session(fetcher, nursery, peer, says=wire.Incoming)


@pytest.mark.parametrize("origin_bytes_came", [False, True])
def test_a_request_to_the_origin_is_cancelled_when_a_region_member_brings_the_chunk(tmp_path, origin_bytes_came):
    """Issue 26 (bench/RESULTS.md, 2026-12-05): in the origin's region a member that has
    asked for all of its share takes over chunks of another's (protocol/picker.py,
    `pick_share`); where both asked the origin for one chunk, the one that hears the
    other's Incoming before a byte of its own came cancels its request, so the origin
    does not send the chunk twice, and takes it from the member instead. Once the
    origin's bytes flow, they are not thrown away."""
    fetcher = _fetcher(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            origin = _session(fetcher, n, "origin", role="origin")
            await trio.testing.wait_all_tasks_blocked()
            assert len(_sent(origin, wire.Request)) == 1
            if origin_bytes_came:
                fetcher.inflows.receive("origin", KEY, 0, 10, 0, 10, b"01234")  # the first part
            s = _member_brings_it(fetcher, n)
            await trio.testing.wait_all_tasks_blocked()
            if origin_bytes_came:
                assert not _sent(origin, wire.Cancel)
            else:
                assert len(_sent(origin, wire.Cancel)) == 1 and len(_sent(s, wire.Request)) == 1
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_relayed_chunk_s_rest_moved_to_the_origin_is_asked_from_the_bytes_held(tmp_path, caplog):
    """Issue 26: in the origin's region, once no chunk is left for the origin to start, the
    member of highest weight among those that lack a chunk another member is fanning out
    takes the rest from the origin (protocol/picker.py, `pick_rest`): its request to the
    relaying member is cancelled and the origin is asked from the byte it has. Names chosen
    so that n0 owns the chunk and me outweighs n1. Nothing moves until a chunk from the origin
    has been timed (REST_MIN_CHUNK_S), so me asks n0 first."""
    fetcher = _fetcher(tmp_path, origin_pipeline=2, endgame_after=0.5)
    fetcher.picker.set_members({"me": "r1", "n0": "r1", "n1": "r1"})

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            origin = _session(fetcher, n, "origin", role="origin")
            _session(fetcher, n, "n1", says=None)  # lacks it too
            n0 = _member_brings_it(fetcher, n, "n0")  # n0 receives it from the origin, relays it to me
            await trio.testing.wait_all_tasks_blocked()
            assert len(_sent(n0, wire.Request)) == 1 and not _sent(origin, wire.Request)
            fetcher.inflows.receive("n0", KEY, 0, 10, 0, 10, b"01234")  # half of it came
            fetcher.picker.origin_chunk_s = 0.3  # as if a chunk from the origin had taken 300 ms
            fetcher.on_announce(n0, wire.HaveOne(KEY[0], KEY[1], 0))  # a fact: the picker is asked again
            await trio.testing.wait_all_tasks_blocked()
            assert len(_sent(n0, wire.Cancel)) == 1
            [rest] = [m for _, m in origin.ms.sent if isinstance(m, (wire.Request, wire.RequestRest))]
            assert rest == wire.RequestRest(KEY[0], KEY[1], 0, 5)
            n.cancel_scope.cancel()

    caplog.set_level(logging.DEBUG, logger="patchswarm")
    # The debug log says which rule asked: the first request planned, the second a rest.
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    asked = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request chunk 0")]
    assert asked[0].endswith("from n0 (planned)") and asked[-1].endswith("from origin from byte 5 (rest)"), asked


@pytest.mark.parametrize("rate, cap", [(None, None), (300e3, 1), (700e3, 3), (2e6, 6), (100e6, 287)])
def test_a_download_limit_sizes_the_requests_in_flight_to_three_seconds_of_it(tmp_path, rate, cap):
    """With `--download-limit`, the picker's `max_inflight` is what the node takes in
    DOWNLINK_QUEUE_S (3 s) at that rate in the plan's largest chunks (1 MiB here), at
    least one; without a limit there is no such bound."""
    from patchswarm.protocol.manifest import sign_manifest

    sk = Ed25519PrivateKey.generate()
    book = VersionBook("sw", sk.public_key())
    m = Manifest(swarm_id="sw", version=1, base_version=0, base_hash="blake3:" + "00" * 32,
                 target_hash="blake3:" + "11" * 32, tensors=[], chunks=[(1 << 20, bytes(32))] * 3 + [(10, bytes(32))],
                 codec={"format": 1}, created_at=0.0)
    book.offer(sign_manifest(m, sk))
    store = ObjectStore(tmp_path / "objects")
    picker = PiecePicker("me", "r1", "r1")
    inflows = Inflows()
    peers = PeerSet("me", store, TokenBucket(None), _noop, inflows=inflows)
    fetcher = Fetcher("me", "r1", picker, peers, inflows, store, book, on_complete=lambda key: None,
                      download_rate=rate)

    async def main():
        fetcher.want([KEY])

    trio.run(main)
    assert picker.is_fetching(KEY) and picker.max_inflight == cap


@pytest.mark.parametrize("newer", [False, True])
def test_a_late_joiner_asks_for_the_first_keyframe_at_once_and_the_swarm_fetches_it_under_the_plan(tmp_path, newer):
    """The swarm's first version is a keyframe with no patch beside it: while it is the newest,
    every member fetches it and it goes under the WAN plan like a patch. A node that joins after
    newer versions came wants it too, but the others applied it long ago: under the plan it waited
    for the takeover (2 s) before asking anyone (test_swarm's late node: 2.0 s of 2.1 s to catch
    up on loopback). Now the origin, the only holder, is asked at once."""
    from patchswarm.protocol.manifest import sign_manifest

    sk = Ed25519PrivateKey.generate()
    book = VersionBook("sw", sk.public_key())
    hashes = ["blake3:" + f"{i:02x}" * 32 for i in range(3)]
    first = Manifest(swarm_id="sw", version=0, base_version=None, base_hash=None, target_hash=hashes[0], tensors=[],
                     chunks=[(10, bytes(32))] * 4, codec={"format": 1}, created_at=0.0)
    book.offer(sign_manifest(first, sk))
    if newer:
        patch = Manifest(swarm_id="sw", version=1, base_version=0, base_hash=hashes[0], target_hash=hashes[1],
                         tensors=[], chunks=[(10, bytes(32))], codec={"format": 1}, created_at=1.0)
        book.offer(sign_manifest(patch, sk))
    store = ObjectStore(tmp_path / "objects")
    picker = PiecePicker("me", "r1", "r0", seed=3, request_timeout=TIMEOUT, takeover_after=2.0)
    picker.set_members({"me": "r1", "a": "r1", "b": "r0"})
    inflows = Inflows()
    peers = PeerSet("me", store, TokenBucket(None), _noop, inflows=inflows)
    fetcher = Fetcher("me", "r1", picker, peers, inflows, store, book, on_complete=lambda key: None)
    key = (0, True)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(fetcher.run)
            sessions = {}
            for peer, role, region in [("a", "node", "r1"), ("b", "node", "r0"), ("origin", "origin", "r0")]:
                s = sessions[peer] = Session(RecordingStream(), peer, role, region, "x:1", outbound=True)
                s.tasks = n
                peers.sessions[peer] = s
                fetcher.peer_joined(s)
            fetcher.on_announce(sessions["origin"], wire.Have(0, True, bytes([0b1111])))
            fetcher.want([key])
            await trio.testing.wait_all_tasks_blocked()
            n.cancel_scope.cancel()
        return sessions

    sessions = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert picker._objects[key].is_patch == (not newer)
    asked = [m.chunk for _, m in sessions["origin"].ms.sent if isinstance(m, wire.Request)]
    if newer:  # as many as the pipeline allows, at once (the mock clock has not moved)
        assert asked and set(asked) <= {0, 1, 2, 3}, asked
