"""The codes for one segment's changes: which ranks changed in each class, and by how much.

Owns the layout of a delta segment's class table and streams (patch.py owns
the container around them). Everything is vectorized numpy over all classes of
a segment at once; the coders are Rice blobs and raw bit fields (ricecode.py),
which decode with a fixed, small number of numpy passes whatever the counts.
Where protocol/_kernels built, the values (decode) and the ranked codes'
symbols (encode) take compiled passes instead, with the same results.

Positions, per class (a class of n base elements of which m changed, as
ranks inside the class): the cheapest of
- GAPS: Rice-coded gaps between changed ranks (sparse classes);
- HOLES: Rice-coded gaps between unchanged ranks (classes that mostly change);
- BITMAP: one bit per class member (change rates near one half).

Values: d = new - old of order-preserving integers (dtypes.py), never 0.
Its sign is one raw bit (it is a coin flip on real steps), its magnitude
a = |d| - 1 is coded per class as the cheaper of
- RUNS: where a > 0 as Rice-coded gaps, then a - 1 there as a ranked code
  (classes of mostly ±1 ulp: 1 bit + ~H(P(a > 0)) per value);
- RANKED: a itself as a ranked code (classes of wide deltas).
A ranked code maps each value to a symbol (itself below DIRECT, else its bit
length, with the lower bits raw), sends the symbols in order of frequency and
Rice-codes each value's rank in that order.

Why no arithmetic coder: rANS saved under 1 % of a patch here, but its decoder is a Python
loop over lane steps (the old decode floor); these codes come within ~1-2 %
of the class-conditioned entropy on real steps and decode in fixed passes.

Class table row: [m, n, pos mode, pos k, value mode, bigs, bigs k, rank k,
symbols] ([0] for a class without changes; n, the class size, lets the
decoder tell a wrong base from a corrupt patch before it decodes). Streams:
[position Rice blob, bitmaps, signs, bigs Rice blob, ranks Rice blob, raw
low bits].
"""

from __future__ import annotations

import numpy as np

from . import ricecode
from .errors import CorruptData

GAPS, HOLES, BITMAP = 0, 1, 2
RUNS, RANKED = 0, 1
DIRECT_BITS = 4
DIRECT = 1 << DIRECT_BITS
SYMBOLS = DIRECT + 64 - DIRECT_BITS
ROW_FIELDS = 9  # a class row with changes; one without is [0]
STREAMS = 6
_MAX_GAP = 1 << 40
_NO_RANKS = np.zeros(0, dtype=np.uint64)


def _gaps(sorted_idx: np.ndarray) -> np.ndarray:
    """Elements skipped before each of the ascending indices."""
    out = np.empty(sorted_idx.size, dtype=np.uint64)
    if sorted_idx.size:
        out[0] = sorted_idx[0]
        np.subtract(sorted_idx[1:], sorted_idx[:-1] + 1, out=out[1:], casting="unsafe")
    return out


