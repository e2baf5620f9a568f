"""A published object: a patch or keyframe cut into the chunks the swarm moves, and back. Sans-IO.

Owns the mapping between `protocol.patch.Patch` and a signed `Manifest`: the
manifest carries the patch's header (kind, hashes, tensor table, full and
removed lists, layout) and one (size, SHA-256) per chunk; the chunks are the
patch's own independently decodable chunks. A node that holds a verified
manifest and every chunk rebuilds the exact Patch with `patch_of`. The
manifest also names the publishing origin's region (manifest.py `origin_region_of`).

An object is named by `ObjKey = (version, keyframe)`: for one version the
origin may publish both a patch (from version - 1) and a keyframe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import zstandard

from . import planes
from .errors import CorruptData, UsageError
from .manifest import (ORIGIN_REGION, TABLE_ZSTD_LEVEL, Manifest, ObjKey, describe, key_of,  # noqa: F401
                       origin_region_of)  # key_of, describe, origin_region_of: re-exported
from .regions import region_fault
from .patch import FORMAT_VERSION, Patch, TensorSpec

# Most chunks the origin cuts one object into. A manifest carries a (size, SHA-256) per chunk
# and travels in one wire frame (16 MiB, with the tensor table): at 1 MiB chunks a ~500 GB
# served checkpoint's keyframe would be ~480,000 chunks, a 29 MB manifest no frame carries.
# 65,536 chunks is a table of ~2.5 MB, leaving the rest for ~140,000 tensors' names.
MAX_OBJECT_CHUNKS = 1 << 16


def object_chunk_bytes(chunk_bytes: int, state_bytes: int, max_chunks: int = MAX_OBJECT_CHUNKS) -> int:
    """The chunk size for an object of a served state of `state_bytes`: `chunk_bytes`, doubled
    until `max_chunks` chunks hold the whole state. A keyframe or a patch is at most about
    the state's size (every element of a random fp8 tensor changed: 1.03x), so neither is
    cut into many more than `max_chunks`. The size is the origin's choice alone (a manifest
    lists each chunk's size): states up to `max_chunks` MiB keep 1 MiB chunks."""
    for name, v, low in (("chunk_bytes", chunk_bytes, 1), ("state_bytes", state_bytes, 0),
                         ("max_chunks", max_chunks, 1)):
        if type(v) is not int or v < low:
            raise UsageError(f"object_chunk_bytes: expected {name} an int >= {low}, found {v!r}")
    size = chunk_bytes
    while size * max_chunks < state_bytes:
        size *= 2
    return size


# `codec["full"]` of a form-1 manifest whose full tensors are all its tensors, in table order
# (a keyframe's), instead of the list of their names again. Members before it read only the
# list, so the origin writes it only where the list form would not travel at all.
ALL_TENSORS = "all"

# Tables up to this many tensors go out as form 1, which every member reads: ~0.1 s and well
# under 1 MB a version. Every dense model has fewer (Llama-3-405B: 1,138; fp8 with scales:
# ~2,300); the MoE models above it (a 140,000-tensor fp8 MoE from a shard directory: a 24 MB
# manifest per patch version, no frame carries it) go out as form 2, which grows with the patch.
FORM1_MAX_TENSORS = 4096
# A form-2 layout's row for a tensor that is in no shard (a side file), by row width.
_NO_FILE = {2: 0xFFFF, 4: 0xFFFFFFFF}


def table_of(state) -> list[TensorSpec]:
    """The tensor table of a state (name -> tensor), in name order: what a form-2 patch
    manifest's target table starts from."""
    return [TensorSpec.of(n, state[n]) for n in sorted(state)]


def table_after(patch: Patch) -> list[TensorSpec]:
    """The tensor table of the state `patch` leaves, in name order (`table_of` of it): its own
    table, which the origin writes in name order (sorted here where it is not)."""
    t = patch.tensors
    return t if all(a.name < b.name for a, b in zip(t, t[1:])) else sorted(t, key=lambda s: s.name)


