"""`patchswarm demo`: a trainer learning from rollouts on other "datacenters", on loopback.

    patchswarm demo [--steps 30] [--nodes 6] [--regions 3] [--seed 0] [--out DIR]

Owns one demo run: the run directory (swarm CA and credentials, data dirs,
one log file per child, summary.json, demo.png), the child processes (a
tracker and N nodes in R regions through `python -m patchswarm.node.cli`, one rollout
worker per node through `python -m patchswarm.node.demo.rollout_worker`), the trainer
loop in this process (`Learner` and the origin embedded with `SyncOrigin`,
the trainer API path), the live view, and the checks at the end: every node
applied every version and holds the last one bit-exactly, every trajectory
a worker submitted reached the trainer, the reward rose. Exit status 0 only
if every check passes, 1 otherwise; 130 on SIGINT, 143 on SIGTERM.

Every child it started is stopped on every way out (SIGTERM, then SIGKILL
after a bounded wait); every wait is bounded in time.

Must not hold learning (task.py, learner.py), rendering (view.py,
figure.py) or swarm logic (node/, tracker/): it wires them. Heavy imports
(torch, the swarm) happen inside `run`, so `add_arguments` stays cheap for
the CLI's parser.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from patchswarm.protocol.errors import PatchswarmError, UsageError

LISTENING = re.compile(r"listening on ([^\s,;]+)")
WORKER_DONE = re.compile(r"worker (\d+): done \((.*)\); (\d+) versions, (\d+) trajectories")
START_TIMEOUT_S = 60.0  # a child prints "listening on" within this (imports are slow on a loaded box)
BATCH_TIMEOUT_S = 60.0  # one training step's batch
FINAL_TIMEOUT_S = 60.0  # workers exit, nodes reach the last version, spools drain
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL
POLL_S = 1.0  # the view refreshes at least this often while the trainer waits
ORIGIN_REGION = "r0"  # the trainer's own datacenter; nodes live in r1..rR
MAX_STALENESS = 2


class DemoFailed(PatchswarmError):
    """A part of the demo (a child process, the swarm, a batch) did not do its job."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; a BaseException so no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ================================================================ signals


class StopSignals:
    """Turns the first SIGINT/SIGTERM into `Interrupted` in the main thread.

    Inside `held()` (starting a child, stopping children) the signal is only
    recorded and raised when the block ends, so no child is ever spawned
    without being tracked and no cleanup is cut short. Later signals are
    ignored: a second Ctrl-C must not abandon children mid-shutdown."""

    def __init__(self):
        self.received: int | None = None
        self._raised = False
        self._held = 0
        self._old: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; the caller owns signals then
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handler(self, signum, frame) -> None:
        if self.received is not None:
            return
        self.received = signum
        if not self._held:
            self._raise()

    def _raise(self) -> None:
        self._raised = True
        raise Interrupted(self.received)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self.received is not None and not self._raised:
            self._raise()


# ================================================================ child processes


@dataclasses.dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, a preexec_fn that has the kernel SIGTERM the child when the thread that
    started it dies, even by SIGKILL: no node is left running after a killed demo."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def set_pdeathsig() -> None:
        prctl(pr_set_pdeathsig, sigterm)

    return set_pdeathsig


