"""The node's local Unix socket: accepts requests from rollout workers and people, and answers them.

Owns the socket file (`DATA_DIR/node.sock`, mode 0600, a stale file from a
crashed daemon is replaced) and the request loop of each connection. The
bytes are protocol/localapi.py's; what a request does is the daemon's
`handle(request) -> reply`. Must not hold node state.
"""

from __future__ import annotations

import logging
import os
import socket as _socket
from pathlib import Path
from typing import Awaitable, Callable

import trio

from protocol import localapi
from protocol.errors import ProtocolError
from protocol.wire import CLOSED, NEED_DATA, FrameBuffer

log = logging.getLogger("patchswarm.localapi")
Handler = Callable[[dict], Awaitable[dict]]


async def serve_local(path: Path, handle: Handler, task_status=trio.TASK_STATUS_IGNORED) -> None:
    path = Path(path)
    path.unlink(missing_ok=True)  # the caller holds the data dir's lock: any file here is stale
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: no window where others could connect
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    listener = trio.SocketListener(sock)

    async def one(stream: trio.SocketStream) -> None:
        frames = FrameBuffer(localapi.MAX_FRAME_BYTES)
        try:
            while True:
                body = frames.next_body()
                if body is CLOSED:
                    return
                if body is NEED_DATA:
                    data = await stream.receive_some(1 << 20)
                    frames.receive_data(data)
                    continue
                try:
                    reply = await handle(localapi.check_request(localapi.decode(body)))
                except ProtocolError as e:
                    reply = localapi.error(localapi.BAD_REQUEST, str(e))
                await stream.send_all(localapi.encode(reply))
        except ProtocolError as e:
            log.warning("local client sent bad frames: %s", e)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    task_status.started(path)
    try:
        await trio.serve_listeners(one, [listener])
    finally:
        path.unlink(missing_ok=True)
