"""Vectorized Golomb-Rice coding of non-negative integer arrays.

Owns the bit layout of a Rice-coded array: three streams, so both directions
are a handful of numpy passes with no per-element Python:
- unary: for each value, min(v >> k, ESCAPE_Q) one-bits then a zero-bit,
  packed little-endian;
- remainders: the low k bits of each value, k bits each, packed little-endian;
- escapes: values whose quotient reaches ESCAPE_Q, raw uint64 little-endian.
Rice codes are within a few percent of the entropy of geometric sources, which
is what gaps between changes inside one context class are.
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
    best, best_cost = 0, None
    for k in range(max(0, guess - 2), min(MAX_K, guess + 3) + 1):
        q = values >> np.uint64(k)
        esc = q >= ESCAPE_Q
        cost = int(np.minimum(q, ESCAPE_Q).sum()) + values.size * (1 + k) + 64 * int(esc.sum())
        if best_cost is None or cost < best_cost:
            best, best_cost = k, cost
    return best


def encode(values: np.ndarray, k: int) -> tuple[bytes, bytes, bytes]:
    v = np.ascontiguousarray(values, dtype=np.uint64)
    if v.size == 0:
        return b"", b"", b""
    q = v >> np.uint64(k)
    esc = q >= ESCAPE_Q
    qc = np.where(esc, ESCAPE_Q, q).astype(np.int64)
    ends = np.cumsum(qc + 1)
    bits = np.ones(int(ends[-1]), dtype=np.uint8)
    bits[ends - 1] = 0
    unary = np.packbits(bits, bitorder="little").tobytes()
    if k:
        r = v & np.uint64((1 << k) - 1)
        rbits = ((r[:, None] >> np.arange(k, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
        rem = np.packbits(rbits.reshape(-1), bitorder="little").tobytes()
    else:
        rem = b""
    return unary, rem, v[esc].astype("<u8").tobytes()


def decode(unary: bytes, rem: bytes, escapes: bytes, count: int, k: int) -> np.ndarray:
    """Inverse of `encode`; raises CorruptData when the streams do not hold `count` values."""
    if count == 0:
        if unary or rem or escapes:
            raise CorruptData("rice stream: expected no data for 0 values, found some")
        return np.zeros(0, dtype=np.uint64)
    if not 0 <= k <= MAX_K:
        raise CorruptData(f"rice parameter: expected 0..{MAX_K}, found {k}")
    bits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8), bitorder="little")
    zeros = np.flatnonzero(bits == 0)
    if zeros.size < count:
        raise CorruptData(f"rice unary stream: expected {count} values, found {zeros.size}")
    zeros = zeros[:count]
    if bits[zeros[-1] + 1 :].any() or len(unary) != (int(zeros[-1]) + 8) // 8:
        raise CorruptData("rice unary stream: trailing data after the last value")
    q = np.diff(zeros, prepend=-1) - 1
    if k:
        need = (count * k + 7) // 8
        if len(rem) != need:
            raise CorruptData(f"rice remainder stream: expected {need} bytes, found {len(rem)}")
        rbits = np.unpackbits(np.frombuffer(rem, dtype=np.uint8), bitorder="little")[: count * k]
        r = (rbits.reshape(count, k).astype(np.uint64) << np.arange(k, dtype=np.uint64)).sum(1, dtype=np.uint64)
    else:
        if rem:
            raise CorruptData(f"rice remainder stream: expected 0 bytes for k=0, found {len(rem)}")
        r = np.zeros(count, dtype=np.uint64)
    values = (q.astype(np.uint64) << np.uint64(k)) | r
    esc = q == ESCAPE_Q
    n_esc = int(esc.sum())
    if len(escapes) != 8 * n_esc:
        raise CorruptData(f"rice escapes: expected {8 * n_esc} bytes, found {len(escapes)}")
    if n_esc:
        raw = np.frombuffer(escapes, dtype="<u8").astype(np.uint64)
        if (raw >> np.uint64(k) < ESCAPE_Q).any():
            raise CorruptData("rice escapes: an escaped value is small enough to be coded inline")
        values[esc] = raw
    return values
