"""Trajectory records and the bytes that carry them: segment files and wire batches.

Sans-IO, the one definition of these formats (node/spool.py, node/trainer/trajstore.py
and the node<->origin wire messages import it). Owns: the `Record` a rollout
worker submits and the `ReceivedRecord` the origin stores, their msgpack
bodies, the checksummed framing of segment files and its scanner, the
lz4-compressed batch a node uploads, the rule for msgpack-object payloads and
`SeqRanges`, the interval set used to deduplicate (node id, seq). Must not
touch files, sockets, clocks or threads: bytes in, bytes and values out.

Segment file
    header   = b"PSTRJSEG" | version u32 LE | crc32(first 12 bytes) u32 LE
    entry    = SYNC (4 bytes) | length u32 LE | crc32(length bytes + body) u32 LE | body
    body     = msgpack array whose first element says what it is (KIND_*): a
               Record (spool), a ReceivedRecord or DuplicatesNote (store), the
               spool's SpoolState and AckedRanges (its `state` and `acks` files),
               RecordIds (record identities: the spool's segments and `ids` file).
    A Record or ReceivedRecord may end with one more element, its record key (a bin
    of exactly RECORD_KEY_BYTES: the client's record id as `record_key` digests it),
    and a DuplicatesNote with one more count (how many of the duplicates were found
    by record key): a body without it is the format before keys, and decodes as
    it always did (key None, by_key 0). Writers add the element only where it has
    something to say, so what they write without keys is what older code reads.
Scanning (`scan_segment`, `scan_records`): an entry is intact when its sync
marker, a plausible length and its CRC-32 (which covers the length too) all
check. Intact entries are taken in order; at a bad spot X the scanner resyncs
at the next offset after X where an intact entry starts (`bytes.find` on the
sync marker, each candidate checked by its CRC) and reports X..resync point as
one problem. Damage with no intact entry after it is the tail (a write torn by
a crash): `good_end` stops before it and a writer may truncate there.
Guarantees, property-tested: a truncation anywhere leaves exactly the entries
that end before the cut (a prefix) and at most one tail problem; one damaged
byte anywhere (sync, length, CRC, body; CRC-32 catches every single-byte
error) loses exactly the entry it hits, or nothing if it hits the file header,
and is reported once. A false resync needs a payload that embeds a whole valid
entry (marker, length and matching CRC): random damage cannot make one.

Wire batch (node -> origin, inside the caller's wire message as opaque bytes)
    b"PSTB" | version u8 | flags u8 | raw length u32 LE | crc32(raw) u32 LE | data
    raw  = msgpack array of record bodies; data = raw, lz4-block-compressed
    when flags & 1 (the encoder keeps raw when lz4 does not make it smaller).
    A body carries its record key only when the encoder was given keys
    (`encode_batch(records, keys)`): a node does so only on a connection whose
    wire revision (4 and later, protocol/wire.py) says the origin reads them;
    an older origin refuses a 9-element record body.
The ack needs no codec of its own: the origin answers with the list of seqs
that are durable (wire.py's `list[int]` field type).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import lz4.block
import msgpack

from .errors import CorruptData, UnsupportedFormat, UsageError
from .packreader import PackReader

# --- limits ---------------------------------------------------------------------
MAX_PAYLOAD_BYTES = 8 << 20  # one record's payload
MAX_META_BYTES = 64 << 10  # one record's packed meta map
MAX_ID_CHARS = 256  # node_id and region
MAX_ENTRY_BYTES = MAX_PAYLOAD_BYTES + MAX_META_BYTES + 4096  # one entry body, fields included
MAX_BATCH_BYTES = 12 << 20  # raw (uncompressed) size of one wire batch; fits a 16 MiB wire frame
MAX_BATCH_RECORDS = 1 << 16  # records in one wire batch
MAX_META_DEPTH = 32  # containers inside a meta map, decoding (encode takes what msgpack packs)
_MAX_ID_BYTES = 4 * MAX_ID_CHARS  # node_id and region as UTF-8
_U64 = 1 << 64

# --- segment framing ------------------------------------------------------------
FORMAT_VERSION = 1
SEGMENT_MAGIC = b"PSTRJSEG"
SEGMENT_HEADER_BYTES = 16
ENTRY_SYNC = b"\xd5\x7a\x1e\xc0"  # read as a length it is far beyond MAX_ENTRY_BYTES
ENTRY_HEADER_BYTES = 12
_HEADER_FIELDS = struct.Struct("<II")  # length, crc

# --- record bodies --------------------------------------------------------------
KIND_RECORD = 1  # [1, node_id, region, seq, policy_version, submitted_at, payload, meta(, key)]
KIND_RECEIVED = 2  # the same fields, then received_at(, key)
KIND_DUPLICATES = 3  # [3, count(, by_key)]: the store dropped `count` duplicates in one append
KIND_SPOOL_STATE = 4  # [4, node_id, region, seq_reserved]: the spool's `state` file
KIND_ACKED = 5  # [5, [[start, end], ...]]: an entry of the spool's `acks` log
KIND_RECORD_IDS = 6  # [6, seqs: bin of u64 LE, keys: bin of RECORD_KEY_BYTES each]: record identities
_BODY_LEN = {KIND_RECORD: 8, KIND_RECEIVED: 9, KIND_DUPLICATES: 2, KIND_SPOOL_STATE: 4, KIND_ACKED: 2,
             KIND_RECORD_IDS: 3}
# Kinds whose body may end with one optional element (module docstring): a record's key, a
# duplicates note's by-key count. Absent, the body is the one written before keys existed.
_OPTIONAL_LAST = frozenset((KIND_RECORD, KIND_RECEIVED, KIND_DUPLICATES))
RECORD_KEY_BYTES = 16  # a record identity as the spool keeps it: the BLAKE2b-128 digest of the client's id
_MAX_IDS_PER_ENTRY = MAX_ENTRY_BYTES // (8 + RECORD_KEY_BYTES)
_ALL_KINDS = tuple(_BODY_LEN)
_MAX_BODY_LEN = max(_BODY_LEN.values()) + 1

# --- payload rule ---------------------------------------------------------------
PAYLOAD_FORMAT_KEY = "payload_format"  # reserved meta key
PAYLOAD_MSGPACK = "msgpack"  # payload = msgpack.packb(obj); absent key: raw bytes

# --- wire batch -----------------------------------------------------------------
BATCH_MAGIC = b"PSTB"
BATCH_VERSION = 1
_BATCH_HEADER = struct.Struct("<4sBBII")  # magic, version, flags, raw length, crc32(raw)
MAX_BATCH_WIRE_BYTES = _BATCH_HEADER.size + MAX_BATCH_BYTES  # the encoder keeps raw when lz4 does not shrink it
_FLAG_LZ4 = 1
_LZ4_MAX_RATIO = 255  # an lz4 block's format: a match grows by at most 255 bytes per byte


# ================================================================ records


@dataclass(frozen=True)
class Record:
    """One trajectory as the node accepted it; (node_id, seq) names it for ever."""
    node_id: str
    region: str
    seq: int
    policy_version: int
    submitted_at: float  # node wall clock, seconds since the epoch
    payload: bytes
    meta: dict | None = None
    # The client's record id as `record_key` digests it (RECORD_KEY_BYTES), where the client
    # gave one and the body carried it (a wire batch of revision 4, the origin's store): the
    # origin drops a record whose key it already holds, from whichever node.
    key: bytes | None = field(default=None, kw_only=True)

    def received(self, received_at: float) -> ReceivedRecord:
        return ReceivedRecord(self.node_id, self.region, self.seq, self.policy_version,
                              self.submitted_at, self.payload, self.meta, key=self.key, received_at=received_at)

    def value(self):
        """The payload as the submitter gave it: bytes, or the msgpack-able object."""
        return decode_payload(self.payload, self.meta)


@dataclass(frozen=True)
class ReceivedRecord(Record):
    """A record as the origin stored it: `received_at` is the origin's clock."""
    received_at: float = field(kw_only=True)


