"""Vectorized Golomb-Rice coding of non-negative integer arrays, and raw bit fields.

Owns two bit layouts, both built and read with a handful of numpy passes and
no per-element Python (building and reading go through protocol/_kernels.c
where it built, the numpy writers and readers staying as reference and
fallback):

- raw fields (`pack_bits`/`unpack_bits`): value i's low widths[i] bits,
  least significant first, back to back, packed little-endian;
- a Rice blob (`pack`/`unpack`), parameter k per value (one int, or an array
  so that several classes share one blob): [remainders][unary][escapes].
  Remainders: each value's low k bits as a raw field. Unary: per value
  min(v >> k, ESCAPE_Q) one-bits then a zero-bit. Escapes: values whose
  quotient reaches ESCAPE_Q, raw uint64 little-endian. Each part starts on a
  byte; the reader knows the count and the k's, so no lengths are stored.

Rice codes are within a few percent of the entropy of geometric sources,
which is what gaps between changes inside one context class are.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .errors import CorruptData

try:  # compiled decoders of the same layouts (protocol/_kernels.c; optional, see setup.py)
    from . import _kernels as KERNEL
except ImportError:
    KERNEL = None

ESCAPE_Q = 40  # protocol/_kernels.c has the same two limits
MAX_K = 40
_NO_WIDTHS = np.zeros(0, dtype=np.int64)


def _k_range(mean: float) -> tuple[int, int]:
    """The Rice parameters worth trying for values of this mean: the geometric
    optimum's k (about log2(0.69 mean)) and its neighbours."""
    guess = min(MAX_K, max(0, int(np.log2(mean * 0.69 + 1e-9))) if mean > 1 else 0)
    return max(0, guess - 1), min(MAX_K, guess + 1)


def best_k_and_bits(values: np.ndarray) -> tuple[int, int]:
    """(k, exact bits of `pack(values, k)` before padding) for the best k next to the mean's."""
    if values.size == 0:
        return 0, 0
    k_lo, k_hi = _k_range(float(values.sum(dtype=np.float64)) / values.size)
    escapes = int(values.max()) >> k_lo >= ESCAPE_Q  # else no k here escapes: one sum per k
    q = values >> np.uint64(k_lo)
    best = None
    for k in range(k_lo, k_hi + 1):
        if k > k_lo:
            np.right_shift(q, np.uint64(1), out=q)
        if escapes:
            esc = int(np.count_nonzero(q >= ESCAPE_Q))
            cost = int(np.minimum(q, np.uint64(ESCAPE_Q)).sum()) + 64 * esc
        else:
            cost = int(q.sum())
        cost += values.size * (1 + k)
        if best is None or cost < best[1]:
            best = (k, cost)
    return best


def best_k_runs(values: np.ndarray, counts: list[int]) -> list[int]:
    """`best_k_and_bits(run)[0]` for each run of `values` (counts[i] values each, all > 0).

    The same candidates (the mean's k and its neighbours) and the same
    choice, with each step one pass over all runs (np.add.reduceat) instead
    of a round of small passes per run.
    """
    starts = np.cumsum([0] + counts[:-1])
    sums = np.add.reduceat(values, starts).tolist()  # exact: float64 sums of these integers are exact too
    tops = np.maximum.reduceat(values, starts).tolist()
    k_lo, k_hi = zip(*(_k_range(float(s) / n) for s, n in zip(sums, counts)))
    if any(top >> k >= ESCAPE_Q for top, k in zip(tops, k_lo)):  # escapes: the plain path
        return [best_k_and_bits(r)[0] for r in np.split(values, np.cumsum(counts)[:-1])]
    q = values >> np.repeat(np.array(k_lo, dtype=np.uint64), counts)
    best = [None] * len(counts)
    for step in range(3):
        if step:
            np.right_shift(q, np.uint64(1), out=q)
        total = np.add.reduceat(q, starts).tolist()
        for i, (t, n) in enumerate(zip(total, counts)):
            k = k_lo[i] + step
            if k > k_hi[i]:
                continue
            cost = t + n * (1 + k)
            if best[i] is None or cost < best[i][1]:
                best[i] = (k, cost)
    return [b[0] for b in best]


def cost_bits(values: np.ndarray, k: int) -> int:
    """Exact size in bits of `pack(values, k)` before byte padding."""
    q = values >> np.uint64(k)
    esc = int((q >= ESCAPE_Q).sum())
    return int(np.minimum(q, ESCAPE_Q).sum()) + values.size * (1 + k) + 64 * esc


_MASKS = np.array([(1 << w) - 1 for w in range(65)], dtype=np.uint64)  # numpy shifts by ≥ 64 give 0


