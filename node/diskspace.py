"""Our own disk failing a write: one notion of it for a member, apart from any peer's fault.

Owns `DiskCondition`: what a member knows about the disk under its data dir
(the last write of ours that failed, how often, whether any write succeeded
since), the one log line that says so (what could not be written, the bytes
free, when it is tried again; at most one such line per LOG_EVERY_S while the
condition lasts, and one when it ends), and the backoff before the writes
that failed are tried again. `ours(e)` says which errors are the disk's:
ENOSPC, EDQUOT, EIO, EROFS.

Why a notion of its own: a write that fails on a full disk is neither a
peer's fault (the chunk it sent verified) nor a reason to stop (what is held
can still be served, trajectories still uploaded). So callers must not let
such an OSError reach code that would drop the peer or end the process: they
drop the write (and its temporary), keep going, and try again when
`may_retry()` says so. Must not retry anything itself nor decide what to drop.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from patchswarm.protocol.errors import DiskFull

log = logging.getLogger("patchswarm.disk")

OUR_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
RETRY_FIRST_S = 1.0  # backoff after the first failure, doubled per failure since the last success
RETRY_MAX_S = 10.0
LOG_EVERY_S = 60.0  # at most one warning line per this while the disk keeps failing


def ours(e: BaseException) -> bool:
    """Whether `e` is our disk failing a write (full, over quota, an I/O error, read-only)."""
    return isinstance(e, OSError) and e.errno in OUR_DISK_ERRNOS


def full(e: BaseException) -> bool:
    """Whether `e` is our disk having no room: the same write may succeed once space is freed."""
    return isinstance(e, OSError) and e.errno in FULL_ERRNOS


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class DiskCondition:
    """The disk under `path` as a member's writes find it. Thread-safe enough for its use:
    every method only sets a few fields (a write in a worker thread may report here)."""

    def __init__(self, path: str | os.PathLike, clock=time.monotonic):
        self.path = Path(path)
        self._clock = clock
        self.failures = 0  # writes of ours that failed on our disk, since start
        self.failing = False  # the last write failed and none succeeded since
        self.last_error: str | None = None
        self._streak = 0  # failures since the last success: the backoff's exponent
        self._retry_at = 0.0
        self._logged_at = -float("inf")
        self._quiet = 0  # failures not logged since the last line

    def failed(self, what: str, e: BaseException) -> None:
        """A write of `what` failed with `e` (an OSError, or DiskFull) on our disk: nothing of it was kept."""
        now = self._clock()
        self.failures += 1
        self._streak += 1
        self.failing = True
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self._streak - 1))
        self._retry_at = now + delay
        free = free_bytes(self.path)
        no_room = full(e) or isinstance(e, DiskFull)
        self.last_error = (f"could not write {what} ({'no space left' if no_room else e.strerror or e}); "
                           f"{'unknown' if free is None else f'{free:,}'} bytes free on {self.path}")
        if now - self._logged_at >= LOG_EVERY_S:
            more = f" ({self._quiet} more failed writes since the last line)" if self._quiet else ""
            log.warning("disk %s: %s; serving what is held, retrying in %.0f s%s",
                        "full" if no_room else "error", self.last_error, delay, more)
            self._logged_at, self._quiet = now, 0
        else:
            self._quiet += 1

    def succeeded(self) -> None:
        """A write of ours went through: the condition, if any, is over."""
        if not self.failing:
            return
        log.warning("disk writes on %s succeed again after %d failed writes", self.path, self._streak)
        self.failing, self._streak, self._quiet = False, 0, 0
        self._logged_at = -float("inf")

    def may_retry(self) -> bool:
        """Whether writes that failed should be tried again now (always, unless failing)."""
        return not self.failing or self._clock() >= self._retry_at

    def retry_in(self) -> float:
        """Seconds until `may_retry()` (0 when not failing)."""
        return max(0.0, self._retry_at - self._clock()) if self.failing else 0.0

    def status(self) -> dict:
        return {"disk_full": self.failing, "disk_write_failures": self.failures, "disk_error": self.last_error,
                "disk_free_bytes": free_bytes(self.path)}
