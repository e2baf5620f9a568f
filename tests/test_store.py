"""The object store across restarts (what start-up keeps, the one rule for what it deletes) and what a read gives back."""

import os

import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from memlink import KEY, store_with
from patchswarm.node.store import OFF_LOOP_MIN_BYTES, ObjectStore
from patchswarm.protocol.manifest import sign_manifest
from patchswarm.protocol.patch import diff
from patchswarm.protocol.publication import manifest_of
from patchswarm.protocol.versions import VersionBook

SWARM = "test-swarm"


def _object(key: Ed25519PrivateKey, version: int = 1):
    g = torch.Generator().manual_seed(version)
    base = {"w": torch.randn(128, 128, generator=g).to(torch.bfloat16)}
    target = {"w": base["w"].clone()}
    target["w"].view(-1).view(torch.int16)[::3] += 1
    p = diff(base, target, chunk_bytes=1_000, segment_elements=1 << 11)
    m = manifest_of(p, swarm_id=SWARM, version=version, created_at=0.0)
    return m, sign_manifest(m, key), p.chunks


def _reopen(root, trainer) -> tuple[ObjectStore, list[str]]:
    store = ObjectStore(root)
    dropped = store.load(VersionBook(SWARM, trainer.public_key()), None)
    return store, dropped


def test_restarts_keep_manifests_and_chunks(tmp_path):
    """The defect: start-up deleted every file that was not a chunk, the manifest
    included, so the second restart dropped every object."""
    trainer = Ed25519PrivateKey.generate()
    m, envelope, chunks = _object(trainer)
    assert len(chunks) > 1
    store = ObjectStore(tmp_path)
    store.write_object((1, False), envelope, chunks)
    store.adopt((1, False), m)
    for restart in range(3):
        store, dropped = _reopen(tmp_path, trainer)
        assert dropped == [], f"restart {restart}: {dropped}"
        assert store.keys() == [(1, False)], f"restart {restart}"
        assert store.complete((1, False)), f"restart {restart}"
        assert (tmp_path / "v0000000001-patch" / "manifest").read_bytes() == envelope
        assert list(store.chunks((1, False))) == chunks


def test_start_up_deletes_only_what_the_store_can_show_is_unusable(tmp_path):
    trainer = Ed25519PrivateKey.generate()
    m, envelope, chunks = _object(trainer)
    store = ObjectStore(tmp_path)
    store.write_object((1, False), envelope, chunks)
    d = tmp_path / "v0000000001-patch"
    (d / f".000000.chunk.{12345}.tmp").write_bytes(b"half a chunk")  # an interrupted write
    (d / ".manifest.777.tmp").write_bytes(b"half a manifest")
    (d / "000001.chunk").write_bytes(b"not the chunk")  # not the size its manifest gives
    (d / "NOTES.txt").write_bytes(b"an operator's file")  # not the store's to judge
    # An object folder without a manifest: an interrupted write_object, nothing checkable.
    (tmp_path / "v0000000002-patch").mkdir()
    (tmp_path / "v0000000002-patch" / "000000.chunk").write_bytes(b"x")
    store, dropped = _reopen(tmp_path, trainer)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        ["manifest", "NOTES.txt"] + [f"{i:06d}.chunk" for i in range(len(chunks)) if i != 1])
    assert store.have((1, False)) == set(range(len(chunks))) - {1}
    assert not (tmp_path / "v0000000002-patch").exists()
    assert len(dropped) == 2 and "000001.chunk" in dropped[0] and "v0000000002-patch" in dropped[1]


