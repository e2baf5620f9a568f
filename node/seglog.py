"""Append-only segment files with group commit: the log under the node's spool and the origin's store.

Owns the files of one directory as a log: `NNNNNNNNNNNN.seg` segment files in
the format of protocol/trajectory.py (header, framed entries), a `LOCK` file
held by the one writer (`DirectoryLock`), and `SegmentLog`, which appends
entry bodies with leader/follower group commit: concurrent callers share one
write + fdatasync, run in one of trio's worker threads. Also the small file
helpers both users need (listing segments, fsyncing a directory, positional
reads and writes). Must not interpret the entries: what a record means, who
acknowledged what and what may be deleted belong to node/spool.py (the node)
and node/trainer/trajstore.py (the origin).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import functools
import logging
import os
import re
from pathlib import Path
from typing import NamedTuple

import trio

from patchswarm.protocol.errors import DiskFull, StorageFailed, UsageError
from patchswarm.protocol.trajectory import (ENTRY_HEADER_BYTES, MAX_ENTRY_BYTES, ScanProblem, body_length,
                                            entry_header, segment_header)

from patchswarm.node.diskspace import free_bytes, full

log = logging.getLogger("patchswarm.seglog")

DEFAULT_SEGMENT_BYTES = 64 << 20  # a new segment file once the active one reaches this
DEFAULT_GROUP_BYTES = 16 << 20  # at most this much per write + fdatasync (at least one caller's worth)
READ_CHUNK = 2 * (MAX_ENTRY_BYTES + ENTRY_HEADER_BYTES)  # one read always holds a whole entry after a damaged one
_SEGMENT_NAME = re.compile(r"^(\d{12})\.seg$")
_IOV_BATCH = 512  # buffers per pwritev call (IOV_MAX is 1024 on Linux)
RECOVER_EVERY_S = 1.0  # a log whose cut-back failed tries it again at most this often (a dead disk must not spin)


# ================================================================ files


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"{number:012d}.seg"


def list_segments(directory: Path) -> list[int]:
    """Segment numbers in the directory, ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_SEGMENT_NAME.match, names) if m)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, pieces: list, offset: int) -> int:
    """Write every buffer at `offset` onwards; returns the offset after them."""
    for i in range(0, len(pieces), _IOV_BATCH):
        chunk = pieces[i:i + _IOV_BATCH]
        want = sum(map(len, chunk))
        done = os.pwritev(fd, chunk, offset)
        if done < want:  # short write (rare on regular files): finish it byte-exact
            rest = memoryview(b"".join(chunk))[done:]
            while rest:
                k = os.pwrite(fd, rest, offset + done)
                if k <= 0:
                    raise OSError(errno.EIO, f"pwrite wrote {k} bytes")
                done += k
                rest = rest[k:]
        offset += want
    return offset


