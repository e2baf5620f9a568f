"""Trajectory storage: record formats and framing (hypothesis), the node spool and
the origin store on real files, readers in other processes, kill -9 recovery."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.node.spool import TrajectorySpool
from patchswarm.node.trainer.trajstore import SegmentLog, TrajectoryReader, TrajectoryStore, list_segments, segment_path
from patchswarm.protocol.errors import CorruptData, ProtocolError, SpoolFull, StorageFailed, UnsupportedFormat, UsageError
from patchswarm.protocol.trajectory import (MAX_BATCH_BYTES, MAX_ID_CHARS, MAX_META_BYTES, SEGMENT_HEADER_BYTES,
                                 DuplicatesNote, ReceivedRecord, Record, SeqRanges, bin_header, decode_batch,
                                 check_segment_header, decode_payload, decode_record, encode_batch, encode_entry, encode_payload, encode_record,
                                 scan_records, scan_segment, seq_ranges, segment_header)

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# ================================================================ strategies

ids = st.text(min_size=1, max_size=12)
meta_values = st.integers(-2**63, 2**63 - 1) | st.text(max_size=8) | st.binary(max_size=8) | st.booleans()
meta_keys = st.text(max_size=6) | st.integers(-2**63, 2**63 - 1)
metas = st.none() | st.dictionaries(meta_keys, st.recursive(
    meta_values, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(meta_keys, inner, max_size=3),
    max_leaves=6), max_size=4)
u64 = st.integers(0, 2**64 - 1)
times = st.floats(allow_nan=False)
records = st.builds(Record, node_id=ids, region=ids, seq=u64, policy_version=u64, submitted_at=times,
                    payload=st.binary(max_size=300), meta=metas)
received = st.builds(lambda r, t: r.received(t), records, times)
any_values = records | received | st.builds(DuplicatesNote, st.integers(0, 2**64 - 1))


BATCH_HEADER_BYTES = 14  # magic, version, flags, raw length, crc32


def segment_of(values) -> tuple[bytes, list[tuple[int, int]]]:
    """Segment bytes and each entry's (offset, end)."""
    out, spans = bytearray(segment_header()), []
    for v in values:
        e = encode_entry(encode_record(v))
        spans.append((len(out), len(out) + len(e)))
        out += e
    return bytes(out), spans


def rec(seq, payload=b"x", node="n1", version=1, meta=None):
    return Record(node, "r1", seq, version, 1.5, payload, meta)


# ================================================================ protocol: bodies, framing, batches


@given(any_values)
def test_record_body_round_trips(v):
    assert decode_record(encode_record(v)) == v


@given(st.lists(any_values, max_size=8))
def test_segment_round_trips(values):
    data, spans = segment_of(values)
    scan = scan_records(data)
    assert [v for _, v in scan.entries] == values
    assert [(e.offset, e.end) for e, _ in scan.entries] == spans
    assert scan.good_end == len(data) and scan.problems == []


@given(st.lists(any_values, min_size=1, max_size=6), st.data())
def test_any_truncation_yields_a_prefix(values, data):
    seg, spans = segment_of(values)
    cut = data.draw(st.integers(0, len(seg)))
    scan = scan_records(seg[:cut])
    whole = [i for i, (_, end) in enumerate(spans) if end <= cut]
    assert [v for _, v in scan.entries] == values[:len(whole)]
    if cut < SEGMENT_HEADER_BYTES:
        assert scan.good_end == 0 and len(scan.problems) == 1 and scan.problems[0].tail
    else:
        assert scan.good_end == (spans[whole[-1]][1] if whole else SEGMENT_HEADER_BYTES)
        at_boundary = cut == scan.good_end
        assert len(scan.problems) == (0 if at_boundary else 1)
        if not at_boundary:
            assert scan.problems[0].tail and scan.problems[0].offset == scan.good_end


@settings(max_examples=300)
@given(st.lists(any_values, min_size=1, max_size=6), st.data())
def test_a_flipped_byte_costs_at_most_the_entry_it_hits(values, data):
    seg, spans = segment_of(values)
    pos = data.draw(st.integers(0, len(seg) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(seg)
    bad[pos] ^= flip
    scan = scan_records(bytes(bad))
    hit = [i for i, (a, b) in enumerate(spans) if a <= pos < b]
    expected = [i for i in range(len(values)) if i not in hit]
    assert [(e.offset, e.end) for e, _ in scan.entries] == [spans[i] for i in expected]
    assert [v for _, v in scan.entries] == [values[i] for i in expected]
    [p] = scan.problems  # damage is always reported, once
    if not hit:
        assert p.kind == "bad_header"
    else:
        assert p.offset == spans[hit[0]][0]
        assert p.tail == (hit[0] == len(values) - 1)


def test_damage_in_a_length_field_resyncs_at_the_next_entry():
    values = [rec(i, bytes([i]) * 50) for i in range(5)]
    seg, spans = segment_of(values)
    bad = bytearray(seg)
    bad[spans[1][0] + 5] ^= 0x40  # length of entry 1 now points far past the data
    scan = scan_records(bytes(bad))
    assert [v.seq for _, v in scan.entries] == [0, 2, 3, 4]
    [p] = scan.problems
    assert (p.kind, p.offset, p.end, p.tail) == ("corrupt", spans[1][0], spans[2][0], False)


def test_a_torn_tail_says_how_far_its_entry_runs_past_the_end():
    seg, spans = segment_of([rec(0, b"a" * 50), rec(1, b"b" * 50)])
    scan = scan_records(seg[:-3])
    assert [v.seq for _, v in scan.entries] == [0]
    [p] = scan.problems
    assert (p.kind, p.offset, p.tail) == ("torn", spans[1][0], True)
    assert p.detail.endswith("runs 3 bytes past the end")


def test_the_framing_carries_bodies_of_one_byte_and_refuses_empty_ones():
    scan = scan_segment(segment_header() + encode_entry(b"\x07") + encode_entry(b"\x90"))
    assert [bytes(e.body) for e in scan.entries] == [b"\x07", b"\x90"] and scan.problems == []
    with pytest.raises(UsageError, match="found 0"):
        encode_entry(b"")


def test_future_segment_version_is_refused_not_repaired():
    import zlib
    head = b"PSTRJSEG" + (2).to_bytes(4, "little")
    with pytest.raises(UnsupportedFormat, match="expected version 1, found 2"):
        scan_segment(head + zlib.crc32(head).to_bytes(4, "little"))


@given(st.binary(max_size=200))
def test_scanner_never_raises_on_random_bytes(data):
    for d in (data, segment_header() + data):
        scan = scan_records(d)
        assert scan.good_end <= len(d)


@given(st.lists(records, max_size=20))
def test_batch_round_trips(recs):
    assert decode_batch(encode_batch(recs)) == recs


def test_batch_of_received_records_carries_plain_records():
    r = rec(3).received(9.0)
    assert decode_batch(encode_batch([r])) == [rec(3)]


@given(st.binary(max_size=300))
def test_random_bytes_are_corrupt_batches(data):
    with pytest.raises((CorruptData, ProtocolError)):
        decode_batch(data)


@given(st.lists(records, min_size=1, max_size=5), st.data())
def test_damaged_batches_raise_invalid_input_or_decode_unchanged(recs, data):
    good = bytearray(encode_batch(recs))
    # the header or the body (left to itself, hypothesis damages mostly the first bytes)
    lo = data.draw(st.sampled_from([0, BATCH_HEADER_BYTES]))
    for _ in range(data.draw(st.integers(1, 3))):
        good[data.draw(st.integers(lo, len(good) - 1))] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.just(len(good)) | st.integers(0, len(good)))
    try:
        got = decode_batch(bytes(good[:cut]))
    except (CorruptData, ProtocolError, UnsupportedFormat):
        return
    # damage either raises or changed nothing the records say (an lz4 match whose offset now
    # points at equal bytes); it never decodes to different records
    assert got == recs


@pytest.mark.parametrize("payload", [b"incompressible \x8f\x01\xfe", b"squeezable " * 40])
def test_a_changed_payload_byte_is_caught_by_the_batch_checksum(payload):
    """msgpack parses the changed batch fine; only the CRC over the raw bytes can tell."""
    good = encode_batch([rec(1, payload)])
    at = good.index(payload[:10]) + 3  # in the payload (as an lz4 literal when compressed)
    bad = good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1:]
    with pytest.raises(CorruptData, match="checksum"):
        decode_batch(bad)


