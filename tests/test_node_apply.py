"""The node daemon's apply step, in process: it applies without undo records, so a
failure found after the first write must leave the node on what its weights file holds."""

import torch
import trio

from patchswarm.node.daemon import Node, NodeConfig
from patchswarm.node.store import ObjectStore
from patchswarm.node.net.trust import init_swarm, issue
from patchswarm.node.weights import Weights, read_weights, write_weights
from patchswarm.protocol.patch import diff
from patchswarm.protocol.picker import PiecePicker
from patchswarm.protocol.publication import manifest_of

KEY = (1, False)


def _bits(t):
    return t.reshape(-1).view(torch.int16)


def _node(tmp_path) -> Node:
    init_swarm(tmp_path / "swarm")
    issue(tmp_path / "swarm", "n1", "node", tmp_path / "n1")
    return Node(NodeConfig(tracker="127.0.0.1:9", creds=tmp_path / "n1", data_dir=tmp_path / "data",
                           listen="127.0.0.1:0", region="r0"))


def _pair():
    g = torch.Generator().manual_seed(3)
    base = {f"w{i}": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(4)}
    target = {k: v.clone() for k, v in base.items()}
    for v in target.values():  # a third of every tensor changes: several chunks
        flat = _bits(v)
        flat[::3] += 1
    return base, target


def _ready(tmp_path, base, target):
    node = _node(tmp_path)
    p = diff(base, target, chunk_bytes=1024, segment_elements=2048)
    assert len(p.chunks) > 2
    node.data_dir.mkdir(parents=True)
    write_weights(node.weights_path, Weights({k: v.clone() for k, v in base.items()}, 0, p.base_hash, node.swarm_id))
    node.weights = node._load_weights()
    node.store = ObjectStore(node.data_dir / "objects")
    node.store.write_object(KEY, b"(envelope)", p.chunks)
    node.store.adopt(KEY, manifest_of(p, swarm_id=node.swarm_id, version=1, created_at=0.0))
    node.picker = PiecePicker(node.id, node.region, node.region)
    return node


def test_apply_writes_the_new_version(tmp_path):
    base, target = _pair()
    node = _ready(tmp_path, base, target)
    trio.run(node._apply, KEY)
    assert node.version == 1 and KEY not in node._unusable
    on_disk = read_weights(node.weights_path)
    for name in target:
        assert torch.equal(_bits(node.weights.state[name]), _bits(target[name]))
        assert torch.equal(_bits(on_disk.state[name]), _bits(target[name]))


def test_a_failed_apply_reloads_the_version_the_weights_file_holds(tmp_path):
    base, target = _pair()
    node = _ready(tmp_path, base, target)
    # A bit flipped in memory where the patch writes nothing: every chunk fits and is
    # written, then the state hash does not match; the state is partly patched.
    _bits(node.weights.state["w3"])[1] ^= 1
    trio.run(node._apply, KEY)
    assert KEY in node._unusable and node.version == 0
    for name in base:
        assert torch.equal(_bits(node.weights.state[name]), _bits(base[name])), name
