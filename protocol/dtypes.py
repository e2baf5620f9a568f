"""The served dtypes and their bit patterns.

Owns: the names used on the wire for each dtype, the integer view of the same
width, the order-preserving map from sign-magnitude float bits to integers
(so +tiny → -tiny is a small delta, and -0.0 ≠ +0.0), and what the codec's
context classes read as a dtype's exponent (its class key). Pure functions,
no I/O.

Unsigned dtypes (u8, u16, u32, u64, f8e8m0, an exponent with no sign, and
f4e2m1x2, two fp4 values in a byte) are viewed as unsigned integers of their
width, so their order is their bits' order with no sign bit to undo.
float8_e8m0fnu came with torch 2.7, float4_e2m1fn_x2 with 2.8; under an older
torch (pyproject allows 2.4) they are not in the tables at all, and their
names (in a patch, a change stream, a checkpoint's F8_E8M0 or F4 header) meet
the usual "expected one of" error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .errors import UnsupportedFormat, UsageError


@dataclasses.dataclass(frozen=True)
class DtypeInfo:
    name: str
    torch_dtype: torch.dtype
    int_dtype: torch.dtype  # same width; unsigned for the unsigned dtypes (and bool's uint8)
    np_int: type  # numpy integer of the same width and signedness
    width: int  # bytes
    mantissa_bits: int  # context key = (bits >> mantissa_bits) & key_mask, ^ key_xor (the exponent)
    is_float: bool  # sign-magnitude: the ordered map flips negatives, keyframe planes rotate the sign down
    exponent_bits: int = -1  # -1: the sign-magnitude float's own (bits - 1 - mantissa_bits); 0: no classes
    key_xor: int = 0  # f64: its exponent's low 8 bits with bit 7 flipped (the fp32 exponent, see below)

    @property
    def exponent(self) -> int:
        """Bits of the exponent field the class key is read from (0: integers, no classes)."""
        if self.exponent_bits >= 0:
            return self.exponent_bits
        return self.bits - 1 - self.mantissa_bits if self.is_float else 0

    @property
    def key_mask(self) -> int:
        """The class key's mask after the shift: the exponent field, at most 8 bits of it."""
        return (1 << min(self.exponent, 8)) - 1

    @property
    def unsigned(self) -> bool:
        return np.dtype(self.np_int).kind == "u"

    @property
    def bits(self) -> int:
        return self.width * 8

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def magnitude_mask(self) -> int:
        return self.sign_bit - 1


_INFOS = [
    DtypeInfo("bf16", torch.bfloat16, torch.int16, np.int16, 2, 7, True),
    DtypeInfo("fp16", torch.float16, torch.int16, np.int16, 2, 10, True),
    DtypeInfo("fp32", torch.float32, torch.int32, np.int32, 4, 23, True),
    DtypeInfo("f8e4m3", torch.float8_e4m3fn, torch.int8, np.int8, 1, 3, True),
    DtypeInfo("f8e5m2", torch.float8_e5m2, torch.int8, np.int8, 1, 2, True),
    DtypeInfo("i8", torch.int8, torch.int8, np.int8, 1, 0, False),
    DtypeInfo("u8", torch.uint8, torch.uint8, np.uint8, 1, 0, False),
    DtypeInfo("i16", torch.int16, torch.int16, np.int16, 2, 0, False),
    DtypeInfo("i32", torch.int32, torch.int32, np.int32, 4, 0, False),
    DtypeInfo("i64", torch.int64, torch.int64, np.int64, 8, 0, False),
    DtypeInfo("bool", torch.bool, torch.uint8, np.uint8, 1, 0, False),
    # Names added on 2026-12-05: an older member refuses a version (patch, keyframe, change
    # stream) naming one ("dtype name: expected one of [...], found 'fp64'"). The class key of an f64 is its 11-bit
    # exponent's low 8 bits with bit 7 flipped: (e + 1023 + 128) mod 256 = e + 127 for e in
    # -127..128, the same key fp32 gives the same value, so the windows that fit fp32's and bf16's
    # weights fit; the rare exponent outside that range wraps into another class (costing bits,
    # never correctness).
    DtypeInfo("fp64", torch.float64, torch.int64, np.int64, 8, 52, True, 11, 0x80),
    DtypeInfo("u16", torch.uint16, torch.uint16, np.uint16, 2, 0, False),
    DtypeInfo("u32", torch.uint32, torch.uint32, np.uint32, 4, 0, False),
    DtypeInfo("u64", torch.uint64, torch.uint64, np.uint64, 8, 0, False),
]
# MX scales: an 8-bit exponent with no sign bit and no mantissa (0xFF is NaN). Its key is the
# whole byte: the value itself, in order. torch >= 2.7 only (see the module docstring).
E8M0 = getattr(torch, "float8_e8m0fnu", None)
if E8M0 is not None:
    _INFOS.append(DtypeInfo("f8e8m0", E8M0, torch.uint8, np.uint8, 1, 0, False, 8))
