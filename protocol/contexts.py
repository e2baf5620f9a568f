"""Context classes for change positions, computed from base weights both sides hold.

Owns: choosing magnitude thresholds (encoder side), splitting a base array into
classes by those thresholds, and rank/select inside a class with bitmaps.

Why: the probability that a served element changes in one optimizer step falls
with the magnitude of its old value (the ulp grows with the exponent while the
Adam step does not). Coding positions as gaps *inside* a class of similar
magnitude pays ~N·Σ H(p_class) instead of N·H(p): ~30 % fewer position bits on
real AdamW checkpoints. Classes are contiguous magnitude ranges so that class
membership is a few vectorized comparisons; rank and select go through packed
64-bit words with popcounts, so nothing sorts the N elements.
"""

from __future__ import annotations

import numpy as np

from .errors import CorruptData

MAX_CLASSES = 8
CLASS_HEADER_BITS = 96  # what a class costs in the container, for the split decision
SAMPLE_TARGET = 1 << 16  # elements sampled per segment to estimate class sizes

_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
# _SELECT8[byte, j] = index of the j-th set bit of byte
_SELECT8 = np.zeros((256, 8), dtype=np.uint8)
for _b in range(256):
    _ones = [i for i in range(8) if _b >> i & 1]
    _SELECT8[_b, : len(_ones)] = _ones


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def _class_cost(n: np.ndarray, m: np.ndarray) -> float:
    ok = n > 0
    return float((n[ok] * _h(m[ok] / n[ok])).sum())


def choose_thresholds(sample_mag: np.ndarray, total: int, changed_mag: np.ndarray, shift: int) -> list[int]:
    """Magnitude thresholds (ascending) splitting elements into classes of similar change rate.

    Works on histograms of the context key (magnitude >> shift): a sample of
    the `total` elements (`sample_mag`, e.g. strided) and every changed element. Starts from one class
    per key and greedily merges the adjacent pair that costs least, while the
    saving of keeping a split stays below what its header costs.
    """
    n_total = total
    if n_total == 0 or sample_mag.size == 0 or changed_mag.size == 0 or changed_mag.size == n_total:
        return []
    keys_all = (sample_mag >> shift).astype(np.int64)
    keys_chg = (changed_mag >> shift).astype(np.int64)
    top = int(max(keys_all.max(initial=0), keys_chg.max(initial=0))) + 1
    n = np.bincount(keys_all, minlength=top).astype(np.float64) * (n_total / keys_all.size)
    m = np.bincount(keys_chg, minlength=top).astype(np.float64)
    n = np.maximum(n, m)
    present = np.flatnonzero(n > 0)
    # groups: list of [first_key, n, m] over contiguous key ranges
    groups = [[int(k), n[k], m[k]] for k in present]
    while len(groups) > 1:
        gn = np.array([g[1] for g in groups])
        gm = np.array([g[2] for g in groups])
        single = gn * _h(gm / np.maximum(gn, 1))
        mn, mm = gn[:-1] + gn[1:], gm[:-1] + gm[1:]
        merged = mn * _h(mm / np.maximum(mn, 1))
        loss = merged - single[:-1] - single[1:]
        i = int(np.argmin(loss))
        if len(groups) <= MAX_CLASSES and loss[i] > CLASS_HEADER_BITS:
            break
        groups[i] = [groups[i][0], mn[i], mm[i]]
        del groups[i + 1]
    return [g[0] << shift for g in groups[1:]]


class ClassIndex:
    """Class membership bitmaps of one base array, with rank and select per class."""

    def __init__(self, mag: np.ndarray, thresholds: list[int]):
        self.size = mag.size
        self.thresholds = thresholds
        n_words = (self.size + 63) // 64
        below_prev = np.zeros(n_words, dtype=np.uint64)
        valid = np.full(n_words, np.uint64(0xFFFFFFFFFFFFFFFF))
        if self.size % 64:
            valid[-1] = np.uint64((1 << (self.size % 64)) - 1)
        self.words: list[np.ndarray] = []
        for t in list(thresholds) + [None]:
            if t is None:
                below = valid
            else:
                bits = np.packbits(mag < t, bitorder="little")
                below = np.zeros(n_words * 8, dtype=np.uint8)
                below[: bits.size] = bits
                below = below.view(np.uint64)
            self.words.append(below & ~below_prev)
            below_prev = below
        self._pop = [np.bitwise_count(w).astype(np.int64) for w in self.words]
        self._cum = [np.cumsum(p) for p in self._pop]

    @property
    def classes(self) -> int:
        return len(self.words)

    def class_size(self, c: int) -> int:
        return int(self._cum[c][-1]) if self.size else 0

    def class_of(self, idx: np.ndarray) -> np.ndarray:
        w, b = idx >> 6, (idx & 63).astype(np.uint64)
        out = np.zeros(idx.size, dtype=np.int64)
        for c, words in enumerate(self.words):
            hit = (words[w] >> b) & np.uint64(1)
            out[hit.astype(bool)] = c
        return out

    def rank(self, c: int, idx: np.ndarray) -> np.ndarray:
        """Number of class-c elements strictly before each position in idx."""
        w = idx >> 6
        below = (np.uint64(1) << (idx & 63).astype(np.uint64)) - np.uint64(1)
        before = self._cum[c][w] - self._pop[c][w]
        return before + np.bitwise_count(self.words[c][w] & below).astype(np.int64)

    def select(self, c: int, ranks: np.ndarray) -> np.ndarray:
        """Positions of the class-c elements with the given ranks (0-based)."""
        if ranks.size == 0:
            return np.zeros(0, dtype=np.int64)
        size = self.class_size(c)
        if ranks[0] < 0 or ranks[-1] >= size:
            raise CorruptData(f"position rank: expected < {size} in class {c}, found {int(ranks.max())}")
        cum = self._cum[c]
        w = np.searchsorted(cum, ranks, side="right")
        k = ranks - (cum[w] - self._pop[c][w])
        by = self.words[c][w].view(np.uint8).reshape(-1, 8)
        pc = _POP8[by].astype(np.int64)
        cb = np.cumsum(pc, axis=1)
        b = (cb <= k[:, None]).sum(1)
        rows = np.arange(ranks.size)
        k2 = k - (cb[rows, b] - pc[rows, b])
        return w * 64 + b * 8 + _SELECT8[by[rows, b], k2].astype(np.int64)
