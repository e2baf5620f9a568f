"""Chunks arriving now, so that they can be served while they arrive (cut-through).

Owns `Inflows`: one `Inflow` per (peer, object, chunk) whose parts are
arriving, each reassembled by a `protocol.assembly.ChunkAssembly`, and who is
waiting on each: a session that serves such a chunk registers a wake-up and is
woken on every part, when the chunk is verified and when the flow fails. The
daemon feeds parts in (`receive`) and says how each flow ends (`finish`,
`discard`, `drop_peer`); node/peers.py asks `source` for a flow to follow.

Also owns the partial chunks: a flow that fails part-way (its peer died, or
the peer's own source did) leaves its bytes here, at most `PARTIALS_KEPT`
chunks, and the next request for that chunk continues from them (`resume`:
wire.RequestRest), so a broken transfer across the WAN is not paid twice
(issue 26: a killed gateway's chunks in flight, and its followers' copies,
crossed the link again). Must not verify chunks, touch the object store or
decide what to fetch.
"""

from __future__ import annotations

import collections
from typing import Callable

from patchswarm.protocol.assembly import ChunkAssembly
from patchswarm.protocol.errors import ProtocolError
from patchswarm.protocol.publication import ObjKey

Wake = Callable[[], None]
# Partial chunks kept to resume from (each holds its chunk's whole buffer). A node
# has a few requests in flight per peer, so a few dozen cover every flow one dead
# peer can break, with room for a second death before they are resumed; the byte
# cap bounds them for large chunks (the origin cuts 1 MiB ones).
PARTIALS_KEPT = 32
PARTIAL_BYTES_KEPT = 64 << 20


class Inflow:
    """One chunk arriving from one peer."""

    __slots__ = ("peer", "key", "chunk", "asm", "failed", "start", "fresh", "_watchers")

    def __init__(self, peer: str, key: ObjKey, chunk: int, asm: ChunkAssembly):
        self.peer = peer
        self.key = key
        self.chunk = chunk
        self.asm = asm
        self.failed = False  # ended without a verified chunk: followers must look elsewhere
        self.start = asm.received  # > 0 when resumed: bytes before it came from another peer
        self.fresh = True  # no part from `peer` yet
        self._watchers: list[Wake] = []

    def watch(self, wake: Wake) -> None:
        self._watchers.append(wake)

    def unwatch(self, wake: Wake) -> None:
        try:
            self._watchers.remove(wake)
        except ValueError:
            pass

    def notify(self) -> None:
        for wake in list(self._watchers):
            wake()


def _moving(flow: Inflow) -> bool:
    """Bytes came from the flow's own peer (a resumed flow's kept ones do not count)."""
    return not (flow.fresh and flow.start)


