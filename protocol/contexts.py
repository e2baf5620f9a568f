"""Context classes for change positions, computed from base weights both sides hold.

Owns: the class key of a float element (its exponent field), choosing a class
window (encoder side), and the class index of a segment's base: membership
bitmaps with rank and select inside a class. Pure numpy/torch, no I/O.

Why: the probability that a served element changes in one optimizer step
halves with each step of the exponent of its old value (the ulp doubles, the
Adam step does not). Coding positions as gaps *inside* a class of equal
exponent pays ~N·Σ H(p_class) instead of N·H(p): ~30 % fewer position bits on
real AdamW checkpoints.

Classes are a window of unit exponent steps: class = clip(exponent - lo, 0,
C - 1) with C in {1, 2, 4, 8}. On real pairs this window costs within 0.5 % of
the best free choice of class boundaries, and it is cheap where cost matters
(the decoder builds it over every base element): the class id is one clip of
a byte, stored as log2(C) packed bit planes, and a class's membership words
are ANDs of planes, 64 elements per operation. Rank and select go through
popcounts and per-word prefix counts, so nothing sorts the N elements.
"""

from __future__ import annotations

import numpy as np
import torch

from .dtypes import DtypeInfo
from .errors import CorruptData

MAX_CLASSES = 8
CLASS_CHOICES = (1, 2, 4, 8)
CLASS_HEADER_BITS = 96  # what a class costs in the container, for the window choice
SAMPLE_TARGET = 1 << 16  # base elements sampled per segment to estimate class sizes
KEY_VALUES = 256

_FULL = np.uint64(0xFFFFFFFFFFFFFFFF)
_BYTES_ONE = np.uint64(0x0101010101010101)
_BYTES_HIGH = np.uint64(0x8080808080808080)
_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
# _SELECT8[byte, j] = index of the j-th set bit of byte
_SELECT8 = np.zeros((256, 8), dtype=np.uint8)
for _b in range(256):
    _ones = [i for i in range(8) if _b >> i & 1]
    _SELECT8[_b, : len(_ones)] = _ones


def has_classes(info: DtypeInfo) -> bool:
    """Floats have an exponent to condition on; integer dtypes get one class."""
    return info.is_float


def _exponent_mask(info: DtypeInfo) -> int:
    return (1 << (info.bits - 1 - info.mantissa_bits)) - 1


