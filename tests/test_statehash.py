"""The state hash as documented in protocol/statehash.py (version 2), as a known answer.

Two checks that do not trust the code under test: the definition written out again
here from its docstring, byte by byte (msgpack records, BLAKE3 over per-block BLAKE3
digests, 4 MiB blocks), and pinned hex answers for fixed states, so that a change of
the definition (block size, record layout, a dtype's wire name, the prefix) shows
as a failing test and not as a swarm whose old data no longer verifies.
"""

import blake3
import msgpack
import numpy as np
import pytest
import torch

from patchswarm.protocol.statehash import combine, is_state_hash, state_hash, tensor_digest

BLOCK = 4 << 20  # the documented block size


def documented(state: dict, names: dict) -> str:
    """The definition, from the docstring alone: `names` maps each tensor to its dtype's wire name."""
    h = blake3.blake3()
    for name in sorted(state):
        t = state[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        leaves = b"".join(blake3.blake3(raw[o:o + BLOCK]).digest() for o in range(0, max(1, len(raw)), BLOCK))
        h.update(msgpack.packb([name, names[name], list(t.shape), blake3.blake3(leaves).digest()]))
    return "blake3:" + h.hexdigest()


def fixed_state() -> tuple[dict, dict]:
    """Every wire dtype name once, a 0-dim, an empty and a non-contiguous tensor; the bytes
    are fixed by arithmetic, not by a random generator."""
    ramp = torch.arange(24, dtype=torch.int32)
    state = {
        "bf16": (ramp.float() / 8 - 1).to(torch.bfloat16).reshape(2, 3, 4),
        "fp16": (ramp.float() / 3).to(torch.float16),
        "fp32": torch.tensor(-0.0),  # 0-dim, and the sign bit counts
        "f8e4m3": (ramp.float() / 4).to(torch.float8_e4m3fn).reshape(4, 6),
        "f8e5m2": (-ramp.float()).to(torch.float8_e5m2),
        "i8": (ramp - 12).to(torch.int8),
        "u8": ramp.to(torch.uint8) * 10,
        "i16": (ramp * -1000).to(torch.int16),
        "i32": ramp.reshape(4, 6).t(),  # not contiguous: hashed as its logical order
        "i64": ramp.to(torch.int64) << 40,
        "bool": ramp % 3 == 0,
        "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
    }
    names = {k: k for k in state}
    names["empty"] = "bf16"
    return state, names


# The answers, computed once with the definition above (2026-12-04); they must never change
# for version 2 of the state hash.
FIXED_ANSWER = "blake3:80f5b7d53e97207bcc05a71af1783e1fb5e05365b6a797deaab920b55b5ddcf3"
EMPTY_ANSWER = "blake3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"  # BLAKE3 of nothing


def test_the_documented_definition_gives_the_same_hash():
    state, names = fixed_state()
    assert state_hash(state) == documented(state, names)


def test_pinned_answers():
    state, _ = fixed_state()
    assert state_hash({}) == EMPTY_ANSWER
    assert state_hash(state) == FIXED_ANSWER


def test_a_tensor_over_several_blocks_is_hashed_block_by_block():
    t = (torch.arange(BLOCK + 3, dtype=torch.int64) % 251).to(torch.uint8)  # 4 MiB and 3 bytes
    state = {"big": t}
    assert state_hash(state) == documented(state, {"big": "u8"})
    # not the digest of the bytes in one piece: that would be a different definition
    flat = blake3.blake3(t.numpy().tobytes()).digest()
    one_block = "blake3:" + blake3.blake3(msgpack.packb(["big", "u8", [BLOCK + 3], flat])).hexdigest()
    assert state_hash(state) != one_block


def test_tensor_by_tensor_matches_the_whole_state():
    state, _ = fixed_state()
    records = {n: (t.dtype, tuple(t.shape), tensor_digest(t)) for n, t in state.items()}
    assert combine(records) == state_hash(state)


@pytest.mark.parametrize("change", [
    lambda s: s.update(fp32=torch.tensor(0.0)),  # -0.0 -> +0.0
    lambda s: s.update(i16=s["i16"].reshape(4, 6)),  # same bytes, another shape
    lambda s: s.update(u8=s["u8"].view(torch.int8)),  # same bytes, another dtype
    lambda s: s.update(renamed=s.pop("bool")),
    lambda s: s.pop("empty"),
])
def test_what_the_hash_covers(change):
    state, _ = fixed_state()
    before = state_hash(state)
    change(state)
    assert state_hash(state) != before and is_state_hash(state_hash(state))


def new_dtype_state(name: str) -> dict:
    """One fixed state per dtype added after the first release (fp64, u16, u32, u64, f8e8m0,
    then the fnuz fp8s and f4e2m1x2): its specials (f64 -0.0, infinities, a NaN with a payload;
    the unsigned types' old sign bit and top; the byte formats' NaN or -0), a 2-D and a
    non-contiguous view, bytes fixed by arithmetic."""
    ramp = torch.arange(24, dtype=torch.int64)
    if name == "fp64":
        t = ramp.double() / 7 - 1
        t[:4] = torch.tensor([-0.0, float("inf"), float("-inf"), 0.0], dtype=torch.float64)
        t.view(torch.int64)[4] = 0x7FF800000000BEEF  # a NaN payload
        return {"x": t.reshape(4, 6), "xt": t.reshape(4, 6).t()}
    byte_dtypes = {"f8e8m0": "float8_e8m0fnu", "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
                   "f4e2m1x2": "float4_e2m1fn_x2"}
    if name in byte_dtypes:  # e8m0's NaN 0xFF; the fnuz formats' one NaN 0x80; fp4x2's -0 in both halves
        t = (ramp * 11 % 256).to(torch.uint8)
        t[0] = {"f8e8m0": 0xFF, "f4e2m1x2": 0x88}.get(name, 0x80)
        x = t.view(getattr(torch, byte_dtypes[name])).reshape(4, 6)
        return {"x": x, "xt": x.t()}
    width = {"u16": 2, "u32": 4, "u64": 8}[name]
    top = (1 << 8 * width) - 1
    bits = np.array([0, 1 << (8 * width - 1), top] + [i * 0x9E3779B97F4A7C15 & top for i in range(3, 24)],
                    dtype=f"u{width}")
    t = torch.from_numpy(bits)
    return {"x": t.reshape(4, 6), "xt": t.reshape(4, 6).t()}


NEW_NAMES = ["fp64", "u16", "u32", "u64", *(["f8e8m0"] if hasattr(torch, "float8_e8m0fnu") else []),
             "f8e4m3fnuz", "f8e5m2fnuz", *(["f4e2m1x2"] if hasattr(torch, "float4_e2m1fn_x2") else [])]
# Computed once with `documented` (2026-12-05); they must never change for version 2 of the state hash.
NEW_ANSWERS = {
    "fp64": "blake3:476d2fa4e09be91362902ad04c17aaa1e3bac2c3a2647884cdd38ea2872846c2",
    "u16": "blake3:20a25be3de6919b70f44a63d0aa97e92433a6d22f113baeca1c8c6ae16ff332c",
    "u32": "blake3:a6658eea4c826fe24953b37a78a630418ca8dcc0dd14114b62d932f5afa405bf",
    "u64": "blake3:404182076972a883a973e78b36c2ce29c359dca26c1cca9b9413b01ccaac2b0c",
    "f8e8m0": "blake3:78e3dc4220a5c29c4cc647a73c44109424c69a08b24e3b989c3e9c5cde8daa2a",
    # 2026-12-07
    "f8e4m3fnuz": "blake3:3890a26accb28cb49b42912c31aab6f9da425dfbce094615a991f1d60cedc17d",
    "f8e5m2fnuz": "blake3:0331c3cf36b1be784684334e13865ebd79d02d9fa1d8a5f241bb61d3183039f4",
    "f4e2m1x2": "blake3:c6173025932be7610f8decb3cb84f62b40195c898bef3f7b4e103f015be68059",
}


@pytest.mark.parametrize("name", NEW_NAMES)
def test_each_new_dtype_has_a_known_answer_under_its_wire_name(name):
    state = new_dtype_state(name)
    assert state_hash(state) == documented(state, {"x": name, "xt": name}) == NEW_ANSWERS[name]
