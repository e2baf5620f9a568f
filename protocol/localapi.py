"""The node's local Unix-socket API: requests from rollout workers and people, and replies. Sans-IO.

One definition of these bytes, used by the daemon (node/localapi.py) and the
client (node/client.py). Frames are the peer protocol's (4-byte length, then a
msgpack map; `protocol.wire.FrameBuffer`). A request is a map with "op"; the
reply is `{"ok": true, ...}` or `{"ok": false, "error": str, "code": str}`.
One request at a time per connection, answered in order. A node at its
connection limit sends one error (code "too_many_connections") unasked and
closes: a client reads it as the reply to its first request. A request larger
than the node's budget for buffered requests gets "too_large", one that waited
for room in it too long "buffers_full", and the node closes after either
(`CLOSING`): a client may read the error before it has sent the whole request.

Ops:
- status                                   -> {"status": {...}}
- wait_version(min_version, timeout)       -> {"status": {...}}; code "timeout" when it runs out
- submit(records, timeout)                 -> {"seqs": [int, ...], "repeated": int}: durable at the node;
    code "stopping" (nothing stored) once the node is stopping and uploads its spool
    records: [[payload: bytes, policy_version: int, meta: map | nil(, record_id: bytes | nil)], ...]
    A record_id (1..MAX_RECORD_ID_BYTES, distinct within one request: a repeat is
    bad_request) makes the record idempotent: a record whose id the node already
    holds is not stored again, its seq is answered as the first time ("repeated"
    counts those). A node older than record ids refuses a 4-element record
    (bad_request, nothing stored), so a client that sent ids may always resend.
- changes(from_version, from_hash | nil)   -> several frames: {"chg": bytes}... then
    {"done": true, "version": int, "state_hash": str}: the change stream
    (protocol/changes.py, cut anywhere) from the caller's version to the node's;
    code "bootstrap" with "path" (a safetensors file whose metadata says its
    version) when the node no longer holds those changes
"""

from __future__ import annotations

import math

import msgpack

from .errors import ProtocolError, UsageError
from .packreader import PackReader
from .trajectory import MAX_META_BYTES, MAX_META_DEPTH, PackedMeta, bin_header
from .wire import frame, frame_header

MAX_FRAME_BYTES = 256 << 20  # a submit of many large records
MAX_RECORDS_PER_SUBMIT = 65536
MAX_RECORD_ID_BYTES = 64  # a client's record id (16 random bytes by default: node/client.py)
SEPARATE_PAYLOAD_BYTES = 64 << 10  # submit_frame_parts: payloads this large are not copied
OPS = ("status", "wait_version", "submit", "changes")
# decode_request: fields of a request map (each op has at most 3; room for fields added later),
# a field name's bytes, and any field or record element other than a payload or a meta: scalars
# (an int, a timeout, a state hash, a record id), read whatever their kind within these bounds
MAX_REQUEST_FIELDS = 16
_MAX_FIELD_NAME_BYTES = 64
_SMALL_VALUES, _SMALL_DEPTH, _SMALL_BYTES = 16, 2, 4096
CHANGES_PART_BYTES = 1 << 20  # change stream bytes per reply frame

# error codes in replies
TIMEOUT = "timeout"
BAD_REQUEST = "bad_request"
FULL = "spool_full"
DISK_FULL = "disk_full"  # the node's disk could not take the records: nothing was acknowledged; retry later
STORAGE = "storage_failed"  # the node's spool failed a durable write: nothing was acknowledged; retry
UNAVAILABLE = "unavailable"
INTERNAL = "internal_error"  # the node failed answering (its log says why); it serves on
TOO_MANY_CONNECTIONS = "too_many_connections"  # sent unasked, then the node closes: retry later
# A request larger than the node's whole budget for bytes received and not yet handled on its
# local socket (node/localapi.py): refused, nothing done, and the node closes; split it.
TOO_LARGE = "too_large"
# The node's local budget stayed spent by other clients' requests for as long as it waits
# (node/localapi.py BUFFER_WAIT_S): nothing done, and the node closes; retry later.
BUFFERS_FULL = "buffers_full"
CLOSING = frozenset({TOO_MANY_CONNECTIONS, TOO_LARGE, BUFFERS_FULL})  # the node closes after these
BOOTSTRAP = "bootstrap"
# The node is stopping (SIGTERM: a host being drained or a spot instance reclaimed) and uploads
# what its spool holds before it exits: the records of this submit were not stored; submit them
# through another node (with their record ids), or to this one once it is back.
STOPPING = "stopping"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _uint(v) -> bool:
    return type(v) is int and 0 <= v < 1 << 63