class PackedMeta(bytes):
    """A record's meta map kept as the msgpack bytes it arrived in, already checked to
    decode within the bounds (`decode_batch(..., packed_meta=True)`): a writer stores
    these bytes as they are. Why: the origin only passes meta on to its store, and a
    meta of 64 KiB of empty containers is ~4.5 MB of Python objects, per record."""


@dataclass(frozen=True)
class DuplicatesNote:
    """Store entry: this many records of one append were duplicates and were dropped;
    `by_key` of them had a record key the store already held (sent by another node,
    or by one that lost its memory of having sent it), the rest a (node id, seq) it held."""
    count: int
    by_key: int = 0


@dataclass(frozen=True)
class SpoolState:
    """The spool's `state` file: whose spool it is, and the seqs it may hand out
    without writing this file again (all seqs below `seq_reserved` may be in use)."""
    node_id: str
    region: str
    seq_reserved: int


@dataclass(frozen=True)
class AckedRanges:
    """An entry of the spool's ack log: half-open seq ranges the origin has acknowledged."""
    ranges: list  # [[start, end], ...]


@dataclass(frozen=True)
class RecordIds:
    """Record identities and the seqs they were stored under: `seqs` packed as u64 LE
    (8 bytes each), `keys` as RECORD_KEY_BYTES each, the i-th key for the i-th seq.
    An entry in a spool segment, written in the same commit as (just before) its records,
    and in the spool's `ids` file for those of records already trimmed."""
    seqs: bytes
    keys: bytes

    def __len__(self) -> int:
        return len(self.seqs) // 8


