"""A node's start-up on damaged or unexpected on-disk state: the base file plus the stored chain.

Each test builds a real data dir (a base file at version 0 and signed patches 1..3
in the object store), damages it, and runs what the daemon runs at start-up
(`ObjectStore.load`, then `DurableState.load`): the node must resume at a
verified version, keep what it can still use, and drop only what it cannot verify.
"""

from pathlib import Path

import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.daemon import Node, NodeConfig
from patchswarm.node.net.trust import init_swarm, issue
from patchswarm.node.persistence import DurableState
from patchswarm.node.store import ObjectStore
from patchswarm.node.weights import WEIGHTS_NAME, Weights, write_weights
from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.manifest import sign_manifest
from patchswarm.protocol.patch import diff
from patchswarm.protocol.publication import manifest_of
from patchswarm.protocol.statehash import state_hash
from patchswarm.protocol.versions import VersionBook

SWARM = "sw"
VERSIONS = 3


def _states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    s = {"w": torch.randn(96, 96, generator=g).to(torch.bfloat16)}
    out = [s]
    for v in range(VERSIONS):
        s = {k: t.clone() for k, t in s.items()}
        s["w"].view(-1).view(torch.int16)[v::5] += 1
        out.append(s)
    return out


def _data_dir(tmp_path):
    """(data dir, trainer key, states): a base at version 0 and patches 1..VERSIONS stored."""
    trainer = Ed25519PrivateKey.generate()
    states = _states()
    store = ObjectStore(tmp_path / "objects")
    for v in range(1, VERSIONS + 1):
        p = diff(states[v - 1], states[v], chunk_bytes=1_000, segment_elements=1 << 11)
        assert len(p.chunks) > 1
        m = manifest_of(p, swarm_id=SWARM, version=v, created_at=0.0)
        store.write_object((v, False), sign_manifest(m, trainer), p.chunks)
    write_weights(tmp_path / WEIGHTS_NAME, Weights(states[0], 0, state_hash(states[0]), SWARM))
    return tmp_path, trainer, states


def _start(data_dir, trainer):
    """What the daemon does at start-up: (store, durable, weights, dropped lines)."""
    book = VersionBook(SWARM, trainer.public_key())
    store = ObjectStore(data_dir / "objects")
    dropped = store.load(book, None)
    durable = DurableState(data_dir, store, SWARM)
    return store, durable, durable.load(book), dropped


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def test_an_undamaged_data_dir_resumes_at_its_last_version(tmp_path):
    d, trainer, states = _data_dir(tmp_path)
    store, durable, w, dropped = _start(d, trainer)
    assert dropped == [] and w.version == VERSIONS and _same(w.state, states[VERSIONS])


def test_a_damaged_chunk_stops_the_replay_before_its_object_and_keeps_the_objects_after_it(tmp_path):
    """The defect: replay filtered the plan down to complete objects, so with a chunk of v2
    dropped it applied v3 straight onto v1; the codec caught it, and the replay then
    deleted v3, a complete verified object the node could still use."""
    d, trainer, states = _data_dir(tmp_path)
    chunk = d / "objects" / "v0000000002-patch" / "000001.chunk"
    chunk.write_bytes(chunk.read_bytes()[:-1])  # truncated
    store, durable, w, dropped = _start(d, trainer)
    assert len(dropped) == 1 and "000001.chunk" in dropped[0]
    assert w.version == 1 and _same(w.state, states[1])
    assert store.complete((3, False)), "v3 is verified and needed once v2's chunk is fetched again"
    assert (d / "objects" / "v0000000003-patch" / "manifest").exists()
    # Once the chunk is back, the next start replays the whole chain.
    p = diff(states[1], states[2], chunk_bytes=1_000, segment_elements=1 << 11)
    chunk.write_bytes(p.chunks[1])
    store, durable, w, dropped = _start(d, trainer)
    assert dropped == [] and w.version == VERSIONS and _same(w.state, states[VERSIONS])


def test_a_chunk_damaged_at_rest_with_its_size_stops_the_replay_at_its_read_and_keeps_its_object(tmp_path):
    """Start-up checks chunk sizes only (node/store.py `load`); a chunk of v2 with one bit
    flipped is found when the replay reads it: the replay resumes at v1, v2 is kept without
    that chunk (fetched again; the origin takes it back) and v3 is kept whole, not dropped as
    an object that failed to apply."""
    d, trainer, states = _data_dir(tmp_path)
    chunk = d / "objects" / "v0000000002-patch" / "000001.chunk"
    good = chunk.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x04
    chunk.write_bytes(bytes(bad))
    store, durable, w, dropped = _start(d, trainer)
    assert dropped == []  # the size is right: start-up cannot tell
    assert w.version == 1 and _same(w.state, states[1])
    assert store.manifest((2, False)) is not None and store.have((2, False)) == set(range(
        len(store.manifest((2, False)).chunks))) - {1}
    assert store.complete((3, False)) and not chunk.exists() and store.chunks_damaged == 1
    chunk.write_bytes(good)  # fetched again
    store, durable, w, dropped = _start(d, trainer)
    assert dropped == [] and w.version == VERSIONS and _same(w.state, states[VERSIONS])


def test_a_manifest_in_another_objects_folder_is_not_served_under_that_folders_name(tmp_path):
    """The defect: the store keyed an object by its folder's name, not by its signed manifest,
    so a v2 manifest under v0000000009-patch was served to peers as v9 (chunks that fail
    v9's SHA-256 from an honest node) and v2 counted as absent."""
    d, trainer, states = _data_dir(tmp_path)
    (d / "objects" / "v0000000002-patch").rename(d / "objects" / "v0000000009-patch")
    store, durable, w, dropped = _start(d, trainer)
    assert (9, False) not in store.keys() and store.manifest((9, False)) is None
    assert any("v0000000009-patch" in line and "found that of v2 patch" in line for line in dropped), dropped
    assert w.version == 1 and _same(w.state, states[1])
    assert store.complete((3, False))


