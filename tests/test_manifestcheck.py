"""Large manifests are verified and decoded off the event loop (node/net/manifestcheck.py): on
the node (Applier.offer) and on the tracker (an origin's Announce over a real session), a trio
task ticking every 5 ms keeps ticking while a 100,000-tensor keyframe manifest is decoded;
small ones stay inline; copies of one envelope are decoded once."""

from __future__ import annotations

import hashlib
import time

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.net import trust
from patchswarm.node.net import manifestcheck
from patchswarm.node.net.manifestcheck import OFF_LOOP_BYTES, ManifestCheck
from patchswarm.protocol import wire
from patchswarm.protocol.manifest import Manifest, sign_manifest, verify_manifest
from patchswarm.protocol.patch import Patch, TensorSpec
from patchswarm.protocol.publication import manifest_of
from patchswarm.protocol.versions import NEW, VersionBook

from test_tracker import _member

TENSORS = 100_000  # a form-2 keyframe manifest of ~63 KB; 140,000 (171 KB) took 0.47 s to decode
TICK = 0.005
MAX_GAP = 0.1  # the longest the loop may stand still while the decode runs


def keyframe(key: Ed25519PrivateKey, swarm_id: str, n: int = TENSORS, version: int = 1) -> bytes:
    tensors = [TensorSpec(f"model.layers.{i:06d}.mlp.weight", "bfloat16", (64, 64)) for i in range(n)]
    patch = Patch(kind="keyframe", base_hash=None, target_hash="blake3:" + "2" * 64, tensors=tensors,
                  full=[t.name for t in tensors], removed=[], chunks=[])
    table = [(1 << 20, hashlib.sha256(i.to_bytes(8, "big")).digest()) for i in range(8)]
    return sign_manifest(manifest_of(patch, swarm_id=swarm_id, version=version, created_at=0.0, chunk_table=table,
                                     form=2, compact=False), key)


def small(key: Ed25519PrivateKey, swarm_id: str, version: int = 2) -> bytes:
    return sign_manifest(Manifest(swarm_id=swarm_id, version=version, base_version=None, base_hash=None,
                                  target_hash="blake3:" + "3" * 64, tensors=[["w", "bf16", [4]]],
                                  chunks=[(100, hashlib.sha256(b"x").digest())], codec={"format": 2},
                                  created_at=0.0), key)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    trust.init_swarm(root / "swarm")
    trust.issue(root / "swarm", "tracker", "tracker", root / "tracker")
    return root


@pytest.fixture(scope="module")
def trainer(swarm):
    from patchswarm.node.trainer.origin import load_trainer_key

    return load_trainer_key(swarm / "swarm" / "trainer.key")


@pytest.fixture(scope="module")
def swarm_id(swarm):
    return trust.Credentials.load(swarm / "tracker").swarm_id()


@pytest.fixture(scope="module")
def big(trainer, swarm_id):
    return keyframe(trainer, swarm_id)


def measure_bound(trainer, big) -> float:
    """The longest stand-still allowed: MAX_GAP, or a third of what the decode takes inline
    now, or three times the longest tick gap of an idle loop now, on a machine so loaded
    that the loop's thread itself waits for a core that long (measured per attempt: the load
    moves; with a suite beside it, an idle loop here stood still up to ~0.1 s)."""
    t0 = time.perf_counter()
    verify_manifest(big, trainer.public_key())
    inline = time.perf_counter() - t0
    idle = trio.run(longest_gap, lambda: trio.sleep(0.3))
    return max(MAX_GAP, inline / 3, 3 * idle)


# A loop's stand-still is measured in wall time, on 2 cores that the suite's other worker
# shares: a burst of its processes can stand any loop still, decode or none. Such a burst
# passes; a decode on the loop does not. So a timing that misses is measured again, with its
# bound measured again, up to ATTEMPTS times (in CI a whole run once missed both ways: 0.30 s
# against a bound of 0.12 s, and an inline decode's 0.37 s against twice 0.19 s).
ATTEMPTS = 3


