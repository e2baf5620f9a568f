"""The state hash: one definition of "these are the same weights".

Owns `state_hash(state)` and the shape of its strings. Definition (version 2):
for each tensor in name order, a record msgpack([name, dtype name, shape,
tensor digest]); the tensor digest is BLAKE3 over the concatenated BLAKE3
digests of its raw little-endian bytes in BLOCK_BYTES blocks; the state hash
is BLAKE3 over the concatenated records, written "blake3:" + 64 hex digits so
that a hash says how it was made (version 1 was plain SHA-256 hex).

Why BLAKE3: the full-state check is the floor of every verified `apply`.
SHA-256 ran at ~1.6 GB/s per core here (with SHA extensions), about as long
as the whole compare of two versions; BLAKE3 is a cryptographic hash at
~3 GB/s per core with AVX2. Why the block tree: the blocks are hashed on
every core (protocol/parallel.py: threads started by the call; the blake3
module releases the GIL), without the blake3 module's own global
thread pool; `hash_tasks` lets `diff` run the hashing of base and target
among its own encoding tasks. Pure computation otherwise: no files, no
clocks.
"""

from __future__ import annotations

import functools
from typing import Callable

import blake3
import msgpack
import torch

from . import parallel
from .dtypes import check_tensor, info_of

PREFIX = "blake3:"
BLOCK_BYTES = 4 << 20
_PARALLEL_MIN_BYTES = 1 << 20  # below this a second thread costs more than it saves


def is_state_hash(s) -> bool:
    """True for a string shaped like `state_hash`'s output."""
    return (isinstance(s, str) and len(s) == len(PREFIX) + 64 and s.startswith(PREFIX)
            and all(c in "0123456789abcdef" for c in s[len(PREFIX):]))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (zero-copy when it is contiguous)."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.dim() == 0:
        t = t.reshape(1)
    elif not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _digest_block(mv: memoryview) -> bytes:
    return blake3.blake3(mv).digest()


def _workers(total_bytes: int, blocks: int, limit: int | None = None) -> int:
    return parallel.threads_for(blocks, total_bytes, _PARALLEL_MIN_BYTES // 2, limit)


def _blocks(state: dict[str, torch.Tensor]) -> tuple[list[str], list[int], list[memoryview]]:
    """(names in order, owning name index per block, blocks)."""
    names = sorted(state)
    owner: list[int] = []
    blocks: list[memoryview] = []
    for i, name in enumerate(names):
        check_tensor(state[name], f"state[{name!r}]")
        mv = tensor_bytes(state[name])
        for off in range(0, max(1, len(mv)), BLOCK_BYTES):
            owner.append(i)
            blocks.append(mv[off : off + BLOCK_BYTES])
    return names, owner, blocks


def _combine(state: dict[str, torch.Tensor], names: list[str], owner: list[int], digests: list[bytes]) -> str:
    leaves: list[list[bytes]] = [[] for _ in names]
    for i, d in zip(owner, digests):
        leaves[i].append(d)
    h = blake3.blake3()
    for name, tensor_leaves in zip(names, leaves):
        t = state[name]
        digest = blake3.blake3(b"".join(tensor_leaves)).digest()
        h.update(msgpack.packb([name, info_of(t.dtype).name, list(t.shape), digest]))
    return PREFIX + h.hexdigest()


def hash_tasks(states: list[dict[str, torch.Tensor]]) -> tuple[list[Callable[[], bytes]], Callable[[list[bytes]], list[str]]]:
    """The state hashes of `states` as independent tasks for `parallel.run_all`,
    largest first, and the function that turns the tasks' results into the
    hashes, in order.

    Largest first: threads that take the next task as they finish end
    together only if the small tasks come last (a model's tensors alternate
    between megabytes and a few hundred bytes). For `diff`, which runs them
    among its own tasks. The states must not change until the tasks have run.
    """
    parts = [_blocks(s) for s in states]
    blocks = [b for _, _, bs in parts for b in bs]
    order = sorted(range(len(blocks)), key=lambda i: -len(blocks[i]))
    tasks = [functools.partial(_digest_block, blocks[i]) for i in order]

    def finish(digests: list[bytes]) -> list[str]:
        by_block: list = [None] * len(blocks)
        for i, d in zip(order, digests):
            by_block[i] = d
        out, at = [], 0
        for state, (names, owner, bs) in zip(states, parts):
            out.append(_combine(state, names, owner, by_block[at : at + len(bs)]))
            at += len(bs)
        return out

    return tasks, finish


def hash_bytes(states: list[dict[str, torch.Tensor]]) -> int:
    """How many bytes hashing `states` reads (to size a thread count)."""
    return sum(t.numel() * t.element_size() for s in states for t in s.values())


def tensor_digest(t: torch.Tensor, threads: int | None = None) -> bytes:
    """One tensor's digest as `state_hash` computes it (for callers that hash a state
    tensor by tensor, e.g. while they build it; `combine` makes the state hash)."""
    check_tensor(t, "tensor")
    mv = tensor_bytes(t)
    blocks = [mv[off: off + BLOCK_BYTES] for off in range(0, max(1, len(mv)), BLOCK_BYTES)]
    tasks = [functools.partial(_digest_block, b) for b in blocks]
    leaves = parallel.run_all(tasks, _workers(len(mv), len(tasks), threads))
    return blake3.blake3(b"".join(leaves)).digest()


def combine(records: dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]) -> str:
    """The state hash from each tensor's (dtype, shape, `tensor_digest`), by name."""
    h = blake3.blake3()
    for name in sorted(records):
        dtype, shape, digest = records[name]
        h.update(msgpack.packb([name, info_of(dtype).name, list(shape), digest]))
    return PREFIX + h.hexdigest()


def state_hash(state: dict[str, torch.Tensor], threads: int | None = None) -> str:
    """`threads`: at most this many (None: as many as the cores and the work are worth)."""
    tasks, finish = hash_tasks([state])
    return finish(parallel.run_all(tasks, _workers(hash_bytes([state]), len(tasks), threads)))[0]
