"""Record ids make a submit idempotent (protocol/localapi.py, node/spool.py, node/recordids.py,
node/client.py): the frame, the spool's memory of ids across restarts and trims and its
window, the clients' resend after a lost reply, an older node, and a node killed between
its fsync and its reply (real processes)."""

from __future__ import annotations

import base64
import functools
import os
import signal
import threading

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import patchswarm.node.client
from patchswarm.node.client import AsyncNodeClient, NodeClient, NodeError
from patchswarm.node.localapi import LocalRequests, serve_local
from patchswarm.node.recordids import RecordIdIndex, merged
from patchswarm.node.spool import IDS_NAME, TrajectorySpool
from patchswarm.protocol import localapi
from patchswarm.protocol.errors import CorruptData, ProtocolError, UsageError
from patchswarm.protocol.trajectory import RecordIds, decode_record, encode_record, record_key

from swarmlab import SwarmLab, dump, wait_spools_empty

ids = st.none() | st.binary(min_size=1, max_size=localapi.MAX_RECORD_ID_BYTES)
metas = st.none() | st.dictionaries(st.text(max_size=4), st.integers(0, 9), max_size=2)


def _distinct(records) -> bool:
    named = [r[3] for r in records if len(r) == 4 and r[3] is not None]
    return len(named) == len(set(named))


# ================================================================ the frame


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=30), st.integers(0, 2**63 - 1), metas) |
                st.tuples(st.binary(max_size=30), st.integers(0, 2**63 - 1), metas, ids),
                min_size=1, max_size=6).filter(_distinct))
def test_a_submit_frame_with_record_ids_is_the_request_and_the_node_reads_it_back(records):
    parts = localapi.submit_frame_parts(records, 5.0)
    frame = b"".join(parts)
    assert frame == localapi.encode(localapi.submit_request(records, 5.0))
    req = localapi.check_request(localapi.decode(frame[4:]))
    assert req["records"] == [list(r) for r in records]


def test_record_ids_are_bounded_and_distinct_with_errors_that_say_what_was_found():
    cases = [([(b"p", 1, None, b"")], "record 0: expected a record_id of 1..64 bytes or nil, found bytes b''"),
             ([(b"p", 1, None, bytes(65))], "record 0: expected a record_id of 1..64 bytes"),
             ([(b"p", 1, None, "text")], "found str 'text'"),
             ([(b"p", 1, None, b"a"), (b"q", 1, None, b"b"), (b"r", 1, None, b"a")],
              "expected distinct record ids within one request, found record 2's id 61 at record 0 too"),
             ([(b"p", 1, None, b"a", "fifth")], r"expected records \[payload")]
    for records, message in cases:
        with pytest.raises(UsageError, match=message):
            localapi.submit_frame_parts(records, 1.0)
        body = msgpack.packb({"op": "submit", "records": [list(r) for r in records], "timeout": 1.0})
        with pytest.raises(ProtocolError, match=message):
            localapi.check_request(localapi.decode(body))
    # a new node's refusal of a bad record is not read as an older node's refusal of ids
    with pytest.raises(ProtocolError) as e:
        localapi.check_request({"op": "submit", "records": [[b"p", -1, None, b"id"]], "timeout": 1.0})
    assert patchswarm.node.client._REFUSES_IDS not in str(e.value)
    # nil is "no id", and records with and without ids mix
    localapi.check_request(localapi.decode(b"".join(localapi.submit_frame_parts(
        [(b"p", 1, None, None), (b"q", 1, None), (b"r", 1, None, None)], 1.0))[4:]))


def test_record_ids_entry_round_trips_and_refuses_mismatched_arrays():
    e = RecordIds((5).to_bytes(8, "little") + (9).to_bytes(8, "little"), record_key(b"a") + record_key(b"b"))
    assert decode_record(encode_record(e)) == e and len(e) == 2
    with pytest.raises(UsageError, match="16 key bytes per seq"):
        encode_record(RecordIds(bytes(8), bytes(15)))
    assert len(record_key(b"x" * 64)) == 16 and record_key(b"x") != record_key(b"y")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.binary(min_size=16, max_size=16)), min_size=1, max_size=20),
       st.data())
