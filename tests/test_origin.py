"""The origin's publishing rules, in process: keyframes when due, restarts that continue, interrupted publishes.

No tracker is needed for these (the origin keeps retrying it in the background);
what nodes receive over the wire is covered by tests/test_swarm.py.
"""

from __future__ import annotations

import time

import torch

from patchswarm.node.net import trust
from patchswarm.node.trainer.origin import SyncOrigin
from synthetic import rl_checkpoints, served
from patchswarm.node.weights import WEIGHTS_NAME, read_weights
from patchswarm.protocol.patch import apply
from patchswarm.protocol.publication import patch_of
from patchswarm.protocol.statehash import state_hash


def make_origin(tmp_path, **kw) -> SyncOrigin:
    swarm = tmp_path / "swarm"
    if not swarm.exists():
        trust.init_swarm(swarm)
        trust.issue(swarm, "origin", "origin", tmp_path / "creds")
    return SyncOrigin(tracker="127.0.0.1:9", creds=tmp_path / "creds", key=swarm / "trainer.key",
                      data_dir=tmp_path / "data", listen="127.0.0.1:0", **kw)


def test_keyframe_first_patches_after_and_a_keyframe_when_the_chain_costs_more(tmp_path):
    states = rl_checkpoints("tiny", 1e-2, 4)  # dense steps: each patch costs most of a keyframe
    with make_origin(tmp_path) as o:
        versions = [o.publish(s) for s in states]
        history = o.stats()["versions"]
    assert versions == [0, 1, 2, 3, 4]
    assert history[0]["patch_bytes"] is None and history[0]["keyframe_bytes"] > 0
    assert all(h["patch_bytes"] > 0 for h in history[1:])
    keyframes = [h["version"] for h in history if h["keyframe_bytes"]]
    assert keyframes[0] == 0 and len(keyframes) >= 2, history
    # each keyframe comes exactly when the patches since the previous one outweigh it
    for prev, k in zip(keyframes, keyframes[1:]):
        chain = sum(history[v]["patch_bytes"] for v in range(prev + 1, k + 1))
        assert chain > history[prev]["keyframe_bytes"]


def test_restart_continues_the_version_chain_from_disk(tmp_path):
    states = rl_checkpoints("tiny", 1e-5, 3)
    with make_origin(tmp_path) as o:
        o.publish(states[0])
        o.publish(states[1])
    with make_origin(tmp_path) as o:
        assert o.publish(states[2]) == 2
        store = o.origin.store
        m = store.manifest((2, False))
        patch = patch_of(m, store.chunks((2, False)))
    base = served(states[1], torch.bfloat16)
    apply(base, patch)  # the new patch is against what was published before the restart
    assert state_hash(base) == state_hash(served(states[2], torch.bfloat16))


def test_interrupted_publish_is_dropped_and_published_again(tmp_path):
    """A crash while version 2's patch was being written: some chunk files, a temporary, no
    manifest (it goes last). The restart drops the object and resumes at version 1."""
    states = rl_checkpoints("tiny", 1e-5, 3)
    with make_origin(tmp_path) as o:
        o.publish(states[0])
        o.publish(states[1])
        o.publish(states[2])
    obj = tmp_path / "data" / "objects" / "v0000000002-patch"
    (obj / "manifest").unlink()
    (obj / ".000001.chunk.999.tmp").write_bytes(b"half")
    with make_origin(tmp_path) as o:
        assert o.origin.version == 1
        assert o.origin.store.manifest((2, False)) is None and not obj.exists()
        assert o.publish(states[2]) == 2
        patch = patch_of(o.origin.store.manifest((2, False)), o.origin.store.chunks((2, False)))
    base = served(states[1], torch.bfloat16)
    apply(base, patch)
    assert state_hash(base) == state_hash(served(states[2], torch.bfloat16))


def test_a_restart_replays_the_base_and_the_patches_after_it(tmp_path):
    """No full write per version: the base is written at the first version and again every
    `compact_every` versions (off the publish path); a restart replays the rest."""
    states = rl_checkpoints("tiny", 1e-5, 6)
    base_file = tmp_path / "data" / WEIGHTS_NAME
    with make_origin(tmp_path, compact_every=4) as o:
        o.publish(states[0])
        assert read_weights(base_file).version == 0
        for s in states[1:4]:
            o.publish(s)
        assert read_weights(base_file).version == 0, "nothing rewritten before compact_every versions"
        o.publish(states[4])  # 4 versions since the base: compaction, in the background
        for _ in range(200):
            if o.origin.durable.base.version == 4:
                break
            time.sleep(0.05)
        assert read_weights(base_file).version == 4
        o.publish(states[5])
        want = o.origin.served.state_hash
    with make_origin(tmp_path, compact_every=4) as o:
        assert o.origin.version == 5 and o.origin.served.state_hash == want
        assert o.origin.served.state_hash == state_hash(served(states[5], torch.bfloat16))


def test_publish_copies_the_trainers_tensors(tmp_path):
    states = rl_checkpoints("tiny", 1e-5, 1)
    live = {k: v.clone() for k, v in states[0].items()}
    ints = {"step": torch.tensor([7], dtype=torch.int64)}  # non-float tensors are served as they are
    with make_origin(tmp_path) as o:
        o.publish({**live, **ints})
        for t in live.values():
            t.add_(1.0)  # the trainer goes on training
        ints["step"].add_(1)
        o.publish({**live, **ints})
        history = o.stats()["versions"]
        step = o.origin.served.state["step"].clone()
    assert history[1]["changed"] > 0
    assert int(step) == 8 and step.dtype == torch.int64
