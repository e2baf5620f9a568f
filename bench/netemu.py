"""An emulated multi-region network on one Linux host: namespaces, veth, bridges, tc tbf.

Owns: building a WAN topology (`Topology`, from a `WanSpec`), its rate limits
(tbf in both directions of every link), the byte counters that say what crossed
each region's WAN link and what each host sent, running processes inside a
host's namespace, tearing all of it down on exit (exceptions and Ctrl-C
included), and removing leftovers of a killed run by name prefix (`cleanup`).

Layout (R regions, N nodes per region, origin and tracker in `origin_region`):

    host netns  eth0 10.<r+1>.0.<k>/24 ─veth─ h<k> ┐
    host netns  ...                               ├ br0 in region netns r ─ wan ─veth─ wan<r> 10.<r+1>.0.254  router netns
    origin .250, tracker .251 (origin region)     ┘                                   (ip_forward on)

- node/origin/tracker links: `lan_mbit` each way (tbf on eth0 = host upload,
  tbf on h<k> = host download);
- region WAN links: `wan_mbit` each way, or each region's own rate
  (`region_mbit`) (tbf on wan<r> in the router = bytes INTO region r, tbf on
  `wan` in the region = bytes OUT of region r).

A region in `nat_regions` sits behind NAT, as a cloud's private subnet behind
its NAT gateway: the router masquerades what leaves it (port-preserving, so
hole punching works) and lets nothing in that its hosts did not start (new
connections and datagrams into the region, or to the router's own addresses,
are dropped; nftables). Its hosts keep their addresses inside the region.

Bytes into region r are the router's `wan<r>` tx counter, bytes out its rx
counter (the kernel's per-interface counters, the same numbers as
/sys/class/net/IF/statistics, read over netlink with `ip -j -s`): link-layer
bytes, so TCP/IP/Ethernet headers (~4.5 % at MTU 1500) are included.

Must not: touch the root namespace (its interfaces, routes, sysctls: nothing is
created there, veth ends are born inside their namespaces), or send traffic to
anything outside the namespaces it creates. Needs root and iproute2. There is
no latency emulation unless the kernel has sch_netem (this one does not):
asking for latency without it is an error, not a silent zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "psw-"                  # every namespace this module creates starts with it
LINK_QUEUE_MS = 50               # tbf queue length in time at the link rate
_TBF_MIN_BURST = 64 * 1024       # >= one GSO super-packet, so tbf rarely splits them
_TBF_BURST_S = 0.002             # bucket depth in seconds of rate at high rates
_TERM_GRACE_S = 3.0
_ORIGIN_HOST, _TRACKER_HOST, _ROUTER_HOST = 250, 251, 254
_IP_TIMEOUT_S = 30.0
_instances = itertools.count()


NICE = 10  # WanSpec.nice_regions' processes: CPU weight ~1/10 of a nice-0 process's


class NamespaceUnavailable(RuntimeError):
    """This process cannot build namespaces here (not root, no iproute2, no permission)."""


class TopologyError(RuntimeError):
    """An `ip`/`tc` command failed while building or reading the topology."""


@dataclasses.dataclass(frozen=True)
class WanSpec:
    """Shape and limits of the emulated network. Rates are in Mbit/s, each way."""

    regions: int = 3
    nodes_per_region: int = 4
    wan_mbit: float = 100.0
    lan_mbit: float = 1000.0
    wan_delay_ms: float = 0.0    # one-way delay per WAN link traversal (needs sch_netem)
    origin_region: int = 0
    # False: hosts set net.ipv4.tcp_slow_start_after_idle=0, the usual tuning of
    # WAN data movers; the kernel default restarts a connection idle for more
    # than its RTO from the initial window, and swarm connections idle between
    # pieces. Every system in one run sees the same hosts.
    idle_restart: bool = True
    # The hosts' TCP congestion control (net.ipv4.tcp_congestion_control in each host's namespace);
    # "": the kernel's default, which new namespaces take from the root one (`default_congestion_control`).
    tcp_congestion: str = ""
    # Each region's WAN link, Mbit/s each way, in region order; empty: `wan_mbit` for every region.
    region_mbit: tuple[float, ...] = ()
    # Regions behind NAT (nothing from outside reaches their hosts unless they started it).
    nat_regions: tuple[int, ...] = ()
    # Regions whose hosts' processes run at nice 10: they take the shared cores only after the
    # others, as if those others had cores of their own (a diagnosis, not a network property).
    nice_regions: tuple[int, ...] = ()
    # Hosts whose uplink is slower than `lan_mbit`: (name, Mbit/s) pairs, e.g. (("n0.2", 10.0),): a
    # busier or smaller machine among its region's members (their downlinks stay at `lan_mbit`).
    slow_uplinks: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        names = {f"n{r}.{k}" for r in range(self.regions) for k in range(1, self.nodes_per_region + 1)}
        bad = [(n, m) for n, m in self.slow_uplinks if n not in names or not 0 < m]
        if bad:
            raise ValueError(f"slow_uplinks: expected (node name n<region>.<k>, Mbit/s > 0) pairs of this "
                             f"topology's nodes, found {bad}")
        if any(not 0 <= r < self.regions for r in self.nice_regions):
            raise ValueError(f"nice_regions: expected regions in 0..{self.regions - 1}, found {self.nice_regions}")
        if any(not 0 <= r < self.regions or r == self.origin_region for r in self.nat_regions):
            raise ValueError(f"nat_regions: expected regions in 0..{self.regions - 1} other than the origin's "
                             f"({self.origin_region}), found {self.nat_regions}")
        if self.region_mbit and (len(self.region_mbit) != self.regions or min(self.region_mbit) <= 0):
            raise ValueError(f"region_mbit: expected {self.regions} rates > 0, found {self.region_mbit}")
        if not 1 <= self.regions <= 250:
            raise ValueError(f"regions: expected 1..250, found {self.regions}")
        if not 0 <= self.nodes_per_region < _ORIGIN_HOST:
            raise ValueError(f"nodes_per_region: expected 0..{_ORIGIN_HOST - 1}, found {self.nodes_per_region}")
        if self.wan_mbit <= 0 or self.lan_mbit <= 0:
            raise ValueError(f"rates: expected > 0 Mbit/s, found wan {self.wan_mbit}, lan {self.lan_mbit}")
        if not 0 <= self.origin_region < self.regions:
            raise ValueError(f"origin_region: expected 0..{self.regions - 1}, found {self.origin_region}")
        if self.tcp_congestion and self.tcp_congestion not in available_congestion_controls():
            raise ValueError(f"tcp_congestion: expected one of the kernel's {available_congestion_controls()}, "
                             f"found {self.tcp_congestion!r}")
        if self.wan_delay_ms < 0:
            raise ValueError(f"wan_delay_ms: expected >= 0, found {self.wan_delay_ms}")

    @property
    def wan_bytes_per_s(self) -> float:
        return self.wan_mbit * 1e6 / 8

    @property
    def lan_bytes_per_s(self) -> float:
        return self.lan_mbit * 1e6 / 8

    @property
    def nodes(self) -> int:
        return self.regions * self.nodes_per_region

    def region_wan_mbit(self, region: int) -> float:
        """Region `region`'s WAN link rate, Mbit/s each way."""
        return self.region_mbit[region] if self.region_mbit else self.wan_mbit

    def region_bound_s(self, payload_bytes: int, region: int) -> float:
        """Fastest any system can put `payload_bytes` on every node of `region`:
        payload ÷ the slowest of a node's downlink, the origin's uplink and,
        outside the origin's region, the region's WAN ingress and the origin
        region's WAN egress (every byte leaves it at least once)."""
        rates = [self.lan_bytes_per_s]
        if region != self.origin_region:
            rates += [self.region_wan_mbit(region) * 1e6 / 8, self.region_wan_mbit(self.origin_region) * 1e6 / 8]
        return payload_bytes / min(rates)

    def lower_bound_s(self, payload_bytes: int) -> float:
        """Fastest any system can put `payload_bytes` on every node (link rates, no headers):
        the largest `region_bound_s` over the regions with nodes. (Remote regions may
        share the origin region's egress: each byte must leave it only once.)"""
        if not self.nodes_per_region:
            return payload_bytes / self.lan_bytes_per_s
        return max(self.region_bound_s(payload_bytes, r) for r in range(self.regions))


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated machine: its own namespace with `eth0` into its region's bridge."""

    name: str        # "origin", "tracker", "n<region>.<k>"
    netns: str
    ip: str
    region: int
    iface: str = "eth0"


