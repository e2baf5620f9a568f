"""patchswarm in the WAN bench: real tracker, origin and node processes in the emulated network.

Owns: issuing credentials with the CLI (`patchswarm swarm init/issue`),
pre-placing version 0 on every node (`D/weights.safetensors` with patchswarm
metadata, the state the origin publishes as version 0, so nodes start there
and fetch nothing for it), starting the tracker and the origin (`--watch`) in
their namespaces and one `patchswarm node` per node namespace (`--no-peers`
for the star baseline), then dropping version 1 into the watch directory and
waiting until every node's status says version >= 1 with the expected state
hash. Must not reach into the daemon's internals: it speaks only the CLI, the
local socket (`patchswarm.node.client.NodeClient`) and the files whose format is a
contract (the weights file, the origin's `watched.json` ledger).

Timing, from the nodes' own wall-clock timeline (`status()["applied"]`):
the clock starts when the first node learned of version 1 (`announced_at`:
the version was published: diffed, signed and announced). "fetch" ends at the
last node's `complete_at` (every chunk held and verified: the network part,
what libtorrent's "done" measures); "applied" at the last node's
`applied_at` (the patch applied, the state hash checked, the weights file
replaced: CPU, the same work for every system that ships a patch). The
origin's publish time (checkpoint renamed into the watch dir -> announced) is
reported apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import procstat
from bench.linktrace import LinkTrace, rate_table
from bench.netemu import Host, Topology, wait_listening
from bench.wan_runner import Faults, Payload, RunFailed, RunResult, SystemUnavailable, keep_logs, log_tails

TRACKER_PORT, ORIGIN_PORT, NODE_PORT = 7700, 7701, 7702
POLL_S = 0.2   # status polls: the times come from the nodes' own timeline, so this only paces the bench
FAST_POLL_S = 0.05  # while fetching with faults scheduled: the polls also run them
# Peak RSS of one daemon, measured: ~750 MB for a 52.6 MB checkpoint (torch ~200 MB + copies of the
# state while applying). Runs that would not fit in MemAvailable are skipped instead of OOM-killing the box.
DAEMON_BASE_BYTES, DAEMON_BYTES_PER_CHECKPOINT_BYTE = 250e6, 10
_CLI_TIMEOUT_S = 120.0
# After a warm-up version: a node looks at its estimate every 2 s and heartbeats every 2 s, and the
# tracker's delta goes out within 1 s (node/daemon.py UPLINK_CHECK_S, tracker/core.py).
WARMUP_SETTLE_S = 8.0
_CONNECT_WAIT_S = 20.0      # for every node to have its peers before the timed version


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
        from patchswarm.node.client import NodeClient  # noqa: F401
    except ImportError as e:
        return f"patchswarm.node.client.NodeClient is missing ({e})"
    return None


class PatchswarmRunner:
    """patchswarm (or, with `no_peers`, the star: every node from the origin only).

    On a topology with per-region WAN rates the tracker tells every member
    them (its `--wan-rates`) unless `tell_rates` is False (the rate-blind plan,
    for comparison). With `faults`, gateways are killed (and one restarted) during
    the fetch; the times are then over the nodes never killed. Every daemon declares
    its uplink (`uplink_args`: its link's rate, a `slow_uplinks` node's slower one)
    unless `declare_uplinks` is False (the plan without them, for comparison)."""

    def __init__(self, no_peers: bool = False, verbose: bool = False, log_dir: Path | None = None,
                 chunk_bytes: int | None = None, node_args: tuple[str, ...] = (), tell_rates: bool = True,
                 faults: Faults | None = None, nat_regions: tuple[int, ...] = (), declare_uplinks: bool = True,
                 link_trace: int | None = None, link_trace_step_s: float = 0.1, slow_declares_lan: bool = False,
                 warmup: bool = False):
        self.no_peers = no_peers
        # Slow nodes declare the LAN's rate (a host slower or busier than it says; `uplink_args`).
        self.slow_declares_lan = slow_declares_lan
        # One untimed version before the timed one (`WARMUP_SETTLE_S` after it), so what each member
        # measured of its uplink while relaying it is in everyone's plan; the timed version is then
        # version 2, the payload's base again (the same changed elements, the other way).
        self.warmup = warmup
        # A region whose links (and the origin's uplink) are traced during the fetch (bench/linktrace.py)
        # and shown per `link_trace_step_s` from the announcement; None: no trace.
        self.link_trace = link_trace
        self.link_trace_step_s = link_trace_step_s
        self.declare_uplinks = declare_uplinks
        # Regions whose nodes sit behind NAT (the topology's `nat_regions`): they run --no-listen,
        # and every node --transport auto, so the others reach them over WebRTC signalled by the tracker.
        self.nat_regions = tuple(nat_regions)
        self.tell_rates = tell_rates
        self.faults = faults
        self.node_args = tuple(node_args)  # extra `patchswarm node` flags, for side-by-side trials
        # The origin's swarm chunk size (None: its default); segments of as many elements, so a
        # chunk holds about one segment of a patch (a patch codes well under a byte per element).
        self.chunk_bytes = chunk_bytes
        self.name = ("star" if no_peers else "patchswarm") + ("" if tell_rates else " rate-blind") \
            + (" after a warm-up version" if warmup else "") \
            + ("" if faults is None else f" {faults.label()}") \
            + ("" if not nat_regions else " NAT " + ",".join(f"r{r}" for r in nat_regions))
        self.verbose = verbose
        self.log_dir = log_dir      # copy each process's log under log_dir/<system>-<R>x<N>-<run>/
        self.last_logs: Path | None = None  # where the last run's logs were kept

    def available(self) -> str | None:
        return unavailable_reason()

    def run(self, topo: Topology, payload: Payload, limit_s: float) -> RunResult:
        reason = self.available() or _memory_shortfall(topo.spec.nodes + 1, payload.target.stat().st_size)
        if reason:
            raise SystemUnavailable(reason)
        work = Path(tempfile.mkdtemp(prefix="psw-ps-"))
        self._pids: dict[str, int] = {}
        try:
            return self._run(topo, payload, limit_s, work)
        except RunFailed as e:
            raise RunFailed(f"{self.name}: {e}{log_tails(work / 'logs')}") from None
        finally:
            self.last_logs = keep_logs(self.log_dir, work / "logs",
                                       f"{self.name}-{topo.spec.regions}x{topo.spec.nodes_per_region}")
            shutil.rmtree(work, ignore_errors=True)

    def _run(self, topo: Topology, payload: Payload, limit_s: float, work: Path) -> RunResult:
        from patchswarm.node.client import NodeClient, NodeUnavailable

        deadline = time.monotonic() + limit_s
        exe = patchswarm_exe()
        swarm, creds, logs, watch = work / "swarm", work / "creds", work / "logs", work / "watch"
        for d in (creds, logs, watch):
            d.mkdir()
        _cli([exe, "swarm", "init", str(swarm)])
        roles = {topo.tracker.name: "tracker", topo.origin.name: "origin", **{h.name: "node" for h in topo.nodes}}
        for name, role in roles.items():
            _cli([exe, "swarm", "issue", str(swarm), name, "--role", role, "-o", str(creds / name)])
        v0 = work / "v0-weights.safetensors"
        if topo.nodes:
            _write_version0(payload.base, v0, creds / topo.nodes[0].name)
        _drop(payload.base, watch / "v000.safetensors")

        tracker_addr = f"{topo.tracker.ip}:{TRACKER_PORT}"
        verbose = ["-v"] if self.verbose else []
        rates = []  # the tracker tells every member (as a deployment does: one value for the swarm)
        if topo.spec.region_mbit and self.tell_rates:
            rates = ["--wan-rates", ",".join(f"{_region(r)}={topo.spec.region_wan_mbit(r):g}"
                                             for r in range(topo.spec.regions))]
        self._spawn(topo, topo.tracker, logs, [exe, "tracker", "--listen", tracker_addr,
                                               "--creds", str(creds / "tracker"), *rates, *verbose])
        wait_listening(topo, topo.origin, topo.tracker.ip, TRACKER_PORT, deadline - time.monotonic())
        origin_dir = work / "origin"
        self._spawn(topo, topo.origin, logs, [
            exe, "origin", "--tracker", tracker_addr, "--creds", str(creds / "origin"),
            "--key", str(swarm / "trainer.key"), "--data-dir", str(origin_dir),
            "--listen", f"{topo.origin.ip}:{ORIGIN_PORT}", "--region", _region(topo.origin.region),
            "--watch", str(watch), *self._uplink_args(topo, topo.origin.name), *verbose,
            *([] if self.chunk_bytes is None else ["--chunk-bytes", str(self.chunk_bytes),
                                                   "--segment-elements", str(self.chunk_bytes)])])
        sockets = {}
        self._argv: dict[str, list[str]] = {}
        if tuple(topo.spec.nat_regions) != self.nat_regions:
            raise RunFailed(f"expected a topology with regions {self.nat_regions} behind NAT, "
                            f"found {topo.spec.nat_regions}")
        for h in topo.nodes:
            data = work / "data" / h.name
            data.mkdir(parents=True)
            _place(v0, data / "weights.safetensors")
            sockets[h.name] = data / "node.sock"
            self._argv[h.name] = [
                exe, "node", "--tracker", tracker_addr, "--creds", str(creds / h.name), "--data-dir", str(data),
                *(["--no-listen"] if h.region in self.nat_regions else ["--listen", f"{h.ip}:{NODE_PORT}"]),
                *(["--transport", "auto"] if self.nat_regions else []), "--region", _region(h.region),
                *(["--no-peers"] if self.no_peers else []),
                *self._uplink_args(topo, h.name), *self.node_args, *verbose]
            self._spawn(topo, h, logs, self._argv[h.name])
        clients = {name: NodeClient(path) for name, path in sockets.items()}
        trace = None
        try:
            # Untimed: every node at the pre-placed version 0, the origin has published the same
            # state as its version 0, and every node holds the connections it wants.
            _wait_versions(clients, 0, deadline, NodeUnavailable)
            _wait_published(origin_dir, "v000.safetensors", deadline)
            connected = _wait_connected(clients, self._wanted_connections(topo), deadline)
            timed, timed_state = 1, payload.target
            if self.warmup:
                _drop(payload.target, watch / "v001.safetensors")
                _wait_versions(clients, 1, deadline, NodeUnavailable)
                time.sleep(WARMUP_SETTLE_S)
                timed, timed_state = 2, payload.base
            start_status = {n: c.status() for n, c in clients.items()}
            before = topo.counters()
            if self.link_trace is not None:
                trace = LinkTrace({**{h.name: (h.netns, h.iface) for h in topo.hosts},
                                   **{f"wan{r}": (topo.router_ns, f"wan{r}") for r in range(topo.spec.regions)}})
                trace.start()
            t_drop = time.time()
            _drop(timed_state, watch / f"v{timed:03d}.safetensors")
            polled = {n: c for n, c in clients.items()}  # killed nodes leave it; a restarted one is back
            schedule = self._fault_schedule(topo, logs, polled) if self.faults else None
            cpu = _watch_fetch(polled, timed, self._pids, deadline, NodeUnavailable, schedule)
            if trace is not None:
                trace.stop()
            _wait_versions(polled, timed, deadline, NodeUnavailable)
            moved = topo.counters() - before
            end_status = {n: c.status() for n, c in polled.items()}
        finally:
            for c in clients.values():
                c.close()
            if trace is not None:
                trace.close()  # (a run that failed mid-fetch too)
        # Every node's final status (per-peer piece bytes, timeline) beside the logs, for diagnosis.
        (logs / "status.json").write_text(json.dumps(end_status, indent=1, sort_keys=True) + "\n")
        (logs / "fetch-cpu.json").write_text(json.dumps(dataclasses.asdict(cpu), indent=1) + "\n")
        expected = _state_hash(timed_state)
        wrong = sorted(n for n, st in end_status.items() if st.get("state_hash") != expected)
        if wrong:
            raise RunFailed(f"state hash differs from version {timed}'s on {wrong[:6]}: expected {expected}, "
                            f"found {end_status[wrong[0]].get('state_hash')}")
        killed = set(self._killed) if self.faults else set()
        # A restarted node may have learned of the version from its store, not an announcement.
        v1 = {n: _timeline(st, timed) for n, st in end_status.items() if n not in killed}
        back = {n: next((a for a in st.get("applied", []) if a.get("version") == timed), {})
                for n, st in end_status.items()
                if n in killed}
        t_announce = min(e["announced_at"] for e in v1.values())
        per_node = {n: e["complete_at"] - t_announce for n, e in v1.items()}
        applied_s = max(e["applied_at"] for e in v1.values()) - t_announce
        apply_cpu = sorted(e["apply_s"] for e in v1.values())
        swarm_patch = {e["bytes"] for e in v1.values()}
        notes = [f"publish (rename -> first node learns of v{timed}) {t_announce - t_drop:.2f} s",
                 f"apply per node (decode, write, hash check; wall) median {apply_cpu[len(apply_cpu) // 2]:.2f} s, "
                 f"max {apply_cpu[-1]:.2f} s",
                 _version0_note(start_status, connected) if not self.warmup else
                 f"version 1 fetched untimed first (warm-up), {WARMUP_SETTLE_S:g} s before version 2; "
                 + _said_note(start_status),
                 f"swarm patch as the origin chunks it: {', '.join(f'{b:,}' for b in sorted(swarm_patch))} bytes",
                 _bytes_in_note(start_status, end_status, payload.patch_bytes),
                 f"CPU while fetching (first node learns of v1 -> every node holds it, as polled): "
                 f"{cpu.wall_s:.2f} s wall; the swarm's processes used {cpu.swarm_s:.2f} CPU-s, everything on "
                 f"the machine {cpu.busy_s:.2f} of the {cpu.cores} cores' {cpu.cores * cpu.wall_s:.2f} CPU-s"]
        stalls = {n: st["longest_wait_s"][f"v{timed} patch"] for n, st in end_status.items()
                  if n not in killed and f"v{timed} patch" in st.get("longest_wait_s", {})}
        if self.faults:
            back = {n: f"{e['complete_at'] - t_announce:.2f} s" if "complete_at" in e else "?" for n, e in back.items()}
            notes.append(f"{self.faults.label()}: killed {sorted(killed)}; restarted and complete: {back or 'none'}; "
                         f"times, stalls and bounds over the {len(per_node)} nodes never killed")
        if self.nat_regions:
            notes.append(_transport_note(start_status, end_status, payload.patch_bytes))
        measured = {n: st["uplink_measured_mbit"] for n, st in sorted(end_status.items())
                    if st.get("uplink_measured_mbit") is not None}
        if measured:  # (protocol/uplinkmeter.py: only where sends backed up)
            notes.append("uplink measured while sends backed up (Mbit/s; status 'uplink_measured_mbit'): "
                         + ", ".join(f"{n} {v:g}" for n, v in measured.items()))
        if stalls:
            notes.append("stall = the longest a node went without a chunk arriving while it lacked chunks "
                         "(from learning of the version; the node's own clock, status 'longest_wait_s')")
        table = ""
        if trace is not None:
            (logs / "link-trace.json").write_text(json.dumps(
                {"announced_at": t_announce, "samples": trace.samples}) + "\n")
            region = [h.name for h in topo.nodes_in(self.link_trace)]
            g = self.link_trace
            into = [("origin", "tx")] if g == topo.spec.origin_region else [(f"wan{g}", "tx")]
            columns = into + [(n, "rx") for n in region] + [(n, "tx") for n in region]
            table = (f"links of r{g} from the announcement (Mbit/s per {self.link_trace_step_s:g} s, as the links "
                     f"counted them; rx: a host's downlink, tx: its uplink"
                     + ("" if g == topo.spec.origin_region else f"; wan{g} tx: into r{g} over its WAN link") + "):\n"
                     + rate_table(trace.samples, columns, t_announce,
                                  max(per_node.values()) + 2 * self.link_trace_step_s, self.link_trace_step_s))
        limit = download_limit(self.node_args)
        if limit is not None:
            links_s = topo.spec.lower_bound_s(payload.patch_bytes)
            notes.append(f"bound: each node's --download-limit, {limit:,.0f} B/s, bounds it at "
                         f"{payload.patch_bytes / limit:.2f} s (the links alone: {links_s:.2f} s)")
        return RunResult(self.name, topo.spec, payload.patch_bytes, max(per_node.values()), per_node, moved, notes,
                         applied_s=applied_s, stall_s=stalls, busy=[(t - t_announce, b, k) for t, b, k in cpu.samples],
                         cores=cpu.cores, link_table=table, node_download_bps=limit)

    def _fault_schedule(self, topo: Topology, logs: Path, polled: dict):
        """The fault events as a function of seconds since the announcement: each call runs those due."""
        from patchswarm.node.client import NodeClient

        victims = first_gateways(topo)
        self._killed = victims
        hosts = {h.name: h for h in topo.nodes}
        events = self.faults.events(victims)

        def run_due(since: float) -> None:
            while events and events[0][0] <= since:
                _, what, name = events.pop(0)
                if what == "kill":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self._pids[name], signal.SIGKILL)
                    polled.pop(name, None)
                else:
                    self._spawn(topo, hosts[name], logs, self._argv[name], log_name=f"{name}.restarted")
                    polled[name] = NodeClient(Path(self._argv[name][self._argv[name].index("--data-dir") + 1])
                                              / "node.sock")
        return run_due

    def _uplink_args(self, topo: Topology, host: str) -> list[str]:
        return uplink_args(topo.spec, host, self.declare_uplinks, self.slow_declares_lan)

    def _wanted_connections(self, topo: Topology) -> int:
        """How many peers (origin included) a node holds at least once the swarm has settled:
        the ones it dials (node/dialer.py `Dialer.wanted`); others may dial it too."""
        from patchswarm.node.dialer import OTHER_REGION_PEERS, SAME_REGION_PEERS

        if self.no_peers:
            return 1
        n, others = topo.spec.nodes_per_region, topo.spec.regions - 1
        return min(n - 1, SAME_REGION_PEERS) + others * min(n, OTHER_REGION_PEERS) + 1

    def _spawn(self, topo: Topology, host: Host, logs: Path, argv: list[str],
               log_name: str | None = None) -> subprocess.Popen:
        with open(logs / f"{log_name or host.name}.log", "wb") as err:
            proc = topo.spawn(host, argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT)
        self._pids[host.name] = proc.pid    # `ip netns exec` execs the command: the same pid
        return proc


def download_limit(node_args) -> float | None:
    """The `--download-limit` in extra node flags, bytes/s (the daemon's own parsing), or None."""
    from patchswarm.node.cli.services import parse_rate

    args = list(node_args)
    for i, a in enumerate(args):
        if a == "--download-limit" and i + 1 < len(args):
            return parse_rate(args[i + 1])
        if a.startswith("--download-limit="):
            return parse_rate(a.split("=", 1)[1])
    return None


def uplink_args(spec, host: str, declare: bool = True, slow_declares_lan: bool = False) -> list[str]:
    """The `--uplink-mbit` a daemon on `host` declares: its link's rate each way (`lan_mbit`), or
    its `slow_uplinks` rate (the LAN's too with `slow_declares_lan`: bench/wan.py
    --slow-declares-lan); nothing where `declare` is False (bench/wan.py --no-declare-uplinks)."""
    if not declare:
        return []
    slow = {} if slow_declares_lan else dict(spec.slow_uplinks)
    return ["--uplink-mbit", f"{slow.get(host, spec.lan_mbit):g}"]


def first_gateways(topo: Topology) -> list[str]:
    """The fault victims: in each region other than the origin's, the first gateway (by the
    plan's weight) of version 1's patch, the node that takes the most of it across the WAN.
    Node ids are the host names, so the same names serve any system on the topology."""
    from patchswarm.protocol.picker import WAN_GATEWAYS
    from patchswarm.protocol.responsibility import gateway_weight, gateways

    victims = []
    for r in range(topo.spec.regions):
        if r == topo.spec.origin_region:
            continue
        gws = gateways((1, False), [h.name for h in topo.nodes_in(r)], WAN_GATEWAYS)
        if gws:
            victims.append(max(gws, key=lambda m: (gateway_weight(m, (1, False)), m)))
    return victims


def _poll_until(clients: dict, done, what: str, deadline: float, unavailable: type, seen=None, tick=None,
                poll_s: float = POLL_S) -> None:
    """Poll every node's status until `done(status)` holds for each; `seen(status)` sees every status read,
    `tick()` runs before each round. A name that leaves `clients` (a node killed) is no longer waited for."""
    left, finished = set(clients), set()
    while left:
        if tick is not None:
            tick()
        for name in sorted(left):
            if name not in clients:
                left.discard(name)
                continue
            try:
                st = clients[name].status()
            except unavailable:
                continue               # not up yet, or restarting: poll again
            if seen is not None:
                seen(st)
            if done(st):
                left.discard(name)
                finished.add(name)
        left |= {n for n in clients if n not in finished}  # a restarted node is waited for again
        if left:
            if time.monotonic() > deadline:
                raise RunFailed(f"{len(left)} of {len(clients)} nodes did not {what} within the time limit: "
                                f"{sorted(left)[:6]}")
            time.sleep(poll_s)


def _wait_versions(clients: dict, version: int, deadline: float, unavailable: type) -> None:
    _poll_until(clients, lambda st: _at_least(st.get("version"), version), f"reach version {version}",
                deadline, unavailable)


@dataclasses.dataclass
class _FetchCpu:
    wall_s: float                # first node learned of the version -> every node holds every chunk (polled)
    swarm_s: float               # CPU seconds of the tracker, origin and nodes in that window
    busy_s: float                # CPU seconds of the whole machine (every process, not only ours)
    cores: int
    per_host_s: dict[str, float]  # the swarm's CPU seconds by host name
    # (wall clock, the machine's busy CPU-s since boot, of them the kernel's) at each status read
    samples: list[tuple[float, float, float]]


def _watch_fetch(clients: dict, version: int, pids: dict[str, int], deadline: float,
                 unavailable: type, schedule=None) -> _FetchCpu:
    """Poll until every node holds every chunk of `version`; CPU used from its announcement until then.
    `schedule(seconds since the announcement)` runs fault events (polled faster, to be on time)."""
    started, samples = [], []

    def seen(st: dict) -> None:
        samples.append((time.time(), *procstat.machine_cpu_seconds()))
        if not started and _at_least(st.get("latest_version"), version):
            started.append((time.monotonic(), _process_cpu_s(pids), samples[-1][1]))  # the sample just read

    def tick() -> None:
        if schedule is not None and started:
            schedule(time.monotonic() - started[0][0])

    def fetched(st: dict) -> bool:
        fetching = st.get("fetching") or {}
        return _at_least(st.get("version"), version) or bool(
            _at_least(st.get("latest_version"), version) and fetching and not any(fetching.values()))

    _poll_until(clients, fetched, f"fetch version {version}", deadline, unavailable, seen, tick,
                poll_s=FAST_POLL_S if schedule is not None else POLL_S)
    t0, cpu0, busy0 = started[0] if started else (time.monotonic(), _process_cpu_s(pids), procstat.machine_busy_seconds())
    cpu = _process_cpu_s(pids)
    # A node restarted meanwhile is a new process: all of its CPU time is in the window.
    per_host = {n: round(cpu[n] - (cpu0.get(n, 0.0) if pids[n] == cpu0.pids.get(n) else 0.0), 2) for n in cpu}
    return _FetchCpu(time.monotonic() - t0, sum(per_host.values()), procstat.machine_busy_seconds() - busy0,
                     os.cpu_count() or 1, per_host, samples)


class _CpuTimes(dict):
    """name -> CPU seconds, with the pid each was read from (`pids`)."""

    pids: dict[str, int]


def _process_cpu_s(pids: dict[str, int]) -> _CpuTimes:
    """User + system CPU seconds of each process (all its threads) so far, by name."""
    out = _CpuTimes()
    out.pids = dict(pids)
    for name, pid in pids.items():
        seconds = procstat.process_cpu_seconds(pid)
        if seconds is not None:
            out[name] = seconds
    return out


def _wait_published(origin_dir: Path, name: str, deadline: float) -> None:
    """Wait until the origin's watch ledger lists `name` (written after it announced that checkpoint)."""
    ledger = origin_dir / "watched.json"
    while True:
        try:
            if name in json.loads(ledger.read_text()):
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise RunFailed(f"the origin did not publish {name} within the time limit")
        time.sleep(POLL_S)


def _wait_connected(clients: dict, want: int, deadline: float) -> dict[str, int]:
    """Wait (at most _CONNECT_WAIT_S) until each node has `want` peers; name -> peers it had."""
    until = min(deadline, time.monotonic() + _CONNECT_WAIT_S)
    while True:
        have = {n: len(c.status().get("peers", [])) for n, c in clients.items()}
        if all(h >= want for h in have.values()) or time.monotonic() > until:
            return have
        time.sleep(POLL_S)


def _timeline(status: dict, version: int) -> dict:
    """A node's timeline of `version` from its status (announced_at, complete_at, applied_at, apply_s, bytes)."""
    entry = next((a for a in status.get("applied", []) if a.get("version") == version), None)
    need = ("announced_at", "complete_at", "applied_at", "apply_s", "bytes")
    if entry is None or any(k not in entry for k in need):
        raise RunFailed(f"{status.get('node_id')}: expected a timeline of version {version} with {need} in its "
                        f"status, found {entry}")
    return entry


def _said_note(status: dict) -> str:
    """The uplinks the nodes say (status 'uplink_said_mbit') where one differs from what it declares."""
    said = {n: st.get("uplink_said_mbit") for n, st in sorted(status.items())
            if st.get("uplink_said_mbit") != st.get("uplink_mbit")}
    return ("uplinks said after it, where not as declared (Mbit/s): "
            + (", ".join(f"{n} {v}" for n, v in said.items()) if said else "none"))


def _version0_note(start: dict, connected: dict[str, int]) -> str:
    """Check that no node fetched or applied anything for version 0 (it was pre-placed); a note."""
    fetched = sum(sum(st.get("bytes_in", {}).values()) for st in start.values())
    applied = sorted(n for n, st in start.items() if st.get("applied"))
    if fetched or applied:
        raise RunFailed(f"version 0 was pre-placed, yet nodes fetched {fetched:,} chunk bytes before version 1 "
                        f"and applied a version on {applied[:6]}")
    lo, hi = min(connected.values(), default=0), max(connected.values(), default=0)
    return (f"version 0 pre-placed on every node (nothing fetched for it); "
            f"peers per node at the start: {lo if lo == hi else f'{lo}-{hi}'}")


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


def _transport_note(start: dict, end: dict, patch_bytes: int) -> str:
    """What the nodes took in for version 1 over each transport (and WebRTC path), in patches."""
    def by_way(statuses: dict) -> dict[str, int]:
        out: dict[str, int] = {}
        for st in statuses.values():
            for q in st.get("peers", []):
                way = q.get("transport", "tcp") + (f" {q['path']}" if q.get("path") else "")
                out[way] = out.get(way, 0) + q.get("bytes_in", 0)
        return out
    # Connections open at the start are still open at the end (their counters grow), and any
    # opened later start at zero: the difference is what moved for version 1 either way.
    before, after = by_way(start), by_way(end)
    return "node chunk bytes in by transport / patch: " + ", ".join(
        f"{w} {(n - before.get(w, 0)) / patch_bytes:.2f}" for w, n in sorted(after.items()))


def _state_hash(path: Path) -> str:
    from patchswarm.node.checkpoint import load_state
    from patchswarm.protocol.statehash import state_hash

    return state_hash(load_state(path)[0])


def _region(r: int) -> str:
    return f"region{r}"


def _write_version0(checkpoint: Path, dst: Path, node_creds: Path) -> None:
    """Version 0 as a node's weights file: the checkpoint's state with patchswarm metadata (swarm id, hash)."""
    from patchswarm.node.checkpoint import load_state
    from patchswarm.node.net.trust import Credentials
    from patchswarm.node.weights import Weights, write_weights
    from patchswarm.protocol.statehash import state_hash

    state = load_state(checkpoint)[0]
    write_weights(dst, Weights(state, 0, state_hash(state), Credentials.load(node_creds).swarm_id()))


def _place(src: Path, dst: Path) -> None:
    """One node's copy of version 0: a hard link (the daemon replaces the file by rename, never in place)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _drop(src: Path, dst: Path) -> None:
    """Put a checkpoint into the watch dir the way a trainer must: write, then rename into place."""
    tmp = dst.with_name("." + dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _cli(argv: list[str]) -> None:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=_CLI_TIMEOUT_S)
    if out.returncode != 0:
        raise RunFailed(f"{' '.join(argv[1:4])}: exit {out.returncode}: {out.stderr.strip()[-300:]}")

