"""A record resubmitted through another node reaches the trainer once: record keys travel
with the records (protocol/trajectory.py bodies, wire revision 4) and the origin's store
drops a key it already holds, from any node, within its window (node/trainer/trajstore.py).
The codec, the store (two nodes, a reopen, the window, a failed commit), the node's uploader
by wire revision, and real processes: a node killed with the records durable and not
uploaded, the same records through another node, the first one back."""

from __future__ import annotations

import base64
import errno
import signal
import zlib

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.errors import CorruptData, StorageFailed, UsageError
from patchswarm.protocol.trajectory import (_BATCH_HEADER, BATCH_MAGIC, BATCH_VERSION, RECORD_KEY_BYTES, DuplicatesNote, Record, ReceivedRecord, decode_batch,
                                            decode_record, encode_batch, encode_record, record_key)

keys = st.none() | st.binary(min_size=RECORD_KEY_BYTES, max_size=RECORD_KEY_BYTES)
records = st.builds(Record, st.sampled_from(["n1", "n2"]), st.just("r1"), st.integers(0, 2**64 - 1),
                    st.integers(0, 2**64 - 1), st.floats(allow_nan=False), st.binary(max_size=40),
                    st.none() | st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2))


def _rec(node: str, seq: int, rid: bytes | None, payload: bytes = b"") -> Record:
    return Record(node, "r1", seq, 1, 1.0, payload or b"p%d" % seq, key=None if rid is None else record_key(rid))


# ================================================================ the codec


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(records, keys), max_size=12), st.booleans())
def test_batches_with_and_without_keys_round_trip(pairs, keyed):
    recs = [r for r, _ in pairs]
    got = decode_batch(encode_batch(recs, [k for _, k in pairs] if keyed else None))
    assert [r.key for r in got] == ([k for _, k in pairs] if keyed else [None] * len(pairs))
    assert [(r.node_id, r.seq, r.policy_version, r.submitted_at, r.payload, r.meta) for r in got] == \
        [(r.node_id, r.seq, r.policy_version, r.submitted_at, r.payload, r.meta) for r in recs]
    # the origin's decode (meta kept packed) reads the same keys
    assert [r.key for r in decode_batch(encode_batch(recs, [k for _, k in pairs]), True)] == [k for _, k in pairs]


@settings(max_examples=50, deadline=None)
@given(records, keys, st.floats(allow_nan=False))
def test_a_stored_record_keeps_its_key_and_one_without_is_the_old_body(rec, key, at):
    keyed = Record(rec.node_id, rec.region, rec.seq, rec.policy_version, rec.submitted_at, rec.payload, rec.meta,
                   key=key)
    body = encode_record(keyed.received(at))
    assert decode_record(body) == keyed.received(at)
    assert decode_record(encode_record(keyed)) == keyed
    if key is None:  # byte for byte what the code before keys wrote (and reads)
        assert len(msgpack.unpackb(body)) == 9 and len(msgpack.unpackb(encode_record(keyed))) == 8


@pytest.mark.parametrize("length", [0, 1, 15, 17, 32])
def test_a_key_of_another_length_is_corrupt_saying_what_was_expected_and_found(length):
    good = encode_batch([_rec("n1", 1, b"id")], [record_key(b"id")])
    raw = msgpack.packb([[1, "n1", "r1", 1, 1, 1.0, b"p", None, b"k" * length]])
    batch = _BATCH_HEADER.pack(BATCH_MAGIC, BATCH_VERSION, 0, len(raw), zlib.crc32(raw)) + raw
    with pytest.raises(CorruptData, match=rf"expected .*{RECORD_KEY_BYTES} bytes, found .*{length}"):
        decode_batch(batch)
    assert decode_batch(good)[0].key == record_key(b"id")
    body = msgpack.packb([2, "n1", "r1", 1, 1, 1.0, b"p", None, 2.0, b"k" * length])
    with pytest.raises(CorruptData, match=rf"expected .*{RECORD_KEY_BYTES} bytes, found .*{length}"):
        decode_record(body)
    with pytest.raises(UsageError, match=rf"record.key: expected None or {RECORD_KEY_BYTES} bytes, found bytes"):
        encode_batch([_rec("n1", 1, None)], [b"k" * length])


def test_old_format_bodies_still_decode_and_two_extra_elements_do_not():
    old = msgpack.packb([1, "n1", "r1", 5, 1, 1.0, b"p", None])
    assert decode_record(old) == Record("n1", "r1", 5, 1, 1.0, b"p")
    assert decode_record(msgpack.packb([3, 7])) == DuplicatesNote(7)
    assert decode_record(msgpack.packb([3, 7, 2])) == DuplicatesNote(7, 2)
    with pytest.raises(CorruptData, match="expected an int in 0..7, found int 8"):
        decode_record(msgpack.packb([3, 7, 8]))
    with pytest.raises(CorruptData, match="kind 1 expects 8 or 9 elements, found 10"):
        decode_record(msgpack.packb([1, "n1", "r1", 5, 1, 1.0, b"p", None, b"k" * 16, b"x"]))
    assert encode_record(DuplicatesNote(7)) == msgpack.packb([3, 7])  # what older readers read
