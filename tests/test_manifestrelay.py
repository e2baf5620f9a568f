"""node/manifestrelay.py: a hinted manifest is asked of the tracker only when no peer passed it on in time."""

from __future__ import annotations

import hashlib

import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.manifestrelay import MAX_HINTS_WAITING, ManifestRelay
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.peers import PeerSet
from patchswarm.protocol import wire
from patchswarm.protocol.manifest import Manifest, sign_manifest
from patchswarm.protocol.versions import NEW, VersionBook

KEY = Ed25519PrivateKey.generate()
SWARM = "s" * 16


def envelope(version: int) -> bytes:
    h = "blake3:" + hashlib.sha256(b"%d" % version).hexdigest()
    return sign_manifest(Manifest(swarm_id=SWARM, version=version, base_version=None, base_hash=None, target_hash=h,
                                  tensors=[["w", "bf16", [4]]], chunks=[(100, hashlib.sha256(b"x").digest())],
                                  codec={"format": 2}, created_at=0.0), KEY)


def relay(asked: list):
    book = VersionBook(SWARM, KEY.public_key())

    async def offer(env: bytes, source: str, from_peer: bool = False) -> bool:
        return book.offer(env, None)[0] == NEW

    async def ask(msg) -> bool:
        asked.append((trio.current_time(), msg))
        return True

    peers = PeerSet("me", None, TokenBucket(None), lambda s, m: None)
    return ManifestRelay(offer, lambda key: book.get(key) is not None, peers, ask, wait=1.0)


def run(body):
    async def main():
        async with trio.open_nursery() as n:
            await body(n)
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_hint_no_peer_answers_is_asked_of_the_tracker_once_after_the_wait():
    asked = []

    async def body(n):
        r = relay(asked)
        n.start_soon(r.run)
        t0 = trio.current_time()
        r.hinted(wire.VersionHint(3, True))
        r.hinted(wire.VersionHint(3, True))  # the same hint again: one wait, one request
        await trio.sleep(5)
        assert [(round(t - t0, 3), m) for t, m in asked] == [(1.0, wire.ManifestRequest(3, True))]
        assert r.status() == {"manifests_passed_on": 0, "manifests_requested": 1, "hints_waiting": 0}

    run(body)


def test_a_manifest_that_arrives_in_time_or_is_held_already_is_not_asked_for():
    asked = []

    async def body(n):
        r = relay(asked)
        n.start_soon(r.run)
        await r.notice(wire.VersionNotice(1, envelope(1)), None)
        r.hinted(wire.VersionHint(1, True))  # held already
        r.hinted(wire.VersionHint(2, True))
        await trio.sleep(0.5)
        await r.notice(wire.VersionNotice(2, envelope(2)), None)  # as from a peer, within the wait
        await trio.sleep(5)
        assert asked == []

    run(body)


def test_hints_waiting_are_bounded():
    asked = []

    async def body(n):
        r = relay(asked)
        for v in range(MAX_HINTS_WAITING + 10):
            r.hinted(wire.VersionHint(v, False))
        assert r.status()["hints_waiting"] == MAX_HINTS_WAITING
        n.start_soon(r.run)
        await trio.sleep(5)
        assert len(asked) == MAX_HINTS_WAITING

    run(body)


def node_applier(tmp_path):
    """A node's applier and book over an empty data dir: a member with no version yet."""
    from patchswarm.node.applier import Applier
    from patchswarm.node.fetcher import Fetcher
    from patchswarm.node.persistence import DurableState
    from patchswarm.node.relay import Inflows
    from patchswarm.node.store import ObjectStore
    from patchswarm.protocol.picker import PiecePicker

    store = ObjectStore(tmp_path / "objects")
    book = VersionBook(SWARM, KEY.public_key())
    inflows = Inflows()
    peers = PeerSet("me", store, TokenBucket(None), lambda s, m: None, inflows=inflows)
    fetcher = Fetcher("me", "r0", PiecePicker("me", "r0", "r0"), peers, inflows, store, book, lambda key: None)
    applier = Applier(book, store, fetcher, DurableState(tmp_path, store, SWARM), keep_versions=4, apply_nice=0,
                      apply_threads=None)
    return applier, book, peers


