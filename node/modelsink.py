"""After each applied version: the model directory an engine loads, and the engine told of it.

Owns the node's configured hand-offs (issue 20): where `--model-dir`, an
engine (`--engine sglang|vllm`) or `--on-version` is configured, each
applied version is written as a Hugging Face model directory
(node/modeldir.py: versioned directories, an atomically switched `current`
link, unchanged shards hard-linked) and offered to the engine's `Handoff`
(node/engines.py: in order, newest pending wins, retried with backoff).

When `current` moves: at once, with each write, unless the engine reloads
through it (vLLM, `reads_current`). Then a version is written to its own
directory at once (so the next reload does not wait for the write) but made
current only by the hand-off, right before the reload that loads it: while a
reload runs, `current` stays at the version it was offered, and the reload
after it loads the newest version written by then (the one pending). SGLang
and `--on-version` are given the version's own directory, which is held
until they answer, so `current` need not wait for them. Either way `changed`
(the tensors the applied patch touched) is relative to the version written
last, which is what the model directory links unchanged shards from.

The write is the one cost of this hand-off that grows with the model (a
disk-loading engine needs the shards on disk); it is separate from the
node's own durability (node/persistence.py), and skipped entirely when no
hand-off is configured. It runs between two applies (the state must not
change while it is written) below the serving loop's priority; a failure
(a full disk) is logged and counted, and the next version tries again.
Must not apply, fetch or decide which version the node is at.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import trio

from patchswarm.protocol.served import split_side_files

from patchswarm.node import diskspace
from patchswarm.node.engines import Engine, Handoff, Offer
from patchswarm.node.lowprio import run_low_priority
from patchswarm.node.modeldir import ModelDir
from patchswarm.node.net.transport import one_line
from patchswarm.node.weights import META_HASH, META_SWARM, META_VERSION, Weights

log = logging.getLogger("patchswarm.node")


class ModelSink:
    def __init__(self, root: Path, engine: Engine | None, nice: int):
        self.dir = ModelDir(root)
        self.switched_by_handoff = engine is not None and getattr(engine, "reads_current", False)
        self.handoff = None if engine is None else Handoff(
            engine, hold=self.dir.hold, release=self._release,
            switch=self.dir.switch if self.switched_by_handoff else None)
        self._prune_wanted = trio.Event()
        self.nice = nice
        self.bytes_written = 0
        self.last_write_s: float | None = None
        self.last_error: str | None = None
        self.disk = diskspace.DiskCondition(root)  # the model directory may be on a disk of its own

    @property
    def version(self) -> int | None:
        """The version written last (the directory's newest; `current` may lag it: see above)."""
        return self.dir.written

    async def run(self) -> None:
        if self.handoff is None:
            await trio.sleep_forever()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._prune_released)
            await self.handoff.run()

    def _release(self, version: int) -> None:
        """The hand-off no longer holds `version`: its directory goes, but not here. The
        hand-off runs on the event loop, and a version's directory may hold every shard of
        the model (a patch that touches every tensor rewrites every shard): removing
        hundreds of GB of files there would stop the node's serving meanwhile."""
        self.dir.release(version, prune=False)
        self._prune_wanted.set()

    async def _prune_released(self) -> None:
        """Prune in a worker thread, below the serving loop's priority, after each release
        (releases that come meanwhile are taken by the next prune)."""
        while True:
            await self._prune_wanted.wait()
            self._prune_wanted = trio.Event()
            try:
                await run_low_priority(self.dir.prune, self.nice, name="patchswarm-modeldir")
            except OSError as e:  # housekeeping: the next write prunes again
                log.warning("model directory %s: pruning released versions failed: %s", self.dir.root, one_line(e))

    async def write(self, w: Weights, layout: dict[str, str] | None, changed: set[str] | None,
                    published_at: float | None) -> None:
        """Write version `w` (the caller keeps its state unchanged until this returns) and
        offer it to the engine. `changed`: the tensors that differ from the version before
        (None: unknown, all are written)."""
        if self.version is not None and w.version <= self.version:
            recorded = self.dir.recorded(self.version)
            mine = recorded.get(META_SWARM) == w.swarm_id and (
                w.version < self.version or recorded.get(META_HASH) == w.state_hash)
            if mine:
                if w.version == self.version:  # already there (a restart that found it written)
                    self._offer(w.state_hash, published_at)
                return
            log.warning("model directory %s: version %d there is of swarm %s with state hash %s, expected %s; "
                        "writing version %d again", self.dir.root, self.version, recorded.get(META_SWARM),
                        recorded.get(META_HASH), f"swarm {w.swarm_id}" + (
                            f" and {w.state_hash}" if w.version == self.version else ""), w.version)
            self.dir.set_aside(self.version)
        if self.version != w.version - 1:
            changed = None  # the version written last is not this one's base: no shard is linked
        tensors, files = split_side_files(w.state)
        meta = {META_VERSION: str(w.version), META_HASH: w.state_hash, META_SWARM: w.swarm_id}
        t0 = time.perf_counter()
        try:
            n = await run_low_priority(lambda: self.dir.write(w.version, tensors, layout, files, meta, changed,
                                                              switch=not self.switched_by_handoff),
                                       self.nice, name="patchswarm-modeldir")
        except OSError as e:
            self.last_error = f"version {w.version}: {one_line(e)}"
            if diskspace.ours(e):  # logged there; the applier writes the version again after the backoff
                self.disk.failed(f"version {w.version} to the model directory (the engine stays at "
                                 f"{self.version})", e)
            else:
                log.error("could not write version %d to the model directory %s (%s); the engine stays at %s",
                          w.version, self.dir.root, one_line(e), self.version)
            return
        self.disk.succeeded()
        self.last_write_s = round(time.perf_counter() - t0, 3)
        self.last_error = None
        self.bytes_written += n
        log.info("model directory %s: version %d written (%s bytes in %.2f s)%s", self.dir.root, w.version,
                 f"{n:,}", self.last_write_s,
                 "; current before the engine's next reload" if self.switched_by_handoff else " and current")
        self._offer(w.state_hash, published_at)

    def _offer(self, state_hash: str, published_at: float | None) -> None:
        """Offer the version written last to the engine."""
        if self.handoff is not None and self.version is not None:
            self.handoff.offer(Offer(self.version, self.dir.path(self.version), state_hash, published_at))

    def status(self) -> dict:
        out = {"model_dir": str(self.dir.current), "model_dir_version": self.dir.current_version(),
               "model_dir_written": self.version,
               "model_dir_bytes_written": self.bytes_written, "model_dir_write_s": self.last_write_s,
               "model_dir_error": self.last_error}
        if self.handoff is not None:
            h = self.handoff.status()
            out["engine"] = {"name": h["engine"], "version": h["engine_version"], "pending": h["pending_version"],
                             "last_error": h["last_error"], "publish_to_engine_s": h["publish_to_engine_s"],
                             "attempts": h["attempts"], "superseded": h["superseded"]}
        return out
