"""Context classes for change positions, computed from base weights both sides hold.

Owns: the class key of a float element (its exponent field), choosing a class
window (encoder side), and the class index of a segment's base: membership
bit planes with rank and select inside a class. Pure numpy/torch, no I/O.

Why: the probability that a served element changes in one optimizer step
halves with each step of the exponent of its old value (the ulp doubles, the
Adam step does not). Coding positions as gaps *inside* a class of equal
exponent pays ~N·Σ H(p_class) instead of N·H(p): ~30 % fewer position bits on
real AdamW checkpoints.

Classes are a window of unit exponent steps: class = clip(exponent - lo, 0,
C - 1) with C in {1, 2, 4, 8}. On real pairs this window costs within 0.5 % of
the best free choice of class boundaries, and it is cheap where cost matters:
the decoder builds the index over every base element, and that pass is the
largest part of `apply` after the state hash. The per-element work is
five numpy passes over bytes: key (one shift-and-cast of the bit pattern),
clip to [lo, lo + C - 1], and per plane an AND and a packbits; the planes
hold the clipped key's low log2(C) bits (class c is the code (lo + c) mod
C, which saves a subtraction pass). Everything after that works on N/64
words: per-word member counts of every class come from popcounts of plane
ANDs by a Möbius transform, prefix counts are kept per block of 512
elements, and rank/select inside a block work on the block's 8 word
popcounts packed in one 64-bit word (SWAR). Nothing sorts the N elements;
the byte temporaries come from a pool (page faults cost more than the work).
`select_positions` and `rank_positions` are what patches call: one compiled
pass (protocol/_kernels.c) where it built, this ClassIndex otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import numpy as np
import torch

from .dtypes import DtypeInfo
from .errors import CorruptData

try:  # the compiled one-pass twin of ClassIndex's rank and select (setup.py; optional)
    from . import _kernels as KERNEL
except ImportError:  # no compiler where this was installed: the numpy version below
    KERNEL = None

MAX_CLASSES = 8
CLASS_CHOICES = (1, 2, 4, 8)
CLASS_HEADER_BITS = 96  # what a class costs in the container, for the window choice
# When more than 1/DENSE_SELECT of a segment's elements are selected, every
# position is listed once in class order (one radix sort, ~15 ns an element
# here) and the selection is a gather, instead of a select per rank (~57 ns
# each): dense patches (large steps, fp32 served) select most elements.
DENSE_SELECT = 4
RUN_RANKS = 1 << 13  # ranks selected per run (its uint64 temporaries, 64 KiB each, stay in L2)
SAMPLE_TARGET = 1 << 16  # base elements sampled per segment to estimate class sizes
KEY_VALUES = 256
BLOCK = 512  # elements per prefix-count block: 8 words of 64

_FULL = np.uint64(0xFFFFFFFFFFFFFFFF)
_BYTES_ONE = np.uint64(0x0101010101010101)
_BYTES_HIGH = np.uint64(0x8080808080808080)
_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
# _SELECT8[byte, j] = index of the j-th set bit of byte
_SELECT8 = np.zeros((256, 8), dtype=np.uint8)
for _b in range(256):
    _ones = [i for i in range(8) if _b >> i & 1]
    _SELECT8[_b, : len(_ones)] = _ones
_SELECT8_FLAT = _SELECT8.ravel().astype(np.uint64)


def has_classes(info: DtypeInfo) -> bool:
    """Floats (and f8e8m0, an exponent alone) have an exponent to condition on; integer dtypes
    get one class."""
    return info.exponent > 0


def _exponent_mask(info: DtypeInfo) -> int:
    return info.key_mask


def _compiled(info: DtypeInfo) -> bool:
    """Whether the compiled pass reads this dtype's keys: it takes 1-, 2- and 4-byte elements
    and a shift-and-mask key. fp64 (8 bytes, a key with a flipped bit) takes ClassIndex, the
    numpy version of the same answers: f64 tensors are a checkpoint's buffers, not its bulk."""
    return KERNEL is not None and info.width <= 4 and not info.key_xor


