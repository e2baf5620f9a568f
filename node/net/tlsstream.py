"""A trio stream over a non-blocking `ssl.SSLSocket`: TLS where OpenSSL owns the socket.

Owns: wrapping an accepted or dialed TCP socket in TLS, the handshake, and
`receive_some` / `send_all` / `aclose` with trio's Stream semantics (one
receiver and one sender at a time, ClosedResourceError after close,
BrokenResourceError for a dead or faulty connection).

Why not `trio.SSLStream`: it runs OpenSSL over memory BIOs, so every 16 KiB
TLS record costs a trip through Python (read the socket, feed the BIO, read
the plaintext, yield to the scheduler). Here OpenSSL reads and writes the
file descriptor itself and `receive_some` drains every record that has
arrived in one call. `bench/transport.py` (1 MiB pieces through the wire
framing on loopback) measured 4.7 -> 1.6 ms of CPU per MiB received and
2.7 -> 1.5 per MiB sent, 221 -> 638 MB/s.

Waiting for the rest of a frame's body, it has the kernel wake it once most of
that rest is in (SO_RCVLOWAT), not per packet batch: at 100 Mbit/s in 64 KiB
parts, 73 -> 43 wake-ups and 11.7 -> 8.9 ms of CPU per MiB received
(`bench/transport.py --pace-mbit 100 --piece-kib 64`).
"""

from __future__ import annotations

import socket
import ssl

import trio

RECEIVE_LIMIT = 256 << 10  # most plaintext one receive_some hands over
# A stream starts with a receive buffer of one TLS record and quadruples it up to
# RECEIVE_LIMIT whenever a receive fills it: a bulk transfer reaches full size within
# a few reads, while a connection that carries small messages (the tracker's 10,000
# sessions, a peer's control traffic) keeps 16 KiB, not 256 KiB, of touched memory.
FIRST_BUFFER = 16 << 10
_SEND_SLICE = 256 << 10    # plaintext handed to OpenSSL per write
# Waiting for the rest of a frame's body, a stream asks the kernel (SO_RCVLOWAT) to wake it
# only once most of that rest is in: at WAN rates bytes trickle in a packet or two per
# wake-up, and each wake-up costs the event loop far more than its bytes. The mark is the
# rest less one record's plaintext (OpenSSL may already hold part of a record, up to
# 16 KiB of plaintext, that the rest completes), so it is always reached by the bytes the
# frame still needs; the kernel also wakes on FIN, errors and memory pressure.
_RECORD_PLAINTEXT = 16 << 10
_LOWAT_MIN = 8 << 10       # below this a wake-up or two more cost less than a setsockopt each
_LOWAT_MAX = 1 << 20       # the kernel caps the mark at half its largest receive buffer anyway


