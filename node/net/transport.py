"""Framed, mutually authenticated connections between swarm members (TLS 1.3 over trio TCP).

Owns: parsing HOST:PORT, dialing and serving TLS with the swarm's contexts
(node/net/trust.py), the Hello exchange that binds a wire identity to the peer's
certificate, and `MessageStream`, which turns a TLS stream into wire messages
(protocol/wire.py) with one sender at a time. Must not hold swarm policy: who
to dial, what to ask for and what to do with a message are the callers'.

Identity: a peer is who its CA-signed certificate says (CN = name, OU = role,
and a region where the certificate names one: node/net/trust.py). Its Hello must
repeat that name and role, and that region where there is one, or the connection
is refused (the region decides the WAN plan: a member that could say any region
could take a share of a region it is not in and withhold it). A listener reads
the dialer's Hello before it sends its own (a dialer sends its Hello first), so a
refused Hello is answered with an Error in place of the listener's Hello, which
the dialer reports as the reason (`PeerRefused`). A
dialer names the member it means to reach (`expect_name`), and an address
answered by any other certificate is refused, so an announced address cannot
make a member talk to someone else under that member's name, nor to itself;
a listener refuses a connection from its own name (itself, through an address
someone announced).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import ssl
import threading
import weakref
from typing import Awaitable, Callable

import idna
import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import BudgetExceeded, InvalidInput, PeerRefused, ProtocolError, UsageError, WrongRegion

from patchswarm.node.net.admission import MemberAdmission
from patchswarm.node.net.tlsstream import TLSSocketStream
from patchswarm.node.net.trust import (Credentials, dial_context, peer_identity, peer_region, peer_serial,
                                       region_fault, server_context)

log = logging.getLogger("patchswarm.transport")
HANDSHAKE_SECONDS = 10.0
# Budgets (issue 21): what peers together may hold of this process before they are authenticated
# and named (a Hello), and received bytes not yet read as messages, over every connection.
MAX_CONNECTIONS_BEFORE_HELLO = 256  # accepted, TLS or Hello not done; more are closed at once
MAX_BEFORE_HELLO_PER_HOST = 16  # of those, from one address: one host cannot take every slot
MAX_BUFFERED_BYTES = 256 << 20  # each connection holds at most a frame (16 MiB) and a read
BEFORE_HELLO = "connections before Hello"  # the budgets' names, for counters and logs
BUFFERED = "bytes buffered"
# Refusals for a region (node/net/trust.py), counted by these kinds beside the budgets': a Hello
# that says another region than the certificate's, and (where `creds.require_region`: a member's
# --require-region, the tracker's or its own) a certificate that names none.
WRONG_REGION = "region not the certificate's"
NO_REGION = "certificate names no region"
# A member refused over its admission budget gets its Error this long after its TLS handshake,
# its connection holding one of the slots before Hello meanwhile: a member that reconnects in a
# loop then costs the listener at most MAX_BEFORE_HELLO_PER_HOST handshakes per REFUSAL_HOLD
# from one host (without it, as many as the member could make: 80-190 a second from one
# process in bench/reconnect.py, each 2-3 ms of the listener's CPU). A host can already fill those
# slots with connections that never finish TLS, so holding costs its neighbours nothing new.
# A connection whose TLS handshake or Hello fails holds its slot too, until REFUSAL_HOLD after it
# was accepted: without it a host outside the swarm (a certificate of another CA, or none) got as
# many failed handshakes a second out of the listener as it could make, each about a whole
# handshake's CPU (bench/reconnect.py --outsider); with it, at most MAX_BEFORE_HELLO_PER_HOST
# per REFUSAL_HOLD from one host and MAX_CONNECTIONS_BEFORE_HELLO from all.
REFUSAL_HOLD = 1.0
REFUSAL_SECONDS = 1.0  # then, the most the Error's write may take

# What a connection that broke, closed, stalled past a deadline or failed TLS
# raises: the one tuple every member catches around a send or a receive.
CONNECTION_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, ssl.SSLError, OSError)


async def run_session(handler: Callable[[], Awaitable[None]], who: str, logger: logging.Logger = log) -> None:
    """Run one session's handler; a bug in it (any Exception) is logged ("session with WHO
    failed", with its traceback) and ends that session alone. The listener's accepted sessions
    and the dialer's dialed ones both run through here: one peer's session must not take the
    listener, the dialer or the node (and every other peer's session) down with it."""
    try:
        await handler()
    except Exception:
        logger.exception("session with %s failed", who)


def one_line(e: BaseException) -> str:
    """An exception as one line for a log or a person: its text with whitespace folded."""
    return " ".join((str(e) or type(e).__name__).split())


def parse_addr(addr: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT` -> (host, port)."""
    if not isinstance(addr, str) or ":" not in addr:
        raise UsageError(f"address: expected HOST:PORT, found {addr!r}")
    host, _, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 0 <= number < 65536:
        raise UsageError(f"address: expected HOST:PORT with a port in [0, 65535], found {addr!r}")
    if not _looks_up(host):
        raise UsageError(f"address: expected HOST:PORT with a host name or an IP address, found {addr!r}")
    return host, number


def _looks_up(host: str) -> bool:
    """Whether getaddrinfo takes `host` at all: a name it cannot encode (an empty label as in
    "a..b", one over 63 characters, a control character) raised UnicodeError out of
    trio.open_tcp_stream, a ValueError no dialer catches, so a member that advertised one had
    every peer that dialed it exit. The stdlib's IDNA 2003 comes first (the numeric-only try),
    then, for a name that is not ASCII, trio's IDNA 2008."""
    if not host.isprintable():
        return False
    try:
        host.encode("idna")
        if not host.isascii():
            idna.encode(host, uts46=True)
    except UnicodeError:  # idna.IDNAError too
        return False
    return True


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass
class Counters:
    """Bytes moved on one connection (TLS payload, frames included)."""

    sent: int = 0
    received: int = 0


class BufferBudget:
    """Bytes received and not yet read as messages, over all the connections that share it.

    A connection whose bytes would take the total past `limit` raises BudgetExceeded (its
    peer is dropped); one connection alone holds at most a frame and a read."""

    def __init__(self, limit: int = MAX_BUFFERED_BYTES):
        self.limit = limit
        self.used = 0


RECEIVE_BUDGET = BufferBudget()  # the process's, unless a caller passes its own
# Reads that need no wait (MessageStream._receive_nowait) go through one buffer shared by every
# connection of a thread's event loop: each read is copied into its connection's FrameBuffer
# before anything awaits, and a buffer per connection would cost the tracker's 10,000 sessions
# 256 KiB each. One per thread, as a process may run an event loop in more than one.
_SCRATCH_BYTES = 256 << 10
_SCRATCH = threading.local()


def _scratch() -> memoryview:
    view = getattr(_SCRATCH, "view", None)
    if view is None:
        view = _SCRATCH.view = memoryview(bytearray(_SCRATCH_BYTES))
    return view


class MessageStream:
    """Wire messages over one authenticated TLS stream.

    `send` may be called from many tasks: frames never interleave. `receive`
    returns the next message, or None when the peer closed cleanly; bad bytes
    raise ProtocolError, a dead socket trio.BrokenResourceError.
    """

    def __init__(self, stream: TLSSocketStream, peer_name: str, peer_role: str,
                 max_frame: int = wire.MAX_FRAME_BYTES,
                 on_receive: Callable[[int], Awaitable[None]] | None = None,
                 peer_serial: str | None = None, creds: Credentials | None = None,
                 budget: BufferBudget | None = None, peer_region: str | None = None):
        self.stream = stream
        self.peer_name = peer_name
        self.peer_role = peer_role
        self.peer_serial = peer_serial
        self.peer_region = peer_region  # the region its certificate binds it to; None: it names none
        self.creds = creds
        if creds is not None:
            _LIVE.add(self)
        self.hello: wire.Hello | None = None
        self.accepted_at: float | None = None  # trio.current_time() when `serve` accepted the connection
        # The wire revision the TLS handshake chose in ALPN (protocol/wire.py WIRE_REVISION: the peer
        # reads the optional fields); None from a member of the previous version, and on other streams.
        selected = getattr(stream, "selected_alpn_protocol", None)
        self.wire_revision: str | None = selected() if selected is not None else None
        self.counters = Counters()
        self._conn = wire.Connection(max_frame=max_frame)
        # A stream that reads into a caller's buffer (TLSSocketStream) takes a chunk part's
        # body straight from OpenSSL into the frame's own buffer (protocol/wire.py FrameBuffer).
        self._receive_into = getattr(stream, "receive_into", None)
        self._receive_into_nowait = getattr(stream, "receive_into_nowait", None)
        self._send_lock = trio.StrictFIFOLock()
        self._on_receive = on_receive  # download rate limit: called with each read's size
        self._budget = RECEIVE_BUDGET if budget is None else budget
        self._charged = 0  # of the budget: this connection's buffered bytes when last counted

    async def send(self, msg) -> None:
        data = self._conn.send(msg)
        async with self._send_lock:
            await self.stream.send_all(data)
        self.counters.sent += len(data)

    async def send_many(self, msgs) -> None:
        """Several messages in one write (their frames in order)."""
        data = b"".join(map(self._conn.send, msgs))
        async with self._send_lock:
            await self.stream.send_all(data)
        self.counters.sent += len(data)

    async def receive(self):
        await trio.lowlevel.checkpoint_if_cancelled()  # reads that need no wait never check it
        unyielded = False  # read without waiting since this call last yielded
        while True:
            event = self._conn.next_event()
            if event is wire.CLOSED:
                return None
            if event is not wire.NEED_DATA:
                self._count_buffered()
                if unyielded:  # one yield per message, not per read (the message is not lost to a cancel)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return event
            self._count_buffered()  # a large frame's header alone allocates its whole buffer
            n = self._receive_nowait() if self._receive_into_nowait is not None else None
            if n is None:
                n = await self._receive_waiting()
                unyielded = False
            else:
                unyielded = True
            self.counters.received += n
            self._count_buffered()
            if n and self._on_receive is not None:
                await self._on_receive(n)

    def _receive_nowait(self) -> int | None:
        """What has arrived, read into the large frame's own buffer or else through the shared
        scratch buffer (copied out at once); None if nothing has (see TLSSocketStream.receive_into_nowait)."""
        target = self._conn.body_buffer()
        if target is not None:
            try:
                n = self._receive_into_nowait(target)
            finally:
                target.release()
            if n is not None:
                self._conn.body_received(n)
            return n
        limit = self._conn.read_limit()
        with _scratch()[:_SCRATCH_BYTES if limit is None else min(limit, _SCRATCH_BYTES)] as view:
            n = self._receive_into_nowait(view)
            if n is not None:
                self._conn.receive_data(view[:n])  # copied in; n == 0 is the peer's EOF
        return n

    async def _receive_waiting(self) -> int:
        """Wait for bytes and read them: the rest of a large frame (a chunk part) straight into
        its own buffer, else every TLS record that has arrived (or only the next header, after a
        large frame: protocol/wire.py FrameBuffer.read_limit)."""
        target = self._conn.body_buffer() if self._receive_into is not None else None
        if target is not None:
            try:
                n = await self._receive_into(target)
            finally:
                target.release()
            self._conn.body_received(n)
            return n
        data = await self.stream.receive_some(self._conn.read_limit())
        self._conn.receive_data(data)
        return len(data)

    def _count_buffered(self) -> None:
        budget, now = self._budget, self._conn.buffered
        budget.used += now - self._charged
        grew, self._charged = now > self._charged, now
        if grew and budget.used > budget.limit:
            raise BudgetExceeded(BUFFERED, f"peer {self.peer_name!r}: {now} bytes buffered take all connections' "
                                           f"to {budget.used}, past the budget of {budget.limit}")

    def release(self) -> None:
        """Give this connection's buffered bytes back to the budget (it is being closed)."""
        self._budget.used -= self._charged
        self._charged = 0

    async def aclose(self) -> None:
        self.release()
        with trio.move_on_after(1) as scope:
            scope.shield = True
            try:
                await self.stream.aclose()
            except CONNECTION_ERRORS:
                pass


def transport_of(ms: MessageStream) -> dict:
    """What a session runs on, for status: {"transport": "tcp"} or, over a data channel
    (node/net/webrtc.py), {"transport": "webrtc", "path": "direct" | "relayed"}."""
    kind = getattr(ms.stream, "transport", "tcp")
    return {"transport": kind} if kind == "tcp" else {"transport": kind, "path": ms.stream.path}


# Every authenticated connection, so a new revocation list can end those of revoked peers.
_LIVE: "weakref.WeakSet[MessageStream]" = weakref.WeakSet()


def apply_revocations(creds: Credentials, envelope: bytes) -> int | None:
    """Take a signed revocation list into `creds` (raises as RevocationBook.offer does);
    None if it was already held, else the number of live connections it ended."""
    if not creds.revocations.offer(envelope):
        return None
    ended = 0
    for ms in list(_LIVE):
        if ms.creds is creds and ms.peer_serial is not None and creds.revocations.revoked(ms.peer_serial):
            log.warning("ending the connection to %s: its certificate (serial %s) is revoked",
                        ms.peer_name, ms.peer_serial)
            ms.stream.abort(f"the certificate of {ms.peer_name!r} is revoked")
            ended += 1
    return ended


async def _handshake(stream: TLSSocketStream, allowed_roles: frozenset[str] | set[str],
                     expect_name: str | None, creds: Credentials) -> tuple[str, str, str, str | None]:
    """(name, role, serial, region) of the peer once TLS is done and its certificate passes."""
    with trio.fail_after(HANDSHAKE_SECONDS):
        await stream.do_handshake()
    name, role = peer_identity(stream)
    serial = peer_serial(stream)
    region = peer_region(stream)
    if creds.revocations is not None and creds.revocations.revoked(serial):
        raise InvalidInput(f"peer {name!r}: its certificate (serial {serial}) is revoked")
    own_name = creds.name
    if role not in allowed_roles:
        raise InvalidInput(f"peer {name!r}: expected role {' or '.join(sorted(allowed_roles))}, found {role!r}")
    if expect_name is not None and name != expect_name:
        raise InvalidInput(f"dialed {expect_name!r}, found a certificate of {name!r} at that address")
    if name == own_name:
        raise InvalidInput(f"peer {name!r}: a connection to this member itself")
    return name, role, serial, region


async def _receive_hello(ms: MessageStream) -> wire.Hello:
    """Read the peer's Hello and check it repeats their certificate's identity (its region too,
    where the certificate names one: WrongRegion otherwise); sets `ms.hello`."""
    with trio.fail_after(HANDSHAKE_SECONDS):
        theirs = await ms.receive()
    if isinstance(theirs, wire.Error):  # a listener that refused us (budget, region) says why
        raise PeerRefused(f"peer {ms.peer_name!r} refused the connection: {theirs.message}", theirs.message)
    if not isinstance(theirs, wire.Hello):
        raise ProtocolError(f"peer {ms.peer_name!r}: expected Hello, found {type(theirs).__name__}")
    if (theirs.node_id, theirs.role) != (ms.peer_name, ms.peer_role):
        raise ProtocolError(f"peer {ms.peer_name!r}: Hello says {theirs.node_id!r} ({theirs.role}), "
                            f"certificate says {ms.peer_name!r} ({ms.peer_role})")
    if theirs.role != "tracker" and (fault := region_fault(theirs.region)) is not None:
        # A region is quoted in logs and pages: one of control characters could forge log lines.
        raise ProtocolError(f"peer {ms.peer_name!r}: its Hello's region: expected {fault}, found {theirs.region!r}")
    if ms.peer_region is not None and theirs.region != ms.peer_region:
        raise WrongRegion(f"{ms.peer_role} {ms.peer_name!r}: its Hello says region {theirs.region!r}, its "
                          f"certificate binds it to region {ms.peer_region!r}")
    ms.hello = theirs
    return theirs


def _for_revision(ms: MessageStream, hello: wire.Hello) -> wire.Hello:
    """`hello` as this connection's peer reads it: our declared uplink goes only where the
    connection selected wire revision 5 (a member of revision 4 refuses a Hello field it does
    not know), so callers build one Hello for every connection."""
    if hello.uplink is not None and wire.revision(ms.wire_revision) < wire.UPLINK_REVISION:
        return dataclasses.replace(hello, uplink=None)
    return hello


async def exchange_hello(ms: MessageStream, hello: wire.Hello) -> wire.Hello:
    """Send our Hello, read theirs, and check it repeats their certificate's identity
    (name, role, and region where the certificate names one)."""
    await ms.send(_for_revision(ms, hello))
    return await _receive_hello(ms)


async def accept_hello(ms: MessageStream, hello: wire.Hello) -> wire.Hello:
    """The listener's side of `exchange_hello`: read the dialer's Hello (a dialer of every
    revision sends its own first, without waiting), check it, and only then send ours, so
    a Hello refused (WrongRegion) is answered with an Error in place of our Hello."""
    theirs = await _receive_hello(ms)
    await ms.send(_for_revision(ms, hello))
    return theirs


async def connect(addr: str, creds: Credentials, allowed_roles: set[str] | frozenset[str],
                  hello: wire.Hello, *, expect_name: str | None = None,
                  ssl_context: ssl.SSLContext | None = None,
                  on_receive: Callable[[int], Awaitable[None]] | None = None,
                  local_address: str | None = None) -> MessageStream:
    """Dial `addr`, authenticate both ways, exchange Hellos; the caller closes the stream.

    With `expect_name`, the peer's certificate must carry that name (InvalidInput
    otherwise); a peer with this member's own name is always refused. `local_address`:
    the IP to dial from (a host with several)."""
    host, port = parse_addr(addr)
    with trio.fail_after(HANDSHAKE_SECONDS):
        tcp = await trio.open_tcp_stream(host, port, local_address=local_address)
    stream = TLSSocketStream.wrap(tcp, ssl_context or dial_context(creds), server_side=False)
    ms = None
    try:
        name, role, serial, region = await _handshake(stream, allowed_roles, expect_name, creds)
        if creds.require_region and region is None and role != "tracker":
            raise InvalidInput(creds.no_region_refusal(name, role))
        ms = MessageStream(stream, name, role, on_receive=on_receive, peer_serial=serial, creds=creds,
                           peer_region=region)
        await exchange_hello(ms, hello)
        return ms
    except BaseException:
        if ms is not None:
            ms.release()
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)
        raise


Handler = Callable[[MessageStream], Awaitable[None]]


async def serve(listen: str, creds: Credentials, allowed_roles: set[str] | frozenset[str],
                hello: Callable[[], wire.Hello], handler: Handler, *,
                on_refused: Callable[[str], None] | None = None,
                on_receive: Callable[[int], Awaitable[None]] | None = None,
                refused: collections.Counter | None = None,
                max_before_hello: int = MAX_CONNECTIONS_BEFORE_HELLO,
                max_before_hello_per_host: int = MAX_BEFORE_HELLO_PER_HOST,
                admission: MemberAdmission | None = None, refusal_hold: float | None = None,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accept TLS connections on `listen`; run `handler(stream)` for each authenticated peer.

    Reports the bound address (`HOST:PORT`, with the real port when 0 was
    asked) through `task_status`. Peers that fail TLS, present a role not in
    `allowed_roles` or a Hello that contradicts their certificate are closed
    and reported to `on_refused(reason)`, and counted in `refused` (by kind). At most
    `max_before_hello` connections are open before their Hello is done, at
    most `max_before_hello_per_host` from one address (each holds at most a
    TLS handshake and a 4 KiB frame, for HANDSHAKE_SECONDS at most); beyond, a
    new connection is closed at once. With `admission`, a member over its budget
    of connections (node/net/admission.py) is refused right after the TLS
    handshake, before any Hello: its own Hello is read (so the close is a FIN,
    not a reset that could discard the Error), it is sent an Error saying when
    it may come back `refusal_hold` seconds after its handshake (default REFUSAL_HOLD,
    which bounds how fast it can make this listener do handshakes), and the
    connection is closed. A connection whose TLS handshake or Hello fails is closed at once
    and holds its slot until `refusal_hold` after it was accepted, for the same bound.
    A member whose Hello says another region than its certificate binds it to is sent an
    Error saying both (in place of our Hello, `refusal_hold` seconds after its handshake, as
    above) and counted as WRONG_REGION; where `creds.require_region` (the member's
    --require-region), a member whose certificate names no region is refused so right after
    TLS, counted as NO_REGION.
    Refusals of a flood are logged at its 1st, 2nd, 4th, ... (every one counted).
    """
    host, port = parse_addr(listen)
    context = server_context(creds)
    listeners = await trio.open_tcp_listeners(port, host=host)
    before_hello = 0
    by_host: collections.Counter[str] = collections.Counter()  # of before_hello
    refused = collections.Counter() if refused is None else refused

    def refuse(kind: str, reason: str) -> None:
        refused[kind] += 1
        n = refused[kind]
        if on_refused is not None and (kind == "refused" or n & (n - 1) == 0):  # a flood: its 1st, 2nd, 4th, ...
            on_refused(reason if kind != BEFORE_HELLO else f"{reason} ({n} refused so far)")

    async def one(tcp: trio.SocketStream) -> None:
        nonlocal before_hello
        accepted_at = trio.current_time()
        try:
            host = tcp.socket.getpeername()[0]
        except OSError:  # reset before we got to it
            host = ""
        if before_hello >= max_before_hello or by_host[host] >= max_before_hello_per_host:
            refuse(BEFORE_HELLO, f"over budget: {before_hello} {BEFORE_HELLO} already open, {by_host[host]} from {host}")
            await trio.aclose_forcefully(tcp)
            return
        try:
            stream = TLSSocketStream.wrap(tcp, context, server_side=True)
        except OSError as e:  # reset before we got to it
            await trio.aclose_forcefully(tcp)
            refuse("refused", _reason(e))
            return
        ms = None
        try:
            before_hello += 1
            by_host[host] += 1
            hold = REFUSAL_HOLD if refusal_hold is None else refusal_hold
            try:
                name, role, serial, region = await _handshake(stream, allowed_roles, None, creds)
                if creds.require_region and region is None and role != "tracker":
                    why = creds.no_region_refusal(name, role)
                    refuse(NO_REGION, why)
                    await _say_refused(stream, why, trio.current_time() + hold)
                    return
                if admission is not None:
                    try:
                        admission.admit(name, trio.current_time())
                    except BudgetExceeded as e:
                        refuse(e.budget, f"over budget: {e}")
                        await _say_refused(stream, str(e), trio.current_time() + hold)
                        return
                ms = MessageStream(stream, name, role, on_receive=on_receive, peer_serial=serial, creds=creds,
                                   peer_region=region)
                ms.accepted_at = accepted_at
                await accept_hello(ms, hello())
            except WrongRegion as e:
                refuse(WRONG_REGION, str(e))
                await _say_refused(stream, str(e), trio.current_time() + hold, hello_read=True)
                return
            except (*CONNECTION_ERRORS, InvalidInput) as e:
                refuse("refused", _reason(e))
                await trio.aclose_forcefully(stream)
                await trio.sleep_until(accepted_at + hold)  # its slot stays taken: see REFUSAL_HOLD
                return
            finally:
                before_hello -= 1
                by_host[host] -= 1
                if not by_host[host]:
                    del by_host[host]
            await run_session(lambda: handler(ms), f"{ms.peer_role} {ms.peer_name}")
        finally:
            if ms is not None:
                ms.release()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    bound = listeners[0].socket.getsockname()
    task_status.started(format_addr(host if host not in ("0.0.0.0", "::") else bound[0], bound[1]))
    await trio.serve_listeners(one, listeners)


async def _say_refused(stream: TLSSocketStream, why: str, until: float, hello_read: bool = False) -> None:
    """Read what a refused member sent (its Hello, sent right after TLS; unless `hello_read`),
    and at `until` (trio time) tell it why (an Error in place of our Hello, which every wire
    revision reads)."""
    with trio.move_on_at(until + REFUSAL_SECONDS):
        try:
            if not hello_read:
                with trio.move_on_at(until):
                    await stream.receive_some()
            await trio.sleep_until(until)
            await stream.send_all(wire.encode(wire.Error(why)))
        except CONNECTION_ERRORS:
            pass


def _reason(e: BaseException) -> str:
    cause = e.__cause__ or e.__context__
    if isinstance(e, trio.BrokenResourceError) and cause is not None:
        e = cause
    text = str(e) or type(e).__name__
    return " ".join(text.split())
