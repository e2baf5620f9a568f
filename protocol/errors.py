"""The one exception hierarchy of patchswarm.

Every error that protocol/, node/ or tracker/ raise on purpose derives from
`PatchswarmError`. As in h11, the split says whose fault it is:

- `UsageError`: the local caller misused an API (wrong argument types, asking
  for something that cannot exist).
- `InvalidInput` and its subclasses: bytes or state that came from elsewhere
  (a file, a peer, a patch) are not what they must be. Messages say what was
  expected and what was found.
"""


class PatchswarmError(Exception):
    """Base of every deliberate patchswarm error."""


class UsageError(PatchswarmError):
    """The local caller used an API wrongly."""


class InvalidInput(PatchswarmError):
    """Data from outside (file, peer, patch) is malformed or inconsistent."""


class CorruptData(InvalidInput):
    """Bytes do not decode: truncated, bad magic, bad checksum, bad framing."""


class UnsupportedFormat(InvalidInput):
    """A container or dtype this version does not know."""


class BaseMismatch(InvalidInput):
    """A patch or chunk does not fit the state it is applied to.

    Raised before anything is written: the state is unchanged.
    """


class AlreadyApplied(BaseMismatch):
    """The state already holds the values this chunk writes."""


class StateHashMismatch(InvalidInput):
    """A full-state hash differs from the one that was promised."""

    def __init__(self, what: str, expected: str, found: str):
        super().__init__(f"{what}: expected state hash {expected}, found {found}")
        self.expected = expected
        self.found = found


class ChunkGone(InvalidInput):
    """A chunk this member stored verified is no longer there whole (its file was removed, or
    changed on disk since: node/store.py `get_chunk`). Our disk's fault, not the object's: the
    chunk is fetched again."""


class ProtocolError(InvalidInput):
    """A peer sent frames or messages that break the wire protocol."""


class BudgetExceeded(ProtocolError):
    """A peer asked more of this node than one peer may (requests queued, bytes
    buffered, announcements per minute): `budget` names the limit."""

    def __init__(self, budget: str, message: str):
        super().__init__(message)
        self.budget = budget


class PeerRefused(ProtocolError):
    """The member we dialed answered our Hello with an Error: it refused the connection (over
    its admission budget, node/net/admission.py, or for our region, `WrongRegion`); the message
    says why and when to come back, `reason` is the Error's text alone."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class WrongRegion(ProtocolError):
    """A member's Hello names a region other than the one its certificate binds it to
    (node/net/trust.py): the region decides which chunks it brings into which region, so a
    member may not choose it where the swarm's operator chose it when issuing the certificate."""


class TruncatedStream(ProtocolError):
    """The stream ended (EOF) inside a frame: what a peer's process killed mid-send, or its
    connection cut, leaves. A lost connection rather than a malformed message: nothing
    that arrived is used, and nothing in it can do more than a disconnect can."""


class FrameTooLarge(ProtocolError):
    """A frame announced a length beyond the negotiated maximum."""


class SignatureError(InvalidInput):
    """A signature does not verify against the trusted key."""


class StaleVersion(InvalidInput):
    """A manifest is older than, or a replay of, what is already known."""


class ConflictingManifest(InvalidInput):
    """Two validly signed manifests name the same object with different content."""


class SpoolFull(PatchswarmError):
    """The trajectory spool stayed at its size limit for the whole timeout; nothing was written."""


class StorageFailed(PatchswarmError):
    """A durable write or fsync failed: nothing of it was acknowledged. The segment log cuts its
    files back and takes the next append (node/seglog.py); while it cannot, appends fail with this."""


class DiskFull(StorageFailed):
    """Our own disk had no room (ENOSPC, EDQUOT) for a write: nothing of it was kept, nothing
    was acknowledged, and the same write may succeed once space is freed."""
