"""Live connections to other members, and serving chunks on them.

Owns `PeerSet`: one `Session` per connected peer (at most one per peer id:
when two members dial each other at once, both keep the connection dialed by
the smaller id), how a session ends (`Session.close(reason)`, from here or
from the owner), and the upload side:
requests queue per session and are answered in parts (protocol/assembly.py;
their size from the uplink this member declares, `part_bytes_for`)
through the shared upload rate limit, from the `ObjectStore`, or, for a chunk
still arriving, from its `Inflow` (node/relay.py) as its parts come in. A
session sends the first part it can in queue order, so a whole chunk goes out
at once while a chunk that is still arriving takes the link only when it has
bytes. A RequestRest is answered like a Request, from its offset on (the asker kept
the bytes before it from a transfer that broke). A Cancel removes a request,
sent in part or not. Everything else a peer
says goes to the owner's `on_message`, as it came: what a peer holds is
recorded by whoever fetches (protocol/picker.py, through node/fetcher.py),
not here. Must not decide what to fetch or whom to tell what.

Budgets (issue 21): what one peer may ask of this node, `PeerBudgets`. Its
requests waiting for an answer are at most `max_queued_requests` (a request
for a chunk neither held nor arriving is answered with a Reject queued on
its own, in O(1), so a flood of them never walks the serve queue); its
announcements (Have, HaveOne, Incoming, manifests) at most
`announcements_per_minute`. A peer past a budget is dropped, and every drop is
counted by kind in `PeerSet.dropped` (the node's status shows it), with the
listener's refusals (node/net/transport.py: connections before Hello, bytes
buffered).
The chunk bytes read from disk for its requests that it then cancelled, less
what went out, are a debt paid off at `wasted_read_bytes_per_second`: past
`wasted_read_burst` its next read waits (`reads_delayed`), a wait and not a
drop, since an honest fetcher cancels too. Chunks served recently come from
the store's kept bytes (`ObjectStore.serve_chunk`) and cost no read.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Awaitable, Callable, Iterable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.assembly import part_bytes_for
from patchswarm.protocol.errors import BudgetExceeded, InvalidInput, ProtocolError, TruncatedStream
from patchswarm.protocol.publication import ObjKey
from patchswarm.protocol.uplinkmeter import UplinkMeter

from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.relay import Inflow, Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.node.net.transport import CONNECTION_ERRORS, HANDSHAKE_SECONDS, MessageStream

log = logging.getLogger("patchswarm.peers")
SEND_TIMEOUT = 60.0  # a peer that takes no bytes for this long is dropped
REQUESTS_QUEUED = "requests queued"  # budgets' names, for counters and logs
ANNOUNCEMENTS = "announcements per minute"
REJECTS_PER_WRITE = 256  # Rejects of requests for chunks not held, sent together
REFUSED_KEPT = 4096  # per session: the chunks it was refused, until it is told of them again
# Per session: a peer's Error messages logged as warnings; later ones at DEBUG. Members send
# peers none today, and each may carry 4 KiB: logged each, a peer could fill the log's disk.
ERRORS_LOGGED = 3
# Two members that dial each other at once each register the other's connection within the
# TLS and Hello deadlines of it: a connection from a member whose session this node dialed
# longer ago than this is not a crossing dial but a reconnect (the member lost the old one).
CROSSING_SECONDS = 2 * HANDSHAKE_SECONDS
_ANNOUNCEMENTS = (wire.Have, wire.HaveOne, wire.Incoming, wire.VersionNotice, wire.Announce)


@dataclasses.dataclass(frozen=True)
class PeerBudgets:
    """What one peer may ask of this node before it is dropped."""

    # An honest fetcher keeps a few requests in flight per peer (protocol/picker.py's pipeline).
    max_queued_requests: int = 1024
    # An honest peer announces each chunk it takes at most twice (Incoming, HaveOne): 2**17 a
    # minute is 2 MiB chunks (the codec's default) at 2.2 GB/s from one peer.
    announcements_per_minute: int = 1 << 17
    # Bytes of chunks read from disk (and hashed) for requests the peer cancelled before they
    # were sent whole, less what went out: past `wasted_read_burst`, the session's next chunk
    # read waits until this rate has paid them off. Not a drop: an honest fetcher cancels too
    # (endgame, a chunk that came from another holder first; mostly chunks served recently,
    # which cost no read), and would only wait. 32 MiB/s of reading and hashing is ~2% of a
    # core; unthrottled, a peer sending Request+Cancel pairs cost a read and a hash per pair.
    wasted_read_bytes_per_second: float = 32 << 20
    wasted_read_burst: float = 128 << 20
REPLACED = "replaced by a newer connection of the same member"
_QUIET_ENDS = ("closed", "said bye", REPLACED)  # logged at INFO


class PeerDropped(Exception):
    """Raised inside a session to end it with a reason (bad data, protocol breach)."""


@dataclasses.dataclass(eq=False)
class Session:
    ms: MessageStream
    id: str
    role: str
    region: str
    addr: str
    outbound: bool
    opened_at: float = 0.0  # trio.current_time() when it was registered
    # The requests being answered, in arrival order (a dict as an ordered set: O(1) removal), and
    # the same by (object, chunk), so a Cancel finds its requests without walking the queue.
    serve_queue: dict = dataclasses.field(default_factory=dict)
    queued: dict = dataclasses.field(default_factory=dict)  # (object, chunk) -> {Outflow: None}
    rejects: collections.deque = dataclasses.field(default_factory=collections.deque)  # Rejects to send first
    announced: int = 0  # announcements since `window_start`
    window_start: float = -60.0
    wasted_reads: float = 0.0  # read bytes not sent, less what the rate has paid off since `wasted_at`
    wasted_at: float = 0.0
    serve_ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    piece_bytes_in: int = 0
    piece_bytes_out: int = 0
    reported_open: bool = False  # the owner was told (`OnSession`) and is told of its end
    closed: bool = False
    close_reason: str | None = None  # why it ended, for the log; the first reason given stands
    tasks: trio.Nursery | None = None  # the session's own tasks (serving, broadcast copies)
    # (object, chunk) this member sent a Reject for, of an object whose manifest it holds, until
    # node/fetcher.py tells the peer of the chunk again (protocol/announce.py: `refused`).
    refused: set = dataclasses.field(default_factory=set)
    errors: int = 0  # Error messages it sent
    # object -> the OR of the Have bitfields it sent (wire.announced_chunks: a repeat costs only
    # what it adds); objects below the applied version are forgotten (node/fetcher.py)
    haves: dict = dataclasses.field(default_factory=dict)

    def error_level(self) -> int:
        """The log level for the Error message the peer just sent (ERRORS_LOGGED)."""
        self.errors += 1
        return logging.WARNING if self.errors <= ERRORS_LOGGED else logging.DEBUG

    def close(self, reason: str) -> None:
        """End the session: nothing more goes out on it, its tasks stop, and
        `PeerSet.run` closes the connection and reports the peer gone. For the
        owner's tasks too (a send that failed, a store that could not take
        what the peer sent). A second call changes nothing."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        if self.tasks is not None:
            self.tasks.cancel_scope.cancel()

    def refuse(self, key: ObjKey, chunk: int, why: str, known: bool = True) -> wire.Reject:
        """A Reject of the peer's request for the chunk; of an object this member knows
        (`known`: it may hold the chunk later), remembered so that the peer hears of the
        chunk again once it is here (at most REFUSED_KEPT remembered)."""
        if known and len(self.refused) < REFUSED_KEPT:
            self.refused.add((key, chunk))
        return wire.Reject(key[0], key[1], chunk, why)

    def wake(self) -> None:
        """Something to serve may have become sendable (a request, a part arrived)."""
        self.serve_ready.set()

    async def send(self, msg) -> None:
        with trio.fail_after(SEND_TIMEOUT):
            await self.ms.send(msg)

    async def send_many(self, msgs) -> None:
        with trio.fail_after(SEND_TIMEOUT):
            await self.ms.send_many(msgs)


