"""The node's local socket (node/localapi.py) with the clients (node/client.py), in one process:
requests answered in order on one connection, frames larger than a read, bad frames, clients
that vanish, the socket file's mode and removal."""

import contextlib
import functools
import os
import socket
import stat
import struct
import time

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import patchswarm.node.client
from patchswarm.node.client import AsyncNodeClient, NodeClient, NodeError
from patchswarm.node import localapi as node_localapi
from patchswarm.node.localapi import RECEIVE_BYTES, BufferBudget, LocalRequests, serve_local
from patchswarm.node.spool import TrajectorySpool
from patchswarm.protocol import localapi
from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.wire import CLOSED, NEED_DATA, FrameBuffer

from memory import traced_peak

metas = st.none() | st.dictionaries(st.text(max_size=4), st.integers(-2**63, 2**64 - 1) | st.text(max_size=4), max_size=3)
payloads = st.binary(max_size=40) | st.integers(0, 3).map(lambda k: bytes(localapi.SEPARATE_PAYLOAD_BYTES - 1 + k))


async def echo(req: dict) -> dict:
    """A daemon stand-in: submit answers the payload sizes, status the number of calls so far."""
    echo.calls += 1
    if req["op"] == "wait_version":  # never reached: the reply comes when the timeout (at most 0.3 s) runs out
        await trio.sleep(min(req["timeout"], 0.3))
        return localapi.error(localapi.TIMEOUT, "not reached")
    if req["op"] == "submit":
        if req["records"][0][1] == 99:
            return localapi.error(localapi.FULL, "the spool is full")
        return localapi.ok(seqs=[len(r[0]) for r in req["records"]])
    return localapi.ok(status={"calls": echo.calls})


echo.calls = 0


def serving(tmp_path, body, **options):
    """Run `await body(path)` (it may use blocking clients through to_thread) while serving."""
    path = tmp_path / "node.sock"

    async def main():
        async with trio.open_nursery() as n:
            await n.start(functools.partial(serve_local, path, echo, **options))
            mode = stat.S_IMODE(os.stat(path).st_mode)
            try:
                await body(path)
            finally:
                n.cancel_scope.cancel()
        return mode

    mode = trio.run(main)
    assert mode == 0o600
    assert not path.exists(), "the socket file outlives the server"


@contextlib.asynccontextmanager
async def spool_node(tmp_path):
    """The local socket at tmp_path/node.sock over LocalRequests and a real spool: (path, spool)."""
    async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
        handle = LocalRequests(lambda: {"version": 1}, None, lambda: 1, spool)
        async with trio.open_nursery() as n:
            yield await n.start(serve_local, tmp_path / "node.sock", handle), spool
            n.cancel_scope.cancel()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(payloads, st.integers(0, 2**63 - 1), metas), min_size=1, max_size=6),
       st.floats(0, 1e6))
def test_submit_frame_parts_are_the_frame_of_submit_request(records, timeout):
    parts = localapi.submit_frame_parts(records, timeout)
    assert b"".join(parts) == localapi.encode(localapi.submit_request(records, timeout))
    big = [p for p, _, _ in records if len(p) >= localapi.SEPARATE_PAYLOAD_BYTES]
    assert [p for p in parts if any(p is b for b in big)] == big  # passed on, not copied


