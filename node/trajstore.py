"""The origin's durable trajectory store, and the segment log it shares with the node spool.

Owns the files under one directory: `NNNNNNNNNNNN.seg` segment files in the
format of protocol/trajectory.py and a `LOCK` file held by the one writer.
`SegmentLog` appends entry bodies with group commit (concurrent callers share
one write + fdatasync, run in one of trio's worker threads). The
`TrajectoryStore` (writer, in the origin) deduplicates by (node id, seq),
appends, and acknowledges only what is durable; `TrajectoryReader` (any other
process, e.g. `patchswarm trajectories`) reads the same files without the lock
and without truncating anything; `TrajectoryCursor` walks records in arrival
order for the trainer. Must not: decide anything about the wire, retention or
the trainer's policy beyond the staleness filter it is given.

Crash safety: records are acknowledged only after fdatasync (and, for a new
segment file, an fsync of the directory). On open the writer truncates a torn
tail of the last segment, reports damaged entries elsewhere (keeping the
intact ones around them) and rebuilds the dedup index from the files; the
duplicates dropped are persisted as `DuplicatesNote` entries in the same
commit, so every count the summary gives is recomputable from the files.
A reader that meets an incomplete tail in the newest segment stops there (the
writer is mid-write); a reader never sees data the writer has not yet made
durable only if it reads through the writer's cursor (`TrajectoryStore.cursor`),
which stops at the committed end.
"""

from __future__ import annotations

import base64
import bisect
import collections
import errno
import fcntl
import functools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import NamedTuple

import trio

from protocol.errors import StorageFailed, UsageError
from protocol.trajectory import (ENTRY_HEADER_BYTES, MAX_ENTRY_BYTES, SEGMENT_HEADER_BYTES, DuplicatesNote,
                                 ReceivedRecord, Record, ScanProblem, SeqRanges, body_length,
                                 check_segment_header, encode_record, entry_header, received_parts,
                                 scan_records, segment_header)

log = logging.getLogger("patchswarm.trajstore")

