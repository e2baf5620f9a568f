"""Every decoder of outside bytes, as a fuzz target: the inputs (hypothesis strategies) and what is run.

Targets (issue 21): a patch (`Patch.from_bytes`, `stats`, `apply` to a small base),
a signed manifest (`verify_manifest`, `decode_manifest`), peer wire frames
(`wire.Connection` after a valid Hello, fed in pieces), local-socket frames
(`FrameBuffer` + `localapi.decode_request` + `check_request`, as the node reads
them), trajectory segments and upload batches (`scan_records`, `decode_record`, `decode_batch`).

Inputs mix raw bytes, any msgpack value, and valid encodings mutated (bits
flipped, bytes cut or inserted, hostile msgpack headers spliced in: huge
lengths, deep nesting). `run(target, data)` returns "valid" or "error" (a
PatchswarmError, the only kind a decoder may raise for bad bytes); anything
else it lets through is a crash. Used by tests/test_fuzz_decoders.py (a few
examples each) and bench/fuzz.py (many, with a table).
"""

from __future__ import annotations

import functools
import tracemalloc

import hypothesis.strategies as st
import msgpack
import torch
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol import localapi, trajectory, wire
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.manifest import (Manifest, decode_manifest, encode_manifest, key_of, peek_key, sign_manifest,
                                          verify_manifest)
from patchswarm.protocol.patch import Patch, apply, diff, keyframe

# Spliced into valid encodings: lengths that claim what the bytes do not hold, and nesting.
HOSTILE = [
    b"\xdd\xff\xff\xff\xff", b"\xdd\x00\x10\x00\x00", b"\xdf\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
    b"\xdb\x00\x01\x00\x00", b"\xc5\xff\xff", b"\x91" * 200, b"\x81\xa1a" * 100, b"\xd4\x01\x00", b"\xc1",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00", b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",
]
MEMORY_BUDGET = 32 << 20  # traced peak per input, for inputs of at most a few KB


@functools.lru_cache(maxsize=None)
def _key():
    return Ed25519PrivateKey.generate()


@functools.lru_cache(maxsize=None)
def _base() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 8, generator=gen).to(torch.bfloat16), "b": torch.randn(16, generator=gen).to(torch.bfloat16)}


def _target() -> dict:
    t = {k: v.clone() for k, v in _base().items()}
    t["w"][3, :5] += 1
    t["b"][7] = 0.5
    return t


@functools.lru_cache(maxsize=None)
def seeds(target: str) -> tuple[bytes, ...]:
    """Valid encodings for `target`, to mutate."""
    if target == "patch":
        return (diff(_base(), _target()).to_bytes(), keyframe(_target()).to_bytes())
    if target == "manifest":
        m = Manifest(swarm_id="sw", version=2, base_version=1, base_hash="blake3:" + "00" * 32,
                     target_hash="blake3:" + "11" * 32, tensors=[("w", "bf16", (64, 8))],
                     chunks=[(100, bytes(32)), (7, bytes(range(32)))], codec={"format": 1}, created_at=1.5)
        m2 = Manifest(swarm_id="sw", version=2, base_version=1, base_hash="blake3:" + "00" * 32,
                      target_hash="blake3:" + "11" * 32, tensors=[("w", "bf16", (64, 8))], chunks=[(100, bytes(32))],
                      codec={"format": 2, "removed": ["v"], "layout": {"files": ["a.safetensors"],
                                                                        "rows": zstandard.compress(b"\0\0\xff\xff")}},
                      created_at=1.5, form=2)
        return (sign_manifest(m, _key()), encode_manifest(m), sign_manifest(m2, _key()), encode_manifest(m2))
    if target == "wire":
        msgs = [wire.Have(3, False, b"\x05"), wire.HaveOne(3, True, 9), wire.Request(3, False, 1),
                wire.Piece(3, False, 1, 0, 4, b"abcd"), wire.PeerList([{"id": "n", "region": "r", "addr": "h:1", "role": "node"}]),
                wire.Heartbeat([1, 2]), wire.TrajectoriesAck([1, 5]), wire.Reject(3, False, 1, "no"), wire.Bye("x")]
        return tuple(wire.encode(m) for m in msgs) + (b"".join(map(wire.encode, msgs)),)
    if target == "local":
        recs = [[b"p", 2, None], [b"q" * 40, 3, {"env": "x"}]]
        return (localapi.encode(localapi.status_request()), localapi.encode(localapi.wait_version_request(3, 1.0)),
                b"".join(localapi.submit_frame_parts(recs, 1.0)))
    if target == "trajectory":
        recs = [trajectory.Record("n1", "eu", s, 2, 0.5, b"payload", {"k": [1, 2.5]} if s % 2 else None) for s in range(3)]
        segment = trajectory.segment_header() + b"".join(trajectory.encode_entry(trajectory.encode_record(r)) for r in recs)
        return (segment, trajectory.encode_batch(recs), trajectory.encode_record(recs[1]))
    raise KeyError(target)


