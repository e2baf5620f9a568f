"""The HTTP side of a service in one trio run: routes, refusals, idle clients, /healthz on a blocked loop, /readyz.

A real server on loopback, real TCP clients; the status behind the metrics is
a dict the test changes, as a service's would change.
"""

from __future__ import annotations

import json
import time

import trio
from prometheus_client.parser import text_string_to_metric_families

from patchswarm.node.net import httpserve
from patchswarm.node.net.exporter import Exporter, LoopMonitor
from patchswarm.node.net.httpserve import Response, serve_http
from patchswarm.node.net.metrics import NodeMetrics
from patchswarm.node.net.transport import parse_addr


async def request(addr: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = parse_addr(addr)
    with trio.fail_after(10):
        s = await trio.open_tcp_stream(host, port)
        async with s:
            await s.send_all(raw)
            data = b""
            while chunk := await s.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


async def get(addr: str, path: str) -> tuple[int, bytes]:
    status, _, body = await request(addr, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return status, body


def run(fn):
    async def main():
        async with trio.open_nursery() as n:
            await fn(n)
            n.cancel_scope.cancel()

    trio.run(main)


def test_routes_and_refusals():
    async def body(n):
        addr = await n.start(serve_http, "127.0.0.1:0", {"/a": lambda: Response(200, b"A"),
                                                          "/boom": lambda: 1 / 0})
        assert await get(addr, "/a?x=1") == (200, b"A")
        status, headers, b = await request(addr, b"HEAD /a HTTP/1.1\r\n\r\n")
        assert (status, headers["Content-Length"], b) == (200, "1", b"")
        assert (await get(addr, "/missing"))[0] == 404
        assert (await request(addr, b"POST /a HTTP/1.1\r\nContent-Length: 0\r\n\r\n"))[0] == 405
        assert (await request(addr, b"nonsense\r\n\r\n"))[0] == 400
        assert (await request(addr, b"GET /a SPDY/3\r\n\r\n"))[0] == 400
        assert (await request(addr, b"GET /a HTTP/1.1\r\nX: " + b"y" * (httpserve.MAX_REQUEST_BYTES + 10)
                              + b"\r\n\r\n"))[0] == 400
        assert (await get(addr, "/boom"))[0] == 500  # a route's bug: 500, and the server goes on
        assert await get(addr, "/a") == (200, b"A")

    run(body)


def test_a_silent_client_does_not_hold_the_server(monkeypatch):
    monkeypatch.setattr(httpserve, "REQUEST_SECONDS", 0.3)

    async def body(n):
        addr = await n.start(serve_http, "127.0.0.1:0", {"/a": lambda: Response(200, b"A")})
        host, port = parse_addr(addr)
        silent = await trio.open_tcp_stream(host, port)
        with trio.fail_after(5):
            assert await get(addr, "/a") == (200, b"A")  # served while the silent one waits
            assert await silent.receive_some(1000) == b""  # closed, unanswered, at its deadline
        await silent.aclose()

    run(body)


async def closed_by_server(s: trio.SocketStream) -> bool:
    """Whether the server closed `s` (end of stream, or a reset: it closed with our bytes unread)."""
    try:
        with trio.fail_after(5):
            return await s.receive_some(1000) == b""
    except trio.BrokenResourceError:
        return True


async def open_idle(addr: str, count: int) -> list[trio.SocketStream]:
    """`count` connections that say nothing, or half a request line, and wait."""
    host, port = parse_addr(addr)
    streams = []
    for i in range(count):
        streams.append(await trio.open_tcp_stream(host, port))
        if i % 2:
            await streams[-1].send_all(b"GET /a HT")
    return streams


def test_idle_connections_on_every_slot_do_not_shut_out_a_probe():
    """Each new connection over the limit takes the slot of the oldest still reading; REQUEST_SECONDS stays 10 s."""
    async def body(n):
        addr = await n.start(serve_http, "127.0.0.1:0", {"/a": lambda: Response(200, b"A")})
        rounds = []
        try:
            for _ in range(3):
                rounds.append(await open_idle(addr, httpserve.MAX_CONNECTIONS + 4))
                with trio.fail_after(2):
                    assert await get(addr, "/a") == (200, b"A")
            for s in rounds[0] + rounds[1]:  # each taken by a newer connection: closed unanswered
                assert await closed_by_server(s)
        finally:
            for s in [s for r in rounds for s in r]:
                await trio.aclose_forcefully(s)

    run(body)


def test_a_connection_being_answered_keeps_its_slot():
    """Its response is larger than the socket buffers and unread while every other slot fills and turns over."""
    big = bytes(16 << 20)

    async def body(n):
        addr = await n.start(serve_http, "127.0.0.1:0", {"/a": lambda: Response(200, b"A"),
                                                          "/big": lambda: Response(200, big)})
        host, port = parse_addr(addr)
        answered = await trio.open_tcp_stream(host, port)
        idle = []
        try:
            await answered.send_all(b"GET /big HTTP/1.1\r\n\r\n")
            await trio.sleep(0.2)  # read, and writing its response
            idle = await open_idle(addr, 2 * httpserve.MAX_CONNECTIONS)
            with trio.fail_after(2):
                assert await get(addr, "/a") == (200, b"A")
            data = bytearray()
            with trio.fail_after(10):
                while chunk := await answered.receive_some(1 << 20):
                    data += chunk
            assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(big[:1000])
            assert len(data) - data.index(b"\r\n\r\n") - 4 == len(big)
        finally:
            for s in [answered, *idle]:
                await trio.aclose_forcefully(s)

    run(body)


def test_healthz_answers_503_after_the_loop_was_blocked_and_200_once_it_runs_again():
    async def body(n):
        exporter = Exporter(NodeMetrics(), loop=LoopMonitor(tick=0.05, stall=0.3))
        addr = await n.start(exporter.run, "127.0.0.1:0")
        await trio.sleep(0.2)
        status, b = await get(addr, "/healthz")
        assert status == 200 and json.loads(b)["healthy"] is True
        time.sleep(0.6)  # what a blocking call on the event loop does
        await trio.sleep(0)
        status, b = await get(addr, "/healthz")
        assert status == 503 and json.loads(b)["event_loop_lag_s"] >= 0.3
        await trio.sleep(0.2)
        assert (await get(addr, "/healthz"))[0] == 200

    run(body)


def test_readyz_is_503_until_the_node_is_current_then_stays_200():
    st = {"version": None, "latest_version": None, "applied": []}

    async def body(n):
        exporter = Exporter(NodeMetrics())
        addr = await n.start(exporter.run, "127.0.0.1:0")
        status, b = await get(addr, "/readyz")
        assert status == 503 and json.loads(b)["reason"] == "starting"
        exporter.attach(lambda: st)
        assert json.loads((await get(addr, "/readyz"))[1])["reason"] == "no verified version yet"
        st.update(version=1, latest_version=2)
        assert (await get(addr, "/readyz"))[0] == 503
        st.update(version=2)
        assert (await get(addr, "/readyz"))[0] == 200
        st.update(latest_version=3)  # fetching the next one: still serving the one it has
        assert (await get(addr, "/readyz"))[0] == 200
        families = {f.name: f for f in text_string_to_metric_families((await get(addr, "/metrics"))[1].decode())}
        assert families["patchswarm_ready"].samples[0].value == 1
        assert families["patchswarm_versions_behind"].samples[0].value == 1
        assert families["patchswarm_build_info"].samples[0].labels["service"] == "node"
        assert "process_resident_memory_bytes" in families

    run(body)


def test_readiness_latches_even_when_no_probe_came_while_the_node_was_current():
    """The exporter checks on its own: a node current for a moment between two probes is ready."""
    st = {"version": 1, "latest_version": 1}

    async def body(n):
        exporter = Exporter(NodeMetrics())
        await n.start(exporter.run, "127.0.0.1:0")
        exporter.metrics.attach(lambda: st)  # not attach(): no check at attach time
        await trio.sleep(1.5)
        st.update(latest_version=2)
        assert exporter.ready

    run(body)
