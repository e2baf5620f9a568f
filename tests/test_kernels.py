"""protocol/_kernels.c against protocol/contexts.py's numpy ClassIndex: the same ranks, positions and sizes.

The compiled module is optional (setup.py); these tests skip, saying why, where it
did not build, and the codec tests then run on the numpy version alone.
"""

import contextlib

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from patchswarm.protocol import contexts
from patchswarm.protocol.dtypes import info_of
from patchswarm.protocol.patch import apply, diff

pytestmark = pytest.mark.skipif(contexts.KERNEL is None, reason="protocol._kernels did not build (no C compiler?)")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _pieces(dtype, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        t = (torch.randn(n, generator=gen) * torch.rand(1, generator=gen) * 0.1).to(dtype)
        out.append(t.view(info_of(dtype).int_dtype).numpy())
    return out


def _numpy(monkeypatch):
    monkeypatch.setattr(contexts, "KERNEL", None)


BOOKKEEPING = ["avx2", "scalar"]  # select and rank with their AVX2 class bookkeeping, then with the scalar one


@contextlib.contextmanager
def _bookkeeping(which):
    k = contexts.KERNEL
    if not k.use_avx2(which == "avx2") and which == "avx2":
        pytest.skip("this CPU (or build) has no AVX2 passes")
    try:
        yield
    finally:
        k.use_avx2(True)


@pytest.mark.parametrize("bookkeeping", BOOKKEEPING)
@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=5),
       classes=st.sampled_from([1, 2, 4, 8]), lo_shift=st.integers(-6, 6), density=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_select_and_rank_match_the_numpy_index(bookkeeping, dtype, sizes, classes, lo_shift, density, seed):
    with _bookkeeping(bookkeeping):
        _select_and_rank_match(dtype, sizes, classes, lo_shift, density, seed)


def _select_and_rank_match(dtype, sizes, classes, lo_shift, density, seed):
    info = info_of(dtype)
    pieces = _pieces(dtype, sizes, seed)
    flat = np.concatenate(pieces)
    keys = contexts.keys_of(flat, info)
    lo = int(np.clip((int(np.median(keys)) if keys.size else 0) + lo_shift, 0, 255))
    ids = contexts.class_of_keys(keys, lo, classes)
    rng = np.random.default_rng(seed)
    picks = [np.flatnonzero(rng.random(int((ids == c).sum())) < density) for c in range(classes)]
    ranks, counts = (np.concatenate(picks).astype(np.int64), [p.size for p in picks])
    want = np.concatenate([np.flatnonzero(ids == c)[picks[c]] for c in range(classes)]).astype(np.int64)
    sizes_want = [int((ids == c).sum()) for c in range(classes)]

    found, got_sizes = contexts.select_positions(pieces, info, lo, classes, ranks, counts)
    assert np.array_equal(found.pos, np.sort(want))  # ascending,
    assert np.array_equal(want[found.order], found.pos)  # each named by its rank,
    assert np.array_equal(found.old, flat[found.pos])  # with the base's bits
    assert found.old.dtype == flat.dtype
    assert got_sizes == sizes_want
    idx = np.sort(want)
    in_class, got_sizes = contexts.rank_positions(pieces, info, lo, classes, idx, ids[idx])
    assert got_sizes == sizes_want
    members = [np.flatnonzero(ids == c) for c in range(classes)]
    assert np.array_equal(in_class, [np.searchsorted(members[ids[p]], p) for p in idx.tolist()])
    if classes > 1 and want.size:  # the numpy index answers the same where it has ranks
        ci = contexts.ClassIndex(pieces, info, lo, classes)
        assert np.array_equal(ci.select_runs(ranks, counts), want)


@pytest.mark.parametrize("bookkeeping", BOOKKEEPING)
@pytest.mark.parametrize("classes", [1, 2, 4, 8])
def test_ranks_that_do_not_fit_are_reported_not_written(bookkeeping, classes):
    with _bookkeeping(bookkeeping):
        _ranks_that_do_not_fit(classes)


