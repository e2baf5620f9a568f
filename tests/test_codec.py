"""Patch codec: bit-exact round trips, order independence, rejection of bad input."""

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence

import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from patchswarm.protocol import contexts, deltacode, ricecode, statehash
from patchswarm.protocol.errors import (AlreadyApplied, BaseMismatch, CorruptData, PatchswarmError, StateHashMismatch,
                                        UsageError)
from patchswarm.protocol.patch import Patch, apply, decode_chunk, diff, keyframe, prepare
from patchswarm.protocol.patchdecode import touched_tensors
from patchswarm.protocol.statehash import state_hash

from patchswarm.protocol.dtypes import BY_TORCH
from patchswarm.protocol.patchencode import ChunkPacker, _plan_segments, keyframe_chunks
from patchswarm.protocol.patchformat import MAX_FULL_SEGMENT_BYTES, TensorSpec, parse_chunk

DTYPES = list(BY_TORCH)  # every dtype the codec supports, so a new one is covered at once
FP4X2 = [torch.float4_e2m1fn_x2] if hasattr(torch, "float4_e2m1fn_x2") else []  # torch >= 2.8; no casts to it
INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Bit patterns a codec keyed on exponents and signs must carry through unchanged,
# written unsigned: infinities, NaNs of both signs with payloads, -0.0, subnormals, extremes.
SPECIALS = {
    torch.bfloat16: [0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x8000, 0x0001, 0x8001, 0x7F7F, 0xFF7F],
    torch.float16: [0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x8000, 0x0001, 0x8001, 0x7BFF, 0xFBFF],
    torch.float32: [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x80000000, 0x00000001,
                    0x80000001, 0x7F7FFFFF, 0xFF7FFFFF],
    # e4m3fn: no infinities; NaN is 0x7f and 0xff only; 0x7e/0xfe are +-448
    torch.float8_e4m3fn: [0x7F, 0xFF, 0x7E, 0xFE, 0x80, 0x00, 0x01, 0x81],
    # e5m2: infinities 0x7c/0xfc, NaNs 0x7d-0x7f and 0xfd-0xff
    torch.float8_e5m2: [0x7C, 0xFC, 0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF, 0x80, 0x01, 0x7B, 0xFB],
    torch.int8: [0x80, 0x7F, 0xFF, 0x00],
    torch.uint8: [0x00, 0xFF, 0x80, 0x7F],
    torch.int16: [0x8000, 0x7FFF, 0xFFFF, 0x0000],
    torch.int32: [0x80000000, 0x7FFFFFFF, 0xFFFFFFFF, 0],
    torch.int64: [1 << 63, (1 << 63) - 1, (1 << 64) - 1, 0],
    torch.bool: [0, 1],
    # f64: infinities, quiet and signalling NaNs with payloads of both signs, -0.0, subnormals, extremes
    torch.float64: [0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000, 0xFFF800000000BEEF,
                    0x7FF0000000000001, 0x8000000000000000, 0x0000000000000001, 0x8000000000000001,
                    0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF],
    # unsigned: no sign bit, so the patterns around 2^(bits-1) are neighbours, not extremes
    torch.uint16: [0x0000, 0xFFFF, 0x8000, 0x7FFF],
    torch.uint32: [0, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF],
    torch.uint64: [0, (1 << 64) - 1, 1 << 63, (1 << 63) - 1],
}
if hasattr(torch, "float8_e8m0fnu"):  # 2^-127 .. 2^127 and NaN (0xFF); no sign, no zero
    SPECIALS[torch.float8_e8m0fnu] = [0xFF, 0x00, 0x7F, 0xFE, 0x80, 0x01]
# fnuz (AMD): no infinities, no -0; 0x80 is the one NaN, +-max 0x7f/0xff, 0x01/0x81 the smallest
SPECIALS[torch.float8_e4m3fnuz] = [0x80, 0x00, 0x7F, 0xFF, 0x01, 0x81]
SPECIALS[torch.float8_e5m2fnuz] = [0x80, 0x00, 0x7F, 0xFF, 0x01, 0x81, 0x7C, 0xFC]
if hasattr(torch, "float4_e2m1fn_x2"):  # two e2m1 a byte: -0 in either half, both +-6, the extremes
    SPECIALS[torch.float4_e2m1fn_x2] = [0x00, 0x08, 0x80, 0x88, 0x77, 0xFF, 0x7F, 0xF7, 0x0F, 0xF0]


def bits(t):
    return t.reshape(-1).view(INT_OF[t.element_size()])


def special_bits(dtype) -> torch.Tensor:
    """The dtype's SPECIALS as a flat tensor of its signed integer view."""
    width = torch.empty(0, dtype=dtype).element_size()
    signed = [v - (1 << (8 * width)) if v >= 1 << (8 * width - 1) else v for v in SPECIALS[dtype]]
    return torch.tensor(signed, dtype=INT_OF[width])


def same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


def clone(s):
    return {k: v.clone() for k, v in s.items()}


def random_bits(shape, dtype, rng):
    width = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype is torch.bool:  # a bool byte other than 0 or 1 is not a bool
        return torch.from_numpy(rng.integers(0, 2, size=n, dtype=np.uint8)).view(torch.bool).reshape(shape)
    raw = torch.from_numpy(rng.integers(0, 256, size=n * width, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def sprinkle_specials(t, rng, share: float) -> None:
    """Overwrite about `share` of `t`'s elements (in place) with its dtype's special patterns."""
    flat = bits(t)
    if flat.numel():
        at = torch.from_numpy(rng.random(flat.numel()) < share)
        sp = special_bits(t.dtype)
        flat[at] = sp[torch.from_numpy(rng.integers(0, len(sp), size=int(at.sum())))]


@st.composite
def pairs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_tensors = draw(st.integers(1, 4))
    base, target = {}, {}
    for i in range(n_tensors):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 70), min_size=0, max_size=3)))
        t = random_bits(shape, dtype, rng)
        if draw(st.booleans()):  # realistic magnitudes, not random bits
            t = (torch.from_numpy(rng.standard_normal(t.numel()).astype(np.float32) * 0.02).reshape(shape).to(dtype)
                 if dtype.is_floating_point and dtype not in FP4X2 else t)  # torch cannot cast to fp4
        specials = draw(st.sampled_from([0.0, 0.0, 0.01, 0.3]))
        sprinkle_specials(t, rng, specials)
        base[f"t{i}"] = t
        density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
        tt = t.clone()
        flat = bits(tt)
        mask = torch.from_numpy(rng.random(flat.numel()) < density)
        repl = bits(random_bits(tuple(flat.shape), dtype, rng))
        if draw(st.booleans()) and dtype is not torch.bool:  # small deltas as from an optimizer step
            repl = flat + torch.from_numpy(rng.choice([-2, -1, 1, 2], flat.numel())).to(flat.dtype)
        flat[mask] = repl[mask]
        sprinkle_specials(tt, rng, specials)  # specials appear, vanish and change into each other
        target[f"t{i}"] = tt
    if draw(st.booleans()):  # an added tensor
        target["new"] = random_bits((5, 3), draw(st.sampled_from(DTYPES)), rng)
    if draw(st.booleans()) and len(base) > 1:  # a removed tensor
        del target["t0"]
    if draw(st.booleans()) and "t1" in target:  # a dtype/shape change
        target["t1"] = random_bits((7,), draw(st.sampled_from(DTYPES)), rng)
    return base, target


