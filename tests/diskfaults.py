"""Full-disk scenarios on real processes, for tests/test_disk_full.py and bench/disk_full.py.

Each scenario starts a tracker, an origin (watching a checkpoint folder) and
one node on loopback (tests/swarmlab.py), with the node's or the origin's data
dir on a small tmpfs (tests/smalldisk.py), fills that disk at the step named,
checks the member stays up and says so (its log and status), frees the space,
and returns what a run must end with: the node's and origin's weights
bit-exact at the last version, every trajectory stored once (lost and
duplicated counted), and the temporaries left under the data dirs. Every wait
is bounded. Needs root (mount); callers check `smalldisk.available()` first.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from pathlib import Path

import torch

from patchswarm.node.client import NodeError
from patchswarm.node.trainer.trajstore import TrajectoryReader
from patchswarm.protocol import localapi
from patchswarm.protocol.trajectory import encode_payload

from smalldisk import SmallDisk, leftovers
from swarmlab import SwarmLab, load_weights, same_bits, write_checkpoint
from synthetic import rl_checkpoints, served

ORIGIN_ARGS = ["--chunk-bytes", "16384", "--segment-elements", "4096"]
DISK_BYTES = 4 << 20
WAIT_S = 120.0
RECORDS = 12
RECORD_BYTES = 20_000


@dataclasses.dataclass
class Outcome:
    fault: str
    survived: bool = False  # every member up throughout, the condition reported, and everything completed
    lost: int = 0  # versions not bit-exact at the end, plus trajectories missing from the origin's store
    duplicated: int = 0  # trajectories stored more than once
    leftovers: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""


def checkpoints() -> tuple[dict[str, torch.Tensor], ...]:
    return rl_checkpoints("tiny", 1e-5, 3)


def _poll(what: str, check, timeout: float = WAIT_S, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


def _records(origin) -> list[bytes]:
    d = origin.data_dir / "trajectories"
    return [r.payload for r in TrajectoryReader(d).iter_records()] if d.exists() else []


def _payloads(trial: int) -> list[bytes]:
    return [bytes([trial % 251, i]) * (RECORD_BYTES // 2) for i in range(RECORDS)]


def _submit_all(node, payloads: list[bytes]) -> tuple[int, list[bytes]]:
    """Submit each payload as a rollout worker would; returns (disk_full refusals, payloads refused)."""
    refused, left = 0, []
    with node.client() as c:
        for p in payloads:
            try:
                c.submit(p, 0, timeout=10)
            except NodeError as e:
                if e.code != localapi.DISK_FULL:
                    raise
                refused += 1
                left.append(p)
    return refused, left


def _count(sent: list[bytes], stored: list[bytes]) -> tuple[int, int]:
    want = collections.Counter(encode_payload(p)[0] for p in sent)
    have = collections.Counter(stored)
    lost = sum((want - have).values())
    dup = sum(max(0, have[k] - want[k]) for k in want) + sum(v for k, v in have.items() if k not in want)
    return lost, dup


@dataclasses.dataclass
class Run:
    """One scenario's swarm: a tracker, an origin watching `watch`, node `n`, one member on `disk`."""
    out: Outcome
    states: tuple
    expected: list
    watch: Path
    disk: SmallDisk
    lab: SwarmLab
    origin: object = None
    node: object = None

    def publish(self, *versions: int) -> None:
        for v in versions:
            write_checkpoint(self.watch, f"step{v:04d}.safetensors", self.states[v])

    def finish(self, version: int) -> Outcome:
        """Publish `version`, wait for it, and fill in what the run ended with."""
        out, lab = self.out, self.lab
        self.publish(version)
        lab.wait_version([self.node], version, timeout=WAIT_S)
        bad = [p.name for p in (self.node, self.origin) if not same_bits(load_weights(p), self.expected[version])]
        out.lost += len(bad)
        out.leftovers = [f"{self.disk.path.name}/{f}" for f in leftovers(self.disk.path)]
        out.survived = all(p.alive() for p in lab.procs) and not bad
        out.detail += f"; not bit-exact: {bad}" if bad else ""
        return out