class Children:
    """The processes this run started, each with its log file; `stop` ends them (bounded).
    Start them from the main thread (it lives as long as the run: see `_die_with_parent`)."""

    def __init__(self, logs: Path, signals: StopSignals):
        self.logs = logs
        self.signals = signals
        self.all: list[Child] = []
        root = str(Path(__file__).resolve().parents[2])  # where `node` and `protocol` import from
        path = os.environ.get("PYTHONPATH")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": root + (os.pathsep + path if path else "")}
        self._preexec = _die_with_parent()

    def start(self, name: str, module: str, args: list) -> Child:
        log_path = self.logs / f"{name}.log"
        with self.signals.held(), open(log_path, "ab") as log:
            popen = subprocess.Popen([sys.executable, "-m", module, *map(str, args)], stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env, preexec_fn=self._preexec)
            child = Child(name, popen, log_path)
            self.all.append(child)
        return child

    def wait_log(self, child: Child, rx: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(child.text())
            if m:
                return m
            if not child.alive():
                raise DemoFailed(f"{child.name} exited with status {child.popen.returncode} before it was ready; "
                                 f"{child.log} ends:\n{child.tail()}")
            if time.monotonic() >= deadline:
                raise DemoFailed(f"{child.name}: expected /{rx.pattern}/ in {child.log} within {timeout:g} s; "
                                 f"it ends:\n{child.tail()}")
            time.sleep(0.05)

    def wait_exit(self, children: list[Child], timeout: float) -> bool:
        """True when all of `children` exited within `timeout`."""
        deadline = time.monotonic() + timeout
        for c in children:
            try:
                c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, children: list[Child] | None = None, grace: float = STOP_GRACE_S) -> list[str]:
        """SIGTERM the live ones, wait up to `grace`, SIGKILL what is left; returns the names killed."""
        children = self.all if children is None else children
        killed = []
        with self.signals.held():
            for c in reversed(children):  # the last started first: workers before the nodes they use
                if c.alive():
                    c.popen.terminate()
            if not self.wait_exit(children, grace):
                for c in children:
                    if c.alive():
                        c.popen.kill()
                        killed.append(c.name)
                self.wait_exit(children, grace)
        return killed


# ================================================================ the run


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    steps: int = 30
    nodes: int = 6
    regions: int = 3
    seed: int = 0
    batch: int = 16  # rollouts per worker per version

    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(self.nodes)]

    def region_of(self, i: int) -> str:
        return f"r{i % self.regions + 1}"

    def worker_seed(self, i: int) -> int:
        return self.seed * 1000 + i + 1


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclasses.dataclass
class NodeProc:
    name: str
    region: str
    child: Child
    data_dir: Path
    creds: Path
    addr: str | None = None

    @property
    def socket(self) -> Path:
        return self.data_dir / "node.sock"


def node_status(n: NodeProc) -> dict:
    """The node's status, or a stand-in that says it did not answer."""
    from patchswarm.node.client import NodeClient, NodeError

    try:
        with NodeClient(n.socket, connect_timeout=2.0) as c:
            return c.status()
    except NodeError as e:
        return {"node_id": n.name, "region": n.region, "version": None, "bytes_in": {}, "applied": [],
                "error": str(e)}