TARGETS = ("patch", "manifest", "wire", "local", "trajectory")


@st.composite
def _mutated(draw, target: str) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds(target))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "cut", "insert", "hostile", "set")))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            data[min(pos, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "hostile":
            data[pos:pos + draw(st.integers(0, 8))] = draw(st.sampled_from(HOSTILE))
        elif data:
            data[min(pos, len(data) - 1)] = draw(st.integers(0, 255))
    return bytes(data)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), inner, max_size=4),
    max_leaves=20)


def inputs(target: str):
    """Bytes to feed `target`: mostly mutated valid encodings, some raw bytes and msgpack values."""
    packed = _values.map(lambda v: msgpack.packb(v, use_bin_type=True))
    framed = packed.map(lambda b: len(b).to_bytes(4, "big") + b)
    return st.one_of(_mutated(target), _mutated(target), _mutated(target), st.binary(max_size=512), packed, framed)


# ------------------------------------------------------------------ what each target runs


def _patch(data: bytes) -> None:
    patch = Patch.from_bytes(data)
    patch.stats()
    state = {k: v.clone() for k, v in _base().items()} if patch.kind != "keyframe" else {}
    apply(state, patch)


def _manifest(data: bytes) -> None:
    """As a signed envelope, else as the manifest's bytes alone. The envelope's first fields
    (`peek_key`, read before any check to refuse old ones) never raise, and name the object
    the signed manifest is wherever it verifies."""
    peeked = peek_key(data)
    try:
        m = verify_manifest(data, _key().public_key())
    except PatchswarmError:
        decode_manifest(data)
    else:
        assert peeked == key_of(m), (peeked, key_of(m))


def _wire(data: bytes) -> None:
    conn = wire.Connection()
    conn.receive_data(wire.encode(wire.Hello("n", "r", "node", "h:1", [])))
    cut = len(data) // 3
    for piece in (data[:cut], data[cut:], b""):
        if piece:
            conn.receive_data(piece)
        else:
            conn.receive_data(b"")  # EOF
        for _ in range(len(data) + 2):  # each frame is at least 4 bytes
            event = conn.next_event()
            if event is wire.NEED_DATA or event is wire.CLOSED:
                break


def _local(data: bytes) -> None:
    frames = wire.FrameBuffer(localapi.MAX_FRAME_BYTES)
    frames.receive_data(data)
    frames.receive_data(b"")
    for _ in range(len(data) + 1):
        body = frames.next_body()
        if body is wire.CLOSED or body is wire.NEED_DATA:
            break
        localapi.check_request(localapi.decode_request(body))


def _trajectory(data: bytes) -> None:
    """Scanned as a segment (damage is reported, not raised); then decoded as what its first
    bytes say: an upload batch, a segment (valid once scanned), else one entry body."""
    scan = trajectory.scan_records(data)
    for problem in scan.problems:
        str(problem)
    if data[:4] == trajectory.BATCH_MAGIC:
        trajectory.decode_batch(data)
    elif data[:4] != trajectory.SEGMENT_MAGIC[:4]:
        trajectory.decode_record(data)


_RUN = {"patch": _patch, "manifest": _manifest, "wire": _wire, "local": _local, "trajectory": _trajectory}


def run(target: str, data: bytes) -> str:
    """'valid' or 'error' (a PatchswarmError); anything else propagates: a crash."""
    try:
        _RUN[target](data)
    except PatchswarmError:
        return "error"
    return "valid"


def run_traced(target: str, data: bytes) -> tuple[str, int]:
    """`run`, and the peak of traced allocations it made (tracemalloc must be started)."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    outcome = run(target, data)
    return outcome, tracemalloc.get_traced_memory()[1] - before
