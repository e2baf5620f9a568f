"""dtypes.py's order-preserving map from bit patterns to integers, over every bit pattern of each
dtype of up to 16 bits (and the extremes of the wider ones): the delta coder's deltas and the
decoder's range check both rest on it."""

import numpy as np
import pytest
import torch

from patchswarm.protocol.dtypes import BY_NAME, ordered_bits, ordered_range, to_ordered

FLOATS = [name for name, info in BY_NAME.items() if info.torch_dtype.is_floating_point]


def every_pattern(info) -> np.ndarray:
    """Every bit pattern of a dtype of up to 16 bits, as its integer view."""
    return np.arange(1 << info.bits, dtype=np.int64).astype(info.np_int, casting="unsafe")


def test_the_float_dtypes_are_the_floats():
    assert sorted(FLOATS) == sorted(n for n, i in BY_NAME.items() if i.is_float) == ["bf16", "f8e4m3", "f8e5m2", "fp16", "fp32"]


@pytest.mark.parametrize("name", [n for n in FLOATS if BY_NAME[n].bits <= 16])
def test_ordered_integers_follow_the_float_order_over_every_bit_pattern(name):
    info = BY_NAME[name]
    bits = every_pattern(info)
    values = torch.from_numpy(bits).view(info.torch_dtype).double().numpy()
    ordered = to_ordered(bits, info)
    keep = ~np.isnan(values)
    by_order = np.argsort(ordered[keep], kind="stable")
    assert np.all(np.diff(values[keep][by_order]) >= 0)  # the order of the integers is the floats'
    assert np.unique(ordered).size == bits.size  # one integer per pattern: -0.0 and +0.0 too
    neg_zero = np.flatnonzero((values == 0) & np.signbit(values))
    assert ordered[neg_zero].tolist() == [-1] and ordered[bits == 0].tolist() == [0]
    assert np.array_equal(ordered_bits(ordered_bits(bits, info), info), bits)  # its own inverse


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_ordered_range_is_the_range_over_every_bit_pattern(name):
    info = BY_NAME[name]
    if info.bits <= 16:
        bits = every_pattern(info)
    else:  # the extremes: 0, 1, the sign bit alone, the magnitude mask, all ones
        bits = np.array([0, 1, info.sign_bit, info.magnitude_mask, (1 << info.bits) - 1], dtype=np.uint64)
        bits = bits.astype(info.np_int, casting="unsafe")
    ordered = to_ordered(bits, info)
    assert ordered_range(info) == (int(ordered.min()), int(ordered.max()))


@pytest.mark.parametrize("name", FLOATS)
def test_mantissa_bits_are_the_float_formats(name):
    """The context key is magnitude >> mantissa_bits: the exponent field exactly, so one class
    per binade (torch's eps is 2 ** -mantissa width)."""
    info = BY_NAME[name]
    assert 2.0 ** -info.mantissa_bits == torch.finfo(info.torch_dtype).eps