@dataclasses.dataclass(eq=False)
class Outflow:
    """One requested chunk being served on a session: from `data` (held whole) or
    by following `flow` (still arriving); `sent` bytes of it went out."""

    key: ObjKey
    chunk: int
    sent: int = 0  # bytes of the chunk answered (from `start`; an answer ends with its last part)
    start: int = 0  # where the answer begins: the offset of a RequestRest
    data: bytes | None = None
    flow: Inflow | None = None
    read: bool = False  # `data` was read from disk for it (not kept from serving it before)


def _same_bytes(a, b, start: int, end: int) -> bool:
    """Whether bytes [start, end) of `a` and `b` are equal (no copy)."""
    with memoryview(a) as va, memoryview(b) as vb:
        return va[start:end] == vb[start:end]


OnMessage = Callable[[Session, object], Awaitable[None]]
# Called in the same step as the session enters or leaves `sessions` (plain functions, no
# checkpoint between): whoever keeps its own record of connected peers (the daemon's picker)
# never sees a peer open twice, even when it reconnects while its old connection closes.
OnSession = Callable[[Session], None]


class PeerSet:
    def __init__(self, me: str, store: ObjectStore, upload: TokenBucket, on_message: OnMessage,
                 on_open: OnSession | None = None, on_close: OnSession | None = None,
                 inflows: Inflows | None = None, budgets: PeerBudgets = PeerBudgets()):
        self.me = me
        self.budgets = budgets
        self.dropped: collections.Counter[str] = collections.Counter()  # peers dropped, by kind of fault
        self.store = store
        self.inflows = inflows  # chunks arriving now, served as they arrive; None: serve held chunks only
        self.upload = upload
        self.sessions: dict[str, Session] = {}
        self.replaced = 0  # sessions ended by a new connection of the same member (its reconnect)
        self._on_message = on_message
        self._on_open = on_open
        self._on_close = on_close
        self.bytes_out = 0
        self.bytes_out_arriving = 0  # of bytes_out: parts of chunks this member was still receiving (cut-through)
        self.reads_delayed = 0  # chunk reads that waited off a peer's cancelled reads (PeerBudgets)
        # This member's upload rate while its sends back up (protocol/uplinkmeter.py), against the
        # uplink it declared (--uplink-mbit, set by its owner): a warning when well under it.
        self.uplink = UplinkMeter()
        self.declared_uplink_mbit = None  # also sets part_bytes
        self.region: str | None = None  # this member's (set by its owner): sends elsewhere cross the WAN
        self._warned_uplink = False

    @property
    def declared_uplink_mbit(self) -> float | None:
        """The uplink this member declares (--uplink-mbit, set by its owner; None: none). It
        sets `part_bytes`, the size of the parts it sends (protocol/assembly.py `part_bytes_for`)."""
        return self._declared_uplink_mbit

    @declared_uplink_mbit.setter
    def declared_uplink_mbit(self, mbit: float | None) -> None:
        self._declared_uplink_mbit = mbit
        self.part_bytes = part_bytes_for(mbit)

    def connected(self, peer_id: str) -> bool:
        return peer_id in self.sessions

    def _keep_existing(self, existing: Session, outbound: bool, peer_id: str) -> bool:
        """Of a member's live session and its new connection, whether the old one stays.

        A member dials only while it holds no session with this node, so a new inbound
        connection says it lost the old one (a network blip, a restart) even where this
        node has not noticed yet (a half-open TCP connection is noticed only when a send
        fails, maybe never on an idle session): the new one replaces the old, unless the
        old one is this node's own dial of under CROSSING_SECONDS, which the member may
        not have registered yet when it dialed (both dialed at once). Then, and for this
        node's own dial arriving second, both ends keep the connection the smaller id
        dialed. Keeping the old one instead locked an honest member out for as long as
        the stale session lasted; a member that reconnects in a loop to churn sessions
        is held by its admission budget (node/net/admission.py), not by this rule."""
        if not outbound and (not existing.outbound or trio.current_time() - existing.opened_at > CROSSING_SECONDS):
            return False
        dialer_of_new = self.me if outbound else peer_id
        dialer_of_old = self.me if existing.outbound else peer_id
        # Both ends apply the same rule, so they keep the same connection.
        return dialer_of_old == min(self.me, peer_id) or dialer_of_new != min(self.me, peer_id)

    async def run(self, ms: MessageStream, outbound: bool) -> None:
        """Run one session until it ends; returns when the peer is gone."""
        hello = ms.hello
        assert hello is not None
        existing = self.sessions.get(ms.peer_name)
        if existing is not None:
            if self._keep_existing(existing, outbound, ms.peer_name):
                await ms.aclose()
                return
            # Unregister the old session and report it gone *before* the new one is
            # registered: its own `finally` then sees it is no longer registered and
            # stays quiet, so a late close of the old connection cannot report the
            # peer gone while its new session is live.
            existing.close(REPLACED)
            self.replaced += 1
            self._forget(existing)
            with trio.CancelScope(shield=True):
                await existing.ms.aclose()
            if ms.peer_name in self.sessions:  # a third connection won meanwhile
                await ms.aclose()
                return
        s = Session(ms, ms.peer_name, ms.peer_role, hello.region, hello.listen, outbound, trio.current_time())
        self.sessions[s.id] = s
        reason = "closed"
        try:
            async with trio.open_nursery() as nursery:
                s.tasks = nursery  # first: a broadcast from here on reaches this peer too
                for key in self.store.keys():
                    have = self.store.have(key)
                    if have:
                        n = len(self.store.manifest(key).chunks)
                        await s.send(wire.Have(key[0], key[1], wire.bitfield_from_indices(have, n)))
                if self.inflows is not None:
                    # What arrives now, too: a member that (re)joins mid-version pulls it from
                    # here instead of fetching it across the WAN a second time (issue 26).
                    for key, chunk in self.inflows.arriving():
                        await s.send(wire.Incoming(key[0], key[1], chunk))
                if s.closed:
                    # Replaced (or closed by its owner) while its greeting went out: a write
                    # that reached the socket completes without a checkpoint that raises, so
                    # this session's end is here. Reporting it open would report the peer
                    # open a second time beside the session that replaced it.
                    return
                s.reported_open = True
                if self._on_open is not None:
                    self._on_open(s)
                nursery.start_soon(self._serve, s)
                reason = await self._receive(s)
                nursery.cancel_scope.cancel()
        except* PeerDropped as group:
            reason = str(group.exceptions[0])
            self.dropped["misbehaved"] += 1
        except* BudgetExceeded as group:  # before ProtocolError, which includes it
            reason = f"over budget: {group.exceptions[0]}"
            self.dropped[group.exceptions[0].budget] += 1
        except* TruncatedStream:  # before ProtocolError: a peer killed mid-send, not a bad message
            reason = "connection lost (it ended inside a frame)"
        except* ProtocolError as group:
            reason = f"protocol error: {group.exceptions[0]}"
            self.dropped["protocol error"] += 1
        except* InvalidInput as group:
            reason = f"invalid input: {group.exceptions[0]}"
            self.dropped["invalid input"] += 1
        except* trio.TooSlowError:  # before the general case, which includes it
            reason = f"took no bytes for {SEND_TIMEOUT:.0f} s"
            self.dropped["stalled"] += 1
        except* CONNECTION_ERRORS as group:
            reason = f"connection lost ({type(group.exceptions[0]).__name__})"
        finally:
            s.close(reason)
            reason = s.close_reason
            if self.sessions.get(s.id) is s:
                self._forget(s)
            with trio.CancelScope(shield=True):
                await ms.aclose()
        level = logging.INFO if reason in _QUIET_ENDS else logging.WARNING
        log.log(level, "peer %s (%s, %s) left: %s", s.id, s.role, s.region, reason)

    def _forget(self, s: Session) -> None:
        """Unregister a session and, if it was reported open, report it gone in one step
        (`OnSession`)."""
        del self.sessions[s.id]
        if s.reported_open and self._on_close is not None:
            self._on_close(s)

    async def _receive(self, s: Session) -> str:
        while not s.closed:
            msg = await s.ms.receive()
            if s.closed:
                # Replaced or closed while this message was read (a read that completes is not
                # lost to a cancel: node/net/transport.py): its peer was reported gone, or lives
                # on in a new session, so what it says here goes nowhere.
                break
            if msg is None:
                return "closed"
            if isinstance(msg, (wire.Request, wire.RequestRest)):
                self._queue_request(s, msg)
            elif isinstance(msg, wire.Cancel):
                key = (msg.version, msg.keyframe)
                for o in list(s.queued.get((key, msg.chunk), ())):
                    self._drop_outflow(s, o)  # sent in part or not at all; else already sent
                    if o.read and o.data is not None:
                        self._waste(s, len(o.data) - (o.sent - o.start))
            elif isinstance(msg, wire.Bye):
                return "said bye"
            else:
                if isinstance(msg, _ANNOUNCEMENTS):
                    self._count_announcement(s)
                await self._on_message(s, msg)
        return "closed"

    def _queue_request(self, s: Session, msg: wire.Request | wire.RequestRest) -> None:
        limit = self.budgets.max_queued_requests
        if len(s.serve_queue) + len(s.rejects) >= limit:
            raise BudgetExceeded(REQUESTS_QUEUED, f"more than {limit} requests waiting for an answer")
        key = (msg.version, msg.keyframe)
        offset = msg.offset if isinstance(msg, wire.RequestRest) else 0
        if not (msg.chunk in self.store.have(key) or self.inflows is not None and self.inflows.source(key, msg.chunk)):
            # answered at once, never walking the queue: a flood of these costs O(1) each
            s.rejects.append(s.refuse(key, msg.chunk, "not held", known=self.store.manifest(key) is not None))
        elif offset and not offset < self._chunk_size(key, msg.chunk):
            s.rejects.append(wire.Reject(msg.version, msg.keyframe, msg.chunk,
                                         f"offset {offset} is not within the chunk"))
        else:
            o = Outflow(key, msg.chunk, sent=offset, start=offset)
            s.serve_queue[o] = None
            s.queued.setdefault((key, msg.chunk), {})[o] = None
        s.wake()

    def _chunk_size(self, key: ObjKey, chunk: int) -> int:
        """The size of a chunk held or arriving here (0 if this node cannot tell)."""
        m = self.store.manifest(key)
        if m is not None and chunk < len(m.chunks):
            return m.chunks[chunk][0]
        flow = self.inflows.source(key, chunk) if self.inflows is not None else None
        return 0 if flow is None else flow.asm.total

    def _count_announcement(self, s: Session) -> None:
        now = trio.current_time()
        if now - s.window_start >= 60.0:
            s.window_start, s.announced = now, 0
        s.announced += 1
        if s.announced > self.budgets.announcements_per_minute:
            raise BudgetExceeded(ANNOUNCEMENTS, f"more than {self.budgets.announcements_per_minute} "
                                                f"announcements in a minute")

    def _waste(self, s: Session, n: int) -> float:
        """Add `n` bytes read for nothing to the session's debt; returns the seconds its next
        read waits (0 while the debt is within the burst)."""
        now, rate = trio.current_time(), self.budgets.wasted_read_bytes_per_second
        s.wasted_reads = max(0.0, s.wasted_reads - (now - s.wasted_at) * rate) + n
        s.wasted_at = now
        return max(0.0, s.wasted_reads - self.budgets.wasted_read_burst) / rate

    async def _serve(self, s: Session) -> None:
        try:
            while True:
                if s.rejects:  # in one write: a flood of them costs their encoding, not a send each
                    await s.send_many([s.rejects.popleft() for _ in range(min(len(s.rejects), REJECTS_PER_WRITE))])
                    continue
                head = next(iter(s.serve_queue), None)
                if head is not None and head.data is None and head.flow is None:
                    # The chunk this session serves next, read and checked off the loop; the
                    # rest of the queue (and a failed flow's fallback) reads in `_resolve`.
                    wait = self._waste(s, 0)
                    if wait > 0:  # reads it cancelled, past the budget: this one waits them off
                        self.reads_delayed += 1
                        await trio.sleep(wait)
                        continue  # the queue may have changed meanwhile
                    data, read = await self.store.serve_chunk(head.key, head.chunk)
                    if head not in s.serve_queue:  # cancelled while it was read
                        if read and data is not None:
                            self._waste(s, len(data))
                    elif data is not None and head.data is None and head.flow is None:
                        head.data, head.read = data, read
                msg, arriving = self._next_to_send(s)
                if msg is None:
                    # Nothing sendable: no await since the scan, so no wake-up was missed.
                    s.serve_ready = trio.Event()
                    await s.serve_ready.wait()
                    continue
                if isinstance(msg, wire.Piece):
                    await self.upload.take(len(msg.data))
                    await self._send_piece(s, msg)
                else:
                    await s.send(msg)
                if isinstance(msg, wire.Piece):
                    s.piece_bytes_out += len(msg.data)
                    self.bytes_out += len(msg.data)
                    if arriving:
                        self.bytes_out_arriving += len(msg.data)
        finally:
            for o in list(s.serve_queue):
                self._drop_outflow(s, o)

    async def _send_piece(self, s: Session, msg: wire.Piece) -> None:
        """Send one part, timed for the uplink meter (a part that waits: its socket's buffer is full)."""
        meter, sent = self.uplink, 0
        local = s.region == self.region  # a send across the WAN waits on the region's link, not ours
        meter.started(trio.current_time(), local)
        try:
            await s.send(msg)
            sent = len(msg.data)
        finally:
            if meter.finished(trio.current_time(), sent, local):
                self._check_uplink()

    def _check_uplink(self) -> None:
        """Warn, once until it recovers, where the measured uplink is well under the declared one."""
        measured = self.uplink.below_declared(self.declared_uplink_mbit)
        if measured is None:
            self._warned_uplink = False
        elif not self._warned_uplink:
            self._warned_uplink = True
            log.warning("this member's uplink measured %.3g Mbit/s while its sends backed up, under a quarter of the "
                        "%.3g Mbit/s it declares (--uplink-mbit); declare what it does",
                        measured, self.declared_uplink_mbit)

    def _next_to_send(self, s: Session):
        """The next message for the serve queue, and whether it is a part of a chunk still
        arriving here: a part of the first request that has bytes to send, or a Reject;
        (None, False) when every request waits on arriving bytes."""
        for o in s.serve_queue:  # every path that changes the queue returns at once
            if o.data is None and o.flow is None or o.flow is not None and o.flow.failed:
                if not self._resolve(s, o):
                    self._drop_outflow(s, o)
                    return s.refuse(o.key, o.chunk, "stream aborted" if o.sent > o.start else "not held"), False
            if o.data is not None:
                total, limit = len(o.data), len(o.data)
            else:
                total, limit = o.flow.asm.total, o.flow.asm.forwardable
            end = min(limit, o.sent + self.part_bytes)
            whole = o.data is not None or o.flow.asm.verified
            if end > o.sent or (total == 0 and whole):  # an empty chunk is one empty part
                part = o.data[o.sent:end] if o.data is not None else o.flow.asm.view(o.sent, end)
                msg = wire.Piece(o.key[0], o.key[1], o.chunk, o.sent, total, part)
                o.sent = end
                arriving = o.data is None
                if end == total:
                    self._drop_outflow(s, o)
                return msg, arriving
        return None, False

    def _resolve(self, s: Session, o: Outflow) -> bool:
        """Find where to serve `o` from (again, after its flow failed): the store,
        else a flow of that chunk still arriving. False if neither.

        An answer already started from a flow that failed goes on from the new source only
        where that source's bytes are the ones it sent: a failed flow was never verified, and
        its bytes may be a hostile upstream's, not the chunk. Spliced onto the verified rest,
        they made the asker assemble a chunk that does not match its manifest and drop this
        (honest) node as its sender; refused ("stream aborted"), it keeps what came and asks
        another holder for the rest, which blames nobody when that does not verify."""
        sent = None  # the bytes of a started answer, from a flow never verified
        if o.flow is not None:
            o.flow.unwatch(s.wake)
            if o.sent > o.start and not o.flow.asm.verified:
                sent = o.flow.asm
            o.flow = None
        data, o.read = self.store.serve_chunk_now(o.key, o.chunk)
        if data is not None:
            if sent is not None and not _same_bytes(sent.data(), data, o.start, o.sent):
                return False
            o.data = data  # the bytes the failed flow was bringing, so the started answer goes on
            return True
        flow = self.inflows.source(o.key, o.chunk) if self.inflows is not None else None
        if flow is None:
            return False
        if sent is not None and flow.asm is not sent and (
                flow.asm.received < o.sent or not _same_bytes(sent.data(), flow.asm.data(), o.start, o.sent)):
            return False  # not (yet) known to carry the bytes sent: the asker resumes elsewhere
        o.flow = flow
        flow.watch(s.wake)
        return True

    def _drop_outflow(self, s: Session, o: Outflow) -> None:
        if s.serve_queue.pop(o, 0) is None:
            same = s.queued[(o.key, o.chunk)]
            del same[o]
            if not same:
                del s.queued[(o.key, o.chunk)]
        if o.flow is not None:
            o.flow.unwatch(s.wake)
            o.flow = None

    def broadcast(self, msg, to: Iterable[Session] | None = None) -> set[Session]:
        """Queue `msg` for every live session (or those of `to` still live) and return
        the sessions it was queued for: each copy is sent by a task of its own session, so a
        connection busy with pieces over a slow link delays only its own copy (sent one
        after another, a Have to a same-region peer waited behind every WAN peer's piece
        in progress: measured, up to 1.4 s). A copy that cannot be sent ends its session
        (SEND_TIMEOUT), as a piece would."""
        sent = set()
        for s in list(self.sessions.values()) if to is None else to:
            if not s.closed and s.tasks is not None:
                try:
                    s.tasks.start_soon(s.send, msg)
                except RuntimeError:
                    continue  # the session is ending: its nursery takes no new tasks
                sent.add(s)
        return sent