def record_key(record_id: bytes) -> bytes:
    """The spool's key for a client's record id: a fixed RECORD_KEY_BYTES whatever the id's
    length (memory per identity is fixed; a collision of two ids is a 2^-64-per-pair event)."""
    return hashlib.blake2b(record_id, digest_size=RECORD_KEY_BYTES).digest()


def _ids_ok(seqs, keys) -> bool:
    return (type(seqs) is bytes and type(keys) is bytes and len(seqs) % 8 == 0
            and len(keys) == len(seqs) // 8 * RECORD_KEY_BYTES and 0 < len(seqs) // 8 <= _MAX_IDS_PER_ENTRY)


def _found(v) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _uint(v) -> bool:
    return type(v) is int and 0 <= v < _U64


def _check_fields(node_id, region, seq, policy_version, submitted_at, payload, meta, exc) -> None:
    # One expression for the usual case (a valid record): this runs once per record on
    # every hop (spool, batch, store), so the loop below only runs to name what is wrong.
    if (type(node_id) is str and 0 < len(node_id) <= MAX_ID_CHARS and type(region) is str
            and 0 < len(region) <= MAX_ID_CHARS and type(seq) is int and 0 <= seq < _U64
            and type(policy_version) is int and 0 <= policy_version < _U64 and type(submitted_at) is float
            and type(payload) is bytes and len(payload) <= MAX_PAYLOAD_BYTES
            and (meta is None or type(meta) is dict or type(meta) is PackedMeta)):
        return
    for name, v in (("node_id", node_id), ("region", region)):
        if type(v) is not str or not 0 < len(v) <= MAX_ID_CHARS:
            raise exc(f"record.{name}: expected a str of 1..{MAX_ID_CHARS} chars, found {_found(v)}")
    for name, v in (("seq", seq), ("policy_version", policy_version)):
        if not _uint(v):
            raise exc(f"record.{name}: expected a non-negative int below 2**64, found {_found(v)}")
    if type(submitted_at) is not float:
        raise exc(f"record.submitted_at: expected a float, found {_found(submitted_at)}")
    if type(payload) is not bytes:
        raise exc(f"record.payload: expected bytes, found {_found(payload)}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise exc(f"record.payload: expected at most {MAX_PAYLOAD_BYTES} bytes, found {len(payload)}")
    if meta is not None and type(meta) not in (dict, PackedMeta):
        raise exc(f"record.meta: expected a dict or None, found {_found(meta)}")


def encode_record(rec) -> bytes:
    """The msgpack body of any entry value: Record, ReceivedRecord, DuplicatesNote,
    SpoolState, AckedRanges or RecordIds (UsageError if invalid)."""
    if type(rec) is DuplicatesNote:
        if not _uint(rec.count):
            raise UsageError(f"DuplicatesNote.count: expected a non-negative int, found {_found(rec.count)}")
        if not (_uint(rec.by_key) and rec.by_key <= rec.count):
            raise UsageError(f"DuplicatesNote.by_key: expected an int in 0..count={rec.count}, found {_found(rec.by_key)}")
        return msgpack.packb([KIND_DUPLICATES, rec.count, rec.by_key] if rec.by_key else [KIND_DUPLICATES, rec.count])
    if type(rec) is SpoolState:
        _check_fields(rec.node_id, rec.region, rec.seq_reserved, 0, 0.0, b"", None, UsageError)
        return msgpack.packb([KIND_SPOOL_STATE, rec.node_id, rec.region, rec.seq_reserved])
    if type(rec) is AckedRanges:
        if not _ranges_ok(rec.ranges):
            raise UsageError(f"AckedRanges.ranges: expected [start, end] pairs with start < end, found {_found(rec.ranges)}")
        return msgpack.packb([KIND_ACKED, [list(r) for r in rec.ranges]])
    if type(rec) is RecordIds:
        if not _ids_ok(rec.seqs, rec.keys):
            raise UsageError(f"RecordIds: expected 1..{_MAX_IDS_PER_ENTRY} u64 seqs and {RECORD_KEY_BYTES} key bytes "
                             f"per seq, found {_found(rec.seqs)} and {_found(rec.keys)}")
        return msgpack.packb([KIND_RECORD_IDS, rec.seqs, rec.keys], use_bin_type=True)
    return b"".join(record_parts(rec))


def bin_header(n: int) -> bytes:
    """msgpack's header for a bin of n bytes (the writers put the payload after it as it is)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def record_parts(rec: Record) -> tuple[bytes, bytes, bytes]:
    """The body of a Record or ReceivedRecord as (prefix, payload, suffix):
    b"".join of them is `encode_record(rec)`. Writers frame and write the three
    pieces (entry_header and pwritev take them as they are) so a large payload
    is never copied into a body."""
    if type(rec) not in (Record, ReceivedRecord):
        raise UsageError(f"expected a Record, found {_found(rec)}")
    return received_parts(rec, rec.received_at) if type(rec) is ReceivedRecord else _parts(rec, None, rec.key)


def received_parts(rec: Record, received_at: float) -> tuple[bytes, bytes, bytes]:
    """The parts of `rec.received(received_at)`'s body without making that object
    (the origin's store writes one per record it takes in)."""
    if not isinstance(rec, Record):
        raise UsageError(f"expected a Record, found {_found(rec)}")
    if type(received_at) is not float:
        raise UsageError(f"record.received_at: expected a float, found {_found(received_at)}")
    return _parts(rec, received_at, rec.key)


def _parts(rec: Record, received_at: float | None, key: bytes | None) -> tuple[bytes, bytes, bytes]:
    _check_fields(rec.node_id, rec.region, rec.seq, rec.policy_version, rec.submitted_at, rec.payload,
                  rec.meta, UsageError)
    if key is not None and not (type(key) is bytes and len(key) == RECORD_KEY_BYTES):
        raise UsageError(f"record.key: expected None or {RECORD_KEY_BYTES} bytes, found {_found(key)}")
    received = received_at is not None
    try:  # [1:] drops the packed list's own fixarray header
        head = msgpack.packb([KIND_RECEIVED if received else KIND_RECORD, rec.node_id, rec.region, rec.seq,
                              rec.policy_version, rec.submitted_at])[1:]
        meta = bytes(rec.meta) if type(rec.meta) is PackedMeta else msgpack.packb(rec.meta)
        at = msgpack.packb(received_at) if received else b""
    except (TypeError, ValueError, OverflowError) as e:
        raise UsageError(f"record.meta: expected msgpack-able values, found {type(e).__name__}: {e}") from None
    # the decoder's bound on size; its other rules (depth, no ext type) are checked where a
    # record is taken in (`pack_meta`, node/spool.py), once, not on every hop
    if len(meta) > MAX_META_BYTES:
        raise UsageError(f"record.meta: expected at most {MAX_META_BYTES} packed bytes, found {len(meta)}")
    count = _BODY_LEN[KIND_RECEIVED if received else KIND_RECORD]
    if key is not None:  # the optional last element (module docstring)
        return (bytes([0x90 | count + 1]) + head + bin_header(len(rec.payload)), rec.payload,
                meta + at + b"\xc4\x10" + key)
    return bytes([0x90 | count]) + head + bin_header(len(rec.payload)), rec.payload, meta + at


def pack_meta(meta: dict) -> PackedMeta:
    """A record's meta map packed, and read back as every decoder of a record reads one
    (MAX_META_BYTES, MAX_META_DEPTH, no ext type, keys that unpack hashable): UsageError
    for one the decoders refuse, so a record taken in decodes wherever it goes. Why: the spool took
    a meta nested 33 deep (or holding a msgpack Timestamp), acknowledged the record, and
    the origin then refused its whole batch and dropped the node, at every resend: that
    node's trajectories stopped for good (and the spool's own recovery dropped the record)."""
    try:
        packed = msgpack.packb(meta)
    except (TypeError, ValueError, OverflowError) as e:
        raise UsageError(f"record.meta: expected msgpack-able values, found {type(e).__name__}: {e}") from None
    if len(packed) > MAX_META_BYTES:
        raise UsageError(f"record.meta: expected at most {MAX_META_BYTES} packed bytes, found {len(packed)}")
    try:
        PackReader(packed, CorruptData, "record.meta").any(MAX_META_BYTES, MAX_META_DEPTH, "a map",
                                                            max_bytes=MAX_META_BYTES, kind="map", build=False)
    except CorruptData as e:
        raise UsageError(str(e)) from None
    return PackedMeta(packed)


def body_length(body) -> int:
    """Length of a body given as bytes or as parts."""
    return len(body) if isinstance(body, (bytes, bytearray, memoryview)) else sum(map(len, body))


def _unpack(body, what: str):
    try:
        # strict_map_key=False: meta maps may have any key msgpack packs (ints too);
        # decode must accept whatever encode accepted.
        return msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False)
    except Exception as e:  # msgpack raises many types for bad input
        raise CorruptData(f"{what}: expected msgpack, found undecodable bytes ({type(e).__name__}: {e})") from None


def _read_value(r: PackReader, allowed=_ALL_KINDS, packed_meta: bool = False):
    """One entry body's value, read along its kind's schema: strings, payload and meta
    are bounded (a meta map by MAX_META_BYTES and MAX_META_DEPTH) before they are built.
    `packed_meta`: a meta map is checked (without building it where protocol/_kernels
    built, else built once and let go) and kept as PackedMeta."""
    start = r.pos
    n = r.array_len(_MAX_BODY_LEN, "an array starting with a kind")
    kind = r.int(expected="a kind") if n else None
    if kind not in allowed:
        r.pos = start
        raise r.fail(f"an array starting with a kind in {list(allowed)}", _found(kind))
    if n != _BODY_LEN[kind] and not (n == _BODY_LEN[kind] + 1 and kind in _OPTIONAL_LAST):
        more = f" or {_BODY_LEN[kind] + 1}" if kind in _OPTIONAL_LAST else ""
        raise CorruptData(f"{r.what}: kind {kind} expects {_BODY_LEN[kind]}{more} elements, found {n}")
    if kind == KIND_DUPLICATES:
        count = r.int(expected="a duplicates count")
        by_key = r.int(expected="a count of duplicates by key") if n > _BODY_LEN[kind] else 0
        if not _uint(count):
            raise CorruptData(f"{r.what}: duplicates count: expected a non-negative int, found {_found(count)}")
        if not (_uint(by_key) and by_key <= count):
            raise CorruptData(f"{r.what}: duplicates by key: expected an int in 0..{count}, found {_found(by_key)}")
        return DuplicatesNote(count, by_key)
    if kind == KIND_ACKED:
        ranges = r.uint_tuples(r.array_len(r.end, "a list of ranges"), 2, _U64 - 1, "a range [start, end]")
        if not _ranges_ok(ranges):
            raise CorruptData(f"{r.what}: expected [start, end] pairs with start < end, found {_found(ranges)}")
        return AckedRanges(ranges)
    if kind == KIND_RECORD_IDS:
        seqs = r.bin(8 * _MAX_IDS_PER_ENTRY, "packed u64 seqs")
        keys = r.bin(RECORD_KEY_BYTES * _MAX_IDS_PER_ENTRY, "packed record keys")
        if not _ids_ok(seqs, keys):
            raise CorruptData(f"{r.what}: record ids: expected 1..{_MAX_IDS_PER_ENTRY} u64 seqs and "
                              f"{RECORD_KEY_BYTES} key bytes per seq, found {len(seqs)} and {len(keys)} bytes")
        return RecordIds(seqs, keys)
    node_id, region = r.str(_MAX_ID_BYTES, "a node id"), r.str(_MAX_ID_BYTES, "a region")
    if kind == KIND_SPOOL_STATE:
        seq = r.int(expected="a seq")
        _check_fields(node_id, region, seq, 0, 0.0, b"", None, CorruptData)
        return SpoolState(node_id, region, seq)
    seq, version = r.int(expected="a seq"), r.int(expected="a policy version")
    submitted_at = r.float("a float submitted_at")
    payload = r.bin(MAX_PAYLOAD_BYTES, "a payload")
    meta = None
    if not r.nil():
        start = r.pos
        meta = r.any(MAX_META_BYTES, MAX_META_DEPTH, "a meta map or nil", max_bytes=MAX_META_BYTES, kind="map",
                     build=not packed_meta)
        if packed_meta:
            meta = PackedMeta(r.data[start:r.pos])
    _check_fields(node_id, region, seq, version, submitted_at, payload, meta, CorruptData)
    received_at = r.float("a float received_at") if kind == KIND_RECEIVED else None
    key = None
    if n > _BODY_LEN[kind]:
        key = r.bin(RECORD_KEY_BYTES, f"a record key of {RECORD_KEY_BYTES} bytes")
        if len(key) != RECORD_KEY_BYTES:
            raise CorruptData(f"{r.what}: record.key: expected {RECORD_KEY_BYTES} bytes, found {len(key)}")
    if kind == KIND_RECORD:
        return Record(node_id, region, seq, version, submitted_at, payload, meta, key=key)
    return ReceivedRecord(node_id, region, seq, version, submitted_at, payload, meta, key=key,
                          received_at=received_at)


def _ranges_ok(ranges) -> bool:
    return isinstance(ranges, list) and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and _uint(r[0]) and _uint(r[1]) and r[0] < r[1] for r in ranges)


def decode_record(body, packed_meta: bool = False) -> Record | ReceivedRecord | DuplicatesNote | SpoolState | \
        AckedRanges | RecordIds:
    """The value in one entry body (CorruptData if it is not one). `packed_meta`: a
    record's meta is checked and kept as PackedMeta (for a reader that only sends it on)."""
    r = PackReader(body, CorruptData, "record body")
    value = _read_value(r, packed_meta=packed_meta)
    r.expect_end()
    return value


# ================================================================ payloads


def encode_payload(obj, meta: dict | None = None) -> tuple[bytes, dict | None]:
    """(payload bytes, meta) for a submit: bytes pass as they are; any other
    msgpack-able object is packed and meta gets {PAYLOAD_FORMAT_KEY: "msgpack"}
    so that `decode_payload` (and `Record.value()`) can give the object back."""
    if meta is not None and type(meta) is not dict:
        raise UsageError(f"meta: expected a dict or None, found {_found(meta)}")
    if meta and PAYLOAD_FORMAT_KEY in meta:
        raise UsageError(f"meta: the key {PAYLOAD_FORMAT_KEY!r} is reserved, found it set to {_found(meta[PAYLOAD_FORMAT_KEY])}")
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj), meta
    try:
        packed = msgpack.packb(obj)
    except (TypeError, ValueError, OverflowError) as e:
        raise UsageError(f"payload: expected bytes or a msgpack-able object, found {_found(obj)} ({e})") from None
    return packed, {**(meta or {}), PAYLOAD_FORMAT_KEY: PAYLOAD_MSGPACK}