@dataclasses.dataclass(frozen=True)
class Counters:
    """A snapshot of byte counters; subtract two to get what one run moved."""

    wan_in: tuple[int, ...]          # per region, router -> region
    wan_out: tuple[int, ...]         # per region, region -> router
    host_tx: dict[str, int]          # per host name, bytes the host sent
    host_rx: dict[str, int]

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(
            tuple(a - b for a, b in zip(self.wan_in, other.wan_in)),
            tuple(a - b for a, b in zip(self.wan_out, other.wan_out)),
            {k: v - other.host_tx.get(k, 0) for k, v in self.host_tx.items()},
            {k: v - other.host_rx.get(k, 0) for k, v in self.host_rx.items()},
        )


def unavailable_reason() -> str | None:
    """None when namespaces can be built here, else why not (for skips and CLI errors)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, found {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. sudo)"
    probe = f"{PREFIX}probe-{os.getpid()}-{next(_instances)}"
    try:
        _ip(["netns", "add", probe])
    except (OSError, TopologyError) as e:
        return f"cannot create a network namespace: {e}"
    try:
        _ip(["-n", probe, "link", "add", "probe0", "type", "bridge"])
        _tc(probe, ["qdisc", "add", "dev", "lo", "root", "handle", "1:", *tbf_args(1e9)])
    except TopologyError as e:
        return f"namespace works but bridge/tbf do not: {e}"
    finally:
        _delete_netns(probe)
    return None


class Topology:
    """The emulated network of `spec`, alive inside a `with` block.

        with Topology(WanSpec(regions=2, nodes_per_region=2)) as topo:
            p = topo.spawn(topo.nodes[0], ["python", "-c", "..."])
            before = topo.counters(); ...; moved = topo.counters() - before

    On leaving the block (normally, by exception or Ctrl-C) every process
    started with `spawn` and everything else running in its namespaces is
    killed and every namespace is deleted, which removes its links too.
    """

    def __init__(self, spec: WanSpec, prefix: str = PREFIX):
        if not prefix.startswith(PREFIX):
            raise ValueError(f"prefix: expected to start with {PREFIX!r} (cleanup finds leftovers by it), found {prefix!r}")
        self.spec = spec
        tag = f"{os.getpid():x}{next(_instances)}"
        self._ns_prefix = f"{prefix}{tag}-"
        self.router_ns = self._ns_prefix + "rt"
        self.region_ns = [f"{self._ns_prefix}r{r}" for r in range(spec.regions)]
        o = spec.origin_region
        self.origin = Host("origin", self._ns_prefix + "origin", _addr(o, _ORIGIN_HOST), o)
        self.tracker = Host("tracker", self._ns_prefix + "tracker", _addr(o, _TRACKER_HOST), o)
        self.nodes = [
            Host(f"n{r}.{k}", f"{self._ns_prefix}n{r}-{k}", _addr(r, k), r)
            for r in range(spec.regions) for k in range(1, spec.nodes_per_region + 1)
        ]
        self._stack: contextlib.ExitStack | None = None
        self._procs: list[subprocess.Popen] = []

    @property
    def hosts(self) -> list[Host]:
        return [self.origin, self.tracker, *self.nodes]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this topology creates (whether or not it is up)."""
        return [self.router_ns, *self.region_ns, *(h.netns for h in self.hosts)]

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Processes started with `spawn` that teardown has not reaped yet."""
        return list(self._procs)

    def nodes_in(self, region: int) -> list[Host]:
        return [h for h in self.nodes if h.region == region]

    # -- lifetime -------------------------------------------------------------

    def __enter__(self) -> "Topology":
        reason = unavailable_reason()
        if reason:
            raise NamespaceUnavailable(reason)
        self._stack = contextlib.ExitStack()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs inside, delete every namespace. Safe to call twice."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            self._stop_processes()
        finally:
            stack.close()

    def _build(self) -> None:
        s = self.spec
        self._add_netns(self.router_ns)
        _sysctl(self.router_ns, "net.ipv4.ip_forward", "1")
        for r, ns in enumerate(self.region_ns):
            self._add_netns(ns)
            _ip(["-n", ns, "link", "add", "br0", "type", "bridge"])
            _ip(["-n", ns, "link", "set", "dev", "br0", "up"])
            _ip(["link", "add", f"wan{r}", "netns", self.router_ns, "type", "veth", "peer", "name", "wan", "netns", ns])
            _ip(["-n", self.router_ns, "addr", "add", f"{_addr(r, _ROUTER_HOST)}/24", "dev", f"wan{r}"])
            _ip(["-n", self.router_ns, "link", "set", "dev", f"wan{r}", "up"])
            _ip(["-n", ns, "link", "set", "dev", "wan", "master", "br0", "up"])
            _shape(self.router_ns, f"wan{r}", s.region_wan_mbit(r) * 1e6, s.wan_delay_ms)
            _shape(ns, "wan", s.region_wan_mbit(r) * 1e6, s.wan_delay_ms)
            if r in s.nat_regions:
                _run(["ip", "netns", "exec", self.router_ns, "nft", "-f", "-"], input=_nat_rules(r))
        for h in self.hosts:
            port = f"h{h.ip.rsplit('.', 1)[1]}"
            rns = self.region_ns[h.region]
            self._add_netns(h.netns)
            _ip(["link", "add", h.iface, "netns", h.netns, "type", "veth", "peer", "name", port, "netns", rns])
            _ip(["-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.iface])
            _ip(["-n", h.netns, "link", "set", "dev", h.iface, "up"])
            if not s.idle_restart:
                _sysctl(h.netns, "net.ipv4.tcp_slow_start_after_idle", "0")
            if s.tcp_congestion:
                _sysctl(h.netns, "net.ipv4.tcp_congestion_control", s.tcp_congestion)
            _ip(["-n", h.netns, "route", "add", "default", "via", _addr(h.region, _ROUTER_HOST)])
            _ip(["-n", rns, "link", "set", "dev", port, "master", "br0", "up"])
            _shape(h.netns, h.iface, dict(s.slow_uplinks).get(h.name, s.lan_mbit) * 1e6, 0.0)
            _shape(rns, port, s.lan_mbit * 1e6, 0.0)

    def _add_netns(self, name: str) -> None:
        _ip(["netns", "add", name])
        self._stack.callback(_delete_netns, name)
        _ip(["-n", name, "link", "set", "dev", "lo", "up"])
        # No IPv6: its DAD/MLD/router chatter would show up in the byte counters.
        _sysctl(name, "net.ipv6.conf.all.disable_ipv6", "1")
        _sysctl(name, "net.ipv6.conf.default.disable_ipv6", "1")

    # -- processes ------------------------------------------------------------

    def spawn(self, host: Host, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start `argv` inside `host`'s namespace; it is killed when the topology closes.

        The child gets its own process group (a terminal's Ctrl-C reaches only
        this process, whose teardown then stops the child in order), but stays
        in this session. A session of its own would put each daemon in its own
        scheduler autogroup (`kernel.sched_autogroup_enabled`), where its nice
        values count only against its own threads: a node's low-priority apply
        would then take a full share of the shared cores from the other nodes'
        serving, which on hosts of their own it cannot.
        """
        if self._stack is None:
            raise RuntimeError("spawn: the topology is not up (use it inside `with`)")
        nice = ["nice", "-n", str(NICE)] if host.region in self.spec.nice_regions else []
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *nice, *argv], process_group=0, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def _stop_processes(self) -> None:
        procs, self._procs = self._procs, []
        live = [p for p in procs if p.poll() is None]
        for p in live:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait(timeout=_TERM_GRACE_S)

    # -- counters -------------------------------------------------------------

    def counters(self) -> Counters:
        """Byte counters of every WAN link and every host link, now."""
        router = _link_stats(self.router_ns)
        wan_in = tuple(router[f"wan{r}"]["tx"]["bytes"] for r in range(self.spec.regions))
        wan_out = tuple(router[f"wan{r}"]["rx"]["bytes"] for r in range(self.spec.regions))
        tx, rx = {}, {}
        for h in self.hosts:
            st = _link_stats(h.netns)[h.iface]
            tx[h.name], rx[h.name] = st["tx"]["bytes"], st["rx"]["bytes"]
        return Counters(wan_in, wan_out, tx, rx)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace named `prefix...` (killing what runs in it); return their names.

    For leftovers of a run that was killed with SIGKILL. Never touches a
    namespace without the prefix.
    """
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix: expected to start with {PREFIX!r}, found {prefix!r}")
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    mine = [n for n in names if n.startswith(prefix)]
    for n in mine:
        _delete_netns(n)
    return mine


def leftover_namespaces(prefix: str = PREFIX) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(prefix)]


# -- a measured TCP transfer (topology self-check) ----------------------------

_RECEIVER = r"""
import socket, sys, time
ip, port, limit_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((ip, port)); s.listen(1); s.settimeout(limit_s)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(limit_s)
n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.monotonic()
    n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""

