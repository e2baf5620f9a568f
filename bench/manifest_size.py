"""What one version's manifest costs at model scale, form 1 against form 2, side by side.

    .venv/bin/python bench/manifest_size.py [--tensors 1000,20000,140000] [--shards 163] [--repeat 3]

Per tensor count: an fp8 MoE's tensor table (expert weights and their fp32 scales, names as
long as real ones), read from a directory of `--shards` shard files (so every manifest has a
name -> shard layout), one patch version of a ~5 GB patch (600 chunks of 8 MiB) that writes no
tensor whole, and the keyframe. Columns: the signed Announce's bytes (against the 16 MiB wire
frame: `no` where it does not fit), what a node spends per patch version on it (signature
check and decode, then rebuilding the Patch against its base table: the best of `--repeat`),
and the keyframe's bytes and signature check and decode (what node/net/manifestcheck.py
moves off the event loop), and what a node past that keyframe spends refusing a copy of its
manifest (a peer passing it on again, or a member replaying old ones: `VersionBook.offer`), and
what holding the keyframe's verified manifest costs in memory (tracemalloc: the envelope and
the decoded manifest, what a book held for each old keyframe it took).
Sizes repeat exactly; times are one core's.
"""

from __future__ import annotations

import argparse
import hashlib
import time
import tracemalloc

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol import wire
from patchswarm.protocol.manifest import sign_manifest, verify_manifest
from patchswarm.protocol.patch import Patch, TensorSpec
from patchswarm.protocol.errors import StaleVersion
from patchswarm.protocol.publication import manifest_of, patch_of
from patchswarm.protocol.versions import VersionBook

CHUNKS, CHUNK_BYTES = 600, 8 << 20


def moe_table(n: int) -> list[TensorSpec]:
    """`n` tensors of a 61-layer fp8 MoE: gate/up/down weights and a scale per expert, in name order."""
    rows = [TensorSpec(f"model.layers.{i % 61}.mlp.experts.{i // 61}.{w}", d, s)
            for i in range(-(-n // 4))
            for w, d, s in (("gate_proj.weight", "float8_e4m3fn", (2048, 7168)),
                            ("up_proj.weight", "float8_e4m3fn", (2048, 7168)),
                            ("down_proj.weight", "float8_e4m3fn", (7168, 2048)),
                            ("down_proj.weight_scale_inv", "float32", (56, 16)))][:n]
    return sorted(rows, key=lambda t: t.name)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(n: int, shards: int, repeat: int) -> list[dict]:
    tensors = moe_table(n)
    layout = {t.name: f"model-{i * shards // n + 1:05d}-of-{shards:05d}.safetensors" for i, t in enumerate(tensors)}
    target = "blake3:" + "2" * 64
    patch = Patch(kind="patch", base_hash="blake3:" + "1" * 64, target_hash=target, tensors=tensors, full=[],
                  removed=[], chunks=[], layout=layout)
    key = Patch(kind="keyframe", base_hash=None, target_hash=target, tensors=tensors, full=[t.name for t in tensors],
                removed=[], chunks=[], layout=layout)
    table = [(CHUNK_BYTES, hashlib.sha256(i.to_bytes(8, "big")).digest()) for i in range(CHUNKS)]
    sk = Ed25519PrivateKey.generate()
    pk = sk.public_key()
    out = []
    for form in (1, 2):
        args = dict(swarm_id="bench", version=7, created_at=0.0, chunk_table=table, form=form, compact=form == 1)
        envelope = sign_manifest(manifest_of(patch, **args), sk)
        size = len(wire.encode(wire.Announce(envelope)))
        m = verify_manifest(envelope, pk)
        chunks = [b""] * CHUNKS
        kf_envelope = sign_manifest(manifest_of(key, **args), sk)
        kf = len(wire.encode(wire.Announce(kf_envelope)))
        out.append({"tensors": n, "form": form, "patch_bytes": size, "fits": size <= wire.MAX_FRAME_BYTES,
                    "verify_s": best(lambda: verify_manifest(envelope, pk), repeat),
                    "patch_of_s": best(lambda: patch_of(m, chunks, tensors), repeat),
                    "keyframe_bytes": kf, "kf_fits": kf <= wire.MAX_FRAME_BYTES,
                    "kf_verify_s": best(lambda: verify_manifest(kf_envelope, pk), repeat),
                    "kf_stale_s": best(lambda: refuse_stale(VersionBook("bench", pk), kf_envelope), repeat),
                    "kf_held_mb": held_bytes(kf_envelope, pk) / 1e6})
    return out


def held_bytes(envelope: bytes, pk) -> int:
    """Bytes a book holding this keyframe's manifest keeps: a copy of its envelope and the
    decoded manifest."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        book = VersionBook("bench", pk)
        book.offer(bytes(envelope))
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def refuse_stale(book: VersionBook, envelope: bytes) -> None:
    try:
        book.offer(envelope, 8)  # the node is past version 7
    except StaleVersion:
        return
    raise AssertionError("a stale manifest was not refused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", default="1000,20000,140000", help="tensor counts, comma-separated")
    ap.add_argument("--shards", type=int, default=163)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    print(f"patch version: {CHUNKS} chunks of {CHUNK_BYTES >> 20} MiB, no tensor written whole; "
          f"{a.shards} shard files; wire frame {wire.MAX_FRAME_BYTES:,} bytes")
    print("tensors | form | patch manifest bytes | fits | verify+decode s | patch_of s | keyframe bytes | fits | "
          "keyframe verify+decode s | stale keyframe refused s | keyframe held MB")
    for n in (int(x) for x in a.tensors.split(",")):
        rows = measure(n, a.shards, a.repeat)
        for r in rows:
            print(f"{r['tensors']:,} | {r['form']} | {r['patch_bytes']:,} | {'yes' if r['fits'] else 'no'} | "
                  f"{r['verify_s']:.3f} | {r['patch_of_s']:.3f} | {r['keyframe_bytes']:,} | "
                  f"{'yes' if r['kf_fits'] else 'no'} | {r['kf_verify_s']:.3f} | {r['kf_stale_s']:.6f} | "
                  f"{r['kf_held_mb']:.1f}")
        one, two = rows
        print(f"  {n:,} tensors: form 2's patch manifest is {one['patch_bytes'] / two['patch_bytes']:.0f}x smaller, "
              f"{(one['verify_s'] + one['patch_of_s']) / (two['verify_s'] + two['patch_of_s']):.0f}x less time a version")


if __name__ == "__main__":
    main()
