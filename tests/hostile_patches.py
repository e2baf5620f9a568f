"""Fabricated patches that declare more than their bytes hold, and a harness that measures what decoding them costs.

Each builder returns (op, base spec, patch bytes): real msgpack structures of
the patch format (patchformat.py) with one declared size made absurd: a class
of 2**29 elements, a Rice blob said to hold 2**28 values, a segment naming one
small tensor thousands of times, a full tensor of 2**48 elements, a tensor
table that inflates to 16 MiB of nested arrays, a chunk of a million nested
empty arrays. A correct decoder rejects each with an error from
protocol/errors.py, allocating in proportion to the bytes (or the base), not
to the number declared.

`measure` runs in a child process (`python tests/hostile_patches.py DIR`):
address space capped a few GB above the start so that a decoder that trusts a
declared size fails fast instead of taking the machine; per case it reports
the outcome, the peak of traced allocations (tracemalloc: numpy and Python
objects) and the growth of the peak RSS.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import tracemalloc
from pathlib import Path

import msgpack
import zstandard

HOLES, GAPS = 1, 0  # deltacode position modes
RANKED = 1
BLAKE = "blake3:" + "0" * 64
SAFETY_BYTES = 3 << 30  # address space allowed beyond what the child holds at the start


def _container(tensors, full, chunks, kind="patch", table_raw: bytes | None = None) -> bytes:
    raw = table_raw if table_raw is not None else msgpack.packb([[n, d, list(s)] for n, d, s in tensors], use_bin_type=True)
    return msgpack.packb({
        "format": "patchswarm", "v": 2, "kind": kind, "base": None if kind == "keyframe" else BLAKE, "target": BLAKE,
        "tensors": zstandard.ZstdCompressor(level=3).compress(raw), "full": full, "removed": [], "layout": None,
        "chunks": chunks,
    }, use_bin_type=True)


def _chunk(segs, old: bytes = b"\0" * 16, new: bytes = b"\0" * 16) -> bytes:
    return msgpack.packb({"s": segs, "o": old, "n": new}, use_bin_type=True)


def _digest(raw: bytes) -> bytes:
    """A chunk digest (patchformat.chunk_digest) of these little-endian bytes."""
    return hashlib.sha256(raw).digest()[:16]


def _delta(pieces, window, rows, streams) -> dict:
    return {"k": "d", "dt": "bf16", "p": pieces, "w": window, "c": rows, "s": streams}


def _row(m, n, mode):
    return [m, n, mode, 0, RANKED, 0, 0, 0, b"\x00"]


ONE_GAP = [b"\x00", b"", b"", b"", b"", b""]  # a Rice blob of one value 0 (k = 0), nothing else
W = [("w", "bf16", (8192,))]  # the base: one bf16 tensor of 8192 elements


def class_of_holes():
    """A class said to hold 2**29 elements, all changed but one (HOLES: one Rice value)."""
    n = 1 << 29
    return "apply", W, _container(W, [], [_chunk([_delta([[0, 0, 8192]], [120, 2], [_row(n - 1, n, HOLES), [0]], ONE_GAP)])])


def rice_count():
    """A class said to change 2**28 elements, with a one-byte Rice blob."""
    n = 1 << 28
    return "apply", W, _container(W, [], [_chunk([_delta([[0, 0, 8192]], [120, 2], [_row(n, n, GAPS), [0]], ONE_GAP)])])


def repeated_pieces():
    """One segment naming the 8192-element tensor 4096 times: 33.5 M elements of 'base'."""
    pieces = [[0, 0, 8192]] * 4096
    size = 8192 * len(pieces)
    return "apply", W, _container(W, [], [_chunk([_delta(pieces, [0, 1], [_row(size - 1, size, HOLES)], ONE_GAP)])])


def full_tensor_of_2_48():
    """A keyframe whose one tensor has 2**48 elements; its only segment holds four (with
    the right digests: the decode passes, the allocation comes next)."""
    t = [("w", "bf16", (1 << 24, 1 << 24))]
    seg = {"k": "f", "dt": "bf16", "p": [[0, 0, 4]], "pl": [[0, b"\0" * 4], [0, b"\0" * 4]]}
    return "apply", [], _container(t, ["w"], [_chunk([seg], _digest(b""), _digest(b"\0" * 8))], kind="keyframe")


def full_segment_count():
    """A full segment said to cover 2**27 elements, with two empty raw planes."""
    t = [("w", "bf16", (1 << 27,))]
    seg = {"k": "f", "dt": "bf16", "p": [[0, 0, 1 << 27]], "pl": [[0, b""], [0, b""]]}
    return "apply", [], _container(t, ["w"], [_chunk([seg])], kind="keyframe")


def table_of_nested_arrays():
    """A tensor table that inflates from ~1 KB to 16 MiB of empty arrays."""
    n = 16 << 20
    raw = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    return "inspect", [], _container([], [], [], table_raw=raw)


def chunk_of_nested_arrays():
    """A chunk of a million empty arrays where its segments should be (a patch of ~1 MB)."""
    n = (1 << 20) - 512
    chunk = b"\x83\xa1s\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\xa1o\xc4\x10" + b"\0" * 16 + b"\xa1n\xc4\x10" + b"\0" * 16
    return "inspect", [], _container([], [], [chunk])


CASES = {f.__name__: f for f in (class_of_holes, rice_count, repeated_pieces, full_tensor_of_2_48, full_segment_count,
                                 table_of_nested_arrays, chunk_of_nested_arrays)}


def write_cases(folder: Path) -> None:
    for name, build in CASES.items():
        op, base, data = build()
        (folder / f"{name}.patch").write_bytes(data)
        (folder / f"{name}.json").write_text(json.dumps({"op": op, "base": base}))


def _vm_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()


def measure(folder: Path) -> dict:
    """Decode every case in `folder` (this process); outcome, traced peak and RSS growth per case."""
    import torch

    from patchswarm.protocol.errors import PatchswarmError
    from patchswarm.protocol.patch import Patch, apply

    limit = _vm_bytes() + SAFETY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = {}
    for spec in sorted(folder.glob("*.json")):
        case = json.loads(spec.read_text())
        data = spec.with_suffix(".patch").read_bytes()
        gen = torch.Generator().manual_seed(0)
        state = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, _, s in case["base"]}
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        try:
            patch = Patch.from_bytes(data)
            if case["op"] == "apply":
                apply(state, patch)
            else:
                patch.stats()
            outcome = "valid"
        except PatchswarmError as e:
            outcome = f"clean {type(e).__name__}: {str(e)[:120]}"
        except BaseException as e:  # noqa: BLE001 - what the harness is here to find
            outcome = f"crash {type(e).__name__}: {str(e)[:120]}"
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
        out[spec.stem] = {"bytes": len(data), "outcome": outcome, "traced_peak": peak, "rss_growth": grown}
    return out


if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1]))))
