"""What a node knows about the chunks it fetches, and the indexes over it, with no policy.

The piece state half of the piece picker (libtorrent splits it the same way:
piece state apart from the request policy of protocol/picker.py). Owns:

- `ObjectState`: one object being fetched. Its missing chunks; for each, who
  announced it (`holders`: a Have or HaveOne says held whole, an Incoming
  says arriving, served as it arrives) and who withdrew it since (a Reject);
  the requests in flight, to whom; the peers that failed it (not asked for
  it again until their word on it changes: a refusal followed by a new
  announcement, or arriving followed by whole). Beside those facts, the indexes the request policy walks, kept
  up to date as facts come in: each chunk's sources (its holders at the best
  tier the policy gave) and the ready chunks (a source, nothing in flight) in
  rarity buckets and per peer.
- `PeerState`: one connected peer: its kind, its region, its requests in
  flight with the time each was sent (the picker's `now`), when a part last
  came from it and when it last went from no requests of mine to some (its
  silence, which the picker judges: `snub_after`), and how far each answer
  has come since it began serving it (its rate: the picker's slow rule).
- `PendingFacts`: what peers announced of objects not being fetched (yet),
  so that an object added later starts from them; bounded.

This is the one record of who holds which chunk and of the requests in flight
on a node: the daemon keeps no copy, and asks the picker. Must not rank
sources or pick chunks or peers (protocol/picker.py gives tiers as numbers),
do I/O, or read a clock.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Iterable

import numpy as np

from .responsibility import ObjKey, ResponsibilityMap

NOT_A_SOURCE = 1 << 30  # source tier: this holder may not be asked now
COMPACT_SLACK = 64  # removals a chunk set absorbs before it is rebuilt (see discard_compacting)
MAX_PENDING_OBJECTS = 64  # objects whose announcements are kept before they are fetched
MAX_UNKNOWN_INDICES = 1024  # single chunks (HaveOne, Incoming) kept per peer of an object with no chunk count yet


class PeerState:
    __slots__ = ("kind", "region", "inflight", "id", "last_part", "busy_since", "progress", "serving_from",
                 "refused_quiet")

    def __init__(self, kind: str, region: str, id: str = ""):
        self.kind = kind
        self.region = region
        self.id = id  # the peer's member id (its tier may depend on it: a slow neighbour, a snubbed peer)
        self.inflight: dict[tuple[ObjKey, int], float] = {}  # (key, chunk) -> when it was asked
        self.last_part = -math.inf  # when a part of an answer last came from it
        self.busy_since = -math.inf  # when its requests in flight last went from none to some
        # Per request in flight that a part of the answer came for: (bytes this peer sent of it,
        # bytes of the chunk still to come, when the last part came); only those the caller
        # told of (`peer_sent`).
        self.progress: dict[tuple[ObjKey, int], tuple[int, int, float]] = {}
        # Since when it has served the chunk it serves now: the later of its last whole chunk to
        # me and `busy_since` (its rate is judged over it: the picker's `slow_after`).
        self.serving_from = -math.inf
        # A refusal that left it nothing in flight: (when, the silence it had held until then, the
        # time it had served since `serving_from`), carried into its next request if that is
        # asked soon after (None: none).
        self.refused_quiet: tuple[float, float, float] | None = None

    def quiet_from(self) -> float:
        """Since when the peer has been silent on my requests: the later of its last part and
        the moment it was last asked with nothing in flight (a peer freshly asked is not
        judged on its silence while it had nothing to send me)."""
        return max(self.last_part, self.busy_since)

    def drop(self, request: tuple[ObjKey, int]) -> None:
        """A request in flight to it ended (answered, cancelled, failed or refused)."""
        del self.inflight[request]
        self.progress.pop(request, None)


TierOf = Callable[[int, PeerState], int]  # (chunk, holder) -> its source tier; lower is better


class ObjectState:
    """The fetch state of one object. A missing chunk is in exactly one state:
    in flight (`inflight`), ready (has `sources`, not in flight: indexed in
    `buckets` and `ready_of`), or waiting (neither).

    `holders[c]` is everyone who announced c on this connection, whole or
    arriving, withdrawn or not (its size is the chunk's rarity);
    `arriving_only[c]` those whose only word was Incoming, `withdrawn[c]`
    those that refused it since (both small, usually empty)."""

    __slots__ = ("key", "n_chunks", "priority", "added_at", "rank", "chunk_of", "missing",
                 "holders", "arriving_only", "withdrawn", "sources", "tier", "inflight", "failed",
                 "buckets", "ready_of", "dead_buckets", "dead_ready", "n_ready", "duty", "mine", "upstream",
                 "coordinated", "progress", "progress_seen", "progress_at", "taken")

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
        chunk_of = np.empty(n_chunks, dtype=np.int64)  # rank -> chunk (a scatter, not a loop: 500,000 at a keyframe)
        chunk_of[ranks] = np.arange(n_chunks)
        self.chunk_of = chunk_of.tolist()
        self.missing = set(range(n_chunks)) - have
        self.holders: dict[int, set[str]] = {c: set() for c in self.missing}
        self.arriving_only: dict[int, set[str]] = {}  # only non-empty
        self.withdrawn: dict[int, set[str]] = {}  # only non-empty
        self.sources: dict[int, set[str]] = {}  # allowed holders now; only non-empty
        self.tier: dict[int, int] = {}  # the tier those sources share
        self.inflight: dict[int, set[str]] = {}
        self.failed: dict[int, set[str]] = {}
        # Ready chunks by rarity, stored as ranks: a set of ints iterates in a
        # fixed order of its values, and the ranks are this node's shuffle, so
        # the walk visits equally rare chunks in a per-node random order.
        self.buckets: dict[int, set[int]] = {}
        self.ready_of: dict[str, set[int]] = {}  # peer -> ready chunks it is a source of
        # removals from each of those sets since it was last compacted (discard_compacting)
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

    # --- what peers said -----------------------------------------------------

    def announced(self, peer: str, c: int) -> bool:
        """`peer` said it holds missing chunk c or is receiving it, and has not refused it since."""
        hs = self.holders.get(c)
        return hs is not None and peer in hs and peer not in self.withdrawn.get(c, ())

    def holds_whole(self, peer: str, c: int) -> bool:
        """`peer` said it holds missing chunk c whole (Have, HaveOne), and has not refused it since."""
        return self.announced(peer, c) and peer not in self.arriving_only.get(c, ())

    def reannounce(self, peer: str, c: int, whole: bool) -> bool:
        """A holder of c announces it again: a refusal is over; whole replaces
        arriving. True if its word changed (it was withdrawn, or arriving and is
        whole now): news that a failed request's answer may be different now."""
        gone = self.withdrawn.get(c)
        if gone is not None and peer in gone:
            _drop(self.withdrawn, c, peer)
            if not whole:
                self.arriving_only.setdefault(c, set()).add(peer)
            return True
        if whole and peer in self.arriving_only.get(c, ()):
            _drop(self.arriving_only, c, peer)
            return True
        return False

    def add_holders(self, peer: str, chunks: Iterable[int], whole: bool, fixed: int | None,
                    tier_at: Callable[[int], int], in_region: bool) -> None:
        """`peer` announced `chunks` (whole, or arriving). Its source tier is
        `fixed` for every chunk, or (None) `tier_at(c)` for the chunks me is
        responsible for and not a source for the others; `in_region`: the
        peer is a node of my region, so what it holds is the region's progress.

        The hot path (one call per Have / HaveOne): locals, and the tier
        hoisted out of the loop wherever it does not depend on the chunk."""
        holders, sources, tiers, inflight = self.holders, self.sources, self.tier, self.inflight
        failed, buckets, rank, mine = self.failed, self.buckets, self.rank, self.mine
        for c in chunks:
            hs = holders.get(c)
            if hs is None:
                continue
            if peer in hs:
                if not ((self.withdrawn or self.arriving_only) and self.reannounce(peer, c, whole)):
                    continue
                # Its word changed since a request to it failed (its relay broke, then it
                # got the chunk anew): the failure is over and it is a source again at
                # once, not after a takeover delay or a new connection.
                if failed:
                    _drop(failed, c, peer)
                ready = c in sources and c not in inflight
            else:
                if not whole:
                    self.arriving_only.setdefault(c, set()).add(peer)
                ready = c in sources and c not in inflight
                if ready:  # rarity goes up by one: move its bucket
                    discard_compacting(buckets, self.dead_buckets, len(hs), rank[c])
                    buckets.setdefault(len(hs) + 1, set()).add(rank[c])
                hs.add(peer)
                if in_region:
                    self.progress += 1
                if failed and peer in failed.get(c, ()):
                    continue
            if fixed is not None:
                t = fixed
            elif mine[c]:
                t = tier_at(c)
            else:
                continue
            current = tiers.get(c, NOT_A_SOURCE)
            if t < current:  # a better tier replaces the sources
                if ready:
                    self.unindex(c)
                sources[c], tiers[c] = {peer}, t
                if c not in inflight:
                    self.index(c)
            elif t == current and t != NOT_A_SOURCE:
                sources[c].add(peer)
                if ready:
                    self.ready_of.setdefault(peer, set()).add(c)

    def withdraw(self, peer: str, c: int) -> None:
        """`peer` refused chunk c: it no longer says it has it (it stays counted in the rarity)."""
        if peer in self.holders.get(c, ()):
            self.withdrawn.setdefault(c, set()).add(peer)
            _drop(self.arriving_only, c, peer)

    def facts(self) -> dict[str, tuple[set[int], set[int]]]:
        """What is still announced of the missing chunks: peer -> (whole, arriving)."""
        out: dict[str, tuple[set[int], set[int]]] = {}
        for c, hs in self.holders.items():
            for p in hs:
                if self.announced(p, c):
                    out.setdefault(p, (set(), set()))[0 if p not in self.arriving_only.get(c, ()) else 1].add(c)
        return out

    # --- the indexes -----------------------------------------------------------

    def index(self, c: int) -> None:
        self.buckets.setdefault(len(self.holders[c]), set()).add(self.rank[c])
        for p in self.sources[c]:
            self.ready_of.setdefault(p, set()).add(c)
        self.n_ready += 1

    def unindex(self, c: int) -> None:
        discard_compacting(self.buckets, self.dead_buckets, len(self.holders[c]), self.rank[c])
        for p in self.sources[c]:
            discard_compacting(self.ready_of, self.dead_ready, p, c)
        self.n_ready -= 1

    def best_holders(self, c: int, tier_of: TierOf, peers: dict[str, PeerState]) -> tuple[int, set[str]]:
        """The best tier among the holders of c not failed for it, and who has it."""
        best, srcs = NOT_A_SOURCE, set()
        bad = self.failed.get(c, ())
        for p in self.holders[c]:
            if p in bad:
                continue
            t = tier_of(c, peers[p])
            if t < best:
                best, srcs = t, {p}
            elif t == best and t != NOT_A_SOURCE:
                srcs.add(p)
        return best, srcs

    def recompute_sources(self, c: int, tier_of: TierOf, peers: dict[str, PeerState]) -> None:
        best, srcs = self.best_holders(c, tier_of, peers)
        if srcs:
            self.sources[c], self.tier[c] = srcs, best
        else:
            self.sources.pop(c, None)
            self.tier.pop(c, None)

    def refresh(self, c: int, tier_of: TierOf, peers: dict[str, PeerState]) -> None:
        """Recompute c's sources (its tiers may have moved) and re-index it."""
        if self.ready(c):
            self.unindex(c)
        self.recompute_sources(c, tier_of, peers)
        if self.ready(c):
            self.index(c)

    def retier_holder(self, peer: str, tier_of: TierOf, peers: dict[str, PeerState]) -> None:
        """`peer`'s tier changed for every chunk it holds (snubbed, or no longer): the sources
        of those chunks follow. O(1) per chunk it holds, but where it was a chunk's only source
        (then that chunk's holders are ranked again)."""
        info = peers[peer]
        sources, tiers, failed = self.sources, self.tier, self.failed
        for c, hs in self.holders.items():
            if peer not in hs or (failed and peer in failed.get(c, ())):
                continue
            t = tier_of(c, info)
            current = tiers.get(c, NOT_A_SOURCE)
            srcs = sources.get(c)
            if srcs is not None and peer in srcs:
                if t == current:
                    continue
                if len(srcs) == 1 or t < current:
                    self.refresh(c, tier_of, peers)
                    continue
                if self.ready(c):
                    discard_compacting(self.ready_of, self.dead_ready, peer, c)
                srcs.discard(peer)  # worse now than the others at the chunk's tier
            elif t < current:
                ready = self.ready(c)
                if ready:
                    self.unindex(c)
                sources[c], tiers[c] = {peer}, t
                if c not in self.inflight:
                    self.index(c)
            elif t == current and t != NOT_A_SOURCE:
                srcs.add(peer)
                if self.ready(c):
                    self.ready_of.setdefault(peer, set()).add(c)

    def forget_holder(self, peer: str, tier_of: TierOf, peers: dict[str, PeerState]) -> None:
        """`peer` is gone (its requests already released): it holds nothing any more."""
        self.ready_of.pop(peer, None)
        self.dead_ready.pop(peer, None)
        for table in (self.arriving_only, self.withdrawn):
            for c in [c for c, ps in table.items() if peer in ps]:
                _drop(table, c, peer)
        for c in [c for c, hs in self.holders.items() if peer in hs]:
            if self.ready(c):
                self.unindex(c)
            self.holders[c].discard(peer)
            srcs = self.sources.get(c)
            if srcs is not None and peer in srcs:
                srcs.discard(peer)
                if not srcs:
                    self.recompute_sources(c, tier_of, peers)
            if self.ready(c):
                self.index(c)

    def received(self, c: int) -> None:
        """Chunk c is held now: drop everything kept about it (unindexed, its requests
        already released)."""
        self.missing.discard(c)
        if c in self.taken:
            self.taken.discard(c)
        else:
            self.progress += 1
        del self.holders[c]
        for table in (self.sources, self.tier, self.failed, self.upstream, self.arriving_only, self.withdrawn):
            table.pop(c, None)


class _ByPeer:
    """key -> peer -> one peer's facts about one object, at most `max_keys` objects per
    peer: a peer's new object pushes out that peer's oldest, never another peer's."""

    __slots__ = ("max_keys", "by_key", "_keys_of")

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self.by_key: dict[ObjKey, dict[str, object]] = {}
        self._keys_of: dict[str, dict[ObjKey, None]] = {}  # peer -> its objects, oldest first

    def get(self, key: ObjKey, peer: str):
        return self.by_key.get(key, {}).get(peer)

    def entry(self, key: ObjKey, peer: str, make: Callable[[], object]):
        """The peer's facts about `key`, made (`make()`) if it has none yet."""
        facts = self.get(key, peer)
        if facts is None:
            mine = self._keys_of.setdefault(peer, {})
            if len(mine) >= self.max_keys:
                self._remove(next(iter(mine)), peer)
                mine = self._keys_of.setdefault(peer, {})
            mine[key] = None
            facts = self.by_key.setdefault(key, {})[peer] = make()
        return facts

    def pop(self, key: ObjKey) -> dict:
        """Every peer's facts about `key`, forgotten here."""
        per_peer = self.by_key.pop(key, {})
        for peer in per_peer:
            self._unlist(key, peer)
        return per_peer

    def peer_left(self, peer: str) -> None:
        for key in self._keys_of.pop(peer, {}):
            per_peer = self.by_key[key]
            del per_peer[peer]
            if not per_peer:
                del self.by_key[key]

    def forget_below(self, floor: int) -> None:
        for key in [k for k in self.by_key if k[0] < floor]:
            self.pop(key)

    def _remove(self, key: ObjKey, peer: str) -> None:
        per_peer = self.by_key[key]
        del per_peer[peer]
        if not per_peer:
            del self.by_key[key]
        self._unlist(key, peer)

    def _unlist(self, key: ObjKey, peer: str) -> None:
        mine = self._keys_of[peer]
        del mine[key]
        if not mine:
            del self._keys_of[peer]


class PendingFacts:
    """Announcements about objects not being fetched: key -> peer -> (whole, arriving) chunks.

    An object is added when its manifest is known and the plan reaches it;
    peers announce it as soon as they have it, often before. At most
    `max_objects` objects are kept per peer (that peer's oldest one first goes):
    a peer cannot grow this without bound, nor push out what others announced
    (a member announcing many objects pushed out, before a fresh node knew any
    manifest, the origin's Have of the version to bootstrap from, which the origin
    does not send again). Indices are not checked here (the number of chunks is
    not known yet): `take` hands them over as they came.

    Objects whose manifest (so chunk count) is not known yet (`add_unknown`: a
    peer may announce a version before its manifest reaches this node, the
    origin always does) are kept apart and never expanded on their own word: a
    Have's bitfield as bytes, OR-ed (at most what the wire lets a bitfield be),
    single chunks up to MAX_UNKNOWN_INDICES per peer; `take(key, n_chunks)`
    expands the bitfield's first n_chunks bits once the count is known."""

    def __init__(self, max_objects: int = MAX_PENDING_OBJECTS):
        self.max_objects = max_objects
        self._facts = _ByPeer(max_objects)  # peer's facts: (chunks held, chunks arriving)
        # of objects with no chunk count yet: (Have bitfield, chunks held, chunks arriving)
        self._unknown = _ByPeer(max_objects)
        self._floor: int | None = None  # versions below it are never fetched: their facts are dropped

    def add(self, peer: str, key: ObjKey, chunks: Iterable[int], whole: bool) -> None:
        if self._floor is not None and key[0] < self._floor:
            return
        held, arriving = self._facts.entry(key, peer, lambda: (set(), set()))
        (held if whole else arriving).update(chunks)

    def add_unknown(self, peer: str, key: ObjKey, bitfield: bytes | None, chunks: Iterable[int], whole: bool) -> None:
        if self._floor is not None and key[0] < self._floor:
            return
        bits, held, arriving = self._unknown.entry(key, peer, lambda: (bytearray(), set(), set()))
        if bitfield:
            if len(bits) < len(bitfield):
                bits.extend(bytes(len(bitfield) - len(bits)))
            view = np.frombuffer(bits, dtype=np.uint8)
            view[:len(bitfield)] |= np.frombuffer(bitfield, dtype=np.uint8)
        into = held if whole else arriving
        for c in chunks:
            if len(into) >= MAX_UNKNOWN_INDICES:
                break
            into.add(c)

    def put(self, key: ObjKey, facts: dict[str, tuple[set[int], set[int]]]) -> None:
        """Keep what was known of an object that stopped being fetched (it may come back)."""
        for peer, (held, arriving) in facts.items():
            self.add(peer, key, held, True)
            self.add(peer, key, arriving, False)

    def withdraw(self, peer: str, key: ObjKey, c: int) -> None:
        entry = self._facts.get(key, peer)
        if entry is not None:
            entry[0].discard(c)
            entry[1].discard(c)

    def announced(self, peer: str, key: ObjKey, c: int) -> bool:
        entry = self._facts.get(key, peer)
        return entry is not None and (c in entry[0] or c in entry[1])

    def holds_whole(self, peer: str, key: ObjKey, c: int) -> bool:
        entry = self._facts.get(key, peer)
        return entry is not None and c in entry[0]

    def peer_left(self, peer: str) -> None:
        self._facts.peer_left(peer)
        self._unknown.peer_left(peer)

    def take(self, key: ObjKey, n_chunks: int) -> dict[str, tuple[set[int], set[int]]]:
        """What is known of `key`, now fetched with `n_chunks` chunks (indices may still be out of range)."""
        facts = self._facts.pop(key)
        for peer, (bits, held, arriving) in self._unknown.pop(key).items():
            ones = np.flatnonzero(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=min(n_chunks, 8 * len(bits)),
                                                bitorder="little")).tolist() if bits else []
            known_held, known_arriving = facts.setdefault(peer, (set(), set()))
            known_held.update(held, ones)
            known_arriving.update(arriving)
        return facts

    def forget_below(self, version: int) -> None:
        """Objects below `version` will never be fetched: drop and ignore what is said of them."""
        self._floor = version if self._floor is None else max(self._floor, version)
        self._facts.forget_below(self._floor)
        self._unknown.forget_below(self._floor)


def _drop(sets: dict, k, v) -> None:
    """Remove v from the small set sets[k], dropping the set once empty."""
    live = sets.get(k)
    if live is not None:
        live.discard(v)
        if not live:
            del sets[k]


def discard_compacting(sets: dict, dead: dict, k, v) -> None:
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