# Names added on 2026-12-07. The fnuz fp8 formats (AMD MI300's: no -0, whose pattern 0x80 is
# their one NaN; exponent bias one more) lay out sign, exponent and mantissa as e4m3 and e5m2
# do, so they take the same order map and class keys.
_INFOS += [
    DtypeInfo("f8e4m3fnuz", torch.float8_e4m3fnuz, torch.int8, np.int8, 1, 3, True),
    DtypeInfo("f8e5m2fnuz", torch.float8_e5m2fnuz, torch.int8, np.int8, 1, 2, True),
]
# Two fp4 e2m1 values packed in a byte (NVFP4 and MXFP4 weights; safetensors' F4). One byte
# is two numbers, so it has no single sign or exponent: its bits are its order, one class (as
# u8). torch >= 2.8 only, like E8M0 before 2.7.
FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
if FP4X2 is not None:
    _INFOS.append(DtypeInfo("f4e2m1x2", FP4X2, torch.uint8, np.uint8, 1, 0, False))


def safetensors_shape_fault(dtype: torch.dtype, shape) -> str | None:
    """Why a tensor of this dtype and shape has no form in a safetensors file, or None.
    safetensors' F4 counts fp4 values, two a byte, along the last dimension, so a
    float4_e2m1fn_x2 tensor with no dimensions has none (safetensors' own save refuses it)."""
    if dtype is FP4X2 and not len(shape):
        return (f"expected at least one dimension for {dtype}, found none (safetensors' F4 counts fp4 values "
                f"along the last one)")
    return None
BY_NAME = {i.name: i for i in _INFOS}
# The dtypes a served checkpoint's floating tensors may be cast to, by the names people type.
SERVED_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
BY_TORCH = {i.torch_dtype: i for i in _INFOS}
_INT_VIEW = {i.torch_dtype: i.int_dtype for i in _INFOS}  # bool's is uint8


def info_of(dtype: torch.dtype) -> DtypeInfo:
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedFormat(f"dtype: expected one of {sorted(BY_NAME)}, found {dtype}") from None


def info_named(name: str) -> DtypeInfo:
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedFormat(f"dtype name: expected one of {sorted(BY_NAME)}, found {name!r}") from None


def check_plain(t: torch.Tensor, what: str) -> None:
    """UnsupportedFormat unless `t`'s bits are its own: a torch.Tensor, or a subclass whose
    operations give plain tensors. A DTensor (FSDP2's state_dict) is neither: each rank holds
    a shard, and only a collective on every rank gathers it."""
    if type(t) is torch.Tensor or type(t.detach()).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return
    raise UnsupportedFormat(f"{what}: expected a plain tensor, found a {type(t).__name__} whose data is not its "
                            f"own (gather it first: DTensor.full_tensor(), or a full state_dict)")


