"""Who each swarm member is told about: bounded, region-aware peer sets, kept fresh by deltas. Sans-IO.

Owns `PeerSets`, the tracker's table of members (id -> wire entry) and its
decision, per member, of which entries that member knows:

- every node of its own region: the WAN plan (protocol/responsibility.py, used
  by protocol/picker.py) is computed from the full membership of the region
  (gateways and balanced owners over all its members), so every member of a
  region must see the same member set or two of them would each think the
  other brings a chunk across the WAN;
- a sample of `other_peers` nodes of each other region: enough to fetch a
  keyframe or take over across the WAN, and to tell which regions have
  members (the plan's region order skips empty regions);
- if it is a gateway of the current object, the gateways of every other
  region inside that sample (they hold each chunk first in their region);
- every origin.

A member's entry is {"id", "region", "addr", "role"} and, where it declared one
in its Hello (wire revision 5), "uplink" (Mbit/s). Gateways are ranked as the
nodes rank them (`responsibility.gateway_rank` with its region's `uplink_caps`),
so the tracker introduces to each other exactly the members that the nodes'
`responsibility.gateways` make gateways; a join, leave or change of a member
with an uplink moves its region's median, so it re-ranks the whole region
(O(region)); one without an uplink re-ranks only itself. The tracker strips
"uplink" for members of revision 4 and before (tracker/core.py).

A change (join, leave, new address, new gateways) reaches only the members
whose set it changes: the members of the changed member's region, the few
that sampled it, and (for gateways) the other regions' gateways. Origins are
known to everyone, so their changes reach everyone. Changes are collected
and `flush` turns them into `wire.PeerDelta`s, one shared message for all
the members of a region that see the same change. A member joining gets its
whole set (`view`) as a PeerList.

Must not know about sessions, time, budgets or manifests (tracker/core.py
owns those); randomness only from the `random.Random(seed)` it was built with.
"""

from __future__ import annotations

import heapq
import random
from . import wire
from .errors import UsageError
from .manifest import ObjKey
from .responsibility import gateway_rank, uplink_caps

OTHER_REGION_PEERS = 3  # nodes of each other region a member is told about (node/daemon.py dials 3)
NODE, ORIGIN = "node", "origin"


def apply_delta(peers: dict[str, dict], delta: wire.PeerDelta) -> dict[str, dict]:
    """A member's side: the peer set (id -> entry) after `delta`, as a new dict."""
    gone = set(delta.remove)
    out = {m: e for m, e in peers.items() if m not in gone}
    out.update((e["id"], e) for e in delta.add)
    return out


class _Region:
    """The nodes of one region, in a list for O(1) random picks, plus each one's
    gateway rank for the current object, the uplinks its members declared and
    the caps (`uplink_caps`) those give."""

    __slots__ = ("ids", "pos", "weights", "uplinks", "caps")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.pos: dict[str, int] = {}
        self.weights: dict[str, tuple] = {}  # member -> responsibility.gateway_rank
        self.uplinks: dict[str, float] = {}  # members that declared one
        self.caps: dict[str, float] | None = None  # uplink_caps(ids, uplinks), kept when uplinks change

    def add(self, member: str) -> None:
        self.pos[member] = len(self.ids)
        self.ids.append(member)

    def remove(self, member: str) -> None:
        i = self.pos.pop(member)
        last = self.ids.pop()
        if last != member:
            self.ids[i] = last
            self.pos[last] = i
        self.weights.pop(member, None)

    def set_uplink(self, member: str, uplink: float | None) -> bool:
        """Record `member`'s declared uplink (it is in `ids` or has just left them); True
        when the caps may have changed, so every rank must be computed again. A member
        that declares none and did not before changes no one's cap (it counts as the
        median, and caps it is missing from give it 1.0 just the same)."""
        if self.uplinks.get(member) == uplink:
            return False
        if uplink is None:
            del self.uplinks[member]
        else:
            self.uplinks[member] = uplink
        self.caps = uplink_caps(self.ids, self.uplinks)
        return True

    def __len__(self) -> int:
        return len(self.ids)


# A pending change: (sequence number, the entry now or None for gone). The same
# member may change in several tables (its region's, a sampler's, the origins');
# the latest change wins when they are merged.
_Change = tuple[int, "dict | None"]


def _latest(*tables: dict[str, _Change]) -> dict[str, _Change]:
    out: dict[str, _Change] = {}
    for table in tables:
        for m, change in table.items():
            if m not in out or change[0] > out[m][0]:
                out[m] = change
    return out


