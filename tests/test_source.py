"""The origin's input (node/trainer/source.py): what a trainer's state_dict or a checkpoint on
disk may hold, and that anything else is refused by name before a tensor is made.

The served state is published to every node, written to safetensors weights files and
streamed to engines; a tensor that cannot make the whole trip must stop at the origin, not
at the nodes (where every node would fail the same version).
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.node.trainer.origin import served_copy
from patchswarm.node.trainer.source import Source
from patchswarm.node.weights import Weights, read_weights, write_weights
from patchswarm.protocol.changes import ChangeEncoder, apply_changes
from patchswarm.protocol.patch import Patch, apply, keyframe
from patchswarm.protocol.statehash import state_hash
from patchswarm.protocol.errors import InvalidInput, PatchswarmError, UnsupportedFormat, UsageError
from patchswarm.protocol.served import FORMATS

class Sharded(torch.Tensor):
    """A tensor whose data is not its own, as DTensor (FSDP2's state_dict) is: every operation
    on it gives a Sharded again, so its bits cannot be read as a plain tensor's."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, Sharded) else x  # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map(lambda x: Sharded(x) if isinstance(x, torch.Tensor) else x, out)


UNSERVABLE = {
    "DTensor-like": (lambda: Sharded(torch.randn(4, 4)), UnsupportedFormat, "a Sharded"),
    "sparse COO": (lambda: torch.randn(4, 4).to_sparse(), UnsupportedFormat, "layout torch.sparse_coo"),
    "sparse CSR": (lambda: torch.randn(4, 4).to_sparse_csr(), UnsupportedFormat, "layout torch.sparse_csr"),
    "nested": (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), UnsupportedFormat,
               "a nested tensor"),
    "meta": (lambda: torch.empty(4, 4, device="meta"), UsageError, "meta device"),
    "complex": (lambda: torch.randn(3, dtype=torch.complex64), UnsupportedFormat, "torch.complex64"),
    "complex128": (lambda: torch.randn(3, dtype=torch.complex128), UnsupportedFormat, "torch.complex128"),
    "qint8": (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), UnsupportedFormat,
              "torch.qint8"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: CSR and nested are beta, qint8 deprecated
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", sorted(UNSERVABLE))
def test_a_tensor_that_cannot_be_served_is_refused_by_name_before_any_is_made(kind, fmt):
    make, error, found = UNSERVABLE[kind]
    made = []

    class Watched(dict):
        def __getitem__(self, name):
            made.append(name)
            return super().__getitem__(name)

    state = Watched({"a.weight": torch.randn(4, 4), "odd.weight": make()})
    with pytest.raises(error, match="expected") as e:
        src = Source.from_state(state, fmt)
        for name in sorted(src.table):
            src.produce(name)
    assert "'odd.weight'" in str(e.value) and found in str(e.value), str(e.value)
    assert made == [], "refused before any tensor was read"


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp64_e8m0_fnuz_fp4_and_unsigned_tensors_keep_their_dtype_and_bits_in_every_format(fmt):
    """Before, the cast formats made an f64 buffer bf16 (45 mantissa bits gone) and an MX
    e8m0 scale bf16, fp8-block quantized a 2-D f64 weight, and as-is refused all of them and
    every unsigned type but u8 (and later the fnuz fp8s and packed fp4)."""
    state = {"rope.inv_freq": torch.randn(3, dtype=torch.float64), "proj.weight": torch.randn(4, 4, dtype=torch.float64),
             **({"mx.scale": torch.arange(120, 130, dtype=torch.uint8).view(torch.float8_e8m0fnu)}
                if hasattr(torch, "float8_e8m0fnu") else {}),
             # AMD's fp8 and packed fp4 weights, 2-D "weight"s that fp8-block would otherwise take (and
             # torch cannot cast fp4 at all: it has no copy kernel for it)
             "amd.weight": torch.randn(4, 4).to(torch.float8_e4m3fnuz),
             "amd5.weight": torch.randn(4, 4).to(torch.float8_e5m2fnuz),
             **({"fp4.weight": torch.arange(16, dtype=torch.uint8).reshape(4, 4).view(torch.float4_e2m1fn_x2)}
                if hasattr(torch, "float4_e2m1fn_x2") else {}),
             "ids": torch.arange(3, dtype=torch.int32).to(torch.uint16), "big": torch.arange(3).to(torch.uint64),
             "u32": torch.arange(3).to(torch.uint32), "master.norm": torch.randn(4)}
    out = served_copy(state, fmt)
    for k in state:
        if k != "master.norm":
            assert out[k].dtype == state[k].dtype and torch.equal(out[k].view(torch.uint8), state[k].view(torch.uint8)), k
    assert set(out) == set(state) and out["master.norm"].dtype == {"as-is": torch.float32, "fp16": torch.float16,
                                                                     "fp32": torch.float32}.get(fmt, torch.bfloat16)


@pytest.mark.parametrize("name, why", [
    ("", "1..4096 bytes"),  # the change stream to engines carries no empty name
    ("x" * 4097, "found 4097 bytes"),  # a patch carries at most 4096
    ("é" * 2049, "found 4098 bytes"),
    ("\ud800", "UTF-8 cannot encode"),
    ("__metadata__", "reserved"),  # safetensors' header key: no weights file could hold it
    ("patchswarm.file:config.json", "reserved"),  # where side files travel
])
def test_a_name_that_cannot_travel_is_refused(name, why):
    with pytest.raises(UsageError, match=why):
        Source.from_state({name: torch.zeros(2), "ok": torch.zeros(2)}, "as-is")


def test_a_tensor_of_more_dimensions_than_the_change_stream_carries_is_refused():
    served_copy({"w": torch.zeros([1] * 16)}, "as-is")
    with pytest.raises(UsageError, match="at most 16 dimensions"):
        Source.from_state({"w": torch.zeros([1] * 17)}, "as-is")


def test_an_empty_tensor_with_a_dimension_no_patch_carries_is_refused():
    """The defect: a [0, 2**48] tensor (no data, any size) passed the origin's checks; every
    object of its version then listed a dimension that patches, manifests and the change
    stream refuse (at most 2**48 - 1), so no node could take the version."""
    served_copy({"w": torch.zeros(0, (1 << 48) - 1)}, "as-is")
    with pytest.raises(UsageError, match="at most 16 dimensions of at most 281474976710655"):
        Source.from_state({"w": torch.zeros(0, 1 << 48)}, "as-is")


def test_a_checkpoint_file_is_opened_once_per_publish_not_once_per_tensor(tmp_path, monkeypatch):
    """The defect: `produce` opened the tensor's file again for every tensor, and each open
    reads the file's whole header: O(tensors^2), 70 s for 8,000 tensors in one file (hours
    at a large MoE's 140k)."""
    from safetensors.torch import save_file

    from patchswarm.node.trainer import source

    state = {f"layers.{i}.w": torch.full((3,), float(i)) for i in range(40)}
    save_file(state, str(tmp_path / "m.safetensors"))
    opens = []
    real = source._open
    monkeypatch.setattr(source, "_open", lambda path: opens.append(path) or real(path))
    src = Source.from_path(tmp_path / "m.safetensors", "as-is")
    for name in sorted(src.table):
        assert torch.equal(src.produce(name), state[name])
    assert len(opens) <= 2, f"{len(opens)} opens for {len(state)} tensors"


@pytest.mark.parametrize("name", ["a.b.c", "a/b/c", "ünïcødé.权重", "x" * 4096, " ", "é" * 2048])
def test_names_that_travel_are_kept(name):
    assert list(served_copy({name: torch.ones(2)}, "bf16")) == [name]


def test_a_refused_state_is_a_patchswarm_error_through_every_entry():
    for call in (lambda: served_copy({"": torch.zeros(1)}), lambda: served_copy({"s": torch.zeros(2).to_sparse()})):
        with pytest.raises(PatchswarmError):
            call()


@pytest.mark.parametrize("entries, size", [
    ({"a": ("F32", [2], [0, 8]), "b": ("F32", [2], [4, 12])}, 12),  # overlapping tensors
    ({"a": ("F32", [1], [0, 4]), "b": ("F32", [1], [8, 12])}, 12),  # a hole between them
    ({"a": ("F32", [1], [0, 4])}, 8),  # bytes no tensor covers
])
def test_a_checkpoint_safetensors_refuses_is_invalid_input_before_any_tensor_is_made(tmp_path, entries, size):
    """Its header parses, but safetensors will not read it: an InvalidInput naming the file (the
    origin's watch skips it), not a SafetensorError that stops the origin."""
    header = json.dumps({n: {"dtype": d, "shape": s, "data_offsets": o} for n, (d, s, o) in entries.items()}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(size))
    with pytest.raises(InvalidInput, match=f"{path}: not a readable safetensors file"):
        Source.from_path(path, "bf16")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(st.text(max_size=40), st.text(min_size=1020, max_size=1100),
                      st.sampled_from(["", "__metadata__", "patchswarm.file:x", "\ud800", "a\x00b", "é" * 2049])),
       dims=st.integers(0, 18))
