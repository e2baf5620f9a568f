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


# ================================================================ the store


def _run(fn, *args, limit=60):
    async def main():
        with trio.fail_after(limit):
            return await fn(*args)
    return trio.run(main)


def _stored(directory) -> list[tuple[str, int, bytes, bytes | None]]:
    from patchswarm.node.trainer.trajstore import TrajectoryReader
    return [(r.node_id, r.seq, r.payload, r.key) for r in TrajectoryReader(directory).iter_records()]


def test_the_same_key_from_two_nodes_is_stored_once_and_both_are_acked(tmp_path):
    """Before: the store deduplicated by (node id, seq) only, so the record that node n1
    stored and node n2 was given again (the client resubmitted it there) was stored twice."""
    from patchswarm.node.trainer.trajstore import TrajectoryStore

    async def main():
        async with await TrajectoryStore.open(tmp_path) as st:
            a = await st.append([_rec("n1", 7, b"ep-1", b"one"), _rec("n1", 8, None, b"plain")])
            b = await st.append([_rec("n2", 3, b"ep-1", b"one"), _rec("n2", 4, b"ep-2", b"two"),
                                 _rec("n2", 5, None, b"plain")])
            # n2 resends (its ack was lost): dropped for its key again (its (node, seq) was never stored)
            again = await st.append([_rec("n2", 3, b"ep-1", b"one")])
            return a, b, again, st.summary()

    a, b, again, summary = _run(main)
    assert (a, b, again) == ([7, 8], [3, 4, 5], [3])  # every seq acked, the dropped one included
    assert _stored(tmp_path) == [("n1", 7, b"one", record_key(b"ep-1")), ("n1", 8, b"plain", None),
                                 ("n2", 4, b"two", record_key(b"ep-2")), ("n2", 5, b"plain", None)]
    assert summary["records"] == 4 and summary["duplicates_dropped"] == 2 and summary["duplicates_by_key"] == 2
    assert summary["record_keys"] == 2 and summary["record_key_window"] == 1 << 20


def test_two_batches_with_one_key_in_one_group_commit_store_it_once(tmp_path):
    from patchswarm.node.trainer.trajstore import TrajectoryStore

    async def main():
        async with await TrajectoryStore.open(tmp_path) as st:
            acked = {}

            async def send(node, seq):
                acked[node] = await st.append([_rec(node, seq, b"same", b"payload")])

            async with trio.open_nursery() as n:  # no checkpoint between the two starts: one round
                n.start_soon(send, "n1", 1)
                n.start_soon(send, "n2", 9)
            return acked, st.summary(), st.log.fsyncs

    acked, summary, fsyncs = _run(main)
    assert acked == {"n1": [1], "n2": [9]}
    assert len(_stored(tmp_path)) == 1 and summary["duplicates_by_key"] == 1
    assert fsyncs <= 2


def test_keys_are_known_again_after_a_reopen(tmp_path):
    from patchswarm.node.trainer.trajstore import TrajectoryStore

    async def main():
        async with await TrajectoryStore.open(tmp_path) as st:
            await st.append([_rec("n1", i, b"ep-%d" % i) for i in range(5)])
        async with await TrajectoryStore.open(tmp_path) as st:  # as after a kill: only the files carry over
            acked = await st.append([_rec("n2", 100 + i, b"ep-%d" % i) for i in range(6)])
            return acked, st.summary()

    acked, summary = _run(main)
    assert acked == list(range(100, 106))
    assert [(n, s) for n, s, _, _ in _stored(tmp_path)] == [("n1", i) for i in range(5)] + [("n2", 105)]
    assert summary["duplicates_by_key"] == 5 and summary["duplicates_dropped"] == 5
    assert summary["record_keys"] == 6


def test_a_key_past_the_window_is_forgotten_in_memory_and_after_a_reopen(tmp_path):
    """The index is bounded by its window (the newest keys stored), whatever members send:
    a key pushed out by `window` newer ones is a new record again, and a reopen rebuilds
    the same window from the files."""
    from patchswarm.node.trainer.trajstore import TrajectoryStore

    async def main():
        async with await TrajectoryStore.open(tmp_path, id_window=4) as st:
            for i in range(12):
                await st.append([_rec("n1", i, b"ep-%d" % i)])
            kept = st.summary()["record_keys"]
            first = await st.append([_rec("n2", 0, b"ep-0")])  # forgotten: stored again
            last = await st.append([_rec("n2", 1, b"ep-11")])  # remembered: dropped
        async with await TrajectoryStore.open(tmp_path, id_window=4) as st:
            rebuilt = st.summary()["record_keys"]
            old = await st.append([_rec("n3", 0, b"ep-1")])  # outside the rebuilt window
            new = await st.append([_rec("n3", 1, b"ep-10")])  # inside it
            return kept, first, last, rebuilt, old, new, st.summary()

    kept, first, last, rebuilt, old, new, summary = _run(main)
    assert kept == 4 and rebuilt == 4
    stored = [(n, s) for n, s, _, _ in _stored(tmp_path)]
    assert ("n2", 0) in stored and ("n2", 1) not in stored
    assert ("n3", 0) in stored and ("n3", 1) not in stored
    assert summary["duplicates_by_key"] == 2