def keys_of(bits: np.ndarray, info: DtypeInfo) -> np.ndarray:
    """The class key (exponent field) of each bit pattern, as uint8."""
    keys = np.empty(bits.shape, dtype=np.uint8)
    _keys_into(bits, info, keys)
    return keys


def sample_keys(pieces: list[np.ndarray], info: DtypeInfo, stride: int) -> np.ndarray:
    """Keys of every stride-th element of the concatenated pieces."""
    parts, off = [], 0
    for p in pieces:
        parts.append(p[(-off) % stride :: stride])
        off += p.size
    return keys_of(np.concatenate(parts), info)


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def choose_window(sample_keys: np.ndarray, total: int, changed_keys: np.ndarray) -> tuple[int, int]:
    """(lo, C): the class window with the fewest estimated position bits.

    `sample_keys` are the keys of a sample of the `total` base elements,
    `changed_keys` those of every changed element. The cost of a window is
    Σ n_c·H(m_c / n_c) plus a header per class; C = 1 means no classes.
    """
    m_total = changed_keys.size
    if total == 0 or sample_keys.size == 0 or m_total == 0 or m_total == total:
        return 0, 1
    n = np.bincount(sample_keys, minlength=KEY_VALUES).astype(np.float64) * (total / sample_keys.size)
    m = np.bincount(changed_keys, minlength=KEY_VALUES).astype(np.float64)
    n = np.maximum(n, m)
    cn = np.concatenate([[0.0], np.cumsum(n)])
    cm = np.concatenate([[0.0], np.cumsum(m)])
    best = (float(total * _h(np.array(m_total / total))), 0, 1)
    # Every class of every window at once, (lo, 2 + 4 + 8) columns; each C sums its own columns.
    nc = cn[_EDGE_HI] - cn[_EDGE_LO]
    mc = cm[_EDGE_HI] - cm[_EDGE_LO]
    bits = np.where(nc > 0, nc * _h(mc / np.maximum(nc, 1)), 0.0)
    for classes, (a, b) in _EDGE_COLUMNS.items():
        cost = bits[:, a:b].sum(1) + classes * CLASS_HEADER_BITS
        i = int(np.argmin(cost))
        if cost[i] < best[0]:
            best = (float(cost[i]), i, classes)
    return best[1], best[2]


def _window_edges(classes: int) -> np.ndarray:
    """(lo, C + 1) key edges of each window: class 0 keys <= lo, class i key lo + i, the last keys >= lo + C - 1."""
    lo = np.arange(KEY_VALUES)
    edges = np.minimum(lo[:, None] + np.arange(classes + 1)[None, :], KEY_VALUES)
    edges[:, 0] = 0
    edges[:, -1] = KEY_VALUES
    return edges


_EDGES = [_window_edges(c) for c in CLASS_CHOICES[1:]]
_EDGE_LO = np.concatenate([e[:, :-1] for e in _EDGES], axis=1)  # (lo, 2 + 4 + 8): first key of each class
_EDGE_HI = np.concatenate([e[:, 1:] for e in _EDGES], axis=1)  # one past its last key
_ENDS = np.cumsum([0, *CLASS_CHOICES[1:]]).tolist()
_EDGE_COLUMNS = {c: (_ENDS[i], _ENDS[i + 1]) for i, c in enumerate(CLASS_CHOICES[1:])}


class Selected(NamedTuple):
    """What a segment's select found, in ascending position."""

    pos: np.ndarray  # int64 segment positions, ascending
    order: np.ndarray  # int64: for each, the index of the rank that named it (the ranks' class order)
    old: np.ndarray  # the base's bits there (the pieces' dtype)


