"""Checkpoint files: bit-exact load/save of single files and shard directories, clear errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from patchswarm.node.checkpoint import INDEX_NAME, load_state, save_state, write_bytes_atomic
from patchswarm.protocol.errors import InvalidInput, PatchswarmError, UsageError


def same_bits(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.fixture
def mixed():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g)
    return {
        "a.bf16": w.to(torch.bfloat16),
        "b.fp8": w.to(torch.float8_e4m3fn),
        "c.int8": torch.randint(-128, 128, (5, 3), dtype=torch.int8, generator=g),
        "d.scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "e.empty": torch.empty(0, 4, dtype=torch.float8_e5m2),
        "f.transposed": w.to(torch.bfloat16).t(),  # not contiguous
        # the dtypes added later: safetensors' F64, U16, U32, U64, F8_E8M0
        "g.f64": torch.tensor([-0.0, float("inf"), float("nan")], dtype=torch.float64),
        "h.u16": torch.tensor([0, 1 << 15, (1 << 16) - 1], dtype=torch.int32).to(torch.uint16),
        "i.u32": torch.tensor([0, 1 << 31, (1 << 32) - 1], dtype=torch.int64).to(torch.uint32),
        "j.u64": torch.tensor([0, -(1 << 63), -1], dtype=torch.int64).view(torch.uint64).reshape(3, 1),
        **({"k.e8m0": torch.tensor([0, 127, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)}
           if hasattr(torch, "float8_e8m0fnu") else {}),
        # and F8_E4M3FNUZ, F8_E5M2FNUZ (AMD's fp8) and F4 (two fp4 values a byte; [2, 2] is [2, 4] there)
        "l.e4fnuz": torch.tensor([0x80, 0x7F, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fnuz),
        "m.e5fnuz": torch.tensor([0x80, 0x7C, 0xFF], dtype=torch.uint8).view(torch.float8_e5m2fnuz),
        **({"n.fp4": torch.tensor([[0x88, 0x77], [0x0F, 0xF0]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
           if hasattr(torch, "float4_e2m1fn_x2") else {}),
    }


def test_single_file_round_trip(tmp_path, mixed):
    out = tmp_path / "m.safetensors"
    save_state(mixed, out)
    state, layout = load_state(out)
    assert layout is None
    same_bits(state, mixed)
    same_bits(load_file(str(out)), mixed)
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temp files left


def _rewrite_tail_in_place(path, n=64):
    with open(path, "r+b") as f:  # what `cp new old` does: same inode, new bytes
        f.seek(-n, os.SEEK_END)
        f.write(b"\xff" * n)


def test_loaded_state_owns_its_memory(tmp_path):
    from patchswarm.node.weights import Weights, read_weights, write_weights
    from patchswarm.protocol.statehash import state_hash

    want = torch.arange(4096, dtype=torch.int32)
    out = tmp_path / "m.safetensors"
    save_state({"w": want}, out)
    state, _ = load_state(out)
    weights = tmp_path / "weights.safetensors"
    write_weights(weights, Weights({"w": want}, 3, state_hash({"w": want}), "swarm"))
    held = read_weights(weights)
    _rewrite_tail_in_place(out)
    _rewrite_tail_in_place(weights)
    # A copy-on-write mapping of the file would show the new bytes here.
    assert torch.equal(state["w"], want) and torch.equal(held.state["w"], want)


def test_weights_read_while_renamed_over_are_one_versions(tmp_path, monkeypatch):
    """A member's weights file is replaced by rename (a compaction) while a tool reads it
    (`persistence.read_current`): the metadata and the tensors must come from one file. Read
    with two opens, a rename between them gave version 1's hash and version 2's tensors
    ("metadata says state hash ..., tensors hash to ...", seen in test_origin_heal)."""
    from patchswarm.node import checkpoint
    from patchswarm.node.weights import Weights, read_weights, write_weights
    from patchswarm.protocol.statehash import state_hash

    v1, v2 = torch.arange(4096, dtype=torch.int32), torch.arange(4096, dtype=torch.int32) * 3
    weights, later = tmp_path / "weights.safetensors", tmp_path / "later.safetensors"
    write_weights(weights, Weights({"w": v1}, 1, state_hash({"w": v1}), "swarm"))
    write_weights(later, Weights({"w": v2}, 2, state_hash({"w": v2}), "swarm"))
    real = checkpoint.safe_open

    def renamed_over_once_opened(*args, **kwargs):
        handle = real(*args, **kwargs)
        if later.exists():
            os.replace(later, weights)  # the compaction's rename, with this reader's file open
        return handle

    monkeypatch.setattr(checkpoint, "safe_open", renamed_over_once_opened)
    w = read_weights(weights)
    assert (w.version, torch.equal(w.state["w"], v1)) == (1, True)
    assert read_weights(weights).version == 2  # the next read: the new file


def test_sharded_round_trip(tmp_path, mixed):
    layout = {n: ("model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
              for i, n in enumerate(sorted(mixed))}
    out = tmp_path / "ckpt"
    save_state(mixed, out, layout)
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["weight_map"] == layout
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in mixed.values())
    state, got = load_state(out)
    assert got == layout
    same_bits(state, mixed)
    for file in set(layout.values()):
        part = load_file(str(out / file))
        assert set(part) == {n for n, f in layout.items() if f == file}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_overwrite_directory_atomically(tmp_path, mixed):
    out = tmp_path / "ckpt"
    save_state(mixed, out, {n: "a.safetensors" for n in mixed})
    save_state(mixed, out, {n: "b.safetensors" for n in mixed})
    assert sorted(p.name for p in out.iterdir()) == sorted([INDEX_NAME, "b.safetensors"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("other", ["notes.txt", "config.json", "subdir"])
def test_a_directory_holding_other_files_is_not_replaced(tmp_path, mixed, other):
    """The defect: a sharded save over an existing directory moved it aside and removed it
    whole, whatever it held: `patchswarm apply BASE PATCH -o DIR` deleted every file of DIR
    (a model directory's config and tokenizer, or unrelated work), not only its shards."""
    out = tmp_path / "ckpt"
    save_state(mixed, out, {n: "a.safetensors" for n in mixed})
    (out / other).mkdir() if other == "subdir" else (out / other).write_text("keep me")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UsageError, match=f"found 1 other entries in it.*{other}"):
        save_state(mixed, out, {n: "b.safetensors" for n in mixed})
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_sharded_load_reads_the_index_once_not_once_per_shard(tmp_path, mixed, monkeypatch):
    """The defect: each shard scanned the whole weight_map for its names, O(shards x tensors):
    4 s of a load (and as much of a save) at DeepSeek-V3's 163 shards and 140k tensors."""
    from patchswarm.node import checkpoint

    class Counted(dict):
        scans = 0

        def items(self):
            Counted.scans += 1
            return super().items()

    out = tmp_path / "ckpt"
    one_each = {n: f"s{i}.safetensors" for i, n in enumerate(mixed)}
    save_state(mixed, out, one_each)
    real = checkpoint.read_index
    monkeypatch.setattr(checkpoint, "read_index", lambda index: Counted(real(index)))
    state, layout = load_state(out)
    same_bits(state, mixed)
    assert layout == one_each
    assert Counted.scans <= 2, f"{Counted.scans} scans of the weight map for {len(mixed)} shards"