class Inflows:
    def __init__(self) -> None:
        self._flows: dict[tuple[str, ObjKey, int], Inflow] = {}
        self._by_chunk: dict[tuple[ObjKey, int], list[Inflow]] = {}
        # (object, chunk) -> the bytes a failed flow left, oldest first
        self._partials: collections.OrderedDict[tuple[ObjKey, int], ChunkAssembly] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._flows)

    def receive(self, peer: str, key: ObjKey, chunk: int, expected_total: int,
                offset: int, total: int, data: bytes) -> tuple[Inflow | None, bool]:
        """Take one part from `peer`: (its flow, whether this part started the first
        flow of that chunk, or the first part of a resumed flow that is the only
        one of its chunk). (None, False) for a part of a flow this node ended
        (cancelled, rejected): the rest of it may still be on the way; so too for a
        resumed flow, until a part at its start comes. ProtocolError if the part does
        not continue its flow."""
        k = (peer, key, chunk)
        flow = self._flows.get(k)
        if offset == 0 and (flow is None or flow.start == 0):
            if flow is not None:  # asked again after a cancel: the old flow is over
                self._end(flow, failed=True)
            flow = self._open(peer, key, chunk, ChunkAssembly(total, expected_total))
        elif flow is None:
            return None, False
        elif flow.start and offset != flow.asm.received:
            # A resumed flow's answer (wire.RequestRest) begins at its start. The same peer's
            # parts of an answer this node cancelled come before it (they were on the way when
            # it asked again): ignored until the flow has a part, then at its start the answer
            # begins again from there. Taken for the answer's, they made the honest peer's
            # answer a protocol error (bench/conn_chaos.py).
            if flow.fresh:
                return None, False
            if offset == flow.start:
                self._end(flow, failed=True, keep=False)  # followers resume from the new flow or elsewhere
                flow = self._open(peer, key, chunk, flow.asm.prefix(flow.start))
        first = flow.fresh and self._by_chunk[(key, chunk)] == [flow]
        flow.fresh = False
        try:
            flow.asm.add(offset, total, data)
        except ProtocolError:
            self._end(flow, failed=True)
            raise
        flow.notify()
        return flow, first

    def _open(self, peer: str, key: ObjKey, chunk: int, asm: ChunkAssembly) -> Inflow:
        flow = Inflow(peer, key, chunk, asm)
        self._flows[(peer, key, chunk)] = flow
        self._by_chunk.setdefault((key, chunk), []).append(flow)
        return flow

    def receiving(self, peer: str, key: ObjKey, chunk: int) -> bool:
        """A flow of that chunk from `peer` is open (a part came, or a resumed one is asked for)."""
        return (peer, key, chunk) in self._flows

    def partial(self, key: ObjKey, chunk: int) -> int:
        """Bytes of the chunk kept from a flow that failed part-way (0: none)."""
        asm = self._partials.get((key, chunk))
        return 0 if asm is None else asm.received

    def resume(self, peer: str, key: ObjKey, chunk: int) -> int:
        """Continue the chunk's kept bytes as a flow from `peer`, whom the caller
        asks for the rest (wire.RequestRest): the offset to ask from, 0 (and no
        flow) when nothing is kept. Served onward from here as it arrives."""
        asm = self._partials.pop((key, chunk), None)
        if asm is None:
            return 0
        old = self._flows.get((peer, key, chunk))
        if old is not None:
            self._end(old, failed=True)
        self._open(peer, key, chunk, asm)
        return asm.received

    def arriving(self) -> list[tuple[ObjKey, int]]:
        """The chunks with a live flow to follow, in order: what a peer that connects now is told is coming."""
        return sorted(k for k, flows in self._by_chunk.items() if any(map(_moving, flows)))

    def source(self, key: ObjKey, chunk: int) -> Inflow | None:
        """The live flow of that chunk furthest along, to follow; None if none. A resumed
        flow counts once a part of the rest has come: until then its peer may be the very
        asker, waiting on bytes this node has not got (two holders of a prefix asking each
        other for the rest would each wait on the other until the request timeout)."""
        flows = [f for f in self._by_chunk.get((key, chunk), ()) if _moving(f)]
        return max(flows, key=lambda f: f.asm.received) if flows else None

    def finish(self, flow: Inflow, ok: bool) -> None:
        """The flow's chunk is whole and was checked: `ok` releases its last part
        to followers; not `ok` fails them."""
        if ok:
            flow.asm.mark_verified()
            self._partials.pop((flow.key, flow.chunk), None)
        self._end(flow, failed=not ok)

    def discard(self, peer: str, key: ObjKey, chunk: int, keep: bool = True) -> None:
        """This node stopped that flow (cancel, reject, timeout): followers look elsewhere.
        `keep=False`: the chunk is held already, so its bytes are not kept to resume from."""
        flow = self._flows.get((peer, key, chunk))
        if flow is not None:
            self._end(flow, failed=True, keep=keep)

    def drop_peer(self, peer: str) -> None:
        for flow in [f for k, f in self._flows.items() if k[0] == peer]:
            self._end(flow, failed=True)

    def drop_object(self, key: ObjKey) -> None:
        for flow in [f for k, f in self._flows.items() if k[1] == key]:
            self._end(flow, failed=True)
        for k in [k for k in self._partials if k[0] == key]:
            del self._partials[k]

    def _end(self, flow: Inflow, failed: bool, keep: bool = True) -> None:
        if self._flows.get((flow.peer, flow.key, flow.chunk)) is flow:
            del self._flows[(flow.peer, flow.key, flow.chunk)]
            others = self._by_chunk[(flow.key, flow.chunk)]
            others.remove(flow)
            if not others:
                del self._by_chunk[(flow.key, flow.chunk)]
            asm = flow.asm
            if failed and keep and 0 < asm.received < asm.total:
                self._keep(flow.key, flow.chunk, asm)
        flow.failed = failed
        flow.notify()

    def _keep(self, key: ObjKey, chunk: int, asm: ChunkAssembly) -> None:
        """Keep a failed flow's bytes (the most of one chunk's), the newest within the caps."""
        k = (key, chunk)
        kept = self._partials.get(k)
        if kept is not None and kept.received >= asm.received:
            return
        self._partials[k] = asm
        self._partials.move_to_end(k)
        while len(self._partials) > PARTIALS_KEPT or sum(a.total for a in self._partials.values()) > PARTIAL_BYTES_KEPT:
            self._partials.popitem(last=False)
