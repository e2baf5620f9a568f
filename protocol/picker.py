"""The swarm fetch policy: which chunk to request next, and from which peer.

Owns `PiecePicker`, a plain object in the style of libtorrent's piece picker:
the node daemon reports facts (members, peers joining and leaving, who has
which chunk or is receiving it, a part of an answer arrived, a chunk
verified, failed or refused) and asks questions (`requests(now)`: what to
send now; `expired(now)`: which requests ran out of time, or were held by a
peer gone silent; `next_wakeup(now)`: when to ask again without a new fact;
`announced` / `holds_whole`: what a peer said of a chunk). The facts and the
indexes over them live in protocol/piecestate.py (piece state), the rules for
which holder may be asked in protocol/sources.py (source tiers); this module
is the request policy (which chunk next, from whom, when).
Together they are the node's one record of who holds what and of its requests
in flight. It must not do I/O, read a clock (time is an argument), see chunk
bytes (the daemon verifies them) or use randomness other than the
`random.Random(seed)` it was built with.

Where chunk c of object key may come from, for this node `me` in region R:

Patch objects (the WAN plan of protocol/responsibility.py; `wan_rates`, the
WAN link rate of each region, the same on every member (the tracker's,
`set_wan_rates`), orders each chunk's chain of regions from the fastest link
to the slowest):
  1. a connected node peer in R that has c (never across the WAN when a
     neighbour has it); one with a slow uplink (declared, `set_members`'
     uplinks: under `responsibility.SLOW_UPLINK` of R's) only where no
     other neighbour has c;
  2. else, if me owns c in R's `balanced_owners` (rendezvous hashing over
     R's gateways, each taking an even share of the chunks R pulls from
     each source, or one in proportion to its declared uplink): a node peer of the
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
     Members leaving re-plan at once (`set_members`, or a same-region
     member's session closing: `peer_left`), with no delay; so do new WAN
     rates (`set_wan_rates`: the tracker's, which every member is told).
Keyframe objects (late joiners, rare): no responsibility; node peers of R,
else node peers of other regions, else the origin. A keyframe every member
fetches (the swarm's first version while it is the newest; node/fetcher.py
decides) is added with `coordinated=True` and follows the patch rules.

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

In the origin's region, with `origin_pipeline` (the daemon's): at most that many
requests per member in flight to the origin, each member asks for its share in
the order of its plan weights, and a member with nothing in flight to the
origin and none of its own share left takes over one chunk at a time of the
tail of another's share: the chunks its owner cannot have asked for yet
(`pick_share`; never a member with a slow uplink, which would then relay it).
The shares are static (`balanced_owners`), the members' flows from the origin
are not equally fast, and without it the origin's last 0.2-0.5 s
served only the slowest member's rest, through that member's downlink, and
that member's uplink then relayed it to all others (issue 26). Once every chunk a member
lacks is at a member of the region, whole or arriving (the origin has nothing left to start
for the region and sends only its last chunks), the member of highest plan weight among those
that lack a chunk another member is fanning out moves the rest of it to the origin
(`pick_rest`): the request to the fanning member is withdrawn (`withdrawn`) and the origin
asked from the byte held. With `endgame_after` (the
daemon's), a second copy is asked for only of a request that has been in
flight that long: where the LAN is the limit, an immediate copy took the links
the last chunks needed (1.2-2.1 MB more into each member of the origin's
region at 100 Mbit/s, measured).

A request unanswered after `request_timeout` seconds (None: never) is
returned once by `expired(now)`, and the chunk is asked of another holder
(the request's answer is the picker's to wait for, so its deadline is too).
A peer that failed a chunk (refused it, sent it bad, or late) is not asked
for it again until its word on the chunk changes: it announces the chunk
again after a refusal, or whole after arriving. Then it is a source again
at once: a relay that broke (its own source died) never keeps a neighbour
from being asked once it holds the chunk.

A same-region node whose session closes is out of the region's plan at
once (its chunks go to the other gateways), though the tracker lists it
until its heartbeat times out; it is back in when it connects again.

Snubbed peers (libtorrent's remedy; `snub_after`, None: never): a node peer
that holds requests of mine and has sent no part of an answer for
`snub_after` seconds, counted from the later of its last part (`peer_sent`,
which the fetcher reports for every part of a request in flight) and the
moment it was last asked while it had nothing of mine in flight (a peer
freshly asked is not judged on its silence before), is snubbed: `expired(now)`
returns all its requests at once, each failed as a late one, and they are
asked elsewhere in the same round. Until a part comes from it, it ranks after
the origin for every chunk (protocol/sources.py `SNUBBED`), so nothing waits
on it where another holder may be asked; a member of my region is out of
the region's plan (its share re-planned over the others, as when its session
closes) and what it announces is no progress of the region's; it is asked
one request at a time, its probe: a chunk no better holder has, or an
endgame copy. A chunk asked only of snubbed peers is asked at once, beside
the probe, of a better source that appears (`pick_beside_probes`); the first
copy in cancels the other. An unanswered probe goes after `snub_after` too.
The snub lasts across the peer's new sessions (a new session is no part)
while it is a member or connected. The origin is never snubbed: it holds
every chunk and is the last source; its requests go by `request_timeout`.
Without snubs, a member that announced every chunk and served none held
`pipeline` requests of each neighbour at a time, each for `request_timeout`
(protocol/README.md, "The longest a node sits").

Slow peers (`slow_chunk_s`, None: never; the daemon's is twice its
`request_timeout`): a node peer that sends a small part of each answer every
few seconds is never silent. The caller tells with each part how far that
answer has come (`peer_sent`: bytes from this peer, bytes still to come). A
node peer that has served me for `snub_after` (from the later of its last
whole chunk to me and the moment it was asked with nothing in flight) is
snubbed as slow where, at the rate it has sent each answer in flight, measured
to that answer's last part, even the fastest would take `slow_chunk_s` or more
to complete: as a silent one (`expired` returns all its requests; ranked after
the origin; a probe at a time), but only a whole chunk from it ends that snub
(`snub_reason`: SILENT or SLOW). With `slow_chunk_min_s` (the daemon's: twice
`snub_after`) that threshold follows this node's own answers: `SLOW_BESIDE_TYPICAL`
times the later of the median time of its last `ANSWER_SAMPLES` whole chunks from
peers on the judged peer's side of the WAN (from when each peer began serving it)
and the median of what the other peers there serve it now would take at their
rates, never under `slow_chunk_min_s` (before any answer came, that) nor over
`slow_chunk_s` (`slow_threshold`). So a member far slower than the node's other
sources is demoted at `snub_after`, and one no slower than they are is waited
for. A request served in order behind another has no part yet and does not
count. A Reject is no part: given its time
(`chunk_refused(..., now)`), the silence the peer held and the time it had
served go on into its next request if it is asked again within `snub_after`,
so one that refuses each request before its snub and announces the chunk
again is snubbed as if it had held it.

Requests past their timeout at their rate (`request_timeout` and
`snub_after` set; `PAST_ITS_TIMEOUT`): a request to a node peer whose answer,
at the rate it has come since the peer began serving it (the later of when
it was asked and the peer's last whole chunk to me, to its last part), would
come whole only after the request's timeout is given up by `expired`
`snub_after` after that answer began, not at the timeout, which gives it up
anyway. Its peer is not snubbed: a busy honest member's 1 MiB chunk may take
it 34-42 s (see SNUB_AFTER), and it is asked for what it serves in time.

The node's own downlink (`max_inflight`, set from a download limit): at most
that many requests in flight to peers not snubbed, all together; a snubbed
peer's probe is neither counted nor held back.

Cost: facts update per-chunk indexes incrementally (holder sets, rarity
buckets of the requestable chunks, the requestable chunks of each peer), so
`requests()` looks only at peers with free slots and at the chunks they can
serve, never at all chunks × all peers.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from .errors import ProtocolError, UsageError
from .parallel import gc_paused
from .piecestate import ObjectState, PeerState, PendingFacts
from .responsibility import ObjKey, check_rates, check_wan_rates
from .sources import NODE, ORIGIN, ORIGIN_TIER, SourceTiers

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
# In the origin's region, requests in flight per member to the origin (the daemon's
# `origin_pipeline`): one arriving and one queued behind it, so the origin's link to
# the member never idles, and what a member has asked for and not started is one
# chunk, which another member taking over part of its share (`pick_share`) leaves alone.
ORIGIN_PIPELINE = 2
# The daemon's `endgame_after`: a second copy of a chunk is asked for only once its
# request has been in flight this long (seconds; 0: at once).
ENDGAME_AFTER = 0.5
# The daemon's `snub_after` (seconds): a node peer that holds requests of mine and sent me no
# part for this long is snubbed. Short against `request_timeout` (30 s), which alone let a member
# that announces every chunk and serves none hold a node for minutes (protocol/README.md); long
# against an honest peer's silences. A session serves its queue in order, each part (64 KiB, larger
# only where a fast uplink is declared: `part_bytes_for`, ~2.5 ms of it) through the member's shared
# upload limit in turn with its other sessions (node/peers.py), so a busy honest member sends
# each session a part every (sessions served at once x part time): 40 sessions (16 neighbours
# dialed, as many dialing in, 3 per other region) at 10 Mbit/s (52 ms a part) is 2.1 s, at an
# --upload-limit of 1 MB/s 2.6 s; 5 s is reached only below ~4 Mbit/s with 40 busy sessions,
# where a chunk of 1 MiB takes 2 s on its own. A relay serving a chunk still arriving is silent
# while its source is: an honest source's silence is the same, a silent one is snubbed by the
# relay after this long, so its followers may snub the relay too (a probe takes it back).
SNUB_AFTER = 5.0
# The daemon's `slow_chunk_s` (seconds): a node peer that has served the chunk it serves me now for
# `snub_after` or more, at a rate that makes that chunk's whole time (from when it began serving it)
# this long or longer, is snubbed as slow (see the module doc); the most the threshold may be where
# `slow_chunk_min_s` lowers it (below). Twice the daemon's `request_timeout` (node/fetcher.py, 30 s),
# which gives up such a request anyway: the threshold of a node whose own answers typically take
# 15 s or more (a region of members that slow). The busy honest member above (a 64 KiB part every
# 2.1-2.6 s) serves a 1 MiB chunk in 34-42 s, under it; a member whose parts are 3.7 s apart or more
# (a 1 MiB chunk at 17.5 KB/s, at most ~5.7 Mbit/s shared by 40 busy sessions) is demoted. A chunk
# that takes 60 s from a neighbour comes sooner from the origin: at 100 Mbit/s it sends a member's
# whole share (1/4 of a 60 MB patch among 4 members) in 1.2 s.
SLOW_CHUNK_S = 60.0
# The daemon's `slow_chunk_min_s` (seconds): where this node's own chunks come fast, a member that
# serves far slower than they do is slow sooner than `slow_chunk_s`: from `SLOW_BESIDE_TYPICAL`
# times the node's typical answer time (the later of the median of its last `ANSWER_SAMPLES` whole
# chunks from peers on that member's side of the WAN, each from when its peer began serving it to
# verified, and the median of what the other peers there serve it now would take at their
# rates), never under this nor over `slow_chunk_s`. Where every answer is slow now (the node's own
# downlink the limit, or its --download-limit), no peer is slow beside the others. Twice
# SNUB_AFTER: a chunk judged at `snub_after` that would take more than as long again. Found by
# the swarm simulation: a busy member of the origin's region that sends a 64 KiB part of each
# answer every 2.1-3.5 s serves a 512 KiB chunk in 17-28 s, under `slow_chunk_s`; holding every
# chunk, it drew a node's requests from an origin that serves the same chunk in a fraction of a
# second, and held that node 50-84 s for 16 chunks; now 5 s (bench/RESULTS.md). Judged against
# the node's own answers, a region whose members all serve that slowly (its typical answer
# 17-28 s) demotes none of them: the threshold rises to `slow_chunk_s`.
# An honest answer over 10 s is a 1 MiB chunk at under 0.84 Mbit/s: a member serving 40 sessions
# at once from a 34 Mbit/s uplink, or 4 chunks sharing a 3.4 Mbit/s WAN link.
SLOW_CHUNK_MIN_S = 2 * SNUB_AFTER
SLOW_BESIDE_TYPICAL = 4.0
ANSWER_SAMPLES = 16
# `pick_share` takes over only while a chunk from the origin takes at least this long (s, from
# request to verified): long against how late members hear of each other's progress (a few
# ms on a LAN), so the owner rarely asks the origin for a chunk already taken. At 1 Gbit/s a
# chunk takes ~10 ms and taking over made the origin send 1.04-1.14 x the patch (bench/RESULTS.md).
TAKEOVER_MIN_CHUNK_S = 0.05
# `pick_rest` moves the rest of a chunk to the origin only while a chunk from the origin takes at
# least this long (s, request to verified): what a move saves grows with a chunk's time on the LAN,
# what it costs (a round trip, the origin's bytes and CPU) does not. In the WAN bench's logs a chunk
# from the origin took 0.19-0.86 s at a 100 Mbit/s LAN (the patch's small last chunk less) and
# 0.01-0.11 s at 1 Gbit/s, where a chunk's fan-out is short and this 2-core machine's CPU the limit.
REST_MIN_CHUNK_S = 0.15

__all__ = ["ANSWER_SAMPLES", "MAX_COPIES", "NODE", "ORIGIN", "ORIGIN_PIPELINE", "ENDGAME_AFTER",
           "PAST_ITS_TIMEOUT", "PEER_KINDS", "SLOW", "SILENT", "SLOW_BESIDE_TYPICAL", "SLOW_CHUNK_MIN_S",
           "SLOW_CHUNK_S", "SNUB_AFTER", "WAN_GATEWAYS", "WAN_PIPELINE", "PiecePicker", "Request"]


@dataclass(frozen=True, order=True)
class Request:
    """Ask `peer` for chunk `chunk` of object `key`; returned by
    `remove_object`, `chunk_received` and `expired`, the same value means: cancel it."""

    peer: str
    key: ObjKey
    chunk: int
    # Which rule asked, for the fetcher's debug log: not part of the request's identity.
    why: str = field(default="", compare=False)


# `Request.why`: the rule that made a request.
PLANNED = "planned"        # from a holder the plan allows (same region, or my gateway's upstream)
SHARE = "taken over"       # another member's share, from the origin (`pick_share`)
REST = "rest"              # the rest of a fanned-out chunk, from the origin (`pick_rest`)
ENDGAME = "second copy"    # an endgame copy of a request in flight (`pick_endgame`)
STALLED = "no progress"    # from any holder after `takeover_after` without progress (`pick_takeover`)
BESIDE_PROBE = "beside a probe"  # a chunk asked only of snubbed peers, from a better source (`pick_beside_probes`)

# Why `expired` gave a request up before its timeout, its peer not snubbed (`Request.why`).
PAST_ITS_TIMEOUT = "past its timeout at its rate"  # its chunk would come whole only after `request_timeout`

# Why a peer is snubbed (`snub_reason`).
SILENT = "silent"  # it held requests and sent no part for `snub_after`
SLOW = "slow"      # the chunk it serves would take it `slow_threshold` or more at its rate


def _answer_takes(told: tuple[int, int, float], start: float) -> float:
    """How long an answer takes to come whole from `start`, at the rate it came from `start` to
    its last part: `told` is (bytes got, bytes left, when its last part came); inf: no byte yet."""
    got, left, at = told
    return (got + left) * (at - start) / got if got else math.inf


def _upper_median(values: Iterable[float]) -> float:
    """The upper median of `values` (0.0 for none)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


