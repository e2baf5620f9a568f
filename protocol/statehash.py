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

Many small tensors (a large MoE has ~140k): each tensor is read once (its
check, dtype, shape and bytes in one pass, the bytes from the int view the
codec reads it by, `views`), the records are packed in one msgpack call,
and blocks under GROUP_BYTES are hashed several to a task; the bytes hashed
are the same (tests/test_many_tensors.py holds them to the record-by-record
computation).
"""

from __future__ import annotations

import functools
from typing import Callable

import blake3
import msgpack
import numpy as np
import torch

from . import parallel
from .dtypes import check_tensor, checked_info, info_of, int_view

PREFIX = "blake3:"
BLOCK_BYTES = 4 << 20
_PARALLEL_MIN_BYTES = 1 << 20  # below this a second thread costs more than it saves
_NO_BYTES = np.empty(0, np.uint8)
GROUP_BYTES = 1 << 16  # blocks below this are hashed several to a task, about this much per task


def is_state_hash(s) -> bool:
    """True for a string shaped like `state_hash`'s output."""
    return (isinstance(s, str) and len(s) == len(PREFIX) + 64 and s.startswith(PREFIX)
            and all(c in "0123456789abcdef" for c in s[len(PREFIX):]))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (zero-copy when it is contiguous)."""
    return memoryview(_raw(t)).cast("B")


def _raw(t: torch.Tensor) -> np.ndarray:
    """`tensor_bytes` as a flat uint8 array (which BLAKE3 reads as it is: no memoryview made)."""
    if t.numel() == 0:
        return _NO_BYTES
    if t.dim() == 0:
        t = t.reshape(1)
    elif not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8).numpy().reshape(-1)  # flat: its blocks are slices of bytes, not of rows


def _digest_block(mv: memoryview) -> bytes:
    return blake3.blake3(mv).digest()


def _digest_blocks(mvs: list[np.ndarray]) -> list[bytes]:
    return [_digest_block(mv) for mv in mvs]


def _workers(total_bytes: int, blocks: int, limit: int | None = None) -> int:
    return parallel.threads_for(blocks, total_bytes, _PARALLEL_MIN_BYTES // 2, limit)


class _Tensors:
    """One state's tensors in name order, read once each: the dtype name and shape of
    each record, and its blocks (`owner[k]` is the name index of block k)."""

    def __init__(self, state: dict[str, torch.Tensor], views: dict | None):
        self.names = sorted(state)
        self.dtypes: list[str] = []
        self.shapes: list[torch.Size] = []  # a tuple: msgpack packs it as the list it was
        self.owner: list[int] = []
        self.blocks: list[np.ndarray] = []
        for i, name in enumerate(self.names):
            t = state[name]
            info = checked_info(t, "state", name)
            self.dtypes.append(info.name)
            self.shapes.append(t.shape)
            if not t.is_contiguous():
                raw = _raw(t)  # a contiguous copy, in the logical order
            else:
                # The flat integer view the codec reads this tensor by (it shares t's memory):
                # the one it made already, or one it will reuse.
                cached = views.get(name) if views is not None else None
                if cached is None or cached[0] is not t:
                    cached = (t, int_view(t))
                    if views is not None:
                        views[name] = cached
                raw = cached[1].view(np.uint8)
            if raw.size <= BLOCK_BYTES:
                self.owner.append(i)
                self.blocks.append(raw)
                continue
            for off in range(0, raw.size, BLOCK_BYTES):
                self.owner.append(i)
                self.blocks.append(raw[off : off + BLOCK_BYTES])

    def combine(self, digests: list[bytes]) -> str:
        """The state hash from each block's digest, in block order."""
        if len(digests) == len(self.names):  # a block per tensor (each has one at least)
            tensor_digests = [blake3.blake3(d).digest() for d in digests]
        else:
            tensor_digests = self._tensor_digests(digests)
        # The records packed as one msgpack array, less its header: the same bytes as the
        # records packed one by one (an array's encoding is a header, then its items').
        records = msgpack.packb(list(zip(self.names, self.dtypes, self.shapes, tensor_digests)))
        return PREFIX + blake3.blake3(records[_array_header_bytes(len(self.names)):]).hexdigest()

    def _tensor_digests(self, digests: list[bytes]) -> list[bytes]:
        tensor_digests: list[bytes] = []
        at = 0
        owner, n = self.owner, len(self.owner)
        while at < n:
            i, end = owner[at], at + 1
            while end < n and owner[end] == i:
                end += 1
            leaves = digests[at] if end == at + 1 else b"".join(digests[at:end])
            tensor_digests.append(blake3.blake3(leaves).digest())
            at = end
        return tensor_digests


