"""The WAN plan: who brings each chunk into a region, and from which regions.

Owns the deterministic, process-independent assignment that lets a swarm move
each chunk across each region boundary about once and out of the origin's
uplink about once in total:

- `responsible`: within one region, the member that fetches a chunk across the
  WAN (rendezvous / highest-random-weight hashing, so a member leaving moves
  only its own share and a member joining takes only what it wins).
- `balanced_owners`: the same, with bounded loads: the gateways' shares of the
  chunks that come from one source differ by one at most, so the last chunk a
  region pulls is not queued behind a gateway that drew more than its share;
  with `uplink_caps` (members' declared uplinks), shares in proportion to each
  gateway's uplink, so a member with a slow uplink relays little or nothing.
- `gateways` / `gateway_limit`: the members of a region that bring an object
  into it at all: at most k per region (a new set per object), every member
  in the origin's region, where pulling from the origin crosses no WAN link;
  members with a slow uplink (`SLOW_UPLINK`) only where too few others are.
- `region_order`: the chain along which a chunk crosses the WAN: the origin's
  region first, then the others from the fastest WAN link to the slowest
  (`rate_classes`, when the swarm's WAN rates are known), regions of one rate
  in a per-chunk rendezvous order, so remote regions of one rate split the
  pulling from the region before them and then exchange with each other.
- `upstream_regions`: for one region, the region it pulls a chunk from (the
  one just before it in the chain) and whether the origin itself is a source.
- `ResponsibilityMap`: `responsible` for every chunk of one object, kept up to
  date incrementally as members come and go; `weights` gives a member's weight
  of every chunk (the order in which a member of the origin's region asks the
  origin for its share, protocol/picker.py).

Weights are SHA-256 digests of text, never Python's `hash()`, so every process
computes the same plan. This module must not know about connections, time,
what anyone holds or what to request next: that is protocol/picker.py.
"""

from __future__ import annotations

import collections
import hashlib
import math
from typing import Hashable, Iterable, Mapping, Sequence

import numpy as np

from .errors import UsageError
from .manifest import ObjKey


def _member_prefix(node_id: str, key: ObjKey) -> bytes:
    version, keyframe = key
    return f"{node_id}|{version}|{int(keyframe)}|".encode()


def member_weight(node_id: str, key: ObjKey, chunk: int) -> bytes:
    """The rendezvous weight of `node_id` for one chunk:
    SHA-256 of f"{node_id}|{version}|{int(kf)}|{chunk}" (bigger wins)."""
    return hashlib.sha256(_member_prefix(node_id, key) + b"%d" % chunk).digest()


def region_weight(region: str, key: ObjKey, chunk: int) -> bytes:
    """The rendezvous weight of a region for one chunk. The "region:" tag keeps
    region labels and node ids in separate name spaces."""
    version, keyframe = key
    return hashlib.sha256(f"region:{region}|{version}|{int(keyframe)}|{chunk}".encode()).digest()


def gateway_weight(node_id: str, key: ObjKey) -> bytes:
    """The rendezvous weight of `node_id` for carrying one object across the WAN
    at all: SHA-256 of f"{node_id}|{version}|{int(kf)}|gateway" (bigger wins)."""
    return hashlib.sha256(_member_prefix(node_id, key) + b"gateway").digest()


# A member whose uplink is under this fraction of its region's median (`uplink_caps`) is slow:
# it brings no object into its region while enough others can (`gateways`), and its neighbours
# ask it for a chunk only where no other member of the region holds it (protocol/sources.py).
SLOW_UPLINK = 0.5


