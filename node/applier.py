"""Applying: versions in, strictly in order, to the weights file; the plan that says what to fetch.

Owns `Applier`: the node's current weights (loaded from and written to
`weights_path`, node/weights.py), the signed manifests it learns of (the
`VersionBook`: offered by the tracker or a peer, checked there), the plan
from the current version to the newest reachable one (`VersionBook.plan`),
which it hands to the fetcher (`Fetcher.want`), applying each object of the
plan once its chunks are all held (protocol/patch.py does the math, on a
low-priority thread), the objects that failed to apply (routed around), the
per-version timeline (announced, complete, applied) for status, and retiring
objects older than the kept window. Must not fetch (node/fetcher.py) or
serve (node/peers.py).
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

import trio

from patchswarm.protocol.errors import (ConflictingManifest, CorruptData, InvalidInput, PatchswarmError, SignatureError,
                                        StaleVersion, UsageError)
from patchswarm.protocol.patch import apply as apply_patch
from patchswarm.protocol.publication import ObjKey, describe, patch_of
from patchswarm.protocol.versions import NEW, VersionBook

from patchswarm.node.fetcher import Fetcher
from patchswarm.node.lowprio import run_low_priority
from patchswarm.node.store import ObjectStore
from patchswarm.node.wakeup import Wakeup
from patchswarm.node.weights import Weights, read_weights, write_weights

log = logging.getLogger("patchswarm.node")
POLL_S = 2.0  # the apply loop looks again at least this often


class Applier:
    def __init__(self, book: VersionBook, store: ObjectStore, fetcher: Fetcher, weights_path: Path, swarm_id: str,
                 *, keep_versions: int, apply_nice: int, apply_threads: int | None):
        self.book = book
        self.store = store
        self.fetcher = fetcher
        self.weights_path = Path(weights_path)
        self.swarm_id = swarm_id
        self.keep_versions = keep_versions
        self.apply_nice = apply_nice
        self.apply_threads = apply_threads
        self.weights: Weights | None = None
        self.applied: collections.deque[dict] = collections.deque(maxlen=64)  # recent versions, for status
        self.manifests_rejected = 0
        self.manifests_stale = 0
        # Objects that failed to apply (verified chunks, yet the patch did not fit): the
        # node routes around them; a person should know the origin published one.
        self.unusable: set[ObjKey] = set()
        self._timeline: dict[ObjKey, dict[str, float]] = {}  # wall-clock announced_at / complete_at
        self._wakeup = Wakeup()
        self._version_changed = trio.Event()

    @property
    def version(self) -> int | None:
        return None if self.weights is None else self.weights.version

    def load_weights(self) -> Weights | None:
        """The weights file's version, or None (no file, or one that does not read: a warning).
        Blocking: run it in a thread."""
        try:
            w = read_weights(self.weights_path)
        except InvalidInput as e:
            log.warning("ignoring %s: %s; starting without weights", self.weights_path, e)
            return None
        if w is not None and w.swarm_id != self.swarm_id:
            raise UsageError(f"{self.weights_path}: holds weights of swarm {w.swarm_id}, this node is in {self.swarm_id}")
        return w

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

    def offer(self, envelope: bytes, source: str) -> None:
        """A signed manifest from the tracker or a peer (`source`, for the log)."""
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
            self._wakeup.set()

    def completed(self, key: ObjKey) -> None:
        """Every chunk of `key` is held (the fetcher says so)."""
        self._timeline.setdefault(key, {})["complete_at"] = time.time()
        self._wakeup.set()

    # ------------------------------------------------------------ applying

    async def run(self) -> None:
        """Keep the fetcher on the plan and apply its first object once complete, until cancelled.
        Nothing is planned before the origin's region is known (the WAN plan needs it)."""
        while True:
            if self.fetcher.picker.origin_region is not None:
                current_hash = None if self.weights is None else self.weights.state_hash
                plan = [k for k in self.book.plan(self.version, current_hash) if k not in self.unusable]
                self.fetcher.want(plan)
                if plan and self.store.complete(plan[0]):
                    await self.apply(plan[0])
                    continue
            await self._wakeup.wait(POLL_S)

    async def apply(self, key: ObjKey) -> None:
        m = self.store.manifest(key)
        t0 = time.perf_counter()
        state = {} if self.weights is None else self.weights.state

        def work() -> None:
            # In place, without undo records: for a dense patch they would be a
            # second copy of the state, and the weights file holds the base anyway.
            apply_patch(state, patch_of(m, self.store.chunks(key)), threads=self.apply_threads, undo=False)

        try:
            # Below the loop's priority: peers fetching this version from us come first (node/lowprio.py).
            await run_low_priority(work, self.apply_nice)
        except PatchswarmError as e:
            self.unusable.add(key)
            log.error("could not apply %s: %s; looking for another path", describe(key), e)
            if self.weights is not None:  # the state may be partly patched: back to what the file holds
                self.weights = await trio.to_thread.run_sync(self.load_weights)
                log.info("reloaded %s: %s", self.weights_path,
                         "no usable weights" if self.weights is None else f"version {self.weights.version}")
            return
        finally:
            self.fetcher.stop(key)
        w = Weights(state, m.version, m.target_hash, self.swarm_id)
        # A failure to write is fatal on purpose: the node must never call current what the file lacks.
        await trio.to_thread.run_sync(write_weights, self.weights_path, w)
        self.weights = w
        seconds = time.perf_counter() - t0
        self.applied.append({"version": m.version, "kind": "keyframe" if m.is_keyframe else "patch",
                             "bytes": m.total_bytes, "apply_s": round(seconds, 3),
                             **self._timeline.pop(key, {}), "published_at": m.created_at, "applied_at": time.time()})
        log.info("applied version %d (%s, %s bytes) in %.2f s; state hash %s…", m.version,
                 "keyframe" if m.is_keyframe else "patch", f"{m.total_bytes:,}", seconds, m.target_hash[:16])
        self._version_changed.set()
        self._version_changed = trio.Event()
        self._retire(m.version)

    def _retire(self, version: int) -> None:
        """Drop what can never be needed again: objects older than the kept window."""
        for key in [k for k in self._timeline if k[0] <= version]:
            del self._timeline[key]
        floor = version - self.keep_versions
        for key in self.store.keys():
            if key[0] < floor and not self.fetcher.picker.is_fetching(key):
                self.store.drop(key)
        self.book.forget_below(floor)
        self.fetcher.forget_below(floor)