def _bit_length(v: np.ndarray) -> np.ndarray:
    out = np.zeros(v.size, dtype=np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        hi = (v >> (out + shift).astype(np.uint64)) != 0
        out[hi] += shift
    return out + (v != 0)


def _symbols(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, raw width) per value: small values are their own symbol."""
    big = v >= DIRECT
    sym = v.astype(np.int64)
    widths = np.zeros(v.size, dtype=np.int64)
    if big.any():
        bl = _bit_length(v[big])
        sym[big] = DIRECT + bl - DIRECT_BITS - 1
        widths[big] = bl - 1
    return sym, widths


def _symbol_widths(sym: np.ndarray) -> np.ndarray:
    return np.where(sym >= DIRECT, sym - DIRECT + DIRECT_BITS, 0)


class _Ranked:
    """A ranked code of one array: symbols table, ranks, raw low bits."""

    def __init__(self, v: np.ndarray):
        kernel = ricecode.KERNEL
        if kernel is not None:  # the same arrays in two compiled passes
            v = np.ascontiguousarray(v, dtype=np.uint64)
            sym, counts = np.empty(v.size, dtype=np.uint8), np.zeros(SYMBOLS, dtype=np.int64)
            kernel.symbols(v, sym, counts)
        else:
            sym, widths = _symbols(v)
            counts = np.bincount(sym, minlength=SYMBOLS)
        used = np.flatnonzero(counts)
        order = used[np.argsort(-counts[used], kind="stable")]
        self.table = bytes(order.astype(np.uint8))
        rank_of = np.zeros(SYMBOLS, dtype=np.int64)
        rank_of[order] = np.arange(order.size)
        if kernel is not None:
            self.ranks, self.low, self.widths = np.empty(v.size, np.uint64), np.empty(v.size, np.uint64), np.empty(v.size, np.int64)
            raw_bits = kernel.ranked(v, sym, rank_of, self.ranks, self.low, self.widths)
        else:
            self.ranks = rank_of[sym].astype(np.uint64)
            self.widths = widths
            self.low = v - np.where(widths > 0, np.uint64(1) << widths.astype(np.uint64), np.uint64(0))
            raw_bits = int(widths.sum())
        self.k, rank_bits = ricecode.best_k_and_bits(self.ranks) if len(self.table) > 1 else (0, 0)
        self.bits = rank_bits + raw_bits + 8 * (len(self.table) + 2)


def _position_code(ranks: np.ndarray, n: int) -> tuple[int, int, np.ndarray | None, np.ndarray | None]:
    """(mode, k, values for the Rice blob or None, bitmap or None) for one class."""
    m = ranks.size
    gaps = _gaps(ranks)
    k, bits = ricecode.best_k_and_bits(gaps)
    best = (bits, GAPS, k, gaps, None)
    if 3 * m > n:  # dense: the complement or a plain bitmap may be smaller
        mask = np.zeros(n, dtype=bool)
        mask[ranks] = True
        if n < best[0]:
            best = (n, BITMAP, 0, None, mask)
        holes = _gaps(np.flatnonzero(~mask))
        kh, cost = ricecode.best_k_and_bits(holes)
        if cost < best[0]:
            best = (cost, HOLES, kh, holes, None)
    return best[1:]


def encode(ranks: list[np.ndarray], sizes: list[int], deltas: list[np.ndarray]) -> tuple[list, list]:
    """Class table and streams for the changes of every class of one segment.

    ranks[c]: ascending int64 ranks of the changed elements inside class c
    (of sizes[c] members); deltas[c]: their int64 order-preserving deltas.
    """
    live = [c for c, r in enumerate(ranks) if r.size]
    if not live:
        return [[0] for _ in ranks], _streams([], [], [], [], [], [], [], [], [], [])
    counts = [ranks[c].size for c in live]
    starts = np.cumsum([0] + counts[:-1])
    r = np.concatenate([ranks[c] for c in live])
    d = np.concatenate([deltas[c] for c in live])
    # Every class's gaps, Rice parameter, signs and magnitudes in passes over
    # all classes; only dense classes and wide deltas take a per-class path.
    gaps = np.empty(r.size, dtype=np.uint64)
    np.subtract(r[1:], r[:-1] + 1, out=gaps[1:], casting="unsafe")
    gaps[starts] = r[starts]
    gap_k = ricecode.best_k_runs(gaps, counts)
    neg = d < 0
    a = np.abs(d).view(np.uint64) - np.uint64(1)  # modular: |int64 min| is 2**63
    wide = (np.maximum.reduceat(a, starts) > 0).tolist()
    rows: list = [[0] for _ in ranks]
    pos_vals, pos_k, bitmaps, big_vals, big_k, rank_vals, rank_k, low_vals, low_w = [], [], [], [], [], [], [], [], []
    for i, c in enumerate(live):
        m, n, lo = counts[i], sizes[c], int(starts[i])
        if 3 * m > n:  # dense: the complement or a plain bitmap may be smaller
            mode, k, vals, bitmap = _position_code(r[lo : lo + m], n)
        else:
            mode, k, vals, bitmap = GAPS, gap_k[i], gaps[lo : lo + m], None
        if vals is not None:
            pos_vals.append(vals)
            pos_k.append(np.full(vals.size, k, dtype=np.int64))
        if bitmap is not None:
            bitmaps.append(bitmap)
        if not wide[i]:  # all ±1: nothing but signs
            rows[c] = [m, n, mode, k, RANKED, 0, 0, 0, b"\x00"]
            continue
        ac = a[lo : lo + m]
        bigs = np.flatnonzero(ac)
        ranked = _Ranked(ac)
        if bigs.size < m:
            big_gaps = _gaps(bigs)
            kg, gap_bits = ricecode.best_k_and_bits(big_gaps)
            on_bigs = _Ranked(ac[bigs] - np.uint64(1))
            runs_bits = gap_bits + on_bigs.bits + 16
        if bigs.size < m and runs_bits < ranked.bits:
            vmode, code = RUNS, on_bigs
            big_vals.append(big_gaps)
            big_k.append(np.full(bigs.size, kg, dtype=np.int64))
        else:
            vmode, code, kg = RANKED, ranked, 0
        if len(code.table) > 1:
            rank_vals.append(code.ranks)
            rank_k.append(np.full(code.ranks.size, code.k, dtype=np.int64))
        low_vals.append(code.low)
        low_w.append(code.widths)
        rows[c] = [m, n, mode, k, vmode, bigs.size if vmode == RUNS else 0, kg, code.k, code.table]
    return rows, _streams(pos_vals, pos_k, bitmaps, [neg], big_vals, big_k, rank_vals, rank_k, low_vals, low_w)


def _streams(pos_vals, pos_k, bitmaps, signs, big_vals, big_k, rank_vals, rank_k, low_vals, low_w) -> list[bytes]:
    def cat(parts, dtype):
        if not parts:
            return np.zeros(0, dtype=dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    return [
        ricecode.pack(cat(pos_vals, np.uint64), cat(pos_k, np.int64)),
        np.packbits(cat(bitmaps, bool), bitorder="little").tobytes(),
        np.packbits(cat(signs, bool), bitorder="little").tobytes(),
        ricecode.pack(cat(big_vals, np.uint64), cat(big_k, np.int64)),
        ricecode.pack(cat(rank_vals, np.uint64), cat(rank_k, np.int64)),
        ricecode.pack_bits(cat(low_vals, np.uint64), cat(low_w, np.int64)),
    ]


M, N, PMODE, PK, VMODE, BIGS, BIGS_K, RANK_K, TABLE = range(ROW_FIELDS)


def check_rows(rows, classes: int) -> list[list]:
    """Validate the shape of a class table (not the sizes against a base)."""
    if not isinstance(rows, list) or len(rows) != classes:
        raise CorruptData(f"class table: expected {classes} rows, found {len(rows) if isinstance(rows, list) else type(rows).__name__}")
    for row in rows:
        ok = isinstance(row, list) and row and isinstance(row[M], int) and row[M] >= 0
        if ok and row[M] > 0:
            ok = (len(row) == ROW_FIELDS and all(isinstance(x, int) and x >= 0 for x in row[N:TABLE]) and isinstance(row[TABLE], bytes)
                  and row[M] <= row[N] and row[PMODE] in (GAPS, HOLES, BITMAP) and row[VMODE] in (RUNS, RANKED)
                  and len(row[TABLE]) <= SYMBOLS and max(row[PK], row[BIGS_K], row[RANK_K]) <= ricecode.MAX_K
                  and row[BIGS] <= row[M] and (row[VMODE] == RUNS or row[BIGS] == 0))
        elif ok:
            ok = len(row) == 1
        if not ok:
            raise CorruptData(f"class table row: expected [m, n, pos mode, k, value mode, bigs, k, k, symbols] or [0], found {str(row)[:80]}")
    return rows


def check_counts(rows: list[list], streams, size: int) -> None:
    """Raise unless the counts a class table declares fit what is present, before
    anything is decoded or allocated for them: the live classes' sizes (the
    classes split the segment's `size` elements, which its pieces took from the
    base) and the changes (one sign bit each, in streams[2])."""
    _check_streams(streams)
    members = sum(row[N] for row in rows if row[M])
    if members > size:
        raise CorruptData(f"class sizes: expected at most the segment's {size} elements in all classes, found {members}")
    changes = sum(row[M] for row in rows)
    if len(streams[2]) != (changes + 7) // 8:
        raise CorruptData(f"signs: expected {(changes + 7) // 8} bytes for {changes} changes, found {len(streams[2])}")


def _check_streams(streams) -> None:
    if not isinstance(streams, list) or len(streams) != STREAMS or not all(isinstance(s, bytes) for s in streams):
        raise CorruptData(f"segment streams: expected {STREAMS} byte strings")


def _check_flags(data: bytes, count: int, what: str) -> None:
    """Raise unless `data` holds `count` bools packed little-endian, with zero padding."""
    if len(data) != (count + 7) // 8:
        raise CorruptData(f"{what}: expected {(count + 7) // 8} bytes, found {len(data)}")
    if count % 8 and data[-1] >> (count % 8):
        raise CorruptData(f"{what}: nonzero padding")


def _unpack_flags(data: bytes, count: int, what: str) -> np.ndarray:
    """`count` bools packed little-endian, with zero padding."""
    _check_flags(data, count, what)
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count, bitorder="little").view(bool)


def _gap_runs(data: bytes, counts: list[int], ks: list[int]) -> np.ndarray:
    """Rice-coded gap runs (one k each) turned into ascending ranks, each run from 0, concatenated."""
    gaps = ricecode.unpack(data, sum(counts), ricecode.KRuns(counts, ks))
    if gaps.size and int(gaps.max()) >= _MAX_GAP:
        raise CorruptData(f"gap: expected below 2**40, found {int(gaps.max())}")
    gaps += np.uint64(1)  # in place, like the sums below: a dense segment's runs are tens of MB
    cs = ricecode.cumsum_in_place(gaps.view(np.int64))
    off, base = 0, 0
    for n in counts:  # in place: rank = elements up to here - 1 - those of the runs before
        if n:
            nxt = int(cs[off + n - 1])
            cs[off : off + n] -= base + 1
            base = nxt
        off += n
    return cs


def decode_rank_runs(rows: list[list], streams: list) -> tuple[np.ndarray, list[int]]:
    """Ascending ranks of the changed elements of every class, concatenated in
    class order, and each class's count (rows from `check_rows`)."""
    _check_streams(streams)
    coded = [row for row in rows if row[M] and row[PMODE] != BITMAP]
    runs = _gap_runs(streams[0], [row[M] if row[PMODE] == GAPS else row[N] - row[M] for row in coded],
                     [row[PK] for row in coded])
    bitmap_bits = sum(row[N] for row in rows if row[M] and row[PMODE] == BITMAP)
    bits = _unpack_flags(streams[1], bitmap_bits, "class bitmaps")
    out, counts, off, bit_off, simple = [], [], 0, 0, True
    for row in rows:
        m, n = row[M], (row[N] if row[M] else 0)
        counts.append(m)
        if m == 0:
            continue
        if row[PMODE] == BITMAP:
            ranks = np.flatnonzero(bits[bit_off : bit_off + n])
            bit_off += n
            simple = False
        else:
            take = m if row[PMODE] == GAPS else n - m
            ranks = runs[off : off + take]
            off += take
            if take and ranks[-1] >= n:
                raise CorruptData(f"class rank: expected below the class size {n}, found {int(ranks[-1])}")
            if row[PMODE] == HOLES:
                mask = np.ones(n, dtype=bool)
                mask[ranks] = False
                ranks = np.flatnonzero(mask)
                simple = False
        if ranks.size != m:
            raise CorruptData(f"class positions: expected {m}, found {ranks.size}")
        out.append(ranks)
    if simple:  # gaps only: the runs are the answer, already in class order
        return runs, counts
    return (np.concatenate(out) if out else np.zeros(0, dtype=np.int64)), counts


