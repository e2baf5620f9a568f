"""What one version changed, element by element, for engines that keep the weights in memory. Sans-IO.

Owns the bytes of a change stream (`ChangeEncoder`, `ChangeStream`), its
events (`VersionHeader`, `Structure`, `Piece`, `VersionEnd`) and
`apply_changes`, which writes them into a caller's tensors in place. Must not
read files or sockets, nor know how the changes were captured: the patch
decoder (patchdecode.py `apply(..., recorder=)`) hands an encoder each write
as it makes it; node/changelog.py stores the frames and the local socket
streams them.

Why a second format beside the patch: a patch is decoded against the base
(context classes, deltas of bit patterns), so an engine would need the
codec, a CPU pass and the base bits in host memory. A change stream is
what the node already computed: flat positions and the new bit patterns,
which an engine writes with one index operation per piece on whatever device
its tensors live on. Size: positions as int32 where the tensor has fewer
than 2^31 elements (int64 otherwise), then the new bits: 6 B per changed
bf16 element, 5 B per fp8 one, 8 B per fp32 one; whole tensors (new, or of
a new dtype or shape) as a range and their bits, no positions.

A stream is frames, each `u32 length | u32 CRC-32 of the body | body`
(little-endian) with a body of at most `MAX_FRAME_BYTES`, so a damaged file
is found before a frame is written into anyone's weights; body = `kind (1 byte) | u32 meta length | meta
(msgpack) | payload`. Per version, in this order:

- `H` header: base version and hash (None when the version was applied to
  nothing), target version and hash, keyframe (every tensor not declared
  full in this version is dropped at its end);
- `S` structure, zero or more: tensors removed, tensors (re)allocated whole
  ([name, dtype, shape]), in bounded lists;
- `P` piece, zero or more: meta [name, dtype, shape, start, count]; with
  start nil the payload is count positions then count bit patterns, else
  the bits of elements [start, start + count);
- `E` end: the number of pieces and of elements written, checked.

Versions follow each other in one stream; each header's base must be the
previous target. Every length is checked before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import struct
import warnings
import zlib
from typing import Callable, Iterable

import msgpack
import numpy as np
import torch

from .dtypes import BY_NAME, DtypeInfo, info_named, info_of
from .errors import BaseMismatch, CorruptData, UnsupportedFormat, UsageError
from .patchformat import TensorSpec
from .wire import NEED_DATA

FORMAT_VERSION = 1
MAX_FRAME_BYTES = 4 << 20  # a frame's body; a reader holds at most one
MAX_META_BYTES = 64 << 10  # a piece's or the end's msgpack meta
MAX_NAME_BYTES = 4096
MAX_DIMS = 16
MAX_ELEMENTS = 1 << 48  # per tensor: a shape beyond this is corrupt, not a model
INT32_LIMIT = 1 << 31  # tensors with fewer elements carry int32 positions
_PREFIX = struct.Struct("<II")  # body length, CRC-32 of the body
PREFIX_BYTES = _PREFIX.size
_BODY = struct.Struct("<cI")  # kind, meta length
KINDS = (b"H", b"S", b"P", b"E")


@dataclasses.dataclass(frozen=True)
class VersionHeader:
    base_version: int | None
    base_hash: str | None
    target_version: int
    target_hash: str
    keyframe: bool = False


@dataclasses.dataclass(frozen=True)
class Structure:
    removed: tuple[str, ...] = ()
    full: tuple[TensorSpec, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
    """Writes to one tensor: `bits` at `positions` (ascending flat positions), or
    at `start`, `start + 1`, ... when `positions` is None."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int | None
    positions: np.ndarray | None
    bits: np.ndarray


@dataclasses.dataclass(frozen=True)
class VersionEnd:
    pieces: int
    elements: int


Event = VersionHeader | Structure | Piece | VersionEnd


