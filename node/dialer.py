"""Dialing: which members this node connects to, and connecting to them, with backoff.

Owns `Dialer`: the members the tracker last listed, the choice of peers to
keep connected (the origin; up to SAME_REGION_PEERS nodes of this region and
OTHER_REGION_PEERS of each other region, each chosen by a hash of both ids, so
the choice is stable and spread), how to reach each (`route`: TCP+TLS, or a
WebRTC data channel through node/net/rtcsignal.py for a member that accepts
nothing inbound, with --transport webrtc, or with auto after failed TCP dials),
the dial loop, the backoff after a failed
dial, and the rule for two members that want each other: the one that can
reach the other over TCP when only one can (a member with no address dials
one that has one), else the one that joined later (the other learns of it
only a tracker delta later), dials first; the other only if no connection
came a little later, so a pair rarely opens two connections
(node/peers.py keeps one if it does). A dialed
connection runs as a session of the `PeerSet`. Must not accept connections
(the daemon serves) or say anything on a session.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import PatchswarmError, PeerRefused

from patchswarm.node.net.backoff import jittered
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.net.rtcsignal import RTCSignaller
from patchswarm.node.net.transport import CONNECTION_ERRORS, connect, one_line, run_session
from patchswarm.node.net.trust import Credentials
from patchswarm.node.peers import PeerSet
from patchswarm.node.wakeup import Wakeup

log = logging.getLogger("patchswarm.node")

SAME_REGION_PEERS = 16
OTHER_REGION_PEERS = 3  # per other region
BACKOFF_MAX = 10.0
SECOND_DIALER_WAIT = 2.0  # s the larger id of a pair waits for the smaller one's dial
REDIAL_AFTER = 1.0  # s after a connection, before the same peer is dialed again once it ends
POLL_S = 1.0
TCP_FAILURES_BEFORE_WEBRTC = 2  # transport auto: a node that many TCP dials did not reach is tried over WebRTC


def rank(a: str, b: str) -> bytes:
    """A stable pseudo-random order of `b`s as seen from `a`."""
    return hashlib.sha256(f"{a}|{b}".encode()).digest()


class Dialer:
    def __init__(self, me: str, region: str, creds: Credentials, peers: PeerSet, hello: Callable[[], wire.Hello],
                 download: TokenBucket, *, no_peers: bool = False, rtc: RTCSignaller | None = None,
                 transport: str = "tcp"):
        self.me = me
        self.region = region
        self.creds = creds
        self.peers = peers
        self.hello = hello
        self.download = download
        self.no_peers = no_peers  # dial only the origin (the star baseline)
        self.members: dict[str, dict] = {}  # id -> peer entry from the tracker, me excluded
        self._dialing: set[str] = set()
        self._dial_after: dict[str, float] = {}
        self._wakeup = Wakeup()
        self.rtc = rtc
        self.transport = transport  # tcp | webrtc | auto
        self._tcp_failures: dict[str, int] = {}  # id -> TCP dials in a row that failed
        self._failures: dict[str, int] = {}  # id -> dials in a row that failed, any route (the backoff)
        # Set when the tracker could not connect to our address (wire.Unreachable): peers list
        # us with none, so we dial as a member without one does. Until we join again.
        self.unreachable: str | None = None
        self._second: set[str] = set()  # peers whose dial we wait for, as the second dialer
        # The members listed when this node joined and listed ever since (one that left and came
        # back is a joiner again): None before the first peer set.
        self._there_before: frozenset[str] | None = None

    def set_members(self, members: dict[str, dict]) -> None:
        self.members = {i: p for i, p in members.items() if i != self.me}
        self._there_before = frozenset(self.members if self._there_before is None
                                       else self._there_before & self.members.keys())
        for counts in (self._failures, self._tcp_failures):  # of members that left: not kept for ever
            for pid in [pid for pid in counts if pid not in self.members]:
                del counts[pid]
        self._wakeup.set()

    def set_unreachable(self, why: str | None) -> None:
        """What the tracker said of our address ("ADDR: why"), or None for a new tracker
        session. Once unreachable, waiting for reachable peers to dial us is moot: dial now."""
        self.unreachable = why
        if why is not None:
            for pid in self._second:
                self._dial_after.pop(pid, None)
            self._second.clear()
            self._wakeup.set()

    def wake(self) -> None:
        """A connection ended: see whom to dial."""
        self._wakeup.set()

    def wanted(self) -> dict[str, dict]:
        """The members to keep connected: id -> peer entry."""
        origin = {i: p for i, p in self.members.items() if p["role"] == "origin"}
        if self.no_peers:
            return origin
        nodes = [p for p in self.members.values() if p["role"] == "node"]
        same = sorted((p for p in nodes if p["region"] == self.region), key=lambda p: rank(self.me, p["id"]))
        out = {p["id"]: p for p in same[:SAME_REGION_PEERS]}
        for region in {p["region"] for p in nodes} - {self.region}:
            there = sorted((p for p in nodes if p["region"] == region), key=lambda p: rank(self.me, p["id"]))
            out.update({p["id"]: p for p in there[:OTHER_REGION_PEERS]})
        out.update(origin)
        return out

    def route(self, p: dict) -> str | None:
        """How to reach member `p`: "tcp", "webrtc", or None (no way from here). The origin
        answers no offers, so it is always TCP; nodes go over WebRTC with transport webrtc,
        when they accept nothing inbound (no address), or, with auto, after failed TCP dials."""
        rtc_ok = self.rtc is not None and p["role"] == "node"
        if rtc_ok and (self.transport == "webrtc" or not p["addr"] or (
                self.transport == "auto" and self._tcp_failures.get(p["id"], 0) >= TCP_FAILURES_BEFORE_WEBRTC)):
            return "webrtc"
        return "tcp" if p["addr"] else None

    def dials_first(self, p: dict) -> bool:
        """Of this node and node `p`, which both want each other, whether this one dials first.
        Where exactly one of the two accepts connections (has an address), the other: it
        reaches that one over TCP, through its NAT, where the reverse would take a WebRTC
        data channel (several times the CPU per byte, node/README.md). Else the one that
        joined later: this node where `p` was listed when it joined, `p` where it came after.
        The earlier member learns of a joiner only from the tracker's next peer delta (up to
        its DELTA_DELAY, 1 s, later) and wants it only if it ranks among its peers. *Why:* by
        ids, a joiner whose id came after its peers' waited that second, or SECOND_DIALER_WAIT
        (2 s), with the origin its only source, and took from it what its peers held
        (bench/late_joiners.py). The smaller id only before any peer set."""
        mine, theirs = bool(self.hello().listen) and self.unreachable is None, bool(p["addr"])
        if mine != theirs:
            return theirs
        if self._there_before is not None:
            return p["id"] in self._there_before
        return self.me < p["id"]

    async def run(self) -> None:
        """Dial whoever is wanted and not connected, until cancelled."""
        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                for pid, p in self.wanted().items():
                    if (self.peers.connected(pid) or pid in self._dialing or self._dial_after.get(pid, 0) > now
                            or self.route(p) is None):
                        continue
                    # Both ends want each other: one dials first, the other a little later if no
                    # connection came, so pairs rarely open two connections.
                    if p["role"] == "node" and not self.dials_first(p) and pid not in self._dial_after:
                        self._dial_after[pid] = now + SECOND_DIALER_WAIT
                        self._second.add(pid)
                        continue
                    self._second.discard(pid)
                    self._dialing.add(pid)
                    nursery.start_soon(self._dial, p)
                await self._wakeup.wait(POLL_S)

    async def _dial(self, p: dict) -> None:
        pid, how = p["id"], self.route(p)
        try:
            if how == "webrtc":
                ms = await self.rtc.connect(pid, p["role"])
            else:
                ms = await connect(p["addr"], self.creds, {p["role"]}, self.hello(), expect_name=pid,
                                   on_receive=self.download.take)
        except (*CONNECTION_ERRORS, PatchswarmError) as e:
            # 2, 4, 8, then BACKOFF_MAX s (jittered) for dials in a row that failed. The delay was
            # computed from `_dial_after`, which is always past when a dial fails, so it stayed 2 s:
            # a member that was down got a dial from each of its peers every 1-2 s.
            failed = self._failures[pid] = self._failures.get(pid, 0) + 1
            delay = min(BACKOFF_MAX, 2.0 ** min(failed, 8))
            if isinstance(e, PeerRefused):  # over its admission budget: each retry would cost it a TLS handshake
                delay = BACKOFF_MAX
            self._dial_after[pid] = trio.current_time() + jittered(delay)  # members that lost one peer spread out
            if how == "tcp":
                self._tcp_failures[pid] = self._tcp_failures.get(pid, 0) + 1
            log.info("could not reach %s %s at %s over %s (%s)", p["role"], pid, p["addr"] or "no address", how,
                     one_line(e))
            return
        finally:
            self._dialing.discard(pid)
        if how == "tcp":
            self._tcp_failures.pop(pid, None)
        self._failures.pop(pid, None)
        self._dial_after[pid] = trio.current_time() + REDIAL_AFTER
        await run_session(lambda: self.peers.run(ms, outbound=True), f"{p['role']} {pid}", log)