DEFAULT_SEGMENT_BYTES = 64 << 20  # a new segment file once the active one reaches this
DEFAULT_GROUP_BYTES = 16 << 20  # at most this much per write + fdatasync (at least one caller's worth)
READ_CHUNK = 2 * (MAX_ENTRY_BYTES + ENTRY_HEADER_BYTES)  # one read always holds a whole entry after a damaged one
_SEGMENT_NAME = re.compile(r"^(\d{12})\.seg$")
_IOV_BATCH = 512  # buffers per pwritev call (IOV_MAX is 1024 on Linux)


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
    durable too (the store relies on that for duplicates). After any I/O error
    the log is broken for good (after a failed fsync the page cache cannot be
    trusted): every commit raises StorageFailed until the owner is reopened.
    """

    def __init__(self, directory: Path, next_number: int, segment_bytes: int, group_bytes: int, on_durable):
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.group_bytes = group_bytes
        self._on_durable = on_durable
        self._next_number = next_number
        self.active: int | None = None  # segment number being appended to
        self.active_end = 0  # committed bytes of the active segment
        self._fd = -1
        self._queue: collections.deque[_Member] = collections.deque()
        self._leading = False
        self._broken: StorageFailed | None = None
        self._closed = False
        self.fsyncs = 0  # data fdatasyncs: one per commit group
        self.dir_fsyncs = 0
        self.entries = 0

    async def commit(self, bodies: list, tag) -> None:
        """Write `bodies` (each bytes, or a tuple of parts as from record_parts)."""
        if self._closed:
            raise UsageError(f"commit on the closed segment log in {self.directory}")
        if self._broken is not None:
            raise self._broken
        if not bodies:
            raise UsageError("commit: expected at least one body, found none")
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
        rotate = self._fd < 0 or self.active_end >= self.segment_bytes
        try:
            if self._broken is not None:
                raise self._broken
            number, fd, start = await in_worker_thread(self._write, rotate, bodies)
        except Exception as e:  # OSError above all; anything else is as fatal for durability
            if self._broken is None:
                self._broken = StorageFailed(f"segment log in {self.directory}: expected a durable write of "
                                             f"{total} bytes, found {type(e).__name__}: {e}; reopen to recover")
                log.error("%s", self._broken)
            for m in group:
                m.error, m.done = self._broken, True
                m.wake()
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
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                start = pwrite_all(fd, [segment_header()], 0)
                pwrite_all(fd, pieces, start)
                os.fdatasync(fd)
                fsync_dir(self.directory)  # the new name must survive a crash with its data
            except BaseException:
                os.close(fd)
                raise
            return number, fd, start
        pwrite_all(self._fd, pieces, self.active_end)
        os.fdatasync(self._fd)
        return self.active, self._fd, self.active_end

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


# ================================================================ summaries


class _Tally:
    """Counters over stored records; rebuilt from the files on open."""

    def __init__(self):
        self.records = 0
        self.duplicates_dropped = 0
        self.payload_bytes = 0
        self.by_node: collections.Counter = collections.Counter()
        self.by_version: collections.Counter = collections.Counter()

    def add(self, value) -> None:
        if type(value) is DuplicatesNote:
            self.duplicates_dropped += value.count
            return
        self.records += 1
        self.payload_bytes += len(value.payload)
        self.by_node[value.node_id] += 1
        self.by_version[value.policy_version] += 1

    def summary(self, current_version, max_staleness, segments: int, problems) -> dict:
        stale = 0
        if current_version is not None and max_staleness is not None:
            stale = sum(c for v, c in self.by_version.items() if current_version - v > max_staleness)
        return {
            "records": self.records,
            "duplicates_dropped": self.duplicates_dropped,
            "stale": stale,
            "by_node": dict(sorted(self.by_node.items())),
            "by_version": dict(sorted(self.by_version.items())),
            "payload_bytes": self.payload_bytes,
            "segments": segments,
            "problems": [str(p) for p in problems],
        }


def _json_default(o):
    if isinstance(o, (bytes, bytearray)):
        return {"b64": base64.b64encode(o).decode()}
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def record_json(r: ReceivedRecord) -> str:
    """One `--dump` line."""
    return json.dumps({
        "node_id": r.node_id, "region": r.region, "seq": r.seq, "policy_version": r.policy_version,
        "submitted_at": r.submitted_at, "received_at": r.received_at,
        "payload_b64": base64.b64encode(r.payload).decode(), "meta": r.meta,
    }, default=_json_default)


# ================================================================ cursor


class TrajectoryCursor:
    """Walks stored records in arrival order from `position` = (segment, offset).

    `read(max_records, current_version=...)` returns the next records it can
    read now and advances; records below `min_version`, or older than
    `max_staleness` versions behind `current_version`, are skipped and counted
    in `below_min` / `stale` (never silently). Damage met on the way is skipped
    and appended to `problems`. `position` is a plain tuple: save it to resume.
    """

    def __init__(self, source, start=None, *, min_version=None, max_staleness=None):
        self._source = source
        self.position: tuple[int, int] = tuple(start) if start else (0, SEGMENT_HEADER_BYTES)
        self.min_version = min_version
        self.max_staleness = max_staleness
        self.stale = 0
        self.below_min = 0
        self.duplicates_seen = 0  # sum of DuplicatesNote counts passed
        self.problems: list[FileProblem] = []
        self.seen: tuple[int, int] = (-1, -1)  # (segment, readable end) when the last read ran dry
        self._cache: tuple[int, int, bytes] | None = None  # (segment, offset, data)
        self._checked_header = -1

    def read(self, max_records: int = 1024, *, current_version: int | None = None) -> list[ReceivedRecord]:
        out: list[ReceivedRecord] = []
        while len(out) < max_records:
            seg, off = self.position
            numbers = self._source.segments()
            k = bisect.bisect_left(numbers, seg)
            if k == len(numbers):
                self.seen = (seg, off)
                break
            if numbers[k] != seg:
                seg, off = numbers[k], SEGMENT_HEADER_BYTES
                self.position = (seg, off)
            if self._checked_header != seg:
                self._check_header(seg)
            end = self._source.readable_end(seg)
            later = k + 1 < len(numbers)
            if off >= end:
                if later and self._source.finished(seg):
                    self.position = (numbers[k + 1], SEGMENT_HEADER_BYTES)
                    continue
                self.seen = (seg, end)
                break
            if not self._read_span(seg, off, end, later and self._source.finished(seg), out, max_records, current_version):
                self.seen = (seg, end)
                break
        return out

    def _check_header(self, seg: int) -> None:
        problem = check_segment_header(read_span(self._source.path(seg), 0, SEGMENT_HEADER_BYTES))
        if problem is not None and not problem.tail:
            self._report(seg, problem)
        self._checked_header = seg

    def _report(self, seg: int, problem: ScanProblem) -> None:
        fp = FileProblem(str(self._source.path(seg)), problem)
        self.problems.append(fp)
        log.warning("trajectory store: %s", fp)

    def _chunk(self, seg: int, off: int, end: int, whole: bool):
        c = self._cache
        if not whole and c and c[0] == seg and c[1] <= off < c[1] + len(c[2]) and (
                c[1] + len(c[2]) >= end or c[1] + len(c[2]) - off >= READ_CHUNK // 2):
            return c[1], c[2]
        data = read_span(self._source.path(seg), off, end - off if whole else min(end - off, READ_CHUNK))
        self._cache = (seg, off, data)
        return off, data

    def _read_span(self, seg, off, end, finished, out, max_records, current_version) -> bool:
        """Consume entries from [off, end); False if no progress was possible."""
        base, data = self._chunk(seg, off, end, whole=False)
        scan = scan_records(data, start=off - base)
        capped = base + len(data) < end
        tail = next((p for p in scan.problems if p.tail), None)
        if capped and tail is not None and scan.good_end == off - base:
            # no entry in a capped read: look at everything that is readable
            base, data = self._chunk(seg, off, end, whole=True)
            scan, capped = scan_records(data, start=0), False
            tail = next((p for p in scan.problems if p.tail), None)
        pos = off - base
        for entry, value in scan.entries:
            if len(out) >= max_records:
                break
            pos = entry.end
            if type(value) is DuplicatesNote:
                self.duplicates_seen += value.count
                continue
            if type(value) is not ReceivedRecord:
                self._report(seg, ScanProblem("invalid", base + entry.offset, base + entry.end, False,
                                              f"expected a received record, found a {type(value).__name__}"))
                continue
            if self.min_version is not None and value.policy_version < self.min_version:
                self.below_min += 1
            elif (self.max_staleness is not None and current_version is not None
                  and current_version - value.policy_version > self.max_staleness):
                self.stale += 1
            else:
                out.append(value)
        for p in scan.problems:  # damage we have now walked past
            if not p.tail and p.end <= pos:
                self._report(seg, ScanProblem(p.kind, base + p.offset, base + p.end, False, p.detail))
            elif not p.tail and p.offset < pos:
                pass  # cannot happen: entries never overlap damage
        if len(out) < max_records and tail is not None and pos == scan.good_end and not capped and finished:
            # damage at the end of a segment that will never grow: report it and move on
            self._report(seg, ScanProblem(tail.kind, base + tail.offset, base + tail.end, True, tail.detail))
            pos = len(data)
        progressed = base + pos > off
        self.position = (seg, base + pos)
        return progressed


# ================================================================ store (writer)


class _Recovered(NamedTuple):
    numbers: list[int]
    ends: dict[int, int]
    problems: list[FileProblem]
    tally: _Tally
    index: dict[str, SeqRanges]


def _scan_segments(directory: Path, truncate_last: bool) -> _Recovered:
    """Worker thread: scan every segment; rebuild tally and dedup index."""
    numbers, ends, problems = [], {}, []
    tally, index = _Tally(), {}
    found = list_segments(directory)
    for i, n in enumerate(found):
        path = segment_path(directory, n)
        data = path.read_bytes()
        scan = scan_records(data)
        for _, value in scan.entries:
            tally.add(value)
            if type(value) is not DuplicatesNote:
                index.setdefault(value.node_id, SeqRanges()).add(value.seq)
        last = i == len(found) - 1
        for p in scan.problems:
            problems.append(FileProblem(str(path), p))
        tail = scan.problems[-1] if scan.problems and scan.problems[-1].tail else None
        if truncate_last and last and tail is not None:
            log.warning("trajectory store: truncating %s at %d: %s", path, scan.good_end, tail)
            if scan.good_end <= SEGMENT_HEADER_BYTES and not scan.entries and len(scan.problems) == 1:
                path.unlink()  # nothing but a torn header or tail: the file held nothing durable
                fsync_dir(directory)
                continue
            with open(path, "r+b") as f:
                f.truncate(scan.good_end)
                os.fsync(f.fileno())
            data = data[:scan.good_end]
        numbers.append(n)
        ends[n] = len(data)
    for fp in problems:
        log.warning("trajectory store: %s", fp)
    return _Recovered(numbers, ends, problems, tally, index)


class TrajectoryStore:
    """The origin's writer: `await TrajectoryStore.open(dir)`, then `await append(records)`."""

    def __init__(self, directory: Path, lock: DirectoryLock, rec: _Recovered, segment_bytes: int,
                 group_bytes: int, clock):
        self.directory = directory
        self._lock = lock
        self._numbers = rec.numbers
        self._ends = rec.ends
        self.problems: list[FileProblem] = rec.problems  # found on open
        self._tally = rec.tally
        self._index = rec.index
        self._clock = clock
        self._new_data = trio.Event()
        next_number = (rec.numbers[-1] + 1) if rec.numbers else 1
        self.log = SegmentLog(directory, next_number, segment_bytes, group_bytes, self._landed)

    @classmethod
    async def open(cls, directory, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   group_bytes: int = DEFAULT_GROUP_BYTES, clock=time.time) -> TrajectoryStore:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock(directory)
        try:
            rec = await trio.to_thread.run_sync(_scan_segments, directory, True)
        except BaseException:
            lock.release()
            raise
        return cls(directory, lock, rec, segment_bytes, group_bytes, clock)

    async def append(self, records) -> list[int]:
        """Store what is new among `records`, drop (and count) duplicates by
        (node id, seq); returns every given seq once all of them are durable."""
        records = list(records)
        if not records:
            return []
        now = float(self._clock())
        for r in records:
            if not isinstance(r, Record):
                raise UsageError(f"append: expected Records, found {type(r).__name__}")
        encoded = [received_parts(r, now) for r in records]  # validate all before the index is touched
        bodies, values, dups = [], [], 0
        index = self._index
        for r, body in zip(records, encoded):
            seen = index.get(r.node_id)
            if seen is None:
                seen = index[r.node_id] = SeqRanges()
            if seen.add(r.seq):
                bodies.append(body)
                values.append(r)  # what the tally counts (node, version, payload size)
            else:
                dups += 1
        if dups:
            note = DuplicatesNote(dups)
            bodies.append(encode_record(note))
            values.append(note)
        # A batch of only duplicates still commits (its note): returning after a
        # commit queued behind the one that wrote the originals is what makes
        # them durable before we acknowledge.
        await self.log.commit(bodies, values)
        return [r.seq for r in records]

    def _landed(self, number: int, landed: list) -> None:
        for values, _, _ in landed:
            for v in values:
                self._tally.add(v)
        if not self._numbers or self._numbers[-1] != number:
            self._numbers.append(number)
        self._ends[number] = self.log.active_end
        self._new_data.set()
        self._new_data = trio.Event()

    # --- source interface for cursors
    def segments(self) -> list[int]:
        return self._numbers

    def readable_end(self, number: int) -> int:
        return self._ends.get(number, 0)

    def finished(self, number: int) -> bool:
        return number != self.log.active

    def path(self, number: int) -> Path:
        return segment_path(self.directory, number)

    # --- reading
    def cursor(self, start=None, *, min_version=None, max_staleness=None) -> TrajectoryCursor:
        """A cursor over durable records only (it never reads past the committed end)."""
        return TrajectoryCursor(self, start, min_version=min_version, max_staleness=max_staleness)

    async def wait_for_records(self, cursor: TrajectoryCursor) -> None:
        """Return once something was committed beyond what `cursor` last saw."""
        while True:
            seg, end = cursor.seen
            if self._numbers and (self._numbers[-1] > seg or self._ends.get(seg, 0) > end):
                return
            await self._new_data.wait()

    def iter_records(self, start=None, *, min_version=None, max_staleness=None, current_version=None):
        """Every durable record from `start` (a cursor position) in arrival order."""
        return _iterate(self.cursor(start, min_version=min_version, max_staleness=max_staleness), current_version)

    def summary(self, current_version: int | None = None, max_staleness: int | None = None) -> dict:
        s = self._tally.summary(current_version, max_staleness, len(self._numbers), self.problems)
        s["fsyncs"] = self.log.fsyncs
        return s

    def dump_jsonl(self, out) -> int:
        return _dump(self.cursor(), out)

    async def aclose(self) -> None:
        await self.log.aclose()
        self._lock.release()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def _iterate(cursor: TrajectoryCursor, current_version):
    while True:
        batch = cursor.read(1024, current_version=current_version)
        if not batch:
            return
        yield from batch