def _delta(changes: dict[str, _Change]) -> wire.PeerDelta:
    return wire.PeerDelta(add=[e for _, e in changes.values() if e is not None],
                          remove=[m for m, (_, e) in changes.items() if e is None])


class PeerSets:
    """The members and the peer set each one is told about (see the module doc)."""

    def __init__(self, *, other_peers: int = OTHER_REGION_PEERS, gateways: int = 2, seed: int = 0):
        """`gateways`: how many members of a region carry an object across the WAN
        (the picker's `wan_gateways`); 0 shares no gateways."""
        if type(other_peers) is not int or other_peers < 1:
            raise UsageError(f"other_peers: expected an int >= 1, found {other_peers!r}")
        if type(gateways) is not int or not 0 <= gateways <= other_peers:
            raise UsageError(f"gateways: expected an int in [0, other_peers={other_peers}], found {gateways!r}")
        self.other_peers = other_peers
        self.max_gateways = gateways
        self._rng = random.Random(seed)
        self.entries: dict[str, dict] = {}  # id -> {"id", "region", "addr", "role"[, "uplink"]}
        self._regions: dict[str, _Region] = {}  # nodes only
        self._origins: set[str] = set()
        self._sample: dict[str, dict[str, list[str]]] = {}  # node -> other region -> sampled nodes
        # node -> the nodes whose sample holds it (a dict for a reproducible order)
        self._holders: dict[str, dict[str, None]] = {}
        self._key: ObjKey | None = None  # the object whose gateways are shared
        self._gateways: dict[str, frozenset[str]] = {}  # region -> its gateways of _key
        self._region_changes: dict[str, dict[str, _Change]] = {}  # seen by the region's members
        self._member_changes: dict[str, dict[str, _Change]] = {}  # seen by one member
        self._origin_changes: dict[str, _Change] = {}  # seen by everyone
        self._seq = 0
        self._synced: dict[str, int] = {}  # member -> the last change its full set holds

    # ------------------------------------------------------------ questions

    def __contains__(self, member: str) -> bool:
        return member in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def region_of(self, member: str) -> str:
        return self.entries[member]["region"]

    def region_members(self, region: str) -> list[str]:
        r = self._regions.get(region)
        return [] if r is None else list(r.ids)

    def gateways(self, region: str) -> frozenset[str]:
        """The gateways of `region` for the current object (empty before `set_object`)."""
        return self._gateways.get(region, frozenset())

    def full(self, member: str) -> list[dict]:
        """`view(member)`, for a PeerList: it supersedes the changes pending for
        `member` alone, which are dropped."""
        self._member_changes.pop(member, None)
        self._synced[member] = self._seq
        return self.view(member)

    def view(self, member: str) -> list[dict]:
        """Every entry `member` is told about now (itself excluded)."""
        e = self.entries[member]
        out = [self.entries[o] for o in self._origins if o != member]
        if e["role"] != NODE:
            return out
        out += [self.entries[m] for m in self._regions[e["region"]].ids if m != member]
        for ids in self._sample[member].values():
            out += [self.entries[m] for m in ids]
        return out

    def sample(self, member: str, region: str) -> list[str]:
        """The nodes of another `region` that `member` is told about."""
        return list(self._sample[member].get(region, ()))

    def changed(self) -> bool:
        return bool(self._region_changes or self._member_changes or self._origin_changes)

    # ------------------------------------------------------------ facts

    def join(self, member: str, role: str, region: str, addr: str, uplink: float | None = None) -> bool:
        """Add `member` (or update it: a member that reconnects may have a new
        address, uplink or region). `uplink`: the one it declared (Mbit/s), None for
        none. False when nothing changed for anyone else."""
        if role not in (NODE, ORIGIN):
            raise UsageError(f"role: expected {NODE!r} or {ORIGIN!r}, found {role!r}")
        entry = {"id": member, "region": region, "addr": addr, "role": role}
        if uplink is not None:
            entry[wire.PEER_UPLINK] = uplink
        old = self.entries.get(member)
        if old == entry:
            return False
        if old is not None and (old["role"], old["region"]) != (role, region):
            self.leave(member)
            old = None
        self.entries[member] = entry
        if role == ORIGIN:
            self._origins.add(member)
            self._note(self._origin_changes, member, entry)
            return True
        self._note(self._region_changes.setdefault(region, {}), member, entry)
        if old is not None:  # a new address or uplink: whoever knows it learns the new one
            for m in self._holders.get(member, ()):
                self._note(self._member_changes.setdefault(m, {}), member, entry)
            if self._regions[region].set_uplink(member, uplink):
                self._rerank(region)
            return True
        r = self._regions.get(region)
        if r is None:
            r = self._regions[region] = _Region()
        small = len(r) < self.other_peers
        r.add(member)
        reranked = r.set_uplink(member, uplink)
        self._holders[member] = {}
        self._sample[member] = {}
        if small:  # every sample of this region held all of it: it takes the newcomer too
            for other, ids in self._sample.items():
                if self.entries[other]["region"] != region:
                    self._add_to_sample(other, region, member)
        for u in self._regions:
            if u != region:
                self._fill_sample(member, u)
        if not small:
            self._rebalance(region, member)
        if reranked:
            self._rerank(region)
        elif self._key is not None and self.max_gateways:
            r.weights[member] = gateway_rank(member, self._key, r.caps)
            self._update_gateways(region)
        if member in self._gateways.get(region, ()):
            self._take_gateways(member)
        return True

    def leave(self, member: str) -> bool:
        """Remove `member`; False if it was not there."""
        e = self.entries.pop(member, None)
        if e is None:
            return False
        if e["role"] == ORIGIN:
            self._origins.discard(member)
            self._note(self._origin_changes, member, None)
            return True
        region = e["region"]
        r = self._regions[region]
        r.remove(member)
        reranked = r.set_uplink(member, None)
        self._note(self._region_changes.setdefault(region, {}), member, None)
        self._member_changes.pop(member, None)
        for ids in self._sample.pop(member).values():
            for m in ids:
                del self._holders[m][member]
        for other in self._holders.pop(member):
            ids = self._sample[other][region]
            ids.remove(member)
            self._note(self._member_changes.setdefault(other, {}), member, None)
            self._fill_sample(other, region)
            if not ids:
                del self._sample[other][region]
        if not len(r):
            del self._regions[region]
            self._gateways.pop(region, None)
        elif reranked:
            self._rerank(region)
        elif member in self._gateways.get(region, ()):
            self._update_gateways(region)
        return True

    def set_object(self, key: ObjKey) -> None:
        """The object now being spread: its gateways (the members that carry it
        across the WAN, `responsibility.gateways`) get to know each other."""
        if key == self._key:
            return
        self._key = key
        self._gateways = {region: frozenset() for region in self._regions}
        if not self.max_gateways:
            return
        for region in self._regions:
            self._rerank(region)

    # ------------------------------------------------------------ deltas

    def flush(self) -> list[tuple[list[str], wire.PeerDelta]]:
        """The deltas that bring every member's set up to date since the last
        flush: (members, message) pairs, one message shared by many members
        wherever they see the same change. A member may find its own id in a
        delta of its region (it ignores it)."""
        region_changes, member_changes, origin_changes, synced = \
            self._region_changes, self._member_changes, self._origin_changes, self._synced
        self._region_changes, self._member_changes, self._origin_changes, self._synced = {}, {}, {}, {}
        out: list[tuple[list[str], wire.PeerDelta]] = []
        regions = self._regions.keys() if origin_changes else region_changes.keys() & self._regions.keys()
        base: dict[str, dict[str, _Change]] = {}
        for region in regions:
            base[region] = _latest(origin_changes, region_changes.get(region, {}))
            shared = [m for m in self._regions[region].ids if m not in member_changes and m not in synced]
            if shared:
                out.append((shared, _delta(base[region])))
        # Members with changes of their own, and members sent their full set since the
        # last flush (they take only the changes after it), each get a message of their own.
        for m in member_changes.keys() | (synced.keys() & self.entries.keys()):
            if self.entries[m]["role"] != NODE:
                continue
            after = synced.get(m, -1)
            region = {k: c for k, c in base.get(self.entries[m]["region"], {}).items() if c[0] > after}
            changes = _latest(region, member_changes.get(m, {}))
            if changes:
                out.append(([m], _delta(changes)))
        if origin_changes:
            for o in self._origins:
                mine = {k: c for k, c in origin_changes.items() if k != o and c[0] > synced.get(o, -1)}
                if mine:
                    out.append(([o], _delta(mine)))
        return out

    def _note(self, changes: dict[str, _Change], member: str, entry: dict | None) -> None:
        self._seq += 1
        changes[member] = (self._seq, entry)

    # ------------------------------------------------------------ samples

    def _add_to_sample(self, member: str, region: str, node: str) -> None:
        self._sample[member].setdefault(region, []).append(node)
        self._holders[node][member] = None
        self._note(self._member_changes.setdefault(member, {}), node, self.entries[node])

    def _drop_from_sample(self, member: str, region: str, node: str) -> None:
        self._sample[member][region].remove(node)
        del self._holders[node][member]
        self._note(self._member_changes.setdefault(member, {}), node, None)

    def _fill_sample(self, member: str, region: str) -> None:
        """Top up `member`'s sample of `region` to `other_peers` (or all of it)."""
        r = self._regions.get(region)
        if r is None:
            return
        have = self._sample[member].get(region, [])
        while len(have) < min(self.other_peers, len(r)):
            self._add_to_sample(member, region, self._pick(r, set(have)))
            have = self._sample[member][region]

    def _pick(self, r: _Region, taken: set[str]) -> str:
        """A node of `r` not in `taken`: the less sampled of two random ones (two
        choices keep every node's number of samplers near the mean, newcomers
        included), or the first free one when the random draws all miss."""
        picks: list[str] = []
        for _ in range(8):
            m = r.ids[self._rng.randrange(len(r))]
            if m not in taken and m not in picks:
                picks.append(m)
                if len(picks) == 2:
                    break
        if not picks:
            return next(m for m in r.ids if m not in taken)
        return min(picks, key=lambda m: len(self._holders[m]))

    def _rebalance(self, region: str, newcomer: str) -> None:
        """Let `newcomer` take its share of the samplers of its region from the
        most sampled nodes there. Without it the first nodes of a region stay
        in nearly every other member's sample (they were the whole region when
        those members joined) and take a connection from each; with it a join
        moves about `other_peers` x (members elsewhere) / (region size) samplers,
        each one delta to the sampler."""
        r = self._regions[region]
        outside = len(self.entries) - len(self._origins) - len(r)
        share = self.other_peers * outside / len(r)
        gws = self._gateways.get(region, frozenset())
        moved, tries = 0, 0
        while moved < int(share) and tries < 2 * int(share) + 8:
            tries += 1
            a, b = (r.ids[self._rng.randrange(len(r))] for _ in range(2))
            donor = max((a, b), key=lambda m: len(self._holders[m]))
            if donor == newcomer or len(self._holders[donor]) <= share + 1:
                continue
            # A gateway stays in the samples of the other regions' gateways.
            sampler = next((s for s in self._holders[donor] if newcomer not in self._sample[s][region]
                            and not (donor in gws and s in self._gateways.get(self.entries[s]["region"], ()))),
                           None)
            if sampler is None:
                continue
            self._drop_from_sample(sampler, region, donor)
            self._add_to_sample(sampler, region, newcomer)
            moved += 1

    # ------------------------------------------------------------ gateways

    def _rerank(self, region: str) -> None:
        """Every member's gateway rank in `region` for the current object, then its
        gateways: its caps changed, or the object did (O(region))."""
        if self._key is None or not self.max_gateways:
            return
        r = self._regions[region]
        r.weights = {m: gateway_rank(m, self._key, r.caps) for m in r.ids}
        self._update_gateways(region)

    def _update_gateways(self, region: str) -> None:
        r = self._regions[region]
        new = frozenset(rank[-1] for rank in heapq.nlargest(self.max_gateways, r.weights.values()))
        old = self._gateways.get(region, frozenset())
        self._gateways[region] = new
        for g in new - old:
            self._take_gateways(g)
            for u, gws in self._gateways.items():
                if u != region:
                    for other in gws:
                        self._include(other, region, g)

    def _take_gateways(self, member: str) -> None:
        """Make `member` (a gateway) know every other region's gateways."""
        region = self.entries[member]["region"]
        for u, gws in self._gateways.items():
            if u != region:
                for g in gws:
                    self._include(member, u, g)

    def _include(self, member: str, region: str, node: str) -> None:
        """Put `node` into `member`'s sample of `region`, in place of a node that
        is not a gateway there (the sample keeps its size)."""
        ids = self._sample[member].get(region, [])
        if node in ids:
            return
        gws = self._gateways.get(region, frozenset())
        out = next((m for m in ids if m not in gws), None)
        if out is not None and len(ids) >= min(self.other_peers, len(self._regions[region])):
            self._drop_from_sample(member, region, out)
        self._add_to_sample(member, region, node)