def test_a_link_to_a_directory_is_replaced_without_a_stray_link_beside_it(tmp_path, mixed):
    """The defect: `p` a symbolic link to a directory was moved aside as `p.old-*` and removed
    with rmtree, which refuses links (its error ignored): the link stayed there for good."""
    (tmp_path / "real").mkdir()
    (tmp_path / "ckpt").symlink_to(tmp_path / "real")
    save_state(mixed, tmp_path / "ckpt", {n: "a.safetensors" for n in mixed})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "real"]
    same_bits(load_state(tmp_path / "ckpt")[0], mixed)


def test_directory_without_index(tmp_path, mixed):
    d = tmp_path / "d"
    d.mkdir()
    names = sorted(mixed)
    save_file({n: mixed[n].contiguous() for n in names[:3]}, str(d / "x.safetensors"))
    save_file({n: mixed[n].contiguous() for n in names[3:]}, str(d / "y.safetensors"))
    state, layout = load_state(d)
    same_bits(state, mixed)
    assert layout == {n: ("x.safetensors" if n in names[:3] else "y.safetensors") for n in names}


def test_shared_storage_is_saved(tmp_path):
    w = torch.randn(4, 4).to(torch.bfloat16)
    save_state({"embed": w, "head": w}, tmp_path / "tied.safetensors")
    state, _ = load_state(tmp_path / "tied.safetensors")
    same_bits(state, {"embed": w, "head": w})


def test_index_naming_missing_shard(tmp_path, mixed):
    out = tmp_path / "ckpt"
    save_state(mixed, out, {n: ("a.safetensors" if i % 2 else "b.safetensors") for i, n in enumerate(mixed)})
    os.unlink(out / "b.safetensors")
    with pytest.raises(InvalidInput, match="b.safetensors"):
        load_state(out)


