"""Signed swarm manifests: what a version is made of, and who says so. Sans-IO.

A manifest names one published version of a swarm's weights: which version it
patches (`base_version`/`base_hash`, both None for a keyframe), the state hash
it yields (`target_hash`), the tensors it holds, and the chunks (size and
SHA-256 each) that nodes fetch from each other, and (since 2026-12-07) the
publishing origin's region (`origin_region_of`). The trainer signs it with its
Ed25519 key; nodes verify it against the swarm's `trainer.pub` before trusting
any chunk it lists.

Two forms, told apart by the magic first field (`form`):

- form 1 ("patchswarm-manifest/1"): `tensors` is the target's whole tensor
  table, `codec` names the full tensors and maps every tensor to its shard;
- form 2 ("patchswarm-manifest/2"): `tensors` lists only the tensors the
  object writes whole (for a keyframe: all of them); every other tensor of
  the target is the base's, as `base_hash` fixes it. A patch version's
  manifest then grows with what the version changes, not with the model
  (protocol/publication.py reads both; protocol/README.md has the numbers).
  On the wire the list is one zstd frame of the msgpack rows, in name order
  (names share long prefixes: a 140,000-tensor MoE's 10 MB table is ~0.3 MB);
  `Manifest.tensors` holds the rows either way.

Wire form:

- manifest bytes: a msgpack array in one fixed order (the magic, then `_FIELDS`),
  maps in `codec` with sorted keys, so that one manifest has exactly one encoding;
- envelope: msgpack `[manifest_bytes, signature]`, the signature over the
  manifest bytes.

No files, no clocks: `created_at` is passed in by the caller.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, NamedTuple

import msgpack
import zstandard
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import CorruptData, SignatureError, UsageError
from .regions import region_fault
from .packreader import PackReader

MAGIC = "patchswarm-manifest/1"
# The manifest forms a member reads, by their magic (module docstring).
MAGICS = {1: MAGIC, 2: "patchswarm-manifest/2"}
_FORMS = {magic: form for form, magic in MAGICS.items()}
SIGNATURE_BYTES = 64
SHA256_BYTES = 32
# Chunks of one version, at most: 2 TiB of 2 MiB chunks (a 500 GB checkpoint's keyframe
# is ~170k). Wire messages bound chunk indices and Have bitfields by it.
MAX_CHUNKS = 1 << 20
ORIGIN_REGION = "origin_region"  # codec key: the publishing origin's region (`origin_region_of`)
_FIELDS = ("swarm_id", "version", "base_version", "base_hash", "target_hash",
           "tensors", "chunks", "codec", "created_at")
# A form-2 tensor table: compressed at this level (as the patch container's), and read back
# only up to these bounds (a table is ~75 bytes a row: 1M tensors ~ 75 MB; names compress ~70x).
TABLE_ZSTD_LEVEL = 12
MAX_TABLE_BYTES = 256 << 20
TABLE_MAX_RATIO = 512
MAX_NAME_BYTES = 4096
_MAX_DTYPE_BYTES = 32
_MAX_DIMS = 64
_MAX_DIM = (1 << 48) - 1


class ObjKey(NamedTuple):
    """One published object: the patch or the keyframe of a version. Equal to, and
    interchangeable with, the plain tuple (version, keyframe)."""

    version: int
    keyframe: bool


@dataclasses.dataclass(frozen=True)
class Manifest:
    """One version of a swarm's weights. `tensors` and `chunks` are normalized to tuples."""

    swarm_id: str
    version: int
    base_version: int | None
    base_hash: str | None
    target_hash: str
    tensors: tuple  # of (name: str, dtype: str, shape: tuple[int, ...])
    chunks: tuple  # of (size: int, sha256: bytes)
    codec: dict
    created_at: float
    form: int = 1  # 1: `tensors` is the whole table; 2: only the tensors written whole
    # Form 2: the compressed table as signed (kept so that the manifest encodes to its bytes).
    table_blob: bytes | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self, UsageError)
        object.__setattr__(self, "tensors", tuple((n, d, tuple(s)) for n, d, s in self.tensors))
        object.__setattr__(self, "chunks", tuple((int(z), bytes(h)) for z, h in self.chunks))
        object.__setattr__(self, "codec", _canonical(self.codec, UsageError))
        object.__setattr__(self, "created_at", float(self.created_at))

    @property
    def is_keyframe(self) -> bool:
        return self.base_version is None

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.chunks)


