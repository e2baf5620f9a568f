"""Uploading: spooled trajectories to the origin, each batch resent until the origin acks it.

Owns `TrajectoryUploader`: the loop that takes batches from the node's
`TrajectorySpool` (node/spool.py) and sends them to the origin over its peer
session, the window of batches in flight, what happens when the origin's
connection goes (everything unacked is requeued and sent again; the origin
drops what it already has), the acks (records leave the spool only then),
the origin's deferrals (TrajectoriesBusy, wire revision 3: a batch it had
no room for, dropped there and sent again from here after a backoff), the
record keys sent with the records to an origin of wire revision 4 (it drops a
record whose key it holds, from any node), and the recent upload rate, for status. Must not open connections (the
dialer does) or take trajectories in (the local API appends to the spool).
"""

from __future__ import annotations

import collections
import math
import random
from typing import Callable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.trajectory import encode_batch

from patchswarm.node import failpoints
from patchswarm.node.net.transport import CONNECTION_ERRORS, one_line
from patchswarm.node.peers import Session
from patchswarm.node.spool import TrajectorySpool
from patchswarm.node.wakeup import Wakeup

UPLOAD_WINDOW = 4  # trajectory batches in flight to the origin before waiting for acks
UPLOAD_BATCH_BYTES = 4 << 20
UPLOAD_LINGER = 0.05  # s between upload batches unless one fills up (see run)
UPLOAD_FILL_BYTES = 1 << 20  # a batch this large leaves without waiting out the linger
RATE_WINDOW_S = 5.0  # the upload rate in status is over this many seconds
POLL_S = 1.0  # with no origin, or a full window, the loop looks again at least this often
# After the origin deferred a batch: the next one waits the origin's hint, or this doubled per
# deferral in a row (whichever is longer, at most DEFER_MAX_S, times 1 to 1.25 so that nodes
# deferred together do not come back together), and is a probe: one batch of at most
# PROBE_BYTES in flight until an ack says the origin takes batches again. A node kept waiting
# by a stuck store so sends at most PROBE_BYTES per DEFER_MAX_S.
DEFER_FIRST_S = 0.5
DEFER_MAX_S = 30.0
PROBE_BYTES = 256 << 10
DRAIN_POLL_S = 0.05  # while a stop waits for the spool's last acks (drain)


def _reads_keys(s: Session) -> bool:
    """The origin's connection selected a wire revision that reads record keys in a batch."""
    return wire.revision(s.ms.wire_revision) >= wire.RECORD_KEYS_REVISION