def select_positions(pieces: list[np.ndarray], info: DtypeInfo, lo: int, classes: int,
                     ranks: np.ndarray, counts: list[int]) -> tuple[Selected | None, list[int]]:
    """(found, class sizes) for one segment's base: the members with the given
    in-class ranks (counts[c] ascending ranks of class c, classes in order),
    in ascending position with their base bits, and the size of every class
    that has ranks (-1 for the others where the numpy version skips them).
    Found is None when some rank does not fit (beyond its class, or not
    ascending): the caller checks the sizes first, since another base has
    other sizes."""
    _check_window(lo, classes)
    if _compiled(info):
        n = ranks.size
        bits = pieces[0].dtype if pieces else info.np_int
        found = Selected(np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=bits))
        sizes = np.zeros(classes, dtype=np.int64)
        ok = KERNEL.select(pieces, info.width, info.mantissa_bits, _exponent_mask(info), lo, classes,
                           np.ascontiguousarray(ranks, dtype=np.int64), np.asarray(counts, dtype=np.int64),
                           found.pos, found.order, found.old.view(np.uint8), sizes)
        return (found if ok else None), sizes.tolist()
    ci = ClassIndex(pieces, info, lo, classes, needed=[c for c, n in enumerate(counts) if n])
    sizes = [ci.class_size(c) if counts[c] else -1 for c in range(classes)]
    try:
        in_class_order = ci.select_runs(ranks, counts)
    except CorruptData:
        return None, sizes
    order = np.argsort(in_class_order, kind="stable")
    pos = in_class_order[order]
    return Selected(pos, order, gather_sorted(pieces, pos)), sizes


def piece_cuts(pieces: list[np.ndarray], pos: np.ndarray) -> tuple[list[int], list[int]]:
    """(where each piece starts in the pieces' concatenation, where its share of the
    ascending positions `pos` starts), each with one more entry for the end."""
    offsets = np.cumsum([0] + [p.size for p in pieces])
    return offsets.tolist(), np.searchsorted(pos, offsets).tolist()


def gather_sorted(pieces: list[np.ndarray], pos: np.ndarray) -> np.ndarray:
    """The pieces' elements at ascending positions into their concatenation."""
    out = np.empty(pos.size, dtype=pieces[0].dtype if pieces else np.uint8)
    offsets, cuts = piece_cuts(pieces, pos)
    for i, p in enumerate(pieces):
        a, b = cuts[i], cuts[i + 1]
        if b > a:
            np.take(p, pos[a:b] - offsets[i] if i else pos[a:b], out=out[a:b])
    return out


