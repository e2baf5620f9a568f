"""Wire protocol: round trips, framing under any split, Hello-first rules, hostile bytes."""

import dataclasses
import itertools

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from patchswarm.protocol import wire
from patchswarm.protocol.errors import FrameTooLarge, ProtocolError, TruncatedStream, UsageError
from patchswarm.protocol.manifest import MAX_CHUNKS
from patchswarm.protocol.wire import (
    CLOSED, NEED_DATA, Announce, Bye, Cancel, Connection, Error, Have, HaveOne, Heartbeat,
    Hello, Incoming, Piece, PeerDelta, PeerList, Reject, Request, RequestRest, Revocations, Signal, Trajectories,
    TrajectoriesAck,
    VersionNotice,
    bitfield_from_indices, indices_from_bitfield,
)

from memory import traced_peak

uint = st.integers(min_value=0, max_value=2**64 - 1)
chunk = st.integers(min_value=0, max_value=MAX_CHUNKS - 1)  # chunk indices are below what a manifest may hold
text = st.text(max_size=20)
blob = st.binary(max_size=64)
# a declared uplink (revision 5): msgpack carries an int or a float, both in (0, MAX_UPLINK_MBIT]
uplinks = st.integers(1, wire.MAX_UPLINK_MBIT) | st.floats(
    min_value=1e-6, max_value=wire.MAX_UPLINK_MBIT, allow_nan=False, allow_infinity=False)
peer = st.fixed_dictionaries({"id": text, "region": text, "addr": text, "role": text},
                             optional={"uplink": uplinks})

hellos = st.builds(Hello, node_id=text, region=text, role=text, listen=text,
                   versions=st.lists(uint, max_size=5), uplink=st.none() | uplinks)
messages = st.one_of(
    hellos,
    st.builds(Have, version=uint, keyframe=st.booleans(), chunks=blob),
    st.builds(HaveOne, version=uint, keyframe=st.booleans(), chunk=chunk),
    st.builds(Request, version=uint, keyframe=st.booleans(), chunk=chunk),
    st.builds(RequestRest, version=uint, keyframe=st.booleans(), chunk=chunk, offset=uint),
    st.builds(Piece, version=uint, keyframe=st.booleans(), chunk=chunk, offset=uint, total=uint, data=blob),
    st.builds(Incoming, version=uint, keyframe=st.booleans(), chunk=chunk),
    st.builds(Cancel, version=uint, keyframe=st.booleans(), chunk=chunk),
    st.builds(Reject, version=uint, keyframe=st.booleans(), chunk=chunk, reason=text),
    st.builds(Trajectories, batch=blob),
    st.builds(TrajectoriesAck, seqs=st.lists(uint, max_size=5)),
    st.builds(wire.TrajectoriesBusy, retry_ms=st.integers(0, wire.MAX_RETRY_MS)),
    st.builds(Announce, manifest=blob),
    st.builds(PeerList, peers=st.lists(peer, max_size=4)),
    st.builds(PeerList, peers=st.lists(peer, max_size=4),
              wan_rates=st.none() | st.dictionaries(text.filter(bool), st.integers(1, 10**6) | st.floats(
                  min_value=1e-3, max_value=1e9, allow_nan=False, allow_infinity=False), max_size=4)),
    st.builds(PeerDelta, add=st.lists(peer, max_size=4), remove=st.lists(text, max_size=4)),
    st.builds(VersionNotice, version=uint, manifest=blob),
    st.builds(wire.VersionHint, version=uint, keyframe=st.booleans()),
    st.builds(wire.ManifestRequest, version=uint, keyframe=st.booleans()),
    st.builds(wire.Unreachable, addr=text, reason=text),
    st.builds(Heartbeat, versions=st.lists(uint, max_size=2)),
    st.builds(Revocations, envelope=blob),
    st.builds(Signal, peer=text.filter(bool), kind=st.sampled_from(wire.SIGNAL_KINDS), session=uint, sdp=text,
              cert=blob, signature=blob),
    st.builds(Bye, reason=text),
    st.builds(Error, message=text),
)
body_messages = messages.filter(lambda m: not isinstance(m, (Hello, Bye)))

HELLO = Hello(node_id="n1", region="eu", role="node", listen="10.0.0.1:7000", versions=[1, 2])


def frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def drain(conn):
    out = []
    while (ev := conn.next_event()) is not NEED_DATA and ev is not CLOSED:
        out.append(ev)
    return out, ev


def session(msgs):
    """The bytes a sender emits for Hello followed by msgs."""
    sender = Connection()
    return b"".join(sender.send(m) for m in [HELLO, *msgs])


# --- round trips and framing -------------------------------------------------------


def test_every_type_is_covered():
    assert set(wire.MESSAGE_TYPES) == {
        "Hello", "Have", "HaveOne", "Incoming", "Request", "RequestRest", "Piece", "Cancel", "Reject", "Announce",
        "PeerList", "VersionNotice", "Heartbeat", "Trajectories", "TrajectoriesAck", "Revocations", "Bye",
        "Error", "PeerDelta", "Signal", "VersionHint", "ManifestRequest", "Unreachable", "TrajectoriesBusy"}


@given(messages)
def test_round_trip_each_message(msg):
    data = wire.encode(msg)
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    assert wire.decode_body(data[4:]) == msg


@given(st.lists(body_messages, max_size=10))
def test_byte_by_byte_equals_whole(msgs):
    data = session(msgs)
    whole = Connection()
    whole.receive_data(data)
    whole.receive_data(b"")
    expected, end = drain(whole)
    assert expected == [HELLO, *msgs] and end is CLOSED

    split = Connection()
    got = []
    for i in range(len(data)):
        split.receive_data(data[i:i + 1])
        more, end = drain(split)
        assert end is NEED_DATA
        got += more
    split.receive_data(b"")
    more, end = drain(split)
    assert got + more == expected and end is CLOSED
    assert split.next_event() is CLOSED  # stays closed