# Small chunks and segments too, so that a patch spans several of each (the defaults put
# these small states in one of each); 48 bytes is below one segment's header: a chunk per segment.
CHUNK_SIZES = st.sampled_from([48, 300, 4096, 1 << 20])
SEGMENT_SIZES = st.sampled_from([16, 100, 4096, 1 << 22])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs(), CHUNK_SIZES, SEGMENT_SIZES)
def test_round_trip_is_bit_exact(pair, chunk_bytes, segment_elements):
    base, target = pair
    p = Patch.from_bytes(diff(base, target, chunk_bytes=chunk_bytes, segment_elements=segment_elements).to_bytes())
    state = clone(base)
    apply(state, p)
    same(state, target)
    assert p.base_hash == state_hash(base) and p.target_hash == state_hash(target)
    kf = Patch.from_bytes(keyframe(target, chunk_bytes=chunk_bytes).to_bytes())
    state = {}
    apply(state, kf)
    same(state, target)


def test_every_supported_dtype_is_in_the_property_test():
    assert len(DTYPES) == 17 + hasattr(torch, "float8_e8m0fnu") + hasattr(torch, "float4_e2m1fn_x2")
    assert set(SPECIALS) == set(DTYPES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_with_specials_over_many_chunks_and_segments(dtype):
    """Deterministic companion of the property test: per dtype, every special pattern in
    base and target, sparse and dense changes, a patch of several chunks and segments."""
    rng = np.random.default_rng(11)
    base = {"a": random_bits((40, 50), dtype, rng), "b": random_bits((3000,), dtype, rng)}
    for t in base.values():
        sprinkle_specials(t, rng, 0.2)
    target = clone(base)
    bits(target["a"])[::7] = bits(random_bits((40 * 50,), dtype, rng))[::7]  # dense
    sp = special_bits(dtype)
    bits(target["b"])[::97] = sp[torch.arange(len(bits(target["b"])[::97])) % len(sp)]  # sparse, specials
    if dtype is not torch.bool:
        bits(target["b"])[5::11] += 1
    p = Patch.from_bytes(diff(base, target, chunk_bytes=300, segment_elements=100).to_bytes())
    segments = [seg for c in p.chunks for seg in parse_chunk(c)[0]]
    assert len(p.chunks) > 3 and len(segments) > 3, (len(p.chunks), len(segments))
    state = clone(base)
    apply(state, p)
    same(state, target)
    state = {}
    apply(state, Patch.from_bytes(keyframe(target, chunk_bytes=300).to_bytes()))
    same(state, target)


def test_a_class_without_changes_round_trips():
    # Small weights and large ones, only the large ones changed: the window gives the small
    # ones a class of their own, which carries no changes (its row is [0]).
    g = torch.Generator().manual_seed(0)
    w = torch.cat([torch.rand(8192, generator=g) * 1e-4, 1 + torch.rand(8192, generator=g)]).to(torch.bfloat16)
    base, target = {"w": w}, {"w": w.clone()}
    target["w"][8192::7] *= 1.01
    p = Patch.from_bytes(diff(base, target).to_bytes())
    rows = [row for c in p.chunks for seg in parse_chunk(c)[0] for row in seg.rows]
    assert [0] in rows and any(row[0] for row in rows)
    state = clone(base)
    apply(state, p)
    same(state, target)


def test_a_patch_of_many_small_tensors_round_trips():
    # more rows than the tensor table's allowance for its compressed size alone (64)
    base = {f"layers.{i}.norm.bias": torch.zeros(3) for i in range(200)}
    target = {k: v + 1 for k, v in base.items()}
    p = Patch.from_bytes(diff(base, target).to_bytes())
    assert len(p.tensors) == 200
    state = clone(base)
    apply(state, p)
    same(state, target)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=60), data=st.data())
def test_a_delta_segment_lists_only_the_tensors_it_changes(sizes, data):
    """Small tensors stack into one planned segment; its changes are listed with their own
    tensors only (positions in those pieces' concatenation), not every tensor of the stack,
    and the patch still applies bit-exactly."""
    base = {f"t{i:03d}": torch.arange(n, dtype=torch.float32) * 0.5 + i for i, n in enumerate(sizes)}
    target = clone(base)
    changed = data.draw(st.sets(st.sampled_from(sorted(base)), max_size=len(base)))
    for name in changed:
        n = base[name].numel()
        for j in data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)):
            target[name][j] += 1.0
    p = Patch.from_bytes(diff(base, target, segment_elements=1 << 20).to_bytes())
    names = [t.name for t in p.tensors]
    listed = [names[i] for c in p.chunks for seg in parse_chunk(c)[0] for i, _, _ in seg.pieces]
    assert listed == sorted(changed)
    state = clone(base)
    apply(state, p)
    same(state, target)


def test_a_class_window_over_the_changed_tensors_of_a_stack_round_trips():
    """Class windows over a segment whose unchanged tensors were left out: ranks are counted
    among the listed pieces' elements only, at the encoder and the decoder alike."""
    g = torch.Generator().manual_seed(1)
    base = {f"w{i}": torch.cat([torch.rand(8192, generator=g) * 1e-4, 1 + torch.rand(8192, generator=g)]).to(torch.bfloat16)
            for i in range(6)}
    target = clone(base)
    for name in ("w1", "w4"):
        target[name][8192::7] *= 1.01
    p = Patch.from_bytes(diff(base, target).to_bytes())
    segs = [seg for c in p.chunks for seg in parse_chunk(c)[0]]
    names = [t.name for t in p.tensors]
    assert [[names[i] for i, _, _ in seg.pieces] for seg in segs] == [["w1", "w4"]]
    assert segs[0].window[1] > 1
    state = clone(base)
    apply(state, p)
    same(state, target)


@pytest.mark.parametrize("start, ok", [((1 << 63) - 2, True), (1 << 63, False)])
def test_chunk_positions_are_bounded_by_int64(start, ok):
    chunk = msgpack.unpackb(diff({"w": torch.zeros(8)}, {"w": torch.ones(8)}).chunks[0])
    chunk["s"][0]["p"] = [[0, start, start + 1]]
    data = msgpack.packb(chunk)
    if ok:
        assert parse_chunk(data)[0][0].pieces == [(0, start, start + 1)]
    else:
        with pytest.raises(CorruptData, match="a piece"):
            parse_chunk(data)


def test_a_full_segment_over_its_limit_is_refused_and_named():
    chunk = msgpack.unpackb(keyframe({"w": torch.zeros(8, dtype=torch.bfloat16)}).chunks[0])
    assert chunk["s"][0]["k"] == "f"
    n = MAX_FULL_SEGMENT_BYTES // 2 + 1  # bf16 elements
    chunk["s"][0]["p"] = [[0, 0, n]]
    with pytest.raises(CorruptData, match=f"bytes of elements, found {2 * n}$"):
        parse_chunk(msgpack.packb(chunk))


@pytest.mark.parametrize("dim, ok", [((1 << 48) - 1, True), (1 << 48, False)])
def test_table_dimensions_are_bounded(dim, ok):
    p = diff({"w": torch.zeros(8)}, {"w": torch.ones(8)})
    p.tensors = [TensorSpec("w", "fp32", (dim,))]
    if ok:
        assert Patch.from_bytes(p.to_bytes()).tensors[0].shape == (dim,)
    else:
        with pytest.raises(CorruptData, match="a dimension"):
            Patch.from_bytes(p.to_bytes())


