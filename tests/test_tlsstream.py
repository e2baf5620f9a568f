"""node/net/tlsstream.py: the TLS stream every swarm connection runs on, over real loopback sockets.

Bytes arrive intact and in order however the reads fall, both directions at
once; trio's Stream rules hold (one receiver at a time, closed means
ClosedResourceError, cancellation leaves the stream usable while nothing
was half sent); the peer's close is an EOF.
"""

from __future__ import annotations

import functools
import hashlib
import os
import ssl
import threading

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.node.net import transport, trust
from patchswarm.node.net.tlsstream import FIRST_BUFFER, RECEIVE_LIMIT, TLSSocketStream
from patchswarm.protocol import wire


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    trust.init_swarm(root / "swarm")
    for name, role in (("origin1", "origin"), ("node1", "node")):
        trust.issue(root / "swarm", name, role, root / name)
    return {name: trust.Credentials.load(root / name) for name in ("origin1", "node1")}


async def _pair(nursery, creds):
    """A connected, handshaken (server, client) pair of TLSSocketStreams."""
    send, receive = trio.open_memory_channel(1)

    async def on_accept(tcp):
        s = TLSSocketStream.wrap(tcp, trust.server_context(creds["origin1"]), server_side=True)
        await send.send(s)
        await trio.sleep_forever()  # the test owns the stream; the nursery's cancel ends this

    listeners = await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"), on_accept, 0)
    port = listeners[0].socket.getsockname()[1]
    client = TLSSocketStream.wrap(await trio.open_tcp_stream("127.0.0.1", port),
                                  trust.client_context(creds["node1"]), server_side=False)
    async with trio.open_nursery() as hs:
        hs.start_soon(client.do_handshake)
        server = await receive.receive()
        await server.do_handshake()
    return server, client


async def _read_exactly(stream, n):
    out = bytearray()
    reads = 0
    while len(out) < n:
        data = await stream.receive_some()
        assert data, f"EOF after {len(out)} of {n} bytes"
        assert len(data) <= RECEIVE_LIMIT
        out += data
        reads += 1
    return bytes(out), reads


def test_bytes_cross_both_ways_at_once_intact(creds):
    rng = os.urandom
    up = [rng(n) for n in (1, 5, 16 << 10, (16 << 10) + 1, 3 << 20, 777)]
    down = [rng(n) for n in (9 << 20, 2, 100_000)]

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                server, client = await _pair(n, creds)
                assert len(client._buffer) == len(server._buffer) == FIRST_BUFFER  # idle: one record's worth
                got = {}

                async def send(stream, parts):
                    for p in parts:
                        await stream.send_all(p)

                async def read(stream, parts, key):
                    got[key] = await _read_exactly(stream, sum(map(len, parts)))

                async with trio.open_nursery() as io:
                    io.start_soon(send, client, up)
                    io.start_soon(send, server, down)
                    io.start_soon(read, server, up, "up")
                    io.start_soon(read, client, down, "down")
                assert len(client._buffer) == RECEIVE_LIMIT  # 9 MiB grew it to full size
                await client.aclose()
                assert await server.receive_some() == b""  # the peer's close reads as EOF
                assert await server.receive_some() == b""
                await server.aclose()
                n.cancel_scope.cancel()
        return got

    got = trio.run(main)
    assert hashlib.sha256(got["up"][0]).digest() == hashlib.sha256(b"".join(up)).digest()
    assert got["down"][0] == b"".join(down)
    assert got["down"][1] < (9 << 20) // (16 << 10), "expected reads that take several TLS records at once"


def test_stream_rules(creds):
    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                server, client = await _pair(n, creds)
                # A receive cancelled while waiting leaves the stream as it was.
                with trio.move_on_after(0.05):
                    await client.receive_some()
                await server.send_all(b"after the cancel")
                assert await client.receive_some() == b"after the cancel"
                # One receiver at a time.
                async with trio.open_nursery() as two:
                    two.start_soon(client.receive_some)
                    await trio.sleep(0.05)
                    with pytest.raises(trio.BusyResourceError):
                        await client.receive_some()
                    await server.send_all(b"x")
                with pytest.raises(ValueError):
                    await client.receive_some(0)
                assert client.getpeercert() and trust.peer_identity(client) == ("origin1", "origin")
                assert trust.peer_identity(server) == ("node1", "node")
                await client.aclose()
                await client.aclose()  # idempotent
                with pytest.raises(trio.ClosedResourceError):
                    await client.receive_some()
                with pytest.raises(trio.ClosedResourceError):
                    await client.send_all(b"late")
                await server.aclose()
                n.cancel_scope.cancel()

    trio.run(main)