def _ranks_that_do_not_fit(classes):
    info = info_of(torch.bfloat16)
    pieces = _pieces(torch.bfloat16, [700, 5, 300], 1)
    keys = contexts.keys_of(np.concatenate(pieces), info)
    lo = int(np.median(keys))
    sizes = np.bincount(contexts.class_of_keys(keys, lo, classes), minlength=classes)
    c = int(np.argmax(sizes))
    counts = [0] * classes
    counts[c] = 2
    for bad in ([3, 3], [5, 4], [0, int(sizes[c])]):  # repeated, descending, beyond the class
        found, got = contexts.select_positions(pieces, info, lo, classes, np.array(bad, dtype=np.int64), counts)
        assert found is None and got[c] == sizes[c]
    with pytest.raises(ValueError, match="ascending"):
        contexts.rank_positions(pieces, info, lo, classes, np.array([4, 2]), np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="ascending"):
        contexts.rank_positions(pieces, info, lo, classes, np.array([1005]), np.zeros(1, dtype=np.int64))


def test_argument_errors_are_clear():
    k = contexts.KERNEL
    x = np.zeros(10, dtype=np.uint16)
    empty, sizes = np.empty(0, dtype=np.int64), np.empty(8, dtype=np.int64)
    out = (empty, empty, np.empty(0, np.uint8))
    with pytest.raises(ValueError, match="width"):
        k.select([x], 3, 7, 255, 0, 8, np.empty(0, np.int64), np.zeros(8, np.int64), *out, sizes)
    with pytest.raises(ValueError, match="classes"):
        k.select([x], 2, 7, 255, 0, 3, np.empty(0, np.int64), np.zeros(3, np.int64), *out, sizes)
    with pytest.raises(ValueError, match="multiple of 2"):
        k.select([np.zeros(3, np.uint8)], 2, 7, 255, 0, 8, np.empty(0, np.int64), np.zeros(8, np.int64), *out, sizes)
    many = [np.zeros(4, np.uint16) for _ in range(70)] + [np.zeros(3, np.uint8)]  # past the on-stack piece table
    with pytest.raises(ValueError, match="piece 70: expected a multiple of 2 bytes, found 3"):
        k.select(many, 2, 7, 255, 0, 8, np.empty(0, np.int64), np.zeros(8, np.int64), *out, sizes)
    assert k.select(many[:70], 2, 7, 255, 0, 8, np.empty(0, np.int64), np.zeros(8, np.int64), *out, sizes)
    assert sizes[0] == 280
    with pytest.raises(TypeError, match="read-write"):
        ro = np.empty(8, dtype=np.int64)
        ro.flags.writeable = False
        k.select([x], 2, 7, 255, 0, 8, np.empty(0, np.int64), np.zeros(8, np.int64), *out, ro)


@pytest.mark.parametrize("lr", [1e-5, 1e-2])
def test_patches_are_the_same_bytes_with_and_without_the_kernel(lr, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    base = {f"w{i}": (torch.randn(n, generator=gen) * 0.02).bfloat16() for i, n in enumerate((40_000, 9_000, 130))}
    target = {k: (v.float() - lr * torch.randn(v.shape, generator=gen).sign()).bfloat16() for k, v in base.items()}
    compiled = diff(base, target).to_bytes()
    _numpy(monkeypatch)
    assert diff(base, target).to_bytes() == compiled
    from patchswarm.protocol.patch import Patch

    state = {k: v.clone() for k, v in base.items()}
    apply(state, Patch.from_bytes(compiled))
    assert all(torch.equal(state[k].view(torch.int16), target[k].view(torch.int16)) for k in target)


# --- Rice blobs and raw bit fields: the compiled decoders against ricecode's numpy ones -------------

from patchswarm.protocol import ricecode  # noqa: E402
from patchswarm.protocol.errors import CorruptData  # noqa: E402


def _both(fn_name, *args):
    """(result or the CorruptData message) of the compiled and of the numpy decoder."""
    out = []
    for fn in (getattr(ricecode, fn_name), getattr(ricecode, f"_{fn_name}_numpy")):
        try:
            out.append(fn(*args).tolist())
        except CorruptData as e:
            out.append(("CorruptData", str(e)))
    return out


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 300), min_size=1, max_size=200),
       k=st.integers(0, 40), per_value=st.booleans(), data=st.data())
