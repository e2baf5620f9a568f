"""The patch and keyframe encodings of the systems patchswarm is measured against.

Each is written here from its public description or source (the facts in
DESIGN.md, "Peers to measure against"), with a decoder, so that the codec
bench (bench/codec.py) reports a size only for bytes that were decoded back to
the target bit for bit. Sizes are of the bytes each system would put on the
wire or on disk for one version, containers included; none of this is
patchswarm's own code path.

Patch encodings (base, target -> bytes; base, bytes -> target):

- `slime_xor`: slime's disk delta, "xor" encoding (THUDM/slime,
  update_weight_from_disk_delta.py): per changed tensor, zstd level 1 of
  the byte-wise XOR of its new and old bytes; the changed tensors in one
  safetensors file with a per-tensor checksum in its metadata, then the
  version's model.safetensors.index.json that slime writes beside it.
- `slime_overwrite`: the same with the "overwrite" encoding
  (slime/utils/disk_delta.py): per changed tensor, zstd level 1 of a u32
  count, the u32 positions of the changed *bytes* and their new values.
- `pulse_v2`, `pulse_v31`: PULSE (arXiv 2602.03839; its code,
  one-covenant/grail, infrastructure/sparse_codec.py): per changed tensor the
  flat positions of changed elements, sorted and delta-coded (int32), then
  the new values (bf16/fp16 as their 16 bits, anything else as float32);
  v3.1 instead splits positions into (row, column) with row deltas and
  column deltas within a row, each stored in the narrowest of
  uint8/uint16/int32 that holds them. A JSON header (grail's fields per
  tensor: name, shape, count, dtypes, offsets and sizes), then everything in
  one zstd level-1 frame.
- `trl_style`: int32 positions and the raw new values per changed element,
  no entropy stage (HF TRL's sparse update as DESIGN.md describes it; its
  source is not read here).

Keyframe size model:

- `dfloat11_bytes`: DFloat11 (bf16 only): each element's sign and 7
  mantissa bits kept as one raw byte, its 8 exponent bits Huffman-coded
  with a code built per tensor, plus a 256-byte code-length table per
  tensor. The exact Huffman size, not a file: DFloat11's GPU decode
  metadata (thread block offsets) is not counted, which favours it.

Pure functions over tensors and bytes; importing does no work.
"""

from __future__ import annotations

import heapq
import json
import struct

import blake3
import numpy as np
import torch
import zstandard

State = dict[str, torch.Tensor]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    return flat if flat.numel() else torch.empty(0, dtype=t.dtype)  # an empty one may have stride 0


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return _flat(t).view(torch.uint8).numpy()


def _elems_of(t: torch.Tensor) -> np.ndarray:
    """`t`'s elements as integers of their width; for a contiguous `t` (the decoders' clones) a
    view that shares its memory, so the decoders write through it."""
    return _flat(t).view(_INT[t.element_size()]).numpy()


def _same_layout(base: State, target: State) -> None:
    if set(base) != set(target) or any(base[k].dtype != target[k].dtype or base[k].shape != target[k].shape
                                       for k in target):
        raise ValueError("peer encodings here take two versions with the same names, dtypes and shapes")


def _z1(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1).compress(data)


def _unz(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data)


def _checksum(buf: np.ndarray) -> str:
    return blake3.blake3(buf).hexdigest(length=16)  # 32 hex digits, as slime's xxh3-128


# --- slime ---------------------------------------------------------------------------------------

def _slime(base: State, target: State, mode: str) -> bytes:
    from safetensors.numpy import save

    _same_layout(base, target)
    delta, sums = {}, {}
    for name in sorted(target):
        new, old = _bytes_of(target[name]), _bytes_of(base[name])
        if mode == "xor":
            diff = new ^ old
            if not diff.any():
                continue
            payload = diff.tobytes()
        else:
            mask = new != old
            if not mask.any():
                continue
            pos = np.flatnonzero(mask).astype("<u4")
            payload = struct.pack("<I", pos.size) + pos.tobytes() + new[mask].tobytes()
        delta[name] = np.frombuffer(_z1(payload), dtype=np.uint8)
        sums[name] = _checksum(new)
    # Written by slime every version, a file beside the tensors' (its metadata as a one-rank
    # run with the xxh3-128 checksum writes them; json.dumps' default separators, as slime's).
    index = {
        "metadata": {"version": "000001", "base_version": "000000", "delta_encoding": mode,
                     "compression_format": "zstd", "checksum_format": "xxh3-128"},
        "weight_map": {name: _SLIME_FILE for name in delta},
    }
    return (save(delta, metadata=sums) if delta else b"") + json.dumps(index).encode()