def decode_payload(payload: bytes, meta: dict | None):
    """The object `encode_payload` was given (CorruptData if the packed payload is bad)."""
    if type(meta) is PackedMeta:
        meta = _unpack(meta, "record meta")
    if meta and meta.get(PAYLOAD_FORMAT_KEY) == PAYLOAD_MSGPACK:
        return _unpack(payload, "msgpack payload")
    return payload


# ================================================================ segment framing


def segment_header() -> bytes:
    head = SEGMENT_MAGIC + FORMAT_VERSION.to_bytes(4, "little")
    return head + zlib.crc32(head).to_bytes(4, "little")


def entry_header(body) -> bytes:
    """The 12 bytes that frame `body` (bytes, or parts as from record_parts):
    write them, then the body."""
    parts = (body,) if isinstance(body, (bytes, bytearray, memoryview)) else body
    n = sum(map(len, parts))
    if not 0 < n <= MAX_ENTRY_BYTES:
        raise UsageError(f"entry body: expected 1..{MAX_ENTRY_BYTES} bytes, found {n}")
    nb = n.to_bytes(4, "little")
    crc = zlib.crc32(nb)
    for p in parts:
        crc = zlib.crc32(p, crc)
    return ENTRY_SYNC + nb + crc.to_bytes(4, "little")