def test_rice_unpack_matches_numpy_on_good_and_damaged_blobs(values, k, per_value, data):
    v = np.array(values, dtype=np.uint64)
    ks = np.array(data.draw(st.lists(st.integers(0, 40), min_size=v.size, max_size=v.size)), dtype=np.int64) \
        if per_value else k
    blob = bytearray(ricecode.pack(v, ks))
    compiled, numpy_ = _both("unpack", bytes(blob), v.size, ks)
    assert compiled == numpy_ == v.tolist()
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "count"]))
    count = v.size
    if how == "flip" and blob:
        blob[data.draw(st.integers(0, len(blob) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    elif how == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=9))
    elif not per_value:
        count = data.draw(st.integers(1, v.size + 3))
    compiled, numpy_ = _both("unpack", bytes(blob), count, ks)
    # The same values, or a rejection by both (messages may name the first problem differently).
    assert compiled == numpy_ or (isinstance(compiled, tuple) and isinstance(numpy_, tuple)), (compiled, numpy_)


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), min_size=1, max_size=8), data=st.data())
def test_rice_unpack_takes_parameters_in_runs(runs, data):
    ks = [k for k, _ in runs]
    counts = [n for _, n in runs]
    per_value = np.repeat(np.array(ks, dtype=np.int64), counts)
    count = int(per_value.size)
    v = np.array(data.draw(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 300), min_size=count, max_size=count)),
                 dtype=np.uint64)
    blob = bytearray(ricecode.pack(v, per_value)) if count else bytearray()
    if data.draw(st.booleans()) and blob:
        blob[data.draw(st.integers(0, len(blob) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    got = []
    for k in (ricecode.KRuns(counts, ks), per_value):
        try:
            got.append(ricecode.unpack(bytes(blob), count, k).tolist())
        except CorruptData:
            got.append("CorruptData")
    assert got[0] == got[1]


def test_rice_unpack_rejects_runs_that_do_not_add_up():
    blob = ricecode.pack(np.arange(5, dtype=np.uint64), 2)
    for counts, ks in (([2, 2], [2, 2]), ([3, 3], [2, 2]), ([6, -1], [2, 2]), ([5], [41])):
        with pytest.raises(CorruptData, match="rice parameter"):
            ricecode.unpack(blob, 5, ricecode.KRuns(counts, ks))


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 64)), min_size=1, max_size=200),
       scalar=st.booleans(), tamper=st.sampled_from([None, "pad", "cut", "extend"]))
def test_unpack_bits_matches_numpy(pairs, scalar, tamper):
    v = np.array([p[0] for p in pairs], dtype=np.uint64)
    w = pairs[0][1] if scalar else np.array([p[1] for p in pairs], dtype=np.int64)
    data = bytearray(ricecode.pack_bits(v, w))
    if tamper == "pad" and data:
        data[-1] |= 0x80
    elif tamper == "cut" and data:
        data = data[:-1]
    elif tamper == "extend":
        data += b"\x00"
    compiled, numpy_ = _both("unpack_bits", bytes(data), w, v.size)
    assert compiled == numpy_ or (isinstance(compiled, tuple) and isinstance(numpy_, tuple)), (compiled, numpy_)
    if tamper is None:
        masks = [(1 << (w if scalar else n)) - 1 for _, n in pairs]
        assert compiled == [x & m for (x, _), m in zip(pairs, masks)]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(1, 50), st.integers(0, 45))
