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

from patchswarm.protocol.contexts import has_classes, keys_of
from patchswarm.protocol.dtypes import BY_NAME, info_named, info_of, ordered_bits, ordered_range, to_ordered
from patchswarm.protocol.errors import UnsupportedFormat

HAS_FP4X2 = hasattr(torch, "float4_e2m1fn_x2")
# torch's floats that hold one number an element (float4_e2m1fn_x2 packs two in a byte: below)
FLOATS = [name for name, info in BY_NAME.items() if info.torch_dtype.is_floating_point and name != "f4e2m1x2"]


def every_pattern(info) -> np.ndarray:
    """Every bit pattern of a dtype of up to 16 bits, as its integer view."""
    return np.arange(1 << info.bits, dtype=np.int64).astype(info.np_int, casting="unsafe")


HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")
NEW = ["fp64", "u16", "u32", "u64", *(["f8e8m0"] if HAS_E8M0 else []), "f8e4m3fnuz", "f8e5m2fnuz",
       *(["f4e2m1x2"] if HAS_FP4X2 else [])]


def test_the_float_dtypes_are_the_floats():
    """The sign-magnitude floats are torch's floats but f8e8m0, an exponent with no sign."""
    signed = ["bf16", "f8e4m3", "f8e4m3fnuz", "f8e5m2", "f8e5m2fnuz", "fp16", "fp32", "fp64"]
    assert sorted(n for n, i in BY_NAME.items() if i.is_float) == signed
    assert sorted(FLOATS) == sorted(signed + (["f8e8m0"] if HAS_E8M0 else []))


def test_the_new_dtypes_are_known_by_name_and_torch_dtype():
    for name in NEW:
        info = BY_NAME[name]
        assert info_of(info.torch_dtype) is info and info_named(name) is info
        assert torch.empty(0, dtype=info.torch_dtype).element_size() == info.width


@pytest.mark.parametrize("attr, const, name, st_name", [("float8_e8m0fnu", "E8M0", "f8e8m0", "F8_E8M0"),
                                                        ("float4_e2m1fn_x2", "FP4X2", "f4e2m1x2", "F4")])
def test_without_a_late_dtype_in_torch_its_name_is_unknown_with_the_usual_error(tmp_path, attr, const, name, st_name):
    """Under torch < 2.7 (no float8_e8m0fnu) or < 2.8 (no float4_e2m1fn_x2) the tables lack it:
    its wire name, and a checkpoint's tensor of it, meet the "expected one of" error every
    unknown dtype meets, and the rest loads. In a fresh interpreter whose torch lacks the
    attribute (reloading here would leave other modules holding the tables of the first import)."""
    header = json.dumps({"s": {"dtype": st_name, "shape": [2], "data_offsets": [0, 1 if name == "f4e2m1x2" else 2]}})
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(2))
    code = (
        f"import torch\nif hasattr(torch, {attr!r}): delattr(torch, {attr!r})\n"
        "from patchswarm.protocol import dtypes, patch, served, changes\n"
        "from patchswarm.node import basefile\n"
        f"assert dtypes.{const} is None and {name!r} not in dtypes.BY_NAME and 'fp64' in dtypes.BY_NAME\n"
        f"for call in (lambda: dtypes.info_named({name!r}), lambda: basefile.read_header({str(path)!r})):\n"
        "    try:\n"
        "        call()\n"
        "    except dtypes.UnsupportedFormat as e:\n"
        "        print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    name_error, file_error = r.stdout.splitlines()
    assert re.fullmatch(rf"dtype name: expected one of \[.*'fp64'.*\], found '{name}'", name_error), r.stdout
    assert re.search(rf"tensor 's': dtype: expected one of \[.*'U64'.*\], found '{st_name}'$", file_error), r.stdout


@pytest.mark.skipif(not HAS_FP4X2, reason="torch < 2.8 has no float4_e2m1fn_x2")
def test_packed_fp4_is_read_as_unsigned_bytes_in_one_class():
    """Two e2m1 values a byte have no one sign or exponent: the byte's bits are its order (a
    step of the low value is a delta of one, of the high value sixteen) and it has one class."""
    info = BY_NAME["f4e2m1x2"]
    bits = every_pattern(info)
    assert info.unsigned and not info.is_float and info.width == 1
    assert np.array_equal(to_ordered(bits, info), np.arange(256)) and ordered_range(info) == (0, 255)
    assert not has_classes(info)


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
        # the sign bit alone is -0.0 (the fnuz formats' one NaN: they have no -0), ordered -1
        sign_alone = (bits.astype(np.int64) & ((1 << info.bits) - 1)) == info.sign_bit
        assert ordered[sign_alone].tolist() == [-1] and ordered[bits == 0].tolist() == [0]
        assert values[sign_alone][0] == 0 and np.signbit(values[sign_alone][0]) or np.isnan(values[sign_alone][0])
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
    per binade: the pattern after 1.0's is 1 + 2 ** -mantissa width. (Read from the patterns,
    not torch.finfo: its eps for float8_e5m2fnuz is 0.125 where the format's step is 0.25.)"""
    info = BY_NAME[name]
    one = torch.ones(1, dtype=torch.float32).to(info.torch_dtype).view(info.int_dtype)
    after = (one + 1).view(info.torch_dtype).double().item()
    assert after - 1.0 == 2.0 ** -info.mantissa_bits


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
