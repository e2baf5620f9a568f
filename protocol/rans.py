"""Vectorized static rANS over a small alphabet, with bucketed large values.

Owns the bit layout of an rANS-coded array of non-negative integers. Values
below DIRECT are symbols of their own; a larger value v is the symbol of its
bit length (DIRECT + bit_length(v) - DIRECT_BITS - 1) followed by its low
bit_length-1 bits, raw, in a separate bit stream. Frequencies are normalised to 2**PROB_BITS and sent as
uint16; L interleaved coders ("lanes") each take every L-th value, so every
step of the coder is one numpy operation over L lanes and the number of Python
steps is n / L. Unlike a prefix code this spends fractions of a bit per symbol,
which matters for value deltas (most are ±1 ulp: ~1.8 bits of entropy, 2+ bits
in any prefix code).

Each value may have a context (an int both sides know, e.g. its position's
magnitude class) that selects its frequency table; all contexts share the
lanes, so one pass codes a whole segment.

Stream: [lanes u16][contexts u8]{[symbols u8][freqs u16 × symbols]} per context
[final states u32 × lanes][words u16 ...], plus the raw low bits of bucketed
values as a second string.
"""

from __future__ import annotations

import numpy as np

from .errors import CorruptData

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
DIRECT_BITS = 4
DIRECT = 1 << DIRECT_BITS
ALPHABET = DIRECT + 64 - DIRECT_BITS
RANS_L = 1 << 16
_MIN_STEPS = 256
_MAX_LANES = 1024