def test_rice_decoders_reject_the_same_random_bytes(blob, count, k):
    compiled, numpy_ = _both("unpack", blob, count, k)
    assert compiled == numpy_ or (isinstance(compiled, tuple) and isinstance(numpy_, tuple)), (compiled, numpy_)


# --- a delta segment's values: the compiled pass against deltacode's numpy path --------------------

from patchswarm.protocol import deltacode  # noqa: E402
from tests.test_codec import class_changes  # noqa: E402


def _deltas_both(rows, streams):
    out, kernel = [], ricecode.KERNEL
    for k in (kernel, None):
        ricecode.KERNEL = k
        try:
            out.append(deltacode.decode_deltas(rows, streams).tolist())
        except CorruptData:
            out.append("CorruptData")
        finally:
            ricecode.KERNEL = kernel
    return out


@settings(max_examples=300, deadline=None)
@given(changes=class_changes(), data=st.data())
def test_values_match_numpy_on_good_and_damaged_codes(changes, data):
    rows, streams = deltacode.encode(*changes)
    compiled, numpy_ = _deltas_both(rows, streams)
    assert compiled == numpy_ == np.concatenate(changes[2]).tolist()
    streams = [bytearray(s) for s in streams]
    i = data.draw(st.sampled_from([2, 3, 4, 5]))  # signs, bigs, ranks, raw bits: what the pass reads
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "row"]))
    if how == "flip" and streams[i]:
        streams[i][data.draw(st.integers(0, len(streams[i]) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut" and streams[i]:
        streams[i] = streams[i][: data.draw(st.integers(0, len(streams[i]) - 1))]
    elif how == "extend":
        streams[i] += data.draw(st.binary(min_size=1, max_size=9))
    elif how == "row":
        live = [r for r in rows if len(r) > 1]
        if live:
            row = data.draw(st.sampled_from(live))
            col = data.draw(st.sampled_from([deltacode.VMODE, deltacode.BIGS, deltacode.RANK_K, deltacode.TABLE]))
            row[col] = data.draw(st.binary(max_size=4)) if col == deltacode.TABLE else data.draw(st.integers(0, 70))
    try:
        rows = deltacode.check_rows(rows, len(rows))
    except CorruptData:
        return
    compiled, numpy_ = _deltas_both(rows, [bytes(s) for s in streams])
    # The same deltas, or a rejection by both (the messages may name the first problem differently).
    assert compiled == numpy_, (compiled[:8] if compiled != "CorruptData" else compiled, numpy_[:8] if numpy_ != "CorruptData" else numpy_)


@settings(max_examples=200, deadline=None)
@given(changes=class_changes())
def test_delta_codes_are_the_same_bytes_with_and_without_the_kernel(changes):
    kernel = ricecode.KERNEL
    try:
        compiled = deltacode.encode(*changes)
        ricecode.KERNEL = None
        numpy_ = deltacode.encode(*changes)
    finally:
        ricecode.KERNEL = kernel
    assert compiled == numpy_


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["bf16", "fp16", "fp32", "f8e4m3", "f8e5m2", "i8", "u8", "i16", "i32", "bool"]),
       n=st.integers(0, 300), ordered=st.booleans(), spread=st.sampled_from([1, 300, 2**40]), seed=st.integers(0, 2**16))
def test_new_values_match_numpy_in_range_and_out(name, n, ordered, spread, seed):
    from patchswarm.protocol import patchdecode
    from patchswarm.protocol.dtypes import info_named

    info = info_named(name)
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, n * info.width, dtype=np.uint8).view(info.np_int)
    if name == "bool":
        old = old & 1
    d = rng.integers(-spread, spread + 1, n).astype(np.int64)
    order = rng.permutation(n).astype(np.int64) if ordered else None
    got = []
    for kernel in (contexts.KERNEL, None):
        saved, contexts.KERNEL = contexts.KERNEL, kernel
        try:
            got.append([x.tolist() for x in patchdecode._new_values(old, order, d, info)])
        except CorruptData:
            got.append("CorruptData")
        finally:
            contexts.KERNEL = saved
    assert got[0] == got[1]


