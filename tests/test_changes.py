"""Change streams (protocol/changes.py): what `apply` records, written into a copy of the base, is the target, bit for bit."""

import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from patchswarm.protocol import changes
from patchswarm.protocol.changes import (MAX_FRAME_BYTES, ChangeEncoder, ChangeStream, Piece, VersionEnd, VersionHeader,
                                         apply_changes, iter_events)
from patchswarm.protocol.dtypes import BY_NAME, info_of
from patchswarm.protocol.errors import BaseMismatch, CorruptData, InvalidInput
from patchswarm.protocol.patch import Patch, apply, diff, keyframe
from patchswarm.protocol.patchformat import TensorSpec
from patchswarm.protocol import statehash
from patchswarm.protocol.statehash import state_hash
from patchswarm.protocol.wire import NEED_DATA

DTYPES = [i.torch_dtype for i in BY_NAME.values()]
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Bit patterns worth seeing in every 1-byte float: ±0, NaN (e4m3fn: 0x7f/0xff), ±inf and NaN (e5m2), ±max, subnormals.
FP8_SPECIAL = [0x00, 0x80, 0x7F, 0xFF, 0x7C, 0xFC, 0x7D, 0xFE, 0x7E, 0x01, 0x81, 0x08]


def random_bits(shape, dtype, rng):
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype is torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=n).astype(np.bool_)).reshape(shape)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, size=n * width, dtype=np.uint8)
    if width == 1 and dtype.is_floating_point and n:
        pick = rng.random(n) < 0.3
        raw[pick] = rng.choice(FP8_SPECIAL, int(pick.sum()))
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def flat_bits(t):
    return t.reshape(-1).view(torch.uint8)


def same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(flat_bits(a[k].contiguous()), flat_bits(b[k].contiguous())), k


def clone(s):
    return {k: v.clone() for k, v in s.items()}


def changed(t, rng, density, dtype):
    t = t.clone()
    if not t.numel():
        return t
    mask = torch.from_numpy(rng.random(t.numel()) < density)
    as_int = SIGNED[info_of(dtype).width]  # torch indexes no uint16/32/64 tensor
    repl = random_bits(tuple(t.shape), dtype, rng).reshape(-1).view(as_int)
    flat = t.reshape(-1).view(as_int)
    flat[mask] = repl[mask]
    return t


@st.composite
def chains(draw):
    """A base and 1..3 versions after it: every dtype, sparse and dense changes, tensors added,
    removed and changed in dtype or shape."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 60), min_size=0, max_size=3)))
        base[f"t{i}"] = random_bits(shape, dtype, rng)
    states = [base]
    for _ in range(draw(st.integers(1, 3))):
        prev = states[-1]
        nxt = {k: changed(v, rng, draw(st.sampled_from([0.0, 0.002, 0.05, 0.5, 1.0])), v.dtype) for k, v in prev.items()}
        if draw(st.booleans()):
            nxt[f"new{len(states)}"] = random_bits((draw(st.integers(0, 40)), 3), draw(st.sampled_from(DTYPES)), rng)
        if draw(st.booleans()) and len(nxt) > 1:
            del nxt[sorted(nxt)[0]]
        if draw(st.booleans()) and nxt:
            name = sorted(nxt)[-1]
            nxt[name] = random_bits((draw(st.integers(0, 30)),), draw(st.sampled_from(DTYPES)), rng)
        states.append(nxt)
    return states


def record(state, patch, base, version, max_frame_bytes=MAX_FRAME_BYTES) -> bytes:
    """Apply `patch` to `state` with a recorder; the version's change stream."""
    out = []
    enc = ChangeEncoder.for_patch(patch, base, version, lambda bufs: out.extend(bytes(b) for b in bufs),
                                  max_frame_bytes=max_frame_bytes)
    enc.header()
    apply(state, patch, recorder=enc)
    enc.end()
    return b"".join(out)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.sampled_from([4096, 1 << 16, MAX_FRAME_BYTES]))
