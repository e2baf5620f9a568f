"""The durable base (node/basefile.py): a plain safetensors file written streaming, and
compacted forward by applying verified patches in place on a copy of it."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from patchswarm.node import basefile
from patchswarm.node.trainer.source import Source
from patchswarm.protocol.errors import BaseMismatch, InvalidInput, StateHashMismatch, UnsupportedFormat, UsageError
from patchswarm.protocol.patch import diff, keyframe
from patchswarm.protocol.statehash import state_hash


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    s = {"emb": torch.randn(300, 64, generator=g).to(torch.bfloat16),
         "w": torch.randn(257, 129, generator=g).to(torch.bfloat16),
         "fp8": torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn),
         "scale": torch.rand(1, 1, generator=g),
         "odd": torch.arange(7, dtype=torch.uint8),
         "empty": torch.empty(0, 3)}
    out = [s]
    for _ in range(n):
        s = {k: v.clone() for k, v in s.items()}
        for k in ("emb", "w"):
            flat = s[k].view(-1).view(torch.int16)
            flat[torch.randint(0, flat.numel(), (40,), generator=g)] += 1
        s["scale"] += 0.5
        out.append(s)
    return out


def meta(v: int, h: str) -> dict[str, str]:
    return {"patchswarm.version": str(v), "patchswarm.state_hash": h}


def test_write_is_plain_safetensors_with_aligned_data(tmp_path):
    s = states(0)[0]
    n = basefile.write(tmp_path / "b.safetensors", s, meta(0, "x"))
    assert n == os.path.getsize(tmp_path / "b.safetensors")
    assert same(load_file(str(tmp_path / "b.safetensors")), s)
    start, entries, m = basefile.read_header(tmp_path / "b.safetensors")
    assert start % basefile.HEADER_ALIGN == 0 and m == meta(0, "x")
    for e in entries:
        assert (start + e.begin) % torch.empty(0, dtype=e.dtype).element_size() == 0, e.name


@pytest.mark.parametrize("writer", ["ours", "safetensors"])
def test_compact_applies_the_chain_in_place_on_a_copy(tmp_path, writer):
    chain = states(4)
    base = tmp_path / "base.safetensors"
    if writer == "ours":
        basefile.write(base, chain[0], meta(0, state_hash(chain[0])))
    else:  # a base another writer made: offsets not aligned for us, metadata elsewhere
        save_file({k: v.contiguous() for k, v in chain[0].items()}, str(base), metadata={"format": "pt"})
    before = base.read_bytes()
    patches = [diff(a, b) for a, b in zip(chain, chain[1:])]
    out = tmp_path / "new.safetensors"
    seen = []
    basefile.compact(base, patches, out, meta(4, patches[-1].target_hash), patches[-1].target_hash,
                     on_object=seen.append)
    assert seen == [1, 2, 3, 4]
    assert same(load_file(str(out)), chain[4])
    assert basefile.read_header(out)[2] == meta(4, patches[-1].target_hash)
    assert base.read_bytes() == before, "the old base must stay as it was"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors", "new.safetensors"]


def test_compact_rewrites_when_the_structure_changes(tmp_path):
    a, b = states(1)
    b = dict(b)
    b["new"] = torch.arange(10, dtype=torch.int32)  # added
    del b["odd"]  # removed
    b["w"] = b["w"][:100].clone()  # reshaped
    base = tmp_path / "base.safetensors"
    basefile.write(base, a, meta(0, "a"))
    p = diff(a, b)
    basefile.compact(base, [p], base, meta(1, p.target_hash), p.target_hash)
    assert same(load_file(str(base)), b)
    assert [x.name for x in tmp_path.iterdir()] == ["base.safetensors"]


def test_a_wrong_chain_or_hash_leaves_the_base_and_no_temporaries(tmp_path):
    chain = states(2)
    base = tmp_path / "base.safetensors"
    basefile.write(base, chain[0], meta(0, "a"))
    before = base.read_bytes()
    p1, p2 = diff(chain[0], chain[1]), diff(chain[1], chain[2])
    with pytest.raises(BaseMismatch):
        basefile.compact(base, [p2], base, meta(2, "x"), p2.target_hash)  # skips version 1
    with pytest.raises(StateHashMismatch):
        basefile.compact(base, [p1], base, meta(1, "x"), p2.target_hash)  # not where the chain ends
    with pytest.raises(UsageError, match="patches only"):
        basefile.compact(base, [keyframe(chain[1])], base, meta(1, "x"), p1.target_hash)
    assert base.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir()] == ["base.safetensors"]


@pytest.mark.parametrize("dtype", ["C64", "F6_E2M3"])
def test_a_dtype_safetensors_has_and_we_do_not_is_named_not_called_malformed(tmp_path, dtype):
    """An origin publishing from a checkpoint (node/trainer/source.py) reads its headers here."""
    header = json.dumps({"ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "odd.weight": {"dtype": dtype, "shape": [2], "data_offsets": [4, 12]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(UnsupportedFormat, match=f"tensor 'odd.weight': dtype: expected one of .*BF16.*, found '{dtype}'"):
        basefile.read_header(path)
    with pytest.raises(UnsupportedFormat, match=f"found '{dtype}'"):
        Source.from_path(path, "bf16")


def test_a_base_of_every_new_dtype_is_written_read_and_compacted_bit_exactly(tmp_path):
    """fp64, u16, u32, u64, f8e8m0, the fnuz fp8s and f4e2m1x2 (safetensors' F64, U16, U32,
    U64, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F4): the base file names them as safetensors does,
    this module and safetensors read them back, and a chain of two patches compacts onto it;
    before, each had no name here."""
    s = {"f64": torch.tensor([-0.0, float("inf"), float("nan"), 1e-300] * 50, dtype=torch.float64),
         "u16": torch.tensor([0, 1 << 15, (1 << 16) - 1] * 50, dtype=torch.int32).to(torch.uint16),
         "u32": torch.tensor([0, 1 << 31, (1 << 32) - 1] * 50, dtype=torch.int64).to(torch.uint32),
         "u64": torch.tensor([0, -(1 << 63), -1] * 50, dtype=torch.int64).view(torch.uint64),
         **({"e8m0": torch.tensor([0, 127, 255] * 50, dtype=torch.uint8).view(torch.float8_e8m0fnu)}
            if hasattr(torch, "float8_e8m0fnu") else {}),
         "e4fnuz": torch.tensor([0x80, 0x7F, 0xFF] * 50, dtype=torch.uint8).view(torch.float8_e4m3fnuz),
         "e5fnuz": torch.tensor([0x80, 0x7C, 0x01] * 50, dtype=torch.uint8).view(torch.float8_e5m2fnuz).reshape(5, 30),
         **({"fp4": torch.tensor([0x88, 0x77, 0xF0] * 50, dtype=torch.uint8).reshape(15, 10)
             .view(torch.float4_e2m1fn_x2)} if hasattr(torch, "float4_e2m1fn_x2") else {})}
    s["f64"].view(torch.int64)[2] = 0x7FF800000000BEEF
    chain = [s]
    for step in (1, 2):
        nxt = {k: v.clone() for k, v in chain[-1].items()}
        for t in nxt.values():
            flat = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            flat[step::7] += step
        chain.append(nxt)
    base = tmp_path / "base.safetensors"
    basefile.write(base, s, meta(0, state_hash(s)))
    assert same(load_file(str(base)), s)
    assert {e.name: e.dtype for e in basefile.read_header(base)[1]} == {k: t.dtype for k, t in s.items()}
    raw = base.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    names = {"f64": "F64", "u16": "U16", "u32": "U32", "u64": "U64", "e8m0": "F8_E8M0", "e4fnuz": "F8_E4M3FNUZ",
             "e5fnuz": "F8_E5M2FNUZ", "fp4": "F4"}
    assert {k: header[k]["dtype"] for k in s} == {k: names[k] for k in s}
    patches = [diff(chain[0], chain[1]), diff(chain[1], chain[2])]
    basefile.compact(base, patches, base, meta(2, patches[-1].target_hash), patches[-1].target_hash)
    assert same(load_file(str(base)), chain[2])


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch < 2.8 has no float4_e2m1fn_x2")
def test_packed_fp4_shapes_count_fp4_values_in_the_header_as_safetensors_does(tmp_path):
    """safetensors' F4 counts fp4 values, two a byte: a torch float4_e2m1fn_x2 tensor of shape
    [3, 5] is [3, 10] in the header. The base file writes what safetensors writes, reads
    safetensors' own files back at the torch shape, refuses an odd count of fp4 values (half
    a byte) as malformed, and a tensor with no dimensions (no F4 form) by name."""
    fp4 = torch.arange(15, dtype=torch.uint8).reshape(3, 5).view(torch.float4_e2m1fn_x2)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    basefile.write(ours, {"w": fp4}, {})
    save_file({"w": fp4}, str(theirs))
    for path in (ours, theirs):
        raw = path.read_bytes()
        assert json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["w"]["shape"] == [3, 10]
        [entry] = basefile.read_header(path)[1]
        assert entry.shape == (3, 5) and entry.dtype == torch.float4_e2m1fn_x2 and entry.end - entry.begin == 15
        assert same(load_file(str(path)), {"w": fp4})
    header = json.dumps({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}).encode()
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(struct.pack("<Q", len(header)) + header + bytes(2))
    with pytest.raises(InvalidInput, match=r"tensor 'w': expected an even last dimension for F4 .*found shape \[3\]"):
        basefile.read_header(odd)
    with pytest.raises(UsageError, match="tensor 'z': expected at least one dimension"):
        basefile.write(tmp_path / "z.safetensors", {"z": torch.zeros((), dtype=torch.uint8).view(fp4.dtype)}, {})
    assert sorted(x.name for x in tmp_path.iterdir()) == ["odd.safetensors", "ours.safetensors", "theirs.safetensors"]