def test_a_copy_of_another_objects_manifest_does_not_hide_that_object(tmp_path):
    d, trainer, states = _data_dir(tmp_path)
    objects = d / "objects"
    (objects / "v0000000002-patch" / "manifest").write_bytes((objects / "v0000000003-patch" / "manifest").read_bytes())
    store, durable, w, dropped = _start(d, trainer)
    assert len(dropped) == 1 and "expected the manifest of v2 patch, found that of v3 patch" in dropped[0]
    assert store.complete((3, False)) and store.manifest((2, False)) is None
    assert w.version == 1 and _same(w.state, states[1])


def test_a_base_file_whose_state_is_not_the_signed_chains_is_not_resumed_from(tmp_path, caplog):
    """The defect: a base file that hashes to what its own metadata says, but whose state is not
    the one the signed manifests name at its version (the v1 patch's base hash), was taken as
    version 0: the node served a state no trainer published, could not replay the stored chain,
    and stayed there until the next keyframe."""
    d, trainer, states = _data_dir(tmp_path)
    other = {k: t.clone() for k, t in states[0].items()}
    other["w"].view(-1).view(torch.int16)[7] += 1
    write_weights(d / WEIGHTS_NAME, Weights(other, 0, state_hash(other), SWARM))
    store, durable, w, dropped = _start(d, trainer)
    assert w is None and durable.base is None, "no verified version: fetch a keyframe"
    assert all(store.complete((v, False)) for v in range(1, VERSIONS + 1)), "the chain stays"
    lines = [r.getMessage() for r in caplog.records if "base file" in r.getMessage()]
    assert len(lines) == 1 and "v1 patch" in lines[0] and state_hash(other)[:20] in lines[0], lines
    # The matching base: the stored chain replays to the last version.
    write_weights(d / WEIGHTS_NAME, Weights(states[0], 0, state_hash(states[0]), SWARM))
    store, durable, w, dropped = _start(d, trainer)
    assert w.version == VERSIONS and _same(w.state, states[VERSIONS])


def test_a_node_refuses_another_swarms_data_dir_before_it_deletes_anything(tmp_path):
    """The defect: start-up loaded the object store first, which deletes every object folder
    whose manifest does not verify (all of them, under another swarm's key), and only then
    read the base file and refused it as another swarm's: a wrong --data-dir or --creds
    destroyed the other swarm's stored chain before the node said no."""
    d, trainer, states = _data_dir(tmp_path / "data")
    before = sorted(p.relative_to(d) for p in (d / "objects").rglob("*"))
    node = _node(tmp_path, d)
    with pytest.raises(UsageError, match=f"{WEIGHTS_NAME}: expected weights of swarm {node.swarm_id}, found swarm {SWARM}"):
        _run(node)
    assert sorted(p.relative_to(d) for p in (d / "objects").rglob("*")) == before


def _node(tmp_path, data_dir, **cfg) -> Node:
    """A node of a swarm of its own (credentials issued here), on `data_dir`; its tracker
    address is a closed port: these tests end at start-up."""
    if not (tmp_path / "creds").exists():
        init_swarm(tmp_path / "swarm")
        issue(tmp_path / "swarm", "n1", "node", tmp_path / "creds")
    return Node(NodeConfig("127.0.0.1:9", tmp_path / "creds", data_dir, "127.0.0.1:0", "r0", **cfg))


def _run(node: Node) -> None:
    async def main():
        with trio.fail_after(30):  # a node that starts runs until cancelled: these must refuse
            await node.run()
    trio.run(main)


@pytest.mark.parametrize("name,make", [("objects", "file"), ("spool", "file"), ("changes", "file"),
                                       (WEIGHTS_NAME, "dir"), ("lock", "dir")])
def test_a_file_where_a_folder_belongs_or_the_reverse_is_named_at_start_up(tmp_path, name, make):
    """Before: `[Errno 17] File exists: D/objects` (what was expected unsaid), and a folder
    named weights.safetensors was ignored as an unreadable base while every later base
    write failed on it, reported as our disk failing."""
    d = tmp_path / "data"
    d.mkdir()
    (d / name).mkdir() if make == "dir" else (d / name).write_bytes(b"x")
    expected = "a file, found a directory" if make == "dir" else "a directory, found a file"
    with pytest.raises(UsageError, match=f"{name}: expected {expected}"):
        _run(_node(tmp_path, d, sparse_handoff=True))


def test_a_base_file_the_node_may_not_read_is_refused_not_replaced(tmp_path, monkeypatch):
    """The defect: a base file that could not be opened (EACCES: chowned to another user) was
    'ignored' like a damaged one; the node fell back to a keyframe (fetched whole where none
    was stored) and its next base write replaced the file, a good state it could use once
    its permissions are fixed. Now start-up refuses with the file and the error."""
    import builtins

    from patchswarm.node import persistence

    d, trainer, states = _data_dir(tmp_path / "data")
    base = d / WEIGHTS_NAME

    def deny(path, *args, **kwargs):
        if Path(path) == base:
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(persistence, "open", deny, raising=False)
    store = ObjectStore(d / "objects")
    with pytest.raises(UsageError, match=f"{WEIGHTS_NAME}: expected a file this member can read, found Permission denied"):
        DurableState(d, store, SWARM).check_swarm()