async def _messages_served(creds, send) -> list:
    """What a member that dials a `transport.serve` listener receives, until the listener's
    handler, `await send(ms)`, closes the connection."""
    got = []
    async with trio.open_nursery() as n:
        async def handler(ms):
            await send(ms)
            await ms.aclose()

        addr = await n.start(transport.serve, "127.0.0.1:0", creds["origin1"], {"node"},
                             lambda: wire.Hello("origin1", "r0", "origin", "", []), handler)
        ms = await transport.connect(addr, creds["node1"], {"origin"}, wire.Hello("node1", "r0", "node", "", []))
        assert isinstance(ms.stream, TLSSocketStream)
        while (msg := await ms.receive()) is not None:
            got.append(msg)
        await ms.aclose()
        n.cancel_scope.cancel()
    return got


def test_message_stream_frames_over_it(creds):
    """The transport's connect/serve run Hello and Pieces over TLSSocketStream end to end."""
    pieces = [os.urandom(n) for n in (0, 1, 1 << 20, 5 << 20)]

    async def send(ms):
        for i, p in enumerate(pieces):
            await ms.send(wire.Piece(3, False, i, 0, len(p), p))

    async def main():
        with trio.fail_after(30):
            return await _messages_served(creds, send)

    got = trio.run(main)
    assert [m.data for m in got] == pieces and [m.chunk for m in got] == [0, 1, 2, 3]
    # 1 MiB: its body went from OpenSSL into a buffer of its own (no copy); 5 MiB is over the cap
    assert type(got[2].data.obj) is bytearray and type(got[3].data.obj) is bytes


def test_chunk_parts_arrive_intact_each_received_into_its_own_buffer(creds):
    """Parts of 64 KiB back to back, as a node serves them, with small messages among them:
    every byte intact and in order, and after the first every part's body read straight
    from OpenSSL into its frame's buffer (protocol/wire.py FrameBuffer.direct_bodies)."""
    parts = [os.urandom(64 << 10) for _ in range(40)]

    async def send(ms):
        for i, p in enumerate(parts):
            await ms.send(wire.Piece(3, False, i, 0, len(p), p))
            if i % 7 == 0:
                await ms.send(wire.HaveOne(3, False, i))

    async def main():
        with trio.fail_after(30):
            return await _messages_served(creds, send)

    got = trio.run(main)
    pieces = [m for m in got if isinstance(m, wire.Piece)]
    assert [bytes(m.data) for m in pieces] == parts
    assert [m.chunk for m in got if isinstance(m, wire.HaveOne)] == list(range(0, 40, 7))
    assert all(type(m.data.obj) is bytearray for m in pieces[1:])


def test_receive_into_fills_the_callers_buffer_and_reads_the_peers_close_as_zero(creds):
    payload = os.urandom(300_000)

    async def main():
        async with trio.open_nursery() as n:
            server, client = await _pair(n, creds)
            target = bytearray(len(payload))
            view, got = memoryview(target), 0
            with trio.fail_after(10):
                n.start_soon(server.send_all, payload)
                with pytest.raises(ValueError, match="empty"):
                    await client.receive_into(view[:0])
                while got < len(payload):
                    k = await client.receive_into(view[got:])
                    assert k > 0
                    got += k
                await server.aclose()
                assert await client.receive_into(view[:10]) == 0
            view.release()
            await client.aclose()
            with pytest.raises(trio.ClosedResourceError):
                await client.receive_into(memoryview(bytearray(1)))
            n.cancel_scope.cancel()
            return bytes(target)

    assert trio.run(main) == payload


