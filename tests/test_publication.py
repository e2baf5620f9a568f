"""protocol/publication.py: how the origin sizes an object's chunks and writes its manifest so
that the manifest travels in one wire frame at any model size, and a patch version's manifest
grows with the patch (form 2), not with the model."""

import hashlib

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol import wire
from patchswarm.protocol.errors import CorruptData, UsageError
from patchswarm.protocol.manifest import MAGICS, Manifest, decode_manifest, encode_manifest, sign_manifest, verify_manifest
from patchswarm.protocol.patch import Patch, TensorSpec, apply, diff, keyframe
from patchswarm.protocol.publication import (ALL_TENSORS, MAX_OBJECT_CHUNKS, manifest_of, object_chunk_bytes, patch_of,
                                             table_of)

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


# ------------------------------------------------------------ form 2: a patch manifest lists what changed

def _layout_of(patch: Patch, files: int = 163) -> dict[str, str]:
    n = len(patch.tensors)
    return {t.name: f"model-{i * files // n + 1:05d}-of-{files:05d}.safetensors" for i, t in enumerate(patch.tensors)}


def _signed_bytes(m) -> int:
    return len(wire.encode(wire.Announce(sign_manifest(m, Ed25519PrivateKey.generate()))))


def test_a_shard_directory_of_140k_tensors_is_announced_and_its_patches_grow_with_the_patch():
    """A 140,000-tensor fp8 MoE read from a 163-shard directory: in form 1 every patch version's
    manifest carries the tensor table and the name -> shard map (24 MB: no frame carries it,
    whatever the patch). In form 2 a patch that writes no tensor whole lists none, its layout is
    2 bytes a tensor, and the keyframe fits one frame."""
    k = _keyframe(140_000)
    k.layout = _layout_of(k)
    table = [(8 * MiB, bytes(32))] * 600  # a ~5 GB patch of 8 MiB chunks
    p = Patch(kind="patch", base_hash="blake3:" + "1" * 64, target_hash=k.target_hash, tensors=k.tensors,
              full=[], removed=[], chunks=[], layout=k.layout)
    args = dict(swarm_id="s", version=5, created_at=0.0, chunk_table=table)
    assert _signed_bytes(manifest_of(p, **args)) > wire.MAX_FRAME_BYTES
    form2 = manifest_of(p, **args, form=2)
    assert form2.tensors == () and _signed_bytes(form2) < 2 * 140_000 + 64 * 600 + 8 * 1024
    assert _signed_bytes(manifest_of(k, **args, form=2)) <= wire.MAX_FRAME_BYTES
    back = patch_of(form2, [b""] * 600, k.tensors)
    assert back.tensors == k.tensors and back.full == [] and back.layout == k.layout


def _states():
    """A base and a target that differ in every way a version can: a tensor changed in place,
    one added, one removed, one reshaped, one of another dtype, side files unsharded."""
    g = torch.Generator().manual_seed(3)
    base = {"a": torch.randn(40, generator=g).bfloat16(), "b": torch.randn(6, 5, generator=g),
            "c": torch.arange(12, dtype=torch.int32), "gone": torch.ones(3), "shape": torch.zeros(4, 3),
            "patchswarm.file:config.json": torch.frombuffer(bytearray(b"{}"), dtype=torch.uint8)}
    target = {k: v.clone() for k, v in base.items() if k != "gone"}
    target["a"][3] += 1
    target["new"] = torch.randn(7, generator=g).half()
    target["shape"] = torch.zeros(3, 4)
    target["c"] = target["c"].to(torch.int64)
    return base, target


@pytest.mark.parametrize("layout", [None, {"a": "x.safetensors", "b": "y.safetensors", "c": "x.safetensors",
                                           "new": "y.safetensors", "shape": "x.safetensors"}])
