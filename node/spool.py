"""The node's durable trajectory spool: accept, fsync, hand out for upload, delete after the ack.

Owns one directory: `NNNNNNNNNNNN.seg` segment files of `Record` entries
(protocol/trajectory.py framing, written by node/seglog.SegmentLog with
group commit), `state` (which node this spool belongs to and the seq
high-water mark reserved so far), `acks` (log of acknowledged seq ranges),
`ids` (record ids of trimmed records, see below) and `LOCK`. Must not: talk
to the network, decide batching policy for the wire, or drop a record: a full spool makes `append` wait, then fail with SpoolFull;
a full disk makes it fail at once with DiskFull, nothing acknowledged, nothing
of it left in the files (node/seglog.py cuts the write off), and the next
append tries the disk again (`disk`, node/diskspace.py, says so in status).
Another I/O error (EIO) fails it with StorageFailed, nothing acknowledged,
and the log recovers in-process (node/seglog.py: cut back, new segment file):
the next append is written (`storage_recoveries` in status).

Seqs: unique per node for ever. The spool hands out seqs below `seq_reserved`,
persisted in `state` before use (in steps of SEQ_RESERVE); a restart resumes at
the reserved mark, so deleting acknowledged segments can never let a seq be
reused. The price is a gap in the numbering per restart. A spool with no
readable `state` (a new one, or a used one whose `state` is lost) starts at
the clock's microseconds (or above the highest seq on disk, if higher):
reservations never get near it, and a node id whose data dir was wiped, or a
new host given a reclaimed one's identity, never hands out a seq the origin
already stored under that id (it would drop the record as a duplicate).

Upload: a cursor design. `await next_batch()` (or the non-blocking
`pending()`) returns durable, unacknowledged records with seq >= the cursor,
in seq order, and moves the cursor past them (they are "in flight"). The
newest records (up to `hot_bytes`) are also kept in memory as the Records
`append` made, so an uploader that keeps up never reads or decodes the files
(no worker thread either); older ones are read back in a worker thread.
`ack(seqs)` forgets them: an entry in the ack log, then whole segments
unlinked once every record in them is acknowledged. `requeue()` (call it when
the connection to the origin is lost) moves the cursor back to the start, so
everything unacknowledged is pending again. A restart does the same. Delivery
is at-least-once; the origin deduplicates by (node_id, seq).

Ack durability: an ack entry is written (page cache: it survives kill -9) but
not fdatasynced, since forgetting an ack is harmless: after a power loss the
last acks may be gone and those records are uploaded again, and the origin
drops them as duplicates. That saves a worker-thread hop and an fdatasync per
upload batch. Compacting the log syncs (it replaces the file).

Record ids: an item may carry a client's record id; an id the spool
remembers is answered with the seq it was stored under, and nothing is
written. Remembered: the newest `id_window` identities (node/recordids.py's
index, in memory), durable as a `RecordIds` entry written just before its
records in the same commit (recovery keeps an entry's ids only for records
that survived it), and, once a segment is trimmed, in the `ids` file
(appended and fdatasynced before the unlink; rewritten with the window alone
before it holds 1.5 windows). An append waits for another append that is
writing one of its ids, then answers from it (or stores, if that write failed).

Space: `max_bytes` bounds the framed bytes of unacknowledged records plus
those being written; disk use can exceed it by the acknowledged part of
segments not yet deleted (at most about one segment).
"""

from __future__ import annotations

import bisect
import collections
import errno
import logging
import os
import sys
import time
from array import array
from pathlib import Path

import msgpack
import numpy as np
import trio

from patchswarm.protocol.errors import CorruptData, DiskFull, SpoolFull, StorageFailed, UnsupportedFormat, UsageError
from patchswarm.protocol.trajectory import (ENTRY_HEADER_BYTES, KIND_RECORD_IDS, MAX_BATCH_BYTES, MAX_ID_CHARS,
                                            MAX_PAYLOAD_BYTES, RECORD_KEY_BYTES, AckedRanges, PackedMeta, Record,
                                            RecordIds, SpoolState, decode_record, encode_entry, encode_record,
                                            pack_meta, record_key, record_parts, scan_records, segment_header, seq_ranges)

from patchswarm.node.diskspace import DiskCondition, full
from patchswarm.node.recordids import DEFAULT_WINDOW, RecordIdIndex, packed
from patchswarm.node.seglog import DirectoryLock, FileProblem, SegmentLog, fsync_dir, list_segments, segment_path

log = logging.getLogger("patchswarm.spool")

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_GROUP_BYTES = 16 << 20
DEFAULT_BATCH_RECORDS = 4096
DEFAULT_HOT_BYTES = 32 << 20  # newest records kept in memory for the uploader
SEQ_RESERVE = 1 << 20  # seqs reserved per write of `state`
ACK_LOG_COMPACT_BYTES = 1 << 20  # rewrite `acks` from memory once it grows past this
STATE_NAME, ACKS_NAME, IDS_NAME = "state", "acks", "ids"
MAX_RECORD_ID_BYTES = 64  # a client's record id (protocol/localapi.py's bound too)
IDS_PER_ENTRY = 1 << 16  # identities per RecordIds entry written
# Submits of more records than this are checked and framed in a worker thread: that costs per
# record (65,536 records of 1 byte held the event loop 0.46 s, ~7 us a record, measured on the loaded
# 2-core machine; 1.0 s with record ids), where the hop costs ~65-117 us (node/seglog.py
# in_worker_thread). 64 records: at most ~0.5 ms on the loop; a submit of a few records hops not.
INLINE_RECORDS = 64
# Framed size of a record beyond payload, packed meta and the two id strings:
# entry header, array header, kind, 2 str headers, seq, version, float, bin header.
_RECORD_OVERHEAD = ENTRY_HEADER_BYTES + 1 + 1 + 2 * 5 + 9 + 9 + 9 + 5


