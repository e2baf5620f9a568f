"""Lossless coding of raw tensor bytes: byte planes with an entropy stage.

Owns the layout of a "full" payload (new tensors, keyframes). Float bit
patterns are rotated left by one so the sign joins the mantissa and the
exponent fills whole bytes; the array is split into byte planes (all first
bytes, all second bytes, ...), and each plane is zstd-compressed on its own
(the exponent plane shrinks to ~1/3, mantissa planes stay near raw; a plane
that does not shrink is stored raw).

Decoding trusts no size a frame declares: zstd allocates the content size a
frame header states, whatever output limit it is given, so `decompress` checks
that size against the caller's limit and against ZSTD_MAX_RATIO times the
frame's bytes before it runs, and `decode` checks every plane's size before
it allocates the output.
"""

from __future__ import annotations

import numpy as np
import zstandard

from .dtypes import DtypeInfo
from .errors import CorruptData

ZSTD_LEVEL = 1  # measured on bf16 exponent planes: 2.88 bits at level 1, 3.25 at 3, 2.65 at 19 (170x slower)
# Level 1 with its match table cut from 2^14 entries to zstd's least, 2^6: the exponents of
# trained weights repeat no long strings, and the short matches a larger table finds cost
# more than the literals they replace: `make bench`'s bf16 keyframes 0.680 -> 0.664 of raw
# (protocol/README.md). Only the encoder changes: the frames are plain zstd to any decoder.
ZSTD_HASH_LOG = 6
# The most a zstd frame can expand, by its format: a block holds at most 128 KiB
# and takes at least 4 bytes (an RLE block: 3 of header, 1 of content). A plane
# of zeros gets close (16 MiB in 531 bytes, 31,596x, at level 1), so no lower cap
# would keep every real tensor.
ZSTD_MAX_RATIO = (128 << 10) // 4
_RAW, _ZSTD = 0, 1
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _compressor() -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        ZSTD_LEVEL, hash_log=ZSTD_HASH_LOG))


def _rotate(bits: np.ndarray, info: DtypeInfo, left: bool) -> np.ndarray:
    u = bits.view(_UNSIGNED[info.width])
    n = info.bits
    one, rest = u.dtype.type(1), u.dtype.type(n - 1)
    return (u << one) | (u >> rest) if left else (u >> one) | (u << rest)


def encode(bits: np.ndarray, info: DtypeInfo) -> list:
    """Planes of a flat integer array → [[mode, bytes], ...] (msgpack-able)."""
    u = _rotate(bits, info, True) if info.is_float else bits.view(_UNSIGNED[info.width])
    planes = u.astype(u.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, info.width)
    cctx = _compressor()
    out = []
    for j in range(info.width):
        raw = np.ascontiguousarray(planes[:, j]).tobytes()
        z = cctx.compress(raw)
        out.append([_ZSTD, z] if len(z) < len(raw) else [_RAW, raw])
    return out


def decompress(data: bytes, limit: int, what: str) -> bytes:
    """The content of one zstd frame, at most `limit` bytes; CorruptData otherwise.

    The content size the frame declares (zstd allocates it whatever output
    limit it is given) is checked against `limit` and ZSTD_MAX_RATIO times the
    frame's bytes first; a frame that declares none grows up to `limit`."""
    limit = min(limit, ZSTD_MAX_RATIO * len(data))
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: expected a zstd frame, found bytes that are not one ({e})") from None
    if declared > limit:
        raise CorruptData(f"{what}: expected at most {limit} bytes of content from a frame of {len(data)}, "
                          f"found a frame that declares {declared}")
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise CorruptData(f"{what}: undecodable zstd frame ({e})") from None


def decode(planes: list, count: int, info: DtypeInfo) -> np.ndarray:
    """Inverse of `encode`; the result is the dtype's integer view, `count` elements.

    Every plane's size is checked (a raw plane's length, a zstd frame's
    declared content) before anything is allocated for `count` elements."""
    if not isinstance(planes, list) or len(planes) != info.width:
        raise CorruptData(f"byte planes: expected {info.width}, found {len(planes) if isinstance(planes, list) else type(planes).__name__}")
    for j, plane in enumerate(planes):
        if not (isinstance(plane, list) and len(plane) == 2 and plane[0] in (_RAW, _ZSTD) and type(plane[0]) is int
                and isinstance(plane[1], bytes)):
            raise CorruptData(f"byte plane {j}: expected [0 or 1, bytes], found {str(plane)[:60]}")
        mode, data = plane
        if mode == _RAW and len(data) != count:
            raise CorruptData(f"byte plane {j}: expected {count} raw bytes, found {len(data)}")
        if mode == _ZSTD:
            try:
                declared = zstandard.frame_content_size(data)
            except zstandard.ZstdError as e:
                raise CorruptData(f"byte plane {j}: expected a zstd frame, found bytes that are not one ({e})") from None
            if declared not in (count, -1) or count > ZSTD_MAX_RATIO * len(data):
                raise CorruptData(f"byte plane {j}: expected a zstd frame of {count} bytes of content, found one of "
                                  f"{len(data)} bytes that declares {declared}")
    u8 = np.empty((count, info.width), dtype=np.uint8)
    for j, (mode, data) in enumerate(planes):
        if mode == _ZSTD:
            data = decompress(data, count, f"byte plane {j}")
            if len(data) != count:
                raise CorruptData(f"byte plane {j}: expected {count} bytes, found {len(data)}")
        u8[:, j] = np.frombuffer(data, dtype=np.uint8)
    u = u8.view(np.dtype(_UNSIGNED[info.width]).newbyteorder("<")).reshape(-1).astype(_UNSIGNED[info.width])
    if info.is_float:
        u = _rotate(u, info, False)
    return u.view(info.np_int)
