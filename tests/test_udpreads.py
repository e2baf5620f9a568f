"""node/net/udpreads.py: datagrams that arrived together reach the protocol in one
loop turn, in order, none lost, errors reported as asyncio reports them, and a
closed transport reads nothing more. Real sockets on loopback, a real asyncio loop."""

from __future__ import annotations

import asyncio
import socket

from patchswarm.node.net import udpreads


class Recorder(asyncio.DatagramProtocol):
    """Each datagram with the loop turn it arrived in (a ticker counts turns)."""

    def __init__(self) -> None:
        self.got: list[tuple[bytes, int]] = []
        self.errors: list[OSError] = []
        self.turn = 0

    def datagram_received(self, data, addr) -> None:
        self.got.append((data, self.turn))

    def error_received(self, exc) -> None:
        self.errors.append(exc)


async def _endpoint(batched: bool, batch: int = udpreads.BATCH):
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(Recorder, local_addr=("127.0.0.1", 0))
    if batched:
        assert udpreads.read_in_batches(transport, batch)

    def tick() -> None:
        proto.turn += 1
        if not transport.is_closing():
            loop.call_soon(tick)

    loop.call_soon(tick)
    return transport, proto


async def _send_and_collect(transport, proto, count: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
        for i in range(count):  # all sent before the loop looks: they wait in the socket together
            out.sendto(i.to_bytes(4, "big") * 100, transport.get_extra_info("sockname"))
    for _ in range(2000):
        if len(proto.got) == count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"expected {count} datagrams, got {len(proto.got)}")


def test_queued_datagrams_arrive_in_one_turn_in_order():
    async def main():
        for batched in (False, True):
            transport, proto = await _endpoint(batched)
            await _send_and_collect(transport, proto, 40)
            assert [d[:4] for d, _ in proto.got] == [i.to_bytes(4, "big") for i in range(40)]
            turns = {t for _, t in proto.got}
            # asyncio alone: one datagram per turn; batched: the 40 in one turn.
            assert len(turns) == (1 if batched else 40), (batched, sorted(turns))
            transport.close()

    asyncio.run(main())


def test_a_batch_is_bounded_so_other_callbacks_run_between():
    async def main():
        transport, proto = await _endpoint(True, batch=16)
        await _send_and_collect(transport, proto, 40)
        per_turn: dict[int, int] = {}
        for _, t in proto.got:
            per_turn[t] = per_turn.get(t, 0) + 1
        assert sorted(per_turn.values(), reverse=True) == [16, 16, 8]
        transport.close()

    asyncio.run(main())


def test_errors_are_reported_and_reading_goes_on():
    async def main():
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as closed_peer:
            closed_peer.bind(("127.0.0.1", 0))
            gone = closed_peer.getsockname()
        # A connected UDP socket gets ECONNREFUSED back from the ICMP of a send to a closed port.
        transport, proto = await loop.create_datagram_endpoint(Recorder, local_addr=("127.0.0.1", 0),
                                                               remote_addr=gone)
        assert udpreads.read_in_batches(transport)
        transport.sendto(b"x")
        for _ in range(1000):
            if proto.errors:
                break
            await asyncio.sleep(0.001)
        assert proto.errors and isinstance(proto.errors[0], ConnectionRefusedError)
        assert not transport.is_closing()  # as asyncio does: reported, not fatal
        transport.close()

    asyncio.run(main())


def test_a_closed_transport_reads_nothing_more():
    async def main():
        transport, proto = await _endpoint(True)
        addr = transport.get_extra_info("sockname")
        transport.close()
        await asyncio.sleep(0.01)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
            out.sendto(b"late", addr)
        await asyncio.sleep(0.05)
        assert proto.got == []

    asyncio.run(main())


def test_what_is_not_a_selector_datagram_transport_is_left_alone():
    class NotATransport:
        def is_closing(self) -> bool:
            return False

    async def main():
        assert not udpreads.read_in_batches(NotATransport())
        transport, _ = await _endpoint(False)
        transport.close()
        assert not udpreads.read_in_batches(transport)  # closing: nothing to install

    asyncio.run(main())
