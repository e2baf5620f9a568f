"""What a sparse change costs in a patch, per changed element, for each served dtype.

Question: do the dtypes added after the first release (fp64, u16, u32, u64,
f8e8m0; later AMD's fnuz fp8s and packed fp4, f4e2m1x2) patch about as small
per changed element as the first ones? A patch stores positions (ranks inside
context classes) and values (deltas of order-preserving integers), so the cost
of a change should follow how many elements change and by how much, not the
dtype's width.

Per dtype, one tensor of `--elements` elements of typical values (floats:
normal * 0.02 in the dtype, as weights; f8e8m0: exponents 110..134, as MX
block scales; f4e2m1x2: any byte, two fp4 codes (torch has no cast to it);
integers: uniform over the dtype, or over 0..2^31 for 64-bit),
and a target in which a `--share` of the elements moved by a small step of
the order-preserving integer (an ulp step or an increment: -3, -1, +1 or +2
units), or, with `--random`, took random bit patterns. The changed elements
are uniform over the tensor, or with `--by-exponent` (floats and e8m0) drawn
with a probability proportional to 1/|value| (floored at 1e-4), as an Adam
step moves small weights by more ulps than large ones: there the context
classes (the exponent of the old value) pay, and fp64's key (its exponent's
low 8 bits, bit 7 flipped) should pay as fp32's does. Columns: changed
elements, patch bytes of positions and values per changed element (the
segment streams and class tables, as `Patch.stats()` counts them), the whole
patch per changed element, and the window the encoder chose (the most classes
of any segment). Deterministic: seeded, one run. `--time` adds diff and apply
times (best of 3 rounds, milliseconds; timings move with the machine's load).

    .venv/bin/python bench/dtype_cost.py [--elements 1048576] [--shares 0.001,0.01] [--random] [--by-exponent] [--time]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from patchswarm.protocol.dtypes import BY_NAME, FP4X2
from patchswarm.protocol.patch import apply, diff
from patchswarm.protocol.patchformat import parse_chunk

ORDER = ["bf16", "fp16", "fp32", "f8e4m3", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "fp64", "f8e8m0", "f4e2m1x2", "u8",
         "u16", "u32", "u64", "i8", "i16", "i32", "i64"]
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def typical(name: str, n: int, rng: np.random.Generator) -> torch.Tensor:
    info = BY_NAME[name]
    if name == "f8e8m0":
        return torch.from_numpy(rng.integers(110, 135, size=n, dtype=np.uint8)).view(info.torch_dtype)
    if info.torch_dtype.is_floating_point and info.torch_dtype is not FP4X2:  # torch cannot cast to fp4
        return torch.from_numpy(rng.standard_normal(n) * 0.02).to(info.torch_dtype)
    if info.width == 8:
        return torch.from_numpy(rng.integers(0, 1 << 31, size=n, dtype=np.int64)).view(info.torch_dtype)
    raw = rng.integers(0, 256, size=n * info.width, dtype=np.uint8)
    return torch.from_numpy(raw).view(info.torch_dtype)


def target_of(base: torch.Tensor, share: float, random_bits: bool, by_exponent: bool,
              rng: np.random.Generator) -> torch.Tensor:
    out = base.clone()
    flat = out.view(SIGNED[out.element_size()])
    p = np.full(flat.numel(), share)
    if by_exponent and base.dtype.is_floating_point and base.dtype is not FP4X2:  # one value a byte
        weight = 1 / np.maximum(np.abs(base.double().numpy()), 1e-4)
        p = np.minimum(1.0, share * weight / weight.mean())
    at = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < p))
    if random_bits:
        raw = torch.from_numpy(rng.integers(0, 256, size=at.numel() * out.element_size(), dtype=np.uint8))
        flat[at] = raw.view(flat.dtype)
    else:
        flat[at] += torch.from_numpy(rng.choice([-3, -1, 1, 2], at.numel())).to(flat.dtype)
    return out


def timed(base: dict, target: dict, rounds: int = 3) -> tuple[float, float]:
    """(diff, apply) in milliseconds, the best of `rounds`; the apply's copy made outside."""
    best_diff = best_apply = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        p = diff(base, target)
        best_diff = min(best_diff, time.perf_counter() - t)
        state = {k: v.clone() for k, v in base.items()}
        t = time.perf_counter()
        apply(state, p)
        best_apply = min(best_apply, time.perf_counter() - t)
    return best_diff * 1e3, best_apply * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--shares", default="0.001,0.01", help="comma-separated shares of elements changed")
    ap.add_argument("--random", action="store_true", help="changed elements take random bits, not small steps")
    ap.add_argument("--by-exponent", action="store_true", help="floats: small values change more often (1/|value|)")
    ap.add_argument("--time", action="store_true", help="add diff and apply times (best of 3)")
    ap.add_argument("--dtypes", default=",".join(n for n in ORDER if n in BY_NAME))
    args = ap.parse_args()
    print(f"{'dtype':>10} {'share':>6} {'changed':>9} {'pos B/ch':>9} {'val B/ch':>9} {'patch B/ch':>10} {'classes':>7}"
          + (f" {'diff ms':>8} {'apply ms':>8}" if args.time else ""))
    for share in [float(x) for x in args.shares.split(",")]:
        for name in args.dtypes.split(","):
            rng = np.random.default_rng(7)
            base = {"x": typical(name, args.elements, rng)}
            target = {"x": target_of(base["x"], share, args.random, args.by_exponent, rng)}
            p = diff(base, target)
            s = p.stats()
            classes = max((seg.window[1] for c in p.chunks for seg in parse_chunk(c)[0] if seg.kind == "d"), default=0)
            m = max(1, s["changed"])
            line = (f"{name:>10} {share:>6g} {s['changed']:>9,} {s['position_bytes'] / m:>9.3f} "
                    f"{s['value_bytes'] / m:>9.3f} {s['chunk_bytes'] / m:>10.3f} {classes:>7}")
            if args.time:
                line += " {:>8.1f} {:>8.1f}".format(*timed(base, target))
            print(line)


if __name__ == "__main__":
    main()
