"""`VersionBook`, the gate every manifest passes and the planner of what a node applies next.

The gate (`offer`): trainer signature, swarm id, one manifest per object, forward only.
The planner (`plan`): the patch chain or a keyframe plus the patches after it, whichever
reaches the highest reachable version for the fewest bytes; a patch joins a path only if
its base hash is the state the path is at. Tables of scenarios, no sockets.
"""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol.errors import ConflictingManifest, InvalidInput, SignatureError, StaleVersion
from patchswarm.protocol.manifest import Manifest, sign_manifest
from patchswarm.protocol.versions import KNOWN, NEW, VersionBook

KEY = Ed25519PrivateKey.generate()
SWARM = "sw-test"


def h(version: int, variant: str = "") -> str:
    """The state hash of version `version` (a different `variant` is another state)."""
    return "blake3:" + hashlib.sha256(f"{version}{variant}".encode()).hexdigest()


def envelope(version: int, keyframe: bool = False, size: int = 100, base: str | None = None,
             target: str | None = None, swarm: str = SWARM, key=KEY, created_at: float = 0.0,
             base_version: int | None = None) -> bytes:
    m = Manifest(
        swarm_id=swarm, version=version,
        base_version=None if keyframe else (version - 1 if base_version is None else base_version),
        base_hash=None if keyframe else (base or h(version - 1)),
        target_hash=target or h(version), tensors=[["w", "bf16", [4]]],
        chunks=[(size, hashlib.sha256(b"%d" % version).digest())], codec={"format": 2}, created_at=created_at)
    return sign_manifest(m, key)


def book(*envelopes: bytes) -> VersionBook:
    b = VersionBook(SWARM, KEY.public_key())
    for e in envelopes:
        b.offer(e)
    return b


# ------------------------------------------------------------------ the gate


def test_an_envelope_held_already_is_known_by_its_bytes_without_verifying_it_again(monkeypatch):
    """A node gets each manifest from the tracker and from peers: only the first is verified
    and decoded (seconds for a 140,000-tensor keyframe); a dropped one is verified again."""
    import patchswarm.protocol.versions as versions

    calls = []
    real = versions.verify_manifest
    monkeypatch.setattr(versions, "verify_manifest", lambda data, key: calls.append(1) or real(data, key))
    b = VersionBook(SWARM, KEY.public_key())
    e = envelope(3)
    assert b.offer(e)[0] == NEW and b.offer(bytearray(e))[0] == KNOWN and b.offer(e, 5)[0] == KNOWN
    assert len(calls) == 1
    b.forget_below(4)
    with pytest.raises(StaleVersion):
        b.offer(e, 3)
    assert len(calls) == 1 and b.keys() == []  # stale: refused from its first fields
    assert b.offer(e)[0] == NEW and len(calls) == 2
    b.discard((3, False))
    assert b.offer(e)[0] == NEW and len(calls) == 3


def test_a_stale_envelope_is_refused_unread_however_many_are_replayed(monkeypatch):
    """An old keyframe's manifest that peers pass on again (or a member replays from a long
    history) was verified and decoded before it was found stale: 0.47 s a copy at 140,000
    tensors. The digests of the last 64 were remembered, so a member cycling through 65 old
    manifests had every one decoded again. An envelope that says it is at or below the
    node's version is now refused from its first fields, never checked, however many there
    are; one whose object is held is still checked (two signed manifests of one object are
    the trainer's fault, said so), and a node whose version went back checks it again."""
    import patchswarm.protocol.versions as versions

    calls = []
    real = versions.verify_manifest
    monkeypatch.setattr(versions, "verify_manifest", lambda data, key: calls.append(1) or real(data, key))
    b = VersionBook(SWARM, KEY.public_key())
    old = [envelope(v, keyframe=v % 2 == 0) for v in range(1, 201)]
    for _ in range(2):
        for e in old:
            with pytest.raises(StaleVersion, match="expected a version above the current 500"):
                b.offer(e, 500)
            assert not b.needs_check(e, 500)
    assert calls == [] and b.keys() == []
    e = envelope(3)
    assert b.needs_check(e, 2) and b.offer(e, 2)[0] == NEW and len(calls) == 1
    assert b.offer(e, 4)[0] == KNOWN and len(calls) == 1  # held: known by its bytes
    assert b.needs_check(envelope(3, created_at=1.0), 4)
    with pytest.raises(ConflictingManifest):  # held object, other bytes: checked, though stale
        b.offer(envelope(3, created_at=1.0), 4)
    assert len(calls) == 2
    forged = envelope(2, key=Ed25519PrivateKey.generate())
    with pytest.raises(StaleVersion):  # says it is old: refused as old, unread
        b.offer(forged, 4)
    with pytest.raises(SignatureError):
        b.offer(forged, 1)
    assert b.needs_check(b"\x92\xc4\x01\x00", 4)  # no readable head: checked (and refused) as before