def decode_positions(rows: list[list], streams: list) -> list[np.ndarray]:
    """Ascending ranks of the changed elements of every class (rows from `check_rows`)."""
    ranks, counts = decode_rank_runs(rows, streams)
    return np.split(ranks, np.cumsum(counts)[:-1]) if counts else []


def _values_kernel(kernel, live: list[list], coded: list[int], tables: list[bytes], streams: list, total: int,
                   bigs: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """decode_deltas's values in one compiled pass (its numpy path below is the reference)."""
    classes = np.array([[row[M], n, row[VMODE] == RUNS, len(t)] for row, n, t in zip(live, coded, tables)],
                       dtype=np.int64).reshape(-1, 4)
    out = np.empty(total, dtype=np.int64)
    try:
        kernel.values(streams[2], np.ascontiguousarray(ranks, dtype=np.uint64), np.ascontiguousarray(bigs, dtype=np.int64),
                      b"".join(tables), classes, streams[5], out)
    except ValueError as e:
        raise CorruptData(str(e)) from None
    return out


def decode_deltas(rows: list[list], streams: list) -> np.ndarray:
    """The int64 order-preserving deltas of every class, concatenated in class order."""
    _check_streams(streams)
    live = [row for row in rows if row[M]]
    total = sum(row[M] for row in live)
    _check_flags(streams[2], total, "signs")
    runs = [row for row in live if row[VMODE] == RUNS]
    big_counts = [row[BIGS] for row in runs]
    bigs = _gap_runs(streams[3], big_counts, [row[BIGS_K] for row in runs])
    # A ranked code with one symbol below DIRECT is that value everywhere:
    # no ranks, no raw bits. Only the other codes are decoded value by value.
    coded = [row[BIGS] if row[VMODE] == RUNS else row[M] for row in live]  # values in each ranked code
    tables = [row[TABLE] for row in live]
    ranks = _NO_RANKS  # only codes of more than one symbol send ranks
    if any(len(t) > 1 for t in tables):
        rank_counts = [n if len(t) > 1 else 0 for t, n in zip(tables, coded)]
        ranks = ricecode.unpack(streams[4], sum(rank_counts), ricecode.KRuns(rank_counts, [row[RANK_K] for row in live]))
    elif streams[4]:
        raise CorruptData("rice blob: expected no data for 0 values, found some")
    kernel = ricecode.KERNEL
    if kernel is not None:
        return _values_kernel(kernel, live, coded, tables, streams, total, bigs, ranks)
    plain = [len(t) == 1 and t[0] < DIRECT for t in tables]
    wide = [i for i, p in enumerate(plain) if not p]
    if wide:
        sel_tables = [tables[i] for i in wide]
        sel_coded = [coded[i] for i in wide]
        table_len = np.array([len(t) for t in sel_tables], dtype=np.int64)
        flat_tables = np.frombuffer(b"".join(sel_tables), dtype=np.uint8)
        if (flat_tables >= SYMBOLS).any():
            raise CorruptData(f"symbol table: expected symbols below {SYMBOLS}")
        if any(not t and n for t, n in zip(sel_tables, sel_coded)):
            raise CorruptData("ranked code: a rank beyond its symbol table")
        which = np.repeat(np.arange(len(wide)), sel_coded)
        rank_all = np.zeros(which.size, dtype=np.int64)
        if any(len(t) > 1 for t in sel_tables):
            rank_off = np.cumsum([0] + rank_counts)
            rank_all = np.concatenate([ranks[rank_off[i] : rank_off[i + 1]].astype(np.int64) if len(tables[i]) > 1
                                       else np.zeros(coded[i], dtype=np.int64) for i in wide])
            if (rank_all >= table_len[which]).any():
                raise CorruptData("ranked code: a rank beyond its symbol table")
        table_off = np.cumsum(table_len) - table_len
        sym = flat_tables[table_off[which] + rank_all].astype(np.int64)
        widths = _symbol_widths(sym)
        low = ricecode.unpack_bits(streams[5], widths, sym.size)
        mags = np.where(widths > 0, (np.uint64(1) << widths.astype(np.uint64)) | low, sym.astype(np.uint64))
    else:
        ricecode.unpack_bits(streams[5], 0, 0)  # no raw bits: the stream must be empty
    a = np.zeros(total, dtype=np.uint64)
    off = woff = boff = 0
    for i, row in enumerate(live):
        m, n = row[M], coded[i]
        if plain[i]:
            v = np.uint64(tables[i][0])
        else:
            v = mags[woff : woff + n]
            woff += n
        if row[VMODE] == RUNS:
            pos = bigs[boff : boff + n]
            boff += n
            if n and pos[-1] >= m:
                raise CorruptData(f"value runs: expected positions below {m}, found {int(pos[-1])}")
            a[off + pos] = v + np.uint64(1)
        elif not plain[i] or v:
            a[off : off + m] = v
        off += m
    d = (a + np.uint64(1)).view(np.int64)  # modular, like the encoder
    np.negative(d, out=d, where=_unpack_flags(streams[2], total, "signs"))
    return d
