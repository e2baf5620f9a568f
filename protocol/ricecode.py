"""Vectorized Golomb-Rice coding of non-negative integer arrays, and raw bit fields.

Owns two bit layouts, both built and read with a handful of numpy passes and
no per-element Python:

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

import numpy as np

from .errors import CorruptData

ESCAPE_Q = 40
MAX_K = 40


def best_k(values: np.ndarray) -> int:
    """The Rice parameter with the fewest bits for these values (searched near the mean)."""
    if values.size == 0:
        return 0
    mean = float(values.mean())
    guess = max(0, int(np.log2(mean * 0.69 + 1e-9))) if mean > 1 else 0
    ks = np.arange(max(0, guess - 2), min(MAX_K, guess + 2) + 1, dtype=np.uint64)
    q = values[None, :] >> ks[:, None]
    esc = (q >= ESCAPE_Q).sum(1)
    cost = np.minimum(q, ESCAPE_Q).sum(1) + values.size * (1 + ks) + 64 * esc
    return int(ks[int(np.argmin(cost))])


def cost_bits(values: np.ndarray, k: int) -> int:
    """Exact size in bits of `pack(values, k)` before byte padding."""
    q = values >> np.uint64(k)
    esc = int((q >= ESCAPE_Q).sum())
    return int(np.minimum(q, ESCAPE_Q).sum()) + values.size * (1 + k) + 64 * esc


def _offsets(widths: np.ndarray | int, count: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(widths, bit offsets, total bits) of `count` fields, as int64 arrays."""
    w = np.full(count, int(widths), dtype=np.int64) if np.ndim(widths) == 0 else np.asarray(widths, dtype=np.int64)
    ends = np.cumsum(w)
    total = int(ends[-1]) if count else 0
    return w, ends - w, total


def pack_bits(values: np.ndarray, widths: np.ndarray | int) -> bytes:
    """The low widths[i] (≤ 64) bits of each value, back to back, little-endian."""
    v = np.asarray(values, dtype=np.uint64)
    w, off, total = _offsets(widths, v.size)
    if total == 0:
        return b""
    # Each field lands in one 64-bit word, or straddles two: OR the low parts
    # per word (fields sharing a word are adjacent), then the few spills.
    wu, shift = w.astype(np.uint64), (off & 63).astype(np.uint64)
    v = v & np.where(w < 64, (np.uint64(1) << np.minimum(wu, 63)) - np.uint64(1), ~np.uint64(0))
    word = off >> 6
    words = np.zeros((total + 63) // 64 + 1, dtype=np.uint64)
    live = w > 0
    word, v_live, shift_live = word[live], v[live], shift[live]
    starts = np.flatnonzero(np.diff(word, prepend=-1))
    words[word[starts]] = np.bitwise_or.reduceat(v_live << shift_live, starts)
    spill = shift_live + wu[live] > np.uint64(64)
    words[word[spill] + 1] |= v_live[spill] >> (np.uint64(64) - shift_live[spill])
    return words.astype("<u8").tobytes()[: (total + 7) // 8]


def unpack_bits(data: bytes, widths: np.ndarray | int, count: int) -> np.ndarray:
    """Inverse of `pack_bits`; `data` must be exactly the packed bytes."""
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
    padded = np.zeros((total + 63) // 64 + 2, dtype="<u8")
    padded.view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    words = padded.astype(np.uint64)
    word, shift = off >> 6, (off & 63).astype(np.uint64)
    lo = words[word] >> shift
    hi = np.where(shift > 0, words[word + 1] << ((np.uint64(64) - shift) & np.uint64(63)), np.uint64(0))
    wu = w.astype(np.uint64)
    mask = np.where(w < 64, (np.uint64(1) << np.minimum(wu, 63)) - np.uint64(1), ~np.uint64(0))
    return (lo | hi) & mask


def pack(values: np.ndarray, k: np.ndarray | int) -> bytes:
    """Rice blob of `values` with parameter k (an int, or one per value)."""
    v = np.ascontiguousarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    ks = np.uint64(k) if np.ndim(k) == 0 else np.asarray(k, dtype=np.uint64)
    q = v >> ks
    esc = q >= ESCAPE_Q
    qc = np.where(esc, ESCAPE_Q, q).astype(np.int64)
    ends = np.cumsum(qc + 1)
    bits = np.ones(int(ends[-1]), dtype=np.uint8)
    bits[ends - 1] = 0
    unary = np.packbits(bits, bitorder="little").tobytes()
    rem = pack_bits(v, k if np.ndim(k) == 0 else np.asarray(k, dtype=np.int64))
    return rem + unary + v[esc].astype("<u8").tobytes()


def unpack(data: bytes, count: int, k: np.ndarray | int) -> np.ndarray:
    """Inverse of `pack`; raises CorruptData unless `data` is exactly `count` values."""
    if count == 0:
        if data:
            raise CorruptData("rice blob: expected no data for 0 values, found some")
        return np.zeros(0, dtype=np.uint64)
    scalar = np.ndim(k) == 0
    ks = np.asarray(k, dtype=np.int64)
    if (ks < 0).any() or (ks > MAX_K).any():
        raise CorruptData(f"rice parameter: expected 0..{MAX_K}, found {int(ks.max())}")
    rem_bits = int(ks) * count if scalar else int(ks.sum())
    rem_len = (rem_bits + 7) // 8
    if len(data) < rem_len + 1:
        raise CorruptData(f"rice blob: expected at least {rem_len + 1} bytes, found {len(data)}")
    rest = np.frombuffer(data, dtype=np.uint8, offset=rem_len)
    bits = np.unpackbits(rest, bitorder="little")
    zeros = np.flatnonzero(bits == 0)
    if zeros.size < count:
        raise CorruptData(f"rice unary part: expected {count} values, found {zeros.size}")
    zeros = zeros[:count]
    unary_len = (int(zeros[-1]) + 8) // 8
    if bits[zeros[-1] + 1 : unary_len * 8].any():
        raise CorruptData("rice unary part: nonzero padding after the last value")
    q = np.diff(zeros, prepend=-1) - 1
    if (q > ESCAPE_Q).any():
        raise CorruptData(f"rice unary part: expected quotients up to {ESCAPE_Q}")
    r = unpack_bits(data[:rem_len], int(ks) if scalar else ks, count)
    values = (q.astype(np.uint64) << ks.astype(np.uint64)) | r
    esc = q == ESCAPE_Q
    n_esc = int(esc.sum())
    tail = data[rem_len + unary_len :]
    if len(tail) != 8 * n_esc:
        raise CorruptData(f"rice escapes: expected {8 * n_esc} bytes, found {len(tail)}")
    if n_esc:
        raw = np.frombuffer(tail, dtype="<u8").astype(np.uint64)
        if (raw >> (ks[esc] if not scalar else ks).astype(np.uint64) < ESCAPE_Q).any():
            raise CorruptData("rice escapes: an escaped value is small enough to be coded inline")
        values[esc] = raw
    return values
