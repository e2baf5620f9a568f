"""The peers' encodings the codec bench measures against (bench/peer_codecs.py): each decodes
back to the target bit for bit, and their sizes follow their formats."""

import sys
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer_codecs  # noqa: E402

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


@st.composite
def pairs(draw):
    """Two versions of 1-3 float tensors (0-3 dimensions, empty ones too), a fraction changed."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base, target = {}, {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 300), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(FLOATS))
        t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
        u = t.clone()
        flat = u.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[u.element_size()])
        if flat.numel():
            density = draw(st.sampled_from([0.0, 0.001, 0.05, 1.0]))
            pos = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < density))
            flat[pos] = flat[pos] ^ 1  # the lowest mantissa bit: finite stays finite
        base[f"t{i}"], target[f"t{i}"] = t, u
    return base, target


def same_bits(a, b):
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert a[k].numel() == 0 or torch.equal(a[k].contiguous().reshape(-1).view(torch.uint8),
                                                b[k].contiguous().reshape(-1).view(torch.uint8)), k


@settings(max_examples=60, deadline=None)
@given(pairs(), st.sampled_from(sorted(peer_codecs.PATCH_CODECS)))
def test_every_peer_encoding_decodes_to_the_target(pair, name):
    base, target = pair
    encode, decode = peer_codecs.PATCH_CODECS[name]
    same_bits(decode(base, encode(base, target)), target)


def test_sizes_follow_each_format():
    base = {"w": torch.zeros(1000, 64, dtype=torch.bfloat16)}
    target = {"w": base["w"].clone()}
    flat = target["w"].reshape(-1).view(torch.int16)
    flat[torch.arange(0, 64000, 100)] = 0x3F80  # 640 changed elements, both bytes of each
    n = 640
    assert len(peer_codecs.trl_style(base, target)) == 4 + n * (4 + 2)
    # PULSE v3.1: the positions (row r, column c) with 100 elements apart are regular: they compress
    # well below the raw uint8 row deltas + uint16 column deltas + values.
    assert len(peer_codecs.pulse_v31(base, target)) < n * (1 + 2 + 2)
    # Unchanged tensors cost no data (slime writes its index file only, PULSE a header only).
    assert len(peer_codecs.slime_xor(base, base)) < 250 and len(peer_codecs.slime_overwrite(base, base)) < 250
    assert len(peer_codecs.pulse_v2(base, base)) < 64


def test_the_fp8_values_pulse_sends_as_float32():
    base = {"q": torch.zeros(4096, dtype=torch.float8_e4m3fn)}
    target = {"q": base["q"].clone()}
    target["q"].view(torch.uint8)[::4] = 0x38  # 1.0
    v2 = peer_codecs.pulse_v2(base, target)
    import zstandard
    raw = zstandard.ZstdDecompressor().decompress(v2)
    assert raw.count(np.float32(1.0).tobytes()) == 1024  # each new value as 4 bytes


def test_huffman_bits_and_the_dfloat11_model():
    assert peer_codecs.huffman_bits(np.array([1, 1, 2])) == 6  # codes 2, 2, 1 bits
    assert peer_codecs.huffman_bits(np.array([0, 5, 0])) == 5  # one symbol: one bit each
    assert peer_codecs.huffman_bits(np.array([4, 4, 4, 4])) == 32  # four equal: two bits each
    one_exponent = {"w": torch.full((800,), 1.0, dtype=torch.bfloat16)}
    assert peer_codecs.dfloat11_bytes(one_exponent) == 800 + 100 + 256
    assert peer_codecs.dfloat11_bytes({"w": torch.zeros(3, dtype=torch.float32)}) is None


def test_tensors_that_differ_in_layout_are_refused():
    with pytest.raises(ValueError, match="same names, dtypes and shapes"):
        peer_codecs.trl_style({"a": torch.zeros(2)}, {"a": torch.zeros(3)})


def _changed_pair():
    base = {"a": torch.zeros(40, 30, dtype=torch.bfloat16), "b": torch.zeros(500, dtype=torch.float32),
            "c": torch.zeros(8, dtype=torch.bfloat16)}
    target = {k: v.clone() for k, v in base.items()}
    target["a"][::3, ::7] = 1.0
    target["b"][::11] = 2.0  # "c" is unchanged
    return base, target


def test_pulse_headers_carry_the_fields_grail_writes():
    """one-covenant/grail's sparse_codec.py writes, per changed tensor, these fields in this order
    (offsets from the start of the data, after the header): the JSON header's bytes are part of
    the zstd frame, so a lighter header would understate PULSE's size."""
    import json
    import struct

    import zstandard

    v2 = ["name", "shape", "num_nonzero", "value_dtype", "indices_offset", "indices_size", "values_offset",
          "values_size"]
    v31 = ["name", "shape", "num_nonzero", "value_dtype", "row_dtype", "col_dtype", "indices_offset", "indices_size",
           "rows_size", "cols_size", "values_offset", "values_size"]
    base, target = _changed_pair()
    for encode, version, fields in [(peer_codecs.pulse_v2, 2, v2), (peer_codecs.pulse_v31, 31, v31)]:
        raw = zstandard.ZstdDecompressor().decompress(encode(base, target))
        (hlen,) = struct.unpack_from("<I", raw)
        header = json.loads(raw[4:4 + hlen])
        assert header["version"] == version and [m["name"] for m in header["tensors"]] == ["a", "b"]
        at = 0
        for m, n in zip(header["tensors"], [14 * 5, 46]):
            assert list(m) == fields and m["num_nonzero"] == n
            assert m["indices_offset"] == at and m["values_offset"] == at + m["indices_size"]
            if version == 31:
                assert m["indices_size"] == m["rows_size"] + m["cols_size"]
            at = m["values_offset"] + m["values_size"]
        assert 4 + hlen + at == len(raw)


def test_slime_versions_carry_the_index_file_slime_writes():
    """THUDM/slime's disk delta (update_weight_from_disk_delta.py) writes, per version, the
    safetensors file of the changed tensors and, always, model.safetensors.index.json (its
    metadata and the weight map of the changed tensors): both count, back to back."""
    import json
    import struct

    base, target = _changed_pair()
    for encode, mode in [(peer_codecs.slime_xor, "xor"), (peer_codecs.slime_overwrite, "overwrite")]:
        blob = encode(base, target)
        (n,) = struct.unpack_from("<Q", blob)
        header = json.loads(blob[8:8 + n])
        end = 8 + n + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        assert sorted(header["__metadata__"]) == ["a", "b"]
        index = json.loads(blob[end:])
        assert index == {"metadata": {"version": "000001", "base_version": "000000", "delta_encoding": mode,
                                      "compression_format": "zstd", "checksum_format": "xxh3-128"},
                         "weight_map": {"a": "model-00000-of-00001.safetensors",
                                        "b": "model-00000-of-00001.safetensors"}}
        # A version with nothing changed: no safetensors file, the index with an empty weight map.
        assert json.loads(encode(base, base))["weight_map"] == {}
        decode = peer_codecs.PATCH_CODECS["slime-" + ("xor" if mode == "xor" else "ow")][1]
        same_bits(decode(base, encode(base, base)), base)
        same_bits(decode(base, blob), target)