def position_dtype(numel: int) -> type:
    return np.int32 if numel < INT32_LIMIT else np.int64


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _frame(kind: bytes, meta, *payload) -> list:
    """One frame as buffers to write in order (payload arrays are not copied)."""
    m = msgpack.packb(meta, use_bin_type=True)
    size = _BODY.size + len(m) + sum(p.nbytes for p in payload)
    if size > MAX_FRAME_BYTES:
        raise UsageError(f"change frame: expected at most {MAX_FRAME_BYTES} bytes, found {size}")
    head = _BODY.pack(kind, len(m)) + m
    crc = zlib.crc32(head)
    for p in payload:
        crc = zlib.crc32(p, crc)
    return [_PREFIX.pack(size, crc) + head, *payload]


# ------------------------------------------------------------------ encoding


class ChangeEncoder:
    """One version's frames, handed to `emit(buffers)` as they are made.

    Call it as the patch decoder's recorder: `encoder(name, positions, bits)`
    with positions an int array (ascending) or a slice, bits the new bit
    patterns (the dtype's integer view). `header()` first, then the writes,
    then `end()`. `specs`: the target's tensor table (dtype and shape of each
    name written); `full`: the tensors the version allocates whole; `removed`:
    those it drops."""

    def __init__(self, header: VersionHeader, specs: Iterable[TensorSpec], emit: Callable[[list], None], *,
                 full: Iterable[str] = (), removed: Iterable[str] = (), max_frame_bytes: int = MAX_FRAME_BYTES):
        if not 4096 <= max_frame_bytes <= MAX_FRAME_BYTES:
            raise UsageError(f"max_frame_bytes: expected 4096..{MAX_FRAME_BYTES}, found {max_frame_bytes}")
        self._header = header
        self._specs = {s.name: s for s in specs}
        self._emit = emit
        self._full = [self._spec(n) for n in full]
        self._removed = list(removed)
        self._max = max_frame_bytes
        self.pieces = 0
        self.elements = 0
        self.bytes = 0

    @classmethod
    def for_patch(cls, patch, base: tuple[int, str] | None, target_version: int, emit: Callable[[list], None],
                  max_frame_bytes: int = MAX_FRAME_BYTES) -> "ChangeEncoder":
        """The encoder that records what applying `patch` (protocol/patch.py) to a state
        at `base` (version, state hash; None for no state) writes."""
        header = VersionHeader(None if base is None else base[0], None if base is None else base[1], target_version,
                               patch.target_hash, patch.kind == "keyframe")
        return cls(header, patch.tensors, emit, full=patch.full, removed=patch.removed, max_frame_bytes=max_frame_bytes)

    def _spec(self, name: str) -> TensorSpec:
        s = self._specs.get(name)
        if s is None:
            raise UsageError(f"change encoder: expected {name!r} in the target's tensor table, found no such tensor")
        return s

    def _out(self, buffers: list) -> None:
        self.bytes += sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
        self._emit(buffers)

    def header(self) -> None:
        h = self._header
        self._out(_frame(b"H", {"v": FORMAT_VERSION, "base_version": h.base_version, "base_hash": h.base_hash,
                                "target_version": h.target_version, "target_hash": h.target_hash,
                                "keyframe": h.keyframe}))
        # Structure lists in frames of bounded size: a keyframe of a model with
        # 100k tensors declares them all.
        items = [("removed", n) for n in self._removed] + [("full", [s.name, s.dtype, list(s.shape)]) for s in self._full]
        budget = self._max - _BODY.size - 64
        cur: dict = {"removed": [], "full": []}
        used = 0
        for key, item in items:
            size = len(msgpack.packb(item, use_bin_type=True))
            if used + size > budget and used:
                self._out(_frame(b"S", cur))
                cur, used = {"removed": [], "full": []}, 0
            cur[key].append(item)
            used += size
        if used:
            self._out(_frame(b"S", cur))

    def __call__(self, name: str, positions: np.ndarray | slice, bits: np.ndarray) -> None:
        spec = self._spec(name)
        info = info_named(spec.dtype)
        n = len(bits)
        if not n:
            return
        bits = bits.view(_np_bits(info))
        meta_room = 64 + len(name.encode()) + 12 * len(spec.shape)
        if isinstance(positions, slice):
            per = info.width
            step = max(1, (self._max - _BODY.size - meta_room) // per)
            for a in range(0, n, step):
                b = min(n, a + step)
                self._out(_frame(b"P", [name, spec.dtype, list(spec.shape), positions.start + a, b - a], bits[a:b]))
        else:
            pos = positions.astype(position_dtype(spec.numel), copy=False)
            per = pos.itemsize + info.width
            step = max(1, (self._max - _BODY.size - meta_room) // per)
            for a in range(0, n, step):
                b = min(n, a + step)
                self._out(_frame(b"P", [name, spec.dtype, list(spec.shape), None, b - a], pos[a:b], bits[a:b]))
        self.pieces += -(-n // step)
        self.elements += n

    def end(self) -> None:
        self._out(_frame(b"E", {"pieces": self.pieces, "elements": self.elements}))


def _np_bits(info: DtypeInfo) -> type:
    return np.uint8 if info.np_int is np.uint8 else info.np_int


def encode_version(header: VersionHeader, specs: Iterable[TensorSpec],
                   writes: Iterable[tuple[str, np.ndarray | slice, np.ndarray]], *, full: Iterable[str] = (),
                   removed: Iterable[str] = (), max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """A whole version's frames as one bytes (for tests and small states)."""
    out: list = []
    enc = ChangeEncoder(header, specs, lambda bufs: out.extend(bytes(b) for b in bufs), full=full, removed=removed,
                        max_frame_bytes=max_frame_bytes)
    enc.header()
    for w in writes:
        enc(*w)
    enc.end()
    return b"".join(out)


# ------------------------------------------------------------------ decoding


def _bad(what: str, expected: str, found) -> CorruptData:
    return CorruptData(f"change frame {what}: expected {expected}, found {found!r}"[:400])


def frame_prefix(prefix: bytes) -> tuple[int, int]:
    """(body length, CRC-32) a frame's PREFIX_BYTES announce, the length checked against MAX_FRAME_BYTES."""
    n, crc = _PREFIX.unpack(prefix)
    if not _BODY.size <= n <= MAX_FRAME_BYTES:
        raise _bad("length", f"{_BODY.size}..{MAX_FRAME_BYTES} bytes", n)
    return n, crc


def _spec_of(item) -> TensorSpec:
    if not (isinstance(item, list) and len(item) == 3):
        raise _bad("tensor", "[name, dtype, shape]", item)
    name, dtype, shape = item
    if not isinstance(name, str) or not 0 < len(name.encode()) <= MAX_NAME_BYTES:
        raise _bad("tensor name", f"a string of 1..{MAX_NAME_BYTES} bytes", name)
    if dtype not in BY_NAME:
        raise UnsupportedFormat(f"change frame dtype: expected one of {sorted(BY_NAME)}, found {dtype!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(s) is int and 0 <= s < MAX_ELEMENTS for s in shape) or _numel(shape) > MAX_ELEMENTS):
        raise _bad("shape", f"at most {MAX_DIMS} sizes >= 0, at most {MAX_ELEMENTS} elements", shape)
    return TensorSpec(name, dtype, tuple(shape))


def decode_frame(body: bytes | memoryview, crc: int) -> Event:
    """One frame's body (without its prefix) as an event; CorruptData if it is malformed
    or its CRC-32 is not `crc`."""
    body = memoryview(body)
    if not _BODY.size <= len(body) <= MAX_FRAME_BYTES:
        raise _bad("body", f"{_BODY.size}..{MAX_FRAME_BYTES} bytes", len(body))
    if zlib.crc32(body) != crc:
        raise _bad("checksum", f"CRC-32 {crc:08x}", f"{zlib.crc32(body):08x} (damaged)")
    kind, mlen = _BODY.unpack_from(body)
    if kind not in KINDS:
        raise _bad("kind", f"one of {[k.decode() for k in KINDS]}", kind)
    if mlen > len(body) - _BODY.size:
        raise _bad("meta length", f"at most {len(body) - _BODY.size}", mlen)
    if kind in (b"P", b"E") and mlen > MAX_META_BYTES:  # a header's or structure's lists may be longer
        raise _bad("meta length", f"at most {MAX_META_BYTES} in a {kind.decode()} frame", mlen)
    try:
        meta = msgpack.unpackb(body[_BODY.size:_BODY.size + mlen], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise _bad("meta", "msgpack", type(e).__name__) from None
    payload = body[_BODY.size + mlen:]
    if kind == b"P":
        return _piece(meta, payload)
    if payload:
        raise _bad("payload", f"none in a {kind.decode()} frame", f"{len(payload)} bytes")
    if kind == b"H":
        return _header(meta)
    if kind == b"S":
        if not (isinstance(meta, dict) and isinstance(meta.get("removed"), list) and isinstance(meta.get("full"), list)):
            raise _bad("structure", "a map with lists 'removed' and 'full'", meta)
        for n in meta["removed"]:
            if not isinstance(n, str) or not 0 < len(n.encode()) <= MAX_NAME_BYTES:
                raise _bad("removed name", f"a string of 1..{MAX_NAME_BYTES} bytes", n)
        return Structure(tuple(meta["removed"]), tuple(_spec_of(i) for i in meta["full"]))
    if not (isinstance(meta, dict) and all(type(meta.get(k)) is int and meta[k] >= 0 for k in ("pieces", "elements"))):
        raise _bad("end", "a map with counts 'pieces' and 'elements'", meta)
    return VersionEnd(meta["pieces"], meta["elements"])


def _header(meta) -> VersionHeader:
    if not isinstance(meta, dict):
        raise _bad("header", "a map", meta)
    if meta.get("v") != FORMAT_VERSION:
        raise UnsupportedFormat(f"change stream: expected format version {FORMAT_VERSION}, found {meta.get('v')!r}")
    bv, bh, tv, th = (meta.get(k) for k in ("base_version", "base_hash", "target_version", "target_hash"))
    if (bv is None) != (bh is None) or not (bv is None or (type(bv) is int and bv >= 0 and isinstance(bh, str))):
        raise _bad("header base", "version >= 0 and hash, or both nil", (bv, bh))
    if type(tv) is not int or tv < 0 or not isinstance(th, str) or not isinstance(meta.get("keyframe"), bool):
        raise _bad("header target", "version >= 0, hash and keyframe flag", (tv, th, meta.get("keyframe")))
    return VersionHeader(bv, bh, tv, th, meta["keyframe"])


def _piece(meta, payload: memoryview) -> Piece:
    if not (isinstance(meta, list) and len(meta) == 5):
        raise _bad("piece", "[name, dtype, shape, start, count]", meta)
    spec = _spec_of(meta[:3])
    start, count = meta[3], meta[4]
    numel = spec.numel
    info = info_named(spec.dtype)
    if type(count) is not int or not 0 < count <= numel:
        raise _bad("piece count", f"1..{numel}", count)
    if start is not None and (type(start) is not int or not 0 <= start <= numel - count):
        raise _bad("piece start", f"0..{numel - count}", start)
    pdt = np.dtype(position_dtype(numel))
    need = count * info.width + (0 if start is not None else count * pdt.itemsize)
    if len(payload) != need:
        raise _bad("piece payload", f"{need} bytes for {count} elements of {spec.dtype}", len(payload))
    positions = None
    off = 0
    if start is None:
        positions = np.frombuffer(payload, dtype=pdt, count=count)
        off = count * pdt.itemsize
        # Ascending and in range: one vectorized check instead of trusting the sender. Compared
        # pairwise, not by np.diff: a difference of two int32 positions can wrap (100 and
        # -2147483549 differ by more than int32 holds and would pass as ascending).
        if positions[0] < 0 or positions[-1] >= numel or (count > 1 and not (positions[1:] > positions[:-1]).all()):
            raise _bad("piece positions", f"ascending in [0, {numel})", f"{positions[:4]}…")
    bits = np.frombuffer(payload, dtype=_np_bits(info), count=count, offset=off)
    return Piece(spec.name, spec.dtype, spec.shape, start, positions, bits)


class ChangeStream:
    """Frames in (`receive_data`), checked events out (`next_event`, or NEED_DATA).

    Checks the order (H, S*, P*, E per version), that each header's base is
    the previous target, and each end's counts. Holds at most one frame."""

    def __init__(self, after: tuple[int, str | None] | None = None):
        """`after`: (version, state hash) the first header's base must be (hash None: not checked)."""
        self._buf = bytearray()
        self._need: tuple[int, int] | None = None
        self._in_version = False
        self._seen_piece = False
        self._pieces = self._elements = 0
        self.last: tuple[int, str] | None = after  # (version, state hash) of the last complete version

    def receive_data(self, data: bytes | memoryview) -> None:
        self._buf += data

    def next_event(self):
        if self._need is None:
            if len(self._buf) < PREFIX_BYTES:
                return NEED_DATA
            self._need = frame_prefix(bytes(self._buf[:PREFIX_BYTES]))
        n, crc = self._need
        if len(self._buf) < PREFIX_BYTES + n:
            return NEED_DATA
        body = bytes(self._buf[PREFIX_BYTES:PREFIX_BYTES + n])
        del self._buf[:PREFIX_BYTES + n]
        self._need = None
        return self.check(decode_frame(body, crc))

    def check(self, ev: Event) -> Event:
        """`ev` if it may come next (for frames that arrive already split), else CorruptData or BaseMismatch."""
        if isinstance(ev, VersionHeader):
            if self._in_version:
                raise _bad("order", "an end before the next header", "a header")
            if self.last is not None and (ev.base_version != self.last[0]
                                          or (self.last[1] is not None and ev.base_hash != self.last[1])):
                raise BaseMismatch(f"change stream: expected a version after {self.last[0]} ({self.last[1][:23]}…), "
                                   f"found one after {ev.base_version} ({str(ev.base_hash)[:23]}…)")
            self._in_version, self._seen_piece, self._pieces, self._elements = True, False, 0, 0
            self._target = (ev.target_version, ev.target_hash)
        elif not self._in_version:
            raise _bad("order", "a header first", type(ev).__name__)
        elif isinstance(ev, Structure):
            if self._seen_piece:
                raise _bad("order", "structure before the pieces", "structure after a piece")
        elif isinstance(ev, Piece):
            self._seen_piece = True
            self._pieces += 1
            self._elements += len(ev.bits)
        else:
            if (ev.pieces, ev.elements) != (self._pieces, self._elements):
                raise _bad("end", f"{self._pieces} pieces and {self._elements} elements",
                           (ev.pieces, ev.elements))
            self._in_version = False
            self.last = self._target
        return ev

    @property
    def between_versions(self) -> bool:
        return not self._in_version and not self._buf


def iter_events(data: bytes, after: tuple[int, str] | None = None) -> list[Event]:
    """Every event of a complete stream in `data`; CorruptData if it ends inside a frame or a version."""
    s = ChangeStream(after)
    s.receive_data(data)
    out = []
    while (ev := s.next_event()) is not NEED_DATA:
        out.append(ev)
    if not s.between_versions:
        raise _bad("stream end", "the end of a version", f"{len(s._buf)} bytes of a frame or a version cut short")
    return out


# ------------------------------------------------------------------ applying


class ChangeApplier:
    """Writes events into `tensors` (name → contiguous tensor, any device) in place.

    Tensors a version allocates whole keep their memory when dtype and shape
    are unchanged; otherwise a new one is made on `device` (default: the
    device of the first tensor held when the applier is made, else CPU).
    `last` is the header of the last version completed."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device | str | None = None):
        self.tensors = tensors
        # Read now, not at each allocation: a version that removes every tensor before it
        # allocates others leaves the dict empty for a moment, and an engine's new tensors
        # would land in host memory.
        self.device = device if device is not None or not tensors else next(iter(tensors.values())).device
        self.last: VersionHeader | None = None
        self._header: VersionHeader | None = None
        self._declared: set[str] = set()

    def _device(self):
        if self.device is not None:
            return self.device
        return next(iter(self.tensors.values())).device if self.tensors else torch.device("cpu")

    def feed(self, ev: Event) -> None:
        if isinstance(ev, VersionHeader):
            self._header, self._declared = ev, set()
        elif isinstance(ev, Structure):
            for name in ev.removed:
                if self.tensors.pop(name, None) is None:
                    raise BaseMismatch(f"tensor {name!r}: the version removes it, the tensors have none")
            for spec in ev.full:
                self._declared.add(spec.name)
                t = self.tensors.get(spec.name)
                dt = info_named(spec.dtype).torch_dtype
                if t is None or t.dtype != dt or tuple(t.shape) != spec.shape:
                    self.tensors[spec.name] = torch.empty(spec.shape, dtype=dt, device=self._device())
        elif isinstance(ev, Piece):
            write_piece(self.tensors, ev)
        else:
            if self._header is not None and self._header.keyframe:
                for name in [n for n in self.tensors if n not in self._declared]:
                    del self.tensors[name]
            self.last, self._header = self._header, None


_SIGNED_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIGNED_NP = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def write_piece(tensors: dict[str, torch.Tensor], p: Piece) -> None:
    """One piece's bits into its tensor with one index operation (a copy for a range)."""
    t = tensors.get(p.name)
    info = info_named(p.dtype)
    if t is None or info_of(t.dtype) is not info or tuple(t.shape) != p.shape:
        found = "none" if t is None else f"{info_of(t.dtype).name}{list(t.shape)}"
        raise BaseMismatch(f"tensor {p.name!r}: the changes expect {p.dtype}{list(p.shape)}, the tensors have {found}")
    if not t.is_contiguous():
        raise UsageError(f"tensor {p.name!r}: expected a contiguous tensor to write changes into, found strides {t.stride()}")
    # Written through the signed integer view of the width: torch has no index_copy_ for
    # uint16/32/64 (nor for most ops on them), and bits are bits.
    flat = t.view(_SIGNED_TORCH[info.width]).view(-1)
    with warnings.catch_warnings():
        # The frame's bytes are read-only; torch only reads them (copied to the device).
        warnings.simplefilter("ignore", UserWarning)
        bits = torch.from_numpy(p.bits.view(_SIGNED_NP[info.width])).to(flat.device, non_blocking=True)
        if p.positions is None:
            flat[p.start:p.start + len(bits)].copy_(bits)
        else:
            # index_copy_ wants int64 indices: widened on the device, after the (narrower) transfer.
            idx = torch.from_numpy(p.positions).to(flat.device, non_blocking=True).to(torch.int64)
            flat.index_copy_(0, idx, bits)


def apply_changes(tensors: dict[str, torch.Tensor], changes: Iterable[Event] | bytes,
                  after: tuple[int, str] | None = None) -> VersionHeader | None:
    """Write `changes` (events, or a whole stream's bytes) into `tensors` in place; the
    header of the last version written. `after` (version, state hash): what `tensors`
    hold, checked against the first header."""
    if isinstance(changes, (bytes, bytearray, memoryview)):
        changes = iter_events(changes, after)
    check = ChangeStream(after).check
    a = ChangeApplier(tensors)
    for ev in changes:
        a.feed(check(ev))
    return a.last
