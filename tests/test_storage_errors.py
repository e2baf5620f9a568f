"""An I/O error (EIO) in a write or fdatasync of the segment log (node/seglog.py), and the recovery without a restart.

The rule: the failed round and the commits queued behind it raise
StorageFailed and are acknowledged nowhere; the log drops the descriptor whose
page cache it can no longer trust, cuts the file back to its committed end
and fdatasyncs it, and the next commit goes to a new segment file, so a
restart's scan finds exactly the acknowledged records and none of a failed
round's, even where the failed write had reached the file. A cut-back that
fails keeps the log refusing, and it is tried again at most every
RECOVER_EVERY_S.

The in-process tests fail one os call inside node/seglog.py (monkeypatched on
the os module for the call it arms, then passed through). The slow test puts
a spool on a real block device that fails: ext4 on a loop device whose
backing file lies on a small tmpfs, which is then filled (root only; skipped
with the reason elsewhere).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import subprocess
import time

import pytest
import trio

import patchswarm.node.seglog as seglog
from patchswarm.node.client import NodeClient, NodeError
from patchswarm.node.localapi import LocalRequests, serve_local
from patchswarm.node.seglog import SegmentLog, list_segments, segment_path
from patchswarm.node.spool import TrajectorySpool
from patchswarm.protocol import localapi
from patchswarm.protocol.errors import StorageFailed
from patchswarm.protocol.trajectory import encode_payload, scan_segment

import smalldisk

_real = {name: getattr(os, name) for name in ("fdatasync", "ftruncate", "pwritev", "pwrite")}


class Faults:
    """Fails chosen os calls with EIO: `arm(kind)` the next one (after `delay` s in the
    calling worker thread), `dead()` every fdatasync and ftruncate until `heal()`.
    kind "write": pwritev writes all but the last byte for real (a short write), and
    pwrite_all's pwrite of the rest fails: the file holds the round past its end."""

    def __init__(self, monkeypatch):
        self.armed: str | None = None
        self.delay = 0.0
        self.is_dead = False
        self.calls = collections.Counter()
        monkeypatch.setattr(os, "fdatasync", lambda fd: self._call("fdatasync", fd))
        monkeypatch.setattr(os, "ftruncate", lambda fd, n: self._call("ftruncate", fd, n))
        monkeypatch.setattr(os, "pwritev", self._pwritev)
        monkeypatch.setattr(os, "pwrite", lambda fd, b, o: self._call("pwrite", fd, b, o))

    def arm(self, kind: str, delay: float = 0.0) -> None:
        self.armed, self.delay = kind, delay

    def dead(self) -> None:
        self.is_dead = True

    def heal(self) -> None:
        self.is_dead = False

    def _fail(self, name: str) -> None:
        time.sleep(self.delay)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def _call(self, name: str, *args):
        self.calls[name] += 1
        if self.is_dead and name in ("fdatasync", "ftruncate"):
            self._fail(name)
        if self.armed == name or (self.armed == "write" and name == "pwrite"):
            self.armed = None
            self._fail(name)
        return _real[name](*args)

    def _pwritev(self, fd, buffers, offset):
        if self.armed != "write":
            return _real["pwritev"](fd, buffers, offset)
        data = b"".join(buffers)
        return _real["pwritev"](fd, [data[:-1]], offset)  # short: pwrite_all goes on with pwrite


def run(fn, *args, limit=60):
    async def main():
        with trio.fail_after(limit):
            return await fn(*args)
    return trio.run(main)


def bodies_on_disk(directory) -> dict[int, list[bytes]]:
    """What a restart's scan finds: each segment's entry bodies."""
    out = {}
    for n in list_segments(directory):
        scan = scan_segment(segment_path(directory, n).read_bytes())
        assert not scan.problems, scan.problems
        out[n] = [bytes(e.body) for e in scan.entries]
    return out


# ================================================================ the segment log


