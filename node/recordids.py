"""The spool's memory of record identities: which client record id was stored under which seq.

Owns `RecordIdIndex`, an in-memory map from a record key (protocol.trajectory.record_key
of the client's id: 16 bytes) to the seq it was stored under, for the newest `window`
identities. Must not touch files: node/spool.py makes identities durable (in the
segments, next to their records, and in its `ids` file once those are trimmed) and
feeds them here, on open and as records land.

Layout, for a bounded and small cost per identity: the newest identities sit in a
dict (`_recent`, at most SEAL_EVERY of them, ~130 bytes each); every SEAL_EVERY
additions they are merged into two numpy arrays sorted by key (`S16` keys and u64
seqs: 24 bytes per identity), and past `window` the oldest by seq are dropped
there. A lookup is a dict probe and one binary search. Memory is at most
`window * 24 + SEAL_EVERY * ~130` bytes (2^20 identities: ~24 MiB + ~8 MiB), the
same after a day as after a minute; a merge is one sort of the new part and one
copy of the arrays, amortised ~1 us per identity.
"""

from __future__ import annotations

import numpy as np

from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.trajectory import RECORD_KEY_BYTES

DEFAULT_WINDOW = 1 << 20  # identities remembered: the newest this many identified records
SEAL_EVERY = 1 << 16  # dict entries merged into the sorted arrays at a time
_KEY = f"S{RECORD_KEY_BYTES}"  # every key is exactly RECORD_KEY_BYTES: no two differ only by trailing NULs


class RecordIdIndex:
    """key -> seq for the newest `window` identities (module docstring)."""

    def __init__(self, window: int = DEFAULT_WINDOW, seal_every: int = SEAL_EVERY):
        if type(window) is not int or window < 1 or type(seal_every) is not int or seal_every < 1:
            raise UsageError(f"record id window: expected ints >= 1, found window={window!r}, seal_every={seal_every!r}")
        self.window = window
        self._seal_every = seal_every
        self._recent: dict[bytes, int] = {}
        self._keys = np.empty(0, dtype=_KEY)
        self._seqs = np.empty(0, dtype=np.uint64)
        self.forgotten = 0  # identities dropped past the window

    def __len__(self) -> int:
        return len(self._recent) + len(self._keys)

    def get(self, key: bytes) -> int | None:
        seq = self._recent.get(key)
        if seq is not None or not len(self._keys):
            return seq
        i = int(np.searchsorted(self._keys, key))
        # compared as raw bytes: an element read as np.bytes_ loses trailing NULs
        if i < len(self._keys) and self._keys[i:i + 1].tobytes() == key:
            return int(self._seqs[i])
        return None

    def add(self, keys, seqs) -> None:
        """Remember keys[i] -> seqs[i] (a later add of a key replaces nothing: the first seq stays)."""
        recent = self._recent
        for k, s in zip(keys, seqs):
            if k not in recent:
                recent[k] = s
        if len(recent) >= self._seal_every:
            self.seal()

    def add_packed(self, seqs: bytes, keys: bytes) -> None:
        """Add a RecordIds entry's packed arrays (recovery) without making a Python object per identity."""
        s = np.frombuffer(seqs, dtype="<u8").astype(np.uint64)
        k = np.frombuffer(keys, dtype=_KEY)
        self._merge(k, s)

    def seal(self) -> None:
        """Merge the dict into the sorted arrays and drop what falls out of the window."""
        if not self._recent:
            return
        k = np.array(list(self._recent), dtype=_KEY)
        s = np.fromiter(self._recent.values(), dtype=np.uint64, count=len(self._recent))
        self._recent = {}
        self._merge(k, s)

    def _merge(self, k: np.ndarray, s: np.ndarray) -> None:
        order = np.argsort(k, kind="stable")
        k, s = k[order], s[order]
        # a key twice (a recovery reads it from a segment and from the ids file): keep the first seq
        if len(k) > 1:
            first = np.ones(len(k), dtype=bool)
            first[1:] = k[1:] != k[:-1]
            k, s = k[first], s[first]
        if len(self._keys):
            at = np.searchsorted(self._keys, k)
            inside = at < len(self._keys)
            known = np.zeros(len(k), dtype=bool)
            known[inside] = self._keys[at[inside]] == k[inside]
            k, s, at = k[~known], s[~known], at[~known]
            self._keys = np.insert(self._keys, at, k)
            self._seqs = np.insert(self._seqs, at, s)
        else:
            self._keys, self._seqs = k, s
        excess = len(self._keys) - self.window
        if excess > 0:  # keep the newest `window` by seq
            cut = np.partition(self._seqs, excess)[excess]
            keep = self._seqs >= cut
            self.forgotten += int(len(keep) - keep.sum())
            self._keys, self._seqs = self._keys[keep], self._seqs[keep]

    def packed(self) -> tuple[bytes, bytes]:
        """Everything remembered as (seqs u64 LE, keys): what the spool writes to its `ids` file."""
        self.seal()
        return self._seqs.astype("<u8").tobytes(), self._keys.tobytes()
