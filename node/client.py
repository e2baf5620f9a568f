"""Talk to a node daemon over its local Unix socket: `NodeClient` (blocking) and `AsyncNodeClient` (trio).

For rollout workers and people. `status()`, `wait_version(min_version,
timeout)`, `submit(payload, policy_version, meta=None) -> seq` and
`submit_many(records) -> seqs`. A payload is bytes, or any msgpack-able
object (packed by `protocol.trajectory.encode_payload`; the trainer gets it
back with `record.value()`). `submit` returns once the node has the records
durably in its spool. `follow(tensors, from_version, from_hash)` is the
sparse hand-off: the changes since a version written into the caller's
tensors in place (any device; protocol/changes.py), with a bootstrap from the
node's base file when the node no longer holds them.
Errors the node reports raise `NodeError` (with `.code`); a missing socket
raises `NodeUnavailable`. A connection kept from a node that has since closed
it (a restart) is replaced and the call sent again when the request did not go
out (the send failed: no node saw it, so this is safe for a submit too).

Submits are idempotent: each record carries a record id (16 random bytes, or
the caller's `record_id`), and a node that already holds an id answers the
seq it stored that record under instead of storing it again. So a submit
whose connection broke after the request went out (the node died before its
reply, maybe after its fsync) is sent again, with the same ids, on a new
connection, retrying the connect until the call's timeout while the node
restarts. A node older than record ids refuses a request that has them
(nothing stored); the client then sends without ids (as before: no resend
after a lost reply) until it next connects. Other calls are sent again only
when they did not go out, as before.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import trio

from patchswarm.protocol import localapi
from patchswarm.protocol.errors import (CorruptData, InvalidInput, PatchswarmError, ProtocolError, StateHashMismatch,
                                        UsageError)
from patchswarm.protocol.trajectory import encode_payload
from patchswarm.protocol.wire import CLOSED, NEED_DATA, FrameBuffer

from patchswarm.node.localapi import RECEIVE_BYTES, unix_address

if TYPE_CHECKING:
    import torch
# torch, safetensors and the change applier are imported by the calls that move weights
# (`follow`, `bootstrap`): status, submit and wait_version (`patchswarm status`, a rollout
# worker's submits) start in ~0.1 s of CPU instead of the ~1.5 s that importing torch costs.

# receive_some allocates its buffer per call: below glibc's mmap threshold (128 KiB) that is cheap.
_ASYNC_RECEIVE_BYTES = 64 << 10

_IOV_MAX = 1024
SOCKET_NAME = "node.sock"
DEFAULT_SUBMIT_TIMEOUT = 60.0
RECORD_ID_BYTES = 16  # an id the client makes: random, so unique without coordination
_RESEND_PAUSE = (0.05, 0.5)  # s between tries to reach a restarting node: first, longest
_LONGEST_TIMEOUT = float(1 << 31)  # s (68 years): the kernel's socket timeout takes no more


class _Undelivered(Exception):
    """The node had closed a kept connection before the request went out."""


class _ReplyLost(Exception):
    """The request went out (or may have) and the connection broke before its reply."""


class NodeError(PatchswarmError):
    """The node answered a request with an error."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class NodeUnavailable(NodeError):
    """No node answers on the socket."""


