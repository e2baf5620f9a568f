"""The origin role on the trainer: publish(state_dict) -> patch, sign, seed; trajectories in.

Owns: casting the trainer's state to the served dtype, coding each version
against the previous served one (a keyframe first, then patches, and a
keyframe again whenever the chain since the last one has cost more than a
keyframe), signing manifests with the trainer key, keeping the published
objects on disk and serving their chunks to nodes, announcing every version
to the tracker (again after a tracker restart), and `--watch`ing a checkpoint
directory. State survives restarts: the latest served weights and every
retained object live under the data dir, so version numbers continue. A chunk
its own disk damaged is taken back from nodes (recovery.py), made again from
the served state, or routed around by a keyframe-only version (README.md).

`Origin` is the trio service; `SyncOrigin` runs one in a background thread
for a plain training loop (the only thread, behind that one interface).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import threading
import time
from pathlib import Path

import torch
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol import wire
from patchswarm.protocol.errors import (BudgetExceeded, CorruptData, DiskFull, InvalidInput, PatchswarmError,
                                        StorageFailed, UsageError)
from patchswarm.protocol.manifest import chunk_ok, sign_manifest
from patchswarm.protocol.patch import Patch, TensorSpec
from patchswarm.protocol.patchencode import TargetSpec, diff_in_place, keyframe_chunks
from patchswarm.protocol.peersets import apply_delta
from patchswarm.protocol.publication import (FORM1_MAX_TENSORS, MAX_OBJECT_CHUNKS, ObjKey, describe, manifest_layout,
                                             manifest_of, object_chunk_bytes)
from patchswarm.protocol.served import (DEFAULT_FORMAT, check_format)
from patchswarm.protocol.statehash import state_hash
from patchswarm.protocol.trajectory import ReceivedRecord, decode_batch
from patchswarm.protocol.versions import VersionBook

from patchswarm.node import failpoints
from patchswarm.node.diskspace import ours
from patchswarm.node.peers import PeerDropped, PeerSet, Session
from patchswarm.node.net.admission import MemberAdmission
from patchswarm.node.net.manifestcheck import ManifestCheck
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.store import ObjectStore
from patchswarm.node.recordids import DEFAULT_WINDOW as RECORD_ID_WINDOW
from patchswarm.node.trainer.trajstore import TrajectoryCursor, TrajectoryStore
from patchswarm.node.net.trackerlink import TrackerLink
from patchswarm.node.net.transport import CONNECTION_ERRORS, serve
from patchswarm.node.net.trust import Credentials, swarm_id_of
from patchswarm.node.lowprio import run_low_priority
from patchswarm.node.persistence import COMPACT_EVERY, DurableState
from patchswarm.node.trainer.recovery import ChunkRecovery
from patchswarm.node.trainer.watch import Watch
from patchswarm.node.trainer.source import Source
from patchswarm.node.weights import Weights

log = logging.getLogger("patchswarm.origin")

RETAIN_PATCHES = 64  # patches kept besides the latest keyframe's chain, for nodes a little behind
ORIGIN_CHUNK_BYTES = 1 << 20  # swarm pieces: small enough that a few MB spread over many peers at once
ORIGIN_SEGMENT_ELEMENTS = 1 << 20  # a chunk holds whole segments; smaller segments, finer pieces
WATCH_SECONDS = 0.5
# A node's trajectory batches read off its connection and not yet stored: the uploader keeps
# 4 in flight (node/uploader.py); past this a batch is deferred (wire revision 3), or the
# origin stops reading the connection of an older node: a node that does not wait for acks
# costs its own bandwidth or fills its own socket, not the origin's memory.
INTAKE_BATCHES_PER_NODE = 4
# ... and of all nodes together: what intake holds whatever the number of nodes (with the
# uploader's 4 MiB batches, 256 MiB; a commit groups up to 16 MiB, so the disk never waits).
INTAKE_BATCHES_TOTAL = 64
# A node whose connection selected wire revision 3 is never made to wait for a slot: a batch
# that finds none is answered with a TrajectoriesBusy and dropped, so the connection keeps
# being read (its chunk requests, above all). The wait it asks for: long enough that a store
# that takes a batch a second is not asked again and again, short next to the node's backoff.
DEFER_RETRY_MS = 1000
# A restart that finds a chunk of the chain to its latest version damaged waits this long for
# nodes to bring it back (node/trainer/recovery.py) before it goes on at the version it reaches.
CATCH_UP_S = 120.0


@dataclasses.dataclass
class OriginConfig:
    tracker: str
    creds: Path
    key: Path
    data_dir: Path
    listen: str
    region: str = "default"
    upload_limit: float | None = None
    chunk_bytes: int = ORIGIN_CHUNK_BYTES  # at least; larger for a state over max_object_chunks of them
    max_object_chunks: int = MAX_OBJECT_CHUNKS
    segment_elements: int = ORIGIN_SEGMENT_ELEMENTS
    compact_every: int = COMPACT_EVERY
    advertise: str | None = None  # the address told to the tracker and nodes; None: the bound listen address
    # Manifest form (protocol/manifest.py): None picks form 1, which every member reads, up to
    # FORM1_MAX_TENSORS tensors, form 2 (patch manifests that grow with the patch) above.
    manifest_form: int | None = None
    # Record keys the trajectory store remembers (node/trainer/trajstore.py): a record whose
    # key is among the newest this many stored is dropped as a duplicate, from any node.
    record_id_window: int = RECORD_ID_WINDOW
    # Its uplink in Mbit/s (--uplink-mbit), declared in its Hello on connections of wire revision 5;
    # shown in its peer entry (the nodes' plan uses nodes' uplinks only). None: declares none.
    uplink_mbit: float | None = None
    # Chunks served lately kept in memory as read and checked (node/store.py); None: its default.
    served_kept_bytes: int | None = None
    # How long a restart whose chain lacks chunks damaged on disk waits for nodes to bring them back.
    catch_up_s: float = CATCH_UP_S
    # Refuse peers (nodes) whose certificate names no region (--require-region): a
    # region-less certificate lets its member say any region to this member directly.
    require_region: bool = False


@dataclasses.dataclass
class VersionStats:
    version: int
    patch_bytes: int | None  # None for the first version (keyframe only)
    keyframe_bytes: int | None
    full_bytes: int  # the served checkpoint's raw bytes
    changed: int | None
    params: int
    encode_s: float


def load_trainer_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise UsageError(f"{path}: no trainer key here (run `patchswarm swarm init` first?)") from None
    except ValueError as e:
        raise InvalidInput(f"{path}: not a PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidInput(f"{path}: expected an Ed25519 trainer key, found {type(key).__name__}")
    return key


def served_copy(state_dict: dict, served: str = DEFAULT_FORMAT) -> dict[str, torch.Tensor]:
    """The served state `publish(state_dict, served)` makes (all of it at once: for checks)."""
    src = Source.from_state(state_dict, served)
    return {n: src.produce(n) for n in sorted(src.table)}


def _full_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Origin:
    def __init__(self, cfg: OriginConfig):
        if cfg.manifest_form not in (None, 1, 2):
            raise UsageError(f"manifest_form: expected 1, 2 or None (by the model's tensors), found {cfg.manifest_form!r}")
        self.cfg = cfg
        self.creds = Credentials.load(cfg.creds)
        if self.creds.role != "origin":
            raise UsageError(f"{cfg.creds}: expected credentials with role origin, found {self.creds.role!r}")
        self.creds.check_region(cfg.region)  # every peer would refuse another region: say so now
        self.creds = dataclasses.replace(self.creds, require_region=cfg.require_region)
        self.key = load_trainer_key(cfg.key)
        pub = self.key.public_key()
        if swarm_id_of(pub) != self.creds.swarm_id():
            raise UsageError(f"{cfg.key}: this trainer key does not match {self.creds.trainer_pub} of the credentials")
        self.id = self.creds.name
        self.swarm_id = self.creds.swarm_id()
        self.data_dir = Path(cfg.data_dir)
        self.book = VersionBook(self.swarm_id, pub)
        self.manifest_check = ManifestCheck(self.book)  # its own large manifests verified off the loop
        self.store: ObjectStore | None = None
        self.durable: DurableState | None = None
        self.served: Weights | None = None
        self._compacting = False
        self.upload = TokenBucket(cfg.upload_limit)
        self.peers = PeerSet(self.id, None, self.upload, self._on_message, on_open=self._on_open,
                             on_close=self._on_close)
        self.recovery: ChunkRecovery | None = None
        # Chunks lost for good (no node brought them back) are routed around by a keyframe-only
        # version: the version of the last one, and whether the trainer's next version must be one
        # (the served state is not at the latest version, so no patch can follow it).
        self._routed_at: int | None = None
        self._keyframe_only_next = False
        # The base a keyframe-only version needs, not written yet (it failed, or a compaction was
        # writing the base): written at the next publish.
        self._base_due = False
        self.peers.declared_uplink_mbit, self.peers.region = cfg.uplink_mbit, cfg.region
        self.listen_addr = cfg.listen
        self.tracker = TrackerLink(cfg.tracker, self.creds, self._hello, self._on_tracker_message,
                                   on_connect=self._on_tracker_connect, revocations_file=self.data_dir / "revocations")
        self.history: list[VersionStats] = []
        self.trajectory_store: TrajectoryStore | None = None
        self._publish_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._members: list[dict] = []
        self._intake: dict[str, trio.Semaphore] = {}  # node id -> its batches being stored
        self._intake_total = trio.Semaphore(INTAKE_BATCHES_TOTAL)
        self.intake_deferred = 0  # batches answered with TrajectoriesBusy (for stats)

    @property
    def version(self) -> int | None:
        return None if self.served is None else self.served.version

    # ------------------------------------------------------------ life

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = ObjectStore(self.data_dir / "objects", self.cfg.served_kept_bytes)
        self.peers.store = self.store
        for line in self.store.load(self.book, None):
            log.warning("dropped from the object store: %s", line)
        # The served state is the base file plus the stored objects after it, replayed and
        # verified: a version is durable once its object is (chunks first, manifest last).
        self.durable = DurableState(self.data_dir, self.store, self.swarm_id, self.cfg.compact_every)
        self.served = await trio.to_thread.run_sync(self.durable.load, self.book)
        # An object whose manifest is here was written whole (its manifest last): a chunk missing
        # from it now was damaged on this disk, and is taken back from nodes, the chain replayed then.
        lost = [(k, c) for k in self.store.keys() if not self.store.complete(k)  # only those walk their chunks
                for c in range(len(self.store.manifest(k).chunks)) if c not in self.store.have(k)]
        for key in [] if lost else self.store.keys():
            if key[0] > (-1 if self.version is None else self.version):
                log.warning("dropping %s: beyond the version it reaches", describe(key))
                self.store.drop(key)
                self.book.discard(key)
        self.trajectory_store = await TrajectoryStore.open(self.data_dir / "trajectories",
                                                           id_window=self.cfg.record_id_window)
        for problem in self.trajectory_store.problems:
            log.warning("trajectory store: %s (intact records around it are kept)", problem)
        try:
            await self._run(task_status, lost)
        finally:
            with trio.CancelScope(shield=True):
                await self.trajectory_store.aclose()

    async def _run(self, task_status, lost: list[tuple[ObjKey, int]]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.recovery = ChunkRecovery(self.store, self.peers, self._on_chunk_lost)
            await nursery.start(self.recovery.run)
            token = trio.lowlevel.current_trio_token()
            self.store.on_lost = lambda key, chunk: _call_soon(token, self.recovery.missing, key, chunk)
            for key, chunk in lost:
                log.warning("chunk %d of %s is missing or was damaged on this disk; taking it back from nodes",
                            chunk, describe(key))
                self.recovery.missing(key, chunk)
            if lost and self._chain_incomplete():
                await nursery.start(self._catch_up)  # holds the publish lock from here
            self.listen_addr = await nursery.start(self._serve_peers)
            log.info("origin %s (region %s) listening on %s; %s", self.id, self.cfg.region, self.listen_addr,
                     "nothing published yet" if self.served is None else f"at version {self.version}")
            nursery.start_soon(self.tracker.run)
            task_status.started(self)

    async def _catch_up(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """After a restart that stopped short of the latest version (a chunk of the chain was
        damaged): wait up to `catch_up_s` for nodes to bring the lost chunks back, then replay the
        rest of the chain. Publishing waits meanwhile (this holds its lock). If the chain still
        cannot be replayed, the trainer's next version is published as a keyframe only: no patch
        can be made from a state the origin does not hold."""
        async with self._publish_lock:
            task_status.started()
            with trio.move_on_after(self.cfg.catch_up_s):
                while self._chain_incomplete():
                    await trio.sleep(0.2)
            self.served = await trio.to_thread.run_sync(self.durable.carry, self.served, self.book)
            if self.version is None or self.version < self.book.latest_version:
                self._keyframe_only_next = True
                log.error("the chain to version %d cannot be replayed (chunks lost on this disk that no node "
                          "brought back in %.0f s); serving what is stored, and the next version is published "
                          "as a keyframe only", self.book.latest_version, self.cfg.catch_up_s)
            else:
                log.info("replayed the chain to version %d with the chunks nodes brought back", self.version)

    def _chain_incomplete(self) -> bool:
        """Whether an object of the chain from the served state to the latest version lacks chunks."""
        plan = self.book.plan(self.version, None if self.served is None else self.served.state_hash)
        return any(not self.store.complete(k) for k in plan)

    def _on_chunk_lost(self, key: ObjKey, chunk: int) -> None:
        self._nursery.start_soon(self._route_around, key, chunk)

    async def _route_around(self, key: ObjKey, chunk: int) -> None:
        """No node brought back chunk `chunk` of `key`. A chunk of the served version's keyframe
        is made again from the served state (the encode is deterministic; the bytes must match
        the signed SHA-256). Otherwise publish the served state again at once as a new version
        made of a keyframe only, so that no chain through the lost chunk leads to the latest
        version and a node that needs it takes the keyframe instead (protocol/versions.py
        `plan`). Once for every chunk lost before that version."""
        async with self._publish_lock:
            if self._routed_at is not None and self._routed_at > key[0] or chunk in self.store.have(key):
                return
            if self.served is not None and key == (self.version, True):
                data = await trio.to_thread.run_sync(self._keyframe_chunk, chunk)
                m = self.store.manifest(key)
                if m is not None and data is not None and chunk_ok(m, chunk, data):
                    self.recovery.restore(key, chunk, data, "made again from the served state")
                    return
                log.error("chunk %d of %s made again from the served state does not match its manifest", chunk,
                          describe(key))
            if self.served is None or self.version < self.book.latest_version:
                self._keyframe_only_next = True  # the trainer's next version: no state here to publish now
                return
            try:
                version = await self._publish(None, DEFAULT_FORMAT)
            except (PatchswarmError, OSError) as e:
                self._keyframe_only_next = True  # then the trainer's next version is the keyframe only
                log.error("could not publish the served state again as a keyframe only (%s); the next version "
                          "will be one", e)
                return
            log.error("published version %d, the state of version %d again as a keyframe only, so that nodes "
                      "that need the lost chunk %d of %s move on to it", version, version - 1, chunk, describe(key))

    def _on_close(self, s: Session) -> None:
        if self.recovery is not None:
            self.recovery.peer_left(s)

    def _hello(self) -> wire.Hello:
        return wire.Hello(self.id, self.cfg.region, "origin", self.cfg.advertise or self.listen_addr,
                          [] if self.version is None else [self.version], uplink=self.cfg.uplink_mbit)

    async def _serve_peers(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await serve(self.cfg.listen, self.creds, {"node"}, self._hello,
                    lambda ms: self.peers.run(ms, outbound=False),
                    on_refused=lambda why: log.warning("refused a connection: %s", why), refused=self.peers.dropped,
                    admission=MemberAdmission(), task_status=task_status)

    def _on_open(self, s: Session) -> None:
        log.info("node %s (region %s) connected", s.id, s.region)

    async def _on_message(self, s: Session, msg) -> None:
        if isinstance(msg, wire.Trajectories):
            await self._take_trajectories(s, msg.batch)
            return
        if isinstance(msg, wire.Piece):  # answers to the origin's requests for chunks it lost
            self.recovery.on_piece(s, msg)
            return
        if isinstance(msg, wire.Reject):
            self.recovery.on_reject(s, msg)
            return
        if isinstance(msg, (wire.Have, wire.HaveOne, wire.Incoming, wire.Heartbeat)):
            return
        if isinstance(msg, wire.Error):
            log.log(s.error_level(), "node %s says: %s", s.id, msg.message)
            return
        raise PeerDropped(f"sent {type(msg).__name__}, which the origin does not take")

    async def _take_trajectories(self, s: Session, batch: bytes) -> None:
        """Decode a batch and start its store-and-ack task, once it has a slot: one of the
        node's INTAKE_BATCHES_PER_NODE (shared by its connections: a reconnect starts no
        fresh allowance while its old batches wait) and one of INTAKE_BATCHES_TOTAL.

        A node of wire revision 3 or later gets a slot now or a TrajectoriesBusy: the
        batch is dropped undecoded and the node sends it again later, so its connection is
        read on (its chunk requests are not stuck behind a store that is slow or full).
        An older node cannot be told so: until a slot is free its connection is not read,
        and its next batches (and requests) wait in its socket, as before."""
        slots = self._intake.get(s.id)
        if slots is None:
            slots = self._intake[s.id] = trio.Semaphore(INTAKE_BATCHES_PER_NODE)
        deferrable = wire.revision(s.ms.wire_revision) >= 3
        held: list[trio.Semaphore] = []
        try:
            for sem in (slots, self._intake_total):
                if not deferrable:
                    await sem.acquire()
                elif not _try_acquire(sem):
                    await self._defer(s)
                    return
                held.append(sem)
            try:
                # In a worker thread: checking a batch of 12 MiB costs up to seconds (meta maps
                # of empty containers), which the loop must not stand still for. Meta stays the
                # bytes it came in (PackedMeta): the store only writes it out again.
                records = await trio.to_thread.run_sync(decode_batch, batch, True)
            except CorruptData as e:
                raise PeerDropped(f"sent an undecodable trajectory batch: {e}") from None
            wrong = next((r.node_id for r in records if r.node_id != s.id), None)
            if wrong is not None:
                raise PeerDropped(f"sent trajectories in the name of node {wrong!r}")
            # Stored and acked in its own task, which releases the slots: batches from one
            # node commit together with other nodes' batches (one fsync), and the
            # connection keeps reading meanwhile.
            self._nursery.start_soon(self._store_and_ack, s, records, held)
            held = []
        finally:
            for sem in held:
                sem.release()

    async def _defer(self, s: Session) -> None:
        """Tell the node its batch was not taken, and when to send it again: DEFER_RETRY_MS,
        or later while the store's disk is failing (its own backoff says when it tries)."""
        self.intake_deferred += 1
        disk = self.trajectory_store.disk
        wait_ms = DEFER_RETRY_MS if not disk.failing else max(DEFER_RETRY_MS, math.ceil(disk.retry_in() * 1000))
        try:
            await s.send(wire.TrajectoriesBusy(min(wait_ms, wire.MAX_RETRY_MS)))
        except CONNECTION_ERRORS as e:  # the node resends after reconnecting
            s.close(f"could not send a TrajectoriesBusy ({type(e).__name__})")

    async def _store_and_ack(self, s: Session, records, slots: list[trio.Semaphore]) -> None:
        """Store a batch and ack it. The global slot goes back once the records are stored
        (their memory with it), the node's only once the ack is sent: a node that does not
        read its acks holds its own slots (until SEND_TIMEOUT drops it), no one else's."""
        node_slot, total_slot = slots
        try:
            try:
                seqs = await self._store(s, records)
            finally:
                del records
                total_slot.release()
            if seqs is not None and not s.closed:
                try:
                    await s.send(wire.TrajectoriesAck(seqs))
                except CONNECTION_ERRORS as e:
                    # The node resends after reconnecting; the store drops the duplicates.
                    s.close(f"could not send a TrajectoriesAck ({type(e).__name__})")
        finally:
            node_slot.release()

    async def _store(self, s: Session, records) -> list[int] | None:
        """The seqs to ack once `records` are durable; None if they are not to be acked."""
        while True:
            try:
                return await self.trajectory_store.append(records)
            except DiskFull:
                # Our disk, not the node's fault: not acked, kept (the node's upload window
                # bounds what waits here) and tried again once the backoff allows; a node that
                # goes meanwhile resends after reconnecting instead.
                if s.closed:
                    return None
                await trio.sleep(max(0.1, self.trajectory_store.disk.retry_in()))
            except StorageFailed as e:
                log.error("trajectory store failed (%s); closing %s's connection so it resends later", e, s.id)
                s.close(f"trajectory store failed ({e})")
                return None
            except BudgetExceeded as e:  # the node's fault: refused, not acked, the node dropped
                self.peers.dropped[e.budget] += 1
                s.close(f"over budget: {e}")
                return None

    def trajectories(self, min_version: int | None = None, max_staleness: int | None = None,
                     start: tuple[int, int] | None = None) -> "TrajectoryFeed":
        """Trajectories in arrival order, from the first one stored, or from `start`: a
        feed's `position` saved earlier (it holds across restarts); see TrajectoryFeed."""
        if self.trajectory_store is None:
            raise UsageError("trajectories: expected a running origin (await nursery.start(origin.run)), "
                             "found one not started")
        return TrajectoryFeed(self, self.trajectory_store.cursor(start, min_version=min_version,
                                                                 max_staleness=max_staleness))

    # ------------------------------------------------------------ tracker

    async def _on_tracker_connect(self, ms) -> None:
        for key in self.book.retained(RETAIN_PATCHES):
            await ms.send(wire.Announce(self.book.envelope(key)))

    async def _on_tracker_message(self, msg) -> None:
        if isinstance(msg, wire.PeerList):
            self._members = msg.peers
        elif isinstance(msg, wire.PeerDelta):
            self._members = list(apply_delta({p["id"]: p for p in self._members}, msg).values())

    # ------------------------------------------------------------ publishing

    async def publish(self, state_dict: dict | str | Path, served: str = DEFAULT_FORMAT) -> int:
        """Publish the next version of the weights; returns its number once it is announced.

        `state_dict`: the trainer's tensors, or the path of a checkpoint (a .safetensors
        file, or a Hugging Face model directory, whose shard layout and side files --
        config, tokenizer, generation files -- travel with the version). `served`: the
        served format (protocol/served.py: as-is, bf16, fp16, fp32, fp8-block). The
        caller's tensors are copied before this returns, and never referenced
        afterwards: the trainer may go on updating them.
        """
        check_format(served)
        async with self._publish_lock:
            return await self._publish(state_dict, served)

    async def _publish(self, state_dict: dict | str | Path | None, served: str) -> int:
        """`publish` under its lock; `state_dict` None: the served state again, as a keyframe only."""
        # After the latest stored version: a restart that could not replay the chain serves
        # an older state, and version numbers only move forward.
        version = max(-1 if self.served is None else self.served.version,
                      -1 if self.book.latest_version is None else self.book.latest_version) + 1
        keyframe_only = state_dict is None or self._keyframe_only_next
        # Cast, hash, code, sign and write the objects' files off the event loop:
        # serving chunks to nodes goes on meanwhile.
        try:
            new, stats, objects = await trio.to_thread.run_sync(self._encode, state_dict, served, version,
                                                                keyframe_only)
            # The book verifies what it takes, the origin's own manifests too: a 140,000-tensor
            # keyframe's took 0.47 s of the event loop, so large ones are checked in a thread
            # first (here: cancelled meanwhile, the version is rolled back like a failed encode).
            verified = [await self.manifest_check.check(envelope) for _, _, envelope in objects]
        except BaseException as e:
            # The served state is changed tensor by tensor as the patch is made: after a
            # failure part of it may be the new version's. Back to what is durable.
            with trio.CancelScope(shield=True):
                for key in [(version, False), (version, True)]:
                    self.store.drop(key)  # what it wrote of them: never adopted, never announced
                if self.served is not None:
                    self.served = await trio.to_thread.run_sync(self.durable.load, self.book)
            if ours(e):
                self.store.disk.failed(f"the objects of version {version}", e)
            raise
        for (key, m, envelope), checked in zip(objects, verified):
            self.store.adopt(key, m)
            self.book.offer(envelope, verified=checked)
        # The objects are durable before anyone hears of the version: after a crash the
        # origin continues from the base plus them.
        self.served = new
        if keyframe_only:
            self._keyframe_only_next, self._routed_at = False, version
        self._base_due = self._base_due or keyframe_only
        if self.durable.base is None or self._base_due and not self._compacting:
            # The first version (its keyframe holds it meanwhile), or one no patch chain bridges to
            # (after a compaction that is writing the base now: two writers would race).
            try:
                await trio.to_thread.run_sync(self.durable.write_base, new)
                self._base_due = False
            except OSError as e:
                self.store.disk.failed(f"the base at version {version} (tried again at the next publish)", e)
        else:
            self.store.disk.succeeded()
        self.history.append(stats)
        for key, m, envelope in objects:
            n = len(m.chunks)
            self.peers.broadcast(wire.Have(key[0], key[1], wire.bitfield_from_indices(range(n), n)))
            if not await self.tracker.send(wire.Announce(envelope)):
                log.warning("could not announce %s now; will when the tracker is back", describe(key))
        self._retire()
        if self.durable.due(version) and not self._compacting:
            self._compacting = True
            self._nursery.start_soon(self._compact, version, new.state_hash)
        what = ", ".join(f"{'keyframe' if k[1] else 'patch'} {m.total_bytes:,} B" for k, m, _ in objects)
        log.info("published version %d (%s; checkpoint %s B) in %.2f s", version, what,
                 f"{stats.full_bytes:,}", stats.encode_s)
        return version

    def _encode(self, state_dict, served_format: str, version: int, keyframe_only: bool = False):
        """Worker thread: the new served state, its stats and its signed objects, whose files
        are written as they are made. The served state is changed in place, tensor by
        tensor (one served copy, never two: diff_in_place). With `keyframe_only`, a keyframe
        and no patch; `state_dict` None: of the served state as it is."""
        t0 = time.perf_counter()
        prev = self.served
        if state_dict is None:
            layout = manifest_layout(self.book.get(max(k for k in self.book.keys() if k[0] == prev.version)),
                                     sorted(prev.state))
            specs = {n: TargetSpec(t.dtype, tuple(t.shape)) for n, t in prev.state.items()}
        else:
            src = (Source.from_path(state_dict, served_format) if isinstance(state_dict, (str, Path))
                   else Source.from_state(state_dict, served_format))
            specs = {n: TargetSpec(dt, shape) for n, (dt, shape) in src.table.items()}
            layout = src.layout
        objects = []
        patch_bytes = keyframe_bytes = changed = None
        # Chunks grow with the model, so that a manifest's chunk table fits one wire frame.
        state_bytes = sum(s.numel() * s.dtype.itemsize for s in specs.values())
        chunk_bytes = object_chunk_bytes(self.cfg.chunk_bytes, state_bytes, self.cfg.max_object_chunks)
        if state_dict is None:
            state, target_hash = prev.state, prev.state_hash
        elif prev is None:
            state = {n: src.produce(n) for n in sorted(specs)}
            target_hash = state_hash(state)
        else:
            # A keyframe-only version still moves the served state in place, its patch thrown
            # away: one served copy, never two, whatever the model's size.
            writer = None if keyframe_only else self.store.writer((version, False))
            counts: dict = {}
            p = diff_in_place(prev.state, specs, src.produce, prev.state_hash, layout=layout,
                              chunk_bytes=chunk_bytes, segment_elements=self.cfg.segment_elements,
                              on_chunk=(lambda chunk: None) if writer is None else writer.add, counts=counts)
            state, target_hash, changed = prev.state, p.target_hash, counts["changed"]
            if writer is not None:
                objects.append(self._seal((version, False), p, writer))
                patch_bytes = objects[-1][1].total_bytes
        if prev is None or keyframe_only or self._keyframe_due(patch_bytes):
            writer = self.store.writer((version, True))
            for chunk in keyframe_chunks(state, chunk_bytes):
                writer.add(chunk)
            names = sorted(state)
            k = Patch(kind="keyframe", base_hash=None, target_hash=target_hash,
                      tensors=[TensorSpec.of(n, state[n]) for n in names], full=names, removed=[], chunks=[],
                      layout=layout)
            objects.append(self._seal((version, True), k, writer))
            keyframe_bytes = objects[-1][1].total_bytes
        stats = VersionStats(version, patch_bytes, keyframe_bytes, _full_bytes(state), changed,
                             sum(t.numel() for t in state.values()), time.perf_counter() - t0)
        return Weights(state, version, target_hash, self.swarm_id), stats, objects

    def _seal(self, key: ObjKey, patch: Patch, writer) -> tuple:
        """Sign the manifest of an object whose chunks `writer` wrote, and write it last."""
        failpoints.hit("publish.written")  # a kill here: chunks on disk, no manifest, nothing announced
        created_at = time.time()
        for form, compact in self._manifest_forms(len(patch.tensors)):
            m = manifest_of(patch, swarm_id=self.swarm_id, version=key[0], created_at=created_at,
                            chunk_table=writer.table, compact=compact, form=form, origin_region=self.cfg.region)
            envelope = sign_manifest(m, self.key)
            size = len(wire.encode(wire.Announce(envelope)))
            if size <= wire.MAX_FRAME_BYTES:
                break
        else:  # no tracker or peer would take it: refused before it is adopted
            raise UsageError(f"{describe(key)}: a signed manifest of {size:,} bytes; one wire frame carries "
                             f"{wire.MAX_FRAME_BYTES:,} ({len(patch.tensors):,} tensors, {len(m.chunks):,} chunks of "
                             f"up to {max((z for z, _ in m.chunks), default=0):,} bytes: fewer chunks, i.e. a smaller "
                             f"max_object_chunks than {self.cfg.max_object_chunks:,}, or fewer tensors)")
        writer.finish(envelope)
        return key, m, envelope

    def _keyframe_chunk(self, index: int) -> bytes | None:
        """Worker thread, under the publish lock: chunk `index` of the served state's keyframe as
        `_encode` cut it (encoded up to that chunk); None past its end."""
        state = self.served.state
        chunk_bytes = object_chunk_bytes(self.cfg.chunk_bytes, _full_bytes(state), self.cfg.max_object_chunks)
        return next(itertools.islice(keyframe_chunks(state, chunk_bytes), index, None), None)

    def _manifest_forms(self, tensors: int) -> list[tuple[int, bool]]:
        """(form, compact) to try in turn: the first whose manifest fits one wire frame is sent.
        Form 1's compact `full` list, and form 2 below the threshold, only where the plain form
        1 cannot travel (members before them read neither)."""
        form1 = [(1, False), (1, True)]
        if self.cfg.manifest_form == 1:
            return form1
        if self.cfg.manifest_form == 2 or tensors > FORM1_MAX_TENSORS:
            return [(2, False)]
        return form1 + [(2, False)]

    async def _compact(self, version: int, target_hash: str) -> None:
        """Fold the patches since the base into a new base, below the serving loop's priority;
        the store keeps the chain (`_retire` asks `durable.keep_from`) until this is done."""
        try:
            await run_low_priority(lambda: self.durable.compact(version, target_hash), nice=19,
                                   name="patchswarm-compact")
        except (PatchswarmError, OSError) as e:
            log.error("compaction to version %d failed (%s); the base stays at version %s and the chain is kept",
                      version, e, self.durable.base.version if self.durable.base else None)
        finally:
            self._compacting = False
        self._retire()

    def _keyframe_due(self, patch_bytes: int) -> bool:
        """A keyframe is due when the patches since the last one cost more than it did."""
        keyframes = [k for k in self.store.keys() if k[1]]
        if not keyframes:
            return True
        last = max(keyframes)
        kf_bytes = self.store.manifest(last).total_bytes
        chain = sum(self.store.manifest(k).total_bytes for k in self.store.keys() if not k[1] and k[0] > last[0])
        return chain + patch_bytes > kf_bytes

    def _retire(self) -> None:
        """Keep what late joiners need (the latest keyframe's chain, recent patches) and what
        a restart replays (every patch after the base); drop the rest."""
        keep = set(self.book.retained(RETAIN_PATCHES))
        keep.update(k for k in self.store.keys() if not k[1] and k[0] >= self.durable.keep_from())
        for key in self.store.keys():
            if key not in keep:
                self.store.drop(key)
        floor = min((k[0] for k in keep), default=0)
        self.book.forget_below(floor)

    # ------------------------------------------------------------ watching a directory

    async def watch(self, directory: Path, served: str = DEFAULT_FORMAT) -> None:
        """Publish each new checkpoint in `directory` (name order, numbers by value:
        checkpoint-500 before checkpoint-1000) once it is in place, whole and unchanged
        between two polls (node/trainer/watch.py): trainers save in place, shard after shard."""
        directory = Path(directory)
        ledger = self.data_dir / "watched.json"
        done = set(json.loads(ledger.read_text())) if ledger.exists() else set()
        log.info("watching %s for checkpoints (%d already published)", directory, len(done))
        polls = Watch(directory)
        while True:
            for entry in await trio.to_thread.run_sync(polls.ready, done):
                try:
                    version = await self.publish(entry, served)
                except (PatchswarmError, OSError) as e:
                    if ours(e):
                        break  # our disk (publish told store.disk, which logs): the same checkpoint again later
                    log.error("skipping %s (whole, but not a checkpoint publish can read): %s", entry, e)
                else:
                    log.info("published %s as version %d", entry.name, version)
                done.add(entry.name)
                try:
                    _write_ledger(ledger, done)
                except OSError as e:  # rewritten whole after the next publish
                    self.store.disk.failed(f"the watch ledger {ledger}", e)
            await trio.sleep(max(WATCH_SECONDS, self.store.disk.retry_in()))

    # ------------------------------------------------------------ stats

    def stats(self) -> dict:
        return {
            "origin_id": self.id,
            "swarm_id": self.swarm_id,
            "version": self.version,
            "tracker_connected": self.tracker.connected,
            "listen": self.listen_addr,
            "nodes": sorted(s.id for s in self.peers.sessions.values()),
            "peers": sorted(({"id": s.id, "region": s.region, "role": s.role} for s in self.peers.sessions.values()),
                            key=lambda p: p["id"]),
            "bytes_out": self.peers.bytes_out,
            # Declared (--uplink-mbit), and as measured while its sends backed up (protocol/uplinkmeter.py).
            "uplink_mbit": self.cfg.uplink_mbit,
            "part_bytes": self.peers.part_bytes,  # the parts it sends, sized to that (protocol/assembly.py)
            "uplink_measured_mbit": self.peers.uplink.estimate_mbit(),
            "peers_dropped": dict(self.peers.dropped),  # and connections refused, by kind (node/peers.py)
            "sessions_replaced": self.peers.replaced,  # by the same member's new connection (its reconnect)
            "versions": [dataclasses.asdict(v) for v in self.history],
            "trajectories": self.trajectory_store.summary(self.version),
            **self.store.disk.status(),  # our disk failing writes (node/diskspace.py)
            "trajectory_disk_full": self.trajectory_store.disk.failing,
            "trajectory_batches_deferred": self.intake_deferred,
            # Chunks found changed on this disk when read (node/store.py), taken back from nodes, and
            # lost: no node brought them back (routed around by a keyframe-only version).
            "chunks_damaged": self.store.chunks_damaged,
            "chunks_recovered": self.recovery.recovered if self.recovery else 0,
            "chunks_lost": self.recovery.lost if self.recovery else 0,
        }