class DemoRun:
    """One run: `execute()` returns the checks; children are stopped on every way out."""

    def __init__(self, cfg: DemoConfig, out: Path, console, signals: StopSignals):
        self.cfg, self.out, self.console, self.signals = cfg, out, console, signals
        self.logs = out / "logs"
        self.children = Children(self.logs, signals)
        self.nodes: list[NodeProc] = []
        self.workers: list[Child] = []
        self.tracker: Child | None = None
        self.t0 = time.monotonic()
        self.applied: dict[str, set[int]] = {}  # node -> versions seen in its `applied` (a window of recent ones)
        self.trained = self.read_after = self.bad = 0  # trajectories trained on, read after the last step, undecodable

    # ------------------------------------------------------------ setup

    def _credentials(self) -> dict[str, Path]:
        """The swarm CA, the trainer key and every member's credentials (in process: the same
        code `patchswarm swarm init/issue` runs, without a Python start per member)."""
        from patchswarm.node.net import trust

        swarm = self.out / "swarm"
        trust.init_swarm(swarm)
        # Each member's region is in its certificate (the tracker runs with --require-region), so
        # no member of the demo can say another region than the one it was issued for.
        members = [("tracker", "tracker", None), ("origin", "origin", ORIGIN_REGION)] + \
            [(n, "node", self.cfg.region_of(i)) for i, n in enumerate(self.cfg.node_names())]
        creds = {}
        for name, role, region in members:
            creds[name] = self.out / "creds" / name
            trust.issue(swarm, name, role, creds[name], region=region)
        return creds

    def _start_nodes(self, creds: dict[str, Path]) -> None:
        self.tracker = self.children.start("tracker", "patchswarm.node.cli",
                                           ["tracker", "--creds", creds["tracker"], "--listen", "127.0.0.1:0",
                                            "--require-region"])
        self.tracker_addr = self.children.wait_log(self.tracker, LISTENING, START_TIMEOUT_S).group(1)
        for i, name in enumerate(self.cfg.node_names()):
            data = self.out / name
            region = self.cfg.region_of(i)
            child = self.children.start(name, "patchswarm.node.cli", [
                "node", "--tracker", self.tracker_addr, "--creds", creds[name], "--data-dir", data,
                "--listen", "127.0.0.1:0", "--region", region, "--sparse-handoff"])
            self.nodes.append(NodeProc(name, region, child, data, creds[name]))

    def _start_workers(self) -> None:
        """One worker per node, each once its node is listening (its local socket answers by then)."""
        last = self.cfg.steps - 1  # the last version the trainer learns from
        for i, n in enumerate(self.nodes):
            n.addr = self.children.wait_log(n.child, LISTENING, START_TIMEOUT_S).group(1)
            self.workers.append(self.children.start(f"worker-{i}", "patchswarm.node.demo.rollout_worker", [
                "--socket", n.socket, "--seed", self.cfg.worker_seed(i), "--batch", self.cfg.batch,
                "--until-version", last, "--connect-timeout", START_TIMEOUT_S,
                "--idle-timeout", BATCH_TIMEOUT_S * 2, "--deadline", BATCH_TIMEOUT_S * (self.cfg.steps + 4)]))

    def _check_alive(self) -> None:
        for c in [self.tracker] + [n.child for n in self.nodes]:
            if not c.alive():
                raise DemoFailed(f"{c.name} exited with status {c.popen.returncode}; {c.log} ends:\n{c.tail()}")
        for w in self.workers:  # a worker ends on its own only after the last version the trainer learns from
            if not w.alive() and (w.popen.returncode != 0 or ": done (final version" not in w.text()):
                raise DemoFailed(f"{w.name} stopped early (status {w.popen.returncode}); {w.log} ends:\n{w.tail()}")

    # ------------------------------------------------------------ the loop

    def execute(self) -> list[Check]:
        import torch

        from patchswarm.node.trainer.origin import SyncOrigin

        from .learner import Learner
        from .view import DemoView

        self.logs.mkdir(parents=True, exist_ok=True)
        creds = self._credentials()
        try:
            self._start_nodes(creds)
            self.console.print(f"tracker at {self.tracker_addr}; {self.cfg.nodes} nodes in {self.cfg.regions} "
                               f"regions, one rollout worker each; logs in {self.logs}", highlight=False, soft_wrap=True)
            torch.set_num_threads(1)  # the box also runs the nodes and the workers
            learner = Learner(seed=self.cfg.seed)  # its warm-up overlaps the nodes starting
            self._start_workers()
            with DemoView(self.console) as view, \
                    SyncOrigin(tracker=self.tracker_addr, creds=creds["origin"], key=self.out / "swarm" / "trainer.key",
                               data_dir=self.out / "origin", listen="127.0.0.1:0", region=ORIGIN_REGION) as origin:
                self._train(learner, origin, view)
                checks = self._finish(learner, origin)
                view.update(self.statuses, self.origin_stats, self.rewards,
                            note=f"done  ({time.monotonic() - self.t0:.0f} s)")
                return checks
        finally:
            self.children.stop()

    def _refresh(self, view, origin, learner, note: str) -> list[dict]:
        self._check_alive()
        statuses = self._statuses()
        view.update(statuses, origin.stats(), learner.rewards(),
                    note=f"{note}  ({time.monotonic() - self.t0:.0f} s)")
        return statuses

    def _statuses(self) -> list[dict]:
        statuses = [node_status(n) for n in self.nodes]
        for s in statuses:
            self.applied.setdefault(s["node_id"], set()).update(a["version"] for a in s.get("applied") or [])
        return statuses

    def _train(self, learner, origin, view) -> None:
        self.feed = feed = origin.trajectories(max_staleness=MAX_STALENESS)
        state = learner.state_dict()
        v = origin.publish(state)
        want = self.cfg.nodes * self.cfg.batch
        for step in range(1, self.cfg.steps + 1):
            note = f"step {step}/{self.cfg.steps}: waiting for {want} trajectories of version {v}"
            recs = self._batch(feed, want, lambda: self._refresh(view, origin, learner, note))
            if not recs:
                st = [f"{s['node_id']}: version {s.get('version')}" for s in (node_status(n) for n in self.nodes)]
                raise DemoFailed(f"step {step}: expected {want} trajectories within {BATCH_TIMEOUT_S:g} s, "
                                 f"found none; {', '.join(st)}; logs in {self.logs}")
            if len(recs) < want:
                self.console.print(f"step {step}: {len(recs)} of {want} trajectories within "
                                   f"{BATCH_TIMEOUT_S:g} s; training on those", highlight=False, soft_wrap=True)
            m = learner.step(recs, v)
            self.trained += len(recs)
            self.bad += m["bad_records"]
            state = learner.state_dict()
            v = origin.publish(state)
            self._refresh(view, origin, learner, f"step {step}/{self.cfg.steps}: published version {v}")
        self.final_version = v
        self.final_state = state

    def _batch(self, feed, n: int, refresh: Callable[[], object]) -> list:
        got: list = []
        deadline = time.monotonic() + BATCH_TIMEOUT_S
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got += feed.get_batch(n - len(got), timeout=min(POLL_S, left))
            if len(got) < n:
                refresh()
        return got

    # ------------------------------------------------------------ the end

    def _finish(self, learner, origin) -> list[Check]:
        from patchswarm.node.client import NodeClient, NodeError

        deadline = time.monotonic() + FINAL_TIMEOUT_S
        workers_done = self.children.wait_exit(self.workers, FINAL_TIMEOUT_S)
        for n in self.nodes:  # every node reaches the last version (the one nobody rolls out)
            while time.monotonic() < deadline:
                try:
                    with NodeClient(n.socket, connect_timeout=2.0) as c:
                        c.wait_version(self.final_version, min(5.0, max(0.1, deadline - time.monotonic())))
                    break
                except NodeError as e:
                    if not n.child.alive():
                        break
                    if e.code != "timeout":
                        time.sleep(0.2)  # the node is busy or restarting its socket: ask again shortly
        submitted = self._worker_counts()
        while time.monotonic() < deadline:  # spools drain: every record acked by the origin
            statuses = self._statuses()
            if all(s.get("spool") and s["spool"]["acked_total"] == s["spool"]["appended_total"] for s in statuses):
                break
            time.sleep(0.2)
        received = origin.stats()["trajectories"]["records"]
        # Records the trainer has not read are only there after a short batch: read them to count them.
        self.read_after = len(self.feed.get_batch(received - self.trained, 1.0)) if received > self.trained else 0
        statuses = self._statuses()
        stats = origin.stats()
        self.statuses, self.origin_stats, self.rewards = statuses, stats, learner.rewards()
        checks = [self._check_versions(statuses), self._check_bits(statuses),
                  self._check_trajectories(statuses, stats, submitted, workers_done), self._check_reward()]
        return checks

    def _worker_counts(self) -> dict[str, int | None]:
        out = {}
        for w in self.workers:
            m = WORKER_DONE.search(w.text())
            out[w.name] = int(m.group(4)) if m and w.popen.poll() == 0 else None
        return out

    def _check_versions(self, statuses: list[dict]) -> Check:
        every = set(range(self.final_version + 1))
        bad = []
        for s in statuses:
            missing = sorted(every - self.applied.get(s["node_id"], set()))
            if missing or s.get("version") != self.final_version:
                bad.append(f"{s['node_id']} at version {s.get('version')}, never applied {missing}")
        detail = f"{len(statuses)} nodes applied versions 0..{self.final_version}" if not bad else "; ".join(bad)
        return Check("every version applied", not bad, detail)

    def _check_bits(self, statuses: list[dict]) -> Check:

        from patchswarm.node.trainer.origin import served_copy
        from patchswarm.node.net.trust import Credentials
        from patchswarm.node.persistence import read_current
        from patchswarm.protocol.statehash import state_hash

        served = served_copy(self.final_state)  # what the last publish served
        want_hash = state_hash(served)
        bad = []
        for n, s in zip(self.nodes, statuses):
            try:
                c = Credentials.load(n.creds)  # read as a restart would: the base plus the stored chain
                w = read_current(n.data_dir, c.swarm_id(), c.trainer_public_key())
            except PatchswarmError as e:
                bad.append(f"{n.name}: {e}")
                continue
            if w is None or w.version != self.final_version:
                bad.append(f"{n.name}: holds version {None if w is None else w.version}, expected {self.final_version}")
            elif w.state_hash != want_hash or not same_bits(w.state, served):
                bad.append(f"{n.name}: version {w.version} differs from the published state")
        detail = (f"{len(self.nodes)} nodes' durable states equal the published version {self.final_version} "
                  f"bit for bit (state hash {want_hash[:12]}…)") if not bad else "; ".join(bad)
        return Check("bit-exact weights", not bad, detail)

    def _check_trajectories(self, statuses, stats, submitted: dict, workers_done: bool) -> Check:
        t = stats["trajectories"]
        problems = []
        if not workers_done or any(v is None for v in submitted.values()):
            problems.append("workers that did not finish on their own: "
                            + ", ".join(k for k, v in submitted.items() if v is None))
        sent = sum(v or 0 for v in submitted.values())
        spooled = sum((s.get("spool") or {}).get("appended_total", 0) for s in statuses)
        for i, s in enumerate(statuses):
            sp = s.get("spool") or {}
            got = t["by_node"].get(s["node_id"], 0)
            if submitted.get(f"worker-{i}") not in (None, sp.get("appended_total")):
                problems.append(f"{s['node_id']}: worker submitted {submitted[f'worker-{i}']}, "
                                f"node spooled {sp.get('appended_total')}")
            if sp.get("appended_total") != got or sp.get("acked_total") != got:
                problems.append(f"{s['node_id']}: spooled {sp.get('appended_total')}, acked "
                                f"{sp.get('acked_total')}, origin received {got}")
        consumed = self.trained + self.read_after
        if consumed != t["records"]:
            problems.append(f"origin received {t['records']}, trainer read {consumed}")
        if self.feed.stale or self.feed.below_min or self.bad:
            problems.append(f"skipped by the trainer: {self.feed.stale} stale, {self.bad} undecodable")
        self.counts = {"submitted_by_workers": sent, "spooled_by_nodes": spooled, "received_by_origin": t["records"],
                       "read_by_trainer": consumed, "trained_on": self.trained, "stale": self.feed.stale,
                       "duplicates_dropped": t["duplicates_dropped"]}
        detail = (f"workers submitted {sent}, nodes spooled {spooled}, origin received {t['records']}, "
                  f"trainer trained on {self.trained}" + (f" (+{self.read_after} read after the last step)"
                                                          if self.read_after else ""))
        return Check("every trajectory to the trainer", not problems and sent > 0,
                     detail + ("" if not problems else "; " + "; ".join(problems)))

    def _check_reward(self) -> Check:
        start, end, k = reward_ends(self.rewards)
        steps = "step" if k == 1 else f"{k} steps"
        return Check("reward rose", end > start, f"mean reward of the first {steps} {start:.3f}, of the last {end:.3f}")


