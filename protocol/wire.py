"""The peer/tracker wire protocol, with no I/O (in the style of h11).

A frame is a 4-byte big-endian body length followed by a msgpack map whose key
"t" names the message type; the other keys are exactly the message's fields.
`Connection` holds one side's state: feed it bytes with `receive_data`, pull
messages with `next_event` (or the `NEED_DATA` / `CLOSED` sentinels), and turn
messages into bytes with `send`. The caller owns the socket and the clock.

Whose fault: bad bytes from the peer raise `ProtocolError` (after which the
connection is broken for good); the local caller misusing the API (sending an
invalid message, sending before Hello or after Bye) raises `UsageError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack

from .errors import FrameTooLarge, ProtocolError, UsageError

MAX_FRAME_BYTES = 16 << 20  # default limit on one frame's body
HEADER_BYTES = 4  # big-endian body length
_LENGTH_LIMIT = (1 << 32) - 1  # what the header can express
_UINT_LIMIT = 1 << 64  # msgpack's widest unsigned int
_COMPACT_MIN = 64 << 10  # compact the buffer once this much has been consumed...


class _Sentinel:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


NEED_DATA = _Sentinel("NEED_DATA")  # next_event: no complete frame buffered yet
CLOSED = _Sentinel("CLOSED")  # next_event: peer sent EOF at a frame boundary


# --- messages ---------------------------------------------------------------
# Field annotations double as the wire schema (see _CHECKS). Messages are not
# validated on construction; `send` and decoding validate them.


@dataclass(frozen=True)
class Hello:
    node_id: str
    region: str
    role: str
    listen: str
    versions: list[int]


# Chunks belong to an object: the patch or the keyframe of one version, named
# by (version, keyframe). Both can exist for the same version.


@dataclass(frozen=True)
class Have:
    version: int
    keyframe: bool
    chunks: bytes  # bitfield, see bitfield_from_indices; all zero = "I want this object"


@dataclass(frozen=True)
class HaveOne:
    version: int
    keyframe: bool
    chunk: int


@dataclass(frozen=True)
class Request:
    version: int
    keyframe: bool
    chunk: int


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + len(data)) of a chunk of `total` bytes: one part
    of the answer to a Request (protocol/assembly.py). A chunk's parts go in
    order on one connection; parts of different chunks may interleave."""

    version: int
    keyframe: bool
    chunk: int
    offset: int
    total: int
    data: bytes


@dataclass(frozen=True)
class Incoming:
    """The sender is receiving this chunk now and forwards it, as it arrives,
    to whoever requests it (cut-through); a HaveOne follows once it is verified."""

    version: int
    keyframe: bool
    chunk: int


@dataclass(frozen=True)
class Cancel:
    version: int
    keyframe: bool
    chunk: int


@dataclass(frozen=True)
class Reject:
    """The answer to a Request the sender cannot serve (chunk evicted or never held)."""

    version: int
    keyframe: bool
    chunk: int
    reason: str


@dataclass(frozen=True)
class Announce:
    manifest: bytes  # signed manifest bytes


@dataclass(frozen=True)
class PeerList:
    peers: list[dict]  # each exactly {"id": str, "region": str, "addr": str, "role": str}


@dataclass(frozen=True)
class VersionNotice:
    version: int
    manifest: bytes


@dataclass(frozen=True)
class Heartbeat:
    versions: list[int]  # as in Hello: the sender's current verified version, [] if none


@dataclass(frozen=True)
class Trajectories:
    """Node -> origin: one batch of spooled trajectory records (protocol/trajectory.py)."""

    batch: bytes


@dataclass(frozen=True)
class TrajectoriesAck:
    """Origin -> node: these sequence numbers are durable at the origin."""

    seqs: list[int]


@dataclass(frozen=True)
class Revocations:
    """Tracker -> member: the swarm's revocation list, signed by the swarm CA
    (protocol/revocation.py); sent on join and whenever the list changes."""

    envelope: bytes