def manifest_of(patch: Patch, *, swarm_id: str, version: int, created_at: float,
                chunk_table: list[tuple[int, bytes]] | None = None, compact: bool = False,
                form: int = 1, origin_region: str | None = None) -> Manifest:
    """The manifest of `patch` published as `version` (its base is version - 1 unless a keyframe).

    `chunk_table`: each chunk's (size, SHA-256), for a patch whose chunks went to disk as
    they were made (its `chunks` then stay empty). `compact` (form 1): a `full` list that
    names every tensor in table order is written as ALL_TENSORS. `form` 2: only the full
    tensors' specs, the layout as one row index per tensor (protocol/manifest.py).
    `origin_region`: the publishing origin's region, signed with the rest (`origin_region_of`)."""
    if not isinstance(patch, Patch):
        raise UsageError(f"manifest_of: expected a Patch, found {type(patch).__name__}")
    if form not in (1, 2):
        raise UsageError(f"manifest_of: expected form 1 or 2, found {form!r}")
    keyframe = patch.kind == "keyframe"
    if not keyframe and version < 1:
        raise UsageError(f"manifest_of: a patch needs a base version, found version {version}")
    if form == 1:
        full: list[str] | str = list(patch.full)
        if compact and full == [t.name for t in patch.tensors]:
            full = ALL_TENSORS
        tensors = [(t.name, t.dtype, t.shape) for t in patch.tensors]
        codec = {"format": FORMAT_VERSION, "full": full, "removed": list(patch.removed), "layout": patch.layout}
    else:
        tensors = _full_specs(patch)
        codec = {"format": FORMAT_VERSION, "removed": list(patch.removed),
                 "layout": _pack_layout(patch.layout, [t.name for t in patch.tensors])}
    if origin_region is not None:
        if (fault := region_fault(origin_region)) is not None:
            raise UsageError(f"manifest_of: expected origin_region {fault}, found {origin_region!r:.80}")
        codec[ORIGIN_REGION] = origin_region
    return Manifest(
        swarm_id=swarm_id,
        version=version,
        base_version=None if keyframe else version - 1,
        base_hash=None if keyframe else patch.base_hash,
        target_hash=patch.target_hash,
        tensors=tensors,
        chunks=chunk_table if chunk_table is not None else [(len(c), hashlib.sha256(c).digest()) for c in patch.chunks],
        codec=codec,
        created_at=created_at,
        form=form,
    )


def _full_specs(patch: Patch) -> list[tuple]:
    """A form-2 manifest's `tensors`: the specs of the tensors `patch` writes whole, in name
    order; every other tensor of its table must be the base's as is."""
    names = [t.name for t in patch.tensors]
    if names != sorted(set(names)):
        raise UsageError("manifest_of: expected the tensor table in name order, each name once")
    full = set(patch.full)
    if patch.kind == "keyframe" and len(full) != len(names):
        raise UsageError(f"manifest_of: expected a keyframe to write all {len(names)} tensors whole, "
                         f"found {len(full)} in its full list")
    specs = [(t.name, t.dtype, t.shape) for t in patch.tensors if t.name in full]
    if len(specs) != len(full):
        raise UsageError(f"manifest_of: full list names {sorted(full - set(names))[:3]}, which the table lacks")
    return specs


def _pack_layout(layout: dict[str, str] | None, names: list[str]) -> dict | None:
    """{"files": shard names, "rows": one little-endian index into them per table row, 2 bytes
    each (4 beyond 65,535 files), the top value for a tensor in no shard}: 2 bytes a tensor
    where the name -> file map cost both names again."""
    if layout is None:
        return None
    extra = set(layout) - set(names)
    if extra:
        raise UsageError(f"manifest_of: the layout names tensors the table lacks: {sorted(extra)[:3]}")
    files = sorted(set(layout.values()))
    width = 2 if len(files) < _NO_FILE[2] else 4
    index = {f: i for i, f in enumerate(files)}
    rows = np.array([index.get(layout.get(n), _NO_FILE[width]) for n in names], dtype=f"<u{width}")
    # Compressed: a shard holds runs of neighbouring names, 280 KB of rows at 140,000 tensors.
    return {"files": files, "rows": zstandard.ZstdCompressor(level=TABLE_ZSTD_LEVEL).compress(rows.tobytes())}


