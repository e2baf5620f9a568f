"""Hand-off bench, sparse half: what an engine that holds the weights in memory pays per version.

For a synthetic served checkpoint of each size (`scaled_served_versions` in
tests/synthetic.py: bf16 matrices with ~0.75 % of elements changed per
version, fp8 e4m3 matrices with 0.05 % changed and half of their fp32 block
scales, bf16 norms) and each version after it:

- the node's apply, as the daemon runs it (node/applier.py): the patch
  applied in place with the change recorder writing `changes/<v>.chg`
  (node/changelog.py), including apply's full state-hash check; "rec s" is
  the part of it spent in the recorder (encoding and writing the file);
- the hand-off: `NodeClient.follow` in this process (the engine) against the
  node's local-socket code (`serve_local` + `LocalRequests` + `Changelog`)
  in a separate process, from the request to the last change written into
  the engine's copy; bytes moved are the change stream's bytes;
- then (untimed) the engine's copy is hashed and must equal the version's
  state hash, or the bench aborts;
- "copy s": the whole state copied from the node's tensors into the engine's
  (`copy_` per tensor, then a device synchronize): the floor of any hand-off
  that reloads the weights, with the file already read into memory.

`--device cuda` keeps the engine's copy in GPU memory (the node's state stays in
host memory, as on a node host): the hand-off then moves only the changed
elements to the device, and "copy s" is a host-to-device copy of the whole state.

Targets (issue 20): bytes moved <= 8 per changed element; hand-off time <=
2x the node's apply.

Run: `python bench/handoff.py [--sizes 1,2] [--versions 3] [--device cpu|cuda] [--json rows.json]`
(sizes in GiB; needs about 3x the largest size in host memory, and 1x on the GPU with --device cuda).
Importing this module does no work.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "tests"))  # the fixtures' generator (tests/synthetic.py)


def serve(directory: Path, sock: Path, version: int, state_hash: str) -> None:
    """The node's side of the hand-off: its local socket over the change log in `directory`;
    the node's version is the newest file's (or `version`/`state_hash` before any)."""
    import trio

    from patchswarm.node.changelog import Changelog
    from patchswarm.node.localapi import LocalRequests, serve_local
    from patchswarm.node.spool import TrajectorySpool

    log = Changelog(directory)

    def status() -> dict:
        vs = log.versions()
        h = log.header(vs[-1]) if vs else None
        return {"version": version if h is None else h.target_version,
                "state_hash": state_hash if h is None else h.target_hash, "weights_path": str(directory / "none")}

    async def main():
        async with await TrajectorySpool.open(directory.parent / "spool", "bench", "r") as spool:
            handle = LocalRequests(status, None, lambda: status()["version"], spool, changelog=log)
            await serve_local(sock, handle)

    trio.run(main)


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def _synchronize(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bench_size(gib: float, versions: int, tmp: Path, device: str = "cpu") -> list[dict]:
    from patchswarm.node.changelog import Changelog
    from patchswarm.node.client import NodeClient
    from patchswarm.protocol.patch import apply, diff
    from patchswarm.protocol.statehash import state_hash, state_hash_any_device
    from synthetic import scaled_served_versions

    work = tmp / f"{gib:g}gib"
    changes = work / "changes"
    log = Changelog(changes)
    sock = work / "node.sock"
    gen = scaled_served_versions(gib, versions)
    t0 = time.perf_counter()
    source, _ = next(gen)
    node = clone(source)
    engine = {k: v.to(device, copy=True) for k, v in source.items()}
    del source
    _synchronize(device)
    at = (0, state_hash(node))
    print(f"# {gib:g} GiB: generated in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(changes), str(sock), str(at[0]), at[1]],
                              cwd=_ROOT)
    rows = []
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the node's socket did not appear at {sock}")
            time.sleep(0.05)
        with NodeClient(sock) as client:
            for v in range(1, versions + 1):
                target, changed = next(gen)
                patch = diff(node, target)
                spent = [0.0]
                with log.recording(patch, at, v) as rec:
                    def recorder(name, pos, bits, rec=rec):
                        t = time.perf_counter()
                        rec(name, pos, bits)
                        spent[0] += time.perf_counter() - t

                    t0 = time.perf_counter()
                    apply(node, patch, undo=False, recorder=recorder)
                t_apply = time.perf_counter() - t0  # includes closing and renaming the change file
                stream_bytes = log.path(v).stat().st_size
                t0 = time.perf_counter()
                got = client.follow(engine, *at)
                t_handoff = time.perf_counter() - t0
                at = (v, patch.target_hash)
                if got != at or state_hash_any_device(engine) != at[1]:
                    raise SystemExit(f"{gib:g} GiB version {v}: the engine's copy is not the node's version")
                t0 = time.perf_counter()
                for k, t in engine.items():
                    t.copy_(node[k])
                _synchronize(device)
                t_copy = time.perf_counter() - t0
                numel = sum(t.numel() for t in node.values())
                row = {"device": device, "gib": gib, "version": v, "changed": changed, "changed_pct": 100 * changed / numel,
                       "patch_bytes": sum(map(len, patch.chunks)), "stream_bytes": stream_bytes,
                       "bytes_per_changed": stream_bytes / changed, "apply_s": t_apply, "record_s": spent[0],
                       "handoff_s": t_handoff, "handoff_per_apply": t_handoff / t_apply,
                       "copy_s": t_copy, "handoff_per_copy": t_handoff / t_copy}
                rows.append(row)
                print(f"# {gib:g} GiB version {v}: {row['bytes_per_changed']:.2f} B/changed, apply "
                      f"{t_apply:.2f} s, hand-off {t_handoff:.2f} s, copy {t_copy:.2f} s", file=sys.stderr, flush=True)
        for r in rows:
            r["server_peak_rss_mib"] = _peak_rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return rows


def _machine(device: str) -> str:
    import os

    import torch

    where = "host memory"
    if torch.device(device).type == "cuda":
        where = torch.cuda.get_device_name(device)
    return f"engine's copy in {where}; torch {torch.__version__}; {os.cpu_count()} CPUs"


def _peak_rss_mib(pid: int) -> float:
    """VmHWM of a live process (Linux), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