# Tensors the codec cannot read, and what the error must say about each.
UNREADABLE = {
    "DTensor-like": (lambda: __import__("test_source").Sharded(torch.randn(3)), "a Sharded"),
    "sparse COO": (lambda: torch.randn(4, 4).to_sparse(), "layout torch.sparse_coo"),
    "sparse CSR": (lambda: torch.randn(4, 4).to_sparse_csr(), "layout torch.sparse_csr"),
    "nested": (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "a nested tensor"),
    "meta": (lambda: torch.empty(3, device="meta"), "device meta"),
    "complex": (lambda: torch.randn(3, dtype=torch.complex64), "torch.complex64"),
    # A float torch has and safetensors does not (fp64 and the fnuz fp8s, once here, are served now).
    "complex32": (lambda: torch.zeros(3, dtype=torch.complex32), "torch.complex32"),
    "qint8": (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "torch.qint8"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: CSR and nested are beta, qint8 deprecated
@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_a_tensor_the_codec_cannot_read_is_refused_by_name(kind):
    """Every entry point says which tensor and what it is, never a crash inside torch or numpy."""
    make, found = UNREADABLE[kind]
    odd, ok = {"odd.weight": make()}, {"ok": torch.ones(3)}
    for call in (lambda: keyframe({**ok, **odd}), lambda: diff(ok, {**ok, **odd}), lambda: diff({**ok, **odd}, ok),
                 lambda: apply({**ok, **odd}, diff(ok, {"ok": torch.zeros(3)})), lambda: state_hash({**ok, **odd})):
        with pytest.raises(PatchswarmError, match="expected") as e:
            call()
        assert found in str(e.value) and "'odd.weight'" in str(e.value), str(e.value)
    with pytest.raises(PatchswarmError, match=f"^tensor: .*expected .*{found}"):
        statehash.tensor_digest(odd["odd.weight"])


@pytest.mark.parametrize("name, ok", [("x" * 4096, True), ("é" * 2048, True), ("x" * 4097, False),
                                      ("é" * 2049, False), ("\ud800", False), ("", True), ("a/b.ü 权", True)])
def test_names_are_checked_when_a_patch_is_made_not_when_it_is_read(name, ok):
    """A patch is made only of names it can carry: UTF-8, at most MAX_NAME_BYTES."""
    a, b = {name: torch.zeros(3)}, {name: torch.ones(3)}
    if ok:
        for p in (diff(a, b), keyframe(b)):
            state = {} if p.kind == "keyframe" else {name: torch.zeros(3)}
            apply(state, Patch.from_bytes(p.to_bytes()))
            assert torch.equal(state[name], b[name])
    else:
        for call in (lambda: diff(a, b), lambda: keyframe(b), lambda: diff(a, {})):
            with pytest.raises(UsageError, match="tensor name: expected"):
                call()


@pytest.mark.parametrize("shape, ok", [([0, (1 << 48) - 1], True), ([1] * 64, True), ([0, 1 << 48], False),
                                       ([0, 1 << 62], False), ([1] * 65, False)])
def test_shapes_are_checked_when_a_patch_is_made_not_when_it_is_read(shape, ok):
    """The defects: an empty tensor with a dimension of 2**48 or more made a patch whose
    own reader refused it ("tensor table: expected a dimension in [0, 2**48-1]"), and one
    of [0, 2**62] or of 65 dimensions raised numpy's ValueError from the state hash (a
    traceback out of `patchswarm diff`, and of `apply` on such a BASE)."""
    a, b = {"w": torch.zeros(shape)}, {"w": torch.ones(shape)}
    assert statehash.is_state_hash(state_hash(a))
    if ok:
        for p in (diff(a, b), keyframe(b)):
            state = {} if p.kind == "keyframe" else {"w": a["w"].clone()}
            apply(state, Patch.from_bytes(p.to_bytes()))
            assert state_hash(state) == state_hash(b)
    else:
        for call in (lambda: diff(a, b), lambda: keyframe(b), lambda: diff({}, b)):
            with pytest.raises(UsageError, match="shape: expected at most 64 dimensions"):
                call()
        with pytest.raises(UsageError, match="shape: expected"):
            apply(dict(a), diff({}, {"x": torch.ones(2)}))


@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from([torch.float32, torch.bfloat16])), max_size=12),
       st.integers(1, 12))
@example([(6, torch.float32), (5, torch.float32), (5, torch.float32), (1, torch.float32)], 10)
def test_segments_hold_whole_pieces_of_one_dtype_up_to_their_size(tensors, max_elements):
    state = {f"t{i:02}": torch.empty(n, dtype=dt) for i, (n, dt) in enumerate(tensors)}
    segments = _plan_segments(state, sorted(state), max_elements)
    pieces = [p for seg in segments for p in seg]
    # every element once, in order; a piece within one tensor
    assert pieces == sorted(pieces) and all(0 <= a < b <= state[name].numel() for name, a, b in pieces)
    assert {name: sum(b - a for n, a, b in pieces if n == name) for name in state} == {
        name: t.numel() for name, t in state.items()}
    for seg, after in zip(segments, segments[1:] + [None]):
        assert len({state[name].dtype for name, _, _ in seg}) == 1
        assert sum(b - a for _, a, b in seg) <= max_elements
        if after is not None and state[after[0][0]].dtype == state[seg[0][0]].dtype:  # filled before the next
            assert sum(b - a for _, a, b in seg) + after[0][2] - after[0][1] > max_elements


def test_keyframe_progress_counts_segments_up_to_the_total():
    state = {"a": torch.ones(4), "b": torch.ones(4, dtype=torch.bfloat16), "c": torch.ones(4, dtype=torch.float16)}
    calls = []
    chunks = list(keyframe_chunks(state, threads=1, progress=lambda done, total: calls.append((done, total))))
    assert chunks and calls == [(1, 3), (2, 3), (3, 3)]  # one segment per dtype


def test_a_one_class_row_of_another_size_is_refused_and_named():
    base, target = {"w": torch.zeros(8)}, {"w": torch.ones(8)}
    target["w"][3] = 0
    p = diff(base, target)
    chunk = msgpack.unpackb(p.chunks[0])
    assert chunk["s"][0]["w"][1] == 1 and chunk["s"][0]["c"][0][:2] == [7, 8]  # one class: 7 changes of 8
    chunk["s"][0]["c"][0][1] = 7
    p.chunks[0] = msgpack.packb(chunk)
    with pytest.raises(CorruptData, match="expected the segment's 8 elements, found 7$"):
        apply(base, p)
    assert torch.equal(base["w"], torch.zeros(8))


def test_apply_without_the_compiled_kernel_gives_the_same_bits(real_pair, monkeypatch):
    base, target = real_pair
    p = Patch.from_bytes(diff(base, target).to_bytes())
    monkeypatch.setattr(contexts, "KERNEL", None)  # the numpy path, as where _kernels did not build
    state = clone(base)
    apply(state, p)
    same(state, target)


def test_stats_count_every_stream_and_table_byte(real_pair):
    p = diff(*real_pair, chunk_bytes=256, segment_elements=4096)
    delta = [seg for c in p.chunks for seg in parse_chunk(c)[0] if seg.kind == "d"]
    s = p.stats()
    assert s["position_bytes"] + s["value_bytes"] == (sum(len(x) for seg in delta for x in seg.streams)
                                                      + sum(len(row[-1]) for seg in delta for row in seg.rows if row[0]))
    full = sum(t.numel for t in p.tensors if t.name in set(p.full))
    assert 0 < s["value_bytes"] and s["changed"] == sum(row[0] for seg in delta for row in seg.rows) + full