def test_submit_frame_parts_refuse_what_msgpack_cannot_carry():
    with pytest.raises(UsageError, match="msgpack-able meta"):
        localapi.submit_frame_parts([(b"p", 1, {"k": 2**64})], 5)
    with pytest.raises(UsageError, match="records"):
        localapi.submit_frame_parts([(b"p", -1, None)], 5)
    big = bytes(localapi.MAX_FRAME_BYTES // 3)  # three fit no frame: the message says so, not "a frame"
    with pytest.raises(UsageError, match="submit of 3 records: expected at most .* in one request, found .*; split"):
        localapi.submit_frame_parts([(big, 1, None)] * 3, 5)


def test_many_requests_on_one_connection_and_a_frame_larger_than_a_read(tmp_path):
    big = os.urandom(3 * RECEIVE_BYTES + 17)

    def blocking(path):
        with NodeClient(path) as c:
            got = [c.submit(b"x" * i, 1) for i in range(50)]
            got.append(c.submit(big, 1))
            got.append(c.submit_many([(b"ab", 1, None), (b"abc", 2, {"k": 1})]))
            sock = c._sock
            with pytest.raises(NodeError) as e:
                c.submit(b"z", 99)
            assert c._sock is sock  # an error reply ends the exchange cleanly: no reconnect
            after = c.submit(b"still served", 1)
        return got, e.value.code, after

    async def body(path):
        got, code, after = await trio.to_thread.run_sync(blocking, path)
        assert got == list(range(50)) + [len(big), [2, 3]]
        assert code == localapi.FULL and after == len(b"still served")
        c = AsyncNodeClient(path)
        assert await c.submit(big, 1) == len(big)
        await c.aclose()

    serving(tmp_path, body)


def test_a_submit_of_more_buffers_than_one_sendmsg_takes(tmp_path, monkeypatch):
    monkeypatch.setattr(patchswarm.node.client, "_IOV_MAX", 3)
    records = [(os.urandom(localapi.SEPARATE_PAYLOAD_BYTES + i), 1, {"i": i}) for i in range(7)]

    async def body(path):
        with NodeClient(path) as c:
            assert await trio.to_thread.run_sync(c.submit_many, records) == [len(p) for p, _, _ in records]

    serving(tmp_path, body)


def test_pipelined_requests_are_answered_in_order(tmp_path):
    async def body(path):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        n = 200
        payloads = [os.urandom(i % 7) for i in range(n)]
        s.sendall(b"".join(localapi.encode(localapi.submit_request([[p, 1, None]], 5)) for p in payloads))
        data = b""
        while data.count(b"seqs") < n:  # every reply holds the key once
            data += await trio.to_thread.run_sync(s.recv, 1 << 16)
        s.close()
        replies, pos = [], 0
        while pos < len(data):
            (k,) = struct.unpack_from(">I", data, pos)
            replies.append(msgpack.unpackb(data[pos + 4:pos + 4 + k]))
            pos += 4 + k
        assert [r["seqs"] for r in replies] == [[len(p)] for p in payloads]

    serving(tmp_path, body)


def _exchange(path, raw: bytes) -> bytes:
    """Send `raw` on a new connection, close our side, and read everything the node answers."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
        return out


def test_bad_requests_get_an_error_and_bad_frames_cost_only_their_connection(tmp_path):
    async def body(path):
        exchange = functools.partial(_exchange, path)
        reply = await trio.to_thread.run_sync(exchange, localapi.encode({"op": "fly"}))
        assert msgpack.unpackb(reply[4:])["code"] == localapi.BAD_REQUEST
        garbage = b"\xc1\xc1"  # not msgpack
        reply = await trio.to_thread.run_sync(exchange, len(garbage).to_bytes(4, "big") + garbage)
        assert msgpack.unpackb(reply[4:])["code"] == localapi.BAD_REQUEST
        # a header past the frame limit, and a frame cut short: no reply, the connection closes
        assert await trio.to_thread.run_sync(exchange, (localapi.MAX_FRAME_BYTES + 1).to_bytes(4, "big")) == b""
        assert await trio.to_thread.run_sync(exchange, (100).to_bytes(4, "big") + b"short") == b""
        # a client that resets mid-frame
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        s.send((1000).to_bytes(4, "big") + b"x" * 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        with NodeClient(path) as c:  # the others are still served
            assert await trio.to_thread.run_sync(c.submit, b"ok", 1) == 2

    serving(tmp_path, body)


def test_a_call_cut_short_leaves_no_reply_behind_for_the_next_one(tmp_path, monkeypatch):
    """A call that ends early (a trio cancel scope around an async call, an exception such as
    KeyboardInterrupt between the send and the reply in a blocking one) must not leave its
    reply in flight: the next call on the same client read it as its own answer (a status
    call got the cut-short submit's seqs, a submit the cut-short wait's timeout error)."""

    async def body(path):
        c = AsyncNodeClient(path)
        with trio.move_on_after(0.05):
            await c.wait_version(1, 0.3)
        await trio.sleep(0.4)  # the node has answered the cut-short wait by now
        assert await c.submit(b"abc", 1) == 3
        await c.aclose()

        send = patchswarm.node.client._send_parts

        def send_then_interrupt(s, parts):
            send(s, parts)
            raise KeyboardInterrupt

        def blocking():
            with NodeClient(path) as b:
                monkeypatch.setattr(patchswarm.node.client, "_send_parts", send_then_interrupt)
                with pytest.raises(KeyboardInterrupt):
                    b.submit(b"abcd", 1)
                monkeypatch.setattr(patchswarm.node.client, "_send_parts", send)
                return b.submit(b"abcde", 1)

        assert await trio.to_thread.run_sync(blocking) == 5

    serving(tmp_path, body)


def test_connections_past_the_limit_are_refused_with_a_reason_and_the_others_served(tmp_path):
    """Each connection holds a file descriptor (the node's peers and files need theirs): past
    `max_connections` a new one gets an error reply saying so and is closed, whether the
    client's request went out before the node closed or not. Before, every connection was
    kept, with 256 KiB of receive buffer each (900 idle ones: 540 MB RSS, 308 MB with the shared buffer)."""

    async def body(path):
        def blocking():
            held = [NodeClient(path) for _ in range(3)]
            for c in held:
                c.status()
            out = []
            for late in (False, True):  # the request goes out before the node closes, or after
                with NodeClient(path) as extra:
                    if late:
                        extra._connect()
                        time.sleep(0.2)
                    with pytest.raises(NodeError) as e:
                        extra.status()
                    out.append((e.value.code, str(e.value)))
            held.pop().close()
            time.sleep(0.2)
            with NodeClient(path) as extra:
                out.append(extra.status()["calls"] > 0)
            for c in held:
                out.append(c.submit(b"ab", 1))
                c.close()
            return out

        got = await trio.to_thread.run_sync(blocking)
        for code, message in got[:2]:
            assert code == localapi.TOO_MANY_CONNECTIONS
            assert "at most 3 connections" in message
        assert got[2:] == [True, 2, 2]

        def hold():
            held = [NodeClient(path) for _ in range(3)]
            for c in held:
                c.status()
            return held

        held = await trio.to_thread.run_sync(hold)
        c = AsyncNodeClient(path)
        with pytest.raises(NodeError) as e:
            await c.status()
        assert e.value.code == localapi.TOO_MANY_CONNECTIONS
        for h in held:
            h.close()
        await trio.sleep(0.2)
        assert (await c.status())["calls"] > 0
        await c.aclose()

    serving(tmp_path, body, max_connections=3)


def test_a_wait_with_a_timeout_too_long_for_the_kernel_is_still_a_wait(tmp_path):
    """wait_version(v, 1e300) (a caller's "forever") in the blocking client raised
    struct.error from packing the kernel's socket timeout, and left the request unsent."""

    async def body(path):
        def blocking():
            with NodeClient(path) as c:
                with pytest.raises(NodeError) as e:
                    c.wait_version(1, 1e300)
                return e.value.code

        async def waiting():
            c = AsyncNodeClient(path)
            with pytest.raises(NodeError) as e:
                await c.wait_version(1, 1e300)
            await c.aclose()
            return e.value.code

        assert await trio.to_thread.run_sync(blocking) == localapi.TIMEOUT
        assert await waiting() == localapi.TIMEOUT

    serving(tmp_path, body)


def test_a_waiter_that_leaves_ends_its_wait_and_frees_its_connection(tmp_path):
    """A client that closes while its wait_version runs (a rollout worker killed) ends that
    wait: before, the node kept the wait, its task and its file descriptor until the
    timeout ran out (an hour for wait_version(v, 3600)), and with a connection limit such
    waiters would crowd out live clients. A client that only shuts down its sending side
    still gets its answer."""
    path = tmp_path / "node.sock"
    waits = []

    async def handle(req):
        if req["op"] != "wait_version":
            return localapi.ok(status={})
        ended = trio.Event()
        waits.append(ended)
        try:
            await trio.sleep(req["timeout"])
        finally:
            ended.set()
        return localapi.error(localapi.TIMEOUT, "not reached")

    def ask(timeout: float) -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        s.sendall(localapi.encode(localapi.wait_version_request(1, timeout)))
        return s

    async def main():
        async with trio.open_nursery() as n:
            await n.start(functools.partial(serve_local, path, handle, max_connections=1))
            ask(30.0).close()
            await trio.sleep(0.1)
            with trio.fail_after(2):
                await waits[0].wait()
            with NodeClient(path) as c:  # its connection is free again: the limit of one is not reached
                assert await trio.to_thread.run_sync(c.status) == {}
            await trio.sleep(0.1)  # the node sees that one close
            half = ask(0.2)
            half.shutdown(socket.SHUT_WR)
            reply = await trio.to_thread.run_sync(half.recv, 1 << 16)
            half.close()
            assert msgpack.unpackb(reply[4:])["code"] == localapi.TIMEOUT
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_waiter_that_pipelines_a_request_and_then_leaves_frees_its_connection(tmp_path, monkeypatch):
    """A client that sends a request behind its wait_version, then closes: the node saw the
    pipelined bytes (readable, no hangup), stopped watching, and kept the wait, its task and
    its connection slot until the timeout (for ever at 1e300); four such clients left a node
    of four connections refusing every other client with too_many_connections."""
    monkeypatch.setattr(node_localapi, "LEFT_POLL_S", 0.05)
    path = tmp_path / "node.sock"
    ended = []

    async def handle(req):
        if req["op"] != "wait_version":
            return localapi.ok(status={})
        try:
            await trio.sleep(req["timeout"])
        finally:
            ended.append(req["min_version"])
        return localapi.error(localapi.TIMEOUT, "not reached")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(functools.partial(serve_local, path, handle, max_connections=2))
            for v in range(2):
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
                    s.sendall(localapi.encode(localapi.wait_version_request(v, 1e300)))
                    await trio.sleep(0.1)  # the node is in the wait
                    s.sendall(localapi.encode(localapi.status_request()))  # pipelined behind it
                    await trio.sleep(0.1)  # the node sees those bytes, not yet a hangup
            with trio.fail_after(5):
                while len(ended) < 2:
                    await trio.sleep(0.01)
            with NodeClient(path) as c:  # the limit of two is not reached: both left
                assert await trio.to_thread.run_sync(c.status) == {}
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_frame_left_half_sent_costs_its_connection_after_a_while(tmp_path, monkeypatch):
    """A client that stops in the middle of a frame (a header claiming 200 MiB, then a few bytes)
    held its connection, and what it had sent, for ever; now the node waits FRAME_WAIT_S for
    the rest, then closes. A connection idle between requests stays open."""
    monkeypatch.setattr(patchswarm.node.localapi, "FRAME_WAIT_S", 0.2)

    async def body(path):
        def stalled_and_idle():
            with socket.socket(socket.AF_UNIX) as s, socket.socket(socket.AF_UNIX) as idle:
                idle.connect(str(path))
                s.connect(str(path))
                s.sendall((200 << 20).to_bytes(4, "big") + b"x" * 1000)
                s.settimeout(5)
                t0 = time.monotonic()
                assert s.recv(16) == b""
                waited = time.monotonic() - t0
                idle.sendall(localapi.encode(localapi.status_request()))
                idle.settimeout(5)
                return waited, msgpack.unpackb(idle.recv(1 << 16)[4:])["ok"]

        waited, ok = await trio.to_thread.run_sync(stalled_and_idle)
        assert 0.1 < waited < 2 and ok is True

    serving(tmp_path, body)


def test_a_frame_sent_a_byte_at_a_time_costs_its_connection_after_a_while(tmp_path, monkeypatch):
    """A client that goes on with its frame a byte at a time, each within FRAME_WAIT_S of the
    last, never finishing: the deadline was per read, so the node held the frame's room in
    its budget for ever; four such connections (headers of 256 MiB, a byte a minute) held
    the whole 1 GiB, and every other client, a status too, got buffers_full. Now the whole
    frame must be in within FRAME_WAIT_S."""
    monkeypatch.setattr(node_localapi, "FRAME_WAIT_S", 0.5)
    budget = BufferBudget(1 << 20)

    async def main():
        async with trio.open_nursery() as n:
            path = await n.start(functools.partial(serve_local, tmp_path / "node.sock", echo, budget=budget,
                                                   budget_wait=0.3))
            with socket.socket(socket.AF_UNIX) as hog:
                hog.connect(str(path))
                hog.setblocking(False)
                hog.send((budget.limit - 4).to_bytes(4, "big") + b"x")  # a frame of the whole budget
                t0 = time.monotonic()
                with trio.fail_after(5):
                    while True:  # a byte every 0.1 s until the node closes (at most 5 s)
                        await trio.sleep(0.1)
                        try:
                            hog.send(b"x")
                        except OSError:
                            break
                assert time.monotonic() - t0 < 2
            with NodeClient(path) as c:  # the node serves on, its budget given back
                assert "calls" in await trio.to_thread.run_sync(c.status)
            assert budget.used == 0
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_hundred_connects_while_the_node_is_busy_all_wait_in_its_queue(tmp_path):
    """The node's loop busy for a moment (here: this test's synchronous connects) while many
    clients connect: with a listen backlog of 64, those past it found the queue full, and an
    AF_UNIX connect with a timeout fails at once then (EAGAIN), so a hundred workers asking
    at once after a node restart had a third of them told that no node answers."""

    async def body(path):
        socks, full = [], 0
        try:
            for _ in range(200):  # the loop does not turn meanwhile: nothing is accepted
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
                socks.append(s)
                try:
                    s.connect(str(path))
                except BlockingIOError:
                    full += 1
        finally:
            for s in socks:
                s.close()
        assert full == 0

    serving(tmp_path, body)


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_a_client_that_finds_the_nodes_queue_full_waits_for_room(tmp_path, kind):
    """A node whose queue of connections not yet accepted is full for a moment: the client's
    connect failed at once (EAGAIN) instead of waiting within its connect timeout; the
    blocking client said no node answers, the async one (trio took EAGAIN for a connect in
    progress) handed back an unconnected socket whose send failed with EINVAL."""
    path = tmp_path / "node.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(0)
    fillers = []
    for _ in range(50):  # until the queue is full
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            s.connect(str(path))
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
    else:
        pytest.fail("expected the listen queue to fill within 50 connects")

    def serve_one_late() -> None:
        time.sleep(0.3)  # the client finds the queue full meanwhile
        srv.settimeout(10)
        for _ in fillers:
            srv.accept()[0].close()
        conn = srv.accept()[0]
        with conn:
            conn.settimeout(10)
            frames = FrameBuffer(localapi.MAX_FRAME_BYTES)
            while (body := frames.next_body()) is NEED_DATA:
                frames.receive_data(conn.recv(1 << 16))
            assert localapi.decode(body)["op"] == "status"
            conn.sendall(localapi.encode(localapi.ok(status={"late": True})))

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(functools.partial(trio.to_thread.run_sync, serve_one_late))
            with trio.fail_after(10):
                if kind == "blocking":
                    with NodeClient(path) as c:
                        return await trio.to_thread.run_sync(c.status)
                async with AsyncNodeClient(path) as c:
                    return await c.status()

    try:
        assert trio.run(main) == {"late": True}
    finally:
        for s in fillers:
            s.close()
        srv.close()


def test_a_socket_path_longer_than_af_unix_takes_is_served_and_reached(tmp_path):
    """sockaddr_un holds 107 bytes of path: a data dir deeper than that made the node fail to
    start ("AF_UNIX path too long", without the path) and clients fail to connect."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)

    async def body(path):
        assert len(str(path)) > 107
        with NodeClient(path) as c:
            assert await trio.to_thread.run_sync(c.submit, b"abc", 1) == 3
        c = AsyncNodeClient(path)
        assert await c.submit(b"abcd", 1) == 4
        await c.aclose()

    serving(deep, body)


def test_async_calls_from_several_tasks_do_not_wait_for_each_other(tmp_path):
    """One AsyncNodeClient shared by a task in wait_version and a task that submits: the
    submit used to queue behind the wait (one connection, one lock) for as long as the wait
    ran, up to its timeout. Now each call in progress has its own connection, and a few
    are kept for the next calls. `async with` closes them all."""

    async def body(path):
        done = []
        async with AsyncNodeClient(path) as c:
            async def wait():
                with pytest.raises(NodeError):
                    await c.wait_version(1, 0.3)
                done.append("wait")

            async with trio.open_nursery() as n:
                n.start_soon(wait)
                await trio.sleep(0.05)
                assert await c.submit(b"abc", 1) == 3
                done.append("submit")
            assert done == ["submit", "wait"]
            assert await c.submit(b"abcd", 1) == 4
            assert len(c._open) == 2  # kept for the next calls
        assert not c._open

    serving(tmp_path, body)


def test_a_client_kept_across_a_node_restart_reconnects(tmp_path):
    """A connection kept from before the node restarted: the next call found it closed and
    failed ("closed the connection"), though the new node was up. When the node closed it
    before the request went out (the send fails: nothing reached any node, so retrying is
    safe for a submit too), the call now goes again on a new connection."""
    path = tmp_path / "node.sock"

    async def main():
        sync, async_ = NodeClient(path), AsyncNodeClient(path)
        for _ in range(2):  # the first node, then its replacement
            async with trio.open_nursery() as n:
                await n.start(serve_local, path, echo)
                assert await trio.to_thread.run_sync(sync.submit, b"abc", 1) == 3
                assert await async_.submit(b"abcd", 1) == 4
                n.cancel_scope.cancel()
        sync.close()
        await async_.aclose()

    trio.run(main)


def test_a_node_that_never_answers_runs_the_client_out_of_time(tmp_path):
    """The blocking client bounds each read with the kernel's socket timeout (set to
    the call's timeout + 10 s; a negative call timeout here makes that 0.2 s)."""
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)  # accepts nothing, answers nothing
        with NodeClient(path) as c:
            with pytest.raises(patchswarm.node.client.NodeUnavailable, match="expected an answer within 0.2 s"):
                c._call([localapi.encode(localapi.status_request())], -9.8)
            with pytest.raises(patchswarm.node.client.NodeUnavailable):  # reconnects, and times out again
                c._call([localapi.encode(localapi.status_request())], -9.8)


def test_a_client_that_finds_no_node_says_what_it_expected_and_found(tmp_path, monkeypatch):
    """Both clients raise NodeUnavailable naming the path and what is there. Before, a socket
    without permission escaped as a bare OSError without the path ("[Errno 13] Permission
    denied"), and the rest named only an exception class."""
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # closed without unlinking: a node killed -9 leaves this
    (tmp_path / "plain").write_text("x")
    long = tmp_path / ("d" * 120) / "node.sock"
    cases = {tmp_path / "missing.sock": "found no such file", stale: "found a socket file no process listens on",
             tmp_path / "plain": "found a file that is not a socket", long: "found no such file"}

    def expect(call, path, found):
        with pytest.raises(patchswarm.node.client.NodeUnavailable) as e:
            call()
        assert str(e.value).startswith(f"no node answers at {path}: expected a node's socket, ")
        assert found in str(e.value), str(e.value)

    for path, found in cases.items():
        expect(NodeClient(path).status, path, found)

        async def via_async():
            await AsyncNodeClient(path).status()
        expect(lambda: trio.run(via_async), path, found)

    class Denied(socket.socket):
        def connect(self, address):
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(patchswarm.node.client.socket, "socket", Denied)
    expect(NodeClient(stale).status, stale, "found no permission to connect")


def test_a_spool_write_error_fails_the_submit_and_the_node_serves_on(tmp_path, monkeypatch):
    """An I/O error other than a full disk while the spool reserves seqs (EIO, a read-only
    file system) escaped the submit as an OSError and ended serve_local, i.e. the whole node:
    one rollout worker's submit took down weights, peers and the other workers. Now the
    submit fails with storage_failed, nothing acknowledged, and the node answers the rest."""
    import errno

    import patchswarm.node.spool as spool_module

    monkeypatch.setattr(spool_module, "SEQ_RESERVE", 1)  # the second append reserves again

    async def main():
        async with spool_node(tmp_path) as (path, spool):
            s0 = spool.stats()["next_seq"]  # a new spool's first: the clock's microseconds

            def blocking():
                with NodeClient(path) as c:
                    first = c.submit(b"a", 1)

                    def failing(*args):
                        raise OSError(errno.EIO, "Input/output error")

                    monkeypatch.setattr(spool_module, "_write_state", failing)
                    with pytest.raises(NodeError) as e:
                        c.submit(b"b", 1)
                    return first, e.value, c.status()

            first, err, st = await trio.to_thread.run_sync(blocking)
            assert first == s0 and st == {"version": 1}
            assert err.code == localapi.STORAGE and "Input/output error" in str(err)
            assert spool.stats()["records"] == 1

    trio.run(main)


def test_a_request_the_node_fails_on_costs_that_request_not_the_node(tmp_path):
    """A fault of the node's while answering (a bug in a handler, EIO reading a change file
    mid-stream) escaped _serve_connection and ended serve_local, i.e. the node. Now the
    client gets internal_error (or, mid-stream, a closed connection) and the node serves on."""
    from patchswarm.node.localapi import StreamedReply

    path = tmp_path / "node.sock"

    async def parts():
        yield localapi.ok(chg=b"x")
        raise OSError(5, "Input/output error")

    async def handle(req):
        if req["op"] == "status":
            raise RuntimeError("boom")
        if req["op"] == "changes":
            return StreamedReply(parts())
        return localapi.ok(seqs=[len(r[0]) for r in req["records"]])

    async def main():
        async with trio.open_nursery() as n:
            await n.start(serve_local, path, handle)

            def blocking():
                with NodeClient(path) as c:
                    with pytest.raises(NodeError) as e:
                        c.status()
                    after = c.submit(b"abc", 1)
                    with pytest.raises(patchswarm.node.client.NodeUnavailable, match="closed the connection"):
                        c._call([localapi.encode(localapi.changes_request(0, None))], 5.0, lambda r: "chg" in r)
                    return e.value, after, c.submit(b"abcd", 1)

            err, after, again = await trio.to_thread.run_sync(blocking)
            assert err.code == localapi.INTERNAL and "RuntimeError: boom" in str(err)
            assert (after, again) == (3, 4)
            n.cancel_scope.cancel()

    trio.run(main)


def test_local_requests_answer_status_wait_and_submit(tmp_path):
    """What each op does (node/localapi.py LocalRequests), over a real spool, on trio's mock clock."""
    async def main():
        version = {"v": 3}
        changed = trio.Event()

        async def wait_version(min_version, timeout):
            with trio.move_on_after(timeout):
                while version["v"] < min_version:
                    await changed.wait()
                return True
            return False

        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1", max_bytes=4096) as spool:
            handle = LocalRequests(lambda: {"version": version["v"]}, wait_version, lambda: version["v"], spool)
            s0 = spool.stats()["next_seq"]
            assert await handle({"op": "status"}) == localapi.ok(status={"version": 3})
            late = await handle({"op": "wait_version", "min_version": 4, "timeout": 5.0})
            assert late["code"] == localapi.TIMEOUT and "the node is at 3" in late["error"]
            async with trio.open_nursery() as n:
                async def bump():
                    await trio.sleep(1.0)
                    version["v"] = 4
                    changed.set()
                n.start_soon(bump)
                assert await handle({"op": "wait_version", "min_version": 4, "timeout": 5.0}) == \
                    localapi.ok(status={"version": 4})
            ok = await handle({"op": "submit", "records": [[bytes(2500), 4, None]], "timeout": 1.0})
            assert ok == localapi.ok(seqs=[s0], repeated=0) and spool.stats()["records"] == 1
            # Room for one such record, not two, and nothing uploads it: the submit waits, then fails.
            full = await handle({"op": "submit", "records": [[bytes(2500), 4, None]], "timeout": 1.0})
            assert full["code"] == localapi.FULL
            bad = await handle({"op": "submit", "records": [["not bytes", 4, None]], "timeout": 1.0})
            assert bad["code"] == localapi.BAD_REQUEST
            assert (await handle({"op": "publish"}))["code"] == localapi.UNAVAILABLE
            # from_hash is "str | nil": left out, it is nil (a KeyError here ended the node)
            assert (await handle(localapi.check_request({"op": "changes", "from_version": 0})))["code"] == \
                localapi.UNAVAILABLE

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_meta_the_origin_would_refuse_is_refused_at_submit_not_acknowledged(tmp_path):
    """A meta map nested deeper than the decoders read (MAX_META_DEPTH), or holding a msgpack
    ext value (a Timestamp), passed the spool's checks: the record was acknowledged, and the
    origin then refused its batch as undecodable and dropped the node, at every resend, so the
    node's trajectories stopped for good. Now the submit gets bad_request, nothing is stored,
    and what the spool holds is a batch the origin decodes."""
    from patchswarm.protocol import trajectory

    deep = {"k": 1}
    for _ in range(trajectory.MAX_META_DEPTH):
        deep = {"k": deep}
    stamp = {"at": msgpack.Timestamp(1, 2)}

    async def main():
        async with spool_node(tmp_path) as (path, spool):
            s0 = spool.stats()["next_seq"]

            def blocking():
                errors = []
                with NodeClient(path) as c:
                    for meta in (deep, stamp):
                        with pytest.raises(NodeError) as e:
                            c.submit(b"x", 1, meta=meta)
                        errors.append(e.value)
                    return errors, c.submit(b"ok", 1, meta=deep["k"])  # 32 deep: the decoders' limit

            errors, seq = await trio.to_thread.run_sync(blocking)
            assert [e.code for e in errors] == [localapi.BAD_REQUEST] * 2
            assert "nested at most" in str(errors[0]) and "ext" in str(errors[1])
            assert seq == s0 and spool.stats()["records"] == 1
            held = spool.pending()
            assert trajectory.decode_batch(trajectory.encode_batch(held), True)[0].payload == b"ok"

    trio.run(main)


def test_a_request_of_nested_arrays_costs_the_node_its_bytes_not_their_objects(tmp_path):
    """The node unpacked each request with msgpack before looking at it: a frame of empty
    arrays (one byte each, ~70 bytes of Python each) in any field was built whole on the
    event loop, 2.3 GB and 8 s for 32 MiB (measured), ~19 GB for a frame at the 256 MiB
    limit: one local client could stop the node's loop or have it killed. Now a request is
    read along its schema: a field other than records is a small value, and the frame costs
    about its bytes; the node answers bad_request and serves on."""

    n = 4 << 20
    body = b"\x82\xa2op\xa6status\xa3pad\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    replies = []

    async def exchange(path):
        replies.append(await trio.to_thread.run_sync(_exchange, path, len(body).to_bytes(4, "big") + body))
        with NodeClient(path) as c:
            replies.append(await trio.to_thread.run_sync(c.status))

    peak = traced_peak(lambda: serving(tmp_path, exchange))
    assert peak < 8 * n, f"{peak:,} bytes traced for a {len(body):,}-byte request"  # unpacked: ~300 MB
    assert msgpack.unpackb(replies[0][4:])["code"] == localapi.BAD_REQUEST
    assert replies[1]["calls"] >= 1


def test_a_submit_holds_its_metas_as_the_bytes_they_came_in(tmp_path):
    """A meta map of 64 KiB of empty arrays is ~4.5 MB of Python objects: a 1 MiB submit of
    16 of them held ~75 MB in the node until the spool took it (the 256 MiB frame limit:
    ~18 GB). Now each meta is checked as the origin will decode it (built once, let go) and
    kept as the bytes it came in; the spool stores those bytes, and the origin reads the
    same meta back."""
    from patchswarm.protocol import trajectory

    meta = {"a": [[] for _ in range(64000)]}
    raw = localapi.encode(localapi.submit_request([(b"p%d" % i, 1, meta) for i in range(16)], 5.0))
    held = []

    async def main():
        async with spool_node(tmp_path) as (path, spool):
            held.append(spool.stats()["next_seq"])
            held.append(await trio.to_thread.run_sync(_exchange, path, raw))
            held.append(spool.pending())

    peak = traced_peak(lambda: trio.run(main))
    s0, reply, records = held
    assert msgpack.unpackb(reply[4:]) == localapi.ok(seqs=list(range(s0, s0 + 16)), repeated=0)
    assert peak < 24 << 20, f"{peak:,} bytes traced for a {len(raw):,}-byte submit"  # unpacked: ~75 MB
    back = trajectory.decode_batch(trajectory.encode_batch(records))
    assert [r.payload for r in back] == [b"p%d" % i for i in range(16)] and back[5].meta == meta


@pytest.mark.parametrize("ids", [False, True])
def test_a_submit_of_many_tiny_records_does_not_stop_the_nodes_loop(tmp_path, monkeypatch, ids):
    """A request was read on the event loop when under 1 MiB, and the spool checked and
    framed its records there too: a submit of 65,536 records of 1 byte (393 KB; 1.5 MB with
    ids) held the node's loop 0.6-1.3 s (measured), serving no peer, no chunk, no status
    meanwhile, for reading and spooling cost per record, not per byte. Now a request of
    many records is read, and its records checked and framed, in a worker thread (checked
    by where those calls ran, not by a time: a bound of 0.25 s on the loop's longest stall
    failed at 0.251-0.257 s in a loaded suite run, where what stays on the loop with ids
    takes ~0.13 s alone; the stall is printed), and every record is stored once, in order."""
    import threading

    from patchswarm.node import spool as spool_mod

    n = localapi.MAX_RECORDS_PER_SUBMIT
    recs = [[bytes([i & 0xff]), 1, None] + ([os.urandom(16)] if ids else []) for i in range(n)]
    raw = b"".join(localapi.submit_frame_parts(recs, 30.0))
    where = set()  # the threads that read the request and framed its records
    for mod, name in ((localapi, "decode_request"), (spool_mod, "record_parts")):
        def spy(*a, _f=getattr(mod, name)):
            where.add(threading.current_thread() is threading.main_thread())
            return _f(*a)
        monkeypatch.setattr(mod, name, spy)
    out = {}

    async def main():
        async with spool_node(tmp_path) as (path, spool):
            out["s0"] = spool.stats()["next_seq"]
            async with trio.open_nursery() as tasks:
                async def tick():
                    late, last = 0.0, trio.current_time()
                    while "reply" not in out:
                        await trio.sleep(0.001)
                        now = trio.current_time()
                        late, last = max(late, now - last), now
                    out["late"] = late

                tasks.start_soon(tick)
                out["reply"] = await trio.to_thread.run_sync(_exchange, path, raw)
            out["stored"] = spool.pending(2 * n, 1 << 30)

    trio.run(main)
    reply = msgpack.unpackb(out["reply"][4:])
    s0 = out["s0"]
    assert reply == localapi.ok(seqs=list(range(s0, s0 + n)), repeated=0)
    assert [(r.seq - s0, r.payload) for r in out["stored"]] == [(i, bytes([i & 0xff])) for i in range(n)]
    assert where == {False}, "read or framed on the event loop"
    print(f"the loop's longest stall: {out['late']:.3f} s (before: 0.6-1.3 s)")


# ------------------------------------------------------------------ the budget over all connections


async def _read_reply(stream) -> dict:
    frames = FrameBuffer(localapi.MAX_FRAME_BYTES)
    while (body := frames.next_body()) is NEED_DATA:
        frames.receive_data(await stream.receive_some(1 << 16))
    assert body is not CLOSED
    return localapi.decode(body)


def test_connections_never_hold_more_than_the_budget_and_all_complete(tmp_path, monkeypatch):
    """1,024 local clients could each make the node buffer a 256 MiB frame. Now one budget
    bounds what all connections hold: six clients each send all but the last bytes of a 2 MiB
    submit into a 6 MiB budget. Two get room for their whole frame; the other four stop being
    read (their sends block) and hold at most a read's worth each. The bytes the connections
    really hold (their frame buffers, watched every millisecond) never pass what the budget
    counts, nor the budget. Once the first two finish, the others get in: all six are answered,
    and the spool holds each record once."""
    budget = BufferBudget(6 << 20)
    buffers = []

    class Watched(FrameBuffer):
        def __init__(self, *a):
            super().__init__(*a)
            buffers.append(self)

    monkeypatch.setattr(node_localapi, "FrameBuffer", Watched)
    payloads = [bytes([i]) * (2 << 20) for i in range(6)]
    frames = [b"".join(localapi.submit_frame_parts([[p, 1, None, os.urandom(16)]], 30)) for p in payloads]

    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            handle = LocalRequests(lambda: {"version": 1}, None, lambda: 1, spool)
            s0 = spool.stats()["next_seq"]
            seen = {"real": 0, "counted": 0}
            head_sent, go, replies = set(), trio.Event(), {}

            async def client(i):
                stream = await trio.open_unix_socket(str(path))
                async with stream:
                    await stream.send_all(frames[i][:-10])
                    head_sent.add(i)
                    await go.wait()
                    await stream.send_all(frames[i][-10:])
                    replies[i] = await _read_reply(stream)

            async def watch():
                while True:
                    real = sum(b.buffered for b in buffers)
                    assert real <= budget.used <= budget.limit
                    seen["real"], seen["counted"] = max(seen["real"], real), max(seen["counted"], budget.used)
                    await trio.sleep(0.001)

            with trio.fail_after(30):
                async with trio.open_nursery() as n:
                    path = await n.start(functools.partial(serve_local, tmp_path / "node.sock", handle, budget=budget))
                    n.start_soon(watch)
                    async with trio.open_nursery() as clients:
                        for i in range(6):
                            clients.start_soon(client, i)
                        for _ in range(2000):  # until the node has read all it will
                            if budget.status()["waiting"] == 4 and len(head_sent) == 2:
                                break
                            await trio.sleep(0.005)
                        await trio.sleep(0.2)  # nothing more moves
                        assert budget.status()["waiting"] == 4 and len(head_sent) == 2
                        waiting_hold = budget.used - sum(len(frames[i]) for i in head_sent)
                        assert waiting_hold <= 4 * RECEIVE_BYTES  # the four waiting hold a read's worth each
                        go.set()
                    n.cancel_scope.cancel()
            assert all(r["ok"] for r in replies.values()) and len(replies) == 6
            assert sorted(s for r in replies.values() for s in r["seqs"]) == list(range(s0, s0 + 6))
            assert spool.stats()["records"] == 6
            held = spool.pending(max_records=100, max_bytes=1 << 30)
            assert sorted(r.payload for r in held) == payloads  # each once, whole
            assert budget.used == 0 and budget.waits >= 4 and budget.peak <= budget.limit
            assert seen["real"] > 4 << 20  # two frames at once, really held

    trio.run(main)


def test_a_request_larger_than_the_whole_budget_is_refused_and_the_node_serves_on(tmp_path):
    """A frame larger than the budget can never be taken: the client gets too_large (it reads
    it while its send fails: the node closes the connection), nothing is stored, and the next
    call (a new connection) is served."""
    budget = BufferBudget(1 << 20)

    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            handle = LocalRequests(lambda: {"version": 1}, None, lambda: 1, spool)
            s0 = spool.stats()["next_seq"]
            async with trio.open_nursery() as n:
                path = await n.start(functools.partial(serve_local, tmp_path / "node.sock", handle, budget=budget))

                def blocking():
                    with NodeClient(path) as c:
                        with pytest.raises(NodeError) as e:
                            c.submit(bytes(2 << 20), 1, timeout=5)
                        assert c._sock is None  # closed with the node's side
                        return e.value, c.submit(b"small", 1, timeout=5)

                with trio.fail_after(20):
                    e, seq = await trio.to_thread.run_sync(blocking)
                    assert e.code == localapi.TOO_LARGE and "split it" in str(e) and str(1 << 20) in str(e)
                    async with AsyncNodeClient(path) as c:
                        with pytest.raises(NodeError) as ae:
                            await c.submit(bytes(2 << 20), 1, timeout=5)
                        assert ae.value.code == localapi.TOO_LARGE
                        assert await c.submit(b"small too", 1, timeout=5) == s0 + 1
                n.cancel_scope.cancel()
            assert seq == s0 and spool.stats()["records"] == 2
            assert budget.refused == 2 and budget.used == 0

    trio.run(main)


def test_a_request_that_finds_no_room_within_the_wait_gets_buffers_full(tmp_path):
    """One client holds most of the budget with a frame it does not finish; another's request
    waits for room (backpressure), and when the wait runs out it gets buffers_full, not a hang.
    Once the first finishes, the second's retry is served; both records are stored once."""
    budget = BufferBudget(1 << 20)

    async def main():
        async with await TrajectorySpool.open(tmp_path / "spool", "n1", "r1") as spool:
            handle = LocalRequests(lambda: {"version": 1}, None, lambda: 1, spool)
            s0 = spool.stats()["next_seq"]
            async with trio.open_nursery() as n:
                path = await n.start(functools.partial(serve_local, tmp_path / "node.sock", handle, budget=budget,
                                                       budget_wait=0.5))
                big = b"".join(localapi.submit_frame_parts([[b"a" * (700 << 10), 1, None, b"first"]], 30))
                with trio.fail_after(20):
                    async with await trio.open_unix_socket(str(path)) as hog:
                        await hog.send_all(big[:-10])
                        while budget.used < len(big):
                            await trio.sleep(0.005)

                        def second():
                            with NodeClient(path) as c:
                                with pytest.raises(NodeError) as e:
                                    c.submit(b"b" * (400 << 10), 1, timeout=5, record_id=b"second")
                                return e.value

                        t0 = time.monotonic()
                        e = await trio.to_thread.run_sync(second)
                        assert e.code == localapi.BUFFERS_FULL and 0.4 < time.monotonic() - t0 < 5
                        await hog.send_all(big[-10:])
                        assert (await _read_reply(hog))["seqs"] == [s0]
                    async with AsyncNodeClient(path) as c:
                        assert await c.submit(b"b" * (400 << 10), 1, timeout=5, record_id=b"second") == s0 + 1
                n.cancel_scope.cancel()
            assert spool.stats()["records"] == 2 and budget.timed_out == 1 and budget.used == 0

    trio.run(main)