def _array_header_bytes(n: int) -> int:
    """The size of msgpack's header of an n-item array (fixarray, array 16, array 32)."""
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


def hash_tasks(states: list[dict[str, torch.Tensor]], views: list[dict | None] | None = None
               ) -> tuple[list[Callable[[], list[bytes]]], Callable[[list[list[bytes]]], list[str]]]:
    """The state hashes of `states` as independent tasks for `parallel.run_all`,
    largest first, and the function that turns the tasks' results into the
    hashes, in order.

    Largest first: threads that take the next task as they finish end
    together only if the small tasks come last (a model's tensors alternate
    between megabytes and a few hundred bytes). Blocks smaller than
    GROUP_BYTES are hashed a group of about GROUP_BYTES per task: a task per
    block cost more to make, sort and hand out than a few-hundred-byte block
    costs to hash. For `diff`, which runs them among its own tasks. The
    states must not change until the tasks have run. `views`, per state:
    name -> (tensor, its flat integer view), as `patchformat.piece_bits`
    caches them, to read a tensor's bytes from a view made already.
    """
    parts = [_Tensors(s, v) for s, v in zip(states, views or [None] * len(states))]
    blocks = [b for p in parts for b in p.blocks]
    sizes = [b.size for b in blocks]
    order = sorted(range(len(blocks)), key=sizes.__getitem__, reverse=True)
    groups: list[list[int]] = []
    small = 0
    for k in order:
        if sizes[k] >= GROUP_BYTES or not groups or small >= GROUP_BYTES:
            groups.append([k])
            small = sizes[k]
        else:
            groups[-1].append(k)
            small += sizes[k]
    tasks = [functools.partial(_digest_blocks, [blocks[k] for k in g]) for g in groups]

    def finish(results: list[list[bytes]]) -> list[str]:
        # The groups are consecutive runs of `order`: their results, in order, are the
        # digests of order[0], order[1], ...
        inverse = np.empty(len(order), np.int64)
        inverse[order] = np.arange(len(order))
        by_order = [d for digests in results for d in digests]
        by_block = list(map(by_order.__getitem__, inverse.tolist()))
        out, at = [], 0
        for p in parts:
            out.append(p.combine(by_block[at : at + len(p.blocks)]))
            at += len(p.blocks)
        return out

    return tasks, finish


def hash_bytes(states: list[dict[str, torch.Tensor]]) -> int:
    """How many bytes hashing `states` reads (to size a thread count)."""
    return sum(t.nbytes for s in states for t in s.values())


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


def state_hash_any_device(state: dict[str, torch.Tensor]) -> str:
    """`state_hash` of tensors that may live in an accelerator's memory (an engine's
    weights): each such tensor is copied to host memory in turn, so the host holds one
    tensor's copy at a time, never a second state; CPU tensors are read in place. The
    same string as `state_hash` of the same bits. A full pass over the state plus, for
    device tensors, one device-to-host copy each: for checks, not for every version."""
    if all(t.device.type == "cpu" for t in state.values()):
        return state_hash(state)
    return _state_hash_by_tensor(state)


def _state_hash_by_tensor(state: dict[str, torch.Tensor]) -> str:
    records = {}
    for name, t in state.items():
        host = t if t.device.type == "cpu" else t.detach().to("cpu")
        records[name] = (host.dtype, tuple(host.shape), tensor_digest(host))
    return combine(records)


@parallel.gc_paused()  # a state of many tensors: parallel.py
def state_hash(state: dict[str, torch.Tensor], threads: int | None = None, views: dict | None = None) -> str:
    """`threads`: at most this many (None: as many as the cores and the work are worth).
    `views`: as `hash_tasks` takes them, for this state."""
    tasks, finish = hash_tasks([state], [views])
    return finish(parallel.run_all(tasks, _workers(hash_bytes([state]), len(tasks), threads)))[0]