def test_a_peer_that_passes_on_a_manifest_that_does_not_verify_is_dropped(tmp_path):
    """Members pass on only manifests they verified, so one that does not verify (not the
    trainer's signature, not a manifest at all, another swarm's) is the sender's fault. Before,
    each was counted and logged as a warning and the peer kept sending: one a message, up to
    its announcement budget of 2**17 a minute, a warning line each. Now the session ends
    ("invalid input"); a second manifest the trainer signed for one object is not the peer's
    fault and ends nothing."""
    from patchswarm.protocol.errors import InvalidInput
    import pytest

    applier, book, peers = node_applier(tmp_path)
    r = ManifestRelay(applier.offer, lambda key: book.get(key) is not None, peers, lambda m: None)
    forged = sign_manifest(Manifest(swarm_id=SWARM, version=9, base_version=None, base_hash=None,
                                    target_hash="blake3:" + "00" * 32, tensors=[["w", "bf16", [4]]],
                                    chunks=[(100, bytes(32))], codec={"format": 2}, created_at=0.0),
                           Ed25519PrivateKey.generate())

    async def main():
        with pytest.raises(InvalidInput):
            await r.notice(wire.VersionNotice(9, forged), source=object.__new__(_FakeSession))
        with pytest.raises(InvalidInput):
            await r.notice(wire.VersionNotice(9, b"\x00not a manifest"), source=object.__new__(_FakeSession))
        assert applier.manifests_rejected == 2
        await r.notice(wire.VersionNotice(9, forged), source=None)  # from the tracker: counted, logged, no raise
        assert applier.manifests_rejected == 3
        await r.notice(wire.VersionNotice(3, envelope(3)), source=object.__new__(_FakeSession))
        other = sign_manifest(Manifest(swarm_id=SWARM, version=3, base_version=None, base_hash=None,
                                       target_hash="blake3:" + "33" * 32, tensors=[["w", "bf16", [4]]],
                                       chunks=[(100, bytes(32))], codec={"format": 2}, created_at=1.0), KEY)
        # A second manifest the trainer signed for one object: its doing, not the peer's.
        await r.notice(wire.VersionNotice(3, other), source=object.__new__(_FakeSession))
        assert applier.manifests_rejected == 4

    trio.run(main)


def test_a_node_with_no_version_takes_no_manifest_the_latest_keyframe_supersedes(tmp_path, monkeypatch):
    """A member may pass a joining node (no version yet, its first keyframe still coming) the
    old keyframes of a long history, each signed by the trainer. Before, each was checked
    (0.47 s at 140,000 tensors), held (~47 MB) and passed on to the node's peers until its
    first apply. Now, with the latest keyframe held, older keyframes and every patch at or
    below it are refused from their first fields, unchecked; sent oldest first, each one
    taken drops the one before. The patches after it are taken."""
    import patchswarm.protocol.versions as versions

    checked = []
    real = versions.verify_manifest
    monkeypatch.setattr(versions, "verify_manifest", lambda data, key: checked.append(1) or real(data, key))
    applier, book, peers = node_applier(tmp_path)
    r = ManifestRelay(applier.offer, lambda key: book.get(key) is not None, peers, lambda m: None)
    mallory = object.__new__(_FakeSession)

    async def main():
        for v in (16, 32):  # oldest first, before the tracker's latest: each drops the one before
            await r.notice(wire.VersionNotice(v, envelope(v)), source=mallory)
            assert book.keys() == [(v, True)]
        await r.notice(wire.VersionNotice(48, envelope(48)), source=None)
        assert book.keys() == [(48, True)] and len(checked) == 3
        for v in range(1, 48, 3):
            await r.notice(wire.VersionNotice(v, envelope(v)), source=mallory)
            await r.notice(wire.VersionNotice(v, patch_envelope(v)), source=mallory)
        await r.notice(wire.VersionNotice(48, patch_envelope(48)), source=mallory)
        assert book.keys() == [(48, True)] and len(checked) == 3 and applier.manifests_stale == 33
        await r.notice(wire.VersionNotice(49, patch_envelope(49)), source=mallory)
        assert book.keys() == [(48, True), (49, False)] and len(checked) == 4

    trio.run(main)


def patch_envelope(version: int) -> bytes:
    h = "blake3:" + hashlib.sha256(b"%d" % version).hexdigest()
    return sign_manifest(Manifest(swarm_id=SWARM, version=version, base_version=version - 1,
                                  base_hash="blake3:" + hashlib.sha256(b"%d" % (version - 1)).hexdigest(),
                                  target_hash=h, tensors=[], chunks=[(100, hashlib.sha256(b"x").digest())],
                                  codec={"format": 2}, created_at=0.0), KEY)


class _FakeSession:
    id = "mallory"