def origin_region_of(m: Manifest) -> str | None:
    """The region of the origin that published `m`, as it signed it; None where it names none
    (an origin from before 2026-12-07) or names one no member could be of (`region_fault`).

    *Why in the manifest:* a node plans each chunk's chain of regions from the origin's
    region, which it learned only from the tracker's list of live members. A node that
    joined or restarted while the trainer was down (a crash, a preemption, a resume from a
    checkpoint) planned nothing, even where its peers held every object it lacked. Signed
    beside the objects, the region is known wherever a manifest is; a key that readers of
    the codec before it ignore."""
    region = m.codec.get(ORIGIN_REGION)
    return region if region_fault(region) is None else None


def key_of(m: Manifest) -> ObjKey:
    return ObjKey(m.version, m.is_keyframe)


def describe(key: ObjKey) -> str:
    return f"v{key[0]} {'keyframe' if key[1] else 'patch'}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(m: Any, error: type[Exception]) -> None:
    """Raise `error` naming the first field of `m` that is not what a manifest must hold."""

    def bad(field: str, expected: str, found: Any) -> None:
        raise error(f"manifest {field}: expected {expected}, found {found!r:.80}")

    if not isinstance(m.swarm_id, str) or not m.swarm_id:
        bad("swarm_id", "a non-empty str", m.swarm_id)
    if not _is_int(m.version) or m.version < 0:
        bad("version", "an int >= 0", m.version)
    if getattr(m, "form", 1) not in MAGICS:
        bad("form", f"one of {sorted(MAGICS)}", m.form)
    if (m.base_version is None) != (m.base_hash is None):
        bad("base_version/base_hash", "both None (keyframe) or both set", (m.base_version, m.base_hash))
    if m.base_version is not None:
        if not _is_int(m.base_version) or not 0 <= m.base_version < m.version:
            bad("base_version", f"an int in [0, {m.version})", m.base_version)
        if not isinstance(m.base_hash, str) or not m.base_hash:
            bad("base_hash", "a non-empty str", m.base_hash)
    if not isinstance(m.target_hash, str) or not m.target_hash:
        bad("target_hash", "a non-empty str", m.target_hash)
    if not isinstance(m.tensors, (list, tuple)):
        bad("tensors", "a list", m.tensors)
    for t in m.tensors:
        if (not isinstance(t, (list, tuple)) or len(t) != 3 or not isinstance(t[0], str)
                or not isinstance(t[1], str) or not isinstance(t[2], (list, tuple))
                or not all(_is_int(d) and d >= 0 for d in t[2])):
            bad("tensors entry", "[name: str, dtype: str, shape: list of ints >= 0]", t)
    if getattr(m, "form", 1) == 2:
        names = [t[0] for t in m.tensors]
        if names != sorted(set(names)):
            bad("tensors", "names in order, each once (form 2)", names[:5])
    if not isinstance(m.chunks, (list, tuple)) or len(m.chunks) > MAX_CHUNKS:
        bad("chunks", f"a list of at most {MAX_CHUNKS}", m.chunks if not isinstance(m.chunks, (list, tuple)) else len(m.chunks))
    for c in m.chunks:
        if (not isinstance(c, (list, tuple)) or len(c) != 2 or not _is_int(c[0]) or c[0] < 0
                or not isinstance(c[1], (bytes, bytearray)) or len(c[1]) != SHA256_BYTES):
            bad("chunks entry", "[size: int >= 0, sha256: 32 bytes]", c)
    if not isinstance(m.codec, dict):
        bad("codec", "a dict", m.codec)
    if (not isinstance(m.created_at, (int, float)) or isinstance(m.created_at, bool)
            or not math.isfinite(m.created_at)):
        bad("created_at", "a finite float", m.created_at)


