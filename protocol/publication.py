"""A published object: a patch or keyframe cut into the chunks the swarm moves, and back. Sans-IO.

Owns the mapping between `protocol.patch.Patch` and a signed `Manifest`: the
manifest carries the patch's header (kind, hashes, tensor table, full and
removed lists, layout) and one (size, SHA-256) per chunk; the chunks are the
patch's own independently decodable chunks. A node that holds a verified
manifest and every chunk rebuilds the exact Patch with `patch_of`.

An object is named by `ObjKey = (version, keyframe)`: for one version the
origin may publish both a patch (from version - 1) and a keyframe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .errors import CorruptData, UsageError
from .manifest import Manifest, ObjKey, describe, key_of  # noqa: F401 (key_of, describe: re-exported)
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


# `codec["full"]` of a manifest whose full tensors are all its tensors, in table order (a
# keyframe's), instead of the list of their names again: what a keyframe of ~140,000 tensors
# needs to fit one wire frame (tests/test_publication.py). Members before it read only the
# list, so the origin writes it only where the list form would not travel at all.
ALL_TENSORS = "all"


def manifest_of(patch: Patch, *, swarm_id: str, version: int, created_at: float,
                chunk_table: list[tuple[int, bytes]] | None = None, compact: bool = False) -> Manifest:
    """The manifest of `patch` published as `version` (its base is version - 1 unless a keyframe).

    `chunk_table`: each chunk's (size, SHA-256), for a patch whose chunks went to disk as
    they were made (its `chunks` then stay empty). `compact`: a `full` list that names every
    tensor in table order is written as ALL_TENSORS."""
    if not isinstance(patch, Patch):
        raise UsageError(f"manifest_of: expected a Patch, found {type(patch).__name__}")
    keyframe = patch.kind == "keyframe"
    if not keyframe and version < 1:
        raise UsageError(f"manifest_of: a patch needs a base version, found version {version}")
    full: list[str] | str = list(patch.full)
    if compact and full == [t.name for t in patch.tensors]:
        full = ALL_TENSORS
    return Manifest(
        swarm_id=swarm_id,
        version=version,
        base_version=None if keyframe else version - 1,
        base_hash=None if keyframe else patch.base_hash,
        target_hash=patch.target_hash,
        tensors=[(t.name, t.dtype, t.shape) for t in patch.tensors],
        chunks=chunk_table if chunk_table is not None else [(len(c), hashlib.sha256(c).digest()) for c in patch.chunks],
        codec={"format": FORMAT_VERSION, "full": full, "removed": list(patch.removed), "layout": patch.layout},
        created_at=created_at,
    )


def patch_of(m: Manifest, chunks: Sequence[bytes]) -> Patch:
    """The Patch a manifest and its verified chunks (in index order) make up."""
    if len(chunks) != len(m.chunks):
        raise UsageError(f"patch_of: expected {len(m.chunks)} chunks, found {len(chunks)}")
    codec = m.codec
    if codec.get("format") != FORMAT_VERSION:
        raise CorruptData(f"manifest codec: expected patch format {FORMAT_VERSION}, found {codec.get('format')!r}")
    full, removed, layout = codec.get("full"), codec.get("removed"), codec.get("layout")
    if full == ALL_TENSORS:
        full = [n for n, _, _ in m.tensors]
    if not (isinstance(full, list) and all(isinstance(x, str) for x in full)
            and isinstance(removed, list) and all(isinstance(x, str) for x in removed)):
        raise CorruptData(f"manifest codec: expected lists of names in 'full' (or {ALL_TENSORS!r}) and 'removed'")
    if layout is not None and not (isinstance(layout, dict) and all(isinstance(v, str) for v in layout.values())):
        raise CorruptData("manifest codec: expected 'layout' to map names to file names, or nil")
    return Patch(
        kind="keyframe" if m.is_keyframe else "patch",
        base_hash=m.base_hash,
        target_hash=m.target_hash,
        tensors=[TensorSpec(n, d, tuple(s)) for n, d, s in m.tensors],
        full=list(full),
        removed=list(removed),
        # A sequence stays one: a store's lazily read chunks are read batch by batch by apply.
        chunks=chunks if isinstance(chunks, Sequence) else list(chunks),
        layout=layout,
    )