def encode_entry(body) -> bytes:
    parts = (body,) if isinstance(body, (bytes, bytearray, memoryview)) else body
    return entry_header(parts) + b"".join(parts)


@dataclass(frozen=True)
class Entry:
    offset: int  # of the entry header
    end: int  # offset just past the body
    body: memoryview  # a view into the scanned data


@dataclass(frozen=True)
class ScanProblem:
    kind: str  # "bad_header" | "torn" (entry runs past the end) | "corrupt" | "invalid" (body is not a record)
    offset: int  # where the damage starts
    end: int  # where scanning resumed (the data's end for a tail)
    tail: bool  # nothing intact follows: a writer may truncate at `offset`
    detail: str

    def __str__(self) -> str:
        where = "at the tail" if self.tail else f"resynced at {self.end}"
        return f"{self.kind} at offset {self.offset} ({where}): {self.detail}"


class SegmentScan(NamedTuple):
    entries: list  # Entry, or (Entry, value) from scan_records
    good_end: int  # offset just past the last intact entry (the header's end if none)
    problems: list[ScanProblem]


def _intact_end(data: bytes, pos: int, n: int):
    """(end, None) if an intact entry starts at pos, else (None, (kind, detail))."""
    if n - pos < ENTRY_HEADER_BYTES:
        return None, ("torn", f"{n - pos} bytes left, an entry header needs {ENTRY_HEADER_BYTES}")
    if data[pos:pos + 4] != ENTRY_SYNC:
        return None, ("corrupt", f"expected the sync marker {ENTRY_SYNC.hex()}, found {bytes(data[pos:pos + 4]).hex()}")
    length, crc = _HEADER_FIELDS.unpack_from(data, pos + 4)
    if not 0 < length <= MAX_ENTRY_BYTES:
        return None, ("corrupt", f"expected a body length in 1..{MAX_ENTRY_BYTES}, found {length}")
    end = pos + ENTRY_HEADER_BYTES + length
    if end > n:
        return None, ("torn", f"the body of {length} bytes runs {end - n} bytes past the end")
    mv = memoryview(data)
    if zlib.crc32(mv[pos + ENTRY_HEADER_BYTES:end], zlib.crc32(mv[pos + 4:pos + 8])) != crc:
        return None, ("corrupt", f"checksum mismatch over a body of {length} bytes")
    return end, None