def test_recorded_changes_make_the_base_into_the_target(states, frame_bytes):
    node = clone(states[0])
    stream = b""
    at = (0, state_hash(states[0]))
    for v, target in enumerate(states[1:], 1):
        patch = Patch.from_bytes(diff(states[v - 1], target).to_bytes())
        stream += record(node, patch, at, v, frame_bytes)
        same(node, target)
        at = (v, patch.target_hash)
    follower = clone(states[0])
    last = apply_changes(follower, stream, after=(0, state_hash(states[0])))
    same(follower, states[-1])
    assert (last.target_version, last.target_hash) == at == (len(states) - 1, state_hash(follower))
    for ev in iter_events(stream):
        if isinstance(ev, Piece):
            assert len(ev.bits) * ev.bits.itemsize + (0 if ev.positions is None else ev.positions.nbytes) < frame_bytes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_a_keyframe_over_a_state_replaces_it(states):
    node = clone(states[0])
    kf = keyframe(states[-1])
    stream = record(node, kf, (0, state_hash(states[0])), 7)
    same(node, states[-1])
    follower = clone(states[0])
    apply_changes(follower, stream)
    same(follower, states[-1])


def test_sparse_bf16_costs_six_bytes_per_changed_element():
    rng = np.random.default_rng(1)
    base = {"w": torch.from_numpy(rng.standard_normal(1 << 20).astype(np.float32)).to(torch.bfloat16)}
    target = {"w": base["w"].clone()}
    flat = target["w"].view(torch.int16)
    pos = torch.from_numpy(rng.choice(1 << 20, 10_000, replace=False))
    flat[pos] += 1
    stream = record(clone(base), diff(base, target), (0, state_hash(base)), 1)
    assert 10_000 * 6 < len(stream) < 10_000 * 6 + 600


def test_positions_are_int64_only_for_tensors_of_2_31_elements_or_more():
    assert changes.position_dtype((1 << 31) - 1) is np.int32 and changes.position_dtype(1 << 31) is np.int64


def test_frames_split_and_each_piece_writes_in_place_on_its_tensor():
    base = {"a": torch.zeros(10_000, dtype=torch.float32)}
    held = base["a"]
    out = []
    enc = ChangeEncoder(VersionHeader(0, "h0", 1, "h1"), [TensorSpec("a", "fp32", (10_000,))],
                        lambda b: out.extend(bytes(x) for x in b), max_frame_bytes=4096)
    enc.header()
    pos = np.arange(0, 10_000, 2, dtype=np.int64)
    enc("a", pos, np.full(len(pos), 0x3F800000, dtype=np.int32))  # 1.0
    enc.end()
    stream = b"".join(out)
    pieces = [e for e in iter_events(stream) if isinstance(e, Piece)]
    assert len(pieces) > 5 and all(p.positions.dtype == np.int32 for p in pieces)
    apply_changes(base, stream)
    assert base["a"] is held and held[::2].eq(1).all() and held[1::2].eq(0).all()


def _one_version():
    return b"".join(bytes(b) for f in _frames() for b in f)


def _frames():
    out = []
    enc = ChangeEncoder(VersionHeader(3, "h3", 4, "h4"), [TensorSpec("a", "bf16", (100,)), TensorSpec("b", "u8", (5,))],
                        out.append, full=["b"])
    enc.header()
    enc("a", np.array([1, 5, 99]), np.array([1, 2, 3], dtype=np.int16))
    enc("b", slice(0, 5), np.arange(5, dtype=np.uint8))
    enc.end()
    return out


def test_stream_checks_order_chain_and_counts():
    data = _one_version()
    evs = iter_events(data, after=(3, "h3"))
    assert isinstance(evs[0], VersionHeader) and isinstance(evs[-1], VersionEnd)
    with pytest.raises(BaseMismatch):
        iter_events(data, after=(3, "other"))
    with pytest.raises(BaseMismatch):
        iter_events(data + data)  # the second version's base is 3, not 4
    for cut in (1, 5, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptData):
            iter_events(data[:cut])
    frames = [b"".join(bytes(x) for x in f) for f in _frames()]
    with pytest.raises(CorruptData):  # a piece dropped: the end's counts differ
        iter_events(b"".join(frames[:2] + frames[3:]))
    with pytest.raises(CorruptData):  # no header
        iter_events(b"".join(frames[1:]))


