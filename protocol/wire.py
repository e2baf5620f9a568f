"""The peer/tracker wire protocol, with no I/O (in the style of h11).

A frame is a 4-byte big-endian body length followed by a msgpack map whose key
"t" names the message type; the other keys are exactly the message's fields.
`Connection` holds one side's state: feed it bytes with `receive_data`, pull
messages with `next_event` (or the `NEED_DATA` / `CLOSED` sentinels), and turn
messages into bytes with `send`. The caller owns the socket and the clock.

Whose fault: bad bytes from the peer raise `ProtocolError` (after which the
connection is broken for good); the local caller misusing the API (sending an
invalid message, sending before Hello or after Bye) raises `UsageError`.

Optional fields (a field with a default, None): added to a message after
its first version. `encode` leaves one out while it is None, so the frame is
the one a member of the previous version reads; `decode_body` takes a frame
without it as None. A member of the previous version refuses a field it does
not know, so a sender includes one only where the receiver's connection
selected the wire revision that added it (`WIRE_REVISION`, offered in TLS
ALPN by node/net/trust.py). Revision 2 added PeerList.wan_rates.

New message types: a member of an older revision refuses a message type it
does not know, so a type added by a revision is sent only on a connection that
selected it (`revision(ms.wire_revision) >= N`). Revision 3 added
TrajectoriesBusy.

Content of an opaque field: revision 4 lets a Trajectories batch carry each
record's key (protocol/trajectory.py: a record body with one more element, the
client's record id digested), which the origin deduplicates by across nodes.
An origin of revision 3 or before refuses such a body (and drops the node), so
a node sends keys only on a connection that selected revision 4; an origin of
revision 4 takes batches with and without keys. A member offers every revision it speaks, newest first
(`WIRE_REVISIONS`), and the listener picks the newest both offer, so each pair
of versions talks the newest revision both know.

Revision 5 added the members' declared uplinks: `Hello.uplink` (a member's upload
rate in Mbit/s, its --uplink-mbit) and an optional key "uplink" in a peer entry
of PeerList.peers and PeerDelta.add, with which the tracker passes each member's
on to the others. The WAN plan (protocol/responsibility.py `uplink_caps`) gives a
member with a slow uplink a smaller share of the chunks its region relays, and
makes it a gateway only where too few others are: every member of a region must
plan with the same uplinks, so they come from the tracker, like the WAN rates. A
member of revision 4 refuses both (an unknown Hello field, an unknown peer key):
a node sends its uplink only on a connection that selected revision 5
(node/net/transport.py `exchange_hello` leaves it out on others), and the tracker
strips "uplink" from the entries it sends to a member of revision 4.

Revision 6 added `Heartbeat.uplink`: the uplink a member says it has now, which may move
during its session (protocol/uplinkmeter.py `reported_uplink`: its declared rate, lowered to
what it measured where that is well under it, or what it measured where it declares none). The
tracker takes a new value into the member's peer entry (at most once per
`tracker.core.UPLINK_CHANGE_S`) and passes it on as at a join, so every member plans with it. A
member sends it only to a tracker whose connection selected revision 6 (a tracker of revision 5
would refuse the field); one of revision 5 keeps what the member's Hello said.

Limits (named constants below, like h11's): every frame before the peer's
Hello is at most MAX_HELLO_FRAME_BYTES (its header alone is refused beyond
that, before any body is buffered); after it, `max_frame`. A body is read
along its message's schema (protocol/packreader.py), the type key "t" first:
each field is checked against what that message may carry (names and text by
byte length, version lists, peer lists and ack lists by count, a Have's
bitfield by the largest chunk count a manifest may declare, chunk indices below
it) as it is read, so no frame costs more memory than the fields its type
allows, whatever it declares or nests.

Announcements, for the daemon: `announced_chunks(msg, chunk_count)` checks a
Have, HaveOne or Incoming against the chunk count of the object's manifest and
gives the indices; for an object whose manifest is not known here it gives
None. Such an announcement is ignored without anything built unless its
version is near the latest known (`unknown_kept`): the origin announces a
version to its peers as it tells the tracker, so its Have often arrives before
the manifest, and it does not announce again. Those are kept as they came,
bounded (protocol/piecestate.py). A bitfield is never expanded to indices on
its own length: an all-ones Have of an unknown version once cost a node ~1 GB.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack
import numpy as np

from .errors import FrameTooLarge, ProtocolError, TruncatedStream, UsageError
from .manifest import MAX_CHUNKS
from .packreader import PackReader
from .trajectory import MAX_BATCH_RECORDS, MAX_BATCH_WIRE_BYTES

MAX_FRAME_BYTES = 16 << 20  # default limit on one frame's body
MAX_HELLO_FRAME_BYTES = 4 << 10  # every frame before the peer's Hello (a Hello is ~100 bytes)
HEADER_BYTES = 4  # big-endian body length
MAX_NAME_BYTES = 256  # a node id, region or role (UTF-8)
MAX_ADDR_BYTES = 512  # a listen address, "[host]:port"
MAX_TEXT_BYTES = 4 << 10  # the text of a Reject, Bye or Error
MAX_VERSIONS_LISTED = 64  # Hello and Heartbeat versions (a node sends its current one)
MAX_PEERS = 1 << 14  # members in one PeerList
MAX_WAN_REGIONS = 1 << 10  # regions in a PeerList's wan_rates
# The wire revisions this code speaks, offered newest first in TLS ALPN (node/net/trust.py); a
# connection reads what the revision it selected added (`revision`). Members of the first
# version offer no ALPN protocol and select none; they are sent no optional field.
# the newest: 6 added Heartbeat.uplink (an uplink that moves within a session), 5 declared uplinks
# (Hello.uplink, "uplink" in peer entries), 4 record keys in
# Trajectories batches, 3 TrajectoriesBusy, 2 PeerList.wan_rates
WIRE_REVISION = "patchswarm/6"
WIRE_REVISIONS = (WIRE_REVISION, "patchswarm/5", "patchswarm/4", "patchswarm/3", "patchswarm/2")
RECORD_KEYS_REVISION = 4  # a Trajectories batch may carry record keys (module docstring)
UPLINK_REVISION = 5  # Hello.uplink and peer entries' "uplink" (module docstring)
UPLINK_NOW_REVISION = 6  # Heartbeat.uplink (module docstring)
# The largest uplink a member may declare, in Mbit/s (10 Tbit/s: beyond any NIC; the plan only
# compares uplinks with their region's median, so the bound only keeps the number sane).
MAX_UPLINK_MBIT = 10_000_000
_REVISION_PREFIX = "patchswarm/"
# The longest wait a TrajectoriesBusy may ask for (an hour); a node waits at most its own cap.
MAX_RETRY_MS = 3_600_000
MAX_ACK_SEQS = MAX_BATCH_RECORDS  # a TrajectoriesAck acknowledges one batch
MAX_BITFIELD_BYTES = (MAX_CHUNKS + 7) // 8  # a Have's bitfield
MAX_INT = (1 << 64) - 1  # msgpack's widest unsigned int
SIGNAL_KINDS = ("offer", "answer")
SDP_MAX_BYTES = 16 << 10  # an SDP with one data channel and a few dozen candidates is ~1-3 KiB
CERT_MAX_BYTES = 4 << 10  # a P-256 member certificate in PEM is ~0.8 KiB
SIGNATURE_MAX_BYTES = 160  # a DER ECDSA P-256 signature is at most 72 bytes
MEMBER_NAME_MAX = 253  # a DNS name (node/net/trust.py)
_LENGTH_LIMIT = (1 << 32) - 1  # what the header can express
_MAX_KEY_BYTES = 16  # a field name
_MAX_FIELDS = 6  # fields of the largest message (Piece), "t" aside
_COMPACT_MIN = 64 << 10  # compact the buffer once this much has been consumed...
# FrameBuffer(direct_bodies=True): bodies this large get a buffer of their own (a chunk part,
# 64 KiB), received into without a copy; smaller ones are cheaper copied. The cap bounds what
# a header alone makes a reader allocate (it counts as buffered, against the reader's budget).
DIRECT_MIN_BYTES = 16 << 10
DIRECT_MAX_BYTES = 4 << 20
# After such a frame, the next this many frames' headers are read alone, so that a part
# after a few small messages (HaveOne, Incoming, a Request) still gets its own buffer; a
# connection of small messages only goes back to reading all that has arrived at once.
DIRECT_HEADER_READS = 16


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
    # Revision 5 (optional): the member's declared uplink in Mbit/s, in (0, MAX_UPLINK_MBIT];
    # None: it declares none. Sent only on a connection that selected revision 5.
    uplink: float | None = None


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
class RequestRest:
    """A Request for the chunk from byte `offset` on, answered with Pieces from
    `offset` (or a Reject): the asker holds bytes [0, offset) from a peer whose
    stream broke (it died, or its own source did), so only the rest crosses the
    link again. `offset` is below the chunk's size; a Cancel withdraws it."""

    version: int
    keyframe: bool
    chunk: int
    offset: int


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
    data: bytes | memoryview  # decoded: a read-only view into the frame's body (no copy)


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
    """Tracker -> member: its peer set, the first message of a session (PeerDeltas follow).

    `wan_rates` (revision 2, optional): the swarm's WAN rate of each region (Mbit/s, the
    tracker's --wan-rates), which every member plans its chains with; None: the tracker
    gives none, and a member plans with its own configuration."""

    # each {"id": str, "region": str, "addr": str, "role": str}, plus (revision 5, optional)
    # "uplink": the member's declared uplink in Mbit/s, a number in (0, MAX_UPLINK_MBIT]
    peers: list[dict]
    wan_rates: dict[str, float] | None = None  # region -> rate > 0