def socket_path(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / SOCKET_NAME


def record(payload, policy_version: int, meta: dict | None = None, record_id: bytes | None = None) -> list:
    """One submit record: [payload bytes, policy_version, meta, record_id] (a random id
    of RECORD_ID_BYTES when None)."""
    data, meta = encode_payload(payload, meta)
    return [data, policy_version, meta, os.urandom(RECORD_ID_BYTES) if record_id is None else record_id]


def _records(records) -> tuple[list, bool]:
    """submit_many's items as records, and whether the caller chose any record id."""
    recs, chosen = [], False
    for r in records:
        if not isinstance(r, (tuple, list)) or not 2 <= len(r) <= 4:
            raise UsageError(f"submit_many: expected (payload, policy_version[, meta[, record_id]]) items, "
                               f"found {type(r).__name__} {repr(r)[:80]}")
        chosen = chosen or (len(r) == 4 and r[3] is not None)
        recs.append(record(*r))
    return recs, chosen


# How a node older than record ids refuses a record of 4 elements (its check_records' words).
_REFUSES_IDS = "policy_version: int >= 0, meta: map | nil], found"


def _refuses_ids(e: NodeError) -> bool:
    return e.code == localapi.BAD_REQUEST and _REFUSES_IDS in str(e)


def _without_ids(recs: list, chosen: bool, path: Path) -> list:
    """The records for a node that refuses record ids: without them (the ids it would
    have made idempotent were random), or an error if the caller chose them."""
    if chosen:
        raise NodeError(localapi.BAD_REQUEST, f"node at {path}: expected a node that takes record ids, found one "
                                              f"that refuses them (older than record ids); upgrade it, or submit "
                                              f"without record_id")
    return [r[:3] for r in recs]


def _lost(path: Path, lost: BaseException, timeout: float) -> NodeUnavailable:
    return NodeUnavailable("unavailable", f"node at {path}: the connection broke before the submit's reply ({lost}) "
                                          f"and no node that takes record ids answered it again within {timeout:g} s; "
                                          f"the records may be stored: resubmit them with the same record ids to "
                                          f"find out")


def _resend_after(e: Exception, lost: _ReplyLost | None, path: Path, timeout: float) -> _ReplyLost:
    """One failed try of a resendable submit: the lost reply to send again for, or raise
    what the caller gets (both clients' `_call` loops)."""
    if isinstance(e, _ReplyLost):
        return e
    if isinstance(e, NodeUnavailable) and lost is not None:  # the node is not back yet: try again
        return lost
    if lost is not None and _refuses_ids(e):  # an older node came back: the first may be stored
        raise _lost(path, lost, timeout) from None
    raise e  # no node to begin with, or a node's answer: as for any call


def _send_parts(s: socket.socket, parts: list) -> None:
    """Write the buffers in order with as few calls as the kernel allows (sendmsg
    takes up to _IOV_MAX of them at once; a short write resumes where it stopped)."""
    if len(parts) == 1:
        s.sendall(parts[0])
        return
    views, i = [memoryview(p) for p in parts], 0
    while i < len(views):
        sent = s.sendmsg(views[i:i + _IOV_MAX])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


def _fed(client: "NodeClient", more: Callable[[dict], bool], reply: dict) -> bool:
    try:
        return more(reply)
    except BaseException:
        client.close()  # the rest of the stream would be read as replies to the next request
        raise


def _unavailable(path: Path, e: BaseException, connect_timeout: float) -> NodeUnavailable:
    """Connecting to `path` failed with `e`: what was expected there, and what was found."""
    if isinstance(e, FileNotFoundError):
        found = "no such file (is the node running, on this data dir?)"
    elif isinstance(e, PermissionError):
        found = "no permission to connect (the node makes it mode 0600: run as the node's user)"
    elif isinstance(e, (socket.timeout, TimeoutError, trio.TooSlowError)):
        found = f"no answer to connect within {connect_timeout:g} s (the node is not accepting)"
    elif isinstance(e, ConnectionRefusedError):
        try:
            is_socket = stat.S_ISSOCK(path.stat().st_mode)
        except OSError:
            is_socket = False
        found = ("a socket file no process listens on (a node that stopped without removing it, "
                 "or one still loading its state)" if is_socket else "a file that is not a socket")
    else:
        found = f"{type(e).__name__}: {e.strerror or e}" if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    return NodeUnavailable("unavailable", f"no node answers at {path}: expected a node's socket, found {found}")


def _result(reply: dict) -> dict:
    if reply.get("ok") is True:
        return reply
    raise NodeError(str(reply.get("code", "error")), str(reply.get("error", reply)))


def _settle(tensors: dict[str, torch.Tensor]) -> None:
    """Wait for the writes queued into accelerator tensors (`index_copy_` and copies run
    asynchronously on the device's current stream), so that the caller may read them on
    any stream, or hand them to another process, once `follow` returns."""
    import torch

    for device in {t.device for t in tensors.values() if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


class NodeClient:
    """Blocking client; one request at a time (open one client per thread)."""

    def __init__(self, path: str | os.PathLike, connect_timeout: float = 5.0):
        self.path = Path(path)
        self._sock: socket.socket | None = None
        self._frames = FrameBuffer(localapi.MAX_FRAME_BYTES)
        self._connect_timeout = connect_timeout
        # Replies are read into this one buffer: a fresh recv(1 MiB) per call costs an
        # mmap and munmap (11 us measured), more than the rest of a small reply's read.
        self._buf = bytearray(RECEIVE_BYTES)
        self._timeout: float | None = None  # the kernel's send/receive timeout now set
        self._ids_refused = False  # the node on this connection refused record ids (older than them)
        self.resends = 0  # submits sent again after their reply was lost
        self.bootstraps = 0  # full reads of the node's base file by `follow`/`bootstrap`

    def _connect(self) -> socket.socket:
        if self._sock is None:
            deadline, pause = time.monotonic() + self._connect_timeout, 0.001
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    with unix_address(self.path) as address:
                        s.connect(address)
                    break
                except BlockingIOError as e:
                    # The node's queue of connections not yet accepted is full (a busy moment): an
                    # AF_UNIX connect with a timeout fails at once then, where a blocking one waits.
                    s.close()
                    if time.monotonic() + pause > deadline:
                        raise _unavailable(self.path, TimeoutError(str(e)), self._connect_timeout) from None
                    time.sleep(pause)
                    pause = min(2 * pause, 0.05)
                except OSError as e:  # no file, no listener, no permission, a path too long, a timeout
                    s.close()
                    raise _unavailable(self.path, e, self._connect_timeout) from None
            s.settimeout(None)
            self._sock, self._timeout, self._ids_refused = s, None, False
            self._frames = FrameBuffer(localapi.MAX_FRAME_BYTES)
        return self._sock

    def _set_timeout(self, s: socket.socket, seconds: float) -> None:
        """Bound each send and receive by `seconds` with the kernel's socket timeouts,
        set only when the value changes. A Python timeout (settimeout) costs an
        ioctl per call and a poll before every send and receive: five syscalls per
        request where two do. Runs out as BlockingIOError."""
        seconds = min(seconds, _LONGEST_TIMEOUT)  # wait_version(v, 1e300): "never", not struct.error
        if seconds != self._timeout:
            tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._timeout = seconds

    def _call(self, frame: list, timeout: float, more: Callable[[dict], bool] | None = None,
              resend: bool = False) -> dict:
        """Send the frame (a list of buffers, written in order), return the reply. With
        `more`, a streamed reply: each frame goes to `more` until it returns False; that
        frame is the reply. If `more` raises, the connection is closed (the rest of the
        stream is not read). `resend` (an idempotent request: a submit with record ids):
        a connection that breaks before the reply is replaced and the frame sent again,
        connecting until `timeout` runs out while the node restarts."""
        if not resend:
            try:
                return self._exchange(frame, timeout, more)
            except _ReplyLost as e:
                raise NodeUnavailable("unavailable", f"node at {self.path}: {e}") from None
        deadline, pause, lost = time.monotonic() + timeout, _RESEND_PAUSE[0], None
        while True:
            try:
                return self._exchange(frame, timeout, more)
            except (_ReplyLost, NodeError) as e:
                lost = _resend_after(e, lost, self.path, timeout)
            if time.monotonic() + pause > deadline:
                raise _lost(self.path, lost, timeout) from None
            time.sleep(pause)
            pause = min(2 * pause, _RESEND_PAUSE[1])
            self.resends += 1

    def _exchange(self, frame: list, timeout: float, more: Callable[[dict], bool] | None = None) -> dict:
        """One try of `_call`: _ReplyLost when the connection broke after the request went out."""
        reused = self._sock is not None
        s = self._connect()
        undelivered = False
        try:
            self._set_timeout(s, timeout + 10.0)
            try:
                _send_parts(s, frame)
            except (BrokenPipeError, ConnectionResetError):
                undelivered = True  # the node closed; what it sent before (a refusal) is still there to read
            while True:
                body = self._frames.next_body()
                if body is CLOSED:
                    if undelivered and reused:
                        raise _Undelivered
                    raise _ReplyLost("closed the connection")
                if body is not NEED_DATA:
                    reply = _result(localapi.decode(body))
                    if more is None or not _fed(self, more, reply):
                        return reply
                    continue
                n = s.recv_into(self._buf)
                self._frames.receive_data(memoryview(self._buf)[:n])
        except _Undelivered:  # a connection kept from a node since gone: no node saw the request
            self.close()
            return self._exchange(frame, timeout, more)  # on a new connection, so at most once
        except _ReplyLost:
            self.close()
            raise
        except BlockingIOError:  # the socket timeout ran out
            self.close()
            raise NodeUnavailable("unavailable", f"node at {self.path}: expected an answer within "
                                                 f"{self._timeout:g} s, found none") from None
        except (ConnectionResetError, BrokenPipeError) as e:  # the node died while we read: the reply is lost
            self.close()
            if undelivered and reused:  # ... or the request never went out
                return self._exchange(frame, timeout, more)
            raise _ReplyLost(f"{type(e).__name__}: {e}") from None
        except (OSError, ProtocolError) as e:
            self.close()
            raise NodeUnavailable("unavailable", f"node at {self.path}: {type(e).__name__}: {e}") from None
        except NodeError as e:  # an error reply ends the exchange; the connection serves on unless it is gone
            if isinstance(e, NodeUnavailable) or e.code in localapi.CLOSING:
                self.close()
            raise
        except BaseException:  # e.g. KeyboardInterrupt: this call's reply would be read as the next one's
            self.close()
            raise

    def status(self) -> dict:
        return self._call([localapi.encode(localapi.status_request())], 5.0)["status"]

    def wait_version(self, min_version: int, timeout: float) -> dict:
        return self._call([localapi.encode(localapi.wait_version_request(min_version, timeout))], timeout)["status"]

    def submit(self, payload, policy_version: int, meta: dict | None = None,
               timeout: float = DEFAULT_SUBMIT_TIMEOUT, *, record_id: bytes | None = None) -> int:
        """The record's seq once durable at the node. `record_id` (1..64 bytes, default
        16 random ones): submitting the same id again answers the same seq, stored once
        (within the node's window: README, Rollout API)."""
        return self.submit_many([(payload, policy_version, meta, record_id)], timeout)[0]

    def submit_many(self, records, timeout: float = DEFAULT_SUBMIT_TIMEOUT) -> list[int]:
        """Items (payload, policy_version[, meta[, record_id]]): their seqs, in order, once durable."""
        recs, chosen = _records(records)
        if self._ids_refused and self._sock is not None:
            recs = _without_ids(recs, chosen, self.path)
            return self._call(localapi.submit_frame_parts(recs, timeout), timeout)["seqs"]
        try:
            return self._call(localapi.submit_frame_parts(recs, timeout), timeout, resend=True)["seqs"]
        except NodeError as e:
            if not _refuses_ids(e):
                raise
            bare = _without_ids(recs, chosen, self.path)  # an older node refused the ids: it stored nothing
            seqs = self._call(localapi.submit_frame_parts(bare, timeout), timeout)["seqs"]
            self._ids_refused = True  # it takes them without: until the next connection
            return seqs

    def follow(self, tensors: dict[str, torch.Tensor], from_version: int | None, from_hash: str | None = None, *,
               verify: bool = False, device: torch.device | str | None = None,
               timeout: float = 600.0) -> tuple[int, str]:
        """Bring `tensors` (name → contiguous tensor, any device; written in place) from
        `from_version` (whose state hash is `from_hash`, checked against the changes
        when given) to the node's current version; returns (version, state hash).

        `from_version` None, a node that no longer holds the changes, or changes that
        do not fit (a corrupt file, another chain): bootstrap, i.e. read the node's
        base file (status base_path) whole into `tensors`, then follow from its version. New tensors
        go to `device` (default: where the tensors are). Tensors in a GPU's memory
        receive only the changed elements (copied over, then one `index_copy_` per
        piece); `follow` returns once the device has written them. The writes land in
        the tensors as the stream arrives: an engine pauses its forward passes (or
        accepts one step that reads a mix of two versions) for the call. `verify`: hash
        `tensors` at the end and raise StateHashMismatch unless they are the node's
        version (a full pass over the state, device tensors copied to host one at a
        time: for tests and small models)."""
        at = None if from_version is None else (from_version, from_hash)
        for attempt in range(2):
            if at is None:
                at = self.bootstrap(tensors, device)
            try:
                at = self._follow_changes(tensors, at, device, timeout)
                break
            except NodeError as e:
                if e.code != localapi.BOOTSTRAP or attempt:
                    raise
            except InvalidInput:  # the tensors may be half-written: the bootstrap writes every one
                if attempt:
                    raise
            at = None
        _settle(tensors)
        if verify:
            from patchswarm.protocol.statehash import state_hash_any_device

            found = state_hash_any_device(tensors)
            if found != at[1]:
                raise StateHashMismatch(f"tensors after following to version {at[0]}", at[1], found)
        return at

    def _follow_changes(self, tensors, at: tuple[int, str | None], device, timeout: float) -> tuple[int, str]:
        from patchswarm.protocol.changes import ChangeApplier, ChangeStream

        stream, applier = ChangeStream(at), ChangeApplier(tensors, device)

        def more(reply: dict) -> bool:
            if "chg" not in reply:
                return False
            stream.receive_data(reply["chg"])
            while (ev := stream.next_event()) is not NEED_DATA:
                applier.feed(ev)
            return True

        end = self._call([localapi.encode(localapi.changes_request(*at))], timeout, more)
        version, h = end.get("version"), end.get("state_hash")
        if (not end.get("done") or not stream.between_versions or stream.last[0] != version
                or stream.last[1] not in (None, h)):
            raise CorruptData(f"changes: expected a stream ending at the node's version {version}, "
                              f"found one ending at {stream.last[0]} (between versions: {stream.between_versions})")
        return version, h

    def bootstrap(self, tensors: dict[str, torch.Tensor], device: torch.device | str | None = None) -> tuple[int, str]:
        """Read the node's base file (status `base_path`) into `tensors` (in place where dtype and shape
        match, new tensors on `device` otherwise; names it lacks are dropped); returns
        its (version, state hash) from its metadata."""
        from safetensors import SafetensorError, safe_open

        from patchswarm.node.weights import META_HASH, META_VERSION

        self.bootstraps += 1
        st = self.status()
        path = st.get("base_path") or st.get("weights_path")
        if device is None and tensors:
            device = next(iter(tensors.values())).device
        try:
            # One open file: the node may replace it meanwhile; this read stays on one version.
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
                for name in [n for n in tensors if n not in names]:
                    del tensors[name]
                for name in sorted(names):
                    t = f.get_tensor(name)
                    cur = tensors.get(name)
                    if cur is not None and cur.dtype == t.dtype and cur.shape == t.shape and cur.is_contiguous():
                        cur.copy_(t)
                    else:
                        tensors[name] = t.to(device or "cpu").contiguous()
        except (SafetensorError, OSError) as e:
            raise NodeUnavailable("unavailable", f"{path}: expected the node's base file, found {e}") from None
        try:
            return int(meta[META_VERSION]), meta[META_HASH]
        except (KeyError, ValueError):
            raise CorruptData(f"{path}: expected patchswarm metadata ({META_VERSION}, {META_HASH}), "
                              f"found keys {sorted(meta)}") from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _open_unix(address: str) -> trio.SocketStream:
    """`trio.open_unix_socket(address)`, waiting (the caller's deadline) while the node's queue
    of connections not yet accepted is full: an AF_UNIX connect fails with EAGAIN then, and
    trio took that for a connect in progress, waited for writable and handed back an
    unconnected socket (its first send: EINVAL)."""
    pause = 0.001
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            s.connect(address)  # AF_UNIX: done at once, or EAGAIN, never in progress
        except BlockingIOError:
            s.close()
            await trio.sleep(pause)
            pause = min(2 * pause, 0.05)
            continue
        except BaseException:
            s.close()
            raise
        return trio.SocketStream(trio.socket.from_stdlib_socket(s))


class AsyncNodeClient:
    """The same calls for trio code: `await client.submit(...)`; `async with` closes it.
    Calls from several tasks run side by side, each on a connection of its own (kept
    for the next call): a task in wait_version does not hold up another's submit."""

    KEEP_IDLE = 4  # connections kept open between calls

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._idle: list[tuple[trio.SocketStream, FrameBuffer]] = []
        self._open: set[trio.SocketStream] = set()
        self._ids_refused = False  # the node refused record ids (older than them): until a new connection
        self.resends = 0  # submits sent again after their reply was lost

    async def _connection(self) -> tuple[trio.SocketStream, FrameBuffer, bool]:
        """(stream, its frames, whether it was kept from an earlier call)."""
        if self._idle:
            return *self._idle.pop(), True
        try:
            with trio.fail_after(5), unix_address(self.path) as address:
                stream = await _open_unix(address)
        except (OSError, trio.TooSlowError) as e:
            raise _unavailable(self.path, e, 5.0) from None
        self._open.add(stream)
        self._ids_refused = False  # maybe another node now (a restart, an upgrade): ask again
        return stream, FrameBuffer(localapi.MAX_FRAME_BYTES), False

    async def _discard(self, stream: trio.SocketStream) -> None:
        self._open.discard(stream)
        await trio.aclose_forcefully(stream)

    async def _call(self, frame: list, timeout: float, resend: bool = False) -> dict:
        """Send the frame, return the reply; `resend` as NodeClient._call's."""
        if not resend:
            try:
                return await self._exchange(frame, timeout)
            except _ReplyLost as e:
                raise NodeUnavailable("unavailable", f"node at {self.path}: {e}") from None
        deadline, pause, lost = trio.current_time() + timeout, _RESEND_PAUSE[0], None
        while True:
            try:
                return await self._exchange(frame, timeout)
            except (_ReplyLost, NodeError) as e:
                lost = _resend_after(e, lost, self.path, timeout)
            if trio.current_time() + pause > deadline:
                raise _lost(self.path, lost, timeout) from None
            await trio.sleep(pause)
            pause = min(2 * pause, _RESEND_PAUSE[1])
            self.resends += 1

    async def _exchange(self, frame: list, timeout: float) -> dict:
        stream, frames, reused = await self._connection()
        undelivered = False
        try:
            with trio.fail_after(timeout + 10.0):
                try:
                    for part in frame:
                        await stream.send_all(part)
                except trio.BrokenResourceError:
                    undelivered = True  # the node closed; what it sent before (a refusal) is still there to read
                while True:
                    body = frames.next_body()
                    if body is CLOSED:
                        if undelivered and reused:
                            raise _Undelivered
                        raise _ReplyLost("closed the connection")
                    if body is not NEED_DATA:
                        reply = localapi.decode(body)
                        break
                    try:
                        frames.receive_data(await stream.receive_some(_ASYNC_RECEIVE_BYTES))
                    except trio.BrokenResourceError as e:  # reset while we read: the reply is lost
                        if undelivered and reused:
                            raise _Undelivered from None
                        raise _ReplyLost(f"{type(e).__name__}: {e}") from None
        except _Undelivered:  # a connection kept from a node since gone: no node saw the request
            await self._discard(stream)
            return await self._exchange(frame, timeout)  # each kept connection fails so at most once
        except _ReplyLost:
            await self._discard(stream)
            raise
        except (OSError, trio.BrokenResourceError, trio.TooSlowError, ProtocolError) as e:
            await self._discard(stream)
            raise NodeUnavailable("unavailable", f"node at {self.path}: {type(e).__name__}: {e}") from None
        except BaseException:  # cancelled: this call's reply would be read as the next one's
            await self._discard(stream)
            raise
        if (stream in self._open and len(self._idle) < self.KEEP_IDLE
                and reply.get("code") not in localapi.CLOSING):  # refused: the node closed it
            self._idle.append((stream, frames))
        else:
            await self._discard(stream)
        return _result(reply)

    async def status(self) -> dict:
        return (await self._call([localapi.encode(localapi.status_request())], 5.0))["status"]

    async def wait_version(self, min_version: int, timeout: float) -> dict:
        return (await self._call([localapi.encode(localapi.wait_version_request(min_version, timeout))],
                                 timeout))["status"]

    async def submit(self, payload, policy_version: int, meta: dict | None = None,
                     timeout: float = DEFAULT_SUBMIT_TIMEOUT, *, record_id: bytes | None = None) -> int:
        """As NodeClient.submit."""
        return (await self.submit_many([(payload, policy_version, meta, record_id)], timeout))[0]

    async def submit_many(self, records, timeout: float = DEFAULT_SUBMIT_TIMEOUT) -> list[int]:
        """As NodeClient.submit_many."""
        recs, chosen = _records(records)
        if self._ids_refused:
            recs = _without_ids(recs, chosen, self.path)
            return (await self._call(localapi.submit_frame_parts(recs, timeout), timeout))["seqs"]
        try:
            return (await self._call(localapi.submit_frame_parts(recs, timeout), timeout, resend=True))["seqs"]
        except NodeError as e:
            if not _refuses_ids(e):
                raise
            bare = _without_ids(recs, chosen, self.path)  # an older node refused the ids: it stored nothing
            seqs = (await self._call(localapi.submit_frame_parts(bare, timeout), timeout))["seqs"]
            self._ids_refused = True
            return seqs

    async def aclose(self) -> None:
        """Close every connection, those of calls in progress too (they fail)."""
        streams, self._open, self._idle = list(self._open), set(), []
        with trio.CancelScope(shield=True):  # all of them, in a cancelled scope too
            for stream in streams:
                await trio.aclose_forcefully(stream)

    async def __aenter__(self) -> "AsyncNodeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
