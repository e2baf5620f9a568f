"""Fetching: asks peers for the chunks of the objects the plan wants, takes them in, tells peers what arrives.

Owns `Fetcher`: it executes the piece picker's answers (protocol/picker.py
decides which chunk to ask of whom, and when a request has run out of time;
it is also the node's one record of who holds which chunk and of the
requests in flight, so the facts peers announce go straight to it), sends
Request (RequestRest for a chunk whose transfer broke part-way, or that the
picker moved from a relaying member to the origin: only the bytes still
missing, from the next holder) and Cancel, takes each Piece in
(node/relay.py reassembles it, and lets sessions serve it onward while it
arrives), checks every whole chunk
against its signed manifest before the object store takes it, and tells
peers of it: `Incoming` at its first part, `HaveOne` once verified, to the
peers protocol/announce.py names. The relay state is kept here: which
sessions were told `Incoming` for a chunk not yet held. An object whose
chunks are all held is reported to the owner (`on_complete`).

Must not choose which objects to fetch (the applier's plan, through `want`),
which chunk or peer comes next (the picker), or serve peers (node/peers.py).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Callable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.announce import INCOMING_TELLS, Listener, tell_have, tell_incoming
from patchswarm.protocol.wire import unknown_kept
from patchswarm.protocol.manifest import chunk_ok
from patchswarm.protocol.picker import ORIGIN, NODE, PAST_ITS_TIMEOUT, SLOW, PiecePicker, Request
from patchswarm.protocol.publication import ObjKey, describe
from patchswarm.protocol.versions import VersionBook

from patchswarm.node.net.transport import CONNECTION_ERRORS, one_line
from patchswarm.node.peers import PeerDropped, PeerSet, Session
from patchswarm.node.relay import Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.node.wakeup import Wakeup

log = logging.getLogger("patchswarm.node")

REQUEST_TIMEOUT = 30.0  # a requested chunk not delivered by then is asked of someone else
POLL_S = 1.0  # the fetch loop looks again at least this often
KEEP_WAITS = 8  # objects whose longest wait for a chunk is kept for the status
# With a download limit (the node's own downlink, `--download-limit`), the requests in flight
# to peers not snubbed are what it takes in this long at that rate, at least MIN_INFLIGHT.
# Under SNUB_AFTER (5 s): no answer waits on the others in flight for as long as a peer is
# given to send a part. One is the least: at 300 KB/s and 1 MiB chunks, one request at a time
# let every relay pass its chunk on at the full rate (bench/RESULTS.md, "A node's own
# downlink"; protocol/picker.py, `max_inflight`).
DOWNLINK_QUEUE_S = 3.0
MIN_INFLIGHT = 1


class Fetcher:
    def __init__(self, me: str, region: str, picker: PiecePicker, peers: PeerSet, inflows: Inflows,
                 store: ObjectStore, book: VersionBook, on_complete: Callable[[ObjKey], None],
                 download_rate: float | None = None):
        self.me = me
        self.download_rate = download_rate  # bytes/s the node takes in at most (None: no limit)
        self.region = region
        self.picker = picker
        self.peers = peers
        self.inflows = inflows
        self.store = store
        self.book = book
        self._on_complete = on_complete
        self.bytes_in = {"origin": 0, "same_region": 0, "other_region": 0}
        self.chunks_rejected = 0
        self.pieces_unasked = 0  # first parts of chunks nobody asked of their sender: ignored
        self.snubs = 0  # times a peer was snubbed (sent no part for the picker's `snub_after`)
        self.given_up_early = 0  # requests given up before their timeout: at the peer's rate, due only after it
        self.slow_snubs = 0  # times a peer was snubbed as slow (a chunk would take it the picker's `slow_threshold`)
        # Sessions sent an Incoming for a chunk not yet held. Sessions, not peer ids: a peer
        # that reconnects meanwhile has a new session, which was never told.
        self._told: dict[ObjKey, dict[int, collections.Counter[Session]]] = {}  # Incoming sent, per peer
        # Chunks whose request to the origin a member's announcement already cancelled, per object
        # fetched: the next request to the origin for that chunk is left to answer (`_drop_origin_copy`).
        self._origin_dropped: dict[ObjKey, set[int]] = {}
        self._wakeup = Wakeup()
        self._nursery: trio.Nursery | None = None
        # Per object: when a chunk of it last arrived (or it was added), and the longest
        # time it went without one while chunks were missing (the last few objects kept).
        self._last_chunk_at: dict[ObjKey, float] = {}
        self.longest_wait: dict[ObjKey, float] = {}

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Send what the picker answers, as facts come in, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery  # the Request and Cancel sends
            task_status.started()
            while True:
                now = trio.current_time()
                self._expire(now)
                debug = log.isEnabledFor(logging.DEBUG)
                requests = self.picker.requests(now)
                for r in self.picker.withdrawn():  # moved to the origin: what came is kept for the rest
                    if debug:
                        log.debug("chunk %d of %s: the rest from the origin, not %s", r.chunk, describe(r.key), r.peer)
                    self._cancel(r)
                for r in requests:
                    if r.peer not in self.peers.sessions:
                        continue
                    # Bytes kept from a transfer of this chunk that broke: ask only for the rest.
                    offset = self.inflows.resume(r.peer, r.key, r.chunk)
                    if debug:  # with the arrival lines: who brought which chunk across the WAN, when and why
                        log.debug("request chunk %d of %s from %s%s (%s)", r.chunk, describe(r.key), r.peer,
                                  f" from byte {offset:,}" if offset else "", r.why or "?")
                    msg = (wire.RequestRest(r.key[0], r.key[1], r.chunk, offset) if offset
                           else wire.Request(r.key[0], r.key[1], r.chunk))
                    nursery.start_soon(self._send_to, r.peer, msg)
                wake = self.picker.next_wakeup(now)
                await self._wakeup.wait(POLL_S if wake is None else min(POLL_S, wake - now))

    def _expire(self, now: float) -> None:
        """Cancel the requests the picker says ran out of time: one that timed out, or all of a
        peer's that sent no part for `snub_after`, or served so slowly that a chunk would take it
        its `slow_threshold` (snubbed: asked for one chunk at a time, and ranked after the origin, until
        a part comes, or for a slow one a whole chunk)."""
        was = self.picker.snubbed_peers()  # O(snubbed), not a pass over the sessions each loop turn
        late = self.picker.expired(now)
        silent = collections.Counter(r.peer for r in late if self.picker.snubbed(r.peer))
        for peer, n in sorted(silent.items()):
            slow = self.picker.snub_reason(peer) == SLOW
            what = (f"served too slowly (a chunk would take it {self.picker.slow_threshold(peer):.0f} s or more)"
                    if slow else f"sent no part for {self.picker.snub_after:.1f} s")
            if peer in was:  # its probe, unanswered too
                log.debug("snubbed peer %s %s; its %d request(s) asked elsewhere", peer, what, n)
                continue
            if slow:
                self.slow_snubs += 1
            else:
                self.snubs += 1
            log.warning("peer %s %s while it held %d of my requests; asking elsewhere, and it only one at a time "
                        "until %s comes", peer, what, n, "a whole chunk" if slow else "a part")
        for r in late:
            if r.why == PAST_ITS_TIMEOUT:
                self.given_up_early += 1
                log.warning("peer %s would deliver chunk %d of %s only after its %.0f s timeout at its rate so far; "
                            "asking elsewhere for the rest", r.peer, r.chunk, describe(r.key), self.picker.request_timeout)
            elif r.peer not in silent:
                log.warning("peer %s did not deliver chunk %d of %s within %.0f s; asking elsewhere",
                            r.peer, r.chunk, describe(r.key), self.picker.request_timeout)
            self._cancel(r)

    def wake(self) -> None:
        """Something the picker answers from may have changed (members): ask it again."""
        self._wakeup.set()

    # ------------------------------------------------------------ what to fetch

    def want(self, plan: list[ObjKey]) -> None:
        """Fetch exactly the objects of `plan` (earlier versions first)."""
        now = trio.current_time()
        for key in plan:
            if self.picker.is_fetching(key):
                continue
            if not self.store.disk.may_retry():
                continue  # our disk failed a write lately: fetched once the backoff allows a retry
            m = self.book.get(key)
            if self.store.manifest(key) is None:
                try:
                    self.store.put_manifest(key, m, self.book.envelope(key))
                except OSError:
                    continue  # our disk (the store told store.disk, which logs); the next want retries
            # A keyframe with no patch beside it (the first version, or one published keyframe-only)
            # is what every member fetches while it is the newest: fetch it under the WAN plan like
            # a patch. Once newer versions are out it is a late joiner's, which the others applied
            # long ago: from any holder at once. Under the plan, with nobody of the region fetching
            # it, the joiner sat out the takeover (2 s) before anyone was asked.
            coordinated = not key[1] or (self.book.get((key[0], False)) is None
                                         and self.book.latest_version == key[0])
            self.picker.add_object(key, len(m.chunks), have=self.store.have(key), priority=key[0], now=now,
                                   coordinated=coordinated)
            self._last_chunk_at[key] = now
            self.longest_wait[key] = 0.0
            while len(self.longest_wait) > KEEP_WAITS:
                del self.longest_wait[next(iter(self.longest_wait))]
        for key in set(self.picker.fetching()) - set(plan):
            self.stop(key)
        self._size_pipeline(plan)
        self._wakeup.set()

    def _size_pipeline(self, plan: list[ObjKey]) -> None:
        """Requests in flight at most: DOWNLINK_QUEUE_S of the download limit in the plan's
        largest chunks, where there is a limit."""
        chunk = max((m.chunks[0][0] for m in map(self.book.get, plan) if m is not None and m.chunks), default=0)
        if self.download_rate is not None and chunk > 0:
            self.picker.max_inflight = max(MIN_INFLIGHT, math.ceil(self.download_rate * DOWNLINK_QUEUE_S / chunk))

    def stop(self, key: ObjKey) -> None:
        """Stop fetching `key` (applied, unusable, or off the plan): its requests are cancelled."""
        for r in self.picker.remove_object(key):
            self._cancel(r)
        self.inflows.drop_object(key)
        self._told.pop(key, None)
        self._origin_dropped.pop(key, None)
        for p in self.peers.sessions.values():
            p.refused -= {r for r in p.refused if r[0] == key}
        self._last_chunk_at.pop(key, None)

    def status(self) -> dict[str, int]:
        """Chunks still missing, per object being fetched."""
        return {describe(k): self.picker.missing(k) for k in self.picker.fetching()}

    def waits(self) -> dict[str, float]:
        """Per object fetched lately: the longest it went without a chunk arriving while chunks were
        missing (from its start), in seconds: how long the node sat without progress."""
        return {describe(k): round(v, 3) for k, v in self.longest_wait.items()}

    # ------------------------------------------------------------ facts from peers

    def peer_joined(self, s: Session) -> None:
        self.picker.peer_joined(s.id, ORIGIN if s.role == "origin" else NODE, s.region)
        self._wakeup.set()

    def peer_left(self, s: Session) -> None:
        self.picker.peer_left(s.id)
        self.inflows.drop_peer(s.id)
        self._wakeup.set()

    def on_announce(self, s: Session, msg: wire.Have | wire.HaveOne | wire.Incoming) -> None:
        """A peer holds chunks (Have, HaveOne) or receives one (Incoming): the picker records it.
        Checked against the object's manifest (ProtocolError, which drops the peer, if it does
        not fit). For an object whose manifest is not known here, kept unexpanded and bounded
        if its version is near the latest known (protocol/wire.py's `unknown_kept`), else ignored."""
        key = (msg.version, msg.keyframe)
        m = self.store.manifest(key) or self.book.get(key)
        chunks = wire.announced_chunks(msg, None if m is None else len(m.chunks), s.haves)
        whole = not isinstance(msg, wire.Incoming)
        if chunks is not None:
            self.picker.peer_has(s.id, key, chunks, whole=whole)
            if (not isinstance(msg, wire.Have) and s.role != "origin" and s.region == self.region
                    and not self.picker.snubbed(s.id)):  # a snubbed member's word moves nothing
                self._drop_origin_copy(key, msg.chunk)
        elif unknown_kept(key[0], self.book.latest_version):  # its manifest may be on its way (the origin
            # announces as it tells the tracker): kept as it came, bounded, until the manifest is here
            bitfield = msg.chunks if isinstance(msg, wire.Have) else None
            self.picker.peer_has_unknown(s.id, key, bitfield, () if bitfield is not None else (msg.chunk,), whole=whole)
        self._wakeup.set()

    def _drop_origin_copy(self, key: ObjKey, c: int) -> None:
        """A member of my region has chunk c or is receiving it: a request for it to the
        origin of which no byte has come is cancelled (the origin sends each chunk once;
        the picker then asks the member). Two members of the origin's region ask the
        origin for one chunk only when one took over part of the other's share
        (protocol/picker.py, `pick_share`); the one that hears first keeps it.

        Once per chunk and fetch: a member's word is only its word (and its region only its
        Hello's), so one that announced a chunk again and again without ever serving it had
        every new request to the origin for it cancelled, and the chunk never came."""
        if c in self._origin_dropped.get(key, ()):
            return
        for o in [o for o in self.peers.sessions.values() if o.role == "origin"]:
            if self.picker.sent_at(o.id, key, c) is not None and not self.inflows.receiving(o.id, key, c):
                # a request in flight: `key` is being fetched, so `stop` forgets this entry
                self._origin_dropped.setdefault(key, set()).add(c)
                log.debug("chunk %d of %s is coming to my region from a member: the origin's copy is cancelled",
                          c, describe(key))
                self.picker.request_lost(key, c, o.id)
                self._cancel(Request(o.id, key, c), keep=False)

    def on_reject(self, s: Session, msg: wire.Reject) -> None:
        """The peer will not send a chunk asked of it (or stopped mid-chunk: its own source failed)."""
        key = (msg.version, msg.keyframe)
        n = self.picker.n_chunks(key)
        if n is not None and msg.chunk >= n:
            raise PeerDropped(f"refused chunk {msg.chunk} of {describe(key)}, which has {n} chunks")
        self.inflows.discard(s.id, key, msg.chunk)
        self.picker.chunk_refused(key, msg.chunk, s.id, trio.current_time())  # no part: its silence goes on
        self._wakeup.set()

    async def on_piece(self, s: Session, msg: wire.Piece) -> None:
        key, c = (msg.version, msg.keyframe), msg.chunk
        if not self.picker.is_fetching(key) or c in self.store.have(key):
            self.inflows.discard(s.id, key, c, keep=False)
            return  # an endgame duplicate, or an object we stopped wanting
        m = self.store.manifest(key)
        if c >= len(m.chunks):
            raise PeerDropped(f"sent chunk {c} of {describe(key)}, which has {len(m.chunks)} chunks")
        if msg.offset == 0 and self.picker.sent_at(s.id, key, c) is None:
            # Not asked of this peer (any more): the first part of an answer this node withdrew
            # (a Cancel crossed it), or a member sending unasked. Ignored, so a peer cannot open a
            # chunk-sized buffer per chunk, nor make this node announce and serve chunks it
            # will never complete. A flow already open goes on (its request is in flight).
            self.pieces_unasked += 1
            return
        flow, first = self.inflows.receive(s.id, key, c, m.chunks[c][0], msg.offset, msg.total, msg.data)
        if flow is None:
            return  # the rest of a flow this node cancelled
        # A part of an answer to a request in flight: the peer is not silent (a snub ends), and
        # how far its answer has come (its rate: the picker's `slow_threshold`).
        asm = flow.asm
        self.picker.peer_sent(s.id, trio.current_time(), key, c, got=asm.received - flow.start,
                              left=asm.total - asm.received)
        if first and not flow.asm.complete:
            # Neighbours (and the next region's gateway) may follow it from here on.
            told = self._told.setdefault(key, {}).setdefault(c, collections.Counter())
            told.update(self._tell(wire.Incoming(key[0], key[1], c), self._audience(s, key, c, tell_incoming, told)))
        if not flow.asm.complete:
            return
        if log.isEnabledFor(logging.DEBUG):
            asked_at = self.picker.sent_at(s.id, key, c)
            log.debug("chunk %d of %s from %s (%s, region %s), %s B, %s", c, describe(key), s.id, s.role,
                      s.region, f"{msg.total:,}", "unasked" if asked_at is None
                      else f"{trio.current_time() - asked_at:.3f} s after the request")
        data = flow.asm.data()
        if not chunk_ok(m, c, data):  # one SHA-256 of the chunk, on the path of every chunk
            self.inflows.finish(flow, ok=False)
            self.chunks_rejected += 1
            if flow.start:
                # Resumed: its first bytes came from a peer whose transfer broke, so the fault may
                # be that peer's. Nobody is blamed; the chunk is asked again, whole (nothing is kept).
                self.picker.request_lost(key, c, s.id)
                log.warning("chunk %d of %s, resumed from byte %d with peer %s, does not match the manifest's "
                            "SHA-256; asking for it whole", c, describe(key), flow.start, s.id)
                self._wakeup.set()
                return
            self.picker.chunk_failed(key, c, s.id)
            log.warning("rejected chunk %d of %s from peer %s: does not match the manifest's SHA-256; dropping the peer",
                        c, describe(key), s.id)
            raise PeerDropped("sent a chunk that does not match its manifest")
        try:
            self.store.put_chunk(key, c, data)
        except OSError:
            # Our disk, not the peer's fault (the chunk verified): the peer stays, the object
            # leaves the picker, and `want` adds it again once store.disk allows a retry.
            self.inflows.finish(flow, ok=False)
            self.stop(key)
            return
        now = trio.current_time()
        if key in self._last_chunk_at:
            self.longest_wait[key] = max(self.longest_wait.get(key, 0.0), now - self._last_chunk_at[key])
            self._last_chunk_at[key] = now
        self.inflows.finish(flow, ok=True)  # its followers send the last part; new requests read the store
        source = "origin" if s.role == "origin" else "same_region" if s.region == self.region else "other_region"
        self.bytes_in[source] += len(data) - flow.start  # a resumed chunk's first bytes came before
        s.piece_bytes_in += len(data) - flow.start
        # Who hears of it is decided before the picker forgets the chunk's holders.
        hear = self._audience(s, key, c, tell_have, self._told.get(key, {}).pop(c, ()))
        for dup in self.picker.chunk_received(key, c, s.id, trio.current_time()):
            self._cancel(dup, keep=False)
        self._tell(wire.HaveOne(key[0], key[1], c), hear)
        if self.store.complete(key):
            self._on_complete(key)
        self._wakeup.set()

    def forget_below(self, version: int) -> None:
        """Objects below `version` are gone for good: what peers say of them no longer matters."""
        self.picker.forget_below(version)
        for p in self.peers.sessions.values():
            for key in [k for k in p.haves if k[0] < version]:
                del p.haves[key]

    # ------------------------------------------------------------ sending

    def _audience(self, sender: Session, key: ObjKey, c: int, rule, told=()) -> list[Session]:
        """The sessions `rule` (protocol/announce.py) says to tell of chunk c of `key`."""
        picker = self.picker
        return [p for p in self.peers.sessions.values()
                if rule(Listener(sender=p.id == sender.id, origin=p.role == "origin", same_region=p.region == self.region,
                                 announced=picker.announced(p.id, key, c), whole=picker.holds_whole(p.id, key, c),
                                 told=p in told, refused=(key, c) in p.refused,
                                 told_enough=p in told and told[p] >= INCOMING_TELLS))]

    def _tell(self, msg: wire.Incoming | wire.HaveOne, to: list[Session]) -> set[Session]:
        """Announce a chunk to `to`: those refused it before count this member a holder again."""
        told = self.peers.broadcast(msg, to=to)
        for p in told:
            p.refused.discard(((msg.version, msg.keyframe), msg.chunk))
        return told

    def _cancel(self, r: Request, keep: bool = True) -> None:
        """Withdraw a request: the peer drops it, and the parts that still come are ignored
        (what came is kept to resume from unless `keep` is False: the chunk is held)."""
        self.inflows.discard(r.peer, r.key, r.chunk, keep=keep)
        self._nursery.start_soon(self._send_to, r.peer, wire.Cancel(r.key[0], r.key[1], r.chunk))

    async def _send_to(self, peer: str, msg) -> None:
        s = self.peers.sessions.get(peer)
        if s is None:
            return
        try:
            await s.send(msg)
        except CONNECTION_ERRORS as e:
            s.close(f"could not send a {type(msg).__name__} ({one_line(e)})")