def test_a_failed_commit_leaves_its_keys_unclaimed_and_a_resend_through_another_node_is_stored(tmp_path, monkeypatch):
    """A commit that fails on disk (EIO) was not acknowledged and nothing of it stays: its keys
    must leave the claims with its seqs, or the resend, through this node or another, would be
    dropped as a duplicate of nothing and acked: lost. The batch queued behind the failing one
    that held the same key as a duplicate fails with it (FIFO commits), unacked too."""
    from patchswarm.node.trainer.trajstore import TrajectoryStore
    from test_storage_errors import Faults

    faults = Faults(monkeypatch)

    async def main():
        errors = []
        async with await TrajectoryStore.open(tmp_path) as st:
            await st.append([_rec("n1", 0, b"before")])
            faults.arm("fdatasync", delay=0.2)

            async def send(node, seq):
                try:
                    await st.append([_rec(node, seq, b"ep-x", b"x")])
                except StorageFailed:
                    errors.append(node)

            async with trio.open_nursery() as n:
                n.start_soon(send, "n1", 1)
                await trio.sleep(0.05)  # n2's batch queues behind the failing round, as a duplicate
                n.start_soon(send, "n2", 5)
            acked = await st.append([_rec("n2", 5, b"ep-x", b"x")])  # the resend
            return errors, acked, st.summary()

    errors, acked, summary = _run(main)
    assert sorted(errors) == ["n1", "n2"] and acked == [5]
    assert [(n, s, p) for n, s, p, _ in _stored(tmp_path)] == [("n1", 0, b"p0"), ("n2", 5, b"x")]
    assert summary["duplicates_by_key"] == 0


# ================================================================ the node's uploader


@pytest.mark.parametrize("revision, keyed", [("patchswarm/4", True), ("patchswarm/3", False),
                                             ("patchswarm/2", False), (None, False)])
def test_the_uploader_sends_keys_only_to_an_origin_that_reads_them_also_after_a_restart(tmp_path, revision, keyed):
    """The spool keeps each record's key in a RecordIds entry next to it; the uploader sends it
    with the record where the origin's connection selected revision 4, and not otherwise (an
    origin before it would refuse the batch and drop the node). After a restart the records
    come from the files and their keys from the segments' identities."""
    import trio.testing

    from patchswarm.node.spool import TrajectorySpool
    from patchswarm.node.uploader import TrajectoryUploader
    from patchswarm.protocol import wire
    from test_uploader import _origin, _settle

    def sent(s):
        return [(r.seq, r.key) for m in s.ms.sent if isinstance(m, wire.Trajectories) for r in decode_batch(m.batch)]

    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            seqs = await spool.append([(b"a", 1, None, b"ep-a"), (b"b", 1, None), (b"c", 1, None, b"ep-c")], timeout=5)
        got = []
        for _ in range(2):  # fresh from memory, then after a restart (from the files)
            async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
                if not got:
                    seqs += await spool.append([(b"d", 1, None, b"ep-d")], timeout=5)
                origin = _origin(revision)
                up = TrajectoryUploader(spool, lambda: origin)
                async with trio.open_nursery() as n:
                    n.start_soon(up.run)
                    await _settle()
                    n.cancel_scope.cancel()
                got.append(sent(origin))
        return seqs, got

    seqs, got = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    want = list(zip(seqs, [b"ep-a", None, b"ep-c", b"ep-d"]))
    for batch in got:
        assert batch == [(s, record_key(k) if keyed and k else None) for s, k in want]


# ================================================================ an origin, over TLS