class PiecePicker:
    """Which chunk to request next from which peer, for one node (see module doc).

    `origin_region` may be None until the tracker names it: facts are taken
    meanwhile, objects only once it is set (`set_origin_region`)."""

    def __init__(self, me: str, region: str, origin_region: str | None, *, seed: int = 0,
                 pipeline: int = 4, takeover_after: float = 2.0, wan_pipeline: int = WAN_PIPELINE,
                 wan_gateways: int | None = WAN_GATEWAYS, request_timeout: float | None = None,
                 wan_rates: Mapping[str, float] | None = None, origin_pipeline: int | None = None,
                 endgame_after: float = 0.0, snub_after: float | None = None,
                 slow_chunk_s: float | None = None, slow_chunk_min_s: float | None = None,
                 max_inflight: int | None = None):
        if type(pipeline) is not int or pipeline < 1:
            raise UsageError(f"pipeline: expected an int >= 1, found {pipeline!r}")
        if type(wan_pipeline) is not int or wan_pipeline < 1:
            raise UsageError(f"wan_pipeline: expected an int >= 1, found {wan_pipeline!r}")
        if wan_gateways is not None and (type(wan_gateways) is not int or wan_gateways < 1):
            raise UsageError(f"wan_gateways: expected None or an int >= 1, found {wan_gateways!r}")
        if origin_pipeline is not None and (type(origin_pipeline) is not int or origin_pipeline < 1):
            raise UsageError(f"origin_pipeline: expected None or an int >= 1, found {origin_pipeline!r}")
        if not endgame_after >= 0:
            raise UsageError(f"endgame_after: expected seconds >= 0, found {endgame_after!r}")
        if not takeover_after >= 0:
            raise UsageError(f"takeover_after: expected seconds >= 0, found {takeover_after!r}")
        if request_timeout is not None and not request_timeout > 0:
            raise UsageError(f"request_timeout: expected None or seconds > 0, found {request_timeout!r}")
        if snub_after is not None and not snub_after > 0:
            raise UsageError(f"snub_after: expected None or seconds > 0, found {snub_after!r}")
        if slow_chunk_s is not None and not slow_chunk_s > 0:
            raise UsageError(f"slow_chunk_s: expected None or seconds > 0, found {slow_chunk_s!r}")
        if slow_chunk_min_s is not None and not (slow_chunk_s is not None and 0 < slow_chunk_min_s <= slow_chunk_s):
            raise UsageError(f"slow_chunk_min_s: expected None or seconds in (0, slow_chunk_s={slow_chunk_s!r}], "
                             f"found {slow_chunk_min_s!r}")
        check_wan_rates(wan_rates)
        self.me = me
        self.region = region
        self.pipeline = pipeline
        self.wan_pipeline = wan_pipeline
        self.max_inflight = max_inflight  # a property: checked where set
        self.wan_gateways = wan_gateways
        self.origin_pipeline = origin_pipeline
        self.endgame_after = float(endgame_after)
        self.origin_chunk_s: float | None = None  # the last chunk from the origin, request to verified (not a rest)
        self.request_timeout = request_timeout
        self.snub_after = None if snub_after is None else float(snub_after)
        self.slow_chunk_s = None if slow_chunk_s is None else float(slow_chunk_s)
        self.slow_chunk_min_s = None if slow_chunk_min_s is None else float(slow_chunk_min_s)
        self._slow: set[str] = set()  # the snubbed peers snubbed as slow (the others: silent)
        # The last whole chunks' answer times (s), from peers of my region (False) and from across
        # the WAN (True): what `slow_threshold` judges by.
        self._answers: dict[bool, deque[float]] = {False: deque(maxlen=ANSWER_SAMPLES),
                                                   True: deque(maxlen=ANSWER_SAMPLES)}
        self.takeover_after = float(takeover_after)
        self._rng = random.Random(seed)
        self._tiers = SourceTiers(me, region, origin_region, wan_gateways, wan_rates)
        self._peers: dict[str, PeerState] = {}
        self._objects: dict[ObjKey, ObjectState] = {}
        self._order: list[ObjectState] = []  # by (priority, key)
        self._pending = PendingFacts()
        self._n_inflight = 0
        self._withdrawn: list[Request] = []  # requests replaced by one to the origin (`pick_rest`)
        self._rests: set[tuple[ObjKey, int]] = set()  # chunks whose rest was asked of the origin: not timed

    @property
    def origin_region(self) -> str | None:
        return self._tiers.origin_region

    # --- facts ---------------------------------------------------------------

    def set_origin_region(self, region: str) -> None:
        """The origin's region, once known (the first word stands: objects are planned on it)."""
        if self._tiers.origin_region is None:
            self._tiers.origin_region = region

    def set_members(self, members: dict[str, str], uplinks: Mapping[str, float] | None = None) -> None:
        """The live nodes of the swarm (node id -> region, origin excluded), as
        the tracker reports them, and their declared uplinks (node id -> Mbit/s,
        this node's included; an id left out declared none). Responsibility is
        recomputed at once: shares by uplink (`responsibility.uplink_caps`), and a
        neighbour with a slow uplink asked last (`sources.SLOW_NEIGHBOUR`)."""
        if members.get(self.me, self.region) != self.region:
            raise UsageError(f"members: expected {self.me!r} in region {self.region!r}, "
                             f"found {members[self.me]!r}")
        uplinks = check_rates(uplinks, "uplinks", "node id -> Mbit/s > 0")
        caps = self._tiers.caps
        self._tiers.snubbed &= members.keys() | self._peers.keys()  # kept for members and connected peers only
        self._slow &= self._tiers.snubbed
        self._replan(self._tiers.set_members(members, uplinks), caps)

    @property
    def slow_neighbours(self) -> list[str]:
        """The members of my region planned as slow (`responsibility.SLOW_UPLINK`)."""
        return sorted(m for m in self._tiers.region_members if self._tiers.slow(m))

    @property
    def wan_rates(self) -> dict[str, float] | None:
        """The WAN rates the chains are planned on (None: not known, every region equal)."""
        return self._tiers.wan_rates

    def set_wan_rates(self, wan_rates: Mapping[str, float] | None) -> bool:
        """The swarm's WAN rates changed (the tracker's arrived, or replaced the ones
        this node was started with): every patch object's chains and shares are
        planned again at once, as when a region comes or goes, and the missing
        chunks whose sources moved are asked of their new sources. Requests in
        flight stay (their answers still count). True if the rates changed."""
        rates = check_wan_rates(wan_rates)
        if rates == self._tiers.wan_rates:
            return False
        self._tiers.wan_rates = rates
        self._replan(True, self._tiers.caps)
        return True

    def _replan(self, regions_changed: bool, caps_before) -> None:
        """Re-plan every patch object after a change of members, regions or rates;
        `caps_before`: the region's uplink caps before it (where they moved, a
        neighbour's tier may have too, so every missing chunk's sources are redone)."""
        refresh_all = regions_changed or self._tiers.caps != caps_before
        for obj in self._objects.values():
            if obj.is_patch:
                tier_of = self._tiers.tier_of(obj)
                for c in self._tiers.replan(obj, regions_changed, refresh_all):
                    obj.refresh(c, tier_of, self._peers)
            elif self._tiers.caps != caps_before:
                tier_of = self._tiers.tier_of(obj)
                for c in sorted(obj.missing):
                    obj.refresh(c, tier_of, self._peers)

    def add_object(self, key: ObjKey, n_chunks: int, *, have: Iterable[int] = (),
                   priority: int = 0, now: float, coordinated: bool | None = None) -> None:
        """Start fetching `key` (n_chunks chunks, `have` already held). Lower
        `priority` is fetched first. `now` starts the takeover clock.
        `coordinated` (default: patches yes, keyframes no) says every member
        fetches this object, so it follows the WAN plan; a keyframe that all
        members bootstrap from (the first version) is one. What connected
        peers announced of it before counts from here on."""
        if (not isinstance(key, tuple) or len(key) != 2 or type(key[0]) is not int
                or type(key[1]) is not bool):
            raise UsageError(f"add_object: expected a key (version: int, keyframe: bool), "
                             f"found {key!r}")
        if key in self._objects:
            raise UsageError(f"add_object: {key} is already being fetched")
        if self.origin_region is None:
            raise UsageError(f"add_object: {key} before the origin's region is known")
        if type(n_chunks) is not int or n_chunks < 0:
            raise UsageError(f"add_object: expected n_chunks >= 0, found {n_chunks!r}")
        held = set(have)
        bad = [c for c in held if not (type(c) is int and 0 <= c < n_chunks)]
        if bad:
            raise UsageError(f"add_object: expected have in [0, {n_chunks}), found {bad[:5]}")
        # A keyframe of a 500 GB checkpoint is 500,000 chunks, each with a set of holders: the
        # collector made passes over that growing heap (0.76-1.38 s here with them, 0.42-0.52 s
        # without and the inverse below in numpy: bench/picker.py, bench/RESULTS.md).
        with gc_paused():
            obj = ObjectState(key, n_chunks, held, priority, now, self._rng,
                              (not key[1]) if coordinated is None else bool(coordinated))
        if obj.is_patch:
            self._tiers.plan(obj)
            if self.origin_pipeline is not None and self.region == self.origin_region:
                # Walk chunks by this member's plan weight, so that others know in which
                # order it asks the origin for its share (`pick_share` takes from its end).
                order = np.argsort(obj.duty.weights(self.me), kind="stable")[::-1]
                obj.chunk_of = order.tolist()  # rank -> chunk
                obj.rank = np.argsort(order, kind="stable").tolist()  # its inverse: chunk -> rank
        self._objects[key] = obj
        self._order.append(obj)
        self._order.sort(key=lambda o: (o.priority, o.key))
        for peer, (whole, arriving) in self._pending.take(key, n_chunks).items():
            # Out-of-range indices from before the object was known are dropped:
            # there is no caller to blame any more.
            for chunks, is_whole in ((whole, True), (arriving - whole, False)):
                self._peer_holds(obj, peer, [c for c in chunks if type(c) is int and 0 <= c < n_chunks],
                                 is_whole)

    def remove_object(self, key: ObjKey) -> list[Request]:
        """Stop fetching `key`; returns the in-flight requests to cancel. What
        peers announced of it is kept, should it be added again."""
        obj = self._objects.pop(key, None)
        if obj is None:
            return []
        self._order.remove(obj)
        self._rests = {r for r in self._rests if r[0] != key}
        cancels = []
        for c, peers in obj.inflight.items():
            for p in peers:
                self._peers[p].drop((key, c))
                self._n_inflight -= 1
                cancels.append(Request(p, key, c))
        self._pending.put(key, obj.facts())
        return sorted(cancels)

    def forget_below(self, version: int) -> None:
        """Objects below `version` will never be fetched: forget what peers say of them."""
        self._pending.forget_below(version)

    def peer_joined(self, peer: str, kind: str, region: str) -> None:
        """A connection to `peer` is up. It holds nothing until `peer_has`."""
        if kind not in PEER_KINDS:
            raise UsageError(f"peer_joined: expected kind in {PEER_KINDS}, found {kind!r}")
        if peer in self._peers:
            raise UsageError(f"peer_joined: {peer!r} is already connected")
        if peer == self.me:
            raise UsageError(f"peer_joined: {peer!r} is this node")
        self._peers[peer] = PeerState(kind, region, peer)
        caps = self._tiers.caps
        if kind == NODE and self._tiers.member_back(peer):  # (a snubbed member stays out: a new session is no part)
            self._replan(False, caps)

    def peer_left(self, peer: str) -> None:
        """The connection to `peer` is gone: its requests in flight are released
        and it is no longer a holder; a member of my region is out of the
        plan until it connects again. A snubbed peer stays snubbed when it
        connects again (see `peer_sent`). Unknown peers are ignored."""
        self._pending.peer_left(peer)
        info = self._peers.get(peer)
        if info is None:
            return
        for key, c in sorted(info.inflight):
            self._release(self._objects[key], c, peer)
        for obj in self._objects.values():
            obj.forget_holder(peer, self._tiers.tier_of(obj), self._peers)
        del self._peers[peer]
        caps = self._tiers.caps
        if info.kind == NODE and self._tiers.member_down(peer):
            # A gateway that died takes its share with it: the region re-plans now,
            # not when the tracker's heartbeat timeout drops it.
            self._replan(False, caps)

    def peer_has(self, peer: str, key: ObjKey, chunks: Iterable[int], *, whole: bool = True) -> None:
        """`peer` holds `chunks` of `key` (a Have bitfield's indices or one
        HaveOne), or with `whole=False` is receiving them (an Incoming: it
        serves them as they arrive). Facts about objects not added yet are
        kept until they are."""
        if peer not in self._peers:
            raise UsageError(f"peer_has: {peer!r} has not joined")
        obj = self._objects.get(key)
        if obj is None:
            self._pending.add(peer, key, chunks, whole)
            return
        chunks = list(chunks)
        bad = [c for c in chunks if not (type(c) is int and 0 <= c < obj.n_chunks)]
        if bad:
            raise ProtocolError(f"peer {peer!r} announced chunks of {key}: expected indices in "
                                f"[0, {obj.n_chunks}), found {bad[:5]}")
        self._peer_holds(obj, peer, chunks, whole)

    def peer_has_unknown(self, peer: str, key: ObjKey, bitfield: bytes | None, chunks: Iterable[int] = (), *,
                         whole: bool = True) -> None:
        """As `peer_has`, for an object whose chunk count is not known yet (no manifest):
        kept bounded, as the bitfield's bytes and at most a few single chunks
        (protocol/piecestate.py's PendingFacts), until `add_object` gives the count."""
        if peer not in self._peers:
            raise UsageError(f"peer_has_unknown: {peer!r} has not joined")
        self._pending.add_unknown(peer, key, bitfield, chunks, whole)

    def peer_sent(self, peer: str, now: float, key: ObjKey | None = None, chunk: int | None = None, *,
                  got: int = 0, left: int = 0) -> None:
        """A part of an answer to a request of mine in flight to `peer` arrived, at `now` (the
        clock of `requests`): its silence ends, and a snub for silence with it (a source at its
        tier again, a member of my region back in the plan); a snub as slow ends only with a
        whole chunk (`chunk_received`). With `key` and `chunk`, the request it answers: `got`
        bytes of it have come from `peer` so far, `left` are still to come (its rate, judged by
        `slow_chunk_s`). O(1) but when it ends a snub. Unknown peers are ignored."""
        info = self._peers.get(peer)
        if info is None:
            return
        info.last_part = now
        if key is not None and (key, chunk) in info.inflight:
            if type(got) is not int or type(left) is not int or got < 0 or left < 0:
                raise UsageError(f"peer_sent: expected byte counts >= 0, found got={got!r}, left={left!r}")
            info.progress[(key, chunk)] = (got, left, now)
        if peer in self._tiers.snubbed and peer not in self._slow:
            self._set_snubbed(peer, False)

    def snubbed(self, peer: str) -> bool:
        """`peer` is snubbed: it held requests of mine and sent no part for `snub_after` s, and none since."""
        return peer in self._tiers.snubbed

    def snubbed_peers(self) -> set[str]:
        """The peers snubbed now (a copy; usually empty)."""
        return set(self._tiers.snubbed)

    def snub_reason(self, peer: str) -> str | None:
        """Why `peer` is snubbed (`SILENT` or `SLOW`); None if it is not."""
        if peer not in self._tiers.snubbed:
            return None
        return SLOW if peer in self._slow else SILENT

    def chunk_received(self, key: ObjKey, chunk: int, peer: str, now: float | None = None) -> list[Request]:
        """Chunk `chunk` of `key` from `peer` verified and stored (at `now`, on the clock of
        `requests`; None: not timed). Returns the cancels for the other copies still in
        flight (endgame)."""
        obj = self._objects.get(key)
        if obj is None:
            return []
        self._check_chunk(obj, chunk, "chunk_received")
        if chunk not in obj.missing:
            return []
        info = self._peers.get(peer)
        rest = (key, chunk) in self._rests  # a part of a chunk: its time says little of the link
        self._rests.discard((key, chunk))
        if now is not None and info is not None and (key, chunk) in info.inflight and not rest:
            sent = info.inflight[(key, chunk)]
            if info.kind == ORIGIN:
                self.origin_chunk_s = now - sent
            # A whole chunk, from when its peer began serving it: its side's typical answer.
            self._answers[info.region != self.region].append(max(0.0, now - max(info.serving_from, sent)))
        if obj.ready(chunk):
            obj.unindex(chunk)
        cancels = []
        for p in sorted(obj.inflight.pop(chunk, ())):
            self._peers[p].drop((key, chunk))
            self._n_inflight -= 1
            if p != peer:
                cancels.append(Request(p, key, chunk))
        obj.received(chunk)
        if info is not None:
            if now is not None:
                info.serving_from = now  # its next chunk is judged from here
            if peer in self._tiers.snubbed:  # a whole chunk: a part, and an answer in time
                self._set_snubbed(peer, False)
        return cancels

    def chunk_failed(self, key: ObjKey, chunk: int, peer: str) -> None:
        """`peer` sent bad data for the chunk, or did not send it in time:
        release the request; that peer is not asked for that chunk again
        until its word on it changes (see the module doc)."""
        obj = self._objects.get(key)
        if obj is None:
            return
        self._check_chunk(obj, chunk, "chunk_failed")
        self._fail(obj, chunk, peer)

    def request_lost(self, key: ObjKey, chunk: int, peer: str) -> None:
        """The answer to a request was unusable through no fault known of `peer`
        (a resumed chunk that did not verify: its first bytes came from another
        peer): the request is released, and `peer` may be asked again."""
        obj = self._objects.get(key)
        if obj is None:
            return
        self._check_chunk(obj, chunk, "request_lost")
        if chunk in obj.missing and peer in obj.inflight.get(chunk, ()):
            self._release(obj, chunk, peer)

    def chunk_refused(self, key: ObjKey, chunk: int, peer: str, now: float | None = None) -> None:
        """`peer` answered a request for the chunk with a Reject: it no longer
        says it has the chunk, and is not asked for it again until it
        announces it again (Incoming or HaveOne: it got the chunk anew).
        A Reject is no part: with `now` (the clock of `requests`), the silence
        the peer held until it, and the time it served at its rate, go on
        into its next request if it is asked again within `snub_after`, so a
        peer that refuses each request before its snub and announces the
        chunk again is snubbed all the same."""
        obj = self._objects.get(key)
        if obj is None:
            self._pending.withdraw(peer, key, chunk)
            return
        self._check_chunk(obj, chunk, "chunk_refused")
        info = self._peers.get(peer)
        if now is not None and info is not None and list(info.inflight) == [(key, chunk)]:
            info.refused_quiet = (now, now - info.quiet_from(), now - info.serving_from)
        obj.withdraw(peer, chunk)
        self._fail(obj, chunk, peer)

    def expired(self, now: float) -> list[Request]:
        """The requests that ran out of time by `now`, not answered: those sent
        `request_timeout` seconds or more before it, and every request in flight
        to a node peer silent for `snub_after` s (`_snub_at`) or serving slower
        than `slow_chunk_s` allows (`_slow_at`), which is snubbed from here on,
        and a request to a node peer whose chunk would come whole only past its
        timeout at its answer's rate (`_past_timeout_at`; why PAST_ITS_TIMEOUT).
        Each is released and its peer is not asked for that chunk
        again until its word on it changes (`requests()` asks another holder).
        The caller cancels them."""
        if not self._n_inflight or self.request_timeout is None and self.snub_after is None:
            return []
        # `sent + timeout <= now`, the very sum `next_wakeup` gives: `sent <= now - timeout` can
        # differ from it in the last bit (30.005 - 30 < 0.005), and the fetcher, woken at the
        # time `next_wakeup` named, found nothing expired and was woken at once again, without
        # end on a clock that does not move by itself (trio's MockClock). Likewise `_snub_at`, `_slow_at`.
        timeout = self.request_timeout
        late, snubs, answering = [], [], {}
        for p, info in self._peers.items():
            if not info.inflight:
                continue
            why = SILENT if self._snub_at(info) <= now else SLOW if self._slow_at(info, answering) <= now else None
            if why is not None:
                snubs.append((p, why))
                late += (Request(p, key, c) for key, c in info.inflight)
            elif timeout is not None:
                for (key, c), sent in info.inflight.items():
                    if sent + timeout <= now:
                        late.append(Request(p, key, c))
                    elif self._past_timeout_at(info, (key, c)) <= now:
                        late.append(Request(p, key, c, PAST_ITS_TIMEOUT))
        late.sort()
        for r in late:
            self._fail(self._objects[r.key], r.chunk, r.peer)
        for p, why in snubs:
            self._set_snubbed(p, True)
            if why == SLOW:
                self._slow.add(p)
            else:
                self._slow.discard(p)
        return late

    # --- questions -----------------------------------------------------------

    @property
    def max_inflight(self) -> int | None:
        """Requests in flight at most, to all peers together (None: no such bound): what
        the node's own downlink takes in a few seconds, where it is the limit. *Why:* a
        node at 300 KB/s that asked four peers up to four chunks each split its downlink
        that many ways, so every answer came at a fraction of it: peers were snubbed as
        silent or slow and requests given up at their timeout for what was the node's own
        limit (bench/RESULTS.md, "A node's own downlink")."""
        return self._max_inflight

    @max_inflight.setter
    def max_inflight(self, n: int | None) -> None:
        if n is not None and (type(n) is not int or n < 1):
            raise UsageError(f"max_inflight: expected None or an int >= 1, found {n!r}")
        self._max_inflight = n

    def requests(self, now: float) -> list[Request]:
        """The new requests to send now (they count as in flight from here on)."""
        round_ = _Round(self, now)
        for obj in self._order:
            if obj.progress != obj.progress_seen:
                obj.progress_seen, obj.progress_at = obj.progress, now
        if self._tiers.snubbed:
            round_.pick_beside_probes()
        for obj in self._order:
            if not round_.free:
                break
            if obj.n_ready:
                round_.pick_ready(obj)
            if round_.origin_free and obj.is_patch and obj.waiting():
                round_.pick_share(obj)
            if round_.free and obj.missing and len(obj.inflight) == len(obj.missing):
                round_.pick_endgame(obj)
            if round_.origin_free and obj.is_patch and obj.missing and len(obj.inflight) == len(obj.missing):
                round_.pick_rest(obj)
        if not round_.out and self._n_inflight == 0 and round_.free:
            # Idle: take over stuck chunks, at most `pipeline` per idle round so
            # that many idle nodes of one region do not flood the WAN at once.
            for obj in self._order:
                if obj.is_patch and now >= obj.progress_at + self.takeover_after and obj.waiting():
                    round_.pick_takeover(obj, self.pipeline - len(round_.out))
                if len(round_.out) >= self.pipeline or not round_.free:
                    break
        return round_.out

    def withdrawn(self) -> list[Request]:
        """The requests `requests()` replaced by one to the origin since the last call
        (`pick_rest`), each released here: the caller cancels them, keeping the bytes
        that came so that the origin is asked only for the rest."""
        out, self._withdrawn = self._withdrawn, []
        return out

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time after `now` at which `requests()` could return
        something new without a new fact (a takeover clock running out), or
        `expired()` a request (a request's timeout, a peer's snub)."""
        due = [obj.progress_at + self.takeover_after for obj in self._order
               if obj.is_patch and obj.waiting() and obj.progress_at + self.takeover_after > now]
        if self.endgame_after:
            for obj in self._order:
                if obj.missing and len(obj.inflight) == len(obj.missing):
                    due += [t for t in (self._first_sent(obj, c) + self.endgame_after
                                        for c, ps in obj.inflight.items() if len(ps) < MAX_COPIES) if t > now]
        if self.request_timeout is not None and self._n_inflight:
            due.append(min(sent for info in self._peers.values() for sent in info.inflight.values())
                       + self.request_timeout)
        if self.snub_after is not None and self._n_inflight:
            due += [self._snub_at(info) for info in self._peers.values() if info.inflight and info.kind == NODE]
            answering = {}
            for info in self._peers.values():  # the slow rule and the past-timeout rule, one walk
                if info.progress:
                    due += [t for t in (self._slow_at(info, answering),
                                        *(self._past_timeout_at(info, r) for r in info.progress))
                            if now < t < math.inf]
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

    def fetching(self) -> list[ObjKey]:
        """The objects being fetched, in key order."""
        return sorted(self._objects)

    def is_fetching(self, key: ObjKey) -> bool:
        return key in self._objects

    def n_chunks(self, key: ObjKey) -> int | None:
        """The chunk count of an object being fetched; None for any other."""
        obj = self._objects.get(key)
        return None if obj is None else obj.n_chunks

    def announced(self, peer: str, key: ObjKey, chunk: int) -> bool:
        """`peer` said it holds the chunk or is receiving it, and has not refused it since."""
        obj = self._objects.get(key)
        return self._pending.announced(peer, key, chunk) if obj is None else obj.announced(peer, chunk)

    def holds_whole(self, peer: str, key: ObjKey, chunk: int) -> bool:
        """`peer` said it holds the chunk whole, and has not refused it since."""
        obj = self._objects.get(key)
        return self._pending.holds_whole(peer, key, chunk) if obj is None else obj.holds_whole(peer, chunk)

    def in_flight(self, peer: str | None = None) -> int:
        """Requests in flight, to `peer` or in all."""
        if peer is None:
            return self._n_inflight
        info = self._peers.get(peer)
        return len(info.inflight) if info else 0

    def sent_at(self, peer: str, key: ObjKey, chunk: int) -> float | None:
        """When that request in flight was sent (the `now` of its `requests()`); None if it is not."""
        info = self._peers.get(peer)
        return None if info is None else info.inflight.get((key, chunk))

    def responsible_for(self, key: ObjKey) -> int:
        """How many chunks of a patch object me must bring into the region."""
        obj = self._objects.get(key)
        if obj is None:
            raise UsageError(f"responsible_for: {key} is not being fetched")
        return sum(obj.mine)

    # --- bookkeeping ---------------------------------------------------------

    def _snub_at(self, info: PeerState) -> float:
        """When a node peer holding requests of mine is snubbed unless a part comes (inf: never)."""
        if self.snub_after is None or info.kind != NODE:
            return math.inf
        return info.quiet_from() + self.snub_after

    def _past_timeout_at(self, info: PeerState, request: tuple[ObjKey, int]) -> float:
        """When a request in flight to a node peer is given up before `request_timeout` (inf:
        not at its rate so far, or no part told with its bytes): where, at the rate its answer
        has come since the peer began serving it (the later of `serving_from` and when it was
        asked, to its last part), its chunk would come whole only after the request's timeout,
        which gives it up anyway: `snub_after` after the peer began serving it, not at the
        timeout. The peer is not snubbed for it (a busy honest member's 1 MiB chunk may take it
        34-42 s: see SNUB_AFTER); the bytes it sent are kept (the rest is asked elsewhere)."""
        if self.request_timeout is None or self.snub_after is None or info.kind != NODE:
            return math.inf
        told = info.progress.get(request)
        if told is None or not told[0]:
            return math.inf
        sent = info.inflight[request]
        start = max(info.serving_from, sent)
        whole_at = start + _answer_takes(told, start)
        return start + self.snub_after if whole_at > sent + self.request_timeout else math.inf

    def slow_threshold(self, peer: str) -> float | None:
        """How long a chunk from `peer` may take at its rate before it is snubbed as slow (s; None:
        never, or `peer` unknown): `slow_chunk_s`; with `slow_chunk_min_s`, `SLOW_BESIDE_TYPICAL`
        times this node's typical answer from that side of the WAN, within [slow_chunk_min_s,
        slow_chunk_s]. The typical answer is the later of the median of its last whole chunks'
        times and the median of what the other peers there serve it now takes them at their
        rates: where every answer is slow now (the node's own downlink the limit) no peer is
        slow beside the others."""
        info = self._peers.get(peer)
        return None if info is None else self._slow_threshold(info, {})

    def _slow_threshold(self, info: PeerState, answering: dict[bool, list[tuple[float, str]]]) -> float | None:
        """`slow_threshold` of `info`; `answering` caches, per side of the WAN, each peer's fastest
        answer now (filled on first use: one walk over the answers in flight per question)."""
        if self.slow_chunk_s is None or self.slow_chunk_min_s is None:
            return self.slow_chunk_s
        side = info.region != self.region
        if side not in answering:
            answering[side] = sorted((t, p) for p, other in self._peers.items()
                                     if other.progress and (other.region != self.region) == side
                                     and (t := self._fastest_answer(other)) < math.inf)
        others_now = [t for t, p in answering[side] if p != info.id]
        typical = max(_upper_median(self._answers[side]), _upper_median(others_now))
        return min(self.slow_chunk_s, max(self.slow_chunk_min_s, SLOW_BESIDE_TYPICAL * typical))

    def _fastest_answer(self, info: PeerState) -> float:
        """How long the fastest answer `info` serves me now takes at its rate, from when it began
        serving (inf: no byte of any yet)."""
        return min(_answer_takes(told, info.serving_from) for told in info.progress.values())

    def _slow_at(self, info: PeerState, answering: dict[bool, list[tuple[float, str]]]) -> float:
        """When a node peer serving requests of mine is snubbed as slow (inf: not at its rate so
        far, or no part told with its bytes). Of each answer in flight it had sent `got` bytes,
        `left` to come, at its last part, `at`: at that answer's rate since the peer began
        serving (`serving_from`), its chunk takes (got + left) * (at - serving_from) / got. The
        rate is measured to the last part, not to now: between parts 2.6 s apart, one part in
        5 s read as half the rate it was. Slow where even its fastest answer would take its
        `slow_threshold` or more (one served in order after others has no part yet, and does not
        count), from `snub_after` after `serving_from` on; a peer that stops sending is silent.
        `answering`: `_slow_threshold`'s cache, one per question."""
        if self.slow_chunk_s is None or self.snub_after is None or info.kind != NODE or not info.progress:
            return math.inf
        fastest = self._fastest_answer(info)
        if fastest < (self.slow_chunk_min_s or self.slow_chunk_s):  # the common case: no threshold to work out
            return math.inf
        return info.serving_from + self.snub_after if fastest >= self._slow_threshold(info, answering) else math.inf

    def _set_snubbed(self, peer: str, snubbed: bool) -> None:
        """Snub `peer` or end its snub: its tier moves for every chunk it holds, and a member
        of my region leaves the plan or comes back (its share re-planned, as when its session
        closes or opens). What it says meanwhile is no progress of my region's."""
        if (peer in self._tiers.snubbed) == snubbed:
            return
        if not snubbed:
            self._slow.discard(peer)
        caps = self._tiers.caps
        if self._tiers.snub(peer, snubbed):
            self._replan(False, caps)
        for obj in self._objects.values():
            obj.retier_holder(peer, self._tiers.tier_of(obj), self._peers)

    def _first_sent(self, obj: ObjectState, c: int) -> float:
        """When the oldest request in flight for chunk c was sent."""
        return min(self._peers[p].inflight[(obj.key, c)] for p in obj.inflight[c])

    def _check_chunk(self, obj: ObjectState, chunk: int, what: str) -> None:
        if not (type(chunk) is int and 0 <= chunk < obj.n_chunks):
            raise UsageError(f"{what}: expected a chunk index of {obj.key} in "
                             f"[0, {obj.n_chunks}), found {chunk!r}")

    def _peer_holds(self, obj: ObjectState, peer: str, chunks: Iterable[int], whole: bool) -> None:
        info = self._peers[peer]
        fixed = self._tiers.fixed_tier(obj, info)
        obj.add_holders(peer, chunks, whole, fixed, lambda c: self._tiers.tier(obj, c, info),
                        in_region=info.kind == NODE and info.region == self.region and peer not in self._tiers.snubbed)

    def _fail(self, obj: ObjectState, chunk: int, peer: str) -> None:
        if chunk not in obj.missing:
            return
        obj.failed.setdefault(chunk, set()).add(peer)
        if peer in obj.inflight.get(chunk, ()):
            self._release(obj, chunk, peer)
        if peer in obj.sources.get(chunk, ()):
            obj.refresh(chunk, self._tiers.tier_of(obj), self._peers)

    def _send(self, obj: ObjectState, c: int, p: str, now: float, why: str) -> Request:
        if obj.ready(c):
            obj.unindex(c)
        obj.inflight.setdefault(c, set()).add(p)
        info = self._peers[p]
        if not info.inflight:
            # Asked with nothing in flight: judged from now, unless it refused its last request
            # within `snub_after`: then from when that one's silence began (a Reject is no part).
            carried, info.refused_quiet = info.refused_quiet, None
            if carried is not None and self.snub_after is not None and now - carried[0] < self.snub_after:
                info.busy_since, info.serving_from = now - carried[1], now - carried[2]
            else:
                info.busy_since = info.serving_from = now
        info.inflight[(obj.key, c)] = now
        self._n_inflight += 1
        return Request(p, obj.key, c, why)

    def _release(self, obj: ObjectState, c: int, p: str) -> None:
        asked = obj.inflight[c]
        asked.discard(p)
        self._peers[p].drop((obj.key, c))
        self._n_inflight -= 1
        if not asked:
            del obj.inflight[c]
            if c in obj.sources:
                obj.index(c)


class _Round:
    """One `requests()` call: the peers with free slots, what each other
    region's link may still take, and the requests made so far."""

    def __init__(self, picker: PiecePicker, now: float):
        self.picker = picker
        self.now = now
        self.peers = picker._peers
        self.region = picker.region
        budget: dict[str, int] = {}  # per other region: requests it may still take this round
        for info in self.peers.values():
            if info.region != self.region:
                budget[info.region] = budget.get(info.region, picker.wan_pipeline) - len(info.inflight)
        self.wan_budget = budget
        # A snubbed peer: one request at a time (its probe), so it is back as soon as a part comes.
        snubbed = picker._tiers.snubbed
        self.free = {p: room for p, info in self.peers.items()
                     if (room := (1 if p in snubbed else picker.pipeline) - len(info.inflight)) > 0
                     and (info.region == self.region or budget[info.region] > 0)}
        # In the origin's region with `origin_pipeline`: the origin's peers here, each with at most that
        # many requests in flight, and shares taken over from busier members (`pick_share`).
        self.origin_free: list[str] = []
        if picker.origin_pipeline is not None and self.region == picker.origin_region:
            for p, info in self.peers.items():
                if info.kind == ORIGIN and info.region == self.region and p in self.free:
                    room = picker.origin_pipeline - len(info.inflight)
                    if room > 0:
                        self.free[p] = min(self.free[p], room)
                        self.origin_free.append(p)
                    else:
                        del self.free[p]
        self.out: list[Request] = []
        # The node's own downlink (`max_inflight`): what may still be asked this round of the peers
        # not snubbed. A snubbed peer's probe is neither counted nor held back: it is not
        # expected to fill the downlink, counted it could leave no room for the copy asked
        # beside it, and held back the peer would stay snubbed while the others have the room.
        self.snubbed = snubbed
        self.room = math.inf if picker.max_inflight is None else picker.max_inflight - (
            picker._n_inflight - sum(len(self.peers[p].inflight) for p in snubbed if p in self.peers))
        if self.room <= 0:
            self._downlink_full()

    def pick_ready(self, obj: ObjectState) -> None:
        free = self.free
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

        def take(c: int, eligible: set[str]) -> bool:
            """Ask one of `eligible` for c; False once no useful peer has a slot left."""
            p = self._pick_peer(eligible)
            picks.append((c, p))
            self._take_slot(p)
            if p not in free or not useful <= free.keys():  # p, or a whole region's peers, ran out of slots
                useful.intersection_update(free)
                return bool(useful)
            return True

        # Across the WAN, a chunk that only members with a slow uplink hold comes after every
        # other: asked first (the rarest), it took part of that uplink from the neighbours the
        # member relays its own share to, where a fast one of them holds the chunk soon after.
        slow_there, later = self.picker._tiers.slow_elsewhere, []
        for c in walk:
            eligible = obj.sources[c] & useful
            if not eligible:
                continue
            if slow_there and eligible <= slow_there:
                later.append(c)
                continue
            if not take(c, eligible):
                break
        else:
            for c in later:
                eligible = obj.sources[c] & useful
                if eligible and not take(c, eligible):
                    break
        for c, p in picks:
            self.out.append(self.picker._send(obj, c, p, self.now, PLANNED))

    def pick_beside_probes(self) -> None:
        """A chunk asked only of snubbed peers (their probes: one each) that has a source
        not snubbed now (it announced the chunk, or the plan moved since the probe) is asked
        of that source too, at once: no chunk waits on a snubbed peer where another holder
        may be asked. The probe stays (a slow peer that answers is back); the first copy
        that arrives cancels the other, as in the endgame."""
        picker, free = self.picker, self.free
        snubbed = picker._tiers.snubbed
        for p in sorted(snubbed):
            info = self.peers.get(p)
            if info is None:
                continue
            for key, c in sorted(info.inflight):
                obj = picker._objects[key]
                asked = obj.inflight[c]
                if any(q not in snubbed for q in asked):
                    continue
                eligible = [q for q in obj.sources.get(c, ()) if q in free and q not in snubbed]
                if eligible:
                    q = self._pick_peer(set(eligible))
                    self._take_slot(q)
                    self.out.append(picker._send(obj, c, q, self.now, BESIDE_PROBE))

    def pick_share(self, obj: ObjectState) -> None:
        """In the origin's region, a member with nothing in flight to the origin and
        nothing of its own share left to ask of it takes one chunk of another member's
        share that no member of the region has announced and that member cannot have
        asked for yet: members ask for their shares in the order of their plan weights
        (`add_object`), at most `origin_pipeline` at a time, so of its unannounced
        chunks all but the first `origin_pipeline` are free to take. From the member
        with the most such chunks, the one of highest weight for this member (so that
        members taking over at once take different ones). The origin still sends each
        chunk about once (a late collision is cancelled by the one that hears the
        other's Incoming first: node/fetcher.py), and its uplink ends serving as many
        members as have work, not the one whose share happened to come slowest."""
        origins = self._idle_origins(TAKEOVER_MIN_CHUNK_S)
        if not origins or self.picker._tiers.slow(self.picker.me):
            return  # (a member with a slow uplink would hold the region up relaying what it took)
        if any(obj.ready(c) and obj.tier.get(c) == ORIGIN_TIER for c in obj.missing):
            return  # my own share still has chunks to ask for
        waiting: dict[str, list[int]] = {}
        snubbed = self.picker._tiers.snubbed
        for c in obj.missing:
            if c in obj.inflight or c in obj.sources or obj.mine[c]:
                continue
            owner = obj.duty.owner(c) if obj.duty is not None else None
            hs = obj.holders[c]
            if owner is None or not any(p in hs for p in origins) or any(p in obj.failed.get(c, ()) for p in origins):
                continue
            if any(self.peers[h].kind == NODE and self.peers[h].region == self.region and h not in snubbed
                   for h in hs if h in self.peers):
                continue  # (a snubbed member's word is not the region's)
            waiting.setdefault(owner, []).append(c)
        if not waiting:
            return
        # Each member asks for its share in order of its plan weight (`add_object`), at most
        # `origin_pipeline` at a time: its first that many unannounced chunks may be asked
        # for already; the rest, its tail, are not. The tail of the member with the most.
        tails = {}
        for m, cs in waiting.items():
            w = obj.duty.weights(m)
            tails[m] = sorted(cs, key=lambda c: -int(w[c]))[self.picker.origin_pipeline:]
        owner = max(sorted(tails), key=lambda m: len(tails[m]))
        if not tails[owner]:
            return
        mine = obj.duty.weights(self.picker.me)
        c = max(tails[owner], key=lambda c: int(mine[c]))  # members taking over at once pick apart
        p = self._least_busy([q for q in origins if q in obj.holders[c]])
        self._take_slot(p)
        self.out.append(self.picker._send(obj, c, p, self.now, SHARE))

    def pick_rest(self, obj: ObjectState) -> None:
        """In the origin's region, once every chunk this member lacks is at a member here,
        whole or arriving (the origin has nothing left to start for the region: it sends
        its last chunks, then idles), and this member has nothing in flight to the origin:
        the rest of one chunk it is getting from a member that fans it out to two or more,
        from the origin instead. That member's uplink carries one copy less; the origin's,
        about to idle, carries it. Of the members that lack the chunk only the one of
        highest plan weight for it moves (each member computes the same), so the relay
        keeps the others; only where a chunk from the origin takes `REST_MIN_CHUNK_S` or
        more. The request it replaces is withdrawn (`withdrawn`): the caller cancels it
        and asks the origin from the byte it has (wire.RequestRest). Without it the
        region's last 0.1-0.2 s was one or two members' uplinks fanning the origin's last
        chunks out to three others each while the origin idled (bench/RESULTS.md, issue
        26). Waiting until the source holds the chunk whole moved nothing: a member hears
        that over the source's connection, behind the parts the source queued to it, so
        about when its own copy is complete."""
        origins = self._idle_origins(REST_MIN_CHUNK_S)
        if not origins or obj.duty is None:
            return
        peers, me = self.peers, self.picker.me
        snubbed = self.picker._tiers.snubbed
        nearby = [q for q, info in peers.items() if info.kind == NODE and info.region == self.region and q not in snubbed]
        best = None
        for c in obj.missing:
            if not any(obj.announced(q, c) for q in nearby):
                return  # the origin has yet to send it to the region: its uplink is busy
            asked = obj.inflight.get(c, ())
            if len(asked) != 1 or not obj.announced(next(iter(asked)), c) or any(o in obj.failed.get(c, ()) for o in origins):
                continue
            source = next(iter(asked))
            lacking = [me] + [q for q in nearby if q != source and not obj.holds_whole(q, c)]
            if len(lacking) < 2:
                continue  # the source serves me alone
            if max(lacking, key=lambda m: (int(obj.duty.weights(m)[c]), m)) != me:
                continue  # another member that lacks it moves
            if best is None or (len(lacking), -obj.rank[c]) > (best[0], -obj.rank[best[1]]):
                best = (len(lacking), c, source)
        if best is None:
            return
        _, c, source = best
        self.picker._release(obj, c, source)  # not a failure: the source stays one
        old = Request(source, obj.key, c)
        if old in self.out:
            self.out.remove(old)  # asked this very round: never sent
        else:
            self.picker._withdrawn.append(old)
        o = self._least_busy(origins)
        self._take_slot(o)
        self.out.append(self.picker._send(obj, c, o, self.now, REST))
        self.picker._rests.add((obj.key, c))

    def _idle_origins(self, min_chunk_s: float) -> list[str]:
        """The origin's peers here with a free slot and nothing of mine in flight, where the
        last chunk from the origin took `min_chunk_s` or more (else none)."""
        if (self.picker.origin_chunk_s or 0.0) < min_chunk_s:
            return []
        return [p for p in self.origin_free if p in self.free and not self.peers[p].inflight]

    @staticmethod
    def _by_rarity(obj: ObjectState):
        chunk_of = obj.chunk_of
        for rarity in sorted(obj.buckets):
            for r in obj.buckets[rarity]:
                yield chunk_of[r]

    def pick_endgame(self, obj: ObjectState) -> None:
        free = self.free
        tiers = self.picker._tiers
        nearby = [p for p in free if self.peers[p].kind == NODE and self.peers[p].region == self.region
                  and not tiers.slow(p)]  # a copy from a slow uplink comes after the first
        if not nearby:
            return
        # A second copy only of a request in flight `endgame_after` s or more: where the LAN is
        # the limit, copies of chunks still moving take the very links the last chunks need.
        late = self.now - self.picker.endgame_after
        short = sorted((c for c, ps in obj.inflight.items() if len(ps) < MAX_COPIES
                        and (not self.picker.endgame_after or self.picker._first_sent(obj, c) <= late)),
                       key=lambda c: (len(obj.holders[c]), obj.rank[c]))
        for c in short:
            asked, bad, hs = obj.inflight[c], obj.failed.get(c, ()), obj.holders[c]
            eligible = [p for p in nearby if p in free and p in hs and p not in asked
                        and p not in bad]
            if eligible:
                p = self._least_busy(eligible)
                self._take_slot(p)
                self.out.append(self.picker._send(obj, c, p, self.now, ENDGAME))
                if not free:
                    return

    def pick_takeover(self, obj: ObjectState, budget: int) -> None:
        free = self.free
        stuck = sorted((c for c in obj.missing
                        if c not in obj.inflight and c not in obj.sources and obj.holders[c]),
                       key=lambda c: (len(obj.holders[c]), obj.rank[c]))
        for c in stuck:
            _, best = obj.best_holders(c, self.picker._tiers.any_tier_of, self.peers)
            eligible = [p for p in best if p in free]
            if eligible:
                p = self._least_busy(eligible)
                self._take_slot(p)
                self.out.append(self.picker._send(obj, c, p, self.now, STALLED))
                obj.taken.add(c)
                budget -= 1
                if not free or not budget:
                    return

    def _pick_peer(self, eligible: set[str]) -> str:
        """Inside the region, the least busy holder. Across the WAN, the holder
        already busiest with my requests (while it has a slot): a peer sends
        one connection's pieces one after another, so requests stacked on one
        connection cross the shared link in turn, each whole as early as it
        can be, where requests spread over several connections share the link
        and all finish late; the next region relays a chunk only once it is
        whole. (The sources of a chunk are all of one tier, hence one region.) Across
        the WAN, a holder with a slow uplink only where no other is free."""
        across = self.peers[next(iter(eligible))].region != self.region
        if across:  # (inside the region a slow neighbour is a lower tier: protocol/sources.py)
            slow = self.picker._tiers.slow
            eligible = [p for p in eligible if not slow(p)] or eligible
        return self._least_busy(eligible, busiest=across)

    def _least_busy(self, eligible: Iterable[str], busiest: bool = False) -> str:
        """The eligible peer with the most free slots (with `busiest`, the fewest); ties by rng."""
        rand = self.picker._rng.random
        sign = 1 if busiest else -1
        free = self.free
        return min(sorted(eligible), key=lambda p: (sign * free[p], rand()))

    def _downlink_full(self) -> None:
        """The node's downlink has its fill: only snubbed peers' probes this round."""
        for q in [q for q in self.free if q not in self.snubbed]:
            del self.free[q]
        self.origin_free.clear()  # the origin is never snubbed

    def _take_slot(self, p: str) -> None:
        free = self.free
        free[p] -= 1
        if not free[p]:
            del free[p]
        region = self.peers[p].region
        if region != self.region:
            self.wan_budget[region] -= 1
            if self.wan_budget[region] <= 0:  # that region's link is busy enough: none of its peers this round
                for q in [q for q in free if self.peers[q].region == region]:
                    del free[q]
        if p not in self.snubbed:
            self.room -= 1
            if self.room <= 0:
                self._downlink_full()