def test_full_bytes_count_the_full_segments_planes_and_nothing_else(real_pair):
    base, target = real_pair
    sparse = diff(base, target)
    kf = keyframe(target, chunk_bytes=1 << 16)
    planes = sum(len(pl[1]) for c in kf.chunks for seg in parse_chunk(c)[0] if seg.kind == "f" for pl in seg.planes)
    assert kf.stats()["full_bytes"] == planes > 0
    assert not any(seg.kind == "f" for c in sparse.chunks for seg in parse_chunk(c)[0])
    assert sparse.stats()["full_bytes"] == 0


def test_apply_counts_chunks_then_the_hash_up_to_one_total(real_pair):
    base, target = real_pair
    p = diff(base, target, chunk_bytes=256, segment_elements=4096)
    calls = []
    apply(clone(base), p, progress=lambda done, total: calls.append((done, total)))
    total = len(p.chunks) + 1
    assert {t for _, t in calls} == {total} and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) == total


def test_apply_to_a_state_holding_a_non_contiguous_tensor(real_pair):
    base, target = real_pair
    name = next(n for n, t in base.items() if t.dim() == 2 and t.shape[0] != t.shape[1])
    p = diff(base, target)
    state = clone(base)
    state[name] = state[name].t().contiguous().t()  # the same values, transposed strides
    assert not state[name].is_contiguous()
    apply(state, p)
    same(state, target)


def test_a_small_keyframe_of_several_segments_is_one_chunk():
    state = {"a": torch.arange(100, dtype=torch.bfloat16), "b": torch.arange(50, dtype=torch.float32),
             "c": torch.arange(30, dtype=torch.int8)}
    kf = keyframe(state)
    assert sum(len(parse_chunk(c)[0]) for c in kf.chunks) == 3 and len(kf.chunks) == 1
    assert len(diff(clone(state), {**state, "a": state["a"] + 1}).chunks) == 1


@pytest.mark.parametrize("over", [-1, 0, 1])
def test_the_packer_closes_a_chunk_only_when_the_next_segment_would_pass_chunk_bytes(over):
    segs = [{"x": bytes(100)}, {"x": bytes(200)}]
    sizes = [len(msgpack.packb(seg, use_bin_type=True)) for seg in segs]
    packer = ChunkPacker(sum(sizes) - over)
    none = [np.zeros(1, np.uint8)]
    assert packer.add(segs[0], none, none) == []
    closed = packer.add(segs[1], none, none)
    rest = packer.finish()
    assert len(closed) == (1 if over > 0 else 0) and len(closed) + len(rest) == (2 if over > 0 else 1)
    assert [seg for c in closed + rest for seg in msgpack.unpackb(c)["s"]] == segs


def test_diff_without_the_compiled_kernel_makes_the_same_patch(real_pair, monkeypatch):
    base, target = real_pair
    with_kernel = diff(base, target, chunk_bytes=256, segment_elements=4096).to_bytes()
    monkeypatch.setattr(contexts, "KERNEL", None)  # the numpy twins, as where _kernels did not build
    assert diff(base, target, chunk_bytes=256, segment_elements=4096).to_bytes() == with_kernel


def test_special_values_round_trip():
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 65504.0, 1.0]
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        base = {"x": torch.tensor(vals, dtype=dt).repeat(500)}
        target = {"x": torch.tensor(list(reversed(vals)), dtype=dt).repeat(500)}
        b = bits(target["x"])
        b[::7] = torch.tensor(0x7FC1 if dt != torch.float32 else 0x7FC00001, dtype=b.dtype)  # NaN payload
        state = clone(base)
        apply(state, diff(base, target))
        same(state, target)


@pytest.fixture(scope="module")
def real_pair():
    from synthetic import served_pairs

    return served_pairs("tiny", lr=1e-5, steps=1)[0]


def test_real_pair_is_sparse_and_multi_chunk(real_pair):
    base, target = real_pair
    p = diff(base, target, chunk_bytes=256, segment_elements=4096)
    s = p.stats()
    assert 0 < s["changed"] < s["params"] * 0.5
    assert s["chunks"] > 3
    assert len(p.to_bytes()) < sum(t.numel() * t.element_size() for t in target.values()) / 4


def test_chunks_apply_in_any_order(real_pair):
    base, target = real_pair
    p = diff(base, target, chunk_bytes=256, segment_elements=4096)
    for seed in range(3):
        state = clone(base)
        prepare(state, p)
        order = list(range(len(p.chunks)))
        random.Random(seed).shuffle(order)
        for i in order:
            decode_chunk(state, p.chunks[i], p.tensors).write(state)
        same(state, target)


def test_wrong_base_and_double_apply_change_nothing(real_pair):
    base, target = real_pair
    p = diff(base, target)
    state = clone(target)
    with pytest.raises(BaseMismatch):
        apply(state, p)
    same(state, target)
    other = clone(base)
    name = sorted(other)[0]
    bits(other[name])[:] += 3
    snapshot = clone(other)
    with pytest.raises(BaseMismatch):
        apply(other, p)
    same(other, snapshot)


def test_double_apply_of_one_chunk_is_detected(real_pair):
    base, target = real_pair
    p = diff(base, target, chunk_bytes=1 << 30)
    state = clone(base)
    decode_chunk(state, p.chunks[0], p.tensors).write(state)
    with pytest.raises(BaseMismatch):
        decode_chunk(state, p.chunks[0], p.tensors)


def test_base_differing_outside_changed_positions_is_rolled_back(real_pair):
    base, target = real_pair
    p = diff(base, target)
    state = clone(base)
    name = max(state, key=lambda k: state[k].numel())
    flat = bits(state[name])
    unchanged = torch.nonzero(bits(base[name]) == bits(target[name]))[0, 0]
    flat[unchanged] ^= 1
    snapshot = clone(state)
    with pytest.raises(StateHashMismatch):
        apply(state, p)
    same(state, snapshot)


def test_truncated_and_corrupted_patches_are_rejected(real_pair):
    base, target = real_pair
    data = diff(base, target).to_bytes()
    rng = random.Random(0)
    for cut in [0, 1, 10, len(data) // 2, len(data) - 1]:
        with pytest.raises(CorruptData):
            Patch.from_bytes(data[:cut])
    rejected = 0
    for _ in range(60):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        state = clone(base)
        try:
            apply(state, Patch.from_bytes(bytes(bad)))
        except PatchswarmError:
            rejected += 1
            same(state, base)
        else:
            same(state, target)  # a flip in slack space may be harmless; the result must still be right
    assert rejected > 40


def test_keyframe_round_trip_and_size(real_pair):
    _, target = real_pair
    kf = Patch.from_bytes(keyframe(target).to_bytes())
    state = {"stale": torch.zeros(3)}
    apply(state, kf)
    same(state, target)
    raw = sum(t.numel() * t.element_size() for t in target.values())
    assert len(kf.to_bytes()) < 0.9 * raw


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 50), max_size=300), st.integers(0, 40))
def test_rice_round_trip(values, k):
    v = np.array(values, dtype=np.uint64)
    blob = ricecode.pack(v, k)
    assert np.array_equal(ricecode.unpack(blob, len(values), k), v)
    escaped = int(((v >> np.uint64(k)) >= ricecode.ESCAPE_Q).sum())
    unary_bits = ricecode.cost_bits(v, k) - len(values) * k - 64 * escaped
    assert len(blob) == (len(values) * k + 7) // 8 + (unary_bits + 7) // 8 + 8 * escaped  # no lengths stored
    best, bits = ricecode.best_k_and_bits(v)
    assert bits == ricecode.cost_bits(v, best)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1) | st.integers(0, 300), st.integers(0, 40)), max_size=300))