def rank_positions(pieces: list[np.ndarray], info: DtypeInfo, lo: int, classes: int,
                   idx: np.ndarray, cls: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(ranks, class sizes): for each ascending segment position idx[i] of class
    cls[i], how many members of its class come before it; every class's size."""
    _check_window(lo, classes)
    if _compiled(info):
        got_cls = np.empty(idx.size, dtype=np.uint8)
        ranks = np.empty(idx.size, dtype=np.int64)
        sizes = np.zeros(classes, dtype=np.int64)
        KERNEL.rank(pieces, info.width, info.mantissa_bits, _exponent_mask(info), lo, classes,
                    np.ascontiguousarray(idx, dtype=np.int64), got_cls, ranks, sizes)
        return ranks, sizes.tolist()
    counts = np.bincount(cls, minlength=classes).tolist()
    order = np.argsort(cls.astype(np.int8), kind="stable")  # by class, ascending inside: 8-bit keys, a radix sort
    ci = ClassIndex(pieces, info, lo, classes, needed=[c for c in range(classes) if counts[c]])
    ranks = np.empty(idx.size, dtype=np.int64)
    ranks[order] = ci.rank_runs(idx[order], counts)
    return ranks, [ci.class_size(c) if counts[c] else -1 for c in range(classes)]


def _check_window(lo: int, classes: int) -> None:
    if classes not in CLASS_CHOICES:
        raise CorruptData(f"class count: expected one of {CLASS_CHOICES}, found {classes}")
    if not 0 <= lo < KEY_VALUES:
        raise CorruptData(f"class window: expected a start in 0..{KEY_VALUES - 1}, found {lo}")


def class_of_keys(keys: np.ndarray, lo: int, classes: int) -> np.ndarray:
    """Class ids of the given keys (any shape), as int64."""
    return np.clip(keys.astype(np.int64) - lo, 0, classes - 1)


class ClassIndex:
    """Class membership of one segment's base elements, with rank and select per class.

    Built from the base pieces of a segment, read once in runs of CHUNK
    elements into pooled buffers (no fresh N-sized temporaries). Class ids
    are stored as log2(C) packed bit planes. Per class: membership words (64
    elements each), their popcounts, and prefix counts per block of 8 words
    (512 elements); inside a block, rank and select read the 8 popcounts as
    one 64-bit word (SWAR), so the per-class work over the whole segment is a
    few passes over N/64 words. Only classes in `needed` are built (the others
    are never ranked).
    """

    def __init__(self, pieces: list[np.ndarray], info: DtypeInfo, lo: int, classes: int, needed=None):
        _check_window(lo, classes)
        size = sum(p.size for p in pieces)
        self.size = size
        self.classes = classes
        n_words = -(-size // BLOCK) * (BLOCK // 64)
        n_blocks = n_words // 8
        self._n_blocks = n_blocks
        planes = _planes(pieces, info, lo, classes, n_words)
        self._planes = planes
        # The planes hold the low bits of clip(key, lo, lo + C - 1), not of the
        # class id (one pass fewer): class c is the code (lo + c) mod C. A
        # class's word is the AND of each plane or its complement, i.e. of the
        # planes XOR these masks.
        codes = [(lo + c) & (classes - 1) for c in range(classes)]
        self._codes = codes
        self._flip = [np.array([0 if code >> j & 1 else _FULL for code in codes], dtype=np.uint64) for j in range(len(planes))]
        self.needed = list(range(classes)) if needed is None else sorted(set(int(c) for c in needed))
        counts = _word_counts(planes, size, n_words)
        # per block: its 8 word popcounts as bytes
        octets = np.empty((len(self.needed), n_blocks), dtype=np.uint64)
        for i, c in enumerate(self.needed):
            octets[i] = counts[codes[c]].view(np.uint64)
        totals = _byte_sums(octets).astype(np.int64).ravel()
        # One flat prefix over all needed classes (torch's 1-D cumsum is serial
        # and several times faster than numpy's); each class's run starts
        # where the previous one ends, so one searchsorted serves them all.
        self._through = torch.cumsum(torch.from_numpy(totals), 0).numpy()  # members up to each block's end
        self._before = self._through - totals
        self._octets = octets.ravel()
        self._row_of = np.full(classes, -1, dtype=np.int64)  # class -> row in the flat arrays, -1 if not built
        self._row_of[self.needed] = np.arange(len(self.needed))
        self._start_of = np.zeros(classes, dtype=np.int64)  # class -> members of the classes before it
        self._end_of = np.zeros(classes, dtype=np.int64)
        if n_blocks:
            rows = np.arange(len(self.needed))
            self._start_of[self.needed] = self._before[rows * n_blocks]
            self._end_of[self.needed] = self._through[rows * n_blocks + n_blocks - 1]

    def class_size(self, c: int) -> int:
        if self._row_of[c] < 0:
            raise ValueError(f"class index: class {c} is outside `needed`")
        return int(self._end_of[c] - self._start_of[c])

    def rank_runs(self, idx: np.ndarray, counts: list[int]) -> np.ndarray:
        """Rank inside its class (members of that class before it) of each position, given
        as runs: counts[c] ascending positions of class c, classes in order."""
        classes = np.array([c for c, n in enumerate(counts) if n], dtype=np.int64)
        counts = [counts[c] for c in classes.tolist()]
        if (self._row_of[classes] < 0).any():
            raise ValueError("class index: a class outside `needed` was asked for")
        w = idx >> 6
        flat = np.repeat(self._row_of[classes] * self._n_blocks, counts) + (w >> 3)
        lower = (np.uint64(1) << ((w & 7) << 3).astype(np.uint64)) - np.uint64(1)  # the block's words before w
        before_word = _byte_sums(np.take(self._octets, flat) & lower).astype(np.int64)
        below = (np.uint64(1) << (idx & 63).astype(np.uint64)) - np.uint64(1)
        before_class = np.take(self._before, flat) - np.repeat(self._start_of[classes], counts)
        return before_class + before_word + np.bitwise_count(self._run_words(w, classes, counts) & below).astype(np.int64)

    def _run_words(self, w: np.ndarray, classes: np.ndarray, counts: list[int]) -> np.ndarray:
        """`_words` for classes given as runs: per-class masks repeated, not gathered."""
        x = None
        for plane, flip in zip(self._planes, self._flip):
            term = np.take(plane, w) ^ np.repeat(flip[classes], counts)
            x = term if x is None else np.bitwise_and(x, term, out=x)
        return np.full(w.size, _FULL) if x is None else x

    def select_runs(self, ranks: np.ndarray, counts: list[int]) -> np.ndarray:
        """Positions of the members with the given ranks (ascending, 0-based), given as
        runs: counts[c] ranks of class c, classes in order; the result in the same order."""
        live = [c for c, n in enumerate(counts) if n]
        return self._select(ranks, live, [counts[c] for c in live])

    def _select(self, ranks: np.ndarray, classes: list[int], counts: list[int]) -> np.ndarray:
        if not classes:
            return np.zeros(0, dtype=np.int64)
        off = 0
        for c, n in zip(classes, counts):
            size = self.class_size(c)
            if ranks[off] < 0 or ranks[off + n - 1] >= size:
                raise CorruptData(f"position rank: expected < {size} in class {c}, found {int(ranks[off + n - 1])}")
            off += n
        if ranks.size * DENSE_SELECT > self.size:
            order, first = self._by_class()
            return np.take(order, ranks + np.repeat(first[np.array(classes, dtype=np.int64)], counts))
        return self._select_sparse(ranks, classes, counts)

    def _by_class(self) -> tuple[np.ndarray, np.ndarray]:
        """(every position, grouped by class and ascending inside each; where each
        class starts in it). One radix sort of the per-element plane codes."""
        codes = np.zeros(self.size, dtype=np.uint8)
        for j, plane in enumerate(self._planes):
            bits = np.unpackbits(plane.view(np.uint8), count=self.size, bitorder="little")
            codes |= bits << np.uint8(j)
        order = np.argsort(codes, kind="stable")  # radix sort for 8-bit keys: linear
        sizes = np.bincount(codes, minlength=self.classes)
        return order, (np.cumsum(sizes) - sizes)[self._codes]

    def _select_sparse(self, ranks: np.ndarray, classes: list[int], counts: list[int]) -> np.ndarray:
        # Per-class constants spread over each class's run (np.repeat), not gathered per rank.
        classes = np.array(classes, dtype=np.int64)
        target = ranks + np.repeat(self._start_of[classes], counts)  # members of the classes before, plus the rank
        row_words = np.repeat(self._row_of[classes] * (self._n_blocks << 3), counts)
        flips = [np.repeat(flip[classes], counts) for flip in self._flip]
        out = np.empty(target.size, dtype=np.int64)
        merged = None
        if classes.size == 1 or (classes[1:] > classes[:-1]).all():
            # The targets ascend, and so do the block ends: one stable sort of
            # both (timsort merges the two runs in linear time) gives every
            # target's block, where a binary search per target pays ~20 ns.
            order = np.argsort(np.concatenate([self._through, target]), kind="stable")
            merged = np.flatnonzero(order >= self._through.size) - np.arange(target.size)
        # In runs of RUN_RANKS: a dozen passes over each run's temporaries stay in L2.
        for a in range(0, target.size, RUN_RANKS):
            t = target[a : a + RUN_RANKS]
            flat = np.searchsorted(self._through, t, side="right") if merged is None else merged[a : a + RUN_RANKS]
            j, k_word = _select_in_octets(np.take(self._octets, flat), (t - np.take(self._before, flat)).astype(np.uint64))
            # flat = row * n_blocks + block; the word is block * 8 + j
            w = (flat << 3) + j - row_words[a : a + RUN_RANKS]
            x = np.full(w.size, _FULL) if not self._planes else None
            for plane, flip in zip(self._planes, flips):
                term = np.take(plane, w) ^ flip[a : a + RUN_RANKS]
                x = term if x is None else np.bitwise_and(x, term, out=x)
            np.add(w << 6, select_in_words(x, k_word), out=out[a : a + RUN_RANKS])
        return out


def _word_counts(planes: list[np.ndarray], size: int, n_words: int) -> list[np.ndarray]:
    """Per code x: how many of each word's (valid) elements have plane bits x, as uint8.

    Popcounts of the ANDs of every nonempty set S of planes (2^P - 1 of
    them; S = {} counts the valid elements), then the Möbius transform over
    supersets turns "all bits of S set" into "bits exactly x": for P = 3
    that is 4 ANDs, 7 popcounts and 12 byte subtractions, against 16 ANDs
    and 8 popcounts for the 8 class words one by one.
    """
    n_planes = len(planes)
    valid = np.zeros(n_words, dtype=np.uint8)
    valid[: size // 64] = 64
    if size % 64:
        valid[size // 64] = size % 64
    counts, ands = [valid], [None]
    for s in range(1, 1 << n_planes):
        high = s.bit_length() - 1
        rest = s & ~(1 << high)
        word = planes[high] if rest == 0 else np.bitwise_and(ands[rest], planes[high])
        ands.append(word)
        counts.append(np.bitwise_count(word))
    for j in range(n_planes):  # uint8 wraps in between; the results are exact counts
        for s in range(1 << n_planes):
            if not s >> j & 1:
                np.subtract(counts[s], counts[s | 1 << j], out=counts[s])
    return counts


CHUNK = 1 << 20  # elements per pass when building planes (1M measured fastest: fewer calls than L2-sized runs)


class BufferPool:
    """Byte buffers reused across calls and threads.

    A fresh N-byte temporary per call is page-faulted in again whenever glibc
    has trimmed the last one (about 1 µs a page here: 3 ms for a 4M-element
    segment's keys). The pool keeps at most `keep` buffers of at most
    `keep_bytes` each; `take` hands out one of at least n bytes (the caller
    slices it) and `give` returns it.
    """

    def __init__(self, keep: int = 4, keep_bytes: int = 1 << 26):
        self._free: list[np.ndarray] = []
        self._keep = keep
        self._keep_bytes = keep_bytes  # larger buffers (huge segments) are not kept
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= n]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].size))
        return np.empty(max(n, 1 << 16), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        if buf.size > self._keep_bytes:
            return
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:  # drop the smallest (by index: arrays do not compare with ==)
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].size))

    @contextlib.contextmanager
    def scratch(self, n: int):
        buf = self.take(n)
        try:
            yield buf[:n]
        finally:
            self.give(buf)


