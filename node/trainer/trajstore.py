"""The origin's durable trajectory store.

Owns the records in one directory of segment files, written through the
segment log (node/seglog.py: files, lock, group commit). The
`TrajectoryStore` (writer, in the origin) deduplicates by (node id, seq),
appends, and acknowledges only what is durable; `TrajectoryReader` (any other
process, e.g. `patchswarm trajectories`) reads the same files without the lock
and without truncating anything; `TrajectoryCursor` walks records in arrival
order for the trainer. Must not: decide anything about the wire, retention or
the trainer's policy beyond the staleness filter it is given.

Record keys: a record may carry its client record id's key (16 bytes, sent
by nodes of wire revision 4). The store also drops a record whose key it
holds, from any node, and acknowledges it like any duplicate: the same
record resubmitted through another node after the first died with it
durable. Held: the keys of the newest `id_window` keyed records stored
(node/recordids.py's index, numbered by arrival), and those of records in
commits not landed yet (`_claimed`: the duplicate's note commits behind the
original, so it is acknowledged only once the original is durable, and
fails with it). A (node id, seq) held is counted as before, whatever its
key; a key dropped is counted in the note's `by_key`. The keys are stored in
the records' bodies, and open rebuilds the index from the newest window of
them (node/trainer/README.md, "Record keys", for the costs).

Full disk: a commit that finds no room raises DiskFull with nothing of it in
the files and its seqs out of the dedup index, so it is not acknowledged and
the node's resend is stored as new (`disk` reports it, bounded). Another
I/O error (EIO) raises StorageFailed the same way (its seqs and keys leave the
indexes, `_not_written`); the log recovers in-process (node/seglog.py), so the node's
resend after the origin closed its connection is stored (`storage_recoveries`
in the summary).

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
import json
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import trio

from patchswarm.protocol.errors import BudgetExceeded, DiskFull, UsageError
from patchswarm.protocol.trajectory import (RECORD_KEY_BYTES, SEGMENT_HEADER_BYTES, DuplicatesNote, ReceivedRecord,
                                            Record, ScanProblem, SeqRanges, check_segment_header, encode_record,
                                            received_parts, scan_records)

from patchswarm.node.diskspace import DiskCondition
from patchswarm.node.recordids import DEFAULT_WINDOW, RecordIdIndex
from patchswarm.node.seglog import (DEFAULT_GROUP_BYTES, DEFAULT_SEGMENT_BYTES, READ_CHUNK, DirectoryLock, FileProblem,
                                    SegmentLog, fsync_dir, list_segments, read_span, segment_path)

log = logging.getLogger("patchswarm.trajstore")

# Ranges in one node's dedup index. An honest node's seqs are dense with a gap per restart
# (node/spool.py) or per spool write that found its disk full; each range costs memory, and a
# new seq below others moves every range after it (a list insert): unbounded, a member could
# stall the origin for seconds per batch. A batch that would go past this is refused whole.
MAX_SEQ_RANGES_PER_NODE = 1 << 16
SEQ_RANGES_BUDGET = "seq ranges per node"  # BudgetExceeded.budget
# Policy versions counted one by one in a summary (an honest run publishes fewer); records of
# further versions, which only a buggy or hostile submitter invents, are counted together.
MAX_TALLIED_VERSIONS = 1 << 20


# ================================================================ summaries


class _Tally:
    """Counters over stored records; rebuilt from the files on open."""

    def __init__(self):
        self.records = 0
        self.duplicates_dropped = 0
        self.duplicates_by_key = 0  # of those, dropped for a record key held (another node's, maybe)
        self.payload_bytes = 0
        self.by_node: collections.Counter = collections.Counter()
        self.by_version: collections.Counter = collections.Counter()
        self.untallied_versions = 0  # records of versions past MAX_TALLIED_VERSIONS distinct ones

    def add(self, value) -> None:
        if type(value) is DuplicatesNote:
            self.duplicates_dropped += value.count
            self.duplicates_by_key += value.by_key
            return
        self.records += 1
        self.payload_bytes += len(value.payload)
        self.by_node[value.node_id] += 1
        v = value.policy_version
        if v in self.by_version or len(self.by_version) < MAX_TALLIED_VERSIONS:
            self.by_version[v] += 1
        else:
            self.untallied_versions += 1

    def summary(self, current_version, max_staleness, segments: int, problems) -> dict:
        stale = 0
        if current_version is not None and max_staleness is not None:
            stale = sum(c for v, c in self.by_version.items() if current_version - v > max_staleness)
        return {
            "records": self.records,
            "duplicates_dropped": self.duplicates_dropped,
            "duplicates_by_key": self.duplicates_by_key,
            "stale": stale,
            "by_node": dict(sorted(self.by_node.items())),
            "by_version": dict(sorted(self.by_version.items())),
            "untallied_versions": self.untallied_versions,
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
    in `below_min` / `stale` (never silently); with `max_staleness`, so are records
    claiming a version above `current_version` (`ahead`: none was published, so
    they come from a buggy or hostile submitter, or an origin whose data dir was reset). Damage met on the way is skipped
    and appended to `problems`. `position` is a plain tuple: save it to resume.
    """

    def __init__(self, source, start=None, *, min_version=None, max_staleness=None):
        for name, v in (("min_version", min_version), ("max_staleness", max_staleness)):
            if v is not None and not (type(v) is int and v >= 0):
                raise UsageError(f"{name}: expected None or an int >= 0, found {type(v).__name__} {v!r}")
        if start is not None and not (isinstance(start, (tuple, list)) and len(start) == 2
                                      and all(type(v) is int for v in start)
                                      and start[0] >= 0 and start[1] >= SEGMENT_HEADER_BYTES):
            raise UsageError(f"start: expected None or a cursor's position (segment >= 0, offset >= "
                             f"{SEGMENT_HEADER_BYTES}), found {type(start).__name__} {start!r}")
        self._source = source
        self.position: tuple[int, int] = tuple(start) if start else (0, SEGMENT_HEADER_BYTES)
        self.min_version = min_version
        self.max_staleness = max_staleness
        self.stale = 0
        self.below_min = 0
        self.ahead = 0
        self.duplicates_seen = 0  # sum of DuplicatesNote counts passed
        self.duplicates_by_key_seen = 0  # and of their by_key counts
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
        # Frame and decode only about the entries still wanted (a few more, for stale ones
        # and notes): the rest of the chunk stays cached for the next read.
        limit = max(max_records - len(out), 16)
        base, data = self._chunk(seg, off, end, whole=False)
        scan = scan_records(data, start=off - base, limit=limit)
        capped = base + len(data) < end
        tail = next((p for p in scan.problems if p.tail), None)
        if capped and tail is not None and scan.good_end == off - base:
            # no entry in a capped read: look at everything that is readable
            base, data = self._chunk(seg, off, end, whole=True)
            scan, capped = scan_records(data, start=0, limit=limit), False
            tail = next((p for p in scan.problems if p.tail), None)
        pos = off - base
        for entry, value in scan.entries:
            if len(out) >= max_records:
                break
            pos = entry.end
            if type(value) is DuplicatesNote:
                self.duplicates_seen += value.count
                self.duplicates_by_key_seen += value.by_key
                continue
            if type(value) is not ReceivedRecord:
                self._report(seg, ScanProblem("invalid", base + entry.offset, base + entry.end, False,
                                              f"expected a received record, found a {type(value).__name__}"))
                continue
            if self.min_version is not None and value.policy_version < self.min_version:
                self.below_min += 1
            elif (self.max_staleness is not None and current_version is not None
                  and value.policy_version > current_version):
                self.ahead += 1  # no such version was published: not on-policy data, whoever sent it
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
    ids: RecordIdIndex
    arrivals: int  # keyed records in the files: the next one's arrival number