@given(st.lists(body_messages, max_size=10), st.data())
def test_random_splits(msgs, data):
    raw = session(msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    conn = Connection()
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(raw)]):
        if b > a:
            conn.receive_data(raw[a:b])
        got += drain(conn)[0]
    assert got == [HELLO, *msgs]


class CountingFrames(wire.FrameBuffer):
    """A FrameBuffer that counts the bytes its compaction moves: its one cost that grows
    with what is buffered, so parsing is linear exactly when this stays within a small
    multiple of the input (a check on work done, not on this machine's speed)."""

    def __init__(self):
        super().__init__()
        self.moved = 0

    def _consume(self, end):
        before = len(self._buf)
        super()._consume(end)
        if 0 < len(self._buf) < before:
            self.moved += len(self._buf)


def _frames_fed(raw: bytes, piece: int) -> tuple[list[bytes], CountingFrames]:
    frames, bodies = CountingFrames(), []
    for i in range(0, len(raw), piece):
        frames.receive_data(raw[i:i + piece])
        while (b := frames.next_body()) is not NEED_DATA:
            bodies.append(b)
    return bodies, frames


@pytest.mark.parametrize("piece", [1 << 20, 4096, 100])
def test_many_small_frames_cost_linear_work(piece):
    """A parser that compacted its buffer on every frame would move ~n²/2 bytes here."""
    msgs = [HaveOne(version=1, keyframe=False, chunk=i) for i in range(60_000)]
    raw = session(msgs)
    bodies, frames = _frames_fed(raw, piece)
    assert len(bodies) == len(msgs) + 1 and wire.decode_body(bodies[-1]) == msgs[-1]
    assert frames.moved <= len(raw), (frames.moved, len(raw))


def test_parsed_frames_are_dropped_while_a_partial_one_waits():
    """The buffer never empties while a frame is half in (a stream that never pauses between
    frames); what was parsed must still go, or the buffer holds the whole stream."""
    body = b"x" * 1000
    framed = wire.frame_header(len(body)) + body
    n = 3 * (64 << 10) // len(framed)
    frames = wire.FrameBuffer()
    frames.receive_data(framed * n + framed[:10])
    assert [frames.next_body() for _ in range(n)] == [body] * n
    assert frames.next_body() is NEED_DATA
    assert len(frames._buf) <= (64 << 10) + len(framed), len(frames._buf)


def test_one_large_frame_fed_in_small_pieces():
    piece = Piece(version=3, keyframe=True, chunk=7, offset=0, total=8 << 20, data=bytes(range(256)) * (8 << 12))  # 8 MiB
    raw = session([piece])
    conn = Connection()
    got = []
    for i in range(0, len(raw), 4096):
        conn.receive_data(raw[i:i + 4096])
        got += drain(conn)[0]
    assert got == [HELLO, piece]
    # the waiting frame is never moved while it grows (2048 pieces of 4 KiB)
    bodies, frames = _frames_fed(raw, 4096)
    assert len(bodies) == 2 and frames.moved <= wire.HEADER_BYTES + len(bodies[0])


# --- limits and truncation ---------------------------------------------------------


def test_oversized_header_raises_at_once():
    conn = Connection(max_frame=1000)
    conn.receive_data((1001).to_bytes(4, "big"))  # no body at all yet
    with pytest.raises(FrameTooLarge):
        conn.next_event()
    with pytest.raises(ProtocolError):  # broken for good
        conn.next_event()


