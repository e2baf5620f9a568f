"""What a member's restart costs in reading its object store, by the store's size.

For each size in `--sizes` (GiB), writes one object into a fresh store under
`--work`: 1 MiB chunks of random bytes and a manifest over them signed by a
fresh trainer key, as a member holds a keyframe it fetched. Then times
`ObjectStore(root).load(book)`, the call a node and the origin make at
start-up before they serve, `--repeat` times, and prints per size the chunks,
the best load time and the store's bytes over it. The chunks were just
written, so the page cache holds them; `--drop-caches` (root) empties it
before each load, as after a reboot, where whatever load reads comes from the
disk. To set two trees side by side, run this file with each tree's
interpreter: the package comes from the interpreter's install.

    .venv/bin/python bench/restart_cost.py [--sizes 0.5,2] [--repeat 3] [--drop-caches] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.store import ObjectStore
from patchswarm.protocol.manifest import Manifest, sign_manifest
from patchswarm.protocol.versions import VersionBook

SWARM = "restart-bench"
CHUNK = 1 << 20


def _write_store(root: Path, gib: float, trainer: Ed25519PrivateKey) -> int:
    """One signed keyframe object of `gib` GiB in a fresh store at `root`, written the way the
    origin writes one (`ObjectStore.writer`: chunk files, then the manifest); its chunk count."""
    n = max(1, int(gib * (1 << 30)) // CHUNK)
    block = os.urandom(CHUNK)
    writer = ObjectStore(root).writer((1, True))
    for i in range(n):
        writer.add(i.to_bytes(8, "little") + block[8:])  # each chunk differs, as a keyframe's do
    m = Manifest(swarm_id=SWARM, version=1, base_version=None, base_hash=None, target_hash="blake3:" + "11" * 32,
                 tensors=[], chunks=writer.table, codec={"format": 1}, created_at=0.0)
    writer.finish(sign_manifest(m, trainer))
    return n


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5,2", help="store sizes in GiB, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="loads per size (the best is shown)")
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each load (root)")
    ap.add_argument("--work", help="where the stores are written (default: a temporary folder)")
    args = ap.parse_args()
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes: expected GiB as numbers separated by commas, found {args.sizes!r}")
    if not sizes or min(sizes) <= 0 or args.repeat < 1:
        ap.error("--sizes: expected positive sizes; --repeat: at least 1")
    if args.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        ap.error("--drop-caches: /proc/sys/vm/drop_caches is not writable here (root only)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="psw-restart-"))
    trainer = Ed25519PrivateKey.generate()
    rows = []
    try:
        for gib in sizes:
            root = work / f"store-{gib:g}"
            shutil.rmtree(root, ignore_errors=True)
            print(f"writing a {gib:g} GiB store...", flush=True)
            n = _write_store(root, gib, trainer)
            times = []
            for _ in range(args.repeat):
                if args.drop_caches:
                    _drop_caches()
                book = VersionBook(SWARM, trainer.public_key())
                store = ObjectStore(root)
                t0 = time.perf_counter()
                dropped = store.load(book, None)
                times.append(time.perf_counter() - t0)
                if dropped or not store.complete((1, True)):
                    raise SystemExit(f"the store did not load whole: {dropped[:3]}")
            rows.append((gib, n, min(times), times))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    cache = "cold (page cache dropped before each load)" if args.drop_caches else "warm (chunks just written)"
    print(f"\n{'store GiB':>9}  {'chunks':>7}  {'load s (best)':>13}  {'GB/s':>7}  loads s")
    for gib, n, best, times in rows:
        print(f"{gib:>9g}  {n:>7,}  {best:>13.3f}  {n * CHUNK / 1e9 / best:>7.1f}  "
              + " ".join(f"{t:.3f}" for t in times))
    print(f"\n(ObjectStore.load of one signed object in 1 MiB chunks, page cache {cache}, "
          f"best of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