def _unpack_layout(packed, names: list[str]) -> dict[str, str] | None:
    """The name -> shard file map a form-2 layout stands for (CorruptData if it is not one)."""
    if packed is None:
        return None
    files, rows = (packed.get("files"), packed.get("rows")) if isinstance(packed, dict) else (None, None)
    if not (isinstance(files, list) and all(isinstance(f, str) for f in files) and isinstance(rows, bytes)):
        raise CorruptData("manifest codec: expected a form-2 layout {files: [names], rows: bytes}, or nil")
    rows = planes.decompress(rows, 4 * len(names), "manifest layout rows")
    width = len(rows) // len(names) if names else 2
    if width not in _NO_FILE or len(rows) != width * len(names):
        raise CorruptData(f"manifest layout: expected 2 or 4 bytes for each of {len(names)} tensors, "
                          f"found {len(rows)} bytes")
    idx = np.frombuffer(rows, dtype=f"<u{width}")
    held = idx != _NO_FILE[width]
    if held.any() and int(idx[held].max()) >= len(files):
        raise CorruptData(f"manifest layout: expected file indices below {len(files)}, found {int(idx[held].max())}")
    return {names[i]: files[j] for i, j in zip(np.flatnonzero(held).tolist(), idx[held].tolist())}


def manifest_layout(m: Manifest, names: Sequence[str]) -> dict[str, str] | None:
    """The shard layout `m` gives its target, whose tensor names (in name order) are `names`."""
    if m.form == 1:
        return m.codec.get("layout")
    return _unpack_layout(m.codec.get("layout"), list(names))


def patch_of(m: Manifest, chunks: Sequence[bytes], base_tensors: Sequence[TensorSpec] | None = None) -> Patch:
    """The Patch a manifest and its verified chunks (in index order) make up.

    `base_tensors`: the base state's table (`table_of`), which a form-2 patch manifest
    lists only the changes to; not read otherwise."""
    if len(chunks) != len(m.chunks):
        raise UsageError(f"patch_of: expected {len(m.chunks)} chunks, found {len(chunks)}")
    codec = m.codec
    if codec.get("format") != FORMAT_VERSION:
        raise CorruptData(f"manifest codec: expected patch format {FORMAT_VERSION}, found {codec.get('format')!r}")
    removed, layout = codec.get("removed"), codec.get("layout")
    if not (isinstance(removed, list) and all(isinstance(x, str) for x in removed)):
        raise CorruptData("manifest codec: expected a list of names in 'removed'")
    listed = [TensorSpec(n, d, tuple(s)) for n, d, s in m.tensors]
    if m.form == 1:
        full = codec.get("full")
        if full == ALL_TENSORS:
            full = [t.name for t in listed]
        if not (isinstance(full, list) and all(isinstance(x, str) for x in full)):
            raise CorruptData(f"manifest codec: expected a list of names in 'full' (or {ALL_TENSORS!r})")
        if layout is not None and not (isinstance(layout, dict) and all(isinstance(v, str) for v in layout.values())):
            raise CorruptData("manifest codec: expected 'layout' to map names to file names, or nil")
        tensors = listed
    else:
        full = [t.name for t in listed]  # in order, each once: the Manifest checks
        both = set(removed).intersection(full)
        if both:
            raise CorruptData(f"manifest: expected removed tensors not to be written, found {sorted(both)[:3]} in both")
        tensors = listed if m.is_keyframe else _target_table(base_tensors, listed, removed)
        layout = _unpack_layout(layout, [t.name for t in tensors])
    return Patch(
        kind="keyframe" if m.is_keyframe else "patch",
        base_hash=m.base_hash,
        target_hash=m.target_hash,
        tensors=tensors,
        full=list(full),
        removed=list(removed),
        # A sequence stays one: a store's lazily read chunks are read batch by batch by apply.
        chunks=chunks if isinstance(chunks, Sequence) else list(chunks),
        layout=layout,
        chunk_sizes=[size for size, _ in m.chunks],
    )


def _target_table(base: Sequence[TensorSpec] | None, listed: list[TensorSpec], removed: list[str]) -> list[TensorSpec]:
    """A form-2 patch's target table: the base's, less what it removes, with what it writes
    whole in place or added; in name order."""
    if base is None:
        raise UsageError("patch_of: a form-2 patch manifest lists only changes: expected the base's tensor table")
    if not listed and not removed:
        return list(base)
    drop = set(removed).union(t.name for t in listed)
    return sorted([t for t in base if t.name not in drop] + listed, key=lambda t: t.name)