# --- the encoder's kernels: the compare and the Rice and bit-field writers against numpy ------------

@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 64)), max_size=200), scalar=st.booleans())
def test_pack_bits_writes_the_numpy_bytes(pairs, scalar):
    v = np.array([p[0] for p in pairs], dtype=np.uint64)
    w = (pairs[0][1] if pairs else 7) if scalar else np.array([p[1] for p in pairs], dtype=np.int64)
    assert ricecode.pack_bits(v, w) == ricecode._pack_bits_numpy(v, w)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 300), max_size=200),
       k=st.integers(0, 40), per_value=st.booleans(), data=st.data())
def test_rice_pack_writes_the_numpy_bytes(values, k, per_value, data):
    v = np.array(values, dtype=np.uint64)
    ks = np.array(data.draw(st.lists(st.integers(0, 40), min_size=v.size, max_size=v.size)), dtype=np.int64) \
        if per_value else k
    assert ricecode.pack(v, ks) == ricecode._pack_numpy(v, ks)


def test_writers_reject_widths_out_of_range():
    v = np.ones(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="width 1: expected 0..64, found 65"):
        contexts.KERNEL.pack_bits(v, np.array([3, 65]), 0)
    with pytest.raises(ValueError, match="width: expected 0..40, found 41"):
        contexts.KERNEL.rice_pack(v, np.empty(0, np.int64), 41)
    with pytest.raises(ValueError, match="expected 2 int64"):
        contexts.KERNEL.rice_pack(v, np.zeros(3, np.int64), 0)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES + [torch.int8]), sizes=st.lists(st.integers(0, 300), min_size=1, max_size=5),
       density=st.floats(0, 1), seed=st.integers(0, 2**16), cap=st.integers(1, 50))
def test_changes_finds_what_numpy_finds_whatever_the_room(dtype, sizes, density, seed, cap):
    from patchswarm.protocol.patchencode import _changed, _changed_numpy

    rng = np.random.default_rng(seed)
    int_dtype = info_of(dtype).int_dtype
    base = [torch.from_numpy(rng.integers(-100, 100, n).astype(np.int64)).to(int_dtype).numpy() for n in sizes]
    target = [b.copy() for b in base]
    for t in target:
        hit = rng.random(t.size) < density
        t[hit] += 1  # wraps at the type's edge, still another bit pattern
    want = _changed_numpy(base, target)
    got = _changed(base, target)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    # A kernel call stops when its room is full and says where to go on from.
    width, total = base[0].dtype.itemsize, sum(sizes)
    parts, start = [], 0
    for _ in range(total + 2):
        pos, old, new = np.empty(cap, np.int64), np.empty(cap, base[0].dtype), np.empty(cap, base[0].dtype)
        n, start = contexts.KERNEL.changes(base, target, width, start, pos, old.view(np.uint8), new.view(np.uint8))
        parts.append(pos[:n])
        if start >= total:
            break
    assert np.array_equal(np.concatenate(parts), want[0])


def test_changes_argument_errors_are_clear():
    k = contexts.KERNEL
    a, b = np.zeros(4, np.uint16), np.zeros(5, np.uint16)
    room = (np.empty(4, np.int64), np.empty(8, np.uint8), np.empty(8, np.uint8))
    with pytest.raises(ValueError, match="piece 0: expected the same length in base and target, found 8 and 10"):
        k.changes([a], [b], 2, 0, *room)
    with pytest.raises(ValueError, match="expected as many target pieces as base pieces"):
        k.changes([a], [a, a], 2, 0, *room)
    with pytest.raises(ValueError, match="width"):
        k.changes([a], [a], 8, 0, *room)