@dataclass(frozen=True)
class PeerDelta:
    """Tracker -> member: a change to the peer set it last sent (a PeerList, then
    the deltas after it, in order): drop the ids in `remove`, then add the
    entries in `add` (an entry replaces one with the same id)."""

    add: list[dict]  # entries as in PeerList
    remove: list[str]  # member ids


@dataclass(frozen=True)
class VersionNotice:
    version: int
    manifest: bytes


@dataclass(frozen=True)
class VersionHint:
    """Tracker -> node: an object was announced. Its signed manifest reaches most
    members from their peers (a node passes on every manifest it accepts) or from
    the tracker on a ManifestRequest: the tracker sends whole VersionNotices to a
    few members per region only, so its bytes per version grow with the fleet,
    not with the fleet times the manifest."""

    version: int
    keyframe: bool


@dataclass(frozen=True)
class ManifestRequest:
    """Node -> tracker: the VersionNotice of this hinted object, which no peer passed on in time."""

    version: int
    keyframe: bool


@dataclass(frozen=True)
class Unreachable:
    """Tracker -> node: it could not connect to `addr`, the address the node joined with
    (tracker --probe-reachability), because of `reason`; peers now list the node with
    no address, so it dials them, and nodes that accept nothing reach it over WebRTC."""

    addr: str
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    versions: list[int]  # as in Hello: the sender's current verified version, [] if none
    # Revision 6 (optional): the uplink the member says it has now, Mbit/s as Hello.uplink; None:
    # none. Sent only on a connection that selected revision 6.
    uplink: float | None = None