def _resync(data: bytes, start: int, n: int):
    """The first offset >= start where an intact entry starts, or None."""
    while True:
        i = data.find(ENTRY_SYNC, start, n)
        if i < 0:
            return None
        if _intact_end(data, i, n)[0] is not None:
            return i
        start = i + 1


def scan_entries(data: bytes, start: int = SEGMENT_HEADER_BYTES, end: int | None = None,
                 limit: int | None = None) -> SegmentScan:
    """Every intact entry in data[start:end] (offsets are into `data`); see the module docstring.
    `limit`: stop after that many entries (`good_end` is then just past the last of them)."""
    n = len(data) if end is None else end
    entries, problems = [], []
    mv = memoryview(data)
    pos = good_end = start
    while pos < n and (limit is None or len(entries) < limit):
        e, why = _intact_end(data, pos, n)
        if e is not None:
            entries.append(Entry(pos, e, mv[pos + ENTRY_HEADER_BYTES:e]))
            pos = good_end = e
            continue
        nxt = _resync(data, pos + 1, n)
        if nxt is None:
            problems.append(ScanProblem(why[0], pos, n, True, why[1]))
            break
        problems.append(ScanProblem("corrupt", pos, nxt, False, f"{why[1]}; {nxt - pos} bytes skipped"))
        pos = nxt
    return SegmentScan(entries, good_end, problems)


