"""The node daemon: joins the swarm, fetches and verifies chunks, applies versions in order, serves peers.

Owns one member's I/O life: the tracker session (membership, version
notices, heartbeats, reconnects), dialing and accepting peers (node/peers.py),
executing the piece picker's answers (protocol/picker.py decides), checking
every chunk against its signed manifest, applying objects strictly in the
order `VersionBook.plan` gives (protocol/patch.py does the math, on a low-priority
thread), publishing each verified version at `weights_path`
(node/weights.py), the local socket (status, wait_version, submit) and the
trajectory uploader. Every task lives in the daemon's nursery.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import hashlib
import logging
import math
import os
import time
from pathlib import Path

import trio

from patchswarm.protocol import localapi, wire
from patchswarm.protocol.errors import (ConflictingManifest, CorruptData, InvalidInput, PatchswarmError, SignatureError,
                             SpoolFull, StaleVersion, UsageError)
from patchswarm.protocol.manifest import chunk_ok
from patchswarm.protocol.patch import apply as apply_patch
from patchswarm.protocol.peersets import apply_delta
from patchswarm.protocol.picker import WAN_GATEWAYS, PiecePicker
from patchswarm.protocol.publication import ObjKey, describe, patch_of
from patchswarm.protocol.trajectory import encode_batch
from patchswarm.protocol.versions import NEW, VersionBook

from patchswarm.node.localapi import serve_local
from patchswarm.node.lowprio import APPLY_NICE, run_low_priority
from patchswarm.node.peers import PeerDropped, PeerSet, Session
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.relay import Inflows
from patchswarm.node.spool import TrajectorySpool
from patchswarm.node.store import ObjectStore
from patchswarm.node.net.trackerlink import TrackerLink
from patchswarm.node.net.transport import CONNECTION_ERRORS, connect, one_line, serve
from patchswarm.node.net.trust import Credentials
from patchswarm.node.weights import WEIGHTS_NAME, Weights, read_weights, write_weights

log = logging.getLogger("patchswarm.node")

REQUEST_TIMEOUT = 30.0  # a requested chunk not delivered by then is asked of someone else
SAME_REGION_PEERS = 16
OTHER_REGION_PEERS = 3  # per other region
KEEP_VERSIONS = 4  # objects kept after they are applied, to serve peers that are behind
BACKOFF_MAX = 10.0
SPOOL_BYTES = 1 << 30  # trajectories kept while the origin is unreachable; submit waits beyond
UPLOAD_WINDOW = 4  # trajectory batches in flight to the origin before waiting for acks
UPLOAD_BATCH_BYTES = 4 << 20
UPLOAD_LINGER = 0.05  # s between upload batches unless one fills up (see _upload_loop)
UPLOAD_FILL_BYTES = 1 << 20  # a batch this large leaves without waiting out the linger


class Wakeup:
    """A level-triggered flag a loop sleeps on: `set()` from anywhere, `await wait(timeout)`."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> None:
        with trio.move_on_after(max(0.0, timeout)):
            await self._event.wait()
        self._event = trio.Event()


@dataclasses.dataclass
class NodeConfig:
    tracker: str
    creds: Path
    data_dir: Path
    listen: str
    region: str
    upload_limit: float | None = None
    download_limit: float | None = None
    no_peers: bool = False
    keep_versions: int = KEEP_VERSIONS
    seed: int | None = None
    spool_bytes: int = SPOOL_BYTES
    apply_nice: int = APPLY_NICE
    apply_threads: int | None = None  # None: as many as the cores (protocol/parallel.py)
    wan_gateways: int | None = WAN_GATEWAYS


def _rank(a: str, b: str) -> bytes:
    return hashlib.sha256(f"{a}|{b}".encode()).digest()