def test_batch_limits_and_bomb_header():
    with pytest.raises(UsageError, match="expected at most"):
        encode_batch([rec(i, b"\0" * (1 << 20)) for i in range(13)])
    good = encode_batch([rec(1)])
    bomb = good[:6] + (MAX_BATCH_BYTES + 1).to_bytes(4, "little") + good[10:]
    with pytest.raises(CorruptData, match="raw bytes"):
        decode_batch(bomb)


def test_a_batch_of_max_batch_bytes_round_trips_and_one_byte_more_is_refused():
    def batch(size):  # two records, the second with a payload of `size` bytes
        return [rec(0, b"\0" * (MAX_BATCH_BYTES // 2)), rec(1, b"\0" * size)]

    def raw_bytes(recs):  # the array header (one byte for two), then each record's body
        return 1 + sum(len(encode_record(r)) for r in recs)

    probe = 1 << 20  # as large as the answer: the same bin header size
    size = MAX_BATCH_BYTES - (raw_bytes(batch(probe)) - probe)
    assert raw_bytes(batch(size)) == MAX_BATCH_BYTES
    assert decode_batch(encode_batch(batch(size))) == batch(size)
    with pytest.raises(UsageError, match=f"expected at most {MAX_BATCH_BYTES} bytes, found {MAX_BATCH_BYTES + 1}"):
        encode_batch(batch(size + 1))


@pytest.mark.parametrize("received", [False, True])
def test_meta_is_bounded_by_its_packed_size_alike_at_encode_and_decode(received):
    def record(packed):  # {"m": bin16}: a fixmap byte, the key's two, the bin header's three
        r = rec(1, meta={"m": bytes(packed - 6)})
        return r.received(2.0) if received else r

    assert decode_record(encode_record(record(MAX_META_BYTES))) == record(MAX_META_BYTES)
    with pytest.raises(UsageError, match=f"at most {MAX_META_BYTES} packed bytes, found {MAX_META_BYTES + 1}$"):
        encode_record(record(MAX_META_BYTES + 1))
    if not received:  # a batch the origin would refuse whole must not be made
        with pytest.raises(UsageError, match="packed bytes"):
            encode_batch([record(MAX_META_BYTES + 1)])


def test_ids_of_the_longest_utf8_round_trip():
    r = Record("\U0001F600" * MAX_ID_CHARS, "\u00e9" * MAX_ID_CHARS, 1, 1, 0.0, b"", None)
    assert decode_record(encode_record(r)) == r


@pytest.mark.parametrize("n", [0, 255, 256, 65535, 65536, 1 << 20])
def test_bin_header_is_msgpacks_own(n):
    header = bin_header(n)
    assert msgpack.packb(bytes(n), use_bin_type=True) == header + bytes(n)


def test_compressible_batches_shrink():
    recs = [rec(i, b"observation " * 80) for i in range(200)]
    assert len(encode_batch(recs)) < sum(len(r.payload) for r in recs) / 5


def test_payload_rule_round_trips_objects_and_passes_bytes():
    assert encode_payload(b"raw", {"k": 1}) == (b"raw", {"k": 1})
    obj = {"obs": [1, 2, 3], "reward": 0.5, "text": "hi"}
    payload, meta = encode_payload(obj, {"episode": 7})
    assert meta == {"episode": 7, "payload_format": "msgpack"} and msgpack.unpackb(payload) == obj
    assert Record("n", "r", 1, 1, 0.0, payload, meta).value() == obj
    assert decode_payload(b"raw", None) == b"raw"
    with pytest.raises(UsageError, match="reserved"):
        encode_payload(b"x", {"payload_format": "msgpack"})
    with pytest.raises(UsageError, match="msgpack-able"):
        encode_payload(object())


def test_invalid_records_are_refused_at_encode():
    with pytest.raises(UsageError, match="payload: expected bytes"):
        encode_record(Record("n", "r", 1, 1, 0.0, "text", None))
    with pytest.raises(UsageError, match="record.seq: expected a non-negative int below 2\\*\\*64, found int -1$"):
        encode_record(Record("n", "r", -1, 1, 0.0, b"", None))
    with pytest.raises(UsageError, match="msgpack-able"):
        encode_record(Record("n", "r", 1, 1, 0.0, b"", {"x": object()}))


@pytest.mark.parametrize("cut", range(SEGMENT_HEADER_BYTES))
def test_a_torn_segment_header_is_a_tail_from_offset_0(cut):
    p = check_segment_header(segment_header()[:cut])
    assert (p.kind, p.offset, p.end, p.tail) == ("torn", 0, cut, True)
    assert p.detail == f"a header of {cut} of {SEGMENT_HEADER_BYTES} bytes"


def test_a_long_bad_value_is_cut_in_the_message():
    long_id = "x" * (MAX_ID_CHARS + 1)
    with pytest.raises(UsageError, match=re.escape(f"found str {repr(long_id)[:57]}...") + "$"):
        encode_record(Record(long_id, "r", 1, 1, 0.0, b"", None))


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(-1, 8))))
def test_seq_ranges_behave_like_a_set(ops):
    model, ranges = set(), SeqRanges()
    for a, k in ops:
        if k == 0:
            assert ranges.add(a) == (a not in model)
            model.add(a)
        elif k < 0:  # a write that failed after its seq was added (origin's full disk)
            assert ranges.discard(a) == (a in model)
            model.discard(a)
        else:
            assert ranges.add_range(a, a + k) == len(set(range(a, a + k)) - model)
            model.update(range(a, a + k))
    assert len(ranges) == len(model)
    assert all((x in ranges) == (x in model) for x in range(-1, 215))
    rs = ranges.ranges()
    assert all(rs[i][1] < rs[i + 1][0] for i in range(len(rs) - 1))  # disjoint and not adjacent
    assert rs == seq_ranges(model)  # and no empty range left behind


