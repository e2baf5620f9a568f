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
import functools
import hashlib
from typing import Callable, Iterable

import msgpack
import numpy as np
import torch
import zstandard

from . import contexts, deltacode, planes
from .dtypes import DtypeInfo, checked_info, info_named, info_of, int_view
from .errors import CorruptData, UnsupportedFormat, UsageError
from .packreader import PackReader
from .statehash import is_state_hash

FORMAT = "patchswarm"
FORMAT_VERSION = 2  # 2: BLAKE3 state hashes, exponent-window classes, Rice-only codes
DIGEST_BYTES = 16
MAX_PATCH_BYTES = 1 << 40
MAX_TABLE_BYTES = 1 << 30
TABLE_ZSTD_LEVEL = 12  # 53-tensor table: 261 B in 0.08 ms; level 19 saved 12 B for 0.5 ms
MAX_SEGMENT_ELEMENTS = 1 << 30
MAX_NAME_BYTES = 4096  # a tensor or shard file name, UTF-8
MAX_DIMS = 64
MAX_DIM = (1 << 48) - 1
# The tensor table's content per compressed byte, at most. Measured at level 12:
# 33x (Llama-70B-like names), 72x (DeepSeek-V3's 47k experts), 77x (Qwen3-MoE fp8
# with scales), 194x (100k names sharing a 200-character prefix).
TABLE_MAX_RATIO = 512
# Rows per compressed byte, at most: 187k short expert names took 0.7 byte a row.
TABLE_ROWS_PER_BYTE = 16
TABLES_CACHED = 4  # tensor tables kept read (one per model a process works with, usually)
_MAX_FIELDS = 16  # entries of a container, chunk or segment map
_MAX_KEY_BYTES = 32  # field names, kinds, dtype names
_MAX_POSITION = (1 << 63) - 1  # element offsets and counts: they index int64 arrays
# A full segment decodes into one array (and a few temporaries) on one thread: the
# encoder makes them of 2 MiB (patchencode.FULL_SEGMENT_BYTES); this leaves room.
MAX_FULL_SEGMENT_BYTES = 64 << 20
CLASS_MIN_ELEMENTS = 4096  # below this a class window costs more than it saves
PARALLEL_MIN_BYTES = 1 << 19  # bytes read per thread below which another thread costs more than it saves

Progress = Callable[[int, int], None] | None
State = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
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
    # Each chunk's length where it is known without reading the chunk (a manifest's sizes, for a
    # store's chunks read from disk as they are reached): `check_structure` then reads none, and
    # an apply reads each chunk once. None: the lengths of `chunks`. Not encoded.
    chunk_sizes: list[int] | None = None

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
        """The patch in `data`; CorruptData (UnsupportedFormat for another version) if it is not one.

        Read along the container's schema (packreader.py): every length is
        checked against its limit and the bytes present before it is read, and
        the tensor table's against what its compressed bytes can hold."""
        r = PackReader(data, CorruptData, "patch container")
        fields: dict = {}
        for _ in range(r.map_len(_MAX_FIELDS, "a map of fields")):
            key = r.str(_MAX_KEY_BYTES, "a field name")
            if key in fields:
                raise r.fail("each field once", f"{key!r} again")
            read = _CONTAINER_FIELDS.get(key)
            fields[key] = read(r) if read is not None else r.skip(_MAX_FIELDS, 4, "a value")  # a field it does not know
        r.expect_end()
        _expect(fields.get("format") == FORMAT, f"patch container: expected format {FORMAT!r}", fields.get("format"))
        if fields.get("v") != FORMAT_VERSION:
            raise UnsupportedFormat(f"patch container: expected version {FORMAT_VERSION}, found {fields.get('v')!r}")
        kind = fields.get("kind")
        _expect(kind in ("patch", "keyframe"), "patch kind: expected 'patch' or 'keyframe'", kind)
        base, target = fields.get("base"), fields.get("target")
        _expect(base is None or is_state_hash(base), "base hash: expected 'blake3:' and 64 hex digits, or nil", base)
        _expect(is_state_hash(target), "target hash: expected 'blake3:' and 64 hex digits", target)
        table = fields.get("tensors")
        _expect(isinstance(table, bytes), "tensor table: expected compressed bytes", type(table).__name__)
        specs = list(_read_table(table))
        names = [s.name for s in specs]
        full, removed, chunks, layout = fields.get("full"), fields.get("removed"), fields.get("chunks"), fields.get("layout")
        for what, lst in (("full", full), ("removed", removed)):
            _expect(lst is not None, f"{what} list: expected names", lst)
        _expect(set(full) <= set(names), "full list: expected names from the tensor table", full[:5])
        _expect(chunks is not None, "chunks: expected a list of bytes", chunks)
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


