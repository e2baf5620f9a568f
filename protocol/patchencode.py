"""Making patches: `diff(base, target)` and `keyframe(state)`.

Owns how a patch is computed, never how it is read: planning segments over
the target's tensors, finding the changed elements (bit patterns, never
float values), coding each segment (deltacode.py for changes, planes.py for
full tensors) and packing segments into chunks of about `chunk_bytes`.
Segments are encoded as independent tasks on every core (parallel.py),
beside the state-hash blocks. The container is patchformat.py's.

A changed element's position is coded as its rank inside a context class of
the base (its exponent, contexts.py) and its value as the delta of
order-preserving integers (dtypes.py). Tensors that are new, or whose dtype
or shape changed, are carried in full; removed tensors are listed.
Pure: no files, no sockets, no clocks.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, NamedTuple

import msgpack
import numpy as np
import torch

from . import contexts, deltacode, parallel, planes, statehash
from .dtypes import info_of, to_ordered
from .errors import UsageError
from .patchformat import (CLASS_MIN_ELEMENTS, PARALLEL_MIN_BYTES, Patch, Progress, State, TensorSpec, check_state,
                          chunk_digest, piece_bits)
from .statehash import state_hash

DELTA_SEGMENT_ELEMENTS = 1 << 22
FULL_SEGMENT_BYTES = 2 << 20
CHUNK_BYTES = 2 << 20
# A segment holds at most this many changes: a dense step's 1 M-element segment
# decoded into ~30 MB of transients, and a segment is what one decode thread holds
# at once (apply's peak: 119 -> 18 MB on the WAN payload). Sparse segments are far
# below it, so their size (and the per-segment headers) is unchanged.
SEGMENT_CHANGES = 1 << 18


def _plan_segments(state, names: list[str], max_elements: int) -> list[list[tuple[str, int, int]]]:
    """Pieces grouped into segments: same dtype, at most max_elements each. `state` maps
    names to tensors, or to anything with `dtype` and `numel()` (a spec of one to come)."""
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

def _gather(state: State, pieces) -> np.ndarray:
    arrays = piece_bits(state, pieces)
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


def _encode_delta(base: State, target: State, pieces, index: dict[str, int],
                  views: tuple[dict | None, dict | None] = (None, None)) -> list[tuple[dict, list, list]]:
    """The segments of one planned segment's changes: itself, none when nothing
    changed, or consecutive parts of at most SEGMENT_CHANGES changes each.
    `views`: `piece_bits` caches for base and target."""
    bs, ts = piece_bits(base, pieces, views[0]), piece_bits(target, pieces, views[1])
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
        out.append(_encode_changes(base, part, index, piece_bits(base, part), idx[at] - first, old[at], new[at]))
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


def _changed_pieces(pieces, bs: list[np.ndarray], idx: np.ndarray):
    """(the pieces holding a change, their bits, `idx` in their concatenation).

    A planned segment stacks small tensors back to back (up to DELTA_SEGMENT_ELEMENTS), and
    every piece a segment lists costs ~7 bytes and a step of the node's apply, changed or
    not: a sparse step listed every tensor of a touched segment (140,000 norms and fp8
    scales: ~1 MB a version). Only the pieces with changes are listed now; positions are
    coded in their concatenation, which the decoder reads from the same list."""
    if len(pieces) == 1:
        return pieces, bs, idx
    sizes = np.fromiter((b.size for b in bs), np.int64, len(bs))
    which = np.searchsorted(np.cumsum(sizes), idx, side="right")  # each change's piece
    hit = np.zeros(len(pieces), bool)
    hit[which] = True
    if hit.all():
        return pieces, bs, idx
    gone = np.where(hit, 0, sizes)
    idx = idx - (np.cumsum(gone) - gone)[which]  # minus the elements of dropped pieces before it
    keep = np.flatnonzero(hit).tolist()
    return [pieces[i] for i in keep], [bs[i] for i in keep], idx


def _encode_changes(base: State, pieces, index: dict[str, int], bs: list[np.ndarray], idx: np.ndarray,
                    old: np.ndarray, new: np.ndarray) -> tuple[dict, list, list]:
    pieces, bs, idx = _changed_pieces(pieces, bs, idx)
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


class ChunkPacker:
    """Segments in, chunks of about `chunk_bytes` out, as they fill: only the open chunk's
    segments (and the values its digests cover) are held, so a keyframe or a patch of
    any size can go to disk chunk by chunk."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self._segs: list[dict] = []
        self._size = 0
        self._olds: list[np.ndarray] = []
        self._news: list[np.ndarray] = []

    def add(self, seg: dict, olds: list, news: list) -> list[bytes]:
        """Take one encoded segment; returns the chunks it closed (zero or one)."""
        size = len(msgpack.packb(seg, use_bin_type=True))
        out = []
        if self._segs and self._size + size > self.chunk_bytes:
            out.append(self._flush())
        self._segs.append(seg)
        self._olds += olds
        self._news += news
        self._size += size
        return out

    def finish(self) -> list[bytes]:
        return [self._flush()] if self._segs else []

    def _flush(self) -> bytes:
        chunk = msgpack.packb({"s": self._segs, "o": chunk_digest(self._olds), "n": chunk_digest(self._news)},
                              use_bin_type=True)
        self._segs, self._olds, self._news, self._size = [], [], [], 0
        return chunk


