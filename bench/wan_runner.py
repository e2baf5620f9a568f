"""What every system in the WAN bench is given and what it returns.

Owns: the payload (two consecutive served bf16 checkpoints of a generated model
and the real patch between them, cached on disk by parameters), the result of
one run (`RunResult`: times, bytes moved, ratios against the patch and the
lower bound), the fault schedule (`Faults`: which nodes die and come back
when, whatever the system), the runner interface every system implements, the exception
that says a system cannot run here, and reading line events from the
processes a runner starts. Must not build networks (bench/netemu.py) or know
any one system (bench/wan_libtorrent.py, bench/wan_patchswarm.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import select
import shutil
import subprocess
import time
import sys
from pathlib import Path
from typing import Protocol

import numpy as np

from bench.netemu import Counters, Topology, WanSpec

PAYLOAD_CACHE = Path("/tmp/patchswarm-wan-payload")


class SystemUnavailable(RuntimeError):
    """A system cannot run here (not installed, not built yet); the message says why."""


class RunFailed(RuntimeError):
    """A system ran but did not deliver the payload to every node in time."""


@dataclasses.dataclass(frozen=True)
class Payload:
    """Version 0 and version 1 of a served model, and the patch between them."""

    base: Path            # version 0, .safetensors (bf16)
    target: Path          # version 1
    patch: Path           # protocol.patch.diff(base, target).to_bytes()
    patch_bytes: int
    label: str            # e.g. "medium lr=0.01 seed=0"


def make_payload(model: str = "medium", lr: float = 1e-2, seed: int = 0,
                 cache_root: Path = PAYLOAD_CACHE) -> Payload:
    """Generate (or reuse from `cache_root`) two consecutive served bf16 checkpoints and their patch.

    One RL step of tests/synthetic.py at `lr` after its warm-up. The checkpoints
    are cached in a directory keyed by the parameters (`meta.json` is written
    last, so a directory without it is regenerated); the patch is cached
    beside them per patch container version, so a codec change re-diffs the
    cached checkpoints instead of re-running the model.
    """
    from patchswarm.protocol.patch import FORMAT_VERSION

    d = Path(cache_root) / f"{model}-lr{lr:g}-seed{seed}-bf16"
    meta, patch = d / "meta.json", d / f"patch-v{FORMAT_VERSION}.bin"
    label = f"{model} lr={lr:g} seed={seed}"
    if not meta.exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import synthetic  # the test fixtures' generator; torch: only when a payload must be made
        from patchswarm.node import checkpoint

        d.mkdir(parents=True, exist_ok=True)
        (base, target), = synthetic.served_pairs(model, lr=lr, steps=1, seed=seed, dtype="bf16")
        checkpoint.save_state(base, d / "v0.safetensors")
        checkpoint.save_state(target, d / "v1.safetensors")
        raw = sum(t.numel() * t.element_size() for t in target.values())
        checkpoint.write_bytes_atomic(meta, json.dumps({"checkpoint_bytes": raw}).encode())
    if not patch.exists():
        from patchswarm.node import checkpoint
        from patchswarm.protocol.patch import diff

        base, target = (checkpoint.load_state(d / f"v{v}.safetensors")[0] for v in (0, 1))
        checkpoint.write_bytes_atomic(patch, diff(base, target).to_bytes())
    return Payload(d / "v0.safetensors", d / "v1.safetensors", patch, patch.stat().st_size, label)


@dataclasses.dataclass
class RunResult:
    """One system delivering one payload over one topology."""

    system: str
    spec: WanSpec
    patch_bytes: int
    seconds: float                      # published/announced -> the last node holds every byte, verified
    per_node_s: dict[str, float]        # host name -> seconds from the same start
    moved: Counters                     # byte counters over the timed window
    notes: list[str] = dataclasses.field(default_factory=list)
    applied_s: float | None = None      # -> the last node runs the new version (systems that apply)
    stall_s: dict[str, float] = dataclasses.field(default_factory=dict)  # host -> longest time without progress
    # (seconds since the announcement, the machine's busy CPU-s since boot, of them the
    # kernel's: system, irq, softirq), as sampled
    busy: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    cores: int = 1
    link_table: str = ""  # with a link trace (patchswarm): Mbit/s per interval of some hosts' links
    # Each node's own download limit, bytes/s (patchswarm's `--node-args "--download-limit X"`):
    # no system puts the patch on such a node faster than patch / limit, whatever the links.
    node_download_bps: float | None = None

    def busy_share(self, until_s: float, kernel: bool = False) -> float | None:
        """How busy the machine's cores were from the announcement until `until_s` (0..1; with
        `kernel`, busy in the kernel), the CPU-s interpolated between the samples around each
        end (None: no sample before the announcement or none after `until_s`)."""
        if not self.busy or not self.busy[0][0] <= 0 < until_s <= self.busy[-1][0]:
            return None
        t, busy, in_kernel = zip(*self.busy)
        start, end = np.interp([0.0, until_s], t, in_kernel if kernel else busy)
        return float(end - start) / (self.cores * until_s)

    def region_s(self, region: int) -> float | None:
        """When the last node of `region` held everything (None: no node of it is counted)."""
        times = [t for name, t in self.per_node_s.items() if name.startswith(f"n{region}.")]
        return max(times) if times else None

    def region_bound_s(self, region: int) -> float:
        return max(self.spec.region_bound_s(self.patch_bytes, region), self._download_bound_s())

    @property
    def bound_s(self) -> float:
        return max(self.spec.lower_bound_s(self.patch_bytes), self._download_bound_s())

    def _download_bound_s(self) -> float:
        return 0.0 if self.node_download_bps is None else self.patch_bytes / self.node_download_bps

    @property
    def time_over_bound(self) -> float:
        return self.seconds / self.bound_s

    @property
    def wan_in_over_patch(self) -> list[float]:
        return [b / self.patch_bytes for b in self.moved.wan_in]

    @property
    def origin_out_over_patch(self) -> float:
        return self.moved.host_tx["origin"] / self.patch_bytes


@dataclasses.dataclass(frozen=True)
class Faults:
    """Nodes that die mid-transfer: `kill_at` s after the clock starts, SIGKILL each
    victim (the runner is given them: one per region other than the origin's);
    `restart_at` s after it (None: never), start the first victim again on its data,
    as a supervisor would."""

    kill_at: float
    restart_at: float | None = None

    def label(self) -> str:
        return f"kill@{self.kill_at:g}s" + ("" if self.restart_at is None else f",restart@{self.restart_at:g}s")

    def events(self, victims: list[str]) -> list[tuple[float, str, str]]:
        """(seconds from the start, "kill" | "restart", node name), in time order."""
        out = [(self.kill_at, "kill", v) for v in victims]
        if self.restart_at is not None and victims:
            out.append((self.restart_at, "restart", victims[0]))
        return sorted(out, key=lambda e: e[0])


class Runner(Protocol):
    """A system under test. `run` starts its processes with `topo.spawn` (so they die with it)."""

    name: str

    def run(self, topo: Topology, payload: Payload, limit_s: float) -> RunResult: ...


class LineEvents:
    """Lines printed by several child processes, read as they come, with a deadline.

    Each child writes one event per line on stdout (e.g. `ready`, `done 12.3`).
    Reads the raw pipe with select (no buffering between select and read).
    """

    def __init__(self, procs: dict[str, subprocess.Popen]):
        self._by_fd = {p.stdout.fileno(): name for name, p in procs.items()}
        self._procs = dict(procs)
        self._partial = {name: b"" for name in procs}

    def drop(self, name: str) -> None:
        """Stop reading `name` (a process killed on purpose): its exit is no error, its unread lines are gone."""
        self._by_fd = {fd: n for fd, n in self._by_fd.items() if n != name}
        self._partial[name] = b""

    def add(self, name: str, proc: subprocess.Popen) -> None:
        """Read `proc` as `name` from now on (a process started again under a dropped name)."""
        self.drop(name)
        self._by_fd[proc.stdout.fileno()] = name
        self._procs[name] = proc

    def next(self, deadline: float) -> tuple[str, str] | None:
        """The next (name, line); None at the deadline. A child that exits is an error."""
        while True:
            for name, buf in self._partial.items():
                if b"\n" in buf:
                    line, rest = buf.split(b"\n", 1)
                    self._partial[name] = rest
                    return name, line.decode(errors="replace").strip()
            left = deadline - time.monotonic()
            if left <= 0 or not self._by_fd:
                return None
            ready, _, _ = select.select(list(self._by_fd), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                name = self._by_fd[fd]
                if not chunk:
                    del self._by_fd[fd]
                    code = self._procs[name].wait(timeout=5)
                    raise RunFailed(f"{name}: exited (code {code}) before the run ended")
                self._partial[name] += chunk

    def wait_all(self, names: set[str], word: str, deadline: float) -> dict[str, str]:
        """Wait until every name in `names` printed a line starting with `word`; name -> rest of line."""
        got: dict[str, str] = {}
        while set(got) != names:
            ev = self.next(deadline)
            if ev is None:
                missing = sorted(names - set(got))
                raise RunFailed(f"no {word!r} within the time limit from {len(missing)} of {len(names)}: {missing[:6]}")
            name, line = ev
            head, _, rest = line.partition(" ")
            if head == word and name in names:
                got[name] = rest
        return got


def log_tails(logs: Path, lines: int = 3) -> str:
    """The last `lines` lines of each `*.log` under `logs`, for an error message."""
    out = []
    for f in sorted(logs.glob("*.log")) if logs.exists() else []:
        tail = f.read_text(errors="replace").strip().splitlines()[-lines:]
        if tail:
            out.append(f"\n  {f.stem}: " + " | ".join(tail))
    return "".join(out)


def keep_logs(dest_root: Path | None, logs: Path, run_name: str) -> Path | None:
    """Copy a run's log folder to dest_root/run_name-K, K = 1, 2, ... the first
    folder not there yet, so no run's logs replace another's (runs of one
    system, of an earlier invocation); return it. No-op (None) without dest_root."""
    if dest_root is None or not logs.exists():
        return None
    Path(dest_root).mkdir(parents=True, exist_ok=True)
    for k in itertools.count(1):
        dest = Path(dest_root) / f"{run_name}-{k}"
        try:
            dest.mkdir()  # claims the name: no other run copies into it
        except FileExistsError:
            continue
        shutil.copytree(logs, dest, dirs_exist_ok=True)
        return dest
