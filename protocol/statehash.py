"""The state hash: one definition of "these are the same weights".

Owns `state_hash(state)`. Definition (version 1): for each tensor in name order,
a record msgpack([name, dtype name, shape, tensor digest]); the tensor digest is
SHA-256 over the concatenated SHA-256 digests of its raw little-endian bytes in
16 MiB blocks; the state hash is SHA-256 over the concatenated records, hex.
The block tree is there so the hash runs on every core (hashlib releases the
GIL): a full-state check is the floor of `apply`, and it must not be one core.
Pure computation; the thread pool lives and dies inside the call.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os

import msgpack
import torch

from .dtypes import info_of

BLOCK_BYTES = 16 << 20
_PARALLEL_MIN_BYTES = 4 << 20


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor, zero-copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy())


def _block_digest(mv: memoryview) -> bytes:
    return hashlib.sha256(mv).digest()


def state_hash(state: dict[str, torch.Tensor]) -> str:
    names = sorted(state)
    blocks: list[tuple[int, memoryview]] = []
    for i, name in enumerate(names):
        mv = tensor_bytes(state[name])
        if len(mv) == 0:
            blocks.append((i, mv))
        for off in range(0, len(mv), BLOCK_BYTES):
            blocks.append((i, mv[off : off + BLOCK_BYTES]))
    total = sum(len(b) for _, b in blocks)
    if total >= _PARALLEL_MIN_BYTES and (os.cpu_count() or 1) > 1:
        # Many small tensors: batch them so each task hashes a few MiB.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
            digests = list(pool.map(_block_digest, (b for _, b in blocks), chunksize=8))
    else:
        digests = [_block_digest(b) for _, b in blocks]
    per_tensor: list[list[bytes]] = [[] for _ in names]
    for (i, _), d in zip(blocks, digests):
        per_tensor[i].append(d)
    h = hashlib.sha256()
    for name, leaves in zip(names, per_tensor):
        t = state[name]
        digest = hashlib.sha256(b"".join(leaves)).digest()
        h.update(msgpack.packb([name, info_of(t.dtype).name, list(t.shape), digest]))
    return h.hexdigest()
