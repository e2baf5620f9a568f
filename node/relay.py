"""Chunks arriving now, so that they can be served while they arrive (cut-through).

Owns `Inflows`: one `Inflow` per (peer, object, chunk) whose parts are
arriving, each reassembled by a `protocol.assembly.ChunkAssembly`, and who is
waiting on each: a session that serves such a chunk registers a wake-up and is
woken on every part, when the chunk is verified and when the flow fails. The
daemon feeds parts in (`receive`) and says how each flow ends (`finish`,
`discard`, `drop_peer`); node/peers.py asks `source` for a flow to follow.
Must not verify chunks, touch the object store or decide what to fetch.
"""

from __future__ import annotations

from typing import Callable

from patchswarm.protocol.assembly import ChunkAssembly
from patchswarm.protocol.errors import ProtocolError
from patchswarm.protocol.publication import ObjKey

Wake = Callable[[], None]


class Inflow:
    """One chunk arriving from one peer."""

    __slots__ = ("peer", "key", "chunk", "asm", "failed", "_watchers")

    def __init__(self, peer: str, key: ObjKey, chunk: int, asm: ChunkAssembly):
        self.peer = peer
        self.key = key
        self.chunk = chunk
        self.asm = asm
        self.failed = False  # ended without a verified chunk: followers must look elsewhere
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


class Inflows:
    def __init__(self) -> None:
        self._flows: dict[tuple[str, ObjKey, int], Inflow] = {}
        self._by_chunk: dict[tuple[ObjKey, int], list[Inflow]] = {}

    def __len__(self) -> int:
        return len(self._flows)

    def receive(self, peer: str, key: ObjKey, chunk: int, expected_total: int,
                offset: int, total: int, data: bytes) -> tuple[Inflow | None, bool]:
        """Take one part from `peer`: (its flow, whether this part started the first
        flow of that chunk). (None, False) for a part of a flow this node ended
        (cancelled, rejected): the rest of it may still be on the way.
        ProtocolError if the part does not continue its flow."""
        k = (peer, key, chunk)
        flow = self._flows.get(k)
        if offset == 0:
            if flow is not None:  # asked again after a cancel: the old flow is over
                self._end(flow, failed=True)
            flow = Inflow(peer, key, chunk, ChunkAssembly(total, expected_total))
            self._flows[k] = flow
            others = self._by_chunk.setdefault((key, chunk), [])
            first = not others
            others.append(flow)
        elif flow is None:
            return None, False
        else:
            first = False
        try:
            flow.asm.add(offset, total, data)
        except ProtocolError:
            self._end(flow, failed=True)
            raise
        flow.notify()
        return flow, first

    def source(self, key: ObjKey, chunk: int) -> Inflow | None:
        """The live flow of that chunk furthest along, to follow; None if none."""
        flows = self._by_chunk.get((key, chunk))
        return max(flows, key=lambda f: f.asm.received) if flows else None

    def finish(self, flow: Inflow, ok: bool) -> None:
        """The flow's chunk is whole and was checked: `ok` releases its last part
        to followers; not `ok` fails them."""
        if ok:
            flow.asm.mark_verified()
        self._end(flow, failed=not ok)

    def discard(self, peer: str, key: ObjKey, chunk: int) -> None:
        """This node stopped that flow (cancel, reject, timeout): followers look elsewhere."""
        flow = self._flows.get((peer, key, chunk))
        if flow is not None:
            self._end(flow, failed=True)

    def drop_peer(self, peer: str) -> None:
        for flow in [f for k, f in self._flows.items() if k[0] == peer]:
            self._end(flow, failed=True)

    def drop_object(self, key: ObjKey) -> None:
        for flow in [f for k, f in self._flows.items() if k[1] == key]:
            self._end(flow, failed=True)

    def _end(self, flow: Inflow, failed: bool) -> None:
        if self._flows.get((flow.peer, flow.key, flow.chunk)) is flow:
            del self._flows[(flow.peer, flow.key, flow.chunk)]
            others = self._by_chunk[(flow.key, flow.chunk)]
            others.remove(flow)
            if not others:
                del self._by_chunk[(flow.key, flow.chunk)]
        flow.failed = failed
        flow.notify()