_SLIME_FILE = "model-00000-of-00001.safetensors"


def _safetensors_end(blob: bytes) -> int:
    """Where a safetensors file that starts `blob` ends (0: none, the index follows at once)."""
    try:  # the index alone (a version that changed nothing); a safetensors file is never JSON
        json.loads(blob)
        return 0
    except ValueError:
        pass
    (n,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8:8 + n])
    return 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)


def _slime_decode(base: State, blob: bytes, mode: str) -> State:
    from safetensors.numpy import load

    out = {k: v.clone() for k, v in base.items()}
    end = _safetensors_end(blob)
    if set(json.loads(blob[end:])["weight_map"]) != set(load(blob[:end]) if end else ()):
        raise ValueError("slime delta: the index's weight map is not the file's tensors")
    for name, comp in (load(blob[:end]).items() if end else ()):
        flat = _bytes_of(out[name])  # shares the clone's memory
        raw = _unz(comp.tobytes())
        if mode == "xor":
            flat ^= np.frombuffer(raw, dtype=np.uint8)
        else:
            (n,) = struct.unpack_from("<I", raw)
            pos = np.frombuffer(raw, dtype="<u4", count=n, offset=4)
            flat[pos] = np.frombuffer(raw, dtype=np.uint8, count=n, offset=4 + 4 * n)
    return out


def slime_xor(base: State, target: State) -> bytes:
    return _slime(base, target, "xor")


def slime_xor_decode(base: State, blob: bytes) -> State:
    return _slime_decode(base, blob, "xor")


def slime_overwrite(base: State, target: State) -> bytes:
    return _slime(base, target, "overwrite")


def slime_overwrite_decode(base: State, blob: bytes) -> State:
    return _slime_decode(base, blob, "overwrite")


# --- PULSE ---------------------------------------------------------------------------------------

def _pulse_values(t: torch.Tensor, pos: np.ndarray) -> tuple[bytes, str]:
    flat = t.reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        return _elems_of(t)[pos].tobytes(), str(t.dtype).removeprefix("torch.")
    idx = torch.from_numpy(pos.astype(np.int64))
    return flat[idx].float().numpy().tobytes(), "float32"  # as PULSE sends every other dtype


def _narrowest(v: np.ndarray, allow_u8: bool) -> str:
    if v.size == 0 or (allow_u8 and v.max() <= 0xFF):
        return "uint8"
    return "uint16" if v.max() <= 0xFFFF else "int32"


def _pulse(base: State, target: State, coo: bool) -> bytes:
    _same_layout(base, target)
    metas, parts, offset = [], [], 0
    for name in sorted(target):
        t = target[name]
        pos = np.flatnonzero(_elems_of(t) != _elems_of(base[name]))
        if not pos.size:
            continue
        if pos[-1] > np.iinfo(np.int32).max:
            raise ValueError(f"{name}: PULSE's int32 positions cannot address {t.numel()} elements")
        values, vdt = _pulse_values(t, pos)
        # grail's header fields, in its order: the header is inside the zstd frame, so its
        # bytes count (offsets are from the start of the data that follows the header).
        meta = {"name": name, "shape": list(t.shape), "num_nonzero": int(pos.size), "value_dtype": vdt}
        if coo:
            per_row = int(np.prod(t.shape[1:])) if t.dim() > 1 else 1
            rows, cols = pos // per_row, pos % per_row
            drows = np.diff(rows, prepend=0)
            boundary = np.ones(pos.size, dtype=bool)
            boundary[1:] = drows[1:] != 0
            dcols = np.where(boundary, cols, np.diff(cols, prepend=0))
            rdt, cdt = _narrowest(drows, True), _narrowest(dcols, False)
            rb, cb = drows.astype(rdt).tobytes(), dcols.astype(cdt).tobytes()
            meta.update(row_dtype=rdt, col_dtype=cdt, indices_offset=offset, indices_size=len(rb) + len(cb),
                        rows_size=len(rb), cols_size=len(cb))
            parts += [rb, cb]
        else:
            ib = np.diff(pos, prepend=0).astype(np.int32).tobytes()
            meta.update(indices_offset=offset, indices_size=len(ib))
            parts.append(ib)
        meta.update(values_offset=offset + meta["indices_size"], values_size=len(values))
        offset = meta["values_offset"] + len(values)
        parts.append(values)
        metas.append(meta)
    header = json.dumps({"version": 31 if coo else 2, "tensors": metas}, separators=(",", ":")).encode()
    return _z1(struct.pack("<I", len(header)) + header + b"".join(parts))