def _canonical(value: Any, error: type[Exception]) -> Any:
    """`value` with every map's keys sorted; only msgpack's plain types (str keys) allowed."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise error(f"manifest codec: expected str keys, found {list(value)!r:.80}")
        return {k: _canonical(value[k], error) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, error) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        if _is_int(value) and not -(2**63) <= value < 2**64:
            raise error(f"manifest codec: int {value} does not fit msgpack")
        return value
    raise error(f"manifest codec: expected msgpack plain types, found {type(value).__name__}")


def encode_manifest(m: Manifest) -> bytes:
    """The one canonical encoding of `m`."""
    if not isinstance(m, Manifest):
        raise UsageError(f"encode_manifest: expected a Manifest, found {type(m).__name__}")
    if m.form == 1:
        tensors: Any = [[n, d, list(s)] for n, d, s in m.tensors]
    else:
        if m.table_blob is None:
            object.__setattr__(m, "table_blob", pack_table(m.tensors))
        tensors = m.table_blob
    return msgpack.packb([
        MAGICS[m.form], m.swarm_id, m.version, m.base_version, m.base_hash, m.target_hash,
        tensors,
        [[z, h] for z, h in m.chunks],
        m.codec, m.created_at,
    ], use_bin_type=True)


def decode_manifest(data: bytes) -> Manifest:
    """Parse canonical manifest bytes (unsigned). Raises CorruptData only."""
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises a zoo: ValueError, ExtraData, FormatError, StackError, TypeError
        raise CorruptData(f"manifest: not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, list) or len(obj) != 1 + len(_FIELDS):
        raise CorruptData(f"manifest: expected an array of {1 + len(_FIELDS)}, found {type(obj).__name__}")
    form = _FORMS.get(obj[0]) if isinstance(obj[0], str) else None
    if form is None:
        raise CorruptData(f"manifest: expected magic {' or '.join(map(repr, MAGICS.values()))}, found {obj[0]!r:.80}")
    fields = dict(zip(_FIELDS, obj[1:]), form=form)
    if form == 2:
        if not isinstance(fields["tensors"], bytes):
            raise CorruptData(f"manifest tensors: expected a compressed table (bin), found "
                              f"{type(fields['tensors']).__name__}")
        fields["table_blob"] = fields["tensors"]
        fields["tensors"] = read_table(fields["tensors"])
    try:
        # Checked once, by the constructor (its UsageError is a peer's CorruptData here): at
        # 140,000 tensors a second check cost 0.6 s of a node's every version.
        m = Manifest(**fields)
    except UsageError as e:
        raise CorruptData(str(e)) from None
    if encode_manifest(m) != bytes(data):
        raise CorruptData("manifest: not in canonical encoding")
    return m


def pack_table(rows) -> bytes:
    """A form-2 manifest's `tensors` on the wire: msgpack [[name, dtype, shape], ...], zstd."""
    raw = msgpack.packb([[n, d, list(s)] for n, d, s in rows], use_bin_type=True)
    return zstandard.ZstdCompressor(level=TABLE_ZSTD_LEVEL).compress(raw)


def read_table(blob: bytes) -> tuple:
    """The rows of a compressed table, each (name, dtype, shape); CorruptData unless it is
    one zstd frame of at most TABLE_MAX_RATIO times its bytes (and MAX_TABLE_BYTES) holding
    rows with names in order, each once."""
    limit = min(MAX_TABLE_BYTES, TABLE_MAX_RATIO * len(blob))
    # Not planes.decompress: that module brings numpy and torch, which the tracker (it reads
    # manifests) does without.
    try:
        declared = zstandard.frame_content_size(blob)
        if declared > limit:
            raise CorruptData(f"manifest tensors: expected at most {limit} bytes of table from {len(blob)} "
                              f"compressed, found a frame that declares {declared}")
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise CorruptData(f"manifest tensors: expected a zstd frame of at most {limit} bytes ({e})") from None
    r = PackReader(raw, CorruptData, "manifest tensor table")
    rows = []
    for _ in range(r.array_len(len(raw), "a list of [name, dtype, shape]")):
        if r.array_len(3, "a row [name, dtype, shape]") != 3:
            raise r.fail("a row [name, dtype, shape]", "an array of another length")
        name = r.str(MAX_NAME_BYTES, "a tensor name")
        dtype = r.str(_MAX_DTYPE_BYTES, "a dtype name")
        rows.append((name, dtype, tuple(r.uints(r.array_len(_MAX_DIMS, "a shape"), _MAX_DIM, "a dimension"))))
    r.expect_end()
    return tuple(rows)


