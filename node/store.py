"""A member's objects on disk: signed manifests and verified chunks, to apply and to serve.

Owns the layout under `DATA_DIR/objects/`: one directory per object
(`v{version:010d}-patch` or `-keyframe`) holding `manifest` (the signed
envelope as received) and `NNNNNN.chunk` files. A file is written under a
temporary name (`.NAME.PID.tmp`) and renamed, so a file that exists is whole.
Every read of a chunk checks it against its manifest's SHA-256 again
(`get_chunk`: a crash or a disk error costs a refetch, never a bad apply or a
bad chunk sent); start-up checks each chunk file's size only (`load`). A write
that fails (a full disk) removes its temporary, is reported to `disk` (node/diskspace.py: the one
record of our disk failing) and raises its OSError to the caller, which drops
that write and tries again later. Must not decide what to fetch or keep:
callers say what to drop. The last SERVED_KEPT_BYTES of chunks served are kept in
memory as the bytes that matched the manifest (`serve_chunk`), so a chunk asked for
again is neither read nor hashed, and damage since is still never sent. A held chunk
found damaged or gone on reading is reported to `on_lost` where the owner set it (the
origin, which has no peer to fetch it from, takes it back: node/trainer/recovery.py).

What start-up may delete, the one rule: what this store wrote and can show is
unusable. That is a temporary of an interrupted write, a chunk file that is
not the size its manifest gives (one damaged in place is found when it is
read), and an object folder whose manifest is missing, does not verify, or is
that of another object (nothing in it can be checked). A
file that cannot be read now (EACCES, EIO) is no such proof: it is reported
and left in place, its object not loaded (fetched again if needed). Any other file is left where it is.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from patchswarm.protocol.errors import ChunkGone, InvalidInput
from patchswarm.protocol.manifest import Manifest, ObjKey, describe, key_of
from patchswarm.protocol.versions import NEW, VersionBook

from patchswarm.node.diskspace import DiskCondition

log = logging.getLogger("patchswarm.store")
# Chunks from this size are read and hashed in a worker thread when served (0.6 ms a MiB to
# hash; a thread hand-off is ~0.1 ms): every chunk the origin cuts (1 MiB at least).
OFF_LOOP_MIN_BYTES = 1 << 20
# Chunks served recently, kept as the bytes that were read and checked (`serve_chunk`): a chunk
# asked for again (by another peer, or by one that asks and cancels in a loop) is neither read
# nor hashed again. 32 MiB: the chunks a seeder is serving to a region at once.
SERVED_KEPT_BYTES = 32 << 20
_DIR = re.compile(r"^v(\d{10})-(patch|keyframe)$")
_CHUNK = re.compile(r"^(\d{6})\.chunk$")
_TEMPORARY = re.compile(r"^\..+\.\d+\.tmp$")  # _write_atomic's names
MANIFEST_NAME = "manifest"


def _dirname(key: ObjKey) -> str:
    return f"v{key[0]:010d}-{'keyframe' if key[1] else 'patch'}"


class ObjectStore:
    def __init__(self, root: str | os.PathLike, served_kept_bytes: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._have: dict[ObjKey, set[int]] = {}
        self._manifests: dict[ObjKey, Manifest] = {}
        self.disk = DiskCondition(self.root)
        self.chunks_damaged = 0  # chunks found changed on disk when read (get_chunk), removed
        self._removes = True  # a damaged chunk file found on reading is deleted (not in `read_only`)
        # Told (key, index) of each held chunk found damaged or gone on reading, from the thread
        # that read it (a compaction's worker too): the origin takes it back from nodes.
        self.on_lost: Callable[[ObjKey, int], None] | None = None
        self._init_kept(SERVED_KEPT_BYTES if served_kept_bytes is None else served_kept_bytes)

    def _init_kept(self, limit: int) -> None:
        # (object, chunk) -> its bytes as read and checked, least recently served first. A lock:
        # an apply's worker thread forgets chunks (`_forget`) while the loop serves.
        self._kept: collections.OrderedDict[tuple[ObjKey, int], bytes] = collections.OrderedDict()
        self._kept_bytes, self._kept_limit, self._kept_lock = 0, limit, threading.Lock()
        self.chunk_reads = 0  # chunks read from disk and hashed to serve them (`serve_chunk`)

    @classmethod
    def read_only(cls, root: str | os.PathLike, book: VersionBook) -> "ObjectStore":
        """The verified objects under `root` as they are, for tools and tests: nothing is
        created or deleted (a running member may own the folder)."""
        store = cls.__new__(cls)
        store.root, store._have, store._manifests = Path(root), {}, {}
        store.chunks_damaged, store._removes, store.on_lost = 0, False, None
        store._init_kept(SERVED_KEPT_BYTES)
        store.disk = DiskCondition(store.root)
        if store.root.is_dir():
            store._scan(book, None, delete=False)
        return store

    def load(self, book: VersionBook, current_version: int | None) -> list[str]:
        """Re-read what survived a restart into `book`; returns one line per thing dropped.

        Each manifest's signature is checked, each chunk file's size only: a chunk's
        SHA-256 is checked on every read (`get_chunk`), so one damaged at rest is found
        when it is first served or applied, removed and fetched again, never sent.
        *Why not hash here:* that read the whole store at every start before the member
        could serve, the latest keyframe included, so a restart cost the model's bytes
        (bench/restart_cost.py, a 2 GiB store: 1.59 s -> 0.010 s from the page cache,
        3.5 s -> 0.026 s from the disk; ~6 and ~14 min at 500 GB before)."""
        return self._scan(book, current_version, delete=True)

    def _scan(self, book: VersionBook, current_version: int | None, delete: bool) -> list[str]:
        dropped = []
        for d in sorted(self.root.iterdir()):
            m = _DIR.match(d.name)
            if not m or not d.is_dir():
                continue
            key = (int(m.group(1)), m.group(2) == "keyframe")
            try:
                envelope = (d / MANIFEST_NAME).read_bytes()
            except FileNotFoundError:
                envelope = None
            except OSError as e:  # EACCES, EIO: no proof that the object is unusable
                dropped.append(f"{d.name}: {e}; not loaded, left in place")
                continue
            try:
                if envelope is None:
                    raise InvalidInput(f"expected a {MANIFEST_NAME} file, found none (an interrupted write)")
                status, manifest = book.offer(envelope, current_version)
                if key_of(manifest) != key:
                    # Served under this name, its chunks would fail the SHA-256 peers hold for it.
                    if status == NEW:
                        book.discard(key_of(manifest))
                    raise InvalidInput(f"expected the manifest of {describe(key)}, found that of "
                                       f"{describe(key_of(manifest))}")
            except InvalidInput as e:
                dropped.append(f"{d.name}: {e}")
                if delete:
                    shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                files = list(d.iterdir())
            except OSError as e:
                if status == NEW:
                    book.discard(key)
                dropped.append(f"{d.name}: {e}; not loaded, left in place")
                continue
            self._manifests[key] = manifest
            have = self._have.setdefault(key, set())
            for f in files:
                if _TEMPORARY.match(f.name):
                    if delete:
                        f.unlink(missing_ok=True)  # an interrupted write
                    continue
                c = _CHUNK.match(f.name)
                if not c:
                    continue  # the manifest, or a file that is not the store's to judge
                i = int(c.group(1))
                try:
                    size = f.stat().st_size
                except OSError as e:
                    dropped.append(f"{d.name}/{f.name}: {e}")
                    continue
                if i < len(manifest.chunks) and size == manifest.chunks[i][0]:
                    have.add(i)
                else:
                    expected = (f"{manifest.chunks[i][0]:,} bytes" if i < len(manifest.chunks)
                                else f"no chunk {i} (it has {len(manifest.chunks)})")
                    dropped.append(f"{d.name}/{f.name}: does not match its manifest: {size:,} bytes, "
                                   f"the manifest gives {expected}")
                    if delete:
                        f.unlink(missing_ok=True)
        return dropped

    def put_manifest(self, key: ObjKey, manifest: Manifest, envelope: bytes) -> None:
        d = self.root / _dirname(key)
        try:
            d.mkdir(exist_ok=True)
            _write_atomic(d / MANIFEST_NAME, envelope)
        except OSError as e:
            self.disk.failed(f"the manifest of {d.name}", e)
            raise
        self.disk.succeeded()
        self._manifests[key] = manifest
        self._have.setdefault(key, set())

    def write_object(self, key: ObjKey, envelope: bytes, chunks: list[bytes]) -> None:
        """Write a whole object's files; touches no in-memory state, so it may run in a
        worker thread. `adopt` it afterwards, from the owning thread."""
        d = self.root / _dirname(key)
        d.mkdir(exist_ok=True)
        for i, c in enumerate(chunks):
            _write_atomic(d / f"{i:06d}.chunk", c)
        _write_atomic(d / MANIFEST_NAME, envelope)

    def writer(self, key: ObjKey) -> "ObjectWriter":
        """Write an object chunk by chunk as it is made (`add`), its manifest last
        (`finish`): a keyframe of any size never has to be held whole. Touches no
        in-memory state (may run in a worker thread); `adopt` it afterwards."""
        d = self.root / _dirname(key)
        shutil.rmtree(d, ignore_errors=True)  # leftovers of an interrupted publish of this key
        d.mkdir()
        return ObjectWriter(d)

    def adopt(self, key: ObjKey, manifest: Manifest) -> None:
        """Start serving an object whose files `write_object` wrote."""
        self._unkeep(key)
        self._manifests[key] = manifest
        self._have[key] = set(range(len(manifest.chunks)))

    def put_chunk(self, key: ObjKey, index: int, data: bytes) -> None:
        """Store a chunk the caller has verified against the manifest (an OSError: not stored,
        nothing left behind; `disk` was told)."""
        try:
            _write_atomic(self.root / _dirname(key) / f"{index:06d}.chunk", data)
        except OSError as e:
            self.disk.failed(f"chunk {index} of {_dirname(key)} ({len(data):,} bytes)", e)
            raise
        self.disk.succeeded()
        self._unkeep(key, index)
        self._have[key].add(index)

    def get_chunk(self, key: ObjKey, index: int) -> bytes | None:
        """A held chunk as read from disk and checked against its manifest again; None if it is
        not held, or no longer: the file is gone, or it changed on disk since it was stored
        (bit rot, a bad sector, another program). A damaged file is removed and the chunk
        forgotten, so it is fetched again where it is needed and never served or applied.

        *Why here:* a peer that receives a chunk that does not match its manifest drops the
        sender as a source of bad data, so a member must not send what its own disk damaged.
        The check costs one SHA-256 per chunk read (0.6 ms/MiB), on what is served or applied:
        it grows with the patch and its readers, never with the model. Serving reads through
        `get_chunk_off_loop`, so that the event loop pays for neither the read nor the hash."""
        found = self._locate(key, index)
        return None if found is None else self._settle(key, index, found[0], _read_checked(*found))

    async def get_chunk_off_loop(self, key: ObjKey, index: int) -> bytes | None:
        """`get_chunk`, its file read and SHA-256 in a worker thread (hashlib lets go of the
        GIL) for a chunk of OFF_LOOP_MIN_BYTES or more: an origin serving 1 GB/s would
        otherwise spend most of its loop hashing. A smaller one is read here: handing it to
        a thread would cost about what hashing it does."""
        found = self._locate(key, index)
        if found is None:
            return None
        if found[1][0] < OFF_LOOP_MIN_BYTES:
            return self._settle(key, index, found[0], _read_checked(*found))
        return self._settle(key, index, found[0], await trio.to_thread.run_sync(_read_checked, *found))

    async def serve_chunk(self, key: ObjKey, index: int) -> tuple[bytes | None, bool]:
        """`get_chunk_off_loop` for serving, and whether it read the file: a chunk served
        recently is given as the bytes read and checked then (SERVED_KEPT_BYTES of them,
        the least recently served let go first), not read nor hashed again.

        *Why:* a peer may ask for a held chunk and cancel at once, in a loop: a few dozen
        bytes that cost this node a file read and a SHA-256 of the chunk each (measured: 1000
        pairs over 8 chunks of 1 MiB, 997 reads, 1.0 s of CPU). Kept bytes are the very bytes
        that matched the manifest, so damage on disk since then is never sent: it is found
        when the chunk is read again (let go from here, or `_forget`ten)."""
        found = self._locate(key, index)
        if found is None:
            return None, False
        kept = self._kept_get(key, index)
        if kept is not None:
            return kept, False
        data = await self.get_chunk_off_loop(key, index)
        self.chunk_reads += 1
        self._keep(key, index, data)
        return data, True

    def serve_chunk_now(self, key: ObjKey, index: int) -> tuple[bytes | None, bool]:
        """`serve_chunk` on the calling thread (`get_chunk`'s read and hash in place)."""
        if self._locate(key, index) is None:
            return None, False
        kept = self._kept_get(key, index)
        if kept is not None:
            return kept, False
        data = self.get_chunk(key, index)
        self.chunk_reads += 1
        self._keep(key, index, data)
        return data, True

    def _kept_get(self, key: ObjKey, index: int) -> bytes | None:
        with self._kept_lock:
            data = self._kept.get((key, index))
            if data is not None:
                self._kept.move_to_end((key, index))
            return data

    def _keep(self, key: ObjKey, index: int, data: bytes | None) -> None:
        if data is None or len(data) > self._kept_limit or index not in self._have.get(key, ()):
            return  # gone, too big to keep, or forgotten while it was read
        with self._kept_lock:
            old = self._kept.pop((key, index), None)
            self._kept_bytes += len(data) - (0 if old is None else len(old))
            self._kept[(key, index)] = data
            while self._kept_bytes > self._kept_limit:
                self._kept_bytes -= len(self._kept.popitem(last=False)[1])

    def _unkeep(self, key: ObjKey, index: int | None = None) -> None:
        """Let go of a kept chunk (every chunk of the object with `index` None): its file
        was rewritten, removed or found damaged."""
        with self._kept_lock:
            for k in [(key, index)] if index is not None else [k for k in self._kept if k[0] == key]:
                data = self._kept.pop(k, None)
                if data is not None:
                    self._kept_bytes -= len(data)

    def _locate(self, key: ObjKey, index: int) -> tuple[Path, tuple[int, bytes]] | None:
        """(file, (size, SHA-256) the manifest gives) of a held chunk; None if not held."""
        if index not in self._have.get(key, ()):
            return None
        return self.root / _dirname(key) / f"{index:06d}.chunk", self._manifests[key].chunks[index]

    def _settle(self, key: ObjKey, index: int, path: Path, read: tuple[bytes, bool] | None) -> bytes | None:
        """The chunk `_read_checked` found, or None: a missing or damaged chunk is forgotten
        (a damaged file removed, except in a read-only store)."""
        if read is None:
            self._forget(key, index)
            self._lost(key, index)
            return None
        data, intact = read
        if intact:
            return data
        self._forget(key, index)
        self.chunks_damaged += 1
        self._lost(key, index)
        log.warning("chunk %d of %s changed on disk since it was stored (%s bytes, expected %s with the "
                    "manifest's SHA-256): removed, fetched again where needed", index, _dirname(key),
                    f"{len(data):,}", f"{self._manifests[key].chunks[index][0]:,}" if key in self._manifests else "?")
        if self._removes:
            path.unlink(missing_ok=True)
        return None

    def _lost(self, key: ObjKey, index: int) -> None:
        if self.on_lost is not None:
            self.on_lost(key, index)

    def _forget(self, key: ObjKey, index: int) -> None:
        """Drop a chunk from the held set by replacing the set: an apply's worker thread
        forgets chunks here while the event loop may be iterating `have(key)` (a bitfield);
        a complete object, the only kind applied, gets no chunk added meanwhile."""
        self._unkeep(key, index)
        held = self._have.get(key)
        if held is not None and index in held:
            self._have[key] = held - {index}

    def chunks(self, key: ObjKey) -> "StoredChunks":
        """Every chunk of a complete object, in index order, each read from disk when it is
        reached: an apply holds one batch of a keyframe or a dense patch, not all of it."""
        n = len(self._manifests[key].chunks)
        missing = sorted(set(range(n)) - self._have.get(key, set()))
        if missing:
            raise InvalidInput(f"object {_dirname(key)}: chunks {missing[:5]} are missing")
        return StoredChunks(self, key, n)

    def have(self, key: ObjKey) -> set[int]:
        return self._have.get(key, set())

    def keys(self) -> list[ObjKey]:
        return sorted(self._manifests)

    def manifest(self, key: ObjKey) -> Manifest | None:
        return self._manifests.get(key)

    def complete(self, key: ObjKey) -> bool:
        m = self._manifests.get(key)
        return m is not None and len(self._have.get(key, ())) == len(m.chunks)

    def drop(self, key: ObjKey) -> None:
        self._unkeep(key)
        self._have.pop(key, None)
        self._manifests.pop(key, None)
        shutil.rmtree(self.root / _dirname(key), ignore_errors=True)


def _read_checked(path: Path, expected: tuple[int, bytes]) -> tuple[bytes, bool] | None:
    """A chunk file's bytes and whether they are what the manifest says; None if it is gone.
    Touches nothing else: runs in worker threads."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return data, (len(data), hashlib.sha256(data).digest()) == tuple(expected)


class StoredChunks(Sequence):
    """A complete object's chunks as a sequence that reads each from the store when indexed."""

    def __init__(self, store: ObjectStore, key: ObjKey, n: int):
        self._store, self._key, self._n = store, key, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        data = self._store.get_chunk(self._key, i % self._n)
        if data is None:  # removed or damaged since the object was complete: fetched again, never applied half
            raise ChunkGone(f"object {_dirname(self._key)}: chunk {i % self._n} is gone from the store")
        return data


def _write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` whole, or is as it was (a failed write leaves no temporary)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class ObjectWriter:
    """Chunk files of one object as they come; `table` is their (size, SHA-256) list."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.table: list[tuple[int, bytes]] = []

    def add(self, chunk: bytes) -> None:
        _write_atomic(self.directory / f"{len(self.table):06d}.chunk", chunk)
        self.table.append((len(chunk), hashlib.sha256(chunk).digest()))

    def finish(self, envelope: bytes) -> None:
        """The manifest goes last: an object without one is an interrupted write (dropped at start)."""
        _write_atomic(self.directory / MANIFEST_NAME, envelope)


def latest_version(root: str | os.PathLike) -> int | None:
    """The highest version with a manifest in an object store's folder, read without
    loading or verifying anything (for tools looking at a member's data dir)."""
    found = [int(m.group(1)) for d in Path(root).iterdir() if (m := _DIR.match(d.name))
             and (d / MANIFEST_NAME).exists()] if Path(root).is_dir() else []
    return max(found, default=None)