class TLSSocketStream(trio.abc.Stream):
    """TLS over one TCP socket; create with `wrap` and call `do_handshake` before use."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool):
        sock.setblocking(False)
        self._ssl = context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
        self._buffer = bytearray(FIRST_BUFFER)
        self._view = memoryview(self._buffer)
        self._handshake_done = False
        self._closed = False
        self._broken: BaseException | None = None
        self._eof = False
        self._receiving = False
        self._sending = False
        self._lowat = 1            # the socket's SO_RCVLOWAT; 0 where the socket refused it

    @classmethod
    def wrap(cls, tcp: trio.SocketStream, context: ssl.SSLContext, server_side: bool) -> "TLSSocketStream":
        """Take over the socket of `tcp` (which must not be used afterwards)."""
        sock = socket.socket(fileno=tcp.socket.detach())
        return cls(sock, context, server_side)

    # -- what the rest of the node asks of a TLS stream

    def getpeercert(self):
        return self._ssl.getpeercert()

    def getpeername(self):
        return self._ssl.getpeername()

    def selected_alpn_protocol(self) -> str | None:
        """The wire revision both sides offered in ALPN (None: the peer offered none)."""
        return self._ssl.selected_alpn_protocol()

    async def do_handshake(self) -> None:
        """Run the TLS handshake (certificates verified by the context); idempotent."""
        self._check_usable()
        while not self._handshake_done:
            try:
                self._ssl.do_handshake()
                self._handshake_done = True
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self._ssl)
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self._ssl)
            except (ssl.SSLError, OSError) as e:
                self._broken = e
                raise trio.BrokenResourceError(f"TLS handshake failed: {e}") from e
        await trio.lowlevel.checkpoint()

    # -- trio.abc.Stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        self._check_usable()
        limit = RECEIVE_LIMIT if max_bytes is None else min(int(max_bytes), RECEIVE_LIMIT)
        if limit < 1:
            raise ValueError(f"max_bytes: expected at least 1, found {max_bytes}")
        got = await self._receive(min(limit, len(self._buffer)), self._view)
        data = bytes(self._view[:got])
        if got == len(self._buffer) < RECEIVE_LIMIT:
            self._buffer = bytearray(min(RECEIVE_LIMIT, 4 * len(self._buffer)))
            self._view = memoryview(self._buffer)
        return data

    async def receive_into(self, target: memoryview) -> int:
        """Receive straight into `target` (a writable byte view), without the copy that
        `receive_some` makes: every plaintext byte that has arrived, up to len(target), at
        least one unless the peer closed (0). For a frame's body (wire.FrameBuffer.body_buffer):
        the caller must be sure that len(target) bytes are coming, since a wait ends only once
        most of them have arrived (see _RECORD_PLAINTEXT)."""
        self._check_usable()
        if len(target) < 1:
            raise ValueError("receive_into: expected a target of at least 1 byte, found an empty one")
        return await self._receive(len(target), target, wake_for=len(target))

    async def _receive(self, limit: int, into: memoryview, wake_for: int = 1) -> int:
        """Wait until plaintext has arrived and read up to `limit` bytes of it into `into`:
        at least one, or 0 once the peer has closed. `wake_for`: plaintext bytes the caller
        is sure will come (the rest of a frame), so a wait may end only once most are in."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this TLS stream")
        self._receiving = True
        try:
            if not self._handshake_done:
                await self.do_handshake()
            await trio.lowlevel.checkpoint_if_cancelled()
            while True:
                got = self._drain(limit, into)
                if got or self._eof:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return got
                self._set_wake_mark(wake_for)
                await trio.lowlevel.wait_readable(self._ssl)
                self._check_usable()
        finally:
            self._receiving = False

    def receive_into_nowait(self, target: memoryview) -> int | None:
        """`receive_into` without waiting and without yielding: the bytes read (at least
        one), 0 if the peer closed, None if nothing has arrived (then await `receive_into`).
        Not a checkpoint: a caller that reads this way yields once per message it returns
        (node/net/transport.py MessageStream.receive), not once per read."""
        self._check_usable()
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this TLS stream")
        if len(target) < 1:
            raise ValueError("receive_into_nowait: expected a target of at least 1 byte, found an empty one")
        if not self._handshake_done:
            return None
        got = self._drain(len(target), target)
        return got if got or self._eof else None

    def _set_wake_mark(self, coming: int) -> None:
        """Before a wait: have the kernel report the socket readable once enough of the
        `coming` plaintext bytes have arrived that no wake-up is spent on a trickle (see
        _RECORD_PLAINTEXT); 1 byte when the caller does not know what comes."""
        mark = min(coming - _RECORD_PLAINTEXT, _LOWAT_MAX)
        if mark < _LOWAT_MIN:
            mark = 1
        if mark == self._lowat or not self._lowat:
            return
        try:
            self._ssl.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
            self._lowat = mark
        except OSError:
            self._lowat = 0  # not a socket that takes it: wake on every arrival, as before

    def _drain(self, limit: int, into: memoryview) -> int:
        """Read every plaintext byte OpenSSL can give without blocking, up to `limit`, into `into`."""
        got = 0
        try:
            while got < limit and not self._eof:
                n = self._ssl.recv_into(into[got:limit])
                if n == 0:
                    self._eof = True  # close_notify, or a bare FIN: frames carry their own length
                got += n
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLWantWriteError:
            pass  # TLS 1.3 never needs to write to read; if it ever does, the next wait retries
        except (ssl.SSLError, OSError) as e:
            if got:
                return got  # hand over what arrived intact; the error repeats on the next call
            self._broken = e
            raise trio.BrokenResourceError(f"TLS receive failed: {e}") from e
        return got

    async def send_all(self, data) -> None:
        self._check_usable()
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this TLS stream")
        self._sending = True
        view = memoryview(data).cast("B")
        sent = 0
        try:
            if not self._handshake_done:
                await self.do_handshake()
            await trio.lowlevel.checkpoint_if_cancelled()
            while sent < len(view):
                piece = view[sent:sent + _SEND_SLICE]
                try:
                    sent += self._ssl.send(piece)
                except ssl.SSLWantWriteError:
                    await trio.lowlevel.wait_writable(self._ssl)  # then retry the same piece, as OpenSSL requires
                    self._check_usable()
                except ssl.SSLWantReadError:
                    await trio.sleep(0.001)  # only during a handshake; the receiving task owns wait_readable
                except (ssl.SSLError, OSError) as e:
                    self._broken = e
                    raise trio.BrokenResourceError(f"TLS send failed: {e}") from e
            await trio.lowlevel.cancel_shielded_checkpoint()
        except BaseException as e:
            if 0 < sent < len(view) and self._broken is None:
                self._broken = e  # half a message went out: the byte stream is no longer framed
            raise
        finally:
            self._sending = False

    def send_nowait(self, data) -> bool:
        """Write `data` (at most one send slice) now if the socket takes it: True if it went
        out, False if not. After False the caller sends it with `send_all`, and that must be the
        next write on this stream, with the same bytes: OpenSSL may hold a record of it half
        written and takes only that write again. For small messages to many streams (the
        tracker's notices to every member): no task wake-up per stream."""
        if (self._sending or not self._handshake_done or self._closed or self._broken is not None
                or len(data) > _SEND_SLICE):
            return False
        try:
            self._ssl.send(data)  # whole or not at all: partial writes are not enabled
        except ssl.SSLWantWriteError:
            return False
        except ssl.SSLWantReadError:
            return False  # not after the handshake with TLS 1.3; send_all knows what to do
        except (ssl.SSLError, OSError) as e:
            self._broken = e  # the next send_all raises BrokenResourceError
            return False
        return True

    async def wait_send_all_might_not_block(self) -> None:
        self._check_usable()
        await trio.lowlevel.wait_writable(self._ssl)

    def abort(self, why: str) -> None:
        """End the connection now, from synchronous code: the peer and any task waiting on
        this stream see it fail (used when the peer's certificate is revoked)."""
        if self._closed or self._broken is not None:
            return
        self._broken = trio.BrokenResourceError(why)
        try:
            self._ssl.shutdown(socket.SHUT_RDWR)  # a pending receive wakes and fails
        except OSError:
            pass

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._handshake_done and self._broken is None:
            try:
                self._ssl.unwrap()  # one non-blocking try at close_notify; the peer reads EOF either way
            except (ssl.SSLError, OSError, ValueError):
                pass
        trio.lowlevel.notify_closing(self._ssl)
        self._ssl.close()
        await trio.lowlevel.checkpoint()

    def _check_usable(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this TLS stream was closed")
        if self._broken is not None:
            raise trio.BrokenResourceError(f"TLS stream broken earlier: {self._broken!r}")
