"""What checking a batch's meta maps costs the origin: an adversarial batch and an honest one.

A node uploads records in lz4-compressed batches (protocol/trajectory.py
`decode_batch`); the origin checks each record's meta map (depth, no ext type,
hashable keys, UTF-8) before it stores it. Rows, each `decode_batch` timed
(best of `--repeat`, CPU ms of this thread) with `packed_meta=True` (the
origin's path) and without (a node's spool scan and the local API build metas):

- tiny-containers: 12 MiB of records whose metas are 64 KiB of empty arrays
  (`{"k": [[], [], ...]}`): the most values per byte a meta can hold, and what
  lz4 squeezes to a few dozen KB on the wire.
- fixint-arrays: metas of arrays of 15 fixints each (0x9f 0x01 ...).
- honest: 64 records of 16 KiB payloads with small metas (a few str/float keys).

    .venv/bin/python bench/meta_check.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patchswarm.protocol import packreader  # noqa: E402
from patchswarm.protocol.trajectory import (MAX_BATCH_BYTES, MAX_META_BYTES, Record, decode_batch,  # noqa: E402
                                            encode_batch, pack_meta)


def _fill(meta: dict) -> list[Record]:
    packed = pack_meta(meta)
    n = MAX_BATCH_BYTES // (len(packed) + 64)
    return [Record("node-a", "r", i, 1, 1.0, b"", packed) for i in range(n)]


def tiny_containers() -> list[Record]:
    return _fill({"k": [[]] * (MAX_META_BYTES - 16)})


def fixint_arrays() -> list[Record]:
    return _fill({"k": [[1] * 15] * ((MAX_META_BYTES - 16) // 16)})


def honest() -> list[Record]:
    payload = bytes(8 << 10) + bytes(range(256)) * 32
    return [Record("node-a", "r", i, 1, 1.0, payload, pack_meta({"env": "cartpole", "return": 12.5, "steps": 200}))
            for i in range(64)]


def timed(data: bytes, packed_meta: bool, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        decode_batch(data, packed_meta=packed_meta)
        best = min(best, time.thread_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    kernel = getattr(packreader, "KERNEL", None)
    print(f"compiled meta check: {'yes' if kernel is not None else 'no'}")
    print(f"{'batch':<16} {'records':>7} {'raw MB':>7} {'wire KB':>8} {'origin ms':>10} {'built ms':>9} {'us/wire B':>9}")
    for name, make in (("tiny-containers", tiny_containers), ("fixint-arrays", fixint_arrays), ("honest", honest)):
        records = make()
        data = encode_batch(records)
        raw = sum(len(bytes(r.meta)) + len(r.payload) for r in records)
        origin = timed(data, True, args.repeat)
        built = timed(data, False, args.repeat)
        print(f"{name:<16} {len(records):>7} {raw / 1e6:>7.1f} {len(data) / 1e3:>8.1f} {origin * 1e3:>10.2f} {built * 1e3:>9.1f} "
              f"{origin / len(data) * 1e6:>9.2f}")


if __name__ == "__main__":
    main()
