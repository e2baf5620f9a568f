"""Served formats (protocol/served.py): as-is keeps bits, casts never touch fp8 or scales,
fp8-block follows the DeepSeek-V3 / DeepGEMM block convention, side files ride as bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import InvalidInput, UsageError
from patchswarm.protocol.served import (AMAX_FLOOR, BLOCK, E4M3_MAX, FILE_PREFIX, block_dequantize, block_quantize,
                                        file_tensor, file_tensor_name, serve_state, split_side_files)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def fp8_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """A pre-quantized checkpoint as DeepSeek-V3 ships one: e4m3 weights with fp32 block
    scales, bf16 norms and embeddings."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 200, generator=g) * 0.02
    fp8, scale = block_quantize(w)
    return {
        "model.embed_tokens.weight": (torch.randn(64, 200, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": fp8,
        "model.layers.0.mlp.down_proj.weight_scale_inv": scale,
        "model.layers.0.input_layernorm.weight": torch.ones(200, dtype=torch.bfloat16),
    }


def test_as_is_keeps_every_dtype_and_bit():
    state = fp8_checkpoint()
    state["special"] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float32)
    state["special"].view(torch.int32)[0] |= 0x12345  # a NaN payload
    state["counts"] = torch.arange(5, dtype=torch.int8)
    served = serve_state(state, "as-is")
    assert list(served) == list(state)
    for k in state:
        assert served[k].dtype == state[k].dtype and bits(served[k]) == bits(state[k]), k
        assert served[k].untyped_storage().data_ptr() != state[k].untyped_storage().data_ptr(), "must be a copy"


@pytest.mark.parametrize("fmt, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_casts_never_touch_fp8_weights_or_their_scales(fmt, dtype):
    """The defect: with the default bf16 the fp8 weights changed dtype and the fp32 scales were rounded."""
    state = fp8_checkpoint()
    state["master.weight"] = torch.randn(8, 8, dtype=torch.float32)
    served = serve_state(state, fmt)
    for k in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"):
        assert served[k].dtype == state[k].dtype and bits(served[k]) == bits(state[k]), k
    assert served["master.weight"].dtype == dtype
    assert served["model.embed_tokens.weight"].dtype == dtype


def test_compressed_tensors_scale_names_are_kept_too():
    state = {"l.weight": torch.randn(4, 4).to(torch.float8_e4m3fn), "l.weight_scale": torch.tensor([0.37]),
             "l.input_scale": torch.tensor([1.7])}
    served = serve_state(state, "bf16")
    assert all(bits(served[k]) == bits(state[k]) and served[k].dtype == state[k].dtype for k in state)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "fp8-block"])
@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale",  # vLLM / compressed-tensors fp8 KV cache
    "model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.v_proj.v_scale",  # ModelOpt
    "model.layers.0.self_attn.q_scale", "model.layers.0.self_attn.prob_scale",  # Quark fp8 attention
    "model.layers.0.self_attn.kv_scale",  # TGI
    "model.layers.0.mlp.down_proj.weight_scale_2",  # ModelOpt NVFP4: second-level scale
    "model.layers.0.mlp.down_proj.output_scale",  # Quark
])
def test_kv_cache_and_second_level_scales_keep_their_bits(name, fmt):
    """A pre-quantized checkpoint's fp32 scales are part of its quantization: served in bf16
    they were rounded (k_scale 0.0123 became 0.01233), silently changing what the engine
    computes from the unchanged fp8 weights."""
    state = {**fp8_checkpoint(), name: torch.tensor([0.0123456789], dtype=torch.float32)}
    served = serve_state(state, fmt)
    assert served[name].dtype == torch.float32 and bits(served[name]) == bits(state[name])


def reference_block_quantize(w: torch.Tensor):
    """DeepGEMM's per_block_cast_to_fp8, written out block by block (the loop is the spec)."""
    m, n = w.shape
    rows, cols = -(-m // BLOCK), -(-n // BLOCK)
    fp8 = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            amax = block.abs().max().clamp(min=AMAX_FLOOR)
            fp8[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
            scale[i, j] = amax / E4M3_MAX
    return fp8, scale


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (1, 129), (257, 1)])
def test_block_quantize_is_the_deepgemm_convention(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.05
    w[0, 0] = 0.0
    fp8, scale = block_quantize(w)
    ref_fp8, ref_scale = reference_block_quantize(w)
    assert fp8.shape == w.shape and scale.shape == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    assert fp8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert bits(fp8) == bits(ref_fp8) and bits(scale) == bits(ref_scale)
    # Dequantized as the checkpoint's readers do (weight * scale_inv): within e4m3's half-ulp (2^-4 relative).
    back = block_dequantize(fp8, scale)
    blockmax = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]] * E4M3_MAX
    assert ((back - w).abs() <= blockmax * 2.0 ** -4 + 1e-12).all()


def test_an_all_zero_block_gets_the_floor_scale():
    fp8, scale = block_quantize(torch.zeros(130, 4))
    assert torch.equal(scale, torch.full((2, 1), AMAX_FLOOR / E4M3_MAX))
    assert not fp8.float().any()


def test_fp8_block_quantizes_2d_weights_only():
    g = torch.Generator().manual_seed(3)
    state = {"model.embed_tokens.weight": torch.randn(32, 16, generator=g),
             "lm_head.weight": torch.randn(32, 16, generator=g),
             "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 16, generator=g),
             "model.layers.0.self_attn.q_proj.bias": torch.randn(256, generator=g),
             "model.norm.weight": torch.randn(16, generator=g)}
    served = serve_state(state, "fp8-block")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert served[q].dtype == torch.float8_e4m3fn and served[q + "_scale_inv"].shape == (2, 1)
    assert bits(served[q]) == bits(block_quantize(state[q])[0])
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"):
        assert served[k].dtype == torch.bfloat16, k
    assert len(served) == len(state) + 1


def test_fp8_block_refuses_to_overwrite_an_existing_scale():
    state = {"a.weight": torch.randn(4, 4), "a.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(UsageError, match="already has"):
        serve_state(state, "fp8-block")


def test_unknown_format_and_bad_state_are_usage_errors():
    with pytest.raises(UsageError, match="as-is, bf16"):
        serve_state({}, "int4")
    with pytest.raises(UsageError):
        serve_state({"w": [1, 2]}, "bf16")


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9_.\-]{0,20}", fullmatch=True), st.binary(max_size=300), max_size=5))
def test_side_files_round_trip(files):
    state = {"w": torch.ones(3)}
    state.update({file_tensor_name(n): file_tensor(d) for n, d in files.items()})
    weights, back = split_side_files(state)
    assert back == files and list(weights) == ["w"]


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", ".hidden", "", "x\\y"])
def test_side_file_names_are_plain(name):
    with pytest.raises(UsageError):
        file_tensor_name(name)
    with pytest.raises(InvalidInput):
        split_side_files({FILE_PREFIX + name: torch.zeros(1, dtype=torch.uint8)})
