"""Lossless coding of raw tensor bytes: byte planes with an entropy stage.

Owns the layout of a "full" payload (new tensors, keyframes). Float bit
patterns are rotated left by one so the sign joins the mantissa and the
exponent fills whole bytes; the array is split into byte planes (all first
bytes, all second bytes, ...), and each plane is zstd-compressed on its own
(the exponent plane shrinks to ~1/3, mantissa planes stay near raw; a plane
that does not shrink is stored raw).
"""

from __future__ import annotations

import numpy as np
import zstandard

from .dtypes import DtypeInfo
from .errors import CorruptData

ZSTD_LEVEL = 1  # measured on bf16 exponent planes: 2.88 bits at level 1, 3.25 at 3, 2.65 at 19 (170x slower)
_RAW, _ZSTD = 0, 1
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _rotate(bits: np.ndarray, info: DtypeInfo, left: bool) -> np.ndarray:
    u = bits.view(_UNSIGNED[info.width])
    n = info.bits
    one, rest = u.dtype.type(1), u.dtype.type(n - 1)
    return (u << one) | (u >> rest) if left else (u >> one) | (u << rest)


def encode(bits: np.ndarray, info: DtypeInfo) -> list:
    """Planes of a flat integer array → [[mode, bytes], ...] (msgpack-able)."""
    u = _rotate(bits, info, True) if info.is_float else bits.view(_UNSIGNED[info.width])
    planes = u.astype(u.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, info.width)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    out = []
    for j in range(info.width):
        raw = np.ascontiguousarray(planes[:, j]).tobytes()
        z = cctx.compress(raw)
        out.append([_ZSTD, z] if len(z) < len(raw) else [_RAW, raw])
    return out


def decode(planes: list, count: int, info: DtypeInfo) -> np.ndarray:
    """Inverse of `encode`; the result is the dtype's integer view, `count` elements."""
    if not isinstance(planes, list) or len(planes) != info.width:
        raise CorruptData(f"byte planes: expected {info.width}, found {len(planes) if isinstance(planes, list) else type(planes).__name__}")
    u8 = np.empty((count, info.width), dtype=np.uint8)
    dctx = zstandard.ZstdDecompressor()
    for j, plane in enumerate(planes):
        try:
            mode, data = plane
            if mode == _ZSTD:
                data = dctx.decompress(data, max_output_size=count)
            elif mode != _RAW:
                raise CorruptData(f"byte plane mode: expected 0 or 1, found {mode!r}")
        except (ValueError, TypeError, zstandard.ZstdError) as e:
            raise CorruptData(f"byte plane {j}: {e}") from None
        if not isinstance(data, (bytes, bytearray)) or len(data) != count:
            raise CorruptData(f"byte plane {j}: expected {count} bytes, found {len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__}")
        u8[:, j] = np.frombuffer(data, dtype=np.uint8)
    u = u8.view(np.dtype(_UNSIGNED[info.width]).newbyteorder("<")).reshape(-1).astype(_UNSIGNED[info.width])
    if info.is_float:
        u = _rotate(u, info, False)
    return u.view(info.np_int)
