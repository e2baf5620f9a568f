"""Which holders of a chunk a node may ask, under the WAN plan: source tiers, with no I/O.

Owns `SourceTiers`: this node's view of the swarm (the nodes and their
regions, the origin's region) and, per object, the chunks this node must
bring into its region (a `ResponsibilityMap`, protocol/responsibility.py) and
the regions each chunk may come from. From those it gives the tier of a
holder for a chunk: lower is better, `NOT_A_SOURCE` may not be asked now.
These are rules 1-3 and the keyframe rule of protocol/picker.py's module doc;
the picker asks only the holders at a chunk's best tier. A node peer the
picker snubbed (`snub`: it held requests and sent no part for `snub_after`)
ranks after the origin for every chunk and is out of my region's plan until
it sends a part. Must not hold facts about peers' chunks
(protocol/piecestate.py) or pick (protocol/picker.py).
"""

from __future__ import annotations

from typing import Mapping

from .piecestate import NOT_A_SOURCE, ObjectState, PeerState
from .responsibility import SLOW_UPLINK, ResponsibilityMap, gateway_limit, uplink_caps, upstream_regions

ORIGIN = "origin"  # peer kind: the seeder on the trainer, holds every announced chunk
NODE = "node"  # peer kind: another node daemon

SAME_REGION = 0  # a node peer in my region
OTHER_REGION = 1  # keyframes and takeover: node peers of other regions (upstream regions: 1, 2, ...)
# A node peer in my region with a slow uplink (responsibility.SLOW_UPLINK): asked for a chunk
# only where no other neighbour holds it. Its uplink would take a tenth of the time or more
# per chunk; a neighbour that holds the chunk too is always the sooner copy.
SLOW_NEIGHBOUR = OTHER_REGION
ORIGIN_TIER = 1 << 20  # after the upstream region's node peers
# A snubbed node peer: its tier under the normal rules plus this, so after the origin and every
# peer that is not snubbed, and never a source where the rules make it none. It is asked only
# where no better holder has the chunk (its probe: protocol/picker.py, `snub_after`).
SNUBBED = 1 << 21


