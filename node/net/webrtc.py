"""WebRTC data channels (aiortc) as trio streams: the transport for members behind NAT.

Owns: `RTCLoop`, the one asyncio event loop (in one thread) where aiortc runs in
this process; `RTCPeer`, one peer connection with one reliable, ordered data
channel, set up from SDP handed over by the caller; `DataChannelStream`, a trio
Stream over that channel, so `MessageStream` (node/net/transport.py) frames wire
messages over it exactly as over TLS and nothing above the transport knows which
one a session runs on; `IceConfig`, the ICE servers and host addresses (no STUN
or TURN server is contacted unless configured: aiortc's default is a public STUN
server). Must not decide who is who: node/net/rtcsignal.py binds a channel to a
swarm identity (signed DTLS fingerprints); nor know what the bytes mean.

The boundary between trio and asyncio: trio hands work to the loop with
`call_soon_threadsafe` / `run_coroutine_threadsafe`; the loop reports back with
the trio token's `run_sync_soon`, so a stream's trio-side state (what arrived,
whether the channel took the last send) is only touched in trio's thread, and
the channel and the peer connection only in the loop's.

Bytes, not messages: the wire format is already a length-prefixed byte stream
(protocol/wire.py), so `send_all` cuts what it is given into data-channel
messages of at most MESSAGE_BYTES (RFC 8841's default maximum message size,
which every SCTP peer accepts) and `receive_some` hands back what arrived,
concatenated; the frame parser reassembles. Backpressure: `send_all` returns
once the channel's `bufferedAmount` is at most HIGH_WATER, else when it has
fallen to LOW_WATER (`bufferedamountlow`). Receiving has no window beyond
SCTP's own: aiortc delivers every message as it arrives, and the node's
traffic is pulled (a peer sends pieces only when asked), which bounds what an
honest peer sends. A hostile one pushes whatever it likes, and nothing stops it
as a full socket buffer stops a TCP peer: a stream holding more than MAX_UNREAD
bytes its reader has not taken ends as broken (its session with it).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
import socket
import threading
from typing import Callable

import trio

from patchswarm.protocol.errors import InvalidInput

from . import sctpfast, udpreads

log = logging.getLogger("patchswarm.webrtc")

MESSAGE_BYTES = 64 << 10  # RFC 8841 section 6: what a peer that advertises nothing accepts
HIGH_WATER = 1 << 20  # send_all waits while more than this is queued in the channel...
LOW_WATER = 256 << 10  # ...until it has fallen to this (bufferedamountlow)
RECEIVE_LIMIT = 1 << 20  # most bytes one receive_some hands back
# Most bytes a stream holds that its reader has not taken: the requests in flight to one peer
# (a few chunks of up to 16 MiB, a large state's) and a frame (16 MiB), several times over, while
# the reader waits (the download limit, a manifest checked in a thread). Past it the peer is
# pushing what was not asked for: the stream ends as broken.
MAX_UNREAD = 128 << 20
CLOSE_SECONDS = 2.0
# UDP socket buffers asked for (the kernel caps them at net.core.rmem_max / wmem_max):
# SCTP's window in flight must fit the receiver's buffer, or bursts are dropped there.
SOCKET_BUFFER = 4 << 20
# ...but the SCTP window announced stays at most this: whatever is in flight queues in
# the receiver's socket ahead of ICE's consent checks (RFC 7675), which aioice gives
# 0.5 s and six tries before it closes the connection; ~450 packets drain in ~70 ms.
# (With 1 MiB, a test run on a starved receiver saw its connection close, most likely so.)
RECEIVE_WINDOW_MAX = 512 << 10
LABEL = "patchswarm"
CHANNEL_ID = 0  # negotiated out of band (both ends create it), so no DCEP round trip
_FINGERPRINT = re.compile(r"^a=fingerprint:(\S+) ([0-9A-Fa-f:]+)\s*$", re.MULTILINE)
_CANDIDATE = re.compile(r"^a=candidate:\S+ \d+ \S+ \d+ (\S+) (\d+) typ (\S+)", re.MULTILINE)


def sdp_fingerprints(sdp: str) -> list[tuple[str, str]]:
    """The DTLS certificate fingerprints an SDP names: (algorithm, upper-case hex)."""
    return [(alg.lower(), value.upper()) for alg, value in _FINGERPRINT.findall(sdp)]


def sdp_candidates(sdp: str) -> list[tuple[str, int, str]]:
    """The ICE candidates an SDP carries: (address, port, type)."""
    return [(addr, int(port), typ) for addr, port, typ in _CANDIDATE.findall(sdp)]


@dataclasses.dataclass(frozen=True)
class IceConfig:
    """What ICE may use. Nothing here: host candidates only, no server contacted."""

    stun: str | None = None  # HOST:PORT
    turn: str | None = None  # turn:HOST:PORT[?transport=udp|tcp] (or turns:)
    turn_user: str | None = None
    turn_password: str | None = None
    # Local addresses for host candidates; None: every interface but 127.0.0.1 (aioice's choice).
    host_addresses: tuple[str, ...] | None = None

    def servers(self, relay: bool = True) -> list:
        """aiortc's ICE servers; without TURN when not `relay`."""
        from aiortc import RTCIceServer
        out = []
        if self.stun:
            out.append(RTCIceServer(urls=f"stun:{self.stun}"))
        if self.turn and relay:
            url = self.turn if self.turn.startswith(("turn:", "turns:")) else f"turn:{self.turn}"
            out.append(RTCIceServer(urls=url, username=self.turn_user, credential=self.turn_password))
        return out  # [] and not None: None means aiortc's default public STUN server