def test_default_max_frame():
    conn = Connection()
    conn.receive_data(wire.encode(HELLO) + (wire.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert conn.next_event() == HELLO
    with pytest.raises(FrameTooLarge):
        conn.next_event()
    ok = Connection()
    ok.receive_data(wire.encode(HELLO) + wire.MAX_FRAME_BYTES.to_bytes(4, "big"))
    assert ok.next_event() == HELLO
    assert ok.next_event() is NEED_DATA


def test_frames_before_hello_are_held_to_the_hello_limit():
    conn = Connection()
    conn.receive_data((wire.MAX_HELLO_FRAME_BYTES + 1).to_bytes(4, "big"))  # the header alone
    with pytest.raises(FrameTooLarge, match=str(wire.MAX_HELLO_FRAME_BYTES)):
        conn.next_event()
    conn = Connection(max_frame=100)  # a smaller max_frame is the limit before Hello too
    conn.receive_data((101).to_bytes(4, "big"))
    with pytest.raises(FrameTooLarge):
        conn.next_event()


def test_send_respects_max_frame():
    conn = Connection(max_frame=100)
    conn.send(HELLO)
    big = Piece(version=1, keyframe=False, chunk=0, offset=0, total=200, data=bytes(200))
    body = len(wire.encode(big)) - wire.HEADER_BYTES
    with pytest.raises(UsageError, match=f"expected a frame of at most 100 bytes, found {body}$"):
        conn.send(big)


@pytest.mark.parametrize("slack", [0, 1, 3, 4, 5])
def test_send_takes_a_frame_up_to_max_frame_exactly(slack):
    big = Piece(version=1, keyframe=False, chunk=0, offset=0, total=200, data=bytes(200))
    body = len(wire.encode(big)) - wire.HEADER_BYTES
    fits = Connection(max_frame=body + slack)
    fits.send(HELLO)
    assert fits.send(big) == wire.encode(big)
    over = Connection(max_frame=body - 1 - slack)
    over.send(HELLO)
    with pytest.raises(UsageError, match=f"at most {body - 1 - slack} bytes, found {body}$"):
        over.send(big)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6), st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_framed_bodies_come_back_whole_however_the_stream_is_cut(bodies, cuts):
    """wire.frame (the local API's framing) read back by FrameBuffer, the stream fed in pieces."""
    raw = b"".join(wire.frame(b) for b in bodies)
    assert len(raw) == sum(wire.HEADER_BYTES + len(b) for b in bodies)
    frames, got, pos, i = wire.FrameBuffer(), [], 0, 0
    while pos < len(raw):
        step = cuts[i % len(cuts)]
        frames.receive_data(raw[pos:pos + step])
        pos, i = pos + step, i + 1
        while (body := frames.next_body()) is not NEED_DATA:
            got.append(body)
    frames.receive_data(b"")
    assert got == bodies and frames.next_body() is wire.CLOSED


def test_frame_refuses_a_body_over_max_frame():
    assert wire.frame(bytes(10), max_frame=10)[wire.HEADER_BYTES:] == bytes(10)
    with pytest.raises(UsageError):
        wire.frame(bytes(11), max_frame=10)


@pytest.mark.parametrize("version, latest, kept", [
    (5, None, True), (10 ** 9, None, True),  # nothing known yet: any may be on its way
    (10, 10, True), (7, 10, True), (6, 10, False), (0, 10, False),  # behind: 4, the bound excluded
    (26, 10, True), (27, 10, False), (10 ** 6, 10, False),  # ahead: 16, the bound included
    (0, 0, True), (16, 0, True), (17, 0, False),
])
def test_announcements_of_unknown_versions_are_kept_only_near_the_latest(version, latest, kept):
    assert wire.UNKNOWN_VERSIONS_BEHIND == 4 and wire.UNKNOWN_VERSIONS_AHEAD == 16
    assert wire.unknown_kept(version, latest) is kept


@pytest.mark.parametrize("value, ok", [((1 << 64) - 1, True), (1 << 64, False), (1 << 70, False)])
def test_an_int_field_is_bounded_by_msgpacks_widest_uint(value, ok):
    """Above 2**64 - 1 msgpack cannot carry an int: refused as the message's field, not
    an OverflowError from deep in the packer."""
    msg = Heartbeat(versions=[1, value])
    if ok:
        conn = Connection()
        conn.receive_data(session([msg]))
        assert drain(conn)[0] == [HELLO, msg]
    else:
        with pytest.raises(UsageError, match="Heartbeat.versions"):
            wire.encode(msg)


@pytest.mark.parametrize("cut", [1, 3, 4, 10])
def test_truncated_frame_at_eof(cut):
    raw = session([])
    conn = Connection()
    conn.receive_data(raw[:cut])
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    with pytest.raises(TruncatedStream, match="truncated frame"):
        conn.next_event()


def test_eof_before_anything_is_closed():
    conn = Connection()
    conn.receive_data(b"")
    assert conn.next_event() is CLOSED
    with pytest.raises(UsageError):
        conn.receive_data(b"x")


def test_bad_max_frame():
    for bad in (0, -1, 2**32, "16"):
        with pytest.raises(UsageError):
            Connection(max_frame=bad)


# --- state machine -----------------------------------------------------------------


def test_send_must_start_with_hello():
    conn = Connection()
    with pytest.raises(UsageError):
        conn.send(Heartbeat(versions=[]))
    conn.send(HELLO)
    conn.send(Heartbeat(versions=[]))
    with pytest.raises(UsageError):
        conn.send(HELLO)  # only once


def test_nothing_after_bye():
    conn = Connection()
    conn.send(HELLO)
    conn.send(Bye(reason="done"))
    for msg in (Heartbeat(versions=[]), Bye(reason="again"), HELLO):
        with pytest.raises(UsageError):
            conn.send(msg)


def test_receive_must_start_with_hello():
    conn = Connection()
    conn.receive_data(wire.encode(Heartbeat(versions=[])))
    with pytest.raises(ProtocolError, match="Hello"):
        conn.next_event()
    with pytest.raises(ProtocolError):
        conn.next_event()


def test_a_refusal_may_come_in_place_of_hello_and_ends_the_connection():
    """A listener over a member's admission budget answers its Hello with an Error
    (node/net/transport.py); before, the dialer read it as a broken Hello."""
    conn = Connection()
    conn.receive_data(wire.encode(Error(message="over budget")) + wire.encode(HELLO))
    assert conn.next_event() == Error(message="over budget")
    with pytest.raises(ProtocolError, match="nothing after Bye or a refusal"):  # a refusal is the connection's last word
        conn.next_event()


def test_receive_after_bye_and_second_hello():
    conn = Connection()
    conn.receive_data(wire.encode(HELLO) + wire.encode(Bye(reason="x")) + wire.encode(Heartbeat(versions=[])))
    assert conn.next_event() == HELLO
    assert conn.next_event() == Bye(reason="x")
    with pytest.raises(ProtocolError, match="Bye"):
        conn.next_event()

    conn = Connection()
    conn.receive_data(wire.encode(HELLO) * 2)
    assert conn.next_event() == HELLO
    with pytest.raises(ProtocolError):
        conn.next_event()


def test_bye_then_eof_is_clean():
    conn = Connection()
    conn.receive_data(session([Bye(reason="bye")]))
    conn.receive_data(b"")
    assert drain(conn) == ([HELLO, Bye(reason="bye")], CLOSED)


# --- validation ------------------------------------------------------------------


@pytest.mark.parametrize("obj, needle", [
    ({"t": "Nope"}, '"t"'),
    ({"version": 1}, '"t"'),
    ([1, 2], "map"),
    ({"t": "Request", "version": 1, "keyframe": False}, "missing ['chunk']"),
    ({"t": "Request", "version": 1, "keyframe": False, "chunk": 2, "x": 3}, "unexpected ['x']"),
    ({"t": "Request", "version": -1, "keyframe": False, "chunk": 2}, "Request.version: expected non-negative int"),
    ({"t": "Request", "version": True, "keyframe": False, "chunk": 2}, "found bool"),
    ({"t": "Request", "version": "1", "keyframe": False, "chunk": 2}, "found str"),
    ({"t": "Request", "version": 1, "keyframe": 0, "chunk": 2}, "Request.keyframe: expected bool, found int"),
    ({"t": "Piece", "version": 1, "keyframe": False, "chunk": 2, "offset": 0, "total": 4, "data": "text"}, "Piece.data: expected bytes, found str"),
    ({"t": "TrajectoriesAck", "seqs": [1, "2"]}, "TrajectoriesAck.seqs"),
    ({"t": "Bye", "reason": b"raw"}, "Bye.reason: expected str"),
    ({"t": "Hello", "node_id": "a", "region": "b", "role": "c", "listen": "d", "versions": [1, -2]},
     "Hello.versions"),
    ({"t": "PeerList", "peers": [{"id": "a", "region": "b"}]}, "PeerList.peers"),
    ({"t": "PeerList", "peers": [{"id": "a", "region": "b", "addr": 5, "role": "node"}]}, "PeerList.peers"),
    ({"t": "PeerList", "peers": [{"id": "a", "region": "b", "addr": "x"}]}, "PeerList.peers"),
    ({"t": "PeerDelta", "add": [], "remove": ["a", 3]}, "PeerDelta.remove"),
    ({"t": "PeerDelta", "add": [{"id": "a"}], "remove": []}, "PeerDelta.add"),
    ({"t": "Heartbeat", "versions": [], "extra": 1}, "unexpected"),
])
def test_decode_rejects(obj, needle):
    with pytest.raises(ProtocolError) as info:
        wire.decode_body(msgpack.packb(obj, use_bin_type=True))
    assert needle in str(info.value)


@pytest.mark.parametrize("body", [b"", b"\xc1", b"\x81", msgpack.packb({"t": "Heartbeat", "versions": []}) + b"\x00",
                                  b"\xa2\xff\xfe"])
def test_non_msgpack_body(body):
    with pytest.raises(ProtocolError, match="msgpack"):
        wire.decode_body(body)


def test_send_validates():
    conn = Connection()
    conn.send(HELLO)
    for bad in (Request(version=-1, keyframe=False, chunk=0), Piece(version=1, keyframe=False, chunk=0, offset=0, total=3, data=bytearray(3)),
                PeerList(peers=[{"id": "a"}]), "Heartbeat", {"t": "Heartbeat"}):
        with pytest.raises(UsageError):
            conn.send(bad)
    assert conn.our_state == wire.OPEN  # a refused send changes nothing


# --- hostile input -----------------------------------------------------------------


def feed_and_drain(conn, data):
    try:
        conn.receive_data(data)
        drain(conn)
        conn.receive_data(b"")
        drain(conn)
    except ProtocolError:
        with pytest.raises(ProtocolError):
            conn.next_event()


@settings(max_examples=300)
@given(st.binary(max_size=200), st.booleans())
def test_random_bytes_raise_only_protocol_error(data, after_hello):
    prefix = wire.encode(HELLO) if after_hello else b""
    feed_and_drain(Connection(max_frame=1 << 12), prefix + data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | text | blob,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150)
@given(st.sampled_from(sorted(wire.MESSAGE_TYPES)),
       st.dictionaries(st.sampled_from(["version", "chunk", "data", "peers", "node_id", "region",
                                        "role", "listen", "versions", "reason", "message",
                                        "manifest", "chunks", "keyframe", "batch", "seqs", "peer",
                                        "kind", "session", "sdp", "cert", "signature", "other"]),
                       msgpack_values, max_size=6))
def test_random_maps_raise_only_protocol_error(name, fields):
    raw = wire.encode(HELLO) + frame({"t": name, **fields})
    feed_and_drain(Connection(), raw)


# --- signalling bounds -----------------------------------------------------------------

SIGNAL = Signal("n2", "offer", 7, "v=0\r\n", b"-----BEGIN CERTIFICATE-----", b"sig")


@pytest.mark.parametrize("field,value,expected", [
    ("kind", "candidate", "one of offer, answer"),
    ("peer", "", "a member name"),
    ("peer", "n" * (wire.MEMBER_NAME_MAX + 1), f"at most {wire.MEMBER_NAME_MAX}"),
    ("sdp", "x" * (wire.SDP_MAX_BYTES + 1), f"at most {wire.SDP_MAX_BYTES}"),
    ("cert", b"x" * (wire.CERT_MAX_BYTES + 1), f"at most {wire.CERT_MAX_BYTES}"),
    ("signature", b"x" * (wire.SIGNATURE_MAX_BYTES + 1), f"at most {wire.SIGNATURE_MAX_BYTES}"),
])
def test_signal_out_of_bounds_is_refused_both_ways(field, value, expected):
    import dataclasses
    bad = dataclasses.replace(SIGNAL, **{field: value})
    with pytest.raises(UsageError, match=expected):
        wire.encode(bad)
    fields = {f: getattr(bad, f) for f in ("peer", "kind", "session", "sdp", "cert", "signature")}
    with pytest.raises(ProtocolError, match=expected):
        drain_all(wire.encode(HELLO) + frame({"t": "Signal", **fields}))


def drain_all(raw: bytes):
    c = Connection()
    c.receive_data(raw)
    return drain(c)


def test_signal_statement_binds_every_field():
    base = ("sw-1", "n1", "n2", "offer", 7, "v=0")
    s = wire.signal_statement(*base)
    for i, other in enumerate(("sw-2", "n3", "n3", "answer", 8, "v=1")):
        changed = list(base)
        changed[i] = other
        assert wire.signal_statement(*changed) != s


# --- bitfields ---------------------------------------------------------------------


@given(st.integers(0, 300).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(n - 1, 0)))
                                                          if n else st.just(set()))))
