"""A full disk under a member's own writes (issue 21, defect 5): a real one, a small tmpfs and a filler.

The rule (node/diskspace.py): our disk failing a write is not a peer's fault
and not a reason to stop. The write is dropped with nothing of it left behind,
nothing is acknowledged that is not durable, one line says so, status shows it,
and the write is tried again until space returns; then everything completes:
bit-exact weights, every trajectory stored exactly once, no leftover files.

The first tests drive the storage parts in-process on a real full tmpfs (fast);
the slow ones run a tracker, an origin and a node as real processes, with the
node's or the origin's data dir on the small disk, and free the space mid-run.
Each needs root to mount the tmpfs, and is skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.spool import TrajectorySpool
from patchswarm.node.store import ObjectStore
from patchswarm.node.trainer.trajstore import TrajectoryReader, TrajectoryStore
from patchswarm.protocol.errors import DiskFull
from patchswarm.protocol.manifest import sign_manifest
from patchswarm.protocol.patch import diff
from patchswarm.protocol.publication import manifest_of
from patchswarm.protocol.trajectory import Record

import diskfaults
import smalldisk
from smalldisk import SmallDisk, leftovers

WHY_NOT = smalldisk.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"needs a real small disk: {WHY_NOT}")


def run(fn, *args, limit=60):
    async def main():
        with trio.fail_after(limit):
            return await fn(*args)
    return trio.run(main)


def rec(seq: int, payload: bytes = b"x" * 1000) -> Record:
    return Record("n1", "r1", seq, 0, 1.5, payload, None)


# ================================================================ in-process, on a real full tmpfs


def test_store_chunk_write_on_a_full_disk_leaves_no_temporary_and_is_reported(tmp_path):
    """Before: `_write_atomic` left its `.NAME.PID.tmp` (as much of the chunk as fit) behind."""
    trainer = Ed25519PrivateKey.generate()
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16)}
    target = {"w": base["w"].clone()}
    target["w"].view(-1).view(torch.int16)[::2] += 1
    p = diff(base, target, chunk_bytes=20_000, segment_elements=1 << 12)
    m = manifest_of(p, swarm_id="s", version=1, created_at=0.0)
    with SmallDisk(tmp_path / "d", 1 << 20) as disk:
        store = ObjectStore(disk.path / "objects")
        store.put_manifest((1, False), m, sign_manifest(m, trainer))
        disk.fill(leave=4096)  # less than a chunk
        with pytest.raises(OSError):
            store.put_chunk((1, False), 0, p.chunks[0])
        assert leftovers(disk.path) == []
        assert store.have((1, False)) == set()
        st = store.disk.status()
        assert st["disk_full"] and st["disk_write_failures"] == 1 and "no space left" in st["disk_error"]
        disk.free()
        store.put_chunk((1, False), 0, p.chunks[0])
        assert store.have((1, False)) == {0} and not store.disk.status()["disk_full"]


def test_spool_append_on_a_full_disk_fails_clearly_acknowledges_nothing_and_works_once_space_returns(tmp_path):
    """Before: the segment log broke for good on the first ENOSPC (every later append failed
    until a restart), and a torn write stayed in the segment file."""
    async def main(disk: SmallDisk):
        sp = await TrajectorySpool.open(disk.path / "spool", "n1", "r1", segment_bytes=1 << 16)
        first = await sp.append([(b"a" * 1000, 0)], timeout=5)
        sizes = {p.name: p.stat().st_size for p in (disk.path / "spool").iterdir()}
        disk.fill(leave=0)
        with pytest.raises(DiskFull, match="disk full"):
            await sp.append([(b"b" * 50_000, 0)], timeout=5)
        assert {p.name: p.stat().st_size for p in (disk.path / "spool").iterdir()} == sizes  # nothing kept
        assert sp.stats()["disk_full"] and sp.stats()["records"] == 1
        disk.free()
        second = await sp.append([(b"c" * 50_000, 0)], timeout=5)
        assert not sp.stats()["disk_full"]
        got = [r.payload[:1] for r in sp.pending()]
        await sp.aclose()
        return first, second, got

    with SmallDisk(tmp_path / "d", 1 << 20) as disk:
        first, second, got = run(main, disk)
        assert leftovers(disk.path) == []
    assert got == [b"a", b"c"] and second[0] > first[0]


def test_origin_store_commit_on_a_full_disk_is_not_acked_and_the_resend_is_stored_once(tmp_path):
    """Before: the seqs of a failed commit stayed in the dedup index, so the node's resend
    was dropped as a duplicate and acked: lost. And the store refused every later commit."""
    async def main(disk: SmallDisk):
        st = await TrajectoryStore.open(disk.path / "trajectories", segment_bytes=1 << 16)
        await st.append([rec(1)])
        disk.fill(leave=0)
        with pytest.raises(DiskFull):
            await st.append([rec(2, b"y" * 60_000), rec(3, b"z" * 60_000)])
        assert st.disk.failing
        disk.free()
        assert await st.append([rec(2, b"y" * 60_000), rec(3, b"z" * 60_000)]) == [2, 3]  # the resend
        assert not st.disk.failing
        await st.aclose()

    with SmallDisk(tmp_path / "d", 1 << 20) as disk:
        run(main, disk)
        summary = TrajectoryReader(disk.path / "trajectories").summary()
        seqs = [r.seq for r in TrajectoryReader(disk.path / "trajectories").iter_records()]
        assert leftovers(disk.path) == []
    assert seqs == [1, 2, 3] and summary["duplicates_dropped"] == 0


# ================================================================ real processes


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(diskfaults.SCENARIOS))
def test_a_full_disk_is_survived_bit_exact_with_nothing_lost_or_left_behind(tmp_path, scenario):
    """Before: the node or origin died with a traceback (spool, trajectory store), dropped the
    peer that sent a good chunk, left temporaries, or skipped a checkpoint for good."""
    out = diskfaults.SCENARIOS[scenario](tmp_path)
    assert out.survived, out
    assert (out.lost, out.duplicated, out.leftovers) == (0, 0, []), out
