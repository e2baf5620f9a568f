"""Served formats: what the trainer's tensors become before they are diffed and moved. Sans-IO.

Owns the per-tensor rule of each format, so a caller can serve a state one
tensor at a time (the origin streams, it never holds two served copies):

- `as-is`: every tensor keeps its dtype and bits (pre-quantized checkpoints:
  fp8 e4m3/e5m2 (OCP or AMD's fnuz) weights with their fp32 scales, packed
  fp4 ones, bf16 norms, int8...).
- `bf16` (the default, for fp32 masters): fp32 and fp16 tensors become bf16;
  fp8 and packed fp4 tensors and the scale tensors that belong to them keep
  their bits (a rounded scale would silently change every weight of its
  block). So do f64 tensors (buffers a model keeps in f64 on purpose: rotary
  frequencies, running statistics; nothing becomes f64 by default, and a cast
  would drop 45 of its 52 mantissa bits), f8e8m0 ones (MX block scales:
  exponents an engine reads as such) and every integer and bool tensor.
- `fp16`, `fp32`: as `bf16`, to that dtype.
- `fp8-block`: 2-D `*weight` tensors (not embeddings, not `lm_head`) become
  float8_e4m3fn with an fp32 `<name>_scale_inv` per 128x128 block, the
  DeepSeek-V3 / DeepGEMM convention: blocks zero-padded to 128, scale_inv =
  max(|block|, 1e-4) / 448, fp8 = block * (448 / amax), dequantized as
  fp8 * scale_inv; everything else floating becomes bf16.

Scale tensors are recognised by name: `<weight>_scale_inv` (DeepSeek-V3),
`<prefix>.weight_scale` and `<prefix>.input_scale` (compressed-tensors),
`.weight_scale_2` (ModelOpt NVFP4), `.output_scale` (Quark) and the attention's
fp8 KV-cache scales `.k_scale`, `.v_scale`, `.q_scale`, `.prob_scale` (vLLM,
compressed-tensors, ModelOpt, Quark) and `.kv_scale` (TGI).

What may be served at all is checked here too, before a tensor is made
(`check_source_tensor`, `check_served_spec`): a tensor that could not make the
whole trip (patch, nodes' weights files, the change stream to engines) is
refused at the origin, by name, not by every node.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .changes import MAX_DIMS as CHANGE_MAX_DIMS
from .dtypes import BY_NAME, BY_TORCH, E8M0, FP4X2, check_dense, safetensors_shape_fault
from .errors import InvalidInput, UnsupportedFormat, UsageError
from .patchformat import MAX_DIM, MAX_NAME_BYTES, name_bytes

FORMATS = ("as-is", "bf16", "fp16", "fp32", "fp8-block")
DEFAULT_FORMAT = "bf16"
BLOCK = 128
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # an all-zero block gets a finite scale (DeepGEMM clamps the same way)
SCALE_SUFFIX = "_scale_inv"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# Floating dtypes no format casts or quantizes (see the docstring): fp8, f64, and e8m0 and
# packed fp4 where torch has them (torch cannot even cast fp4: it has no copy kernel for it).
_KEPT = (*_FP8, torch.float64, *(d for d in (E8M0, FP4X2) if d is not None))
_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SCALE_ENDINGS = (SCALE_SUFFIX, ".weight_scale", ".input_scale", ".weight_scale_2", ".output_scale",
                  ".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")
_NOT_QUANTIZED = ("embed", "lm_head")  # DeepSeek-V3 and compressed-tensors keep these in bf16


# safetensors' header key for the file's metadata: a tensor of this name breaks every
# weights file that holds it (the origin's base, each node's).
RESERVED_NAMES = frozenset({"__metadata__"})


def check_source_tensor(name: str, t: torch.Tensor) -> None:
    """Raise unless `t` is a tensor the served state can be made of: dense, plain, with data
    (any device: it is copied to the CPU). UnsupportedFormat for sparse, nested or DTensor ones, UsageError
    for a meta tensor, before any work."""
    check_dense(t, f"served state: tensor {name!r}")
    if t.device.type == "meta":
        raise UsageError(f"served state: tensor {name!r}: expected a tensor with data, found one on the meta device")


def check_served_spec(name: str, dtype: torch.dtype, shape: tuple[int, ...], fmt: str) -> None:
    """Raise unless a served tensor of this name, dtype and shape can travel the whole way:
    in a patch, in a node's safetensors weights file and in the change stream to an engine
    (protocol/changes.py: names of 1..MAX_NAME_BYTES UTF-8 bytes, at most its MAX_DIMS
    dimensions, each at most the patch table's MAX_DIM). The origin checks its whole table
    before it makes a tensor."""
    size = name_bytes(name)
    if not 0 < size <= MAX_NAME_BYTES:
        raise UsageError(f"served state: tensor name: expected 1..{MAX_NAME_BYTES} bytes of UTF-8, found "
                         f"{'a string UTF-8 cannot encode' if size < 0 else f'{size} bytes'}: {name[:60]!r}")
    if name in RESERVED_NAMES or name.startswith(FILE_PREFIX):
        raise UsageError(f"served state: tensor name {name[:60]!r}: expected a name that is not reserved "
                         f"({', '.join(sorted(RESERVED_NAMES))}, or starting {FILE_PREFIX!r}: side files)")
    if dtype not in BY_TORCH:
        raise UnsupportedFormat(f"served state: tensor {name!r} served {fmt} is {dtype}; expected one of "
                                f"{sorted(BY_NAME)} (a cast format serves other floats as its dtype)")
    if len(shape) > CHANGE_MAX_DIMS or any(d > MAX_DIM for d in shape):  # an empty tensor's may be any size
        raise UsageError(f"served state: tensor {name!r}: expected at most {CHANGE_MAX_DIMS} dimensions of at most "
                         f"{MAX_DIM}, found shape {list(shape)}")
    fault = safetensors_shape_fault(dtype, shape)  # nodes' weights files are safetensors
    if fault is not None:
        raise UsageError(f"served state: tensor {name!r}: {fault}")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UsageError(f"served format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    return fmt


def is_scale(name: str) -> bool:
    """Whether `name` is a quantization scale tensor (kept bit-exact by every cast format)."""
    return name.endswith(_SCALE_ENDINGS)


def quantizes(name: str, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether `fp8-block` turns this tensor into e4m3 + a block scale."""
    return (len(shape) == 2 and dtype.is_floating_point and dtype not in _KEPT and name.endswith("weight")
            and not any(word in name for word in _NOT_QUANTIZED))


def _cast_to(name: str, dtype: torch.dtype, fmt: str) -> torch.dtype:
    """The dtype a tensor that is not quantized is served in."""
    target = torch.bfloat16 if fmt == "fp8-block" else _CAST.get(fmt)
    if target is not None and dtype.is_floating_point and dtype not in _KEPT and not is_scale(name):
        return target
    return dtype


def served_specs(name: str, dtype: torch.dtype, shape: tuple[int, ...],
                 fmt: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What `serve_tensor` makes of a tensor of this name, dtype and shape, without making it."""
    shape = tuple(shape)
    if fmt == "fp8-block" and quantizes(name, dtype, shape):
        return [(name, torch.float8_e4m3fn, shape),
                (name + SCALE_SUFFIX, torch.float32, (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)))]
    return [(name, _cast_to(name, dtype, fmt), shape)]


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight of w's shape, fp32 scale_inv of shape [ceil(m/128), ceil(n/128)])."""
    if w.dim() != 2:
        raise UsageError(f"block_quantize: expected a 2-D weight, found shape {list(w.shape)}")
    m, n = w.shape
    pm, pn = -(-m // BLOCK) * BLOCK, -(-n // BLOCK) * BLOCK
    padded = torch.zeros(pm, pn, dtype=torch.float32)
    padded[:m, :n] = w
    blocks = padded.view(pm // BLOCK, BLOCK, pn // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    fp8 = (blocks * (E4M3_MAX / amax)).to(torch.float8_e4m3fn).view(pm, pn)[:m, :n].contiguous()
    return fp8, (amax / E4M3_MAX).view(pm // BLOCK, pn // BLOCK).contiguous()


def block_dequantize(fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 * scale_inv per 128x128 block (what an engine computes); for checks and tests."""
    m, n = fp8.shape
    scale = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:m, :n]
    return (fp8.to(torch.float32) * scale).to(dtype)


def _own(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`t` as memory nobody else holds: never a view of what the trainer will overwrite."""
    t = t.contiguous()
    if t.numel() and t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        t = t.clone()
    return t


def serve_tensor(name: str, tensor: torch.Tensor, fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The served tensor(s) for one of the trainer's tensors: usually one, two for a
    quantized weight (itself and its scale). Detached, contiguous, on the CPU, owned."""
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise UsageError(f"served state: expected str -> torch.Tensor, found {name!r}: {type(tensor).__name__}")
    check_source_tensor(name, tensor)
    source = tensor.detach()
    t = source.to("cpu")
    if fmt == "fp8-block" and quantizes(name, t.dtype, t.shape):
        fp8, scale_inv = block_quantize(t)
        yield name, fp8
        yield name + SCALE_SUFFIX, scale_inv
        return
    target = _cast_to(name, t.dtype, fmt)
    if t.dtype != target:
        t = t.to(target)
    yield name, _own(t, source)


def served_table(table: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 fmt: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The served state's names, dtypes and shapes from the trainer's, before any tensor is
    made (the origin plans a version with it); UsageError where `fmt` would write a name
    the state already has, or a served tensor fails `check_served_spec`."""
    check_format(fmt)
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (dtype, shape) in table.items():
        for served_name, sdtype, sshape in served_specs(name, dtype, shape, fmt):
            check_served_spec(served_name, sdtype, sshape, fmt)
            if served_name in out or (served_name != name and served_name in table):
                raise UsageError(f"served state: {fmt} would write {served_name!r}, which the state already has")
            out[served_name] = (sdtype, sshape)
    return out


def serve_state(state: dict, fmt: str) -> dict[str, torch.Tensor]:
    """Every tensor of `state` served as `fmt` (the whole state at once: for small states and
    tests; the origin serves tensor by tensor)."""
    check_format(fmt)
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UsageError("served state: expected a dict[str, torch.Tensor] (a state_dict)")
    for name, t in state.items():
        check_source_tensor(name, t)
    served_table({n: (t.dtype, tuple(t.shape)) for n, t in state.items()}, fmt)  # collisions, before any work
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        out.update(serve_tensor(name, t, fmt))
    return out


# ---------------------------------------------------------------- side files

# A model directory's other files (config.json, tokenizer, generation config...)
# travel inside the state as 1-D uint8 tensors under this prefix: diffed, chunked,
# verified and hashed like every tensor, carried again only when they change.
FILE_PREFIX = "patchswarm.file:"
MAX_SIDE_FILE_BYTES = 1 << 30


def file_tensor_name(filename: str) -> str:
    check_side_file_name(filename)
    return FILE_PREFIX + filename


def check_side_file_name(filename: str, error: type[Exception] = UsageError) -> str:
    """Side files are plain file names: no folders, nothing hidden, nothing that escapes."""
    if (not isinstance(filename, str) or not filename or filename in (".", "..") or "/" in filename
            or "\\" in filename or filename.startswith(".") or "\0" in filename):
        raise error(f"side file: expected a plain file name, found {filename!r}")
    return filename


def file_tensor(data: bytes) -> torch.Tensor:
    if len(data) > MAX_SIDE_FILE_BYTES:
        raise UsageError(f"side file: expected at most {MAX_SIDE_FILE_BYTES} bytes, found {len(data)}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def split_side_files(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """(the weights, {file name: bytes}) of a served state."""
    weights, files = {}, {}
    for name, t in state.items():
        if name.startswith(FILE_PREFIX):
            filename = check_side_file_name(name[len(FILE_PREFIX):], InvalidInput)
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise InvalidInput(f"side file {filename!r}: expected a 1-D uint8 tensor, found {t.dtype} {list(t.shape)}")
            files[filename] = t.numpy().tobytes()
        else:
            weights[name] = t
    return weights, files
