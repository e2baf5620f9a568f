"""The sparse hand-off on one machine: the node's change log (node/changelog.py), the local
socket's `changes` stream (node/localapi.py) and `NodeClient.follow` (node/client.py),
over a real Unix socket; versions are real patches applied with the node's recorder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from patchswarm.node.changelog import Changelog
from patchswarm.node.client import NodeClient, NodeError
from patchswarm.node.localapi import LocalRequests, serve_local
from patchswarm.node.spool import TrajectorySpool
from patchswarm.node.weights import Weights, write_weights
from patchswarm.protocol import localapi
from patchswarm.protocol.patch import apply, diff, keyframe
from patchswarm.protocol.statehash import state_hash

from test_changes import clone, same


def versions(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n states, each ~1 % of elements away from the one before; version 3 adds a tensor."""
    rng = np.random.default_rng(seed)
    s = {"w": torch.from_numpy(rng.standard_normal(50_000).astype(np.float32)).to(torch.bfloat16),
         "scale": torch.from_numpy(rng.random(64).astype(np.float32)),
         "q": torch.from_numpy(rng.standard_normal(30_000).astype(np.float32)).to(torch.float8_e4m3fn)}
    out = [s]
    for v in range(1, n):
        s = clone(s)
        for t in s.values():
            flat = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]).view(-1)
            pos = torch.from_numpy(rng.choice(flat.numel(), max(1, flat.numel() // 100), replace=False))
            flat[pos] += 1
        if v == 3:
            s["added"] = torch.arange(12, dtype=torch.int32).reshape(3, 4)
        out.append(s)
    return out


class FakeNode:
    """The node's side as the daemon wires it: applies versions with the recorder, writes the weights file."""

    def __init__(self, tmp_path, states):
        self.states = states
        self.log = Changelog(tmp_path / "changes")
        self.weights_path = tmp_path / "weights.safetensors"
        self.state: dict = {}
        self.version: int | None = None
        self.hash: str | None = None

    def apply(self, v: int) -> None:
        patch = keyframe(self.states[v]) if self.version is None else diff(self.states[self.version], self.states[v])
        base = None if self.version is None else (self.version, self.hash)
        with self.log.recording(patch, base, v) as recorder:
            apply(self.state, patch, undo=False, recorder=recorder)
        self.version, self.hash = v, patch.target_hash
        write_weights(self.weights_path, Weights(self.state, v, self.hash, "swarm"))

    def status(self) -> dict:
        return {"version": self.version, "state_hash": self.hash, "weights_path": str(self.weights_path)}


def serving(tmp_path, node: FakeNode, body) -> None:
    async def main():
        path = tmp_path / "node.sock"
        async with await TrajectorySpool.open(tmp_path / "spool", "n", "r") as spool:
            handle = LocalRequests(node.status, None, lambda: node.version, spool, changelog=node.log)
            async with trio.open_nursery() as n:
                await n.start(serve_local, path, handle)
                await trio.to_thread.run_sync(body, path)
                n.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_client_follows_versions_by_changes_alone_and_stays_bit_exact(tmp_path, device):
    """In host memory, and as an engine holding its weights in GPU memory: the bootstrap reads
    the weights file onto the device, each version after it writes only the changed elements
    there, in place (a tensor version 3 adds goes to the device too)."""
    states = versions(7)
    node = FakeNode(tmp_path, states)
    node.apply(0)

    def on_host(tensors):
        assert all(t.device.type == device for t in tensors.values())
        return {k: t.cpu() for k, t in tensors.items()}

    def body(path):
        tensors: dict = {}
        with NodeClient(path) as c:
            at = c.follow(tensors, None, device=device, verify=True)  # bootstraps from the weights file
            assert at == (0, state_hash(states[0]))
            held = tensors["w"]
            storage = {k: t.data_ptr() for k, t in tensors.items()}
            for v in range(1, 7):
                node.apply(v)  # the node applies from its own loop; here, between two follows
                at = c.follow(tensors, *at, verify=True)
                assert at == (v, state_hash(states[v]))
                same(on_host(tensors), states[v])
            assert tensors["w"] is held  # written in place, not replaced
            assert all(tensors[k].data_ptr() == p for k, p in storage.items())
            # Two versions at once, from an older copy.
            old = {k: t.to(device, copy=True) for k, t in states[4].items()}
            assert c.follow(old, 4, state_hash(states[4])) == at
            same(on_host(old), states[6])
            # Already current: nothing to do.
            assert c.follow(old, *at) == at

    serving(tmp_path, node, body)
    assert len(node.log.versions()) == 6  # 1..6: version 0 came from nothing, the weights file holds it


def test_changes_no_longer_held_mean_a_bootstrap(tmp_path):
    states = versions(5)
    node = FakeNode(tmp_path, states)
    for v in range(5):
        node.apply(v)
    node.log.retire(2)  # versions 1 and 2 dropped

    def body(path):
        with NodeClient(path) as c:
            with pytest.raises(NodeError) as e:
                c._follow_changes(clone(states[1]), (1, state_hash(states[1])), None, 10.0)
            assert e.value.code == localapi.BOOTSTRAP
            t = clone(states[1])
            assert c.follow(t, 1, state_hash(states[1]), verify=True) == (4, state_hash(states[4]))
            same(t, states[4])
            t = clone(states[2])  # from 2 the chain is whole
            assert c.follow(t, 2, state_hash(states[2])) == (4, state_hash(states[4]))
            same(t, states[4])
            t = clone(states[2])  # the wrong hash for 2: not the node's chain
            assert c.follow(t, 2, state_hash(states[3]), verify=True) == (4, state_hash(states[4]))
            same(t, states[4])

    serving(tmp_path, node, body)


def test_a_corrupt_change_file_costs_a_bootstrap_not_wrong_weights(tmp_path):
    states = versions(3)
    node = FakeNode(tmp_path, states)
    for v in range(3):
        node.apply(v)
    f = node.log.path(2)
    data = bytearray(f.read_bytes())
    data[-40] ^= 0xFF  # inside the last piece's bits... or its end frame: either way not version 2
    f.write_bytes(bytes(data))

    def body(path):
        with NodeClient(path) as c:
            t = clone(states[1])
            assert c.follow(t, 1, state_hash(states[1]), verify=True) == (2, state_hash(states[2]))
            same(t, states[2])

    serving(tmp_path, node, body)


def test_a_failed_apply_leaves_no_change_file(tmp_path):
    states = versions(3)
    log = Changelog(tmp_path / "changes")
    patch = diff(states[1], states[2])
    with pytest.raises(Exception):
        with log.recording(patch, (0, state_hash(states[0])), 2) as recorder:
            apply(clone(states[0]), patch, recorder=recorder)  # the wrong base
    assert log.versions() == [] and not list(log.dir.iterdir())


def test_a_node_that_records_no_changes_says_how_to_turn_them_on(tmp_path):
    """Without --sparse-handoff the node writes no change files (a version then costs its disk
    the patch alone), and `changes` answers with what to do, not a bootstrap every version."""
    states = versions(2)
    node = FakeNode(tmp_path, states)
    node.apply(0)
    node.log = None

    def body(path):
        with NodeClient(path) as c:
            with pytest.raises(NodeError, match="--sparse-handoff") as e:
                c.follow(clone(states[0]), 0, state_hash(states[0]))
            assert e.value.code == localapi.UNAVAILABLE

    serving(tmp_path, node, body)



def test_a_chain_from_far_behind_opens_the_files_held_not_one_per_version(tmp_path, monkeypatch):
    """`chain(after, upto)` tried to open a file for every version from `after` to `upto`, so a
    local client's `changes(0)` to a node at version V cost V failed opens in a worker thread
    (~9 us each, measured: 4.4 s at 500,000 versions), and clients repeating it on many connections
    held trio's worker threads, which the node's chunk reads and applies wait for. Now it
    opens only the files the log holds in that range."""
    import patchswarm.node.changelog as changelog

    states = versions(4)
    node = FakeNode(tmp_path, states)
    for v in range(4):
        node.apply(v)
    opened = []

    def counting_open(path, *args, **kwargs):
        opened.append(path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(changelog, "open", counting_open, raising=False)
    far = 200_000
    assert node.log.chain(0, None, far, state_hash(states[3])) is None  # the chain ends at 3, not at `far`
    assert len(opened) == len(node.log.versions()) == 3
    files = node.log.chain(1, state_hash(states[1]), 3, state_hash(states[3]))
    assert [f.name for f in files] == [str(node.log.path(v)) for v in (2, 3)]
    for f in files:
        f.close()