def cumsum(x: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums of a 1-D int64 (or uint64, modular) array.

    numpy's integer cumsum is a serial loop at ~2.5 ns an element here;
    torch's is 3-5x faster on the 10^4-10^6 element arrays of a segment.
    """
    out = torch.cumsum(torch.from_numpy(np.ascontiguousarray(x).view(np.int64)), 0).numpy()
    return out.view(x.dtype) if x.dtype == np.uint64 else out


def cumsum_in_place(x: np.ndarray) -> np.ndarray:
    """`cumsum` written over a contiguous int64 `x` (no new array); returns x."""
    torch.from_numpy(x).cumsum_(0)
    return x


def _offsets(widths: np.ndarray | int, count: int) -> tuple[np.ndarray | int, np.ndarray, int]:
    """(widths, bit offsets, total bits) of `count` fields."""
    if np.ndim(widths) == 0:
        w = int(widths)
        return w, np.arange(count, dtype=np.int64) * w, w * count
    w = np.asarray(widths, dtype=np.int64)
    ends = cumsum(w)
    total = int(ends[-1]) if count else 0
    return w, ends - w, total


def pack_bits(values: np.ndarray, widths: np.ndarray | int) -> bytes:
    """The low widths[i] (≤ 64) bits of each value, back to back, little-endian."""
    if KERNEL is not None:
        return KERNEL.pack_bits(np.ascontiguousarray(values, dtype=np.uint64), *_kernel_widths(widths))
    return _pack_bits_numpy(values, widths)


def _kernel_widths(widths: np.ndarray | int) -> tuple[np.ndarray, int]:
    """How the compiled coders take widths (or Rice k's): per value, or none and one for all."""
    if np.ndim(widths) == 0:
        return _NO_WIDTHS, int(widths)
    return np.ascontiguousarray(widths, dtype=np.int64), 0


def _pack_bits_numpy(values: np.ndarray, widths: np.ndarray | int) -> bytes:
    v = np.asarray(values, dtype=np.uint64)
    w, off, total = _offsets(widths, v.size)
    if total == 0:
        return b""
    # Each field lands in one 64-bit word, or straddles two: OR the low parts
    # per word (fields sharing a word are adjacent), then the spills.
    shift = (off & 63).astype(np.uint64)
    v = v & _MASKS[w]
    word = off >> 6
    words = np.zeros((total + 63) // 64 + 1, dtype=np.uint64)
    starts = np.flatnonzero(np.diff(word, prepend=-1))
    words[word[starts]] = np.bitwise_or.reduceat(v << shift, starts)
    spill = shift > np.uint64(64) - np.asarray(w, dtype=np.uint64)
    words[word[spill] + 1] |= v[spill] >> (np.uint64(64) - shift[spill])
    return words.astype("<u8").tobytes()[: (total + 7) // 8]


_FAST_WIDTH = 57  # a field this wide, at any bit offset, lies inside the 8 bytes from its first byte


def _unaligned_words(data: bytes) -> np.ndarray:
    """w[i] = the 8 bytes of `data` from byte i as a little-endian uint64 (zeros past the end).

    A strided view (stride 1 byte), so a field of up to 57 bits at bit
    offset o is (w[o >> 3] >> (o & 7)) & mask: one gather instead of two.
    """
    buf = np.zeros(len(data) + 8, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return np.ndarray(shape=(len(data) + 1,), dtype="<u8", buffer=buf, strides=(1,))


def unpack_bits(data: bytes, widths: np.ndarray | int, count: int) -> np.ndarray:
    """Inverse of `pack_bits`; `data` must be exactly the packed bytes."""
    if KERNEL is not None:
        out = np.empty(count, dtype=np.uint64)
        try:
            KERNEL.unpack_bits(data, *_kernel_widths(widths), count, out)
        except ValueError as e:
            raise CorruptData(str(e)) from None
        return out
    return _unpack_bits_numpy(data, widths, count)


def _unpack_bits_numpy(data: bytes, widths: np.ndarray | int, count: int) -> np.ndarray:
    if count == 0:
        if data:
            raise CorruptData(f"raw bit field: expected 0 bytes for no values, found {len(data)}")
        return np.zeros(0, dtype=np.uint64)
    w, off, total = _offsets(widths, count)
    if len(data) != (total + 7) // 8:
        raise CorruptData(f"raw bit field: expected {(total + 7) // 8} bytes, found {len(data)}")
    if total == 0:
        return np.zeros(count, dtype=np.uint64)
    if total % 8 and data[-1] >> (total % 8):
        raise CorruptData("raw bit field: nonzero padding after the last value")
    if (w if np.ndim(w) == 0 else int(w.max())) <= _FAST_WIDTH:
        return (_unaligned_words(data)[off >> 3] >> (off & 7).astype(np.uint64)) & _MASKS[w]
    padded = np.zeros((total + 63) // 64 + 2, dtype="<u8")
    padded.view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    words = padded.astype(np.uint64)
    word, shift = off >> 6, (off & 63).astype(np.uint64)
    # numpy's uint64 shifts by 64 give 0, so a field inside one word takes nothing from the next
    return ((words[word] >> shift) | (words[word + 1] << (np.uint64(64) - shift))) & _MASKS[w]


def pack(values: np.ndarray, k: np.ndarray | int) -> bytes:
    """Rice blob of `values` with parameter k (an int, or one per value, 0..MAX_K)."""
    if KERNEL is not None:
        return KERNEL.rice_pack(np.ascontiguousarray(values, dtype=np.uint64), *_kernel_widths(k))
    return _pack_numpy(values, k)


def _pack_numpy(values: np.ndarray, k: np.ndarray | int) -> bytes:
    v = np.ascontiguousarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    ks = np.uint64(k) if np.ndim(k) == 0 else np.asarray(k, dtype=np.uint64)
    q = v >> ks
    esc = q >= ESCAPE_Q
    qc = np.where(esc, ESCAPE_Q, q).astype(np.int64)
    ends = cumsum(qc + 1)
    bits = np.ones(int(ends[-1]), dtype=np.uint8)
    bits[ends - 1] = 0
    unary = np.packbits(bits, bitorder="little").tobytes()
    rem = _pack_bits_numpy(v, k if np.ndim(k) == 0 else np.asarray(k, dtype=np.int64))
    return rem + unary + v[esc].astype("<u8").tobytes()


class KRuns(NamedTuple):
    """Rice parameters in runs: ks[r] for counts[r] values in turn (several classes' values in one blob)."""

    counts: list[int]
    ks: list[int]


def unpack(data: bytes, count: int, k: np.ndarray | int | KRuns) -> np.ndarray:
    """Inverse of `pack`; raises CorruptData unless `data` is exactly `count` values.

    Every value has a unary part of at least one bit: more than 8 values a
    byte is refused before anything is allocated for them.

    `k`: one for all values, one per value, or `KRuns` (what `pack` took per value, in runs)."""
    if count == 0:
        if data:
            raise CorruptData("rice blob: expected no data for 0 values, found some")
        return np.zeros(0, dtype=np.uint64)
    if count > 8 * len(data):  # before the output is allocated: the count may be a lie
        raise CorruptData(f"rice blob: expected at least a bit per value ({count} values), found {len(data)} bytes")
    if KERNEL is not None:
        out = np.empty(count, dtype=np.uint64)
        try:
            if isinstance(k, KRuns):  # no per-value array: a dense segment has millions of values
                KERNEL.rice_unpack(data, count, np.array(k.ks, dtype=np.int64), 0, out,
                                   np.array(k.counts, dtype=np.int64))
            else:
                KERNEL.rice_unpack(data, count, *_kernel_widths(k), out)
        except ValueError as e:
            raise CorruptData(str(e)) from None
        return out
    if isinstance(k, KRuns):
        k = np.repeat(np.array(k.ks, dtype=np.int64), k.counts)
    return _unpack_numpy(data, count, k)


def _unpack_numpy(data: bytes, count: int, k: np.ndarray | int) -> np.ndarray:
    scalar = np.ndim(k) == 0
    ks = np.asarray(k, dtype=np.int64)
    if scalar:
        if not 0 <= int(ks) <= MAX_K:
            raise CorruptData(f"rice parameter: expected 0..{MAX_K}, found {int(ks)}")
        rem_bits = int(ks) * count
    else:
        if (ks.view(np.uint64) > MAX_K).any():  # negatives wrap to large
            raise CorruptData(f"rice parameter: expected 0..{MAX_K}, found {int(ks.max()) if ks.min() >= 0 else int(ks.min())}")
        rem_bits = int(ks.sum())
    rem_len = (rem_bits + 7) // 8
    if len(data) < rem_len + 1:
        raise CorruptData(f"rice blob: expected at least {rem_len + 1} bytes, found {len(data)}")
    # The unary part's zero-bits end the values: unpack the complement, find its ones.
    ends = np.flatnonzero(np.unpackbits(~np.frombuffer(data, dtype=np.uint8, offset=rem_len), bitorder="little"))
    if ends.size < count:
        raise CorruptData(f"rice unary part: expected {count} values, found {ends.size}")
    last = int(ends[count - 1])
    unary_len = (last + 8) // 8
    if data[rem_len + unary_len - 1] >> (last % 8 + 1):
        raise CorruptData("rice unary part: nonzero padding after the last value")
    q = np.empty(count, dtype=np.int64)
    q[0] = ends[0]
    np.subtract(ends[1:count], ends[: count - 1] + 1, out=q[1:])
    q_max = int(q.max())
    if q_max > ESCAPE_Q:
        raise CorruptData(f"rice unary part: expected quotients up to {ESCAPE_Q}")
    r = _unpack_bits_numpy(data[:rem_len], int(ks) if scalar else ks, count)
    values = (q.astype(np.uint64) << ks.astype(np.uint64)) | r
    tail = data[rem_len + unary_len :]
    if q_max < ESCAPE_Q:
        if tail:
            raise CorruptData(f"rice escapes: expected 0 bytes, found {len(tail)}")
        return values
    esc = q == ESCAPE_Q
    n_esc = int(esc.sum())
    if len(tail) != 8 * n_esc:
        raise CorruptData(f"rice escapes: expected {8 * n_esc} bytes, found {len(tail)}")
    raw = np.frombuffer(tail, dtype="<u8").astype(np.uint64)
    if (raw >> (ks[esc] if not scalar else ks).astype(np.uint64) < ESCAPE_Q).any():
        raise CorruptData("rice escapes: an escaped value is small enough to be coded inline")
    values[esc] = raw
    return values
