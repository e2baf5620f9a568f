"""A member's durable base: one safetensors file written tensor by tensor, and compacted forward in place.

Owns the on-disk form of a full state that a member restarts from, and its
compaction. The file is plain safetensors (any reader loads it) with two
choices that make it cheap to move forward:

- Written streaming: the header first (computed from names, dtypes and
  shapes), then each tensor's bytes straight from its memory: no second copy
  of the state, ever, at any size. Tensors go in order of element width, then
  name, so every tensor starts aligned to its width.
- The header is padded with spaces (the format allows it) so the data starts
  on a 4 KiB boundary and a later header with other metadata fits in place.

`compact(base, objects, out)` takes the base at version b and the verified
objects after it (patches, or a keyframe and its patches) to a new base at
the last version, without the member's live state: the base's data is copied
to a temporary file (a reflink where the file system has them), mapped, and
each object is applied in place on the mapping with the codec's checks and
the full state hash; the temporary is then fsynced and renamed over `out`.
Memory is the page cache of one file plus the objects' decode transients; a
crash at any point leaves `out` as it was. Must not decide when to compact,
nor hold the live state (node/persistence.py decides; the daemon holds it).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch

from patchswarm.node.checkpoint import check_tensor_name, fsync_path
from patchswarm.protocol.errors import InvalidInput, StateHashMismatch, UnsupportedFormat, UsageError
from patchswarm.protocol.dtypes import E8M0, FP4X2, info_of, safetensors_shape_fault
from patchswarm.protocol.patch import Patch, TensorSpec, apply
from patchswarm.protocol.statehash import state_hash

HEADER_ALIGN = 4096
# safetensors' names for torch dtypes (the format's own table).
_ST_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
if E8M0 is not None:  # torch >= 2.7 (protocol/dtypes.py)
    _ST_DTYPE[E8M0] = "F8_E8M0"
if FP4X2 is not None:  # torch >= 2.8
    _ST_DTYPE[FP4X2] = "F4"
_TORCH_DTYPE = {v: k for k, v in _ST_DTYPE.items()}
_WRITE_BYTES = 64 << 20  # per write call: a large tensor goes out in slices


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


def _nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=dtype).element_size()


def _header_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> list[int]:
    """The shape safetensors writes for a torch tensor: F4 counts fp4 values, two a byte, so a
    float4_e2m1fn_x2 tensor of shape [..., k] is [..., 2k] there (safetensors' own save and
    load do the same)."""
    if dtype is FP4X2:
        return [*shape[:-1], 2 * shape[-1]]
    return list(shape)


def plan(table: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[Entry]:
    """Where each tensor goes: widest elements first (each starts aligned), then by name."""
    rows = sorted(table, key=lambda r: (-torch.empty(0, dtype=r[1]).element_size(), r[0]))
    out, at = [], 0
    for name, dtype, shape in rows:
        check_tensor_name(name)
        if dtype not in _ST_DTYPE:
            raise UsageError(f"base file: dtype {dtype} of {name!r} has no safetensors name")
        fault = safetensors_shape_fault(dtype, shape)
        if fault is not None:
            raise UsageError(f"base file: tensor {name!r}: {fault}")
        size = _nbytes(dtype, shape)
        out.append(Entry(name, dtype, tuple(shape), at, at + size))
        at += size
    return out


def header_bytes(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header, padded so the data starts on HEADER_ALIGN."""
    obj: dict = {"__metadata__": dict(metadata)} if metadata else {}
    for e in entries:
        obj[e.name] = {"dtype": _ST_DTYPE[e.dtype], "shape": _header_shape(e.dtype, e.shape),
                       "data_offsets": [e.begin, e.end]}
    body = json.dumps(obj, separators=(",", ":")).encode()
    total = -(-(8 + len(body)) // HEADER_ALIGN) * HEADER_ALIGN
    return struct.pack("<Q", total - 8) + body + b" " * (total - 8 - len(body))


def read_header(path: str | os.PathLike) -> tuple[int, list[Entry], dict[str, str]]:
    """(data start, entries in file order, metadata) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidInput(f"{path}: expected a safetensors header, found {len(raw)} bytes")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if n > min(size - 8, 100 << 20):
            raise InvalidInput(f"{path}: header of {n} bytes in a file of {size}")
        try:
            obj = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidInput(f"{path}: header is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InvalidInput(f"{path}: header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    entries = []
    for name, d in obj.items():
        if isinstance(d, dict) and isinstance(d.get("dtype"), str) and d["dtype"] not in _TORCH_DTYPE:
            raise UnsupportedFormat(f"{path}: tensor {name!r}: dtype: expected one of {sorted(_TORCH_DTYPE)}, "
                                    f"found {d['dtype']!r}")
        try:
            dtype = _TORCH_DTYPE[d["dtype"]]
            begin, end = (int(x) for x in d["data_offsets"])
            shape = tuple(int(s) for s in d["shape"])
        except (KeyError, TypeError, ValueError):
            raise InvalidInput(f"{path}: header entry {name!r} is malformed") from None
        if dtype is FP4X2:
            if not shape or shape[-1] % 2:
                raise InvalidInput(f"{path}: tensor {name!r}: expected an even last dimension for F4 (fp4 values, "
                                   f"two a byte), found shape {list(shape)}")
            shape = (*shape[:-1], shape[-1] // 2)
        if end - begin != _nbytes(dtype, shape) or begin < 0 or 8 + n + end > size:
            raise InvalidInput(f"{path}: tensor {name!r} does not fit its offsets")
        entries.append(Entry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: e.begin)
    return 8 + n, entries, {str(k): str(v) for k, v in meta.items()}


def table(path: str | os.PathLike) -> list[TensorSpec]:
    """The tensor table of the base file at `path` (from its header), in name order."""
    _, entries, _ = read_header(path)
    return sorted((TensorSpec(e.name, info_of(e.dtype).name, tuple(e.shape)) for e in entries), key=lambda t: t.name)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def write(path: str | os.PathLike, state: dict[str, torch.Tensor], metadata: dict[str, str],
          durable: bool = True, mode: int = 0o600) -> int:
    """Write `state` to `path` atomically, streaming from the tensors' memory; returns the bytes written.

    `mode`: the file's permissions (private by default: weights are the trainer's)."""
    p = Path(path)
    entries = plan((n, t.dtype, tuple(t.shape)) for n, t in state.items())
    header = header_bytes(entries, metadata)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".tmp-", dir=p.parent)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(header)
            for e in entries:
                mv = _tensor_bytes(state[e.name])
                for off in range(0, len(mv), _WRITE_BYTES):
                    f.write(mv[off:off + _WRITE_BYTES])
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
        if durable:
            fsync_path(p.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(header) + (entries[-1].end if entries else 0)


def _copy_data(src: str | os.PathLike, src_start: int, dst_fd: int, dst_start: int, length: int) -> None:
    """Copy a byte range file to file inside the kernel (a reflink where the file system
    shares blocks and both offsets are block-aligned)."""
    with open(src, "rb") as f:
        done = 0
        while done < length:
            n = os.copy_file_range(f.fileno(), dst_fd, length - done, src_start + done, dst_start + done)
            if n <= 0:
                raise OSError(f"copy_file_range copied {n} bytes at {done} of {length}")
            done += n


class _Mapped:
    """A state whose tensors are views into one shared, writable file mapping."""

    def __init__(self, fd: int, size: int, start: int, entries: list[Entry]):
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        self.state: dict[str, torch.Tensor] = {}
        for e in entries:
            if e.end == e.begin:
                self.state[e.name] = torch.empty(e.shape, dtype=e.dtype)
                continue
            buf = torch.frombuffer(self.map, dtype=torch.uint8, count=e.end - e.begin, offset=start + e.begin)
            t = buf.view(e.dtype).view(e.shape)
            # A file another writer made may place a tensor off its element width: the
            # codec's kernels read whole elements, so such a tensor is copied (and the
            # file then written anew, below).
            self.state[e.name] = t if (start + e.begin) % buf.new_empty(0, dtype=e.dtype).element_size() == 0 \
                else t.clone()
        self.original = {n: (t.dtype, tuple(t.shape), t.untyped_storage().data_ptr() if t.numel() else None)
                         for n, t in self.state.items()}

    def in_place(self) -> bool:
        """Whether every tensor is still the mapped one it started as (no object replaced,
        added or removed a tensor), so the file needs only a new header."""
        now = {n: (t.dtype, tuple(t.shape), t.untyped_storage().data_ptr() if t.numel() else None)
               for n, t in self.state.items()}
        return now == self.original

    def close(self) -> None:
        self.state.clear()
        if self.map is not None:
            self.map.flush()
            self.map.close()


def compact(base: str | os.PathLike, objects: Iterable[Patch], out: str | os.PathLike,
            metadata: dict[str, str], expected_hash: str, threads: int | None = None,
            on_object: Callable[[int], None] | None = None) -> int:
    """Write to `out` the state `objects` take the base file `base` to; returns bytes written.

    Every object is applied with the codec's checks (wrong base, corrupt chunk, the
    target hash of each object); the final state must hash to `expected_hash`,
    or nothing replaces `out`. Patches only: a member that took a keyframe holds the
    whole state anyway and writes its base from it (`write`).
    """
    start, entries, _ = read_header(base)
    size = start + (entries[-1].end if entries else 0)
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".compact-", dir=out.parent)
    mapped: _Mapped | None = None
    try:
        written = 0
        os.ftruncate(fd, size)
        # Keep the base's layout: its data keeps its offsets, so a block-aligned base
        # (one this module wrote) is shared, not copied, where reflinks exist.
        with open(base, "rb") as f:
            head = f.read(start)
        os.pwrite(fd, head, 0)
        _copy_data(base, start, fd, start, size - start)
        written += size
        mapped = _Mapped(fd, size, start, entries)
        reached = None  # the hash the last object's apply checked
        for i, obj in enumerate(objects):
            if obj.kind != "patch":
                raise UsageError(f"compact: expected patches only, found a {obj.kind}")
            apply(mapped.state, obj, threads=threads, undo=False)
            reached = obj.target_hash
            if on_object is not None:
                on_object(i + 1)
        found = reached if reached is not None else state_hash(mapped.state, threads)
        if found != expected_hash:
            raise StateHashMismatch("compacted state", expected_hash, found)
        if mapped.in_place():
            header = header_bytes(entries, metadata)
            if len(header) != start:  # metadata that does not fit the base's header: write anew
                final_state = mapped.state
            else:
                mapped.close()
                mapped = None
                os.pwrite(fd, header, 0)
                os.fsync(fd)
                os.close(fd)
                fd = -1
                os.chmod(tmp, 0o600)
                os.replace(tmp, out)
                fsync_path(out.parent)
                return written + len(header)
        else:
            final_state = mapped.state
        # The structure changed (tensors added, removed, reshaped): stream a new file
        # from the mapping and the new tensors, then drop the copy.
        written += write(out, final_state, metadata)
        return written
    finally:
        if mapped is not None:
            mapped.close()
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)

