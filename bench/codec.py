"""Codec bench: patch size and speed on real RL steps, against bounds and baselines.

For each learning rate x served dtype x consecutive (base, target) pair from
`served_pairs` (tests/synthetic.py) it measures:

- patch bytes (`protocol.patch.diff(...).to_bytes()`) against the zero-order
  entropy bound (`zero_order_bound_bytes`), the full checkpoint, and
  `zstd -19 --long=27 --patch-from` on the raw tensor bytes;
- speed against the floor of any diff: "compare", a plain `torch.ne` over
  the two versions' integer bit views (the faster of torch's thread count and
  one thread). "enc" is diff + to_bytes including both full-state hashes;
  "enc-h" is the same when the caller passes the hashes it already holds (the
  origin does); "apply" is from_bytes + apply on a clone of base, including
  apply's full state-hash check; "hash" is `state_hash` of the target alone
  (one is inside every verified apply, two inside "enc"). All five are timed
  in interleaved rounds (ROUNDS of each, round-robin) and the minimum of each
  is kept, so that on a shared machine they see the same conditions; every
  apply result is checked bit-exact against the target and a mismatch aborts
  the bench;
- keyframe bytes (`keyframe(target)`) and zipnn bytes for the same tensors;
- the peers' patch encodings on the same pair (bench/peer_codecs.py: slime's
  "xor" and "overwrite" disk deltas, PULSE v2 and v3.1, TRL-style indices and
  values), each decoded back and checked bit for bit (a size is reported only
  where that holds; otherwise "lossy"), and DFloat11's keyframe size for bf16
  states. A second table puts them beside the patch; "p/best" is the patch
  over the smallest lossless peer encoding, zstd's `--patch-from` included.

Run: `python bench/codec.py [--size small] [--lrs 1e-6,1e-5] [--dtypes bf16,fp8,fp8-block]
[--pairs 2] [--rounds 7] [--json rows.json]`. Importing this module does no work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "tests"))  # the fixtures' generator (tests/synthetic.py)
sys.path.insert(0, str(_ROOT / "bench"))  # peer_codecs, also when this module is imported as bench.codec

import torch  # noqa: E402

import peer_codecs  # noqa: E402

State = dict[str, torch.Tensor]

TARGETS = {"patch/bound": 0.85, "patch/zstd": 0.4, "encode/compare": 3.0, "apply/compare": 1.5}
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t`'s bit patterns as a signed integer of the same width."""
    flat = t.reshape(-1)
    if flat.dtype is torch.bool:
        return flat.view(torch.int8)
    if not flat.dtype.is_floating_point and flat.dtype.is_signed:
        return flat
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


def _binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -p * math.log2(p) - (1.0 - p) * math.log2(1.0 - p)


def zero_order_bound_bytes(base: State, target: State) -> float:
    """Zero-order entropy bound, in bytes, for coding `target` given `base`.

    Positions: for each tensor, N * H(m / N) bits (m changed of N elements,
    binary entropy). Values: M * H(deltas) bits, where the deltas are the
    integer differences of the bit patterns (target_int - base_int, int64) of
    all M changed elements, with H the empirical entropy pooled over the pair.
    Both states must have the same names, dtypes and shapes.
    """
    if set(base) != set(target):
        raise ValueError(f"names differ: {sorted(set(base) ^ set(target))}")
    bits = 0.0
    deltas = []
    for name in sorted(target):
        b, t = base[name], target[name]
        if b.dtype != t.dtype or b.shape != t.shape:
            raise ValueError(f"{name}: dtype/shape differ: {b.dtype}{tuple(b.shape)} vs {t.dtype}{tuple(t.shape)}")
        bi, ti = bits_view(b), bits_view(t)
        mask = torch.ne(bi, ti)
        n, m = bi.numel(), int(mask.sum())
        if n:
            bits += n * _binary_entropy(m / n)
        if m:
            deltas.append(ti[mask].to(torch.int64) - bi[mask].to(torch.int64))
    if deltas:
        _, counts = torch.unique(torch.cat(deltas), return_counts=True)
        c = counts.to(torch.float64)
        total = float(c.sum())
        bits += float(-(c * torch.log2(c / total)).sum())
    return bits / 8.0


def raw_bytes(state: State) -> bytes:
    """The raw tensor bytes concatenated in name order."""
    return b"".join(bits_view(state[k]).numpy().tobytes() for k in sorted(state))


