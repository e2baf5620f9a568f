"""The tracker's decisions, with no I/O: members, liveness, budgets, retained manifests, peer sets.

Owns `TrackerCore`. Events go in, each with the time (`now`, seconds on any
monotonic clock): a member connected (its certificate-checked Hello), a
message from it, its connection ended, time passed (`tick`). Actions come
out: `Send` (one encoded frame for some connections) and `Close` (end one
connection, with the reason). tracker/server.py runs it over TLS sessions
and owns the sockets, the send queues and the clock.

What it decides:
- one session per member id: a member that connects again replaces (closes)
  its old session; a member silent for `heartbeat_timeout` is closed;
- each member's peer set (protocol/peersets.py): the whole set when it
  joins, deltas afterwards, coalesced for `delta_delay` so a burst of joins
  costs each affected member one message; each entry with the uplink its
  member declared in its Hello (wire revision 5), or says in its heartbeats
  since (revision 6: lowered to what it measured, protocol/uplinkmeter.py
  `reported_uplink`; at most one change per `UPLINK_CHANGE_S`), left out for
  a member whose connection selected an older revision (it would refuse the key);
- the manifests: only the origin announces; each is verified (trainer
  signature, swarm, forward only); `notice_seeds` nodes per region get it
  whole (VersionNotice), every other node a VersionHint, and gets it from a
  peer (nodes pass on what they accept) or, asking, from the tracker, once
  per object; the latest keyframe's chain and recent patches are kept
  (`retained`) and sent whole to members that join later;
- budgets per member id and minute (issue 21): joins, announcements and
  WebRTC signals (each relayed to the member it names).
  A member over its announce or signal budget is closed and counted; a join
  over budget is refused at once (its live session, if any, stays), so a
  member reconnecting in a loop costs the others nothing. The server asks
  `join_wait` right after TLS and refuses such a member before its Hello;
  `connected` refuses the ones that pass it together.

Connections are opaque hashable tokens; the core never touches them.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import math
import zlib
from typing import Hashable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from patchswarm.protocol import wire
from patchswarm.protocol.errors import InvalidInput, StaleVersion, UsageError
from patchswarm.protocol.peersets import NODE, ORIGIN, PeerSets
from patchswarm.protocol.picker import WAN_GATEWAYS
from patchswarm.protocol.responsibility import check_wan_rates
from patchswarm.protocol.manifest import describe
from patchswarm.protocol.versions import NEW, Verified, VersionBook

log = logging.getLogger("patchswarm.tracker")

HEARTBEAT_TIMEOUT = 10.0  # a member silent this long is dropped (members heartbeat every 2 s)
RETAIN_PATCHES = 64
# Peer-set changes are coalesced this long before they go out. A joining member gets
# its own set at once; the others learn of it within this delay, and a burst of joins
# (a fleet starting: hundreds a second) costs each member one delta per delay, not one
# per join. Measured in bench/tracker_load.py (tracker/README.md).
DELTA_DELAY = 1.0
# (burst, per minute). A member rejoins after each restart or network blip: a
# handful a minute is generous; 300 from one certificate is an attack.
JOIN_BUDGET = (10, 10.0)
# The origin re-announces everything it retains after each reconnect (up to a
# keyframe plus RETAIN_PATCHES patches), and about two objects per version.
ANNOUNCE_BUDGET = (2 * RETAIN_PATCHES + 16, 120.0)
# WebRTC offers and answers a member sends: a node dialing its whole peer set at once over
# WebRTC (16 of its region and 3 of each other region), direct and then through a relay,
# and answering as many, sends far fewer than the burst. Each is queued for its recipient,
# whose queue (server.SEND_QUEUE = 512 frames) must not be another member's to fill: the burst
# stays below it, so a flood from one member never drops the member it names.
SIGNAL_BUDGET = (256, 240.0)
# Per session: a member's Error messages logged at INFO, later ones at DEBUG (each may carry
# 4 KiB, and a member could send them as fast as its link allows).
ERRORS_LOGGED = 3
# Nodes per region that get each manifest whole from the tracker; the rest get a 38-byte
# VersionHint and the manifest from a peer. At 10,000 members and a 1,000-chunk patch
# (40,300 bytes of manifest) whole notices cost the tracker 10,000 x 40,300 B = 403 MB of TLS
# writes per version, and reached the last member in 0.87 s (bench/tracker_load.py); with
# seeds, 8 per region plus 38 bytes a member: 4.6-4.8 MB measured. A region no larger than this gets whole notices only.
NOTICE_SEEDS = 8

# Why a member was closed: the keys of `TrackerCore.drops`.
SILENT, REPLACED, OVER_JOINS, OVER_ANNOUNCES, OVER_SIGNALS, BAD_MESSAGE, BEHIND, LEFT = (
    "silent", "replaced", "over join budget", "over announce budget", "over signal budget", "bad message",
    "fell behind", "left")


# A member's uplink changes at most this often: each change re-ranks its region's gateways and
# sends the change to every member that knows it. An honest member's moves far less often
# (`reported_uplink`'s step); a member that changes it each heartbeat has the rest ignored
# until the time has passed (its next heartbeat then says its value again).
UPLINK_CHANGE_S = 10.0
MAX_REASON_CHARS = 200  # of an Unreachable's reason (an exception's one line)


@dataclasses.dataclass(frozen=True)
class Send:
    """Send `frame` (the encoding of `msg`) on each connection in `to`."""

    to: tuple[Hashable, ...]
    msg: object
    frame: bytes

    @classmethod
    def of(cls, to, msg) -> "Send":
        return cls(tuple(to), msg, wire.encode(msg))


@dataclasses.dataclass(frozen=True)
class Close:
    """End connection `conn`; `why` is one of the drop reasons above, `detail` says more."""

    conn: Hashable
    why: str
    detail: str = ""


@dataclasses.dataclass(eq=False)
class Member:
    conn: Hashable
    id: str
    role: str
    region: str
    addr: str
    joined_at: float
    last_seen: float
    versions: list[int]
    manifests: set | None = None  # objects whose whole notice it was sent (None: none yet, one object fewer per member)
    errors: int = 0  # Error messages it sent this session (the first ERRORS_LOGGED are logged at INFO)
    revision: int = 1  # the wire revision its connection chose (2 and later read WAN rates)
    unreachable: tuple[str, str] | None = None  # (address, why) it was told it cannot be reached at
    uplink: float | None = None  # Mbit/s, as its Hello declared (revision 5) or its heartbeats say (6); None: none
    uplink_at: float = -math.inf  # when a heartbeat last changed `uplink`

    def entry(self) -> dict:
        e = {"id": self.id, "region": self.region, "addr": self.addr, "role": self.role}
        if self.uplink is not None:
            e[wire.PEER_UPLINK] = self.uplink
        return e


def _reads_rates(m: Member) -> bool:
    """Its connection chose wire revision 2 or later, whose PeerList has the WAN rates (a member
    of revision 1 would refuse the field)."""
    return m.revision >= 2


def _reads_uplinks(m: Member) -> bool:
    """Its connection chose wire revision 5 or later, whose peer entries may carry "uplink" (a
    member of revision 4 would refuse the key)."""
    return m.revision >= wire.UPLINK_REVISION


def _without_uplinks(entries: list[dict]) -> list[dict]:
    """Peer entries as a member of revision 4 or before reads them."""
    return [e if wire.PEER_UPLINK not in e else {k: v for k, v in e.items() if k != wire.PEER_UPLINK}
            for e in entries]


class Budget:
    """Token buckets per key: `burst` at most, refilled at `per_minute`."""

    def __init__(self, burst: int, per_minute: float):
        self.burst = float(burst)
        self.rate = per_minute / 60.0
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str, now: float) -> bool:
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        return True

    def wait(self, key: str, now: float) -> float:
        """Seconds until `key` has a token (0: now); takes nothing."""
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def prune(self, now: float) -> None:
        """Forget keys whose bucket is full again (they are as good as new)."""
        full = [k for k, (t, at) in self._buckets.items() if t + (now - at) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]

    def __len__(self) -> int:
        return len(self._buckets)


class TrackerCore:
    """The tracker's state and decisions (see the module doc)."""

    def __init__(self, swarm_id: str, trainer_key: Ed25519PublicKey, *,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT, retain_patches: int = RETAIN_PATCHES,
                 delta_delay: float = DELTA_DELAY, join_budget: tuple[int, float] = JOIN_BUDGET,
                 announce_budget: tuple[int, float] = ANNOUNCE_BUDGET,
                 signal_budget: tuple[int, float] = SIGNAL_BUDGET, wan_gateways: int | None = WAN_GATEWAYS,
                 notice_seeds: int = NOTICE_SEEDS, seed: int = 0, wan_rates: dict[str, float] | None = None):
        if notice_seeds < 1:
            raise UsageError(f"expected at least 1 notice seed per region, found {notice_seeds}")
        # The swarm's WAN rate of each region (--wan-rates), told to every member in its PeerList,
        # so all plan the same chains; None: members plan with their own configuration.
        self.wan_rates = check_wan_rates(wan_rates)
        self.book = VersionBook(swarm_id, trainer_key)
        self.heartbeat_timeout = heartbeat_timeout
        self.retain_patches = retain_patches
        self.notice_seeds = notice_seeds
        self.delta_delay = delta_delay
        self.peers = PeerSets(gateways=wan_gateways or 0, seed=seed)
        self.members: dict[str, Member] = {}
        self._by_conn: dict[Hashable, Member] = {}
        self._by_seen: collections.OrderedDict[str, None] = collections.OrderedDict()  # least recently heard first
        self.join_budget = join_budget  # (in a row, a minute)
        self._joins = Budget(*join_budget)
        self._announces = Budget(*announce_budget)
        self._signals = Budget(*signal_budget)
        self._notices: dict[tuple[int, bool], Send] = {}  # retained object -> its VersionNotice
        self._delta_due: float | None = None
        self._last_prune = 0.0
        self.manifests_rejected = 0
        self.manifests_requested = 0  # whole notices sent on ManifestRequest
        self.signals_relayed = 0  # WebRTC offers and answers forwarded between members
        self.signals_dropped = 0  # ... addressed to no member
        self.drops: collections.Counter[str] = collections.Counter()
        self.changes = 0  # membership changes that changed someone's peer set

    # ------------------------------------------------------------ events

    def connected(self, conn: Hashable, hello: wire.Hello, addr: str, now: float, *,
                  wire_revision: str | None = None) -> list:
        """A member authenticated as `hello.node_id` / `hello.role` (its certificate
        says so) and listens at `addr`. Returns its peer set (with the swarm's WAN
        rates where its connection chose wire revision 2 or later, which reads them; a
        member of the first version would refuse the field) and the retained
        manifests, or a Close when it is over its join budget."""
        mid, role = hello.node_id, hello.role
        out: list = []
        old = self.members.get(mid)
        if not self._joins.take(mid, now):
            # Only the new connection is refused: the session it would replace was admitted
            # within the budget, and it is the member's live one (two joins that passed the
            # server's gate together used to end both: the member then had no session).
            self.drops[OVER_JOINS] += 1
            return [Close(conn, OVER_JOINS, f"more than {self._joins.burst:.0f} joins in a row "
                                            f"or {self._joins.rate * 60:.0f} a minute")]
        if old is not None:  # the new session takes its place; the peer sets change only if its entry did
            self.drops[REPLACED] += 1
            del self._by_conn[old.conn]
            out.append(Close(old.conn, REPLACED, "connected again"))
        m = Member(conn, mid, role, hello.region, addr, now, now, list(hello.versions),
                   revision=wire.revision(wire_revision), uplink=hello.uplink)
        self.members[mid] = m
        self._by_conn[conn] = m
        self._by_seen[mid] = None
        self._by_seen.move_to_end(mid)
        if role in (NODE, ORIGIN):
            self._changed(self.peers.join(mid, role, m.region, addr, m.uplink), now)
            out.append(Send.of([conn], self._peer_list(m)))
        if role == NODE:
            out += [dataclasses.replace(self._notices[k], to=(conn,)) for k in sorted(self._notices)]
            if self._notices:
                m.manifests = set(self._notices)
        return out

    def join_wait(self, member: str, now: float) -> float:
        """Seconds until `member` may join again (0: now); takes nothing. The server asks it
        right after TLS, so a member with no join left is refused before its Hello."""
        return self._joins.wait(member, now)

    def unreachable(self, conn: Hashable, addr: str, why: str, now: float) -> list:
        """The tracker could not connect to the member on `conn` at `addr`, the address it
        joined with (tracker/server.py probes it): list it with none, so peers do not dial
        an address that leads nowhere (it dials those that have one; two that have none
        meet over WebRTC), and tell it why. Nothing if it has left or joined again since."""
        m = self._by_conn.get(conn)
        if m is None or m.addr != addr or not addr:
            return []
        m.addr = ""
        m.unreachable = (addr, why[:MAX_REASON_CHARS])
        self._changed(self.peers.join(m.id, m.role, m.region, "", m.uplink), now)
        return [Send.of([conn], wire.Unreachable(*m.unreachable))]

    def set_wan_rates(self, rates) -> list:
        """The swarm's WAN rates changed (the tracker re-read its configuration): every node and
        origin whose connection reads rates gets its peer set again with them, as at its join,
        and re-plans at once (protocol/picker.py `set_wan_rates`); one told it cannot be reached
        is told again, since a member takes a PeerList as a session's start. Nothing when the
        rates are the same; UsageError for bad ones (nothing changed)."""
        rates = check_wan_rates(rates)
        if rates == self.wan_rates:
            return []
        self.wan_rates = rates
        out: list = []
        for m in self.members.values():
            if m.role not in (NODE, ORIGIN) or not _reads_rates(m):
                continue  # a member of the first version plans with its own --wan-rates
            out.append(Send.of([m.conn], self._peer_list(m)))
            if m.unreachable is not None:
                out.append(Send.of([m.conn], wire.Unreachable(*m.unreachable)))
        return out

    def _rates_for(self, m: Member) -> dict[str, float] | None:
        """The swarm's WAN rates as `m` is sent them (none where it does not read them)."""
        return self.wan_rates if _reads_rates(m) else None

    def _peer_list(self, m: Member) -> wire.PeerList:
        """`m`'s whole peer set, with what its wire revision reads (rates, uplinks)."""
        peers = self.peers.full(m.id)
        return wire.PeerList(peers if _reads_uplinks(m) else _without_uplinks(peers), self._rates_for(m))

    def received(self, conn: Hashable, msg, now: float, verified: Verified | None = None) -> list:
        """A message from the member on `conn`. For an Announce, `verified` is its manifest
        as `book.verify` found it (the server checks a large one in a worker thread)."""
        m = self._by_conn.get(conn)
        if m is None:
            return []
        m.last_seen = now
        self._by_seen.move_to_end(m.id)
        if isinstance(msg, wire.Heartbeat):
            m.versions = list(msg.versions)
            self._heard_uplink(m, msg.uplink, now)
            return []
        if isinstance(msg, wire.Announce):
            return self._announce(m, msg.manifest, now, verified)
        if isinstance(msg, wire.Signal):
            if not self._signals.take(m.id, now):
                self.drops[OVER_SIGNALS] += 1
                return self._drop(m, now, OVER_SIGNALS, "sent too many WebRTC signals")
            return self._relay_signal(m, msg)
        if isinstance(msg, wire.ManifestRequest):
            return self._send_manifest(m, (msg.version, msg.keyframe))
        if isinstance(msg, wire.Bye):
            return self._drop(m, now, LEFT, f"said bye ({msg.reason})")
        if isinstance(msg, wire.Error):
            m.errors += 1
            log.log(logging.INFO if m.errors <= ERRORS_LOGGED else logging.DEBUG, "%s %s says: %s", m.role, m.id,
                    msg.message)
            return []
        return self._drop(m, now, BAD_MESSAGE, f"sent {type(msg).__name__}, which the tracker does not take")

    def _heard_uplink(self, m: Member, uplink: float | None, now: float) -> None:
        """A heartbeat's uplink: the member's peer entry takes a new one (the next delta tells
        whoever knows it, and its region is re-ranked), at most once per `UPLINK_CHANGE_S`. A
        member whose connection chose revision 5 or before sends none: its Hello's stands."""
        if m.revision < wire.UPLINK_NOW_REVISION or uplink == m.uplink or m.role not in (NODE, ORIGIN) \
                or now - m.uplink_at < UPLINK_CHANGE_S:
            return
        m.uplink, m.uplink_at = uplink, now
        self._changed(self.peers.join(m.id, m.role, m.region, m.addr, m.uplink), now)

    def _relay_signal(self, m, msg: wire.Signal) -> list:
        """WebRTC signalling between members (node/net/rtcsignal.py): to the member it names,
        as from the member that sent it. The tracker checks nothing in it but who is who:
        the recipient checks the sender's signature."""
        to = self.members.get(msg.peer)
        if to is None or to is m:
            self.signals_dropped += 1
            log.debug("dropped a WebRTC %s from %s to %s: not a member", msg.kind, m.id, msg.peer)
            return []
        self.signals_relayed += 1
        return [Send.of([to.conn], dataclasses.replace(msg, peer=m.id))]

    def closed(self, conn: Hashable, now: float) -> list:
        """The connection ended (whoever ended it)."""
        m = self._by_conn.get(conn)
        return [] if m is None else self._remove(m, now)

    def dropped(self, conn: Hashable, why: str, detail: str, now: float) -> list:
        """The I/O side gave up on `conn` (e.g. it fell behind its send queue)."""
        m = self._by_conn.get(conn)
        return [] if m is None else self._drop(m, now, why, detail)

    def tick(self, now: float) -> list:
        """Drop silent members; send the peer-set changes that are due."""
        out: list = []
        cutoff = now - self.heartbeat_timeout
        while self._by_seen:
            m = self.members[next(iter(self._by_seen))]
            if m.last_seen > cutoff:
                break
            out += self._drop(m, now, SILENT, f"silent for {now - m.last_seen:.0f} s")
        if self._delta_due is not None and now >= self._delta_due:
            out += self._flush()
        if now - self._last_prune >= 60.0:
            self._last_prune = now
            self._joins.prune(now)
            self._announces.prune(now)
            self._signals.prune(now)
        return out

    def next_tick(self, now: float) -> float:
        """When `tick` has something to do next (at the latest a second from now)."""
        due = [now + 1.0]
        if self._delta_due is not None:
            due.append(self._delta_due)
        if self._by_seen:
            due.append(self.members[next(iter(self._by_seen))].last_seen + self.heartbeat_timeout)
        return max(now, min(due))

    # ------------------------------------------------------------ manifests

    def _announce(self, m: Member, envelope: bytes, now: float, verified: Verified | None = None) -> list:
        if not self._announces.take(m.id, now):
            self.drops[OVER_ANNOUNCES] += 1
            return self._drop(m, now, OVER_ANNOUNCES, "announced too often")
        if m.role != ORIGIN:
            self.manifests_rejected += 1
            log.warning("node %s tried to announce a version; only the origin may", m.id)
            return [Send.of([m.conn], wire.Error("only the origin announces versions"))]
        latest = self.book.latest_version
        try:
            status, man = self.book.offer(envelope, None, verified=verified)
        except StaleVersion as e:
            log.debug("ignored an announcement: %s", e)
            return []
        except InvalidInput as e:
            self.manifests_rejected += 1
            log.warning("rejected a manifest from %s: %s", m.id, e)
            return [Send.of([m.conn], wire.Error(f"manifest rejected: {e}"))]
        if status != NEW:
            return []
        key = (man.version, man.is_keyframe)
        if latest is not None and man.version < latest and key not in self.book.retained(self.retain_patches):
            self.book.discard(key)  # an old object re-announced after a restart, which nobody needs any more
            return []
        log.info("%s announced (%d chunks, %s bytes)", describe(key), len(man.chunks), f"{man.total_bytes:,}")
        notice = Send.of((), wire.VersionNotice(man.version, bytes(envelope)))
        self._notices[key] = notice
        self._prune()
        seeds, hinted = self._seeds(key)
        for s in seeds:
            s.manifests = (s.manifests or set()) | {key}
        out = [dataclasses.replace(notice, to=tuple(s.conn for s in seeds))]
        if hinted:
            out.append(Send.of([h.conn for h in hinted], wire.VersionHint(man.version, man.is_keyframe)))
        if man.version == self.book.latest_version and (not man.is_keyframe or self.book.get((man.version, False)) is None):
            # Its gateways now carry chunks across the WAN: they learn each other's addresses at once.
            self.peers.set_object(key)
            out += self._flush()
        return out

    def _seeds(self, key) -> tuple[list[Member], list[Member]]:
        """The nodes that get `key`'s manifest whole (`notice_seeds` per region, spread over
        the region's members object by object) and the nodes that get a hint."""
        regions: dict[str, list[Member]] = collections.defaultdict(list)
        for m in self.members.values():
            if m.role == NODE:
                regions[m.region].append(m)
        seeds, hinted = [], []
        tag = f"{key[0]}/{int(key[1])}/".encode()
        for nodes in regions.values():
            if len(nodes) <= self.notice_seeds:
                seeds += nodes
                continue
            chosen = heapq.nsmallest(self.notice_seeds, nodes, key=lambda m: zlib.crc32(tag + m.id.encode()))
            seeds += chosen
            picked = set(map(id, chosen))
            hinted += [m for m in nodes if id(m) not in picked]
        return seeds, hinted

    def _send_manifest(self, m: Member, key) -> list:
        """A node asks for a hinted object's manifest: sent once per member and object, and
        only for objects still retained, so asking again costs the tracker nothing."""
        notice = self._notices.get(key)
        if m.role != NODE or notice is None or (m.manifests is not None and key in m.manifests):
            return []
        m.manifests = (m.manifests or set()) | {key}
        self.manifests_requested += 1
        return [dataclasses.replace(notice, to=(m.conn,))]

    def _prune(self) -> None:
        keep = self.book.retained(self.retain_patches)
        if keep:
            self.book.forget_below(min(k[0] for k in keep))
        for k in [k for k in self._notices if k not in keep]:
            del self._notices[k]

    # ------------------------------------------------------------ membership

    def _drop(self, m: Member, now: float, why: str, detail: str) -> list:
        if why not in (LEFT, OVER_JOINS, OVER_ANNOUNCES, OVER_SIGNALS):  # budgets are counted where they are checked
            self.drops[why] += 1
        return self._remove(m, now) + [Close(m.conn, why, detail)]

    def _remove(self, m: Member, now: float) -> list:
        del self._by_conn[m.conn]
        if self.members.get(m.id) is m:
            del self.members[m.id]
            del self._by_seen[m.id]
            self._changed(self.peers.leave(m.id), now)
        return []

    def _changed(self, changed: bool, now: float) -> None:
        if changed:
            self.changes += 1
            if self._delta_due is None:
                self._delta_due = now + self.delta_delay

    def _flush(self) -> list:
        self._delta_due = None
        out = []
        for ids, delta in self.peers.flush():
            members = [self.members[i] for i in ids if i in self.members]
            if any(wire.PEER_UPLINK in e for e in delta.add):  # one message per revision that reads it
                older = [m.conn for m in members if not _reads_uplinks(m)]
                members = [m for m in members if _reads_uplinks(m)]
                if older:
                    out.append(Send.of(older, wire.PeerDelta(_without_uplinks(delta.add), delta.remove)))
            if members:
                out.append(Send.of([m.conn for m in members], delta))
        return out

    # ------------------------------------------------------------ status

    def status(self) -> dict:
        return {
            "swarm_id": self.book.swarm_id,
            "latest_version": self.book.latest_version,
            "members": [{**m.entry(), "versions": m.versions} for m in self.members.values()],
            "manifests_rejected": self.manifests_rejected,
            "manifests_requested": self.manifests_requested,
            "signals_relayed": self.signals_relayed,
            "signals_dropped": self.signals_dropped,
            "drops": dict(self.drops),
            "changes": self.changes,
            "wan_rates": self.wan_rates,
        }
