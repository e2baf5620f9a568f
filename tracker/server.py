"""The tracker service: the trio shell around `TrackerCore` (tracker/core.py).

Owns the listener (mutual TLS; nodes and the origin), one task per member
reading its messages into the core, one bounded send queue and sender task per
member, the clock, and executing the core's actions. Every decision (who is a
member, who learns what, what is retained, who is dropped) is the core's.

Pushes run concurrently, one queue per member: a version notice or a peer-set
delta is encoded once and queued for each recipient. A member whose queue
reaches SEND_QUEUE frames, or whose write has not completed for
SEND_TIMEOUT, is dropped (it takes a fresh full peer set when it
reconnects); it never delays anyone else's pushes. Soft state only: after a
restart members reconnect, the origin re-announces, and work continues.

With `probe=True` (`--probe-reachability`) the tracker dials each node that
joins with an address, once, as a client (TLS, Hellos, the node's name
checked), and closes at once; a node it cannot reach in PROBE_SECONDS is
listed with no address (`TrackerCore.unreachable`), so peers stop dialing an
address that leads nowhere (it dials them; two that accept nothing meet over
WebRTC), and is told why.

A member's region is what its Hello says, unless its certificate binds it to
one (node/net/trust.py): then the listener refuses a Hello that says another,
before the core hears of it (node/net/transport.py `serve`: an Error to the
member, counted in `refused` as WRONG_REGION). With `require_region=True`
(`--require-region`) a member whose certificate names no region is refused
too (NO_REGION): the region decides which chunks a member brings into which
region, and only the operator, who issues certificates, should choose it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import resource
from pathlib import Path

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import BudgetExceeded, InvalidInput, PatchswarmError, ProtocolError, UsageError

from patchswarm.node.net.transport import (CONNECTION_ERRORS, MessageStream, apply_revocations, connect, format_addr,
                                           one_line, parse_addr, serve)
from patchswarm.node.net.manifestcheck import ManifestCheck
from patchswarm.node.net.service import format_wan_rates
from patchswarm.node.net.trust import Credentials
from patchswarm.tracker.collector import CollectorSchedule
from patchswarm.tracker.core import BAD_MESSAGE, BEHIND, HEARTBEAT_TIMEOUT, LEFT, OVER_JOINS, Close, Send, TrackerCore

log = logging.getLogger("patchswarm.tracker")

SEND_QUEUE = 512  # frames queued for one member before it counts as fallen behind
SEND_TIMEOUT = 10.0  # a member whose write has not completed for this long has fallen behind
BATCH_BYTES = 256 << 10  # queued frames joined into one write, up to about this much
JOINS_KEPT = 1024  # recent joins whose latency status reports


class _JoinGate:
    """The core's join budget, asked by the listener right after TLS (node/net/transport.py
    `serve`, as a node asks its MemberAdmission): a member with no join left is refused
    before its Hello, its Error held REFUSAL_HOLD, and counted in `Tracker.refused`. Before,
    it was refused by the core after the Hello exchange, at once, so a member reconnecting in
    a loop had the tracker do a TLS handshake and a Hello per try, as fast as it could try.
    The core still takes the token when the member joins."""

    def __init__(self, core: TrackerCore):
        self.core = core

    def admit(self, member: str, now: float) -> None:
        wait = self.core.join_wait(member, now)
        if wait > 0:
            b = self.core.join_budget
            raise BudgetExceeded(OVER_JOINS, f"member {member!r}: expected at most {b[0]} joins in a row and "
                                             f"{b[1]:g} a minute, found one more; the next is admitted in {wait:.1f} s")


class _Session:
    """One member's connection: its send queue and the scope of its tasks."""

    __slots__ = ("ms", "queue", "scope", "why", "_ready", "_tracker", "_first_alone")

    def __init__(self, ms: MessageStream, tracker: "Tracker"):
        self.ms = ms
        self.queue: collections.deque[tuple[str, bytes]] = collections.deque()
        self.scope: trio.CancelScope | None = None
        self.why: str | None = None  # set once the session is ending, with the reason
        self._ready = trio.Event()
        self._tracker = tracker
        self._first_alone = False  # the queue's first frame must be written by itself (a write to retry)

    def push(self, kind: str, frame: bytes) -> bool:
        """Send a frame now if the member's socket takes it, else queue it; False if the
        queue is full. Written at once, a notice to 10,000 members costs no task wake-up
        per member."""
        if not self.queue and self._tracker.busy.get(self) is None:
            stream = self.ms.stream
            if getattr(stream, "send_nowait", None) is not None and self.why is None:
                if stream.send_nowait(frame):
                    self._tracker.sent[kind] += len(frame)
                    self.ms.counters.sent += len(frame)
                    return True
                self._first_alone = True  # OpenSSL may hold it half written: retried alone
        if len(self.queue) >= SEND_QUEUE:
            return False
        self.queue.append((kind, frame))
        self._ready.set()
        return True

    def close(self, why: str) -> None:
        if self.why is None:
            self.why = why
        if self.scope is not None:
            self.scope.cancel()

    async def send_loop(self) -> None:
        # The only task that writes to this stream once the Hellos are exchanged, so it
        # writes frames encoded once for every recipient straight to the TLS stream,
        # whatever is queued in one write (one wake-up). No deadline scope per write
        # (measured: a third of the cost of a small push); the tick loop drops a member
        # whose write has not completed for SEND_TIMEOUT (`Tracker._watch_senders`).
        stream, counters, busy = self.ms.stream, self._tracker.sent, self._tracker.busy
        try:
            while True:
                while not self.queue:
                    self._ready = trio.Event()
                    await self._ready.wait()
                busy[self] = trio.current_time()
                while self.queue:
                    batch, size = [], 0
                    limit = 0 if self._first_alone else BATCH_BYTES  # a write to retry goes out by itself
                    self._first_alone = False
                    while self.queue and (size < limit or not batch):
                        kind, frame = self.queue.popleft()
                        batch.append(frame)
                        size += len(frame)
                        counters[kind] += len(frame)
                    await stream.send_all(batch[0] if len(batch) == 1 else b"".join(batch))
                    self.ms.counters.sent += size
                    busy[self] = trio.current_time()
                del busy[self]
        except CONNECTION_ERRORS as e:
            self.close(f"connection lost ({type(e).__name__})")
        finally:
            busy.pop(self, None)