def full_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def zstd_patch_from(base: State, target: State) -> tuple[int, float]:
    """(bytes, seconds) of `zstd -19 --long=27 --patch-from=BASE TARGET` on raw tensor bytes."""
    zstd = shutil.which("zstd") or "/usr/bin/zstd"
    with tempfile.TemporaryDirectory(prefix="bench-zstd-") as d:
        bp, tp, op = (os.path.join(d, n) for n in ("base.bin", "target.bin", "out.zst"))
        Path(bp).write_bytes(raw_bytes(base))
        Path(tp).write_bytes(raw_bytes(target))
        cmd = [zstd, "-19", "--long=27", f"--patch-from={bp}", tp, "-o", op, "-q", "-f"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        dt = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"zstd failed ({proc.returncode}): {proc.stderr.decode(errors='replace')}")
        return os.path.getsize(op), dt


_ZIPNN_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def zipnn_bytes(state: State) -> tuple[int | None, str]:
    """(summed compressed bytes per tensor, note). Bytes is None when zipnn fails.

    The note says whether zipnn's own decompress gave back the input bytes.
    """
    try:
        from zipnn import ZipNN

        dtypes = {t.dtype for t in state.values()}
        if len(dtypes) != 1:
            raise ValueError(f"mixed dtypes {sorted(map(str, dtypes))}")
        (dt,) = dtypes
        if dt not in _ZIPNN_DTYPE:
            raise ValueError(f"no zipnn dtype for {dt}")
        z = ZipNN(bytearray_dtype=_ZIPNN_DTYPE[dt], input_format="byte")
        total, bad = 0, 0
        for k in sorted(state):
            raw = bits_view(state[k]).numpy().tobytes()
            c = z.compress(raw)
            total += len(c)
            if bytes(z.decompress(c)) != raw:
                bad += 1
        note = "" if not bad else f"zipnn roundtrip NOT lossless on {bad}/{len(state)} tensors"
        return total, note
    except Exception as e:  # a baseline: report, don't stop the bench
        return None, f"zipnn n/a: {type(e).__name__}: {e}"


def _compare_once(base: State, target: State, names: list[str]) -> float:
    # Only the ne: an earlier version also counted the mask (.sum()), which
    # doubled this floor and flattered every ratio against it by ~2x.
    t0 = time.perf_counter()
    for k in names:
        torch.ne(bits_view(base[k]), bits_view(target[k]))
    return time.perf_counter() - t0


ROUNDS = 7