@pytest.mark.parametrize("others, lone", [([], 0), ([], 5), ([(0, 2)], 9), ([(7, 9)], 3), ([], 1 << 40)])
def test_discarding_a_lone_seq_leaves_no_empty_range(others, lone):
    ranges = SeqRanges(others)
    assert ranges.add(lone) and ranges.discard(lone)
    assert ranges.ranges() == others and len(ranges) == sum(b - a for a, b in others)
    assert lone not in ranges and not ranges.discard(lone)


def test_seq_ranges_of_seqs_merge_runs():
    assert seq_ranges([7, 1, 2, 5, 6, 2]) == [(1, 3), (5, 8)]


def test_seq_ranges_start_from_given_ranges_and_refuse_bad_ones():
    ranges = SeqRanges([(5, 7), (0, 3), (3, 4)])
    assert ranges.ranges() == [(0, 4), (5, 7)] and len(ranges) == 6
    for a, b in [(5, 3), (-1, 2), (1.0, 2)]:
        with pytest.raises(UsageError, match="expected 0 <= a <= b ints"):
            ranges.add_range(a, b)
    with pytest.raises(UsageError):
        SeqRanges([(2, 1)])


# ================================================================ spool


def run(fn, *args, limit=60):
    async def main():
        with trio.fail_after(limit):
            return await fn(*args)
    return trio.run(main)


async def drain(sp, batch=50):
    out = []
    while True:
        got = sp.pending(batch)
        if not got:
            return out
        out.extend(got)


def test_concurrent_appenders_share_fsyncs(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        seqs = {}

        async def submit(i):
            [seqs[i]] = await sp.append([(b"p%d" % i, 7, {"i": i})], timeout=5)

        async with trio.open_nursery() as n:
            for i in range(64):
                n.start_soon(submit, i)
        stats = sp.stats()
        got = await drain(sp)
        await sp.aclose()
        return seqs, stats, got

    seqs, stats, got = run(main)
    first = min(seqs.values())
    assert sorted(seqs.values()) == list(range(first, first + 64))
    assert stats["records"] == 64 and stats["appended_total"] == 64
    assert stats["fsyncs"] <= 4, f"64 concurrent appends took {stats['fsyncs']} fsyncs"
    assert {r.seq: (r.payload, r.meta) for r in got} == {s: (b"p%d" % i, {"i": i}) for i, s in seqs.items()}
    assert [r.seq for r in got] == sorted(r.seq for r in got)


def test_segment_log_reports_each_round_once_in_file_order(tmp_path):
    rounds = []

    async def main():
        log = SegmentLog(tmp_path, 1, 1 << 20, 1 << 20, lambda number, landed: rounds.append((number, landed)))

        async def commit(i):
            await log.commit([b"body %d" % i] * (1 + i % 3), i)

        async with trio.open_nursery() as n:
            for i in range(40):
                n.start_soon(commit, i)
        await log.aclose()
        return log.fsyncs

    fsyncs = run(main)
    assert len(rounds) == fsyncs < 40  # one call per round; rounds were shared
    landed = [m for _, ms in rounds for m in ms]
    assert sorted(tag for tag, _, _ in landed) == list(range(40))
    data = segment_path(tmp_path, 1).read_bytes()
    entries = [(e.offset, e.end - e.offset, bytes(e.body)) for e in scan_segment(data).entries]
    assert [(o, size, b"body %d" % tag) for tag, offsets, sizes in landed for o, size in zip(offsets, sizes)] == entries


def test_restart_resumes_seqs_and_pending_and_acked_never_return(tmp_path):
    async def first():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=300)
        seqs = await sp.append([(b"rec%d" % i, 1) for i in range(10)], timeout=5)
        batch = sp.pending(4)
        assert [r.seq for r in batch] == seqs[:4]
        assert await sp.ack([r.seq for r in batch]) == 4
        assert await sp.ack([r.seq for r in batch]) == 0  # repeated acks are harmless
        await sp.aclose()
        return seqs

    async def second(seqs):
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=300)
        got = await drain(sp)
        assert [r.seq for r in got] == seqs[4:]
        assert [r.payload for r in got] == [b"rec%d" % i for i in range(4, 10)]
        [new] = await sp.append([(b"new", 2)], timeout=5)
        assert new > max(seqs)
        await sp.ack([r.seq for r in got] + [new])  # everything acknowledged: segments go
        stats = sp.stats()
        await sp.aclose()
        return new, stats

    async def third(before):
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=300)
        assert await drain(sp) == []
        [s] = await sp.append([(b"again", 3)], timeout=5)
        await sp.aclose()
        return s

    seqs = run(first)
    new, stats = run(second, seqs)
    assert stats["records"] == 0 and stats["bytes"] == 0
    assert run(third, new) > new  # no reuse even though every segment was deleted
    assert len(list_segments(tmp_path)) <= 1