async def _raw_sender_pair(nursery, creds):
    """(receiver, send_records): a server-side TLSSocketStream, and its client as an ssl.SSLObject
    over memory BIOs on a plain TCP stream, so that a test decides how the TLS records' bytes
    are cut on the wire and when each cut goes: `await send_records(plaintexts, cuts, pause)`
    seals each plaintext as one record and writes the ciphertext cut at `cuts` (offsets; a
    negative one counts from the end)."""
    send, receive = trio.open_memory_channel(1)

    async def on_accept(tcp):
        await send.send(TLSSocketStream.wrap(tcp, trust.server_context(creds["origin1"]), server_side=True))
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"), on_accept, 0)
    tcp = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = trust.client_context(creds["node1"]).wrap_bio(incoming, outgoing, server_side=False)
    receiver = await receive.receive()
    nursery.start_soon(receiver.do_handshake)
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if outgoing.pending:
                await tcp.send_all(outgoing.read())
            incoming.write(await tcp.receive_some())
    await tcp.send_all(outgoing.read())  # the client's Finished

    async def send_records(plaintexts, cuts, pause):
        for p in plaintexts:
            tls.write(p)  # one record per write of at most 16 KiB
        wire_bytes = outgoing.read()
        cuts = [c if c >= 0 else len(wire_bytes) + c for c in cuts]  # negative: from the end
        edges = [0, *sorted({c for c in cuts if 0 < c < len(wire_bytes)}), len(wire_bytes)]
        for a, b in zip(edges, edges[1:]):
            await tcp.send_all(wire_bytes[a:b])
            await trio.sleep(pause)

    return receiver, send_records


async def _receive_all_into(stream, n):
    """Receive n bytes with receive_into, as MessageStream does a frame's body: (bytes, returns)."""
    target = bytearray(n)
    view, got, returns = memoryview(target), 0, 0
    while got < n:
        k = await stream.receive_into(view[got:])
        assert k > 0, f"EOF after {got} of {n} bytes"
        got, returns = got + k, returns + 1
    view.release()
    return bytes(target), returns


def _records_cut_arrive_whole(creds, record_sizes, cuts, pause):
    plaintexts = [os.urandom(n) for n in record_sizes]

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                receiver, send_records = await _raw_sender_pair(n, creds)
                n.start_soon(send_records, plaintexts, cuts, pause)
                got, _ = await _receive_all_into(receiver, sum(record_sizes))
                n.cancel_scope.cancel()
                return got

    assert trio.run(main) == b"".join(plaintexts)


def test_receive_into_ends_when_openssl_holds_most_of_the_last_record(creds):
    """receive_into waits until most of its target can be filled (SO_RCVLOWAT), so its wake
    mark must be reached by the bytes still to come even when OpenSSL already holds part of a
    record. The worst case: four 16 KiB records, all but the last 30 bytes sent, then a pause;
    a mark of the whole 16 KiB still missing after the first three would never be reached."""
    _records_cut_arrive_whole(creds, [16 << 10] * 4, [-30], 0.05)


@settings(max_examples=25, deadline=None)
@given(record_sizes=st.lists(st.integers(1, 16 << 10), min_size=1, max_size=8),
       cuts=st.lists(st.one_of(st.integers(0, 140_000), st.integers(-200, -1)), max_size=6))
def test_receive_into_ends_however_records_are_cut(creds, record_sizes, cuts):
    """The same for any record sizes and any cuts of their bytes, a pause after each cut."""
    _records_cut_arrive_whole(creds, record_sizes, cuts, 0.003)


def test_receive_into_a_body_that_trickles_in_wakes_a_few_times_not_per_packet(creds):
    """A 64 KiB part arriving a 1 KiB record at a time, as over a slow link: the receiver is woken
    for the first three quarters at once, then per record for the rest (one record's plaintext
    may already sit in OpenSSL), not once per record throughout. The worst case: a record each
    half read at a wake; a 48 KiB mark that ignored it would never be reached."""
    body = os.urandom(64 << 10)
    records = [body[i:i + 1024] for i in range(0, len(body), 1024)]
    # One cut per record, and one that leaves the 49th half sent until after a pause.
    record_wire = 1024 + 22  # 5-byte header, content type, 16-byte tag
    cuts = [i * record_wire for i in range(1, 64)] + [48 * record_wire + 600]

    async def main():
        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                receiver, send_records = await _raw_sender_pair(n, creds)
                n.start_soon(send_records, records, cuts, 0.002)
                got = await _receive_all_into(receiver, len(body))
                n.cancel_scope.cancel()
                return got

    got, returns = trio.run(main)
    assert got == body
    assert returns <= 24, f"{returns} wake-ups for 64 records: the wake mark did not hold"


