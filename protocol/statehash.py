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


def _hash_range(blocks: list[memoryview], out: list, lo: int, hi: int) -> None:
    for i in range(lo, hi):
        out[i] = blake3.blake3(blocks[i]).digest()


def _split(sizes: list[int], parts: int) -> list[int]:
    """Bounds of `parts` contiguous runs of blocks with about equal bytes."""
    total = sum(sizes)
    bounds, acc = [0], 0
    for i, n in enumerate(sizes):
        acc += n
        if len(bounds) < parts and acc >= total * len(bounds) / parts:
            bounds.append(i + 1)
    bounds.append(len(sizes))
    return bounds


def _workers(total_bytes: int) -> int:
    if total_bytes < _PARALLEL_MIN_BYTES:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_THREADS, total_bytes // (_PARALLEL_MIN_BYTES // 2)))


def _block_digests(blocks: list[memoryview], workers: int | None = None) -> list[bytes]:
    digests: list = [None] * len(blocks)
    bounds = _split([len(b) for b in blocks], workers or _workers(sum(len(b) for b in blocks)))
    threads = [threading.Thread(target=_hash_range, args=(blocks, digests, bounds[w], bounds[w + 1]), daemon=True)
               for w in range(1, len(bounds) - 1)]
    for t in threads:
        t.start()
    try:
        _hash_range(blocks, digests, bounds[0], bounds[1])
    finally:
        for t in threads:
            t.join()
    if any(d is None for d in digests):
        raise RuntimeError("state hash: a hashing thread failed")
    return digests


def state_hash(state: dict[str, torch.Tensor], _workers_override: int | None = None) -> str:
    names = sorted(state)
    owner: list[int] = []
    blocks: list[memoryview] = []
    for i, name in enumerate(names):
        mv = tensor_bytes(state[name])
        for off in range(0, max(1, len(mv)), BLOCK_BYTES):
            owner.append(i)
            blocks.append(mv[off : off + BLOCK_BYTES])
    leaves: list[list[bytes]] = [[] for _ in names]
    for i, d in zip(owner, _block_digests(blocks, _workers_override)):
        leaves[i].append(d)
    h = blake3.blake3()
    for name, tensor_leaves in zip(names, leaves):
        t = state[name]
        digest = blake3.blake3(b"".join(tensor_leaves)).digest()
        h.update(msgpack.packb([name, info_of(t.dtype).name, list(t.shape), digest]))
    return PREFIX + h.hexdigest()


class BackgroundHashes:
    """State hashes computed on one helper thread while the caller works on.

    For `diff`: hashing base and target costs about as much as the diff
    itself and needs nothing from it. The states must not change until
    `result()`, which joins the thread (call it in a `finally`: the thread
    lives and dies inside the caller's call) and re-raises its error.
    """

    def __init__(self, states: list[dict[str, torch.Tensor]]):
        self._out: list = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(states,), daemon=True)
        if states:
            self._thread.start()

    def _run(self, states) -> None:
        try:
            for state in states:
                self._out.append(state_hash(state, _workers_override=1))
        except BaseException as e:  # handed to result()
            self._error = e

    def result(self) -> list[str]:
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out