def test_requeue_hands_out_in_flight_records_again(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        await sp.append([(b"a", 1), (b"b", 1), (b"c", 1)], timeout=5)
        first = sp.pending(2)
        assert sp.stats()["in_flight"] == 2
        await sp.ack([first[0].seq])
        assert [r.payload for r in sp.pending()] == [b"c"]
        sp.requeue()
        again = sp.pending()
        await sp.aclose()
        return again

    assert [r.payload for r in run(main)] == [b"b", b"c"]


def test_wait_pending_wakes_on_append(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        got = []

        async def uploader():
            await sp.wait_pending()
            got.extend(sp.pending())

        async with trio.open_nursery() as n:
            n.start_soon(uploader)
            await trio.sleep(0.05)
            assert not got
            await sp.append([(b"x", 1)], timeout=5)
        await sp.aclose()
        return got

    assert [r.payload for r in run(main)] == [b"x"]


def test_full_spool_waits_then_fails_clearly_and_drops_nothing(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", max_bytes=4000)
        first = await sp.append([(bytes(900), 1) for _ in range(4)], timeout=1)
        t0 = trio.current_time()
        with pytest.raises(SpoolFull, match=r"expected room for \d+ bytes within 0.2 s, found it full") as e:
            await sp.append([(bytes(900), 1)], timeout=0.2)
        waited = trio.current_time() - t0
        assert sp.stats()["records"] == 4
        # a waiting append succeeds as soon as an ack makes room
        result = []

        async def late():
            result.extend(await sp.append([(b"late" + bytes(500), 1)], timeout=5))

        async with trio.open_nursery() as n:
            n.start_soon(late)
            await trio.sleep(0.1)
            assert not result
            await sp.ack(first[:1])
        got = await drain(sp)
        await sp.aclose()
        return str(e.value), waited, first, result, got

    msg, waited, first, late, got = run(main)
    assert waited >= 0.2 and "nothing was written" in msg
    assert [r.seq for r in got] == first[1:] + late
    with pytest.raises(UsageError, match="could never fit"):
        async def huge():
            sp = await TrajectorySpool.open(tmp_path / "other", "n1", "r1", max_bytes=1000)
            try:
                await sp.append([(bytes(2000), 1)], timeout=1)
            finally:
                await sp.aclose()
        run(huge)


@pytest.mark.parametrize("damage", [b"", b"\xff\x00 not a state", None])
def test_a_drained_spool_whose_state_file_is_lost_never_reuses_a_seq(tmp_path, damage, caplog):
    """The defect: with every segment acknowledged and deleted, `state` is the only record of
    the seqs handed out; truncated, garbage or missing, the spool started again at seq 0, and
    the origin dropped the new records as duplicates of ones it had stored (acknowledged to the
    worker, then lost). Now a spool that was used before resumes above the clock's microseconds,
    with one warning."""
    async def used():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", clock=lambda: 1_000.0)
        seqs = await sp.append([(b"rec%d" % i, 1) for i in range(5)], timeout=5)
        await sp.ack([r.seq for r in sp.pending()])
        await sp.aclose()
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")  # a restart: the acknowledged segment goes
        await sp.aclose()
        return seqs

    async def after():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", clock=lambda: 2_000.0)
        [s] = await sp.append([(b"new", 2)], timeout=5)
        await sp.aclose()
        return s

    seqs = run(used)
    assert list_segments(tmp_path) == []
    if damage is None:
        (tmp_path / "state").unlink()
    else:
        (tmp_path / "state").write_bytes(damage)
    new = run(after)
    assert new > max(seqs) and new >= 2_000 * 10**6, new
    warned = [r.getMessage() for r in caplog.records if "no readable state" in r.getMessage()]
    assert len(warned) == 1 and str(new) in warned[0], warned
    # The damage itself is in `problems`, which the daemon logs once each: the spool does
    # not log it a second time (before: two lines per problem, three for this one).
    assert not [r for r in caplog.records if r.name == "patchswarm.spool" and "no readable state" not in r.getMessage()]

    caplog.clear()

    async def fresh():  # a new spool starts at the clock too, with no warning (see below)
        sp = await TrajectorySpool.open(tmp_path / "new", "n1", "r1", clock=lambda: 3_000.0)
        [s] = await sp.append([(b"first", 0)], timeout=5)
        await sp.aclose()
        return s

    assert run(fresh) == 3_000 * 10**6 and not [r for r in caplog.records if "no readable state" in r.getMessage()]


def test_a_new_spool_never_hands_out_a_seq_an_earlier_spool_of_its_node_id_did(tmp_path):
    """A node whose data dir was wiped, or a new host given a reclaimed one's identity, starts a
    new spool under the same node id. It started at seq 0, and the origin, which dedups by
    (node id, seq), dropped its records as duplicates of the earlier spool's: acknowledged to
    the worker, stored nowhere (bench/spot_reclaim.py: 43-49 % of the acked records). A new
    spool starts at the clock's microseconds, above any seq the earlier one handed out."""
    times = iter([1_000.0, 1_000.0, 1_060.0])  # the wiped node is back a minute later

    async def incarnation(d):
        sp = await TrajectorySpool.open(d, "n1", "r1", clock=lambda: next(times, 1_060.0))
        seqs = await sp.append([(b"rec%d" % i, 1) for i in range(1000)], timeout=5)
        await sp.aclose()
        return seqs

    before = run(lambda: incarnation(tmp_path / "first"))
    after = run(lambda: incarnation(tmp_path / "wiped"))
    assert min(after) > max(before), (max(before), min(after))


@pytest.mark.parametrize("name", ["000000000001.seg", "state", "acks"])
def test_a_spool_file_of_a_newer_format_is_refused_by_name(tmp_path, name):
    """Before: `segment format: expected version 1, found 2`, and which of the spool's files
    said so was left for the operator to find."""
    import zlib

    async def used():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        await sp.append([(b"rec", 1)], timeout=5)
        await sp.aclose()

    run(used)
    head = b"PSTRJSEG" + (2).to_bytes(4, "little")
    path = tmp_path / name
    path.write_bytes(head + zlib.crc32(head).to_bytes(4, "little") + path.read_bytes()[16:])

    async def reopen():
        await TrajectorySpool.open(tmp_path, "n1", "r1")

    with pytest.raises(UnsupportedFormat, match=f"{path}: segment format: expected version 1, found 2"):
        run(reopen)
    assert path.read_bytes().startswith(head), "refused, not repaired"


def test_spool_refuses_another_node_and_a_second_writer(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        with pytest.raises(UsageError, match="held by another writer"):
            await TrajectorySpool.open(tmp_path, "n1", "r1")
        await sp.aclose()
        with pytest.raises(UsageError, match="found the spool of node 'n1'"):
            await TrajectorySpool.open(tmp_path, "n2", "r1")

    run(main)


def test_spool_torn_tail_is_truncated_and_intact_records_kept(tmp_path):
    async def write():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        seqs = await sp.append([(b"r%d" % i, 1) for i in range(5)], timeout=5)
        await sp.aclose()
        return seqs

    seqs = run(write)
    [n] = list_segments(tmp_path)
    path = segment_path(tmp_path, n)
    size = path.stat().st_size
    with open(path, "ab") as f:  # a crash in the middle of the next write
        f.write(encode_entry(encode_record(rec(99, b"z" * 100)))[:60])

    async def reopen():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        problems = list(sp.problems)
        got = await drain(sp)
        await sp.aclose()
        return problems, got

    problems, got = run(reopen)
    assert [r.seq for r in got] == seqs
    assert len(problems) == 1 and problems[0].problem.tail and problems[0].problem.offset == size
    assert path.stat().st_size == size
    assert run(reopen)[0] == []  # repaired: nothing to report the second time


def test_spool_corrupt_middle_segment_is_reported_and_neighbours_survive(tmp_path):
    async def write():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=500)
        seqs = []
        for i in range(12):
            seqs += await sp.append([(b"%03d" % i + bytes(100), 1)], timeout=5)
        await sp.aclose()
        return seqs

    seqs = run(write)
    numbers = list_segments(tmp_path)
    assert len(numbers) >= 3
    middle = segment_path(tmp_path, numbers[1])
    data = bytearray(middle.read_bytes())
    entries = scan_segment(bytes(data)).entries
    victim = entries[0]
    lost = decode_record(victim.body).seq
    data[victim.offset + 30] ^= 0xFF
    middle.write_bytes(bytes(data))

    async def reopen():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=500)
        got = await drain(sp)
        problems = list(sp.problems)
        await sp.aclose()
        return got, problems

    got, problems = run(reopen)
    assert [r.seq for r in got] == [s for s in seqs if s != lost]
    assert len(problems) == 1 and problems[0].path == str(middle) and problems[0].problem.kind == "corrupt"


SPOOL_CHILD = r"""
import random, sys, trio
from patchswarm.node.spool import TrajectorySpool

random.seed(int(sys.argv[2]))

async def main():
    sp = await TrajectorySpool.open(sys.argv[1], "n1", "r1", max_bytes=1 << 22, segment_bytes=1 << 14)
    print("OPEN", flush=True)

    async def writer(w):
        for i in range(10**9):
            items = [(b"%d:%d:%d" % (w, i, k) + bytes(random.randrange(300)), i, None) for k in range(random.randrange(1, 4))]
            seqs = await sp.append(items, timeout=30)
            for s, (p, _, _) in zip(seqs, items):
                print("A", s, p.split(b"\0")[0].decode(), flush=True)

    async def acker():
        while True:
            await sp.wait_pending()
            half = sp.pending(max_records=9)[::2]
            for r in half:
                print("T", r.seq, flush=True)  # about to ack: it may vanish from now on
            await sp.ack([r.seq for r in half])
            for r in half:
                print("K", r.seq, flush=True)
            await trio.sleep(0.002)

    async with trio.open_nursery() as n:
        for w in range(8):
            n.start_soon(writer, w)
        n.start_soon(acker)

trio.run(main)
"""


def process_seed(test: str) -> int:
    """The seed of a randomized process test: from PATCHSWARM_TEST_SEED if set, else a fresh
    one; printed, so a failure's captured output says how to replay the test's choices (kill
    times, payload sizes, resends; the processes' scheduling is not replayable)."""
    seed = int(os.environ.get("PATCHSWARM_TEST_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"{test}: seed {seed} (PATCHSWARM_TEST_SEED={seed} replays it)", flush=True)
    return seed


def _run_and_kill(script: Path, args, out: Path, seconds: float) -> list[list[str]]:
    with open(out, "w") as f:
        p = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=f, env=ENV, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while "OPEN" not in out.read_text():
            assert p.poll() is None, f"child exited with {p.returncode}"
            assert time.monotonic() < deadline, "child did not open its files"
            time.sleep(0.02)
        time.sleep(seconds)
        assert p.poll() is None, f"child exited with {p.returncode}"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    complete = out.read_text().split("\n")[:-1]  # the kill may cut the last line: drop it
    return [line.split() for line in complete[1:]]


@pytest.mark.slow
def test_sigkill_spool_keeps_every_acknowledged_record_exactly_once(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SPOOL_CHILD)
    spool_dir = tmp_path / "spool"
    rng = random.Random(process_seed("sigkill spool"))
    appended, acking, acked, last_seq = {}, set(), set(), -1
    for round_ in range(3):
        lines = _run_and_kill(script, [spool_dir, rng.randrange(1 << 32)], tmp_path / f"out{round_}",
                              rng.uniform(0.3, 1.2))
        for fields in lines:
            if len(fields) == 3 and fields[0] == "A":
                appended[int(fields[1])] = fields[2]
            elif len(fields) == 2 and fields[0] == "K":
                acked.add(int(fields[1]))
            elif len(fields) == 2 and fields[0] == "T":
                acking.add(int(fields[1]))
        assert appended, "the child acknowledged nothing before the kill"

        async def check():
            sp = await TrajectorySpool.open(spool_dir, "n1", "r1", max_bytes=1 << 22, segment_bytes=1 << 14)
            got = await drain(sp, 500)
            # Ack what survived, as the uploader would once the origin has it: the child acks
            # only half of what it writes, so without this a fast machine fills the spool to
            # max_bytes in three rounds and the fresh append below has no room.
            await sp.ack([r.seq for r in got])
            [fresh] = await sp.append([(b"fresh%d\0" % round_, 0)], timeout=5)
            await sp.aclose()
            return got, fresh

        got, fresh = run(check)
        seqs = [r.seq for r in got]
        assert len(seqs) == len(set(seqs)), "a record is pending twice"
        by_seq = {r.seq: r.payload.split(b"\0")[0].decode() for r in got}
        missing = set(appended) - acking - set(by_seq)
        assert not missing, f"acknowledged appends lost after kill -9: {sorted(missing)[:10]}"
        assert all(by_seq[s] == appended[s] for s in set(appended) - acking)
        assert not acked & set(by_seq), "an acknowledged record came back"
        assert fresh > max([last_seq, *appended, *by_seq]), "a seq was reused after restart"
        last_seq = fresh
        acking |= set(by_seq)
        acked |= set(by_seq)
        appended[fresh] = f"fresh{round_}"


# ================================================================ store


def test_store_dedups_and_counts_duplicates_durably(tmp_path):
    recs = [rec(i, b"p%d" % i, node=f"n{i % 2}") for i in range(10)]

    async def main():
        st = await TrajectoryStore.open(tmp_path)
        assert await st.append(recs) == [r.seq for r in recs]
        assert await st.append(recs[:6] + [rec(100)]) == [r.seq for r in recs[:6]] + [100]
        assert await st.append([rec(200), rec(200)]) == [200, 200]  # a duplicate inside one batch
        summary = st.summary()
        await st.aclose()
        st = await TrajectoryStore.open(tmp_path)
        again = st.summary()
        got = list(st.iter_records())
        await st.aclose()
        return summary, again, got

    summary, again, got = run(main)
    assert summary["records"] == 12 and summary["duplicates_dropped"] == 7
    assert summary["by_node"] == {"n0": 5, "n1": 7}
    for k in ("records", "duplicates_dropped", "by_node", "by_version"):
        assert again[k] == summary[k]
    assert sorted((r.node_id, r.seq) for r in got) == sorted({(r.node_id, r.seq) for r in recs + [rec(100), rec(200)]})
    assert all(isinstance(r, ReceivedRecord) and r.received_at > 0 for r in got)
    assert TrajectoryReader(tmp_path).summary()["duplicates_dropped"] == 7


def test_a_node_whose_seqs_leave_too_many_gaps_is_refused_before_its_index_costs_the_origin(tmp_path, monkeypatch):
    """Before: every gap in a node's seqs was a range in its dedup index, without bound,
    and a new seq below the others is a list insert that moves every range after it: a
    member that stored 800,000 records two apart, then sent 65,536 seqs below them,
    stalled the origin's event loop 32 s per batch (measured; quadratic). Now a batch
    that would leave a node more than MAX_SEQ_RANGES_PER_NODE ranges is refused
    whole (BudgetExceeded, the index as before it), and everything else still goes in."""
    from patchswarm.node.trainer import trajstore
    from patchswarm.protocol.errors import BudgetExceeded

    monkeypatch.setattr(trajstore, "MAX_SEQ_RANGES_PER_NODE", 8)

    async def main():
        st = await TrajectoryStore.open(tmp_path)
        assert await st.append([rec(2 * i) for i in range(7)]) == [2 * i for i in range(7)]  # 7 ranges
        assert await st.append([rec(100 + i) for i in range(50)])  # one more, dense: 8
        with pytest.raises(BudgetExceeded, match="n1.*ranges") as e:
            await st.append([rec(1), rec(500), rec(1000)])  # 1 joins two ranges (7); 500, 1000 make 9
        assert e.value.budget == "seq ranges per node"
        assert await st.append([rec(1), rec(3), rec(150), rec(150)]) == [1, 3, 150, 150]  # joins, a duplicate
        assert await st.append([rec(1000, node="n2")])  # other nodes are not held to n1's gaps
        monkeypatch.setattr(trajstore, "MAX_SEQ_RANGES_PER_NODE", 2)  # n1 holds 6: more than allowed now
        assert await st.append([rec(150 + i) for i in range(10)])  # seqs that add no range still go in
        with pytest.raises(BudgetExceeded):
            await st.append([rec(3000)])
        got = sorted((r.node_id, r.seq) for r in st.iter_records())
        await st.aclose()
        return got

    got = run(main)
    assert ("n1", 500) not in got and ("n1", 1000) not in got and ("n1", 1) in got and ("n2", 1000) in got


def test_a_reopened_store_drops_seqs_it_stored_before_the_restart(tmp_path):
    """A node resends what the origin stored but never acknowledged (it restarted): the
    dedup index is rebuilt from the segments on open, so nothing is stored twice."""
    before = [rec(i, b"p%d" % i, node=f"n{i % 2}") for i in range(6)]

    async def main():
        st = await TrajectoryStore.open(tmp_path, segment_bytes=200)  # several segments
        await st.append(before)
        await st.aclose()
        st = await TrajectoryStore.open(tmp_path)
        assert await st.append(before[2:] + [rec(7, b"p7", node="n1")]) == [2, 3, 4, 5, 7]
        summary = st.summary()
        got = [(r.node_id, r.seq) for r in st.iter_records()]
        await st.aclose()
        return summary, got

    summary, got = run(main)
    assert sorted(got) == sorted({(r.node_id, r.seq) for r in before} | {("n1", 7)})
    assert summary["records"] == 7 and summary["duplicates_dropped"] == 4


def test_concurrent_store_appends_share_fsyncs_and_dedup_across_callers(tmp_path):
    async def main():
        st = await TrajectoryStore.open(tmp_path)
        batch = [rec(i) for i in range(50)]

        async def send(b):
            assert await st.append(b) == [r.seq for r in b]

        async with trio.open_nursery() as n:
            for k in range(20):
                n.start_soon(send, batch if k % 2 else [rec(1000 + k)])
        s = st.summary()
        await st.aclose()
        return s

    s = run(main)
    assert s["records"] == 60 and s["duplicates_dropped"] == 450
    assert s["fsyncs"] <= 5


def test_store_torn_tail_and_corrupt_middle(tmp_path):
    async def write():
        st = await TrajectoryStore.open(tmp_path, segment_bytes=400)
        for i in range(12):
            await st.append([rec(i, bytes(100))])
        await st.aclose()

    run(write)
    numbers = list_segments(tmp_path)
    assert len(numbers) >= 3
    last = segment_path(tmp_path, numbers[-1])
    size = last.stat().st_size
    with open(last, "ab") as f:
        f.write(encode_entry(encode_record(rec(99).received(1.0)))[:-3])
    middle = segment_path(tmp_path, numbers[1])
    data = bytearray(middle.read_bytes())
    victim = scan_segment(bytes(data)).entries[0]
    lost = decode_record(victim.body).seq
    data[victim.end - 5] ^= 1
    middle.write_bytes(bytes(data))

    reader_before = TrajectoryReader(tmp_path).summary()
    assert last.stat().st_size > size  # a reader truncates nothing

    async def reopen():
        st = await TrajectoryStore.open(tmp_path, segment_bytes=400)
        problems = [str(p) for p in st.problems]
        seqs = [r.seq for r in st.iter_records()]
        await st.append([rec(50)])
        summary = st.summary()
        await st.aclose()
        return problems, seqs, summary

    problems, seqs, summary = run(reopen)
    assert seqs == [i for i in range(12) if i != lost]
    assert len(problems) == 2 and "corrupt" in problems[0] and "at the tail" in problems[1]
    assert last.stat().st_size == size
    assert summary["records"] == 12 and len(summary["problems"]) == 2
    assert reader_before["records"] == 11 and len(reader_before["problems"]) == 1  # its tail: still being written?
    assert TrajectoryReader(tmp_path).summary()["records"] == 12


def test_a_small_read_decodes_about_what_it_returns(tmp_path, monkeypatch):
    """Before: every cursor read decoded every entry of the up to 16 MiB it had read and
    kept the few asked for: get_batch(1) over 1 KiB records cost 174 ms (measured), all on
    the origin's event loop, and a trainer taking small batches got ~6 of them a second.
    Now a read frames and decodes entries only up to the records still wanted (skipped
    stale ones and notes aside), and the next read goes on from the bytes it has."""
    from patchswarm.node.trainer import trajstore

    decoded = [0]
    real = trajstore.scan_records

    def counting(*args, **kw):
        scan = real(*args, **kw)
        decoded[0] += len(scan.entries)
        return scan

    monkeypatch.setattr(trajstore, "scan_records", counting)

    async def main():
        st = await TrajectoryStore.open(tmp_path)
        await st.append([rec(i, b"x" * 1024) for i in range(2000)])
        cur = st.cursor()
        got = [r.seq for _ in range(20) for r in cur.read(1)]
        one = decoded[0]
        rest = [r.seq for r in cur.read(5000)]
        stale = st.cursor(max_staleness=0)
        none = stale.read(10, current_version=5)
        await st.aclose()
        return got, one, rest, none, stale.stale

    got, one, rest, none, stale = run(main)
    assert got == list(range(20)) and rest == list(range(20, 2000))
    assert one <= 20 * 16  # at least 16 a read, for runs of stale records
    assert none == [] and stale == 2000  # a read past only stale records still goes to the end


def test_the_tally_of_versions_is_bounded_whatever_versions_records_claim(tmp_path, monkeypatch):
    """Before: the store's summary kept a count per distinct policy version, for every
    version any record claimed: a member sending each record with a version of its own
    (any of 2**64) grew the origin's memory by ~100 bytes per 40-byte record, and every
    status call sorted them all. Now at most MAX_TALLIED_VERSIONS versions are counted
    one by one (honest runs publish fewer); records of any further version are counted
    in `untallied_versions`, alike in the store and a reader, across a reopen."""
    from patchswarm.node.trainer import trajstore

    monkeypatch.setattr(trajstore, "MAX_TALLIED_VERSIONS", 3)

    async def main():
        st = await TrajectoryStore.open(tmp_path)
        await st.append([rec(i, version=v) for i, v in enumerate([1, 2, 2, 3, 2**64 - 1, 9, 1, 10**9])])
        live = st.summary()
        await st.aclose()
        st = await TrajectoryStore.open(tmp_path)
        again = st.summary()
        await st.aclose()
        return live, again

    live, again = run(main)
    for s in (live, again, TrajectoryReader(tmp_path).summary()):
        assert s["records"] == 8 and s["by_version"] == {1: 2, 2: 2, 3: 1} and s["untallied_versions"] == 3


def test_cursor_filters_count_skips_and_resume(tmp_path):
    async def main():
        st = await TrajectoryStore.open(tmp_path)
        await st.append([rec(i, version=v) for i, v in enumerate([1, 2, 3, 4, 5, 2, 5])])
        cur = st.cursor(min_version=2, max_staleness=2)
        got = cur.read(100, current_version=5)
        counts = (cur.below_min, cur.stale)
        pos = cur.position
        woke = []

        async def trainer():
            await st.wait_for_records(cur)
            woke.extend(cur.read(100, current_version=5))

        async with trio.open_nursery() as n:
            n.start_soon(trainer)
            await trio.sleep(0.05)
            assert not woke
            await st.append([rec(20, version=5)])
        resumed = [r.seq for r in st.cursor(pos).read(100)]
        summary = st.summary(current_version=5, max_staleness=2)
        await st.aclose()
        return got, counts, woke, resumed, summary

    got, counts, woke, resumed, summary = run(main)
    assert [r.policy_version for r in got] == [3, 4, 5, 5]
    assert counts == (1, 2)  # v1 below min; two v2 records older than the staleness bound
    assert [r.seq for r in woke] == [20] and resumed == [20]
    assert summary["stale"] == 3 and summary["by_version"] == {1: 1, 2: 2, 3: 1, 4: 1, 5: 3}


def test_records_of_a_version_not_yet_published_are_counted_not_fed_as_fresh(tmp_path):
    """Before: with max_staleness, a record claiming version 2**64-1 (or any above the
    origin's) passed the filter as the freshest of data (current - version < 0), for
    ever: a buggy or hostile submitter, or spooled records from before an origin's data
    dir was reset, fed the trainer as on-policy. Now they are skipped and counted in
    `ahead`, like stale ones; without max_staleness every record is still given."""
    async def main():
        st = await TrajectoryStore.open(tmp_path)
        await st.append([rec(i, version=v) for i, v in enumerate([5, 6, 2**64 - 1, 4, 3])])
        cur = st.cursor(max_staleness=1)
        got = [r.seq for r in cur.read(100, current_version=5)]
        every = [r.seq for r in st.cursor().read(100, current_version=5)]
        await st.aclose()
        return got, (cur.ahead, cur.stale), every

    got, counts, every = run(main)
    assert got == [0, 3] and counts == (2, 1) and every == [0, 1, 2, 3, 4]


READER = r"""
import io, json, sys
from patchswarm.node.trainer.trajstore import TrajectoryReader
r = TrajectoryReader(sys.argv[1])
out = io.StringIO()
n = r.dump_jsonl(out)
print(json.dumps({"summary": r.summary(current_version=3, max_staleness=1), "dumped": n, "first": out.getvalue().splitlines()[0]}))
"""


@pytest.mark.slow
def test_reader_process_sees_records_while_the_writer_holds_the_files(tmp_path):
    async def read_in_child():
        p = await trio.run_process([sys.executable, "-c", READER, str(tmp_path)], capture_stdout=True, env=ENV)
        return json.loads(p.stdout)

    async def main():
        st = await TrajectoryStore.open(tmp_path)
        await st.append([rec(i, b"payload%d" % i, node=f"n{i % 3}", version=i % 4) for i in range(30)])
        first = await read_in_child()
        sizes = {n: segment_path(tmp_path, n).stat().st_size for n in list_segments(tmp_path)}
        # the writer is mid-write: half an entry past the committed end
        last = segment_path(tmp_path, max(sizes))
        with open(last, "ab") as f:
            f.write(encode_entry(encode_record(rec(999).received(1.0)))[:25])
        torn = await read_in_child()
        assert last.stat().st_size == sizes[max(sizes)] + 25  # the reader truncated nothing
        await st.append([rec(i) for i in range(30, 35)])  # the writer carries on over it
        second = await read_in_child()
        await st.aclose()
        return first, torn, second

    first, torn, second = run(main)
    s = first["summary"]
    assert s["records"] == 30 and s["by_node"] == {"n0": 10, "n1": 10, "n2": 10}
    assert s["stale"] == 16  # versions 0 and 1 (8 records each) are more than 1 behind 3
    assert first["dumped"] == 30
    line = json.loads(first["first"])
    assert {"node_id", "seq", "policy_version", "payload_b64", "region", "submitted_at", "received_at"} <= set(line)
    assert (line["node_id"], line["seq"], line["payload_b64"]) == ("n0", 0, "cGF5bG9hZDA=")
    assert torn["summary"]["records"] == 30 and torn["summary"]["problems"] == []
    assert second["summary"]["records"] == 35


STORE_CHILD = r"""
import random, sys, trio
from patchswarm.node.trainer.trajstore import TrajectoryStore
from patchswarm.protocol.trajectory import Record

random.seed(int(sys.argv[3]))

async def main():
    st = await TrajectoryStore.open(sys.argv[1], segment_bytes=1 << 15)
    print("OPEN", flush=True)
    start = int(sys.argv[2])

    async def node(name):
        sent = []
        for seq in range(start, start + 10**9, 3):
            batch = [Record(name, "r1", s, 1, 0.0, b"%s/%d" % (name.encode(), s) + bytes(random.randrange(200)), None)
                     for s in range(seq, seq + 3)]
            if sent and random.random() < 0.3:
                batch += random.sample(sent, min(2, len(sent)))  # a resend after a lost ack
            for s in await st.append(batch):
                print("A", name, s, flush=True)
            sent += batch

    async with trio.open_nursery() as n:
        for k in range(4):
            n.start_soon(node, f"node{k}")

trio.run(main)
"""


@pytest.mark.slow
def test_sigkill_store_keeps_every_acknowledged_record_exactly_once(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(STORE_CHILD)
    store_dir = tmp_path / "store"
    rng = random.Random(process_seed("sigkill store"))
    acked = set()
    for round_ in range(3):
        # every round starts at seq 0: each restart sees seqs the store already holds (the
        # dedup index rebuilt from the segments), a fresh range too once it outruns the last
        lines = _run_and_kill(script, [store_dir, 0, rng.randrange(1 << 32)], tmp_path / f"out{round_}",
                              rng.uniform(0.3, 1.0))
        now = {(f[1], int(f[2])) for f in lines if len(f) == 3 and f[0] == "A"}
        assert now, "the child acknowledged nothing before the kill"
        assert round_ == 0 or now & acked, "no seq stored before the restart was sent again"
        acked |= now

        async def check():
            st = await TrajectoryStore.open(store_dir)
            got = [(r.node_id, r.seq, r.payload) for r in st.iter_records()]
            await st.aclose()
            return got

        got = run(check)
        keys = [(n, s) for n, s, _ in got]
        assert len(keys) == len(set(keys)), "a record is stored twice"
        assert acked <= set(keys), f"acknowledged records lost: {sorted(acked - set(keys))[:10]}"
        assert all(p.split(b"\0")[0] == b"%s/%d" % (n.encode(), s) for n, s, p in got)


def test_cancelled_appenders_never_stall_the_others(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        done, gave_up = {}, 0

        async def appender(i):
            nonlocal gave_up
            for k in range(20):
                with trio.move_on_after(0.0005 if i % 2 else 30) as scope:
                    [done[(i, k)]] = await sp.append([(b"%d/%d" % (i, k), 1)], timeout=30)
                gave_up += scope.cancelled_caught

        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(appender, i)
        got = await drain(sp, 1000)
        stats = sp.stats()
        await sp.aclose()
        return done, gave_up, got, stats

    done, gave_up, got, stats = run(main, limit=60)
    by_seq = {r.seq: r.payload for r in got}
    assert len(done) + gave_up == 16 * 20 and len([k for k in done if k[0] % 2 == 0]) == 8 * 20
    assert all(by_seq[s] == b"%d/%d" % k for k, s in done.items())  # acknowledged means stored
    assert stats["records"] == len(got) >= len(done)  # given-up ones may have landed, once


def test_a_failed_write_fails_its_append_and_the_store_takes_the_resend_without_a_reopen(tmp_path):
    """Before: one failed write broke the store until it was reopened (every append raised
    StorageFailed). Now the append fails, its seqs leave the dedup index, and the next append
    (the node's resend) is stored as new, in a new segment file."""
    async def main():
        st = await TrajectoryStore.open(tmp_path, segment_bytes=1)  # every commit starts a new file
        await st.append([rec(1)])
        in_the_way = segment_path(tmp_path, st.log.active + 1)
        in_the_way.write_bytes(b"in the way")  # the next file cannot be created (O_EXCL)
        with pytest.raises(StorageFailed, match="expected a durable write .* FileExistsError"):
            await st.append([rec(2)])
        assert in_the_way.read_bytes() == b"in the way"  # not the log's file: left alone
        in_the_way.unlink()
        assert await st.append([rec(2), rec(3)]) == [2, 3]  # no reopen; 2 is no duplicate: never durable
        summary = st.summary()
        await st.aclose()
        st = await TrajectoryStore.open(tmp_path)
        seqs = [r.seq for r in st.iter_records()]
        dups = st.summary()["duplicates_dropped"]
        await st.aclose()
        return summary, seqs, dups

    summary, seqs, dups = run(main)
    assert (seqs, dups) == ([1, 2, 3], 0)
    assert (summary["storage_failed"], summary["storage_failures"], summary["storage_recoveries"]) == (False, 1, 1)


def test_next_batch_waits_then_reads_in_a_worker_thread(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        got = []

        async def uploader():
            while len(got) < 5:
                got.extend(await sp.next_batch(max_records=2))

        async with trio.open_nursery() as n:
            n.start_soon(uploader)
            await trio.sleep(0.05)
            assert not got
            await sp.append([(b"%d" % i, 1) for i in range(5)], timeout=5)
        await sp.aclose()
        return got

    assert [r.payload for r in run(main)] == [b"0", b"1", b"2", b"3", b"4"]


def test_uploader_takes_the_newest_records_from_memory_and_older_ones_from_disk(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        seqs = await sp.append([(b"r0" + bytes(100), 1)], timeout=5)
        size = sp.stats()["bytes"]  # framed bytes of one record; all ten have the same size
        sp.hot_bytes = 3 * size  # memory keeps the newest three
        seqs += await sp.append([(b"r%d" % i + bytes(100), 1) for i in range(1, 10)], timeout=5)
        seen = [sp.pending_bytes()]
        old = await sp.next_batch(max_records=7)
        seen += [sp.read_from_disk, sp.pending_bytes()]
        new = await sp.next_batch()
        seen += [sp.read_from_disk, sp.pending_bytes()]
        await sp.ack(seqs[:5])  # written without fdatasync: still there after a reopen
        seen.append(sp.pending_bytes())
        sp.requeue()
        seen.append(sp.pending_bytes())
        await sp.aclose()
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        after = await drain(sp)
        await sp.aclose()
        return size, seqs, old, new, seen, after

    size, seqs, old, new, seen, after = run(main)
    assert [r.seq for r in old + new] == seqs
    assert [r.payload[:2] for r in old + new] == [b"r%d" % i for i in range(10)]
    assert seen == [10 * size, 7, 3 * size, 7, 0, 0, 5 * size]
    assert [r.seq for r in after] == seqs[5:]


def test_wait_pending_bytes_returns_once_enough_has_landed(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        await sp.append([(bytes(100), 1)], timeout=5)
        one = sp.pending_bytes()
        with trio.move_on_after(0.05) as waited:
            await sp.wait_pending_bytes(3 * one)  # only one record there: times out
        async with trio.open_nursery() as n:
            n.start_soon(sp.wait_pending_bytes, 3 * one)
            await trio.sleep(0.01)
            await sp.append([(bytes(100), 1), (bytes(100), 1)], timeout=5)  # now three: it returns
        await sp.aclose()
        return waited.cancelled_caught

    assert run(main) is True


def test_ack_log_compaction_keeps_acks_across_restarts(tmp_path, monkeypatch):
    import patchswarm.node.spool as spool_mod
    monkeypatch.setattr(spool_mod, "ACK_LOG_COMPACT_BYTES", 200)  # compact after a few acks

    async def main():
        # seqs from 0 (the clock at 0), so the byte counts below are those of small seqs
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", clock=lambda: 0.0)
        seqs = await sp.append([(b"%d" % i, 1) for i in range(60)], timeout=5)
        for k in range(0, 60, 3):  # acks in many small, gappy calls
            await sp.ack([seqs[k], seqs[k + 2]])
        size = (tmp_path / "acks").stat().st_size
        await sp.aclose()
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        got = await drain(sp)
        await sp.aclose()
        return seqs, got, size

    seqs, got, size = run(main)
    assert [r.seq for r in got] == seqs[1::3]
    assert size < 300  # rewritten along the way (436 bytes if it had only grown)


def test_bad_items_are_refused_before_anything_is_written(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        for items, match in [([(b"ok", 1), ("text", 1)], "payload: expected bytes"),
                             ([(b"ok", 1), (b"x", -1)], "policy_version"),
                             ([(b"ok", 1, {"x": object()})], "msgpack-able"),
                             ([b"just bytes"], r"\(payload, policy_version\[, meta\[, record_id\]\]\)"),
                             ([(b"ok", 1, None, b"")], r"record_id: expected 1\.\.64 bytes"),
                             ([(b"ok", 1, None, "text")], r"record_id: expected 1\.\.64 bytes"),
                             ([(b"a", 1, None, b"i"), (b"b", 1, None, b"i")], "expected distinct record ids")]:
            with pytest.raises(UsageError, match=match):
                await sp.append(items, timeout=1)
        payload, meta = encode_payload({"obs": [1, 2]}, {"ep": 3})
        [seq] = await sp.append([(payload, 4, meta)], timeout=1)
        got = await drain(sp)
        stats = sp.stats()
        await sp.aclose()
        return seq, got, stats

    seq, [r], stats = run(main)
    assert stats["appended_total"] == 1 and r.seq == seq and r.value() == {"obs": [1, 2]}
