"""The node daemon's apply step, in process: a version costs the disk its patch (the object
is stored; the base file is not rewritten), and it applies without undo records, so a
failure found after the first write must leave the node on what is durable (the base file
plus the stored chain)."""

import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.applier import Applier
from patchswarm.node.fetcher import Fetcher
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.peers import PeerSet
from patchswarm.node.persistence import DurableState
from patchswarm.node.relay import Inflows
from patchswarm.node.store import ObjectStore
from patchswarm.node.weights import WEIGHTS_NAME, Weights, read_weights, write_weights
from patchswarm.protocol.patch import diff
from patchswarm.protocol.picker import PiecePicker
from patchswarm.protocol.publication import manifest_of
from patchswarm.protocol.versions import VersionBook

KEY = (1, False)
SWARM = "sw"


def _bits(t):
    return t.reshape(-1).view(torch.int16)


async def _noop(s, msg) -> None:
    pass


def _pair():
    g = torch.Generator().manual_seed(3)
    base = {f"w{i}": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(4)}
    target = {k: v.clone() for k, v in base.items()}
    for v in target.values():  # a third of every tensor changes: several chunks
        flat = _bits(v)
        flat[::3] += 1
    return base, target


def _ready(tmp_path, base, target) -> Applier:
    p = diff(base, target, chunk_bytes=1024, segment_elements=2048)
    assert len(p.chunks) > 2
    store = ObjectStore(tmp_path / "objects")
    store.write_object(KEY, b"(envelope)", p.chunks)
    store.adopt(KEY, manifest_of(p, swarm_id=SWARM, version=1, created_at=0.0))
    book = VersionBook(SWARM, Ed25519PrivateKey.generate().public_key())
    picker, inflows = PiecePicker("n1", "r0", "r0"), Inflows()
    fetcher = Fetcher("n1", "r0", picker, PeerSet("n1", store, TokenBucket(None), _noop, inflows=inflows), inflows,
                      store, book, on_complete=lambda key: None)
    applier = Applier(book, store, fetcher, DurableState(tmp_path, store, SWARM), keep_versions=4, apply_nice=0,
                      apply_threads=None)
    write_weights(applier.base_path, Weights({k: v.clone() for k, v in base.items()}, 0, p.base_hash, SWARM))
    applier.weights = applier.load_weights()
    return applier


def test_apply_changes_the_state_and_leaves_the_base_file_alone(tmp_path):
    base, target = _pair()
    applier = _ready(tmp_path, base, target)
    before = applier.base_path.stat().st_mtime_ns
    trio.run(applier.apply, KEY)
    assert applier.version == 1 and KEY not in applier.unusable
    for name in target:
        assert torch.equal(_bits(applier.weights.state[name]), _bits(target[name]))
    # Durable as the base plus the stored patch: no state-sized write for a patch.
    assert applier.base_path.stat().st_mtime_ns == before
    assert read_weights(applier.base_path).version == 0
    assert applier.durable.bytes_written == 0 and applier.store.complete(KEY)


def test_the_first_version_a_node_applies_is_written_as_its_base(tmp_path):
    base, target = _pair()
    applier = _ready(tmp_path, base, target)
    applier.base_path.unlink()
    applier.durable.base = None  # as on a node whose first version this is
    trio.run(applier.apply, KEY)
    on_disk = read_weights(applier.base_path)
    assert on_disk.version == 1 and applier.durable.base.version == 1
    for name in target:
        assert torch.equal(_bits(on_disk.state[name]), _bits(target[name]))


def test_a_failed_apply_reloads_the_durable_version(tmp_path):
    base, target = _pair()
    applier = _ready(tmp_path, base, target)
    # A bit flipped in memory where the patch writes nothing: every chunk fits and is
    # written, then the state hash does not match; the state is partly patched.
    _bits(applier.weights.state["w3"])[1] ^= 1
    trio.run(applier.apply, KEY)
    assert KEY in applier.unusable and applier.version == 0
    for name in base:
        assert torch.equal(_bits(applier.weights.state[name]), _bits(base[name])), name