def _pack_chunks(encoded: list[tuple[dict, list, list]], chunk_bytes: int) -> list[bytes]:
    packer = ChunkPacker(chunk_bytes)
    chunks = [c for item in encoded for c in packer.add(*item)]
    return chunks + packer.finish()


@parallel.gc_paused()  # a state of many tensors: parallel.py
def diff(base: State, target: State, layout: dict[str, str] | None = None, progress: Progress = None,
         chunk_bytes: int = CHUNK_BYTES, base_hash: str | None = None, target_hash: str | None = None,
         segment_elements: int = DELTA_SEGMENT_ELEMENTS) -> Patch:
    """The patch that turns `base` into `target`, bit for bit.

    `base_hash`/`target_hash` may be passed when the caller already knows them
    (the origin does), to skip hashing the state again.
    """
    check_state(base, "base")
    check_state(target, "target")
    unhashed = [s for s, h in ((base, base_hash), (target, target_hash)) if h is None]
    names = sorted(target)
    full = [n for n, b, t in ((n, base.get(n), target[n]) for n in names) if b is None or b.dtype != t.dtype or b.shape != t.shape]
    # Segments and state-hash blocks are independent tasks, run on every core together.
    # Each tensor is viewed once: the hashing's views (made now, on this thread) are the
    # ones the encoding reads (a view cost ~2 us, as much as hashing a small tensor).
    views: dict[int, dict] = {id(base): {}, id(target): {}}
    hashing, finish_hashes = statehash.hash_tasks(unhashed, [views[id(s)] for s in unhashed])
    encoding = _encode_tasks(base, target, names, full, segment_elements, (views[id(base)], views[id(target)]))
    tasks = encoding + hashing
    work = statehash.hash_bytes(unhashed) + 2 * statehash.hash_bytes([target])
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


