"""patchswarm in the WAN bench: real tracker, origin and node processes in the emulated network.

Owns: issuing credentials with the CLI (`patchswarm swarm init/issue`),
starting the tracker and the origin (`--watch`) in their namespaces and one
`patchswarm node` per node namespace (`--no-peers` for the star baseline),
bringing every node to version 0 (untimed), then dropping version 1 into the
watch directory and timing until every node's status says version >= 1 with
the expected state hash. Must not reach into the daemon's internals: it
speaks only the CLI and the local socket (`node.client.NodeClient`).

Timing: the clock starts when a node first reports `latest_version >= 1` (the
version was published: diffed, signed and announced); the origin's publish
time (checkpoint renamed into the watch dir -> announced) is reported apart.
Status is polled every `POLL_S` over each node's Unix socket.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.netemu import Host, Topology, wait_listening
from bench.wan_runner import Payload, RunFailed, RunResult, SystemUnavailable, keep_logs, log_tails

TRACKER_PORT, ORIGIN_PORT, NODE_PORT = 7700, 7701, 7702
POLL_S = 0.05
# Peak RSS of one daemon, measured: ~750 MB for a 52.6 MB checkpoint (torch ~200 MB + copies of the
# state while applying). Runs that would not fit in MemAvailable are skipped instead of OOM-killing the box.
DAEMON_BASE_BYTES, DAEMON_BYTES_PER_CHECKPOINT_BYTE = 250e6, 10
_CLI_TIMEOUT_S = 120.0


def patchswarm_exe() -> str:
    """The `patchswarm` entry point next to this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("patchswarm")
    return str(here) if here.exists() else (shutil.which("patchswarm") or "patchswarm")