def _attempts(measure, ok) -> list:
    """`measure()` until `ok(result)`, at most ATTEMPTS times; every result, the last one last."""
    results = []
    for _ in range(ATTEMPTS):
        results.append(measure())
        if ok(results[-1]):
            break
    return results


async def longest_gap(during) -> float:
    """The longest a task that sleeps TICK waited between ticks while `during()` ran."""
    gaps = []
    done = trio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await trio.sleep(TICK)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as n:
        n.start_soon(ticker)
        await trio.sleep(5 * TICK)
        await during()
        done.set()
    return max(gaps)


def test_the_test_sees_a_decode_on_the_loop(trainer, big):
    """The same decode inline stands the loop still for as long (what the node and the tracker
    did before): the bound below would catch it."""
    async def main():
        return await longest_gap(lambda: _inline(big, trainer))

    tries = _attempts(lambda: (trio.run(main), measure_bound(trainer, big)), lambda r: r[0] > 2 * r[1])
    gap, bound = tries[-1]
    assert gap > 2 * bound, tries


async def _inline(envelope: bytes, trainer) -> None:
    verify_manifest(envelope, trainer.public_key())
    await trio.lowlevel.checkpoint()


def _applier(tmp_path, trainer, swarm_id: str):
    from patchswarm.node.applier import Applier
    from patchswarm.node.fetcher import Fetcher
    from patchswarm.node.net.ratelimit import TokenBucket
    from patchswarm.node.peers import PeerSet
    from patchswarm.node.persistence import DurableState
    from patchswarm.node.relay import Inflows
    from patchswarm.node.store import ObjectStore
    from patchswarm.protocol.picker import PiecePicker

    store = ObjectStore(tmp_path / "objects")
    book = VersionBook(swarm_id, trainer.public_key())
    inflows = Inflows()
    peers = PeerSet("me", store, TokenBucket(None), lambda s, m: None, inflows=inflows)
    fetcher = Fetcher("me", "r0", PiecePicker("me", "r0", "r0"), peers, inflows, store, book, lambda key: None)
    return Applier(book, store, fetcher, DurableState(tmp_path, store, swarm_id), keep_versions=4, apply_nice=0,
                   apply_threads=None)


def test_a_node_keeps_its_loop_turning_while_a_large_keyframe_manifest_is_decoded(tmp_path, trainer, swarm_id, big):
    def measure():
        where = tmp_path / f"try{len(list(tmp_path.iterdir()))}"
        where.mkdir()
        applier = _applier(where, trainer, swarm_id)
        accepted = []

        async def main():
            async def offer():
                accepted.append(await applier.offer(big, "tracker"))

            return await longest_gap(offer)

        gap = trio.run(main)
        assert accepted == [True] and applier.book.get((1, True)) is not None
        assert applier.manifest_check.off_loop == 1
        return gap, measure_bound(trainer, big)

    tries = _attempts(measure, lambda r: r[0] < r[1])
    gap, bound = tries[-1]
    assert gap < bound, f"the loop stood still {gap:.3f} s against {bound:.3f} s; every try: {tries}"


def test_copies_of_one_manifest_are_decoded_once(tmp_path, trainer, swarm_id, big, monkeypatch):
    """The tracker's copy and the peers' copies of a keyframe arrive within a second."""
    applier = _applier(tmp_path, trainer, swarm_id)
    calls = []
    verify = applier.book.verify
    monkeypatch.setattr(applier.book, "verify", lambda env: (calls.append(1), verify(env))[1])
    results = []

    async def main():
        async with trio.open_nursery() as n:
            for source in ("tracker", "peer a", "peer b"):
                n.start_soon(_offer_into, applier, big, source, results)

    trio.run(main)
    assert sorted(results) == [False, False, True] and len(calls) == 1


async def _offer_into(applier, envelope: bytes, source: str, results: list) -> None:
    results.append(await applier.offer(envelope, source))


