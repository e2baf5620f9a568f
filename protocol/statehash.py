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
every core by threads that live and die inside the call (the blake3 module
releases the GIL), without the blake3 module's own global thread pool;
`BackgroundHashes` lets `diff` hash base and target on a helper thread while
it encodes (joined before `diff` returns). Pure computation otherwise: no
files, no clocks.
"""

from __future__ import annotations

import itertools
import os
import threading

import blake3
import msgpack
import torch

from .dtypes import info_of

PREFIX = "blake3:"
BLOCK_BYTES = 4 << 20
_PARALLEL_MIN_BYTES = 1 << 20  # below this a second thread costs more than it saves
_MAX_THREADS = 16


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


class _BlockJob:
    """Blocks hashed by whoever calls `work`: each caller takes the next block
    until none is left, so a thread the scheduler keeps waiting costs at most
    one block, never a fixed share."""

    def __init__(self, blocks: list[memoryview]):
        self.blocks = blocks
        self.digests: list = [None] * len(blocks)
        self.error: BaseException | None = None
        self._next = itertools.count()  # next() on a count is atomic under the GIL

    def work(self) -> None:
        try:
            for i in self._next:
                if i >= len(self.blocks) or self.error is not None:
                    return
                self.digests[i] = _digest_block(self.blocks[i])
        except BaseException as e:  # re-raised by the thread that collects
            self.error = e

    def collect(self, threads: list[threading.Thread]) -> list[bytes]:
        for t in threads:
            t.join()
        if self.error is not None:
            raise self.error
        if any(d is None for d in self.digests):
            raise RuntimeError("state hash: a block was left unhashed")
        return self.digests


def _workers(total_bytes: int) -> int:
    if total_bytes < _PARALLEL_MIN_BYTES:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_THREADS, total_bytes // (_PARALLEL_MIN_BYTES // 2)))


def _start(job: _BlockJob, helpers: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=job.work, daemon=True) for _ in range(helpers)]
    for t in threads:
        t.start()
    return threads


def _blocks(state: dict[str, torch.Tensor]) -> tuple[list[str], list[int], list[memoryview]]:
    """(names in order, owning name index per block, blocks)."""
    names = sorted(state)
    owner: list[int] = []
    blocks: list[memoryview] = []
    for i, name in enumerate(names):
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


def state_hash(state: dict[str, torch.Tensor]) -> str:
    names, owner, blocks = _blocks(state)
    job = _BlockJob(blocks)
    threads = _start(job, _workers(sum(len(b) for b in blocks)) - 1)
    job.work()
    return _combine(state, names, owner, job.collect(threads))


class BackgroundHashes:
    """State hashes computed on a helper thread while the caller works on.

    For `diff`: hashing base and target costs about as much as the diff
    itself and needs nothing from it. The states must not change until
    `result()`, where the caller hashes whatever blocks are left, joins the
    thread (call it in a `finally`: the thread lives and dies inside the
    caller's call) and re-raises its error.
    """

    def __init__(self, states: list[dict[str, torch.Tensor]]):
        self._states = states
        self._parts = [_blocks(s) for s in states]
        self._job = _BlockJob([b for _, _, blocks in self._parts for b in blocks])
        self._threads = _start(self._job, 1 if states else 0)

    def result(self) -> list[str]:
        self._job.work()
        digests = self._job.collect(self._threads)
        out, at = [], 0
        for state, (names, owner, blocks) in zip(self._states, self._parts):
            out.append(_combine(state, names, owner, digests[at : at + len(blocks)]))
            at += len(blocks)
        return out
