"""The swarm fetch policy: which chunk to request next, and from which peer.

Owns `PiecePicker`, a plain object in the style of libtorrent's piece picker:
the node daemon reports facts (members, peers joining and leaving, who has
which chunk, a chunk verified or failed) and asks questions (`requests(now)`:
what to send now; `next_wakeup(now)`: when to ask again without a new fact).
It must not do I/O, read a clock (time is an argument), see chunk bytes (the
daemon verifies them) or use randomness other than the `random.Random(seed)`
it was built with.

Where chunk c of object key may come from, for this node `me` in region R:

Patch objects (the WAN plan of protocol/responsibility.py):
  1. a connected node peer in R that has c (never across the WAN when a
     neighbour has it);
  2. else, if me owns c in R's `balanced_owners` (rendezvous hashing over
     R's gateways, each taking an even share of the chunks R pulls from
     each source): a node peer of the
     region just before R in c's chain (`upstream_regions`), never a farther
     one (each region's uplink carries each chunk at most once); the origin
     only where `upstream_regions` says the origin serves R;
  3. else nothing: wait for the responsible node of R to bring it;
  4. takeover: once my region has made no progress on the object (no chunk
     of it newly held by me or a same-region peer) for `takeover_after`
     seconds, a node that is idle (nothing in flight, nothing else
     requestable) fetches waiting chunks from any holder: node peers of any
     region first, then the origin; at most `pipeline` chunks per idle round,
     rarest first. A slow WAN that still moves chunks never triggers it; a
     responsible node that went silent does.
     Members leaving re-plan at once (`set_members`), with no delay.
Keyframe objects (late joiners, rare): no responsibility; node peers of R,
else node peers of other regions, else the origin. A keyframe every member
fetches (the swarm's first version) is added with `coordinated=True` and
follows the patch rules.

Among requestable chunks: objects by priority (lower first), then rarest first
(rarity = connected peers that have the chunk), ties by a per-object shuffle
from the seeded rng, so different nodes start on different chunks. Each request
goes to the eligible peer with the fewest requests in flight (ties by rng), at
most `pipeline` per peer and at most `wan_pipeline` in flight per other region
(the origin counts as a peer of its region): chunks in flight over one WAN
link share it, so the fewer at once, the sooner each is whole and the sooner
the next region can relay it; a relay from one region is never held up by a
slow transfer from another. Endgame: when every missing chunk of an object is in
flight, a same-region node peer with a free slot is asked for a second copy
(at most MAX_COPIES); the first copy that arrives cancels the others. Endgame
never crosses the WAN: a duplicate there would spend the scarce link the plan
exists to save.

Cost: facts update per-chunk indexes incrementally (holder sets, rarity
buckets of the requestable chunks, the requestable chunks of each peer), so
`requests()` looks only at peers with free slots and at the chunks they can
serve, never at all chunks × all peers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable

from .errors import ProtocolError, UsageError
from .responsibility import ObjKey, ResponsibilityMap, upstream_regions

ORIGIN = "origin"  # peer kind: the seeder on the trainer, holds every announced chunk
NODE = "node"  # peer kind: another node daemon
PEER_KINDS = (ORIGIN, NODE)
MAX_COPIES = 2  # endgame: copies of one chunk in flight at once
# Requests in flight across the WAN (to peers, the origin included, of other
# regions), per node. Chunks in flight over one link share it, so each arrives
# later the more there are; a region can forward a chunk only once it is whole.
# Few at a time, each chunk crosses fast and the next region starts relaying
# it early (see the README's WAN notes for the measurement).
WAN_PIPELINE = 2
# Members per region that bring an object across the WAN (None: all of them).
# Every gateway keeps WAN_PIPELINE chunks in flight per upstream region, so
# this also bounds how many chunks share one WAN link at once.
WAN_GATEWAYS: int | None = 2
MAX_PENDING_OBJECTS = 16  # objects whose Have facts are kept before add_object
COMPACT_SLACK = 64  # removals a chunk set absorbs before it is rebuilt (see _discard)

_NOT_A_SOURCE = 1 << 30  # source tier: this holder may not be asked now
_SAME_REGION = 0  # source tier of a node peer in my region
_OTHER_REGION = 1  # keyframes and takeover: node peers of other regions
_ORIGIN = 1 << 20  # after the upstream region's node peers


@dataclass(frozen=True, order=True)
class Request:
    """Ask `peer` for chunk `chunk` of object `key`; returned by
    `remove_object` and `chunk_received`, the same value means: cancel it."""

    peer: str
    key: ObjKey
    chunk: int


class _Peer:
    __slots__ = ("kind", "region", "inflight")

    def __init__(self, kind: str, region: str):
        self.kind = kind
        self.region = region
        self.inflight: set[tuple[ObjKey, int]] = set()


class _Wanted:
    """The fetch state of one object. A missing chunk is in exactly one state:
    in flight (`inflight`), ready (has `sources`, not in flight: indexed in
    `buckets` and `ready_of`), or waiting (neither)."""

    __slots__ = ("key", "n_chunks", "priority", "added_at", "rank", "chunk_of", "missing",
                 "holders", "sources", "tier", "inflight", "failed", "buckets", "ready_of",
                 "dead_buckets", "dead_ready", "n_ready", "duty", "mine", "upstream", "coordinated",
                 "progress", "progress_seen", "progress_at", "taken")

    def __init__(self, key: ObjKey, n_chunks: int, have: set[int], priority: int,
                 added_at: float, rng: random.Random, coordinated: bool):
        self.key = key
        self.coordinated = coordinated
        # Chunks that reached my region (a same-region holder, or me), and when
        # requests() last saw that count move: takeover waits for a stall.
        self.progress = 0
        self.progress_seen = 0
        self.progress_at = added_at
        self.taken: set[int] = set()  # chunks asked for by takeover: their arrival is not progress
        self.n_chunks = n_chunks
        self.priority = priority
        self.added_at = added_at
        ranks = list(range(n_chunks))
        rng.shuffle(ranks)
        self.rank = ranks  # chunk -> its tie-break rank; per node, per object
        self.chunk_of = [0] * n_chunks  # rank -> chunk
        for c, r in enumerate(ranks):
            self.chunk_of[r] = c
        self.missing = set(range(n_chunks)) - have
        self.holders: dict[int, set[str]] = {c: set() for c in self.missing}
        self.sources: dict[int, set[str]] = {}  # allowed holders now; only non-empty
        self.tier: dict[int, int] = {}  # the tier those sources share
        self.inflight: dict[int, set[str]] = {}
        self.failed: dict[int, set[str]] = {}
        # Ready chunks by rarity, stored as ranks: a set of ints iterates in a
        # fixed order of its values, and the ranks are this node's shuffle, so
        # the walk visits equally rare chunks in a per-node random order.
        self.buckets: dict[int, set[int]] = {}
        self.ready_of: dict[str, set[int]] = {}  # peer -> ready chunks it is a source of
        # removals from each of those sets since it was last compacted (_discard)
        self.dead_buckets: dict[int, int] = {}
        self.dead_ready: dict[str, int] = {}
        self.n_ready = 0
        self.duty: ResponsibilityMap | None = None  # None for keyframes
        self.mine = bytearray(n_chunks)  # 1 where me is responsible
        self.upstream: dict[int, tuple[dict[str, int], bool]] = {}  # lazy, per chunk

    @property
    def is_patch(self) -> bool:
        """Fetched under the WAN plan (responsibility), as every member wants it."""
        return self.coordinated

    def ready(self, c: int) -> bool:
        return c in self.sources and c not in self.inflight

    def waiting(self) -> int:
        return len(self.missing) - len(self.inflight) - self.n_ready


class PiecePicker:
    """Which chunk to request next from which peer, for one node (see module doc)."""

    def __init__(self, me: str, region: str, origin_region: str, *, seed: int = 0,
                 pipeline: int = 4, takeover_after: float = 2.0, wan_pipeline: int = WAN_PIPELINE,
                 wan_gateways: int | None = WAN_GATEWAYS):
        if type(pipeline) is not int or pipeline < 1:
            raise UsageError(f"pipeline: expected an int >= 1, found {pipeline!r}")
        if type(wan_pipeline) is not int or wan_pipeline < 1:
            raise UsageError(f"wan_pipeline: expected an int >= 1, found {wan_pipeline!r}")
        if wan_gateways is not None and (type(wan_gateways) is not int or wan_gateways < 1):
            raise UsageError(f"wan_gateways: expected None or an int >= 1, found {wan_gateways!r}")
        if not takeover_after >= 0:
            raise UsageError(f"takeover_after: expected seconds >= 0, found {takeover_after!r}")
        self.me = me
        self.region = region
        self.origin_region = origin_region
        self.pipeline = pipeline
        self.wan_pipeline = wan_pipeline
        self.wan_gateways = wan_gateways
        self._wan_budget: dict[str, int] = {}  # per other region: what requests() may still send to it
        self.takeover_after = float(takeover_after)
        self._rng = random.Random(seed)
        self._peers: dict[str, _Peer] = {}
        self._objects: dict[ObjKey, _Wanted] = {}
        self._order: list[_Wanted] = []  # by (priority, key)
        self._pending: dict[ObjKey, dict[str, set[int]]] = {}  # Haves for objects not added yet
        self._n_inflight = 0
        self._members: dict[str, str] = {me: region}
        self._region_members: set[str] = {me}
        self._member_regions: frozenset[str] = frozenset({region})

    # --- facts ---------------------------------------------------------------

    def set_members(self, members: dict[str, str]) -> None:
        """The live nodes of the swarm (node id -> region, origin excluded), as
        the tracker reports them. Responsibility is recomputed at once."""
        if members.get(self.me, self.region) != self.region:
            raise UsageError(f"members: expected {self.me!r} in region {self.region!r}, "
                             f"found {members[self.me]!r}")
        self._members = {**members, self.me: self.region}
        self._region_members = {m for m, r in self._members.items() if r == self.region}
        regions = frozenset(self._members.values())
        regions_changed = regions != self._member_regions
        self._member_regions = regions
        for obj in self._objects.values():
            if not obj.is_patch:
                continue
            if regions_changed:  # every chunk's upstream regions may have moved
                obj.upstream.clear()
            flipped = self._update_duty(obj, reclass=regions_changed)
            stale = sorted(obj.missing) if regions_changed else [c for c in flipped if c in obj.missing]
            for c in stale:
                self._refresh(obj, c)

    def add_object(self, key: ObjKey, n_chunks: int, *, have: Iterable[int] = (),
                   priority: int = 0, now: float, coordinated: bool | None = None) -> None:
        """Start fetching `key` (n_chunks chunks, `have` already held). Lower
        `priority` is fetched first. `now` starts the takeover clock.
        `coordinated` (default: patches yes, keyframes no) says every member
        fetches this object, so it follows the WAN plan; a keyframe that all
        members bootstrap from (the first version) is one."""
        if (not isinstance(key, tuple) or len(key) != 2 or type(key[0]) is not int
                or type(key[1]) is not bool):
            raise UsageError(f"add_object: expected a key (version: int, keyframe: bool), "
                             f"found {key!r}")
        if key in self._objects:
            raise UsageError(f"add_object: {key} is already being fetched")
        if type(n_chunks) is not int or n_chunks < 0:
            raise UsageError(f"add_object: expected n_chunks >= 0, found {n_chunks!r}")
        held = set(have)
        bad = [c for c in held if not (type(c) is int and 0 <= c < n_chunks)]
        if bad:
            raise UsageError(f"add_object: expected have in [0, {n_chunks}), found {bad[:5]}")
        obj = _Wanted(key, n_chunks, held, priority, now, self._rng,
                      (not key[1]) if coordinated is None else bool(coordinated))
        if obj.is_patch:
            obj.duty = ResponsibilityMap(key, n_chunks, self._region_members, max_gateways=self.wan_gateways,
                                         classes=self._source_classes(obj))
            for c in range(n_chunks):
                obj.mine[c] = obj.duty.owner(c) == self.me
        self._objects[key] = obj
        self._order.append(obj)
        self._order.sort(key=lambda o: (o.priority, o.key))
        for peer, chunks in self._pending.pop(key, {}).items():
            # Out-of-range indices from before the object was known are dropped:
            # there is no caller to blame any more.
            valid = [c for c in chunks if type(c) is int and 0 <= c < n_chunks]
            self._peer_holds(obj, peer, valid)

    def remove_object(self, key: ObjKey) -> list[Request]:
        """Stop fetching `key`; returns the in-flight requests to cancel."""
        self._pending.pop(key, None)
        obj = self._objects.pop(key, None)
        if obj is None:
            return []
        self._order.remove(obj)
        cancels = []
        for c, peers in obj.inflight.items():
            for p in peers:
                self._peers[p].inflight.discard((key, c))
                self._n_inflight -= 1
                cancels.append(Request(p, key, c))
        return sorted(cancels)

    def peer_joined(self, peer: str, kind: str, region: str) -> None:
        """A connection to `peer` is up. It holds nothing until `peer_has`."""
        if kind not in PEER_KINDS:
            raise UsageError(f"peer_joined: expected kind in {PEER_KINDS}, found {kind!r}")
        if peer in self._peers:
            raise UsageError(f"peer_joined: {peer!r} is already connected")
        if peer == self.me:
            raise UsageError(f"peer_joined: {peer!r} is this node")
        self._peers[peer] = _Peer(kind, region)

    def peer_left(self, peer: str) -> None:
        """The connection to `peer` is gone: its requests in flight are released
        and it is no longer a holder. Unknown peers are ignored."""
        for pending in self._pending.values():
            pending.pop(peer, None)
        info = self._peers.get(peer)
        if info is None:
            return
        for key, c in sorted(info.inflight):
            self._release(self._objects[key], c, peer)
        for obj in self._objects.values():
            obj.ready_of.pop(peer, None)
            obj.dead_ready.pop(peer, None)
            for c in [c for c, hs in obj.holders.items() if peer in hs]:
                was_ready = obj.ready(c)
                if was_ready:
                    self._unindex(obj, c)
                obj.holders[c].discard(peer)
                srcs = obj.sources.get(c)
                if srcs is not None and peer in srcs:
                    srcs.discard(peer)
                    if not srcs:
                        self._recompute_sources(obj, c)
                if obj.ready(c):
                    self._index(obj, c)
        del self._peers[peer]

    def peer_has(self, peer: str, key: ObjKey, chunks: Iterable[int]) -> None:
        """`peer` holds `chunks` of `key` (a Have bitfield's indices or one
        HaveOne). Facts about objects not added yet are kept until they are."""
        if peer not in self._peers:
            raise UsageError(f"peer_has: {peer!r} has not joined")
        obj = self._objects.get(key)
        if obj is None:
            if key not in self._pending and len(self._pending) >= MAX_PENDING_OBJECTS:
                del self._pending[next(iter(self._pending))]  # oldest first
            self._pending.setdefault(key, {}).setdefault(peer, set()).update(chunks)
            return
        chunks = list(chunks)
        bad = [c for c in chunks if not (type(c) is int and 0 <= c < obj.n_chunks)]
        if bad:
            raise ProtocolError(f"peer {peer!r} announced chunks of {key}: expected indices in "
                                f"[0, {obj.n_chunks}), found {bad[:5]}")
        self._peer_holds(obj, peer, chunks)

    def chunk_received(self, key: ObjKey, chunk: int, peer: str) -> list[Request]:
        """Chunk `chunk` of `key` from `peer` verified and stored. Returns the
        cancels for the other copies still in flight (endgame)."""
        obj = self._objects.get(key)
        if obj is None:
            return []
        self._check_chunk(obj, chunk, "chunk_received")
        if chunk not in obj.missing:
            return []
        if obj.ready(chunk):
            self._unindex(obj, chunk)
        cancels = []
        for p in sorted(obj.inflight.pop(chunk, ())):
            self._peers[p].inflight.discard((key, chunk))
            self._n_inflight -= 1
            if p != peer:
                cancels.append(Request(p, key, chunk))
        obj.missing.discard(chunk)
        if chunk in obj.taken:
            obj.taken.discard(chunk)
        else:
            obj.progress += 1
        del obj.holders[chunk]
        for table in (obj.sources, obj.tier, obj.failed, obj.upstream):
            table.pop(chunk, None)
        return cancels

    def chunk_failed(self, key: ObjKey, chunk: int, peer: str) -> None:
        """`peer` sent bad data for the chunk, or refused it: release the
        request; that peer is never asked for that chunk again."""
        obj = self._objects.get(key)
        if obj is None:
            return
        self._check_chunk(obj, chunk, "chunk_failed")
        if chunk not in obj.missing:
            return
        obj.failed.setdefault(chunk, set()).add(peer)
        if peer in obj.inflight.get(chunk, ()):
            self._release(obj, chunk, peer)
        if peer in obj.sources.get(chunk, ()):
            self._refresh(obj, chunk)

    # --- questions -----------------------------------------------------------

    def requests(self, now: float) -> list[Request]:
        """The new requests to send now (they count as in flight from here on)."""
        budget: dict[str, int] = {}  # per other region: requests it may still take this round
        for info in self._peers.values():
            if info.region != self.region:
                budget[info.region] = budget.get(info.region, self.wan_pipeline) - len(info.inflight)
        self._wan_budget = budget
        free = {p: self.pipeline - len(info.inflight) for p, info in self._peers.items()
                if len(info.inflight) < self.pipeline and (info.region == self.region or budget[info.region] > 0)}
        out: list[Request] = []
        for obj in self._order:
            if obj.progress != obj.progress_seen:
                obj.progress_seen, obj.progress_at = obj.progress, now
        for obj in self._order:
            if not free:
                break
            if obj.n_ready:
                self._pick_ready(obj, free, out)
            if free and obj.missing and len(obj.inflight) == len(obj.missing):
                self._pick_endgame(obj, free, out)
        if not out and self._n_inflight == 0 and free:
            # Idle: take over stuck chunks, at most `pipeline` per idle round so
            # that many idle nodes of one region do not flood the WAN at once.
            for obj in self._order:
                if obj.is_patch and now >= obj.progress_at + self.takeover_after and obj.waiting():
                    self._pick_takeover(obj, free, out, self.pipeline - len(out))
                if len(out) >= self.pipeline or not free:
                    break
        return out

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time after `now` at which `requests()` could return
        something new without a new fact (a takeover clock running out)."""
        due = [obj.progress_at + self.takeover_after for obj in self._order
               if obj.is_patch and obj.waiting() and obj.progress_at + self.takeover_after > now]
        return min(due, default=None)

    def complete(self, key: ObjKey) -> bool:
        """Every chunk of `key` is held (UsageError for an unknown key)."""
        return self.missing(key) == 0

    def missing(self, key: ObjKey) -> int:
        """How many chunks of `key` are not held yet."""
        obj = self._objects.get(key)
        if obj is None:
            raise UsageError(f"missing: {key} is not being fetched")
        return len(obj.missing)

    def in_flight(self, peer: str | None = None) -> int:
        """Requests in flight, to `peer` or in all."""
        if peer is None:
            return self._n_inflight
        info = self._peers.get(peer)
        return len(info.inflight) if info else 0

    def responsible_for(self, key: ObjKey) -> int:
        """How many chunks of a patch object me must bring into the region."""
        obj = self._objects.get(key)
        if obj is None:
            raise UsageError(f"responsible_for: {key} is not being fetched")
        return sum(obj.mine)

    # --- picking -------------------------------------------------------------

    def _pick_ready(self, obj: _Wanted, free: dict[str, int], out: list[Request]) -> None:
        useful = {p for p in free if obj.ready_of.get(p)}
        if not useful:
            return
        servable = sum(len(obj.ready_of[p]) for p in useful)
        slots = sum(free[p] for p in useful)
        if servable * servable < slots * obj.n_ready:
            # The free peers can serve few of the ready chunks: rank just those
            # instead of walking past the others in the rarity buckets.
            chosen = set().union(*(obj.ready_of[p] for p in useful))
            walk = sorted(chosen, key=lambda c: (len(obj.holders[c]), obj.rank[c]))
        else:
            walk = self._by_rarity(obj)
        picks = []
        for c in walk:
            eligible = obj.sources[c] & useful
            if not eligible:
                continue
            p = self._pick_peer(eligible, free)
            picks.append((c, p))
            self._take_slot(free, p)
            if p not in free or not useful <= free.keys():  # p, or a whole region's peers, ran out of slots
                useful.intersection_update(free)
                if not useful:
                    break
        for c, p in picks:
            self._send(obj, c, p, out)

    @staticmethod
    def _by_rarity(obj: _Wanted):
        chunk_of = obj.chunk_of
        for rarity in sorted(obj.buckets):
            for r in obj.buckets[rarity]:
                yield chunk_of[r]

    def _pick_endgame(self, obj: _Wanted, free: dict[str, int], out: list[Request]) -> None:
        nearby = [p for p in free if self._peers[p].kind == NODE
                  and self._peers[p].region == self.region]
        if not nearby:
            return
        short = sorted((c for c, ps in obj.inflight.items() if len(ps) < MAX_COPIES),
                       key=lambda c: (len(obj.holders[c]), obj.rank[c]))
        for c in short:
            asked, bad, hs = obj.inflight[c], obj.failed.get(c, ()), obj.holders[c]
            eligible = [p for p in nearby if p in free and p in hs and p not in asked
                        and p not in bad]
            if eligible:
                p = self._least_busy(eligible, free)
                self._take_slot(free, p)
                self._send(obj, c, p, out)
                if not free:
                    return

    def _pick_takeover(self, obj: _Wanted, free: dict[str, int], out: list[Request],
                       budget: int) -> None:
        stuck = sorted((c for c in obj.missing
                        if c not in obj.inflight and c not in obj.sources and obj.holders[c]),
                       key=lambda c: (len(obj.holders[c]), obj.rank[c]))
        for c in stuck:
            _, best = self._best_holders(obj, c, self._any_tier)
            eligible = [p for p in best if p in free]
            if eligible:
                p = self._least_busy(eligible, free)
                self._take_slot(free, p)
                self._send(obj, c, p, out)
                obj.taken.add(c)
                budget -= 1
                if not free or not budget:
                    return

    def _pick_peer(self, eligible: set[str], free: dict[str, int]) -> str:
        """Inside the region, the least busy holder. Across the WAN, the holder
        already busiest with my requests (while it has a slot): a peer sends
        one connection's pieces one after another, so requests stacked on one
        connection cross the shared link in turn, each whole as early as it
        can be, where requests spread over several connections share the link
        and all finish late; the next region relays a chunk only once it is
        whole. (The sources of a chunk are all of one tier, hence one region.)"""
        across = self._peers[next(iter(eligible))].region != self.region
        return self._least_busy(eligible, free, busiest=across)

    def _least_busy(self, eligible: Iterable[str], free: dict[str, int], busiest: bool = False) -> str:
        """The eligible peer with the most free slots (with `busiest`, the fewest); ties by rng."""
        rand = self._rng.random
        sign = 1 if busiest else -1
        return min(sorted(eligible), key=lambda p: (sign * free[p], rand()))

    def _take_slot(self, free: dict[str, int], p: str) -> None:
        free[p] -= 1
        if not free[p]:
            del free[p]
        region = self._peers[p].region
        if region != self.region:
            self._wan_budget[region] -= 1
            if self._wan_budget[region] <= 0:  # that region's link is busy enough: none of its peers this round
                for q in [q for q in free if self._peers[q].region == region]:
                    del free[q]

    # --- bookkeeping ---------------------------------------------------------

    def _check_chunk(self, obj: _Wanted, chunk: int, what: str) -> None:
        if not (type(chunk) is int and 0 <= chunk < obj.n_chunks):
            raise UsageError(f"{what}: expected a chunk index of {obj.key} in "
                             f"[0, {obj.n_chunks}), found {chunk!r}")

    def _update_duty(self, obj: _Wanted, reclass: bool = False) -> list[int]:
        """Refresh `obj.mine` from the region's members (and, with `reclass`, the
        chunks' sources); the chunks that flipped."""
        flipped = []
        for c in obj.duty.set_members(self._region_members, self._source_classes(obj) if reclass else None):
            now_mine = obj.duty.owner(c) == self.me
            if obj.mine[c] != now_mine:
                obj.mine[c] = now_mine
                flipped.append(c)
        return flipped

    def _source_classes(self, obj: _Wanted) -> list[tuple]:
        """Per chunk, where my region pulls it from across the WAN: the gateways
        share out each source's chunks evenly (`balanced_owners`)."""
        out = []
        for c in range(obj.n_chunks):
            regions, origin_serves = self._upstream(obj, c)
            out.append((tuple(sorted(regions)), origin_serves))
        return out

    def _upstream(self, obj: _Wanted, c: int) -> tuple[dict[str, int], bool]:
        plan = obj.upstream.get(c)
        if plan is None:
            regions, origin_serves = upstream_regions(obj.key, c, self.region,
                                                      self._member_regions, self.origin_region)
            plan = {r: _OTHER_REGION + i for i, r in enumerate(regions)}, origin_serves
            obj.upstream[c] = plan
        return plan

    def _tier(self, obj: _Wanted, c: int, info: _Peer) -> int:
        """How good a source `info` is for chunk c under the normal rules (lower first)."""
        if info.kind == NODE and info.region == self.region:
            return _SAME_REGION
        if not obj.is_patch:
            return self._any_tier(info)
        if not obj.mine[c]:
            return _NOT_A_SOURCE
        regions, origin_serves = self._upstream(obj, c)
        if info.kind == NODE:
            return regions.get(info.region, _NOT_A_SOURCE)
        return _ORIGIN if origin_serves else _NOT_A_SOURCE

    @staticmethod
    def _any_tier(info: _Peer) -> int:
        """Keyframes and takeover: any node peer, then the origin."""
        return _OTHER_REGION if info.kind == NODE else _ORIGIN

    def _peer_holds(self, obj: _Wanted, peer: str, chunks: Iterable[int]) -> None:
        # The hot path (one call per Have / HaveOne): locals, and the tier
        # hoisted out of the loop wherever it does not depend on the chunk.
        info = self._peers[peer]
        holders, sources, tiers, inflight = obj.holders, obj.sources, obj.tier, obj.inflight
        failed, buckets, rank, mine = obj.failed, obj.buckets, obj.rank, obj.mine
        if info.kind == NODE and info.region == self.region:
            fixed = _SAME_REGION
        elif not obj.is_patch:
            fixed = self._any_tier(info)
        else:
            fixed = None  # per chunk: only where me is responsible
        for c in chunks:
            hs = holders.get(c)
            if hs is None or peer in hs:
                continue
            ready = c in sources and c not in inflight
            if ready:  # rarity goes up by one: move its bucket
                _discard(buckets, obj.dead_buckets, len(hs), rank[c])
                buckets.setdefault(len(hs) + 1, set()).add(rank[c])
            hs.add(peer)
            if fixed == _SAME_REGION:
                obj.progress += 1
            if failed and peer in failed.get(c, ()):
                continue
            if fixed is not None:
                t = fixed
            elif mine[c]:
                t = self._tier(obj, c, info)
            else:
                continue
            current = tiers.get(c, _NOT_A_SOURCE)
            if t < current:  # a better tier replaces the sources
                if ready:
                    self._unindex(obj, c)
                sources[c], tiers[c] = {peer}, t
                if c not in inflight:
                    self._index(obj, c)
            elif t == current and t != _NOT_A_SOURCE:
                sources[c].add(peer)
                if ready:
                    obj.ready_of.setdefault(peer, set()).add(c)

    def _best_holders(self, obj: _Wanted, c: int, tier_of) -> tuple[int, set[str]]:
        """The best tier among the holders of c not failed for it, and who has it."""
        best, srcs = _NOT_A_SOURCE, set()
        bad = obj.failed.get(c, ())
        for p in obj.holders[c]:
            if p in bad:
                continue
            t = tier_of(self._peers[p])
            if t < best:
                best, srcs = t, {p}
            elif t == best and t != _NOT_A_SOURCE:
                srcs.add(p)
        return best, srcs

    def _recompute_sources(self, obj: _Wanted, c: int) -> None:
        best, srcs = self._best_holders(obj, c, lambda info: self._tier(obj, c, info))
        if srcs:
            obj.sources[c], obj.tier[c] = srcs, best
        else:
            obj.sources.pop(c, None)
            obj.tier.pop(c, None)

    def _refresh(self, obj: _Wanted, c: int) -> None:
        if obj.ready(c):
            self._unindex(obj, c)
        self._recompute_sources(obj, c)
        if obj.ready(c):
            self._index(obj, c)

    def _index(self, obj: _Wanted, c: int) -> None:
        obj.buckets.setdefault(len(obj.holders[c]), set()).add(obj.rank[c])
        for p in obj.sources[c]:
            obj.ready_of.setdefault(p, set()).add(c)
        obj.n_ready += 1

    def _unindex(self, obj: _Wanted, c: int) -> None:
        _discard(obj.buckets, obj.dead_buckets, len(obj.holders[c]), obj.rank[c])
        for p in obj.sources[c]:
            _discard(obj.ready_of, obj.dead_ready, p, c)
        obj.n_ready -= 1

    def _send(self, obj: _Wanted, c: int, p: str, out: list[Request]) -> None:
        if obj.ready(c):
            self._unindex(obj, c)
        obj.inflight.setdefault(c, set()).add(p)
        self._peers[p].inflight.add((obj.key, c))
        self._n_inflight += 1
        out.append(Request(p, obj.key, c))

    def _release(self, obj: _Wanted, c: int, p: str) -> None:
        asked = obj.inflight[c]
        asked.discard(p)
        self._peers[p].inflight.discard((obj.key, c))
        self._n_inflight -= 1
        if not asked:
            del obj.inflight[c]
            if c in obj.sources:
                self._index(obj, c)


def _discard(sets: dict, dead: dict, k, v) -> None:
    """Remove v from sets[k] (dropping the set once empty). A Python set never
    shrinks and iterating it walks its emptied slots too: the buckets lose
    their first ranks first, so without a rebuild the walk to the first live
    rank would grow to the whole table. Rebuilding once removals exceed
    COMPACT_SLACK + 1/8 of what is left keeps that walk short, at an amortized
    few copies per removal."""
    live = sets.get(k)
    if live is None:
        return
    live.discard(v)
    if not live:
        del sets[k]
        dead.pop(k, None)
        return
    removed = dead.get(k, 0) + 1
    if removed > COMPACT_SLACK + (len(live) >> 3):
        sets[k] = set(live)
        removed = 0
    dead[k] = removed