POOL = BufferPool()


def _keys_into(bits: np.ndarray, info: DtypeInfo, out: np.ndarray) -> None:
    # An arithmetic shift leaves sign copies above the exponent; for 8-bit
    # exponents (bf16, fp32) the cast to uint8 drops them exactly.
    # f64's 11-bit exponent keeps its low 8 bits the same way; its key_xor is applied after.
    np.right_shift(bits, info.mantissa_bits, out=out, casting="unsafe")
    mask = _exponent_mask(info)
    if mask < 0xFF:
        np.bitwise_and(out, mask, out=out)
    if info.key_xor:
        np.bitwise_xor(out, info.key_xor, out=out)


def _key_chunks(pieces: list[np.ndarray], info: DtypeInfo, buf: np.ndarray):
    """(start, keys) for consecutive runs of the concatenated pieces, computed into
    `buf` (a multiple of 8 long, or the whole segment): all runs but the last fill it."""
    start = fill = 0
    for p in pieces:
        pos = 0
        while pos < p.size:
            take = min(buf.size - fill, p.size - pos)
            _keys_into(p[pos : pos + take], info, buf[fill : fill + take])
            fill += take
            pos += take
            if fill == buf.size:
                yield start, buf
                start, fill = start + fill, 0
    if fill:
        yield start, buf[:fill]


