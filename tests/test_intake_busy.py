"""Weight distribution does not wait on trajectory intake: a tracker, an origin and two node
daemons, in one process, over mutual TLS on loopback.

The origin's trajectory store is stuck while both nodes keep uploading: held (every
append waits, as on a slow disk), or on a real full disk (a tmpfs under the store,
filled: `Origin._store` retries DiskFull while it holds its intake slots). The shared
slots are set to 2, which the two nodes' windows (4 batches each) overfill, as more than
16 nodes overfill the real 64. A version published then still reaches both nodes from
the origin, bit for bit; once the store takes records again, every record spooled at
the nodes reaches the trainer's feed exactly once.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import trio

from patchswarm.node.daemon import Node, NodeConfig
from patchswarm.node.net import trust
from patchswarm.node.trainer import origin as origin_mod
from patchswarm.tracker import server

import smalldisk
from test_origin import _hold_appends

NODES = ("n1", "n2")
RECORDS = 96  # per node, 64 KiB each and incompressible: 6 MiB, two upload batches (of at most 4 MiB)
FETCH_BOUND_S = 20.0  # a one-chunk version on loopback takes well under a second


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: bytes(v.contiguous().view(torch.uint8).numpy()) for k, v in state.items()}


async def _until(what, timeout: float, step: float = 0.05) -> float:
    """Wait for `what()` to hold, at most `timeout` s; returns the seconds it took."""
    t0 = time.perf_counter()
    with trio.fail_after(timeout):
        while not what():
            await trio.sleep(step)
    return time.perf_counter() - t0


class _HeldStore:
    """The origin's store holds every append until `release`."""

    def __init__(self, tmp_path):
        self.peak = []

    def block(self, o) -> None:
        self.gate = _hold_appends(o, self.peak)

    def stuck(self) -> bool:
        return max(self.peak, default=0) >= 2  # the two shared slots' batches wait in the store

    def release(self) -> None:
        self.gate.set()


class _FullDisk:
    """The origin's store on a tmpfs of its own, filled; `release` frees the space."""

    def __init__(self, tmp_path):
        self.disk = smalldisk.SmallDisk(tmp_path / "origin-data" / "trajectories", 64 << 20)  # 12 MiB of records

    def block(self, o) -> None:
        self.o = o
        self.disk.fill()

    def stuck(self) -> bool:
        return self.o.trajectory_store.disk.failing

    def release(self) -> None:
        self.disk.free()


@pytest.mark.parametrize("stuck", [_HeldStore, _FullDisk], ids=["held", "disk_full"])
def test_a_stuck_trajectory_store_does_not_stop_a_new_version_reaching_the_nodes_and_no_record_is_lost(
        tmp_path, monkeypatch, stuck):
    if stuck is _FullDisk and smalldisk.available() is not None:
        pytest.skip(smalldisk.available())
    monkeypatch.setattr(origin_mod, "INTAKE_BATCHES_TOTAL", 2)
    store = stuck(tmp_path)
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    for name, role in [("tracker", "tracker"), ("origin", "origin"), *((n, "node") for n in NODES)]:
        trust.issue(swarm, name, role, tmp_path / name)
    torch.manual_seed(0)
    first = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    second = {k: v + 0.01 * torch.randn_like(v) for k, v in first.items()}
    out = {}

    async def main():
        with trio.fail_after(120), (store.disk if stuck is _FullDisk else contextlib.nullcontext()):
            async with trio.open_nursery() as n:
                tracker = server.Tracker(tmp_path / "tracker", "127.0.0.1:0")
                await n.start(tracker.run)
                o = origin_mod.Origin(origin_mod.OriginConfig(
                    tracker=tracker.listen_addr, creds=tmp_path / "origin", key=swarm / "trainer.key",
                    data_dir=tmp_path / "origin-data", listen="127.0.0.1:0"))
                await n.start(o.run)
                v0 = await o.publish(first)
                nodes = [Node(NodeConfig(tracker.listen_addr, tmp_path / name, tmp_path / f"{name}-data",
                                         "127.0.0.1:0", "r0")) for name in NODES]
                for node in nodes:
                    await n.start(node.run)
                await _until(lambda: all(node.version == v0 for node in nodes), 30)
                await _until(lambda: all(node._origin_session() is not None for node in nodes), 30)

                store.block(o)
                spooled = {}
                for node in nodes:
                    items = [(os.urandom(64 << 10), v0, None) for _ in range(RECORDS)]
                    spooled[node.id] = await node.spool.append(items, timeout=10)
                # The store holds the two shared slots' batches; the nodes' others are refused.
                await _until(store.stuck, 30)
                await trio.sleep(0.5)  # the nodes' other batches arrive (before: and stop their readers)

                v1 = await o.publish(second)
                out["fetch_s"] = await _until(lambda: all(node.version == v1 for node in nodes), FETCH_BOUND_S)
                out["appends_waiting"] = max(getattr(store, "peak", None) or [0])
                out["bits_equal"] = [_bits(node.applier.weights.state) == _bits(o.served.state) for node in nodes]
                out["deferred_while_held"] = {node.id: node.uploader.deferred_total for node in nodes}
                out["origin_deferred"] = o.intake_deferred

                t0 = time.perf_counter()
                store.release()
                feed = o.trajectories()
                got = []
                with trio.fail_after(60):
                    while len(got) < RECORDS * len(nodes):  # the disk's backoff: at most 10 s
                        got += await feed.get_batch(RECORDS * len(nodes) - len(got), timeout=1.0)
                    got += await feed.get_batch(1, timeout=2.0)  # nothing more comes: no record twice
                out["drain_s"] = time.perf_counter() - t0
                await _until(lambda: all(node.spool.stats()["records"] == 0 for node in nodes), 30)
                out["got"] = sorted((r.node_id, r.seq) for r in got)
                out["spooled"] = sorted((name, s) for name, seqs in spooled.items() for s in seqs)
                out["summary"] = o.trajectory_store.summary()
                n.cancel_scope.cancel()

    trio.run(main)
    print(f"\nwith the store stuck ({stuck.__name__}): the new version at both nodes in {out['fetch_s']:.2f} s; "
          f"batches refused per node {out['deferred_while_held']}; the store let go: every record at the feed "
          f"in {out['drain_s']:.2f} s")
    assert out["appends_waiting"] <= 2 and out["origin_deferred"] >= 2  # no more held than the shared slots
    assert out["bits_equal"] == [True, True]
    assert out["fetch_s"] < FETCH_BOUND_S
    assert out["got"] == out["spooled"] and len(out["got"]) == RECORDS * len(NODES)  # each record once
    assert out["summary"]["records"] == RECORDS * len(NODES)
    # no spinning: a refused node waits the origin's hint (1 s) or more between probes
    refused = out["deferred_while_held"].values()
    assert sum(refused) >= 2 and all(d <= 4 + FETCH_BOUND_S for d in refused)