def test_start_up_reads_no_chunk_and_a_chunk_damaged_at_rest_is_found_at_its_first_read(tmp_path, monkeypatch):
    """Start-up checks each chunk file's size, not its SHA-256: hashing every held chunk made a
    restart read the whole store (a keyframe of the model) before the member could serve. A
    chunk damaged at rest with its size unchanged is held after start-up and found when it is
    first read: not returned, its file removed, the chunk forgotten and reported lost."""
    import pathlib

    trainer = Ed25519PrivateKey.generate()
    m, envelope, chunks = _object(trainer)
    store = ObjectStore(tmp_path)
    store.write_object((1, False), envelope, chunks)
    d = tmp_path / "v0000000001-patch"
    damaged = bytearray((d / "000002.chunk").read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    (d / "000002.chunk").write_bytes(bytes(damaged))
    (d / "000003.chunk").write_bytes((d / "000003.chunk").read_bytes()[:-1])  # torn: a byte short
    reads = []
    real = pathlib.Path.read_bytes

    def read_bytes(self):
        reads.append(self.name)
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    store, dropped = _reopen(tmp_path, trainer)
    assert reads == ["manifest"]  # no chunk read at start-up
    assert len(dropped) == 1 and "000003.chunk" in dropped[0] and "the manifest gives" in dropped[0]
    assert store.have((1, False)) == set(range(len(chunks))) - {3}
    lost = []
    store.on_lost = lambda key, i: lost.append((key, i))
    assert store.get_chunk((1, False), 0) == chunks[0]
    assert store.get_chunk((1, False), 2) is None  # found at its first read
    assert lost == [((1, False), 2)] and store.chunks_damaged == 1
    assert 2 not in store.have((1, False)) and not (d / "000002.chunk").exists()


def test_an_objects_chunks_are_read_when_reached_not_all_at_once(tmp_path):
    """An apply of a keyframe or a dense patch holds one batch of chunks, not the object:
    the store hands out a sequence that reads each chunk from disk when it is indexed."""
    import pytest

    from patchswarm.protocol.errors import InvalidInput

    trainer = Ed25519PrivateKey.generate()
    m, envelope, chunks = _object(trainer)
    store = ObjectStore(tmp_path)
    store.write_object((1, False), envelope, chunks)
    store.adopt((1, False), m)
    seq = store.chunks((1, False))
    assert not isinstance(seq, list) and len(seq) == len(chunks)
    assert seq[0] == chunks[0] and seq[-1] == chunks[-1] and seq[1:3] == chunks[1:3]
    (tmp_path / "v0000000001-patch" / "000001.chunk").unlink()  # read lazily: the loss shows when reached
    with pytest.raises(InvalidInput, match="chunk 1 is gone"):
        seq[1]


def test_a_manifest_that_cannot_be_read_now_is_left_in_place(tmp_path, monkeypatch):
    """The defect: any OSError reading a manifest (EACCES, EIO) deleted the whole object
    folder, chunks and all, as if the manifest were missing: an error of the moment is no
    proof that what the store wrote is unusable. Now the folder is skipped and left as it is."""
    import pathlib

    trainer = Ed25519PrivateKey.generate()
    m, envelope, chunks = _object(trainer)
    ObjectStore(tmp_path).write_object((1, False), envelope, chunks)
    manifest = tmp_path / "v0000000001-patch" / "manifest"
    real = pathlib.Path.read_bytes

    def read_bytes(self):
        if self == manifest:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    store, dropped = _reopen(tmp_path, trainer)
    assert store.keys() == [] and len(dropped) == 1 and "Permission denied" in dropped[0] and "left" in dropped[0]
    assert manifest.exists() and len(list(manifest.parent.glob("*.chunk"))) == len(chunks)
    monkeypatch.setattr(pathlib.Path, "read_bytes", real)
    store, dropped = _reopen(tmp_path, trainer)
    assert dropped == [] and store.complete((1, False))


def test_an_object_folder_that_cannot_be_listed_is_reported_not_a_crash(tmp_path, monkeypatch):
    import pathlib

    trainer = Ed25519PrivateKey.generate()
    m, envelope, chunks = _object(trainer)
    ObjectStore(tmp_path).write_object((1, False), envelope, chunks)
    folder = tmp_path / "v0000000001-patch"
    real = pathlib.Path.iterdir

    def iterdir(self):
        if self == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "iterdir", iterdir)
    book = VersionBook(SWARM, trainer.public_key())
    store = ObjectStore(tmp_path)
    dropped = store.load(book, None)
    assert store.keys() == [] and book.keys() == [] and "left in place" in dropped[0]
    monkeypatch.setattr(pathlib.Path, "iterdir", real)
    assert len(list(folder.glob("*.chunk"))) == len(chunks)


def test_a_served_chunk_is_read_and_checked_off_the_loop_from_1_mib_and_a_damaged_one_is_dropped(tmp_path, monkeypatch):
    """`get_chunk_off_loop` (the serving path): a chunk of OFF_LOOP_MIN_BYTES or more is read
    and hashed in a worker thread, a smaller one in place; either way what changed on disk
    since it was stored is not returned, its file is removed and the chunk forgotten."""
    big, small = os.urandom(OFF_LOOP_MIN_BYTES), os.urandom(1000)
    store = store_with(tmp_path, [big, small, big[::-1]])
    threads = []
    real = trio.to_thread.run_sync

    async def counting(fn, *args, **kw):
        threads.append(fn.__name__)
        return await real(fn, *args, **kw)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting)
    path = next(p for p in tmp_path.iterdir() if p.is_dir()) / "000002.chunk"
    damaged = bytearray(path.read_bytes())
    damaged[12345] ^= 1
    path.write_bytes(bytes(damaged))

    async def main():
        assert await store.get_chunk_off_loop(KEY, 0) == big
        assert await store.get_chunk_off_loop(KEY, 1) == small
        assert await store.get_chunk_off_loop(KEY, 2) is None
        assert await store.get_chunk_off_loop(KEY, 9) is None  # not held

    trio.run(main)
    assert threads == ["_read_checked", "_read_checked"]  # the two 1 MiB chunks, not the small one
    assert store.chunks_damaged == 1 and not path.exists() and 2 not in store.have(KEY)


def test_a_chunk_forgotten_by_an_apply_thread_leaves_a_held_set_being_iterated_whole(tmp_path):
    """The apply reads chunks in a worker thread and forgets a damaged one, while the event
    loop may be iterating the same object's held set (a bitfield for a peer): that iteration
    must not fail with 'Set changed size during iteration' (the interleaving, played in one thread)."""
    store = store_with(tmp_path, [b"a" * 100, b"b" * 100, b"c" * 100])
    path = next(p for p in tmp_path.iterdir() if p.is_dir()) / "000001.chunk"
    path.write_bytes(b"x" * 100)
    seen = []
    for i in store.have(KEY):
        seen.append(i)
        if i == 0:
            assert store.get_chunk(KEY, 1) is None
    assert seen == [0, 1, 2] and store.have(KEY) == {0, 2} and store.chunks_damaged == 1