class RTCLoop:
    """The asyncio loop where aiortc runs, in one thread, for the life of an `async with`.

    Every `RTCPeer` of the process runs here; leaving the block closes those
    still open and joins the thread."""

    def __init__(self, ice: IceConfig = IceConfig()):
        self.ice = ice
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._peers: set[RTCPeer] = set()

    async def __aenter__(self) -> "RTCLoop":
        _use_host_addresses(self.ice.host_addresses)
        for name in ("aioice", "aiortc"):  # a line per candidate pair and TURN message at INFO
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        self._token = trio.lowlevel.current_trio_token()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="patchswarm-webrtc", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CLOSE_SECONDS * 2):
                await self.run(self._close_all())
            self.loop.call_soon_threadsafe(self.loop.stop)
            await trio.to_thread.run_sync(self._thread.join)
            self.loop.close()

    async def _close_all(self) -> None:
        await asyncio.gather(*(p._close_in_loop() for p in list(self._peers)), return_exceptions=True)

    async def run(self, coro):
        """Run an asyncio coroutine on the loop; its result, or its exception, in trio.
        Cancelling the trio side cancels the asyncio task."""
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        future.add_done_callback(lambda _: _call_trio(token, done.set))
        try:
            await done.wait()
        except BaseException:
            future.cancel()
            raise
        return future.result()

    def call(self, fn: Callable, *args) -> None:
        """Call `fn(*args)` in the loop's thread, soon; returns at once."""
        self.loop.call_soon_threadsafe(fn, *args)

    def peer(self, fast_sctp: bool = True, relay: bool = True) -> "RTCPeer":
        """A new peer connection (not yet offered or answered). `fast_sctp`: with
        node/net/sctpfast.py's speed-ups of aiortc's SCTP (False: stock aiortc);
        `relay`: gather relay candidates through the TURN server, if one is configured."""
        return RTCPeer(self, fast_sctp, relay)


def _call_trio(token: trio.lowlevel.TrioToken, fn: Callable, *args) -> None:
    try:
        token.run_sync_soon(fn, *args)
    except trio.RunFinishedError:  # trio is gone; nobody is waiting
        pass


_ORIGINAL_HOST_ADDRESSES = None


def _use_host_addresses(addresses: tuple[str, ...] | None) -> None:
    """Host candidates from `addresses` only (None: aioice's own choice).

    aioice offers no option for it and reads its module function when it
    gathers, so this replaces that function for the process (one RTCLoop per
    process). Why: tests and namespaces must stay on the addresses they own
    (aioice leaves out 127.0.0.1), and a host with many interfaces may pin one."""
    import aioice.ice

    global _ORIGINAL_HOST_ADDRESSES
    if _ORIGINAL_HOST_ADDRESSES is None:
        _ORIGINAL_HOST_ADDRESSES = aioice.ice.get_host_addresses
    if addresses is None:
        aioice.ice.get_host_addresses = _ORIGINAL_HOST_ADDRESSES
    else:
        chosen = list(addresses)
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [
            a for a in chosen if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]