def _call_soon(token: trio.lowlevel.TrioToken, fn, *args) -> None:
    """`fn(*args)` on the origin's event loop, from any thread (the store reports a lost chunk
    from whichever thread read it); nothing once the loop has ended."""
    try:
        token.run_sync_soon(fn, *args)
    except trio.RunFinishedError:
        pass


def _try_acquire(sem: trio.Semaphore) -> bool:
    """Take a unit of `sem` if one is free now (no wait, no checkpoint)."""
    try:
        sem.acquire_nowait()
    except trio.WouldBlock:
        return False
    return True


class TrajectoryFeed:
    """The trainer's view of arriving trajectories (in arrival order, each once).

    Records below `min_version`, or more than `max_staleness` versions behind
    the origin's current version when read, are skipped and counted in
    `stale` / `below_min`, never silently dropped; with `max_staleness`, so are
    records of a version above the origin's (`ahead`: none such was published).
    """

    def __init__(self, origin: Origin, cursor: TrajectoryCursor):
        self._origin = origin
        self._cursor = cursor
        self._busy = False

    @property
    def stale(self) -> int:
        return self._cursor.stale

    @property
    def position(self) -> tuple[int, int]:
        """Where the next record will be read from: save it with the trainer's checkpoint
        and pass it as `trajectories(start=...)` to go on without reading a record twice."""
        return self._cursor.position

    @property
    def below_min(self) -> int:
        return self._cursor.below_min

    @property
    def ahead(self) -> int:
        """Records skipped (with max_staleness) for a policy version above the origin's."""
        return self._cursor.ahead

    async def get_batch(self, n: int, timeout: float | None) -> list[ReceivedRecord]:
        """Up to `n` records: returns once `n` are in, or when `timeout` seconds run out
        with what there is (0: what is there now; None or inf: no limit)."""
        check_batch_args(n, timeout)
        if self._busy:  # two calls would share the cursor (and a cancelled one rewind the other's)
            raise UsageError("get_batch: another get_batch on this feed is still waiting; use one feed per consumer")
        self._busy = True
        out: list[ReceivedRecord] = []
        c = self._cursor
        before = (c.position, c.stale, c.below_min, c.ahead, c.duplicates_seen, c.duplicates_by_key_seen)
        try:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                while True:
                    # In a worker thread: reading and decoding records is ~1 ms per MB, which
                    # the loop (every node's intake, chunk serving) must not stand still for.
                    # Only this call touches the cursor (`_busy`); the store's segment list
                    # and ends, which it reads, change by single assignments and appends.
                    # Shielded: a timeout of 0 still reads what is there (bounded by the disk).
                    with trio.CancelScope(shield=True):
                        out += await trio.to_thread.run_sync(
                            functools.partial(self._cursor.read, n - len(out), current_version=self._origin.version))
                    if len(out) >= n:
                        break
                    await self._origin.trajectory_store.wait_for_records(self._cursor)
        except BaseException:  # cancelled from outside (the origin closing): nothing was delivered
            (c.position, c.stale, c.below_min, c.ahead, c.duplicates_seen,
             c.duplicates_by_key_seen) = before  # read again next time
            raise
        finally:
            self._busy = False
        return out


