"""The origin's chunks found damaged or gone on its own disk: taken back from nodes that hold them.

Owns `ChunkRecovery`: the chunks the origin lost from its store (its store
found one changed on disk when reading it, node/store.py `on_lost`, or
start-up found one missing from an object whose manifest the origin wrote,
which it writes last), and asking connected nodes for each over their
session: nodes answer a Request from any peer, the origin too
(node/peers.py). One node at a time: a Reject (not held) moves on to the
next at once; a request not answered whole within REQUEST_S is cancelled and
the next node asked. A whole chunk must match the signed manifest's size and
SHA-256 (protocol/manifest.py `chunk_ok`, the check a node makes) before the
store takes it; one that does not drops its sender, as a node would. Then
every session hears HaveOne for it: a node the origin refused it to does not
ask the origin again until told (protocol/picker.py, `chunk_refused`).

A chunk that ROUNDS rounds over the connected nodes did not bring back is
reported lost, once (`on_lost`: the origin routes the swarm around it); the
asking goes on, ROUND_WAIT_S doubling up to ROUND_MAX_S between rounds, until
it is back or its object leaves the store. At most CONCURRENT chunks are asked
for at once.

Memory: one entry per chunk lost, one chunk's parts per request in flight; no
record of who holds what (the origin drops Have and HaveOne as before):
asking a node that lacks a chunk costs it a Request and a Reject. Must not
decide what to publish (the origin, told `on_lost`) nor serve (node/peers.py).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Callable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.assembly import ChunkAssembly
from patchswarm.protocol.manifest import chunk_ok
from patchswarm.protocol.publication import ObjKey, describe

from patchswarm.node.net.transport import CONNECTION_ERRORS, one_line
from patchswarm.node.peers import PeerDropped, PeerSet, Session
from patchswarm.node.store import ObjectStore

log = logging.getLogger("patchswarm.origin")

REQUEST_S = 10.0  # a node's whole answer to one request; past it the next node is asked
ROUNDS = 3  # rounds over the connected nodes before a chunk is reported lost
ROUND_WAIT_S = 2.0  # between the first two rounds (nodes that are still fetching may have it next)
ROUND_MAX_S = 60.0  # ... doubling up to this, for as long as the chunk's object is kept
CONCURRENT = 4  # chunks asked for at once (each asks one node at a time)


@dataclasses.dataclass(eq=False)
class _Ask:
    """One request to one node: its parts as they come, and the verified chunk once whole."""

    key: ObjKey
    chunk: int
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    asm: ChunkAssembly | None = None
    data: bytes | None = None


class ChunkRecovery:
    def __init__(self, store: ObjectStore, peers: PeerSet, on_lost: Callable[[ObjKey, int], None]):
        self.store = store
        self.peers = peers
        self._on_lost = on_lost
        self._working: set[tuple[ObjKey, int]] = set()
        self._asks: dict[tuple[Session, ObjKey, int], _Ask] = {}
        self._slots = trio.CapacityLimiter(CONCURRENT)
        self._nursery: trio.Nursery | None = None
        self.recovered = 0  # chunks taken back from a node
        self.lost = 0  # chunks reported lost (no node brought them back in ROUNDS rounds)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def missing(self, key: ObjKey, chunk: int) -> None:
        """The store lost chunk `chunk` of `key`: take it back (once at a time per chunk)."""
        if (key, chunk) in self._working or self.store.manifest(key) is None:
            return
        self._working.add((key, chunk))
        self._nursery.start_soon(self._recover, key, chunk)

    async def _recover(self, key: ObjKey, chunk: int) -> None:
        wait, rounds = ROUND_WAIT_S, 0
        try:
            while self._still_lost(key, chunk):
                async with self._slots:
                    nodes = [s for s in self.peers.sessions.values() if s.role == "node"]
                    random.shuffle(nodes)  # no node is asked first for every chunk
                    for s in nodes:
                        if not self._still_lost(key, chunk):
                            return  # made again meanwhile (the origin), or its object retired
                        data = None if s.closed else await self._ask(s, key, chunk)
                        if data is not None:
                            if self.restore(key, chunk, data, f"taken back from node {s.id}"):
                                return
                            break  # our disk failed the write: the next round tries again
                rounds += 1
                if rounds == ROUNDS:
                    self.lost += 1
                    log.error("chunk %d of %s: damaged on this origin's disk and no node brought it back in %d "
                              "rounds over %d connected node(s); routing the swarm around it (asking goes on "
                              "every %.0f s at most)", chunk, describe(key), ROUNDS, len(nodes), ROUND_MAX_S)
                    self._on_lost(key, chunk)
                await trio.sleep(wait)
                wait = min(2 * wait, ROUND_MAX_S)
        finally:
            self._working.discard((key, chunk))

    def _still_lost(self, key: ObjKey, chunk: int) -> bool:
        return self.store.manifest(key) is not None and chunk not in self.store.have(key)

    def restore(self, key: ObjKey, chunk: int, data: bytes, how: str) -> bool:
        """Store a lost chunk the caller checked against its manifest, and tell every session;
        False where the disk failed the write (store.disk logs it; asked for again later)."""
        if self.store.manifest(key) is None:
            return True  # the object was retired meanwhile: nothing to keep
        try:
            self.store.put_chunk(key, chunk, data)
        except OSError:
            return False
        self.recovered += 1
        log.warning("chunk %d of %s %s (%s bytes, matching the manifest's SHA-256); serving it again",
                    chunk, describe(key), how, f"{len(data):,}")
        self.peers.broadcast(wire.HaveOne(key[0], key[1], chunk))
        return True

    async def _ask(self, s: Session, key: ObjKey, chunk: int) -> bytes | None:
        """Chunk `chunk` of `key` from node `s`, verified; None if it refused, failed or was slow."""
        ask = self._asks[(s, key, chunk)] = _Ask(key, chunk)
        try:
            try:
                await s.send(wire.Request(key[0], key[1], chunk))
                with trio.move_on_after(REQUEST_S) as scope:
                    await ask.done.wait()
                if scope.cancelled_caught:
                    log.info("node %s did not send chunk %d of %s within %.0f s; asking another", s.id, chunk,
                             describe(key), REQUEST_S)
                    await s.send(wire.Cancel(key[0], key[1], chunk))
            except CONNECTION_ERRORS as e:
                s.close(f"could not send a request ({one_line(e)})")
            return ask.data
        finally:
            del self._asks[(s, key, chunk)]

    # ------------------------------------------------------------ what nodes answer

    def on_piece(self, s: Session, msg: wire.Piece) -> None:
        """A part of a chunk; one this origin did not ask `s` for (the rest of a cancelled
        answer) is ignored."""
        ask = self._asks.get((s, (msg.version, msg.keyframe), msg.chunk))
        if ask is None or ask.done.is_set():
            return
        if ask.asm is None:
            m = self.store.manifest(ask.key)
            if m is None:
                ask.done.set()
                return
            if msg.offset != 0:
                raise PeerDropped(f"answered a request for chunk {msg.chunk} of {describe(ask.key)} from "
                                  f"offset {msg.offset}, expected 0")
            ask.asm = ChunkAssembly(msg.total, m.chunks[msg.chunk][0])  # ProtocolError drops the node
        if not ask.asm.add(msg.offset, msg.total, msg.data):
            return
        ask.done.set()
        data = bytes(ask.asm.data())
        m = self.store.manifest(ask.key)
        if m is not None and not chunk_ok(m, msg.chunk, data):
            raise PeerDropped(f"sent chunk {msg.chunk} of {describe(ask.key)} that does not match its manifest")
        ask.data = data

    def on_reject(self, s: Session, msg: wire.Reject) -> None:
        ask = self._asks.get((s, (msg.version, msg.keyframe), msg.chunk))
        if ask is not None:
            ask.done.set()

    def peer_left(self, s: Session) -> None:
        for (owner, _, _), ask in self._asks.items():
            if owner is s:
                ask.done.set()
