"""Large signed manifests verified and decoded off the event loop, for the node's and the tracker's book.

Owns `ManifestCheck`: `await check(envelope)` gives the `Verified` (protocol/versions.py)
of an envelope of OFF_LOOP_BYTES or more, its signature checked and its manifest decoded
in a worker thread, for `VersionBook.offer(..., verified=...)`; None where the book is to
check inline: a smaller envelope, one the book already holds (it knows them by digest) or
would refuse unread (stale, or superseded by a keyframe it holds), or
one whose check failed (the book repeats it and raises the error where its caller counts
it; a bad signature fails before any decode, so the repeat is cheap). Must not decide
what is trusted: the book does.

Why: a form-2 keyframe manifest of a 140,000-tensor model is 171 KB and takes 0.47 s of
one core to verify and decode (bench/manifest_size.py, "keyframe verify+decode s"), once
per keyframe on every node and on the tracker. On the event loop that held up every
heartbeat, chunk answer and peer message for as long. In a thread the decode holds the
GIL too, but the interpreter hands it back to the loop's thread every switch interval
(5 ms), so the loop keeps turning (tests/test_manifestcheck.py measures its ticks).

Small envelopes stay inline: a thread hop costs about what decoding 1 KiB does, and tests
on trio's MockClock(autojump_threshold=0) see a task waiting for a thread as idle and jump
the clock. One decode at a time (a CapacityLimiter of 1): the same keyframe comes from the
tracker and several peers within a second; later copies wait for the first's check and
then find the manifest in the book, so it is decoded once.
"""

from __future__ import annotations

import hashlib

import trio

from patchswarm.protocol.errors import InvalidInput
from patchswarm.protocol.versions import Verified, VersionBook

# An envelope this large or larger is checked in a thread. Form 2 packs a tensor row in
# 0.6-1.2 bytes of zstd where names are regular (measured, 2026-12-05: 5,000 rows in 3.5 KB,
# 19 ms to verify and decode; 27,000 in 17 KB, 146 ms; 100,000 in 63 KB, 0.61 s), so under
# 4 KiB the loop stands still ~25 ms at worst; a form-1 table or a chunk table costs a few
# µs per 40-100 bytes, ~0.5 ms below it.
OFF_LOOP_BYTES = 4 << 10


class ManifestCheck:
    def __init__(self, book: VersionBook, off_loop_bytes: int = OFF_LOOP_BYTES):
        self.book = book
        self.off_loop_bytes = off_loop_bytes
        self._limiter = trio.CapacityLimiter(1)
        self._checking: dict[bytes, trio.Event] = {}  # envelopes' digests -> set when their check ends
        self.off_loop = 0  # envelopes checked in a thread

    async def check(self, envelope: bytes, current_version: int | None = None,
                    drop_superseded: bool = False) -> Verified | None:
        """The envelope verified in a worker thread when it is large and new, else None
        (`current_version`, `drop_superseded`: the caller's, as it gives `offer`; an
        envelope the book refuses unread is not checked)."""
        if not isinstance(envelope, (bytes, bytearray)) or len(envelope) < self.off_loop_bytes:
            return None
        digest = hashlib.sha256(envelope).digest()
        running = self._checking.get(digest)
        if running is not None:  # a copy of one being checked: by the time this wakes, the book holds it
            await running.wait()
            return None
        if not self.book.needs_check(envelope, current_version, drop_superseded):
            return None
        done = self._checking[digest] = trio.Event()
        try:
            verified = await trio.to_thread.run_sync(self.book.verify, bytes(envelope), limiter=self._limiter)
            self.off_loop += 1
            return verified
        except InvalidInput:
            return None
        finally:
            # No checkpoint from here to the caller's `offer`: a copy waiting on `done` runs
            # only after the first one's manifest is in the book.
            del self._checking[digest]
            done.set()