def check_segment_header(data: bytes) -> ScanProblem | None:
    """None for a good header; a problem for a short or damaged one.

    UnsupportedFormat for an intact header of another format version: the file
    is not damaged, this code is too old for it."""
    head = SEGMENT_HEADER_BYTES
    if len(data) < head:
        if segment_header().startswith(bytes(data)):
            return ScanProblem("torn", 0, len(data), True, f"a header of {len(data)} of {head} bytes")
        return ScanProblem("bad_header", 0, len(data), True, f"expected a {head}-byte segment header, found {len(data)} other bytes")
    got = bytes(data[:head])
    if got == segment_header():
        return None
    if zlib.crc32(got[:12]) == int.from_bytes(got[12:], "little") and got[:8] == SEGMENT_MAGIC:
        version = int.from_bytes(got[8:12], "little")
        raise UnsupportedFormat(f"segment format: expected version {FORMAT_VERSION}, found {version}")
    return ScanProblem("bad_header", 0, head, False, f"expected header {segment_header().hex()}, found {got.hex()}")


def scan_segment(data: bytes) -> SegmentScan:
    """Header check, then `scan_entries` (a damaged header is reported and the
    entries are still scanned, so it costs no records)."""
    problem = check_segment_header(data)
    if problem is not None and problem.tail:
        return SegmentScan([], 0, [problem])
    scan = scan_entries(data, SEGMENT_HEADER_BYTES)
    if problem is not None:
        scan.problems.insert(0, problem)
    return scan


def scan_records(data: bytes, start: int | None = None, end: int | None = None,
                 limit: int | None = None) -> SegmentScan:
    """Like scan_segment (start None) or scan_entries (start given, and `limit`), with
    each entry decoded: entries are (Entry, value). An intact entry whose body is not a
    record (a writer bug, not damage) is reported as an "invalid" problem."""
    scan = scan_segment(data) if start is None else scan_entries(data, start, end, limit)
    out, problems = [], list(scan.problems)
    for e in scan.entries:
        try:
            out.append((e, decode_record(e.body)))
        except CorruptData as exc:
            problems.append(ScanProblem("invalid", e.offset, e.end, False, str(exc)))
    if len(problems) > len(scan.problems):
        problems.sort(key=lambda p: p.offset)
    return SegmentScan(out, scan.good_end, problems)


# ================================================================ wire batch


def encode_batch(records, keys=None) -> bytes:
    """One upload batch (UsageError past MAX_BATCH_RECORDS or MAX_BATCH_BYTES).

    `keys`: None, and no body carries a key (what every origin reads, whatever the
    records hold); or one per record, RECORD_KEY_BYTES or None, for an origin that
    reads them (wire revision 4)."""
    records = list(records)
    if len(records) > MAX_BATCH_RECORDS:
        raise UsageError(f"batch: expected at most {MAX_BATCH_RECORDS} records, found {len(records)}")
    if keys is not None:
        keys = list(keys)
        if len(keys) != len(records):
            raise UsageError(f"batch: expected a key (or None) per record, found {len(keys)} for {len(records)}")
    parts = [msgpack.Packer().pack_array_header(len(records))]
    for i, r in enumerate(records):
        if not isinstance(r, Record):
            raise UsageError(f"batch: expected Records, found {_found(r)}")
        # a ReceivedRecord travels as the plain Record it holds
        parts.extend(_parts(r, None, None if keys is None else keys[i]))
    raw = b"".join(parts)
    if len(raw) > MAX_BATCH_BYTES:
        raise UsageError(f"batch: expected at most {MAX_BATCH_BYTES} bytes, found {len(raw)}")
    packed = lz4.block.compress(raw, store_size=False)
    flags = _FLAG_LZ4
    if len(packed) >= len(raw):  # incompressible payloads: skip the decompressor's work
        packed, flags = raw, 0
    return _BATCH_HEADER.pack(BATCH_MAGIC, BATCH_VERSION, flags, len(raw), zlib.crc32(raw)) + packed