def _planes(pieces: list[np.ndarray], info: DtypeInfo, lo: int, classes: int, n_words: int) -> list[np.ndarray]:
    """Bit planes of the low log2(C) bits of clip(key, lo, lo + C - 1), n_words 64-bit words each."""
    n_planes = classes.bit_length() - 1
    if n_planes == 0:
        return []
    planes = [np.zeros(n_words * 8, dtype=np.uint8) for _ in range(n_planes)]
    hi = min(KEY_VALUES - 1, lo + classes - 1)
    step = min(CHUNK, sum(p.size for p in pieces))
    with POOL.scratch(step) as buf, POOL.scratch(step) as temp:
        for start, k in _key_chunks(pieces, info, buf):
            np.clip(k, lo, hi, out=k)
            t = temp[: k.size]
            for j, plane in enumerate(planes):
                np.bitwise_and(k, 1 << j, out=t)
                plane[start // 8 : start // 8 + (k.size + 7) // 8] = np.packbits(t, bitorder="little")
    return [p.view(np.uint64) for p in planes]


_LANES16_LOW = np.uint64(0x00FF00FF00FF00FF)
_LANES16_ONE = np.uint64(0x0001000100010001)
_LANES16_HIGH = np.uint64(0x8000800080008000)


def _byte_sums(x: np.ndarray) -> np.ndarray:
    """Sum of the 8 bytes of each uint64 (bytes up to 64: no overflow in 16-bit lanes)."""
    pairs = (x & _LANES16_LOW) + ((x >> np.uint64(8)) & _LANES16_LOW)
    return (pairs * _LANES16_ONE) >> np.uint64(48)


def _select_in_octets(octet: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For 8 byte counts per uint64 (each ≤ 64) and k below their sum: the byte j
    holding the k-th unit and k minus the counts before byte j."""
    odd = (octet >> np.uint64(8)) & _LANES16_LOW  # counts of bytes 1, 3, 5, 7 in 16-bit lanes
    through_odd = ((octet & _LANES16_LOW) + odd) * _LANES16_ONE  # prefix through bytes 1, 3, 5, 7
    k_lanes = (k * _LANES16_ONE) | _LANES16_HIGH
    passed = (np.bitwise_count((k_lanes - through_odd) & _LANES16_HIGH)
              + np.bitwise_count((k_lanes - (through_odd - odd)) & _LANES16_HIGH))  # bytes with prefix ≤ k
    below = (np.uint64(1) << (passed << np.uint64(3))) - np.uint64(1)  # bytes before j (j ≤ 7)
    return passed.astype(np.int64), k - _byte_sums(octet & below)


def select_in_words(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Index of the k-th (0-based) set bit of each 64-bit word x (k < popcount(x))."""
    # Per-byte popcounts, then inclusive prefix sums across the bytes (≤ 64,
    # no carries); the target byte is the number of bytes whose prefix is ≤ k.
    counts = np.bitwise_count(x.view(np.uint8)).view(np.uint64)
    prefix = counts * _BYTES_ONE
    le = ((k * _BYTES_ONE) | _BYTES_HIGH) - prefix
    shift = np.bitwise_count(le & _BYTES_HIGH).astype(np.uint64) << np.uint64(3)  # 8 × the target byte
    before = ((prefix << np.uint64(8)) >> shift) & np.uint64(0xFF)
    within = (x >> shift) & np.uint64(0xFF)
    return (shift + np.take(_SELECT8_FLAT, (within << np.uint64(3)) | (k - before))).astype(np.int64)
