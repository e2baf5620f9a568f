"""The node's local Unix socket: accepts requests from rollout workers and people, and answers them.

Owns the socket file (`DATA_DIR/node.sock`, mode 0600, a stale file from a
crashed daemon is replaced), the request loop of each connection, and
`LocalRequests`, what each request does: status, wait for a version, submit
trajectories (appended to the spool, acknowledged once durable; a record whose
id the spool remembers is answered with its first seq, not stored again), stream the
changes since a version (node/changelog.py's files, a bounded read at a
time: a `StreamedReply` is several frames). The bytes
are protocol/localapi.py's. Must not hold node state: `LocalRequests` asks
the parts that do.

The loop drives plain non-blocking sockets with trio's `wait_readable` /
`wait_writable` instead of `trio.SocketStream`: a rollout worker makes one
small request at a time and waits for the answer, so the next request is never
there when the loop looks. SocketStream first tries the read (a failing
syscall and an exception), then waits, and yields to the scheduler again after
every send; going straight to the wait and sending without a yield cut the
node's CPU per one-record submit (bench/trajectories.py). Connections read
into one reusable buffer, shared (each read is copied into the connection's
FrameBuffer before the next checkpoint): a fresh `recv(1 MiB)` costs an mmap
and munmap per call (11 us measured), more than the rest of a small request's
read, and a buffer per connection cost 256 KiB per idle client.

At most `max_connections` at once (each holds a file descriptor, which the
node's peers and files need too): past it, a new connection gets one
`too_many_connections` error and is closed, and the node serves on. A
wait_version whose client closes the connection ends then, not at its timeout;
a frame begun and not finished within FRAME_WAIT_S closes its connection (one
deadline for the frame, from its first byte or from when it got its room in the
budget below, not one per read).

One budget over all connections (`BufferBudget`, BUFFER_BUDGET_BYTES) bounds
the bytes received and not yet handled: without it, 1,024 clients could each
make the node buffer a 256 MiB frame. A connection holds budget for what it
has buffered, the frame it is reading (all of it, from the moment its header
is in, so that connections never each hold part of what they need and wait on
one another), and the room of its next read; a request's bytes stay counted
until it is answered. A connection that needs more than is left stops reading
its socket (its client's send blocks) until others give some back, first come
first served, for at most BUFFER_WAIT_S; then it gets `buffers_full` and is
closed. A frame larger than the whole budget gets `too_large` and its
connection is closed. Not counted: what a request's handling builds from its
bytes (a submit's records are copies of its payloads until they are spooled).
A request the node fails on (a fault of its own) gets `internal_error`, or
a closed connection mid-stream; the node serves on.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import resource
import select
import socket as _socket
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, BinaryIO, Callable

import trio

from patchswarm.protocol import localapi
from patchswarm.protocol.errors import DiskFull, ProtocolError, SpoolFull, StorageFailed, UsageError
from patchswarm.protocol.wire import CLOSED, HEADER_BYTES, NEED_DATA, FrameBuffer

from patchswarm.node import failpoints
from patchswarm.node.spool import TrajectorySpool

if TYPE_CHECKING:  # the changelog imports torch; the clients import this module and need neither
    from patchswarm.node.changelog import Changelog

log = logging.getLogger("patchswarm.localapi")
Handler = Callable[[dict], Awaitable[dict]]
RECEIVE_BYTES = 256 << 10  # per read; a larger frame takes several reads
FRAME_WAIT_S = 60.0  # for all of a frame once it has begun (a client idle between requests waits freely)
SUN_PATH_BYTES = 107  # sockaddr_un's path, less its terminating NUL
MAX_CONNECTIONS = 1024  # and at most a quarter of the process's file descriptor limit
LISTEN_BACKLOG = MAX_CONNECTIONS  # connections queued in the kernel, not yet accepted (at least)
# Requests this large are read in a thread: a frame of 64 KiB metas of empty containers costs the
# reader ~0.4 s per MiB (measured on a loaded 2-core machine: each meta is walked and built once to
# check it, as the origin will), where a rollout worker's usual submit of small records is read inline.
DECODE_OFF_LOOP_BYTES = 1 << 20
# ... and so are requests of more records than this, whatever their bytes: reading and checking
# costs per record (65,536 records of 1 byte, 393 KB, took 0.3 s to read and check on the loop,
# ~4.6 us a record, measured on the loaded 2-core machine), where the hop to a worker thread costs
# ~65-117 us (node/seglog.py in_worker_thread). 64 records: at most ~0.3 ms on the loop, and a
# rollout worker's usual submit of a few records stays without a hop.
DECODE_OFF_LOOP_RECORDS = 64
# Bytes received on the local socket and not yet handled, all connections together. 1 GiB: room
# for the largest frame (256 MiB) while every other connection holds a read's worth (1,024 x
# 256 KiB), so the largest request always gets in once the requests before it are answered, and
# for four such frames at once; honest use (a few dozen workers' 1 MiB trajectories) needs a few
# tens of MiB. A fixed figure, not a share of the host's memory: a share would refuse legal
# requests on a small host and differ from host to host.
BUFFER_BUDGET_BYTES = 1 << 30
BUFFER_WAIT_S = FRAME_WAIT_S  # the longest a connection waits for room before it is refused
# How often a wait_version whose client has sent more (a pipelined request, readable until the
# wait is answered) looks whether that client has since closed the connection.
LEFT_POLL_S = 1.0
_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.EBADF)
_ENDED_WITH_CLIENT = frozenset({"wait_version"})  # ops dropped when their client leaves (they change nothing)


class _Waiter:
    __slots__ = ("n", "granted", "event")

    def __init__(self, n: int):
        self.n, self.granted, self.event = n, False, trio.Event()


class BufferBudget:
    """Bytes the local socket's connections may hold, received and not yet handled: `take`
    (waits, first come first served), `try_take` (never waits), `release`. `status()` for the
    node's status map. One per `serve_local`; the daemon makes it to show it."""

    def __init__(self, limit: int = BUFFER_BUDGET_BYTES):
        if type(limit) is not int or limit < RECEIVE_BYTES:
            raise UsageError(f"local buffer budget: expected at least {RECEIVE_BYTES} bytes, found {limit!r}")
        self.limit = limit
        self.used = 0
        self.peak = 0  # the most used at once
        self.waits = 0  # times a connection stopped reading until others gave room back
        self.refused = 0  # frames larger than the whole budget (too_large)
        self.timed_out = 0  # connections that waited BUFFER_WAIT_S for room (buffers_full)
        self._queue: collections.deque[_Waiter] = collections.deque()

    def status(self) -> dict:
        return {"limit_bytes": self.limit, "used_bytes": self.used, "peak_bytes": self.peak,
                "waiting": len(self._queue), "waits": self.waits, "refused": self.refused,
                "timed_out": self.timed_out}

    def try_take(self, n: int) -> bool:
        if self._queue or n > self.limit - self.used:  # behind those waiting, not before them
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    async def take(self, n: int) -> None:
        """Take `n` bytes once they are free and everyone who asked before has had theirs.
        A caller cancelled while waiting takes nothing."""
        if self.try_take(n):
            return
        self.waits += 1
        w = _Waiter(n)
        self._queue.append(w)
        try:
            await w.event.wait()
        except BaseException:
            if w.granted:  # granted, then cancelled before it ran: give it back
                self.release(n)
            else:
                self._queue.remove(w)
                self._grant()  # the next one may fit where this one did not
            raise

    def release(self, n: int) -> None:
        self.used -= n
        if self._queue:
            self._grant()

    def _grant(self) -> None:
        while self._queue and self._queue[0].n <= self.limit - self.used:
            w = self._queue.popleft()
            self.used += w.n
            self.peak = max(self.peak, self.used)
            w.granted = True
            w.event.set()