def encode(obj: dict) -> bytes:
    return frame(msgpack.packb(obj, use_bin_type=True), MAX_FRAME_BYTES)


def decode(body: bytes) -> dict:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"local API: expected a msgpack map, found undecodable bytes ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"local API: expected a msgpack map, found {type(obj).__name__}")
    return obj


# ------------------------------------------------------------------ requests


def decode_request(body: bytes) -> dict:
    """A request map as `decode` gives it, read along the requests' schema (the node's
    side: its clients are not trusted): a record's payload as bytes and its meta map as
    the PackedMeta it came in, checked as every decoder of a record reads one
    (protocol/trajectory.py); every other value small. Nothing is built that the bytes
    declare or nest beyond that: `msgpack.unpackb` built a 32 MiB frame of nested empty
    arrays into 2.3 GB of lists on the node's event loop (8 s; the 256 MiB frame limit,
    ~19 GB), where this holds about the frame and one meta at a time.
    ProtocolError for anything else; `check_request` then checks the values."""
    r = PackReader(body, ProtocolError, "local API")
    req: dict = {}
    for _ in range(r.map_len(MAX_REQUEST_FIELDS, "a msgpack map")):
        key = r.str(_MAX_FIELD_NAME_BYTES, "a field name")
        if key in req:
            raise r.fail("distinct field names", f"{key!r} twice")
        r.what = f"local API: {key}"
        req[key] = _read_records(r) if key == "records" and r.peek_kind() == "array" else _small(r)
        r.what = "local API"
    r.expect_end()
    return req


def declared_records(body: bytes) -> int:
    """How many records a request's "records" array declares (its header, read without
    the records), 0 if it has none or the bytes are not a request (`decode_request` then
    says what is wrong, at once). For the node to price a request before reading it: a
    request's cost to read is per record, not per byte."""
    r = PackReader(body, ProtocolError, "local API")
    try:
        for _ in range(r.map_len(MAX_REQUEST_FIELDS, "a msgpack map")):
            key = r.str(_MAX_FIELD_NAME_BYTES, "a field name")
            if key == "records" and r.peek_kind() == "array":
                return r.array_len(MAX_RECORDS_PER_SUBMIT, "an array of records")
            r.skip(_SMALL_VALUES, _SMALL_DEPTH)
    except ProtocolError:
        pass
    return 0


def _small(r: PackReader):
    return r.any(_SMALL_VALUES, _SMALL_DEPTH, "a small value", max_bytes=_SMALL_BYTES)


def _read_records(r: PackReader) -> list:
    records = []
    for _ in range(r.array_len(MAX_RECORDS_PER_SUBMIT, "an array of records")):
        if r.peek_kind() != "array":
            records.append(_small(r))  # check_records says what a record is
            continue
        rec = []
        for i in range(r.array_len(4, "a record [payload, policy_version, meta(, record_id)]")):
            kind = r.peek_kind()
            if i == 0 and kind == "bin":
                rec.append(r.bin(MAX_FRAME_BYTES, "a payload"))
            elif i == 2 and kind == "map":
                start = r.pos
                r.any(MAX_META_BYTES, MAX_META_DEPTH, "a meta map", max_bytes=MAX_META_BYTES, kind="map", build=False)
                rec.append(PackedMeta(r.data[start:r.pos]))  # checked, kept as the bytes it came in
            elif i == 2 and r.nil():
                rec.append(None)
            else:
                rec.append(_small(r))
        records.append(rec)
    return records


def status_request() -> dict:
    return {"op": "status"}


def wait_version_request(min_version: int, timeout: float) -> dict:
    if not _uint(min_version) or not _number(timeout):
        raise UsageError(f"wait_version: expected min_version >= 0 and timeout >= 0, found {min_version!r}, {timeout!r}")
    return {"op": "wait_version", "min_version": min_version, "timeout": float(timeout)}


def changes_request(from_version: int, from_hash: str | None) -> dict:
    if not _uint(from_version) or not (from_hash is None or isinstance(from_hash, str)):
        raise UsageError(f"changes: expected from_version >= 0 and a state hash or None, found {from_version!r}, {from_hash!r}")
    return {"op": "changes", "from_version": from_version, "from_hash": from_hash}


def submit_request(records: list, timeout: float) -> dict:
    check_records(records, UsageError)
    if not _number(timeout):
        raise UsageError(f"submit: expected a timeout >= 0, found {timeout!r}")
    return {"op": "submit", "records": [list(r) for r in records], "timeout": float(timeout)}


