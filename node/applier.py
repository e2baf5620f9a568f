"""Applying: versions in, strictly in order, to the state in memory; the plan that says what to fetch.

Owns `Applier`: the node's current weights (in memory; durable as the base
file plus the stored patch chain, node/persistence.py, so a version costs
the disk its patch, not the model), the signed manifests it learns of (the
`VersionBook`: offered by the tracker or a peer, checked there), the plan
from the current version to the newest reachable one (`VersionBook.plan`),
which it hands to the fetcher (`Fetcher.want`), applying each object of the
plan once its chunks are all held (protocol/patch.py does the math, on a
low-priority thread), the objects that failed to apply (routed around), the
per-version timeline (announced, complete, applied) for status, writing the
base (first version, keyframes) and compacting it in the background, and
retiring objects no restart or late peer needs. Must not fetch
(node/fetcher.py) or serve (node/peers.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from pathlib import Path

import trio

from patchswarm.protocol.errors import (ChunkGone, ConflictingManifest, CorruptData, InvalidInput, PatchswarmError,
                                        SignatureError, StaleVersion, UsageError)
from patchswarm.protocol.patch import apply as apply_patch
from patchswarm.protocol.publication import ObjKey, describe, manifest_layout, patch_of, table_after, table_of
from patchswarm.protocol.versions import NEW, VersionBook

from patchswarm.node import diskspace, failpoints
from patchswarm.node.changelog import DIRNAME as CHANGES_DIR, Changelog
from patchswarm.node.fetcher import Fetcher
from patchswarm.node.lowprio import run_low_priority
from patchswarm.node.modelsink import ModelSink
from patchswarm.node.net.manifestcheck import ManifestCheck
from patchswarm.node.net.transport import one_line
from patchswarm.node.persistence import DurableState
from patchswarm.node.store import ObjectStore
from patchswarm.node.wakeup import Wakeup
from patchswarm.node.weights import Weights

log = logging.getLogger("patchswarm.node")
POLL_S = 2.0  # the apply loop looks again at least this often
COMPACT_NICE = 19  # compaction is the least urgent work on the host


class Applier:
    def __init__(self, book: VersionBook, store: ObjectStore, fetcher: Fetcher, durable: DurableState,
                 *, keep_versions: int, apply_nice: int, apply_threads: int | None, sink: ModelSink | None = None,
                 record_changes: bool = False, keep_keyframe: bool = True):
        self.book = book
        self.manifest_check = ManifestCheck(book)  # large manifests verified off the event loop
        self.store = store
        self.fetcher = fetcher
        self.durable = durable
        self.sink = sink
        self.swarm_id = durable.swarm_id
        self.keep_versions = keep_versions
        self.no_origin_listed = False  # the tracker's last list of members named no origin (node/daemon.py)
        self.keep_keyframe = keep_keyframe  # for late joiners: see `joiners_keyframe`
        self._keyframe_released: int | None = None  # the keyframe last let go for want of room (logged once)
        self.kept_keyframe: int | None = None  # as of the last retire, for status
        self.apply_nice = apply_nice
        self.apply_threads = apply_threads
        self._weights: Weights | None = None
        # Int views of the live state's tensors, kept from one apply to the next (protocol
        # apply's `views`): at 140k tensors, 0.5 s a version less. Emptied whenever the
        # state is replaced, so it never keeps a state the node has let go of alive.
        self._views: dict = {}
        # What each version wrote, for clients that follow by sparse changes (--sparse-handoff).
        self.changelog = Changelog(durable.path.parent / CHANGES_DIR) if record_changes else None
        self.applied: collections.deque[dict] = collections.deque(maxlen=64)  # recent versions, for status
        self.manifests_rejected = 0
        self.manifests_stale = 0
        self._timeline: dict[ObjKey, dict[str, float]] = {}  # wall-clock announced_at / complete_at
        self._wakeup = Wakeup()
        self._version_changed = trio.Event()
        self._compacting = False
        self._base_due = False  # a base write failed or waited for a compaction: retried after the next apply
        # The current state's tensor table, by its state hash: what a form-2 manifest lists changes to.
        # Made from the state once (~1 s at 140,000 tensors), then each applied object's table.
        self._table: tuple[str, list] | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def version(self) -> int | None:
        return None if self.weights is None else self.weights.version

    @property
    def base_path(self) -> Path:
        return self.durable.path

    def load_weights(self) -> Weights | None:
        """The latest version the base file and the stored chain reach, verified (every
        object replayed with the codec's checks), or None. Blocking: run it in a thread."""
        return self.durable.load(self.book, self.apply_threads)

    async def hand_off_loaded(self) -> None:
        """At start: the configured hand-offs catch up with the version the node resumed at."""
        if self.sink is None or self.weights is None:
            return
        await self._write_sink(None)

    async def _write_sink(self, changed: set[str] | None) -> None:
        """Hand the current version to the model directory, with its manifest's layout and
        publish time (the current version's object stays in the store: it is in the chain)."""
        key = next((k for k in [(self.version, False), (self.version, True)] if self.store.manifest(k)), None)
        m = None if key is None else self.store.manifest(key)
        layout = None
        if m is not None:  # form 2 gives the layout by table row
            table = [] if m.form == 1 else await trio.to_thread.run_sync(self._table_of, self.weights.state)
            layout = manifest_layout(m, [t.name for t in table])
        await self.sink.write(self.weights, layout, changed,
                              None if m is None else m.created_at)

    def _table_of(self, state: dict) -> list:
        """The tensor table of `state`, the current weights' (in a worker thread: it may be made)."""
        if self.weights is None or self.weights.state is not state:
            return table_of(state)
        if self._table is None or self._table[0] != self.weights.state_hash:
            self._table = (self.weights.state_hash, table_of(state))
        return self._table[1]

    def wake(self) -> None:
        self._wakeup.set()

    async def wait_version(self, min_version: int, timeout: float) -> bool:
        """Wait until the node is at `min_version` or later; False if `timeout` ran out first."""
        with trio.move_on_after(timeout):
            while self.version is None or self.version < min_version:
                await self._version_changed.wait()
            return True
        return False

    # ------------------------------------------------------------ manifests in

    async def offer(self, envelope: bytes, source: str, from_peer: bool = False) -> bool:
        """A signed manifest from the tracker or a peer (`source`, for the log); True when it
        was new to this node and accepted. `from_peer`: one that does not verify (signature,
        format, swarm) raises its InvalidInput after it is counted, which ends the session:
        members pass on only manifests they verified, so it is the sender's fault, and a peer
        could otherwise send one a message, each a warning line here. A large one is verified
        in a worker thread (node/net/manifestcheck.py), the rest inline."""
        # Only what a plan from this node's version can use: an older keyframe's manifest, of
        # a long history a member may pass on, is refused unread (protocol/versions.py).
        verified = await self.manifest_check.check(envelope, self.version, drop_superseded=True)
        try:
            status, m = self.book.offer(envelope, self.version, verified=verified, drop_superseded=True)
        except StaleVersion as e:
            self.manifests_stale += 1
            log.debug("ignored a manifest from %s: %s", source, e)
            return False
        except (SignatureError, CorruptData, ConflictingManifest, InvalidInput) as e:
            self.manifests_rejected += 1
            log.warning("rejected a manifest from %s: %s", source, e)
            if from_peer and not isinstance(e, ConflictingManifest):  # two signed ones: the trainer's doing
                raise
            return False
        if status == NEW:
            self._timeline[(m.version, m.is_keyframe)] = {"announced_at": time.time()}
            log.info("version %d announced: %s, %d chunks, %s bytes", m.version,
                     "keyframe" if m.is_keyframe else "patch", len(m.chunks), f"{m.total_bytes:,}")
            self._wakeup.set()
        return status == NEW

    def completed(self, key: ObjKey) -> None:
        """Every chunk of `key` is held (the fetcher says so)."""
        self._timeline.setdefault(key, {})["complete_at"] = time.time()
        self._wakeup.set()

    # ------------------------------------------------------------ applying

    async def run(self) -> None:
        """Keep the fetcher on the plan and apply its first object once complete, until cancelled.
        Nothing is planned before the origin's region is known (the WAN plan needs it): from the
        tracker's list of members, else from the manifests."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery  # for compactions, which outlive one apply
            self._compact_if_due()  # a restart may resume with a long chain after the base
            while True:
                if self._base_due and self.weights is not None and self.store.disk.may_retry():
                    await self._write_base()  # one that failed (a full disk), again once the backoff allows
                self._compact_if_due()
                self._origin_region_from_manifests()
                if self.fetcher.picker.origin_region is not None:
                    current_hash = None if self.weights is None else self.weights.state_hash
                    plan = self.book.plan(self.version, current_hash)
                    self.fetcher.want(plan)
                    if plan and self.store.complete(plan[0]):
                        await self.apply(plan[0])
                        continue
                if self.sink is not None and self.weights is not None and self.sink.disk.failing \
                        and self.sink.disk.may_retry():  # the model directory behind after a full disk
                    await self._write_sink(None)
                await self._wakeup.wait(POLL_S)

    def _origin_region_from_manifests(self) -> None:
        """Where the tracker's list names no origin (the trainer is down), plan with the region
        its manifests name: peers may hold all this node lacks (protocol/manifest.py
        `origin_region_of`). Where the list names one, node/daemon.py took its region."""
        picker = self.fetcher.picker
        if picker.origin_region is None and self.no_origin_listed and (region := self.book.origin_region) is not None:
            picker.set_origin_region(region)
            log.info("planning with the origin's region %s, as its manifests name it (the tracker lists no origin)",
                     region)

    @property
    def unusable(self) -> frozenset[ObjKey]:
        """Objects that failed to apply (verified chunks, yet the patch did not fit): plans
        route around them (VersionBook.mark_unusable); a person should know the origin
        published one."""
        return self.book.unusable

    @property
    def weights(self) -> Weights | None:
        return self._weights

    @weights.setter
    def weights(self, w: Weights | None) -> None:
        if w is None or self._weights is None or w.state is not self._weights.state:
            self._views = {}
        self._weights = w

    async def apply(self, key: ObjKey) -> None:
        m = self.store.manifest(key)
        t0 = time.perf_counter()
        state = {} if self.weights is None else self.weights.state
        base = None if self.weights is None else (self.weights.version, self.weights.state_hash)
        changed: set[str] | None = None if self.sink is None else set()  # the sink rewrites only their shards
        table = None
        views = self._views if self._weights is not None else {}

        def work() -> None:
            nonlocal table
            patch = patch_of(m, self.store.chunks(key), self._table_of(state))
            # In place, without undo records: for a dense patch they would be a second copy
            # of the state, and the base file plus the stored chain hold the version before.
            with (self.changelog.recording(patch, base, m.version) if self.changelog is not None
                  else contextlib.nullcontext(None)) as recorder:
                apply_patch(state, patch, threads=self.apply_threads, undo=False, recorder=recorder,
                            progress=lambda done, total: done == 1 and failpoints.hit("apply.written"),
                            views=views, touched=changed)
            table = table_after(patch)

        try:
            # Below the loop's priority: peers fetching this version from us come first (node/lowprio.py).
            await run_low_priority(work, self.apply_nice)
        except ChunkGone as e:
            # Our disk lost a chunk since it verified (node/store.py): the object is sound, so it
            # is not refused; the next plan fetches the chunk again (the store no longer has it).
            log.warning("could not apply %s: %s; fetching that chunk again", describe(key), e)
            await self._back_to_durable()  # the apply may have written part of the state
            return
        except PatchswarmError as e:
            self.book.mark_unusable(key)
            log.error("could not apply %s: %s; looking for another path", describe(key), e)
            await self._back_to_durable()
            return
        except OSError as e:
            if not diskspace.ours(e):
                raise
            # The change file (--sparse-handoff) could not be written, part-way through the apply.
            # The object is in the store, so the version is durable: reloading replays it. Its
            # changes are not recorded, as after a restart's replay: a follower crossing this
            # version reads the base whole (NodeClient.follow).
            self.store.disk.failed(f"the change file of version {m.version} (followers of the sparse "
                                   f"hand-off read the base whole across it)", e)
            await self._back_to_durable()
            self._version_changed_now()
            return
        finally:
            self.fetcher.stop(key)
        # The object is in the store before it is applied: the version is durable as the base
        # plus the chain. Only where the chain cannot reach it (no base yet, or a keyframe
        # jumped over patches this node never held) is the state written whole.
        self.weights = Weights(state, m.version, m.target_hash, self.swarm_id)
        self._views = views  # the state's, now (a first version's state is new)
        self._table = (m.target_hash, table)
        if self.durable.base is None or m.is_keyframe:
            self._base_due = True
        if self._base_due:
            await self._write_base()
        seconds = time.perf_counter() - t0
        if self.sink is not None:
            await self._write_sink(changed)
        self.applied.append({"version": m.version, "kind": "keyframe" if m.is_keyframe else "patch",
                             "bytes": m.total_bytes, "apply_s": round(seconds, 3),
                             **self._timeline.pop(key, {}), "published_at": m.created_at, "applied_at": time.time()})
        log.info("applied version %d (%s, %s bytes) in %.2f s; state hash %s…", m.version,
                 "keyframe" if m.is_keyframe else "patch", f"{m.total_bytes:,}", seconds, m.target_hash[:16])
        self._version_changed_now()
        self._compact_if_due()
        self._retire(m.version)

    def _version_changed_now(self) -> None:
        """Wake everyone waiting on a version (wait_version), and arm the event for the next one."""
        self._version_changed.set()
        self._version_changed = trio.Event()

    async def _back_to_durable(self) -> None:
        """After an apply that stopped part-way (the state may be partly patched): the base and the stored chain."""
        if self.weights is not None:
            self.weights = await trio.to_thread.run_sync(self.load_weights)
            log.info("reloaded the base and the stored chain: %s",
                     "no usable weights" if self.weights is None else f"version {self.weights.version}")

    def _compact_if_due(self) -> None:
        w = self.weights
        if (w is None or self._base_due or self._compacting or self.durable.base is None
                or not self.durable.due(w.version) or not self.store.disk.may_retry()):
            return
        self._compacting = True
        self._nursery.start_soon(self._compact, w.version, w.state_hash)

    async def _write_base(self) -> None:
        """Write the live state as the base, unless a compaction is writing it now (then
        after it). A failure (a full disk) is logged and retried after the next version:
        the stored chain still holds every version since the last base."""
        if self._compacting:
            return
        w = self.weights
        try:
            # On the apply path on purpose: the state must not change while it is written.
            await trio.to_thread.run_sync(self.durable.write_base, w)
            self._base_due = False
            self.store.disk.succeeded()
        except OSError as e:  # node/diskspace.py logs it; `run` tries again
            self.store.disk.failed(f"the base at version {w.version} (the stored objects keep every version "
                                   f"since {'the first' if self.durable.base is None else self.durable.base.version})", e)

    async def _compact(self, version: int, target_hash: str) -> None:
        """Fold the patches since the base into a new base, below everything else's priority;
        the store keeps the chain (`_retire` asks `durable.keep_from`) until this is done."""
        try:
            await run_low_priority(lambda: self.durable.compact(version, target_hash, self.apply_threads),
                                   COMPACT_NICE, name="patchswarm-compact")
        except OSError as e:  # node/diskspace.py logs it; `_compact_if_due` tries again
            self.store.disk.failed(f"the compacted base at version {version} (the base stays at version "
                                   f"{self.durable.base.version} and the chain is kept)", e)
        except PatchswarmError as e:
            log.error("compaction to version %d failed (%s); the base stays at version %s and the chain is kept",
                      version, one_line(e), self.durable.base.version if self.durable.base else None)
        else:
            self.store.disk.succeeded()
        finally:
            self._compacting = False
        if self._base_due and self.weights is not None:
            await self._write_base()
        if self.version is not None:
            self._retire(self.version)
        self._compact_if_due()  # versions applied meanwhile may make the next one due

    def _retire(self, version: int) -> None:
        """Drop what can never be needed again: objects older than the kept window, except
        what late joiners take (`joiners_keyframe`)."""
        for key in [k for k in self._timeline if k[0] <= version]:
            del self._timeline[key]
        # Kept: the window late peers may still ask for, and every patch since the base (a
        # restart replays them, a compaction folds them).
        floor = min(version - self.keep_versions, self.durable.keep_from())
        if self.changelog is not None:
            self.changelog.retire(floor - 1)  # the same versions' change files: an engine follows from the base
        keyframe = self.kept_keyframe = self.joiners_keyframe()
        if keyframe is not None:
            floor = min(floor, keyframe)
        for key in self.store.keys():
            if key[0] < floor and not self.fetcher.picker.is_fetching(key):
                self.store.drop(key)
        self.book.forget_below(floor)
        self.fetcher.forget_below(floor)

    def joiners_keyframe(self) -> int | None:
        """The latest keyframe's version where this node holds that keyframe whole and keeps it,
        with every patch after it that it holds, for nodes that join later; None otherwise.

        *Why:* a joiner takes the latest keyframe and the patches after it (the tracker hands
        it those manifests). Nodes that were running when the keyframe came out fetched its
        patch, never the keyframe, so the first joiner after it takes it from the origin (0.664
        of the state: ~330 GB at 500 GB). Kept past the window by that joiner, every later
        joiner takes it, and the chain after it, from nodes (its region's, else others') before
        the origin (bench/late_joiners.py). Costs only disk the node had already written (the keyframe, the
        patches it fetched anyway), until the next keyframe; let go, with one warning, while
        the disk has less free than the base file's size (what a compaction writes beside it),
        so that what joiners may need never stops the node from taking its own versions."""
        if not self.keep_keyframe:
            return None
        keyframe = self.book.latest_keyframe
        if keyframe is None or not self.store.complete((keyframe, True)):
            return None
        free = diskspace.free_bytes(self.durable.path.parent)
        try:
            need = self.durable.path.stat().st_size
        except OSError:
            need = 0
        if free is not None and free < need:
            if self._keyframe_released != keyframe:
                self._keyframe_released = keyframe
                log.warning("not keeping v%d's keyframe for late joiners: %s B free, under the base's %s B "
                            "(they take it from the origin)", keyframe, f"{free:,}", f"{need:,}")
            return None
        self._keyframe_released = None
        return keyframe