def test_a_frame_longer_than_the_limit_is_refused_before_it_is_buffered():
    s = ChangeStream()
    s.receive_data((MAX_FRAME_BYTES + 1).to_bytes(4, "little") + bytes(4))
    with pytest.raises(CorruptData):
        s.next_event()
    s = ChangeStream()
    s.receive_data(_one_version()[:10])
    assert s.next_event() is NEED_DATA


def test_a_piece_or_end_whose_meta_is_over_its_limit_is_refused_before_it_is_unpacked():
    import struct
    import zlib

    import msgpack

    from patchswarm.protocol.changes import MAX_META_BYTES, decode_frame

    def body(kind: bytes, meta) -> bytes:
        packed = msgpack.packb(meta)
        return struct.pack("<cI", kind, len(packed)) + packed

    long_name = "x" * (MAX_META_BYTES - 100)  # packs to just under the limit, then over it with more
    for kind, meta in [(b"P", [long_name, "u8", [4], 0, 1]), (b"E", {"pieces": 0, "elements": 0, "pad": long_name})]:
        fits = body(kind, meta)
        over = body(kind, meta[:0] + [long_name + "y" * 200, "u8", [4], 0, 1] if kind == b"P" else
                    {**meta, "pad": long_name + "y" * 200})
        assert len(fits) - 5 <= MAX_META_BYTES < len(over) - 5
        with pytest.raises(CorruptData, match=f"at most {MAX_META_BYTES} in a"):
            decode_frame(over, zlib.crc32(over))
        try:
            decode_frame(fits, zlib.crc32(fits))
        except CorruptData as e:  # refused for what is in it (a name too long), not for its size
            assert f"at most {MAX_META_BYTES} in a" not in str(e)
    header = body(b"S", {"removed": [], "full": [[f"t{i:06d}", "u8", [1]] for i in range(8000)]})
    assert len(header) - 5 > MAX_META_BYTES  # a structure frame of a model with many tensors is not bounded by it
    assert decode_frame(header, zlib.crc32(header)).full[-1].name == "t007999"


def test_changes_that_do_not_fit_the_tensors_are_refused():
    with pytest.raises(BaseMismatch):
        apply_changes({"a": torch.zeros(100, dtype=torch.float16), "b": torch.zeros(5, dtype=torch.uint8)},
                      _one_version())


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decoder_raises_only_its_own_errors(data):
    """Damage with a matching CRC (so the parser, not the checksum, meets it); then any damage."""
    frames = [b"".join(bytes(x) for x in f) for f in _frames()]
    i = data.draw(st.integers(0, len(frames) - 1))
    body = bytearray(frames[i][changes.PREFIX_BYTES:])
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    try:
        ev = changes.decode_frame(bytes(body), zlib.crc32(body))
    except InvalidInput:
        ev = None
    if isinstance(ev, Piece) and ev.positions is not None:  # what decodes is within its tensor
        assert 0 <= ev.positions.min() and ev.positions.max() < np.prod(ev.shape)
    stream = bytearray(b"".join(frames))
    stream[data.draw(st.integers(0, len(stream) - 1))] ^= data.draw(st.integers(1, 255))
    with pytest.raises(InvalidInput):
        iter_events(bytes(stream))


def test_positions_whose_difference_wraps_int32_are_refused():
    """A damaged piece whose positions are [100, -2147483549]: their np.diff wraps to a positive int32,
    so a check by differences let it pass (found by the fuzz test above); compared pairwise it is refused."""
    numel = 1 << 20
    positions = np.array([100, -2147483549], dtype=np.int32)
    payload = memoryview(positions.tobytes() + np.zeros(2, dtype=np.uint16).tobytes())
    with pytest.raises(InvalidInput, match="piece positions"):
        changes._piece(["w", "bf16", [numel], None, 2], payload)