def test_bitfield_round_trip(case):
    n, idx = case
    b = bitfield_from_indices(idx, n)
    assert len(b) == (n + 7) // 8
    assert indices_from_bitfield(b, n) == sorted(idx)


def test_bitfield_layout():
    assert bitfield_from_indices([0, 9], 10) == bytes([0b1, 0b10])
    assert indices_from_bitfield(bytes([0x80]), 8) == [7]


def test_bitfield_rejects():
    with pytest.raises(ProtocolError, match="bitfield of 2 bits: found bits set beyond bit 1$"):
        indices_from_bitfield(bytes([0b0000_0100]), 2)
    with pytest.raises(ProtocolError, match="bitfield of 9 bits: expected 2 bytes, found 1$"):
        indices_from_bitfield(bytes(1), 9)
    with pytest.raises(UsageError):
        bitfield_from_indices([10], 10)
    with pytest.raises(UsageError):
        bitfield_from_indices([-1], 10)
    with pytest.raises(UsageError, match="expected a non-negative int n, found int -1$"):
        bitfield_from_indices([], -1)
    # a long value is cut to 57 characters and '...' in the message
    with pytest.raises(UsageError, match=r"found str 'x{56}\.\.\.$"):
        bitfield_from_indices([], "x" * 100)


# --- bounded decoding -----------------------------------------------------------------