COLUMNS = [("device", "engine", "{}"), ("gib", "GiB", "{:g}"), ("version", "v", "{}"), ("changed", "changed", "{:,}"),
           ("changed_pct", "chg%", "{:.3f}"), ("patch_bytes", "patch B", "{:,}"),
           ("stream_bytes", "moved B", "{:,}"), ("bytes_per_changed", "B/chg", "{:.2f}"),
           ("apply_s", "apply s", "{:.3f}"), ("record_s", "rec s", "{:.3f}"), ("handoff_s", "hand-off s", "{:.3f}"),
           ("handoff_per_apply", "hand-off/apply", "{:.2f}"), ("copy_s", "copy s", "{:.3f}"),
           ("handoff_per_copy", "hand-off/copy", "{:.2f}")]


def print_table(rows: list[dict]) -> None:
    cells = [[fmt.format(r[k]) for k, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(COLUMNS)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(COLUMNS, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(Path(argv[1]), Path(argv[2]), int(argv[3]), argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2", help="comma-separated checkpoint sizes in GiB")
    ap.add_argument("--versions", type=int, default=3, help="versions after the first, per size")
    ap.add_argument("--device", default="cpu", help="where the engine keeps its copy: cpu, cuda, cuda:N")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="handoff-bench-") as tmp:
        for gib in [float(x) for x in args.sizes.split(",") if x.strip()]:
            rows += bench_size(gib, args.versions, Path(tmp), args.device)
    print(f"# {_machine(args.device)}")
    print_table(rows)
    worst_b = max(r["bytes_per_changed"] for r in rows)
    worst_t = max(r["handoff_per_apply"] for r in rows)
    print(f"worst: {worst_b:.2f} B per changed element (target <= 8), hand-off {worst_t:.2f}x the node's apply "
          f"(target <= 2); peak RSS: the node's local-socket process {max(r['server_peak_rss_mib'] for r in rows):.0f} MiB, "
          f"this process (generator, node state, engine copy) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"hand-off at most {max(r['handoff_per_copy'] for r in rows):.2f}x a copy of the whole state")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
