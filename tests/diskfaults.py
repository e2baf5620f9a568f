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


def _submit_all(node, payloads: list[bytes], retry_until: float | None = None) -> tuple[int, list[bytes]]:
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


def _finish(out: Outcome, lab, nodes, origin, expected, version: int, disk_dirs: list[Path]) -> Outcome:
    lab.wait_version(nodes, version, timeout=WAIT_S)
    bad = [p.name for p in [*nodes, origin] if not same_bits(load_weights(p), expected[version])]
    out.lost += len(bad)
    out.leftovers = [f"{d.name}/{f}" for d in disk_dirs for f in leftovers(d)]
    alive = all(p.alive() for p in lab.procs)
    out.survived = alive and not bad
    out.detail += f"; not bit-exact: {bad}" if bad else ""
    return out


# ================================================================ scenarios


def node_chunk_writes(root: Path, trial: int = 0) -> Outcome:
    """The node's disk is full when the first version's chunks arrive."""
    out, states = Outcome("node disk full during chunk writes"), checkpoints()
    expected = [served(s, torch.bfloat16) for s in states]
    watch = root / "watch"
    with SmallDisk(root / "n", DISK_BYTES) as disk, SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        node = lab.start_node("n")
        disk.fill(leave=8192)
        write_checkpoint(watch, "step0000.safetensors", states[0])
        lab.wait_log(node, r"disk full: could not write (chunk|the manifest)", timeout=WAIT_S)
        st = node.status()
        assert st["disk_full"] and st["version"] is None, st
        assert any(p["role"] == "origin" for p in st["peers"]), f"the origin stays a peer: {st['peers']}"
        disk.free()
        lab.wait_version([node], 0, timeout=WAIT_S)
        write_checkpoint(watch, "step0001.safetensors", states[1])
        _finish(out, lab, [node], origin, expected, 1, [disk.path])
        assert not node.status()["disk_full"]
    return out


