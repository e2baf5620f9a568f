"""The origin's chunks found damaged or gone on its own disk: taken back from nodes that hold them.

Owns `ChunkRecovery`: the chunks the origin lost from its store (its store
found one changed on disk when reading it, node/store.py `on_lost`, or
start-up found one missing from an object whose manifest the origin wrote,
which it writes last, or damaged as the replay read it), and asking connected nodes for each over their
session: nodes answer a Request from any peer, the origin too
(node/peers.py). A round asks the connected nodes in waves: one node first
(where the chunk went out long ago every node holds it, and one answer is all
it costs), then twice as many at once as the wave before, up to WAVE_MAX. The
first whole verified answer of a wave ends the round and the wave's other
requests are cancelled; a wave ends early when every node in it sent a Reject
(not held) and late after REQUEST_S. Asked one node at a time, a round over
a fleet that mostly lacks the chunk (one damaged before it spread) cost a
round trip per node, ~100 s over 1,000 nodes 100 ms away, each round before
the origin could route around it; in waves it costs ~log2(WAVE_MAX) + nodes /
WAVE_MAX round trips (~7 s there), and at most WAVE_MAX - 1 needless chunks
into the origin where several nodes of one wave hold it. A whole chunk must
match the signed manifest's size and SHA-256 (protocol/manifest.py
`chunk_ok`, the check a node makes) before the store takes it; one that does
not drops its sender, as a node would. Then every session hears HaveOne for
it: a node the origin refused it to does not ask the origin again until told
(protocol/picker.py, `chunk_refused`).

A chunk that ROUNDS rounds over the connected nodes did not bring back is
reported lost, once (`on_lost`: the origin routes the swarm around it); the
asking goes on, ROUND_WAIT_S doubling up to ROUND_MAX_S between rounds, until
it is back or its object leaves the store. At most CONCURRENT chunks are asked
for at once, each of a wave of at most WAVE_MAX nodes.

Memory: one entry per chunk lost, one chunk's parts per request in flight (at
most CONCURRENT x WAVE_MAX); no
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
CONCURRENT = 4  # chunks asked for at once (each of a wave of nodes)
WAVE_MAX = 16  # nodes asked at once for one chunk, in the widest wave
CANCEL_SEND_S = 5.0  # for the Cancel of a request left unanswered (the session's own send limit is longer)


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
                    if await self._round(nodes, key, chunk):
                        return
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

    async def _round(self, nodes: list[Session], key: ObjKey, chunk: int) -> bool:
        """Ask `nodes` for the chunk in waves of 1, 2, 4 ... WAVE_MAX; True once it is back
        (or needs no taking back), False where no node gave it or the disk refused it."""
        at, width = 0, 1
        while at < len(nodes):
            if not self._still_lost(key, chunk):
                return True  # made again meanwhile (the origin), or its object retired
            wave = [s for s in nodes[at:at + width] if not s.closed]
            at, width = at + width, min(2 * width, WAVE_MAX)
            got = await self._ask_wave(wave, key, chunk)
            if got is not None:
                s, data = got
                # False: our disk failed the write; the next round tries again.
                return self.restore(key, chunk, data, f"taken back from node {s.id}")
        return False

    async def _ask_wave(self, wave: list[Session], key: ObjKey, chunk: int) -> tuple[Session, bytes] | None:
        """The first verified whole chunk one of `wave` sends, asked of all at once, and its
        sender; the others' requests are cancelled then. None where none sent it."""
        first: list[tuple[Session, bytes]] = []
        async with trio.open_nursery() as nursery:
            async def ask(s: Session) -> None:
                data = await self._ask(s, key, chunk)
                if data is not None and not first:
                    first.append((s, data))
                    nursery.cancel_scope.cancel()

            for s in wave:
                nursery.start_soon(ask, s)
        return first[0] if first else None

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
        """Chunk `chunk` of `key` from node `s`, verified; None if it refused, failed or was slow.
        A request left unanswered (slow, or cancelled: another node of its wave answered first)
        is cancelled at the node."""
        ask = self._asks[(s, key, chunk)] = _Ask(key, chunk)
        try:
            await s.send(wire.Request(key[0], key[1], chunk))
            with trio.move_on_after(REQUEST_S):
                await ask.done.wait()
            if not ask.done.is_set():
                log.info("node %s did not send chunk %d of %s within %.0f s; asking another", s.id, chunk,
                         describe(key), REQUEST_S)
            return ask.data
        except CONNECTION_ERRORS as e:
            s.close(f"could not send a request ({one_line(e)})")
            return None
        finally:
            del self._asks[(s, key, chunk)]
            if not ask.done.is_set() and not s.closed:  # the node may be sending it still: no need now
                with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_SEND_S):
                    try:
                        await s.send(wire.Cancel(key[0], key[1], chunk))
                    except CONNECTION_ERRORS as e:
                        s.close(f"could not send a cancel ({one_line(e)})")

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
