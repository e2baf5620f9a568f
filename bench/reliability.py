"""SIGKILL swarm members at the worst moments, as real processes on loopback, and count what survives.

    nice -n 19 .venv/bin/python bench/reliability.py [--scenarios apply,upload,publish,tracker]
                                                     [--trials 50 | --trials apply=50,upload=20] [--hold 30]

Issue 21's kill scenarios, each trial one SIGKILL (tests/swarmlab.py runs the processes):

- apply: a node mid-apply (failpoint `apply.written`, after the patch's first chunk is
  written into the state). Each trial publishes a new version, kills the node there,
  restarts it: it must reach that version bit-exact, with nothing left behind.
- upload: a node mid-upload while a rollout worker submits, alternating two failpoints:
  `upload.acked` (the origin stored the batch and acked it; the ack is not processed, so
  the records are still in the spool and go again) and `upload.sent` (sent, maybe stored,
  not acked). At the end every acked record must be in the origin's store exactly once.
- publish: the origin mid-publish (failpoint `publish.written`: an object's chunks on
  disk, its manifest neither signed nor written, nothing announced). No node may hear of
  the version before the restart; after it the version is published again and every
  node reaches it bit-exact.
- tracker: the tracker at a random moment while a version spreads, restarted on the same
  port: every node reaches every version bit-exact.

A kill counts as landed only when the member's log shows the failpoint line, stamped less
than the hold before the kill, and (apply, publish) no line saying the step finished
after it; the tracker's kills land when it was running. Leftovers: temporary files
(`.tmp`, `.compact-`) written before the kill that are still there once the member is
back, and object folders without a manifest. Data lost: trials ending with weights that
are not bit-exact, or acked trajectory records missing or stored more than once. Prints
fault | trials | landed | survived | data lost | leftovers; exits 1 if any data was lost,
any trial failed or left something behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from swarmlab import (Proc, Submitter, SwarmLab, dump, exactly_once, load_weights, same_bits, summary,  # noqa: E402
                      wait_spools_empty, write_checkpoint)
from synthetic import rl_checkpoints, served  # noqa: E402

TRIALS = {"apply": 50, "upload": 20, "publish": 10, "tracker": 10}
FAULTS = {"apply": "node SIGKILL mid-apply", "upload": "node SIGKILL mid-upload",
          "publish": "origin SIGKILL mid-publish", "tracker": "tracker SIGKILL at random"}
# Small chunks: a tiny model's patch still spans several, so a kill after the first lands mid-apply.
ORIGIN_ARGS = ["--chunk-bytes", "2048", "--segment-elements", "1024"]
HOLD_S = 30.0  # a hold only has to outlast the kill; the origin's is shorter (it holds again on restart)
PUBLISH_HOLD_S = 6.0
TIMEOUT_S = 120.0


@dataclasses.dataclass
class Outcome:
    scenario: str
    trials: int = 0
    landed: int = 0
    survived: int = 0
    lost: int = 0
    leftovers: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def fault(self) -> str:
        return FAULTS[self.scenario]

    @property
    def ok(self) -> bool:
        return not self.lost and not self.leftovers and not self.failures and self.survived == self.trials


def failpoint(name: str, hold: float) -> dict[str, str]:
    """The environment that arms one point of node/failpoints.py for `hold` s."""
    return {"PATCHSWARM_FAILPOINTS": f"{name}=sleep:{hold:g}"}


@dataclasses.dataclass
class Kill:
    at: float  # wall-clock time of the SIGKILL
    landed: bool


def kill_at_failpoint(lab: SwarmLab, p: Proc, point: str, hold: float, after: int,
                      finished: str | None = None) -> Kill:
    """Wait for `p` to log that it holds at `point` (past offset `after`), SIGKILL it, and say
    whether the kill landed there: the line is stamped less than `hold` before the kill, and
    no line matching `finished` (the step completed) follows it."""
    m = lab.wait_log(p, rf"(?m)^(\S+) .*failpoint {re.escape(point)}: holding", timeout=TIMEOUT_S, after=after)
    at = time.time()
    lab.kill(p)
    stamped = datetime.datetime.fromisoformat(m.group(1)).timestamp()
    done = finished is not None and re.search(finished, p.text()[m.end():])
    return Kill(at, at - stamped < hold and not done)


def leftovers(p: Proc, before: float, settle: float = 2.0) -> list[str]:
    """What an interrupted write left in `p`'s data dir: temporaries last written before
    `before` (the kill), and object folders without a manifest (call with nothing in flight),
    still there `settle` s later: a folder the member is deleting right now (a compaction
    drops the patches it folded) is not left over."""
    found = _unfinished(p, before)
    if found:
        time.sleep(settle)
        found = [f for f in _unfinished(p, before) if f in found]
    return found


def _unfinished(p: Proc, before: float) -> list[str]:
    out = []
    for d, dirs, files in os.walk(p.data_dir):  # os.walk skips what a live member deletes meanwhile
        here = Path(d)
        for name in dirs + files:
            f = here / name
            try:
                if (".tmp" in name or ".compact-" in name) and f.stat().st_mtime <= before:
                    out.append(str(f.relative_to(p.data_dir)))
                elif here.name == "objects" and name in dirs and not (f / "manifest").exists():
                    out.append(str(f.relative_to(p.data_dir)) + "/ (no manifest)")
            except FileNotFoundError:
                pass
    return out


def _trial(out: Outcome, v: int, fn) -> bool:
    """Run one trial; a failure (a member that did not come back, a timeout) is recorded and
    ends the scenario, since what follows would start from an unknown state."""
    out.trials += 1
    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001 - an AssertionError of swarmlab's waits, or whatever else broke
        out.failures.append(f"trial {v}: {type(e).__name__}: {str(e)[:2000]}")
        return False


def _say(out: Outcome, v: int, what: str) -> None:
    print(f"  {out.scenario} trial {v}: {what}", file=sys.stderr, flush=True)


def _tally(out: Outcome, v: int, landed: bool, problems: list[str]) -> None:
    out.landed += landed
    out.survived += not problems
    _say(out, v, f"{'landed' if landed else 'NOT landed'}; {', '.join(problems) or 'bit-exact, clean'}")


def _check_weights(out: Outcome, members: list[Proc], expected: dict, kill_at: float) -> list[str]:
    """Bit-exact and clean; counts a member not bit-exact as data lost."""
    problems = []
    for p in members:
        if not same_bits(load_weights(p), expected):
            out.lost += 1
            problems.append(f"{p.name} not bit-exact")
        left = leftovers(p, kill_at)
        if left:
            out.leftovers += len(left)
            problems.append(f"{p.name} left {left}")
    return problems


def _at_version_0(lab: SwarmLab, watch: Path, ckpts, nodes: list[str], tracker_port: int = 0):
    """A tracker, an origin watching `watch` and `nodes`, every node at version 0 (a keyframe)."""
    tracker = lab.start_tracker(port=tracker_port)
    origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS, wait=False)
    members = lab.start_nodes([(name, "r0") for name in nodes], starting=[origin])
    write_checkpoint(watch, "step0000.safetensors", ckpts[0])
    lab.wait_version(members, 0, timeout=TIMEOUT_S)
    return tracker, origin, members


def _arm(lab: SwarmLab, p: Proc, env: dict[str, str]) -> None:
    """Restart `p` (SIGTERM: not a trial) with failpoints armed from then on."""
    p.env = env
    lab.kill(p, signal.SIGTERM)
    lab.restart(p)


def node_mid_apply(root: Path, trials: int, hold: float, ckpts) -> Outcome:
    out = Outcome("apply")
    watch = root / "watch"
    with SwarmLab(root) as lab:
        _, _, (node,) = _at_version_0(lab, watch, ckpts, ["n"])
        _arm(lab, node, failpoint("apply.written", hold))  # not at version 0: a keyframe's apply holds too

        def trial(v: int) -> None:
            offset = len(node.text())
            write_checkpoint(watch, f"step{v:04d}.safetensors", ckpts[v])
            k = kill_at_failpoint(lab, node, "apply.written", hold, offset, finished=rf"applied version {v} ")
            lab.restart(node)  # holds still armed: a restart replays the stored patch, it does not hold
            lab.wait_version([node], v, timeout=TIMEOUT_S)
            problems = _check_weights(out, [node], served(ckpts[v], torch.bfloat16), k.at)
            _tally(out, v, k.landed, problems)

        for v in range(1, trials + 1):
            if not _trial(out, v, lambda: trial(v)):
                break
    return out


def node_mid_upload(root: Path, trials: int, hold: float) -> Outcome:
    out = Outcome("upload")
    points = ["upload.acked", "upload.sent"]
    kills: list[Kill] = []
    with SwarmLab(root) as lab:
        lab.start_tracker()
        origin = lab.start_origin(wait=False)
        (node,) = lab.start_nodes([("n", "r0")], starting=[origin], env=failpoint(points[0], hold))
        stop = threading.Event()
        worker = Submitter(node, stop, random.Random(1))
        worker.start()
        offset = 0

        def trial(i: int) -> None:
            nonlocal offset
            k = kill_at_failpoint(lab, node, points[i % 2], hold, offset)
            kills.append(k)
            out.landed += k.landed
            # The next trial's failpoint; none after the last, so the spool drains.
            node.env = failpoint(points[(i + 1) % 2], hold) if i + 1 < trials else {}
            offset = len(node.text())
            lab.restart(node)
            _say(out, i + 1, f"{points[i % 2]} {'landed' if k.landed else 'NOT landed'}; {len(worker.acked)} acked so far")

        for i in range(trials):
            if not _trial(out, i + 1, lambda: trial(i)):
                break
        time.sleep(1.0)  # records submitted after the last restart go through too
        stop.set()
        worker.join(timeout=30)
        try:
            wait_spools_empty(lab, [node], timeout=TIMEOUT_S)
            counts = exactly_once(dump(origin), [worker])
            resent = summary(origin)["duplicates_dropped"]  # > 0: the kills made the node send again
        except Exception as e:  # noqa: BLE001 - reported, not raised: the table still prints
            out.failures.append(f"end: {str(e)[:2000]}")
            counts, resent = {"acked_missing": len(worker.acked), "stored_twice": 0, "stray": 0}, None
        left = leftovers(node, kills[-1].at) + leftovers(origin, kills[-1].at) if kills else []
    out.lost = counts["acked_missing"] + counts["stored_twice"]
    out.leftovers = len(left)
    if counts["stray"] or left:
        out.failures.append(f"records nobody submitted: {counts['stray']}; leftovers {left}")
    # Survival is judged once, at the end: while the holds are armed the spool cannot drain.
    out.survived = len(kills) if not out.lost and not out.failures else 0
    print(f"  upload: {len(worker.acked)} records acked, {len(worker.unacked)} unacked; {counts}; "
          f"{resent} resent records dropped by the origin as duplicates", file=sys.stderr)
    return out


def origin_mid_publish(root: Path, trials: int, hold: float, ckpts) -> Outcome:
    out = Outcome("publish")
    watch = root / "watch"
    with SwarmLab(root) as lab:
        _, origin, nodes = _at_version_0(lab, watch, ckpts, ["n0", "n1"])
        _arm(lab, origin, failpoint("publish.written", hold))

        def heard_of(v: int) -> list[str]:
            return [p.name for p in nodes if (p.status()["latest_version"] or 0) >= v]

        def trial(v: int) -> None:
            offset = len(origin.text())
            write_checkpoint(watch, f"step{v:04d}.safetensors", ckpts[v])
            k = kill_at_failpoint(lab, origin, "publish.written", hold, offset, finished=rf"published version {v} ")
            early = heard_of(v)
            lab.restart(origin)  # publishes the checkpoint again (holding once more, then going on)
            lab.wait_version(nodes, v, timeout=TIMEOUT_S)
            problems = _check_weights(out, [origin, *nodes], served(ckpts[v], torch.bfloat16), k.at)
            if early:
                out.lost += 1  # a version heard of before it was whole: a half-announcement
                problems.append(f"{early} heard of version {v} before the restart")
            _tally(out, v, k.landed, problems)

        for v in range(1, trials + 1):
            if not _trial(out, v, lambda: trial(v)):
                break
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tracker_at_random(root: Path, trials: int, ckpts, seed: int) -> Outcome:
    out = Outcome("tracker")
    rng = random.Random(seed)
    watch = root / "watch"
    with SwarmLab(root) as lab:
        tracker, _, nodes = _at_version_0(lab, watch, ckpts, ["n0", "n1"], _free_port())  # restarts: same port

        def trial(v: int) -> None:
            write_checkpoint(watch, f"step{v:04d}.safetensors", ckpts[v])
            time.sleep(rng.uniform(0.0, 1.5))  # anywhere in the publish, the announce, the fetches
            landed = tracker.alive()
            at = time.time()
            lab.kill(tracker)
            time.sleep(rng.uniform(0.0, 0.5))
            lab.restart(tracker)
            lab.wait_version(nodes, v, timeout=TIMEOUT_S)
            problems = _check_weights(out, nodes, served(ckpts[v], torch.bfloat16), at)
            _tally(out, v, landed, problems)

        for v in range(1, trials + 1):
            if not _trial(out, v, lambda: trial(v)):
                break
    return out


def run(scenario: str, root: Path, trials: int, hold: float = HOLD_S, publish_hold: float = PUBLISH_HOLD_S,
        ckpts=None, seed: int = 0) -> Outcome:
    """One scenario for `trials` kills under `root` (the function tests/test_reliability.py calls)."""
    if ckpts is None and scenario != "upload":
        ckpts = checkpoints(trials, seed)
    root.mkdir(parents=True, exist_ok=True)
    if scenario == "apply":
        return node_mid_apply(root, trials, hold, ckpts)
    if scenario == "upload":
        return node_mid_upload(root, trials, hold)
    if scenario == "publish":
        return origin_mid_publish(root, trials, publish_hold, ckpts)
    if scenario == "tracker":
        return tracker_at_random(root, trials, ckpts, seed)
    raise ValueError(f"expected a scenario of {sorted(TRIALS)}, found {scenario!r}")


def checkpoints(trials: int, seed: int = 0):
    """trials + 1 served versions of the tiny model (real optimizer steps), enough to change
    a good part of each tensor per version."""
    return rl_checkpoints("tiny", 1e-5, trials, seed=seed)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| fault | trials | landed | survived | data lost | leftovers |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {o.fault} | {o.trials} | {o.landed} | {o.survived} | {o.lost} | {o.leftovers} |" for o in outcomes]
    return "\n".join(lines)


def _trials_arg(text: str) -> dict[str, int]:
    if "=" not in text:
        return dict.fromkeys(TRIALS, int(text))
    out = {}
    for item in text.split(","):
        name, _, n = item.partition("=")
        if name not in TRIALS:
            raise argparse.ArgumentTypeError(f"expected scenarios of {sorted(TRIALS)}, found {name!r}")
        out[name] = int(n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(TRIALS), help=f"comma-separated, of {', '.join(TRIALS)}")
    ap.add_argument("--trials", type=_trials_arg, default={},
                    help=f"kills per scenario: N for all, or name=N,... (default {TRIALS})")
    ap.add_argument("--hold", type=float, default=HOLD_S, help="s a node holds at a failpoint")
    ap.add_argument("--publish-hold", type=float, default=PUBLISH_HOLD_S, help="s the origin holds mid-publish")
    ap.add_argument("--dir", type=Path, help="keep the members' data and logs here (default: a temporary dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(TRIALS)
    if unknown:
        ap.error(f"--scenarios: expected some of {', '.join(TRIALS)}, found {', '.join(sorted(unknown))}")
    trials = {s: args.trials.get(s, TRIALS[s]) for s in scenarios}

    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        root = args.dir or Path(tmp)
        ckpts = checkpoints(max(trials.values()), args.seed)  # one set for every scenario: each starts afresh
        outcomes = []
        for s in scenarios:
            start = time.monotonic()
            print(f"{s}: {trials[s]} trials", file=sys.stderr, flush=True)
            o = run(s, root / s, trials[s], args.hold, args.publish_hold, ckpts, args.seed)
            for f in o.failures:
                print(f"  {s} FAILED {f}", file=sys.stderr)
            print(f"{s}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            outcomes.append(o)
    print(table(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
