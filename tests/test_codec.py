"""Patch codec: bit-exact round trips, order independence, rejection of bad input."""

import random

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from protocol import rans, ricecode
from protocol.errors import AlreadyApplied, BaseMismatch, CorruptData, PatchswarmError, StateHashMismatch
from protocol.patch import Patch, apply, decode_chunk, diff, keyframe, prepare
from protocol.statehash import state_hash

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def bits(t):
    return t.reshape(-1).view(INT_OF[t.element_size()])


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
    raw = torch.from_numpy(rng.integers(0, 256, size=n * width, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


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
                 if dtype.is_floating_point else t)
        base[f"t{i}"] = t
        density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
        tt = t.clone()
        flat = bits(tt)
        mask = torch.from_numpy(rng.random(flat.numel()) < density)
        repl = bits(random_bits(tuple(flat.shape), dtype, rng))
        if draw(st.booleans()):  # small deltas as from an optimizer step
            repl = flat + torch.from_numpy(rng.choice([-2, -1, 1, 2], flat.numel())).to(flat.dtype)
        flat[mask] = repl[mask]
        target[f"t{i}"] = tt
    if draw(st.booleans()):  # an added tensor
        target["new"] = random_bits((5, 3), draw(st.sampled_from(DTYPES)), rng)
    if draw(st.booleans()) and len(base) > 1:  # a removed tensor
        del target["t0"]
    if draw(st.booleans()) and "t1" in target:  # a dtype/shape change
        target["t1"] = random_bits((7,), draw(st.sampled_from(DTYPES)), rng)
    return base, target


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_round_trip_is_bit_exact(pair):
    base, target = pair
    p = Patch.from_bytes(diff(base, target).to_bytes())
    state = clone(base)
    apply(state, p)
    same(state, target)
    assert p.base_hash == state_hash(base) and p.target_hash == state_hash(target)


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
    from node.synthetic import served_pairs

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
    streams = ricecode.encode(v, k)
    assert np.array_equal(ricecode.decode(*streams, len(values), k), v)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.binary(max_size=64), st.binary(max_size=24), st.integers(0, 50), st.integers(0, 45))
def test_rice_decoder_never_crashes(unary, rem, esc, count, k):
    try:
        ricecode.decode(unary, rem, esc, count, k)
    except CorruptData:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_container_parser_raises_only_its_own_errors(data):
    try:
        Patch.from_bytes(data)
    except PatchswarmError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1) | st.integers(0, 40), st.integers(0, 5)), max_size=2000))
def test_rans_round_trip(pairs):
    v = np.array([p[0] for p in pairs], dtype=np.uint64)
    ctx = np.array([p[1] for p in pairs], dtype=np.int64)
    data, low = rans.encode(v, ctx)
    assert np.array_equal(rans.decode(data, low, len(pairs), ctx), v)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=16), st.integers(0, 300))
def test_rans_decoder_never_crashes(data, low, count):
    try:
        rans.decode(data, low, count)
    except CorruptData:
        pass


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
