"""Network namespaces behind NAT for tests: a public network and private hosts behind masquerade.

`NatTopology(prefix, hosts, symmetric)` builds, as root, with `ip` and `nft`:

    ns PUB: bridge, 10.99.0.1/24          (tracker, origin, coturn bind here)
            default route to a gateway nobody answers for (a static neighbour
            entry): as on any host on the internet, a datagram to an address
            that is nowhere, such as a NATed peer's private host candidate,
            leaves and is lost instead of failing with ENETUNREACH. coturn
            (4.6) closes a TURN allocation on the first relay send that fails,
            and ICE makes it send to every candidate the peer names.
      ns R<i>: 10.99.0.1<i>/24 on the bridge, 192.168.<i>.1/24 inside;
               nftables masquerade out of the public side, inbound only for
               connections made from inside ("random": a new port for every
               destination, a symmetric NAT that defeats hole punching).
               Unsolicited packets to the router are dropped before conntrack
               keeps an entry for them, as NAT firewalls do: an entry for a
               peer's early probe would take the tuple the host's own outbound
               probe needs, and Linux would give that one another port.
        ns H<i>: 192.168.<i>.2/24, default route via R<i>   (a node runs here)

and deletes every namespace it made on `close()` (deleting a namespace deletes
its links). Names carry the prefix and the test's pid, so parallel runs and
other users' namespaces are never touched. `skip_reason()` says why it cannot
be built here (not root, no `ip`/`nft`, namespaces refused), for pytest.skip.
`start_coturn(turnserver, topo, workdir)` runs a coturn on the public network
(STUN and TURN at PUBLIC:3478, long-term credentials TURN_USER/TURN_PASSWORD);
the caller terminates it. Used by tests/test_webrtc_nat.py and bench/transport.py --nat.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

PUBLIC = "10.99.0.1"
NOWHERE = "10.99.0.254"  # the public network's gateway: frames to it are flooded and dropped
TURN_PORT = 3478
TURN_USER, TURN_PASSWORD = "patchswarm", "turn-secret"


def _run(*args: str, input: str | None = None) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True, input=input, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    probe = f"psw-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "nft", "add", "table", "ip", "probe")
    except RuntimeError as e:
        return f"cannot make a network namespace with nftables here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class NatTopology:
    def __init__(self, prefix: str, hosts: int, symmetric: bool):
        self.tag = f"{prefix}{os.getpid() % 100000}"
        self.pub = f"{self.tag}-pub"
        self.made: list[str] = []
        self.hosts: list[str] = []  # namespace of each private host
        self.host_addrs: list[str] = []
        try:
            self._build(hosts, symmetric)
        except BaseException:
            self.close()
            raise

    def exec(self, ns: str) -> list[str]:
        """The command prefix that runs a program in namespace `ns`."""
        return ["ip", "netns", "exec", ns]

    def _ns(self, name: str) -> str:
        _run("ip", "netns", "add", name)
        self.made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _build(self, hosts: int, symmetric: bool) -> None:
        pub = self._ns(self.pub)
        _run("ip", "-n", pub, "link", "add", "name", "pubbr", "type", "bridge")
        _run("ip", "-n", pub, "addr", "add", f"{PUBLIC}/24", "dev", "pubbr")
        _run("ip", "-n", pub, "link", "set", "pubbr", "up")
        _run("ip", "-n", pub, "neigh", "add", NOWHERE, "lladdr", "02:00:00:00:00:fe", "dev", "pubbr", "nud", "permanent")
        _run("ip", "-n", pub, "route", "add", "default", "via", NOWHERE)
        for i in range(1, hosts + 1):
            r, h = self._ns(f"{self.tag}-r{i}"), self._ns(f"{self.tag}-h{i}")
            # public side of the router: a veth whose other end is on the bridge
            _run("ip", "link", "add", f"{self.tag}p{i}", "type", "veth", "peer", "name", f"{self.tag}q{i}")
            _run("ip", "link", "set", f"{self.tag}p{i}", "netns", pub)
            _run("ip", "link", "set", f"{self.tag}q{i}", "netns", r)
            _run("ip", "-n", pub, "link", "set", f"{self.tag}p{i}", "master", "pubbr", "up")
            _run("ip", "-n", r, "link", "set", f"{self.tag}q{i}", "name", "wan", "up")
            _run("ip", "-n", r, "addr", "add", f"10.99.0.1{i}/24", "dev", "wan")
            # private side
            _run("ip", "link", "add", f"{self.tag}l{i}", "type", "veth", "peer", "name", f"{self.tag}m{i}")
            _run("ip", "link", "set", f"{self.tag}l{i}", "netns", r)
            _run("ip", "link", "set", f"{self.tag}m{i}", "netns", h)
            _run("ip", "-n", r, "link", "set", f"{self.tag}l{i}", "name", "lan", "up")
            _run("ip", "-n", r, "addr", "add", f"192.168.{i}.1/24", "dev", "lan")
            _run("ip", "-n", h, "link", "set", f"{self.tag}m{i}", "name", "eth0", "up")
            _run("ip", "-n", h, "addr", "add", f"192.168.{i}.2/24", "dev", "eth0")
            _run("ip", "-n", h, "route", "add", "default", "via", f"192.168.{i}.1")
            _run("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run("ip", "netns", "exec", r, "nft", "-f", "-", input=_nat_rules(symmetric))
            self.hosts.append(h)
            self.host_addrs.append(f"192.168.{i}.2")

    def close(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()


def _nat_rules(symmetric: bool) -> str:
    return f"""
table ip nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat;
    oifname "wan" masquerade{" random" if symmetric else ""}
  }}
}}
table ip filter {{
  chain input_filter {{
    type filter hook input priority 0; policy accept;
    iifname "wan" ct state new drop
  }}
  chain forward_filter {{
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }}
}}
"""


def start_coturn(turnserver: str, topo: NatTopology, workdir: Path) -> subprocess.Popen:
    """coturn in `topo`'s public namespace, once it listens; its log in workdir/coturn.log."""
    log = open(workdir / "coturn.log", "wb")
    p = subprocess.Popen([*topo.exec(topo.pub), turnserver, "-n", "--listening-ip", PUBLIC, "--relay-ip", PUBLIC,
                          "--listening-port", str(TURN_PORT), "--min-port", "49152", "--max-port", "49352",
                          "--lt-cred-mech", "--user", f"{TURN_USER}:{TURN_PASSWORD}", "--realm", "patchswarm",
                          "--userdb", str(workdir / "turndb"), "--pidfile", str(workdir / "turn.pid"),
                          "--no-tls", "--no-dtls", "--no-cli", "--fingerprint", "--simple-log",
                          "--log-file", "stdout"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 20
    while f"{PUBLIC}:{TURN_PORT}" not in subprocess.run([*topo.exec(topo.pub), "ss", "-lnu"], capture_output=True,
                                                        text=True, timeout=10).stdout:
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            p.wait()
            raise RuntimeError(f"coturn did not start:\n{(workdir / 'coturn.log').read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return p
