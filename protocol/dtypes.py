"""The served dtypes and their bit patterns.

Owns: the names used on the wire for each dtype, the integer view of the same
width, and the order-preserving map from sign-magnitude float bits to integers
(so +tiny → -tiny is a small delta, and -0.0 ≠ +0.0). Pure functions, no I/O.
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
    int_dtype: torch.dtype  # same width, signed
    np_int: type  # numpy signed integer of the same width
    width: int  # bytes
    mantissa_bits: int  # context key = magnitude >> mantissa_bits (the exponent)
    is_float: bool

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
]
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
    """Bit patterns → int64 whose order matches the float order (sign-magnitude undone)."""
    return ordered_bits(bits, info).astype(np.int64)


def ordered_range(info: DtypeInfo) -> tuple[int, int]:
    """Inclusive bounds of `to_ordered` over every bit pattern of the dtype."""
    if info.is_float:
        return -info.magnitude_mask - 1, info.magnitude_mask
    if info.np_int in (np.uint8,):
        return 0, 255
    ii = np.iinfo(info.np_int)
    return int(ii.min), int(ii.max)