@dataclass(frozen=True)
class Trajectories:
    """Node -> origin: one batch of spooled trajectory records (protocol/trajectory.py)."""

    batch: bytes


@dataclass(frozen=True)
class TrajectoriesAck:
    """Origin -> node: these sequence numbers are durable at the origin."""

    seqs: list[int]


@dataclass(frozen=True)
class TrajectoriesBusy:
    """Origin -> node (revision 3): one Trajectories batch was not taken, because the
    origin's intake had no room for it; it was dropped unread, unstored and unacked,
    and the node sends it again (from its spool), not before `retry_ms` milliseconds.

    Every Trajectories on a connection is answered once, by a TrajectoriesAck or by
    this, so it names no batch: a node that counts its batches in flight knows when
    every one has its answer, and then resends everything unacked. (Naming the seqs
    would cost the origin a decompress and decode of a batch it refuses because it is
    overloaded.) Sent only on a connection that selected revision 3."""

    retry_ms: int


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
    for cls in (Hello, Have, HaveOne, Incoming, Request, RequestRest, Piece, Cancel, Reject, Announce,
                PeerList, VersionNotice, VersionHint, ManifestRequest, Unreachable, Heartbeat, Trajectories, TrajectoriesAck, Revocations, Bye, Error, PeerDelta,
                Signal, TrajectoriesBusy)
}
_PEER_FIELDS = {"id": MAX_NAME_BYTES, "region": MAX_NAME_BYTES, "addr": MAX_ADDR_BYTES, "role": MAX_NAME_BYTES}
PEER_UPLINK = "uplink"  # the one optional key of a peer entry (revision 5): a number, `is_uplink`
_PEER_WHAT = 'a peer {"id", "region", "addr", "role"} and optionally "uplink"'

# What each field may carry beyond its type (annotation): the most bytes of a
# str or bytes field, the most items of a list, the largest int. Unlisted str
# fields take MAX_NAME_BYTES, bytes fields the frame limit, ints MAX_INT.
_LIMITS = {
    ("Hello", "listen"): MAX_ADDR_BYTES,
    ("Unreachable", "addr"): MAX_ADDR_BYTES,
    ("Unreachable", "reason"): MAX_TEXT_BYTES,
    ("Hello", "versions"): MAX_VERSIONS_LISTED,
    ("Heartbeat", "versions"): MAX_VERSIONS_LISTED,
    ("Have", "chunks"): MAX_BITFIELD_BYTES,
    ("PeerList", "peers"): MAX_PEERS,
    ("PeerList", "wan_rates"): MAX_WAN_REGIONS,
    ("PeerDelta", "add"): MAX_PEERS,
    ("PeerDelta", "remove"): MAX_PEERS,
    ("Signal", "peer"): MEMBER_NAME_MAX,
    ("Signal", "sdp"): SDP_MAX_BYTES,
    ("Signal", "cert"): CERT_MAX_BYTES,
    ("Signal", "signature"): SIGNATURE_MAX_BYTES,
    ("TrajectoriesAck", "seqs"): MAX_ACK_SEQS,
    ("TrajectoriesBusy", "retry_ms"): MAX_RETRY_MS,
    ("Trajectories", "batch"): MAX_BATCH_WIRE_BYTES,
    ("Reject", "reason"): MAX_TEXT_BYTES,
    ("Bye", "reason"): MAX_TEXT_BYTES,
    ("Error", "message"): MAX_TEXT_BYTES,
    **{(name, "chunk"): MAX_CHUNKS - 1 for name in ("HaveOne", "Request", "RequestRest", "Piece", "Incoming", "Cancel", "Reject")},
}
_DEFAULTS = {"str": MAX_NAME_BYTES, "bytes": _LENGTH_LIMIT, "bytes | memoryview": _LENGTH_LIMIT, "int": MAX_INT}