@pytest.mark.parametrize("keyframe", [False, True])
def test_peek_key_reads_what_the_signed_manifest_says(keyframe):
    """The cheap read agrees with the full one for both kinds, and reads nothing it cannot."""
    from patchswarm.protocol.manifest import peek_key, verify_manifest

    e = envelope(7, keyframe=keyframe)
    m = verify_manifest(e, KEY.public_key())
    assert peek_key(e) == (m.version, m.is_keyframe) == (7, keyframe)
    assert peek_key(bytearray(e)) == peek_key(memoryview(e)) == (7, keyframe)
    for bad in (b"", b"\x90", e[:20], b"\x92\xc4\x03abc\xc4\x00", "text", None):
        assert peek_key(bad) is None


# (held before, in order; the node's version; offered; refused unread; held after)
SUPERSEDED = {
    "no version: an older keyframe": ([(10, True)], None, (4, True), True, [(10, True)]),
    "no version: a patch at or below the keyframe": ([(10, True)], None, (10, False), True, [(10, True)]),
    "no version: a patch after it": ([(10, True)], None, (11, False), False, [(10, True), (11, False)]),
    "no version: a later keyframe drops what it supersedes":
        ([(10, True), (11, False), (12, False)], None, (12, True), False, [(12, True)]),
    "a version: a patch below the keyframe may be a link of its chain":
        ([(10, True)], 3, (4, False), False, [(4, False), (10, True)]),
    "a version: an older keyframe above it": ([(10, True)], 3, (6, True), True, [(10, True)]),
    "a version: a later keyframe keeps the patches, drops the keyframe":
        ([(4, False), (10, True)], 3, (12, True), False, [(4, False), (12, True)]),
    "no keyframe held: anything above the version": ([(5, False)], 3, (4, True), False, [(4, True), (5, False)]),
}


@pytest.mark.parametrize("held, at, offered, refused, after", SUPERSEDED.values(), ids=SUPERSEDED.keys())
def test_a_running_node_takes_only_what_a_plan_from_its_version_can_use(monkeypatch, held, at, offered, refused,
                                                                       after):
    """`drop_superseded` (a running node's offers): no plan goes through a keyframe below the
    latest held, nor, with no version, through anything at or below it. Such an object is
    refused unread; a later keyframe taken drops the ones it supersedes. Without it (the
    tracker, the origin, a store read back at a start) every one of them is taken."""
    import patchswarm.protocol.versions as versions

    def env(key):
        return envelope(key[0], keyframe=key[1])

    plain = book(*map(env, held))
    b = VersionBook(SWARM, KEY.public_key())
    for key in held:
        b.offer(env(key), at, drop_superseded=True)
    checked = []
    real = versions.verify_manifest
    monkeypatch.setattr(versions, "verify_manifest", lambda data, key: checked.append(1) or real(data, key))
    assert b.needs_check(env(offered), at, drop_superseded=True) is not refused
    assert b.refuses(offered, at, drop_superseded=True) is refused and not b.refuses(offered, at)
    if refused:
        with pytest.raises(StaleVersion, match="superseded: no plan uses it.*not checked"):
            b.offer(env(offered), at, drop_superseded=True)
    else:
        assert b.offer(env(offered), at, drop_superseded=True)[0] == NEW
    assert b.keys() == after and len(checked) == (0 if refused else 1)
    assert plain.offer(env(offered), at)[0] == NEW and plain.keys() == sorted({*held, offered})