class SourceTiers:
    def __init__(self, me: str, region: str, origin_region: str | None, wan_gateways: int | None,
                 wan_rates: Mapping[str, float] | None = None):
        self.me = me
        self.region = region
        self.origin_region = origin_region
        self.wan_gateways = wan_gateways
        self.wan_rates = dict(wan_rates) if wan_rates else None  # region -> WAN rate: the chains' order
        self.members: dict[str, str] = {me: region}
        self.region_members: set[str] = {me}
        self.member_regions: frozenset[str] = frozenset({region})
        # Members of my region whose session closed and did not come back: out of
        # the plan though the tracker still lists them (until its heartbeat timeout).
        self.down: set[str] = set()
        # Node peers snubbed (protocol/picker.py, `snub_after`): after the origin for every chunk,
        # and a member of my region out of the plan, until a part comes from it; kept across its
        # reconnects (a member that closes its session is dialed again), not past its membership.
        self.snubbed: set[str] = set()
        self.uplinks: dict[str, float] = {}  # node -> its declared uplink, Mbit/s (none: not declared)
        self.caps: dict[str, float] | None = None  # uplink_caps of region_members (None: even)
        # The other regions' nodes I know of (a sample) with a slow uplink against those others
        self.slow_elsewhere: frozenset[str] = frozenset()

    def set_members(self, members: dict[str, str], uplinks: Mapping[str, float] | None = None) -> bool:
        """The live nodes (id -> region, me included) and their declared uplinks (id -> Mbit/s,
        None or a missing id: not declared); True if the set of regions changed."""
        self.members = {**members, self.me: self.region}
        self.uplinks = {m: float(v) for m, v in (uplinks or {}).items() if m in self.members}
        self.down &= self.members.keys()
        self._region_members()
        by_region: dict[str, list[str]] = {}
        for m, r in self.members.items():
            if r != self.region:
                by_region.setdefault(r, []).append(m)
        self.slow_elsewhere = frozenset(m for ms in by_region.values() for m, c in (uplink_caps(ms, self.uplinks) or {}).items()
                                        if c < SLOW_UPLINK)
        regions = frozenset(self.members.values())
        changed = regions != self.member_regions
        self.member_regions = regions
        return changed

    def slow(self, node: str) -> bool:
        """`node` has a slow uplink (`SLOW_UPLINK` of its region's): for my region against all
        its members (the plan's view, the same on every member), for another region against
        the members of it I know of (a choice of whom to ask, which needs no agreement)."""
        if self.caps is not None and self.caps.get(node, 1.0) < SLOW_UPLINK:
            return True
        return node in self.slow_elsewhere

    def member_down(self, node: str) -> bool:
        """`node`'s session closed: True if that takes a member of my region out of the plan."""
        if self.members.get(node) != self.region or node == self.me or node in self.down:
            return False
        self.down.add(node)
        self._region_members()
        return True

    def member_back(self, node: str) -> bool:
        """`node` connected again: True if that puts a member of my region back in the plan."""
        if node not in self.down:
            return False
        self.down.discard(node)
        self._region_members()
        return True

    def snub(self, node: str, snubbed: bool) -> bool:
        """`node` is snubbed, or (False) sent a part again: True if that moves a member of my
        region out of the plan or back in."""
        if (node in self.snubbed) == snubbed:
            return False
        (self.snubbed.add if snubbed else self.snubbed.discard)(node)
        if self.members.get(node) != self.region or node == self.me or node in self.down:
            return False
        self._region_members()
        return True

    def _region_members(self) -> None:
        self.region_members = {m for m, r in self.members.items()
                               if r == self.region and m not in self.down and m not in self.snubbed}
        self.caps = uplink_caps(self.region_members, self.uplinks)

    def plan(self, obj: ObjectState) -> None:
        """Give a new patch object its responsibility: which chunks me brings into the region."""
        obj.duty = ResponsibilityMap(obj.key, obj.n_chunks, self.region_members,
                                     max_gateways=gateway_limit(self.region, self.origin_region, self.wan_gateways),
                                     classes=self._source_classes(obj), caps=self.caps)
        for c in range(obj.n_chunks):
            obj.mine[c] = obj.duty.owner(c) == self.me

    def replan(self, obj: ObjectState, regions_changed: bool, refresh_all: bool = False) -> list[int]:
        """After `set_members`: refresh a patch object's responsibility; the
        missing chunks whose sources may have moved (every one with `refresh_all`:
        a neighbour's tier moved)."""
        if regions_changed:  # every chunk's upstream regions may have moved
            obj.upstream.clear()
        flipped = []
        for c in obj.duty.set_members(self.region_members, self._source_classes(obj) if regions_changed else None,
                                      self.caps):
            now_mine = obj.duty.owner(c) == self.me
            if obj.mine[c] != now_mine:
                obj.mine[c] = now_mine
                flipped.append(c)
        return sorted(obj.missing) if regions_changed or refresh_all else [c for c in flipped if c in obj.missing]

    def fixed_tier(self, obj: ObjectState, info: PeerState) -> int | None:
        """The tier `info` has for every chunk of `obj`, or None where it depends on the chunk."""
        if info.kind == NODE and info.region == self.region:
            t = SLOW_NEIGHBOUR if self.slow(info.id) else SAME_REGION
            return t + SNUBBED if info.id in self.snubbed else t
        if not obj.is_patch:
            return self.any_tier(info)
        return None

    def tier(self, obj: ObjectState, c: int, info: PeerState) -> int:
        """How good a source `info` is for chunk c (lower first): the normal rules, and a
        snubbed peer after the origin."""
        fixed = self.fixed_tier(obj, info)
        if fixed is not None:
            return fixed
        if not obj.mine[c]:
            return NOT_A_SOURCE
        regions, origin_serves = self._upstream(obj, c)
        if info.kind == NODE:
            t = regions.get(info.region, NOT_A_SOURCE)
            return t + SNUBBED if t != NOT_A_SOURCE and info.id in self.snubbed else t
        return ORIGIN_TIER if origin_serves else NOT_A_SOURCE

    def tier_of(self, obj: ObjectState):
        """`tier` for one object, as piecestate's `TierOf`."""
        return lambda c, info: self.tier(obj, c, info)

    def any_tier(self, info: PeerState) -> int:
        """Keyframes and takeover: any node peer, then the origin, then a snubbed node peer."""
        if info.kind != NODE:
            return ORIGIN_TIER
        return OTHER_REGION + SNUBBED if info.id in self.snubbed else OTHER_REGION

    def any_tier_of(self, c: int, info: PeerState) -> int:
        """`any_tier` as piecestate's `TierOf`."""
        return self.any_tier(info)

    def _source_classes(self, obj: ObjectState) -> list[tuple]:
        """Per chunk, where my region pulls it from across the WAN: the gateways
        share out each source's chunks evenly (`balanced_owners`)."""
        out = []
        for c in range(obj.n_chunks):
            regions, origin_serves = self._upstream(obj, c)
            out.append((tuple(sorted(regions)), origin_serves))
        return out

    def _upstream(self, obj: ObjectState, c: int) -> tuple[dict[str, int], bool]:
        plan = obj.upstream.get(c)
        if plan is None:
            regions, origin_serves = upstream_regions(obj.key, c, self.region, self.member_regions,
                                                      self.origin_region, self.wan_rates)
            plan = {r: OTHER_REGION + i for i, r in enumerate(regions)}, origin_serves
            obj.upstream[c] = plan
        return plan