def _set_buffers(sock) -> int:
    """Ask for SOCKET_BUFFER both ways; the receive buffer obtained (as the kernel counts it)."""
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


_RECEIVE_WINDOW: int | None = None


def receive_window() -> int:
    """The SCTP receive window to announce: what a UDP socket of this host can hold.

    The kernel charges each ~1.2 KB datagram its buffer's full size, up to ~4 KB
    on loopback, so a quarter of the receive buffer obtained is what surely fits;
    at most RECEIVE_WINDOW_MAX. Measured once per process on a throwaway socket."""
    global _RECEIVE_WINDOW
    if _RECEIVE_WINDOW is None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            _RECEIVE_WINDOW = min(RECEIVE_WINDOW_MAX, _set_buffers(probe) // 4)
    return _RECEIVE_WINDOW


def offers_relay(sdp: str) -> bool:
    """Whether an SDP names a relay candidate: an offer without one asks for a direct path."""
    return any(line.startswith("a=candidate:") and " typ relay" in line for line in sdp.splitlines())


class RTCPeer:
    """One peer connection with one data channel, as seen from trio.

    Offerer: `local_offer()`, then `accept_answer(sdp)`. Answerer:
    `local_answer(offer_sdp)`. Then `await open()` gives the stream; `aclose()`
    (or closing the stream) ends the connection."""

    def __init__(self, rtc: RTCLoop, fast_sctp: bool = True, relay: bool = True):
        self.rtc = rtc
        self.fast_sctp = fast_sctp
        self.relay = relay
        self.stream = DataChannelStream(self)
        self.local_sdp: str | None = None
        self.remote_sdp: str | None = None
        self._pc = None
        self._channel = None
        self._opened: asyncio.Future | None = None
        self._closed = False

    # -- trio side

    async def local_offer(self) -> str:
        self.local_sdp = await self.rtc.run(self._offer_in_loop())
        return self.local_sdp

    async def accept_answer(self, sdp: str) -> None:
        self.remote_sdp = sdp
        await self.rtc.run(self._accept_in_loop(sdp))

    async def local_answer(self, offer_sdp: str) -> str:
        self.remote_sdp = offer_sdp
        self.local_sdp = await self.rtc.run(self._answer_in_loop(offer_sdp))
        return self.local_sdp

    async def open(self) -> "DataChannelStream":
        """Wait for the channel to open (ICE, DTLS, SCTP done); the caller bounds the wait."""
        await self.rtc.run(self._wait_open_in_loop())
        return self.stream

    def local_fingerprints(self) -> list[tuple[str, str]]:
        return sdp_fingerprints(self.local_sdp or "")

    def path(self) -> str:
        """'relayed' when the selected candidate pair goes through TURN, else 'direct'
        ('unknown' before ICE has chosen)."""
        pair = self._selected_pair()
        if pair is None:
            return "unknown"
        types = {pair.local_candidate.type, pair.remote_candidate.type}
        return "relayed" if "relay" in types else "direct"

    def _selected_pair(self):
        # aiortc exposes no selected pair; aioice keeps it as the nominated pair of component 1.
        try:
            connection = self._pc.sctp.transport.transport.iceGatherer._connection
            return connection._nominated.get(1)
        except AttributeError:
            return None

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_SECONDS):
            await self.rtc.run(self._close_in_loop())

    def abort(self) -> None:
        """Close from synchronous code, without waiting."""
        if not self._closed:
            self._closed = True
            self.rtc.call(lambda: asyncio.ensure_future(self._close_in_loop()))

    # -- loop side

    def _new_pc(self):
        from aiortc import RTCConfiguration, RTCPeerConnection

        self._pc = RTCPeerConnection(RTCConfiguration(iceServers=self.rtc.ice.servers(self.relay)))
        self._opened = asyncio.get_running_loop().create_future()
        # Read a failure here, so asyncio does not log it as never retrieved when nobody waits.
        self._opened.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.rtc._peers.add(self)

        @self._pc.on("connectionstatechange")
        def _state():
            if self._pc.connectionState in ("failed", "closed"):
                self._fail(f"peer connection {self._pc.connectionState}", clean=self._pc.connectionState == "closed")

    def _add_channel(self) -> None:
        ch = self._pc.createDataChannel(LABEL, ordered=True, negotiated=True, id=CHANNEL_ID)
        if self.fast_sctp:  # the SCTP transport exists now, and its association has not started
            sctpfast.speed_up(self._pc.sctp, receive_window=receive_window())
        ch.bufferedAmountLowThreshold = LOW_WATER
        self._channel = ch
        stream, token = self.stream, self.rtc._token

        @ch.on("open")
        def _open():
            if not self._opened.done():
                self._opened.set_result(None)

        @ch.on("message")
        def _message(data):
            if isinstance(data, str):
                data = data.encode()
            _call_trio(token, stream._arrived, data)

        @ch.on("close")
        def _close():
            self._fail("data channel closed", clean=True)

        @ch.on("bufferedamountlow")
        def _low():
            stream._drained_in_loop()

        if ch.readyState == "open":
            _open()

    def _fail(self, why: str, clean: bool) -> None:
        if self._opened is not None and not self._opened.done():
            self._opened.set_exception(ConnectionError(why))
        _call_trio(self.rtc._token, self.stream._end, why, clean)

    async def _offer_in_loop(self) -> str:
        self._new_pc()
        self._add_channel()
        await self._pc.setLocalDescription(await self._pc.createOffer())
        self._tune_sockets()
        return self._pc.localDescription.sdp  # aiortc gathers every candidate before this returns

    async def _accept_in_loop(self, sdp: str) -> None:
        await self._take_remote(sdp, "answer")

    async def _answer_in_loop(self, sdp: str) -> str:
        self._new_pc()
        await self._take_remote(sdp, "offer")
        self._add_channel()  # after the offer made the SCTP transport, before anything can arrive
        await self._pc.setLocalDescription(await self._pc.createAnswer())
        self._tune_sockets()
        return self._pc.localDescription.sdp

    async def _take_remote(self, sdp: str, kind: str) -> None:
        """The peer's SDP as the remote description; InvalidInput if aiortc cannot take it. The
        peer signs whatever SDP it likes, and aiortc's parser fails on a bad one with ValueError,
        KeyError (`a=setup:bogus`), AssertionError (a `c=` line cut short) and the like: each
        escaped the task that answered the offer (or dialed) and ended the whole node."""
        from aiortc import RTCSessionDescription
        try:
            await self._pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type=kind))
        except Exception as e:
            raise InvalidInput(f"{kind} SDP: expected one aiortc takes, found one it does not "
                               f"({type(e).__name__}: {' '.join(str(e).split()) or '-'})") from None

    def _tune_sockets(self) -> None:
        """On each UDP socket ICE gathered: ask for SOCKET_BUFFER (aiortc and aioice
        leave the kernel's default, ~208 KiB: ~90 packets), and read datagrams in
        batches (node/net/udpreads.py; a TURN allocation's socket to its server too)."""
        if not self.fast_sctp:
            return
        try:
            protocols = self._pc.sctp.transport.transport.iceGatherer._connection._protocols
        except AttributeError:
            return
        for protocol in protocols:
            transport = getattr(protocol, "transport", None)
            # A relayed candidate's transport wraps the UDP socket to the TURN server.
            inner = getattr(transport, "_TurnTransport__inner_protocol", None)
            if inner is not None:
                transport = getattr(inner, "transport", None)
            sock = getattr(transport, "get_extra_info", lambda _: None)("socket")
            if sock is not None and sock.type == socket.SOCK_DGRAM:
                _set_buffers(sock)
                udpreads.read_in_batches(transport)

    async def _wait_open_in_loop(self) -> None:
        await asyncio.shield(self._opened)

    async def _close_in_loop(self) -> None:
        self.rtc._peers.discard(self)
        if self._pc is not None:
            await self._pc.close()
        _call_trio(self.rtc._token, self.stream._end, "closed", True)


