"""The zero-order bound in bench/codec.py, on hand-built states with known entropy."""

import math

import torch

from bench.codec import zero_order_bound_bytes


def _h(p: float) -> float:
    return -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def test_ten_of_thousand_changed_by_one_ulp():
    base = torch.linspace(0.1, 1.0, 1000).to(torch.bfloat16)  # positive: +1 on the bits is one ulp up
    bits = base.view(torch.int16).clone()
    bits[::100] += 1  # exactly 10 changed, all by the same delta: one symbol, 0 value bits
    target = bits.view(torch.bfloat16)
    got = zero_order_bound_bytes({"w": base}, {"w": target})
    assert math.isclose(got, 1000 * _h(0.01) / 8, rel_tol=1e-12)


def test_unchanged_and_pooled_values():
    a = torch.zeros(8, dtype=torch.bfloat16)
    b = a.view(torch.int16).clone()
    b[:4] = torch.tensor([1, 1, 2, 2], dtype=torch.int16)  # 4 of 8 changed; deltas {1,1,2,2}: 1 bit each
    same = torch.ones(5, dtype=torch.bfloat16)
    got = zero_order_bound_bytes({"a": a, "s": same}, {"a": b.view(torch.bfloat16), "s": same.clone()})
    assert math.isclose(got, (8 * 1.0 + 4 * 1.0) / 8, rel_tol=1e-12)