_PAIRS = (8 << 20) - 64
NESTED_16MIB = b"\xdd" + _PAIRS.to_bytes(4, "big") + b"\x91\x90" * _PAIRS  # 8 M arrays each holding an empty one


def test_a_16_mib_nested_array_frame_before_hello_costs_nothing_to_refuse():
    data = len(NESTED_16MIB).to_bytes(4, "big") + NESTED_16MIB

    def attack():
        conn = Connection()
        with pytest.raises(FrameTooLarge):
            for i in range(0, len(data), 64 << 10):  # as a socket delivers it
                conn.receive_data(data[i:i + (64 << 10)])
                drain(conn)

    assert traced_peak(attack) < 1 << 20


@pytest.mark.parametrize("field", ["peers", "seqs", "versions", "chunks"])
def test_a_16_mib_nested_frame_after_hello_costs_little_beyond_its_bytes(field):
    name = {"peers": "PeerList", "seqs": "TrajectoriesAck", "versions": "Heartbeat", "chunks": "Have"}[field]
    head = msgpack.packb({"t": name})[1:]  # the map's first entry; the map header is written below
    extra = {"Have": msgpack.packb("version")[0:] + b"\x01" + msgpack.packb("keyframe") + b"\xc2"}.get(name, b"")
    body = bytes([0x80 | (2 if not extra else 4)]) + head + extra + msgpack.packb(field) + NESTED_16MIB
    conn = Connection()
    conn.receive_data(wire.encode(HELLO))
    assert conn.next_event() == HELLO
    frame_bytes = len(body).to_bytes(4, "big") + body

    def attack():
        conn.receive_data(frame_bytes)
        with pytest.raises(ProtocolError):
            conn.next_event()

    assert traced_peak(attack) < 2 * len(frame_bytes) + (2 << 20)  # the buffered frame, a copy of its body, little else


def long_text(n):
    return "x" * n


@pytest.mark.parametrize("msg, needle", [
    (Have(version=1, keyframe=False, chunks=bytes(wire.MAX_BITFIELD_BYTES + 1)), "Have.chunks"),
    (HaveOne(version=1, keyframe=False, chunk=MAX_CHUNKS), "HaveOne.chunk"),
    (Request(version=1, keyframe=True, chunk=MAX_CHUNKS), "Request.chunk"),
    (RequestRest(version=1, keyframe=True, chunk=MAX_CHUNKS, offset=1), "RequestRest.chunk"),
    (PeerList(peers=[{"id": "a", "region": "r", "addr": "x:1", "role": "node"}] * (wire.MAX_PEERS + 1)), "PeerList.peers"),
    (PeerList(peers=[{"id": long_text(wire.MAX_NAME_BYTES + 1), "region": "r", "addr": "x:1", "role": "node"}]), "PeerList.peers"),
    (TrajectoriesAck(seqs=list(range(wire.MAX_ACK_SEQS + 1))), "TrajectoriesAck.seqs"),
    (PeerList(peers=[], wan_rates={f"r{i}": 1 for i in range(wire.MAX_WAN_REGIONS + 1)}), "PeerList.wan_rates"),
    (PeerList(peers=[], wan_rates={"r0": 100, "r1": -5}), "PeerList.wan_rates"),
    (PeerList(peers=[], wan_rates={"r0": 0.0}), "PeerList.wan_rates"),
    (PeerList(peers=[], wan_rates={"r0": float("inf")}), "PeerList.wan_rates"),
    (PeerList(peers=[], wan_rates={"r0": "fast"}), "PeerList.wan_rates"),
    (PeerList(peers=[], wan_rates={"": 5}), "PeerList.wan_rates"),
    (PeerList(peers=[], wan_rates={long_text(wire.MAX_NAME_BYTES + 1): 5}), "PeerList.wan_rates"),
    (Heartbeat(versions=list(range(wire.MAX_VERSIONS_LISTED + 1))), "Heartbeat.versions"),
    (Error(message=long_text(wire.MAX_TEXT_BYTES + 1)), "Error.message"),
    (wire.Unreachable(addr=long_text(wire.MAX_ADDR_BYTES + 1), reason="x"), "Unreachable.addr"),
    (wire.Unreachable(addr="x:1", reason=long_text(wire.MAX_TEXT_BYTES + 1)), "Unreachable.reason"),
    (Trajectories(batch=bytes(wire.MAX_BATCH_WIRE_BYTES + 1)), "Trajectories.batch"),
])
def test_every_field_is_bounded_by_what_its_message_may_carry(msg, needle):
    with pytest.raises(UsageError, match=needle):  # the sender's side
        wire.encode(msg)
    fields = {f: getattr(msg, f) for f in msg.__dataclass_fields__}
    body = msgpack.packb({"t": type(msg).__name__, **fields}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=needle):  # the receiver's
        wire.decode_body(body)


