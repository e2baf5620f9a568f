"""Faster paths through aiortc's SCTP, for one association at a time, checked against aiortc's version.

Owns: `speed_up(sctp)`, which replaces a few methods of one
`aiortc.rtcsctptransport.RTCSctpTransport` object (never the class: a stock
peer in the same process stays stock) with versions that do the same thing
with less work per packet, and `SUPPORTED`, the aiortc versions whose
internals these were written and tested against; on any other version, or
if an attribute they rely on is missing, `speed_up` changes nothing and
returns False (stock behaviour). Must not change what goes on the wire: a
sped-up peer and a stock one exchange the same packets in the same order
(tests/test_sctpfast.py runs one against the other); nor know about
streams, trio or the swarm.

What each replacement saves (measured in bench/RESULTS.md, "Transport:
WebRTC data channels"):

- Reassembly. aiortc keeps a stream's received fragments in a list and,
  after every DATA chunk, walks that list from the start looking for a
  complete message (`InboundStream.pop_messages`): a message of n fragments
  costs n*(n+1)/2 steps, ~25,000 for one 256 KiB message of 1,172-byte
  fragments. A chunk that lands after every other one and does not end a
  message cannot complete one, and nothing else that decides delivery
  changed (a stream's next sequence number moves only when a message is
  delivered), so that walk is skipped for it; any other chunk, and every
  FORWARD TSN, takes aiortc's own walk.
- Retransmission scan. Before sending new data, aiortc's `_transmit` (run
  on every SACK and every message queued) walks the whole sent queue looking
  for chunks marked for retransmission: O(cwnd) per packet, ~800 chunks once
  the window has opened. Chunks are marked only by a SACK with gap blocks or
  by the T3 timer; a sped-up sender notes those two events and walks the
  queue (aiortc's own `_transmit`) only while a mark may be pending, and
  otherwise runs the same new-data part of `_transmit` without the walk.
- Window. aiortc's sender ignores the receive window its peer advertises
  (a_rwnd only seeds ssthresh): cwnd grows until packets are lost, and on a
  fast path the first thing to overflow is the receiver's UDP socket buffer
  (212,992 bytes by default: ~90 packets), so every burst past it is lost
  and retransmitted after a timeout. A sped-up sender keeps cwnd within the
  a_rwnd its peer announced at association start (RFC 9260 section 6.1
  rule A, simplified: aiortc's receiver hands every message on as it
  completes, so its a_rwnd stays near the initial one), and a sped-up
  receiver announces `receive_window`: what its socket buffer can hold
  (node/net/webrtc.py sizes it). A stock peer still sends past it: it never
  honoured any window.
- Received TSNs. aiortc adds every TSN to a set, sorts the set and rebuilds
  it (`_mark_received`); the TSN right after the cumulative one with nothing
  out of order pending only moves the cumulative TSN, so that case is done
  directly and every other case is aiortc's.
- SACKs. aiortc sends one SACK per packet received. A SACK costs its sender
  a packet built, encrypted and sent, and its receiver a datagram read,
  decrypted and handled: about a third of a sender's CPU per DATA packet.
  A sped-up receiver whose ICE connection has more datagrams queued defers
  the SACK to the end of that run, at most `sack_every` packets, so one
  SACK answers a burst (node/net/udpreads.py makes bursts arrive queued).
  It still acknowledges at once whatever RFC 9260 section 6.7 asks to be
  acknowledged at once (a gap, a duplicate), and a deferred SACK is sent at
  the latest on the loop's next turn. RFC 9260 section 6.2 says a receiver
  SHOULD acknowledge at least every second packet; this stretches that to a
  burst, as Linux's TCP does with coalesced segments, because both ends of
  our associations are ours and the sender's window is capped by a_rwnd.
  The sender side matches it: its burst limit (MAX_BURST) lets it refill
  what one such SACK frees, and in slow start it grows cwnd by what a SACK
  acknowledges (up to SACK_EVERY packets), not by one packet per SACK.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("patchswarm.webrtc")

# aiortc versions (major.minor) whose RTCSctpTransport and InboundStream internals
# these replacements were read against and tested with (tests/test_sctpfast.py).
SUPPORTED = ("1.16",)
# What the replacements read, write or wrap on the association object.
_NEEDS = ("_transmit", "_t3_expired", "_t3_start", "_t3_handle", "_send_chunk", "_forward_tsn_chunk",
          "_fast_recovery_exit", "_flight_size", "_flight_size_increase", "_outbound_queue", "_sent_queue",
          "_receive_chunk", "_receive_sack_chunk", "_cwnd", "_advertised_rwnd", "_mark_received",
          "_get_inbound_stream", "_inbound_streams", "_last_received_tsn", "_sack_misordered",
          "_sack_duplicates", "_send_sack", "_sack_needed", "transport", "_last_sacked_tsn")
_TSN_MODULO = 2 ** 32
# Packets a sped-up receiver may take before it must acknowledge, when more are queued.
SACK_EVERY = 8
# Packets a sped-up sender may send at once beyond what is in flight (aiortc: 4, RFC 9260's
# Max.Burst). A SACK of a sped-up receiver may free SACK_EVERY packets; with 4 the sender
# could refill only 4 of them and the flight would shrink SACK by SACK.
MAX_BURST = SACK_EVERY + 4


def supported() -> bool:
    """Whether the installed aiortc is one these replacements were checked against."""
    try:
        import aiortc
        from aiortc import rtcsctptransport
    except ImportError:
        return False
    version = ".".join(aiortc.__version__.split(".")[:2])
    return version in SUPPORTED and hasattr(rtcsctptransport, "InboundStream")


_warned = False


def speed_up(sctp, receive_window: int | None = None, sack_every: int | None = None) -> bool:
    """Install the faster paths on one RTCSctpTransport (before its association
    starts). `receive_window`: bytes to announce as a_rwnd (None: aiortc's 1 MiB);
    `sack_every`: packets one SACK may answer when more are queued (1: one per
    packet, as stock; None: SACK_EVERY). True if installed; False, and stock
    behaviour, otherwise."""
    global _warned
    if not supported() or not all(hasattr(sctp, name) for name in _NEEDS):
        if not _warned:
            _warned = True
            log.warning("aiortc %s is not one the SCTP speed-ups were checked against (%s): stock SCTP",
                        _aiortc_version(), ", ".join(SUPPORTED))
        return False
    if sack_every is None:
        sack_every = SACK_EVERY
    from aiortc.rtcsctptransport import USERDATA_MAX_LENGTH, InitAckChunk, InitChunk
    from aiortc.utils import uint32_gt

    stock_mark_received = sctp._mark_received

    def _mark_received(tsn: int) -> bool:
        last = sctp._last_received_tsn
        if not sctp._sack_misordered and last is not None and tsn == (last + 1) % _TSN_MODULO:
            # In order with nothing out of order pending: aiortc's set, sort and
            # filters come to exactly this.
            sctp._last_received_tsn = tsn
            if sctp._sack_duplicates:
                sctp._sack_duplicates = [x for x in sctp._sack_duplicates if uint32_gt(x, tsn)]
            return False
        return stock_mark_received(tsn)

    def _get_inbound_stream(stream_id: int):
        stream = sctp._inbound_streams.get(stream_id)
        if stream is None:
            stream = sctp._inbound_streams[stream_id] = _inbound_stream_class()()
        return stream

    stock_receive_chunk = sctp._receive_chunk
    stock_receive_sack = sctp._receive_sack_chunk
    peer_window = [None]  # the a_rwnd the peer announced in its INIT or INIT ACK

    async def _receive_chunk(chunk) -> None:
        if isinstance(chunk, (InitChunk, InitAckChunk)):
            peer_window[0] = max(chunk.advertised_rwnd, 4 * USERDATA_MAX_LENGTH)
        await stock_receive_chunk(chunk)

    stock_transmit = sctp._transmit
    stock_t3_expired = sctp._t3_expired
    marks_possible = [False]  # a chunk in the sent queue may be marked for retransmission

    growth = [0]  # slow-start growth a stretched SACK earned, taken before its transmit

    async def _transmit() -> None:
        if growth[0]:
            if sctp._fast_recovery_exit is None:
                sctp._cwnd += growth[0]
                if peer_window[0] is not None:
                    sctp._cwnd = min(sctp._cwnd, peer_window[0])
            growth[0] = 0
        if marks_possible[0]:
            await stock_transmit()
            marks_possible[0] = any(c._retransmit for c in sctp._sent_queue)
            return
        # aiortc's _transmit (1.16) without its walk over the sent queue, which finds nothing here.
        if sctp._forward_tsn_chunk is not None:
            await sctp._send_chunk(sctp._forward_tsn_chunk)
            sctp._forward_tsn_chunk = None
            if not sctp._t3_handle:
                sctp._t3_start()
        burst = (2 if sctp._fast_recovery_exit is not None else MAX_BURST) * USERDATA_MAX_LENGTH
        cwnd = min(sctp._flight_size + burst, sctp._cwnd)
        outbound, sent = sctp._outbound_queue, sctp._sent_queue
        while outbound and sctp._flight_size < cwnd:
            chunk = outbound.popleft()
            sent.append(chunk)
            sctp._flight_size_increase(chunk)
            chunk._sent_count += 1
            chunk._sent_time = time.time()
            await sctp._send_chunk(chunk)
            if not sctp._t3_handle:
                sctp._t3_start()

    def _t3_expired() -> None:
        marks_possible[0] = True
        stock_t3_expired()

    async def _receive_sack_chunk(chunk) -> None:
        if chunk.gaps:
            marks_possible[0] = True  # aiortc strikes missing chunks here, and may mark them
        # aiortc grows cwnd, then transmits, inside this handler: cap cwnd before it
        # transmits by capping it on the way in, and again after it grew.
        if peer_window[0] is not None and sctp._cwnd > peer_window[0]:
            sctp._cwnd = peer_window[0]
        growth[0] = _stretch_growth(chunk)
        await stock_receive_sack(chunk)
        growth[0] = 0
        if peer_window[0] is not None and sctp._cwnd > peer_window[0]:
            sctp._cwnd = peer_window[0]

    def _stretch_growth(chunk) -> int:
        # In slow start aiortc grows cwnd by at most one packet per SACK (RFC 9260 7.2.1),
        # so a SACK that answers a run of packets would slow slow start down by the run's
        # length. Count what it acknowledges cumulatively, up to SACK_EVERY packets, as
        # Linux's TCP counts stretch ACKs: the growth beyond aiortc's one packet, applied
        # where aiortc would grow (slow start, window full, no recovery, no gap).
        if (chunk.gaps or sctp._fast_recovery_exit is not None or sctp._cwnd > sctp._ssthresh
                or sctp._flight_size < sctp._cwnd or not uint32_gt(chunk.cumulative_tsn, sctp._last_sacked_tsn)):
            return 0
        acked = 0
        for c in sctp._sent_queue:
            if uint32_gt(c.tsn, chunk.cumulative_tsn):
                break
            if not c._acked:
                acked += c._book_size
        return max(0, min(acked, SACK_EVERY * USERDATA_MAX_LENGTH) - USERDATA_MAX_LENGTH)

    stock_send_sack = sctp._send_sack
    deferred = [0, False]  # packets not acknowledged yet, a flush scheduled

    def _more_queued() -> bool:
        # The aioice connection's queue of received datagrams, which the DTLS task drains
        # without yielding: anything in it is handled before the loop's next turn.
        try:
            return not sctp.transport.transport._connection._queue.empty()
        except AttributeError:
            return False

    async def _send_sack() -> None:
        # aiortc calls this once per packet that needs acknowledging (_handle_data).
        if (deferred[0] + 1 < sack_every and not sctp._sack_misordered and not sctp._sack_duplicates
                and _more_queued()):
            deferred[0] += 1
            if not deferred[1]:
                deferred[1] = True
                asyncio.get_running_loop().call_soon(_flush)
            return
        deferred[0] = 0
        await stock_send_sack()

    def _flush() -> None:
        # The run of queued packets ended without one needing a SACK sent (something in
        # the queue was not a DATA packet): send the deferred one now.
        deferred[1] = False
        if sctp._sack_needed and deferred[0]:
            deferred[0] = 0
            task = asyncio.ensure_future(stock_send_sack())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    if receive_window is not None:
        sctp._advertised_rwnd = max(int(receive_window), 4 * USERDATA_MAX_LENGTH)
    sctp._transmit = _transmit
    sctp._t3_expired = _t3_expired
    sctp._receive_chunk = _receive_chunk
    sctp._receive_sack_chunk = _receive_sack_chunk
    sctp._mark_received = _mark_received
    sctp._get_inbound_stream = _get_inbound_stream
    if sack_every > 1:
        sctp._send_sack = _send_sack
    return True


def _aiortc_version() -> str:
    try:
        import aiortc
        return aiortc.__version__
    except ImportError:
        return "(not installed)"


_FastInboundStream = None


def _inbound_stream_class():
    """aiortc's InboundStream, but a chunk that cannot complete a message skips the walk."""
    global _FastInboundStream
    if _FastInboundStream is not None:
        return _FastInboundStream
    from aiortc.rtcsctptransport import SCTP_DATA_LAST_FRAG, InboundStream
    from aiortc.utils import uint32_gt

    class FastInboundStream(InboundStream):
        def __init__(self) -> None:
            super().__init__()
            self._nothing_to_pop = False

        def add_chunk(self, chunk) -> None:
            at_tail = not self.reassembly or uint32_gt(chunk.tsn, self.reassembly[-1].tsn)
            super().add_chunk(chunk)
            # Fragments of a message have consecutive TSNs: one that comes after every
            # chunk held, without the last-fragment flag, leaves its own message short of
            # its end and touches no other; delivery order (sequence_number) moves only
            # when a message is delivered.
            self._nothing_to_pop = at_tail and not (chunk.flags & SCTP_DATA_LAST_FRAG)

        def pop_messages(self):
            if self._nothing_to_pop:
                self._nothing_to_pop = False  # one skip per chunk added; a FORWARD TSN walks
                return iter(())
            return super().pop_messages()

    _FastInboundStream = FastInboundStream
    return FastInboundStream
