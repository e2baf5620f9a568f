"""The origin role on the trainer: publish(state_dict) -> patch, sign, seed; trajectories in.

Owns: casting the trainer's state to the served dtype, coding each version
against the previous served one (a keyframe first, then patches, and a
keyframe again whenever the chain since the last one has cost more than a
keyframe), signing manifests with the trainer key, keeping the published
objects on disk and serving their chunks to nodes, announcing every version
to the tracker (again after a tracker restart), and `--watch`ing a checkpoint
directory. State survives restarts: the latest served weights and every
retained object live under the data dir, so version numbers continue.

`Origin` is the trio service; `SyncOrigin` runs one in a background thread
for a plain training loop (the only thread, behind that one interface).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from pathlib import Path

import torch
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol import wire
from patchswarm.protocol.errors import CorruptData, InvalidInput, PatchswarmError, StorageFailed, UsageError
from patchswarm.protocol.manifest import sign_manifest
from patchswarm.protocol.patch import diff, keyframe
from patchswarm.protocol.publication import ObjKey, describe, manifest_of
from patchswarm.protocol.statehash import state_hash
from patchswarm.protocol.trajectory import ReceivedRecord, decode_batch
from patchswarm.protocol.versions import VersionBook

from patchswarm.node.checkpoint import load_state
from patchswarm.node.peers import PeerDropped, PeerSet, Session
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.store import ObjectStore
from patchswarm.node.trainer.trajstore import TrajectoryCursor, TrajectoryStore
from patchswarm.node.net.trackerlink import TrackerLink
from patchswarm.node.net.transport import CONNECTION_ERRORS, serve
from patchswarm.node.net.trust import Credentials, swarm_id_of
from patchswarm.node.weights import WEIGHTS_NAME, Weights, read_weights, write_weights

log = logging.getLogger("patchswarm.origin")

RETAIN_PATCHES = 64  # patches kept besides the latest keyframe's chain, for nodes a little behind
ORIGIN_CHUNK_BYTES = 1 << 20  # swarm pieces: small enough that a few MB spread over many peers at once
ORIGIN_SEGMENT_ELEMENTS = 1 << 20  # a chunk holds whole segments; smaller segments, finer pieces
WATCH_SECONDS = 0.5


@dataclasses.dataclass
class OriginConfig:
    tracker: str
    creds: Path
    key: Path
    data_dir: Path
    listen: str
    region: str = "default"
    upload_limit: float | None = None
    chunk_bytes: int = ORIGIN_CHUNK_BYTES
    segment_elements: int = ORIGIN_SEGMENT_ELEMENTS


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


def served_copy(state_dict: dict, served_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The served state: floating tensors cast to `served_dtype`, all detached, contiguous, on the CPU."""
    if not isinstance(state_dict, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in state_dict.items()):
        raise UsageError("publish: expected a dict[str, torch.Tensor] (a model's state_dict)")
    out = {}
    for k, v in state_dict.items():
        t = v.detach().to("cpu")
        if t.is_floating_point() and t.dtype != served_dtype:
            t = t.to(served_dtype)  # a new tensor
        elif t.numel() and t.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
            t = t.clone()  # never keep a view of what the trainer will overwrite
        out[k] = t.contiguous()
    return out