def test_form_2_gives_back_the_patch_form_1_gives_and_it_applies(layout):
    base, target = _states()
    p = diff(base, target, layout=layout)
    assert sorted(p.full) == ["c", "new", "shape"] and p.removed == ["gone"]
    one, two = (manifest_of(p, swarm_id="s", version=4, created_at=1.0, form=f) for f in (1, 2))
    assert [n for n, _, _ in two.tensors] == ["c", "new", "shape"] and two.form == 2
    a, b = patch_of(one, p.chunks), patch_of(two, p.chunks, table_of(base))
    assert (b.tensors, b.full, b.removed, b.layout) == (a.tensors, a.full, a.removed, a.layout)
    state = {k: v.clone() for k, v in base.items()}
    apply(state, b)
    assert state.keys() == target.keys() and all(torch.equal(state[k], target[k]) for k in target)
    k = keyframe(target, layout=layout)
    kb = patch_of(manifest_of(k, swarm_id="s", version=4, created_at=1.0, form=2), k.chunks)
    assert (kb.tensors, kb.full, kb.layout) == (k.tensors, k.full, k.layout)


def test_form_2_misuse_and_damage_are_named():
    base, target = _states()
    p = diff(base, target, layout={"a": "x.safetensors"})
    two = manifest_of(p, swarm_id="s", version=4, created_at=1.0, form=2)
    with pytest.raises(UsageError, match="expected the base's tensor table"):
        patch_of(two, p.chunks)
    with pytest.raises(UsageError, match="expected form 1 or 2"):
        manifest_of(p, swarm_id="s", version=4, created_at=1.0, form=3)
    p.layout = {"nowhere": "x.safetensors"}
    with pytest.raises(UsageError, match="layout names tensors the table lacks"):
        manifest_of(p, swarm_id="s", version=4, created_at=1.0, form=2)
    k = _keyframe(8)
    k.full = k.full[:3]
    with pytest.raises(UsageError, match="keyframe to write all 8 tensors whole, found 3"):
        manifest_of(k, swarm_id="s", version=4, created_at=1.0, form=2)

    fields = dict(swarm_id="s", version=4, base_version=3, base_hash="blake3:" + "1" * 64,
                  target_hash="blake3:" + "2" * 64, chunks=[], created_at=0.0, form=2)
    table = [TensorSpec("a", "bfloat16", (4,)), TensorSpec("b", "float32", (2,))]
    for tensors, codec, match in [
        ([("b", "float32", (2,)), ("a", "float32", (2,))], {"format": 2, "removed": []}, "names in order"),
        ([("a", "float32", (2,))], {"format": 2, "removed": ["a"]}, "removed tensors not to be written"),
        ([], {"format": 2, "removed": [], "layout": {"files": ["x"], "rows": b"\0"}}, "2 or 4 bytes for each of 2"),
        ([], {"format": 2, "removed": [], "layout": {"files": ["x"], "rows": b"\0\0\1\0"}}, "indices below 1, found 1"),
        ([], {"format": 2, "removed": [], "layout": {"files": "x", "rows": b""}}, "form-2 layout"),
        ([], {"format": 2, "removed": "a"}, "list of names in 'removed'"),
    ]:
        with pytest.raises(CorruptData, match=match):
            patch_of(Manifest(tensors=tensors, codec=codec, **fields), [], table)
    # the top value of a row is a tensor in no shard (a side file)
    m = Manifest(tensors=[], codec={"format": 2, "removed": [], "layout": {"files": ["x"], "rows": b"\xff\xff\0\0"}},
                 **fields)
    assert patch_of(m, [], table).layout == {"b": "x"}


def test_both_forms_sign_and_verify_and_another_magic_is_refused():
    key = Ed25519PrivateKey.generate()
    base, target = _states()
    p = diff(base, target)
    for form in (1, 2):
        m = manifest_of(p, swarm_id="s", version=4, created_at=1.0, form=form)
        assert verify_manifest(sign_manifest(m, key), key.public_key()) == m
        assert msgpack.unpackb(encode_manifest(m))[0] == MAGICS[form]
    data = msgpack.packb(["patchswarm-manifest/3"] + msgpack.unpackb(encode_manifest(m))[1:])
    with pytest.raises(CorruptData, match="expected magic 'patchswarm-manifest/1' or 'patchswarm-manifest/2', found"):
        decode_manifest(data)