def class_keys(pieces: list[np.ndarray], info: DtypeInfo) -> np.ndarray:
    """The exponent field of every element of the concatenated pieces, as uint8.

    The result is padded to a multiple of 64 elements (the padding is zero);
    the pieces are read once, nothing is concatenated.
    """
    n = sum(p.size for p in pieces)
    keys = np.zeros(-(-n // 64) * 64, dtype=np.uint8)
    off = 0
    for p in pieces:
        # An arithmetic shift leaves sign copies above the exponent; for 8-bit
        # exponents (bf16, fp32) the cast to uint8 drops them exactly.
        np.right_shift(p, info.mantissa_bits, out=keys[off : off + p.size], casting="unsafe")
        off += p.size
    mask = _exponent_mask(info)
    if mask < 0xFF:
        np.bitwise_and(keys, mask, out=keys)
    return keys


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
    lo = np.arange(KEY_VALUES)
    for classes in CLASS_CHOICES[1:]:
        # class 0: keys <= lo; class i: key lo + i; last class: keys >= lo + C - 1
        edges = np.minimum(lo[:, None] + np.arange(classes + 1)[None, :], KEY_VALUES)  # (lo, C + 1)
        edges[:, 0] = 0
        edges[:, -1] = KEY_VALUES
        nc = np.diff(cn[edges], axis=1)
        mc = np.diff(cm[edges], axis=1)
        cost = np.where(nc > 0, nc * _h(mc / np.maximum(nc, 1)), 0.0).sum(1) + classes * CLASS_HEADER_BITS
        i = int(np.argmin(cost))
        if cost[i] < best[0]:
            best = (float(cost[i]), i, classes)
    return best[1], best[2]


def class_of_keys(keys: np.ndarray, lo: int, classes: int) -> np.ndarray:
    """Class ids of the given keys (any shape), as int64."""
    return np.clip(keys.astype(np.int64) - lo, 0, classes - 1)


class ClassIndex:
    """Class membership of one segment's base elements, with rank and select per class.

    `keys` (from `class_keys`, padded to 64) is overwritten with class ids.
    Only classes in `needed` get prefix counts (the others are never ranked).
    """

    def __init__(self, keys: np.ndarray, size: int, lo: int, classes: int, needed=None):
        if classes not in CLASS_CHOICES:
            raise CorruptData(f"class count: expected one of {CLASS_CHOICES}, found {classes}")
        if not 0 <= lo < KEY_VALUES:
            raise CorruptData(f"class window: expected a start in 0..{KEY_VALUES - 1}, found {lo}")
        self.size = size
        self.classes = classes
        n_words = keys.size // 64
        valid_last = _FULL if size % 64 == 0 else np.uint64((1 << (size % 64)) - 1)
        n_planes = classes.bit_length() - 1
        planes = []
        if n_planes:
            ids = np.clip(keys, lo, lo + classes - 1, out=keys)
            np.subtract(ids, lo, out=ids, casting="unsafe")
            scratch = np.empty_like(ids)
            for j in range(n_planes):
                np.bitwise_and(ids, 1 << j, out=scratch)
                planes.append(np.packbits(scratch, bitorder="little").view(np.uint64))
        inverted = [~p for p in planes]
        needed = range(classes) if needed is None else sorted(set(needed))
        self.words: dict[int, np.ndarray] = {}
        for c in needed:
            if n_planes == 0:
                w = np.full(n_words, _FULL)
            else:
                terms = [planes[j] if c >> j & 1 else inverted[j] for j in range(n_planes)]
                w = terms[0] & terms[1] if n_planes > 1 else terms[0].copy()
                for t in terms[2:]:
                    w &= t
            if n_words:
                w[-1] &= valid_last
            self.words[c] = w
        self._pop: dict[int, np.ndarray] = {}
        self._cum: dict[int, np.ndarray] = {}
        for c in needed:
            pop = np.bitwise_count(self.words[c]).astype(np.int64)
            self._pop[c] = pop
            # torch's 1-D cumsum is serial and ~5x faster than numpy's here.
            self._cum[c] = torch.cumsum(torch.from_numpy(pop), 0).numpy()

    def class_size(self, c: int) -> int:
        cum = self._cum[c]
        return int(cum[-1]) if cum.size else 0

    def rank(self, c: int, idx: np.ndarray) -> np.ndarray:
        """Number of class-c elements strictly before each position in idx (all of class c)."""
        w = idx >> 6
        below = (np.uint64(1) << (idx & 63).astype(np.uint64)) - np.uint64(1)
        before = self._cum[c][w] - self._pop[c][w]
        return before + np.bitwise_count(self.words[c][w] & below).astype(np.int64)

    def select(self, ranks: dict[int, np.ndarray]) -> np.ndarray:
        """Positions of the members with the given ranks (ascending, 0-based) of each class.

        The result lists the classes in the order of `ranks`, ascending inside each.
        """
        words, ks, at = [], [], []
        for c, r in ranks.items():
            if r.size == 0:
                continue
            size = self.class_size(c)
            if r[0] < 0 or r[-1] >= size:
                raise CorruptData(f"position rank: expected < {size} in class {c}, found {int(r.max())}")
            cum = self._cum[c]
            w = np.searchsorted(cum, r, side="right")
            ks.append(r - (cum[w] - self._pop[c][w]))
            words.append(self.words[c][w])
            at.append(w)
        if not at:
            return np.zeros(0, dtype=np.int64)
        w, k, x = np.concatenate(at), np.concatenate(ks).astype(np.uint64), np.concatenate(words)
        return w * 64 + select_in_words(x, k)


def select_in_words(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Index of the k-th (0-based) set bit of each 64-bit word x (k < popcount(x))."""
    # Per-byte popcounts, then inclusive prefix sums across the bytes (≤ 64,
    # no carries); the target byte is the number of bytes whose prefix is ≤ k.
    counts = np.bitwise_count(x.view(np.uint8)).view(np.uint64)
    prefix = counts * _BYTES_ONE
    le = ((k * _BYTES_ONE) | _BYTES_HIGH) - prefix
    byte = np.bitwise_count(le & _BYTES_HIGH).astype(np.uint64)
    before = ((prefix << np.uint64(8)) >> (byte * np.uint64(8))) & np.uint64(0xFF)
    within = (x >> (byte * np.uint64(8))) & np.uint64(0xFF)
    return (byte * np.uint64(8)).astype(np.int64) + _SELECT8[within, k - before].astype(np.int64)
