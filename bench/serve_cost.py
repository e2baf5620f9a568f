"""Honest serving cost: one peer fetches N distinct 1 MiB chunks one after another, twice,
from a node's PeerSet over a memory stream with a real ObjectStore (what a seeder does for
the members of its region). Prints, per repeat, the chunks a second and the CPU (all threads)
per chunk of each pass: the second pass is served from the chunks kept since the first
(node/store.py SERVED_KEPT_BYTES) while they fit.

    .venv/bin/python bench/serve_cost.py [--chunks 64] [--kept BYTES] [--repeat 3]

`--kept 0` turns the kept chunks off (every chunk read and hashed again, as before
2026-12-06). Run it from a tree's root with that tree's venv to compare two trees."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memlink import store_with  # noqa: E402
from test_peer_budgets import _noop  # noqa: E402
from test_request_cancel import _fetch, _join  # noqa: E402

import patchswarm.node.store as store_module  # noqa: E402
from patchswarm.node.net.ratelimit import TokenBucket  # noqa: E402
from patchswarm.node.peers import PeerSet  # noqa: E402

CHUNK = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--kept", type=int, default=None, help="bytes of served chunks kept (default: the store's)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.kept is not None:
        store_module.SERVED_KEPT_BYTES = args.kept
    chunks = [os.urandom(CHUNK) for _ in range(args.chunks)]
    print(f"{args.chunks} chunks of 1 MiB, kept {store_module.SERVED_KEPT_BYTES:,} B")
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            peers = PeerSet("b", store_with(d, chunks), TokenBucket(None), _noop)
            passes = []

            async def run() -> None:
                async with trio.open_nursery() as nursery:
                    far = await _join(nursery, peers, "c")
                    for _ in range(2):
                        t0, c0 = time.perf_counter(), time.process_time()
                        for c in range(args.chunks):
                            with trio.fail_after(30):
                                await _fetch(far, c)
                        passes.append((time.perf_counter() - t0, time.process_time() - c0))
                    nursery.cancel_scope.cancel()

            trio.run(run)
        print("  ".join(f"pass {i + 1}: {args.chunks / wall:.0f} chunks/s, {cpu * 1e3 / args.chunks:.2f} ms CPU a chunk"
                        for i, (wall, cpu) in enumerate(passes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