def read_span(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return os.pread(f.fileno(), length, offset)


class DirectoryLock:
    """An exclusive flock on DIR/LOCK for the lifetime of one writer."""

    def __init__(self, directory: Path):
        self.path = directory / "LOCK"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise UsageError(f"expected {directory} to be free, found its lock {self.path} held by another writer") from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1


class FileProblem(NamedTuple):
    """A damaged spot found in one file."""
    path: str
    problem: ScanProblem | str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


# ================================================================ group commit


async def in_worker_thread(fn, *args):
    """`fn(*args)` in one of trio's cached worker threads; the caller waits for it
    even when cancelled (only shielded commit rounds use it: they must).

    The commit round's hop, once per group: trio.to_thread.run_sync adds a
    capacity limiter, a contextvars copy and cancellation plumbing that a
    shielded round does not need, and cost 117 us of CPU per call here against
    65 us for this (the rest is the kernel's wakeups and the GIL handoffs)."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result) -> None:  # in the worker thread
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    trio.lowlevel.start_thread_soon(functools.partial(fn, *args), deliver)
    return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)


class _Member:
    """One caller's bodies waiting in the commit queue."""
    __slots__ = ("bodies", "tag", "sizes", "nbytes", "done", "error", "event", "abandoned")

    def __init__(self, bodies, tag):
        self.bodies = bodies
        self.tag = tag
        self.sizes = [ENTRY_HEADER_BYTES + body_length(b) for b in bodies]  # framed, in the file
        self.nbytes = sum(self.sizes)
        self.done = False
        self.error: BaseException | None = None
        self.event = trio.Event()
        self.abandoned = False  # its caller was cancelled; the bodies still get written

    def wake(self) -> None:
        self.event.set()

    async def sleep(self) -> None:
        await self.event.wait()
        self.event = trio.Event()


class SegmentLog:
    """Append-only segment files with leader/follower group commit.

    `commit(bodies, tag)` queues the bodies and returns once they are durable.
    The first caller to find no commit in progress leads: it takes the queue's
    head (up to `group_bytes`), writes it with one pwritev and one fdatasync in
    a worker thread, calls `on_durable(segment, landed)` once with each member's
    `(tag, offsets, sizes)` in queue order (so owners see entries land in file
    order, and wake their own waiters once per round, not once per caller),
    wakes the members, and hands the lead to the next waiting member. A new segment file starts
    when the active one has reached `segment_bytes` (and always with the first
    commit after open: recovered files are never appended to).

    A round itself is shielded from cancellation (bounded by the disk). A
    follower cancelled while it waits leaves its bodies queued: they are written
    by a later round (a record is never acknowledged without being durable, but
    one whose caller gave up may still land). The lead is handed only to members
    whose callers still wait; with none, the current leader writes the rest.
    FIFO order means a caller returns only after everything queued before it is
    durable too (the store relies on that for duplicates).

    A failed round acknowledges nothing. That round and every commit still
    queued behind it raise (queued ones may rest on the failed ones: the
    store's duplicates), and `on_failed(tags)` is told first, synchronously.
    A write that finds no room (ENOSPC, EDQUOT) before its fdatasync raises
    DiskFull: it is cut off the file again (ftruncate to the committed end; a
    segment file it had just created is removed), so nothing of it stays, and
    the next commit tries the disk again. Any other error (EIO from a write or
    an fdatasync) raises StorageFailed, and the log recovers at once without a
    reopen (`_cut_back`): after a failed fsync the page cache of that file
    cannot be trusted (the kernel may have dropped the dirty pages and report
    the next fsync clean), so the file descriptor is dropped, the file is cut
    back to its committed end on a new descriptor and fdatasynced (what lay
    beyond was never acknowledged; cut, it cannot come back in a restart's
    scan next to its own retry), a file the round had just created is removed,
    and the next commit starts a new segment file. If the cut-back fails too,
    every commit raises StorageFailed, and one commit at most every
    RECOVER_EVERY_S tries the cut-back again.
    """

    def __init__(self, directory: Path, next_number: int, segment_bytes: int, group_bytes: int, on_durable,
                 on_failed=None):
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.group_bytes = group_bytes
        self._on_durable = on_durable
        self._on_failed = on_failed
        self._next_number = next_number
        self.active: int | None = None  # segment number being appended to
        self.active_end = 0  # committed bytes of the active segment
        self._fd = -1
        self._queue: collections.deque[_Member] = collections.deque()
        self._leading = False
        self._broken: StorageFailed | None = None  # set while the log could not be cut back
        self._recover_at = 0.0  # trio time from which a broken log tries its cut-back again
        self._stray: int | None = None  # a segment file a failed round created: the cut-back removes it
        self._cause = ""  # the I/O error the cut-back follows, for its message
        self._closed = False
        self.failures = 0  # rounds failed by an I/O error other than a full disk
        self.recoveries = 0  # cut-backs after them that made the log usable again
        self.fsyncs = 0  # data fdatasyncs: one per commit group
        self.dir_fsyncs = 0
        self.entries = 0

    async def commit(self, bodies: list, tag) -> None:
        """Write `bodies` (each bytes, or a tuple of parts as from record_parts)."""
        if self._closed:
            raise UsageError(f"commit on the closed segment log in {self.directory}")
        if not bodies:
            raise UsageError("commit: expected at least one body, found none")
        if self._broken is not None and trio.current_time() < self._recover_at:
            if self._on_failed is not None:
                self._on_failed([tag])
            raise self._broken
        me = _Member(bodies, tag)
        self._queue.append(me)  # before any checkpoint: queue order is call order
        try:
            while not me.done:
                if self._leading:
                    await me.sleep()
                else:
                    await self._lead()
        except BaseException:
            if not me.done:
                me.abandoned = True
                self._hand_off()
            raise
        if me.error is not None:
            raise me.error

    async def _lead(self) -> None:
        self._leading = True
        try:
            with trio.CancelScope(shield=True):
                while self._queue:
                    await self._round()
                    if any(not m.abandoned for m in self._queue):
                        break  # someone still waiting takes the next round
        finally:
            self._leading = False
            self._hand_off()

    def _hand_off(self) -> None:
        """Wake the first queued member whose caller still waits: it leads next."""
        if self._leading:
            return
        for m in self._queue:
            if not m.abandoned:
                m.wake()
                return

    async def _round(self) -> None:
        # One scheduler pass first: callers just woken by the previous commit
        # get to queue their next records, so this group is as large as it can be.
        await trio.lowlevel.checkpoint()
        group, total = [], 0
        while self._queue and (not group or total + self._queue[0].nbytes <= self.group_bytes):
            m = self._queue.popleft()
            group.append(m)
            total += m.nbytes
        bodies = [b for m in group for b in m.bodies]
        if self._broken is not None and not await self._recover():
            self._fail(group, self._broken)
            return
        rotate = self._fd < 0 or self.active_end >= self.segment_bytes
        try:
            number, fd, start = await in_worker_thread(self._write, rotate, bodies)
        except DiskFull as e:  # nothing of it was kept: stay usable
            log.debug("%s", e)  # the owner reports it (node/diskspace.py: bounded)
            self._fail(group, e)
            return
        except Exception as e:  # OSError above all; anything else is as suspect for durability
            self.failures += 1
            error = StorageFailed(f"segment log in {self.directory}: expected a durable write of {total} bytes, "
                                  f"found {type(e).__name__}: {e}; nothing of it was acknowledged")
            log.error("%s; cutting segment %s back to its committed end %d", error, self.active, self.active_end)
            if rotate and not isinstance(e, FileExistsError):  # O_EXCL: a file in the way is not ours
                self._stray = self._next_number
            self._cause = f"{type(e).__name__}: {e}"
            self._fail(group, error if await self._recover() else self._broken)
            return
        self.fsyncs += 1
        if rotate:
            self.dir_fsyncs += 1
            if self._fd >= 0:
                os.close(self._fd)
            self._fd, self.active = fd, number
            self._next_number = number + 1
        pos, landed = start, []
        for m in group:
            offsets = []
            for size in m.sizes:
                offsets.append(pos)
                pos += size
            landed.append((m.tag, offsets, m.sizes))
            self.entries += len(m.bodies)
        self.active_end = pos
        self._on_durable(number, landed)
        for m in group:
            m.done = True
            m.wake()

    def _fail(self, group: list, error: StorageFailed) -> None:
        """Fail `group` and every commit queued behind it with `error` (told to on_failed first)."""
        group.extend(self._queue)
        self._queue.clear()
        if self._on_failed is not None:
            self._on_failed([m.tag for m in group])
        for m in group:
            m.error, m.done = error, True
            m.wake()

    async def _recover(self) -> bool:
        """After an I/O error: cut the files back (`_cut_back`); True if the log is usable
        again, else `_broken` says why and the next try waits RECOVER_EVERY_S."""
        if self._broken is not None and trio.current_time() < self._recover_at:
            return False
        fd, self._fd = self._fd, -1  # its page cache is suspect: never written through again
        try:
            await in_worker_thread(self._cut_back, fd, self._stray)
        except Exception as e:
            self._broken = StorageFailed(
                f"segment log in {self.directory}: expected to cut segment {self.active} back to its committed "
                f"end {self.active_end} after {self._cause}, found {type(e).__name__}: {e}; commits fail until a "
                f"cut-back succeeds (tried again at most every {RECOVER_EVERY_S:g} s)")
            self._recover_at = trio.current_time() + RECOVER_EVERY_S
            log.error("%s", self._broken)
            return False
        log.info("segment log in %s: recovered from an I/O error: segment %s cut back to its committed end %d; "
                 "the next commit starts segment %d", self.directory, self.active, self.active_end, self._next_number)
        self._broken, self._stray = None, None
        self.active = None  # the next commit starts a new segment file
        self.recoveries += 1
        return True

    def _cut_back(self, fd: int, stray: int | None) -> None:
        """Worker thread: close `fd`, cut the active segment back to `active_end` on a new
        descriptor and fdatasync it, and remove segment `stray` (a file a failed round
        created) if it is there. Nothing beyond the committed end was acknowledged."""
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # close may report the same write-back error again; the descriptor is gone
        if stray is not None:
            try:
                os.unlink(segment_path(self.directory, stray))
            except FileNotFoundError:
                pass
            fsync_dir(self.directory)  # a crash must not bring its name (and some of its data) back
        if self.active is None:
            return
        fd = os.open(segment_path(self.directory, self.active), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, self.active_end)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _write(self, rotate: bool, bodies: list):
        """Worker thread: frame (the checksums run here, off the event loop), rotate
        to a new file if asked, write, fdatasync. Changes no state of the log."""
        pieces = []
        for b in bodies:
            pieces.append(entry_header(b))
            if isinstance(b, bytes):
                pieces.append(b)
            else:
                pieces.extend(b)
        if rotate:
            number = self._next_number
            path = segment_path(self.directory, number)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if not full(e):
                    raise
                raise self._disk_full(e, pieces) from None
            try:
                start = self._write_or_cut(fd, [segment_header()], 0, 0)
                self._write_or_cut(fd, pieces, start, start)
                os.fdatasync(fd)
                fsync_dir(self.directory)  # the new name must survive a crash with its data
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)  # it holds nothing anyone was told is durable
                raise
            return number, fd, start
        self._write_or_cut(self._fd, pieces, self.active_end, self.active_end)
        os.fdatasync(self._fd)
        return self.active, self._fd, self.active_end

    def _write_or_cut(self, fd: int, pieces: list, offset: int, committed_end: int) -> int:
        """Write `pieces` at `offset`; on a full disk, cut the file back to `committed_end`
        and raise DiskFull (the log stays usable: nothing past the committed end was kept)."""
        try:
            return pwrite_all(fd, pieces, offset)
        except OSError as e:
            if not full(e):
                raise
            os.ftruncate(fd, committed_end)  # a failure here is an I/O error: the log breaks
            raise self._disk_full(e, pieces) from None

    def _disk_full(self, e: OSError, pieces: list) -> DiskFull:
        free = free_bytes(self.directory)
        return DiskFull(f"segment log in {self.directory}: expected room for {sum(map(len, pieces)):,} bytes, found "
                        f"the disk full ({e.strerror}; {'unknown' if free is None else f'{free:,}'} bytes free); "
                        f"nothing of it was kept or acknowledged; the next commit tries again")

    def status(self) -> dict:
        """For the owners' status: whether commits fail now (a cut-back failed), and the counts."""
        return {"storage_failed": self._broken is not None, "storage_failures": self.failures,
                "storage_recoveries": self.recoveries}

    async def aclose(self) -> None:
        """Write what is still queued, then close the active file."""
        with trio.move_on_after(60):
            while self._queue or self._leading:
                if self._leading:
                    await trio.sleep(0.001)
                else:
                    await self._lead()
        self._closed = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