class DataChannelStream(trio.abc.Stream):
    """A trio Stream over an `RTCPeer`'s data channel: one sender and one receiver
    at a time, ClosedResourceError after `aclose`, BrokenResourceError once the
    channel or the peer connection failed or closed under it."""

    transport = "webrtc"

    def __init__(self, peer: RTCPeer):
        self._peer = peer
        self._chunks: collections.deque[bytes] = collections.deque()
        self._unread = 0  # bytes in _chunks
        self._readable = trio.Event()
        self._space = trio.Event()
        self._ended: str | None = None  # why the channel is gone (trio side)
        self._clean = False  # it ended by a close, not a failure: receive_some returns b""
        self._closed = False
        self._receiving = False
        self._sending = False
        self._waiting_for_low = False  # loop side: a send_all waits for bufferedamountlow

    @property
    def path(self) -> str:
        return self._peer.path()

    # -- called in trio's thread by the loop

    def _arrived(self, data: bytes) -> None:
        if self._ended is not None:
            return  # nobody reads past the end
        self._unread += len(data)
        if self._unread > MAX_UNREAD:
            unread, self._unread = self._unread, 0
            self._chunks.clear()
            self.abort(f"the peer sent {unread:,} bytes this member has not read yet, more than {MAX_UNREAD:,}")
            return
        self._chunks.append(data)
        self._readable.set()

    def _end(self, why: str, clean: bool) -> None:
        if self._ended is None:
            self._ended, self._clean = why, clean
        self._readable.set()
        self._space.set()

    def _sent(self) -> None:
        self._space.set()

    # -- called in the loop's thread

    def _send_in_loop(self, chunks: list[bytes]) -> None:
        ch, token = self._peer._channel, self._peer.rtc._token
        try:
            for c in chunks:
                ch.send(c)
        except Exception as e:  # not open any more (InvalidStateError) or torn down
            _call_trio(token, self._end, f"data channel send failed: {type(e).__name__}", False)
            return
        if ch.bufferedAmount <= HIGH_WATER:
            _call_trio(token, self._sent)
        else:
            self._waiting_for_low = True

    def _drained_in_loop(self) -> None:
        if self._waiting_for_low:
            self._waiting_for_low = False
            _call_trio(self._peer.rtc._token, self._sent)

    # -- trio Stream

    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("data channel stream closed")
        if self._ended is not None:
            raise trio.BrokenResourceError(f"data channel: {self._ended}")

    async def send_all(self, data) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this data channel")
        self._check()
        self._sending = True
        try:
            view = memoryview(data)
            if not len(view):
                await trio.lowlevel.checkpoint()
                return
            chunks = [bytes(view[i:i + MESSAGE_BYTES]) for i in range(0, len(view), MESSAGE_BYTES)]
            self._space = trio.Event()
            self._peer.rtc.call(self._send_in_loop, chunks)
            await self._space.wait()
            self._check()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        await self._space.wait()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this data channel")
        if self._closed:
            raise trio.ClosedResourceError("data channel stream closed")
        limit = RECEIVE_LIMIT if max_bytes is None else max_bytes
        self._receiving = True
        try:
            while not self._chunks:
                if self._ended is not None:
                    if self._clean:
                        await trio.lowlevel.checkpoint()
                        return b""  # a clean end: the frame parser tells a cut frame from a whole one
                    raise trio.BrokenResourceError(f"data channel: {self._ended}")
                self._readable = trio.Event()
                await self._readable.wait()
            else:
                await trio.lowlevel.checkpoint()
            out, size = [], 0
            while self._chunks and size < limit:
                c = self._chunks.popleft()
                if size + len(c) > limit:
                    self._chunks.appendleft(c[limit - size:])
                    c = c[:limit - size]
                out.append(c)
                size += len(c)
            self._unread -= size
            return out[0] if len(out) == 1 else b"".join(out)
        finally:
            self._receiving = False

    async def send_eof(self) -> None:  # not half-closable; here for callers that try
        await self.aclose()

    def abort(self, reason: str) -> None:
        """End the connection now (a revoked peer); the next send or receive raises."""
        log.info("closing a data channel: %s", reason)
        self._ended = self._ended or reason
        self._readable.set()
        self._space.set()
        self._peer.abort()

    async def aclose(self) -> None:
        self._closed = True
        self._readable.set()
        self._space.set()
        await self._peer.aclose()