def test_index_disagreeing_with_shard(tmp_path, mixed):
    out = tmp_path / "ckpt"
    save_state(mixed, out, {n: "a.safetensors" for n in mixed})
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"]["ghost"] = "a.safetensors"
    (out / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(InvalidInput, match="ghost"):
        load_state(out)


@pytest.mark.parametrize("bad", ["../evil.safetensors", "sub/x.safetensors", "x.bin"])
def test_index_with_unsafe_shard_name(tmp_path, bad):
    d = tmp_path / "d"
    d.mkdir()
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": bad}}))
    with pytest.raises(InvalidInput, match="shard name"):
        load_state(d)


def test_bad_inputs(tmp_path):
    with pytest.raises(InvalidInput, match="no such file"):
        load_state(tmp_path / "nope.safetensors")
    (tmp_path / "w.bin").write_bytes(b"\0" * 64)
    with pytest.raises(InvalidInput, match="expected a .safetensors file"):
        load_state(tmp_path / "w.bin")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InvalidInput, match="not a readable safetensors"):
        load_state(tmp_path / "junk.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match="found neither"):
        load_state(tmp_path / "empty")


def test_truncated_safetensors(tmp_path, mixed):
    out = tmp_path / "m.safetensors"
    save_state(mixed, out)
    out.write_bytes(out.read_bytes()[:-10])
    with pytest.raises(PatchswarmError):
        load_state(out)


def test_save_usage_errors(tmp_path, mixed):
    with pytest.raises(UsageError, match="must end with .safetensors"):
        save_state(mixed, tmp_path / "m.bin")
    with pytest.raises(UsageError, match="names no shard"):
        save_state(mixed, tmp_path / "d", {"a.bf16": "a.safetensors"})
    with pytest.raises(InvalidInput, match="shard name"):
        save_state(mixed, tmp_path / "d", {n: "../x.safetensors" for n in mixed})
    assert list(tmp_path.iterdir()) == []


def test_write_bytes_atomic(tmp_path):
    p = tmp_path / "x.patch"
    write_bytes_atomic(p, b"one")
    write_bytes_atomic(p, b"two")
    assert p.read_bytes() == b"two"
    assert [q.name for q in tmp_path.iterdir()] == ["x.patch"]


@pytest.mark.parametrize("layout", [None, {"__metadata__": "a.safetensors", "x": "a.safetensors"}])
def test_a_tensor_named_like_the_metadata_key_is_refused_before_a_byte_is_written(tmp_path, layout):
    """safetensors keeps a file's metadata under '__metadata__': a tensor of that name made a
    file no reader takes (the node's durable weights then fail at its restart)."""
    from patchswarm.node import basefile

    state = {"__metadata__": torch.ones(2), "x": torch.zeros(1)}
    out = tmp_path / ("w.safetensors" if layout is None else "d")
    with pytest.raises(UsageError, match="'__metadata__'.*safetensors"):
        save_state(state, out, layout)
    with pytest.raises(UsageError, match="'__metadata__'.*safetensors"):
        basefile.write(tmp_path / "b.safetensors", state, {"k": "v"})
    assert sorted(os.listdir(tmp_path)) == []


# The first safetensors release whose torch binding writes and reads each dtype the codec serves
# (tried 2026-12-05: 0.4.0 and 0.5.3 raise KeyError on save_file of uint16/32/64 and
# float8_e8m0fnu, and cannot read an F8_E8M0 header; 0.6.1 does all of it; 0.6.0 is not on PyPI.
# Tried 2026-12-07: 0.6.1 and 0.7.0 read and write F4, but refuse an F8_E4M3FNUZ header ("unknown
# variant") and raise KeyError on save_file of float8_e4m3fnuz; 0.8.0 does both).
SAFETENSORS_FOR_EVERY_DTYPE = (0, 8, 0)


def test_the_declared_safetensors_floor_reads_and_writes_every_served_dtype():
    """pyproject's floor for safetensors must be a release that handles every dtype the codec
    serves: under an older one pip keeps it, the origin cannot open a checkpoint holding one
    and `patchswarm apply` (save_file) fails with a KeyError on the first such tensor."""
    import re
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    (floor,) = [re.fullmatch(r"safetensors>=([\d.]+)", d.split("#")[0].strip()).group(1)
                for d in deps if d.startswith("safetensors")]
    assert tuple(int(x) for x in floor.split(".")) + (0,) * (3 - len(floor.split("."))) >= SAFETENSORS_FOR_EVERY_DTYPE