def decode_batch(data: bytes, packed_meta: bool = False) -> list[Record]:
    """The records of one batch (CorruptData for anything malformed). `packed_meta`:
    each meta is checked and kept as the PackedMeta bytes it came in (for a writer
    that only stores them: memory in proportion to the batch's bytes)."""
    data = bytes(data)
    if len(data) < _BATCH_HEADER.size:
        raise CorruptData(f"batch: expected at least {_BATCH_HEADER.size} header bytes, found {len(data)}")
    magic, version, flags, raw_len, crc = _BATCH_HEADER.unpack_from(data)
    if magic != BATCH_MAGIC:
        raise CorruptData(f"batch: expected magic {BATCH_MAGIC!r}, found {magic!r}")
    if version != BATCH_VERSION:
        raise UnsupportedFormat(f"batch: expected version {BATCH_VERSION}, found {version}")
    if flags & ~_FLAG_LZ4:
        raise CorruptData(f"batch: expected flags within {_FLAG_LZ4:#x}, found {flags:#x}")
    if raw_len > MAX_BATCH_BYTES:
        raise CorruptData(f"batch: expected at most {MAX_BATCH_BYTES} raw bytes, found a header of {raw_len}")
    body = memoryview(data)[_BATCH_HEADER.size:]  # no copy of what may be megabytes
    if flags & _FLAG_LZ4:
        if raw_len > _LZ4_MAX_RATIO * len(body):  # before lz4 allocates what the header declares
            raise CorruptData(f"batch: expected at most {_LZ4_MAX_RATIO} raw bytes per lz4 byte, found a header of "
                              f"{raw_len} for {len(body)}")
        try:
            raw = lz4.block.decompress(body, uncompressed_size=raw_len)
        except Exception as e:  # LZ4BlockError, ValueError
            raise CorruptData(f"batch: expected an lz4 block of {raw_len} raw bytes, found undecodable data ({e})") from None
    else:
        raw = body
    if len(raw) != raw_len:
        raise CorruptData(f"batch: expected {raw_len} raw bytes, found {len(raw)}")
    if zlib.crc32(raw) != crc:
        raise CorruptData(f"batch: checksum mismatch over {raw_len} raw bytes")
    r = PackReader(raw, CorruptData, "batch")
    records = []
    for i in range(r.array_len(MAX_BATCH_RECORDS, "an array of records")):
        r.what = f"batch record {i}"
        records.append(_read_value(r, (KIND_RECORD,), packed_meta))
    r.what = "batch"
    r.expect_end()
    return records


# ================================================================ seq ranges


class SeqRanges:
    """A set of non-negative ints kept as sorted, disjoint, non-adjacent
    half-open ranges: memory grows with the gaps, not with the count (a node's
    seqs are dense, with a jump per restart)."""

    def __init__(self, ranges=()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._count = 0
        for a, b in ranges:
            self.add_range(a, b)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self._starts, seq) - 1
        return i >= 0 and seq < self._ends[i]

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def range_count(self) -> int:
        """How many ranges (one more than the gaps): what the set's memory and an insert's cost grow with."""
        return len(self._starts)

    def add(self, seq: int) -> bool:
        """Add one seq; False if it was already there."""
        ends = self._ends
        if ends and type(seq) is int and seq >= ends[-1]:  # the usual case: past everything
            if seq == ends[-1]:
                ends[-1] = seq + 1
            else:
                self._starts.append(seq)
                ends.append(seq + 1)
            self._count += 1
            return True
        return self.add_range(seq, seq + 1) == 1

    def discard(self, seq: int) -> bool:
        """Remove one seq (its write failed after `add`); False if it was not there."""
        i = bisect.bisect_right(self._starts, seq) - 1
        if i < 0 or seq >= self._ends[i]:
            return False
        a, b = self._starts[i], self._ends[i]
        if b - a == 1:
            del self._starts[i], self._ends[i]
        elif seq == a:
            self._starts[i] = seq + 1
        elif seq == b - 1:
            self._ends[i] = seq
        else:  # split [a, b) into [a, seq) and [seq + 1, b)
            self._ends[i] = seq
            self._starts.insert(i + 1, seq + 1)
            self._ends.insert(i + 1, b)
        self._count -= 1
        return True

    def add_range(self, a: int, b: int) -> int:
        """Add [a, b); returns how many were new."""
        if not (type(a) is int and type(b) is int and 0 <= a <= b):
            raise UsageError(f"expected 0 <= a <= b ints, found {_found((a, b))}")
        if a == b:
            return 0
        starts, ends = self._starts, self._ends
        i = bisect.bisect_left(ends, a)  # first range that ends at or after a (may touch)
        j = bisect.bisect_right(starts, b)  # ranges [i, j) touch or overlap [a, b)
        if i == j:  # fast path: no contact
            starts.insert(i, a)
            ends.insert(i, b)
            self._count += b - a
            return b - a
        covered = sum(min(ends[k], b) - max(starts[k], a) for k in range(i, j) if ends[k] > a and starts[k] < b)
        new_a, new_b = min(a, starts[i]), max(b, ends[j - 1])
        starts[i:j] = [new_a]
        ends[i:j] = [new_b]
        added = (b - a) - max(covered, 0)
        self._count += added
        return added


def seq_ranges(seqs) -> list[tuple[int, int]]:
    """Sorted half-open ranges covering exactly the given seqs."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(seqs)):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out
