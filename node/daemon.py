"""The node daemon: joins the swarm, fetches and verifies chunks, applies versions in order, serves peers.

Owns one member's life and wiring: the data dir (its lock, the object store,
the trajectory spool, the weights file), one nursery for every task, and the
parts that each do one job, connected here:

- `TrackerLink` (node/net/trackerlink.py): membership and version notices;
- `ManifestRelay` (node/manifestrelay.py): manifests passed on to peers, and
  asked of the tracker after a hint no peer answered;
- `Dialer` (node/dialer.py): whom to connect to, and dialing them;
- `PeerSet` (node/peers.py): the sessions, and serving chunks on them;
- `Fetcher` (node/fetcher.py): executing the piece picker's answers
  (protocol/picker.py), taking chunks in, telling peers what arrives;
- `Applier` (node/applier.py): manifests, the plan, applying versions in
  order to the weights file (node/weights.py);
- `TrajectoryUploader` (node/uploader.py): the spool to the origin;
- `LocalRequests` (node/localapi.py): the local socket's requests.

Messages from peers are routed here to the part they concern. Must not do
any part's job itself.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import logging
import os
import time
from pathlib import Path

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.peersets import apply_delta
from patchswarm.protocol.picker import (ENDGAME_AFTER, ORIGIN_PIPELINE, SLOW_CHUNK_MIN_S, SLOW_CHUNK_S, SNUB_AFTER,
                                        WAN_GATEWAYS, PiecePicker)
from patchswarm.protocol.publication import describe
from patchswarm.protocol.responsibility import swarm_wan_rates
from patchswarm.protocol.uplinkmeter import UplinkReport
from patchswarm.protocol.versions import VersionBook

from patchswarm.node.applier import Applier
from patchswarm.node.dialer import Dialer, rank
from patchswarm.node.fetcher import REQUEST_TIMEOUT, Fetcher
from patchswarm.node.localapi import BufferBudget, LocalRequests, serve_local
from patchswarm.node.lowprio import APPLY_NICE
from patchswarm.node.net.admission import CONNECTION_BURST, MemberAdmission
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.net.rtcsignal import RTCSignaller
from patchswarm.node.net.service import DRAIN_S, format_wan_rates
from patchswarm.node.net.trackerlink import TrackerLink
from patchswarm.node.manifestrelay import ManifestRelay
from patchswarm.node.net.transport import serve, transport_of
from patchswarm.node.net.trust import Credentials
from patchswarm.node.net.webrtc import IceConfig
from patchswarm.node.peers import PeerDropped, PeerSet, Session
from patchswarm.node.relay import Inflows
from patchswarm.node.spool import TrajectorySpool
from patchswarm.node.store import ObjectStore
from patchswarm.node.uploader import TrajectoryUploader
from patchswarm.node.engines import make_engine
from patchswarm.node.modelsink import ModelSink
from patchswarm.node.persistence import COMPACT_EVERY, DurableState
from patchswarm.node.changelog import DIRNAME as CHANGES_DIR
from patchswarm.node.weights import WEIGHTS_NAME

# How often the node looks at its uplink estimate (a median of at most 32 samples); a change is
# sent to the tracker at once, so a host found slow mid-version re-plans its region within ~1 s.
UPLINK_CHECK_S = 0.5
log = logging.getLogger("patchswarm.node")

KEEP_VERSIONS = 4  # objects kept after they are applied, to serve peers that are behind
SPOOL_BYTES = 1 << 30  # trajectories kept while the origin is unreachable; submit waits beyond


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
    keep_keyframe: bool = True  # hold the latest keyframe, once held, for late joiners (Applier.joiners_keyframe)
    seed: int | None = None
    spool_bytes: int = SPOOL_BYTES
    apply_nice: int = APPLY_NICE
    apply_threads: int | None = None  # None: as many as the cores (protocol/parallel.py)
    wan_gateways: int | None = WAN_GATEWAYS
    wan_rates: dict[str, float] | None = None  # region -> WAN rate (the chains' order), where the tracker gives none
    advertise: str | None = None  # the address told to the tracker and peers; None: the bound listen address
    transport: str = "tcp"  # to other nodes: tcp | webrtc | auto (node/dialer.py); webrtc and auto answer offers
    no_listen: bool = False  # accept nothing inbound (behind NAT): advertise no address
    ice: IceConfig = IceConfig()
    compact_every: int = COMPACT_EVERY  # versions between full writes of the state (node/persistence.py)
    model_dir: Path | None = None  # the current version as a model directory (node/modelsink.py)
    engine: str | None = None  # sglang | vllm
    engine_url: str | None = None
    on_version: str | None = None  # a command run per version
    sparse_handoff: bool = False  # record each version's changes for NodeClient.follow (node/changelog.py)
    # Connections one member may open to this node: this many in a row and a minute
    # (node/net/admission.py); 0: no limit.
    member_connections: int = CONNECTION_BURST
    # This host's uplink in Mbit/s (--uplink-mbit), declared in its Hello (wire revision 5) and passed by
    # the tracker to every member, which all plan with it: a slow one relays less; None: declares none.
    uplink_mbit: float | None = None
    # Refuse peers (nodes, the origin) whose certificate names no region (--require-region): a
    # region-less certificate lets its member say any region to this member directly.
    require_region: bool = False
    # On SIGTERM/SIGINT: seconds to keep uploading the trajectory spool before exiting (drain).
    drain_s: float = DRAIN_S


class Node:
    """One node daemon. The parts that need the data dir (store, spool, weights)
    are built by `run`, after the data dir's lock is held."""

    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.creds = Credentials.load(cfg.creds)
        if self.creds.role != "node":
            raise UsageError(f"{cfg.creds}: expected credentials with role node, found {self.creds.role!r}")
        self.creds.check_region(cfg.region)  # every peer would refuse another region: say so now
        self.creds = dataclasses.replace(self.creds, require_region=cfg.require_region)
        self.id = self.creds.name
        self.region = cfg.region
        self.swarm_id = self.creds.swarm_id()
        self.data_dir = Path(cfg.data_dir)
        self.engine = make_engine(cfg.engine, cfg.engine_url, cfg.on_version)  # a usage error before anything starts
        self.listen_addr = cfg.listen
        self.started_at = time.time()
        self.book = VersionBook(self.swarm_id, self.creds.trainer_public_key())
        self.upload = TokenBucket(cfg.upload_limit)
        self.download = TokenBucket(cfg.download_limit)
        self.inflows = Inflows()
        self.local_budget = BufferBudget()  # bytes the local socket's clients may have it hold (node/localapi.py)
        n = cfg.member_connections
        self.admission = MemberAdmission(n, n) if n else None
        seed = cfg.seed if cfg.seed is not None else int.from_bytes(rank(self.id, "seed")[:4], "big")
        # The origin's region comes with the first peer list; facts about peers are taken before.
        self.picker = PiecePicker(self.id, self.region, None, seed=seed, wan_gateways=cfg.wan_gateways,
                                  request_timeout=REQUEST_TIMEOUT, wan_rates=cfg.wan_rates,
                                  origin_pipeline=ORIGIN_PIPELINE, endgame_after=ENDGAME_AFTER,
                                  snub_after=SNUB_AFTER, slow_chunk_s=SLOW_CHUNK_S,
                                  slow_chunk_min_s=SLOW_CHUNK_MIN_S)
        self._rates_warned: dict[str, float] | None = None  # the tracker's rates last warned of
        self.peers = PeerSet(self.id, None, self.upload, self._on_message,  # store set in run()
                             on_open=self._on_peer_open, on_close=self._on_peer_close, inflows=self.inflows)
        self.peers.declared_uplink_mbit, self.peers.region = cfg.uplink_mbit, self.region
        # What this node says its uplink is: declared, or lower where it measured far less (_watch_uplink).
        self.uplink_said = UplinkReport(cfg.uplink_mbit)
        self.tracker = TrackerLink(cfg.tracker, self.creds, self._hello, self._on_tracker_message,
                                   revocations_file=self.data_dir / "revocations")
        self.rtc = None if cfg.transport == "tcp" else RTCSignaller(
            self.creds, cfg.ice, self.tracker.send, self._hello, self._accepted, on_receive=self.download.take)
        self.dialer = Dialer(self.id, self.region, self.creds, self.peers, self._hello, self.download,
                             no_peers=cfg.no_peers, rtc=self.rtc, transport=cfg.transport)
        self.store: ObjectStore | None = None
        self.fetcher: Fetcher | None = None
        self.applier: Applier | None = None
        self.manifests: ManifestRelay | None = None
        self.spool: TrajectorySpool | None = None
        self.uploader: TrajectoryUploader | None = None
        self.local: LocalRequests | None = None
        self._lock_fd: int | None = None

    @property
    def version(self) -> int | None:
        return None if self.applier is None else self.applier.version

    # ------------------------------------------------------------ life

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._check_layout()
        self._lock_data_dir()
        self.store = ObjectStore(self.data_dir / "objects")
        self.peers.store = self.store
        self.fetcher = Fetcher(self.id, self.region, self.picker, self.peers, self.inflows, self.store, self.book,
                               on_complete=lambda key: self.applier.completed(key),
                               download_rate=self.download.rate)
        # The current version is the base file plus the stored patches after it, replayed and
        # verified: a version is durable once its object is (chunks first, manifest last).
        durable = DurableState(self.data_dir, self.store, self.swarm_id, self.cfg.compact_every)
        durable.check_swarm()  # first: the store drops what does not verify, another swarm's objects too
        for line in self.store.load(self.book, None):
            log.warning("dropped from the object store: %s", line)
        self.applier = Applier(self.book, self.store, self.fetcher, durable,
                               keep_versions=self.cfg.keep_versions, apply_nice=self.cfg.apply_nice,
                               apply_threads=self.cfg.apply_threads, sink=self._model_sink(),
                               record_changes=self.cfg.sparse_handoff, keep_keyframe=self.cfg.keep_keyframe)
        self.manifests = ManifestRelay(self.applier.offer, self._has_manifest, self.peers, self.tracker.send)
        self.applier.weights = await trio.to_thread.run_sync(self.applier.load_weights)
        self.spool = await TrajectorySpool.open(self.data_dir / "spool", self.id, self.region,
                                                max_bytes=self.cfg.spool_bytes)
        for problem in self.spool.problems:
            log.warning("trajectory spool: %s (intact records around it are kept)", problem)
        self.uploader = TrajectoryUploader(self.spool, self._origin_session)
        try:
            await self._run(task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self.spool.aclose()

    def _model_sink(self) -> ModelSink | None:
        if self.engine is None and self.cfg.model_dir is None:
            return None
        return ModelSink(self.cfg.model_dir or self.data_dir / "model", self.engine, self.cfg.apply_nice)

    async def _run(self, task_status) -> None:
        local = self.local = LocalRequests(self.status, self.applier.wait_version, lambda: self.version, self.spool,
                                           changelog=self.applier.changelog)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.fetcher.run)  # first: pieces may come as soon as peers can connect
            self.listen_addr = "" if self.cfg.no_listen else await nursery.start(self._serve_peers)
            if self.rtc is not None:
                await nursery.start(self.rtc.run)
            await nursery.start(functools.partial(serve_local, self.data_dir / "node.sock", local,
                                                  budget=self.local_budget))
            log.info("node %s (region %s) listening on %s, at %s; local socket %s", self.id, self.region,
                     self.listen_addr or "no address (--no-listen)",
                     "no version yet" if self.version is None else f"version {self.version}",
                     self.data_dir / "node.sock")
            nursery.start_soon(self.manifests.run)
            nursery.start_soon(self.tracker.run)
            nursery.start_soon(self.dialer.run)
            nursery.start_soon(self._watch_uplink)
            if self.applier.sink is not None:
                nursery.start_soon(self.applier.sink.run)
                await self.applier.hand_off_loaded()
            nursery.start_soon(self.applier.run)
            nursery.start_soon(self.uploader.run)
            task_status.started(self)

    async def drain(self) -> None:
        """Before a stop (the first SIGTERM or SIGINT): refuse new submits (code "stopping")
        and upload what the trajectory spool holds, for at most `drain_s`, while everything
        else runs on (peers are still served). The caller cancels the node afterwards."""
        if self.local is None:
            return  # stopped before it served (the spool and uploader come first)
        self.local.stopping = self.tracker.stopping = True
        held = self.spool.unacked
        if not held:
            return
        if self.cfg.drain_s > 0:
            log.info("stopping: uploading the %d records in the trajectory spool, for up to %g s "
                     "(a second SIGTERM or SIGINT stops at once)", held, self.cfg.drain_s)
        try:
            await self.uploader.drain(self.cfg.drain_s)
        finally:  # a second signal cancels the wait: say what it left all the same
            left = self.spool.unacked
            if left:
                log.warning("stopping with %d of the spool's records not acknowledged by the origin: they "
                            "upload when this node starts again with this data dir", left)
            else:
                log.info("stopping: the origin acknowledged every record the spool held (%d)", held)

    def _check_layout(self) -> None:
        """A file where the data dir has a folder, or the reverse, is refused with its name
        (else: a bare `File exists`, or base writes failing as if our disk were)."""
        for name, folder in (("lock", False), (WEIGHTS_NAME, False), ("objects", True), ("spool", True),
                             (CHANGES_DIR, True)):
            p = self.data_dir / name
            if p.exists() and p.is_dir() != folder:
                raise UsageError(f"{p}: expected {'a directory' if folder else 'a file'}, found "
                                 f"{'a directory' if p.is_dir() else 'a file'}; move it away to start")

    def _lock_data_dir(self) -> None:
        fd = os.open(self.data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{self.data_dir}: another daemon is running on this data dir") from None
        self._lock_fd = fd  # held until the process exits

    def _hello(self) -> wire.Hello:
        # One Hello for every connection: exchange_hello leaves the uplink out below revision 5.
        # The tracker link builds one per heartbeat, which says the uplink too (revision 6).
        return wire.Hello(self.id, self.region, "node", self.cfg.advertise or self.listen_addr,
                          [] if self.version is None else [self.version], uplink=self.uplink_said.value)

    async def _watch_uplink(self) -> None:
        """Keep what this node says its uplink is up to date (`uplink_said`: --uplink-mbit, or what
        it measured where that is far under it, or under what its region's other nodes say where
        it declares none; protocol/uplinkmeter.py `reported_uplink`). On a change this node plans
        with the new value at once and sends the tracker a heartbeat that says it, which the
        tracker's next delta tells the others."""
        said = self.uplink_said
        while True:
            await trio.sleep(UPLINK_CHECK_S)
            now = trio.current_time()
            measured = self.peers.uplink.estimate_mbit(now)
            if not said.update(now, measured, self._region_says()):
                continue
            log.info("this node now says its uplink is %s Mbit/s (declared: %s; measured while its sends "
                     "backed up: %s): each version's plan takes it",
                     "none" if said.value is None else f"{said.value:g}",
                     "none" if said.declared is None else f"{said.declared:g}", measured)
            if self.dialer.members:
                self._on_peer_list(list(self.dialer.members.values()))
            with trio.move_on_after(UPLINK_CHECK_S * 10):  # a tracker that reads nothing: the periodic one says it
                await self.tracker.heartbeat_now()

    # ------------------------------------------------------------ tracker

    async def _on_tracker_message(self, msg) -> None:
        if isinstance(msg, wire.PeerList):  # a session's first: what an earlier one said of us is old
            self.dialer.set_unreachable(None)
            self._on_wan_rates(msg.wan_rates)
            self._on_peer_list(msg.peers)
        elif isinstance(msg, wire.PeerDelta):
            self._on_peer_list(list(apply_delta(self.dialer.members, msg).values()))
        elif isinstance(msg, wire.VersionNotice):
            await self.manifests.notice(msg, None)
        elif isinstance(msg, wire.VersionHint):
            self.manifests.hinted(msg)
        elif isinstance(msg, wire.Signal) and self.rtc is not None:
            await self.rtc.on_signal(msg)
        elif isinstance(msg, wire.Unreachable):
            log.warning("the tracker could not connect to %s (%s): peers are told this node accepts no "
                        "connections; it dials them%s", msg.addr, msg.reason,
                        ", and nodes that accept none reach it over WebRTC" if self.rtc is not None else
                        " (nodes that accept none cannot reach it: --transport auto lets them, over WebRTC)")
            self.dialer.set_unreachable(f"{msg.addr}: {msg.reason}")

    def _on_wan_rates(self, from_tracker: dict[str, float] | None) -> None:
        """Each session's PeerList says the swarm's WAN rates (None: the tracker gives none, or is
        of the previous version): plan with the tracker's, else with this node's own
        --wan-rates; the picker re-plans what it is fetching when they change."""
        rates, differ = swarm_wan_rates(from_tracker, self.cfg.wan_rates)
        if differ and self._rates_warned != from_tracker:
            self._rates_warned = dict(from_tracker)
            log.warning("this node's --wan-rates %s differ from the tracker's %s: planning with the tracker's, "
                        "as every member does (give the node the tracker's, or none)",
                        format_wan_rates(self.cfg.wan_rates), format_wan_rates(from_tracker))
        if self.picker.set_wan_rates(rates):
            log.info("WAN rates now %s (%s)", format_wan_rates(rates) if rates else "none",
                     "the tracker's" if from_tracker else "this node's --wan-rates" if rates else "regions equal")

    def _on_peer_list(self, peers: list[dict]) -> None:
        self.dialer.set_members({p["id"]: p for p in peers})
        origins = [p for p in peers if p["role"] == "origin"]
        self.applier.no_origin_listed = not origins
        if self.picker.origin_region is None:
            if origins:
                self.picker.set_origin_region(origins[0]["region"])
            self.applier.wake()  # the plan can start (with no origin: from the manifests' region)
        uplinks = self._uplinks(peers)
        if self.cfg.no_peers:
            self.picker.set_members({self.id: self.region}, uplinks={k: v for k, v in uplinks.items() if k == self.id})
        else:
            nodes = {p["id"]: p["region"] for p in peers if p["role"] == "node"}
            nodes[self.id] = self.region
            self.picker.set_members(nodes, uplinks=uplinks)
        self.fetcher.wake()

    def _uplinks(self, peers: list[dict]) -> dict[str, float]:
        """The uplinks the plan uses (node id -> Mbit/s; ids missing said none): the nodes' peer
        entries, and this node's own as the tracker has it (`_uplink_told`)."""
        uplinks = {p["id"]: p[wire.PEER_UPLINK] for p in peers
                   if p["role"] == "node" and wire.PEER_UPLINK in p and p["id"] != self.id}
        own = self._uplink_told()
        if own is not None:
            uplinks[self.id] = own
        return uplinks

    def _region_says(self) -> float | None:
        """The upper median of the uplinks the other nodes of this region say (their peer
        entries), which a node that declares none compares its measurement with; None: none say one."""
        said = sorted(p[wire.PEER_UPLINK] for p in self.dialer.members.values()
                      if p["role"] == "node" and p["region"] == self.region and wire.PEER_UPLINK in p)
        return said[len(said) // 2] if said else None

    def _uplink_told(self) -> float | None:
        """This node's uplink as the tracker has it, which the others plan with, so this node
        does too: what it says now where the tracker's connection selected revision 6 (its
        heartbeats say it); what this session's Hello said at revision 5; none at revision 4
        or before, or with no tracker yet (it hears none)."""
        ms = self.tracker.stream
        revision = 0 if ms is None else wire.revision(ms.wire_revision)
        if revision >= wire.UPLINK_NOW_REVISION:
            return self.uplink_said.value
        return self.tracker.hello_sent.uplink if revision >= wire.UPLINK_REVISION else None

    # ------------------------------------------------------------ peers

    async def _serve_peers(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # The tracker dials in once to check this node is reachable (--probe-reachability).
        await serve(self.cfg.listen, self.creds, {"node", "tracker"}, self._hello, self._accepted,
                    on_refused=lambda why: log.warning("refused a connection: %s", why),
                    on_receive=self.download.take, refused=self.peers.dropped, admission=self.admission,
                    task_status=task_status)

    async def _accepted(self, ms) -> None:
        if ms.peer_role == "tracker":  # its reachability probe: the handshake was the check
            log.debug("the tracker checked this node is reachable")
            await ms.aclose()
            return
        await self.peers.run(ms, outbound=False)

    def _has_manifest(self, key) -> bool:
        """A manifest for `key` is held, or the applier would refuse one (the object is not
        above the applied version, or the latest keyframe held supersedes it)."""
        return self.book.get(key) is not None or self.book.refuses(key, self.version, drop_superseded=True)

    def _origin_session(self) -> Session | None:
        return next((s for s in self.peers.sessions.values() if s.role == "origin" and not s.closed), None)

    def _on_peer_open(self, s: Session) -> None:
        log.info("peer %s (%s, region %s) connected (%s)", s.id, s.role, s.region, "out" if s.outbound else "in")
        self.fetcher.peer_joined(s)

    def _on_peer_close(self, s: Session) -> None:
        if s.role == "origin":
            self.uploader.origin_lost()
        self.fetcher.peer_left(s)
        self.dialer.wake()

    async def _on_message(self, s: Session, msg) -> None:
        if isinstance(msg, wire.Piece):
            await self.fetcher.on_piece(s, msg)
        elif isinstance(msg, (wire.Have, wire.HaveOne, wire.Incoming)):
            self.fetcher.on_announce(s, msg)
        elif isinstance(msg, wire.Reject):
            self.fetcher.on_reject(s, msg)
        elif isinstance(msg, wire.VersionNotice):
            await self.manifests.notice(msg, s)
        elif isinstance(msg, wire.TrajectoriesAck) and s.role == "origin":
            await self.uploader.acked(msg.seqs)
        elif isinstance(msg, wire.TrajectoriesBusy) and s.role == "origin":
            self.uploader.deferred(msg.retry_ms)
        elif isinstance(msg, wire.Error):
            log.log(s.error_level(), "peer %s says: %s", s.id, msg.message)
        else:
            raise PeerDropped(f"sent {type(msg).__name__}, which peers do not send")

    # ------------------------------------------------------------ status

    def _declared(self, member: str) -> dict:
        """{"uplink": Mbit/s} where the tracker's entry for `member` carries one, else {}."""
        up = self.dialer.members.get(member, {}).get(wire.PEER_UPLINK)
        return {} if up is None else {"uplink": up}

    def status(self) -> dict:
        a, f = self.applier, self.fetcher
        return {
            "node_id": self.id,
            "region": self.region,
            "swarm_id": self.swarm_id,
            "version": self.version,
            "state_hash": None if a.weights is None else a.weights.state_hash,
            "base_path": str(a.base_path),  # the base file; the current version is it plus the stored chain
            **a.durable.status(),
            **({} if a.sink is None else a.sink.status()),
            "latest_version": self.book.latest_version,
            # The latest keyframe, held and kept with the patches after it for nodes that join later; None: not held.
            "kept_keyframe": a.kept_keyframe,
            "stopping": self.local is not None and self.local.stopping,  # uploading the spool, refusing submits
            "listen": self.listen_addr,
            "tracker_connected": self.tracker.connected,
            "uplink_mbit": self.cfg.uplink_mbit,  # as declared (--uplink-mbit); each peer's: its "uplink"
            "part_bytes": self.peers.part_bytes,  # the parts it sends, sized to that (protocol/assembly.py)
            # As measured while this node's sends backed up (protocol/uplinkmeter.py); None: they never did.
            "uplink_measured_mbit": self.peers.uplink.estimate_mbit(),
            # What the tracker has of it, and so what every member plans its share on: declared, or
            # measured where that is far under it (protocol/uplinkmeter.py reported_uplink).
            "uplink_said_mbit": self._uplink_told(),
            # Members of this region planned as slow by the uplinks they say (protocol/responsibility.py
            # SLOW_UPLINK): they bring nothing in while others can, and are asked last.
            "slow_neighbours": self.picker.slow_neighbours,
            # The WAN rates (Mbit/s) this node plans each chunk's chain of regions with: the tracker's,
            # else its own --wan-rates; None: every region alike.
            "wan_rates": self.picker.wan_rates,
            # The tracker could not connect to the address this node joined with (its probe): "ADDR: why".
            "unreachable": self.dialer.unreachable,
            "peers": sorted(({"id": s.id, "region": s.region, "role": s.role,
                              "bytes_in": s.piece_bytes_in, "bytes_out": s.piece_bytes_out,
                              "snubbed": self.picker.snubbed(s.id), "snub_reason": self.picker.snub_reason(s.id),
                              **transport_of(s.ms),
                              **self._declared(s.id)}
                             for s in self.peers.sessions.values()), key=lambda p: p["id"]),
            "webrtc_refused": {} if self.rtc is None else dict(self.rtc.refused),
            "bytes_in": dict(f.bytes_in),
            "bytes_out": self.peers.bytes_out,
            "bytes_out_arriving": self.peers.bytes_out_arriving,
            "chunks_rejected": f.chunks_rejected,
            "chunks_damaged": self.store.chunks_damaged,  # held chunks found changed on disk, removed (store.py)
            # chunks read from disk and hashed to serve them (the rest came from the kept ones), and
            # reads that waited off a peer's reads for requests it cancelled (node/peers.py budgets)
            "chunk_reads": self.store.chunk_reads,
            "reads_delayed": self.peers.reads_delayed,
            "pieces_unasked": f.pieces_unasked,  # first parts of chunks not asked of their sender, ignored
            "peers_dropped": dict(self.peers.dropped),  # and connections refused, by kind (node/peers.py)
            "peers_snubbed": f.snubs,  # times a peer sent no part for SNUB_AFTER s while holding requests
            "peers_snubbed_slow": f.slow_snubs,  # times a peer served a chunk too slowly (SLOW_CHUNK_MIN_S)
            "requests_given_up_early": f.given_up_early,  # due whole only past their timeout at the peer's rate
            "sessions_replaced": self.peers.replaced,  # by the same member's new connection (its reconnect)
            "manifests_rejected": a.manifests_rejected,
            "manifests_stale": a.manifests_stale,  # refused unread: not above the version, or superseded
            **self.manifests.status(),
            "fetching": f.status(),
            "longest_wait_s": f.waits(),
            # Objects that failed to apply (verified chunks, yet the patch did not fit): the
            # node routes around them; a person should know the origin published one.
            "unusable": [describe(k) for k in sorted(a.unusable)],
            **self.store.disk.status(),  # our disk failing writes (node/diskspace.py); the spool's: in "spool"
            "applied": list(a.applied),
            "spool": self.uploader.status(),
            # Bytes of requests received on the local socket and not yet handled, against the budget
            # (node/localapi.py): waits, refusals (too_large) and waits that ran out (buffers_full).
            "local_socket": self.local_budget.status(),
            "uptime_s": round(time.time() - self.started_at, 1),
        }