def test_a_node_of_revision_3_uploads_without_keys_and_is_deduplicated_by_node_and_seq(tmp_path):
    """An origin of this version takes batches from a node of the revision before keys
    (its TLS offers patchswarm/3 and patchswarm/2): nothing of them has a key, a resend
    of one is dropped by (node id, seq) as before, and the same payloads from a node of
    this version (with keys) are not mistaken for them; that node's records sent again
    under new seqs are dropped by their keys."""
    from patchswarm.node.trainer.origin import Origin
    from patchswarm.node.net import trust
    from patchswarm.protocol import wire
    from test_origin import _dial_as, _intake_setup

    cfg = _intake_setup(tmp_path)
    trust.issue(tmp_path / "swarm", "n2", "node", tmp_path / "n2")
    old_batch = encode_batch([Record("n1", "r1", i, 1, 1.0, b"p%d" % i) for i in range(4)])
    new_batch = encode_batch([Record("n2", "r1", i, 1, 1.0, b"p%d" % i) for i in range(4)],
                             [record_key(b"ep-%d" % i) for i in range(4)])
    # n2 again under new seqs with the same keys (as after losing its spool's ack state)
    renumbered = encode_batch([Record("n2", "r1", 10 + i, 1, 1.0, b"p%d" % i) for i in range(4)],
                              [record_key(b"ep-%d" % i) for i in range(4)])

    async def main():
        o = Origin(cfg)
        acks = []
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                old = await _dial_as(tmp_path, "n1", o.listen_addr, ["patchswarm/3", "patchswarm/2"])
                new = await _dial_as(tmp_path, "n2", o.listen_addr)
                revisions = (wire.revision(old.wire_revision), wire.revision(new.wire_revision))
                for ms, batch in ((old, old_batch), (old, old_batch), (new, new_batch), (new, new_batch),
                                  (new, renumbered)):
                    await ms.send(wire.Trajectories(batch))
                    while True:
                        msg = await ms.receive()
                        if isinstance(msg, wire.TrajectoriesAck):
                            acks.append(sorted(msg.seqs))
                            break
                for ms in (old, new):
                    await ms.aclose()
                summary = o.trajectory_store.summary()
                n.cancel_scope.cancel()
        return revisions, acks, summary

    revisions, acks, summary = trio.run(main)
    assert revisions == (3, wire.revision(wire.WIRE_REVISION))  # the new node: this version's newest (keys from 4 on)
    assert acks == [[0, 1, 2, 3]] * 4 + [[10, 11, 12, 13]]
    stored = _stored(tmp_path / "data" / "trajectories")
    assert [(n, s, k) for n, s, _, k in stored] == [("n1", i, None) for i in range(4)] + \
        [("n2", i, record_key(b"ep-%d" % i)) for i in range(4)]
    assert summary["duplicates_dropped"] == 12 and summary["duplicates_by_key"] == 4


# ================================================================ real processes


@pytest.mark.slow
def test_a_record_resubmitted_through_another_node_after_the_first_was_killed_is_stored_once(tmp_path):
    """Node a takes records with ids and fsyncs them, and is killed (SIGKILL) before it could
    upload them (no origin yet); the client submits the same records, same ids, through
    node b, which uploads them; a comes back and uploads its spool. Before: the trainer's
    store held each record twice (the origin deduplicated by (node id, seq) only)."""
    from patchswarm.node.client import NodeClient
    from swarmlab import SwarmLab, dump, summary, wait_spools_empty

    items = [(b"episode-%d" % i + bytes(200), b"worker-7/episode-%d" % i) for i in range(6)]
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        a = lab.start_node("a")  # no origin in the swarm yet: nothing leaves a's spool
        with NodeClient(a.socket) as c:
            seqs_a = [c.submit(p, 1, record_id=rid) for p, rid in items]
            assert c.status()["spool"]["records"] == len(items)
        lab.kill(a, signal.SIGKILL)
        origin = lab.start_origin()
        b = lab.start_node("b")
        with NodeClient(b.socket) as c:
            seqs_b = [c.submit(p, 1, record_id=rid) for p, rid in items]
        wait_spools_empty(lab, [b])
        lab.restart(a)
        wait_spools_empty(lab, [a])
        records, counts = dump(origin), summary(origin)

    payloads = [base64.b64decode(r["payload_b64"]) for r in records]
    assert sorted(payloads) == sorted(p for p, _ in items)  # each once, nothing else
    assert [r["node_id"] for r in records] == ["b"] * len(items)
    assert sorted(r["seq"] for r in records) == sorted(seqs_b) and len(seqs_a) == len(items)
    assert counts["records"] == len(items) and counts["duplicates_by_key"] == len(items)