def test_new_then_known_then_conflicting():
    b = VersionBook(SWARM, KEY.public_key())
    status, m = b.offer(envelope(3))
    assert status == NEW and (m.version, m.is_keyframe) == (3, False)
    assert b.offer(envelope(3))[0] == KNOWN  # the same bytes again: known, not stale
    with pytest.raises(ConflictingManifest, match="different, validly signed manifest") as e:
        b.offer(envelope(3, created_at=1.0))  # another manifest for the same object
    # both target hashes, to the same 16 characters (here the same state: only created_at differs)
    assert str(e.value).endswith(f"(target {h(3)[:16]}…, found {h(3)[:16]}…)")
    assert b.keys() == [(3, False)]


@pytest.mark.parametrize("first, second", [(0.0, 1.0), (1.0, 0.0), (0.0, 1e9), (1e9, 0.0)])
def test_a_conflicting_manifest_is_refused_whichever_came_first(first, second):
    """Two validly signed manifests of one object, offered in either order (so the held
    envelope's bytes sort below or above the new one's): the second is refused."""
    b = VersionBook(SWARM, KEY.public_key())
    assert b.offer(envelope(3, created_at=first))[0] == NEW
    with pytest.raises(ConflictingManifest):
        b.offer(envelope(3, created_at=second))
    assert b.envelope((3, False)) == envelope(3, created_at=first)


@pytest.mark.parametrize("bad, error, match", [
    (envelope(3, key=Ed25519PrivateKey.generate()), SignatureError, "does not verify"),
    (envelope(3, swarm="another-swarm"), InvalidInput, "expected swarm 'sw-test', found 'another-swarm'"),
    (envelope(3, swarm="zz-swarm"), InvalidInput, "found 'zz-swarm'"),  # an id that sorts above ours
    (envelope(3, swarm="sw-test "), InvalidInput, "found 'sw-test '"),
    (b"not a manifest", InvalidInput, "manifest"),
])
def test_untrusted_manifests_are_refused(bad, error, match):
    b = VersionBook(SWARM, KEY.public_key())
    with pytest.raises(error, match=match):
        b.offer(bad)
    assert b.keys() == [] and b.latest_version is None


@pytest.mark.parametrize("current, offered, stale", [
    (5, 4, True),    # older
    (5, 5, True),    # a replay of the version the node holds
    (5, 6, False),
    (None, 1, False),  # a node without weights takes anything
])
def test_versions_only_move_forward(current, offered, stale):
    b = VersionBook(SWARM, KEY.public_key())
    if stale:
        with pytest.raises(StaleVersion, match=f"above the current {current}, found {offered}"):
            b.offer(envelope(offered), current)
        assert b.keys() == []
    else:
        assert b.offer(envelope(offered), current)[0] == NEW


def test_a_held_manifest_is_known_even_below_the_current_version():
    b = book(envelope(5))
    assert b.offer(envelope(5), current_version=7)[0] == KNOWN


def test_forget_below_and_discard():
    b = book(envelope(1), envelope(2), envelope(2, keyframe=True), envelope(3))
    b.forget_below(2)
    assert b.keys() == [(2, False), (2, True), (3, False)]
    b.discard((3, False))
    assert b.keys() == [(2, False), (2, True)] and b.envelope((3, False)) is None


@pytest.mark.parametrize("held, max_patches, kept", [
    # the latest keyframe, every patch after it, and up to max_patches patches in all
    ([(1, 0), (2, 0), (3, 0), (3, 1), (4, 0)], 64, [(1, 0), (2, 0), (3, 0), (3, 1), (4, 0)]),
    ([(1, 0), (2, 0), (3, 0), (3, 1), (4, 0)], 2, [(3, 0), (3, 1), (4, 0)]),
    ([(1, 0), (2, 0), (3, 1), (4, 0), (5, 0)], 1, [(3, 1), (4, 0), (5, 0)]),  # the chain after the keyframe stays
    ([(1, 0), (2, 0), (3, 0)], 0, []),
    ([(1, 0), (2, 0), (3, 0)], 1, [(3, 0)]),  # no keyframe: the last max_patches patches
    ([(1, 0), (2, 0), (3, 0)], -1, []),  # a negative count keeps none, as 0 does
    ([(1, 0), (2, 0), (2, 1), (3, 0), (4, 0), (4, 1), (5, 0)], 0, [(4, 1), (5, 0)]),  # the latest keyframe only
    ([(1, 1), (2, 0), (3, 1), (3, 0)], 0, [(3, 1)]),  # a patch of the keyframe's version is not after it
])
def test_retained(held, max_patches, kept):
    b = book(*(envelope(v, keyframe=bool(k)) for v, k in held))
    assert b.retained(max_patches) == [(v, bool(k)) for v, k in kept]