def _names(r: PackReader) -> list[str]:
    return [r.str(MAX_NAME_BYTES, "a tensor name") for _ in range(r.array_len(r.end, "a list of names"))]


def _layout(r: PackReader) -> dict[str, str] | None:
    if r.nil():
        return None
    n = r.map_len(r.end, "a map name -> file or nil")
    return {r.str(MAX_NAME_BYTES, "a tensor name"): r.str(MAX_NAME_BYTES, "a file name") for _ in range(n)}


def _hash_or_nil(r: PackReader) -> str | None:
    return None if r.nil() else r.str(_MAX_KEY_BYTES * 4, "a state hash")


# The container's fields and how each is read (`from_bytes` checks what they say).
_CONTAINER_FIELDS: dict[str, Callable[[PackReader], object]] = {
    "format": lambda r: r.str(_MAX_KEY_BYTES, "a format name"),
    "v": lambda r: r.int(expected="a version"),
    "kind": lambda r: r.str(_MAX_KEY_BYTES, "a kind"),
    "base": _hash_or_nil,
    "target": _hash_or_nil,
    "tensors": lambda r: r.bin(r.end, "the compressed tensor table"),
    "full": _names,
    "removed": _names,
    "layout": _layout,
    "chunks": lambda r: [r.bin(MAX_PATCH_BYTES, "a chunk") for _ in range(r.array_len(r.end, "a list of chunks"))],
}


@functools.lru_cache(maxsize=TABLES_CACHED)
def _read_table(compressed: bytes) -> tuple[TensorSpec, ...]:
    """The tensor table's rows, checked. Its content may be at most TABLE_MAX_RATIO times
    its compressed bytes, and its rows TABLE_ROWS_PER_BYTE times (both far above what
    real tables reach), so that the rows built stay in proportion to the patch's bytes.

    Cached: the patches of one model carry the same table, and reading it costs
    ~3 us a row (0.26 s for a 72k-tensor MoE) on every version otherwise."""
    raw = planes.decompress(compressed, min(MAX_TABLE_BYTES, TABLE_MAX_RATIO * len(compressed)), "tensor table")
    r = PackReader(raw, CorruptData, "tensor table")
    n = r.array_len(TABLE_ROWS_PER_BYTE * len(compressed) + 64, "a list of [name, dtype, shape]")
    specs = []
    for _ in range(n):
        if r.array_len(3, "a row [name, dtype, shape]") != 3:
            raise r.fail("a row [name, dtype, shape]", "an array of another length")
        name = r.str(MAX_NAME_BYTES, "a tensor name")
        dtype = info_named(r.str(_MAX_KEY_BYTES, "a dtype name")).name  # the one str object per dtype
        shape = tuple(r.uints(r.array_len(MAX_DIMS, "a shape"), MAX_DIM, "a dimension"))
        specs.append(TensorSpec(name, dtype, shape))
    r.expect_end()
    names = [s.name for s in specs]
    _expect(names == sorted(set(names)), "tensor table: expected unique names in order", names[:5])
    return tuple(specs)


def _expect(ok: bool, what: str, found) -> None:
    if not ok:
        text = repr(found)
        raise CorruptData(f"{what}, found {text[:80]}")