def _pulse_decode(base: State, blob: bytes) -> State:
    raw = _unz(blob)
    (hlen,) = struct.unpack_from("<I", raw)
    header = json.loads(raw[4:4 + hlen])
    at = 4 + hlen
    out = {k: v.clone() for k, v in base.items()}

    def take(n: int, dtype: str) -> np.ndarray:
        nonlocal at
        a = np.frombuffer(raw, dtype=dtype, count=n // np.dtype(dtype).itemsize, offset=at)
        at += n
        return a

    for m in header["tensors"]:
        t = out[m["name"]]
        if header["version"] == 31:
            per_row = int(np.prod(m["shape"][1:])) if len(m["shape"]) > 1 else 1
            drows = take(m["rows_size"], m["row_dtype"]).astype(np.int64)
            dcols = take(m["cols_size"], m["col_dtype"]).astype(np.int64)
            rows = np.cumsum(drows)
            starts = np.ones(rows.size, dtype=bool)
            starts[1:] = drows[1:] != 0
            # A column is its row's first column plus the deltas after it: cumsum, less the sum before the row.
            csum = np.cumsum(dcols)
            first = np.flatnonzero(starts)
            before = np.repeat(csum[first] - dcols[first], np.diff(np.append(first, rows.size)))
            pos = rows * per_row + (csum - before)
        else:
            pos = np.cumsum(take(m["indices_size"], "<i4").astype(np.int64))
        vdt = m["value_dtype"]
        if vdt == "float32":
            vals = torch.from_numpy(take(m["values_size"], "<f4").copy()).to(t.dtype)
            t.reshape(-1)[torch.from_numpy(pos)] = vals
        else:
            _elems_of(t)[pos] = take(m["values_size"], "<i2")
    return out


def pulse_v2(base: State, target: State) -> bytes:
    return _pulse(base, target, coo=False)


def pulse_v31(base: State, target: State) -> bytes:
    return _pulse(base, target, coo=True)


pulse_v2_decode = pulse_v31_decode = _pulse_decode


# --- TRL-style -----------------------------------------------------------------------------------

def trl_style(base: State, target: State) -> bytes:
    _same_layout(base, target)
    parts = []
    for name in sorted(target):
        new = _elems_of(target[name])
        pos = np.flatnonzero(new != _elems_of(base[name]))
        if pos.size:
            parts += [struct.pack("<I", pos.size), pos.astype("<i4").tobytes(), new[pos].tobytes()]
        else:
            parts.append(struct.pack("<I", 0))
    return b"".join(parts)


def trl_style_decode(base: State, blob: bytes) -> State:
    out = {k: v.clone() for k, v in base.items()}
    at = 0
    for name in sorted(out):
        (n,) = struct.unpack_from("<I", blob, at)
        at += 4
        if not n:
            continue
        view = _elems_of(out[name])
        pos = np.frombuffer(blob, dtype="<i4", count=n, offset=at)
        at += 4 * n
        view[pos] = np.frombuffer(blob, dtype=view.dtype, count=n, offset=at)
        at += n * view.itemsize
    return out


PATCH_CODECS = {  # name -> (encode, decode)
    "slime-xor": (slime_xor, slime_xor_decode),
    "slime-ow": (slime_overwrite, slime_overwrite_decode),
    "pulse-v2": (pulse_v2, pulse_v2_decode),
    "pulse-v3.1": (pulse_v31, pulse_v31_decode),
    "trl": (trl_style, trl_style_decode),
}


# --- DFloat11 ------------------------------------------------------------------------------------

def huffman_bits(counts: np.ndarray) -> int:
    """Total bits of the symbols counted in `counts` under an optimal prefix code for them."""
    weights = [int(c) for c in counts if c]
    if len(weights) <= 1:
        return sum(weights)  # one symbol: a 1-bit code each
    heapq.heapify(weights)
    total = 0
    while len(weights) > 1:
        a, b = heapq.heappop(weights), heapq.heappop(weights)
        total += a + b  # every symbol under this merge gets one bit longer
        heapq.heappush(weights, a + b)
    return total


def dfloat11_bytes(state: State) -> int | None:
    """DFloat11's size for `state` (see the module docstring); None unless every tensor is bf16."""
    if any(t.dtype != torch.bfloat16 for t in state.values()):
        return None
    total = 0
    for t in state.values():
        bits = _elems_of(t).view(np.uint16)
        exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
        total += t.numel() + (huffman_bits(np.bincount(exponent, minlength=256)) + 7) // 8 + 256
    return total
