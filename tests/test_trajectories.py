"""Trajectories back to the trainer, as real processes: exactly once through SIGKILLs, and damage contained.

Nodes and the origin are killed (-9) and restarted while rollout workers
submit; every record whose submit was acknowledged must reach the origin
exactly once with its payload intact, and no record may arrive twice.
"""

from __future__ import annotations

import pytest
import base64
import random
import signal
import threading
import time
from pathlib import Path

from patchswarm.node.client import NodeClient, NodeError
from swarmlab import SwarmLab, Submitter, dump, summary, wait_spools_empty

pytestmark = pytest.mark.slow  # real processes


def test_every_acknowledged_record_arrives_exactly_once_through_kills(tmp_path):
    rng = random.Random(7)
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(wait=False)
        nodes = lab.start_nodes([(f"n{i}", f"r{i % 2}") for i in range(4)], starting=[origin])
        stop = threading.Event()
        workers = [Submitter(p, stop, random.Random(i), pause=0.005) for i, p in enumerate(nodes)]
        for w in workers:
            w.start()
        victims = [origin, *nodes]
        # The origin at least once. Four kills at random moments: the kills that land exactly
        # between the origin's commit and the node's ack are bench/reliability.py's (20 of them).
        kills = [origin, *(rng.choice(victims) for _ in range(3))]
        rng.shuffle(kills)
        for victim in kills:
            time.sleep(rng.uniform(0.5, 2.0))
            lab.kill(victim, signal.SIGKILL)
            time.sleep(rng.uniform(0.1, 1.0))
            lab.restart(victim)
        time.sleep(1.0)
        stop.set()
        for w in workers:
            w.join(timeout=30)
        wait_spools_empty(lab, nodes)
        records = dump(origin)

    acked = {p: (w.node.name, seq) for w in workers for p, seq in w.acked.items()}
    unacked = set().union(*(w.unacked for w in workers))
    assert sum(len(w.acked) for w in workers) > 200, "too few records went through to mean anything"
    seen: dict[bytes, int] = {}
    keys = set()
    for r in records:
        payload = base64.b64decode(r["payload_b64"])
        seen[payload] = seen.get(payload, 0) + 1
        assert (r["node_id"], r["seq"]) not in keys, f"stored twice: {r['node_id']} seq {r['seq']}"
        keys.add((r["node_id"], r["seq"]))
        assert r["policy_version"] == 3
        assert payload in acked or payload in unacked, "a record nobody submitted"
    for payload, (node, seq) in acked.items():
        assert seen.get(payload) == 1, f"acknowledged record {payload[:20]!r} ({node} seq {seq}) seen {seen.get(payload)} times"
    assert all(seen.get(p, 0) <= 1 for p in unacked)
    assert len(records) == len(seen)


def _corrupt_middle(segment: Path, needle: bytes) -> None:
    data = bytearray(segment.read_bytes())
    at = data.index(needle)
    data[at + len(needle) + 2] ^= 0xFF  # inside that record's payload
    segment.write_bytes(bytes(data))


def test_corrupt_spool_segment_and_torn_store_tail_lose_only_the_damage(tmp_path):
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        node = lab.start_node("n0")
        # No origin yet: everything stays in the spool.
        with NodeClient(node.socket) as c:
            seqs = [c.submit(f"record-{i:03d}-".encode() + bytes(200), 1) for i in range(60)]
        assert seqs == sorted(seqs) and len(set(seqs)) == 60
        lab.kill(node, signal.SIGKILL)
        (segment,) = sorted((node.data_dir / "spool").glob("*.seg"))
        _corrupt_middle(segment, b"record-030-")
        lab.restart(node)
        lab.wait_log(node, r"trajectory spool: .*(kept)")

        origin = lab.start_origin()
        wait_spools_empty(lab, [node])
        got = {base64.b64decode(r["payload_b64"])[:11] for r in dump(origin)}
        assert got == {f"record-{i:03d}-".encode() for i in range(60) if i != 30}

        # A torn tail of the origin's store (a write cut short by a crash) is truncated on restart.
        lab.kill(origin, signal.SIGKILL)
        (store_seg,) = sorted((origin.data_dir / "trajectories").glob("*.seg"))[-1:]
        with open(store_seg, "ab") as f:
            f.write(bytes(store_seg.read_bytes()[16:40]))  # the first 24 bytes of an entry, nothing more
        lab.restart(origin)
        lab.wait_log(origin, r"trajectory store: .*")
        with NodeClient(node.socket) as c:
            c.submit(b"after-the-tear", 2)
        wait_spools_empty(lab, [node])
        s = summary(origin)
        assert s["records"] == 60 and s["by_node"] == {"n0": 60} and s["duplicates_dropped"] == 0
        assert base64.b64decode(dump(origin)[-1]["payload_b64"]) == b"after-the-tear"