class StreamedReply:
    """A reply of several frames: the maps `parts` yields, sent in order as they come."""

    def __init__(self, parts: AsyncIterator[dict]):
        self.parts = parts


class LocalRequests:
    """`handle(request) -> reply` for `serve_local`. `status()` is the node's
    status map; `wait_version(min_version, timeout)` returns False when the
    timeout ran out first; `version()` the node's version, for that error;
    `changelog`: where `changes` finds its files (None: the node records none, `changes` says so)."""

    def __init__(self, status: Callable[[], dict], wait_version: Callable[[int, float], Awaitable[bool]],
                 version: Callable[[], int | None], spool: TrajectorySpool, changelog: Changelog | None = None):
        self._status = status
        self._wait_version = wait_version
        self._version = version
        self._spool = spool
        self._changelog = changelog
        # Set when the node stops (Node.drain): submits are refused, nothing stored, so the
        # records go to another node instead of a spool that may never upload them.
        self.stopping = False

    async def __call__(self, req: dict) -> dict:
        op = req["op"]
        if op == "status":
            return localapi.ok(status=self._status())
        if op == "wait_version":
            if await self._wait_version(req["min_version"], req["timeout"]):
                return localapi.ok(status=self._status())
            return localapi.error(localapi.TIMEOUT, f"version {req['min_version']} not reached within "
                                                    f"{req['timeout']} s; the node is at {self._version()}")
        if op == "submit":
            if self.stopping:
                return localapi.error(localapi.STOPPING, "this node is stopping and uploading its spool: nothing "
                                                         "stored; submit through another node, or here once it is back")
            try:
                seqs, repeated = await self._spool.submit(req["records"], req["timeout"])
            except SpoolFull as e:
                return localapi.error(localapi.FULL, str(e))
            except DiskFull as e:  # nothing acknowledged: the worker keeps its records and retries
                return localapi.error(localapi.DISK_FULL, str(e))
            except StorageFailed as e:  # an I/O error: nothing acknowledged; the spool recovers, retry
                return localapi.error(localapi.STORAGE, str(e))
            except UsageError as e:
                return localapi.error(localapi.BAD_REQUEST, str(e))
            await failpoints.hold("submit.durable")  # a kill here: fsynced, the client never hears of it
            return localapi.ok(seqs=seqs, repeated=repeated)
        if op == "changes":
            return await self._changes(req["from_version"], req.get("from_hash"))  # left out: nil
        return localapi.error(localapi.UNAVAILABLE, f"{op}: not available on this node")

    async def _changes(self, after: int, after_hash: str | None) -> dict | StreamedReply:
        st = self._status()
        version, current = st.get("version"), st.get("state_hash")
        if version is None:
            return localapi.error(localapi.UNAVAILABLE, "changes: the node holds no version yet")
        if self._changelog is None:
            return localapi.error(localapi.UNAVAILABLE, "changes: this node does not record them; start it with "
                                                        "--sparse-handoff")
        files = await trio.to_thread.run_sync(self._changelog.chain, after, after_hash, version, current)
        if files is None:
            path = st.get("base_path") or st.get("weights_path")
            return localapi.error(localapi.BOOTSTRAP, f"changes: the node no longer holds those from version {after} "
                                                      f"to {version}; read {path} and follow from its version", path=path)
        return StreamedReply(_stream_files(files, localapi.ok(done=True, version=version, state_hash=current)))