@contextlib.contextmanager
def _swarm(root: Path, fault: str, on: str, node_extra=(), first_version: bool = True):
    """`on`: whose data dir ("n" or "origin") is the small disk. `first_version`: version 0
    reaches the node before the scenario starts."""
    states = checkpoints()
    expected = [served(s, torch.bfloat16) for s in states]
    with SmallDisk(root / on, DISK_BYTES) as disk, SwarmLab(root) as lab:
        run = Run(Outcome(fault), states, expected, root / "watch", disk, lab)
        lab.start_tracker()
        run.origin = lab.start_origin(watch=run.watch, extra=ORIGIN_ARGS, wait=False)
        run.node = lab.start_node("n", extra=list(node_extra), wait=False)
        lab.listening(run.origin, run.node)
        if first_version:
            run.publish(0)
            lab.wait_version([run.node], 0, timeout=WAIT_S)
        yield run


# ================================================================ scenarios


def node_chunk_writes(root: Path, trial: int = 0) -> Outcome:
    """The node's disk is full when the first version's chunks arrive."""
    with _swarm(root, "node disk full during chunk writes", "n", first_version=False) as run:
        run.disk.fill(leave=8192)
        run.publish(0)
        run.lab.wait_log(run.node, r"disk full: could not write (chunk|the manifest)", timeout=WAIT_S)
        st = run.node.status()
        assert st["disk_full"] and st["version"] is None, st
        assert any(p["role"] == "origin" for p in st["peers"]), f"the origin stays a peer: {st['peers']}"
        run.disk.free()
        run.lab.wait_version([run.node], 0, timeout=WAIT_S)
        run.finish(1)
        assert not run.node.status()["disk_full"]
    return run.out


