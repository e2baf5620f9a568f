"""Reading patches: decode chunks against a state, and `apply`.

Owns what a chunk writes (`DecodedChunk`, `decode_chunk(s)`), the structure
change a patch makes (`check_structure`, `prepare`, `restore`) and `apply`,
never how a patch is made (patchencode.py) or its bytes (patchformat.py).

`apply(state, patch)` works in place, a batch of chunks at a time. Every
chunk is decoded and checked against the digest of the values it overwrites
before it is written; after the writes the full state hash must equal the
patch's target hash, otherwise every write is undone (from each chunk's undo
record: the old bits of the ranges it wrote, or positions and old bits). A
wrong base, a second apply, a truncated or corrupted patch raise and leave
the state as it was (with `undo=False`, only when found before the first
write: for callers that keep the base elsewhere). Segments are decoded as
independent tasks on every core (parallel.py); errors still surface in chunk
order. Pure: no files, no sockets, no clocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np
import torch

from . import contexts, deltacode, parallel, planes
from .dtypes import BY_TORCH, DtypeInfo, info_named, info_of, int_view, ordered_bits, ordered_range
from .errors import (AlreadyApplied, BaseMismatch, CorruptData, InvalidInput, PatchswarmError, StateHashMismatch,
                     UsageError)
from .patchformat import (CLASS_MIN_ELEMENTS, PARALLEL_MIN_BYTES, Patch, Progress, Segment, State, TensorSpec,
                          check_state, chunk_digest, parse_chunk, piece_bits)
from .statehash import state_hash

APPLY_BATCH_BYTES = 1 << 18  # at least this much patch per apply batch (and a segment per decode thread)


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


def _check_delta_pieces(state: State, seg: Segment, specs: dict[str, TensorSpec]) -> None:
    for name, s, e in seg.pieces:
        t = state.get(name)
        if t is None:
            raise BaseMismatch(f"tensor {name!r}: the patch changes it but the state has no such tensor")
        spec = specs.get(name)
        if spec is None or spec.dtype != seg.info.name or e > spec.numel:
            raise CorruptData(f"segment piece {name!r}[{s}:{e}]: does not fit the tensor table entry {spec}")
        if (BY_TORCH.get(t.dtype) or info_of(t.dtype)) is not seg.info or t.shape != spec.shape:  # a Size is a tuple
            raise BaseMismatch(f"tensor {name!r}: patch expects {spec.dtype}{list(spec.shape)}, state has {info_of(t.dtype).name}{list(t.shape)}")
        if not t.is_contiguous():
            state[name] = t.contiguous()


def _live(seg: Segment) -> list[int]:
    return [c for c, row in enumerate(seg.rows) if row[0]]


def _positions(bs: list[np.ndarray], seg: Segment) -> contexts.Selected:
    """The changed elements in ascending position: positions, their index in
    the patch's (class) order (None where that is ascending too), base bits."""
    lo, classes = seg.window
    live = _live(seg)
    deltacode.check_counts(seg.rows, seg.streams, seg.size)
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


def _decode_delta(state: State, seg: Segment, views: dict):
    """(writes, old values, new values) of a delta segment whose pieces `_check_delta_pieces` passed.

    The writes go in ascending position, piece by piece; the old and new
    values for the chunk's digests in the patch's order."""
    bs = piece_bits(state, seg.pieces, views)
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
        ok = kernel.new_values(old, info.width, not info.unsigned, flip, lo, hi, d, order, new, *scatter)
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


def _decode_full(seg: Segment, specs: dict[str, TensorSpec]):
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


def _named_segments(chunk: bytes, tensors: list[TensorSpec]) -> tuple[list[Segment], bytes, bytes]:
    segs, old_digest, new_digest = parse_chunk(chunk)
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


def _decode_parsed(state: State, parsed: list, specs: dict[str, TensorSpec], threads: int | None,
                   views: dict | None = None) -> list[DecodedChunk]:
    """`decode_chunks` of chunks already parsed (as `_parsed_in_order` gives them; an error ends the list).
    `views`: one cache of the tensors' int views for every chunk (`apply` shares it with
    the state hash); None: a cache per chunk."""
    tasks: list[Callable] = []
    plan: list = []  # per chunk: an error, or (task numbers or an error, digests, views)
    work = 0
    for item in parsed:
        if isinstance(item, PatchswarmError):
            plan.append(item)
            break
        segs, old_digest, new_digest = item
        chunk_views: dict = {} if views is None else views
        steps: list = []
        for seg in segs:
            if seg.kind == "d":
                try:
                    _check_delta_pieces(state, seg, specs)  # may make a tensor contiguous: not in a thread
                except PatchswarmError as e:
                    steps.append(e)
                    break
                tasks.append(functools.partial(_held, functools.partial(_decode_delta, state, seg, chunk_views)))
            else:
                tasks.append(functools.partial(_held, functools.partial(_decode_full, seg, specs)))
            work += seg.size * seg.info.width
            steps.append(len(tasks) - 1)
        plan.append((steps, old_digest, new_digest, chunk_views))
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
        if chunk_digest(olds) != old_digest:
            if len(olds) == len(news) and chunk_digest(olds) == new_digest:
                raise AlreadyApplied("chunk: the state already holds the values this chunk writes (applied twice?)")
            raise BaseMismatch("chunk: the values it overwrites differ from the state's (wrong base, or already applied)")
        if chunk_digest(news) != new_digest:
            raise CorruptData("chunk: decoded values do not match the chunk's digest of what it writes")
        decoded.append(DecodedChunk(writes, views))
    return decoded