def _normalise(counts: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to PROB_SCALE, ≥1 wherever a count is ≥1."""
    total = counts.sum()
    f = np.floor(counts * (PROB_SCALE / total)).astype(np.int64)
    f[(counts > 0) & (f == 0)] = 1
    diff = PROB_SCALE - f.sum()
    order = np.argsort(-counts, kind="stable")
    i = 0
    while diff != 0:  # at most ALPHABET adjustments per pass, few passes
        j = order[i % ALPHABET]
        if counts[j] > 0 and (diff > 0 or f[j] > 1):
            step = 1 if diff > 0 else -1
            f[j] += step
            diff -= step
        i += 1
    return f


def _symbols(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    big = v >= DIRECT
    nbits = _bit_length(v[big])
    sym = v.astype(np.int64)
    sym[big] = DIRECT + nbits - DIRECT_BITS - 1
    return sym, big, nbits


def encode(values: np.ndarray, ctx: np.ndarray | None = None) -> tuple[bytes, bytes]:
    """Code `values`; `ctx[i]` (small ints, known to the decoder) picks value i's frequency table."""
    v = np.ascontiguousarray(values, dtype=np.uint64)
    n = v.size
    if n == 0:
        return b"", b""
    ctx = np.zeros(n, dtype=np.int64) if ctx is None else ctx.astype(np.int64)
    n_ctx = int(ctx.max()) + 1
    if n_ctx > 255 or ctx.size != n:
        raise ValueError(f"rans contexts: expected {n} values below 255, found {ctx.size} up to {n_ctx - 1}")
    sym, big, nbits = _symbols(v)
    counts = np.bincount(ctx * ALPHABET + sym, minlength=n_ctx * ALPHABET).reshape(n_ctx, ALPHABET)
    freq = np.zeros_like(counts)
    table = bytearray([n_ctx])
    for c in range(n_ctx):
        if counts[c].sum() == 0:
            table.append(0)
            continue
        freq[c] = _normalise(counts[c])
        nsym = int(np.flatnonzero(counts[c]).max()) + 1
        table.append(nsym)
        table += freq[c, :nsym].astype("<u2").tobytes()
    cum = np.cumsum(freq, axis=1) - freq
    lanes = int(max(1, min(_MAX_LANES, n // _MIN_STEPS)))
    steps = -(-n // lanes)
    x = np.full(lanes, RANS_L, dtype=np.uint64)
    f_all = freq[ctx, sym].astype(np.uint64)
    c_all = cum[ctx, sym].astype(np.uint64)
    out_steps: list[np.ndarray] = [None] * steps  # type: ignore[list-item]
    for t in range(steps - 1, -1, -1):
        lo = t * lanes
        k = min(lanes, n - lo)
        f, c = f_all[lo : lo + k], c_all[lo : lo + k]
        xs = x[:k]
        emit = xs >= (f << np.uint64(32 - PROB_BITS))
        out_steps[t] = (xs[emit] & np.uint64(0xFFFF)).astype("<u2")
        xs[emit] >>= np.uint64(16)
        x[:k] = ((xs // f) << np.uint64(PROB_BITS)) + (xs % f) + c
    head = np.array([lanes], dtype="<u2").tobytes() + bytes(table) + x.astype("<u4").tobytes()
    return head + np.concatenate(out_steps).tobytes(), _pack_low_bits(v[big], nbits - 1)


def _bit_length(v: np.ndarray) -> np.ndarray:
    out = np.zeros(v.size, dtype=np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        hi = (v >> np.uint64(out + shift)) != 0
        out[hi] += shift
    return out + (v != 0)


def _pack_low_bits(v: np.ndarray, widths: np.ndarray) -> bytes:
    if v.size == 0:
        return b""
    j = np.arange(64, dtype=np.uint64)
    bits = ((v[:, None] >> j) & np.uint64(1)).astype(np.uint8)
    keep = j[None, :] < widths[:, None].astype(np.uint64)
    return np.packbits(bits[keep], bitorder="little").tobytes()


def _unpack_low_bits(data: bytes, widths: np.ndarray) -> np.ndarray:
    total = int(widths.sum())
    if len(data) != (total + 7) // 8:
        raise CorruptData(f"rans raw bits: expected {(total + 7) // 8} bytes, found {len(data)}")
    if widths.size == 0:
        return np.zeros(0, dtype=np.uint64)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[total:].any():
        raise CorruptData("rans raw bits: trailing data")
    j = np.arange(64)
    keep = j[None, :] < widths[:, None]
    mat = np.zeros((widths.size, 64), dtype=np.uint64)
    mat[keep] = bits[:total]
    return (mat << j.astype(np.uint64)).sum(1, dtype=np.uint64)


def decode(data: bytes, escapes: bytes, count: int, ctx: np.ndarray | None = None) -> np.ndarray:
    if count == 0:
        if data or escapes:
            raise CorruptData("rans stream: expected no data for 0 values, found some")
        return np.zeros(0, dtype=np.uint64)
    ctx = np.zeros(count, dtype=np.int64) if ctx is None else ctx.astype(np.int64)
    if len(data) < 3:
        raise CorruptData(f"rans stream: expected a header, found {len(data)} bytes")
    lanes = int(np.frombuffer(data, "<u2", 1)[0])
    n_ctx = data[2]
    if lanes == 0 or n_ctx <= int(ctx.max()):
        raise CorruptData(f"rans header: expected ≥ 1 lanes and > {int(ctx.max())} contexts, found {lanes} and {n_ctx}")
    freq = np.zeros((n_ctx, ALPHABET), dtype=np.int64)
    slot_sym = np.zeros((n_ctx, PROB_SCALE), dtype=np.int64)
    off = 3
    for c in range(n_ctx):
        if off >= len(data) or data[off] > ALPHABET:
            raise CorruptData(f"rans table {c}: expected a symbol count up to {ALPHABET}")
        nsym = data[off]
        if len(data) < off + 1 + 2 * nsym:
            raise CorruptData(f"rans table {c}: expected {nsym} frequencies, found {len(data) - off - 1} bytes")
        freq[c, :nsym] = np.frombuffer(data, "<u2", nsym, off + 1)
        off += 1 + 2 * nsym
        if nsym and freq[c].sum() != PROB_SCALE:
            raise CorruptData(f"rans table {c}: expected frequencies summing to {PROB_SCALE}, found {freq[c].sum()}")
        if nsym:
            slot_sym[c] = np.repeat(np.arange(ALPHABET), freq[c])
    used = np.flatnonzero(freq.sum(1) == 0)
    if used.size and np.isin(ctx, used).any():
        raise CorruptData("rans contexts: a value refers to an empty frequency table")
    if len(data) < off + 4 * lanes or (len(data) - off - 4 * lanes) % 2:
        raise CorruptData(f"rans stream: expected {lanes} lane states and 16-bit words, found {len(data) - off} bytes")
    x = np.frombuffer(data, "<u4", lanes, off).astype(np.uint64)
    words = np.frombuffer(data, "<u2", (len(data) - off - 4 * lanes) // 2, off + 4 * lanes).astype(np.uint64)
    if (x < RANS_L).any():
        raise CorruptData("rans lane state: expected ≥ 2**16")
    f_u = freq.astype(np.uint64)
    c_u = (np.cumsum(freq, axis=1) - freq).astype(np.uint64)
    out = np.empty(count, dtype=np.int64)
    steps = -(-count // lanes)
    ptr = 0
    mask = np.uint64(PROB_SCALE - 1)
    for t in range(steps):
        lo = t * lanes
        k = min(lanes, count - lo)
        xs = x[:k]
        c = ctx[lo : lo + k]
        slot = xs & mask
        s = slot_sym[c, slot.astype(np.int64)]
        out[lo : lo + k] = s
        xs = f_u[c, s] * (xs >> np.uint64(PROB_BITS)) + slot - c_u[c, s]
        need = xs < RANS_L
        m = int(need.sum())
        if ptr + m > words.size:
            raise CorruptData("rans stream: ran out of words before the last value")
        xs[need] = (xs[need] << np.uint64(16)) | words[ptr : ptr + m]
        ptr += m
        x[:k] = xs
    if ptr != words.size or (x != RANS_L).any():
        raise CorruptData("rans stream: the coder did not end where it began (corrupt or truncated)")
    values = out.astype(np.uint64)
    big = out >= DIRECT
    widths = out[big] - DIRECT + DIRECT_BITS  # bit_length - 1
    low = _unpack_low_bits(escapes, widths)
    values[big] = (np.uint64(1) << widths.astype(np.uint64)) | low
    return values