def node_base_write(root: Path, trial: int = 0) -> Outcome:
    """The node's disk holds the first version's chunks but not its base (the state written whole)."""
    with _swarm(root, "node disk full during the weights (base) write", "n", first_version=False) as run:
        state_bytes = sum(t.numel() * t.element_size() for t in run.expected[0].values())
        run.disk.fill(leave=state_bytes * 3 // 2)  # the keyframe's chunks fit, a second copy does not
        run.publish(0)
        run.lab.wait_log(run.node, r"disk full: could not write the base at version 0", timeout=WAIT_S)
        run.lab.wait_version([run.node], 0, timeout=WAIT_S)  # applied: durable as its keyframe object meanwhile
        st = run.node.status()
        assert st["disk_full"] and st["base_version"] is None, st
        assert leftovers(run.disk.path) == [], "the failed base write removed its temporary"
        run.disk.free()
        _poll("the base written once space returned", lambda: run.node.status()["base_version"] == 0)
        run.publish(1)
        run.finish(2)
    return run.out


def node_compaction(root: Path, trial: int = 0) -> Outcome:
    """The node's disk holds the next patches but not a compaction's copy of the base."""
    with _swarm(root, "node disk full during a compaction (base rewrite)", "n",
                node_extra=["--compact-every", "2"]) as run:
        _poll("the first base", lambda: run.node.status()["base_version"] == 0)
        state_bytes = sum(t.numel() * t.element_size() for t in run.expected[0].values())
        run.disk.fill(leave=state_bytes // 2)  # patches fit, a second copy of the state does not
        run.publish(1, 2)
        run.lab.wait_log(run.node, r"disk full: could not write the compacted base at version 2", timeout=WAIT_S)
        run.lab.wait_version([run.node], 2, timeout=WAIT_S)
        st = run.node.status()
        assert st["disk_full"] and st["base_version"] == 0, st
        run.disk.free()
        _poll("the compaction once space returned", lambda: run.node.status()["base_version"] == 2)
        run.finish(3)
    return run.out


def node_spool_appends(root: Path, trial: int = 0) -> Outcome:
    """The node's disk is full while a rollout worker submits trajectories."""
    sent = _payloads(trial)
    with _swarm(root, "node disk full during trajectory spool appends", "n") as run:
        run.disk.fill(leave=0)
        refused, left = _submit_all(run.node, sent)
        assert refused == len(sent), f"a full disk refuses every submit ({refused} of {len(sent)})"
        assert run.node.status()["spool"]["disk_full"]
        run.disk.free()
        refused, left = _submit_all(run.node, left)  # the worker's retry
        assert not left, f"{refused} refused after space returned"
        _poll("every trajectory at the origin", lambda: len(_records(run.origin)) >= len(sent))
        _poll("the node's spool drained", lambda: run.node.status()["spool"]["records"] == 0)
        run.out.lost, run.out.duplicated = _count(sent, _records(run.origin))
        run.finish(1)
    return run.out


def origin_publish_chunk_writes(root: Path, trial: int = 0) -> Outcome:
    """The origin's disk is full while it writes a new version's chunks (--watch)."""
    with _swarm(root, "origin disk full during a publish's chunk writes", "origin") as run:
        run.disk.fill(leave=0)
        run.publish(1)
        run.lab.wait_log(run.origin, r"disk full: could not write the objects of version 1", timeout=WAIT_S)
        time.sleep(1.0)
        assert run.node.status()["latest_version"] == 0, "a version the origin could not write is never announced"
        assert run.origin.alive()
        run.disk.free()
        run.finish(2)
    return run.out


def origin_trajectory_commits(root: Path, trial: int = 0) -> Outcome:
    """The origin's disk is full when the node's trajectories arrive."""
    sent = _payloads(trial)
    with _swarm(root, "origin disk full during trajectory commits", "origin") as run:
        run.disk.fill(leave=0)
        refused, _ = _submit_all(run.node, sent)
        assert refused == 0
        run.lab.wait_log(run.origin, r"disk full: could not write \d+ trajectory records", timeout=WAIT_S)
        assert run.node.status()["spool"]["records"] > 0, "nothing the origin could not store is acked"
        run.disk.free()
        _poll("the node's spool drained", lambda: run.node.status()["spool"]["records"] == 0)
        run.out.lost, run.out.duplicated = _count(sent, _records(run.origin))
        run.finish(1)
    return run.out


def node_change_file_writes(root: Path, trial: int = 0) -> Outcome:
    """The disk under the node's change files (--sparse-handoff) is full when a patch is applied:
    the apply stops part-way, and the node goes back to its durable state, which replays the
    stored patch (the version without a change file, as after a restart); the next version is
    recorded once space returns."""
    with _swarm(root, "node disk full during change-file writes (--sparse-handoff)", "n/changes",
                node_extra=["--sparse-handoff"]) as run:
        run.disk.fill(leave=0)
        run.publish(1)
        run.lab.wait_log(run.node, r"disk full: could not write the change file of version 1", timeout=WAIT_S)
        run.lab.wait_version([run.node], 1, timeout=WAIT_S)
        assert run.node.status()["disk_full"]
        assert leftovers(run.disk.path) == [], "the failed change file removed its temporary"
        run.disk.free()
        run.finish(2)
        assert (run.disk.path / "0000000002.chg").exists(), sorted(p.name for p in run.disk.path.iterdir())
    return run.out


def node_model_dir_writes(root: Path, trial: int = 0) -> Outcome:
    """The disk under the node's model directory (--model-dir) is full when a version arrives:
    the engine's directory stays at the version before, and catches up once space returns."""
    md = root / "md"
    with _swarm(root, "node disk full during model-directory writes (--model-dir)", "md",
                node_extra=["--model-dir", str(md)]) as run:
        _poll("version 0 in the model directory", lambda: run.node.status()["model_dir_version"] == 0)
        run.disk.fill(leave=0)
        run.publish(1)
        run.lab.wait_log(run.node, r"disk full: could not write version 1 to the model directory", timeout=WAIT_S)
        run.lab.wait_version([run.node], 1, timeout=WAIT_S)  # the node itself moves on
        assert run.node.status()["model_dir_version"] == 0
        run.disk.free()
        _poll("version 1 in the model directory once space returned",
              lambda: run.node.status()["model_dir_version"] == 1)
        run.finish(2)
        _poll("version 2 in the model directory", lambda: run.node.status()["model_dir_version"] == 2)
    return run.out


SCENARIOS = {
    "node-chunks": node_chunk_writes,
    "node-base": node_base_write,
    "node-compaction": node_compaction,
    "node-spool": node_spool_appends,
    "node-changes": node_change_file_writes,
    "node-model-dir": node_model_dir_writes,
    "origin-publish": origin_publish_chunk_writes,
    "origin-trajectories": origin_trajectory_commits,
}
