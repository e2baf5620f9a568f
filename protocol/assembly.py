"""A chunk in parts on the wire: reassembling it, and what of it may be forwarded, with no I/O.

A `wire.Piece` carries bytes [offset, offset + len(data)) of a chunk of
`total` bytes. A sender sends one chunk's parts in order on one connection,
offset 0 first; parts of different chunks may interleave. Parts let a member
relay a chunk while it still arrives (cut-through): a region's gateway
forwards what came so far to the next region and to its neighbours, instead
of waiting for the whole chunk and then sending it again (store and forward
made the last chunks of a version cross two WAN links one after the other).

Owns `PART_BYTES` and `part_bytes_for` (the sender's part size) and `ChunkAssembly` (the
receiver's side: one chunk from one peer). A relay forwards everything but
the part that completed the chunk until the chunk has been verified against
its manifest, so an honest relay never hands on a whole chunk that is bad: a
receiver that assembles a bad chunk knows whom to blame. Must not verify
hashes (the caller holds the manifest) or know about peers.
"""

from __future__ import annotations

from .errors import ProtocolError, UsageError

# Bytes of a chunk per Piece message. A relay forwards a part once it is whole,
# so each hop adds a part's time on its link (a chunk's first part before anyone
# may relay it, its last one, held until the chunk verifies, after); each message
# costs the sender and the receiver a fixed amount of interpreter time. 64 KiB:
# 5 ms at 100 Mbit/s, 21 ms on the quarter of it a member of the origin's region
# gets while four share the origin. Against 128 KiB, side by side (issue 26,
# bench/RESULTS.md, 2026-12-05): the origin's region alone at a 100 Mbit/s LAN
# 2.10 s against 2.16 (means of 6 runs), in 3 regions x 4 at 100/50/20 Mbit/s
# 2.29 against 2.40 s and the 50 Mbit/s region 4.08 against 4.20 s.
PART_BYTES = 64 << 10
# A sender whose uplink is declared faster sends larger parts (`part_bytes_for`): at 100
# Mbit/s a part's time on the link is what the relay lags by, but at 1-10 Gbit/s a 64 KiB
# part takes 50-500 us, and each message's fixed cost at both ends takes the CPU instead
# (bench/transport.py: receiving costs 1.2-1.3 ms of CPU per MiB in 64 KiB parts, 0.7 in
# 1 MiB ones). So a part is sized to take about PART_SECONDS on the share of the uplink one
# of PART_SHARERS peers served at once gets, a power of two within [PART_BYTES, MAX_PART_BYTES]:
# 64 KiB up to ~300 Mbit/s, 256 KiB at 1 Gbit/s, 1 MiB from ~3.4 Gbit/s.
MAX_PART_BYTES = 1 << 20
PART_SECONDS = 0.01
PART_SHARERS = 4


def part_bytes_for(uplink_mbit: float | None) -> int:
    """The part size of a sender that declares this uplink (Mbit/s; None: PART_BYTES)."""
    if uplink_mbit is None:
        return PART_BYTES
    want = uplink_mbit * 1e6 / 8 / PART_SHARERS * PART_SECONDS
    size = PART_BYTES
    while size < MAX_PART_BYTES and size * 2 <= want:
        size *= 2
    return size


class ChunkAssembly:
    """The bytes of one chunk arriving from one peer, in order.

    `add` takes each part (ProtocolError if it does not continue the chunk);
    `forwardable` is how many leading bytes may go on to others now;
    `mark_verified()` releases the rest once the caller has checked the whole.
    """

    __slots__ = ("total", "received", "_buf", "_last_start", "verified")

    def __init__(self, total: int, expected_total: int):
        if total != expected_total:
            raise ProtocolError(f"piece: expected a chunk of {expected_total} bytes (its manifest's size), "
                                f"found a total of {total}")
        self.total = total
        self.received = 0
        self._buf = bytearray(total)
        self._last_start = 0  # where the part that completed the chunk began
        self.verified = False

    def add(self, offset: int, total: int, data: bytes) -> bool:
        """Append one part; True once the chunk is whole."""
        if total != self.total:
            raise ProtocolError(f"piece: expected total {self.total} for every part of the chunk, found {total}")
        if offset != self.received:
            raise ProtocolError(f"piece: expected the part at offset {self.received}, found offset {offset}")
        end = offset + len(data)
        if end > self.total or (not data and self.total):
            raise ProtocolError(f"piece: expected a non-empty part within {self.total} bytes, "
                                f"found {len(data)} bytes at offset {offset}")
        self._buf[offset:end] = data
        self._last_start = offset
        self.received = end
        return self.complete

    @property
    def complete(self) -> bool:
        return self.received == self.total

    @property
    def forwardable(self) -> int:
        """Leading bytes a relay may send on now: all that arrived, except the
        part that completed the chunk while it is unverified."""
        if not self.complete or self.verified:
            return self.received
        return self._last_start

    def mark_verified(self) -> None:
        """The caller checked the whole chunk against its manifest: all of it may go on."""
        if not self.complete:
            raise UsageError(f"mark_verified: the chunk is not whole ({self.received} of {self.total} bytes)")
        self.verified = True

    def prefix(self, n: int) -> "ChunkAssembly":
        """A new assembly of the same chunk holding this one's first `n` bytes (received)."""
        if not 0 <= n <= self.received:
            raise UsageError(f"prefix: expected at most the {self.received} bytes received, found {n}")
        other = ChunkAssembly(self.total, self.total)
        other._buf[:n] = memoryview(self._buf)[:n]
        other.received = other._last_start = n
        return other

    def data(self) -> bytearray:
        """The chunk's bytes (the assembly's own buffer: do not modify)."""
        return self._buf

    def view(self, start: int, end: int) -> bytes:
        """A copy of bytes [start, end), for a part sent on."""
        if not 0 <= start <= end <= self.forwardable:
            raise UsageError(f"view: expected a range within the {self.forwardable} forwardable bytes, "
                             f"found [{start}, {end})")
        with memoryview(self._buf) as mv:
            return bytes(mv[start:end])