@pytest.mark.parametrize("field, text", [("node_id", long_text(wire.MAX_NAME_BYTES + 1)), ("listen", long_text(wire.MAX_ADDR_BYTES + 1)),
                                         ("region", "é" * (wire.MAX_NAME_BYTES // 2 + 1))])
def test_hello_names_are_bounded_in_utf8_bytes(field, text):
    bad = dataclasses.replace(HELLO, **{field: text})
    with pytest.raises(UsageError, match=f"Hello.{field}"):
        wire.encode(bad)
    conn = Connection(max_frame=1 << 20)
    conn.receive_data(frame({"t": "Hello", **dataclasses.asdict(bad)}))
    with pytest.raises(ProtocolError, match=f"Hello.{field}"):
        conn.next_event()


def test_the_type_key_comes_first_and_fields_once():
    body = msgpack.packb({"version": 1, "t": "HaveOne", "keyframe": False, "chunk": 1})
    with pytest.raises(ProtocolError, match='first key is "t"'):
        wire.decode_body(body)
    twice = b"\x84" + msgpack.packb("t") + msgpack.packb("Bye") + (msgpack.packb("reason") + msgpack.packb("x")) * 2 + b"\xc0\xc0"
    with pytest.raises(ProtocolError, match="twice"):
        wire.decode_body(twice)


def test_have_chunks_checks_a_have_against_the_manifest_and_ignores_unknown_objects():
    have = Have(version=3, keyframe=False, chunks=bitfield_from_indices([0, 5, 9], 10))
    assert wire.have_chunks(have, 10) == [0, 5, 9]
    assert wire.have_chunks(have, None) is None  # object not known here: ignorable
    with pytest.raises(ProtocolError, match="bitfield of 20 bits"):
        wire.have_chunks(have, 20)
    with pytest.raises(ProtocolError, match="beyond bit 8"):
        wire.have_chunks(have, 9)


def test_a_full_bitfield_expands_in_one_vectorized_pass():
    n = MAX_CHUNKS
    got = indices_from_bitfield(b"\xff" * wire.MAX_BITFIELD_BYTES, n)
    assert len(got) == n and got[:3] == [0, 1, 2] and got[-1] == n - 1


nested = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | text | blob,
    lambda kids: st.lists(kids, max_size=40) | st.dictionaries(text, kids, max_size=8),
    max_leaves=400,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(wire.MESSAGE_TYPES)), st.sampled_from(["peers", "seqs", "versions", "chunks", "data", "node_id"]),
       nested, st.booleans())
def test_nested_structures_in_any_field_end_in_protocol_error_within_a_budget(name, field, value, after_hello):
    data = frame({"t": name, field: value})
    prefix = wire.encode(HELLO) if after_hello else b""
    peak = traced_peak(lambda: feed_and_drain(Connection(), prefix + data))
    assert peak < 4 * len(data) + (256 << 10)


# --- optional fields: a member of the previous version ----------------------------

PEER = {"id": "n1", "region": "eu", "addr": "10.0.0.1:7000", "role": "node"}


def test_an_optional_field_left_at_none_is_the_previous_versions_frame():
    """A PeerList without rates is byte for byte what a tracker of the previous version sent,
    so a member of that version (which refuses fields it does not know) reads it."""
    old = frame({"t": "PeerList", "peers": [PEER]})
    assert wire.encode(PeerList(peers=[PEER])) == old
    assert wire.decode_body(old[4:]) == PeerList(peers=[PEER], wan_rates=None)  # absent: no rates


def test_a_peer_list_with_wan_rates_round_trips_and_a_field_unknown_to_the_reader_is_refused():
    msg = PeerList(peers=[PEER], wan_rates={"eu": 100, "us": 2.5})
    data = wire.encode(msg)
    assert wire.decode_body(data[4:]) == msg
    with pytest.raises(ProtocolError, match=r"unexpected \['rates'\]"):  # what a reader does with a field it does not know
        wire.decode_body(frame({"t": "PeerList", "peers": [PEER], "rates": {"eu": 1}})[4:])
    with pytest.raises(ProtocolError, match=r"missing \['peers'\]"):  # only the optional field may be absent
        wire.decode_body(frame({"t": "PeerList", "wan_rates": {"eu": 1}})[4:])


@pytest.mark.parametrize("rates, found", [
    ({"eu": -1}, "-1 for region 'eu'"),
    ({"eu": 0}, "0 for region 'eu'"),
    ({"eu": float("nan")}, "nan for region 'eu'"),
    ({"": 1}, "region ''"),
    ({"eu": "100"}, "str"),
    ([["eu", 1]], "array"),
])
def test_bad_wan_rates_from_the_tracker_say_what_was_expected_and_found(rates, found):
    with pytest.raises(ProtocolError, match="PeerList.wan_rates") as raised:
        wire.decode_body(frame({"t": "PeerList", "peers": [], "wan_rates": rates})[4:])
    assert found in str(raised.value) and "expected" in str(raised.value)


# --- declared uplinks (revision 5) -------------------------------------------------


def test_a_hello_without_an_uplink_is_the_previous_revisions_frame():
    """A revision-4 member refuses a Hello field it does not know: a Hello with no uplink is the
    frame it reads, and one with an uplink round-trips to a member of revision 5."""
    old = frame({"t": "Hello", **{k: v for k, v in dataclasses.asdict(HELLO).items() if k != "uplink"}})
    assert wire.encode(HELLO) == old
    assert wire.decode_body(old[4:]).uplink is None
    for value in (10, 2.5, wire.MAX_UPLINK_MBIT):
        with_uplink = dataclasses.replace(HELLO, uplink=value)
        assert wire.decode_body(wire.encode(with_uplink)[4:]) == with_uplink


@pytest.mark.parametrize("value", [0, -1, 0.0, float("nan"), float("inf"), wire.MAX_UPLINK_MBIT + 1, True, "10"])
def test_an_uplink_out_of_bounds_is_refused_both_ways(value):
    with pytest.raises(UsageError, match="Hello.uplink: expected None or an uplink"):
        wire.encode(dataclasses.replace(HELLO, uplink=value))
    with pytest.raises(ProtocolError, match="Hello.uplink: expected an uplink in Mbit/s"):
        wire.decode_body(frame({"t": "Hello", **dataclasses.asdict(HELLO), "uplink": value})[4:])
    entry = {**PEER, "uplink": value}
    with pytest.raises(UsageError, match="PeerList.peers"):
        wire.encode(PeerList(peers=[entry]))
    for msg in ({"t": "PeerList", "peers": [entry]}, {"t": "PeerDelta", "add": [entry], "remove": []}):
        with pytest.raises(ProtocolError, match="expected a peer's uplink in Mbit/s"):
            wire.decode_body(frame(msg)[4:])


@pytest.mark.parametrize("entry, found", [
    ({**PEER, "speed": 10}, "key 'speed'"),  # only "uplink" may be added
    ({**PEER, "uplink": 10, "speed": 10}, "a peer map"),  # six keys: more than a peer has
    ({"id": "n1", "region": "eu", "addr": "x:1", "uplink": 10}, "keys ['addr', 'id', 'region', 'uplink']"),
    ({"id": "n1", "region": "eu", "addr": "x:1"}, "a map of 3 keys"),
])
def test_a_peer_entry_may_add_only_an_uplink(entry, found):
    with pytest.raises(ProtocolError, match="PeerDelta.add") as raised:
        wire.decode_body(frame({"t": "PeerDelta", "add": [entry], "remove": []})[4:])
    assert found in str(raised.value) and "expected" in str(raised.value)
    with pytest.raises(UsageError, match="PeerDelta.add"):
        wire.encode(PeerDelta(add=[entry], remove=[]))


def test_a_peer_entry_with_an_uplink_round_trips_as_int_or_float():
    entries = [{**PEER, "uplink": 100}, {**PEER, "id": "n2", "uplink": 12.5}, {**PEER, "id": "n3"}]
    assert wire.decode_body(wire.encode(PeerList(peers=entries))[4:]).peers == entries


# --- large bodies received into their own buffers (FrameBuffer direct_bodies) ------------------------


def _piece(i: int, size: int) -> Piece:
    pattern = bytes(range(i % 251, 251)) + bytes(range(i % 251))  # byte k is (i + k) % 251
    return Piece(version=7, keyframe=False, chunk=i, offset=0, total=size, data=(pattern * (size // 251 + 1))[:size])


def _read_like_a_socket(conn: Connection, raw: bytes, reads: list[int]):
    """Feed `raw` the way node/net/transport.py does: into `body_buffer()` while there is one,
    else `receive_data` of at most `read_limit()`; each read takes at most the next of `reads`
    (cycled) of what has "arrived". The messages, how many bytes went into body buffers, and
    where in `raw` each read ended."""
    got, pos, direct, i, ends = [], 0, 0, 0, []
    while True:
        more, end = drain(conn)
        got += more
        if end is CLOSED:
            return got, direct, ends
        if pos == len(raw):
            conn.receive_data(b"")
            continue
        want = min(reads[i % len(reads)], len(raw) - pos)
        i += 1
        target = conn.body_buffer()
        if target is not None:
            n = min(want, len(target))
            target[:n] = raw[pos:pos + n]
            target.release()
            conn.body_received(n)
            direct += n
        else:
            limit = conn.read_limit()
            n = want if limit is None else min(want, limit)
            conn.receive_data(raw[pos:pos + n])
        pos += n
        ends.append(pos)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 100, wire.DIRECT_MIN_BYTES - 1, wire.DIRECT_MIN_BYTES, 65536, 70000]),
                max_size=8),
       st.lists(st.integers(1, 40000), min_size=1, max_size=6), st.lists(body_messages, max_size=3))
def test_large_bodies_land_in_their_own_buffers_and_every_message_comes_back(sizes, reads, small):
    """Chunk parts among small messages, however the reads fall: the messages are those sent,
    in order; a part's data is a read-only view; every part at least DIRECT_MIN_BYTES whose
    frame begins after the read that brought the first one's header read its body straight
    into its own buffer, so its data views a bytearray (that read may hold more whole frames,
    large ones too, read before any large one was seen: copied once, as any small frame)."""
    msgs = [_piece(i, n) for i, n in enumerate(sizes)]
    msgs[1:1] = small
    raw = session(msgs)
    got, direct, ends = _read_like_a_socket(Connection(), raw, reads)
    assert got == [HELLO, *msgs]
    parts = [m for m in got if isinstance(m, Piece) and m.chunk < len(sizes) and m.version == 7 and m.total == len(m.data)]
    for m in got:
        if isinstance(m, Piece):
            assert isinstance(m.data, memoryview) and m.data.readonly
    starts = dict(zip(map(id, [HELLO, *msgs]),
                      itertools.accumulate([len(wire.encode(m)) for m in [HELLO, *msgs]], initial=0)))
    large = [(starts[id(sent)], m) for sent, m in zip(msgs, got[1:])
             if any(m is p for p in parts) and len(m.data) >= wire.DIRECT_MIN_BYTES]
    if large:
        seen = next(e for e in ends if e >= large[0][0] + wire.HEADER_BYTES)  # the read that brought its header
        after = [m for start, m in large[1:] if start >= seen]
        for m in after:  # after a large frame the next header is read alone: its body is never in a read
            assert type(m.data.obj) is bytearray and len(m.data.obj) >= len(m.data)
        if after:
            assert direct > 0


def test_a_large_frames_header_alone_holds_its_whole_body_against_the_budget():
    """From its header on, a large frame counts as buffered whole (its buffer is allocated):
    a reader's budget sees what a header alone makes it allocate."""
    raw = session([_piece(0, 65536)])
    hello_end = 4 + int.from_bytes(raw[:4], "big")
    frame_len = int.from_bytes(raw[hello_end:hello_end + 4], "big")
    conn = Connection()
    conn.receive_data(raw[:hello_end + 4 + 10])
    assert drain(conn) == ([HELLO], NEED_DATA)
    assert conn.buffered == 4 + frame_len
    assert conn.read_limit() == frame_len - 10
    target = conn.body_buffer()
    assert len(target) == frame_len - 10
    target[:] = raw[hello_end + 14:]
    target.release()
    conn.body_received(frame_len - 10)
    [msg], _ = drain(conn)
    assert msg == _piece(0, 65536) and conn.buffered == 0
    assert conn.read_limit() == wire.HEADER_BYTES  # the next header alone
    with pytest.raises(UsageError, match="body_received without a body_buffer"):
        conn.body_received(1)


def test_eof_inside_a_large_frames_own_buffer_is_a_truncated_frame():
    raw = session([_piece(0, 65536)])
    conn = Connection()
    conn.receive_data(raw[:-100])
    drain(conn)
    assert conn.body_buffer() is not None
    conn.body_received(0)  # the peer closed
    assert conn.body_buffer() is None
    with pytest.raises(TruncatedStream, match="truncated frame"):
        conn.next_event()


def test_a_frame_over_the_limit_is_refused_before_any_buffer_is_allocated():
    conn = Connection(max_frame=64 << 10)
    conn.receive_data(session([]))
    drain(conn)
    conn.receive_data((wire.DIRECT_MAX_BYTES).to_bytes(4, "big"))
    with pytest.raises(FrameTooLarge):
        conn.next_event()
    assert conn.buffered == 4


def test_frames_over_the_direct_cap_and_the_local_api_framing_keep_the_copying_path():
    """Bodies over DIRECT_MAX_BYTES, and a FrameBuffer without direct_bodies (the local socket's),
    come back as bytes, and their data as copies."""
    big = Piece(1, False, 0, 0, wire.DIRECT_MAX_BYTES + 1, bytes(wire.DIRECT_MAX_BYTES + 1))
    raw = session([big])
    got, direct, _ = _read_like_a_socket(Connection(), raw, [65536])
    assert got == [HELLO, big] and direct == 0 and type(got[1].data.obj) is bytes
    frames = wire.FrameBuffer()
    body = bytes(100_000)
    frames.receive_data(wire.frame(body)[:50_000])
    assert frames.next_body() is NEED_DATA and frames.body_buffer() is None and frames.read_limit() is None
    frames.receive_data(wire.frame(body)[50_000:])
    assert frames.next_body() == body


def test_piece_data_may_be_any_contiguous_byte_view_and_encodes_as_the_bytes():
    data = bytes(range(200))
    as_bytes = wire.encode(Piece(1, True, 2, 0, 200, data))
    assert wire.encode(Piece(1, True, 2, 0, 200, memoryview(bytearray(data)))) == as_bytes
    assert wire.encode(Piece(1, True, 2, 0, 200, memoryview(data).toreadonly())) == as_bytes
    for bad in (memoryview(data)[::2], memoryview(bytearray(data)).cast("I"), bytearray(data)):
        with pytest.raises(UsageError, match="Piece.data"):
            wire.encode(Piece(1, True, 2, 0, 100, bad))
    decoded = wire.decode_body(as_bytes[4:])
    assert decoded.data.readonly and bytes(decoded.data) == data


def test_bytes_past_a_large_frames_end_in_one_receive_data_go_to_the_next_frames():
    """A caller that feeds more than `read_limit()` (a large frame's rest and the next message in
    one piece) still gets both messages, in order: the excess goes back into the frame buffer."""
    msgs = [_piece(0, 65536), HaveOne(7, False, 3)]
    raw = session(msgs)
    hello_end = 4 + int.from_bytes(raw[:4], "big")
    conn = Connection()
    conn.receive_data(raw[:hello_end + 100])
    assert drain(conn) == ([HELLO], NEED_DATA) and conn.body_buffer() is not None
    conn.receive_data(raw[hello_end + 100:])
    conn.receive_data(b"")
    assert drain(conn) == (msgs, CLOSED)
