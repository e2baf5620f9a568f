"""The trajectory uploader, in process: batches go to the origin's session, leave the spool
only on the origin's ack, and everything unacked goes again when the origin's connection is
lost (the origin drops what it already has).

The origin is a session whose message stream only records what it is sent; the spool is real."""

import dataclasses

import trio
import trio.testing

from patchswarm.node.peers import Session
from patchswarm.node.spool import TrajectorySpool
from patchswarm.node.uploader import UPLOAD_WINDOW, TrajectoryUploader
from patchswarm.protocol import wire
from patchswarm.protocol.trajectory import decode_batch


@dataclasses.dataclass
class RecordingStream:
    sent: list = dataclasses.field(default_factory=list)
    wire_revision: str | None = wire.WIRE_REVISION  # what the TLS handshake selected

    async def send(self, msg) -> None:
        self.sent.append(msg)


def _origin(revision: str | None = wire.WIRE_REVISION) -> Session:
    return Session(RecordingStream(wire_revision=revision), "origin", "origin", "r0", "x:1", outbound=True)


def _seqs(s: Session) -> list[list[int]]:
    return [[r.seq for r in decode_batch(m.batch)] for m in s.ms.sent if isinstance(m, wire.Trajectories)]


async def _settle() -> None:
    await trio.sleep(1.0)  # the mock clock: past every linger and poll
    await trio.testing.wait_all_tasks_blocked()


def test_unacked_batches_go_again_to_the_next_origin_session_and_leave_on_ack(tmp_path):
    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            first, second = _origin(), _origin()
            origin = {"session": None}
            up = TrajectoryUploader(spool, lambda: origin["session"])
            async with trio.open_nursery() as n:
                n.start_soon(up.run)
                seqs = await spool.append([(b"a", 1, None), (b"b", 1, None)], timeout=5)
                await _settle()
                assert up.status()["batches_in_flight"] == 0  # no origin yet: nothing leaves
                origin["session"] = first
                await _settle()
                assert sum(_seqs(first), []) == seqs and up.in_flight == 1
                # The connection is lost before the ack: the daemon reports it, a new one comes.
                origin["session"] = None
                up.origin_lost()
                origin["session"] = second
                await _settle()
                assert sum(_seqs(second), []) == seqs and up.in_flight == 1
                await up.acked(seqs)
                await _settle()
                assert spool.stats()["records"] == 0 and up.in_flight == 0
                assert len(_seqs(second)) == 1  # acked: not sent again
                n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_at_most_a_window_of_batches_is_in_flight(tmp_path):
    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            origin = _origin()
            up = TrajectoryUploader(spool, lambda: origin)
            async with trio.open_nursery() as n:
                n.start_soon(up.run)
                for i in range(UPLOAD_WINDOW + 2):  # one batch each: the link was idle for the linger
                    await spool.append([(bytes([i]), 1, None)], timeout=5)
                    await _settle()
                assert len(_seqs(origin)) == UPLOAD_WINDOW == up.in_flight
                await up.acked(_seqs(origin)[0])
                await _settle()
                assert len(_seqs(origin)) == UPLOAD_WINDOW + 1
                n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# --- the origin's TrajectoriesBusy (wire revision 3) ----------------------------------------


def _sent_at(s: Session) -> list[tuple[float, list[int], int]]:
    """(time, seqs, bytes) of each batch sent to `s`."""
    return [(t, [r.seq for r in decode_batch(m.batch)], len(m.batch)) for t, m in s.ms.sent_at]


@dataclasses.dataclass
class TimedStream(RecordingStream):
    sent_at: list = dataclasses.field(default_factory=list)

    async def send(self, msg) -> None:
        self.sent.append(msg)
        if isinstance(msg, wire.Trajectories):
            self.sent_at.append((trio.current_time(), msg))