@pytest.mark.parametrize("fault", ["fdatasync", "write"])
def test_an_io_error_fails_its_round_and_the_queued_one_and_the_next_commit_needs_no_reopen(
        tmp_path, monkeypatch, caplog, fault):
    """Before: the log was broken for good: every later commit raised StorageFailed until a
    restart, and the failed round's bytes stayed in the file (a restart's scan would have
    found its records next to their retry: delivered twice)."""
    caplog.set_level(logging.INFO, logger="patchswarm.seglog")
    faults = Faults(monkeypatch)
    landed, failed, errors = [], [], []

    async def main():
        log = SegmentLog(tmp_path, 1, 1 << 20, 1 << 20,
                         lambda number, ms: landed.extend((number, tag) for tag, _, _ in ms), failed.extend)
        await log.commit([b"a1", b"a2"], "a")
        committed = log.active_end
        faults.arm(fault, delay=0.2)  # "c" queues behind the failing round meanwhile

        async def commit(bodies, tag):
            try:
                await log.commit(bodies, tag)
            except StorageFailed as e:
                errors.append((tag, str(e)))

        async with trio.open_nursery() as n:
            n.start_soon(commit, [b"b1", b"b2"], "b")
            await trio.sleep(0.05)
            n.start_soon(commit, [b"c1"], "c")
        size_after = segment_path(tmp_path, 1).stat().st_size
        await log.commit([b"d1"], "d")  # the same log object: no reopen
        status = log.status()
        await log.aclose()
        return committed, size_after, status

    committed, size_after, status = run(main)
    assert [tag for tag, _ in errors] == ["b", "c"] and failed == ["b", "c"]
    assert "Input/output error" in errors[0][1] and "nothing of it was acknowledged" in errors[0][1]
    assert size_after == committed  # cut back: the failed round's bytes are gone
    assert landed == [(1, "a"), (2, "d")]  # a new segment file after the recovery
    assert bodies_on_disk(tmp_path) == {1: [b"a1", b"a2"], 2: [b"d1"]}
    assert status == {"storage_failed": False, "storage_failures": 1, "storage_recoveries": 1}
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "patchswarm.seglog"]
    assert [level for level, _ in lines] == ["ERROR", "INFO"], lines
    assert "recovered" in lines[1][1] and "next commit starts segment 2" in lines[1][1]


def test_an_io_error_in_a_rotation_removes_the_new_file_and_the_next_one_is_stored(tmp_path, monkeypatch):
    faults = Faults(monkeypatch)

    async def main():
        log = SegmentLog(tmp_path, 1, 1, 1 << 20, lambda number, ms: None)  # every commit starts a new file
        await log.commit([b"a"], "a")
        faults.arm("fdatasync")
        with pytest.raises(StorageFailed):
            await log.commit([b"b"], "b")
        await log.commit([b"c"], "c")
        await log.aclose()

    run(main)
    assert bodies_on_disk(tmp_path) == {1: [b"a"], 2: [b"c"]}  # 2 again: its failed file was removed durably


def test_a_failed_cut_back_keeps_refusing_and_is_tried_again_at_most_every_interval(tmp_path, monkeypatch):
    """A dead disk: commits fail at once without touching it, one try per RECOVER_EVERY_S."""
    monkeypatch.setattr(seglog, "RECOVER_EVERY_S", 0.3)
    faults = Faults(monkeypatch)
    failed = []

    async def main():
        log = SegmentLog(tmp_path, 1, 1 << 20, 1 << 20, lambda number, ms: None, failed.extend)
        await log.commit([b"a"], "a")
        faults.dead()
        with pytest.raises(StorageFailed, match="expected to cut segment 1 back to its committed end"):
            await log.commit([b"b"], "b")
        tries = faults.calls["ftruncate"]
        for i in range(50):  # a caller retrying in a tight loop
            with pytest.raises(StorageFailed, match="tried again at most every 0.3 s"):
                await log.commit([b"c"], ("c", i))
        assert faults.calls["ftruncate"] == tries and log.status()["storage_failed"]
        await trio.sleep(0.35)
        with pytest.raises(StorageFailed):  # tried again, still dead
            await log.commit([b"e"], "e")
        assert faults.calls["ftruncate"] == tries + 1
        faults.heal()
        with pytest.raises(StorageFailed):  # within the interval: not tried yet
            await log.commit([b"f"], "f")
        await trio.sleep(0.35)
        await log.commit([b"g"], "g")
        status = log.status()
        await log.aclose()
        return status

    status = run(main)
    assert status == {"storage_failed": False, "storage_failures": 1, "storage_recoveries": 1}
    assert failed == ["b", *[("c", i) for i in range(50)], "e", "f"]  # the store takes each out of its index
    assert bodies_on_disk(tmp_path) == {1: [b"a"], 2: [b"g"]}


