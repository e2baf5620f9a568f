"""A swarm of real processes on loopback for integration tests: tracker, origin, nodes via the CLI.

`SwarmLab(tmp_path)` makes a swarm (CA, trainer key) and issues credentials in this
process (node/net/trust.py, what `patchswarm swarm init|issue` call: a command's start cost
~0.5 s of CPU per member; test_trust.py and test_region_binding.py run the commands), starts
`python -m patchswarm.node.cli tracker|origin|node` with logs in files, finds their addresses
in their logs, and stops every process it started (SIGTERM, then SIGKILL) when closed.
Every wait is bounded in time. For trajectories:
`Submitter` (a rollout worker), `dump` and `summary` (the origin's store), `exactly_once`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from patchswarm.node.client import NodeClient, NodeError, NodeUnavailable
from patchswarm.node.net import trust

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on ([^\s,;\"]+)")  # text or JSON log lines
HTTP_LISTENING = re.compile(r"readiness on http://([^\s/\"]+)/")  # node/net/exporter.py, with --metrics


@dataclasses.dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    data_dir: Path | None = None
    addr: str | None = None
    creds: Path | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the environment at each start
    prefix: list[str] = dataclasses.field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]

    @property
    def socket(self) -> Path:
        return self.data_dir / "node.sock"

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def client(self) -> NodeClient:
        return NodeClient(self.socket)

    def status(self) -> dict:
        with self.client() as c:
            return c.status()


class SwarmLab:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.swarm = self.root / "swarm"
        self.procs: list[Proc] = []
        trust.init_swarm(self.swarm)
        self.tracker_addr: str | None = None

    # -------------------------------------------------------- plumbing

    def _cli(self, *args) -> str:
        r = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", *map(str, args)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise AssertionError(f"patchswarm {' '.join(map(str, args))} failed: {r.stderr}")
        return r.stdout

    def creds(self, name: str, role: str, region: str | None = None) -> Path:
        """`name`'s credentials, issued the first time (bound to `region` where given)."""
        out = self.root / "creds" / name
        if not out.exists():
            trust.issue(self.swarm, name, role, out, region=region)
        return out

    def _start(self, p: Proc) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **p.env}
        log = open(p.log, "ab")
        p.popen = subprocess.Popen([*p.prefix, sys.executable, "-m", "patchswarm.node.cli", *map(str, p.args)],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        if p not in self.procs:
            self.procs.append(p)
        return p

    def wait_log(self, p: Proc, pattern: str | re.Pattern, timeout: float = 60.0, after: int = 0) -> re.Match:
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(p.text(), after)
            if m:
                return m
            if not p.alive():
                raise AssertionError(f"{p.name} exited ({p.popen.returncode}) before /{rx.pattern}/:\n{p.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"{p.name}: no /{rx.pattern}/ within {timeout} s:\n{p.text()[-3000:]}")

    # -------------------------------------------------------- members

    def start_tracker(self, name: str = "tracker", port: int = 0, extra: list[str] = (), prefix: list[str] = ()) -> Proc:
        creds = self.creds(name, "tracker")
        p = Proc(name, ["tracker", "--creds", creds, "--listen", f"127.0.0.1:{port}", *extra],
                 self.root / f"{name}.log", prefix=list(prefix))
        self._start(p)
        self.listening(p)
        self.tracker_addr = p.addr
        return p

    def start_origin(self, name: str = "origin", region: str = "r0", watch: Path | None = None,
                     extra: list[str] = (), prefix: list[str] = (), wait: bool = True) -> Proc:
        creds = self.creds(name, "origin")
        data = self.root / name
        args = ["origin", "--tracker", self.tracker_addr, "--creds", creds, "--key", self.swarm / "trainer.key",
                "--data-dir", data, "--listen", "127.0.0.1:0", "--region", region, *extra]
        if watch is not None:
            args += ["--watch", watch]
        p = Proc(name, args, self.root / f"{name}.log", data_dir=data, creds=creds, prefix=list(prefix))
        self._start(p)
        if wait:
            self.listening(p)
        return p

    def start_node(self, name: str, region: str = "r0", extra: list[str] = (), creds: Path | None = None,
                   wait: bool = True, env: dict[str, str] | None = None, prefix: list[str] = ()) -> Proc:
        creds = creds or self.creds(name, "node")
        data = self.root / name
        p = Proc(name, ["node", "--tracker", self.tracker_addr, "--creds", creds, "--data-dir", data,
                        "--listen", "127.0.0.1:0", "--region", region, *extra], self.root / f"{name}.log",
                 data_dir=data, creds=creds, env=env or {}, prefix=list(prefix))
        self._start(p)
        if wait:
            self.listening(p)
        return p

    def start_nodes(self, members: list[tuple[str, str]], starting: list[Proc] = (), **kw) -> list[Proc]:
        """Nodes (name, region) started together, each with `start_node`'s `kw`, then each waited
        for, and with them the members in `starting` (started with wait=False): a start is ~2 s of
        CPU, most of it importing torch, and one after another they were most of a swarm test's
        set-up."""
        nodes = [self.start_node(name, region, wait=False, **kw) for name, region in members]
        self.listening(*starting, *nodes)
        return nodes

    def listening(self, *procs: Proc) -> None:
        """Until each of `procs` logs its address; sets its `addr`."""
        for p in procs:
            p.addr = self.wait_log(p, LISTENING).group(1)

    def http_addr(self, p: Proc) -> str:
        """The HOST:PORT a member started with `--metrics` serves HTTP on."""
        return self.wait_log(p, HTTP_LISTENING).group(1)

    def restart(self, p: Proc) -> Proc:
        offset = len(p.text())
        self._start(p)
        m = self.wait_log(p, LISTENING, after=offset)
        p.addr = m.group(1)
        return p

    def kill(self, p: Proc, sig: int = signal.SIGKILL) -> None:
        if p.alive():
            p.popen.send_signal(sig)
            p.popen.wait(timeout=30)

    def close(self) -> None:
        for p in self.procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            if p.popen is None:
                continue
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=10)

    def __enter__(self) -> "SwarmLab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------- checks

    def wait_version(self, nodes: list[Proc], version: int, timeout: float = 120.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        out = []
        for p in nodes:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{p.name} did not reach version {version} in {timeout} s; "
                                         f"status {self._status_or_none(p)}\n{p.text()[-3000:]}")
                try:
                    with p.client() as c:
                        out.append(c.wait_version(version, min(left, 5.0)))
                    break
                except NodeUnavailable:
                    if not p.alive():
                        raise AssertionError(f"{p.name} died:\n{p.text()[-3000:]}") from None
                    time.sleep(0.2)
                except Exception as e:  # NodeError timeout: poll again until the deadline
                    if getattr(e, "code", None) != "timeout":
                        raise
        return out

    def _status_or_none(self, p: Proc):
        try:
            return p.status()
        except Exception as e:
            return f"unavailable ({e})"


def wait_until(check, what: str, timeout: float = 60.0, poll: float = 0.2):
    """`check()`'s first true value, polled every `poll` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"not within {timeout} s: {what}")


def write_checkpoint(directory: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    """Write a checkpoint the way trainers should: to a temporary name, then rename into place."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    final = directory / name
    os.replace(tmp, final)
    return final


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def load_weights(p: Proc) -> dict[str, torch.Tensor]:
    """The latest version a member's data dir holds, read as a restart would (its base file
    plus the stored patches after it, each verified), without touching the files."""
    from patchswarm.node.net.trust import Credentials
    from patchswarm.node.persistence import read_current

    c = Credentials.load(p.creds)
    w = read_current(p.data_dir, c.swarm_id(), c.trainer_public_key())
    if w is None:
        raise AssertionError(f"{p.name}: no version in {p.data_dir}")
    return w.state


def _trajectories(origin, flag: str) -> str:
    r = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", "trajectories", "--data-dir", origin.data_dir, flag],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def dump(origin) -> list[dict]:
    """Every trajectory record in the origin's store, in arrival order (`trajectories --dump`)."""
    return [json.loads(line) for line in _trajectories(origin, "--dump").splitlines()]


def summary(origin) -> dict:
    """The origin's store in numbers (`trajectories --json`): records, by_node, duplicates_dropped..."""
    return json.loads(_trajectories(origin, "--json"))


def wait_spools_empty(lab: SwarmLab, nodes, timeout: float = 120.0) -> None:
    """Until every node's spool is empty: all it took in is acked by the origin."""
    deadline = time.monotonic() + timeout
    for p in nodes:
        while True:
            try:
                spool = p.status()["spool"]
                if spool["records"] == 0:
                    break
            except NodeError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{p.name}'s spool did not drain: {lab._status_or_none(p)}\n{p.text()[-2000:]}")
            time.sleep(0.2)


class Submitter(threading.Thread):
    """A rollout worker: submits numbered records to one node until told to stop; notes which were acked.

    `pause`: seconds between batches. A real worker rolls out between submits; at none, four
    workers put ~100,000 records (~170 MB) into a 20 s test, whose dump alone then takes 7 s.
    """

    def __init__(self, node, stop: threading.Event, rng: random.Random, pause: float = 0.0):
        super().__init__(daemon=True)
        self.node, self.stop, self.rng, self.pause = node, stop, rng, pause
        self.acked: dict[bytes, int] = {}  # payload -> seq
        self.unacked: set[bytes] = set()
        self.n = 0

    def payload(self) -> bytes:
        self.n += 1
        head = f"{self.node.name}/{self.n}/".encode()
        return head + self.rng.randbytes(self.rng.randrange(16, 3000))

    def run(self) -> None:
        client = None
        while not self.stop.is_set():
            batch = [self.payload() for _ in range(self.rng.randrange(1, 8))]
            try:
                client = client or NodeClient(self.node.socket)
                seqs = client.submit_many([(p, 3, {"n": self.n}) for p in batch], timeout=10)
                self.acked.update(zip(batch, seqs))
                self.stop.wait(self.pause)
            except NodeError:
                self.unacked.update(batch)  # the node died mid-call: maybe stored, maybe not
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.1)


def exactly_once(records: list[dict], workers: list[Submitter]) -> dict[str, int]:
    """What went wrong between what `workers` submitted and the origin's `records` (dump):
    acked records missing, extra copies of any record (by payload or by node and seq),
    and records nobody submitted. All must be 0."""
    acked = {p for w in workers for p in w.acked}
    unacked = set().union(*(w.unacked for w in workers))
    seen: dict[bytes, int] = {}
    for r in records:
        payload = base64.b64decode(r["payload_b64"])
        seen[payload] = seen.get(payload, 0) + 1
    keys = {(r["node_id"], r["seq"]) for r in records}
    return {"acked_missing": sum(1 for p in acked if p not in seen),
            "stored_twice": len(records) - min(len(seen), len(keys)),  # extra copies, by payload or by key
            "stray": sum(1 for p in seen if p not in acked and p not in unacked)}