# ------------------------------------------------------------------ the planner


P, K = False, True

PLANS = [
    # name, objects (version, keyframe, bytes), node at (version, hash variant), expected plan
    ("up to date", [(3, P, 10)], (3, ""), []),
    ("the chain", [(2, P, 10), (3, P, 10), (4, P, 10)], (1, ""), [(2, P), (3, P), (4, P)]),
    ("a late joiner takes the keyframe and the patches after it",
     [(1, K, 1000), (2, P, 10), (3, P, 10)], (None, ""), [(1, K), (2, P), (3, P)]),
    ("the latest keyframe when it is the cheapest path",
     [(1, K, 1000), (2, P, 10), (3, K, 1000), (3, P, 10)], (None, ""), [(3, K)]),
    ("an older keyframe and its patches when they cost less",
     [(1, K, 1000), (2, P, 10), (3, K, 2000), (3, P, 10)], (None, ""), [(1, K), (2, P), (3, P)]),
    ("a keyframe beats a chain that costs more",
     [(2, P, 600), (3, P, 600), (3, K, 1000)], (1, ""), [(3, K)]),
    ("a chain beats a keyframe that costs more",
     [(2, P, 400), (3, P, 400), (3, K, 1000)], (1, ""), [(2, P), (3, P)]),
    ("equal cost: the chain, not the keyframe",
     [(2, P, 500), (3, P, 500), (3, K, 1000)], (1, ""), [(2, P), (3, P)]),
    ("a gap in the chain: as far as it reaches",
     [(2, P, 10), (4, P, 10)], (1, ""), [(2, P)]),
    ("a gap bridged by a keyframe",
     [(2, P, 10), (3, K, 1000), (4, P, 10)], (1, ""), [(3, K), (4, P)]),
    ("a node on another state (wrong base hash) cannot take the chain",
     [(2, P, 10), (3, P, 10)], (1, "other"), []),
    ("... but can take a keyframe",
     [(2, P, 10), (3, K, 1000), (3, P, 10)], (1, "other"), [(3, K)]),
    ("nothing leads anywhere yet", [(5, P, 10)], (None, ""), []),
    ("a fresh node takes version 0, the first keyframe", [(0, K, 1000)], (None, ""), [(0, K)]),
    ("a fresh node: version 0 when nothing above it can be reached",
     [(0, K, 1000), (2, P, 10)], (None, ""), [(0, K)]),
    ("a keyframe at or below the node's version is no path",
     [(3, K, 10), (4, P, 10)], (3, "other"), []),
    ("... nor one below it, however cheap",
     [(2, K, 1), (3, P, 1), (4, P, 1)], (3, "other"), []),
    ("a node on the chain is not sent back to an older keyframe",
     [(2, K, 1), (3, P, 1), (4, P, 100)], (3, ""), [(4, P)]),
    ("versions past the small ints: the chain",
     [(1000, P, 10), (1001, P, 10), (1002, P, 10), (1002, K, 1000)], (999, ""), [(1000, P), (1001, P), (1002, P)]),
    ("versions past the small ints: a late joiner",
     [(1000, K, 1000), (1001, P, 10), (1002, P, 10)], (None, ""), [(1000, K), (1001, P), (1002, P)]),
]


@pytest.mark.parametrize("name, objects, at, expected", PLANS, ids=[p[0] for p in PLANS])
def test_plan(name, objects, at, expected):
    b = book(*(envelope(v, keyframe=k, size=n) for v, k, n in objects))
    version, variant = at
    current_hash = None if version is None else h(version, variant)
    assert b.plan(version, current_hash) == expected


@pytest.mark.parametrize("base_version", [0, 1])
def test_a_patch_whose_base_version_is_not_the_previous_version_breaks_the_chain(base_version):
    """Version 3's patch names an older base version (its base hash is version 2's target): it
    does not follow version 2, so the chain stops there."""
    objects = [envelope(2), envelope(3, base_version=base_version, base=h(2))]
    assert book(*objects).plan(1, h(1)) == [(2, P)]


