"""protocol/publication.py: how the origin sizes an object's chunks and writes its manifest so
that the manifest travels in one wire frame at any model size."""

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol import wire
from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.manifest import sign_manifest
from patchswarm.protocol.patch import Patch, TensorSpec
from patchswarm.protocol.publication import ALL_TENSORS, MAX_OBJECT_CHUNKS, manifest_of, object_chunk_bytes, patch_of

MiB, GB = 1 << 20, 10 ** 9


@pytest.mark.parametrize("chunk_bytes, state_bytes, max_chunks, expected", [
    (MiB, 0, MAX_OBJECT_CHUNKS, MiB),                  # an empty state
    (MiB, 40 * MiB, MAX_OBJECT_CHUNKS, MiB),           # the WAN bench's model: as configured
    (MiB, 64 * 1024 * MiB, MAX_OBJECT_CHUNKS, MiB),    # exactly max_chunks of them
    (MiB, 64 * 1024 * MiB + 1, MAX_OBJECT_CHUNKS, 2 * MiB),
    (MiB, 500 * GB, MAX_OBJECT_CHUNKS, 8 * MiB),       # a frontier checkpoint served in fp8/bf16
    (MiB, 2000 * GB, MAX_OBJECT_CHUNKS, 32 * MiB),
    (3 * MiB, 500 * GB, MAX_OBJECT_CHUNKS, 12 * MiB),  # doubled from what was configured
    (16 << 10, 200_000, 4, 64 << 10),
])
def test_chunks_double_until_max_chunks_hold_the_state(chunk_bytes, state_bytes, max_chunks, expected):
    size = object_chunk_bytes(chunk_bytes, state_bytes, max_chunks)
    assert size == expected
    assert size * max_chunks >= state_bytes and (size == chunk_bytes or (size // 2) * max_chunks < state_bytes)


@pytest.mark.parametrize("args", [(0, 1), (MiB, -1), (MiB, 1, 0), (1.5, 1), (MiB, 2.0), (True, 1)])
def test_bad_sizes_are_refused(args):
    with pytest.raises(UsageError, match="object_chunk_bytes: expected"):
        object_chunk_bytes(*args)


def _keyframe(n_tensors: int) -> Patch:
    """A keyframe's header with a fp8 MoE's tensor table (expert weights and their scales,
    names as long as real ones); its chunks are given as a table."""
    tensors = [TensorSpec(f"model.layers.{i % 61}.mlp.experts.{i // 61}.{w}", d, s)
               for i in range(n_tensors // 4)
               for w, d, s in (("gate_proj.weight", "float8_e4m3fn", (2048, 7168)),
                               ("up_proj.weight", "float8_e4m3fn", (2048, 7168)),
                               ("down_proj.weight", "float8_e4m3fn", (7168, 2048)),
                               ("down_proj.weight_scale_inv", "float32", (56, 16)))]
    tensors.sort(key=lambda t: t.name)
    return Patch(kind="keyframe", base_hash=None, target_hash="blake3:" + "0" * 64, tensors=tensors,
                 full=[t.name for t in tensors], removed=[], chunks=[])


def _announce_bytes(patch: Patch, n_chunks: int, chunk_bytes: int, compact: bool) -> int:
    table = [(chunk_bytes, hashlib.sha256(i.to_bytes(8, "big")).digest()) for i in range(n_chunks)]
    m = manifest_of(patch, swarm_id="s", version=0, created_at=0.0, chunk_table=table, compact=compact)
    return len(wire.encode(wire.Announce(sign_manifest(m, Ed25519PrivateKey.generate()))))


def test_a_500_gb_keyframe_of_140k_tensors_is_announced_in_one_frame():
    """At 1 MiB a 500 GB keyframe is ~477,000 chunks: its chunk table alone is more than one
    wire frame carries. At the size `object_chunk_bytes` picks it is ~60,000, and with the
    names of 140,000 tensors (a 61-layer fp8 MoE of 574 experts a layer) the manifest fits
    once the keyframe's `full` list, every name again, is written as ALL_TENSORS."""
    state = 500 * GB
    size = object_chunk_bytes(MiB, state)
    at_1_mib, picked = -(-state // MiB), -(-state // size)
    assert picked <= MAX_OBJECT_CHUNKS < at_1_mib
    assert _announce_bytes(_keyframe(0), at_1_mib, MiB, compact=False) > wire.MAX_FRAME_BYTES
    big = _keyframe(140_000)
    assert _announce_bytes(big, picked, size, compact=False) > wire.MAX_FRAME_BYTES
    assert _announce_bytes(big, picked, size, compact=True) <= wire.MAX_FRAME_BYTES


def test_the_compact_full_list_reads_back_as_every_tensor_and_only_stands_for_that():
    k = _keyframe(8)
    m = manifest_of(k, swarm_id="s", version=3, created_at=0.0, chunk_table=[], compact=True)
    assert m.codec["full"] == ALL_TENSORS
    assert patch_of(m, []).full == k.full == [t.name for t in k.tensors]
    assert manifest_of(k, swarm_id="s", version=3, created_at=0.0, chunk_table=[]).codec["full"] == k.full
    # a patch whose full tensors are some of its tensors keeps the list, compact or not
    p = Patch(kind="patch", base_hash="blake3:" + "1" * 64, target_hash=k.target_hash, tensors=k.tensors,
              full=[k.tensors[2].name], removed=[], chunks=[])
    m = manifest_of(p, swarm_id="s", version=4, created_at=0.0, chunk_table=[], compact=True)
    assert m.codec["full"] == [k.tensors[2].name] and patch_of(m, []).full == p.full