# ================================================================ the spool, through the local API


def test_a_client_submit_that_meets_an_io_error_fails_its_retry_is_stored_and_a_restart_hands_each_out_once(
        tmp_path, monkeypatch):
    """Before: after the first EIO every submit answered storage_failed until the node restarted."""
    faults = Faults(monkeypatch)
    path = tmp_path / "node.sock"
    spool_dir = tmp_path / "spool"

    async def serve_and_submit():
        async with await TrajectorySpool.open(spool_dir, "n1", "r1", segment_bytes=1 << 16) as spool:
            handle = LocalRequests(lambda: {"version": 1}, None, lambda: 1, spool)
            async with trio.open_nursery() as n:
                await n.start(serve_local, path, handle)

                def worker():
                    acked = {}
                    with NodeClient(path) as c:
                        acked[b"a"] = c.submit(b"a", 1, record_id=b"id-a")
                        faults.arm("fdatasync")
                        with pytest.raises(NodeError) as e:
                            c.submit(b"b", 1, record_id=b"id-b")
                        assert e.value.code == localapi.STORAGE and "Input/output error" in str(e.value)
                        acked[b"b"] = c.submit(b"b", 1, record_id=b"id-b")  # the worker's retry: stored
                        assert c.submit(b"b", 1, record_id=b"id-b") == acked[b"b"]  # and remembered now
                        acked[b"c"] = c.submit(b"c", 1, record_id=b"id-c")
                    return acked

                acked = await trio.to_thread.run_sync(worker)
                stats = spool.stats()
                n.cancel_scope.cancel()
        async with await TrajectorySpool.open(spool_dir, "n1", "r1") as spool:  # the restart
            handed = []
            while batch := spool.pending(2):
                handed.extend(batch)
        return acked, stats, handed

    acked, stats, handed = run(serve_and_submit)
    assert (stats["storage_failures"], stats["storage_recoveries"], stats["storage_failed"]) == (1, 1, False)
    assert stats["records"] == 3 and stats["repeated_total"] == 1
    assert sorted((r.seq, r.payload) for r in handed) == sorted(
        (seq, encode_payload(p)[0]) for p, seq in acked.items())  # each acknowledged record once, nothing else
    assert len(list_segments(spool_dir)) == 2  # the failed round's file was cut back, the retry went to a new one


# ================================================================ a real failing block device


def _loop_available() -> str | None:
    why = smalldisk.available()
    if why is not None:
        return why
    for tool in ("losetup", "mkfs.ext4"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} is not installed"
    return None


class LoopDisk:
    """ext4 on a loop device whose backing file lies on a small tmpfs, mounted at `path`.
    Filling the tmpfs makes the block device fail its writes (the kernel logs "Buffer I/O
    error on device loopN"); freeing it heals the device. Without a journal the file system
    goes on (the failed writes reach fdatasync as ENOSPC, the loop driver's status); with
    one, the first failed write aborts the journal (EIO) and ext4 turns read-only for good:
    a dead disk."""

    def __init__(self, root, image_bytes: int = 64 << 20, backing_bytes: int = 24 << 20, journal: bool = False):
        self.backing = smalldisk.SmallDisk(root / "backing", backing_bytes)
        self.path = root / "mnt"
        self.image_bytes = image_bytes
        self.journal = journal
        self.device = None

    def __enter__(self) -> "LoopDisk":
        self.backing.__enter__()
        try:
            image = self.backing.path / "image"
            with open(image, "wb") as f:
                f.truncate(self.image_bytes)  # sparse: blocks are taken from the tmpfs as written
            features = [] if self.journal else ["-O", "^has_journal"]
            subprocess.run(["mkfs.ext4", "-q", "-F", *features, str(image)], check=True, capture_output=True)
            self.device = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                                         text=True).stdout.strip()
            self.path.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-o", "errors=continue", self.device, str(self.path)], check=True,
                           capture_output=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["umount", str(self.path)], capture_output=True)
        if self.device:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
            self.device = None
        self.backing.__exit__()

    def fail(self) -> None:
        self.backing.fill(leave=0)

    def heal(self) -> None:
        self.backing.free()