def test_a_hash_without_a_version_plans_as_a_fresh_node():
    b = book(envelope(1, keyframe=True, size=1000), envelope(2))
    assert b.plan(None, h(1)) == b.plan(None, None) == [(1, K), (2, P)]


def test_a_patch_whose_base_is_not_the_previous_target_breaks_the_chain():
    """Version 3's patch was made against another state of version 2 than version 2's
    patch produces: the chain stops at 2, and a keyframe of 3 goes around it."""
    objects = [envelope(2), envelope(3, base=h(2, "fork"))]
    assert book(*objects).plan(1, h(1)) == [(2, P)]
    assert book(*objects, envelope(3, keyframe=True, size=1000)).plan(1, h(1)) == [(3, K)]


# ------------------------------------------------------------------ objects that did not apply


@pytest.mark.parametrize("name, objects, at, bad, expected", [
    ("a node on the chain goes around a bad keyframe by the chain",
     [(3, K, 10), (2, P, 400), (3, P, 400), (4, P, 10)], (1, ""), (3, K), [(2, P), (3, P), (4, P)]),
    ("a late joiner takes an older keyframe and its patches",
     [(1, K, 1000), (2, P, 10), (3, K, 100), (4, P, 10)], (None, ""), (3, K), [(1, K), (2, P)]),
    ("a bad patch stops the chain where a keyframe goes around it",
     [(2, P, 10), (3, P, 10), (3, K, 1000), (4, P, 10)], (1, ""), (3, P), [(3, K), (4, P)]),
    ("a bad patch with nothing around it: as far as the chain reaches",
     [(2, P, 10), (3, P, 10), (4, P, 10)], (1, ""), (3, P), [(2, P)]),
])
def test_a_plan_goes_around_an_object_marked_unusable(name, objects, at, bad, expected):
    """An object whose verified chunks did not apply is no link of any plan. Before, the
    applier dropped it from the plan it was given: the patches after a bad keyframe were left
    planned onto a state they do not follow, each failed in turn, and the chain from the
    node's own version (a path all along) was never taken."""
    b = book(*(envelope(v, keyframe=k, size=n) for v, k, n in objects))
    version, variant = at
    current_hash = None if version is None else h(version, variant)
    assert bad in b.plan(version, current_hash)
    b.mark_unusable(bad)
    assert b.plan(version, current_hash) == expected and b.unusable == {bad}
    assert b.keys() == sorted((v, k) for v, k, _ in objects), "its manifest is still held (known by digest)"


def test_a_keyframe_marked_unusable_supersedes_nothing():
    """A node with no version holding a keyframe it could not apply takes an older keyframe,
    which a usable one would have superseded, and plans through it."""
    b = VersionBook(SWARM, KEY.public_key())
    for key in [(10, True), (11, False)]:
        b.offer(envelope(*key[:1], keyframe=key[1]), None, drop_superseded=True)
    assert b.refuses((4, True), None, drop_superseded=True)
    b.mark_unusable((10, True))
    assert b.latest_keyframe is None and not b.refuses((4, True), None, drop_superseded=True)
    for v, k in [(4, True), (5, False), (6, False)]:
        assert b.offer(envelope(v, keyframe=k), None, drop_superseded=True)[0] == NEW
    assert b.plan(None, None) == [(4, K), (5, P), (6, P)] and b.latest_keyframe == 4
    b.forget_below(11)
    assert b.unusable == set()


def _naming(version: int, region: str | None, keyframe: bool = False) -> bytes:
    m = Manifest(swarm_id=SWARM, version=version, base_version=None if keyframe else version - 1,
                 base_hash=None if keyframe else h(version - 1), target_hash=h(version), tensors=[["w", "bf16", [4]]],
                 chunks=[(100, hashlib.sha256(b"%d" % version).digest())],
                 codec={"format": 2, **({} if region is None else {"origin_region": region})}, created_at=0.0)
    return sign_manifest(m, KEY)


def test_the_origins_region_is_the_newest_manifests_that_names_one():
    assert book().origin_region is None
    assert book(envelope(0, keyframe=True), envelope(1)).origin_region is None  # an origin from before it
    assert book(_naming(0, "r0", keyframe=True), envelope(1)).origin_region == "r0"
    assert book(_naming(0, "r0", keyframe=True), _naming(1, "r2")).origin_region == "r2"  # the origin moved