_SENDER = r"""
import socket, sys, time
ip, port, nbytes, limit_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + limit_s
while True:
    try:
        c = socket.create_connection((ip, port), timeout=limit_s); break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
block = bytes(1 << 20)
left = nbytes
while left > 0:
    c.sendall(block[:min(left, len(block))]); left -= min(left, len(block))
c.close()
"""


def tcp_throughput(topo: Topology, src: Host, dst: Host, nbytes: int, port: int = 5201,
                   limit_s: float = 60.0) -> float:
    """Send `nbytes` over one TCP connection from `src` to `dst`; bytes/s seen by the receiver."""
    recv = topo.spawn(dst, [sys.executable, "-c", _RECEIVER, dst.ip, str(port), str(limit_s)],
                      stdout=subprocess.PIPE, text=True)
    line = recv.stdout.readline()
    if line.strip() != "ready":
        raise TopologyError(f"receiver in {dst.netns}: expected 'ready', found {line!r}")
    send = topo.spawn(src, [sys.executable, "-c", _SENDER, dst.ip, str(port), str(nbytes), str(limit_s)])
    try:
        send.wait(timeout=limit_s)
        out, _ = recv.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        raise TopologyError(f"transfer {src.name} -> {dst.name} of {nbytes} bytes: no end within {limit_s} s") from None
    got, seconds = out.split()
    if int(got) != nbytes:
        raise TopologyError(f"transfer {src.name} -> {dst.name}: expected {nbytes} bytes, received {got}")
    return nbytes / float(seconds)


