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

    async def send(self, msg) -> None:
        self.sent.append(msg)


def _origin() -> Session:
    return Session(RecordingStream(), "origin", "origin", "r0", "x:1", outbound=True)


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