def unavailable_reason() -> str | None:
    """None when `patchswarm node` exists here, else why the system cannot run."""
    try:
        out = subprocess.run([patchswarm_exe(), "node", "--help"], capture_output=True, text=True, timeout=_CLI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"patchswarm CLI not runnable ({e})"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"the patchswarm node daemon is not built yet (`patchswarm node --help`: exit {out.returncode}: {last})"
    try:
        from node.client import NodeClient  # noqa: F401
    except ImportError as e:
        return f"node.client.NodeClient is missing ({e})"
    return None


class PatchswarmRunner:
    """patchswarm (or, with `no_peers`, the star: every node from the origin only)."""

    def __init__(self, no_peers: bool = False, verbose: bool = False, log_dir: Path | None = None):
        self.no_peers = no_peers
        self.name = "star" if no_peers else "patchswarm"
        self.verbose = verbose
        self.log_dir = log_dir      # copy each process's log under log_dir/<system>-<R>x<N>/

    def available(self) -> str | None:
        return unavailable_reason()

    def run(self, topo: Topology, payload: Payload, limit_s: float) -> RunResult:
        reason = self.available() or _memory_shortfall(topo.spec.nodes + 1, payload.target.stat().st_size)
        if reason:
            raise SystemUnavailable(reason)
        work = Path(tempfile.mkdtemp(prefix="psw-ps-"))
        try:
            return self._run(topo, payload, limit_s, work)
        except RunFailed as e:
            raise RunFailed(f"{self.name}: {e}{log_tails(work / 'logs')}") from None
        finally:
            keep_logs(self.log_dir, work / "logs", f"{self.name}-{topo.spec.regions}x{topo.spec.nodes_per_region}")
            shutil.rmtree(work, ignore_errors=True)

    def _run(self, topo: Topology, payload: Payload, limit_s: float, work: Path) -> RunResult:
        from node.client import NodeClient, NodeUnavailable

        deadline = time.monotonic() + limit_s
        exe = patchswarm_exe()
        swarm, creds, logs, watch = work / "swarm", work / "creds", work / "logs", work / "watch"
        for d in (creds, logs, watch):
            d.mkdir()
        _cli([exe, "swarm", "init", str(swarm)])
        roles = {topo.tracker.name: "tracker", topo.origin.name: "origin", **{h.name: "node" for h in topo.nodes}}
        for name, role in roles.items():
            _cli([exe, "swarm", "issue", str(swarm), name, "--role", role, "-o", str(creds / name)])
        _drop(payload.base, watch / "v000.safetensors")

        tracker_addr = f"{topo.tracker.ip}:{TRACKER_PORT}"
        verbose = ["-v"] if self.verbose else []
        self._spawn(topo, topo.tracker, logs, [exe, "tracker", "--listen", tracker_addr,
                                               "--creds", str(creds / "tracker"), *verbose])
        wait_listening(topo, topo.origin, topo.tracker.ip, TRACKER_PORT, deadline - time.monotonic())
        self._spawn(topo, topo.origin, logs, [
            exe, "origin", "--tracker", tracker_addr, "--creds", str(creds / "origin"),
            "--key", str(swarm / "trainer.key"), "--data-dir", str(work / "origin"),
            "--listen", f"{topo.origin.ip}:{ORIGIN_PORT}", "--region", _region(topo.origin.region),
            "--watch", str(watch), *verbose])
        sockets = {}
        for h in topo.nodes:
            data = work / "data" / h.name
            data.mkdir(parents=True)
            sockets[h.name] = data / "node.sock"
            self._spawn(topo, h, logs, [
                exe, "node", "--tracker", tracker_addr, "--creds", str(creds / h.name), "--data-dir", str(data),
                "--listen", f"{h.ip}:{NODE_PORT}", "--region", _region(h.region),
                *(["--no-peers"] if self.no_peers else []), *verbose])
        clients = {name: NodeClient(path) for name, path in sockets.items()}
        try:
            _wait_versions(clients, 0, deadline, NodeUnavailable)          # untimed: version 0 everywhere
            start_status = {n: c.status() for n, c in clients.items()}
            before = topo.counters()
            t_drop = time.monotonic()
            _drop(payload.target, watch / "v001.safetensors")
            seen = _wait_versions(clients, 1, deadline, NodeUnavailable)
            moved = topo.counters() - before
            end_status = {n: c.status() for n, c in clients.items()}
        finally:
            for c in clients.values():
                c.close()
        t_announce = min(s.announced for s in seen.values())
        per_node = {n: s.reached - t_announce for n, s in seen.items()}
        expected = _state_hash(payload.target)
        wrong = sorted(n for n, st in end_status.items() if st.get("state_hash") != expected)
        if wrong:
            raise RunFailed(f"state hash differs from version 1's on {wrong[:6]}: expected {expected}, "
                            f"found {end_status[wrong[0]].get('state_hash')}")
        notes = [f"publish (rename -> first node sees v1) {t_announce - t_drop:.2f} s",
                 _bytes_in_note(start_status, end_status, payload.patch_bytes)]
        return RunResult(self.name, topo.spec, payload.patch_bytes, max(per_node.values()), per_node, moved, notes)

    def _spawn(self, topo: Topology, host: Host, logs: Path, argv: list[str]) -> subprocess.Popen:
        with open(logs / f"{host.name}.log", "wb") as err:
            return topo.spawn(host, argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT)


class _Seen:
    """When the poller first saw a node learn of a version and reach it."""

    def __init__(self):
        self.announced: float | None = None
        self.reached: float | None = None


def _wait_versions(clients: dict, version: int, deadline: float, unavailable: type) -> dict[str, _Seen]:
    seen = {n: _Seen() for n in clients}
    while True:
        for name, client in clients.items():
            s = seen[name]
            if s.reached is not None:
                continue
            try:
                st = client.status()
            except unavailable:
                continue               # not up yet, or restarting: poll again
            now = time.monotonic()
            if s.announced is None and _at_least(st.get("latest_version"), version):
                s.announced = now
            if _at_least(st.get("version"), version):
                s.reached = now
                s.announced = s.announced if s.announced is not None else now
        if all(s.reached is not None for s in seen.values()):
            return seen
        if time.monotonic() > deadline:
            missing = sorted(n for n, s in seen.items() if s.reached is None)
            raise RunFailed(f"{len(missing)} of {len(seen)} nodes did not reach version {version} "
                            f"within the time limit: {missing[:6]}")
        time.sleep(POLL_S)


def _memory_shortfall(daemons: int, checkpoint_bytes: int) -> str | None:
    need = daemons * (DAEMON_BASE_BYTES + DAEMON_BYTES_PER_CHECKPOINT_BYTE * checkpoint_bytes)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if need > avail:
        return (f"{daemons} daemons need ~{need / 1e9:.1f} GB (estimate), {avail / 1e9:.1f} GB is available: "
                f"not started, to spare the machine an OOM kill")
    return None


def _at_least(v, version: int) -> bool:
    return isinstance(v, int) and v >= version


def _bytes_in_note(start: dict, end: dict, patch_bytes: int) -> str:
    """What the nodes say they took in for version 1, by source, in patches."""
    sums = {}
    for key in ("origin", "same_region", "other_region"):
        sums[key] = sum(end[n].get("bytes_in", {}).get(key, 0) - start[n].get("bytes_in", {}).get(key, 0)
                        for n in end)
    return "node chunk bytes in / patch: " + ", ".join(f"{k} {v / patch_bytes:.2f}" for k, v in sums.items())


def _state_hash(path: Path) -> str:
    from node.checkpoint import load_state
    from protocol.statehash import state_hash

    return state_hash(load_state(path)[0])


def _region(r: int) -> str:
    return f"region{r}"


def _drop(src: Path, dst: Path) -> None:
    """Put a checkpoint into the watch dir the way a trainer must: write, then rename into place."""
    tmp = dst.with_name("." + dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _cli(argv: list[str]) -> None:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=_CLI_TIMEOUT_S)
    if out.returncode != 0:
        raise RunFailed(f"{' '.join(argv[1:4])}: exit {out.returncode}: {out.stderr.strip()[-300:]}")

