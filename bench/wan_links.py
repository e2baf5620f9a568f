"""Per-link byte rates over time in the WAN bench's origin region: what each host sent and received, every 5 ms.

`bench/wan.py` counts bytes per link only at the start and end of a run; this
samples them during it, to see whether a link idles (issue 26: the origin's
uplink and the members' downlinks must be busy from the first byte to the
last for the origin's region to reach its bound). Two commands:

- `python bench/wan_links.py sample OUT SECONDS` (root): while it runs, every
  region-0 namespace a bench topology creates (`psw-*-r0`) gets one sampler
  process in it that appends `time iface rx tx` lines to OUT every 5 ms
  (`/proc/net/dev` of that namespace; the `h<k>` ports of the region's bridge:
  rx is what host k sent, tx what it received), and a `# ns NAME` line when a
  new topology appears. Run it beside a bench command, e.g.
  `python bench/wan_links.py sample /tmp/links.txt 300 & python bench/wan.py ... --logs DIR`.
- `python bench/wan_links.py table OUT RUN_DIR [K] [--bin S]`: the K-th topology
  in OUT (0-based, in the order the runs ran) against the run's logs (`--logs`
  folder of that run: the clock starts at the first node's "version 1
  announced" line), one row per bin: MB/s received / sent per host (for the
  origin, .250, what it sent), then each host's totals.

Counters are the kernel's per-interface bytes (GSO packets count their headers
once), sampled with the wall clock the daemons log with. Needs root and
iproute2; reads and writes nothing else. Importing this module does no work.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import os
import subprocess
import sys
import time

_INNER = r'''
import sys, time
end = time.time() + float(sys.argv[1])
while time.time() < end:
    try:
        text = open("/proc/net/dev").read()
    except OSError:
        break
    t = time.time()
    for line in text.splitlines()[2:]:
        name, rest = line.split(":", 1)
        f = rest.split()
        if name.strip().startswith("h"):
            sys.stdout.write(f"{t:.4f} {name.strip()} {f[0]} {f[8]}\n")
    sys.stdout.flush()
    time.sleep(0.005)
'''


def sample(out_path: str, seconds: float) -> None:
    """Start a sampler in every new psw-*-r0 namespace until `seconds` have passed."""
    end = time.time() + seconds
    seen: set[str] = set()
    procs: list[subprocess.Popen] = []
    with open(out_path, "a") as out:
        try:
            while time.time() < end:
                names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                       timeout=10).stdout.split()
                for ns in names:
                    if ns.startswith("psw-") and ns.endswith("-r0") and ns not in seen:
                        seen.add(ns)
                        out.write(f"# ns {ns}\n")
                        out.flush()
                        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _INNER,
                                                       str(max(1.0, end - time.time()))], stdout=out))
                time.sleep(0.5)
        finally:
            for p in procs:
                p.kill()
                p.wait()


def _announced_at(run_dir: str) -> float:
    times = []
    for path in glob.glob(os.path.join(run_dir, "n*.log")):
        with open(path) as f:
            times += [datetime.datetime.fromisoformat(line[:29]).timestamp() for line in f
                      if "version 1 announced" in line]
    if not times:
        raise SystemExit(f"{run_dir}: no 'version 1 announced' line in any n*.log")
    return min(times)


def table(out_path: str, run_dir: str, index: int, bin_s: float) -> str:
    series: dict[str, list[tuple[float, int, int]]] = collections.defaultdict(list)
    ns = -1
    with open(out_path) as f:
        for line in f:
            if line.startswith("#"):
                ns += 1
            elif ns == index:
                t, name, rx, tx = line.split()
                series[name].append((float(t), int(rx), int(tx)))
    if not series:
        raise SystemExit(f"{out_path}: no samples of topology {index}")
    t0 = _announced_at(run_dir)

    def at(name: str, t: float, col: int) -> int:
        rows = series[name]
        best = rows[0]
        for row in rows:
            if row[0] > t:
                break
            best = row
        return best[col]

    names = sorted(series, key=lambda n: int(n[1:]))
    lines = ["t s    " + "  ".join(f"{n + ' in/out':>12}" for n in names) + "   (MB/s; in: what the host received)"]
    end = max(rows[-1][0] for rows in series.values()) - t0
    t = -bin_s
    while t < min(end, 30.0):
        cells = [f"{(at(n, t0 + t + bin_s, 2) - at(n, t0 + t, 2)) / bin_s / 1e6:5.1f}/"
                 f"{(at(n, t0 + t + bin_s, 1) - at(n, t0 + t, 1)) / bin_s / 1e6:5.1f}" for n in names]
        lines.append(f"{t:5.2f}  " + "  ".join(f"{c:>12}" for c in cells))
        if all(c.strip() == "0.0/  0.0" for c in cells) and t > 1:
            break
        t += bin_s
    for n in names:
        lines.append(f"{n}: received {(at(n, t0 + end, 2) - at(n, t0 - bin_s, 2)) / 1e6:.2f} MB, "
                     f"sent {(at(n, t0 + end, 1) - at(n, t0 - bin_s, 1)) / 1e6:.2f} MB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out")
    s.add_argument("seconds", type=float)
    t = sub.add_parser("table")
    t.add_argument("out")
    t.add_argument("run_dir")
    t.add_argument("index", type=int, nargs="?", default=0)
    t.add_argument("--bin", type=float, default=0.1)
    args = ap.parse_args(argv)
    if args.cmd == "sample":
        sample(args.out, args.seconds)
    else:
        print(table(args.out, args.run_dir, args.index, args.bin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