def check_batch_args(n, timeout) -> None:
    """UsageError unless `n` is an int >= 0 and `timeout` None or a number >= 0."""
    if type(n) is not int or n < 0:
        raise UsageError(f"get_batch: expected n, an int >= 0, found {type(n).__name__} {n!r}")
    if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0):  # NaN fails >= too
        raise UsageError(f"get_batch: expected a timeout of None or seconds >= 0, found "
                         f"{type(timeout).__name__} {timeout!r}")


def _write_ledger(path: Path, done: set[str]) -> None:
    """The checkpoints published so far, replaced whole (a failed write leaves the old one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(sorted(done)))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class SyncOrigin:
    """An `Origin` running in a background thread, for a plain (non-async) training loop.

        with SyncOrigin(tracker=..., creds=..., key=..., data_dir=..., listen="127.0.0.1:0") as origin:
            v = origin.publish(model.state_dict())
    """

    def __init__(self, **config):
        self.origin = Origin(OriginConfig(**{k: Path(v) if k in ("creds", "key", "data_dir") else v
                                             for k, v in config.items()}))
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def __enter__(self) -> "SyncOrigin":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, timeout: float = 60.0) -> None:
        self._thread = threading.Thread(target=self._main, name="patchswarm-origin", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise UsageError(f"origin did not start within {timeout} s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        async def main():
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._cancel = scope
                async with trio.open_nursery() as n:
                    await n.start(self.origin.run)
                    self._started.set()
        try:
            trio.run(main)
        except BaseException as e:  # reported to the caller of start(), or on the next call
            self._error = e
            self._started.set()

    def _call(self, fn, *args, sync: bool = False):
        """`fn(*args)` on the origin's trio thread. UsageError once the origin has stopped
        or been closed, also for a call that was waiting when it closed (that call's task
        was cancelled: trio.Cancelled must not reach the caller's thread)."""
        if self._error is not None:
            raise UsageError(f"origin stopped: {self._error}")
        token = self._token
        if self._thread is None or token is None:
            raise UsageError(f"{fn.__name__}: the origin is closed (or was never started)")
        try:
            if sync:
                return trio.from_thread.run_sync(fn, *args, trio_token=token)
            return trio.from_thread.run(fn, *args, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled):
            if self._error is not None:
                raise UsageError(f"origin stopped: {self._error}") from None
            raise UsageError(f"{fn.__name__}: the origin was closed") from None

    def publish(self, state_dict: dict | str | Path, served: str = DEFAULT_FORMAT) -> int:
        return self._call(self.origin.publish, state_dict, served)

    def stats(self) -> dict:
        return self._call(self.origin.stats, sync=True)

    def trajectories(self, min_version: int | None = None, max_staleness: int | None = None,
                     start: tuple[int, int] | None = None) -> "SyncTrajectoryFeed":
        feed = self._call(self.origin.trajectories, min_version, max_staleness, start, sync=True)
        return SyncTrajectoryFeed(self, feed)

    @property
    def listen_addr(self) -> str:
        return self.origin.listen_addr

    def close(self) -> None:
        if self._thread is None:
            return
        if self._cancel is not None and self._error is None:
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout=30)
        self._thread = None
        self._token = None


class SyncTrajectoryFeed:
    """`TrajectoryFeed` for a plain training loop: `get_batch(n, timeout)` blocks."""

    def __init__(self, owner: SyncOrigin, feed: TrajectoryFeed):
        self._owner = owner
        self._feed = feed

    @property
    def stale(self) -> int:
        return self._feed.stale

    @property
    def below_min(self) -> int:
        return self._feed.below_min

    @property
    def ahead(self) -> int:
        return self._feed.ahead

    @property
    def position(self) -> tuple[int, int]:
        return self._feed.position

    def get_batch(self, n: int, timeout: float | None) -> list[ReceivedRecord]:
        check_batch_args(n, timeout)
        return self._owner._call(self._feed.get_batch, n, timeout)
