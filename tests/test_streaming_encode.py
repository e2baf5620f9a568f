"""The origin's encoder that never holds two states: diff_in_place makes the same patch diff
makes, byte for byte, while replacing the base's tensors one by one; keyframe_chunks makes a
keyframe's chunks one batch at a time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.patch import apply, diff, keyframe
from patchswarm.protocol.patchencode import TargetSpec, diff_in_place, keyframe_chunks
from patchswarm.protocol.statehash import state_hash

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.uint8]


def bits(t):
    return t.contiguous().view(torch.uint8) if t.numel() else t.view(torch.uint8)


@st.composite
def pairs(draw):
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    n = draw(st.integers(1, 6))
    base, target = {}, {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        numel = draw(st.sampled_from([0, 1, 7, 300, 5000, 20000]))
        raw = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
        t = raw.view(dtype)
        name = f"t{i}"
        fate = draw(st.sampled_from(["same", "sparse", "removed", "new", "reshaped", "retyped"]))
        if fate != "new":
            base[name] = t.clone()
        if fate == "removed":
            continue
        u = t.clone()
        if fate == "sparse" and numel:
            flat = u.view(torch.uint8)
            flat[:: draw(st.integers(3, 50))] ^= 1
        elif fate == "reshaped" and numel:
            u = u.reshape(1, numel).clone()
        elif fate == "retyped":
            u = torch.randint(0, 100, (numel,), generator=g, dtype=torch.int32)
        target[name] = u
    return base, target


@settings(max_examples=40, deadline=None)
@given(pairs(), st.sampled_from([1, 2, 4]), st.sampled_from([512, 4096]))
def test_diff_in_place_is_diff(pair, threads, segment_elements):
    base, target = pair
    ref = diff(base, target, chunk_bytes=2000, segment_elements=segment_elements)
    state = {k: v.clone() for k, v in base.items()}
    produced = []

    def produce(name):
        produced.append(name)
        return target[name].clone()

    specs = {k: TargetSpec(v.dtype, tuple(v.shape)) for k, v in target.items()}
    counts = {}
    made = []
    p = diff_in_place(state, specs, produce, ref.base_hash, chunk_bytes=2000, segment_elements=segment_elements,
                      threads=threads, on_chunk=made.append, counts=counts)
    assert made == ref.chunks and p.chunks == []
    assert (p.target_hash, p.full, p.removed, p.tensors) == (ref.target_hash, ref.full, ref.removed, ref.tensors)
    assert sorted(produced) == sorted(target), "each target tensor made exactly once"
    assert set(state) == set(target) and all(torch.equal(bits(state[k]), bits(target[k])) for k in target)
    assert counts["changed"] == ref.stats()["changed"]
    again = {k: v.clone() for k, v in base.items()}
    apply(again, ref)
    assert state_hash(again) == p.target_hash


def test_a_produced_tensor_unlike_its_spec_is_refused():
    base = {"w": torch.zeros(8)}
    with pytest.raises(UsageError, match="was to be"):
        diff_in_place(base, {"w": TargetSpec(torch.float32, (8,))}, lambda n: torch.zeros(4), state_hash(base))


@pytest.mark.parametrize("threads", [1, 3])
def test_keyframe_chunks_are_keyframes(threads):
    g = torch.Generator().manual_seed(1)
    s = {"a": torch.randn(3000, generator=g).bfloat16(), "b": torch.randn(40, 40, generator=g),
         "c": torch.arange(9, dtype=torch.int8)}
    assert list(keyframe_chunks(s, 4000, threads=threads)) == keyframe(s, chunk_bytes=4000).chunks
