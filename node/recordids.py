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
there. A lookup is a dict probe or two and one binary search. Memory is at most
`window * 24 + 2 * SEAL_EVERY * ~130` bytes (2^20 identities: ~24 MiB + ~16 MiB),
the same after a day as after a minute, plus the merge's temporary copy (~2x the
arrays, while it runs). A merge is one sort of the new part and one copy of the
arrays (~0.2 s at 2^20, in a worker thread: node/spool.py), a few us per identity.
"""

from __future__ import annotations

import numpy as np
import trio

from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.trajectory import RECORD_KEY_BYTES

DEFAULT_WINDOW = 1 << 20  # identities remembered: the newest this many identified records
SEAL_EVERY = 1 << 16  # dict entries merged into the sorted arrays at a time
_KEY = f"S{RECORD_KEY_BYTES}"  # every key is exactly RECORD_KEY_BYTES: no two differ only by trailing NULs


class RecordIdIndex:
    """key -> seq for the newest `window` identities (module docstring).

    Sealing (the merge into the arrays) is O(window): ~0.2 s at 2^20. The spool runs it
    off the event loop: `seal_begin()` sets the dict aside (lookups still see it),
    `merged(...)` (any thread: pure) builds the new arrays, `seal_end()` puts them in.
    `seal()` does all three at once (recovery, tests)."""

    def __init__(self, window: int = DEFAULT_WINDOW, seal_every: int = SEAL_EVERY):
        if type(window) is not int or window < 1 or type(seal_every) is not int or seal_every < 1:
            raise UsageError(f"record id window: expected ints >= 1, found window={window!r}, seal_every={seal_every!r}")
        self.window = window
        self._seal_every = min(seal_every, window)  # a small window is not held up by a large dict
        self._recent: dict[bytes, int] = {}
        self._sealing: dict[bytes, int] = {}  # set aside by seal_begin, until seal_end
        self._keys = np.empty(0, dtype=_KEY)
        self._seqs = np.empty(0, dtype=np.uint64)
        self.forgotten = 0  # identities dropped past the window

    def __len__(self) -> int:
        return len(self._recent) + len(self._sealing) + len(self._keys)

    def get(self, key: bytes) -> int | None:
        seq = self._recent.get(key)
        if seq is None and self._sealing:
            seq = self._sealing.get(key)
        if seq is not None or not len(self._keys):
            return seq
        i = int(np.searchsorted(self._keys, key))
        # compared as raw bytes: an element read as np.bytes_ loses trailing NULs
        if i < len(self._keys) and self._keys[i:i + 1].tobytes() == key:
            return int(self._seqs[i])
        return None

    def add(self, keys, seqs) -> None:
        """Remember keys[i] -> seqs[i] (a key already known keeps its first seq: the
        caller looked it up first, so this is a recovery reading it twice)."""
        recent = self._recent
        for k, s in zip(keys, seqs):
            if k not in recent:
                recent[k] = s

    def seal_due(self) -> bool:
        """The dict is full and no seal is under way."""
        return len(self._recent) >= self._seal_every and not self._sealing

    def seal_begin(self) -> tuple:
        """Set the dict aside; the arguments for `merged`."""
        if self._sealing:
            raise UsageError("record id index: a seal is already under way")
        self._sealing, self._recent = self._recent, {}
        return self._keys, self._seqs, list(self._sealing), list(self._sealing.values()), self.window

    def seal_end(self, merged: tuple | None) -> None:
        """Put in what `merged` built (None: it failed; the dict set aside comes back)."""
        if merged is None:
            self._recent = {**self._sealing, **self._recent}
        else:
            self._keys, self._seqs, dropped = merged
            self.forgotten += dropped
        self._sealing = {}

    async def seal_off_loop(self) -> None:
        """`seal` with the merge in a worker thread (O(window): ~0.2 s at 2^20, too long for
        an event loop); the caller waits for it. Lookups see every key meanwhile."""
        work = self.seal_begin()
        result = None
        try:
            with trio.CancelScope(shield=True):  # bounded CPU work; the dict set aside must come back
                result = await trio.to_thread.run_sync(merged, *work)
        finally:
            self.seal_end(result)

    def seal(self) -> None:
        """Merge the dict into the sorted arrays now and drop what falls out of the window."""
        if self._recent and not self._sealing:
            self.seal_end(merged(*self.seal_begin()))

    def add_packed(self, seqs: bytes, keys: bytes) -> None:
        """Add a RecordIds entry's packed arrays (recovery) without a Python object per identity."""
        self.seal()
        s = np.frombuffer(seqs, dtype="<u8").astype(np.uint64)
        k = np.frombuffer(keys, dtype=_KEY)
        self._keys, self._seqs, dropped = _merge(self._keys, self._seqs, k, s, self.window)
        self.forgotten += dropped

    def packed_parts(self) -> tuple:
        """What `packed` needs, taken now (the arrays are never changed in place, only replaced)."""
        items = [*self._sealing.items(), *self._recent.items()]
        return self._seqs, self._keys, [s for _, s in items], [k for k, _ in items]

    def packed(self) -> tuple[bytes, bytes]:
        """Everything remembered as (seqs u64 LE, keys): what the spool writes to its `ids` file."""
        return packed(*self.packed_parts())


def packed(seqs: np.ndarray, keys: np.ndarray, more_seqs: list, more_keys: list) -> tuple[bytes, bytes]:
    """`RecordIdIndex.packed` from its `packed_parts` (any thread)."""
    return (seqs.astype("<u8").tobytes() + np.array(more_seqs, dtype="<u8").tobytes(),
            keys.tobytes() + b"".join(more_keys))


def merged(keys: np.ndarray, seqs: np.ndarray, new_keys: list, new_seqs: list, window: int):
    """(keys, seqs, how many dropped): the sorted arrays with the new identities in, the
    newest `window` kept. Pure: any thread (numpy lets go of the GIL for most of it)."""
    return _merge(keys, seqs, np.array(new_keys, dtype=_KEY), np.array(new_seqs, dtype=np.uint64), window)


def _merge(keys, seqs, k, s, window):
    order = np.argsort(k, kind="stable")
    k, s = k[order], s[order]
    # a key twice (a recovery reads it from a segment and from the ids file): keep the first seq
    if len(k) > 1:
        first = np.ones(len(k), dtype=bool)
        first[1:] = k[1:] != k[:-1]
        k, s = k[first], s[first]
    if len(keys):
        at = np.searchsorted(keys, k)
        inside = at < len(keys)
        known = np.zeros(len(k), dtype=bool)
        known[inside] = keys[at[inside]] == k[inside]
        k, s, at = k[~known], s[~known], at[~known]
        keys, seqs = np.insert(keys, at, k), np.insert(seqs, at, s)
    else:
        keys, seqs = k, s
    excess = len(keys) - window
    if excess <= 0:
        return keys, seqs, 0
    cut = np.partition(seqs, excess)[excess]  # seqs are distinct: the newest `window` are >= cut
    keep = seqs >= cut
    return keys[keep], seqs[keep], int(len(keep) - np.count_nonzero(keep))
