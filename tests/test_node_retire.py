"""What a node keeps after applying a version, in process: the window late peers ask for, the
patches since its base, and (for nodes that join later) the latest keyframe it holds with the
patches after it, until a newer keyframe comes out or the disk runs short of room."""

import logging

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node import diskspace
from patchswarm.node.applier import Applier
from patchswarm.node.fetcher import Fetcher
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.peers import PeerSet
from patchswarm.node.persistence import DurableState
from patchswarm.node.relay import Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.node.weights import Weights, write_weights
from patchswarm.protocol.manifest import sign_manifest
from patchswarm.protocol.patch import diff, keyframe
from patchswarm.protocol.picker import PiecePicker
from patchswarm.protocol.publication import manifest_of
from patchswarm.protocol.statehash import state_hash
from patchswarm.protocol.versions import VersionBook

SWARM = "sw"
LAST = 9  # versions 0..LAST; the node holds keyframe 1 and patches 2..LAST


async def _noop(s, msg) -> None:
    pass


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(32, 32, generator=g).to(torch.bfloat16) for i in range(3)}
    out = [state]
    for v in range(1, n):
        state = {k: t.clone() for k, t in state.items()}
        for t in state.values():
            t.view(-1).view(torch.int16)[v::7] += 1
        out.append(state)
    return out


class Node:
    """An applier over a store that holds keyframe 1 and patches 2..LAST, its base at `base`."""

    def __init__(self, tmp_path, base: int, keep_keyframe: bool = True):
        self.key = Ed25519PrivateKey.generate()
        self.states = _states(LAST + 2)
        self.hashes = [state_hash(s) for s in self.states]
        self.store = ObjectStore(tmp_path / "objects")
        self.book = VersionBook(SWARM, self.key.public_key())
        self._put((1, True), keyframe(self.states[1], chunk_bytes=512))
        for v in range(2, LAST + 1):
            self._put((v, False), diff(self.states[v - 1], self.states[v], chunk_bytes=512))
        picker, inflows = PiecePicker("n1", "r0", "r0"), Inflows()
        fetcher = Fetcher("n1", "r0", picker, PeerSet("n1", self.store, TokenBucket(None), _noop, inflows=inflows),
                          inflows, self.store, self.book, on_complete=lambda key: None)
        self.applier = Applier(self.book, self.store, fetcher, DurableState(tmp_path, self.store, SWARM),
                               keep_versions=4, apply_nice=0, apply_threads=None, keep_keyframe=keep_keyframe)
        write_weights(self.applier.base_path, Weights(self.states[base], base, self.hashes[base], SWARM))
        self.applier.weights = self.applier.load_weights()
        assert self.applier.version == LAST and self.applier.durable.keep_from() == base + 1

    def _put(self, key, patch, held: bool = True) -> None:
        m = manifest_of(patch, swarm_id=SWARM, version=key[0], created_at=0.0)
        envelope = sign_manifest(m, self.key)
        self.book.offer(envelope)
        if held:
            self.store.write_object(key, envelope, patch.chunks)
            self.store.adopt(key, m)

    def announce_keyframe(self, version: int) -> None:
        """A newer keyframe's manifest, as the tracker hands it on; its chunks are not held."""
        self._put((version, True), keyframe(self.states[version], chunk_bytes=512), held=False)

    def kept(self) -> list[tuple[int, bool]]:
        return sorted(self.store.keys())


def test_a_node_holding_the_latest_keyframe_keeps_it_and_the_patches_after_it(tmp_path):
    node = Node(tmp_path, base=7)  # compacted to 7: a restart needs only 8 and 9
    node.applier._retire(LAST)
    assert node.kept() == [(1, True)] + [(v, False) for v in range(2, LAST + 1)]
    assert node.applier.kept_keyframe == 1
    assert node.book.get((1, True)) is not None  # the book still hands it to the plan and peers


def test_without_keep_keyframe_only_the_window_and_the_chain_since_the_base_stay(tmp_path):
    node = Node(tmp_path, base=7, keep_keyframe=False)
    node.applier._retire(LAST)
    assert node.kept() == [(v, False) for v in range(LAST - 4, LAST + 1)]
    assert node.applier.kept_keyframe is None


def test_a_newer_keyframe_the_node_does_not_hold_lets_the_older_one_go(tmp_path):
    node = Node(tmp_path, base=7)
    node.applier._retire(LAST)
    node.announce_keyframe(LAST + 1)  # joiners are handed that one now; nobody asks for 1
    node.applier._retire(LAST)
    assert node.kept() == [(v, False) for v in range(LAST - 4, LAST + 1)]
    assert node.applier.kept_keyframe is None


def test_the_keyframe_is_let_go_once_free_space_is_under_the_base_size(tmp_path, monkeypatch, caplog):
    node = Node(tmp_path, base=7)
    base_bytes = node.applier.base_path.stat().st_size
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: base_bytes - 1)
    with caplog.at_level(logging.WARNING, logger="patchswarm.node"):
        node.applier._retire(LAST)
    assert node.kept() == [(v, False) for v in range(LAST - 4, LAST + 1)]
    lines = [r.getMessage() for r in caplog.records if "late joiners" in r.getMessage()]
    assert len(lines) == 1 and "v1's keyframe" in lines[0] and f"{base_bytes:,} B" in lines[0], lines


def test_with_room_the_keyframe_stays_and_a_keyframe_not_held_whole_is_not_kept(tmp_path, monkeypatch):
    node = Node(tmp_path, base=7)
    base_bytes = node.applier.base_path.stat().st_size
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: base_bytes)
    node.applier._retire(LAST)
    assert (1, True) in node.kept()
    # A chunk of it found damaged on a read, and removed: not whole, so not kept for joiners.
    path = next((tmp_path / "objects").glob("*keyframe/000000.chunk"))
    path.write_bytes(bytes([path.read_bytes()[0] ^ 1]) + path.read_bytes()[1:])
    assert node.store.get_chunk((1, True), 0) is None and not node.store.complete((1, True))
    node.applier._retire(LAST)
    assert node.kept() == [(v, False) for v in range(LAST - 4, LAST + 1)]