def test_a_chunk_damaged_on_disk_before_the_apply_is_fetched_again_not_the_object_refused(tmp_path):
    """Bit rot between a chunk's verified arrival and the apply: before, the object failed to
    apply and was marked unusable for good (a valid version the node never applied). Now the
    damaged chunk leaves the store, the node stays on its durable version, and the object is
    applied once the chunk is whole again (fetched: here, written back)."""
    base, target = _pair()
    applier = _ready(tmp_path, base, target)
    path = next((tmp_path / "objects").glob("*/000001.chunk"))
    good = path.read_bytes()
    path.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    trio.run(applier.apply, KEY)
    assert KEY not in applier.unusable and applier.version == 0
    assert not applier.store.complete(KEY) and 1 not in applier.store.have(KEY) and applier.store.chunks_damaged == 1
    for name in base:
        assert torch.equal(_bits(applier.weights.state[name]), _bits(base[name])), name
    applier.store.put_chunk(KEY, 1, good)  # fetched again
    trio.run(applier.apply, KEY)
    assert applier.version == 1 and KEY not in applier.unusable
    for name in target:
        assert torch.equal(_bits(applier.weights.state[name]), _bits(target[name]))


def test_the_applier_keeps_the_tensors_views_from_one_version_to_the_next(tmp_path):
    """The int views of the state's tensors are made once and kept across applies (the
    protocol apply's `views`); a reload of the durable version empties them, so they never
    keep a state the node let go of alive."""
    base, target = _pair()
    applier = _ready(tmp_path, base, target)
    trio.run(applier.apply, KEY)
    assert applier.version == 1
    views = applier._views
    assert sorted(views) == sorted(target)
    assert all(views[n][0] is applier.weights.state[n] for n in views)
    # A later version applied into the same state reads the same views (no new ones made).
    p2 = diff(target, base, chunk_bytes=1024, segment_elements=2048)
    key2 = (2, False)
    applier.store.write_object(key2, b"(envelope)", p2.chunks)
    applier.store.adopt(key2, manifest_of(p2, swarm_id=SWARM, version=2, created_at=0.0))
    made = {n: id(v[1]) for n, v in views.items()}
    trio.run(applier.apply, key2)
    assert applier.version == 2 and applier._views is views
    assert {n: id(v[1]) for n, v in views.items()} == made
    for name in base:
        assert torch.equal(_bits(applier.weights.state[name]), _bits(base[name]))
    applier.weights = applier.load_weights()  # as after a failed apply
    assert applier._views == {}


def test_with_no_origin_listed_the_plan_starts_from_the_region_the_manifests_name(tmp_path):
    """A node that joins or restarts while the trainer is down hears of no origin from the
    tracker; it plans with the region the signed manifests name, so peers holding the objects
    serve it (before, it planned nothing until an origin came back)."""
    from patchswarm.protocol.manifest import sign_manifest
    from patchswarm.protocol.patch import keyframe

    key = Ed25519PrivateKey.generate()
    state = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)}
    m = manifest_of(keyframe(state, chunk_bytes=1024), swarm_id=SWARM, version=0, created_at=0.0,
                    origin_region="r7")
    store = ObjectStore(tmp_path / "objects")
    book = VersionBook(SWARM, key.public_key())
    picker, inflows = PiecePicker("n1", "r0", None), Inflows()
    fetcher = Fetcher("n1", "r0", picker, PeerSet("n1", store, TokenBucket(None), _noop, inflows=inflows), inflows,
                      store, book, on_complete=lambda key: None)
    applier = Applier(book, store, fetcher, DurableState(tmp_path, store, SWARM), keep_versions=4, apply_nice=0,
                      apply_threads=None)

    async def main():
        with trio.move_on_after(0.3):
            await applier.run()

    trio.run(main)
    assert picker.origin_region is None and not picker.is_fetching((0, True))  # no manifest: nothing to go on
    book.offer(sign_manifest(m, key))
    trio.run(main)  # (a restart's stored manifests, before the tracker's word)
    assert picker.origin_region is None and not picker.is_fetching((0, True))
    applier.no_origin_listed = True  # the tracker's list names no origin
    trio.run(main)
    assert picker.origin_region == "r7" and picker.is_fetching((0, True))