WHY_NO_LOOP = _loop_available()


@pytest.mark.slow
@pytest.mark.skipif(WHY_NO_LOOP is not None, reason=f"needs a loop device on a tmpfs: {WHY_NO_LOOP}")
def test_a_spool_on_a_real_failing_block_device_recovers_once_it_heals(tmp_path):
    """No mock: the spool's fdatasync fails because the device under its file system fails."""
    payload = os.urandom(1 << 20)  # more than the page cache holds back: the write reaches the device

    async def main(disk: LoopDisk):
        spool_dir = disk.path / "spool"
        acked, refused = [], 0
        async with await TrajectorySpool.open(spool_dir, "n1", "r1", segment_bytes=8 << 20,
                                              max_bytes=1 << 30) as spool:
            acked += await spool.append([(payload[:1000], 1)], timeout=5)
            disk.fail()
            for i in range(8):  # until the device fails a write of ours
                try:
                    acked += await spool.append([(payload + b"%d" % i, 1)], timeout=5)
                except StorageFailed:
                    refused += 1
                    break
            disk.heal()
            deadline = trio.current_time() + 10
            while True:  # the worker's retry; the cut-back may need the backoff once
                try:
                    acked += await spool.append([(payload + b"retry", 1)], timeout=5)
                    break
                except StorageFailed:
                    assert trio.current_time() < deadline
                    await trio.sleep(0.2)
            stats = spool.stats()
        async with await TrajectorySpool.open(spool_dir, "n1", "r1") as spool:  # the restart
            handed = []
            while batch := spool.pending(4):
                handed.extend(r.seq for r in batch)
        return refused, acked, stats, handed

    with LoopDisk(tmp_path) as disk:
        refused, acked, stats, handed = run(main, disk)
    assert refused == 1, "the device never failed a write"
    assert stats["storage_failures"] >= 1 and stats["storage_recoveries"] >= 1 and not stats["storage_failed"]
    assert sorted(handed) == sorted(acked)  # each acknowledged record once, none of a failed round


@pytest.mark.slow
@pytest.mark.skipif(WHY_NO_LOOP is not None, reason=f"needs a loop device on a tmpfs: {WHY_NO_LOOP}")
def test_a_spool_whose_file_system_gives_up_refuses_at_once_and_tries_again_at_most_once_a_second(
        tmp_path, caplog):
    """A real EIO: journaled ext4 aborts on the device's failed write and turns read-only, so
    the cut-back fails (EROFS) and keeps failing. The spool must refuse each append at once
    (nothing acknowledged), and touch the disk at most once a second: one error line each."""
    caplog.set_level(logging.ERROR, logger="patchswarm.seglog")

    async def main(disk: LoopDisk):
        async with await TrajectorySpool.open(disk.path / "spool", "n1", "r1") as spool:
            await spool.append([(b"x" * 1000, 1)], timeout=5)
            disk.fail()
            with pytest.raises(StorageFailed, match="after OSError: .Errno 5. Input/output error, found OSError: "
                                                    ".Errno 30. Read-only file system"):
                await spool.append([(os.urandom(1 << 20), 1)], timeout=5)
            start, refused = time.monotonic(), 0
            while time.monotonic() - start < 2.5:  # a worker retrying every 10 ms
                with pytest.raises(StorageFailed, match="expected to cut segment 1 back"):
                    await spool.append([(b"y", 1)], timeout=5)
                refused += 1
                await trio.sleep(0.01)
            disk.heal()  # too late for this file system: it stays read-only
            stats = spool.stats()
        return refused, stats

    with LoopDisk(tmp_path, journal=True) as disk:
        refused, stats = run(main, disk)
    assert refused > 100
    assert (stats["storage_failed"], stats["storage_failures"], stats["storage_recoveries"]) == (True, 1, 0)
    errors = [r.getMessage() for r in caplog.records if r.name == "patchswarm.seglog"]
    # the failed write, the first cut-back, then one try a second over 2.5 s
    assert 3 <= len(errors) <= 5 and all("Errno 30" in e or "Errno 5" in e for e in errors), errors
