"""The current verified version of a member's weights, as one safetensors file.

Owns `weights_path`'s contract: at any moment the file under that name holds
one complete version, never a half-applied one (each version is written to a
temporary name, fsynced, then renamed over it; a reader that opened the old
file keeps reading the old version). The file is self-describing: its
safetensors metadata carries the version, the state hash and the swarm id, so
a restart after a crash at any point resumes from exactly what the file says.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from patchswarm.protocol.errors import InvalidInput
from patchswarm.protocol.statehash import state_hash

from patchswarm.node.checkpoint import read_tensors_and_metadata, save_state

WEIGHTS_NAME = "weights.safetensors"
META_VERSION = "patchswarm.version"
META_HASH = "patchswarm.state_hash"
META_SWARM = "patchswarm.swarm"


@dataclasses.dataclass
class Weights:
    state: dict[str, torch.Tensor]
    version: int
    state_hash: str
    swarm_id: str


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise InvalidInput(f"{path}: not a readable safetensors file ({e})") from None


def read_weights(path: str | os.PathLike, verify: bool = True) -> Weights | None:
    """The weights at `path`, or None if there is no file. Raises InvalidInput if it
    lacks patchswarm metadata or (with `verify`) its tensors do not hash to what it says."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        state, meta = read_tensors_and_metadata(p)  # one open: a file renamed over meanwhile is not mixed in
    except OSError as e:
        raise InvalidInput(f"{p}: not a readable safetensors file ({e})") from None
    try:
        version, expected, swarm = int(meta[META_VERSION]), meta[META_HASH], meta[META_SWARM]
    except (KeyError, ValueError):
        raise InvalidInput(f"{p}: expected patchswarm metadata ({META_VERSION}, {META_HASH}, {META_SWARM}), "
                           f"found keys {sorted(meta)}") from None
    if verify:
        found = state_hash(state)
        if found != expected:
            raise InvalidInput(f"{p}: metadata says state hash {expected}, tensors hash to {found}")
    return Weights(state, version, expected, swarm)


def write_weights(path: str | os.PathLike, w: Weights) -> None:
    """Replace `path` atomically and durably with `w`."""
    save_state(w.state, path, None, metadata={META_VERSION: str(w.version), META_HASH: w.state_hash,
                                              META_SWARM: w.swarm_id}, durable=True)