def check_structure(state: State, patch: Patch) -> set[str]:
    """Raise BaseMismatch unless `state` has the tensors the patch changes; return the names it drops.

    Raises CorruptData when the full tensors the table declares hold more bytes
    than the chunks could expand to (before `prepare` allocates them)."""
    full = set(patch.full)
    full_bytes = sum(t.numel * info_named(t.dtype).width for t in patch.tensors if t.name in full)
    # The sizes where given: a store's chunks are each read from disk and checked when reached,
    # and summing their lengths read every chunk of the patch once more before its apply did.
    chunk_bytes = sum(patch.chunk_sizes if patch.chunk_sizes is not None else (len(c) for c in patch.chunks))
    if full_bytes > planes.ZSTD_MAX_RATIO * chunk_bytes:
        raise CorruptData(f"full tensors: expected at most {planes.ZSTD_MAX_RATIO} bytes per chunk byte ({chunk_bytes} "
                          f"chunk bytes), found {full_bytes} bytes declared")
    for t in patch.tensors:
        if t.name in full:
            continue
        cur = state.get(t.name)
        if cur is None:
            raise BaseMismatch(f"tensor {t.name!r}: the patch expects it in the base, the state has none")
        if (BY_TORCH.get(cur.dtype) or info_of(cur.dtype)).name != t.dtype or cur.shape != t.shape:
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
    return _prepare(state, patch, check_structure(state, patch))


def _prepare(state: State, patch: Patch, drop: set[str]) -> dict[str, torch.Tensor | None]:
    """`prepare` once `check_structure` has passed and returned `drop`."""
    specs = {t.name: t for t in patch.tensors}
    made = {}
    for name in patch.full:  # all of them before the state changes: an allocation may fail
        spec = specs[name]
        try:
            made[name] = torch.empty(spec.shape, dtype=info_named(spec.dtype).torch_dtype)
        except RuntimeError as e:  # torch's allocator: out of memory, or a size it cannot express
            raise InvalidInput(f"tensor {name!r}: allocating {spec.dtype}{list(spec.shape)} "
                               f"({spec.numel * info_named(spec.dtype).width} bytes) failed: {str(e)[:120]}") from None
    saved: dict[str, torch.Tensor | None] = {}
    for name in drop:
        saved[name] = state.pop(name)
    for name, t in made.items():
        saved.setdefault(name, state.get(name))
        state[name] = t
    return saved


def restore(state: State, saved: dict[str, torch.Tensor | None]) -> None:
    for name, t in saved.items():
        if t is None:
            state.pop(name, None)
        else:
            state[name] = t


class _FullCoverage:
    """The ranges of a patch's full tensors that its full segments write. Each must be
    written exactly once: `prepare` allocates a full tensor uninitialized at the size the
    table declares, and the state hash reads all of it."""

    def __init__(self, patch: Patch):
        full = set(patch.full)
        self.numel = {t.name: t.numel for t in patch.tensors if t.name in full}
        self.ranges: dict[str, list[tuple[int, int]]] = {name: [] for name in self.numel}

    def add(self, segs: list[Segment]) -> None:
        for seg in segs:
            if seg.kind != "f":
                continue
            for name, s, e in seg.pieces:
                if name not in self.ranges:  # it would overwrite a base tensor with no undo record
                    raise CorruptData(f"full piece {name!r}[{s}:{e}]: expected a tensor of the patch's full list")
                self.ranges[name].append((s, e))

    def check(self) -> None:
        for name, ranges in self.ranges.items():
            at = 0
            for s, e in sorted(ranges):
                if s != at:
                    raise CorruptData(f"full tensor {name!r}: expected its segments to cover [0, {self.numel[name]}) "
                                      f"once, found {'a gap' if s > at else 'an overlap'} at {min(s, at)}")
                at = e
            if at != self.numel[name]:
                raise CorruptData(f"full tensor {name!r}: expected its segments to cover [0, {self.numel[name]}), "
                                  f"found [0, {at})")


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