def test_rice_with_a_k_per_value_round_trips(pairs):
    v = np.array([p[0] for p in pairs], dtype=np.uint64)
    k = np.array([p[1] for p in pairs], dtype=np.int64)
    assert np.array_equal(ricecode.unpack(ricecode.pack(v, k), len(pairs), k), v)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 64)), max_size=200))
def test_raw_bit_fields_match_a_plain_bit_layout(pairs):
    v = np.array([p[0] for p in pairs], dtype=np.uint64)
    w = np.array([p[1] for p in pairs], dtype=np.int64)
    data = ricecode.pack_bits(v, w)
    bits = [(x >> j) & 1 for x, n in pairs for j in range(n)]
    assert data == (np.packbits(np.array(bits, np.uint8), bitorder="little").tobytes() if bits else b"")
    want = np.array([x & ((1 << n) - 1) for x, n in pairs], dtype=np.uint64)
    assert np.array_equal(ricecode.unpack_bits(data, w, len(pairs)), want)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 50), st.integers(0, 45))
def test_rice_decoder_never_crashes(blob, count, k):
    try:
        ricecode.unpack(blob, count, k)
    except CorruptData:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_container_parser_raises_only_its_own_errors(data):
    try:
        Patch.from_bytes(data)
    except PatchswarmError:
        pass