class TrajectoryUploader:
    def __init__(self, spool: TrajectorySpool, origin: Callable[[], Session | None]):
        self.spool = spool
        self._origin = origin  # the live session to the origin, if any
        self.in_flight = 0  # batches sent and not acked yet
        self._wakeup = Wakeup()
        self._sent: collections.deque[tuple[float, int]] = collections.deque()  # (time, bytes) sent
        self.deferrals = 0  # batches the origin deferred since its last ack
        self.deferred_total = 0
        self._retry_at = -math.inf  # no batch leaves before this (the origin's deferral)
        self._resend_when_drained = False  # a batch was deferred: requeue once none is in flight
        self._rng = random.Random()

    async def run(self) -> None:
        """Stream spooled trajectories to the origin; they leave the spool only on its ack.

        A batch costs about the same whatever it holds: here an encode, a TLS send
        and an ack to take in; at the origin a decode, a group commit and an ack.
        Sent as soon as records landed, one-record submits made batches of ~6
        records and those costs were a third of the CPU per record. So after a
        batch leaves, the next one waits up to UPLOAD_LINGER for more records (or
        until it holds UPLOAD_FILL_BYTES); a record that finds the link idle for
        that long leaves at once. Upload latency grows by at most the linger;
        nothing waits for it at the submitter."""
        last_sent = -math.inf
        while True:
            # After a refusal nothing leaves until every batch in flight has its answer
            # (`_resend_if_drained`), nor before the retry time.
            if self._origin() is None or self.in_flight >= self._window() or self._resend_when_drained:
                await self._wakeup.wait(POLL_S)
                continue
            if trio.current_time() < self._retry_at:
                await self._wakeup.wait(min(POLL_S, self._retry_at - trio.current_time()))
                continue
            await self.spool.wait_pending()
            if trio.current_time() < last_sent + UPLOAD_LINGER:
                with trio.move_on_at(last_sent + UPLOAD_LINGER):
                    await self.spool.wait_pending_bytes(UPLOAD_FILL_BYTES)
            if self._resend_when_drained or trio.current_time() < self._retry_at or self.in_flight >= self._window():
                continue  # refused while it waited for records: look again
            batch = await self.spool.next_batch(max_bytes=PROBE_BYTES if self.deferrals else UPLOAD_BATCH_BYTES)
            s = self._origin()  # again: the wait may have outlived a connection
            # Record keys only to an origin that reads them (wire revision 4): one before
            # would refuse the batch and drop this node, at every resend.
            keys = self.spool.keys_of(batch) if s is not None and _reads_keys(s) else None
            data = encode_batch(batch, keys)
            try:
                if s is None:
                    raise trio.ClosedResourceError("no connection to the origin")
                self.in_flight += 1
                await s.send(wire.Trajectories(data))
            except CONNECTION_ERRORS as e:
                # Whatever was handed out goes again later; the origin drops what it already has.
                self.spool.requeue()
                if s is not None:
                    s.close(f"could not send trajectories ({one_line(e)})")
                continue
            await failpoints.hold("upload.sent")  # a kill here: sent, maybe stored, surely not acked
            now = last_sent = trio.current_time()
            self._sent.append((now, len(data)))
            while self._sent and self._sent[0][0] < now - RATE_WINDOW_S:
                self._sent.popleft()

    def _window(self) -> int:
        """Batches that may be in flight: one probe after a refusal, until an ack."""
        return 1 if self.deferrals else UPLOAD_WINDOW

    def _resend_if_drained(self) -> None:
        """After a refusal, once every batch in flight has its answer: everything unacked is
        pending again, the refused batch with it (the origin answers each batch once and
        names none; see wire.TrajectoriesBusy). Wakes the loop even while it waits for
        records (the spool's requeue does)."""
        if self._resend_when_drained and self.in_flight == 0:
            self._resend_when_drained = False
            self.spool.requeue()
            self._wakeup.set()

    def origin_lost(self) -> None:
        """The origin's connection is gone: batches in flight on it may never be acked, so
        everything unacked goes again (the origin drops what it already has)."""
        self.in_flight = 0
        self._resend_when_drained = False  # done here
        self.spool.requeue()
        self._wakeup.set()

    def deferred(self, retry_ms: int) -> None:
        """The origin had no room for one batch in flight and dropped it (wire revision 3):
        it goes again once every batch in flight has its answer, not before the origin's
        `retry_ms` nor before this node's backoff (DEFER_FIRST_S doubled per deferral in a
        row, at most DEFER_MAX_S), one probe batch at a time until an ack."""
        self.in_flight = max(0, self.in_flight - 1)
        self.deferrals += 1
        self.deferred_total += 1
        backoff = DEFER_FIRST_S * 2.0 ** min(self.deferrals - 1, 30)
        wait = min(DEFER_MAX_S, max(retry_ms / 1000, backoff)) * self._rng.uniform(1.0, 1.25)
        self._retry_at = max(self._retry_at, trio.current_time() + wait)
        self._resend_when_drained = True
        self._resend_if_drained()
        self._wakeup.set()

    async def acked(self, seqs) -> None:
        """The origin stored a batch durably: its records leave the spool."""
        await failpoints.hold("upload.acked")  # a kill here: stored at the origin, still in the spool
        self.in_flight = max(0, self.in_flight - 1)
        self.deferrals = 0  # the origin takes batches again: the full window, no backoff
        self._wakeup.set()
        await self.spool.ack(seqs)
        self._resend_if_drained()  # after the ack: these records are not pending again

    async def drain(self, seconds: float) -> None:
        """Keep uploading until the origin has acknowledged every record in the spool, for
        at most `seconds` (`spool.unacked` says what is left). For a stop (the node refuses
        new records meanwhile). *Why:* a spot instance reclaimed, or a host drained, loses
        its disk with it: a record the spool held, durable at the node and answered as
        such, was lost when the node stopped at once on SIGTERM."""
        with trio.move_on_after(seconds):
            while self.spool.unacked:
                await trio.sleep(DRAIN_POLL_S)

    def status(self) -> dict:
        st = self.spool.stats()
        now = trio.current_time()
        recent = sum(b for t, b in self._sent if t >= now - RATE_WINDOW_S)
        return {"records": st["records"], "bytes": st["bytes"], "appended_total": st["appended_total"],
                "acked_total": st["acked_total"], "upload_rate_bps": recent / RATE_WINDOW_S,
                "batches_in_flight": self.in_flight, "disk_full": st["disk_full"],
                "batches_deferred": self.deferred_total,
                # record ids (node/spool.py): remembered, and resubmits answered from them
                "record_ids": st["record_ids"], "repeated_total": st["repeated_total"]}