async def _stream_files(files: list[BinaryIO], last: dict) -> AsyncIterator[dict]:
    """The files' bytes as `chg` parts of at most CHANGES_PART_BYTES, then `last`; closes them."""
    try:
        for f in files:
            while chunk := await trio.to_thread.run_sync(f.read, localapi.CHANGES_PART_BYTES):
                yield localapi.ok(chg=chunk)
        yield last
    finally:
        for f in files:
            f.close()


@contextlib.contextmanager
def unix_address(path: Path):
    """`path` as an AF_UNIX address to bind or connect: itself when it fits sockaddr_un
    (107 bytes), else through an open handle on its directory (/proc/self/fd/N/NAME), so
    a data dir of any length works (a pod's volume path alone can pass 100 bytes)."""
    path = Path(path)
    if len(os.fsencode(path)) <= SUN_PATH_BYTES:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _connection_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(1, min(MAX_CONNECTIONS, soft // 4))


async def serve_local(path: Path, handle: Handler, task_status=trio.TASK_STATUS_IGNORED, *,
                      max_connections: int | None = None, budget: BufferBudget | None = None,
                      budget_wait: float = BUFFER_WAIT_S) -> None:
    """Serve `handle` on a Unix socket at `path` until cancelled. `budget`: the bytes all
    connections may hold (a new BufferBudget() if None); `budget_wait`: the longest one
    waits for room in it."""
    path = Path(path)
    budget = BufferBudget() if budget is None else budget
    limit = _connection_limit() if max_connections is None else max_connections
    refusal = localapi.encode(localapi.error(
        localapi.TOO_MANY_CONNECTIONS, f"local socket {path}: expected at most {limit} connections at once, found "
                                       f"{limit} open; close idle clients or retry later"))
    buf = bytearray(RECEIVE_BYTES)
    open_connections = 0

    async def serve_connection(conn: _socket.socket) -> None:
        nonlocal open_connections
        try:
            await _serve_connection(conn, handle, buf, budget, budget_wait)
        finally:
            open_connections -= 1

    path.unlink(missing_ok=True)  # the caller holds the data dir's lock: any file here is stale
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC)
    try:
        old = os.umask(0o177)  # the socket is created 0600: no window where others could connect
        try:
            with unix_address(path) as address:
                sock.bind(address)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        # Connections not yet accepted wait in the kernel's queue: room for as many as the node
        # serves at once (the kernel caps it at net.core.somaxconn). With 64, a hundred workers
        # connecting while the loop was busy for a moment found it full, and a client's connect
        # fails at once then (EAGAIN on AF_UNIX), not after its connect timeout.
        sock.listen(max(limit, LISTEN_BACKLOG))
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as e:  # e.g. out of file descriptors: keep serving the others
                    log.warning("local socket: accept failed: %s", e)
                    await trio.sleep(0.1)
                    continue
                conn.setblocking(False)
                if open_connections >= limit:
                    with conn:
                        with contextlib.suppress(OSError):  # a small frame into an empty buffer
                            conn.send(refusal)
                    continue
                open_connections += 1
                nursery.start_soon(serve_connection, conn)
    finally:
        trio.lowlevel.notify_closing(sock)
        sock.close()
        path.unlink(missing_ok=True)


async def _serve_connection(conn: _socket.socket, handle: Handler, buf: bytearray, budget: BufferBudget,
                             budget_wait: float) -> None:
    """Answer one client's requests in order until it closes the connection. `buf`
    is shared: each read is copied out of it before the next checkpoint. `held`: the
    bytes of `budget` this connection holds, at least what it has buffered and the
    requests it has taken out of its buffer and not yet answered."""
    frames = FrameBuffer(localapi.MAX_FRAME_BYTES)
    view = memoryview(buf)
    held = 0
    begun = None  # when the frame being read began (or got its room), for FRAME_WAIT_S
    try:
        waited = True
        while True:
            body = frames.next_body()
            if body is CLOSED:
                return
            if body is NEED_DATA:
                # Every request taken out before has been answered: hold what is buffered, or the
                # whole frame it begins once its header is in, and nothing more.
                buffered = frames.buffered
                total = None if buffered < HEADER_BYTES else frames.frame_bytes
                if total is not None and total > budget.limit:
                    budget.refused += 1
                    await _refuse(conn, localapi.TOO_LARGE, f"local socket: expected a request of at most "
                                  f"{budget.limit - HEADER_BYTES} bytes (the node's budget for requests received and "
                                  f"not yet handled is {budget.limit}), found one of {total - HEADER_BYTES}; split it "
                                  f"over several calls")
                    return
                want = buffered if total is None else total
                if held > want:
                    budget.release(held - want)
                    held = want
                elif held < want:  # a frame begun: room for all of it before reading on
                    if not budget.try_take(want - held):
                        if not await _take(budget, want - held, budget_wait):
                            await _refuse_full(conn, budget, budget_wait)
                            return
                        begun = None  # the wait for room is not the client's time
                    held = want
                if buffered:  # in the middle of a frame: all of it comes soon or never
                    # One deadline for the whole frame, not one per read: a client that sends a byte
                    # now and then would otherwise hold its frame's room in the budget for ever.
                    begun = trio.current_time() if begun is None else begun
                    with trio.move_on_at(begun + FRAME_WAIT_S) as cut:
                        await trio.lowlevel.wait_readable(conn)
                    if cut.cancelled_caught:
                        log.warning("local client: expected a frame begun to be finished within %g s, found %d of "
                                    "its %s bytes; closing", FRAME_WAIT_S, frames.buffered,
                                    "?" if total is None else total)
                        return
                else:
                    await trio.lowlevel.wait_readable(conn)
                waited = True
                if total is None:  # room for one read (less where less is free), given back after it
                    room = max(HEADER_BYTES - buffered, min(RECEIVE_BYTES, budget.limit - budget.used))
                    if not budget.try_take(room):
                        if not await _take(budget, room, budget_wait):
                            await _refuse_full(conn, budget, budget_wait)
                            return
                        begun = None  # as above: the wait for room is not the client's time
                    held += room
                else:  # the frame's reserved bytes, and none of the next request's
                    room = min(RECEIVE_BYTES, held - buffered)
                try:
                    n = conn.recv_into(buf, room)
                except (BlockingIOError, InterruptedError):
                    continue
                frames.receive_data(view[:n])  # copied; n == 0 is the client's EOF
                if total is None:
                    buffered = frames.buffered
                    budget.release(held - buffered)
                    held = buffered
                continue
            begun = None
            if not waited:  # requests queued back to back: let other tasks run between them
                await trio.lowlevel.checkpoint()
            waited = False
            try:
                if len(body) < DECODE_OFF_LOOP_BYTES and localapi.declared_records(body) <= DECODE_OFF_LOOP_RECORDS:
                    req = localapi.check_request(localapi.decode_request(body))
                else:  # its metas or records may cost seconds of the reader's CPU: the loop turns meanwhile
                    req = await trio.to_thread.run_sync(_read_request, body)
            except ProtocolError as e:
                reply = localapi.error(localapi.BAD_REQUEST, str(e))
            else:
                try:
                    if req["op"] in _ENDED_WITH_CLIENT:
                        reply = await _unless_client_leaves(conn, handle, req)
                        if reply is None:
                            return
                    else:
                        reply = await handle(req)
                except Exception as e:  # the node's fault, not the client's: this request fails, not the node
                    log.exception("local socket: %s failed", req["op"])
                    reply = localapi.error(localapi.INTERNAL, f"{req['op']}: the node failed: {_fault(e)}")
            if isinstance(reply, StreamedReply):
                async with contextlib.aclosing(reply.parts) as parts:
                    while True:
                        try:
                            part = await parts.__anext__()
                        except StopAsyncIteration:
                            break
                        except Exception:  # part of the reply is out: closing is all that is left to say
                            log.exception("local socket: a streamed reply failed")
                            return
                        await _send_all(conn, localapi.encode(part))
            else:
                await _send_all(conn, localapi.encode(reply))
    except ProtocolError as e:
        log.warning("local client sent bad frames: %s", e)
    except OSError as e:
        if e.errno not in _GONE:
            raise
    finally:
        budget.release(held)
        trio.lowlevel.notify_closing(conn)
        conn.close()


def _read_request(body: bytes) -> dict:
    """A worker thread's read of a request: decoded and checked (both per record)."""
    return localapi.check_request(localapi.decode_request(body))


async def _take(budget: BufferBudget, n: int, wait: float) -> bool:
    """`budget.take(n)` within `wait` seconds; False if it ran out. (Callers try
    `budget.try_take` first: the usual case, without a coroutine or a cancel scope.)"""
    with trio.move_on_after(wait):
        await budget.take(n)
        return True
    return False


async def _refuse_full(conn: _socket.socket, budget: BufferBudget, wait: float) -> None:
    budget.timed_out += 1
    await _refuse(conn, localapi.BUFFERS_FULL, f"local socket: expected room for this request in the node's budget "
                  f"for requests received and not yet handled ({budget.limit} bytes) within {wait:g} s, found it "
                  f"held by other clients' requests all along; nothing was done, retry later")


async def _refuse(conn: _socket.socket, code: str, message: str) -> None:
    """Send one error and let the caller close: its client may still be sending the request
    (its send then fails, and it reads this error). Bounded: a client that reads nothing is
    not waited on."""
    log.warning("local client refused (%s): %s", code, message)
    with trio.move_on_after(1.0), contextlib.suppress(OSError):
        await _send_all(conn, localapi.encode(localapi.error(code, message)))


def _fault(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:  # from a nursery
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


async def _unless_client_leaves(conn: _socket.socket, handle: Handler, req: dict):
    """`await handle(req)`, or None once the client has closed the connection (both
    directions: a client that shut down only its sending side still reads the answer).
    For waits that change nothing: a worker killed during wait_version(v, 3600) would
    otherwise hold its task and file descriptor for the hour."""
    reply = None
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            p = select.poll()
            p.register(conn, select.POLLIN)
            while True:
                await trio.lowlevel.wait_readable(conn)  # data (a pipelined request), EOF or a hangup
                if any(ev & (select.POLLHUP | select.POLLERR) for _, ev in p.poll(0)):
                    nursery.cancel_scope.cancel()
                    return
                # Readable and still there: a pipelined request (or its sender's EOF alone), which
                # stays readable until this one is answered. Look again every LEFT_POLL_S: a
                # client that leaves after pipelining is still noticed, without a busy loop.
                await trio.sleep(LEFT_POLL_S)

        nursery.start_soon(watch)
        reply = await handle(req)
        nursery.cancel_scope.cancel()
    return reply


async def _send_all(conn: _socket.socket, data: bytes) -> None:
    """Send everything; wait for room only when the socket buffer is full (rare:
    replies are small and the client reads them at once)."""
    rest = memoryview(data)
    while rest:
        try:
            rest = rest[conn.send(rest):]
        except (BlockingIOError, InterruptedError):
            pass
        if rest:
            await trio.lowlevel.wait_writable(conn)
