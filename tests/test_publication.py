"""protocol/publication.py: how the origin sizes an object's chunks and writes its manifest so
that the manifest travels in one wire frame at any model size, and a patch version's manifest
grows with the patch (form 2), not with the model."""

import hashlib

import msgpack
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol import wire
from patchswarm.protocol.errors import CorruptData, UsageError
from patchswarm.protocol.manifest import MAGICS, Manifest, decode_manifest, encode_manifest, sign_manifest, verify_manifest
from patchswarm.protocol.patch import Patch, TensorSpec, apply, diff, keyframe
from patchswarm.protocol.publication import (ALL_TENSORS, MAX_OBJECT_CHUNKS, ORIGIN_REGION, manifest_of,
                                             object_chunk_bytes, origin_region_of, patch_of, table_of)

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
    a compressed row index, and the keyframe's table travels compressed: at 500 GB (65,536
    chunks) its manifest is mostly the chunk table."""
    k = _keyframe(140_000)
    k.layout = _layout_of(k)
    table = [(8 * MiB, bytes(32))] * 600  # a ~5 GB patch of 8 MiB chunks
    p = Patch(kind="patch", base_hash="blake3:" + "1" * 64, target_hash=k.target_hash, tensors=k.tensors,
              full=[], removed=[], chunks=[], layout=k.layout)
    args = dict(swarm_id="s", version=5, created_at=0.0, chunk_table=table)
    assert _signed_bytes(manifest_of(p, **args)) > wire.MAX_FRAME_BYTES
    form2 = manifest_of(p, **args, form=2)
    assert form2.tensors == () and _signed_bytes(form2) < 64 * 600 + 8 * 1024  # the chunk table, about
    at_500_gb = dict(args, chunk_table=[(8 * MiB, bytes(32))] * MAX_OBJECT_CHUNKS)
    assert _signed_bytes(manifest_of(k, **at_500_gb, form=2)) < 41 * MAX_OBJECT_CHUNKS + 1024 * 1024
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
    with pytest.raises(UsageError, match="names in order, each once"):
        Manifest(tensors=[("b", "float32", (2,)), ("a", "float32", (2,))], codec={"format": 2, "removed": []}, **fields)
    z = zstandard.ZstdCompressor().compress
    for tensors, codec, match in [
        ([("a", "float32", (2,))], {"format": 2, "removed": ["a"]}, "removed tensors not to be written"),
        ([], {"format": 2, "removed": [], "layout": {"files": ["x"], "rows": z(b"\0")}}, "2 or 4 bytes for each of 2"),
        ([], {"format": 2, "removed": [], "layout": {"files": ["x"], "rows": z(b"\0\0\1\0")}}, "indices below 1, found 1"),
        ([], {"format": 2, "removed": [], "layout": {"files": ["x"], "rows": z(bytes(9))}}, "at most 8 bytes"),
        ([], {"format": 2, "removed": [], "layout": {"files": ["x"], "rows": b"\0\0\0\0"}}, "expected a zstd frame"),
        ([], {"format": 2, "removed": [], "layout": {"files": "x", "rows": b""}}, "form-2 layout"),
        ([], {"format": 2, "removed": "a"}, "list of names in 'removed'"),
    ]:
        with pytest.raises(CorruptData, match=match):
            patch_of(Manifest(tensors=tensors, codec=codec, **fields), [], table)
    # the top value of a row is a tensor in no shard (a side file)
    m = Manifest(tensors=[], codec={"format": 2, "removed": [], "layout": {"files": ["x"], "rows": z(b"\xff\xff\0\0")}},
                 **fields)
    assert patch_of(m, [], table).layout == {"b": "x"}


@pytest.mark.parametrize("blob, match", [
    (b"not zstd", "expected a zstd frame"),
    (zstandard.ZstdCompressor().compress(bytes(1 << 16)), "at most 10240 bytes of table from 20"),  # > 512x
    (zstandard.ZstdCompressor().compress(msgpack.packb([["a", "float32"]])), "a row"),
    (zstandard.ZstdCompressor().compress(msgpack.packb([["b", "f", []], ["a", "f", []]])), "names in order"),
    (zstandard.ZstdCompressor().compress(msgpack.packb([["a", "f", [-1]]])), "dimension"),
    (zstandard.ZstdCompressor().compress(msgpack.packb([["a", "f", []]]) + b"\0"), "nothing more"),
])
def test_a_form_2_table_that_is_not_one_is_corrupt_data(blob, match):
    """A form-2 manifest's table travels compressed: what does not decompress within its
    bounds to rows in name order is refused (CorruptData), read before anything is built."""
    m = Manifest(swarm_id="s", version=4, base_version=3, base_hash="blake3:" + "1" * 64,
                 target_hash="blake3:" + "2" * 64, tensors=[], chunks=[], codec={"format": 2, "removed": []},
                 created_at=0.0, form=2)
    data = msgpack.unpackb(encode_manifest(m))
    data[6] = blob
    with pytest.raises(CorruptData, match=match):
        decode_manifest(msgpack.packb(data))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=40), st.sampled_from(["bfloat16", "float8_e4m3fn", "float32"]),
                          st.lists(st.integers(0, 1 << 40), max_size=4).map(tuple)),
                unique_by=lambda t: t[0], max_size=30))
def test_form_2_tables_round_trip_through_signing(rows):
    rows = sorted(rows)
    key = Ed25519PrivateKey.generate()
    m = Manifest(swarm_id="s", version=0, base_version=None, base_hash=None, target_hash="blake3:" + "2" * 64,
                 tensors=rows, chunks=[], codec={"format": 2, "removed": []}, created_at=0.0, form=2)
    back = verify_manifest(sign_manifest(m, key), key.public_key())
    assert back == m and back.tensors == tuple(rows) and encode_manifest(back) == encode_manifest(m)


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


# ------------------------------------------------------------------ the origin's region


@pytest.mark.parametrize("form", [1, 2])
def test_the_origins_region_is_signed_into_the_manifest_and_read_back(form):
    state = {"w": torch.arange(16, dtype=torch.float32).to(torch.bfloat16)}
    m = manifest_of(keyframe(state), swarm_id="s", version=0, created_at=0.0, form=form, origin_region="eu-west")
    assert origin_region_of(m) == "eu-west"
    key = Ed25519PrivateKey.generate()
    back = verify_manifest(sign_manifest(m, key), key.public_key())
    assert origin_region_of(back) == "eu-west" and back == m
    plain = manifest_of(keyframe(state), swarm_id="s", version=0, created_at=0.0, form=form)
    assert origin_region_of(plain) is None and ORIGIN_REGION not in plain.codec  # as origins before it wrote


def test_a_region_a_manifest_may_name_is_one_a_member_may_say_in_its_hello():
    from patchswarm.protocol.regions import MAX_REGION_BYTES
    assert MAX_REGION_BYTES == wire.MAX_NAME_BYTES


@pytest.mark.parametrize("value", ["", "r" * 257, "é" * 129, "r\n0", 7, ["r0"], None])
def test_a_manifest_naming_no_usable_region_names_none(value):
    state = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    m = manifest_of(keyframe(state), swarm_id="s", version=0, created_at=0.0)
    odd = Manifest(**{**{f: getattr(m, f) for f in ("swarm_id", "version", "base_version", "base_hash",
                                                    "target_hash", "tensors", "chunks", "created_at")},
                      "codec": {**m.codec, ORIGIN_REGION: value}})
    assert origin_region_of(odd) is None
    if value is not None:
        with pytest.raises(UsageError, match="origin_region"):
            manifest_of(keyframe(state), swarm_id="s", version=0, created_at=0.0, origin_region=value)