def test_a_record_ids_body_round_trips_and_any_change_to_it_decodes_or_is_corrupt(pairs, data):
    e = RecordIds(b"".join(s.to_bytes(8, "little") for s, _ in pairs), b"".join(k for _, k in pairs))
    body = encode_record(e)
    assert decode_record(body) == e
    cut = data.draw(st.integers(0, len(body) - 1))
    flip = data.draw(st.integers(0, len(body) - 1))
    for bad in (body[:cut], body[:flip] + bytes([body[flip] ^ data.draw(st.integers(1, 255))]) + body[flip + 1:]):
        try:
            got = decode_record(bad)
        except CorruptData:
            continue
        assert type(got) is RecordIds and len(got.keys) == 16 * len(got)  # a flipped key or seq byte: still well formed


# ================================================================ the index


def test_the_index_keeps_the_newest_window_and_finds_keys_in_the_dict_and_the_arrays():
    index = RecordIdIndex(window=100, seal_every=16)
    keys = [record_key(i.to_bytes(4, "big")) for i in range(1000)]
    keys[7] = bytes(15) + b"\x01"  # and one that ends in NULs: numpy's S16 would read it shorter
    keys[8] = b"\x01" + bytes(15)
    for i in range(0, 1000, 10):
        index.add(keys[i:i + 10], range(i, i + 10))
        if index.seal_due():  # as the spool does, in two steps: lookups see the part set aside
            work = index.seal_begin()
            assert index.get(keys[i]) == i
            index.seal_end(merged(*work))
    assert len(index) <= 100 + 16 + 10  # the window plus at most one unsealed dict
    assert index.get(keys[999]) == 999 and index.get(keys[985]) == 985  # dict or arrays
    assert index.get(keys[0]) is None and index.get(keys[7]) is None  # past the window
    index.seal()
    assert len(index) == 100 and index.forgotten == 900
    assert [index.get(k) for k in keys[900:]] == list(range(900, 1000))
    seqs, packed = index.packed()
    again = RecordIdIndex(window=100)
    again.add_packed(seqs, packed)
    assert [again.get(k) for k in keys[900:]] == list(range(900, 1000))
    index.add([keys[0]], [5000])
    index.seal_begin()  # a merge that failed: what was set aside comes back
    assert index.get(keys[0]) == 5000
    index.seal_end(None)
    assert index.get(keys[0]) == 5000 and index.get(keys[999]) == 999 and len(index) == 101
    small = RecordIdIndex(window=10, seal_every=1)
    small.add([keys[7], keys[8]], [1, 2])
    assert small.get(keys[7]) == 1 and small.get(keys[8]) == 2 and small.get(bytes(16)) is None
    with pytest.raises(UsageError, match="window"):
        RecordIdIndex(window=0)


# ================================================================ the spool


def run(fn):
    return trio.run(fn)