class _Segment:
    """In-memory index of one live segment file (payloads stay on disk)."""
    __slots__ = ("number", "path", "seqs", "offsets", "sizes", "acked", "n_acked", "has_ids", "id_seqs", "id_keys")

    def __init__(self, number: int, path: Path):
        self.number = number
        self.path = path
        self.seqs = array("Q")
        self.offsets = array("Q")
        self.sizes = array("I")  # framed entry sizes
        self.acked = bytearray()
        self.n_acked = 0
        self.has_ids = False  # some of its records have record ids
        # Their seqs (ascending) and keys (RECORD_KEY_BYTES each): the uploader sends each record's
        # key with it (`keys_of`), also after a restart; 24 bytes per identified record, freed
        # with the segment.
        self.id_seqs = array("Q")
        self.id_keys = bytearray()

    def unacked_from(self, j: int) -> int:
        return (len(self.seqs) - j) - self.acked.count(1, j)


# ================================================================ files (worker thread)


def _replace_file(directory: Path, name: str, data: bytes) -> None:
    """Replace `name` atomically and durably; a failed write (a full disk) leaves no temporary."""
    tmp = directory / (name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def _write_state(directory: Path, state: SpoolState) -> None:
    """Replace `state` atomically and durably."""
    _replace_file(directory, STATE_NAME, segment_header() + encode_entry(encode_record(state)))


def _pack_seqs(seqs) -> bytes:
    """Seqs as RecordIds packs them: u64 little-endian."""
    a = array("Q", seqs)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _unpack_seqs(data: bytes) -> array:
    a = array("Q", data)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def _id_entries(seqs: bytes, keys: bytes) -> list:
    """RecordIds entries (at most IDS_PER_ENTRY identities each) holding these packed identities."""
    return [RecordIds(seqs[i * 8:(i + IDS_PER_ENTRY) * 8],
                      keys[i * RECORD_KEY_BYTES:(i + IDS_PER_ENTRY) * RECORD_KEY_BYTES])
            for i in range(0, len(seqs) // 8, IDS_PER_ENTRY)]


def _write_ids(directory: Path, seqs: bytes, keys: bytes) -> None:
    """Replace `ids` atomically and durably with these identities."""
    _replace_file(directory, IDS_NAME, segment_header() + b"".join(
        encode_entry(encode_record(e)) for e in _id_entries(seqs, keys)))


def _write_acks(directory: Path, ranges: list) -> None:
    """Replace `acks` atomically with one entry holding `ranges`."""
    _replace_file(directory, ACKS_NAME,
                  segment_header() + (encode_entry(encode_record(AckedRanges(ranges))) if ranges else b""))


def _read_values(path: Path, problems: list, kind):
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    scan = _scan(path, data)
    problems.extend(FileProblem(str(path), p) for p in scan.problems)
    return [v for _, v in scan.entries if type(v) is kind]


def _scan(path: Path, data: bytes):
    """scan_records, with a newer format refused by the file's name (never repaired)."""
    try:
        return scan_records(data)
    except UnsupportedFormat as e:
        raise UnsupportedFormat(f"{path}: {e}") from None


def _recover(directory: Path, node_id: str, region: str, clock=time.time, id_window: int = DEFAULT_WINDOW):
    """Worker thread: rebuild the index from the files; returns what open() needs."""
    problems: list[FileProblem] = []
    ids = RecordIdIndex(id_window)
    ids_problems = len(problems)
    id_entries = _read_values(directory / IDS_NAME, problems, RecordIds) or []
    ids_rewrite = len(problems) > ids_problems or not (directory / IDS_NAME).exists()
    ids_in_file = 0
    # The identities read, merged into the index a window's worth at a time, not an entry at a
    # time: a merge copies the whole index, and a spool of single-record submits holds an entry
    # per record (recovery was quadratic: ~2 s at 8,000 records, minutes at 100,000).
    found = _FoundIds(ids)
    for e in id_entries:
        found.add(e.seqs, e.keys)
        ids_in_file += len(e)
    used = any((directory / name).exists() for name in (STATE_NAME, ACKS_NAME))  # else a new spool
    states = _read_values(directory / STATE_NAME, problems, SpoolState)
    state = states[-1] if states else None
    if state is not None and (state.node_id, state.region) != (node_id, region):
        raise UsageError(f"spool {directory}: expected node {node_id!r} in region {region!r}, "
                         f"found the spool of node {state.node_id!r} in region {state.region!r}")
    segments, max_seq = [], -1
    numbers = list_segments(directory)
    for i, n in enumerate(numbers):
        path = segment_path(directory, n)
        data = path.read_bytes()
        scan = _scan(path, data)
        problems.extend(FileProblem(str(path), p) for p in scan.problems)
        seg = _Segment(n, path)
        seg_ids = []
        for entry, value in scan.entries:
            if type(value) is RecordIds:
                seg_ids.append(value)
                continue
            if type(value) is not Record or value.node_id != node_id:
                problems.append(FileProblem(str(path), f"entry at {entry.offset} is not a record of node {node_id!r}"))
                continue
            seg.seqs.append(value.seq)
            seg.offsets.append(entry.offset)
            seg.sizes.append(entry.end - entry.offset)
            max_seq = max(max_seq, value.seq)
        seg.acked = bytearray(len(seg.seqs))
        _recover_ids(seg, seg_ids, found)
        tail = scan.problems[-1] if scan.problems and scan.problems[-1].tail else None
        if i == len(numbers) - 1 and tail is not None:
            # the write a crash interrupted: never fsynced, so never acknowledged
            log.warning("spool: truncating %s at %d: %s", path, scan.good_end, tail)
            with open(path, "r+b") as f:
                f.truncate(scan.good_end)
                os.fsync(f.fileno())
        segments.append(seg)
    acked = _read_values(directory / ACKS_NAME, problems, AckedRanges) or []
    for entry in acked:
        for a, b in entry.ranges:
            for seg in segments:
                if seg.seqs and seg.seqs[0] < b and seg.seqs[-1] >= a:
                    lo, hi = bisect.bisect_left(seg.seqs, a), bisect.bisect_left(seg.seqs, b)
                    for j in range(lo, hi):
                        seg.acked[j] = 1
    found.flush()
    for seg in segments:
        seg.n_acked = seg.acked.count(1)
    live = [s for s in segments if s.n_acked < len(s.seqs)]  # damage stays reported in `problems`
    trimmed_ids = any(s.has_ids for s in segments if s not in live)
    if ids_rewrite or trimmed_ids or ids_in_file > _ids_file_limit(id_window):
        # before the segments go: the identities of their records outlive them (the window)
        _write_ids(directory, *ids.packed())
        ids_in_file = len(ids)
    for s in segments:
        if s.n_acked == len(s.seqs):
            s.path.unlink()  # made durable by _write_state's directory fsync below
    next_seq = max(state.seq_reserved if state else 0, max_seq + 1)
    if state is None:
        # Nothing says which seqs this node id was handed before: a used spool whose `state`
        # is lost (acknowledged segments are deleted), or a new one, which may be the spool of
        # a node whose data dir was wiped or of a new host given a reclaimed one's identity. A
        # seq at or below one the origin stored under this id would be dropped there as a
        # duplicate (a new spool started at 0: bench/spot_reclaim.py lost 43-49 % of the acked
        # records). The clock in microseconds is above any: reservations move seqs about 2^20
        # per restart, and a node takes far fewer than 10^6 records a second.
        next_seq = max(next_seq, int(clock() * 1e6))
        if used or numbers:
            log.warning("spool %s: no readable state file; resuming seqs at %d (the clock in microseconds, "
                        "above any handed out before)", directory, next_seq)
    reserved = next_seq + SEQ_RESERVE
    _write_state(directory, SpoolState(node_id, region, reserved))
    _write_acks(directory, _acked_ranges(live))  # compacted; also drops a torn tail
    return live, problems, next_seq, reserved, (numbers[-1] + 1 if numbers else 1), ids, ids_in_file


class _FoundIds:
    """Identities read by a recovery, in the order read, merged into `index` once a window of
    them is pending (and at `flush`): a few merges, memory bounded by about a window."""

    def __init__(self, index: RecordIdIndex):
        self.index = index
        self.seqs: list[bytes] = []
        self.keys: list[bytes] = []
        self.pending = 0

    def add(self, seqs: bytes, keys: bytes) -> None:
        self.seqs.append(seqs)
        self.keys.append(keys)
        self.pending += len(seqs) // 8
        if self.pending >= self.index.window:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.index.add_packed(b"".join(self.seqs), b"".join(self.keys))
        self.seqs, self.keys, self.pending = [], [], 0


def _recover_ids(seg: _Segment, entries: list, found: _FoundIds) -> None:
    """The identities of a segment's RecordIds entries whose records it still holds. Each
    is written just before its records, in the same write: a crash that tore the write
    may have kept the entry and lost records after it, and those were never acknowledged
    (their resubmit must be stored, not answered with a seq that holds nothing)."""
    if not entries:
        return
    seqs = np.frombuffer(b"".join(e.seqs for e in entries), dtype="<u8")
    keys = np.frombuffer(b"".join(e.keys for e in entries), dtype=f"S{RECORD_KEY_BYTES}")
    keep = np.isin(seqs, np.frombuffer(seg.seqs, dtype=np.uint64))
    if not keep.any():
        return
    seg.has_ids = True
    if not keep.all():
        seqs, keys = seqs[keep], keys[keep]
    order = np.argsort(seqs, kind="stable")  # written in seq order; sorted all the same for keys_of
    seg.id_seqs = _unpack_seqs(seqs[order].astype("<u8").tobytes())
    seg.id_keys = bytearray(keys[order].tobytes())
    found.add(seqs.tobytes(), keys.tobytes())


def _ids_bound(n: int) -> int:
    """The framed bytes of the RecordIds entries of `n` identities, at most (0 for none)."""
    return n * (8 + RECORD_KEY_BYTES) + 64 * (n // IDS_PER_ENTRY + 1) if n else 0


def _ids_file_limit(window: int) -> int:
    """Identities the `ids` file may hold before it is rewritten with the window only."""
    return window + window // 2


def _acked_ranges(segments) -> list:
    """Seq ranges acknowledged in these segments (runs found with bytes.find, not per record)."""
    out = []
    for s in segments:
        j, n = 0, len(s.seqs)
        while (j := s.acked.find(1, j)) >= 0:
            k = s.acked.find(0, j)
            k = n if k < 0 else k
            if s.seqs[k - 1] - s.seqs[j] == k - 1 - j:  # consecutive seqs: the usual case
                out.append((s.seqs[j], s.seqs[k - 1] + 1))
            else:  # a gap (an entry lost to damage) inside the run
                out.extend(seq_ranges(s.seqs[j:k]))
            j = k
    return out


def _read_plan(plan) -> tuple[list[Record], list]:
    """Read and decode planned records (any thread: touches no spool state).
    Returns (records, [(segment number, seq, error), ...] for damaged ones)."""
    records, damaged = [], []
    for number, path, picked in plan:
        base = picked[0][1]
        try:
            with open(path, "rb", buffering=0) as f:
                span = os.pread(f.fileno(), picked[-1][1] + picked[-1][2] - base, base)
        except FileNotFoundError:
            continue  # acknowledged and deleted meanwhile (a requeue raced an ack)
        mv = memoryview(span)
        for seq, offset, size in picked:
            o = offset - base
            try:
                # metas stay the bytes they are on disk, as in the hot cache: the uploader
                # sends them as they are, and building one is ~70 bytes of Python per byte
                rec = decode_record(mv[o + ENTRY_HEADER_BYTES:o + size], packed_meta=True)
                if type(rec) is not Record or rec.seq != seq:
                    raise CorruptData(f"expected record seq {seq}, found {rec!r:.80}")
            except CorruptData as e:
                damaged.append((number, seq, str(e)))
                continue
            records.append(rec)
    return records, damaged


def _record_bound(node_id: bytes, region: bytes, payload: bytes, meta_len: int) -> int:
    return _RECORD_OVERHEAD + len(node_id) + len(region) + len(payload) + meta_len


# ================================================================ the spool


class TrajectorySpool:
    """See the module docstring. Create with `await TrajectorySpool.open(...)`."""

    def __init__(self, directory: Path, node_id: str, region: str, lock: DirectoryLock, recovered,
                 max_bytes: int, segment_bytes: int, group_bytes: int, clock, hot_bytes: int = DEFAULT_HOT_BYTES):
        segments, problems, next_seq, reserved, next_number, ids, ids_in_file = recovered
        self.directory = directory
        self.node_id, self.region = node_id, region
        self._id_bytes = (node_id.encode(), region.encode())
        self.max_bytes = max_bytes
        self.problems: list[FileProblem] = problems  # damage found on open; the caller logs it (once)
        self._lock = lock
        self._clock = clock
        self._segs: list[_Segment] = segments
        self._by_number = {s.number: s for s in segments}
        self._next_seq = next_seq
        self._seq_reserved = reserved
        self._reserve_lock = trio.Lock()
        self._framing = trio.Lock()  # held from taking seqs to the commit's enqueue (_store)
        self._ack_lock = trio.Lock()
        self._cursor = 0  # pending() hands out unacked seqs >= this
        self._in_flight_bytes = 0  # framed bytes handed out since the last requeue, not yet acked
        self._unacked_bytes = sum(sum(s.sizes[j] for j in range(len(s.seqs)) if not s.acked[j]) for s in segments)
        self._unacked = sum(len(s.seqs) - s.n_acked for s in segments)
        self._being_written = 0  # bytes admitted, not yet durable
        self._space_waiters: collections.deque = collections.deque()
        self._new_records = trio.Event()
        self._acks_fd = os.open(directory / ACKS_NAME, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._acks_bytes = os.fstat(self._acks_fd).st_size
        # Record identities (module docstring): remembered ones, those being written now
        # (key -> Event set when that write ends), and how many the `ids` file holds.
        self.ids = ids
        self._writing: dict[bytes, trio.Event] = {}
        self._ids_fd = os.open(directory / IDS_NAME, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._ids_in_file = ids_in_file
        self.repeated_total = 0  # records answered with the seq of an earlier submit of the same id
        self.appended_total = 0
        self.acked_total = 0
        self.lost_total = 0  # records unreadable when handed out (disk damage after open)
        # The newest durable records as append made them, for the uploader: seq -> (Record, framed size).
        self.hot_bytes = hot_bytes
        self._hot: dict[int, tuple[Record, int]] = {}
        self._hot_order: collections.deque[int] = collections.deque()  # seqs in landing order (some may be gone)
        self._hot_total = 0
        self.read_from_disk = 0  # records the uploader had to read back from the files
        self.log = SegmentLog(directory, next_number, segment_bytes, group_bytes, self._landed)
        self.disk = DiskCondition(directory)

    @classmethod
    async def open(cls, directory, node_id: str, region: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES, group_bytes: int = DEFAULT_GROUP_BYTES,
                   hot_bytes: int = DEFAULT_HOT_BYTES, clock=time.time,
                   id_window: int = DEFAULT_WINDOW) -> TrajectorySpool:
        for name, v in (("node_id", node_id), ("region", region)):
            if type(v) is not str or not 0 < len(v) <= MAX_ID_CHARS:
                raise UsageError(f"{name}: expected a str of 1..{MAX_ID_CHARS} chars, found {v!r}")
        if not (type(max_bytes) is int and max_bytes > 0 and type(segment_bytes) is int and segment_bytes > 0):
            raise UsageError(f"expected positive int max_bytes and segment_bytes, found {max_bytes!r}, {segment_bytes!r}")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock(directory)
        try:
            RecordIdIndex(id_window)  # checks it before any file is touched
            recovered = await trio.to_thread.run_sync(_recover, directory, node_id, region, clock, id_window)
        except BaseException:
            lock.release()
            raise
        return cls(directory, node_id, region, lock, recovered, max_bytes, segment_bytes, group_bytes, clock, hot_bytes)

    # ------------------------------------------------------------ append

    async def append(self, items, timeout: float) -> list[int]:
        """Spool (payload bytes, policy_version, meta[, record_id]) items; returns their seqs
        once they are fsynced. Waits up to `timeout` seconds for space, then raises
        SpoolFull having written nothing; a write that fails (DiskFull, or StorageFailed
        for any other error) acknowledges nothing. Payloads must be bytes: turn objects
        into bytes + meta with protocol.trajectory.encode_payload first. An item whose
        record_id the spool remembers (module docstring) is not stored again: its seq is
        the one it was stored under."""
        return (await self.submit(items, timeout))[0]

    async def submit(self, items, timeout: float) -> tuple[list[int], int]:
        """`append`, and how many of the items were answered from remembered ids."""
        items = items if isinstance(items, (list, tuple)) else list(items)
        if len(items) > INLINE_RECORDS:  # per-record work: the event loop turns meanwhile
            prepared, keys, need = await trio.to_thread.run_sync(self._prepare, items)
        else:
            prepared, keys, need = self._prepare(items)
        if not prepared:
            return [], 0
        named = [k for k in keys if k is not None]
        if len(set(named)) < len(named):
            raise UsageError(f"append of {len(prepared)} records: expected distinct record ids, found "
                             f"{len(named) - len(set(named))} repeated")
        # with the ids' entries, which are written too: one that fits only without them would
        # wait at the head of the room queue for its whole timeout
        if need + _ids_bound(len(named)) > self.max_bytes:
            raise UsageError(f"append of {len(prepared)} records: expected at most max_bytes={self.max_bytes} "
                             f"bytes, found {need + _ids_bound(len(named))}; it could never fit")
        if not named:
            return await self._store(prepared, [], need, timeout), 0
        known = await self._known(keys, timeout)
        if len(known) == len(prepared):
            self.repeated_total += len(known)
            return [known[i] for i in range(len(prepared))], len(known)
        new = [i for i in range(len(prepared)) if i not in known]
        ids = [(j, keys[i]) for j, i in enumerate(new) if keys[i] is not None]
        done = trio.Event()
        for _, k in ids:  # no checkpoint since _known looked: no other append saw them missing
            self._writing[k] = done
        try:
            # the ids entries' framed size, next to the records': 8 + RECORD_KEY_BYTES each and headers
            need += _ids_bound(len(ids))
            stored = await self._store([prepared[i] for i in new], ids, need, timeout)
        finally:
            for _, k in ids:
                del self._writing[k]
            done.set()
        known.update(zip(new, stored))
        self.repeated_total += len(prepared) - len(new)
        if self.ids.seal_due():  # the submit that filled it waits for the merge
            await self.ids.seal_off_loop()
        return [known[i] for i in range(len(prepared))], len(prepared) - len(new)

    async def _known(self, keys: list, timeout: float) -> dict[int, int]:
        """{item index: seq} for the keys the spool remembers. A key another append is
        writing now is waited for (its seq, or stored here if that write fails). No
        checkpoint unless it waits (a cancel scope per call cost ~20 us in trio)."""
        deadline = None
        while True:
            known, busy = {}, None
            for i, k in enumerate(keys):
                if k is None:
                    continue
                seq = self.ids.get(k)
                if seq is not None:
                    known[i] = seq
                elif k in self._writing:
                    busy = self._writing[k]
                    break
            if busy is None:
                return known
            deadline = trio.current_time() + timeout if deadline is None else deadline
            with trio.move_on_at(deadline) as scope:
                await busy.wait()
            if scope.cancelled_caught:
                raise SpoolFull(f"trajectory spool {self.directory}: expected the write of a record with the same "
                                f"record id by another submit to end within {timeout} s, found it still going; "
                                f"nothing was written")

    async def _store(self, prepared: list, ids: list, need: int, timeout: float) -> list[int]:
        """Write the checked items (and the identities `ids`: [(item index, key)], in an
        entry before them, in the same write); their seqs once durable."""
        await self._admit(need, timeout)
        try:
            n = len(prepared)
            # Seqs are taken and framed in turn, first come first served, so that seq order stays
            # file order while a large submit frames its records in a worker thread.
            try:
                self._framing.acquire_nowait()  # the usual case: no checkpoint
            except trio.WouldBlock:
                await self._framing.acquire()
            try:
                bodies, records, seqs, id_seqs, id_keys = await self._frame(prepared, ids)
            finally:
                self._framing.release()
            try:
                # No checkpoint from the release to the commit's enqueue: seq order is file order.
                # With ids, not cancelled part-way: node/seglog.py writes a cancelled caller's
                # bodies all the same (they may be in a group in flight), so its ids must stay
                # in `_writing` until they land, or a resubmit meanwhile stores them twice. A
                # queued member is never left waiting: it leads the next round itself.
                with trio.CancelScope(shield=bool(ids)):
                    await self.log.commit(bodies, (seqs, records, len(bodies) - n, id_seqs, id_keys))
            except DiskFull as e:
                self.disk.failed(f"{n} trajectory records ({need:,} bytes) to the spool", e)
                raise
            self.disk.succeeded()
        finally:
            self._being_written -= need
            self._wake_space()
        return seqs

    async def _frame(self, prepared: list, ids: list):
        """Take seqs for the checked items and frame them (with their ids' entries first);
        the caller holds `_framing`. Large submits are framed in a worker thread."""
        n = len(prepared)
        while self._next_seq + n > self._seq_reserved:
            try:
                await self._reserve_seqs(n)
            except OSError as e:
                if not full(e):  # e.g. EIO, a read-only file system: a submit must not end the node
                    log.error("spool %s: seq reservation failed: %s", self.directory, e)
                    raise StorageFailed(f"trajectory spool {self.directory}: expected a durable write of its "
                                        f"state (seq reservation), found {type(e).__name__}: {e}; nothing was "
                                        f"written") from None
                self.disk.failed(f"the spool's seq reservation in {self.directory}", e)
                raise DiskFull(f"trajectory spool {self.directory}: expected room to reserve seqs, found the "
                               f"disk full ({e.strerror}); nothing was written") from None
        first = self._next_seq
        self._next_seq += n
        now = float(self._clock())
        if n > INLINE_RECORDS:  # not cancelled: the seqs are taken (trio waits for the thread)
            return await trio.to_thread.run_sync(self._bodies, prepared, ids, first, now)
        return self._bodies(prepared, ids, first, now)

    def _bodies(self, prepared: list, ids: list, first: int, now: float):
        """(bodies, records, seqs, id_seqs, id_keys) for items from seq `first` on. Reads no
        mutable state (a worker thread runs it for large submits)."""
        n = len(prepared)
        records = [Record(self.node_id, self.region, first + i, v, now, p, m) for i, (p, v, m) in enumerate(prepared)]
        seqs = list(range(first, first + n))
        bodies = [record_parts(r) for r in records]
        id_seqs = id_keys = b""
        if ids:
            id_seqs = _pack_seqs(first + j for j, _ in ids)
            id_keys = b"".join(k for _, k in ids)
            entries = ([msgpack.packb([KIND_RECORD_IDS, id_seqs, id_keys], use_bin_type=True)]
                       if len(ids) <= IDS_PER_ENTRY else [encode_record(e) for e in _id_entries(id_seqs, id_keys)])
            bodies = entries + bodies  # first: a torn write keeps no record without its id (_recover_ids)
        return bodies, records, seqs, id_seqs, id_keys

    def _prepare(self, items) -> tuple[list, list, int]:
        """The items checked: (payload, version, meta) each, their record keys (None for
        none), and the bound on their framed bytes. Reads no mutable state (a worker
        thread runs it for large submits)."""
        prepared, keys, need = [], [], 0
        for item in items:
            payload, version, meta, rid = self._check_item(item)
            # checked as the origin (and the spool's own recovery) will decode it: one they
            # refuse, acknowledged here, would be refused with its whole batch at every resend
            meta_len = 1 if meta is None else len(meta if type(meta) is PackedMeta else pack_meta(meta))
            prepared.append((payload, version, meta))
            keys.append(None if rid is None else record_key(rid))
            need += _record_bound(*self._id_bytes, payload, meta_len)
        return prepared, keys, need

    @staticmethod
    def _check_item(item):
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3, 4):
            raise UsageError(f"append: expected (payload, policy_version[, meta[, record_id]]) tuples, found "
                             f"{type(item).__name__} of {len(item) if isinstance(item, (tuple, list)) else '-'}")
        payload, version, meta, rid = (*item, None, None)[:4]
        if isinstance(payload, (bytearray, memoryview)):
            payload = bytes(payload)
        if type(payload) is not bytes:
            raise UsageError(f"payload: expected bytes (use encode_payload for objects), found {type(payload).__name__}")
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise UsageError(f"payload: expected at most {MAX_PAYLOAD_BYTES} bytes, found {len(payload)}")
        if type(version) is not int or not 0 <= version < 1 << 64:
            raise UsageError(f"policy_version: expected a non-negative int, found {version!r}")
        if meta is not None and type(meta) is not dict and type(meta) is not PackedMeta:
            raise UsageError(f"meta: expected a dict or None, found {type(meta).__name__}")
        if rid is not None:
            if isinstance(rid, (bytearray, memoryview)):
                rid = bytes(rid)
            if type(rid) is not bytes or not 0 < len(rid) <= MAX_RECORD_ID_BYTES:
                raise UsageError(f"record_id: expected 1..{MAX_RECORD_ID_BYTES} bytes or None, found "
                                 f"{type(rid).__name__} {repr(rid)[:80]}")
        return payload, version, meta, rid

    def _fits(self, need: int) -> bool:
        return self._unacked_bytes + self._being_written + need <= self.max_bytes

    async def _admit(self, need: int, timeout: float) -> None:
        """Reserve `need` bytes of room, first come first served."""
        if not self._space_waiters and self._fits(need):
            self._being_written += need
            return
        waiter = [need, trio.Event(), False]  # need, event, granted
        self._space_waiters.append(waiter)
        try:
            with trio.fail_after(timeout):
                await waiter[1].wait()
        except BaseException as e:
            if waiter[2]:
                self._being_written -= need
            else:
                self._space_waiters.remove(waiter)
            self._wake_space()
            if isinstance(e, trio.TooSlowError):
                raise SpoolFull(
                    f"trajectory spool {self.directory}: expected room for {need} bytes within {timeout} s, "
                    f"found it full ({self._unacked_bytes} unacknowledged + {self._being_written} being written "
                    f"of max_bytes={self.max_bytes}); nothing was written. Is the uploader reaching the origin?") from None
            raise

    def _wake_space(self) -> None:
        while self._space_waiters and self._fits(self._space_waiters[0][0]):
            w = self._space_waiters.popleft()
            self._being_written += w[0]
            w[2] = True
            w[1].set()

    async def _reserve_seqs(self, n: int) -> None:
        async with self._reserve_lock:
            if self._next_seq + n <= self._seq_reserved:
                return
            new = max(self._seq_reserved, self._next_seq + n) + SEQ_RESERVE
            await trio.to_thread.run_sync(_write_state, self.directory, SpoolState(self.node_id, self.region, new))
            self._seq_reserved = new

    def _landed(self, number: int, landed: list) -> None:
        """SegmentLog callback, once per commit round, in file order: index the now
        durable records, keep the newest in memory, wake the uploader once."""
        seg = self._by_number.get(number)
        if seg is None:
            seg = self._by_number[number] = _Segment(number, segment_path(self.directory, number))
            self._segs.append(seg)
        hot, order = self._hot, self._hot_order
        for (seqs, records, n_ids, id_seqs, id_keys), offsets, sizes in landed:
            if n_ids:  # the RecordIds entries ahead of the records: identities, not records
                offsets, sizes = offsets[n_ids:], sizes[n_ids:]
                seg.has_ids = True
                seg.id_seqs.extend(_unpack_seqs(id_seqs))  # seq order is file order: stays ascending
                seg.id_keys += id_keys
                self.ids.add([id_keys[i:i + RECORD_KEY_BYTES] for i in range(0, len(id_keys), RECORD_KEY_BYTES)],
                             _unpack_seqs(id_seqs))
            seg.seqs.extend(seqs)
            seg.offsets.extend(offsets)
            seg.sizes.extend(sizes)
            seg.acked.extend(bytes(len(seqs)))
            nbytes = sum(sizes)
            self._unacked += len(seqs)
            self._unacked_bytes += nbytes
            self._hot_total += nbytes
            self.appended_total += len(seqs)
            for seq, rec, size in zip(seqs, records, sizes):
                hot[seq] = (rec, size)
            order.extend(seqs)
        while self._hot_total > self.hot_bytes and order:
            self._forget_hot(order.popleft())
        self._new_records.set()
        self._new_records = trio.Event()

    # ------------------------------------------------------------ upload side

    def _first_segment(self, seq: int) -> int:
        """Index of the first live segment that may hold seq or later ones."""
        for i, s in enumerate(self._segs):
            if s.seqs and s.seqs[-1] >= seq:
                return i
        return len(self._segs)

    def pending(self, max_records: int = DEFAULT_BATCH_RECORDS, max_bytes: int = MAX_BATCH_BYTES) -> list[Record]:
        """Up to `max_records` durable, unacknowledged records past the cursor, in
        seq order, at most `max_bytes` framed bytes (but always one record if
        there is any); the cursor moves past them. Records no longer in memory are
        read from the files on the calling thread: `next_batch` is the form for
        the event loop."""
        plan = self._plan(max_records, max_bytes)
        records = self._from_memory(plan)
        return records if records is not None else self._collect(_read_plan(plan))

    async def next_batch(self, max_records: int = DEFAULT_BATCH_RECORDS,
                         max_bytes: int = MAX_BATCH_BYTES) -> list[Record]:
        """Wait until something is pending, then `pending()`: from memory when the records
        are still there (no thread), else read from the files in a worker thread."""
        while True:
            await self.wait_pending()
            plan = self._plan(max_records, max_bytes)
            if plan:
                records = self._from_memory(plan)
                if records is not None:
                    return records
                return self._collect(await trio.to_thread.run_sync(_read_plan, plan))

    def keys_of(self, records) -> list | None:
        """The record key of each of `records` (live ones, as `next_batch` handed them out):
        RECORD_KEY_BYTES where the client gave an id, else None; None instead of the list
        when none has one. From the segments' identities, so a record read back after a
        restart has its key as one from memory does."""
        segs = [s for s in self._segs if s.id_seqs]
        if not segs:
            return None
        firsts = [s.id_seqs[0] for s in segs]
        out, found = [], False
        for r in records:
            key = None
            i = bisect.bisect_right(firsts, r.seq) - 1
            if i >= 0:
                ids = segs[i].id_seqs
                j = bisect.bisect_left(ids, r.seq)
                if j < len(ids) and ids[j] == r.seq:
                    key = bytes(segs[i].id_keys[j * RECORD_KEY_BYTES:(j + 1) * RECORD_KEY_BYTES])
                    found = True
            out.append(key)
        return out if found else None

    def _from_memory(self, plan) -> list[Record] | None:
        """The planned records from the hot cache, or None if any of them has left it."""
        hot, out = self._hot, []
        for _, _, picked in plan:
            for seq, _, _ in picked:
                got = hot.get(seq)
                if got is None:
                    self.read_from_disk += sum(len(p) for _, _, p in plan)
                    return None
                out.append(got[0])
        return out

    def _forget_hot(self, seq: int) -> None:
        got = self._hot.pop(seq, None)
        if got is not None:
            self._hot_total -= got[1]

    def _plan(self, max_records: int, max_bytes: int) -> list:
        """Choose the next records past the cursor and move the cursor past them:
        [(segment number, path, [(seq, offset, size), ...]), ...]."""
        plan, count, total = [], 0, 0
        for seg in self._segs[self._first_segment(self._cursor):]:
            j = bisect.bisect_left(seg.seqs, self._cursor)
            picked = []
            while j < len(seg.seqs) and count + len(picked) < max_records:
                if not seg.acked[j]:
                    if (count or picked) and total + seg.sizes[j] > max_bytes:
                        break
                    picked.append((seg.seqs[j], seg.offsets[j], seg.sizes[j]))
                    total += seg.sizes[j]
                j += 1
            if picked:
                plan.append((seg.number, seg.path, picked))
                count += len(picked)
                self._cursor = picked[-1][0] + 1
            if j < len(seg.seqs):  # stopped by a limit
                break
        self._in_flight_bytes += total
        return plan

    def pending_bytes(self) -> int:
        """Framed bytes of the records `pending()` would hand out now (all of them, past any
        batch limit), so that an uploader can let a small batch fill up."""
        return max(0, self._unacked_bytes - self._in_flight_bytes)

    def _collect(self, read) -> list[Record]:
        records, damaged = read
        for number, seq, err in damaged:
            # Damaged after open (it checked then): unrecoverable. Count it and free its room.
            seg = self._by_number.get(number)
            j = bisect.bisect_left(seg.seqs, seq) if seg else 0
            log.error("spool: %s: record seq %d is lost: %s", segment_path(self.directory, number), seq, err)
            self.problems.append(FileProblem(str(segment_path(self.directory, number)), f"record seq {seq} unreadable: {err}"))
            self.lost_total += 1
            if seg and j < len(seg.seqs) and seg.seqs[j] == seq and not seg.acked[j]:
                self._mark_acked(seg, j)
        return records

    async def wait_pending(self) -> None:
        """Return once pending() has something to give."""
        while not self._has_pending():
            await self._new_records.wait()

    async def wait_pending_bytes(self, n: int) -> None:
        """Return once pending_bytes() >= n (an uploader lets a small batch fill up for a
        while: put a deadline around it)."""
        while self.pending_bytes() < n:
            await self._new_records.wait()

    def _has_pending(self) -> bool:
        for seg in self._segs[self._first_segment(self._cursor):]:
            if seg.unacked_from(bisect.bisect_left(seg.seqs, self._cursor)):
                return True
        return False

    def requeue(self) -> None:
        """Every unacknowledged record is pending again (e.g. the connection was lost)."""
        self._cursor = 0
        self._in_flight_bytes = 0
        self._new_records.set()
        self._new_records = trio.Event()

    def _mark_acked(self, seg: _Segment, j: int) -> None:
        seg.acked[j] = 1
        seg.n_acked += 1
        self._unacked -= 1
        self._unacked_bytes -= seg.sizes[j]
        if seg.seqs[j] < self._cursor:  # it was handed out (since the last requeue)
            self._in_flight_bytes = max(0, self._in_flight_bytes - seg.sizes[j])
        self._forget_hot(seg.seqs[j])

    async def ack(self, seqs) -> int:
        """The origin holds these seqs durably: forget them (the ack log entry is not
        fdatasynced: module docstring). Returns how many were newly acknowledged
        (unknown or repeated seqs are ignored)."""
        newly = []
        firsts = [s.seqs[0] if s.seqs else 0 for s in self._segs]
        for seq in sorted(set(seqs)):
            i = bisect.bisect_right(firsts, seq) - 1
            if i < 0:
                continue
            seg = self._segs[i]
            j = bisect.bisect_left(seg.seqs, seq)
            if j < len(seg.seqs) and seg.seqs[j] == seq and not seg.acked[j]:
                self._mark_acked(seg, j)
                newly.append(seq)
        if not newly:
            return 0
        order = self._hot_order
        while order and order[0] not in self._hot:
            order.popleft()
        if len(order) > 2 * len(self._hot) + 4096:  # acks out of landing order left holes: drop them
            self._hot_order = collections.deque(s for s in order if s in self._hot)
        self.acked_total += len(newly)
        self._wake_space()
        done = [s for s in self._segs if s.n_acked == len(s.seqs) and s.number != self.log.active]
        for s in done:
            self._segs.remove(s)
            del self._by_number[s.number]
        async with self._ack_lock:
            compact = self._acks_bytes > ACK_LOG_COMPACT_BYTES
            ranges = _acked_ranges(self._segs) if compact else seq_ranges(newly)
            # The identities in the segments about to go move to the `ids` file first (module
            # docstring): the index holds them (those past the window need not move), taken
            # here, on the loop, and picked out by seq in the worker thread.
            moving = None
            if any(s.has_ids for s in done):
                moving = (self.ids.packed_parts(), [(s.seqs[0], s.seqs[-1] + 1) for s in done if s.has_ids])
            try:
                if compact or done:
                    await trio.to_thread.run_sync(self._persist_ack, ranges, compact, [s.path for s in done], moving)
                else:  # the usual case: a small write to the page cache, no fdatasync (module docstring)
                    self._write_ack_entry(ranges)
            except OSError as e:
                if not full(e):
                    raise
                # Harmless to lose (module docstring): after a restart those records go again
                # and the origin drops them as duplicates.
                self.disk.failed(f"an ack entry to {self.directory / ACKS_NAME}", e)
        return len(newly)

    def _write_ack_entry(self, ranges: list) -> None:
        entry = encode_entry(encode_record(AckedRanges(ranges)))
        try:
            if os.write(self._acks_fd, entry) != len(entry):
                raise OSError(errno.ENOSPC, "short write")
        except OSError:
            os.ftruncate(self._acks_fd, self._acks_bytes)  # no torn entry for the next ones to follow
            raise
        self._acks_bytes += len(entry)

    def _persist_ack(self, ranges: list, compact: bool, unlink: list, moving: tuple | None = None) -> None:
        """Worker thread: record the ack (durably when compacting), make the identities of
        the segments' records durable in `ids` (`moving`: the index's packed parts and
        the seq ranges of the segments; appended, or the file rewritten with the whole
        window once it would pass 1.5 windows), then delete whole acknowledged segments.
        A failed ids write leaves the segments on disk: the next open moves their ids
        and deletes them."""
        if compact:
            _write_acks(self.directory, ranges)
            fd = os.open(self.directory / ACKS_NAME, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            os.close(self._acks_fd)
            self._acks_fd = fd
            self._acks_bytes = os.fstat(fd).st_size
        else:
            self._write_ack_entry(ranges)
        if moving is not None:
            self._move_ids(*moving)
        for path in unlink:
            path.unlink()
        if unlink:
            fsync_dir(self.directory)

    def _move_ids(self, parts: tuple, spans: list) -> None:
        """Worker thread: the index's identities whose seqs fall in `spans` appended to `ids`
        and fdatasynced, or the file rewritten with the whole index past 1.5 windows."""
        seqs, keys = packed(*parts)
        every = np.frombuffer(seqs, dtype="<u8")
        pick = np.zeros(len(every), dtype=bool)
        for lo, hi in spans:
            pick |= (every >= lo) & (every < hi)
        n = int(np.count_nonzero(pick))
        if not n:
            return
        if self._ids_in_file + n > _ids_file_limit(self.ids.window):
            _write_ids(self.directory, seqs, keys)
            fd = os.open(self.directory / IDS_NAME, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            os.close(self._ids_fd)
            self._ids_fd = fd
            self._ids_in_file = len(every)
            return
        k = np.frombuffer(keys, dtype=f"S{RECORD_KEY_BYTES}")
        data = b"".join(encode_entry(encode_record(e))
                        for e in _id_entries(every[pick].astype("<u8").tobytes(), k[pick].tobytes()))
        end = os.fstat(self._ids_fd).st_size
        try:
            if os.write(self._ids_fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
            os.fdatasync(self._ids_fd)
        except OSError:
            os.ftruncate(self._ids_fd, end)  # no torn entry for the next ones to follow
            raise
        self._ids_in_file += n

    # ------------------------------------------------------------ status

    @property
    def unacked(self) -> int:
        """Records durable here that the origin has not acknowledged (stats' "records")."""
        return self._unacked

    def stats(self) -> dict:
        in_flight = 0
        for seg in self._segs:
            k = bisect.bisect_left(seg.seqs, self._cursor)
            in_flight += k - seg.acked.count(1, 0, k)
        return {
            "records": self._unacked,
            "bytes": self._unacked_bytes,
            "segments": len(self._segs),
            "in_flight": in_flight,
            "appended_total": self.appended_total,
            "acked_total": self.acked_total,
            "lost_total": self.lost_total,
            "next_seq": self._next_seq,
            "fsyncs": self.log.fsyncs,
            "hot_bytes": self._hot_total,
            "read_from_disk": self.read_from_disk,
            "max_bytes": self.max_bytes,
            "problems": len(self.problems),
            "disk_full": self.disk.failing,
            "disk_write_failures": self.disk.failures,
            **self.log.status(),  # I/O errors in commits, and the recoveries from them (node/seglog.py)
            "record_ids": len(self.ids),
            "record_id_window": self.ids.window,
            "record_ids_forgotten": self.ids.forgotten,
            "repeated_total": self.repeated_total,
        }

    async def aclose(self) -> None:
        await self.log.aclose()
        async with self._ack_lock:
            os.close(self._acks_fd)
            os.close(self._ids_fd)
        self._lock.release()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
