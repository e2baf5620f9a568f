"""The per-tensor fast paths of state_hash, diff and apply give exactly the slow paths' results.

Each fast path is held to a reference written out here from the code it replaced:
the state hash record by record (one msgpack call and one task per block),
`check_tensor` for `checked_info`, the per-name UTF-8 encode for `check_state`,
and a state applied tensor by tensor for `apply`. The states mix every dtype,
empty, 0-dim and non-contiguous tensors and tensors that share one storage.
"""

import gc
import threading
import warnings

import blake3
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol import parallel, patch, statehash
from patchswarm.protocol.dtypes import _INFOS, check_tensor, checked_info
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.patchformat import MAX_NAME_BYTES, check_state, name_bytes, piece_bits

DTYPES = [i.torch_dtype for i in _INFOS]
NAMES = {i.torch_dtype: i.name for i in _INFOS}


def reference_hash(state: dict, block: int = statehash.BLOCK_BYTES) -> str:
    """The state hash as it was computed before: a record packed per tensor, a digest per block."""
    h = blake3.blake3()
    for name in sorted(state):
        t = state[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        leaves = b"".join(blake3.blake3(raw[o:o + block]).digest() for o in range(0, max(1, len(raw)), block))
        h.update(msgpack.packb([name, NAMES[t.dtype], list(t.shape), blake3.blake3(leaves).digest()]))
    return "blake3:" + h.hexdigest()


def _bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if n else torch.empty(0, dtype=dtype)


@st.composite
def states(draw, max_tensors: int = 12) -> dict:
    """Mixed dtypes; plain, 0-dim, empty, transposed, strided and storage-sharing tensors."""
    out = {}
    shared: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    for i in range(draw(st.integers(0, max_tensors))):
        dtype = draw(st.sampled_from(DTYPES))
        kind = draw(st.sampled_from(["plain", "scalar", "empty", "transposed", "strided", "shared"]))
        seed = draw(st.integers(0, 1 << 16))
        if kind == "scalar":
            t = _bits(1, dtype, seed).reshape(())
        elif kind == "empty":
            t = _bits(0, dtype, seed).reshape(0, draw(st.integers(0, 3)))
        elif kind == "transposed":
            t = _bits(12, dtype, seed).reshape(3, 4).t()
        elif kind == "strided":
            t = _bits(20, dtype, seed)[::3]
        elif kind == "shared":
            # Consecutive slices of one tensor: one storage, no element in two tensors.
            base, at = shared.get(dtype, (_bits(64, dtype, seed), 0))
            end = draw(st.integers(at, 64))
            shared[dtype] = (base, end)
            t = base[at:end]
        else:
            t = _bits(draw(st.integers(1, 40)), dtype, seed)
            if draw(st.booleans()):
                t = t.reshape(1, -1)
        out[f"layers.{i % 3}.t{i}"] = t
    return out


@settings(max_examples=150, deadline=None)
@given(states())
def test_state_hash_is_the_per_tensor_reference(state):
    assert statehash.state_hash(state) == reference_hash(state)
    assert statehash.state_hash(state, threads=1) == reference_hash(state)


@settings(max_examples=60, deadline=None)
@given(states(), st.integers(1, 300))
def test_grouped_blocks_and_small_blocks_give_the_reference(state, group):
    """Blocks grouped a few per task, and tensors over several blocks (a small block size
    here, as the reference computes with it): the same hash as a task per block."""
    saved = statehash.GROUP_BYTES, statehash.BLOCK_BYTES
    statehash.GROUP_BYTES, statehash.BLOCK_BYTES = group, 16
    try:
        assert statehash.state_hash(state) == reference_hash(state, block=16)
    finally:
        statehash.GROUP_BYTES, statehash.BLOCK_BYTES = saved


@settings(max_examples=60, deadline=None)
@given(states())
def test_views_made_by_the_codec_give_the_same_hash(state):
    """state_hash with `apply`'s cache of int views (some made from the tensors, one stale,
    the non-contiguous ones views of copies) hashes what it hashes without them."""
    views: dict = {}
    names = sorted(state)
    piece_bits(state, [(n, 0, state[n].numel()) for n in names[::2]], views)
    if names:
        views[names[-1]] = (torch.zeros(3), torch.zeros(3, dtype=torch.int32).numpy())  # not this tensor: ignored
    assert statehash.state_hash(state, views=views) == reference_hash(state)
    tasks, finish = statehash.hash_tasks([state, state], [views, {}])
    assert finish(parallel.run_all(tasks, 2)) == [reference_hash(state)] * 2


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, (1 << 16) - 1, 1 << 16, (1 << 16) + 1])
def test_the_array_header_is_the_one_msgpack_writes(n):
    items = [0] * n
    assert msgpack.packb(items)[statehash._array_header_bytes(n):] == b"".join(msgpack.packb(x) for x in items)


def test_state_hash_over_fifteen_to_seventeen_tensors():
    for n in (15, 16, 17):
        state = {f"t{i}": _bits(i, torch.bfloat16, i) for i in range(n)}
        assert statehash.state_hash(state) == reference_hash(state)


def _error(fn, *args):
    try:
        fn(*args)
    except (PatchswarmError, RuntimeError) as e:
        return type(e), str(e)
    return None


class _Subclass(torch.Tensor):
    pass