def _frozen_origin_with_records(lab: SwarmLab, n: int, extra: list[str] = ()):
    """An origin and a node; the origin stopped (SIGSTOP) once the node uploads to it, then
    `n` records submitted: acknowledged to the worker, held in the node's spool."""
    lab.start_tracker()
    origin = lab.start_origin()
    node = lab.start_node("a", extra=list(extra))
    with node.client() as c:
        c.submit(b"first", 0)
    wait_spools_empty(lab, [node])  # the node's session to the origin is up
    origin.popen.send_signal(signal.SIGSTOP)
    with node.client() as c:
        for i in range(n):
            c.submit(b"r%d" % i, 0)
    assert node.status()["spool"]["records"] == n
    return origin, node


def test_a_stopping_node_uploads_its_spool_before_it_exits_and_refuses_new_records(tmp_path):
    """A spot instance reclaimed or a host drained: SIGTERM, and then the host and its disk may
    be gone. The records the node's spool held (durable at the node, acknowledged to the
    worker) reach the origin before it exits; meanwhile it refuses submits (code "stopping",
    nothing stored) so the worker sends them to another node. Before, the node stopped at once
    and those records waited on a disk that might never come back."""
    with SwarmLab(tmp_path) as lab:
        origin, node = _frozen_origin_with_records(lab, 50)
        node.popen.send_signal(signal.SIGTERM)
        lab.wait_log(node, r"stopping: uploading the 50 records in the trajectory spool, for up to 20 s")
        with node.client() as c:
            with pytest.raises(NodeError) as e:
                c.submit(b"late", 0)
            assert e.value.code == "stopping" and c.status()["stopping"] is True
        time.sleep(1.0)
        assert node.alive(), "it waits for the origin, which is stopped"
        origin.popen.send_signal(signal.SIGCONT)
        assert node.popen.wait(timeout=30) == 0
        assert "the origin acknowledged every record the spool held (50)" in node.text()
        payloads = {base64.b64decode(r["payload_b64"]) for r in dump(origin)}
        assert {b"r%d" % i for i in range(50)} <= payloads and b"late" not in payloads


@pytest.mark.parametrize("how", ["deadline", "second signal"])
def test_a_stop_waits_for_the_spool_at_most_its_drain_time_or_until_a_second_signal(tmp_path, how):
    """With the origin unreachable the node exits after --drain-s (or at a second SIGTERM), saying
    how many records it left; they stay in its spool and upload when it starts again."""
    with SwarmLab(tmp_path) as lab:
        origin, node = _frozen_origin_with_records(lab, 20, ["--drain-s", "2" if how == "deadline" else "60"])
        t0 = time.monotonic()
        node.popen.send_signal(signal.SIGTERM)
        lab.wait_log(node, r"stopping: uploading the 20 records")
        if how == "second signal":
            node.popen.send_signal(signal.SIGTERM)
        assert node.popen.wait(timeout=30) == 0
        took = time.monotonic() - t0
        assert (1.8 <= took < 15) if how == "deadline" else took < 15, took
        assert "stopping with 20 of the spool's records not acknowledged by the origin" in node.text()
        origin.popen.send_signal(signal.SIGCONT)
        lab.restart(node)
        wait_spools_empty(lab, [node])
        payloads = {base64.b64decode(r["payload_b64"]) for r in dump(origin)}
        assert {b"r%d" % i for i in range(20)} <= payloads
