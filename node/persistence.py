"""A member's durable record of its served state: a base file plus the stored objects after it.

Owns what a restart resumes from, for a node and for the origin alike. A
version's cost on disk follows its patch: the object store already holds each
version's verified chunks (written once, as they arrive or are made); the full
state is written only as the *base* (node/basefile.py), at the first version
and then by compaction, off the critical path, at most once per
`compact_every` versions. Until then the objects after the base stay in the
store (`keep_from`), and a restart is the base plus those objects replayed
with every check the codec has (each object's state hash included).

The base file is `weights.safetensors` in the data dir: plain safetensors
whose metadata says its version, state hash and swarm, so a crash at any
moment leaves one complete verified version there; the objects after it are
each complete or absent (the store's rule). Must not fetch, serve or decide
what to apply next; the daemon and the origin do.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from patchswarm.node import basefile, failpoints
from patchswarm.node.compaction import COMPACT_EVERY
from patchswarm.node.store import ObjectStore
from patchswarm.node.weights import (META_HASH, META_SWARM, META_VERSION, WEIGHTS_NAME, Weights, read_metadata,
                                     read_weights)
from patchswarm.protocol.errors import ChunkGone, InvalidInput, PatchswarmError, UsageError
from patchswarm.protocol.manifest import ObjKey
from patchswarm.protocol.patch import apply
from patchswarm.protocol.publication import describe, patch_of, table_after, table_of
from patchswarm.protocol.versions import VersionBook

log = logging.getLogger("patchswarm.persistence")


@dataclasses.dataclass
class Base:
    version: int
    state_hash: str


def metadata(version: int, state_hash: str, swarm_id: str) -> dict[str, str]:
    return {META_VERSION: str(version), META_HASH: state_hash, META_SWARM: swarm_id}


class DurableState:
    def __init__(self, data_dir: Path, store: ObjectStore, swarm_id: str, compact_every: int = COMPACT_EVERY):
        if compact_every < 1:
            raise UsageError(f"compact_every: expected at least 1, found {compact_every}")
        self.path = Path(data_dir) / WEIGHTS_NAME
        self.store = store
        self.swarm_id = swarm_id
        self.compact_every = compact_every
        self.base: Base | None = None
        self.compactions = 0
        self.bytes_written = 0  # base writes and compactions, since start

    # ------------------------------------------------------------ restart

    def load(self, book: VersionBook, threads: int | None = None) -> Weights | None:
        """The latest version the base and the stored objects reach, verified; None if none.

        `book` holds the stored objects' manifests (ObjectStore.load filled it). An object
        that fails to apply ends the replay at the version before it (and is dropped, so
        the swarm fetches it again); one with a chunk found damaged on reading ends it too,
        but is kept without that chunk, which is fetched (the origin: taken back) again."""
        self._remove_temporaries()
        try:
            w = read_base(self.path, self.swarm_id)
            if w is not None:
                check_base(self.path, w, book)
        except InvalidInput as e:
            # The chain after it cannot be replayed either: start from what a keyframe gives.
            log.warning("ignoring the base file %s: %s", self.path, e)
            w = None
        if w is not None:
            self.base = Base(w.version, w.state_hash)
        return self.carry(w, book, threads)

    def carry(self, w: Weights | None, book: VersionBook, threads: int | None = None) -> Weights | None:
        """`w` carried forward through the complete stored objects after it (`replay`), in
        place; an object that fails to apply is dropped, so the swarm fetches it again. The
        origin calls it again once chunks a restart found damaged are back."""
        def failed(key: ObjKey) -> None:
            self.store.drop(key)
            book.discard(key)

        return replay(w, book, self.store, threads=threads, on_failure=failed)

    def check_swarm(self) -> None:
        """Refuse (UsageError) a data dir whose base file says it belongs to another swarm, or
        that this member may not read; call it before the store loads, which would drop that
        swarm's objects as unverifiable. A base whose metadata does not read (damage) is left
        to `load` (ignored there, with a warning)."""
        if not self.path.exists():
            return
        try:
            with open(self.path, "rb"):
                pass
        except PermissionError as e:  # not damage: the file may be good, and must not be replaced
            raise UsageError(f"{self.path}: expected a file this member can read, found {e.strerror}; fix its "
                             f"owner or mode to start") from None
        try:
            found = read_metadata(self.path).get(META_SWARM)
        except InvalidInput:
            return
        if found is not None and found != self.swarm_id:
            raise UsageError(f"{self.path}: expected weights of swarm {self.swarm_id}, found swarm {found} "
                             f"(another swarm's data dir, or credentials of another swarm); nothing was changed")

    def _remove_temporaries(self) -> None:
        """A write of the base that a crash interrupted leaves a state-sized temporary
        (node/basefile.py's names); only the member holding the data dir calls load."""
        for pattern in (f"{WEIGHTS_NAME}.tmp-*", f"{WEIGHTS_NAME}.compact-*"):
            for f in self.path.parent.glob(pattern):
                log.info("removing %s, left by an interrupted write of the base", f.name)
                f.unlink(missing_ok=True)

    # ------------------------------------------------------------ what must stay

    def keep_from(self) -> int:
        """The lowest version whose objects must stay in the store: the first after the base."""
        return 0 if self.base is None else self.base.version + 1

    def chain(self, upto: int) -> list[ObjKey]:
        """The patches from the base to `upto`, in order (all must be stored)."""
        if self.base is None:
            return []
        return [(v, False) for v in range(self.base.version + 1, upto + 1)]

    def due(self, version: int) -> bool:
        """Whether the state at `version` should be written as the base now."""
        return self.base is None or version - self.base.version >= self.compact_every

    # ------------------------------------------------------------ writing the base

    def write_base(self, w: Weights) -> int:
        """Write the live state as the base (the first version, or after a keyframe the chain
        cannot bridge); the caller keeps it unchanged until this returns."""
        t0 = time.perf_counter()
        n = basefile.write(self.path, w.state, metadata(w.version, w.state_hash, self.swarm_id))
        self.base = Base(w.version, w.state_hash)
        self.bytes_written += n
        log.info("wrote the base at version %d (%s bytes) in %.1f s", w.version, f"{n:,}", time.perf_counter() - t0)
        return n

    def compact(self, version: int, state_hash: str, threads: int | None = None) -> int:
        """Fold the stored patches after the base into a new base at `version`, without the
        live state (a mapped copy of the base file; node/basefile.py). Blocking: run it on a
        low-priority thread. The store must keep the chain until this returns."""
        if self.base is None:
            raise UsageError("compact: there is no base yet (write_base first)")
        keys = self.chain(version)
        missing = [describe(k) for k in keys if not self.store.complete(k)]
        if missing:
            raise InvalidInput(f"compact: the chain to version {version} lacks {', '.join(missing[:3])}")
        t0 = time.perf_counter()
        patches = _chain_patches(self.store, keys, basefile.table(self.path))
        n = basefile.compact(self.path, patches, self.path, metadata(version, state_hash, self.swarm_id), state_hash,
                             threads=threads, on_object=lambda i: i == 1 and failpoints.hit("compact.applied"))
        self.base = Base(version, state_hash)
        self.compactions += 1
        self.bytes_written += n
        log.info("compacted %d versions into the base at version %d (%s bytes) in %.1f s", len(keys), version,
                 f"{n:,}", time.perf_counter() - t0)
        return n

    def status(self) -> dict:
        return {"base_version": None if self.base is None else self.base.version,
                "compactions": self.compactions, "bytes_written": self.bytes_written,
                "compact_every": self.compact_every}


def _chain_patches(store: ObjectStore, keys: list, table: list):
    """The stored patches of `keys` in order, each read against the table the one before
    leaves (a form-2 manifest lists only its changes to it)."""
    for k in keys:
        patch = patch_of(store.manifest(k), store.chunks(k), table)
        table = table_after(patch)
        yield patch


def read_base(path: Path, swarm_id: str) -> Weights | None:
    """The base file's verified state, or None where there is none."""
    if not path.exists():
        return None
    w = read_weights(path)  # verifies the tensors against the hash it names
    if w is not None and w.swarm_id != swarm_id:
        raise UsageError(f"{path}: holds weights of swarm {w.swarm_id}, this member is in {swarm_id}")
    return w


def check_base(path: Path, w: Weights, book: VersionBook) -> None:
    """Raise InvalidInput where a signed manifest says the state at the base's version is
    another one: the base file hashes to what its own metadata says, not what the trainer
    published (restored from elsewhere, or a swarm restarted under the same id)."""
    for key in ((w.version, True), (w.version, False), (w.version + 1, False)):
        m = book.get(key)
        expected = None if m is None else m.target_hash if key[0] == w.version else m.base_hash
        if expected is not None and expected != w.state_hash:
            raise InvalidInput(f"{path}: expected the state at version {w.version} that the signed {describe(key)} "
                               f"names ({expected[:23]}…), found {w.state_hash[:23]}…")


def replay(w: Weights | None, book: VersionBook, store: ObjectStore, *, threads: int | None = None,
           on_failure=None) -> Weights | None:
    """`w` (the base, or None) carried forward through the complete stored objects `book`
    plans from it, each applied with every check the codec has; an object that fails
    ends the replay at the version before it (`on_failure(key)` is told). A chunk found
    damaged or gone as it is read (ChunkGone: the store forgot it, so the object is no
    longer complete) ends it too, the object kept: the store's load checks chunk sizes
    only, and this is where damage at rest shows."""
    plan = book.plan(None if w is None else w.version, None if w is None else w.state_hash)
    table = None  # the state's tensor table, made once and then carried from object to object
    for key in plan:
        if not store.complete(key):
            # The chain stops here until the swarm brings the rest of this object; the
            # objects after it stay (applied onto the version before, they fail, and were dropped).
            log.info("replay stops before %s (not complete in the store); resuming at %s", describe(key),
                     "no version" if w is None else f"version {w.version}")
            break
        m = store.manifest(key)
        state = {} if key[1] or w is None else w.state
        try:
            if table is None and not key[1]:
                table = table_of(state)
            patch = patch_of(m, store.chunks(key), table)
            # With undo: a failure leaves the state at the version before (restarts are rare).
            apply(state, patch, threads=threads, undo=True)
            table = table_after(patch)
        except ChunkGone as e:
            log.warning("replay stops before %s (%s); resuming at %s", describe(key), e,
                        "no version" if w is None else f"version {w.version}")
            break
        except PatchswarmError as e:
            log.error("replaying %s failed (%s); resuming at %s", describe(key), e,
                      "no version" if w is None else f"version {w.version}")
            if on_failure is not None:
                on_failure(key)
            break
        w = Weights(state, m.version, m.target_hash, book.swarm_id)
    return w


def read_current(data_dir: Path, swarm_id: str, trainer_key) -> Weights | None:
    """Offline and read-only: the latest verified version a member's data dir holds (its
    base file plus the stored objects after it), for tools and tests. It deletes nothing
    and needs no lock; a running member keeps its own view (`DurableState.load`)."""
    data_dir = Path(data_dir)
    book = VersionBook(swarm_id, trainer_key)
    store = ObjectStore.read_only(data_dir / "objects", book)
    return replay(read_base(data_dir / WEIGHTS_NAME, swarm_id), book, store)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