def odd_tensors():
    yield torch.zeros(3, device="meta")
    yield torch.zeros(3).to_sparse()
    yield torch.zeros(3, dtype=torch.complex64)
    yield torch.zeros(3, dtype=torch.uint16)
    yield torch.nn.Parameter(torch.zeros(3))
    yield torch.zeros(3).as_subclass(_Subclass)
    with warnings.catch_warnings():  # "the PyTorch API of nested tensors is in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    yield nested
    for dtype in DTYPES:
        yield torch.zeros(2, 2, dtype=dtype).t()


@pytest.mark.parametrize("t", list(odd_tensors()), ids=lambda t: f"{type(t).__name__}-{t.dtype}-{t.layout}")
def test_checked_info_is_check_tensor(t):
    assert _error(checked_info, t, "state", "w") == _error(check_tensor, t, "state['w']")
    if _error(check_tensor, t, "x") is None:
        assert checked_info(t, "state", "w") is check_tensor(t, "x")


def reference_check_state(state, what: str) -> None:
    """check_state as it was: every name encoded."""
    for k, v in state.items():
        check_tensor(v, f"{what}[{k!r}]")
        size = name_bytes(k)
        if not 0 <= size <= MAX_NAME_BYTES:
            raise PatchswarmError(f"{what}: tensor name: expected UTF-8 of at most {MAX_NAME_BYTES} bytes (what a patch "
                                  f"carries), found {'a string UTF-8 cannot encode' if size < 0 else f'{size} bytes'}: "
                                  f"{k[:60]!r}")


@pytest.mark.parametrize("name", ["w", "a" * MAX_NAME_BYTES, "a" * (MAX_NAME_BYTES + 1), "é" * (MAX_NAME_BYTES // 2),
                                  "é" * (MAX_NAME_BYTES // 2 + 1), "\ud800", "a\udfff", "ß" * 3000, ""])
def test_check_state_names_as_before(name):
    state = {name: torch.zeros(2)}
    found, expected = _error(check_state, state, "state"), _error(reference_check_state, state, "state")
    assert (found is None) == (expected is None)
    if found is not None:
        assert found[1] == expected[1]


@settings(max_examples=40, deadline=None)
@given(states(), st.data())
def test_diff_and_apply_over_odd_states_are_exact(base, data):
    """diff's hashes are the reference's, and apply makes the target bit for bit,
    whatever the tensors' layouts and storage sharing."""
    target = {}
    for name, t in base.items():
        t = t.contiguous().clone()  # so that the flip below writes into it
        if t.numel() and data.draw(st.booleans()):
            flat = t.reshape(-1).view(torch.uint8)
            flat[data.draw(st.integers(0, flat.numel() - 1))] ^= 1
        target[name] = t
    p = patch.diff(base, target)
    assert (p.base_hash, p.target_hash) == (reference_hash(base), reference_hash(target))
    state = dict(base)  # the same tensors, shared storage and all: apply writes into them
    patch.apply(state, p)
    assert sorted(state) == sorted(target)
    for name in target:
        assert state[name].dtype == target[name].dtype and state[name].shape == target[name].shape
        assert torch.equal(_bytes_of(state[name]), _bytes_of(target[name]))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_a_second_apply_and_a_wrong_base_fail_as_before():
    base = {f"m.{i}": _bits(8, torch.bfloat16, i) for i in range(50)}
    target = dict(base)
    target["m.7"] = base["m.7"].clone()
    target["m.7"].view(torch.int16)[3] += 1
    p = patch.diff(base, target)
    state = {k: v.clone() for k, v in base.items()}
    patch.apply(state, p)
    before = {k: v.clone() for k, v in state.items()}
    with pytest.raises(PatchswarmError, match="already holds"):
        patch.apply(state, p)
    assert all(torch.equal(state[k], before[k]) for k in state)
    state["m.7"] = _bits(8, torch.float16, 1)
    with pytest.raises(PatchswarmError, match=r"tensor 'm.7': patch expects bf16\[8\], state has fp16\[8\]"):
        patch.apply(state, p)


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with parallel.gc_paused():
        assert not gc.isenabled()
        with parallel.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with parallel.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off: left off
    finally:
        gc.enable()
    with pytest.raises(ValueError):
        with parallel.gc_paused():
            raise ValueError("inside")
    assert gc.isenabled()
    statehash.state_hash({"w": torch.zeros(2)})
    assert gc.isenabled()


def test_gc_paused_in_overlapping_threads_keeps_the_collector_off_until_the_last_ends():
    """A block that began first and ended first used to turn the collector on under the other."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with parallel.gc_paused():
            first_in.set()
            assert second_in.wait(10)
        first_out.set()

    def second():
        assert first_in.wait(10)
        with parallel.gc_paused():
            second_in.set()
            assert first_out.wait(10)
            seen["after the first ended"] = gc.isenabled()
        seen["after both"] = gc.isenabled()

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert seen == {"after the first ended": False, "after both": True}
    assert gc.isenabled()


def test_the_bench_measures_what_it_says():
    """bench/many_tensors.py's measurement on a small state: the applies it times make the target and the base again."""
    from bench.many_tensors import make_states, measure

    base, target = make_states(50, 4)
    assert len(base) == 50 and sum(not torch.equal(base[k], target[k]) for k in base) == 1
    times = measure(50, 4, None)
    assert set(times) == {"hash", "diff", "apply", "again", "bytes"} and all(t > 0 for t in times.values())