@dataclass(frozen=True)
class Signal:
    """WebRTC signalling (node/net/rtcsignal.py), relayed by the tracker between members.

    To the tracker, `peer` names the recipient; from the tracker, the sender
    (taken from the sender's certificate, never from the message). `kind` is
    "offer" or "answer"; `session` is the offerer's random id for one attempt,
    which the answer repeats. The SDP carries every ICE candidate (aiortc gathers
    them before it hands out a description: no trickle) and the DTLS certificate
    fingerprint; `signature` is the sender's swarm key over `signal_statement`,
    and `cert` its swarm certificate, so the recipient checks who signed the
    fingerprint without trusting the tracker."""

    peer: str
    kind: str
    session: int
    sdp: str
    cert: bytes
    signature: bytes


@dataclass(frozen=True)
class Bye:
    reason: str


@dataclass(frozen=True)
class Error:
    message: str


MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (Hello, Have, HaveOne, Incoming, Request, Piece, Cancel, Reject, Announce,
                PeerList, VersionNotice, Heartbeat, Trajectories, TrajectoriesAck, Revocations, Signal, Bye, Error)
}
_PEER_KEYS = frozenset({"id", "region", "addr", "role"})


def _found(v) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _is_uint(v) -> bool:
    return type(v) is int and 0 <= v < _UINT_LIMIT


def _check_peer(p) -> bool:
    return (type(p) is dict and p.keys() == _PEER_KEYS
            and all(type(x) is str for x in p.values()))


# annotation -> (predicate, what is expected)
_CHECKS = {
    "str": (lambda v: type(v) is str, "str"),
    "bool": (lambda v: type(v) is bool, "bool"),
    "int": (_is_uint, "non-negative int below 2**64"),
    "bytes": (lambda v: type(v) is bytes, "bytes"),
    "list[int]": (lambda v: type(v) is list and all(map(_is_uint, v)),
                  "list of non-negative ints"),
    "list[dict]": (lambda v: type(v) is list and all(map(_check_peer, v)),
                   'list of {"id": str, "region": str, "addr": str, "role": str} maps'),
}


SIGNAL_KINDS = ("offer", "answer")
SDP_MAX_BYTES = 16 << 10  # an SDP with one data channel and a few dozen candidates is ~1-3 KiB
CERT_MAX_BYTES = 4 << 10  # a P-256 member certificate in PEM is ~0.8 KiB
SIGNATURE_MAX_BYTES = 160  # a DER ECDSA P-256 signature is at most 72 bytes
MEMBER_NAME_MAX = 253  # a DNS name (node/net/trust.py)

# (message, field) -> (predicate, what is expected): bounds beyond the field's type.
_BOUNDS = {
    ("Signal", "peer"): (lambda v: 0 < len(v) <= MEMBER_NAME_MAX, f"a member name of 1 to {MEMBER_NAME_MAX} chars"),
    ("Signal", "kind"): (lambda v: v in SIGNAL_KINDS, f"one of {', '.join(SIGNAL_KINDS)}"),
    ("Signal", "sdp"): (lambda v: len(v) <= SDP_MAX_BYTES, f"an SDP of at most {SDP_MAX_BYTES} chars"),
    ("Signal", "cert"): (lambda v: len(v) <= CERT_MAX_BYTES, f"a certificate of at most {CERT_MAX_BYTES} bytes"),
    ("Signal", "signature"): (lambda v: len(v) <= SIGNATURE_MAX_BYTES,
                              f"a signature of at most {SIGNATURE_MAX_BYTES} bytes"),
}


def _validate(name: str, values: dict, exc: type[Exception]) -> None:
    for f in dataclasses.fields(MESSAGE_TYPES[name]):
        ok, expected = _CHECKS[f.type]
        if not ok(values[f.name]):
            raise exc(f"{name}.{f.name}: expected {expected}, found {_found(values[f.name])}")
        bound = _BOUNDS.get((name, f.name))
        if bound is not None and not bound[0](values[f.name]):
            raise exc(f"{name}.{f.name}: expected {bound[1]}, found {_found(values[f.name])}")