def speed_rounds(base: State, target: State, blob: bytes, where: str, rounds: int = ROUNDS) -> dict:
    """Minimum seconds of encode (with and without state hashing), apply and compare.

    One round runs each once, round-robin (compare twice: torch's threads and
    one thread), so slow spells on a shared machine hit all of them alike.
    """
    from patchswarm.protocol import patch as P
    from patchswarm.protocol.statehash import state_hash

    names = sorted(target)
    base_hash, target_hash = state_hash(base), state_hash(target)
    threads = torch.get_num_threads()
    best = {"encode_s": math.inf, "encode_nohash_s": math.inf, "apply_s": math.inf, "compare_s": math.inf,
            "hash_s": math.inf}
    for _ in range(rounds):
        t0 = time.perf_counter()
        state_hash(target)
        best["hash_s"] = min(best["hash_s"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        P.diff(base, target).to_bytes()
        best["encode_s"] = min(best["encode_s"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        P.diff(base, target, base_hash=base_hash, target_hash=target_hash).to_bytes()
        best["encode_nohash_s"] = min(best["encode_nohash_s"], time.perf_counter() - t0)
        state = {k: v.clone() for k, v in base.items()}
        t0 = time.perf_counter()
        P.apply(state, P.Patch.from_bytes(blob))
        best["apply_s"] = min(best["apply_s"], time.perf_counter() - t0)
        assert_bit_exact(state, target, where)
        del state
        for n in sorted({threads, 1}):
            torch.set_num_threads(n)
            try:
                best["compare_s"] = min(best["compare_s"], _compare_once(base, target, names))
            finally:
                torch.set_num_threads(threads)
    return best


def assert_bit_exact(state: State, target: State, where: str) -> None:
    if set(state) != set(target):
        raise SystemExit(f"FATAL {where}: apply result names differ: {sorted(set(state) ^ set(target))}")
    for k in sorted(target):
        a, b = state[k], target[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits_view(a), bits_view(b)):
            raise SystemExit(f"FATAL {where}: apply result differs from target in tensor {k!r}")


def peer_sizes(base: State, target: State, where: str) -> dict:
    """Each peer encoding's bytes for the pair (None where its decode is not the target
    bit for bit) and its encode seconds."""
    out = {}
    for name, (encode, decode) in peer_codecs.PATCH_CODECS.items():
        t0 = time.perf_counter()
        blob = encode(base, target)
        out[f"{name}_s"] = time.perf_counter() - t0
        try:
            assert_bit_exact(decode(base, blob), target, f"{where} {name}")
            out[f"{name}_bytes"] = len(blob)
        except SystemExit as e:
            print(f"# {e}: reported as lossy", file=sys.stderr, flush=True)
            out[f"{name}_bytes"] = None
    return out


def bench_pair(base: State, target: State, where: str, rounds: int = ROUNDS) -> dict:
    from patchswarm.protocol import patch as P

    from patchswarm.protocol.patch import keyframe
    row: dict = {}
    row["params"] = sum(t.numel() for t in target.values())

    blob = P.diff(base, target).to_bytes()
    stats = P.Patch.from_bytes(blob).stats()
    row["changed"] = int(stats["changed"])
    row["changed_pct"] = 100.0 * row["changed"] / max(1, row["params"])
    row["patch_bytes"] = len(blob)
    row["bound_bytes"] = zero_order_bound_bytes(base, target)
    row["full_bytes"] = full_bytes(target)
    row["zstd_bytes"], row["zstd_s"] = zstd_patch_from(base, target)
    row.update(speed_rounds(base, target, blob, where, rounds))

    row["keyframe_bytes"] = len(keyframe(target).to_bytes())
    row["zipnn_bytes"], row["zipnn_note"] = zipnn_bytes(target)
    row.update(peer_sizes(base, target, where))
    row["dfloat11_bytes"] = peer_codecs.dfloat11_bytes(target)

    def ratio(a, b):
        return a / b if a is not None and b else None

    row["patch/bound"] = ratio(row["patch_bytes"], row["bound_bytes"])
    row["full/patch"] = ratio(row["full_bytes"], row["patch_bytes"])
    row["patch/zstd"] = ratio(row["patch_bytes"], row["zstd_bytes"])
    row["encode/compare"] = ratio(row["encode_s"], row["compare_s"])
    row["encode_nohash/compare"] = ratio(row["encode_nohash_s"], row["compare_s"])
    row["apply/compare"] = ratio(row["apply_s"], row["compare_s"])
    row["hash/compare"] = ratio(row["hash_s"], row["compare_s"])
    row["keyframe/raw"] = ratio(row["keyframe_bytes"], row["full_bytes"])
    row["zipnn/raw"] = ratio(row["zipnn_bytes"], row["full_bytes"])
    row["dfloat11/raw"] = ratio(row["dfloat11_bytes"], row["full_bytes"])
    lossless = [row[f"{p}_bytes"] for p in peer_codecs.PATCH_CODECS if row[f"{p}_bytes"] is not None]
    row["best_peer_bytes"] = min([row["zstd_bytes"], *lossless])
    row["patch/best_peer"] = ratio(row["patch_bytes"], row["best_peer_bytes"])
    row["patch_stats"] = {k: stats[k] for k in stats}
    return row


COLUMNS = [  # (header, key, format)
    ("lr", "lr", "{:g}"), ("dtype", "dtype", "{}"), ("pair", "pair", "{}"),
    ("params", "params", "{:,}"), ("chg%", "changed_pct", "{:.2f}"),
    ("patch B", "patch_bytes", "{:,}"), ("bound B", "bound_bytes", "{:,.0f}"), ("p/bound", "patch/bound", "{:.3f}"),
    ("full B", "full_bytes", "{:,}"), ("full/p", "full/patch", "{:.1f}"),
    ("zstd B", "zstd_bytes", "{:,}"), ("zstd s", "zstd_s", "{:.2f}"), ("p/zstd", "patch/zstd", "{:.3f}"),
    ("enc s", "encode_s", "{:.4f}"), ("enc-h s", "encode_nohash_s", "{:.4f}"), ("apply s", "apply_s", "{:.4f}"),
    ("cmp s", "compare_s", "{:.4f}"), ("hash s", "hash_s", "{:.4f}"),
    ("enc/cmp", "encode/compare", "{:.2f}"), ("enc-h/cmp", "encode_nohash/compare", "{:.2f}"), ("app/cmp", "apply/compare", "{:.2f}"),
    ("hash/cmp", "hash/compare", "{:.2f}"),
    ("kf B", "keyframe_bytes", "{:,}"), ("kf/raw", "keyframe/raw", "{:.3f}"),
    ("zipnn B", "zipnn_bytes", "{:,}"), ("zipnn/raw", "zipnn/raw", "{:.3f}"),
]


PEER_COLUMNS = [
    ("lr", "lr", "{:g}"), ("dtype", "dtype", "{}"), ("pair", "pair", "{}"), ("chg%", "changed_pct", "{:.2f}"),
    ("patch B", "patch_bytes", "{:,}"), ("zstd B", "zstd_bytes", "{:,}"),
    *[(f"{p} B", f"{p}_bytes", "{:,}") for p in ("slime-xor", "slime-ow", "pulse-v2", "pulse-v3.1", "trl")],
    ("p/best", "patch/best_peer", "{:.3f}"),
    ("kf B", "keyframe_bytes", "{:,}"), ("zipnn B", "zipnn_bytes", "{:,}"), ("df11 B", "dfloat11_bytes", "{:,}"),
    ("kf/raw", "keyframe/raw", "{:.3f}"), ("zipnn/raw", "zipnn/raw", "{:.3f}"), ("df11/raw", "dfloat11/raw", "{:.3f}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "lossy" if key.removesuffix("_bytes") in peer_codecs.PATCH_CODECS else "n/a"
    return fmt.format(v)


def print_table(rows: list[dict], columns: list = COLUMNS, title: str = "patchswarm codec bench") -> None:
    cells = [[_cell(r, k, f) for _, k, f in columns] for r in rows]
    headers = [h for h, _, _ in columns]
    if sys.stdout.isatty():
        try:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=title)
            for i, h in enumerate(headers):
                table.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
            for c in cells:
                table.add_row(*c)
            need = sum(max(len(h), *(len(c[i]) for c in cells)) + 3 for i, h in enumerate(headers)) + 1
            Console(width=max(need, shutil.get_terminal_size().columns)).print(table)
            return
        except ImportError:
            pass
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)), flush=True)


def summary(rows: list[dict]) -> str:
    sel = [r for r in rows if r["dtype"] == "bf16" and math.isclose(r["lr"], 1e-6)]
    if not sel:
        return "summary: no bf16 lr=1e-6 rows"
    parts = []
    for key, goal in [*TARGETS.items(), ("encode_nohash/compare", TARGETS["encode/compare"]), ("hash/compare", None)]:
        vals = [r[key] for r in sel if r.get(key) is not None]
        if not vals:
            parts.append(f"{key} n/a")
            continue
        mean = sum(vals) / len(vals)
        verdict = "" if goal is None else f" (target <= {goal:g}: {'ok' if mean <= goal else 'MISS'})"
        parts.append(f"{key} {mean:.3f}{verdict}")
    # One state hash is part of every verified apply, two of an encode that hashes both states.
    return f"summary bf16 lr=1e-6 ({len(sel)} rows): " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated RL learning rates")
    ap.add_argument("--dtypes", default="bf16,fp8,fp8-block",
                    help="comma-separated served dtypes, or fp8-block (e4m3 weights with fp32 block scales, "
                         "bf16 norms: a pre-quantized checkpoint served as-is)")
    ap.add_argument("--pairs", type=int, default=2, help="consecutive (base, target) pairs per lr x dtype")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timing rounds per pair (minimum kept)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--no-kernel", action="store_true",
                    help="use the numpy versions (class index, compare, Rice/bit-field coders) instead of protocol/_kernels")
    args = ap.parse_args(argv)
    from patchswarm.protocol import contexts, ricecode

    if args.no_kernel:
        contexts.KERNEL = ricecode.KERNEL = None
    print(f"# kernels: {'compiled (protocol/_kernels)' if contexts.KERNEL else 'numpy'}", file=sys.stderr, flush=True)

    from synthetic import served_pairs

    lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    rows, notes = [], []
    for lr in lrs:
        for dtype in dtypes:
            t0 = time.perf_counter()
            pairs = served_pairs(size=args.size, lr=lr, steps=args.pairs, seed=0, dtype=dtype)
            print(f"# generated {len(pairs)} {args.size} {dtype} pairs at lr={lr:g} in "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
            for i, (base, target) in enumerate(pairs):
                where = f"size={args.size} lr={lr:g} dtype={dtype} pair={i}"
                row = {"size": args.size, "lr": lr, "dtype": dtype, "pair": i, **bench_pair(base, target, where, args.rounds)}
                rows.append(row)
                if row["zipnn_note"]:
                    notes.append(f"{dtype}: {row['zipnn_note']}")
    print_table(rows)
    print_table(rows, PEER_COLUMNS, "the patch beside the peers' encodings (bytes; lossy: decode not bit-exact)")
    for n in dict.fromkeys(notes):
        print(f"note: {n}")
    print(summary(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