def _scan_segments(directory: Path, truncate_last: bool, id_window: int = DEFAULT_WINDOW) -> _Recovered:
    """Worker thread: scan every segment; rebuild tally and dedup indexes."""
    numbers, ends, problems = [], {}, []
    tally, index = _Tally(), {}
    # The keys of stored records in arrival order, only the newest window of them kept (at most
    # two windows of bytes held): the index numbers them by arrival and forgets the oldest.
    keys, arrivals, keep = bytearray(), 0, id_window * RECORD_KEY_BYTES
    found = list_segments(directory)
    for i, n in enumerate(found):
        path = segment_path(directory, n)
        data = path.read_bytes()
        scan = scan_records(data)
        for _, value in scan.entries:
            tally.add(value)
            if type(value) is not DuplicatesNote:
                index.setdefault(value.node_id, SeqRanges()).add(value.seq)
                if getattr(value, "key", None) is not None:
                    keys += value.key
                    arrivals += 1
                    if len(keys) >= 2 * keep:
                        del keys[:len(keys) - keep]
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
    ids = RecordIdIndex(id_window)
    if keys:
        del keys[:max(0, len(keys) - keep)]
        held = len(keys) // RECORD_KEY_BYTES
        ids.add_packed(np.arange(arrivals - held, arrivals, dtype="<u8").tobytes(), bytes(keys))
    return _Recovered(numbers, ends, problems, tally, index, ids, arrivals)


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
        # Record keys (module docstring): those of durable records, numbered by arrival, the
        # newest window of them; and those of records in commits not landed yet (`_claimed`:
        # a key arriving meanwhile is a duplicate too, acknowledged only after the commit
        # that holds the original, which FIFO commits give; if that one fails, so does it).
        self._ids = rec.ids
        self._arrivals = rec.arrivals
        self._claimed: set[bytes] = set()
        self._clock = clock
        self._new_data = trio.Event()
        self._closed = False
        next_number = (rec.numbers[-1] + 1) if rec.numbers else 1
        self.log = SegmentLog(directory, next_number, segment_bytes, group_bytes, self._landed, self._not_written)
        self.disk = DiskCondition(directory)

    @classmethod
    async def open(cls, directory, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   group_bytes: int = DEFAULT_GROUP_BYTES, clock=time.time,
                   id_window: int = DEFAULT_WINDOW) -> TrajectoryStore:
        """`id_window`: how many record keys (the newest stored) a duplicate is looked for among."""
        if type(id_window) is not int or id_window < 1:
            raise UsageError(f"id_window: expected an int >= 1, found {type(id_window).__name__} {id_window!r}")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock(directory)
        try:
            rec = await trio.to_thread.run_sync(_scan_segments, directory, True, id_window)
        except BaseException:
            lock.release()
            raise
        return cls(directory, lock, rec, segment_bytes, group_bytes, clock)

    async def append(self, records) -> list[int]:
        """Store what is new among `records`, drop (and count) duplicates by
        (node id, seq), and by record key where a record has one (the key of a record
        stored or being stored, from any node, within the window); returns every given
        seq once all of them are durable (a duplicate's original included)."""
        records = list(records)
        if not records:
            return []
        now = float(self._clock())
        for r in records:
            if not isinstance(r, Record):
                raise UsageError(f"append: expected Records, found {type(r).__name__}")
        encoded = [received_parts(r, now) for r in records]  # validate all before the index is touched
        bodies, values, dups, by_key = [], [], 0, 0
        index, ids, claimed = self._index, self._ids, self._claimed
        for r, body in zip(records, encoded):
            seen = index.get(r.node_id)
            if seen is None:
                seen = index[r.node_id] = SeqRanges()
            key = r.key
            # a (node, seq) held is a resend, counted as before; else a key held is the same
            # record through another node (or a node's own, sent again under a new seq)
            if key is not None and (key in claimed or ids.get(key) is not None) and r.seq not in seen:
                dups += 1
                by_key += 1
                continue
            ranges = seen.range_count()
            if seen.add(r.seq):
                bodies.append(body)
                values.append(r)  # what the tally counts (node, version, payload size)
                if key is not None:
                    claimed.add(key)
                # past the bound, and by a new range (a store from before the bound may hold more)
                if seen.range_count() > max(ranges, MAX_SEQ_RANGES_PER_NODE):
                    for v in values:  # nothing of the batch stays: the indexes are as before it
                        index[v.node_id].discard(v.seq)
                        if v.key is not None:
                            claimed.discard(v.key)
                    raise BudgetExceeded(SEQ_RANGES_BUDGET, f"node {r.node_id!r}: expected its seqs to leave at "
                                         f"most {MAX_SEQ_RANGES_PER_NODE} ranges in the dedup index, found a batch "
                                         f"of {len(records)} that leaves more (seq {r.seq}); nothing of it was stored")
            else:
                dups += 1
        if dups:
            note = DuplicatesNote(dups, by_key)
            bodies.append(encode_record(note))
            values.append(note)
        # A batch of only duplicates still commits (its note): returning after a
        # commit queued behind the one that wrote the originals is what makes
        # them durable before we acknowledge.
        try:
            await self.log.commit(bodies, values)
        except DiskFull as e:  # `_not_written` took its seqs out of the index: the node's resend is new
            self.disk.failed(f"{len(values)} trajectory records", e)
            raise
        self.disk.succeeded()
        if ids.seal_due():
            await ids.seal_off_loop()
        return [r.seq for r in records]

    def _not_written(self, tags: list) -> None:
        """SegmentLog callback, before anyone hears of the failure: the records of commits that
        failed (a full disk, an I/O error) were not acknowledged, and nothing of them stays in
        the files, so they leave the dedup index (else the node's resend would be dropped as
        a duplicate, and acked: lost)."""
        for values in tags:
            for v in values:
                if isinstance(v, Record):
                    self._index[v.node_id].discard(v.seq)
                    if v.key is not None:  # unclaimed: a resend through any node is stored
                        self._claimed.discard(v.key)

    def _landed(self, number: int, landed: list) -> None:
        keys = []
        for values, _, _ in landed:
            for v in values:
                self._tally.add(v)
                if type(v) is not DuplicatesNote and v.key is not None:
                    keys.append(v.key)
        if keys:  # durable now: from the claims into the index, numbered in arrival order
            for k in keys:
                self._claimed.discard(k)
            self._ids.add(keys, range(self._arrivals, self._arrivals + len(keys)))
            self._arrivals += len(keys)
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
        """Return once something was committed beyond what `cursor` last saw
        (UsageError once the store is closed: nothing more will be)."""
        while True:
            if self._closed:
                raise UsageError(f"trajectory store in {self.directory} is closed: no more records will arrive")
            seg, end = cursor.seen
            if self._numbers and (self._numbers[-1] > seg or self._ends.get(seg, 0) > end):
                return
            await self._new_data.wait()

    def iter_records(self, start=None, *, min_version=None, max_staleness=None, current_version=None):
        """Every durable record from `start` (a cursor position) in arrival order."""
        return _iterate(self.cursor(start, min_version=min_version, max_staleness=max_staleness), current_version)

    def summary(self, current_version: int | None = None, max_staleness: int | None = None) -> dict:
        s = self._tally.summary(current_version, max_staleness, len(self._numbers), self.problems)
        s["record_keys"] = len(self._ids)  # remembered, of at most record_key_window
        s["record_key_window"] = self._ids.window
        s["fsyncs"] = self.log.fsyncs
        s.update(self.log.status())  # I/O errors in commits, and the recoveries from them (node/seglog.py)
        return s

    def dump_jsonl(self, out) -> int:
        return _dump(self.cursor(), out)

    async def aclose(self) -> None:
        try:
            await self.log.aclose()
        finally:
            self._lock.release()
            self._closed = True
            self._new_data.set()  # waiters see it closed

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
        """One pass over every segment: the keys of TrajectoryStore.summary but the writer's own (fsyncs,
        storage_failed, storage_failures, storage_recoveries)."""
        tally, cur = _Tally(), self.cursor()
        for r in _iterate(cur, None):
            tally.add(r)
        tally.duplicates_dropped = cur.duplicates_seen
        tally.duplicates_by_key = cur.duplicates_by_key_seen
        return tally.summary(current_version, max_staleness, len(self.segments()), cur.problems)

    def dump_jsonl(self, out) -> int:
        return _dump(self.cursor(), out)