PROBE_SECONDS = 5.0  # a probe of a node's address: TCP, TLS and Hellos within this, or unreachable
PROBE_CONCURRENCY = 32  # probes open at once (a fleet joining at once is probed in turn)


class Tracker:
    def __init__(self, creds: str | Path, listen: str, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 revocations: Path | None = None, probe: bool = False, require_region: bool = False, **options):
        """`options` go to `TrackerCore` (budgets, delays, retention); `probe`: dial each node's
        address once when it joins, and list it without one if that fails; `require_region`:
        refuse a member whose certificate names no region."""
        # --require-region is the credentials' policy, as a node's: transport.serve reads it there.
        self.creds = dataclasses.replace(Credentials.load(creds), require_region=require_region)
        if self.creds.role != "tracker":
            raise UsageError(f"{creds}: expected credentials with role tracker, found {self.creds.role!r}")
        self.listen = listen
        self.listen_addr = listen
        self.core = TrackerCore(self.creds.swarm_id(), self.creds.trainer_public_key(),
                                heartbeat_timeout=heartbeat_timeout, **options)
        self.manifest_check = ManifestCheck(self.core.book)  # large announcements verified off the loop
        self.refused: collections.Counter[str] = collections.Counter()  # connections the listener refused, by kind
        self.sent: collections.Counter[str] = collections.Counter()  # bytes pushed, by message type
        self.busy: dict[_Session, float] = {}  # sessions writing now -> when their last write began
        self._wake = trio.Event()
        self._tick_at = float("inf")
        self.revocations_file = revocations
        self._revocations_seen: tuple[int, int] | None = None  # (mtime_ns, size) last read
        self.collector = CollectorSchedule()
        # (when, seconds from TCP accept to the peer list written or queued) of recent joins:
        # the tracker's own part of a join's latency, apart from the member's and the network's
        self.joins: collections.deque[tuple[float, float]] = collections.deque(maxlen=JOINS_KEPT)
        self.probe = probe
        self._probes = trio.CapacityLimiter(PROBE_CONCURRENCY)
        self.probed: collections.Counter[str] = collections.Counter()  # "reachable" / "unreachable"

    @property
    def book(self):
        return self.core.book

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        _raise_fd_limit()
        self.collector.start(trio.current_time())
        try:
            await self._run(task_status)
        finally:
            self.collector.stop()

    async def _run(self, task_status) -> None:
        async with trio.open_nursery() as nursery:
            self.listen_addr = await nursery.start(self._serve)
            log.info("tracker for swarm %s listening on %s; WAN rates for every member: %s; regions: %s",
                     self.book.swarm_id, self.listen_addr, format_wan_rates(self.core.wan_rates)
                     if self.core.wan_rates else "none (each member plans with its own --wan-rates)",
                     "each member's certificate must name its own" if self.creds.require_region else
                     "a certificate that names one binds its member to it")
            nursery.start_soon(self._tick_loop)
            if self.revocations_file is not None:
                self._reload_revocations()
                nursery.start_soon(self._revocations_loop)
            task_status.started(self)

    async def _serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await serve(self.listen, self.creds, {"node", "origin"}, self._hello, self._session,
                    on_refused=lambda why: log.warning("refused a connection: %s", why), refused=self.refused,
                    admission=_JoinGate(self.core), task_status=task_status)

    def _hello(self) -> wire.Hello:
        return wire.Hello(self.creds.name, "", "tracker", self.listen_addr, [])

    def _advertised(self, ms: MessageStream, listen: str) -> str:
        """The member's listen address, with a wildcard host replaced by the address it came from;
        "" for a member that accepts no connections (--no-listen), or whose address leads nowhere:
        not HOST:PORT with a host name or IP and a port (node/net/transport.py `parse_addr`). Such
        an address went to every peer as it was, and "a..b:7000" made each peer that dialed it
        exit (UnicodeError out of the lookup); now the member is listed with none."""
        if not listen:
            return ""
        host, _, port = listen.rpartition(":")
        if host.strip("[]") in ("", "0.0.0.0", "::"):
            if not (port.isascii() and port.isdigit() and int(port) < 65536):
                return ""  # leads nowhere; int() of it raised out of the session (a traceback per join)
            try:
                remote = ms.stream.getpeername()[0]
            except (AttributeError, OSError):
                return listen
            return format_addr(remote, int(port))
        try:
            parse_addr(listen)
        except UsageError as e:
            log.warning("%s %s joined with listen address %r, which leads nowhere (%s): listed without one",
                        ms.peer_role, ms.peer_name, listen, e)
            return ""
        return listen

    # ------------------------------------------------------------ sessions

    async def _session(self, ms: MessageStream) -> None:
        s = _Session(ms, self)
        hello = ms.hello
        try:
            async with trio.open_nursery() as nursery:
                s.scope = nursery.cancel_scope
                nursery.start_soon(s.send_loop)
                if self.creds.revocations.envelope is not None:  # first, so a member knows whom to refuse
                    s.push("Revocations", wire.encode(wire.Revocations(self.creds.revocations.envelope)))
                addr = self._advertised(ms, hello.listen)
                self._do(self.core.connected(s, hello, addr, trio.current_time(), wire_revision=ms.wire_revision))
                if s.why is None and ms.accepted_at is not None:
                    now = trio.current_time()
                    self.joins.append((now, now - ms.accepted_at))
                if s.why is None:
                    log.info("%s %s joined (region %s, %s, versions %s)", ms.peer_role, ms.peer_name,
                             hello.region, ms.hello.listen, hello.versions or "none")
                    if self.probe and hello.role == "node" and addr:
                        nursery.start_soon(self._probe, s, addr)  # ends with the session
                    await self._read(s)
                nursery.cancel_scope.cancel()
        finally:
            self._do(self.core.closed(s, trio.current_time()))
            self._poke()
            log.info("%s %s %s", ms.peer_role, ms.peer_name, s.why or "left")

    async def _probe(self, s: _Session, addr: str) -> None:
        """Dial node `s` at `addr` as a client would; list it with no address if that fails."""
        name = s.ms.peer_name
        async with self._probes:
            try:
                with trio.fail_after(PROBE_SECONDS):
                    ms = await connect(addr, self.creds, {"node"}, self._hello(), expect_name=name)
                await ms.aclose()
                self.probed["reachable"] += 1
                return
            except trio.TooSlowError:
                why = f"no answer in {PROBE_SECONDS:.0f} s"
            except (*CONNECTION_ERRORS, PatchswarmError) as e:
                why = one_line(e)
        self.probed["unreachable"] += 1
        log.info("node %s is not reachable at %s (%s): listed without an address", name, addr, why)
        self._do(self.core.unreachable(s, addr, why, trio.current_time()))

    async def _read(self, s: _Session) -> None:
        try:
            while True:
                msg = await s.ms.receive()
                if msg is None:
                    s.why = s.why or LEFT
                    return
                verified = None
                if isinstance(msg, wire.Announce) and s.ms.peer_role == "origin":  # only its announcements count
                    verified = await self.manifest_check.check(msg.manifest)  # a large one in a worker thread
                self._do(self.core.received(s, msg, trio.current_time(), verified))
        except ProtocolError as e:
            self._do(self.core.dropped(s, BAD_MESSAGE, f"protocol error: {e}", trio.current_time()))
        except CONNECTION_ERRORS as e:
            s.why = s.why or f"connection lost ({type(e).__name__})"

    def fell_behind(self, s: _Session, detail: str) -> None:
        self._do(self.core.dropped(s, BEHIND, detail, trio.current_time()))

    def _do(self, actions: list) -> None:
        """Execute the core's actions; runs without a checkpoint, so no other task sees half of them."""
        if not actions:  # a heartbeat, 5,000 a second at 10,000 members: nothing to do
            return
        work = collections.deque(actions)
        while work:
            a = work.popleft()
            if isinstance(a, Send):
                kind = type(a.msg).__name__
                for s in a.to:
                    if s.why is None and not s.push(kind, a.frame):
                        work.extend(self.core.dropped(s, BEHIND, f"{len(s.queue)} frames queued", trio.current_time()))
            elif isinstance(a, Close):
                if a.why != LEFT:
                    log.warning("dropping %s %s: %s%s", a.conn.ms.peer_role, a.conn.ms.peer_name, a.why,
                                f" ({a.detail})" if a.detail else "")
                a.conn.close(f"dropped: {a.why}" if a.why != LEFT else LEFT)
        self._poke()

    def _poke(self) -> None:
        """Wake the tick loop if the core now has something due before it planned to wake."""
        if self.core.next_tick(trio.current_time()) < self._tick_at:
            self._wake.set()

    def _watch_senders(self, now: float) -> None:
        for s, since in [(s, t) for s, t in self.busy.items() if now - t > SEND_TIMEOUT]:
            self.fell_behind(s, f"a write has not completed for {now - since:.0f} s")

    async def _tick_loop(self) -> None:
        while True:
            self._watch_senders(trio.current_time())
            self._do(self.core.tick(trio.current_time()))
            self.collector.tick(trio.current_time(), len(self.members))
            self._tick_at = min(self.core.next_tick(trio.current_time()), self.collector.due(trio.current_time()))
            with trio.move_on_at(self._tick_at):
                await self._wake.wait()
            self._wake = trio.Event()

    def set_wan_rates(self, rates: dict[str, float] | None) -> None:
        """New WAN rates for the swarm (the configuration re-read on SIGHUP): every member that
        reads rates gets them with its peer set, and re-plans at once. UsageError for bad ones."""
        old = self.core.wan_rates
        actions = self.core.set_wan_rates(rates)
        if self.core.wan_rates == old:
            log.info("WAN rates unchanged: %s", format_wan_rates(old) if old else "none")
            return
        told = sum(1 for a in actions if isinstance(a, Send) and isinstance(a.msg, wire.PeerList))
        log.info("WAN rates now %s, told to %d member%s (members of the first wire revision keep their own)",
                 format_wan_rates(self.core.wan_rates) if self.core.wan_rates else
                 "none (each member plans with its own --wan-rates)", told, "" if told == 1 else "s")
        self._do(actions)

    # ------------------------------------------------------------ revocations

    def _reload_revocations(self) -> bool:
        """Take the revocation list file if it changed; True if a newer list is now held."""
        try:
            st = self.revocations_file.stat()
        except FileNotFoundError:
            return False
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._revocations_seen:
            return False
        self._revocations_seen = seen
        try:
            ended = apply_revocations(self.creds, self.revocations_file.read_bytes())
        except (InvalidInput, OSError) as e:
            log.warning("ignoring %s: %s", self.revocations_file, e)
            return False
        if ended is None:
            return False
        rl = self.creds.revocations.current
        log.info("revocation list %d: %d certificates revoked; %d member connections ended",
                 rl.sequence, len(rl.serials), ended)
        return True

    async def _revocations_loop(self) -> None:
        """Hand every member a new revocation list within a second of its file changing:
        encoded once, queued for each like any other push."""
        while True:
            await trio.sleep(1.0)
            if self._reload_revocations():
                notice = wire.Revocations(self.creds.revocations.envelope)
                self._do([Send.of([m.conn for m in self.members.values()], notice)])

    # ------------------------------------------------------------ status

    @property
    def members(self):
        return self.core.members

    @property
    def manifests_rejected(self) -> int:
        return self.core.manifests_rejected

    @property
    def signals_relayed(self) -> int:
        return self.core.signals_relayed

    @property
    def signals_dropped(self) -> int:
        return self.core.signals_dropped

    def status(self) -> dict:
        waits = sorted(w for _, w in self.joins)
        return {**self.core.status(), "listen": self.listen_addr, "bytes_sent": dict(self.sent),
                "refused": dict(self.refused),  # by the listener, before a session: over join budget, region
                "require_region": self.creds.require_region,
                "probed": dict(self.probed) if self.probe else None,
                "gc": self.collector.status(),
                "recent_joins": {"count": len(waits), "p50_s": round(waits[len(waits) // 2], 4) if waits else None,
                                 "max_s": round(waits[-1], 4) if waits else None}}


def _raise_fd_limit() -> None:
    """One descriptor per member: lift the soft limit to the hard one (often 1024 -> far more)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
            return
    log.debug("open-file limit %d", max(soft, hard))