def chunk_digest(parts: Iterable[np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(np.ascontiguousarray(p).astype(p.dtype.newbyteorder("<"), copy=False))  # no copy on little-endian
    return h.digest()[:DIGEST_BYTES]

def name_bytes(name: str) -> int:
    """The UTF-8 size of a tensor name; -1 for a string UTF-8 cannot encode (a lone surrogate)."""
    try:
        return len(name.encode())
    except UnicodeEncodeError:
        return -1


def check_shape(shape, what: str) -> None:
    """UsageError unless a patch's tensor table can carry `shape`: at most MAX_DIMS
    dimensions, each at most MAX_DIM (what `from_bytes` accepts)."""
    if len(shape) > MAX_DIMS or any(d > MAX_DIM for d in shape):
        found = list(shape) if len(shape) <= 8 else f"{len(shape)} dimensions"
        raise UsageError(f"{what}: shape: expected at most {MAX_DIMS} dimensions of at most {MAX_DIM} "
                         f"(what a patch carries), found {found}")


def check_state(state, what: str) -> None:
    if not isinstance(state, dict):
        raise UsageError(f"{what}: expected dict[str, torch.Tensor], found {type(state).__name__}")
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise UsageError(f"{what}: expected dict[str, torch.Tensor], found entry {k!r}: {type(v).__name__}")
        checked_info(v, what, k)
        # Only an empty tensor (or one of more than MAX_DIMS dimensions) can have a shape a
        # patch's tensor table refuses: the dimensions of one with data multiply to its size.
        if not v.numel() or v.dim() > MAX_DIMS:
            check_shape(v.shape, f"{what}[{k!r}]")
        # An ASCII name's UTF-8 size is its length (isascii reads a flag the string keeps).
        if k.isascii() and len(k) <= MAX_NAME_BYTES:
            continue
        size = name_bytes(k)
        if not 0 <= size <= MAX_NAME_BYTES:
            raise UsageError(f"{what}: tensor name: expected UTF-8 of at most {MAX_NAME_BYTES} bytes (what a patch "
                             f"carries), found {'a string UTF-8 cannot encode' if size < 0 else f'{size} bytes'}: "
                             f"{k[:60]!r}")


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
        v = cached[1]
        out.append(v if s == 0 and e == v.size else v[s:e])
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

    @functools.cached_property
    def size(self) -> int:
        # Cached: a segment of small tensors has thousands of pieces, and its size is
        # asked several times per decode. Pieces are renamed after parsing, never resized.
        return sum(e - s for _, s, e in self.pieces)


def parse_chunk(data: bytes) -> tuple[list[Segment], bytes, bytes]:
    """A chunk's segments (tensor indices in their pieces) and its two digests; CorruptData
    (UnsupportedFormat for a dtype it does not know) if it is not one.

    Read along the schema (packreader.py), so what a chunk costs to parse is in
    proportion to its segments' fields, never to what its bytes declare or nest."""
    r = PackReader(data, CorruptData, "chunk")
    segs = old = new = None
    for _ in range(r.map_len(_MAX_FIELDS, "a map with segments")):
        key = r.str(_MAX_KEY_BYTES, "a field name")
        if key == "s" and segs is None:
            segs = [_segment(r) for _ in range(r.array_len(r.end, "a list of segments"))]
        elif key == "o" and old is None:
            old = r.bin(DIGEST_BYTES, "a digest")
        elif key == "n" and new is None:
            new = r.bin(DIGEST_BYTES, "a digest")
        else:
            r.skip(_MAX_FIELDS, 4, f"the value of {key!r} (once)")
    r.expect_end()
    _expect(segs is not None, "chunk: expected a map with segments", None)
    _expect(isinstance(old, bytes) and isinstance(new, bytes) and len(old) == len(new) == DIGEST_BYTES,
            f"chunk digests: expected two {DIGEST_BYTES}-byte values", (old, new))
    return segs, old, new


def _pieces(r: PackReader) -> list[tuple[int, int, int]]:
    return r.uint_tuples(r.array_len(r.end, "segment pieces"), 3, _MAX_POSITION, "a piece [tensor index, start, end]")


def _class_rows(r: PackReader) -> list[list]:
    rows = []
    for _ in range(r.array_len(contexts.MAX_CLASSES, "a class table")):
        n = r.array_len(deltacode.ROW_FIELDS, "a class row")
        if n == deltacode.ROW_FIELDS:
            row = r.uints(n - 1, _MAX_POSITION, "a class row field")
            row.append(r.bin(deltacode.SYMBOLS, "a symbol table"))
        elif n == 1:
            row = r.uints(1, _MAX_POSITION, "a class row field")
        else:
            raise r.fail(f"a class row of 1 or {deltacode.ROW_FIELDS} fields", f"{n}")
        rows.append(row)
    return rows


def _byte_planes(r: PackReader) -> list[list]:
    out = []
    for _ in range(r.array_len(8, "byte planes")):
        if r.array_len(2, "a plane [mode, bytes]") != 2:
            raise r.fail("a plane [mode, bytes]", "an array of another length")
        out.append([r.uint(255, "a plane mode"), r.bin(r.end, "plane bytes")])
    return out


def _segment(r: PackReader) -> Segment:
    f: dict = {}
    for _ in range(r.map_len(_MAX_FIELDS, "a segment")):
        key = r.str(_MAX_KEY_BYTES, "a segment field")
        if key in f:
            raise r.fail("each segment field once", f"{key!r} again")
        if key == "k":
            f[key] = r.str(_MAX_KEY_BYTES, "a segment kind")
        elif key == "dt":
            f[key] = info_named(r.str(_MAX_KEY_BYTES, "a dtype name"))
        elif key == "p":
            f[key] = _pieces(r)
        elif key == "w":
            f[key] = r.uints(r.array_len(2, "a class window [lo, C]"), _MAX_POSITION, "a class window value")
        elif key == "c":
            f[key] = _class_rows(r)
        elif key == "s":
            f[key] = [r.bin(r.end, "a stream") for _ in range(r.array_len(8, "segment streams"))]
        elif key == "pl":
            f[key] = _byte_planes(r)
        else:
            f[key] = r.skip(_MAX_FIELDS, 4, "a segment field's value")
    kind, info, pieces = f.get("k"), f.get("dt"), f.get("p")
    _expect(kind in ("d", "f"), "segment: expected kind 'd' or 'f'", kind)
    _expect(info is not None, "segment: expected a dtype name", None)
    _expect(bool(pieces) and all(p[1] < p[2] for p in pieces),
            "segment pieces: expected [[tensor index, start, end], ...] with start < end", pieces[:4] if pieces else pieces)
    # Ascending and disjoint: a segment's size is then at most the elements of the
    # tensors it names (the decoder allocates in proportion to it).
    _expect(all((p[0], p[2]) <= (q[0], q[1]) for p, q in zip(pieces, pieces[1:])),
            "segment pieces: expected ascending, disjoint ranges", pieces[:4])
    if kind == "f":
        _expect("pl" in f, "full segment: expected byte planes", None)
        seg = Segment("f", info, pieces, planes=f["pl"])
        _expect(seg.size * info.width <= MAX_FULL_SEGMENT_BYTES,
                f"full segment: expected at most {MAX_FULL_SEGMENT_BYTES} bytes of elements", seg.size * info.width)
        return seg
    window = f.get("w")
    _expect(window is not None and len(window) == 2 and window[1] in contexts.CLASS_CHOICES
            and (window[1] == 1 or contexts.has_classes(info)),
            f"segment class window: expected [lo, C] with C in {contexts.CLASS_CHOICES}", window)
    _expect("s" in f and len(f["s"]) == deltacode.STREAMS, f"segment streams: expected {deltacode.STREAMS} byte strings", None)
    seg = Segment("d", info, pieces, tuple(window), deltacode.check_rows(f.get("c"), window[1]), f["s"])
    _expect(seg.size <= MAX_SEGMENT_ELEMENTS, f"segment: expected at most {MAX_SEGMENT_ELEMENTS} elements", seg.size)
    return seg