_CONNECT = r"""
import socket, sys, time
ip, port, limit_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit_s
while True:
    try:
        socket.create_connection((ip, port), timeout=1.0).close(); break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"nothing listens on {ip}:{port} after {limit_s} s")
        time.sleep(0.05)
"""


def wait_listening(topo: Topology, src: Host, ip: str, port: int, limit_s: float) -> None:
    """Return once a TCP connect from `src` to ip:port succeeds (then closes it at once)."""
    proc = topo.spawn(src, [sys.executable, "-c", _CONNECT, ip, str(port), str(limit_s)],
                      stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=limit_s + 10)
    except subprocess.TimeoutExpired:
        err = "no answer"
    if proc.returncode != 0:
        raise TopologyError(f"wait for {ip}:{port} from {src.name}: {err.strip()}")


# -- iproute2 plumbing --------------------------------------------------------

def _addr(region: int, host: int) -> str:
    return f"10.{region + 1}.0.{host}"


def tbf_args(rate_bit: float) -> list[str]:
    """tbf at `rate_bit` bits/s: a bucket of max(64 KiB, 2 ms of rate), a 50 ms queue."""
    burst = max(_TBF_MIN_BURST, int(rate_bit / 8 * _TBF_BURST_S))
    return ["tbf", "rate", f"{int(rate_bit)}bit", "burst", str(burst), "latency", f"{LINK_QUEUE_MS}ms"]


