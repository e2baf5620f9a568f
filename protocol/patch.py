"""Lossless patches between served states: diff, the container, and apply.

Owns the patch format (version 2) and its two operations:

- `diff(base, target) -> Patch`: compares bit patterns (never float values).
  A changed element's position is coded as its rank inside a context class
  of the base (its exponent, contexts.py) and its value as the delta of
  order-preserving integers (dtypes.py), both with the vectorized codes of
  deltacode.py. Tensors that are new, or whose dtype or shape changed, are
  carried in full (planes.py); removed tensors are listed.
- `apply(state, patch)`: in place, a batch of chunks at a time. Every chunk is
  decoded and checked against the digest of the values it overwrites before
  it is written; after the writes the full state hash must equal the patch's
  target hash, otherwise every write is undone (from each chunk's undo
  record: the old bits of the ranges it wrote, or positions and old bits).
  A wrong base, a second apply, a truncated or corrupted patch raise and
  leave the state as it was (with `undo=False`, only when found before the
  first write: for callers that keep the base elsewhere).

Layout: a patch is a table of target tensors plus chunks. A chunk holds whole
segments; a segment covers contiguous element ranges ("pieces") of one dtype:
one range of a large tensor, or several small tensors back to back. Segments
never overlap, so chunks decode and apply in any order. A chunk's digests
cover the old and new bit patterns of its changed elements in segment order,
inside a segment in the order the codes list them (by class, ascending
position inside a class). Segments are encoded and decoded as independent
tasks on every core (parallel.py); errors still surface in chunk order.
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

from . import contexts, deltacode, parallel, planes, statehash
from .dtypes import DtypeInfo, info_named, info_of, int_view, ordered_bits, ordered_range, to_ordered
from .errors import (AlreadyApplied, BaseMismatch, CorruptData, PatchswarmError, StateHashMismatch, UnsupportedFormat,
                     UsageError)
from .statehash import is_state_hash, state_hash

FORMAT = "patchswarm"
FORMAT_VERSION = 2  # 2: BLAKE3 state hashes, exponent-window classes, Rice-only codes
DELTA_SEGMENT_ELEMENTS = 1 << 22
FULL_SEGMENT_BYTES = 2 << 20
CHUNK_BYTES = 2 << 20
DIGEST_BYTES = 16
MAX_PATCH_BYTES = 1 << 40
MAX_TABLE_BYTES = 1 << 30
TABLE_ZSTD_LEVEL = 12  # 53-tensor table: 261 B in 0.08 ms; level 19 saved 12 B for 0.5 ms
MAX_SEGMENT_ELEMENTS = 1 << 30
# A segment holds at most this many changes: a dense step's 1 M-element segment
# decoded into ~30 MB of transients, and a segment is what one decode thread holds
# at once (apply's peak: 119 -> 18 MB on the WAN payload). Sparse segments are far
# below it, so their size (and the per-segment headers) is unchanged.
SEGMENT_CHANGES = 1 << 18
CLASS_MIN_ELEMENTS = 4096  # below this a class window costs more than it saves
APPLY_BATCH_BYTES = 1 << 18  # at least this much patch per apply batch (and a segment per decode thread)
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
            for seg in _parse_chunk(chunk)[0]:
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


def _digest(parts: Iterable[np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(np.ascontiguousarray(p).astype(p.dtype.newbyteorder("<"), copy=False))  # no copy on little-endian
    return h.digest()[:DIGEST_BYTES]


# ---------------------------------------------------------------- encoding


def _check_state(state, what: str) -> None:
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


def _plan_segments(state: State, names: list[str], max_elements: int) -> list[list[tuple[str, int, int]]]:
    """Pieces grouped into segments: same dtype, at most max_elements each."""
    segments, cur, cur_n, cur_dt = [], [], 0, None
    for name in names:
        t = state[name]
        n = t.numel()
        if n == 0:
            continue
        if cur and (t.dtype != cur_dt or cur_n + n > max_elements):
            segments.append(cur)
            cur, cur_n = [], 0
        cur_dt = t.dtype
        for start in range(0, n, max_elements):
            end = min(n, start + max_elements)
            if cur and cur_n + (end - start) > max_elements:
                segments.append(cur)
                cur, cur_n = [], 0
            cur.append((name, start, end))
            cur_n += end - start
    if cur:
        segments.append(cur)
    return segments


def _piece_bits(state: State, pieces, views: dict | None = None) -> list[np.ndarray]:
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


def _gather(state: State, pieces) -> np.ndarray:
    arrays = _piece_bits(state, pieces)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _changed(bs: list[np.ndarray], ts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ascending segment positions where base and target pieces differ, the base's bits there, the target's)."""
    kernel = contexts.KERNEL
    dtype = bs[0].dtype
    width = dtype.itemsize
    if kernel is None or width not in (1, 2, 4):
        return _changed_numpy(bs, ts)
    size = sum(b.size for b in bs)
    found, start, cap = [], 0, max(1 << 12, size // 32)  # room for 3 %; a denser patch takes a second call
    while True:
        pos, old, new = np.empty(cap, np.int64), np.empty(cap, dtype), np.empty(cap, dtype)
        n, start = kernel.changes(bs, ts, width, start, pos, old.view(np.uint8), new.view(np.uint8))
        found.append((pos[:n], old[:n], new[:n]))
        if start >= size:
            break
        cap = size - start
    if len(found) == 1:
        return found[0]
    return tuple(np.concatenate(parts) for parts in zip(*found))  # type: ignore[return-value]


def _changed_numpy(bs: list[np.ndarray], ts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    size = sum(b.size for b in bs)
    with contexts.POOL.scratch(size) as differs:
        idx = _changes(bs, ts, differs.view(bool))
    return idx, contexts.gather_sorted(bs, idx), contexts.gather_sorted(ts, idx)


def _changes(bs: list[np.ndarray], ts: list[np.ndarray], differs: np.ndarray) -> np.ndarray:
    """Ascending segment positions where base and target pieces differ (`differs`: bool scratch)."""
    off = 0
    for b, t in zip(bs, ts):
        np.not_equal(b, t, out=differs[off : off + b.size])
        off += b.size
    mask = differs[:off]
    # Changes are sparse: find the 8-byte words with a change (a flatnonzero
    # over N/8 words), then the changed bytes inside those words only.
    whole = off - off % 8
    words = mask[:whole].view(np.uint64)
    with contexts.POOL.scratch(words.size) as hit:
        at = np.flatnonzero(np.not_equal(words, 0, out=hit.view(bool)))
    inside = np.flatnonzero(np.take(words, at).view(bool))
    found = (np.take(at, inside >> 3) << 3) | (inside & 7)
    if whole < off:
        found = np.concatenate([found, whole + np.flatnonzero(mask[whole:])])
    return found


def _encode_delta(base: State, target: State, pieces, index: dict[str, int]) -> list[tuple[dict, list, list]]:
    """The segments of one planned segment's changes: itself, none when nothing
    changed, or consecutive parts of at most SEGMENT_CHANGES changes each."""
    bs, ts = _piece_bits(base, pieces), _piece_bits(target, pieces)
    idx, old, new = _changed(bs, ts)
    if not idx.size:
        return []
    if idx.size <= SEGMENT_CHANGES:
        return [_encode_changes(base, pieces, index, bs, idx, old, new)]
    # Each part starts at its first change: its changes are a run of these, shifted.
    starts = idx[::SEGMENT_CHANGES].tolist()
    out = []
    for k, part in enumerate(_split_pieces(pieces, starts[1:])):
        at = slice(k * SEGMENT_CHANGES, (k + 1) * SEGMENT_CHANGES)
        first = starts[k] if k else 0
        out.append(_encode_changes(base, part, index, _piece_bits(base, part), idx[at] - first, old[at], new[at]))
    return out


def _split_pieces(pieces, cuts: list[int]) -> list[list[tuple[str, int, int]]]:
    """`pieces` cut at ascending positions of their concatenation (none at 0 or the end)."""
    bounds = [0, *cuts, sum(e - s for _, s, e in pieces)]
    parts, offset, at = [[] for _ in cuts + [0]], 0, 0
    for name, s, e in pieces:
        lo, hi = offset, offset + e - s
        while at < len(parts) and bounds[at] < hi:
            a, b = max(lo, bounds[at]), min(hi, bounds[at + 1])
            if b > a:
                parts[at].append((name, s + a - lo, s + b - lo))
            if bounds[at + 1] > hi:
                break
            at += 1
        offset = hi
    return parts


def _encode_changes(base: State, pieces, index: dict[str, int], bs: list[np.ndarray], idx: np.ndarray,
                    old: np.ndarray, new: np.ndarray) -> tuple[dict, list, list]:
    info = info_of(base[pieces[0][0]].dtype)
    size = sum(b.size for b in bs)
    d = to_ordered(new, info) - to_ordered(old, info)
    lo, classes = 0, 1
    if contexts.has_classes(info) and size >= CLASS_MIN_ELEMENTS:
        changed_keys = contexts.keys_of(old, info)
        stride = max(1, size // contexts.SAMPLE_TARGET)
        lo, classes = contexts.choose_window(contexts.sample_keys(bs, info, stride), size, changed_keys)
    if classes == 1:
        ranks, sizes, deltas = [idx], [size], [d]
        olds, news = [old], [new]
    else:
        cls = contexts.class_of_keys(changed_keys, lo, classes)
        order = np.argsort(cls.astype(np.int8), kind="stable")  # by class, ascending inside; 8-bit keys: a radix sort
        counts = np.bincount(cls, minlength=classes).tolist()
        in_class, sizes = contexts.rank_positions(bs, info, lo, classes, idx, cls)
        bounds = np.cumsum([0] + counts).tolist()
        ranks_all = in_class[order]
        ranks = [ranks_all[bounds[c] : bounds[c + 1]] for c in range(classes)]
        sizes = [sizes[c] if counts[c] else 0 for c in range(classes)]
        d = d[order]
        deltas = [d[bounds[c] : bounds[c + 1]] for c in range(classes)]
        olds, news = [old[order]], [new[order]]
    rows, streams = deltacode.encode(ranks, sizes, deltas)
    seg = {"k": "d", "dt": info.name, "p": [[index[n], a, b] for n, a, b in pieces], "w": [lo, classes], "c": rows, "s": streams}
    return seg, olds, news


def _encode_full(target: State, pieces, index: dict[str, int]) -> tuple[dict, list[np.ndarray]]:
    info = info_of(target[pieces[0][0]].dtype)
    bits = _gather(target, pieces)
    return {"k": "f", "dt": info.name, "p": [[index[n], a, b] for n, a, b in pieces], "pl": planes.encode(bits, info)}, [bits]


def _pack_chunks(encoded: list[tuple[dict, list, list]], chunk_bytes: int) -> list[bytes]:
    chunks, cur, cur_size = [], [], 0

    def flush():
        segs = [e[0] for e in cur]
        old = _digest(a for e in cur for a in e[1])
        new = _digest(a for e in cur for a in e[2])
        chunks.append(msgpack.packb({"s": segs, "o": old, "n": new}, use_bin_type=True))

    for item in encoded:
        size = len(msgpack.packb(item[0], use_bin_type=True))
        if cur and cur_size + size > chunk_bytes:
            flush()
            cur, cur_size = [], 0
        cur.append(item)
        cur_size += size
    if cur:
        flush()
    return chunks


def diff(base: State, target: State, layout: dict[str, str] | None = None, progress: Progress = None,
         chunk_bytes: int = CHUNK_BYTES, base_hash: str | None = None, target_hash: str | None = None,
         segment_elements: int = DELTA_SEGMENT_ELEMENTS) -> Patch:
    """The patch that turns `base` into `target`, bit for bit.

    `base_hash`/`target_hash` may be passed when the caller already knows them
    (the origin does), to skip hashing the state again.
    """
    _check_state(base, "base")
    _check_state(target, "target")
    unhashed = [s for s, h in ((base, base_hash), (target, target_hash)) if h is None]
    names = sorted(target)
    full = [n for n in names if n not in base or base[n].dtype != target[n].dtype or base[n].shape != target[n].shape]
    # Segments and state-hash blocks are independent tasks, run on every core together.
    encoding = _encode_tasks(base, target, names, full, segment_elements)
    hashing, finish_hashes = statehash.hash_tasks(unhashed)
    tasks = encoding + hashing
    work = statehash.hash_bytes(unhashed) + 2 * sum(target[n].numel() * target[n].element_size() for n in names)
    threads = parallel.threads_for(len(tasks), work, PARALLEL_MIN_BYTES)
    results = parallel.run_all(tasks, threads, on_done=(lambda n: progress(n, len(tasks))) if progress else None)
    chunks = _pack_chunks([seg for r in results[: len(encoding)] for seg in r], chunk_bytes)
    hashes = iter(finish_hashes(results[len(encoding) :]))
    return Patch(
        kind="patch",
        base_hash=base_hash or next(hashes),
        target_hash=target_hash or next(hashes),
        tensors=[TensorSpec.of(n, target[n]) for n in names],
        full=full,
        removed=sorted(set(base) - set(target)),
        chunks=chunks,
        layout=layout,
    )


def _encode_tasks(base: State, target: State, names: list[str], full: list[str], segment_elements: int) -> list[Callable]:
    """One task per planned segment, each returning a list of (segment, old values, new values)."""
    full_set = set(full)
    index = {n: i for i, n in enumerate(names)}
    delta_names = [n for n in names if n not in full_set]
    tasks: list[Callable] = [functools.partial(_encode_delta, base, target, pieces, index)
                             for pieces in _plan_segments(target, delta_names, segment_elements)]
    for pieces in _plan_segments_bytes(target, full):
        tasks.append(functools.partial(_encode_full_task, target, pieces, index))
    return tasks


def _encode_full_task(target: State, pieces, index: dict[str, int]) -> list[tuple[dict, list, list[np.ndarray]]]:
    seg, news = _encode_full(target, pieces, index)
    return [(seg, [], news)]


def _plan_segments_bytes(state: State, names: list[str]):
    out = []
    for dt in sorted({state[n].dtype for n in names}, key=str):
        group = [n for n in names if state[n].dtype == dt]
        out += _plan_segments(state, group, max(1, FULL_SEGMENT_BYTES // info_of(dt).width))
    return out


def keyframe(state: State, layout: dict[str, str] | None = None, progress: Progress = None,
             chunk_bytes: int = CHUNK_BYTES, state_hash_hex: str | None = None) -> Patch:
    """A full snapshot of `state` as a patch from nothing."""
    _check_state(state, "state")
    names = sorted(state)
    segs = _plan_segments_bytes(state, names)
    encoded = []
    index = {n: i for i, n in enumerate(names)}
    for i, pieces in enumerate(segs):
        seg, news = _encode_full(state, pieces, index)
        encoded.append((seg, [], news))
        if progress:
            progress(i + 1, len(segs))
    return Patch(
        kind="keyframe", base_hash=None, target_hash=state_hash_hex or state_hash(state),
        tensors=[TensorSpec.of(n, state[n]) for n in names], full=names, removed=[],
        chunks=_pack_chunks(encoded, chunk_bytes), layout=layout,
    )


# ---------------------------------------------------------------- decoding


@dataclasses.dataclass
class _Segment:
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


def _parse_chunk(data: bytes) -> tuple[list[_Segment], bytes, bytes]:
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
            segs.append(_Segment("f", info, pieces, planes=s.get("pl")))
            continue
        window = s.get("w")
        _expect(isinstance(window, list) and len(window) == 2 and all(isinstance(x, int) for x in window)
                and window[1] in contexts.CLASS_CHOICES and (window[1] == 1 or contexts.has_classes(info)),
                f"segment class window: expected [lo, C] with C in {contexts.CLASS_CHOICES}", window)
        seg = _Segment("d", info, pieces, tuple(window), deltacode.check_rows(s.get("c"), window[1]), s.get("s"))
        _expect(seg.size <= MAX_SEGMENT_ELEMENTS, f"segment: expected at most {MAX_SEGMENT_ELEMENTS} elements", seg.size)
        segs.append(seg)
    return segs, old, new


@dataclasses.dataclass
class DecodedChunk:
    """What one chunk writes: per piece, flat positions, old and new bit patterns."""

    writes: list[tuple[str, np.ndarray | slice, np.ndarray | None, np.ndarray]]
    # name -> (tensor, its int view) as seen at decode time, to skip re-viewing
    views: dict[str, tuple[torch.Tensor, np.ndarray]] = dataclasses.field(default_factory=dict, repr=False)

    def _view(self, state: State, name: str) -> np.ndarray:
        t = state[name]
        cached = self.views.get(name)
        return cached[1] if cached is not None and cached[0] is t else int_view(t)

    def write(self, state: State) -> None:
        for name, pos, _old, new in self.writes:
            self._view(state, name)[pos] = new

    def undo_record(self, state: State) -> "DecodedChunk":
        """What `undo` needs once this chunk is written; call it before `write`.

        Per delta piece the cheaper of: the old bits of the whole range its
        writes span (a dense piece), or its positions (int32 where they fit)
        and old bits. Full pieces keep nothing (`restore` puts the old tensor
        back); new bits are let go."""
        kept = []
        for name, pos, old, _new in self.writes:
            if old is None or not len(old):
                continue
            lo, hi = int(pos[0]), int(pos[-1]) + 1  # a piece's writes are ascending
            if (hi - lo) * old.itemsize <= len(pos) * (4 + old.itemsize):
                kept.append((name, slice(lo, hi), self._view(state, name)[lo:hi].copy(), None))
            else:
                kept.append((name, pos.astype(np.int32) if hi <= _INT32_MAX else pos, old, None))
        return DecodedChunk(kept, self.views)

    def undo(self, state: State) -> None:
        for name, pos, old, _new in self.writes:
            if old is not None and name in state:
                self._view(state, name)[pos] = old


def _check_delta_pieces(state: State, seg: _Segment, specs: dict[str, TensorSpec]) -> None:
    for name, s, e in seg.pieces:
        t = state.get(name)
        if t is None:
            raise BaseMismatch(f"tensor {name!r}: the patch changes it but the state has no such tensor")
        spec = specs.get(name)
        if spec is None or spec.dtype != seg.info.name or e > spec.numel:
            raise CorruptData(f"segment piece {name!r}[{s}:{e}]: does not fit the tensor table entry {spec}")
        if info_of(t.dtype) is not seg.info or tuple(t.shape) != spec.shape:
            raise BaseMismatch(f"tensor {name!r}: patch expects {spec.dtype}{list(spec.shape)}, state has {info_of(t.dtype).name}{list(t.shape)}")
        if not t.is_contiguous():
            state[name] = t.contiguous()


def _live(seg: _Segment) -> list[int]:
    return [c for c, row in enumerate(seg.rows) if row[0]]


def _positions(bs: list[np.ndarray], seg: _Segment) -> contexts.Selected:
    """The changed elements in ascending position: positions, their index in
    the patch's (class) order (None where that is ascending too), base bits."""
    lo, classes = seg.window
    live = _live(seg)
    if classes == 1:
        if live and seg.rows[0][1] != seg.size:
            raise CorruptData(f"segment class: expected the segment's {seg.size} elements, found {seg.rows[0][1]}")
        pos = deltacode.decode_rank_runs(seg.rows, seg.streams)[0]
        return contexts.Selected(pos, None, contexts.gather_sorted(bs, pos))
    if seg.size < CLASS_MIN_ELEMENTS:
        raise CorruptData(f"segment class window: expected none below {CLASS_MIN_ELEMENTS} elements, found {classes} classes")
    ranks, counts = deltacode.decode_rank_runs(seg.rows, seg.streams)
    found, sizes = contexts.select_positions(bs, seg.info, lo, classes, ranks, counts)
    for c in live:
        if sizes[c] != seg.rows[c][1]:
            # The classes come from the base: another base has other class sizes.
            raise BaseMismatch(f"segment class {c}: the patch expects {seg.rows[c][1]} base elements in it, "
                               f"the state has {sizes[c]} (wrong base, or already applied)")
    if found is None:
        raise CorruptData("segment positions: expected ascending ranks inside each class's size, found others")
    return found


def _decode_delta(state: State, seg: _Segment, views: dict):
    """(writes, old values, new values) of a delta segment whose pieces `_check_delta_pieces` passed.

    The writes go in ascending position, piece by piece; the old and new
    values for the chunk's digests in the patch's order."""
    bs = _piece_bits(state, seg.pieces, views)
    pos, order, old = _positions(bs, seg)
    d = deltacode.decode_deltas(seg.rows, seg.streams)  # in the patch's order
    new, old_c, new_c = _new_values(old, order, d, seg.info)
    offsets, cuts = contexts.piece_cuts(bs, pos)
    writes = []
    for i, (name, s, _e) in enumerate(seg.pieces):
        a, b = cuts[i], cuts[i + 1]
        if b > a:
            shift = s - offsets[i]
            if shift:
                pos[a:b] += shift  # in place: the segment's positions are used up here
            writes.append((name, pos[a:b], old[a:b], new[a:b]))
    return writes, old_c, new_c


_NO_ORDER = np.zeros(0, dtype=np.int64)
_INT32_MAX = (1 << 31) - 1


def _new_values(old: np.ndarray, order: np.ndarray | None, d: np.ndarray, info: DtypeInfo):
    """(new bits in ascending position, old and new bits in the patch's order) from the
    old bits (ascending position), `order` (each one's index in the patch's order, None
    where that is ascending too) and the deltas (the patch's order)."""
    kernel = contexts.KERNEL
    lo, hi = ordered_range(info)
    if kernel is not None and info.width < 8:
        new = np.empty_like(old)
        if order is None:  # the digests' order is ascending too: nothing to scatter
            old_c, new_c, order, scatter = old, new, _NO_ORDER, (bytearray(), bytearray())
        else:
            old_c, new_c = np.empty_like(old), np.empty_like(old)
            scatter = (old_c, new_c)
        flip = info.magnitude_mask if info.is_float else 0
        ok = kernel.new_values(old, info.width, info.np_int != np.uint8, flip, lo, hi, d, order, new, *scatter)
    else:
        new_ord = ordered_bits(old, info).astype(np.int64) + (d if order is None else d[order])
        ok = info.width == 8 or not new_ord.size or (new_ord.min() >= lo and new_ord.max() <= hi)
        new = ordered_bits(new_ord.astype(info.np_int), info)
        old_c, new_c = old, new
        if order is not None:  # the digests' order: the patch's
            old_c, new_c = np.empty_like(old), np.empty_like(new)
            old_c[order], new_c[order] = old, new
    if not ok:
        raise CorruptData(f"segment values: expected bit patterns of {info.name}, found out-of-range deltas")
    return new, old_c, new_c


def _decode_full(seg: _Segment, specs: dict[str, TensorSpec]):
    for name, s, e in seg.pieces:
        spec = specs.get(name)
        if spec is None or spec.dtype != seg.info.name or e > spec.numel:
            raise CorruptData(f"full piece {name!r}[{s}:{e}]: does not fit the tensor table entry {spec}")
    bits = planes.decode(seg.planes, seg.size, seg.info)
    writes, off = [], 0
    for name, s, e in seg.pieces:
        writes.append((name, slice(s, e), None, bits[off : off + e - s]))
        off += e - s
    return writes, None, bits


def decode_chunk(state: State, chunk: bytes, tensors: list[TensorSpec]) -> DecodedChunk:
    """Decode one chunk against `state` and check it fits; writes nothing.

    Raises BaseMismatch (or AlreadyApplied) when the values the chunk would
    overwrite are not the ones it was made against.
    """
    return decode_chunks(state, [chunk], tensors)[0]


class _Failed:
    """A task's error, held until the walk in chunk order reaches it."""

    def __init__(self, error: PatchswarmError):
        self.error = error


def _held(fn: Callable):
    try:
        return fn()
    except PatchswarmError as e:
        return _Failed(e)


def _named_segments(chunk: bytes, tensors: list[TensorSpec]) -> tuple[list[_Segment], bytes, bytes]:
    segs, old_digest, new_digest = _parse_chunk(chunk)
    for seg in segs:
        if any(i >= len(tensors) for i, _, _ in seg.pieces):
            raise CorruptData(f"segment piece: expected a tensor index below {len(tensors)}, found {max(i for i, _, _ in seg.pieces)}")
        seg.pieces = [(tensors[i].name, a, b) for i, a, b in seg.pieces]
    return segs, old_digest, new_digest


def decode_chunks(state: State, chunks: list[bytes], tensors: list[TensorSpec],
                  threads: int | None = None) -> list[DecodedChunk]:
    """`decode_chunk` of each chunk, their segments decoded on every core (at
    most `threads` threads when set).

    Raises the error a loop over the chunks in order would have raised first:
    parsing and the state checks run in order, the decodes in parallel with
    their errors held, then the walk in chunk order raises the first one.
    """
    parsed = [item for _, item in _parsed_in_order(chunks, tensors)]
    return _decode_parsed(state, parsed, {t.name: t for t in tensors}, threads)


def _parsed_in_order(chunks: list[bytes], tensors: list[TensorSpec]):
    """(chunk, its `_named_segments` or the error parsing it raised), chunk by chunk as
    they are reached, ending with the first error (held for the walk in chunk order)."""
    for chunk in chunks:
        try:
            yield chunk, _named_segments(chunk, tensors)
        except PatchswarmError as e:
            yield chunk, e
            return


def _decode_parsed(state: State, parsed: list, specs: dict[str, TensorSpec], threads: int | None) -> list[DecodedChunk]:
    """`decode_chunks` of chunks already parsed (as `_parsed_in_order` gives them; an error ends the list)."""
    tasks: list[Callable] = []
    plan: list = []  # per chunk: an error, or (task numbers or an error, digests, views)
    work = 0
    for item in parsed:
        if isinstance(item, PatchswarmError):
            plan.append(item)
            break
        segs, old_digest, new_digest = item
        views: dict = {}
        steps: list = []
        for seg in segs:
            if seg.kind == "d":
                try:
                    _check_delta_pieces(state, seg, specs)  # may make a tensor contiguous: not in a thread
                except PatchswarmError as e:
                    steps.append(e)
                    break
                tasks.append(functools.partial(_held, functools.partial(_decode_delta, state, seg, views)))
            else:
                tasks.append(functools.partial(_held, functools.partial(_decode_full, seg, specs)))
            work += seg.size * seg.info.width
            steps.append(len(tasks) - 1)
        plan.append((steps, old_digest, new_digest, views))
        if steps and isinstance(steps[-1], PatchswarmError):
            break
    results = parallel.run_all(tasks, parallel.threads_for(len(tasks), work, PARALLEL_MIN_BYTES, threads))
    decoded = []
    for item in plan:
        if isinstance(item, PatchswarmError):
            raise item
        steps, old_digest, new_digest, views = item
        writes, olds, news = [], [], []
        for step in steps:
            if isinstance(step, PatchswarmError):
                raise step
            r = results[step]
            if isinstance(r, _Failed):
                raise r.error
            w, o, n = r
            writes += w
            if o is not None:
                olds.append(o)
            news.append(n)
        if _digest(olds) != old_digest:
            if len(olds) == len(news) and _digest(olds) == new_digest:
                raise AlreadyApplied("chunk: the state already holds the values this chunk writes (applied twice?)")
            raise BaseMismatch("chunk: the values it overwrites differ from the state's (wrong base, or already applied)")
        if _digest(news) != new_digest:
            raise CorruptData("chunk: decoded values do not match the chunk's digest of what it writes")
        decoded.append(DecodedChunk(writes, views))
    return decoded


def check_structure(state: State, patch: Patch) -> set[str]:
    """Raise BaseMismatch unless `state` has the tensors the patch changes; return the names it drops."""
    full = set(patch.full)
    for t in patch.tensors:
        if t.name in full:
            continue
        cur = state.get(t.name)
        if cur is None:
            raise BaseMismatch(f"tensor {t.name!r}: the patch expects it in the base, the state has none")
        if info_of(cur.dtype).name != t.dtype or tuple(cur.shape) != t.shape:
            raise BaseMismatch(f"tensor {t.name!r}: patch expects {t.dtype}{list(t.shape)}, state has {info_of(cur.dtype).name}{list(cur.shape)}")
    drop = set(state) - {t.name for t in patch.tensors} if patch.kind == "keyframe" else set(patch.removed)
    missing = [n for n in drop if n not in state]
    if missing:
        raise BaseMismatch(f"tensor {missing[0]!r}: the patch removes it, the state has none")
    return drop


def prepare(state: State, patch: Patch) -> dict[str, torch.Tensor | None]:
    """Make the state's structure the target's: drop removed tensors, allocate full ones.

    Returns what was replaced (name → old tensor or None) so it can be undone.
    """
    drop = check_structure(state, patch)
    specs = {t.name: t for t in patch.tensors}
    full = set(patch.full)
    saved: dict[str, torch.Tensor | None] = {}
    for name in drop:
        saved[name] = state.pop(name)
    for name in full:
        spec = specs[name]
        saved.setdefault(name, state.get(name))
        state[name] = torch.empty(spec.shape, dtype=info_named(spec.dtype).torch_dtype)
    return saved


def restore(state: State, saved: dict[str, torch.Tensor | None]) -> None:
    for name, t in saved.items():
        if t is None:
            state.pop(name, None)
        else:
            state[name] = t


def _parsed_batches(chunks: list[bytes], tensors: list[TensorSpec], min_bytes: int, min_segments: int):
    """Consecutive runs of parsed chunks (`_parsed_in_order`), each of at least `min_bytes` of
    patch and `min_segments` segments (but the last), parsed as they are reached so
    only one batch's streams are held. A chunk that fails to parse ends its batch
    and the iteration."""
    cur, size, segs = [], 0, 0
    for c, item in _parsed_in_order(chunks, tensors):
        cur.append(item)
        if isinstance(item, PatchswarmError):
            break
        size += len(c)
        segs += len(item[0])
        if size >= min_bytes and segs >= min_segments:
            yield cur
            cur, size, segs = [], 0, 0
    if cur:
        yield cur


def apply(state: State, patch: Patch, progress: Progress = None, threads: int | None = None,
          undo: bool = True) -> None:
    """Apply `patch` to `state` in place; on any error the state is left unchanged.

    `threads`: at most this many for decoding and hashing (None: as many as
    the cores and the work are worth). `progress(done, total)` counts chunks
    written, then the state hash as one more step.

    `undo=False` is for callers that keep the base elsewhere (the node daemon
    has it in its weights file): no undo records are kept, which for a dense
    patch is a copy of every range it writes (the whole state at worst), and
    an error raised after the first write leaves the state partly patched.
    Errors found before any write (structure, wrong base in the first batch,
    a second apply) still leave it unchanged."""
    _check_state(state, "state")
    if not isinstance(patch, Patch):
        raise UsageError(f"patch: expected a Patch, found {type(patch).__name__}")
    n = len(patch.chunks)
    check_structure(state, patch)
    # A batch of chunks at a time (a segment per decode thread at least),
    # decoded on every core, checked, written; only what undoing it needs is
    # kept. Holding every chunk's decoded arrays until the end made an apply's
    # memory grow with the patch (16 B per changed element, and fresh pages
    # cost more than the decode).
    batches = _parsed_batches(patch.chunks, patch.tensors, APPLY_BATCH_BYTES,
                              min(threads or parallel.cores(), parallel.MAX_THREADS))
    specs = {t.name: t for t in patch.tensors}  # once, not per batch: a table may list many tensors
    saved: dict | None = None
    kept: list[DecodedChunk] = []  # undo records, with `undo`
    written = 0
    try:
        for batch in batches:
            decoded = _decode_parsed(state, batch, specs, threads)
            if saved is None:
                # After the first checks: a wrong base or a second apply fails before
                # the structure changes. Delta chunks never read full or removed tensors.
                saved = prepare(state, patch)
            for d in decoded:
                if undo:
                    kept.append(d.undo_record(state))
                d.write(state)
                written += 1
                if progress:
                    progress(written, n + 1)
        if saved is None:
            saved = prepare(state, patch)
        found = state_hash(state, threads)
        if found != patch.target_hash:
            raise StateHashMismatch("patched state", patch.target_hash, found)
        if progress:
            progress(n + 1, n + 1)
    except BaseException:
        if undo or not written:
            for d in reversed(kept):
                d.undo(state)
            if saved is not None:
                restore(state, saved)
        raise