def test_an_id_survives_a_restart_and_a_resubmit_is_not_stored_again(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        first, repeated = await sp.submit([(b"a", 1, None, b"id-a"), (b"b", 1, None), (b"c", 1, None, b"id-c")], 1)
        assert repeated == 0
        again, repeated = await sp.submit([(b"c", 1, None, b"id-c"), (b"d", 1, None, b"id-d")], 1)
        assert again[0] == first[2] and repeated == 1 and again[1] not in first
        await sp.aclose()  # as after a kill: nothing but the files carries over
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        got, repeated = await sp.submit([(b"a", 1, None, b"id-a"), (b"d", 1, None, b"id-d"), (b"b", 1, None)], 1)
        assert got[:2] == [first[0], again[1]] and repeated == 2 and got[2] not in first
        stored = sorted(r.payload for r in sp.pending())
        await sp.aclose()
        return stored

    assert run(main) == [b"a", b"b", b"b", b"c", b"d"]  # the record without an id went twice


def test_an_id_survives_the_trim_of_its_segment_within_the_window_and_is_forgotten_after(tmp_path):
    """The ids of acknowledged, deleted segments live on in the `ids` file, the newest
    `id_window` of them; the file is rewritten before it holds 1.5 windows."""
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=2048, id_window=40)
        seqs = {}
        for i in range(120):
            [seqs[i]] = await sp.append([(bytes(300), 1, None, b"rec%d" % i)], 1)
            await sp.ack([r.seq for r in sp.pending()])  # the origin has it: its segment goes
        assert sp.stats()["segments"] == 1  # only the active one is left
        assert sp.stats()["record_ids"] <= 2 * 40 and sp.stats()["record_ids_forgotten"] >= 40  # while it runs
        ids_bytes = (tmp_path / IDS_NAME).stat().st_size
        await sp.aclose()
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=2048, id_window=40)
        assert len(sp.ids) == 40 and not sp.problems
        newest, repeated = await sp.submit([(bytes(300), 1, None, b"rec%d" % i) for i in range(80, 120)], 1)
        assert newest == [seqs[i] for i in range(80, 120)] and repeated == 40
        assert not sp.pending()  # nothing stored again
        oldest, repeated = await sp.submit([(bytes(300), 1, None, b"rec0")], 1)
        assert repeated == 0 and oldest[0] > seqs[119]  # past the window: stored as new
        await sp.aclose()
        return ids_bytes

    ids_bytes = run(main)
    assert ids_bytes < 1.5 * 40 * 24 + 2048  # rewritten along the way, not grown with all 120