def test_what_the_origin_takes_travels_the_whole_way(tmp_path, name, dims):
    """Any name and rank: refused at the origin, or carried bit for bit by a patch, a node's
    weights file and the change stream to an engine."""
    t = torch.arange(2, dtype=torch.float32).reshape([2] + [1] * max(0, dims - 1)) if dims else torch.tensor(1.5)
    try:
        served = served_copy({name: t, "b": torch.ones(3)}, "bf16")
    except UsageError:
        return
    patch = Patch.from_bytes(keyframe(served).to_bytes())
    node: dict = {}
    frames: list = []
    enc = ChangeEncoder.for_patch(patch, None, 0, lambda bufs: frames.extend(bytes(b) for b in bufs))
    enc.header()
    apply(node, patch, recorder=enc)
    enc.end()
    engine: dict = {}
    apply_changes(engine, b"".join(frames))
    write_weights(tmp_path / "w.safetensors", Weights(node, 0, patch.target_hash, "s"))
    for got in (node, engine, read_weights(tmp_path / "w.safetensors").state):
        assert state_hash(got) == patch.target_hash == state_hash(served)


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch < 2.8 has no float4_e2m1fn_x2")
def test_packed_fp4_with_no_dimensions_is_refused_at_the_origin_by_name():
    """safetensors' F4 counts fp4 values along the last dimension, so a 0-d float4_e2m1fn_x2
    tensor has no form in a node's weights file: the origin refuses it, not every node."""
    odd = torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(UsageError, match="tensor 'odd': expected at least one dimension for torch.float4_e2m1fn_x2"):
        Source.from_state({"odd": odd, "ok": torch.zeros(2)}, "as-is")
