"""Read every datagram a UDP socket holds in one turn of the asyncio loop.

Owns: `read_in_batches(transport)`, which replaces the reader callback of one
asyncio selector datagram transport (the sockets aioice gathers for ICE) with
one that reads up to `BATCH` datagrams per readiness event instead of one.
Must not change what is read or in what order, nor touch any transport it
was not given; on a loop or transport without the internals it relies on it
changes nothing and returns False.

Why: asyncio's `_SelectorDatagramTransport._read_ready` takes one datagram
per loop turn, so a WebRTC end receiving ~850 datagrams per MB pays one
epoll call, one loop turn and one wake-up of the DTLS task per datagram,
and the DTLS task never sees more than one datagram queued. Read in batches,
the datagrams that arrived together are queued together, the task drains
them in one run, and node/net/sctpfast.py's receiver acknowledges the
batch with one SACK instead of one per packet (measured in bench/RESULTS.md,
"Fewer turns and fewer SACKs").
"""

from __future__ import annotations

import asyncio

# Datagrams read per readiness event at most: enough to drain what a burst
# leaves in the socket (~60 KB), few enough that other callbacks (timers,
# the trio bridge) still run between batches.
BATCH = 64


def read_in_batches(transport, batch: int | None = None) -> bool:
    """Make `transport` (a selector loop's datagram transport) read up to `batch`
    (None: BATCH) datagrams per readiness event. True if installed."""
    batch = BATCH if batch is None else batch
    loop = getattr(transport, "_loop", None)
    sock = getattr(transport, "_sock", None)
    protocol = getattr(transport, "_protocol", None)
    fd = getattr(transport, "_sock_fd", None)
    if (not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop) or sock is None
            or protocol is None or fd is None or not hasattr(transport, "_conn_lost")
            or not hasattr(transport, "max_size") or transport.is_closing()):
        return False
    recvfrom, max_size = sock.recvfrom, transport.max_size

    def ready() -> None:
        # asyncio's _read_ready, looped: the same calls, the same error handling.
        for _ in range(batch):
            if transport._conn_lost:
                return
            try:
                data, addr = recvfrom(max_size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                protocol.error_received(exc)
                return
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                transport._fatal_error(exc, "Fatal read error on datagram transport")
                return
            protocol.datagram_received(data, addr)

    # Replaces the reader the transport registered (the selector keeps one per fd);
    # the transport's close() removes it as it would its own.
    loop._add_reader(fd, ready)
    return True
