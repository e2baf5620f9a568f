"""The patch container (format version 2): what a patch file and its chunks hold.

Owns the bytes of a patch and nothing that computes one: `Patch` (the table
of target tensors, the full and removed lists, the chunks; `to_bytes` and
`from_bytes`), `TensorSpec`, a chunk's segments (`parse_chunk`) and its
digests (`chunk_digest`), and the helpers both sides use to read a state's
bit patterns. patchencode.py makes patches, patchdecode.py applies them;
protocol/patch.py is the public face of all three.

Layout: a patch is a table of target tensors plus chunks. A chunk holds whole
segments; a segment covers contiguous element ranges ("pieces") of one dtype:
one range of a large tensor, or several small tensors back to back. Segments
never overlap, so chunks decode and apply in any order. A chunk's digests
cover the old and new bit patterns of its changed elements in segment order,
inside a segment in the order the codes list them (by class, ascending
position inside a class). A delta segment carries its class window, class
table and streams (deltacode.py), a full segment its byte planes (planes.py).
Pure: no files, no sockets, no clocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Iterable

import msgpack
import numpy as np
import torch
import zstandard

from . import contexts, deltacode
from .dtypes import DtypeInfo, info_named, info_of, int_view
from .errors import CorruptData, UnsupportedFormat, UsageError
from .statehash import is_state_hash

FORMAT = "patchswarm"
FORMAT_VERSION = 2  # 2: BLAKE3 state hashes, exponent-window classes, Rice-only codes
DIGEST_BYTES = 16
MAX_PATCH_BYTES = 1 << 40
MAX_TABLE_BYTES = 1 << 30
TABLE_ZSTD_LEVEL = 12  # 53-tensor table: 261 B in 0.08 ms; level 19 saved 12 B for 0.5 ms
MAX_SEGMENT_ELEMENTS = 1 << 30
CLASS_MIN_ELEMENTS = 4096  # below this a class window costs more than it saves
PARALLEL_MIN_BYTES = 1 << 19  # bytes read per thread below which another thread costs more than it saves

Progress = Callable[[int, int], None] | None
State = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        return cls(name, info_of(t.dtype).name, tuple(t.shape))


@dataclasses.dataclass
class Patch:
    kind: str  # "patch" or "keyframe"
    base_hash: str | None
    target_hash: str
    tensors: list[TensorSpec]
    full: list[str]
    removed: list[str]
    chunks: list[bytes]
    layout: dict[str, str] | None = None

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "format": FORMAT,
                "v": FORMAT_VERSION,
                "kind": self.kind,
                "base": self.base_hash,
                "target": self.target_hash,
                # Names share long prefixes ("blocks.17.attn..."): compressed,
                # the table costs a quarter of its plain size.
                "tensors": zstandard.ZstdCompressor(level=TABLE_ZSTD_LEVEL).compress(
                    msgpack.packb([[t.name, t.dtype, list(t.shape)] for t in self.tensors], use_bin_type=True)),
                "full": self.full,
                "removed": self.removed,
                "layout": self.layout,
                "chunks": self.chunks,
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> "Patch":
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_PATCH_BYTES)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise CorruptData(f"patch container: expected msgpack, found undecodable bytes ({type(e).__name__}: {e})") from None
        _expect(isinstance(obj, dict), "patch container: expected a map", obj)
        _expect(obj.get("format") == FORMAT, f"patch container: expected format {FORMAT!r}", obj.get("format"))
        if obj.get("v") != FORMAT_VERSION:
            raise UnsupportedFormat(f"patch container: expected version {FORMAT_VERSION}, found {obj.get('v')!r}")
        kind = obj.get("kind")
        _expect(kind in ("patch", "keyframe"), "patch kind: expected 'patch' or 'keyframe'", kind)
        base, target = obj.get("base"), obj.get("target")
        _expect(base is None or is_state_hash(base), "base hash: expected 'blake3:' and 64 hex digits, or nil", base)
        _expect(is_state_hash(target), "target hash: expected 'blake3:' and 64 hex digits", target)
        tensors = obj.get("tensors")
        _expect(isinstance(tensors, bytes), "tensor table: expected compressed bytes", type(tensors).__name__)
        try:
            tensors = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(tensors, max_output_size=MAX_TABLE_BYTES), raw=False)
        except Exception as e:
            raise CorruptData(f"tensor table: expected zstd-compressed msgpack, found undecodable bytes ({type(e).__name__})") from None
        _expect(isinstance(tensors, list), "tensor table: expected a list", type(tensors).__name__)
        specs = []
        for row in tensors:
            _expect(
                isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[2], list)
                and all(isinstance(s, int) and 0 <= s < 1 << 48 for s in row[2]),
                "tensor table row: expected [name, dtype, shape]", row,
            )
            info_named(row[1])
            specs.append(TensorSpec(row[0], row[1], tuple(row[2])))
        names = [s.name for s in specs]
        _expect(names == sorted(set(names)), "tensor table: expected unique names in order", names[:5])
        full, removed, chunks, layout = obj.get("full"), obj.get("removed"), obj.get("chunks"), obj.get("layout")
        for what, lst in (("full", full), ("removed", removed)):
            _expect(isinstance(lst, list) and all(isinstance(x, str) for x in lst), f"{what} list: expected names", lst)
        _expect(set(full) <= set(names), "full list: expected names from the tensor table", full)
        _expect(isinstance(chunks, list) and all(isinstance(c, bytes) for c in chunks), "chunks: expected a list of bytes", type(chunks).__name__)
        _expect(
            layout is None or (isinstance(layout, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in layout.items())),
            "layout: expected a map name -> file or nil", type(layout).__name__,
        )
        return cls(kind, base, target, specs, full, removed, chunks, layout)

    def stats(self) -> dict:
        s = {"kind": self.kind, "tensors": len(self.tensors), "params": sum(t.numel for t in self.tensors),
             "changed": 0, "position_bytes": 0, "value_bytes": 0, "full_bytes": 0, "chunks": len(self.chunks),
             "chunk_bytes": sum(len(c) for c in self.chunks)}
        for chunk in self.chunks:
            for seg in parse_chunk(chunk)[0]:
                if seg.kind == "f":
                    s["full_bytes"] += sum(len(p[1]) for p in seg.planes)
                    continue
                s["changed"] += sum(row[0] for row in seg.rows)
                s["position_bytes"] += len(seg.streams[0]) + len(seg.streams[1])
                s["value_bytes"] += sum(len(x) for x in seg.streams[2:]) + sum(len(row[-1]) for row in seg.rows if row[0])
        full = set(self.full)
        s["changed"] += sum(t.numel for t in self.tensors if t.name in full)
        return s


def _expect(ok: bool, what: str, found) -> None:
    if not ok:
        text = repr(found)
        raise CorruptData(f"{what}, found {text[:80]}")


def chunk_digest(parts: Iterable[np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(np.ascontiguousarray(p).astype(p.dtype.newbyteorder("<"), copy=False))  # no copy on little-endian
    return h.digest()[:DIGEST_BYTES]

def check_state(state, what: str) -> None:
    if not isinstance(state, dict):
        raise UsageError(f"{what}: expected dict[str, torch.Tensor], found {type(state).__name__}")
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise UsageError(f"{what}: expected dict[str, torch.Tensor], found entry {k!r}: {type(v).__name__}")
        if v.device.type != "cpu":
            raise UsageError(f"{what}[{k!r}]: expected a CPU tensor, found device {v.device}")
        info_of(v.dtype)


def _flat_bits(t: torch.Tensor) -> np.ndarray:
    return int_view(t if t.is_contiguous() else t.contiguous())


def piece_bits(state: State, pieces, views: dict | None = None) -> list[np.ndarray]:
    """Flat int views of each piece; `views` (name -> (tensor, view)) caches them."""
    out = []
    for name, s, e in pieces:
        t = state[name]
        cached = views.get(name) if views is not None else None
        if cached is None or cached[0] is not t:
            cached = (t, _flat_bits(t))
            if views is not None:
                views[name] = cached
        out.append(cached[1][s:e])
    return out


@dataclasses.dataclass
class Segment:
    kind: str
    info: DtypeInfo
    pieces: list[tuple[str, int, int]]
    window: tuple[int, int] = (0, 1)
    rows: list = dataclasses.field(default_factory=list)
    streams: list = dataclasses.field(default_factory=list)
    planes: list = dataclasses.field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(e - s for _, s, e in self.pieces)


def parse_chunk(data: bytes) -> tuple[list[Segment], bytes, bytes]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise CorruptData(f"chunk: expected msgpack, found undecodable bytes ({type(e).__name__})") from None
    _expect(isinstance(obj, dict) and isinstance(obj.get("s"), list), "chunk: expected a map with segments", type(obj).__name__)
    old, new = obj.get("o"), obj.get("n")
    _expect(isinstance(old, bytes) and isinstance(new, bytes) and len(old) == len(new) == DIGEST_BYTES,
            f"chunk digests: expected two {DIGEST_BYTES}-byte values", (old, new))
    segs = []
    for s in obj["s"]:
        _expect(isinstance(s, dict) and s.get("k") in ("d", "f"), "segment: expected kind 'd' or 'f'", s if not isinstance(s, dict) else s.get("k"))
        info = info_named(s.get("dt"))
        pieces = s.get("p")
        _expect(
            isinstance(pieces, list) and pieces and all(
                isinstance(p, list) and len(p) == 3 and isinstance(p[0], int) and isinstance(p[1], int)
                and isinstance(p[2], int) and 0 <= p[1] < p[2] for p in pieces),
            "segment pieces: expected [[tensor index, start, end], ...] with start < end", pieces,
        )
        pieces = [tuple(p) for p in pieces]
        if s["k"] == "f":
            segs.append(Segment("f", info, pieces, planes=s.get("pl")))
            continue
        window = s.get("w")
        _expect(isinstance(window, list) and len(window) == 2 and all(isinstance(x, int) for x in window)
                and window[1] in contexts.CLASS_CHOICES and (window[1] == 1 or contexts.has_classes(info)),
                f"segment class window: expected [lo, C] with C in {contexts.CLASS_CHOICES}", window)
        seg = Segment("d", info, pieces, tuple(window), deltacode.check_rows(s.get("c"), window[1]), s.get("s"))
        _expect(seg.size <= MAX_SEGMENT_ELEMENTS, f"segment: expected at most {MAX_SEGMENT_ELEMENTS} elements", seg.size)
        segs.append(seg)
    return segs, old, new