def node_base_write(root: Path, trial: int = 0) -> Outcome:
    """The node's disk holds the first version's chunks but not its base (the state written whole)."""
    out, states = Outcome("node disk full during the weights (base) write"), checkpoints()
    expected = [served(s, torch.bfloat16) for s in states]
    state_bytes = sum(t.numel() * t.element_size() for t in expected[0].values())
    watch = root / "watch"
    with SmallDisk(root / "n", DISK_BYTES) as disk, SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        node = lab.start_node("n")
        disk.fill(leave=state_bytes * 3 // 2)  # the keyframe's chunks fit, a second copy does not
        write_checkpoint(watch, "step0000.safetensors", states[0])
        lab.wait_log(node, r"disk full: could not write the base at version 0", timeout=WAIT_S)
        lab.wait_version([node], 0, timeout=WAIT_S)  # applied: durable as its keyframe object meanwhile
        st = node.status()
        assert st["disk_full"] and st["base_version"] is None, st
        assert leftovers(disk.path) == [], "the failed base write removed its temporary"
        disk.free()
        _poll("the base written once space returned", lambda: node.status()["base_version"] == 0)
        write_checkpoint(watch, "step0001.safetensors", states[1])
        write_checkpoint(watch, "step0002.safetensors", states[2])
        _finish(out, lab, [node], origin, expected, 2, [disk.path])
    return out


def node_compaction(root: Path, trial: int = 0) -> Outcome:
    """The node's disk holds the next patches but not a compaction's copy of the base."""
    out, states = Outcome("node disk full during a compaction (base rewrite)"), checkpoints()
    expected = [served(s, torch.bfloat16) for s in states]
    state_bytes = sum(t.numel() * t.element_size() for t in expected[0].values())
    watch = root / "watch"
    with SmallDisk(root / "n", DISK_BYTES) as disk, SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        node = lab.start_node("n", extra=["--compact-every", "2"])
        write_checkpoint(watch, "step0000.safetensors", states[0])
        lab.wait_version([node], 0, timeout=WAIT_S)
        _poll("the first base", lambda: node.status()["base_version"] == 0)
        disk.fill(leave=state_bytes // 2)  # patches fit, a second copy of the state does not
        for v in (1, 2):
            write_checkpoint(watch, f"step{v:04d}.safetensors", states[v])
        lab.wait_log(node, r"disk full: could not write the compacted base at version 2", timeout=WAIT_S)
        lab.wait_version([node], 2, timeout=WAIT_S)
        st = node.status()
        assert st["disk_full"] and st["base_version"] == 0, st
        disk.free()
        _poll("the compaction once space returned", lambda: node.status()["base_version"] == 2)
        write_checkpoint(watch, "step0003.safetensors", states[3])
        _finish(out, lab, [node], origin, expected, 3, [disk.path])
    return out


def node_spool_appends(root: Path, trial: int = 0) -> Outcome:
    """The node's disk is full while a rollout worker submits trajectories."""
    out, states = Outcome("node disk full during trajectory spool appends"), checkpoints()
    expected = [served(s, torch.bfloat16) for s in states]
    watch = root / "watch"
    sent = _payloads(trial)
    with SmallDisk(root / "n", DISK_BYTES) as disk, SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        node = lab.start_node("n")
        write_checkpoint(watch, "step0000.safetensors", states[0])
        lab.wait_version([node], 0, timeout=WAIT_S)
        disk.fill(leave=0)
        refused, left = _submit_all(node, sent)
        assert refused == len(sent), f"a full disk refuses every submit ({refused} of {len(sent)})"
        assert node.status()["spool"]["disk_full"]
        disk.free()
        refused, left = _submit_all(node, left)  # the worker's retry
        assert not left, f"{refused} refused after space returned"
        _poll("every trajectory at the origin", lambda: len(_records(origin)) >= len(sent))
        _poll("the node's spool drained", lambda: node.status()["spool"]["records"] == 0)
        out.lost, out.duplicated = _count(sent, _records(origin))
        write_checkpoint(watch, "step0001.safetensors", states[1])
        _finish(out, lab, [node], origin, expected, 1, [disk.path])
    return out


def origin_publish_chunk_writes(root: Path, trial: int = 0) -> Outcome:
    """The origin's disk is full while it writes a new version's chunks (--watch)."""
    out, states = Outcome("origin disk full during a publish's chunk writes"), checkpoints()
    expected = [served(s, torch.bfloat16) for s in states]
    watch = root / "watch"
    with SmallDisk(root / "origin", DISK_BYTES) as disk, SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        node = lab.start_node("n")
        write_checkpoint(watch, "step0000.safetensors", states[0])
        lab.wait_version([node], 0, timeout=WAIT_S)
        disk.fill(leave=0)
        write_checkpoint(watch, "step0001.safetensors", states[1])
        lab.wait_log(origin, r"disk full: could not write the objects of version 1", timeout=WAIT_S)
        time.sleep(1.0)
        assert node.status()["latest_version"] == 0, "a version the origin could not write is never announced"
        assert origin.alive()
        disk.free()
        write_checkpoint(watch, "step0002.safetensors", states[2])
        _finish(out, lab, [node], origin, expected, 2, [disk.path])
    return out


def origin_trajectory_commits(root: Path, trial: int = 0) -> Outcome:
    """The origin's disk is full when the node's trajectories arrive."""
    out, states = Outcome("origin disk full during trajectory commits"), checkpoints()
    expected = [served(s, torch.bfloat16) for s in states]
    watch = root / "watch"
    sent = _payloads(trial)
    with SmallDisk(root / "origin", DISK_BYTES) as disk, SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        node = lab.start_node("n")
        write_checkpoint(watch, "step0000.safetensors", states[0])
        lab.wait_version([node], 0, timeout=WAIT_S)
        disk.fill(leave=0)
        refused, _ = _submit_all(node, sent)
        assert refused == 0
        lab.wait_log(origin, r"disk full: could not write \d+ trajectory records", timeout=WAIT_S)
        assert node.status()["spool"]["records"] > 0, "nothing the origin could not store is acked"
        disk.free()
        _poll("the node's spool drained", lambda: node.status()["spool"]["records"] == 0)
        out.lost, out.duplicated = _count(sent, _records(origin))
        write_checkpoint(watch, "step0001.safetensors", states[1])
        _finish(out, lab, [node], origin, expected, 1, [disk.path])
    return out


SCENARIOS = {
    "node-chunks": node_chunk_writes,
    "node-base": node_base_write,
    "node-compaction": node_compaction,
    "node-spool": node_spool_appends,
    "origin-publish": origin_publish_chunk_writes,
    "origin-trajectories": origin_trajectory_commits,
}