def test_a_damaged_ids_file_costs_the_ids_it_hit_is_reported_and_rewritten(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", segment_bytes=1024)
        seqs = []
        for i in range(6):  # one segment per record: each trim appends one entry to `ids`
            seqs += await sp.append([(bytes(1100), 1, None, b"rec%d" % i)], 1)
            await sp.ack([r.seq for r in sp.pending()])
        await sp.aclose()
        data = bytearray((tmp_path / IDS_NAME).read_bytes())
        at = data.index(record_key(b"rec1"))
        data[at] ^= 0xFF  # inside the entry of rec1's identity
        (tmp_path / IDS_NAME).write_bytes(bytes(data))
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        problems = [str(p) for p in sp.problems]
        got, repeated = await sp.submit([(bytes(1100), 1, None, b"rec%d" % i) for i in (0, 2, 3, 4)], 1)
        lost, _ = await sp.submit([(bytes(1100), 1, None, b"rec1")], 1)
        await sp.aclose()
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")  # rewritten: no damage left to report
        again = sp.problems
        await sp.aclose()
        return seqs, problems, got, repeated, lost, again

    seqs, problems, got, repeated, lost, again = run(main)
    assert len(problems) == 1 and IDS_NAME in problems[0] and "checksum" in problems[0], problems
    assert got == [seqs[i] for i in (0, 2, 3, 4)] and repeated == 4
    assert lost[0] not in seqs  # the id the damage hit is forgotten: stored again
    assert again == []


def test_a_torn_write_that_kept_the_ids_but_not_all_records_remembers_only_those_it_kept(tmp_path):
    """The ids entry goes just before its records in one write: a crash that tore the write
    may keep it and lose records after it. Those were never acknowledged; a resubmit of them
    must be stored, not answered with a seq that holds nothing."""
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        seqs = await sp.append([(b"kept" + bytes(100), 1, None, b"id-0"), (b"torn" + bytes(100), 1, None, b"id-1")], 1)
        await sp.aclose()
        (seg,) = tmp_path.glob("*.seg")
        data = seg.read_bytes()
        seg.write_bytes(data[:data.index(b"torn") + 20])  # the second record cut short
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        got, repeated = await sp.submit([(b"kept" + bytes(100), 1, None, b"id-0"),
                                         (b"torn" + bytes(100), 1, None, b"id-1")], 1)
        pending = [r.payload[:4] for r in sp.pending()]
        await sp.aclose()
        return seqs, got, repeated, pending

    seqs, got, repeated, pending = run(main)
    assert got[0] == seqs[0] and got[1] != seqs[1] and repeated == 1
    assert pending == [b"kept", b"torn"]


def test_the_same_id_submitted_twice_at_once_is_stored_once(tmp_path):
    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        out = []

        async def submit():
            out.append(await sp.append([(b"x" * 1000, 1, None, b"same")], 1))

        async with trio.open_nursery() as n:
            for _ in range(4):
                n.start_soon(submit)
        stored = len(sp.pending())
        await sp.aclose()
        return out, stored

    out, stored = run(main)
    assert len({tuple(o) for o in out}) == 1 and stored == 1


# ================================================================ the clients


class Node:
    """An in-process node: the local socket over a real spool, killed (its nursery cancelled,
    every connection cut) once a submit is durable and before its reply, when told."""

    def __init__(self, tmp_path):
        self.dir, self.path = tmp_path / "spool", tmp_path / "node.sock"
        self.kill_next_submit = True
        self.killed = trio.Event()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED):
        spool = await TrajectorySpool.open(self.dir, "n1", "r1")
        try:
            handle = LocalRequests(lambda: {}, None, lambda: None, spool)

            async def requests(req):
                reply = await handle(req)
                if req["op"] == "submit" and self.kill_next_submit:
                    self.kill_next_submit = False
                    self.killed.set()
                    await trio.sleep_forever()  # cancelled with the node: no reply goes out
                return reply

            async with trio.open_nursery() as n:
                await n.start(serve_local, self.path, requests)
                task_status.started(n.cancel_scope)
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # the files' lock goes with the "process"
                await spool.aclose()

    async def restart_after_kill(self, nursery):
        """Wait for the kill, cut every connection, come back a little later on the same files."""
        scope = await nursery.start(self.serve)
        await self.killed.wait()
        scope.cancel()
        await trio.sleep(0.3)  # the client finds no node for a while
        return await nursery.start(self.serve)

    async def stored(self):
        async with await TrajectorySpool.open(self.dir, "n1", "r1") as sp:
            return [r.payload for r in sp.pending()]


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_submit_whose_reply_was_lost_is_sent_again_and_stored_once(tmp_path, flavour):
    node = Node(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(node.restart_after_kill, n)
            await trio.sleep(0.2)
            if flavour == "sync":
                with NodeClient(node.path) as c:
                    seqs = await trio.to_thread.run_sync(c.submit_many, [(b"one", 1), (b"two", 1, {"k": 1})], 10.0)
                    resends = c.resends
                    assert await trio.to_thread.run_sync(c.submit, b"three", 1) > seqs[1]  # a restart skips seqs
            else:
                async with AsyncNodeClient(node.path) as c:
                    seqs = await c.submit_many([(b"one", 1), (b"two", 1, {"k": 1})], 10.0)
                    resends = c.resends
                    assert await c.submit(b"three", 1) > seqs[1]
            n.cancel_scope.cancel()
        return seqs, resends, await node.stored()

    seqs, resends, stored = trio.run(main)
    assert resends >= 1 and seqs[1] == seqs[0] + 1  # stored once: the resend answered the same seqs
    assert stored == [b"one", b"two", b"three"]


def test_without_ids_a_lost_reply_is_not_sent_again(tmp_path):
    """Other calls keep the old rule (and so does a submit to a node that refuses ids)."""
    node = Node(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(node.restart_after_kill, n)
            await trio.sleep(0.2)
            async with AsyncNodeClient(node.path) as c:
                frame = localapi.submit_frame_parts([(b"bare", 1, None)], 5.0)
                with pytest.raises(NodeError, match="closed the connection"):
                    await c._call(frame, 5.0)
                assert c.resends == 0
            n.cancel_scope.cancel()

    trio.run(main)


async def _older_node(req: dict) -> dict:
    """A node from before record ids: its check_records refused a 4-element record so."""
    if any(len(r) != 3 for r in req.get("records", [])):
        _older_node.refused += 1
        return localapi.error(localapi.BAD_REQUEST, "submit: expected records [payload: bytes, policy_version: "
                                                    "int >= 0, meta: map | nil], found [b'x', 1, None, b'...']")
    _older_node.submits += 1
    return localapi.ok(seqs=list(range(len(req["records"]))))


def test_an_older_node_that_refuses_ids_gets_the_records_without_them(tmp_path):
    path = tmp_path / "node.sock"
    _older_node.submits = _older_node.refused = 0

    async def main():
        async with trio.open_nursery() as n:
            await n.start(functools.partial(serve_local, path, _older_node))

            def blocking():
                with NodeClient(path) as c:
                    first = c.submit_many([(b"x", 1), (b"y", 1)])
                    second = c.submit(b"z", 1)  # known now: sent without ids straight away
                    with pytest.raises(NodeError, match="expected a node that takes record ids, found one that "
                                                        "refuses them"):
                        c.submit(b"w", 1, record_id=b"mine")
                    return first, second

            first, second = await trio.to_thread.run_sync(blocking)
            async with AsyncNodeClient(path) as c:
                assert await c.submit_many([(b"x", 1)]) == [0]
                assert c._ids_refused
            n.cancel_scope.cancel()
        return first, second

    assert trio.run(main) == ([0, 1], 0)
    # one refused try per client (then it knows), none for the caller's own id (refused unsent)
    assert (_older_node.refused, _older_node.submits) == (2, 3)


# ================================================================ real processes


@pytest.mark.slow
def test_a_node_killed_after_the_fsync_and_before_the_reply_stores_the_record_once(tmp_path):
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin()
        node = lab.start_node("n0", env={"PATCHSWARM_FAILPOINTS": "submit.durable=sleep:60"})
        out = {}

        def submit():
            with NodeClient(node.socket) as c:
                try:
                    out["seq"] = c.submit(b"exactly-once" + bytes(100), 1, timeout=60)
                except Exception as e:  # reported below
                    out["error"] = e
                out["resends"] = c.resends

        worker = threading.Thread(target=submit)
        worker.start()
        lab.wait_log(node, r"failpoint submit\.durable: holding")
        lab.kill(node, signal.SIGKILL)  # fsynced, and the client never got its seq
        before = {p.name for p in (node.data_dir / "spool").glob("*.seg")}
        node.env = {}
        lab.restart(node)
        worker.join(timeout=90)
        assert not worker.is_alive() and "error" not in out, out
        assert out["resends"] >= 1

        # Again with the caller's id, once the record's segment is acknowledged and deleted
        # and the node restarted: the `ids` file still answers it.
        with NodeClient(node.socket) as c:
            mine = c.submit(b"mine" + bytes(100), 1, record_id=b"worker-3/episode-17")
        wait_spools_empty(lab, [node])
        assert not before & {p.name for p in (node.data_dir / "spool").glob("*.seg")}, "not trimmed"
        lab.kill(node, signal.SIGKILL)
        lab.restart(node)
        with NodeClient(node.socket) as c:
            assert c.submit(b"mine" + bytes(100), 1, record_id=b"worker-3/episode-17") == mine
            assert c.status()["spool"]["repeated_total"] == 1
        wait_spools_empty(lab, [node])
        records = dump(origin)

    payloads = [base64.b64decode(r["payload_b64"]) for r in records]
    assert payloads.count(b"exactly-once" + bytes(100)) == 1 and payloads.count(b"mine" + bytes(100)) == 1
    assert [r["seq"] for r in records if base64.b64decode(r["payload_b64"]).startswith(b"exactly")] == [out["seq"]]
    assert len(records) == 2


def test_a_lost_reply_then_an_older_node_is_an_error_not_a_second_copy(tmp_path):
    """The first node may have stored the records; the older one that comes back would
    take them again without ids. The call fails, saying the records may be stored."""
    path = tmp_path / "node.sock"
    _older_node.submits = _older_node.refused = 0
    got = trio.Event()

    async def dies_before_replying(req):
        got.set()
        await trio.sleep_forever()

    async def first_node(task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as inner:
                await inner.start(serve_local, path, dies_before_replying)
                task_status.started(scope)

    async def main():
        async with trio.open_nursery() as n:
            first = await n.start(first_node)

            async def swap():
                await got.wait()
                first.cancel()  # the node dies with the request read, maybe stored, unanswered
                await trio.sleep(0.2)
                await n.start(functools.partial(serve_local, path, _older_node))

            n.start_soon(swap)

            def blocking():
                with NodeClient(path) as c:
                    with pytest.raises(NodeError, match="no node that takes record ids answered it again .* may be "
                                                        "stored") as e:
                        c.submit(b"x", 1, timeout=10)
                    return e.value.code

            code = await trio.to_thread.run_sync(blocking)
            n.cancel_scope.cancel()
        return code

    assert trio.run(main) == "unavailable"
    assert _older_node.submits == 0 and _older_node.refused >= 1


def test_reopening_merges_the_recovered_ids_once_not_once_per_entry(tmp_path, monkeypatch):
    """Each submit with ids writes a RecordIds entry of its own: a spool of records submitted
    one at a time holds an entry per record. Recovery merged each entry into the sorted index
    (a copy of the whole index) and rebuilt a set of its segment's seqs per entry: quadratic,
    ~2 s at 8,000 records and minutes at 100,000. Now one merge for all of them."""
    import patchswarm.node.recordids as recordids

    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        seqs = []
        for i in range(300):  # one RecordIds entry per append
            seqs += await sp.append([(b"x" * 20, 1, None, b"rec%d" % i)], 1)
        await sp.aclose()
        merges = []
        real = recordids._merge
        monkeypatch.setattr(recordids, "_merge", lambda *a: merges.append(len(a[2])) or real(*a))
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        assert len(sp.ids) == 300 and not sp.problems
        got, repeated = await sp.submit([(b"x" * 20, 1, None, b"rec%d" % i) for i in (0, 150, 299)], 1)
        assert repeated == 3 and got == [seqs[0], seqs[150], seqs[299]]
        await sp.aclose()
        return merges

    merges = run(main)
    assert len(merges) <= 2 and sum(merges) == 300, merges


def test_a_submit_cancelled_while_its_write_is_queued_still_answers_a_resubmit_of_its_id(tmp_path):
    """A cancelled submit's records are written all the same (node/seglog.py writes an
    abandoned commit: it may be part of a group already in flight). Its ids must stay
    'being written' until that write ends: released at the cancel, a resubmit of the same
    id in between found it nowhere and stored the record a second time."""
    import threading

    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        gate, real = threading.Event(), sp.log._write

        def held_write(*a):
            gate.wait(10)
            return real(*a)

        sp.log._write = held_write
        scope = trio.CancelScope()

        async def first():
            with scope:
                await sp.submit([(b"first", 1, None, b"X")], 5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sp.submit, [(b"other", 1, None, b"O")], 5)  # leads the group commit
            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()  # the write is held with both in it or queued
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            again = []

            async def resubmit():
                again.append(await sp.submit([(b"first", 1, None, b"X")], 5))

            nursery.start_soon(resubmit)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        stored = sorted(r.payload for r in sp.pending())
        await sp.aclose()
        return stored, again

    stored, again = run(main)
    assert stored == [b"first", b"other"], stored  # the cancelled submit's record, once
    assert again[0][1] == 1  # answered from its id


def test_a_submit_that_fits_only_without_its_ids_is_refused_at_once_not_queued_for_room(tmp_path):
    """The never-fits check counted the records alone, and the ids' entry was added to the
    room asked for after it: a submit that fits max_bytes only without its ids waited at the
    head of the room queue (first come first served: every other append behind it) for its
    whole timeout, then failed as SpoolFull, though it could never fit."""
    from patchswarm.node.spool import _record_bound

    async def main():
        bound = _record_bound(b"n1", b"r1", bytes(1000), 1)
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1", max_bytes=bound)
        t0 = trio.current_time()
        with pytest.raises(UsageError, match="could never fit"):
            await sp.submit([(bytes(1000), 1, None, b"X")], 3)
        waited = trio.current_time() - t0
        assert await sp.append([(bytes(1000), 1, None)], 1)  # the same without an id fits
        await sp.aclose()
        return waited

    assert run(main) < 1.0