def _dump(cursor: TrajectoryCursor, out) -> int:
    n = 0
    for r in _iterate(cursor, None):
        out.write(record_json(r) + "\n")
        n += 1
    return n


# ================================================================ reader (any process)


class TrajectoryReader:
    """Read-only view of a store directory, safe while the writer runs: takes no
    lock, truncates nothing, and stops at an incomplete tail of the newest
    segment (the writer is mid-write; read again later)."""

    def __init__(self, directory):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise UsageError(f"expected a trajectory store directory, found nothing at {self.directory}")

    def segments(self) -> list[int]:
        return list_segments(self.directory)

    def readable_end(self, number: int) -> int:
        try:
            return os.stat(self.path(number)).st_size
        except FileNotFoundError:
            return 0

    def finished(self, number: int) -> bool:
        numbers = self.segments()
        return bool(numbers) and number < numbers[-1]

    def path(self, number: int) -> Path:
        return segment_path(self.directory, number)

    def cursor(self, start=None, *, min_version=None, max_staleness=None) -> TrajectoryCursor:
        return TrajectoryCursor(self, start, min_version=min_version, max_staleness=max_staleness)

    def iter_records(self, start=None, *, min_version=None, max_staleness=None, current_version=None):
        return _iterate(self.cursor(start, min_version=min_version, max_staleness=max_staleness), current_version)

    def summary(self, current_version: int | None = None, max_staleness: int | None = None) -> dict:
        """One pass over every segment: the same keys as TrajectoryStore.summary."""
        tally, cur = _Tally(), self.cursor()
        for r in _iterate(cur, None):
            tally.add(r)
        tally.duplicates_dropped = cur.duplicates_seen
        return tally.summary(current_version, max_staleness, len(self.segments()), cur.problems)

    def dump_jsonl(self, out) -> int:
        return _dump(self.cursor(), out)
