"""A very small HTTP/1.1 server on trio, for a service's own endpoints (metrics, health, a page).

Owns accepting plain-HTTP connections on one address, reading one GET or HEAD
request per connection (bounded in size and time), calling the route for its
path and writing the response with `Connection: close`. Every connection is a
task in the server's nursery; at most MAX_CONNECTIONS at once. Must not serve
swarm traffic (that is TLS, node/net/transport.py) nor know what a route shows.

Why a probe gets through while idle connections hold every slot: when all
MAX_CONNECTIONS slots are taken, a new connection takes the slot of the oldest
connection still reading its request, which is closed unanswered (a
slowloris's, a port scan's or a stuck scraper's). A connection that has read
its whole request is never taken from: it holds its slot until its response is
written, at most REQUEST_SECONDS more, and only when every slot is answering is
a new connection closed at once. A probe sends its request as it connects, so
it loses its slot only if MAX_CONNECTIONS newer connections arrive before its
request does. No cap per peer address: the kubelet or a sidecar on the node's
own host shares its address with anyone else there. Bookkeeping is a counter
and a dict of at most MAX_CONNECTIONS entries, O(1) a connection.

Why not a library: what is served is a few small documents to a scraper, a
probe and a browser; a full server (and its threads or asyncio loop) would be
more code to trust than these lines. Query strings are ignored.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import trio

from patchswarm.node.net.transport import format_addr, parse_addr

log = logging.getLogger("patchswarm.http")

MAX_REQUEST_BYTES = 8 << 10  # request line and headers
REQUEST_SECONDS = 10.0  # to send the request, and again to take the response
MAX_CONNECTIONS = 64
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
           503: "Service Unavailable"}


@dataclasses.dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[], Response]


def text(status: int, message: str) -> Response:
    return Response(status, (message + "\n").encode())


def _head(status: int, content_type: str, length: int) -> bytes:
    return (f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n"
            "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n").encode()


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_REQUEST_BYTES:
            return None
        data = await stream.receive_some(4096)
        if not data:
            return None
        buf += data
    head = buf.split(b"\r\n\r\n", 1)[0]
    return head if len(head) <= MAX_REQUEST_BYTES else None


def respond(routes: dict[str, Route], head: bytes | None) -> tuple[Response, bool]:
    """The response to one request head (None: unreadable), and whether to send its body."""
    if head is None:
        return text(400, "bad request"), True
    try:
        method, target, version = head.split(b"\r\n", 1)[0].decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        return text(400, "bad request line"), True
    if not version.startswith("HTTP/1."):
        return text(400, "expected HTTP/1.x"), True
    if method not in ("GET", "HEAD"):
        return text(405, "only GET and HEAD"), True
    route = routes.get(target.split("?", 1)[0])
    if route is None:
        return text(404, f"not found; try {', '.join(sorted(routes))}"), method == "GET"
    try:
        response = route()
    except Exception:  # a route's bug answers 500; the server and the service go on
        log.exception("HTTP route %s failed", target)
        response = text(500, "internal error (see the service's log)")
    return response, method == "GET"


async def serve_http(addr: str, routes: dict[str, Route], task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `routes` (path -> route) on `addr` (HOST:PORT; port 0 picks one) until cancelled.

    Reports the bound address through `task_status`.
    """
    host, port = parse_addr(addr)
    listeners = await trio.open_tcp_listeners(port, host=host)
    free = MAX_CONNECTIONS  # slots no connection holds
    reading: dict[trio.CancelScope, None] = {}  # slot holders still reading their request, oldest first

    def take_slot(scope: trio.CancelScope) -> bool:
        """A slot for a connection reading under `scope`; False: every slot is answering a request."""
        nonlocal free
        if free:
            free -= 1
        elif reading:
            oldest = next(iter(reading))
            del reading[oldest]
            oldest.cancel()  # it closes unanswered; its slot is the new connection's
        else:
            return False
        reading[scope] = None
        return True

    async def one(stream: trio.SocketStream) -> None:
        nonlocal free
        waited = trio.CancelScope(deadline=trio.current_time() + REQUEST_SECONDS)
        answering = False
        try:
            if not take_slot(waited):
                return  # close at once rather than queue
            with waited:
                head = await _read_head(stream)
            if waited not in reading or waited.cancelled_caught:
                return  # its slot was taken, or it said nothing in time: it gets nothing
            del reading[waited]
            answering = True  # from here on its slot cannot be taken
            response, with_body = respond(routes, head)
            with trio.move_on_after(REQUEST_SECONDS):
                await stream.send_all(_head(response.status, response.content_type, len(response.body))
                                      + (response.body if with_body else b""))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away
        finally:
            if answering or waited in reading:
                reading.pop(waited, None)
                free += 1
            await trio.aclose_forcefully(stream)

    bound = listeners[0].socket.getsockname()
    task_status.started(format_addr(host, bound[1]))
    await trio.serve_listeners(one, listeners)