def check_dense(t: torch.Tensor, what: str) -> None:
    """UnsupportedFormat unless `t` is dense (strided, not nested) and plain (`check_plain`)."""
    if t.is_nested or t.layout != torch.strided:
        found = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise UnsupportedFormat(f"{what}: expected a dense (strided) tensor, found {found}")
    check_plain(t, what)


def check_tensor(t: torch.Tensor, what: str) -> DtypeInfo:
    """The dtype of `t` (named `what` in errors) if the codec and the state hash can read its
    bits: a dense tensor in CPU memory of a dtype above. UnsupportedFormat otherwise (sparse,
    nested, complex, quantized...), UsageError for one that is not in CPU memory (meta, an
    accelerator's: the caller moves it), before anything reads it."""
    check_dense(t, what)
    if t.device.type != "cpu":
        raise UsageError(f"{what}: expected a CPU tensor, found device {t.device}")
    info = BY_TORCH.get(t.dtype)
    if info is None:
        raise UnsupportedFormat(f"{what}: dtype: expected one of {sorted(BY_NAME)}, found {t.dtype}")
    return info


def checked_info(t: torch.Tensor, where: str, name: str) -> DtypeInfo:
    """`check_tensor(t, f"{where}[{name!r}]")`, its common case first: a plain CPU tensor of a
    dtype above is told by four attribute reads, without the call chain and the error
    text (a state of 140k tensors is checked once per phase of every apply). Anything
    else goes to `check_tensor`, which raises what it always did or passes it."""
    if type(t) is torch.Tensor and t.is_cpu and not t.is_nested and t.layout == torch.strided:
        info = BY_TORCH.get(t.dtype)
        if info is not None:
            return info
    return check_tensor(t, f"{where}[{name!r}]")


def int_view(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view (shared memory) of a contiguous `t`'s bit patterns as integers."""
    as_int = _INT_VIEW.get(t.dtype) or info_of(t.dtype).int_dtype
    if t.dim() > 64 or not t.numel():
        # Flattened by torch first: numpy takes at most 64 dimensions and no shape whose
        # product overflows, which an empty tensor may have ([0, 2**62]).
        t = t.reshape(-1)
    a = t.view(as_int).numpy()
    return a if a.ndim == 1 else a.reshape(-1)  # a 1-d array is flat already: one object less


def ordered_bits(bits: np.ndarray, info: DtypeInfo) -> np.ndarray:
    """`to_ordered` in the dtype's own width; it is its own inverse.

    A negative float's ordered value is -magnitude - 1 = ~magnitude, whose
    bit pattern is the float's with the magnitude bits flipped: one xor with
    a mask made from the sign (an arithmetic shift), no int64 temporaries.
    """
    if not info.is_float:
        return bits
    return bits ^ ((bits >> (info.bits - 1)) & info.magnitude_mask)


def to_ordered(bits: np.ndarray, info: DtypeInfo) -> np.ndarray:
    """Bit patterns → int64 whose order matches the float order (sign-magnitude undone), or
    the unsigned order; u64 patterns from 2^63 up wrap to negative int64. No delta
    changes: a 64-bit delta is taken modulo 2^64 (as i64's, whose differences overflow
    too), and modulo 2^64 the wrapped and the true difference are the same."""
    return ordered_bits(bits, info).astype(np.int64)


def ordered_range(info: DtypeInfo) -> tuple[int, int]:
    """Inclusive bounds of `to_ordered` over every bit pattern of the dtype."""
    if info.is_float:
        return -info.magnitude_mask - 1, info.magnitude_mask
    if info.width == 8:  # to_ordered's int64 wraps u64 (64-bit deltas are modular: i64's, f64's, u64's)
        ii = np.iinfo(np.int64)
    else:
        ii = np.iinfo(info.np_int)  # unsigned: 0 .. 2^bits - 1
    return int(ii.min), int(ii.max)