Recorder = Callable[[str, np.ndarray | slice, np.ndarray], None]


@parallel.gc_paused()  # a state of many tensors: parallel.py
def apply(state: State, patch: Patch, progress: Progress = None, threads: int | None = None,
          undo: bool = True, recorder: Recorder | None = None, views: dict | None = None,
          touched: set[str] | None = None) -> None:
    """Apply `patch` to `state` in place; on any error the state is left unchanged.

    `threads`: at most this many for decoding and hashing (None: as many as
    the cores and the work are worth). `progress(done, total)` counts chunks
    written, then the state hash as one more step.

    `undo=False` is for callers that keep the base elsewhere (the node daemon
    has it in its weights file): no undo records are kept, which for a dense
    patch is a copy of every range it writes (the whole state at worst), and
    an error raised after the first write leaves the state partly patched.
    Errors found before any write (structure, wrong base in the first batch,
    a second apply) still leave it unchanged.

    `recorder(name, positions, new_bits)` is told each write as it is made:
    flat positions (ascending int64, or a slice for a whole tensor's range)
    and the new bit patterns (the dtype's integer view), the arrays the
    decoder made, not copies (protocol/changes.py encodes them). It only
    reads them. Writes are told once each, in no particular order across
    chunks; if `apply` raises, what was told is void.

    `views`: a cache of the tensors' int views (name -> (tensor, flat integer view)) that
    the caller keeps from one apply to the next on the same state (the node applies
    every version into one state): each tensor is then viewed once, not once per
    version (~2-5 us a tensor: 0.3-0.7 s a version at 140k tensors). An entry is used
    only for the tensor object it was made of, and the cache is left holding the
    state's tensors alone. The caller must not swap a cached tensor's storage in place
    (`set_`, `.data =`); the node replaces tensors, never their storage.

    `touched`: if given, the names `touched_tensors(patch)` returns are added to it, from
    the chunks as the apply parses them (not a second read of every chunk); if `apply`
    raises, what it added is void."""
    check_state(state, "state")
    if not isinstance(patch, Patch):
        raise UsageError(f"patch: expected a Patch, found {type(patch).__name__}")
    n = len(patch.chunks)
    # Checked once: decoding changes no name, dtype or shape, so `prepare`'s own check
    # would find the same (a state of 140k tensors took ~0.5 s per check here).
    drop = check_structure(state, patch)
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
    coverage = _FullCoverage(patch)
    # One cache of int views for every batch and the state hash: each tensor is viewed
    # once per apply (a view cost ~2 us, as much as hashing a small tensor), or once for
    # many applies where the caller keeps `views`.
    if views is None:
        views = {}
    try:
        if touched is not None:
            touched.update(patch.full, patch.removed)
            if patch.kind == "keyframe":
                touched.update(t.name for t in patch.tensors)
        for batch in batches:
            for item in batch:
                if not isinstance(item, PatchswarmError):
                    coverage.add(item[0])
                    if touched is not None:
                        touched.update(n for seg in item[0] for n, _, _ in seg.pieces)
            decoded = _decode_parsed(state, batch, specs, threads, views)
            if saved is None:
                # After the first checks: a wrong base or a second apply fails before
                # the structure changes. Delta chunks never read full or removed tensors.
                saved = _prepare(state, patch, drop)
            for d in decoded:
                if undo:
                    kept.append(d.undo_record(state))
                d.write(state)
                if recorder is not None:
                    for name, pos, _old, new in d.writes:
                        recorder(name, pos, new)
                written += 1
                if progress:
                    progress(written, n + 1)
        if saved is None:
            saved = _prepare(state, patch, drop)
        coverage.check()
        found = state_hash(state, threads, views)
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
    finally:
        if patch.full or patch.removed or len(views) > len(state):
            _keep_views_of(views, state)


def _keep_views_of(views: dict, state: State) -> None:
    """Drop cached views of tensors the state no longer holds (removed, replaced, or put
    back by an undo), so that a cache kept across applies holds no other memory alive."""
    for name in [n for n, (t, _) in views.items() if state.get(n) is not t]:
        del views[name]


def touched_tensors(patch: Patch) -> set[str]:
    """The names of the tensors `patch` writes or removes: its full and removed tensors and
    every tensor a delta segment names (a keyframe: all of them). One parse of its chunks,
    no decode: for a hand-off that rewrites only what changed."""
    if patch.kind == "keyframe":
        return {t.name for t in patch.tensors}
    names = set(patch.full) | set(patch.removed)
    for chunk in patch.chunks:
        segs, _, _ = _named_segments(chunk, patch.tensors)
        names.update(n for seg in segs for n, _, _ in seg.pieces)
    return names