def _full_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Origin:
    def __init__(self, cfg: OriginConfig):
        self.cfg = cfg
        self.creds = Credentials.load(cfg.creds)
        if self.creds.role != "origin":
            raise UsageError(f"{cfg.creds}: expected credentials with role origin, found {self.creds.role!r}")
        self.key = load_trainer_key(cfg.key)
        pub = self.key.public_key()
        if swarm_id_of(pub) != self.creds.swarm_id():
            raise UsageError(f"{cfg.key}: this trainer key does not match {self.creds.trainer_pub} of the credentials")
        self.id = self.creds.name
        self.swarm_id = self.creds.swarm_id()
        self.data_dir = Path(cfg.data_dir)
        self.book = VersionBook(self.swarm_id, pub)
        self.store: ObjectStore | None = None
        self.served: Weights | None = None
        self.upload = TokenBucket(cfg.upload_limit)
        self.peers = PeerSet(self.id, None, self.upload, self._on_message, on_open=self._on_open)
        self.listen_addr = cfg.listen
        self.tracker = TrackerLink(cfg.tracker, self.creds, self._hello, self._on_tracker_message,
                                   on_connect=self._on_tracker_connect)
        self.history: list[VersionStats] = []
        self.trajectory_store: TrajectoryStore | None = None
        self._publish_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._members: list[dict] = []

    @property
    def version(self) -> int | None:
        return None if self.served is None else self.served.version

    # ------------------------------------------------------------ life

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.served = await trio.to_thread.run_sync(self._load_served)
        self.store = ObjectStore(self.data_dir / "objects")
        self.peers.store = self.store
        for line in self.store.load(self.book, None):
            log.warning("dropped from the object store: %s", line)
        for key in self.store.keys():
            # Objects are written whole, then the served weights, then announced: anything
            # incomplete or beyond the served version was never announced.
            if not self.store.complete(key) or key[0] > (-1 if self.version is None else self.version):
                log.warning("dropping %s: its publish was interrupted before it was announced", describe(key))
                self.store.drop(key)
                self.book.discard(key)
        self.trajectory_store = await TrajectoryStore.open(self.data_dir / "trajectories")
        for problem in self.trajectory_store.problems:
            log.warning("trajectory store: %s (intact records around it are kept)", problem)
        try:
            await self._run(task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self.trajectory_store.aclose()

    async def _run(self, task_status) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.listen_addr = await nursery.start(self._serve_peers)
            log.info("origin %s (region %s) listening on %s; %s", self.id, self.cfg.region, self.listen_addr,
                     "nothing published yet" if self.served is None else f"at version {self.version}")
            nursery.start_soon(self.tracker.run)
            task_status.started(self)

    def _load_served(self) -> Weights | None:
        w = read_weights(self.data_dir / WEIGHTS_NAME)
        if w is not None and w.swarm_id != self.swarm_id:
            raise UsageError(f"{self.data_dir}: holds weights of swarm {w.swarm_id}, this origin is {self.swarm_id}")
        return w

    def _hello(self) -> wire.Hello:
        return wire.Hello(self.id, self.cfg.region, "origin", self.listen_addr,
                          [] if self.version is None else [self.version])

    async def _serve_peers(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await serve(self.cfg.listen, self.creds, {"node"}, self._hello,
                    lambda ms: self.peers.run(ms, outbound=False),
                    on_refused=lambda why: log.warning("refused a connection: %s", why), task_status=task_status)

    async def _on_open(self, s: Session) -> None:
        log.info("node %s (region %s) connected", s.id, s.region)

    async def _on_message(self, s: Session, msg) -> None:
        if isinstance(msg, wire.Trajectories):
            try:
                records = decode_batch(msg.batch)
            except CorruptData as e:
                raise PeerDropped(f"sent an undecodable trajectory batch: {e}") from None
            wrong = next((r.node_id for r in records if r.node_id != s.id), None)
            if wrong is not None:
                raise PeerDropped(f"sent trajectories in the name of node {wrong!r}")
            # Stored and acked in its own task: batches from one node commit together with
            # other nodes' batches (one fsync), and the connection keeps reading meanwhile.
            self._nursery.start_soon(self._store_and_ack, s, records)
            return
        if isinstance(msg, (wire.Have, wire.HaveOne, wire.Incoming, wire.Heartbeat)):
            return
        if isinstance(msg, wire.Error):
            log.warning("node %s says: %s", s.id, msg.message)
            return
        raise PeerDropped(f"sent {type(msg).__name__}, which the origin does not take")

    async def _store_and_ack(self, s: Session, records) -> None:
        try:
            seqs = await self.trajectory_store.append(records)
        except StorageFailed as e:
            log.error("trajectory store failed (%s); closing %s's connection so it resends later", e, s.id)
            s.close(f"trajectory store failed ({e})")
            return
        if not s.closed:
            try:
                await s.send(wire.TrajectoriesAck(seqs))
            except CONNECTION_ERRORS as e:
                # The node resends after reconnecting; the store drops the duplicates.
                s.close(f"could not send a TrajectoriesAck ({type(e).__name__})")

    def trajectories(self, min_version: int | None = None, max_staleness: int | None = None) -> "TrajectoryFeed":
        """Trajectories in arrival order, from the first one stored; see TrajectoryFeed."""
        return TrajectoryFeed(self, self.trajectory_store.cursor(min_version=min_version,
                                                                 max_staleness=max_staleness))

    # ------------------------------------------------------------ tracker

    async def _on_tracker_connect(self, ms) -> None:
        for key in self.book.retained(RETAIN_PATCHES):
            await ms.send(wire.Announce(self.book.envelope(key)))

    async def _on_tracker_message(self, msg) -> None:
        if isinstance(msg, wire.PeerList):
            self._members = msg.peers

    # ------------------------------------------------------------ publishing

    async def publish(self, state_dict: dict, served_dtype: torch.dtype = torch.bfloat16) -> int:
        """Publish the next version of the weights; returns its number once it is announced.

        The caller's tensors are copied (cast to `served_dtype`) before this returns, and
        never referenced afterwards: the trainer may go on updating them.
        """
        async with self._publish_lock:
            version = 0 if self.served is None else self.served.version + 1
            # Cast, hash, code, sign and write the objects' files off the event loop:
            # serving chunks to nodes goes on meanwhile.
            new, stats, objects = await trio.to_thread.run_sync(self._encode, state_dict, served_dtype, version)
            for key, m, envelope, chunks in objects:
                self.store.adopt(key, m)
                self.book.offer(envelope)
            # The served state is durable before anyone hears of the version: after a
            # crash the origin continues from exactly what it announced.
            await trio.to_thread.run_sync(write_weights, self.data_dir / WEIGHTS_NAME, new)
            self.served = new
            self.history.append(stats)
            for key, m, envelope, chunks in objects:
                self.peers.broadcast(wire.Have(key[0], key[1], wire.bitfield_from_indices(range(len(chunks)), len(chunks))))
                if not await self.tracker.send(wire.Announce(envelope)):
                    log.warning("could not announce %s now; will when the tracker is back", describe(key))
            self._retire()
            what = ", ".join(f"{'keyframe' if k[1] else 'patch'} {m.total_bytes:,} B" for k, m, _, _ in objects)
            log.info("published version %d (%s; checkpoint %s B) in %.2f s", version, what,
                     f"{stats.full_bytes:,}", stats.encode_s)
            return version

    def _encode(self, state_dict: dict, served_dtype: torch.dtype, version: int):
        """Worker thread: the served state, its stats and its signed objects (files written)."""
        t0 = time.perf_counter()
        served = served_copy(state_dict, served_dtype)
        target_hash = state_hash(served)
        prev = self.served
        parts: list[tuple[ObjKey, object]] = []
        patch_bytes = keyframe_bytes = changed = None
        if prev is not None:
            p = diff(prev.state, served, base_hash=prev.state_hash, target_hash=target_hash,
                     chunk_bytes=self.cfg.chunk_bytes, segment_elements=self.cfg.segment_elements)
            parts.append(((version, False), p))
            patch_bytes = sum(len(c) for c in p.chunks)
            changed = p.stats()["changed"]
        if prev is None or self._keyframe_due(patch_bytes):
            k = keyframe(served, chunk_bytes=self.cfg.chunk_bytes, state_hash_hex=target_hash)
            parts.append(((version, True), k))
            keyframe_bytes = sum(len(c) for c in k.chunks)
        objects = []
        for key, patch in parts:
            m = manifest_of(patch, swarm_id=self.swarm_id, version=version, created_at=time.time())
            envelope = sign_manifest(m, self.key)
            self.store.write_object(key, envelope, patch.chunks)
            objects.append((key, m, envelope, patch.chunks))
        stats = VersionStats(version, patch_bytes, keyframe_bytes, _full_bytes(served), changed,
                             sum(t.numel() for t in served.values()), time.perf_counter() - t0)
        return Weights(served, version, target_hash, self.swarm_id), stats, objects

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
        keep = set(self.book.retained(RETAIN_PATCHES))
        for key in self.store.keys():
            if key not in keep:
                self.store.drop(key)
        floor = min((k[0] for k in keep), default=0)
        self.book.forget_below(floor)

    # ------------------------------------------------------------ watching a directory

    async def watch(self, directory: Path, served_dtype: torch.dtype = torch.bfloat16) -> None:
        """Publish each new checkpoint in `directory` (name order) once it is in place."""
        directory = Path(directory)
        ledger = self.data_dir / "watched.json"
        done = set(json.loads(ledger.read_text())) if ledger.exists() else set()
        log.info("watching %s for checkpoints (%d already published)", directory, len(done))
        while True:
            for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
                if entry.name in done or not _complete_checkpoint(entry):
                    continue
                try:
                    state, _ = await trio.to_thread.run_sync(load_state, entry)
                except (PatchswarmError, OSError) as e:
                    log.warning("skipping %s: %s", entry, e)
                    done.add(entry.name)
                    continue
                version = await self.publish(state, served_dtype)
                log.info("published %s as version %d", entry.name, version)
                done.add(entry.name)
                ledger.write_text(json.dumps(sorted(done)))
            await trio.sleep(WATCH_SECONDS)

    # ------------------------------------------------------------ stats

    def stats(self) -> dict:
        return {
            "origin_id": self.id,
            "swarm_id": self.swarm_id,
            "version": self.version,
            "tracker_connected": self.tracker.connected,
            "listen": self.listen_addr,
            "nodes": sorted(s.id for s in self.peers.sessions.values()),
            "bytes_out": self.peers.bytes_out,
            "versions": [dataclasses.asdict(v) for v in self.history],
            "trajectories": self.trajectory_store.summary(self.version),
        }


class TrajectoryFeed:
    """The trainer's view of arriving trajectories (in arrival order, each once).

    Records below `min_version`, or more than `max_staleness` versions behind
    the origin's current version when read, are skipped and counted in
    `stale` / `below_min`, never silently dropped.
    """

    def __init__(self, origin: Origin, cursor: TrajectoryCursor):
        self._origin = origin
        self._cursor = cursor

    @property
    def stale(self) -> int:
        return self._cursor.stale

    @property
    def below_min(self) -> int:
        return self._cursor.below_min

    async def get_batch(self, n: int, timeout: float) -> list[ReceivedRecord]:
        """Up to `n` records: returns once `n` are in, or when `timeout` runs out with what there is."""
        out: list[ReceivedRecord] = []
        with trio.move_on_after(timeout):
            while True:
                out += self._cursor.read(n - len(out), current_version=self._origin.version)
                if len(out) >= n:
                    break
                await self._origin.trajectory_store.wait_for_records(self._cursor)
        return out


_TEMP = re.compile(r"(^\.)|(\.tmp)|(\.partial$)|(~$)")


def _complete_checkpoint(p: Path) -> bool:
    """A checkpoint that has been renamed into place: a .safetensors file, or a shard directory."""
    if _TEMP.search(p.name):
        return False
    if p.is_file():
        return p.suffix == ".safetensors"
    return p.is_dir() and any(f.suffix == ".safetensors" for f in p.iterdir())


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

    def _call(self, fn, *args):
        if self._error is not None:
            raise UsageError(f"origin stopped: {self._error}")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def publish(self, state_dict: dict, served_dtype: torch.dtype = torch.bfloat16) -> int:
        return self._call(self.origin.publish, state_dict, served_dtype)

    def stats(self) -> dict:
        return trio.from_thread.run_sync(self.origin.stats, trio_token=self._token)

    def trajectories(self, min_version: int | None = None, max_staleness: int | None = None) -> "SyncTrajectoryFeed":
        feed = trio.from_thread.run_sync(self.origin.trajectories, min_version, max_staleness, trio_token=self._token)
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

    def get_batch(self, n: int, timeout: float) -> list[ReceivedRecord]:
        return self._owner._call(self._feed.get_batch, n, timeout)
