"""Lossless patches between served states: the public API of the patch codec.

- `diff(base, target) -> Patch` and `keyframe(state) -> Patch` make patches
  (patchencode.py);
- `Patch` (`to_bytes`, `from_bytes`, `stats`) and `TensorSpec` are the
  container, format version `FORMAT_VERSION` (patchformat.py);
- `apply(state, patch)` applies one in place, all or nothing, and
  `decode_chunk(s)`, `check_structure`, `prepare`, `restore` are its steps
  for callers that apply chunk by chunk (patchdecode.py).

Everything outside the codec imports from here; the three modules behind it
may move things between them.
"""

from .patchdecode import (APPLY_BATCH_BYTES, DecodedChunk, apply, check_structure, decode_chunk, decode_chunks, prepare,
                          restore)
from .patchencode import CHUNK_BYTES, DELTA_SEGMENT_ELEMENTS, FULL_SEGMENT_BYTES, SEGMENT_CHANGES, diff, keyframe
from .patchformat import (CLASS_MIN_ELEMENTS, DIGEST_BYTES, FORMAT, FORMAT_VERSION, MAX_PATCH_BYTES, MAX_SEGMENT_ELEMENTS,
                          MAX_TABLE_BYTES, PARALLEL_MIN_BYTES, TABLE_ZSTD_LEVEL, Patch, Progress, State, TensorSpec)

__all__ = [
    "APPLY_BATCH_BYTES", "CHUNK_BYTES", "CLASS_MIN_ELEMENTS", "DELTA_SEGMENT_ELEMENTS", "DIGEST_BYTES", "FORMAT",
    "FORMAT_VERSION", "FULL_SEGMENT_BYTES", "MAX_PATCH_BYTES", "MAX_SEGMENT_ELEMENTS", "MAX_TABLE_BYTES",
    "PARALLEL_MIN_BYTES", "SEGMENT_CHANGES", "TABLE_ZSTD_LEVEL", "DecodedChunk", "Patch", "Progress", "State",
    "TensorSpec", "apply", "check_structure", "decode_chunk", "decode_chunks", "diff", "keyframe", "prepare",
    "restore",
]