def submit_frame_parts(records: list, timeout: float) -> list:
    """The frame `encode(submit_request(records, timeout))`, byte for byte, as buffers to
    write one after another: a payload of SEPARATE_PAYLOAD_BYTES or more is one of them,
    as it is, instead of being copied into a packed body and again behind the frame
    header. For 1 MiB records those copies (fresh pages each time) were most of a
    rollout worker's CPU per submit."""
    check_records(records, UsageError)
    if not _number(timeout):
        raise UsageError(f"submit: expected a timeout >= 0, found {timeout!r}")
    packer = msgpack.Packer(use_bin_type=True)
    parts, cur = [], bytearray(packer.pack_map_header(3) + packer.pack("op") + packer.pack("submit")
                                + packer.pack("records") + packer.pack_array_header(len(records)))
    for rec in records:
        payload, version, meta = rec[0], rec[1], rec[2]
        cur += (b"\x93" if len(rec) == 3 else b"\x94") + bin_header(len(payload))
        if len(payload) >= SEPARATE_PAYLOAD_BYTES:
            parts += (bytes(cur), payload)
            cur = bytearray()
        else:
            cur += payload
        try:
            cur += packer.pack(version) + packer.pack(meta)
            if len(rec) == 4:
                cur += packer.pack(rec[3] if rec[3] is None else bytes(rec[3]))
        except (TypeError, ValueError, OverflowError) as e:
            raise UsageError(f"submit: expected msgpack-able meta values, found {type(e).__name__}: {e}") from None
    cur += packer.pack("timeout") + packer.pack(float(timeout))
    parts.append(bytes(cur))
    size = sum(map(len, parts))
    if size > MAX_FRAME_BYTES:
        raise UsageError(f"submit of {len(records)} records: expected at most {MAX_FRAME_BYTES} bytes in one request, "
                         f"found {size}; split them over several calls")
    parts[0] = frame_header(size, MAX_FRAME_BYTES) + parts[0]
    return parts


def check_records(records, error: type[Exception]) -> None:
    if not isinstance(records, (list, tuple)) or not 0 < len(records) <= MAX_RECORDS_PER_SUBMIT:
        raise error(f"submit: expected 1..{MAX_RECORDS_PER_SUBMIT} records, found "
                    f"{len(records) if isinstance(records, (list, tuple)) else type(records).__name__}")
    ids = None
    for i, r in enumerate(records):
        if (not isinstance(r, (list, tuple)) or not 3 <= len(r) <= 4 or not isinstance(r[0], (bytes, bytearray))
                or not _uint(r[1]) or not (r[2] is None or isinstance(r[2], dict) or type(r[2]) is PackedMeta)):
            raise error(f"submit: expected records [payload: bytes, policy_version: int >= 0, meta: map | nil"
                        f"(, record_id: bytes | nil)], found {repr(r)[:80]}")
        if len(r) == 4 and r[3] is not None:
            rid = r[3]
            if not isinstance(rid, (bytes, bytearray)) or not 0 < len(rid) <= MAX_RECORD_ID_BYTES:
                raise error(f"submit: record {i}: expected a record_id of 1..{MAX_RECORD_ID_BYTES} bytes or nil, "
                            f"found {type(rid).__name__} {repr(rid)[:80]}")
            ids = {} if ids is None else ids
            first = ids.setdefault(bytes(rid), i)
            if first != i:
                raise error(f"submit: expected distinct record ids within one request, found record {i}'s id "
                            f"{bytes(rid).hex()} at record {first} too")


def check_request(req: dict) -> dict:
    """The request if well formed; ProtocolError naming what is wrong otherwise."""
    op = req.get("op")
    if op not in OPS:
        raise ProtocolError(f"local API: expected op in {list(OPS)}, found {op!r}")
    if op == "wait_version":
        if not _uint(req.get("min_version")) or not _number(req.get("timeout")):
            raise ProtocolError("wait_version: expected min_version: int >= 0 and timeout: number >= 0")
    elif op == "changes":
        if not _uint(req.get("from_version")) or not (req.get("from_hash") is None or isinstance(req["from_hash"], str)):
            raise ProtocolError("changes: expected from_version: int >= 0 and from_hash: str | nil")
    elif op == "submit":
        check_records(req.get("records"), ProtocolError)
        if not _number(req.get("timeout")):
            raise ProtocolError("submit: expected timeout: number >= 0")
    return req


# ------------------------------------------------------------------ replies


def ok(**fields) -> dict:
    return {"ok": True, **fields}


def error(code: str, message: str, **fields) -> dict:
    return {"ok": False, "code": code, "error": message, **fields}