def _encode_tasks(base: State, target: State, names: list[str], full: list[str], segment_elements: int,
                  views: tuple[dict | None, dict | None] = (None, None)) -> list[Callable]:
    """One task per planned segment, each returning a list of (segment, old values, new values)."""
    full_set = set(full)
    index = {n: i for i, n in enumerate(names)}
    delta_names = [n for n in names if n not in full_set]
    tasks: list[Callable] = [functools.partial(_encode_delta, base, target, pieces, index, views)
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
    check_state(state, "state")
    names = sorted(state)
    chunks = list(keyframe_chunks(state, chunk_bytes, progress=progress))
    return Patch(
        kind="keyframe", base_hash=None, target_hash=state_hash_hex or state_hash(state),
        tensors=[TensorSpec.of(n, state[n]) for n in names], full=names, removed=[],
        chunks=chunks, layout=layout,
    )


def keyframe_chunks(state: State, chunk_bytes: int = CHUNK_BYTES, threads: int | None = None,
                    progress: Progress = None) -> Iterator[bytes]:
    """`keyframe(state)`'s chunks, as they are made: a batch of segments (one per thread)
    at a time, so only that batch and the open chunk are ever held."""
    check_state(state, "state")
    names = sorted(state)
    index = {n: i for i, n in enumerate(names)}
    segs = _plan_segments_bytes(state, names)
    packer = ChunkPacker(chunk_bytes)
    step = max(1, threads or parallel.cores())
    for i in range(0, len(segs), step):
        group = segs[i:i + step]
        work = sum(state[n].element_size() * (b - a) for pieces in group for n, a, b in pieces)
        results = parallel.run_all([functools.partial(_encode_full, state, pieces, index) for pieces in group],
                                   parallel.threads_for(len(group), work, PARALLEL_MIN_BYTES, threads))
        for seg, news in results:
            yield from packer.add(seg, [], news)
        if progress:
            progress(i + len(group), len(segs))
    yield from packer.finish()


class TargetSpec(NamedTuple):
    """What a tensor of the target will be, before it exists."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def diff_in_place(state: State, specs: dict[str, TargetSpec], produce: Callable[[str], torch.Tensor],
                  base_hash: str, layout: dict[str, str] | None = None, chunk_bytes: int = CHUNK_BYTES,
                  segment_elements: int = DELTA_SEGMENT_ELEMENTS, threads: int | None = None,
                  on_chunk: Callable[[bytes], None] | None = None, counts: dict | None = None) -> Patch:
    """`diff(state, target)` without ever holding both states: the target's tensors are made
    one at a time by `produce(name)` (a tensor matching `specs[name]`), in segment order,
    and each replaces the base's tensor in `state` as soon as every segment that reads
    it is encoded. Returns the same patch `diff` would (the same chunks, byte for byte),
    its target hash computed tensor by tensor; `state` is then the target.

    Memory beyond `state`: the target tensors a batch of segments spans (one per
    thread), the open chunk, and the chunks made (or none: `on_chunk(chunk)` takes each
    one as it is made and the patch's `chunks` stays empty). `counts`, when given, gets
    "changed": the elements that differ. If `produce` raises, part of `state` may
    already be the target's: the caller must restore it."""
    check_state(state, "base")
    names = sorted(specs)
    full = [n for n in names if n not in state or state[n].dtype != specs[n].dtype
            or tuple(state[n].shape) != tuple(specs[n].shape)]
    full_set = set(full)
    removed = sorted(set(state) - set(specs))
    index = {n: i for i, n in enumerate(names)}
    delta_names = [n for n in names if n not in full_set]
    plan = _plan_segments(specs, delta_names, segment_elements)
    last_use = {name: i for i, pieces in enumerate(plan) for name, _, _ in pieces}
    packer = ChunkPacker(chunk_bytes)
    chunks: list[bytes] = []
    digests: dict[str, bytes] = {}

    def emit(made: list[bytes]) -> None:
        for c in made:
            if on_chunk is not None:
                on_chunk(c)
            else:
                chunks.append(c)

    def made(name: str) -> torch.Tensor:
        t = produce(name)
        spec = specs[name]
        if not isinstance(t, torch.Tensor) or t.dtype != spec.dtype or tuple(t.shape) != tuple(spec.shape):
            raise UsageError(f"diff_in_place: {name!r} was to be {spec.dtype}{list(spec.shape)}, "
                             f"found {getattr(t, 'dtype', type(t).__name__)}{list(getattr(t, 'shape', []))}")
        if t.device.type != "cpu":
            raise UsageError(f"diff_in_place: {name!r}: expected a CPU tensor, found device {t.device}")
        return t.contiguous()

    def settle(name: str, t: torch.Tensor) -> None:
        state[name] = t
        digests[name] = statehash.tensor_digest(t, threads)

    new: dict[str, torch.Tensor] = {}
    changed = 0
    step = max(1, threads or parallel.cores())
    for i in range(0, len(plan), step):
        group = plan[i:i + step]
        for pieces in group:
            for name, _, _ in pieces:
                if name not in new:
                    new[name] = made(name)
        work = 2 * sum(specs[n].numel() for pieces in group for n, _, _ in pieces)
        results = parallel.run_all([functools.partial(_encode_delta, state, new, pieces, index) for pieces in group],
                                   parallel.threads_for(len(group), work, PARALLEL_MIN_BYTES, threads))
        for r in results:
            for seg in r:
                changed += sum(len(a) for a in seg[1])
                emit(packer.add(*seg))
        for name in [n for n in new if last_use[n] < i + len(group)]:
            settle(name, new.pop(name))
    for name in delta_names:
        if name not in digests:  # no elements, so in no segment
            settle(name, made(name))
    for name in removed:
        del state[name]
    for name in full:
        state.pop(name, None)  # the base's tensor of another dtype or shape goes first
        settle(name, made(name))
    for pieces in _plan_segments_bytes(state, full):
        seg, news = _encode_full(state, pieces, index)
        emit(packer.add(seg, [], news))
    emit(packer.finish())
    if counts is not None:
        counts["changed"] = changed + sum(specs[n].numel() for n in full)
    return Patch(
        kind="patch", base_hash=base_hash,
        target_hash=statehash.combine({n: (state[n].dtype, tuple(state[n].shape), digests[n]) for n in names}),
        tensors=[TensorSpec(n, info_of(specs[n].dtype).name, tuple(specs[n].shape)) for n in names],
        full=full, removed=removed, chunks=chunks, layout=layout,
    )