def revision(selected: str | None) -> int:
    """The wire revision a connection selected in ALPN, as a number: 1 for none (a member
    of the first version, or a stream without ALPN), N for "patchswarm/N". ProtocolError
    for anything else (ALPN selects only what this side offered, so only a bug gets there)."""
    if selected is None:
        return 1
    number = selected[len(_REVISION_PREFIX):] if selected.startswith(_REVISION_PREFIX) else ""
    if not (number.isascii() and number.isdigit()) or int(number) < 2:
        raise ProtocolError(f"expected a wire revision {_REVISION_PREFIX}N with N >= 2, or none, found {selected!r}")
    return int(number)


def _optional(cls) -> frozenset[str]:
    """The fields a frame of `cls` may leave out (those with a default: added after its first version)."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING)


def _schema(cls) -> tuple[tuple[str, str, int | None], ...]:
    """(field, annotation, limit) of each field of a message type."""
    return tuple((f.name, f.type, _LIMITS.get((cls.__name__, f.name), _DEFAULTS.get(f.type)))
                 for f in dataclasses.fields(cls))


_SCHEMAS = {name: _schema(cls) for name, cls in MESSAGE_TYPES.items()}
_OPTIONAL = {name: _optional(cls) for name, cls in MESSAGE_TYPES.items()}
_ONE_OF_TYPES = f'"t" to be one of {sorted(MESSAGE_TYPES)}'
# message -> field -> (what errors call it, annotation, limit): `decode_body`'s table
_FIELDS_OF = {name: {f: (f"{name}.{f}", kind, limit) for f, kind, limit in schema} for name, schema in _SCHEMAS.items()}


def _found(v) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _is_uint(v, limit: int = MAX_INT) -> bool:
    return type(v) is int and 0 <= v <= limit


def _utf8_within(v, limit: int) -> bool:
    if type(v) is not str or len(v) > limit:
        return False
    try:
        return len(v.encode("utf-8")) <= limit
    except UnicodeEncodeError:  # a lone surrogate: msgpack cannot send it
        return False


def _is_rate(v) -> bool:
    return type(v) in (int, float) and 0 < v < float("inf")


def _check_rates(v, limit: int) -> bool:
    return v is None or (type(v) is dict and len(v) <= limit and all(
        _utf8_within(k, MAX_NAME_BYTES) and k and _is_rate(rate) for k, rate in v.items()))


def is_uplink(v) -> bool:
    """A declared uplink (Mbit/s) a member may send: an int or float in (0, MAX_UPLINK_MBIT]
    (not a bool, not NaN or infinite)."""
    return type(v) in (int, float) and 0 < v <= MAX_UPLINK_MBIT


def _check_peer(p) -> bool:
    if type(p) is not dict:
        return False
    if PEER_UPLINK in p:
        if not is_uplink(p[PEER_UPLINK]) or len(p) != len(_PEER_FIELDS) + 1:
            return False
    elif len(p) != len(_PEER_FIELDS):
        return False
    return all(k in p and _utf8_within(p[k], limit) for k, limit in _PEER_FIELDS.items())


# annotation -> (predicate(value, limit), what is expected given the limit): `encode`'s checks
_CHECKS = {
    "str": (_utf8_within, "str of at most {} UTF-8 bytes"),
    "bool": (lambda v, _: type(v) is bool, "bool"),
    "int": (_is_uint, "non-negative int up to {}"),
    "bytes": (lambda v, limit: type(v) is bytes and len(v) <= limit, "bytes, at most {}"),
    "bytes | memoryview": (lambda v, limit: (type(v) is bytes or type(v) is memoryview and v.format == "B"
                                             and v.ndim == 1 and v.c_contiguous) and len(v) <= limit,
                           "bytes (or a contiguous byte memoryview), at most {}"),
    "list[int]": (lambda v, limit: type(v) is list and len(v) <= limit and all(map(_is_uint, v)),
                  "list of at most {} non-negative ints"),
    "list[dict]": (lambda v, limit: type(v) is list and len(v) <= limit and all(map(_check_peer, v)),
                   'list of at most {} {{"id": str, "region": str, "addr": str, "role": str}} maps, '
                   f'each with an optional "uplink" in (0, {MAX_UPLINK_MBIT}]'),
    "list[str]": (lambda v, limit: type(v) is list and len(v) <= limit
                  and all(_utf8_within(x, MAX_NAME_BYTES) for x in v),
                  "list of at most {} member ids"),
    "dict[str, float] | None": (_check_rates, "None or a map of at most {} regions to rates > 0"),
    "float | None": (lambda v, _: v is None or is_uplink(v), f"None or an uplink in Mbit/s in (0, {MAX_UPLINK_MBIT}]"),
}


# (message, field) -> (predicate, what is expected): what a field means beyond its type and
# size, checked when a message is made and when one is read.
_BOUNDS = {
    ("Signal", "peer"): (lambda v: len(v) > 0, "a member name"),
    ("Signal", "kind"): (lambda v: v in SIGNAL_KINDS, f"one of {', '.join(SIGNAL_KINDS)}"),
}


def _check_bounds(name: str, values: dict, exc: type[Exception]) -> None:
    for (message, field), (ok, expected) in _BOUNDS.items():
        if message == name and not ok(values[field]):
            raise exc(f"{name}.{field}: expected {expected}, found {_found(values[field])}")


def _validate(name: str, values: dict, exc: type[Exception]) -> None:
    for field, kind, limit in _SCHEMAS[name]:
        ok, expected = _CHECKS[kind]
        if not ok(values[field], limit):
            raise exc(f"{name}.{field}: expected {expected.format(limit)}, found {_found(values[field])}")
    _check_bounds(name, values, exc)


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
    for field in _OPTIONAL[name]:
        if values[field] is None:  # left out: the frame a member of the previous version reads
            del values[field]
    body = msgpack.packb({"t": name, **values}, use_bin_type=True)
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def _read_uplink(r: PackReader, what: str):
    value = r.number(f"{what} in Mbit/s")
    if not is_uplink(value):
        raise r.fail(f"{what} in Mbit/s in (0, {MAX_UPLINK_MBIT}]", repr(value))
    return value


def _read_peer(r: PackReader) -> dict:
    n = r.map_len(len(_PEER_FIELDS) + 1, "a peer map")
    if n < len(_PEER_FIELDS):
        raise r.fail(_PEER_WHAT, f"a map of {n} keys")
    peer = {}
    for _ in range(n):
        key = r.str(_MAX_KEY_BYTES, "a peer key")
        if key in peer:
            raise r.fail(_PEER_WHAT, f"key {key!r} twice")
        if key == PEER_UPLINK:
            peer[key] = _read_uplink(r, "a peer's uplink")
            continue
        limit = _PEER_FIELDS.get(key)
        if limit is None:
            raise r.fail(_PEER_WHAT, f"key {key!r}")
        peer[key] = r.str(limit, "a str")
    if len(peer) - (PEER_UPLINK in peer) != len(_PEER_FIELDS):  # 5 keys without "uplink", or "uplink" and 3
        raise r.fail(_PEER_WHAT, f"keys {sorted(peer)}")
    return peer


def _read_rates(r: PackReader, limit: int) -> dict[str, float]:
    rates: dict[str, float] = {}
    for _ in range(r.map_len(limit, f"a map of at most {limit} regions to rates")):
        region = r.str(MAX_NAME_BYTES, "a region")
        if not region or region in rates:
            raise r.fail("a map of distinct, non-empty regions to rates", f"region {region!r}")
        rate = r.number("a rate > 0")
        if not _is_rate(rate):
            raise r.fail("a rate > 0", f"{rate!r} for region {region!r}")
        rates[region] = rate
    return rates


def _read_field(r: PackReader, kind: str, limit: int | None):
    if kind == "int":
        return r.uint(limit, "non-negative int")
    if kind == "bool":
        return r.bool("bool")
    if kind == "bytes":
        return r.bin(limit, "bytes")
    if kind == "bytes | memoryview":
        return r.bin_view(limit, "bytes")
    if kind == "str":
        return r.str(limit, "str")
    if kind == "dict[str, float] | None":
        return _read_rates(r, limit)
    if kind == "float | None":
        return _read_uplink(r, "an uplink")
    n = r.array_len(limit, "list")
    if kind == "list[int]":
        return r.uints(n, MAX_INT, "non-negative ints")
    if kind == "list[str]":
        return [r.str(MAX_NAME_BYTES, "a member id") for _ in range(n)]
    return [_read_peer(r) for _ in range(n)]  # list[dict]


def decode_body(body: bytes, only: tuple[type, ...] | None = None):
    """The message in one frame body; ProtocolError if it is not one (or, with
    `only`, if it is of none of those types: checked before its fields are read).

    Read along the message's schema, "t" first: no field is built before its
    type and size are checked, and nothing that nests is built at all."""
    r = PackReader(body, ProtocolError, "msgpack body")
    n = r.map_len(1 + _MAX_FIELDS, "a msgpack map")
    name = r.str(_MAX_KEY_BYTES, 'a map whose first key is "t"') if n else None
    if name != "t":
        raise ProtocolError(f'expected a map whose first key is "t", found {_found(name)}')
    name = r.str(_MAX_KEY_BYTES, _ONE_OF_TYPES)
    if name not in MESSAGE_TYPES:
        raise ProtocolError(f"expected {_ONE_OF_TYPES}, found {_found(name)}")
    if only is not None and name not in {t.__name__ for t in only}:
        raise ProtocolError(f"expected {' or '.join(t.__name__ for t in only)} first, found {name}")
    schema = _FIELDS_OF[name]
    values = {}
    for _ in range(n - 1):
        key = r.str(_MAX_KEY_BYTES, "a field name")
        spec = schema.get(key)
        if spec is None or key in values:
            break
        r.what = spec[0]
        values[key] = _read_field(r, spec[1], spec[2])
    else:
        key = None
    if key is not None or not schema.keys() - _OPTIONAL[name] <= values.keys():
        missing = sorted(schema.keys() - values.keys() - {key} - _OPTIONAL[name])
        extra = [key] if key is not None and key not in schema else []
        again = f", {key!r} twice" if key in values else ""
        raise ProtocolError(f"{name}: expected fields {sorted(schema)}, missing {missing}, unexpected {extra}{again}")
    r.what = "msgpack body"
    r.expect_end()
    _check_bounds(name, values, ProtocolError)
    return MESSAGE_TYPES[name](**values)


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


def _bitfield(b: bytes, n: int) -> np.ndarray:
    """A bitfield of exactly n bits as uint8s (ProtocolError if it is not one)."""
    if type(n) is not int or n < 0:
        raise UsageError(f"expected a non-negative int n, found {_found(n)}")
    if len(b) != (n + 7) // 8:
        raise ProtocolError(f"bitfield of {n} bits: expected {(n + 7) // 8} bytes, found {len(b)}")
    if n % 8 and b[-1] >> (n % 8):
        raise ProtocolError(f"bitfield of {n} bits: found bits set beyond bit {n - 1}")
    return np.frombuffer(b, dtype=np.uint8)


def _indices(bits: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist()


def indices_from_bitfield(b: bytes, n: int) -> list[int]:
    """The sorted set indices of a bitfield of exactly n bits (ProtocolError if not)."""
    return _indices(_bitfield(b, n))


def have_chunks(msg: Have, chunk_count: int | None) -> list[int] | None:
    """The chunks a Have says its sender holds, checked against `chunk_count`, the
    chunk count of the object's manifest (ProtocolError if the bitfield does not
    fit it); None when the manifest is not known here (`chunk_count` None): see
    the module docstring for what to do with such a Have."""
    if chunk_count is None:
        return None
    return indices_from_bitfield(msg.chunks, chunk_count)


UNKNOWN_VERSIONS_AHEAD = 16  # versions above the latest known whose announcements are kept before their manifest
UNKNOWN_VERSIONS_BEHIND = 4  # and below it (a keyframe published after its patch)


def unknown_kept(version: int, latest_known: int | None) -> bool:
    """Whether announcements of a version whose manifest is not known here are worth keeping
    (bounded, unexpanded) until it arrives: one near the latest known version may be on its
    way; any other is ignored without anything built."""
    return latest_known is None or latest_known - UNKNOWN_VERSIONS_BEHIND < version <= latest_known + UNKNOWN_VERSIONS_AHEAD


def announced_chunks(msg: Have | HaveOne | Incoming, chunk_count: int | None,
                     seen: dict | None = None) -> list[int] | None:
    """The chunks an announcement (Have, HaveOne, Incoming) speaks of, each checked
    against `chunk_count`, the chunk count of the object's manifest (ProtocolError
    if one is past it or a bitfield does not fit it). None, with nothing built, when
    the manifest is not known here (`chunk_count` None): such announcements are
    ignored, so one costs a peer's bytes and nothing of this node's memory.

    `seen` (one per session: object -> the OR of the Haves it sent): a Have gives only
    the chunks no earlier Have of that object on the session gave. A member sends one
    Have per object and session, so a repeat says nothing new, yet expanding it and
    handing its chunks on cost O(chunks) each time: 2.6 ms for 16,384 (a 2 KB frame)."""
    if chunk_count is None:
        return None
    if type(msg) is Have:
        bits = _bitfield(msg.chunks, chunk_count)
        if seen is None:
            return _indices(bits)
        key = (msg.version, msg.keyframe)
        before = seen.get(key)
        seen[key] = bits.copy() if before is None else before | bits
        return _indices(bits if before is None else bits & ~before)
    if msg.chunk >= chunk_count:
        raise ProtocolError(f"{type(msg).__name__} of {msg.version}: expected a chunk below {chunk_count}, "
                            f"found {msg.chunk}")
    return [msg.chunk]


# --- connection -----------------------------------------------------------------

AWAIT_HELLO = "AWAIT_HELLO"  # nothing sent (or received) yet
OPEN = "OPEN"  # Hello done; any message but Hello may follow
DONE = "DONE"  # Bye done; nothing may follow

# (state, message type) -> next state; `None` means any other message type.
_TRANSITIONS = {
    (AWAIT_HELLO, Hello): OPEN,
    # A listener that refuses the member (over its admission budget, node/net/admission.py)
    # says why in place of its Hello, and closes. Members of revision 3 and before read it
    # as a broken Hello and fail the dial just the same, so it needs no revision.
    (AWAIT_HELLO, Error): DONE,
    (OPEN, Bye): DONE,
    (OPEN, None): OPEN,
}


_FIRST = (Hello, Error)  # what may open a connection


def _advance(state: str, msg, exc: type[Exception], who: str) -> str:
    nxt = _TRANSITIONS.get((state, type(msg)))
    if nxt is None and type(msg) is not Hello:
        nxt = _TRANSITIONS.get((state, None))
    if nxt is None:
        expected = {AWAIT_HELLO: "Hello (or a refusal, an Error) first", OPEN: "anything but a second Hello",
                    DONE: "nothing after Bye or a refusal"}[state]
        raise exc(f"{who}: expected {expected}, found {type(msg).__name__}")
    return nxt


class FrameBuffer:
    """Length-prefixed frames out of a byte stream: the framing alone, any body.

    Shared by the peer protocol (`Connection`) and the node's local socket
    (protocol/localapi.py). `next_body` returns one body, NEED_DATA, or CLOSED.

    Feed it with `receive_data` (copied in). With `direct_bodies`, a frame whose
    body is at least DIRECT_MIN_BYTES (and at most DIRECT_MAX_BYTES) gets a buffer of
    its own once its header is in: `body_buffer()` is where the caller may receive the
    rest of it straight from its socket (`body_received(n)` after), and `next_body`
    hands that buffer over, a bytearray, without a copy. After such a frame,
    `read_limit()` asks for the next headers alone (DIRECT_HEADER_READS frames), so
    the next large body also lands in its own buffer instead of in this one's. Why:
    a chunk part was copied four times between the TLS read and its chunk's buffer
    (the read's bytes, this buffer, the body, the decoded field), each time into
    fresh memory; receiving 64 KiB parts now costs 15 % less CPU, 1 MiB pieces 35 %
    less (bench/transport.py; protocol/README.md).
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES, direct_bodies: bool = False):
        if type(max_frame) is not int or not 0 < max_frame <= _LENGTH_LIMIT:
            raise UsageError(f"expected max_frame in [1, 2**32), found {_found(max_frame)}")
        self.max_frame = max_frame
        self.direct_bodies = direct_bodies
        self._buf = bytearray()
        self._pos = 0  # bytes of _buf already parsed
        self._eof = False
        self._body: bytearray | None = None  # a large frame's own buffer, being filled
        self._filled = 0  # bytes of _body received
        self._header_next = 0  # frames left whose headers are read alone (DIRECT_HEADER_READS)

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; b"" means the peer closed its side."""
        if not data:
            self._eof = True
        elif self._eof:
            raise UsageError("receive_data after EOF")
        elif self._body is not None:
            with memoryview(data) as view:
                take = min(len(view), len(self._body) - self._filled)
                self._body[self._filled:self._filled + take] = view[:take]
                self._filled += take
                if take < len(view):  # what follows the frame (only a caller that ignored read_limit)
                    self._buf += view[take:]
        else:
            self._buf += data

    def body_buffer(self) -> memoryview | None:
        """Where the rest of the current large frame's body goes (its own buffer), or None
        when no frame is being received that way. Release the view before `next_body`."""
        if self._body is None or self._eof:
            return None
        return memoryview(self._body)[self._filled:]

    def body_received(self, n: int) -> None:
        """`n` bytes were written at the start of `body_buffer()`; 0 means the peer closed its side."""
        if self._body is None:
            raise UsageError("body_received without a body_buffer")
        if n == 0:
            self._eof = True
        elif not 0 < n <= len(self._body) - self._filled:
            raise UsageError(f"body_received: expected 1 to {len(self._body) - self._filled} bytes, found {n}")
        else:
            self._filled += n

    def read_limit(self) -> int | None:
        """The most bytes the next read should take (None: any). Within DIRECT_HEADER_READS
        frames of one that had a buffer of its own: the next header alone, then the rest of
        its frame, so that no read runs into a following large body, which then gets its
        own buffer too."""
        if self._body is not None:
            return len(self._body) - self._filled
        if self._header_next <= 0:
            return None
        avail = len(self._buf) - self._pos
        if avail < HEADER_BYTES:
            return HEADER_BYTES - avail
        # A small frame's header is in: the rest of that frame, and nothing of the next one.
        rest = HEADER_BYTES + int.from_bytes(self._buf[self._pos:self._pos + HEADER_BYTES], "big") - avail
        return rest if rest > 0 else None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as a body (at most a frame and a read); a
        large frame with its own buffer counts whole, header and body, from its header on
        (its buffer is allocated then)."""
        held = len(self._buf) - self._pos
        return held if self._body is None else held + HEADER_BYTES + len(self._body)

    @property
    def frame_bytes(self) -> int | None:
        """Header and body of the frame at the front of the buffer, from the moment its header
        is in (None before): what a reader must make room for to take that frame whole."""
        if self._body is not None:
            return HEADER_BYTES + len(self._body)
        if len(self._buf) - self._pos < HEADER_BYTES:
            return None
        return HEADER_BYTES + int.from_bytes(self._buf[self._pos:self._pos + HEADER_BYTES], "big")

    def next_body(self):
        if self._body is not None:
            if self._filled == len(self._body):
                body, self._body = self._body, None
                return body
            if self._eof:
                raise TruncatedStream(f"truncated frame: EOF with {HEADER_BYTES + self._filled} bytes of an "
                                      f"incomplete frame buffered")
            return NEED_DATA
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail >= HEADER_BYTES:
            n = int.from_bytes(buf[pos:pos + HEADER_BYTES], "big")
            if n > self.max_frame:
                raise FrameTooLarge(f"expected a frame of at most {self.max_frame} bytes, found a header of {n}")
            direct = self.direct_bodies and DIRECT_MIN_BYTES <= n <= DIRECT_MAX_BYTES
            if avail >= HEADER_BYTES + n:
                end = pos + HEADER_BYTES + n
                with memoryview(buf) as view:  # one copy, not a bytearray slice and then bytes
                    body = bytes(view[pos + HEADER_BYTES:end])
                self._consume(end)
                self._header_next = DIRECT_HEADER_READS if direct else max(self._header_next - 1, 0)
                return body
            if direct and not self._eof:
                # Its own buffer from now on; what of it arrived already is the end of `_buf`.
                self._body = bytearray(n)
                self._filled = avail - HEADER_BYTES
                with memoryview(buf) as view:
                    self._body[:self._filled] = view[pos + HEADER_BYTES:]
                self._buf.clear()
                self._pos = 0
                self._header_next = DIRECT_HEADER_READS
                return NEED_DATA
        if not self._eof:
            return NEED_DATA
        if avail:
            raise TruncatedStream(f"truncated frame: EOF with {avail} bytes of an incomplete frame buffered")
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

    def __init__(self, max_frame: int = MAX_FRAME_BYTES, direct_bodies: bool = True):
        self._frames = FrameBuffer(max_frame, direct_bodies)
        self._frames.max_frame = min(max_frame, MAX_HELLO_FRAME_BYTES)  # until the peer's Hello
        self.max_frame = max_frame
        self.our_state = AWAIT_HELLO
        self.their_state = AWAIT_HELLO
        self._error: ProtocolError | None = None

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; b"" means the peer closed its side."""
        self._frames.receive_data(data)

    def body_buffer(self) -> memoryview | None:
        """Where to receive the rest of a large frame straight into (FrameBuffer.body_buffer)."""
        return self._frames.body_buffer()

    def body_received(self, n: int) -> None:
        self._frames.body_received(n)

    def read_limit(self) -> int | None:
        """The most bytes the next `receive_data` should carry (FrameBuffer.read_limit)."""
        return self._frames.read_limit()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as a message."""
        return self._frames.buffered

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
        msg = decode_body(body, _FIRST if self.their_state == AWAIT_HELLO else None)
        self.their_state = _advance(self.their_state, msg, ProtocolError, "peer")
        if type(msg) is Hello:
            self._frames.max_frame = self.max_frame
        return msg

    def send(self, msg) -> bytes:
        """The bytes that carry `msg` to the peer (UsageError if not allowed now)."""
        data = encode(msg)
        if len(data) - HEADER_BYTES > self.max_frame:
            raise UsageError(f"expected a frame of at most {self.max_frame} bytes, found {len(data) - HEADER_BYTES}")
        self.our_state = _advance(self.our_state, msg, UsageError, "send")
        return data