class Node:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.creds = Credentials.load(cfg.creds)
        if self.creds.role != "node":
            raise UsageError(f"{cfg.creds}: expected credentials with role node, found {self.creds.role!r}")
        self.id = self.creds.name
        self.region = cfg.region
        self.swarm_id = self.creds.swarm_id()
        self.data_dir = Path(cfg.data_dir)
        self.weights_path = self.data_dir / WEIGHTS_NAME
        self.book = VersionBook(self.swarm_id, self.creds.trainer_public_key())
        self.store: ObjectStore | None = None
        self.weights: Weights | None = None
        self.upload = TokenBucket(cfg.upload_limit)
        self.download = TokenBucket(cfg.download_limit)
        self.inflows = Inflows()
        self.peers = PeerSet(self.id, None, self.upload, self._on_message,  # store set in run()
                             on_open=self._on_peer_open, on_close=self._on_peer_close, inflows=self.inflows)
        self.tracker = TrackerLink(cfg.tracker, self.creds, self._hello, self._on_tracker_message)
        self.picker: PiecePicker | None = None
        self.members: dict[str, dict] = {}  # id -> peer entry from the tracker
        self.origin_region: str | None = None
        self.listen_addr = cfg.listen
        self.started_at = time.time()
        self.bytes_in = {"origin": 0, "same_region": 0, "other_region": 0}
        self.chunks_rejected = 0
        self.manifests_rejected = 0
        self.manifests_stale = 0
        self.applied: collections.deque[dict] = collections.deque(maxlen=64)  # recent versions, for status
        self._wanted: set[ObjKey] = set()
        self._timeline: dict[ObjKey, dict[str, float]] = {}  # wall-clock announced_at / complete_at
        self._unusable: set[ObjKey] = set()
        # Sessions sent an Incoming for a chunk not yet held. Sessions, not peer ids: a peer
        # that reconnects meanwhile has a new session, which was never told.
        self._told: dict[ObjKey, dict[int, set[Session]]] = {}
        self._outstanding: dict[tuple[str, ObjKey, int], float] = {}
        self._dialing: set[str] = set()
        self._dial_after: dict[str, float] = {}
        self._sched = Wakeup()
        self._applier = Wakeup()
        self._dialer = Wakeup()
        self._version_changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._lock_fd: int | None = None
        self.spool: TrajectorySpool | None = None
        self._uploads_in_flight = 0
        self._uploader = Wakeup()
        self._uploaded: collections.deque[tuple[float, int]] = collections.deque()  # (time, bytes) sent

    # ------------------------------------------------------------ life

    @property
    def version(self) -> int | None:
        return None if self.weights is None else self.weights.version

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_data_dir()
        self.weights = await trio.to_thread.run_sync(self._load_weights)
        self.store = ObjectStore(self.data_dir / "objects")
        self.peers.store = self.store
        for line in self.store.load(self.book, None):
            log.warning("dropped from the object store: %s", line)
        self.spool = await TrajectorySpool.open(self.data_dir / "spool", self.id, self.region,
                                                max_bytes=self.cfg.spool_bytes)
        for problem in self.spool.problems:
            log.warning("trajectory spool: %s (intact records around it are kept)", problem)
        try:
            await self._run(task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self.spool.aclose()

    async def _run(self, task_status) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.listen_addr = await nursery.start(self._serve_peers)
            await nursery.start(serve_local, self.data_dir / "node.sock", self._handle_local)
            log.info("node %s (region %s) listening on %s, at %s; local socket %s", self.id, self.region,
                     self.listen_addr, "no version yet" if self.weights is None else f"version {self.version}",
                     self.data_dir / "node.sock")
            nursery.start_soon(self.tracker.run)
            nursery.start_soon(self._dial_loop)
            nursery.start_soon(self._schedule_loop)
            nursery.start_soon(self._apply_loop)
            nursery.start_soon(self._upload_loop)
            task_status.started(self)

    def _lock_data_dir(self) -> None:
        fd = os.open(self.data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{self.data_dir}: another daemon is running on this data dir") from None
        self._lock_fd = fd  # held until the process exits

    def _load_weights(self) -> Weights | None:
        try:
            w = read_weights(self.weights_path)
        except InvalidInput as e:
            log.warning("ignoring %s: %s; starting without weights", self.weights_path, e)
            return None
        if w is not None and w.swarm_id != self.swarm_id:
            raise UsageError(f"{self.weights_path}: holds weights of swarm {w.swarm_id}, this node is in {self.swarm_id}")
        return w

    def _hello(self) -> wire.Hello:
        return wire.Hello(self.id, self.region, "node", self.listen_addr,
                          [] if self.version is None else [self.version])

    # ------------------------------------------------------------ tracker

    async def _on_tracker_message(self, msg) -> None:
        if isinstance(msg, wire.PeerList):
            self._on_peer_list(msg.peers)
        elif isinstance(msg, wire.PeerDelta):
            self._on_peer_list(list(apply_delta(self.members, msg).values()))
        elif isinstance(msg, wire.VersionNotice):
            await self._offer(msg.manifest, "tracker")

    def _on_peer_list(self, peers: list[dict]) -> None:
        self.members = {p["id"]: p for p in peers if p["id"] != self.id}
        origins = [p for p in peers if p["role"] == "origin"]
        if origins:
            self.origin_region = origins[0]["region"]
        self._ensure_picker()
        if self.picker is not None:
            if self.cfg.no_peers:
                self.picker.set_members({self.id: self.region})
            else:
                nodes = {p["id"]: p["region"] for p in peers if p["role"] == "node"}
                nodes[self.id] = self.region
                self.picker.set_members(nodes)
        self._dialer.set()
        self._sched.set()

    def _ensure_picker(self) -> None:
        if self.picker is not None or self.origin_region is None:
            return
        seed = self.cfg.seed if self.cfg.seed is not None else int.from_bytes(_rank(self.id, "seed")[:4], "big")
        self.picker = PiecePicker(self.id, self.region, self.origin_region, seed=seed,
                                  wan_gateways=self.cfg.wan_gateways)
        for s in self.peers.sessions.values():
            self._picker_peer_joined(s)
        self._applier.set()

    # ------------------------------------------------------------ manifests

    async def _offer(self, envelope: bytes, source: str) -> None:
        try:
            status, m = self.book.offer(envelope, self.version)
        except StaleVersion as e:
            self.manifests_stale += 1
            log.debug("ignored a manifest from %s: %s", source, e)
            return
        except (SignatureError, CorruptData, ConflictingManifest, InvalidInput) as e:
            self.manifests_rejected += 1
            log.warning("rejected a manifest from %s: %s", source, e)
            return
        if status == NEW:
            self._timeline[(m.version, m.is_keyframe)] = {"announced_at": time.time()}
            log.info("version %d announced: %s, %d chunks, %s bytes", m.version,
                     "keyframe" if m.is_keyframe else "patch", len(m.chunks), f"{m.total_bytes:,}")
            self._applier.set()

    # ------------------------------------------------------------ peers

    async def _serve_peers(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await serve(self.cfg.listen, self.creds, {"node"}, self._hello, self._accepted,
                    on_refused=lambda why: log.warning("refused a connection: %s", why),
                    on_receive=self.download.take, task_status=task_status)

    async def _accepted(self, ms) -> None:
        await self.peers.run(ms, outbound=False)

    def _wanted_peers(self) -> dict[str, dict]:
        origin = {i: p for i, p in self.members.items() if p["role"] == "origin"}
        if self.cfg.no_peers:
            return origin
        nodes = [p for p in self.members.values() if p["role"] == "node"]
        same = sorted((p for p in nodes if p["region"] == self.region), key=lambda p: _rank(self.id, p["id"]))
        out = {p["id"]: p for p in same[:SAME_REGION_PEERS]}
        for region in {p["region"] for p in nodes} - {self.region}:
            there = sorted((p for p in nodes if p["region"] == region), key=lambda p: _rank(self.id, p["id"]))
            out.update({p["id"]: p for p in there[:OTHER_REGION_PEERS]})
        out.update(origin)
        return out

    async def _dial_loop(self) -> None:
        while True:
            now = trio.current_time()
            for pid, p in self._wanted_peers().items():
                if self.peers.connected(pid) or pid in self._dialing or self._dial_after.get(pid, 0) > now:
                    continue
                # Both ends want each other: the smaller id dials first, the other a little later
                # if no connection came, so pairs rarely open two connections.
                if p["role"] == "node" and self.id > pid and pid not in self._dial_after:
                    self._dial_after[pid] = now + 2.0
                    continue
                self._dialing.add(pid)
                self._nursery.start_soon(self._dial, p)
            await self._dialer.wait(1.0)

    async def _dial(self, p: dict) -> None:
        pid = p["id"]
        try:
            ms = await connect(p["addr"], self.creds, {p["role"]}, self._hello(), expect_name=pid,
                               on_receive=self.download.take)
        except (*CONNECTION_ERRORS, PatchswarmError) as e:
            delay = min(BACKOFF_MAX, 2 * max(1.0, self._dial_after.get(pid, 0) - trio.current_time() + 1))
            self._dial_after[pid] = trio.current_time() + delay
            log.info("could not reach %s %s at %s (%s)", p["role"], pid, p["addr"], one_line(e))
            return
        finally:
            self._dialing.discard(pid)
        self._dial_after[pid] = trio.current_time() + 1.0
        await self.peers.run(ms, outbound=True)

    def _kind(self, s: Session) -> str:
        return "origin" if s.role == "origin" else "node"

    def _picker_peer_joined(self, s: Session) -> None:
        self.picker.peer_joined(s.id, self._kind(s), s.region)
        for key in s.have.keys() | s.arriving.keys():
            self._tell_picker_has(s.id, key, s.announced(key))

    def _tell_picker_has(self, peer: str, key: ObjKey, chunks) -> None:
        if key in self._wanted:
            n = len(self.store.manifest(key).chunks)
            self.picker.peer_has(peer, key, [c for c in chunks if c < n])

    async def _on_peer_open(self, s: Session) -> None:
        log.info("peer %s (%s, region %s) connected (%s)", s.id, s.role, s.region, "out" if s.outbound else "in")
        if self.picker is not None:
            self._picker_peer_joined(s)
        self._sched.set()

    async def _on_peer_close(self, s: Session) -> None:
        if s.role == "origin":
            # Batches in flight on that connection may never be acked: send everything unacked again
            # (the origin drops what it already has).
            self._uploads_in_flight = 0
            self.spool.requeue()
            self._uploader.set()
        if self.picker is not None:
            self.picker.peer_left(s.id)
        self.inflows.drop_peer(s.id)
        for k in [k for k in self._outstanding if k[0] == s.id]:
            del self._outstanding[k]
        self._sched.set()
        self._dialer.set()

    async def _on_message(self, s: Session, msg) -> None:
        if isinstance(msg, wire.Piece):
            await self._on_piece(s, msg)
        elif isinstance(msg, (wire.Have, wire.HaveOne, wire.Incoming)):
            if self.picker is not None:
                key = (msg.version, msg.keyframe)
                self._tell_picker_has(s.id, key, s.have.get(key, ()) if isinstance(msg, wire.Have) else (msg.chunk,))
                self._sched.set()
        elif isinstance(msg, wire.Reject):
            key = (msg.version, msg.keyframe)
            self._outstanding.pop((s.id, key, msg.chunk), None)
            self.inflows.discard(s.id, key, msg.chunk)  # a relay whose own source failed mid-chunk
            s.have.get(key, set()).discard(msg.chunk)
            s.arriving.get(key, set()).discard(msg.chunk)
            if self.picker is not None and key in self._wanted:
                self.picker.chunk_failed(key, msg.chunk, s.id)
            self._sched.set()
        elif isinstance(msg, wire.VersionNotice):
            await self._offer(msg.manifest, f"peer {s.id}")
        elif isinstance(msg, wire.TrajectoriesAck) and s.role == "origin":
            self._uploads_in_flight = max(0, self._uploads_in_flight - 1)
            self._uploader.set()
            await self.spool.ack(msg.seqs)
        elif isinstance(msg, wire.Error):
            log.warning("peer %s says: %s", s.id, msg.message)
        else:
            raise PeerDropped(f"sent {type(msg).__name__}, which peers do not send")

    async def _on_piece(self, s: Session, msg: wire.Piece) -> None:
        key, c = (msg.version, msg.keyframe), msg.chunk
        if key not in self._wanted or c in self.store.have(key):
            self.inflows.discard(s.id, key, c)
            return  # an endgame duplicate, or an object we stopped wanting
        m = self.store.manifest(key)
        if c >= len(m.chunks):
            raise PeerDropped(f"sent chunk {c} of {describe(key)}, which has {len(m.chunks)} chunks")
        flow, first = self.inflows.receive(s.id, key, c, m.chunks[c][0],
                                           msg.offset, msg.total, msg.data)
        if flow is None:
            return  # the rest of a flow this node cancelled
        if first and not flow.asm.complete:
            # Neighbours (and the next region's gateway) may follow it from here on; those
            # told need no HaveOne later. Peers that announced the chunk do not need it.
            told = self.peers.broadcast(wire.Incoming(key[0], key[1], c), s.id,
                                        skip=lambda p: p.role == "origin" or p.announces(key, c))
            self._told.setdefault(key, {}).setdefault(c, set()).update(told)
        if not flow.asm.complete:
            return
        asked_at = self._outstanding.pop((s.id, key, c), None)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("chunk %d of %s from %s (%s, region %s), %s B, %s", c, describe(key), s.id, s.role,
                      s.region, f"{msg.total:,}", "unasked" if asked_at is None
                      else f"{trio.current_time() - asked_at:.3f} s after the request")
        data = flow.asm.data()
        if not chunk_ok(m, c, data):
            self.inflows.finish(flow, ok=False)
            self.chunks_rejected += 1
            self.picker.chunk_failed(key, c, s.id)
            log.warning("rejected chunk %d of %s from peer %s: does not match the manifest's SHA-256; dropping the peer",
                        c, describe(key), s.id)
            raise PeerDropped("sent a chunk that does not match its manifest")
        self.store.put_chunk(key, c, data)
        self.inflows.finish(flow, ok=True)  # its followers send the last part; new requests read the store
        source = "origin" if s.role == "origin" else "same_region" if s.region == self.region else "other_region"
        self.bytes_in[source] += len(data)
        s.piece_bytes_in += len(data)
        for dup in self.picker.chunk_received(key, c, s.id):
            self._cancel(dup.peer, dup.key, dup.chunk)
        told = self._told.get(key, {}).pop(c, ())
        self.peers.broadcast(wire.HaveOne(key[0], key[1], c), s.id,
                             skip=lambda p: p.role == "origin" or p in told or c in p.have.get(key, ()))
        if self.store.complete(key):
            self._timeline.setdefault(key, {})["complete_at"] = time.time()
            self._applier.set()
        self._sched.set()

    def _cancel(self, peer: str, key: ObjKey, chunk: int) -> None:
        """Withdraw a request: the peer drops it, and the parts that still come are ignored."""
        self._outstanding.pop((peer, key, chunk), None)
        self.inflows.discard(peer, key, chunk)
        self._nursery.start_soon(self._send_to, peer, wire.Cancel(key[0], key[1], chunk))

    async def _send_to(self, peer: str, msg) -> None:
        s = self.peers.sessions.get(peer)
        if s is None:
            return
        try:
            await s.send(msg)
        except CONNECTION_ERRORS:
            s.closed = True

    # ------------------------------------------------------------ fetching

    async def _schedule_loop(self) -> None:
        while True:
            timeout = 1.0
            if self.picker is not None:
                now = trio.current_time()
                for k, sent in list(self._outstanding.items()):
                    if now - sent > REQUEST_TIMEOUT:
                        del self._outstanding[k]
                        peer, key, chunk = k
                        log.warning("peer %s did not deliver chunk %d of %s within %.0f s; asking elsewhere",
                                    peer, chunk, describe(key), REQUEST_TIMEOUT)
                        self.picker.chunk_failed(key, chunk, peer)
                        self._cancel(peer, key, chunk)
                debug = log.isEnabledFor(logging.DEBUG)
                for r in self.picker.requests(now):
                    if r.peer not in self.peers.sessions:
                        continue
                    if debug:  # with the arrival lines: who brought which chunk across the WAN, and when
                        log.debug("request chunk %d of %s from %s", r.chunk, describe(r.key), r.peer)
                    self._outstanding[(r.peer, r.key, r.chunk)] = now
                    self._nursery.start_soon(self._send_to, r.peer, wire.Request(r.key[0], r.key[1], r.chunk))
                wake = self.picker.next_wakeup(now)
                if wake is not None:
                    timeout = min(timeout, wake - now)
            await self._sched.wait(timeout)

    def _sync_wanted(self, plan: list[ObjKey]) -> None:
        """Make the picker fetch exactly the objects of `plan` (earlier versions first)."""
        now = trio.current_time()
        for key in plan:
            if key in self._wanted:
                continue
            m = self.book.get(key)
            if self.store.manifest(key) is None:
                self.store.put_manifest(key, m, self.book.envelope(key))
            self._wanted.add(key)
            # A keyframe with no patch beside it (the first version) is what every member
            # bootstraps from: fetch it under the WAN plan like a patch.
            coordinated = not key[1] or self.book.get((key[0], False)) is None
            self.picker.add_object(key, len(m.chunks), have=self.store.have(key), priority=key[0], now=now,
                                   coordinated=coordinated)
            for s in self.peers.sessions.values():
                if key in s.have or key in s.arriving:
                    self._tell_picker_has(s.id, key, s.announced(key))
        for key in self._wanted - set(plan):
            self._wanted.discard(key)
            for c in self.picker.remove_object(key):
                self._cancel(c.peer, c.key, c.chunk)
            self.inflows.drop_object(key)
            self._told.pop(key, None)
        self._sched.set()

    async def _apply_loop(self) -> None:
        while True:
            if self.picker is not None:
                current_hash = None if self.weights is None else self.weights.state_hash
                plan = [k for k in self.book.plan(self.version, current_hash) if k not in self._unusable]
                self._sync_wanted(plan)
                if plan and self.store.complete(plan[0]):
                    await self._apply(plan[0])
                    continue
            await self._applier.wait(2.0)

    async def _apply(self, key: ObjKey) -> None:
        m = self.store.manifest(key)
        t0 = time.perf_counter()
        state = {} if self.weights is None else self.weights.state

        def work() -> None:
            # In place, without undo records: for a dense patch they would be a
            # second copy of the state, and the weights file holds the base anyway.
            apply_patch(state, patch_of(m, self.store.chunks(key)), threads=self.cfg.apply_threads, undo=False)

        try:
            # Below the loop's priority: peers fetching this version from us come first (node/lowprio.py).
            await run_low_priority(work, self.cfg.apply_nice)
        except PatchswarmError as e:
            self._unusable.add(key)
            log.error("could not apply %s: %s; looking for another path", describe(key), e)
            if self.weights is not None:  # the state may be partly patched: back to what the file holds
                self.weights = await trio.to_thread.run_sync(self._load_weights)
                log.info("reloaded %s: %s", self.weights_path,
                         "no usable weights" if self.weights is None else f"version {self.weights.version}")
            return
        finally:
            self._wanted.discard(key)
            self.picker.remove_object(key)
            self._told.pop(key, None)
        w = Weights(state, m.version, m.target_hash, self.swarm_id)
        # A failure to write is fatal on purpose: the node must never call current what the file lacks.
        await trio.to_thread.run_sync(write_weights, self.weights_path, w)
        self.weights = w
        seconds = time.perf_counter() - t0
        self.applied.append({"version": m.version, "kind": "keyframe" if m.is_keyframe else "patch",
                             "bytes": m.total_bytes, "apply_s": round(seconds, 3),
                             **self._timeline.pop(key, {}), "applied_at": time.time()})
        log.info("applied version %d (%s, %s bytes) in %.2f s; state hash %s…", m.version,
                 "keyframe" if m.is_keyframe else "patch", f"{m.total_bytes:,}", seconds, m.target_hash[:16])
        self._version_changed.set()
        self._version_changed = trio.Event()
        self._retire(m.version)

    def _retire(self, version: int) -> None:
        """Drop what can never be needed again: objects older than the kept window."""
        for key in [k for k in self._timeline if k[0] <= version]:
            del self._timeline[key]
        floor = version - self.cfg.keep_versions
        for key in self.store.keys():
            if key[0] < floor and key not in self._wanted:
                self.store.drop(key)
        self.book.forget_below(floor)

    # ------------------------------------------------------------ trajectories

    def _origin_session(self) -> Session | None:
        return next((s for s in self.peers.sessions.values() if s.role == "origin" and not s.closed), None)

    async def _upload_loop(self) -> None:
        """Stream spooled trajectories to the origin; they leave the spool only on its ack.

        A batch costs about the same whatever it holds: here an encode, a TLS send
        and an ack to take in; at the origin a decode, a group commit and an ack.
        Sent as soon as records landed, one-record submits made batches of ~6
        records and those costs were a third of the CPU per record. So after a
        batch leaves, the next one waits up to UPLOAD_LINGER for more records (or
        until it holds UPLOAD_FILL_BYTES); a record that finds the link idle for
        that long leaves at once. Upload latency grows by at most the linger;
        nothing waits for it at the submitter."""
        last_sent = -math.inf
        while True:
            if self._origin_session() is None or self._uploads_in_flight >= UPLOAD_WINDOW:
                await self._uploader.wait(1.0)
                continue
            await self.spool.wait_pending()
            if trio.current_time() < last_sent + UPLOAD_LINGER:
                with trio.move_on_at(last_sent + UPLOAD_LINGER):
                    await self.spool.wait_pending_bytes(UPLOAD_FILL_BYTES)
            batch = await self.spool.next_batch(max_bytes=UPLOAD_BATCH_BYTES)
            data = encode_batch(batch)
            s = self._origin_session()  # again: the wait may have outlived a connection
            try:
                if s is None:
                    raise trio.ClosedResourceError("no connection to the origin")
                self._uploads_in_flight += 1
                await s.send(wire.Trajectories(data))
            except CONNECTION_ERRORS:
                # Whatever was handed out goes again later; the origin drops what it already has.
                self.spool.requeue()
                if s is not None:
                    s.closed = True
                continue
            now = last_sent = trio.current_time()
            self._uploaded.append((now, len(data)))
            while self._uploaded and self._uploaded[0][0] < now - 5.0:
                self._uploaded.popleft()

    def _spool_status(self) -> dict:
        st = self.spool.stats()
        now = trio.current_time()
        recent = sum(b for t, b in self._uploaded if t >= now - 5.0)
        return {"records": st["records"], "bytes": st["bytes"], "appended_total": st["appended_total"],
                "acked_total": st["acked_total"], "upload_rate_bps": recent / 5.0,
                "batches_in_flight": self._uploads_in_flight}

    async def _submit(self, req: dict) -> dict:
        try:
            seqs = await self.spool.append([tuple(r) for r in req["records"]], req["timeout"])
        except SpoolFull as e:
            return localapi.error(localapi.FULL, str(e))
        except UsageError as e:
            return localapi.error(localapi.BAD_REQUEST, str(e))
        return localapi.ok(seqs=seqs)

    # ------------------------------------------------------------ local socket

    def status(self) -> dict:
        sessions = self.peers.sessions.values()
        fetching = {describe(k): self.picker.missing(k) for k in sorted(self._wanted)} if self.picker else {}
        return {
            "node_id": self.id,
            "region": self.region,
            "swarm_id": self.swarm_id,
            "version": self.version,
            "state_hash": None if self.weights is None else self.weights.state_hash,
            "weights_path": str(self.weights_path),
            "latest_version": self.book.latest_version,
            "listen": self.listen_addr,
            "tracker_connected": self.tracker.connected,
            "peers": sorted(({"id": s.id, "region": s.region, "role": s.role,
                              "bytes_in": s.piece_bytes_in, "bytes_out": s.piece_bytes_out} for s in sessions),
                            key=lambda p: p["id"]),
            "bytes_in": dict(self.bytes_in),
            "bytes_out": self.peers.bytes_out,
            "bytes_out_arriving": self.peers.bytes_out_arriving,
            "chunks_rejected": self.chunks_rejected,
            "manifests_rejected": self.manifests_rejected,
            "fetching": fetching,
            # Objects that failed to apply (verified chunks, yet the patch did not fit): the
            # node routes around them; a person should know the origin published one.
            "unusable": [describe(k) for k in sorted(self._unusable)],
            "applied": list(self.applied),
            "spool": self._spool_status(),
            "uptime_s": round(time.time() - self.started_at, 1),
        }

    async def _handle_local(self, req: dict) -> dict:
        op = req["op"]
        if op == "status":
            return localapi.ok(status=self.status())
        if op == "wait_version":
            with trio.move_on_after(req["timeout"]):
                while self.version is None or self.version < req["min_version"]:
                    await self._version_changed.wait()
                return localapi.ok(status=self.status())
            return localapi.error(localapi.TIMEOUT, f"version {req['min_version']} not reached within "
                                                    f"{req['timeout']} s; the node is at {self.version}")
        if op == "submit":
            return await self._submit(req)
        return localapi.error(localapi.UNAVAILABLE, f"{op}: not available on this node")