def sign_manifest(m: Manifest, private_key: Ed25519PrivateKey) -> bytes:
    """The signed envelope `msgpack [manifest_bytes, signature]`."""
    if not isinstance(private_key, Ed25519PrivateKey):
        raise UsageError(f"sign_manifest: expected an Ed25519PrivateKey, found {type(private_key).__name__}")
    body = encode_manifest(m)
    return msgpack.packb([body, private_key.sign(body)], use_bin_type=True)


def verify_manifest(data: bytes, public_key: Ed25519PublicKey) -> Manifest:
    """The manifest in a signed envelope, once its signature verifies against `public_key`.

    Raises SignatureError when the signature does not verify, CorruptData when
    the envelope or manifest does not decode; nothing else for any `data`.
    """
    if not isinstance(public_key, Ed25519PublicKey):
        raise UsageError(f"verify_manifest: expected an Ed25519PublicKey, found {type(public_key).__name__}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UsageError(f"verify_manifest: expected bytes, found {type(data).__name__}")
    # Read along its schema, not unpacked: an envelope comes from any peer (a VersionNotice), and
    # 16 MiB of nested empty arrays cost ~1.2 GB to unpack before any check could run.
    r = PackReader(bytes(data), CorruptData, "manifest envelope")
    if r.array_len(2, "[manifest: bin, signature: bin]") != 2:
        raise CorruptData("manifest envelope: expected [manifest: bin, signature: bin]")
    body, sig = r.bin(len(data), "manifest: bin"), r.bin(len(data), "signature: bin")
    r.expect_end()
    if len(sig) != SIGNATURE_BYTES:
        raise SignatureError(f"manifest signature: expected {SIGNATURE_BYTES} bytes, found {len(sig)}")
    try:
        public_key.verify(sig, body)
    except InvalidSignature:
        raise SignatureError("manifest signature does not verify against the trainer key") from None
    return decode_manifest(body)


def peek_key(data: bytes) -> ObjKey | None:
    """The object a signed envelope's manifest says it is, read from its first fields alone:
    no signature check, no decode of its tables. None where those fields do not parse.

    Not a reason to trust anything: for refusing, at the cost of a few header bytes, what
    would be refused once checked (an object at or below the version a member holds). The
    fields are inside the signed bytes, so a manifest that says it is old is old or forged.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    r = PackReader(data, CorruptData, "manifest envelope")
    try:
        if r.array_len(2) != 2:
            return None
        body = r.bin_view(len(data))
        r = PackReader(body, CorruptData, "manifest")
        if r.array_len(1 + len(_FIELDS)) != 1 + len(_FIELDS) or r.str(64) not in _FORMS:
            return None
        r.str(len(body))  # swarm_id
        version = r.uint()
        return ObjKey(version, r.nil())  # base_version: nil for a keyframe
    except CorruptData:
        return None


def chunk_ok(m: Manifest, index: int, data: bytes) -> bool:
    """Whether `data` is chunk `index` of `m`: same size and SHA-256. False for an index out of range."""
    if not _is_int(index):
        raise UsageError(f"chunk_ok: expected an int index, found {type(index).__name__}")
    if not 0 <= index < len(m.chunks):
        return False
    size, digest = m.chunks[index]
    return len(data) == size and hashlib.sha256(data).digest() == digest