def test_a_busy_origin_gets_one_probe_per_backoff_and_every_record_once_when_it_takes_them_again(tmp_path):
    """An origin that answers every batch TrajectoriesBusy for 300 s, then acks. The node
    does not spin: after the first window it sends one probe of at most PROBE_BYTES per
    retry, never sooner than the origin's hint, the waits doubling up to DEFER_MAX_S; once
    the origin takes batches again every record is acked exactly once and the spool is empty."""
    from patchswarm.node.uploader import DEFER_MAX_S, PROBE_BYTES

    busy_s, retry_ms = 300.0, 1000

    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            origin = Session(TimedStream(), "origin", "origin", "r0", "x:1", outbound=True)
            up = TrajectoryUploader(spool, lambda: origin)
            seqs = await spool.append([(bytes([i]) * (64 << 10), 1, None) for i in range(200)], timeout=5)
            stored, busy_until = [], trio.current_time() + busy_s

            async def answer():  # the origin: each batch answered once, in order
                seen = 0
                while True:
                    await trio.sleep(0.01)
                    batches = origin.ms.sent_at[seen:]
                    seen += len(batches)
                    for _, msg in batches:
                        if trio.current_time() < busy_until:
                            up.deferred(retry_ms)
                        else:
                            got = [r.seq for r in decode_batch(msg.batch)]
                            stored.extend(got)
                            await up.acked(got)

            async with trio.open_nursery() as n:
                n.start_soon(up.run)
                n.start_soon(answer)
                with trio.fail_after(busy_s + 600):
                    while spool.stats()["records"]:
                        await trio.sleep(1.0)
                n.cancel_scope.cancel()
            return seqs, stored, _sent_at(origin), up.deferred_total, busy_until

    seqs, stored, sent, deferred, busy_until = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(stored) == seqs  # each record stored once: none lost, none twice
    during = [(t, got, size) for t, got, size in sent if t < busy_until]
    assert len(during) == deferred
    retries = during[UPLOAD_WINDOW:]  # after the first window, probes only
    assert all(len(got) * (64 << 10) <= PROBE_BYTES for _, got, _ in retries)  # of 64 KiB records
    gaps = [b[0] - a[0] for a, b in zip(during[UPLOAD_WINDOW - 1:], during[UPLOAD_WINDOW:])]
    assert min(gaps) >= retry_ms / 1000 and max(gaps) <= 1.25 * DEFER_MAX_S + 1
    # backoff 0.5, 1, 2 ... s, at most 30 s: about a dozen probes in 300 s, not thousands
    assert len(retries) <= 6 + busy_s / DEFER_MAX_S


def test_after_a_busy_answer_nothing_is_resent_until_every_batch_in_flight_has_its_answer(tmp_path):
    """The Busy names no batch: the node resends everything unacked only once every batch in
    flight is answered (acked or busy), so a batch the origin still holds is not sent twice."""
    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            origin = Session(TimedStream(), "origin", "origin", "r0", "x:1", outbound=True)
            up = TrajectoryUploader(spool, lambda: origin)
            async with trio.open_nursery() as n:
                n.start_soon(up.run)
                for i in range(UPLOAD_WINDOW):  # one batch each: the link was idle for the linger
                    await spool.append([(bytes([i]), 1, None)], timeout=5)
                    await _settle()
                first = [got for _, got, _ in _sent_at(origin)]
                assert len(first) == UPLOAD_WINDOW == up.in_flight
                up.deferred(10)  # batch 2 was refused; 0, 1, 3 are still held by the origin
                await spool.append([(b"new", 1, None)], timeout=5)
                await trio.sleep(60)
                await _settle()
                assert len(_sent_at(origin)) == UPLOAD_WINDOW  # nothing while 3 are unanswered
                for i in (0, 1):
                    await up.acked(first[i])
                await trio.sleep(60)
                await _settle()
                assert len(_sent_at(origin)) == UPLOAD_WINDOW  # one still unanswered
                await up.acked(first[3])
                await _settle()
                again = [got for _, got, _ in _sent_at(origin)][UPLOAD_WINDOW:]
                assert again == [first[2] + [first[3][0] + 1]]  # the refused batch again, the new record with it
                assert up.in_flight == 1
                await up.acked(again[0])
                await _settle()
                assert spool.stats()["records"] == 0 and up.status()["batches_deferred"] == 1
                n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_refused_batch_goes_again_when_no_new_record_comes(tmp_path):
    """Before: the loop waited for new records once everything was in flight, so a batch
    refused then stayed in the spool until the node's next record (or for ever)."""
    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            origin = Session(TimedStream(), "origin", "origin", "r0", "x:1", outbound=True)
            up = TrajectoryUploader(spool, lambda: origin)
            async with trio.open_nursery() as n:
                n.start_soon(up.run)
                seqs = await spool.append([(b"a", 1, None), (b"b", 1, None)], timeout=5)
                await _settle()
                assert [got for _, got, _ in _sent_at(origin)] == [seqs]
                up.deferred(2000)
                await trio.sleep(1.9)
                await trio.testing.wait_all_tasks_blocked()
                assert len(_sent_at(origin)) == 1  # not before the origin's hint
                await trio.sleep(60)
                await trio.testing.wait_all_tasks_blocked()
                assert [got for _, got, _ in _sent_at(origin)] == [seqs, seqs] and up.in_flight == 1
                n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