@pytest.mark.parametrize("v", [changes.FORMAT_VERSION, changes.FORMAT_VERSION - 1, changes.FORMAT_VERSION + 1, None, "1"])
def test_a_header_of_another_format_version_is_refused(v):
    """Older versions too: a reader knows one format, not a range below it."""
    from patchswarm.protocol.errors import UnsupportedFormat

    meta = {"base_version": None, "base_hash": None, "target_version": 1, "target_hash": "h1", "keyframe": True}
    if v is not None:
        meta["v"] = v
    data = b"".join(bytes(x) for x in changes._frame(b"H", meta))
    _, crc = changes.frame_prefix(data[:changes.PREFIX_BYTES])
    if v == changes.FORMAT_VERSION:
        assert changes.decode_frame(data[changes.PREFIX_BYTES:], crc) == VersionHeader(None, None, 1, "h1", True)
    else:
        with pytest.raises(UnsupportedFormat, match=f"expected format version {changes.FORMAT_VERSION}, found {v!r}$"):
            changes.decode_frame(data[changes.PREFIX_BYTES:], crc)


@pytest.mark.parametrize("shape", [(10_000,), (100, 100)])
@pytest.mark.parametrize("as_range", [True, False])
def test_pieces_fill_their_frames_and_a_split_range_writes_every_element(shape, as_range):
    """Every piece but the last carries at least 3/4 of max_frame_bytes of bits (the meta's room
    is kept small whatever the shape), and a range split over pieces has each piece's count."""
    numel = int(np.prod(shape))
    base = {"a": torch.zeros(shape, dtype=torch.float32)}
    out = []
    enc = ChangeEncoder(VersionHeader(0, "h0", 1, "h1"), [TensorSpec("a", "fp32", shape)],
                        lambda b: out.extend(bytes(x) for x in b), max_frame_bytes=4096)
    enc.header()
    bits = np.arange(numel, dtype=np.int32) + 0x3F800000  # 1.0 and the floats just above it
    enc("a", slice(0, numel) if as_range else np.arange(numel, dtype=np.int64), bits)
    enc.end()
    stream = b"".join(out)
    pieces = [e for e in iter_events(stream) if isinstance(e, Piece)]
    per = 4 if as_range else 8  # bits, or a position and bits
    assert all(len(p.bits) * per >= 3 * 4096 // 4 for p in pieces[:-1]), [len(p.bits) for p in pieces]
    assert sum(len(p.bits) for p in pieces) == numel
    apply_changes(base, stream)
    assert np.array_equal(base["a"].view(torch.int32).numpy().reshape(-1), bits)


def test_a_piece_for_a_tensor_missing_or_of_another_shape_names_what_the_tensors_have():
    from patchswarm.protocol.changes import write_piece

    p = Piece("a", "bf16", (4,), 0, None, np.zeros(4, dtype=np.int16))
    with pytest.raises(BaseMismatch, match=r"tensor 'a': the changes expect bf16\[4\], the tensors have none$"):
        write_piece({}, p)
    with pytest.raises(BaseMismatch, match=r"the changes expect bf16\[4\], the tensors have bf16\[2, 2\]$"):
        write_piece({"a": torch.zeros(2, 2, dtype=torch.bfloat16)}, p)


@pytest.mark.parametrize("positions", [[5, 10], [-1, 3], [-1, 10], [3, 3]])
def test_piece_positions_outside_the_tensor_or_not_ascending_are_refused(positions):
    """Either end out of range alone is enough (a position past the end would reach index_copy_)."""
    body = b"".join(bytes(x) for x in changes._frame(b"P", ["a", "fp32", [10], None, 2],
                                                     np.array(positions, dtype=np.int32), np.zeros(2, dtype=np.int32)))
    _, crc = changes.frame_prefix(body[:changes.PREFIX_BYTES])
    with pytest.raises(CorruptData, match=r"piece positions: expected ascending in \[0, 10\)"):
        changes.decode_frame(body[changes.PREFIX_BYTES:], crc)


def test_structure_lists_fill_their_frames():
    """A keyframe of many tensors declares them in S frames of up to max_frame_bytes, each but
    the last at least 3/4 full, not a frame per tensor."""
    specs = [TensorSpec(f"layer.{i}.weight", "bf16", (64, 64)) for i in range(300)]
    out = []
    enc = ChangeEncoder(VersionHeader(None, None, 1, "h1", keyframe=True), specs, out.append,
                        full=[s.name for s in specs], max_frame_bytes=4096)
    enc.header()
    frames = [b"".join(bytes(x) for x in f) for f in out[1:]]
    assert all(f[changes.PREFIX_BYTES:changes.PREFIX_BYTES + 1] == b"S" for f in frames)
    assert all(len(f) >= 3 * 4096 // 4 for f in frames[:-1]), [len(f) for f in frames]
    declared = [s for f in frames for s in changes.decode_frame(f[changes.PREFIX_BYTES:],
                                                                 changes.frame_prefix(f[:changes.PREFIX_BYTES])[1]).full]
    assert declared == specs


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_host(s):
    return {k: v.cpu() for k, v in s.items()}


@NEEDS_CUDA
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_changes_written_into_gpu_tensors_give_the_same_bits_as_on_the_host(states):
    """Every dtype (fp8 and bool included), tensors added, removed and reshaped: `apply_changes`
    into tensors in GPU memory leaves them bit for bit the target, in place where it can."""
    node = clone(states[0])
    stream = b""
    at = (0, state_hash(states[0]))
    for v, target in enumerate(states[1:], 1):
        patch = diff(states[v - 1], target)
        stream += record(node, patch, at, v)
        at = (v, patch.target_hash)
    follower = {k: t.to("cuda") for k, t in states[0].items()}
    kept = {k for k in follower if all(k in s and s[k].dtype == follower[k].dtype and s[k].shape == follower[k].shape
                                       for s in states)}
    ptrs = {k: follower[k].data_ptr() for k in kept}
    last = apply_changes(follower, stream, after=(0, state_hash(states[0])))
    torch.cuda.synchronize()
    assert all(t.device.type == "cuda" for t in follower.values())
    same(on_host(follower), states[-1])
    assert (last.target_version, last.target_hash) == at
    assert statehash.state_hash_any_device(follower) == at[1]
    assert all(follower[k].data_ptr() == ptrs[k] for k in kept)


@settings(max_examples=40, deadline=None)
@given(chains())
def test_the_state_hash_tensor_by_tensor_is_the_state_hash(states):
    """What `state_hash_any_device` computes for device tensors (each copied to host in turn)."""
    for s in states:
        assert statehash._state_hash_by_tensor(s) == state_hash(s) == statehash.state_hash_any_device(s)


NEW_DTYPES = [torch.float64, torch.uint16, torch.uint32, torch.uint64,
              *([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else []),
              torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
              *([torch.float4_e2m1fn_x2] if hasattr(torch, "float4_e2m1fn_x2") else [])]
# Per new dtype, patterns to see on the way (unsigned, as bits): f64's infinities, NaNs with
# payloads and -0.0; e8m0's NaN and extremes; the unsigned types' old sign bit and extremes.
NEW_SPECIALS = {
    torch.float64: [0x7FF0000000000000, 0xFFF0000000000000, 0x7FF800000000BEEF, 0xFFF0000000000001,
                    0x8000000000000000, 0x0000000000000001],
    torch.uint16: [0, 0xFFFF, 0x8000, 0x7FFF],
    torch.uint32: [0, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF],
    torch.uint64: [0, (1 << 64) - 1, 1 << 63, (1 << 63) - 1],
    getattr(torch, "float8_e8m0fnu", None): [0xFF, 0x00, 0x7F, 0xFE],
    torch.float8_e4m3fnuz: [0x80, 0x7F, 0xFF, 0x01],  # the one NaN, +-max, the smallest
    torch.float8_e5m2fnuz: [0x80, 0x7F, 0xFF, 0x01],
    getattr(torch, "float4_e2m1fn_x2", None): [0x88, 0x77, 0xFF, 0x00],  # -0 and +-6 in both halves
}


def with_specials(t: torch.Tensor, rng, share: float) -> torch.Tensor:
    t = t.clone()
    width = t.element_size()
    flat = t.reshape(-1).view(SIGNED[width])
    sp = torch.tensor([v - (1 << 8 * width) if v >> (8 * width - 1) else v for v in NEW_SPECIALS[t.dtype]],
                      dtype=SIGNED[width])
    at = torch.from_numpy(rng.random(flat.numel()) < share)
    flat[at] = sp[torch.from_numpy(rng.integers(0, len(sp), int(at.sum())))]
    return t


@pytest.mark.parametrize("dtype", NEW_DTYPES, ids=str)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([1, 50, 5000]),
       densities=st.lists(st.sampled_from([0.0, 0.002, 0.1, 1.0]), min_size=2, max_size=2),
       frame_bytes=st.sampled_from([4096, MAX_FRAME_BYTES]))
def test_each_new_dtype_follows_two_versions_by_changes_and_a_keyframe(dtype, seed, n, densities, frame_bytes):
    """The change stream per new dtype: two versions recorded while the node applies them
    (sparse pieces by position, dense ones as ranges, a tensor new in the second version
    allocated whole), written into a copy of the base by `apply_changes`, bit-exactly and
    with the state hash of the target; a keyframe over a state replaces it."""
    rng = np.random.default_rng(seed)
    states = [{"x": with_specials(random_bits((n,), dtype, rng), rng, 0.1), "y": random_bits((3, 4), dtype, rng)}]
    for v, density in enumerate(densities, 1):
        nxt = {k: with_specials(changed(t, rng, density, dtype), rng, density / 4) for k, t in states[-1].items()}
        if v == 2:
            nxt["z"] = random_bits((n, 2), dtype, rng)
        states.append(nxt)
    node, stream, at = clone(states[0]), b"", (0, state_hash(states[0]))
    for v in (1, 2):
        patch = Patch.from_bytes(diff(states[v - 1], states[v]).to_bytes())
        stream += record(node, patch, at, v, frame_bytes)
        at = (v, patch.target_hash)
    follower = clone(states[0])
    last = apply_changes(follower, stream, after=(0, state_hash(states[0])))
    same(follower, states[2])
    assert (last.target_version, last.target_hash) == at == (2, state_hash(follower))
    follower = clone(states[0])
    apply_changes(follower, record(clone(states[0]), keyframe(states[2]), (0, state_hash(states[0])), 9))
    same(follower, states[2])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_a_cache_of_views_kept_across_applies_changes_nothing_and_holds_only_the_state(states):
    """`apply(..., views=)` as the node calls it, one cache for every version of one state:
    every version comes out bit for bit, and after each apply the cache holds views of the
    state's own tensors only (none of a tensor removed, replaced or reshaped)."""
    state, views = clone(states[0]), {}
    for v, target in enumerate(states[1:], 1):
        apply(state, diff(states[v - 1], target), undo=False, views=views)
        same(state, target)
        assert set(views) <= set(state) and all(views[n][0] is state[n] for n in views)


def test_a_version_that_replaces_every_tensor_keeps_them_on_the_followers_device():
    """A version that removes every tensor the follower holds, then adds others: the new ones go
    where the old ones were (an engine's GPU), not to host memory once the dict is empty for a
    moment. The meta device stands in for a GPU: `apply_changes` writes into it the same way."""
    base = {"a": torch.arange(6, dtype=torch.float32).to(torch.bfloat16)}
    target = {"b": torch.arange(5, dtype=torch.int32), "c": torch.ones(3, dtype=torch.float64)}
    patch = diff(base, target)
    stream = record(clone(base), patch, (0, state_hash(base)), 1)
    follower = {k: t.to("meta") for k, t in base.items()}
    last = apply_changes(follower, stream, after=(0, state_hash(base)))
    assert last.target_hash == patch.target_hash and sorted(follower) == ["b", "c"]
    assert {k: t.device.type for k, t in follower.items()} == {"b": "meta", "c": "meta"}