def test_connect_dials_from_the_local_address_it_is_given(creds):
    """A host with several addresses picks the one to dial from (the tracker bench gives each
    simulated member its own, as a fleet has)."""
    async def main():
        seen = []
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                async def handler(ms):
                    seen.append(ms.stream.getpeername()[0])
                    await ms.aclose()

                addr = await n.start(transport.serve, "127.0.0.1:0", creds["origin1"], {"node"},
                                     lambda: wire.Hello("origin1", "r0", "origin", "", []), handler)
                for source in ("127.0.0.7", None):
                    ms = await transport.connect(addr, creds["node1"], {"origin"},
                                                 wire.Hello("node1", "r0", "node", "", []), local_address=source)
                    assert await ms.receive() is None
                    await ms.aclose()
                n.cancel_scope.cancel()
        return seen

    assert trio.run(main) == ["127.0.0.7", "127.0.0.1"]



def test_send_nowait_writes_whole_messages_until_the_socket_is_full_then_send_all_retries_the_same(creds):
    """The tracker writes notices with send_nowait: each goes out whole or not at all, and after
    a False the same bytes through send_all complete the write OpenSSL may hold half done, so the
    receiver sees every message once, in order."""
    messages = [hashlib.sha256(b"%d" % i).digest() * 256 for i in range(4000)]  # 8 KiB each

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                server, client = await _pair(n, creds)
                sent, refused = 0, None
                for m in messages:  # nobody reads: the socket buffers fill
                    if not server.send_nowait(m):
                        refused = m
                        break
                    sent += 1
                assert refused is not None and sent > 0
                got = []

                async def read_all():
                    got.append((await _read_exactly(client, 8192 * (sent + 2)))[0])

                n.start_soon(read_all)
                await server.send_all(refused)  # the write to retry
                await server.send_all(b"\x01" * 8192)
                with trio.fail_after(30):
                    while not got:
                        await trio.sleep(0.01)
                assert got[0] == b"".join(messages[:sent + 1]) + b"\x01" * 8192
                n.cancel_scope.cancel()

    trio.run(main)


def test_send_nowait_declines_while_a_send_is_in_progress_or_after_close(creds):
    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                server, client = await _pair(n, creds)
                assert server.send_nowait(b"hello")
                assert await client.receive_some() == b"hello"
                big = os.urandom(64 << 20)
                n.start_soon(server.send_all, big)  # nobody reads: it waits for the socket
                await trio.sleep(0.5)
                assert not server.send_nowait(b"x")  # it would land inside the big write
                assert (await _read_exactly(client, len(big)))[0] == big
                await trio.sleep(0.1)
                await server.aclose()
                assert not server.send_nowait(b"x")
                n.cancel_scope.cancel()

    trio.run(main)


def test_tracker_pushes_to_a_member_that_stops_reading_arrive_whole_and_in_order_once_it_reads(creds):
    """tracker/server.py writes a frame at once when the member's socket takes it and queues it
    otherwise; the frame OpenSSL refused is written again by itself before anything batched."""
    import collections
    import types

    from patchswarm.tracker.server import _Session

    frames = [hashlib.sha256(b"%d" % i).digest() * 128 for i in range(6000)]  # 4 KiB each

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                server, client = await _pair(n, creds)
                tracker = types.SimpleNamespace(sent=collections.Counter(), busy={})
                session = _Session(types.SimpleNamespace(stream=server, counters=types.SimpleNamespace(sent=0)), tracker)
                n.start_soon(session.send_loop)
                pushed = 0
                for f in frames:  # nobody reads: direct writes until the socket is full, then the queue
                    if not session.push("PeerDelta", f):
                        break
                    pushed += 1
                assert session.queue and pushed < len(frames)
                got = (await _read_exactly(client, 4096 * pushed))[0]
                assert got == b"".join(frames[:pushed])
                assert tracker.sent["PeerDelta"] == 4096 * pushed
                n.cancel_scope.cancel()

    trio.run(main)


def test_two_event_loops_in_two_threads_receive_intact_at_once(creds):
    """Reads that need no wait go through a scratch buffer shared by a thread's connections
    (node/net/transport.py): one per thread, so event loops in two threads of one process
    (tests, an embedding application) never read into each other's."""
    results: dict[int, bool] = {}

    def loop(k: int) -> None:
        parts = [os.urandom(3000 + 97 * i) for i in range(60)]  # small frames: the scratch path

        async def send(ms):
            for i, p in enumerate(parts):
                await ms.send(wire.Piece(k, False, i, 0, len(p), p))

        async def main():
            with trio.fail_after(30):
                return [bytes(m.data) for m in await _messages_served(creds, send)] == parts

        results[k] = trio.run(main)

    threads = [threading.Thread(target=loop, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {1: True, 2: True}
    assert transport._scratch() is transport._scratch()