def uplink_caps(members: Iterable[str], uplinks: Mapping[str, float] | None) -> dict[str, float] | None:
    """Each member's share of relaying, against its region's: min(uplink, median) / median, the
    median (the upper one) over the members that declared an uplink; a member that did not
    counts as the median. A declared uplink can only lower a member's share below an even one:
    one that claims more than the others gets no more than they do, and one member's claim
    moves the median only where it is half of the declared ones or more (of two members, the
    faster one's rate is the median). None where no member is below the median (every share
    even, the plan as without uplinks). Every member computes the same from the same inputs."""
    members = sorted(set(members))
    known = sorted(v for m in members if (v := (uplinks or {}).get(m)) is not None)
    if not known:
        return None
    median = known[len(known) // 2]
    given = uplinks or {}
    caps = {m: min(median if (v := given.get(m)) is None else v, median) / median for m in members}
    return caps if any(c < 1.0 for c in caps.values()) else None


def gateway_rank(member: str, key: ObjKey, caps: Mapping[str, float] | None) -> tuple:
    """The order in which the members of a region become gateways of `key` (bigger first):
    members that are not slow first (`SLOW_UPLINK`), then by `gateway_weight`."""
    return (caps is None or caps.get(member, 1.0) >= SLOW_UPLINK, gateway_weight(member, key), member)


def gateways(key: ObjKey, region_members: Iterable[str], k: int | None,
             caps: Mapping[str, float] | None = None) -> set[str]:
    """The at most `k` members of a region (all of them for k=None) that bring
    `key` across the WAN: the highest `gateway_rank`, a new set per object so
    that the WAN work of successive versions moves around the region, and no
    slow member (`uplink_caps`) while others are enough: a gateway's uplink
    carries what it brings in to its whole region."""
    members = set(region_members)
    if k is None or len(members) <= k:
        return members
    return set(sorted(members, key=lambda m: gateway_rank(m, key, caps), reverse=True)[:k])


def gateway_limit(region: str, origin_region: str | None, max_gateways: int | None) -> int | None:
    """How many members of `region` may bring an object into it (`gateways`'
    k): all of them (None) in the origin's region, `max_gateways` elsewhere.

    The cap exists for the WAN: every gateway keeps chunks in flight across
    its region's link, so fewer gateways mean fewer chunks sharing it. In the
    origin's region a gateway pulls from the origin over the region's own
    LAN, so more of them put no flow on any WAN link; what they change is
    whose uplink carries the region's fan-out. With 2 gateways each one's
    uplink carried its half of the patch to every other member plus the
    region's copy to the next regions (issue 26: the origin's region took
    1.80x its own bound at a 200 Mbit/s LAN); with every member a gateway
    each takes an even share from the origin (`balanced_owners`), so the
    origin still sends each chunk into its region once, and every uplink
    carries a share. A region the origin serves across the WAN (the origin's
    own region has no live member) keeps the cap."""
    return None if region == origin_region else max_gateways


def responsible(key: ObjKey, chunk: int, region_members: Iterable[str]) -> str | None:
    """The member of `region_members` that brings `chunk` of `key` into the
    region: the highest `member_weight` (ties, impossible in practice, go to
    the larger id). None for no members."""
    best, best_weight = None, b""
    for member in region_members:
        weight = member_weight(member, key, chunk)
        if best is None or (weight, member) > (best_weight, best):
            best, best_weight = member, weight
    return best


def _weights(member: str, key: ObjKey, n_chunks: int) -> np.ndarray:
    """`member_weight` of every chunk as the first 8 bytes of each digest (big-endian
    uint64: the same order as the digests, but for a 2**-64 chance of a tie)."""
    prefix = _member_prefix(member, key)
    sha256 = hashlib.sha256
    raw = b"".join(sha256(prefix + b"%d" % c).digest()[:8] for c in range(n_chunks))
    return np.frombuffer(raw, dtype=">u8").astype(np.uint64)


def balanced_owners(key: ObjKey, n_chunks: int, gateways: Iterable[str],
                    classes: Sequence[Hashable] | None = None,
                    weights: dict[str, np.ndarray] | None = None,
                    caps: Mapping[str, float] | None = None) -> list[str | None]:
    """The gateway that brings each chunk into the region: rendezvous hashing
    with bounded loads.

    Chunks of one class (where they come from: the origin, a region; None for
    one class) are taken in ascending order, and each goes to the gateway of
    highest weight still under its share of that class: every gateway takes
    floor(class size / gateways) or one more, and only (class size mod
    gateways) of them one more, so no two shares differ by more than one.
    Plain rendezvous leaves shares binomial: 13 chunks over 2 gateways split
    9/4 often enough, and the region then waits on the gateway with 9
    (measured: README, design, WAN plan). A cap of ceil(size / gateways) alone
    left the last gateway the remainder: 26 chunks over 4 gave 7/7/7/5 in the
    origin's region, 9 over 4 gave 3/3/3/0. `weights` caches `_weights` per member.

    With `caps` (`uplink_caps`: gateway -> its uplink against the region's,
    in (0, 1]), shares follow the caps (`_share_targets`): a gateway's relay
    of its share to its region takes its share over its uplink, so shares in
    proportion to uplinks end together; one at a tenth of the others' rate
    takes no chunk of 26 over four, where an even share (a quarter) took the
    region 1.6-2x as long (bench/RESULTS.md, issue 26). Even caps give the
    even shares above."""
    members = sorted(set(gateways))
    if not members:
        return [None] * n_chunks
    if len(members) == 1:
        return [members[0]] * n_chunks
    cache = weights if weights is not None else {}
    for m in members:
        if m not in cache:
            cache[m] = _weights(m, key, n_chunks)
    w = np.stack([cache[m] for m in members])  # gateways x chunks
    # Best first per chunk; equal weights to the larger id, like `responsible`.
    prefs = np.lexsort((np.broadcast_to(np.arange(len(members))[:, None], w.shape), w), axis=0)[::-1].T
    if classes is None:
        classes = [None] * n_chunks
    elif len(classes) != n_chunks:
        raise UsageError(f"classes: expected one per chunk ({n_chunks}), found {len(classes)}")
    cap = [1.0] * len(members) if caps is None else [float(caps.get(m, 1.0)) for m in members]
    targets = {cls: _share_targets(size, cap) for cls, size in collections.Counter(classes).items()}
    loads = {cls: [0] * len(members) for cls in targets}
    above = collections.Counter()  # per class: extras of the pool taken
    owners: list[str | None] = [None] * n_chunks
    for c, cls in enumerate(classes):
        base, pool, extra = targets[cls]
        load = loads[cls]
        for g in prefs[c].tolist():
            if load[g] < base[g] or load[g] == base[g] and g in pool and above[cls] < extra:
                above[cls] += load[g] == base[g]
                load[g] += 1
                owners[c] = members[g]
                break
    return owners


_CAP_TIE = 1e-9  # relative: shares this close in time are equal (float noise)


def _share_targets(size: int, caps: Sequence[float]) -> tuple[list[int], frozenset[int], int]:
    """How many of `size` chunks each gateway takes, by its cap (> 0): (base counts, pool,
    extra): gateway g takes base[g] chunks, and `extra` of those in `pool` one more, whichever
    reach it first in the chunk order (for even caps: every gateway floor(size / k), and
    size mod k of them, any, one more). Each chunk beyond the floors of size * cap / sum(caps)
    goes to the gateway that would finish relaying its share soonest with it ((count + 1) /
    cap); gateways that tie for the last such chunks form the pool."""
    total = sum(caps)
    base = [math.floor(size * c / total + _CAP_TIE) for c in caps]
    if sum(base) > size:  # the tie's slack rounded up more than float noise: floors as they are
        base = [math.floor(size * c / total) for c in caps]
    left = size - sum(base)
    while left > 0:
        after = [(b + 1) / c for b, c in zip(base, caps)]
        soonest = min(after)
        tied = [g for g, t in enumerate(after) if t <= soonest * (1 + _CAP_TIE)]
        if len(tied) > left:
            return base, frozenset(tied), left
        for g in tied:
            base[g] += 1
        left -= len(tied)
    return base, frozenset(), 0


def check_rates(rates: Mapping[str, float] | None, what: str, expected: str) -> dict[str, float] | None:
    """`rates` as a plain dict (None for none or empty); UsageError (naming `what`, saying
    `expected`) unless each is a str -> a finite number > 0."""
    bad = [(r, v) for r, v in (rates or {}).items()
           if type(r) is not str or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf]
    if bad:
        raise UsageError(f"{what}: expected {expected}, found {bad[:3]}")
    return dict(rates) if rates else None


def check_wan_rates(rates: Mapping[str, float] | None) -> dict[str, float] | None:
    """`rates` as a plain dict (None for none or empty); UsageError unless each is region -> rate > 0."""
    return check_rates(rates, "wan_rates", "region -> rate > 0")


def swarm_wan_rates(from_tracker: Mapping[str, float] | None,
                    own: Mapping[str, float] | None) -> tuple[dict[str, float] | None, bool]:
    """The WAN rates a member plans its chains with, and whether its own differ from them.

    The tracker's when it gives any: one value for the whole swarm, since members that
    plan other chains leave chunks to nobody (a takeover round each) and pull some twice
    (tests/test_picker_swarm.py -k disagree). The member's own configuration only where
    the tracker gives none (a tracker of the previous version, or one started without)."""
    tracker, mine = check_wan_rates(from_tracker), check_wan_rates(own)
    if tracker is None:
        return mine, False
    return tracker, mine is not None and mine != tracker


RATE_TIE = 0.95  # WAN rates within 5 % of a class's fastest are one class (the same speed)


def rate_classes(regions: Iterable[str], rates: Mapping[str, float] | None) -> dict[str, int]:
    """Each region's rate class: 0 for the fastest WAN links, then 1, 2, ...
    by descending rate (`rates`: region -> its WAN link's rate, each way, in
    any one unit). A class starts at the fastest region not yet in one and
    takes every region at least `RATE_TIE` of its rate. Regions with no rate
    share the last class: fed last and relaying to nobody, an unknown link can
    slow only its own region. Without rates every region is of class 0."""
    regions = set(regions)
    if not rates:
        return {r: 0 for r in regions}
    known = sorted((r for r in regions if rates.get(r, 0) > 0), key=lambda r: (-rates[r], r))
    out, cls, top = {}, -1, None
    for r in known:
        if top is None or rates[r] < RATE_TIE * top:
            cls, top = cls + 1, rates[r]
        out[r] = cls
    for r in regions - set(known):
        out[r] = cls + 1
    return out


def region_order(key: ObjKey, chunk: int, regions: Iterable[str], origin_region: str,
                 rates: Mapping[str, float] | None = None) -> list[str]:
    """The order in which regions bring `chunk` across the WAN: `origin_region`
    first (whether or not it is among `regions`), then the other regions by
    `rate_classes` (fastest first), within a class by descending
    `region_weight`. Duplicates in `regions` are ignored.

    Fastest first: a region pulls each chunk from the region just before it,
    so every region's upstream receives at least as fast as it does and never
    holds it back; a slower region relays only to slower ones, over its own
    uplink, which no faster region's transfer uses. With one rate everywhere
    this is the plain per-chunk rendezvous chain."""
    others = {r for r in regions if r != origin_region}
    cls = rate_classes(others, rates)
    ranked = sorted(others, key=lambda r: (-cls[r], region_weight(r, key, chunk), r), reverse=True)
    return [origin_region, *ranked]


def upstream_regions(key: ObjKey, chunk: int, region: str, member_regions: Iterable[str],
                     origin_region: str, rates: Mapping[str, float] | None = None) -> tuple[list[str], bool]:
    """Where `region` pulls `chunk` from across the WAN.

    `member_regions` are the regions that have at least one live member;
    `region` is counted among them; `rates` as in `region_order`. Returns (the region just before `region`
    in `region_order`, as a list of at most one; whether the origin itself is
    a source).

    Only the region just before: a chunk moves along its chain, leaving each
    region at most once, so every region's uplink carries at most one copy of
    each chunk and the origin's region's uplink about one copy in total.
    Pulling from a farther upstream region as soon as it holds the chunk (the
    region just before is still fetching it) would load that region's uplink
    with a copy per downstream region: measured on 3 regions x 4 nodes, the
    origin's region sent 2x the patch and the version took 2.6x the lower
    bound. A region that stalls is the picker's takeover, not this plan.
    The origin serves only its own region, or the first region after it when
    no member lives in the origin's region. Regions without members are left
    out of the order, so a region never waits on an empty one.
    """
    present = set(member_regions)
    order = region_order(key, chunk, present | {region}, origin_region, rates)
    at = order.index(region)
    origin_serves = at == 0 or (at == 1 and origin_region not in present)
    return order[at - 1:at] if at else [], origin_serves


class ResponsibilityMap:
    """`balanced_owners(key, n_chunks, gateways(key, members, max_gateways, caps), classes, caps=caps)`,
    kept up to date as members come and go (`caps`: `uplink_caps` of the members).

    A member's weights are hashed once per object (one SHA-256 per chunk) and
    kept while it is a gateway; a change of members, classes or caps re-runs only
    the bounded assignment (a sort over gateways × chunks, one pass over the
    chunks), so churn costs O(chunks) hashes per new gateway, not
    O(chunks × members) per change.
    """

    def __init__(self, key: ObjKey, n_chunks: int, members: Iterable[str] = (), max_gateways: int | None = None,
                 classes: Sequence[Hashable] | None = None, caps: Mapping[str, float] | None = None):
        self.key = key
        self.n_chunks = n_chunks
        self.max_gateways = max_gateways
        self._members: set[str] = set()
        self._gateways: set[str] = set()
        self._owner: list[str | None] = [None] * n_chunks
        self._weights: dict[str, np.ndarray] = {}
        self._classes = self._checked(classes)
        self._caps = dict(caps) if caps else None
        self._members = set(members)
        self._assign(gateways(key, self._members, max_gateways, self._caps))

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def weights(self, member: str) -> np.ndarray:
        """`member_weight` of `member` for every chunk, as ordered uint64s (cached for gateways)."""
        w = self._weights.get(member)
        return w if w is not None else _weights(member, self.key, self.n_chunks)

    def owner(self, chunk: int) -> str | None:
        """The member responsible for `chunk`, None while there are no members."""
        return self._owner[chunk]

    @property
    def gateways(self) -> frozenset[str]:
        """The members that own chunks (all of them unless `max_gateways` was given)."""
        return frozenset(self._gateways)

    def set_members(self, members: Iterable[str], classes: Sequence[Hashable] | None = None,
                    caps: Mapping[str, float] | None = None) -> list[int]:
        """Replace the member set, their caps (None: even) and the chunks' classes (when
        given); return the chunks whose owner changed, ascending."""
        self._members = set(members)
        caps = dict(caps) if caps else None
        new = gateways(self.key, self._members, self.max_gateways, caps)
        if classes is not None:
            classes = self._checked(classes)
            if classes == self._classes:
                classes = None
            else:
                self._classes = classes
        if new == self._gateways and classes is None and caps == self._caps:
            return []
        self._caps = caps
        old = self._owner
        self._assign(new)
        return [c for c in range(self.n_chunks) if old[c] != self._owner[c]]

    def _checked(self, classes: Sequence[Hashable] | None) -> list | None:
        if classes is None:
            return None
        classes = list(classes)
        if len(classes) != self.n_chunks:
            raise UsageError(f"classes: expected one per chunk ({self.n_chunks}), found {len(classes)}")
        return classes

    def _assign(self, new: set[str]) -> None:
        for m in [m for m in self._weights if m not in new]:
            del self._weights[m]
        self._gateways = new
        self._owner = balanced_owners(self.key, self.n_chunks, new, self._classes, self._weights,
                                      caps=self._caps)
