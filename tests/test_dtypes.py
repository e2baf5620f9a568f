"""dtypes.py's order-preserving map from bit patterns to integers, over every bit pattern of each
dtype of up to 16 bits (and the extremes of the wider ones): the delta coder's deltas and the
decoder's range check both rest on it."""

import json
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from patchswarm.protocol.contexts import keys_of
from patchswarm.protocol.dtypes import BY_NAME, info_named, info_of, ordered_bits, ordered_range, to_ordered
from patchswarm.protocol.errors import UnsupportedFormat

FLOATS = [name for name, info in BY_NAME.items() if info.torch_dtype.is_floating_point]


def every_pattern(info) -> np.ndarray:
    """Every bit pattern of a dtype of up to 16 bits, as its integer view."""
    return np.arange(1 << info.bits, dtype=np.int64).astype(info.np_int, casting="unsafe")


HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")
NEW = ["fp64", "u16", "u32", "u64", *(["f8e8m0"] if HAS_E8M0 else [])]


def test_the_float_dtypes_are_the_floats():
    """The sign-magnitude floats are torch's floats but f8e8m0, an exponent with no sign."""
    signed = ["bf16", "f8e4m3", "f8e5m2", "fp16", "fp32", "fp64"]
    assert sorted(n for n, i in BY_NAME.items() if i.is_float) == signed
    assert sorted(FLOATS) == sorted(signed + (["f8e8m0"] if HAS_E8M0 else []))


def test_the_new_dtypes_are_known_by_name_and_torch_dtype():
    for name in NEW:
        info = BY_NAME[name]
        assert info_of(info.torch_dtype) is info and info_named(name) is info
        assert torch.empty(0, dtype=info.torch_dtype).element_size() == info.width


def test_without_float8_e8m0fnu_in_torch_its_name_is_unknown_with_the_usual_error(tmp_path):
    """Under torch < 2.7 (no float8_e8m0fnu) the tables have no f8e8m0: its wire name, and a
    checkpoint's F8_E8M0 tensor, meet the "expected one of" error every unknown dtype meets,
    and the rest loads. In a fresh interpreter whose torch lacks the attribute (reloading
    here would leave other modules holding the tables of the first import)."""
    header = json.dumps({"s": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(2))
    code = (
        "import torch\nif hasattr(torch, 'float8_e8m0fnu'): del torch.float8_e8m0fnu\n"
        "from patchswarm.protocol import dtypes, patch, served, changes\n"
        "from patchswarm.node import basefile\n"
        "assert dtypes.E8M0 is None and 'f8e8m0' not in dtypes.BY_NAME and 'fp64' in dtypes.BY_NAME\n"
        "for call in (lambda: dtypes.info_named('f8e8m0'), lambda: basefile.read_header(%r)):\n"
        "    try:\n"
        "        call()\n"
        "    except dtypes.UnsupportedFormat as e:\n"
        "        print(e)\n") % str(path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    name_error, file_error = r.stdout.splitlines()
    assert re.fullmatch(r"dtype name: expected one of \[.*'fp64'.*\], found 'f8e8m0'", name_error), r.stdout
    assert re.search(r"tensor 's': dtype: expected one of \[.*'U64'.*\], found 'F8_E8M0'$", file_error), r.stdout


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
    if info.is_float:  # f8e8m0 has no sign and no zero: its bits are its order
        neg_zero = np.flatnonzero((values == 0) & np.signbit(values))
        assert ordered[neg_zero].tolist() == [-1] and ordered[bits == 0].tolist() == [0]
    else:
        assert np.array_equal(ordered, np.arange(bits.size)) and np.isnan(values[-1])  # 0xFF is NaN
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


@pytest.mark.parametrize("name", ["u16", "u32", "u64"])
def test_unsigned_integers_keep_their_order_with_no_sign_bit(name):
    """Every u16 pattern, and the u32 / u64 extremes: the ordered integers ascend with the
    unsigned values (u64's past 2^63 wrap, and their deltas are modular: the same as the true
    ones), and a step across the old sign bit is a delta of one."""
    info = BY_NAME[name]
    if info.bits == 16:
        bits = every_pattern(info)
    else:
        top = (1 << info.bits) - 1
        bits = np.array([0, 1, info.sign_bit - 1, info.sign_bit, top - 1, top], dtype=np.uint64).astype(info.np_int)
    ordered = to_ordered(bits, info)
    if info.width < 8:
        assert np.all(np.diff(ordered) > 0) and ordered[0] == 0
    mid = np.array([info.sign_bit - 1, info.sign_bit], dtype=np.uint64).astype(info.np_int)
    assert int(np.diff(to_ordered(mid, info))[0]) == 1


def test_fp64_nan_payloads_negative_zero_and_infinities_are_distinct_ordered_integers():
    info = BY_NAME["fp64"]
    values = np.array([-np.inf, -1.0, -0.0, 0.0, 5e-324, 1.0, np.inf], dtype=np.float64)
    ordered = to_ordered(values.view(np.int64), info)
    assert np.all(np.diff(ordered) > 0) and ordered[2] == -1 and ordered[3] == 0
    nans = np.array([0x7FF8000000000000, 0x7FF0000000000001, 0xFFF800000000BEEF], dtype=np.uint64).view(np.int64)
    assert np.array_equal(ordered_bits(ordered_bits(nans, info), info), nans)


def test_fp64_class_key_is_the_fp32_exponent_over_the_fp32_range():
    """f64's key: its exponent's low 8 bits with bit 7 flipped, which is fp32's exponent field
    for every value fp32 represents as a normal number, so the same windows fit."""
    values = np.ldexp(1.0, np.arange(-126, 128)) * 1.5
    k64 = keys_of(values.view(np.int64), BY_NAME["fp64"])
    k32 = keys_of(values.astype(np.float32).view(np.int32), BY_NAME["fp32"])
    assert np.array_equal(k64, k32)
    assert keys_of(np.array([-2.0]).view(np.int64), BY_NAME["fp64"]).tolist() == [128]  # the sign does not count


@pytest.mark.skipif(not HAS_E8M0, reason="torch < 2.7 has no float8_e8m0fnu")
def test_e8m0_class_key_is_the_whole_byte():
    bits = every_pattern(BY_NAME["f8e8m0"])
    assert np.array_equal(keys_of(bits, BY_NAME["f8e8m0"]), np.arange(256))
