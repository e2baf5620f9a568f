"""A rollout worker for the demo: one per node, beside it, over the node's local socket.

    python -m patchswarm.node.demo.rollout_worker --socket D/node.sock --seed S [--batch N] [--max-versions K]
                                       [--until-version V]

Owns the worker loop: wait for the node to hold a version newer than the last
one rolled out, read that version's served weights from the node's model
directory (`model_dir`, the node's directory hand-off; checked against the node's state hash, so the trajectories carry the version
that really produced them), sample `--batch` rollouts, submit them in one
`submit_many` (one fsync at the node), repeat. Must not talk to the swarm
itself or train: the node moves weights and trajectories, the trainer learns.

Stops, exit status 0, after `--max-versions` versions, after rolling out
`--until-version` (the last version the trainer will learn from; a newer one
is not rolled out, so no trajectory is left unread), on SIGTERM/SIGINT, when
the node's socket goes away (the demo is over) or when no new version comes
within `--idle-timeout`; every wait is bounded and the whole run is bounded by
`--deadline`. Logs one line per version to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from patchswarm.protocol.errors import InvalidInput, PatchswarmError
from patchswarm.protocol.statehash import state_hash

from . import task

WAIT_SLICE_S = 5.0  # one wait_version call; the loop re-checks stop flags between slices
LOAD_TRIES = 3


class _Stop(Exception):
    """Raised by the signal handler while the worker is blocked in a wait."""


@dataclasses.dataclass
class WorkerSummary:
    versions: list[int]
    trajectories: int
    reason: str


def load_weights(path: str | Path, expected_hash: str | None) -> dict[str, torch.Tensor]:
    """The served state at `path`; raises InvalidInput if its state hash is not
    `expected_hash` (the node replaced the file with a newer version meanwhile)."""
    try:
        if Path(path).is_dir():
            from patchswarm.node.checkpoint import load_state  # a model directory: shards and index

            state = load_state(path)[0]
        else:
            state = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types and OSError
        raise InvalidInput(f"{path}: expected a readable safetensors file ({type(e).__name__}: {e})") from None
    if expected_hash is not None:
        found = state_hash(state)
        if found != expected_hash:
            raise InvalidInput(f"{path}: expected state hash {expected_hash[:16]}…, found {found[:16]}…")
    return state


def rollout_records(weights: dict[str, torch.Tensor], version: int, seed: int, n: int) -> tuple[list, list[float]]:
    """`n` trajectories from `weights` as submit records (payload, version, meta) and their rewards.

    The rollout seed mixes the worker's seed and the version, so each
    (worker, version) pair samples differently and reproducibly."""
    trajs = task.rollout(weights, n, seed=seed * 1_000_003 + version)
    return [(task.encode_trajectory(t), version, None) for t in trajs], [t["reward"] for t in trajs]


def run_worker(client, *, seed: int, batch: int, max_versions: int, idle_timeout: float, deadline: float,
               log: Callable[[str], None], stopping: Callable[[], bool] = lambda: False,
               until_version: int | None = None) -> WorkerSummary:
    """The loop over versions; `client` is a `patchswarm.node.client.NodeClient`.

    Returns why it stopped. Raises only for unexpected faults (bad weights
    that stay bad after LOAD_TRIES reads, node errors other than a timeout or
    a missing socket)."""
    from patchswarm.node.client import NodeError, NodeUnavailable  # the swarm's client; imported late so task-only users need not

    t_end = time.monotonic() + deadline
    done: list[int] = []
    sent = 0
    last = -1  # versions count from 0
    idle_since = time.monotonic()
    while len(done) < max_versions:
        now = time.monotonic()
        if stopping():
            return WorkerSummary(done, sent, "signal")
        if now >= t_end:
            return WorkerSummary(done, sent, f"deadline {deadline:g} s")
        if now - idle_since >= idle_timeout:
            after = "yet" if last < 0 else f"after {last}"
            return WorkerSummary(done, sent, f"no version {after} for {idle_timeout:g} s")
        try:
            st = client.wait_version(last + 1, min(WAIT_SLICE_S, t_end - now))
        except NodeUnavailable:
            return WorkerSummary(done, sent, "node socket gone")
        except NodeError as e:
            if e.code == "timeout":
                continue
            raise
        t0 = time.perf_counter()
        weights = None
        for _ in range(LOAD_TRIES):
            try:
                weights = load_weights(st["model_dir"], st["state_hash"])
                break
            except InvalidInput:
                st = client.status()  # the file moved on to a newer version: tag with that one
        if weights is None:
            raise InvalidInput(f"{st['model_dir']}: no consistent read in {LOAD_TRIES} tries")
        version = int(st["version"])
        if until_version is not None and version > until_version:
            return WorkerSummary(done, sent, f"version {version} is past the final version {until_version}")
        t1 = time.perf_counter()
        records, rewards = rollout_records(weights, version, seed, batch)
        t2 = time.perf_counter()
        try:
            client.submit_many(records)
        except NodeUnavailable:
            return WorkerSummary(done, sent, "node socket gone")
        t3 = time.perf_counter()
        done.append(version)
        sent += len(records)
        last = version
        idle_since = time.monotonic()
        log(f"worker {seed} node {st.get('node_id', '?')} version {version}: {len(records)} rollouts, "
            f"reward {sum(rewards) / len(rewards):.3f}, load {t1 - t0:.2f} s, rollout {t2 - t1:.2f} s, "
            f"submit {t3 - t2:.2f} s")
        if until_version is not None and version >= until_version:
            return WorkerSummary(done, sent, f"final version {until_version} done")
    return WorkerSummary(done, sent, f"{max_versions} versions")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patchswarm.node.demo.rollout_worker", description=__doc__.split("\n")[0])
    ap.add_argument("--socket", required=True, help="the node's local socket (DATA_DIR/node.sock)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--batch", type=int, default=16, help="rollouts per version (default 16)")
    ap.add_argument("--max-versions", type=int, default=1000, help="stop after this many versions (default 1000)")
    ap.add_argument("--until-version", type=int, help="the last version to roll out (the trainer's last)")
    ap.add_argument("--idle-timeout", type=float, default=120.0, help="stop when no new version comes for this long")
    ap.add_argument("--deadline", type=float, default=3600.0, help="stop after this many seconds in all")
    ap.add_argument("--connect-timeout", type=float, default=60.0, help="wait this long for the node's socket")
    args = ap.parse_args(argv)
    if args.batch < 2 or args.max_versions < 1:
        ap.error("--batch must be >= 2 and --max-versions >= 1")
    torch.set_num_threads(1)  # one core per worker at most: the box also runs nodes and the trainer

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    stop = {"flag": False, "waiting": False}

    def on_signal(signum, frame):
        stop["flag"] = True
        if stop["waiting"]:
            raise _Stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from patchswarm.node.client import NodeClient, NodeUnavailable

    def _answers(path: Path) -> bool:
        try:
            with NodeClient(path, connect_timeout=1.0) as c:
                c.status()
            return True
        except NodeUnavailable:
            return False

    sock = Path(args.socket)
    t_connect = time.monotonic() + args.connect_timeout
    stop["waiting"] = True
    try:
        while not _answers(sock):  # the file appears a moment before the daemon accepts on it
            if time.monotonic() >= t_connect:
                log(f"worker {args.seed}: no node answers at {sock} after {args.connect_timeout:g} s")
                return 1
            time.sleep(0.2)
        stop["waiting"] = False
        with NodeClient(sock) as client:
            summary = run_worker(
                _Interruptible(client, stop), seed=args.seed, batch=args.batch, max_versions=args.max_versions,
                idle_timeout=args.idle_timeout, deadline=args.deadline, log=log, stopping=lambda: stop["flag"],
                until_version=args.until_version)
    except _Stop:
        summary = None
    except PatchswarmError as e:
        log(f"worker {args.seed}: {e}")
        return 1
    if summary is None or stop["flag"]:
        # Signalled: whatever it saw after (often its node's socket closing, since the
        # demo stops everything at once) is a consequence, not the reason it ended.
        done = "" if summary is None else f"; {len(summary.versions)} versions, {summary.trajectories} trajectories"
        log(f"worker {args.seed}: stopped by signal{done}")
    else:
        log(f"worker {args.seed}: done ({summary.reason}); {len(summary.versions)} versions, "
            f"{summary.trajectories} trajectories")
    return 0


class _Interruptible:
    """Lets a signal end a blocking wait_version at once; submits finish first
    (an interrupted submit would leave the worker unsure what the node spooled)."""

    def __init__(self, client, stop: dict):
        self._client, self._stop = client, stop

    def wait_version(self, min_version: int, timeout: float) -> dict:
        self._stop["waiting"] = True
        try:
            if self._stop["flag"]:
                raise _Stop()
            return self._client.wait_version(min_version, timeout)
        finally:
            self._stop["waiting"] = False

    def status(self) -> dict:
        return self._client.status()

    def submit_many(self, records) -> list[int]:
        return self._client.submit_many(records)


if __name__ == "__main__":
    sys.exit(main())
