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


def manifest_of(patch: Patch, *, swarm_id: str, version: int, created_at: float,
                chunk_table: list[tuple[int, bytes]] | None = None) -> Manifest:
    """The manifest of `patch` published as `version` (its base is version - 1 unless a keyframe).

    `chunk_table`: each chunk's (size, SHA-256), for a patch whose chunks went to disk as
    they were made (its `chunks` then stay empty)."""
    if not isinstance(patch, Patch):
        raise UsageError(f"manifest_of: expected a Patch, found {type(patch).__name__}")
    keyframe = patch.kind == "keyframe"
    if not keyframe and version < 1:
        raise UsageError(f"manifest_of: a patch needs a base version, found version {version}")
    return Manifest(
        swarm_id=swarm_id,
        version=version,
        base_version=None if keyframe else version - 1,
        base_hash=None if keyframe else patch.base_hash,
        target_hash=patch.target_hash,
        tensors=[(t.name, t.dtype, t.shape) for t in patch.tensors],
        chunks=chunk_table if chunk_table is not None else [(len(c), hashlib.sha256(c).digest()) for c in patch.chunks],
        codec={"format": FORMAT_VERSION, "full": list(patch.full), "removed": list(patch.removed),
               "layout": patch.layout},
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
    if not (isinstance(full, list) and all(isinstance(x, str) for x in full)
            and isinstance(removed, list) and all(isinstance(x, str) for x in removed)):
        raise CorruptData("manifest codec: expected lists of names in 'full' and 'removed'")
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