def reward_ends(rewards: list[tuple[int, float]]) -> tuple[float, float, int]:
    """(mean reward of the first k steps, of the last k, k): a quarter of the run, 1..5 steps."""
    vals = [r for _, r in rewards]
    if not vals:
        return 0.0, 0.0, 0
    k = max(1, min(5, len(vals) // 4))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k, k


def same_bits(a: dict, b: dict) -> bool:
    """Same names, dtypes, shapes and bytes (compared as raw bytes: NaN payloads and -0.0 count)."""
    import torch

    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


# ================================================================ output


def _checks_table(checks: list[Check]):
    from rich.table import Table

    t = Table(title="checks", show_header=False)
    t.add_column("check")
    t.add_column("result")
    t.add_column("detail", overflow="fold")
    for c in checks:
        t.add_row(c.name, "ok" if c.ok else "FAILED", c.detail)
    return t


def _write_summary(path: Path, cfg: DemoConfig, run: DemoRun, checks: list[Check], figure: Path, wall_s: float) -> None:
    summary = {
        "ok": all(c.ok for c in checks),
        "config": dataclasses.asdict(cfg),
        "wall_s": round(wall_s, 1),
        "load_average": list(os.getloadavg()),
        "final_version": run.final_version,
        "checks": [dataclasses.asdict(c) for c in checks],
        "rewards": run.rewards,
        "reward_start_end": list(reward_ends(run.rewards)),
        "trajectories": run.counts,
        "versions": run.origin_stats["versions"],
        "nodes": [{"node_id": s.get("node_id"), "region": s.get("region"), "version": s.get("version"),
                   "applied": sorted(run.applied.get(s.get("node_id"), ())), "bytes_in": s.get("bytes_in"),
                   "spool": s.get("spool")} for s in run.statuses],
        "figure": str(figure),
        "logs": str(run.logs),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    os.replace(tmp, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--nodes", type=int, default=d.nodes, help=f"rollout nodes (default {d.nodes})")
    p.add_argument("--regions", type=int, default=d.regions, help=f"regions the nodes are spread over (default {d.regions})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the policy and the workers (default {d.seed})")
    p.add_argument("--out", type=Path, help="run directory, new or empty (default: a fresh temporary directory)")


def _config(args: argparse.Namespace) -> DemoConfig:
    if args.steps < 2 or args.nodes < 1 or not 1 <= args.regions <= args.nodes:
        raise UsageError(f"demo: expected --steps >= 2, --nodes >= 1 and 1 <= --regions <= --nodes, found "
                         f"--steps {args.steps} --nodes {args.nodes} --regions {args.regions}")
    return DemoConfig(steps=args.steps, nodes=args.nodes, regions=args.regions, seed=args.seed)


def _run_dir(out: Path | None) -> Path:
    if out is None:
        return Path(tempfile.mkdtemp(prefix="patchswarm-demo-"))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"demo: --out {out}: expected a new or empty directory, found one with files "
                         "(an origin continues the version numbers it finds)")
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(args: argparse.Namespace) -> int:
    """The demo for parsed `args` (see `add_arguments`); the exit status."""
    from rich.console import Console

    cfg = _config(args)
    out = _run_dir(args.out).resolve()
    console = Console()
    signals = StopSignals()
    signals.install()
    demo = DemoRun(cfg, out, console, signals)
    try:
        return _run(demo, console)
    except Interrupted as e:
        console.print(f"demo: interrupted ({e}); stopped its {len(demo.children.all)} child processes; logs in {demo.logs}",
                      highlight=False, soft_wrap=True)
        return 128 + e.signum
    except DemoFailed as e:  # printed whole: it carries the tail of the log that says why
        console.print(f"demo: FAILED: {e}", highlight=False, markup=False)
        return 1
    finally:
        signals.restore()


def _run(demo: DemoRun, console) -> int:
    from .figure import write_figure
    from .view import summary_table

    cfg, out = demo.cfg, demo.out
    console.print(f"patchswarm demo: {cfg.steps} steps, {cfg.nodes} nodes in {cfg.regions} regions, seed "
                  f"{cfg.seed}; run directory {out}", highlight=False, soft_wrap=True)
    checks = demo.execute()
    wall = time.monotonic() - demo.t0
    console.print(summary_table(demo.statuses, demo.origin_stats, demo.rewards))
    console.print(_checks_table(checks))
    figure = write_figure(out / "demo.png", demo.rewards, demo.origin_stats, demo.statuses)
    _write_summary(out / "summary.json", cfg, demo, checks, figure, wall)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    console.print(f"figure: {figure}\nsummary: {out / 'summary.json'}\nlogs: {demo.logs}\n"
                  f"wall time {wall:.0f} s (load average {load})", highlight=False, soft_wrap=True)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        console.print(f"demo: FAILED: {', '.join(failed)}", highlight=False)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patchswarm.node.demo.run", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except PatchswarmError as e:
        print(f"demo: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
