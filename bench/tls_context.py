"""What a dial's TLS client context costs: built anew (`trust.client_context`, every dial
before 2026-12-06) against found in the cache (`trust.dial_context`: a stat of the
certificate, key and CA files).

    .venv/bin/python bench/tls_context.py [--repeat 3]"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from patchswarm.node.net import trust


def _per_call_us(fn, creds, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn(creds)
    return (time.perf_counter() - t) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        swarm = Path(d) / "swarm"
        trust.init_swarm(swarm)
        trust.issue(swarm, "n1", "node", Path(d) / "n1")
        creds = trust.Credentials.load(Path(d) / "n1")
        trust.dial_context(creds)
        for _ in range(args.repeat):
            print(f"built: {_per_call_us(trust.client_context, creds, 300):.0f} us a dial; "
                  f"cached: {_per_call_us(trust.dial_context, creds, 3000):.1f} us a dial")
    return 0


if __name__ == "__main__":
    sys.exit(main())