def _shape(netns: str, dev: str, rate_bit: float, delay_ms: float) -> None:
    _tc(netns, ["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf_args(rate_bit)])
    if delay_ms > 0:
        try:
            _tc(netns, ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                        "delay", f"{delay_ms}ms", "limit", "100000"])
        except TopologyError as e:
            raise TopologyError(f"WAN delay needs sch_netem, which this kernel lacks ({e}); run with delay 0") from None


def _nat_rules(region: int) -> str:
    """nftables rules for the router: region `region` behind NAT (masquerade out, nothing new in)."""
    return f"""
table ip nat{region} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat;
    ip saddr {_addr(region, 0)}/24 oifname != "wan{region}" masquerade
  }}
  chain forward {{
    type filter hook forward priority 0; policy accept;
    oifname "wan{region}" ct state established,related accept
    oifname "wan{region}" drop
  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname != "wan{region}" ct state new drop
  }}
}}
"""


def _run(argv: list[str], input: str | None = None) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, input=input)
    except FileNotFoundError as e:
        raise NamespaceUnavailable(f"{argv[0]}: not installed (iproute2 and, for NAT, nftables are needed)") from e
    if out.returncode != 0:
        raise TopologyError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def _ip(args: list[str]) -> str:
    return _run(["ip", *args])


def _tc(netns: str, args: list[str]) -> str:
    return _run(["tc", "-n", netns, *args])


def default_congestion_control() -> str:
    """The TCP congestion control a new namespace starts with (the root namespace's; read only)."""
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


def available_congestion_controls() -> list[str]:
    return Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()


def _sysctl(netns: str, key: str, value: str) -> None:
    # /proc/sys/net is per network namespace; `ip netns exec` gives us that view.
    _run(["ip", "netns", "exec", netns, "sysctl", "-q", "-w", f"{key}={value}"])


def _link_stats(netns: str) -> dict[str, dict]:
    links = json.loads(_ip(["-j", "-s", "-n", netns, "link", "show"]))
    return {link["ifname"]: link["stats64"] for link in links}


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _delete_netns(name: str) -> None:
    """Kill every process inside `name` (ours: we made the namespace), then delete it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _netns_pids(name)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + _TERM_GRACE_S
        while _netns_pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_IP_TIMEOUT_S)
    if Path("/run/netns", name).exists():
        print(f"netemu: could not delete netns {name}", file=sys.stderr)


def _netns_pids(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    return [int(p) for p in out.stdout.split() if p.isdigit()]