@st.composite
def class_changes(draw):
    """Per class: size n, sorted changed ranks, nonzero int64 deltas (narrow, wide or extreme)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ranks, sizes, deltas = [], [], []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(0, 3000))
        density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.4, 0.6, 0.95, 1.0]))
        r = np.flatnonzero(rng.random(n) < density)
        kind = draw(st.sampled_from(["ulp", "wide", "extreme"]))
        if kind == "ulp":
            d = rng.choice([-2, -1, 1, 1, 1, 2], r.size)
        elif kind == "wide":
            d = rng.integers(1, 5000, r.size) * rng.choice([-1, 1], r.size)
        else:
            d = rng.choice(np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 1, 1 << 40], dtype=np.int64), r.size)
        ranks.append(r)
        sizes.append(n)
        deltas.append(d.astype(np.int64))
    return ranks, sizes, deltas


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(class_changes())
def test_delta_code_round_trips(changes):
    ranks, sizes, deltas = changes
    rows, streams = deltacode.encode(ranks, sizes, deltas)
    rows = deltacode.check_rows(msgpack_round_trip(rows), len(ranks))
    streams = msgpack_round_trip(streams)
    got = deltacode.decode_positions(rows, streams)
    for want, have in zip(ranks, got):
        assert np.array_equal(want, have)
    assert np.array_equal(deltacode.decode_deltas(rows, streams), np.concatenate(deltas))


def msgpack_round_trip(x):
    import msgpack

    return msgpack.unpackb(msgpack.packb(x, use_bin_type=True), raw=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(class_changes(), st.data())
def test_delta_decoder_raises_only_corrupt_data(changes, data):
    rows, streams = deltacode.encode(*changes)
    streams = [bytearray(s) for s in streams]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(streams) - 1))
        if data.draw(st.booleans()) and streams[i]:
            j = data.draw(st.integers(0, len(streams[i]) - 1))
            streams[i][j] ^= 1 << data.draw(st.integers(0, 7))
        else:
            streams[i] = streams[i][: data.draw(st.integers(0, len(streams[i])))] + data.draw(st.binary(max_size=3))
    if data.draw(st.booleans()):
        row = data.draw(st.integers(0, len(rows) - 1))
        if len(rows[row]) > 1:
            col = data.draw(st.integers(0, 7))
            rows[row][col] = data.draw(st.integers(0, 70))
    try:
        rows = deltacode.check_rows(rows, len(rows))
        deltacode.decode_positions(rows, [bytes(s) for s in streams])
        deltacode.decode_deltas(rows, [bytes(s) for s in streams])
    except CorruptData:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=50), st.data())
def test_select_in_words_finds_the_kth_set_bit(words, data):
    x = np.array(words, dtype=np.uint64)
    k = [data.draw(st.integers(0, bin(w).count("1") - 1)) for w in words]
    want = [[j for j in range(64) if w >> j & 1][i] for w, i in zip(words, k)]
    assert contexts.select_in_words(x, np.array(k, dtype=np.uint64)).tolist() == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_class_index_rank_and_select_agree_with_a_sort(dtype, monkeypatch):
    from patchswarm.protocol.dtypes import info_of

    monkeypatch.setattr(contexts, "CHUNK", 1024)  # several chunks, a piece across chunk ends
    rng = np.random.default_rng(5)
    info = info_of(dtype)
    gen = torch.Generator().manual_seed(3)
    pieces = [bits((torch.randn(n, generator=gen) * 0.02).to(dtype)).numpy() for n in (1000, 63, 4097, 1)]
    flat = np.concatenate(pieces)
    keys = contexts.keys_of(flat, info)
    lo = max(0, int(np.median(keys)) - 3)
    ids = contexts.class_of_keys(keys, lo, 8)
    ci = contexts.ClassIndex(pieces, info, lo, 8)
    ranks = {}
    for c in range(8):
        members = np.flatnonzero(ids == c)
        assert ci.class_size(c) == members.size
        pick = np.sort(rng.choice(members.size, min(members.size, 50), replace=False)) if members.size else members
        counts = [pick.size if d == c else 0 for d in range(8)]
        assert np.array_equal(ci.rank_runs(members[pick], counts), pick)
        ranks[c] = pick
    want = np.concatenate([np.flatnonzero(ids == c)[ranks[c]] for c in range(8)])
    counts = [ranks[c].size for c in range(8)]
    assert np.array_equal(ci.rank_runs(want, counts), np.concatenate([ranks[c] for c in range(8)]))
    assert np.array_equal(ci.select_runs(np.concatenate([ranks[c] for c in range(8)]), counts), want)
    expo = (flat.astype(np.int64) >> info.mantissa_bits) & ((1 << (info.bits - 1 - info.mantissa_bits)) - 1)
    assert np.array_equal(keys, expo)


@pytest.mark.parametrize("classes", [1, 2, 4, 8])
@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_select_dense_and_sparse_paths_agree(classes, path, monkeypatch):
    """Dense classes gather from the members listed in class order; sparse ones select rank by rank."""
    from patchswarm.protocol.dtypes import info_of

    monkeypatch.setattr(contexts, "DENSE_SELECT", 1 << 40 if path == "dense" else 0)
    rng = np.random.default_rng(classes)
    info = info_of(torch.bfloat16)
    pieces = [bits((torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(torch.bfloat16)).numpy()
              for n in (5000, 77, 1)]
    keys = contexts.keys_of(np.concatenate(pieces), info)
    lo = max(0, int(np.median(keys)) - classes // 2)
    ids = contexts.class_of_keys(keys, lo, classes)
    ci = contexts.ClassIndex(pieces, info, lo, classes)
    picks = [np.flatnonzero(rng.random(ci.class_size(c)) < (0.9 if c % 2 else 0.3)) for c in range(classes)]
    want = np.concatenate([np.flatnonzero(ids == c)[picks[c]] for c in range(classes)])
    got = ci.select_runs(np.concatenate(picks), [p.size for p in picks])
    assert np.array_equal(got, want)


def test_state_hash_is_blake3_prefixed_and_independent_of_threads(monkeypatch):
    state = {"a": torch.arange(3_000_000, dtype=torch.int32), "b": torch.zeros(0), "c": torch.tensor(1.5).bfloat16(),
             "d": torch.ones(5, 7).t()}
    h = state_hash(state)
    assert statehash.is_state_hash(h) and h.startswith("blake3:")
    monkeypatch.setattr(statehash, "_workers", lambda total, blocks, limit=None: 1)
    assert state_hash(state) == h
    monkeypatch.setattr(statehash, "_workers", lambda total, blocks, limit=None: 7)
    monkeypatch.setattr(statehash, "BLOCK_BYTES", 1 << 20)
    other = state_hash(state)  # another block size is another definition
    assert other != h and statehash.is_state_hash(other)
    changed = dict(state, a=state["a"].clone())
    changed["a"][-1] += 1
    monkeypatch.undo()
    assert state_hash(changed) != h
    assert state_hash(dict(state, c=torch.tensor(1.5))) != h  # same value, other dtype


def test_second_apply_of_a_chunk_is_named_as_such():
    # Below 4096 elements a segment has no context classes, so the positions a
    # second apply decodes are the same ones and the state holds the new values.
    base = {"x": (torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()}
    target = clone(base)
    bits(target["x"])[::50] += 1
    p = diff(base, target)
    state = clone(base)
    decode_chunk(state, p.chunks[0], p.tensors).write(state)
    with pytest.raises(AlreadyApplied):
        decode_chunk(state, p.chunks[0], p.tensors)
    with pytest.raises(BaseMismatch):
        apply(state, p)
    same(state, target)


def test_rice_parameter_is_the_best_on_geometric_gaps():
    rng = np.random.default_rng(11)
    for p in (0.5, 0.1, 0.01, 0.0005):
        gaps = rng.geometric(p, 5000).astype(np.uint64) - np.uint64(1)
        k, bits = ricecode.best_k_and_bits(gaps)
        assert bits == min(ricecode.cost_bits(gaps, j) for j in range(ricecode.MAX_K + 1))


def test_diff_hashes_in_the_background_and_reports_hash_errors(monkeypatch):
    base = {"w": torch.arange(5000, dtype=torch.float32).bfloat16()}
    target = clone(base)
    bits(target["w"])[::7] += 1
    p = diff(base, target)
    assert (p.base_hash, p.target_hash) == (state_hash(base), state_hash(target))
    given = diff(base, target, base_hash=p.base_hash, target_hash=p.target_hash)
    assert given.to_bytes() == p.to_bytes()

    def broken(block):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(statehash, "_digest_block", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        diff(base, target)
    assert diff(base, target, base_hash=p.base_hash, target_hash=p.target_hash).to_bytes() == p.to_bytes()


def test_buffer_pool_reuses_and_keeps_at_most_its_limit():
    pool = contexts.BufferPool(keep=2)
    bufs = [pool.take(n) for n in (100, 70_000, 80_000)]
    for b in bufs:
        pool.give(b)
    assert len(pool._free) == 2 and min(b.size for b in pool._free) >= 70_000
    with pool.scratch(70_000) as a:
        assert a.size == 70_000 and any(np.shares_memory(a, b) for b in bufs)
    with pool.scratch(200_000) as big, pool.scratch(10) as small:
        assert big.size == 200_000 and small.size == 10 and not np.shares_memory(big, small)
    small_pool = contexts.BufferPool(keep=2, keep_bytes=100_000)
    small_pool.give(small_pool.take(200_000))
    assert not small_pool._free  # too big to keep


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**45) | st.integers(0, 300), min_size=1, max_size=60), min_size=1, max_size=8))
def test_best_k_runs_matches_best_k_of_each_run(runs):
    values = np.array([v for r in runs for v in r], dtype=np.uint64)
    want = [ricecode.best_k_and_bits(np.array(r, dtype=np.uint64))[0] for r in runs]
    assert ricecode.best_k_runs(values, [len(r) for r in runs]) == want


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_changes_are_every_differing_position_in_order(sizes, seed):
    from patchswarm.protocol.patchencode import _changes

    rng = np.random.default_rng(seed)
    bs = [rng.integers(-5, 5, n).astype(np.int16) for n in sizes]
    ts = [np.where(rng.random(n) < 0.1, b + 1, b).astype(np.int16) for b, n in zip(bs, sizes)]
    got = _changes(bs, ts, np.empty(sum(sizes), dtype=bool))
    assert np.array_equal(got, np.flatnonzero(np.concatenate(bs) != np.concatenate(ts)))


def test_apply_gives_the_same_bits_on_one_thread_or_many():
    gen = torch.Generator().manual_seed(3)
    base = {f"w{i}": (torch.randn(60_000, generator=gen) * 0.02).bfloat16() for i in range(6)}
    target = {k: (v.float() + 1e-3 * torch.randn(v.shape, generator=gen)).bfloat16() for k, v in base.items()}
    p = Patch.from_bytes(diff(base, target, segment_elements=50_000, chunk_bytes=20_000).to_bytes())
    assert len(p.chunks) > 2
    for threads in (1, None):
        state = clone(base)
        apply(state, p, threads=threads)
        assert all(torch.equal(bits(state[k]), bits(target[k])) for k in target)


def test_state_hash_is_the_same_on_one_thread_or_many():
    state = {f"t{i}": torch.arange(300_000 + i, dtype=torch.int32) for i in range(5)}
    assert state_hash(state, threads=1) == state_hash(state) == state_hash(state, threads=3)


def _dense_and_sparse_pair(real_pair):
    """real_pair plus one tensor whose every element changes (its undo keeps the old range, not positions)."""
    base, target = clone(real_pair[0]), clone(real_pair[1])
    rng = np.random.default_rng(7)
    dense = random_bits((64, 96), torch.bfloat16, rng)
    base["z.dense"] = dense
    target["z.dense"] = (bits(dense) ^ torch.from_numpy(rng.integers(1, 4, size=dense.numel(), dtype=np.int16))).view(torch.bfloat16).reshape(dense.shape)
    return base, target


@pytest.fixture
def one_chunk_batches(monkeypatch):
    import patchswarm.protocol.patchdecode as patchdecode

    monkeypatch.setattr(patchdecode, "APPLY_BATCH_BYTES", 1)  # with threads=1: every chunk its own batch


def test_undo_keeps_old_ranges_for_dense_pieces_and_int32_positions_for_sparse(real_pair):
    base, target = _dense_and_sparse_pair(real_pair)
    p = diff(base, target, chunk_bytes=1 << 30)
    state = clone(base)
    d = decode_chunk(state, p.chunks[0], p.tensors)
    kept = {name: (pos, old) for name, pos, old, _ in d.undo_record(state).writes}
    pos, old = kept["z.dense"]
    assert isinstance(pos, slice) and old.size == pos.stop - pos.start
    positions = [(pos, old) for pos, old in kept.values() if not isinstance(pos, slice)]
    assert positions and all(pos.dtype == np.int32 and pos.size == old.size for pos, old in positions)
    ranges = [(pos, old) for pos, old in kept.values() if isinstance(pos, slice)]
    assert all(old.size == pos.stop - pos.start for pos, old in ranges)


def test_undo_keeps_a_dense_piece_as_the_range_from_its_first_write():
    base = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    target = {"w": base["w"].clone()}
    target["w"][100:] = 1.0  # every element from 100 on
    p = diff(base, target)
    state = clone(base)
    [(name, pos, old, _)] = decode_chunk(state, p.chunks[0], p.tensors).undo_record(state).writes
    assert (name, pos, old.size) == ("w", slice(100, 1000), 900)


def test_a_failure_after_earlier_batches_were_written_undoes_them(real_pair, one_chunk_batches):
    base, target = _dense_and_sparse_pair(real_pair)
    p = diff(base, target, chunk_bytes=256, segment_elements=4096)
    assert len(p.chunks) > 3
    state = clone(base)
    apply(state, p, threads=1)  # batch by batch, undo records kept
    same(state, target)

    # The last chunk finds a base it was not made for: the chunks before it were written, then undone.
    state = clone(base)
    last = decode_chunk(state, p.chunks[-1], p.tensors).writes[-1]
    bits(state[last[0]])[int(last[1][-1]) if not isinstance(last[1], slice) else last[1].stop - 1] ^= 1
    snapshot = clone(state)
    with pytest.raises(BaseMismatch):
        apply(state, p, threads=1)
    same(state, snapshot)

    # Every chunk fits, the state hash does not (a flipped bit nothing writes): every batch is undone.
    state = clone(base)
    name = next(n for n in sorted(base) if n != "z.dense")
    flat = bits(state[name])
    flat[torch.nonzero(bits(base[name]) == bits(target[name]))[0, 0]] ^= 1
    snapshot = clone(state)
    with pytest.raises(StateHashMismatch):
        apply(state, p, threads=1)
    same(state, snapshot)


def test_without_undo_no_records_are_kept_and_only_failures_before_a_write_leave_the_state(
        real_pair, one_chunk_batches, monkeypatch):
    import patchswarm.protocol.patchdecode as patchdecode

    base, target = _dense_and_sparse_pair(real_pair)
    p = diff(base, target, chunk_bytes=256, segment_elements=4096)

    def no_records(self, state):
        raise AssertionError("undo=False must not build undo records")

    monkeypatch.setattr(patchdecode.DecodedChunk, "undo_record", no_records)
    state = clone(base)
    apply(state, p, threads=1, undo=False)
    same(state, target)
    # Found before any write (the first batch's check): unchanged, as with undo.
    with pytest.raises(AlreadyApplied):
        apply(state, p, threads=1, undo=False)
    same(state, target)

    # Found after earlier batches were written: the state is left partly patched.
    state = clone(base)
    last = decode_chunk(state, p.chunks[-1], p.tensors).writes[-1]
    bits(state[last[0]])[int(last[1][-1]) if not isinstance(last[1], slice) else last[1].stop - 1] ^= 1
    with pytest.raises(BaseMismatch):
        apply(state, p, threads=1, undo=False)
    name, pos, _old, _new = decode_chunk(clone(base), p.chunks[0], p.tensors).writes[0]
    assert torch.equal(bits(state[name])[pos], bits(target[name])[pos])  # the first chunk's writes stayed
    assert not torch.equal(bits(state[name])[pos], bits(base[name])[pos])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.data())
def test_split_pieces_cuts_the_concatenation_at_the_given_positions(lengths, data):
    from patchswarm.protocol.patchencode import _split_pieces

    pieces = [(f"t{i}", 3 * i, 3 * i + n) for i, n in enumerate(lengths)]
    total = sum(lengths)
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=8))) if total > 1 else []
    parts = _split_pieces(pieces, cuts)
    assert len(parts) == len(cuts) + 1 and all(parts)
    flat = [(name, i) for name, s, e in pieces for i in range(s, e)]
    got = [[(name, i) for name, s, e in part for i in range(s, e)] for part in parts]
    assert [x for part in got for x in part] == flat
    assert [len(part) for part in got] == np.diff([0, *cuts, total]).tolist()


def test_a_dense_segment_is_split_by_changes_and_sparse_ones_are_not(real_pair, monkeypatch):
    import patchswarm.protocol.patchencode as patchencode
    from patchswarm.protocol.patchformat import parse_chunk

    def delta_segments(p):
        return [s for c in p.chunks for s in parse_chunk(c)[0] if s.kind == "d"]

    def changes(p):
        return [sum(row[deltacode.M] for row in s.rows) for s in delta_segments(p)]

    def sparse_segments(p):  # comparable form of every segment that does not cover z.dense
        dense_index = [t.name for t in p.tensors].index("z.dense")
        return sorted(repr((s.pieces, s.window, s.rows, s.streams)) for s in delta_segments(p)
                      if all(piece[0] != dense_index for piece in s.pieces))

    base, target = clone(real_pair[0]), clone(real_pair[1])
    rng = np.random.default_rng(5)
    dense = random_bits((256, 256), torch.bfloat16, rng)
    base["z.dense"] = dense
    target["z.dense"] = (bits(dense) ^ torch.from_numpy(rng.integers(1, 4, size=dense.numel(), dtype=np.int16))).view(torch.bfloat16).reshape(dense.shape)
    dense = dense.numel()
    per = 1 << 16  # elements per planned segment: the sparse tensors' segments do not hold z.dense
    sparse_whole = diff(*real_pair, segment_elements=per)
    cap = max(changes(sparse_whole)) + 1
    assert cap < dense // 3  # the scenario: sparse segments below the cap, the dense tensor well above
    monkeypatch.setattr(patchencode, "SEGMENT_CHANGES", cap)
    split = diff(base, target, segment_elements=per)
    assert max(changes(split)) <= cap and len(changes(split)) >= len(changes(sparse_whole)) + 3
    state = clone(base)
    apply(state, split)
    same(state, target)
    # Only the dense tensor's segment was cut: every other segment is as without the cap.
    monkeypatch.undo()
    kept = sparse_segments(split)
    assert kept and kept == sparse_segments(diff(base, target, segment_elements=per))


def test_apply_batches_hold_a_segment_per_thread_and_end_at_an_unparsable_chunk(real_pair):
    from patchswarm.protocol.patchdecode import _parsed_batches
    from patchswarm.protocol.patchformat import parse_chunk

    base, target = _dense_and_sparse_pair(real_pair)
    p = diff(base, target, chunk_bytes=256, segment_elements=512)
    counts = [len(parse_chunk(c)[0]) for c in p.chunks]
    assert len(p.chunks) > 4
    batches = list(_parsed_batches(p.chunks, p.tensors, 1, 3))
    assert sum(len(b) for b in batches) == len(p.chunks)
    at = 0
    for b in batches[:-1]:
        assert sum(counts[at:at + len(b)]) >= 3 and sum(counts[at:at + len(b) - 1]) < 3
        at += len(b)
    broken = list(p.chunks)
    broken[2] = b"not msgpack"
    items = [item for b in _parsed_batches(broken, p.tensors, 1, 1) for item in b]
    assert len(items) == 3 and isinstance(items[-1], CorruptData)


# ---------------------------------------------------------------- the dtypes added after the first release

E8M0 = [torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else []
FNUZ = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
NEW_DTYPES = [torch.float64, torch.uint16, torch.uint32, torch.uint64, *E8M0, *FNUZ, *FP4X2]


def typical(dtype, n: int, rng) -> torch.Tensor:
    """What a checkpoint holds in each: f64 buffers and AMD fp8 weights of weight-like
    magnitudes, MX scales (e8m0 exponents around 2^0), packed fp4 weights (any byte),
    unsigned counters and ids of every size."""
    if dtype is torch.float64:
        return torch.from_numpy(rng.standard_normal(n) * 0.02)
    if dtype in FNUZ:
        return torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02).to(dtype)
    if dtype in FP4X2:
        return torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8)).view(dtype)
    if dtype.itemsize == 1:  # e8m0
        return torch.from_numpy(rng.integers(110, 135, size=n, dtype=np.uint8)).view(dtype)
    width = dtype.itemsize
    top = min(1 << (8 * width), 1 << 62)
    return torch.from_numpy(rng.integers(0, top, size=n, dtype=np.int64).astype(f"u{width}")).view(dtype) if width < 8 \
        else torch.from_numpy(rng.integers(-(1 << 62), 1 << 62, size=n, dtype=np.int64)).view(dtype)


def stepped(t: torch.Tensor, rng, density: float, small: bool) -> torch.Tensor:
    """A copy of `t` with about `density` of its elements changed: by a few units of the
    integer view (an optimizer's ulp steps; a counter's increments) or to random bits."""
    out = t.clone()
    flat = bits(out)
    at = torch.from_numpy(rng.random(flat.numel()) < density)
    if small:
        repl = flat + torch.from_numpy(rng.choice([-3, -1, 1, 2], flat.numel())).to(flat.dtype)
    else:
        repl = bits(random_bits((flat.numel(),), t.dtype, rng))
    flat[at] = repl[at]
    return out


@pytest.mark.parametrize("dtype", NEW_DTYPES, ids=str)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([0, 1, 77, 4096, 20000]),
       density=st.sampled_from([0.0, 0.001, 0.02, 0.5, 1.0]), small=st.booleans(),
       specials=st.sampled_from([0.0, 0.01, 0.3]), compiled=st.booleans(), segment=st.sampled_from([100, 1 << 20]))
def test_each_new_dtype_round_trips_in_patches_and_keyframes(dtype, seed, n, density, small, specials, compiled,
                                                             segment):
    """Per new dtype: base and target with its specials (NaN payloads, -0.0, infinities for
    f64; NaN and the extremes for e8m0 and the fnuz fp8s; -0 and +-6 in either half of an
    fp4 pair; the old sign bit's neighbours for unsigned), small
    and random changes, segments above CLASS_MIN_ELEMENTS (class windows) and below; the
    patch and a keyframe apply bit-exactly, with the compiled kernels and without."""
    rng = np.random.default_rng(seed)
    base = {"x": typical(dtype, n, rng), "y": random_bits((33,), dtype, rng)}
    sprinkle_specials(base["x"], rng, specials)
    target = {"x": stepped(base["x"], rng, density, small), "y": stepped(base["y"], rng, 0.3, small)}
    sprinkle_specials(target["x"], rng, specials / 10)
    kernel = contexts.KERNEL
    try:
        contexts.KERNEL = kernel if compiled else None
        p = Patch.from_bytes(diff(base, target, chunk_bytes=4096, segment_elements=segment).to_bytes())
        state = clone(base)
        apply(state, p)
        same(state, target)
        state = {}
        apply(state, Patch.from_bytes(keyframe(target, chunk_bytes=4096).to_bytes()))
        same(state, target)
    finally:
        contexts.KERNEL = kernel


@pytest.mark.parametrize("dtype", [torch.float64, *E8M0, *FNUZ], ids=str)
def test_fp64_e8m0_and_fnuz_segments_take_class_windows_and_the_numpy_twin_agrees(dtype, monkeypatch):
    """Changes that follow the old value's exponent (small values change, large ones do not,
    as in an optimizer step) make the encoder choose a class window for f64 (its key: the
    exponent's low 8 bits, bit 7 flipped), e8m0 (the byte) and the fnuz fp8s (their exponent
    field, as e4m3's and e5m2's); the patch is the same bytes
    with and without the compiled kernels, and applies bit-exactly either way."""
    rng = np.random.default_rng(5)
    base = {"x": typical(dtype, 1 << 16, rng)}
    flat = bits(base["x"])
    key = contexts.keys_of(flat.numpy(), BY_TORCH[dtype])
    target = clone(base)
    small = torch.from_numpy((key < np.percentile(key, 40)) & (rng.random(flat.numel()) < 0.2))
    bits(target["x"])[small] += 1
    p = diff(base, target)
    windows = [seg.window for c in p.chunks for seg in parse_chunk(c)[0] if seg.kind == "d"]
    assert windows and all(classes > 1 for _lo, classes in windows), windows
    state = clone(base)
    apply(state, p)
    same(state, target)
    monkeypatch.setattr(contexts, "KERNEL", None)
    assert diff(base, target).to_bytes() == p.to_bytes()
    state = clone(base)
    apply(state, p)
    same(state, target)


def test_a_bf16_exponent_plane_costs_about_its_entropy():
    """The keyframe's exponent plane is zstd-coded with a 64-entry match table: the exponents
    of trained weights have no long repeats, and the matches level 1's default table finds
    cost more than the literals they replace (0.680 of raw bf16 instead of 0.664)."""
    from patchswarm.protocol import planes
    from patchswarm.protocol.dtypes import BY_NAME, int_view

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)
    encoded = planes.encode(int_view(w), BY_NAME["bf16"])
    exponent = ((int_view(w).view(np.uint16) >> 7) & 0xFF).astype(np.uint8)
    p = np.bincount(exponent, minlength=256) / exponent.size
    p = p[p > 0]
    entropy_bytes = float(-(p * np.log2(p)).sum()) * exponent.size / 8
    mode, data = encoded[1]  # little-endian: the rotated word's high byte, the exponent, is plane 1
    assert mode == 1 and len(data) < 1.05 * entropy_bytes  # level 1 with its default table: 1.13


class _CountedChunks(Sequence):
    """A patch's chunks that count each read, as a store's read from disk and check one."""

    def __init__(self, chunks):
        self._chunks, self.reads = list(chunks), Counter()

    def __len__(self):
        return len(self._chunks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        chunk = self._chunks[i]  # IndexError past the end: how iteration over a Sequence stops
        self.reads[i] += 1
        return chunk


def test_an_apply_reads_each_chunk_once_and_tells_what_it_touched(real_pair):
    """A node applies from its store's chunks, each read from disk and hashed when reached.
    Summing their lengths for the structure check read every chunk once more, and naming the
    touched tensors for the model directory a third time: with the sizes given (a manifest's)
    each is read once, and `touched` is what `touched_tensors` finds."""
    base, target = real_pair
    removed = sorted(target)[0]
    target = {n: t for n, t in target.items() if n != removed}
    target["zz.added"] = torch.arange(64, dtype=torch.bfloat16)  # a full tensor: the size check
    p = diff(base, target, chunk_bytes=256, segment_elements=4096)
    assert len(p.chunks) > 3 and p.full == ["zz.added"] and p.removed == [removed]
    counted = _CountedChunks(p.chunks)
    lazy = dataclasses.replace(p, chunks=counted, chunk_sizes=[len(c) for c in p.chunks])
    state, touched = clone(base), set()
    apply(state, lazy, touched=touched)
    same(state, target)
    assert dict(counted.reads) == {i: 1 for i in range(len(p.chunks))}
    assert touched == touched_tensors(p) and {"zz.added", removed} <= touched
    assert touched < set(target) | {removed}  # a sparse patch: not every tensor
    kf = keyframe(target, chunk_bytes=4096)
    touched = set()
    apply({}, kf, touched=touched)
    assert touched == touched_tensors(kf) == set(target)