_SIGNAL_DOMAIN = b"patchswarm webrtc signal v1"


def signal_statement(swarm_id: str, sender: str, recipient: str, kind: str, session: int, sdp: str) -> bytes:
    """The bytes a Signal's sender signs: which swarm, from whom, to whom, which step of
    which attempt, and the whole SDP (its DTLS fingerprint with it). A signature over
    these cannot be replayed to another member, swarm, attempt or step."""
    return _SIGNAL_DOMAIN + msgpack.packb([swarm_id, sender, recipient, kind, session, sdp], use_bin_type=True)


def encode(msg) -> bytes:
    """One frame for `msg` (validated; UsageError if invalid)."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise UsageError(f"expected a wire message, found {_found(msg)}")
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    _validate(name, values, UsageError)
    body = msgpack.packb({"t": name, **values}, use_bin_type=True)
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def decode_body(body: bytes):
    """The message in one frame body; ProtocolError if it is not one."""
    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for bad input
        raise ProtocolError(f"expected a msgpack body, found undecodable bytes ({type(e).__name__}: {e})") from None
    if type(obj) is not dict:
        raise ProtocolError(f"expected a msgpack map, found {_found(obj)}")
    name = obj.get("t")
    if type(name) is not str or name not in MESSAGE_TYPES:
        raise ProtocolError(f"expected \"t\" to be one of {sorted(MESSAGE_TYPES)}, found {_found(name)}")
    cls = MESSAGE_TYPES[name]
    wanted = {f.name for f in dataclasses.fields(cls)}
    keys = set(obj) - {"t"}
    if keys != wanted:
        missing, extra = sorted(wanted - keys), sorted(map(str, keys - wanted))
        raise ProtocolError(f"{name}: expected fields {sorted(wanted)}, missing {missing}, unexpected {extra}")
    del obj["t"]
    _validate(name, obj, ProtocolError)
    return cls(**obj)


# --- bitfields ----------------------------------------------------------------


def bitfield_from_indices(indices, n: int) -> bytes:
    """Bit i (byte i // 8, bit i % 8, LSB first) set for each index in [0, n)."""
    if type(n) is not int or n < 0:
        raise UsageError(f"expected a non-negative int n, found {_found(n)}")
    out = bytearray((n + 7) // 8)
    for i in indices:
        if type(i) is not int or not 0 <= i < n:
            raise UsageError(f"expected indices in [0, {n}), found {_found(i)}")
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def indices_from_bitfield(b: bytes, n: int) -> list[int]:
    """The sorted set indices of a bitfield of exactly n bits (ProtocolError if not)."""
    if type(n) is not int or n < 0:
        raise UsageError(f"expected a non-negative int n, found {_found(n)}")
    if len(b) != (n + 7) // 8:
        raise ProtocolError(f"bitfield of {n} bits: expected {(n + 7) // 8} bytes, found {len(b)}")
    if n % 8 and b[-1] >> (n % 8):
        raise ProtocolError(f"bitfield of {n} bits: found bits set beyond bit {n - 1}")
    return [(k << 3) + j for k, byte in enumerate(b) if byte for j in range(8) if byte >> j & 1]


# --- connection -----------------------------------------------------------------

AWAIT_HELLO = "AWAIT_HELLO"  # nothing sent (or received) yet
OPEN = "OPEN"  # Hello done; any message but Hello may follow
DONE = "DONE"  # Bye done; nothing may follow

# (state, message type) -> next state; `None` means any other message type.
_TRANSITIONS = {
    (AWAIT_HELLO, Hello): OPEN,
    (OPEN, Bye): DONE,
    (OPEN, None): OPEN,
}


def _advance(state: str, msg, exc: type[Exception], who: str) -> str:
    nxt = _TRANSITIONS.get((state, type(msg)))
    if nxt is None and type(msg) is not Hello:
        nxt = _TRANSITIONS.get((state, None))
    if nxt is None:
        expected = {AWAIT_HELLO: "Hello first", OPEN: "anything but a second Hello",
                    DONE: "nothing after Bye"}[state]
        raise exc(f"{who}: expected {expected}, found {type(msg).__name__}")
    return nxt


class FrameBuffer:
    """Length-prefixed frames out of a byte stream: the framing alone, any body.

    Shared by the peer protocol (`Connection`) and the node's local socket
    (protocol/localapi.py). `next_body` returns one body, NEED_DATA, or CLOSED.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES):
        if type(max_frame) is not int or not 0 < max_frame <= _LENGTH_LIMIT:
            raise UsageError(f"expected max_frame in [1, 2**32), found {_found(max_frame)}")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0  # bytes of _buf already parsed
        self._eof = False

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; b"" means the peer closed its side."""
        if not data:
            self._eof = True
        elif self._eof:
            raise UsageError("receive_data after EOF")
        else:
            self._buf += data

    def next_body(self):
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail >= HEADER_BYTES:
            n = int.from_bytes(buf[pos:pos + HEADER_BYTES], "big")
            if n > self.max_frame:
                raise FrameTooLarge(f"expected a frame of at most {self.max_frame} bytes, found a header of {n}")
            if avail >= HEADER_BYTES + n:
                end = pos + HEADER_BYTES + n
                with memoryview(buf) as view:  # one copy, not a bytearray slice and then bytes
                    body = bytes(view[pos + HEADER_BYTES:end])
                self._consume(end)
                return body
        if not self._eof:
            return NEED_DATA
        if avail:
            raise ProtocolError(f"truncated frame: EOF with {avail} bytes of an incomplete frame buffered")
        return CLOSED

    def _consume(self, end: int) -> None:
        # Dropping the consumed prefix costs O(rest); doing it only once the
        # prefix is at least half the buffer keeps parsing linear overall.
        if end == len(self._buf):
            self._buf.clear()
            end = 0
        elif end >= _COMPACT_MIN and end * 2 >= len(self._buf):
            del self._buf[:end]
            end = 0
        self._pos = end


def frame_header(n: int, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """The length header of an n-byte body (UsageError if it exceeds `max_frame`)."""
    if n > max_frame:
        raise UsageError(f"expected a frame of at most {max_frame} bytes, found {n}")
    return n.to_bytes(HEADER_BYTES, "big")


def frame(body: bytes, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """`body` behind its length header (UsageError if it exceeds `max_frame`)."""
    return frame_header(len(body), max_frame) + body


class Connection:
    """One side of a peer/tracker connection; see the module docstring."""

    def __init__(self, max_frame: int = MAX_FRAME_BYTES):
        self._frames = FrameBuffer(max_frame)
        self.max_frame = max_frame
        self.our_state = AWAIT_HELLO
        self.their_state = AWAIT_HELLO
        self._error: ProtocolError | None = None

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; b"" means the peer closed its side."""
        self._frames.receive_data(data)

    def next_event(self):
        """The next message from the peer, NEED_DATA, or CLOSED."""
        if self._error is not None:
            raise ProtocolError(f"connection is broken: {self._error}") from self._error
        try:
            return self._next()
        except ProtocolError as e:
            self._error = e
            raise

    def _next(self):
        body = self._frames.next_body()
        if body is NEED_DATA or body is CLOSED:
            return body
        msg = decode_body(body)
        self.their_state = _advance(self.their_state, msg, ProtocolError, "peer")
        return msg

    def send(self, msg) -> bytes:
        """The bytes that carry `msg` to the peer (UsageError if not allowed now)."""
        data = encode(msg)
        if len(data) - HEADER_BYTES > self.max_frame:
            raise UsageError(f"expected a frame of at most {self.max_frame} bytes, found {len(data) - HEADER_BYTES}")
        self.our_state = _advance(self.our_state, msg, UsageError, "send")
        return data