def test_small_manifests_are_checked_inline_so_mock_clock_tests_stay_exact(trainer, swarm_id, monkeypatch):
    """A small envelope never waits for a thread: on MockClock(autojump_threshold=0) a task
    waiting for one looks idle and the clock jumps."""
    def no_thread(*a, **k):
        raise AssertionError("a small manifest went to a worker thread")

    monkeypatch.setattr(manifestcheck.trio.to_thread, "run_sync", no_thread)
    book = VersionBook(swarm_id, trainer.public_key())
    check = ManifestCheck(book)
    envelope = small(trainer, swarm_id)
    assert len(envelope) < OFF_LOOP_BYTES

    async def main():
        t0 = trio.current_time()
        assert await check.check(envelope) is None
        assert book.offer(envelope)[0] == NEW
        assert trio.current_time() == t0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_forged_large_manifest_is_left_to_the_book_which_refuses_it(trainer, swarm_id):
    book = VersionBook(swarm_id, trainer.public_key())
    forged = keyframe(Ed25519PrivateKey.generate(), swarm_id, n=20_000)
    assert len(forged) >= OFF_LOOP_BYTES

    async def main():
        return await ManifestCheck(book).check(forged)

    assert trio.run(main) is None  # the signature fails first, in the thread; the book says so again
    from patchswarm.protocol.errors import SignatureError
    with pytest.raises(SignatureError):
        book.offer(forged)


def test_the_tracker_keeps_its_loop_turning_while_it_decodes_an_origins_keyframe(swarm, trainer, big):
    """An origin's Announce of a large keyframe over a real tracker session (in-memory stream):
    the tracker verifies it in a worker thread and retains it; the loop keeps turning."""
    from patchswarm.tracker import server

    envelope = big

    async def main():
        tracker = server.Tracker(swarm / "tracker", "127.0.0.1:0", heartbeat_timeout=1e6)
        async with trio.open_nursery() as nursery:
            m_ms = await _member(tracker, nursery, "origin", role="origin", pair=trio.testing.memory_stream_pair,
                                 my_hello=wire.Hello("origin", "r0", "origin", "127.0.0.1:1", []))

            async def announce():
                await m_ms.send(wire.Announce(envelope))
                while tracker.core.book.get((1, True)) is None:
                    await trio.sleep(TICK)

            gap = await longest_gap(announce)
            nursery.cancel_scope.cancel()
        return tracker, gap

    def measure():
        tracker, gap = trio.run(main)
        assert tracker.manifest_check.off_loop == 1 and tracker.core.book.get((1, True)) is not None
        return gap, measure_bound(trainer, big)

    tries = _attempts(measure, lambda r: r[0] < r[1])
    gap, bound = tries[-1]
    assert gap < bound, f"the tracker's loop stood still {gap:.3f} s against {bound:.3f} s; every try: {tries}"


def test_a_stale_large_manifest_is_never_decoded(trainer, swarm_id, big, monkeypatch):
    """Peers pass an old keyframe's manifest on to a node past it (or a member replays it):
    every copy, the first too, is refused from its first fields, without a thread or a
    decode; the same envelope at a node below it goes to the thread."""
    from patchswarm.protocol.errors import StaleVersion

    book = VersionBook(swarm_id, trainer.public_key())
    check = ManifestCheck(book)
    real = manifestcheck.trio.to_thread.run_sync

    async def main():
        def no_thread(*a, **k):
            raise AssertionError("a stale manifest went to a worker thread")

        monkeypatch.setattr(manifestcheck.trio.to_thread, "run_sync", no_thread)
        for _ in range(3):
            assert await check.check(big, 5) is None
            with pytest.raises(StaleVersion, match="not checked"):
                book.offer(big, 5)
        monkeypatch.setattr(manifestcheck.trio.to_thread, "run_sync", real)
        verified = await check.check(big, 0)
        assert verified is not None and check.off_loop == 1 and book.offer(big, 0, verified=verified)[0] == NEW

    trio.run(main)
