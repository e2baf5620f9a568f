"""A peer's Request then Cancel at once, in a loop over chunks this node holds: what it costs
the serving node in chunk reads (each a file read and a SHA-256 of the chunk), and that the
node still serves an honest peer meanwhile and a chunk damaged on disk still is never sent.

PeerSet runs over trio's in-memory stream pairs with a real ObjectStore on disk; reads are
counted by wrapping node/store.py's `_read_checked` (the one place a chunk is read and hashed)."""

from __future__ import annotations

import time

import trio
import trio.testing

from memlink import KEY, store_with
from patchswarm.node import store as store_module
from patchswarm.node.net.ratelimit import TokenBucket
from patchswarm.node.net.transport import MessageStream
from patchswarm.node.peers import PeerBudgets, PeerSet
from patchswarm.protocol import wire

from test_peer_budgets import FarEnd, _noop

CHUNK = 1 << 20


def _chunks(n: int) -> list[bytes]:
    return [bytes([i]) * CHUNK for i in range(n)]


async def _join(nursery, peers: PeerSet, peer: str) -> FarEnd:
    local, remote = trio.testing.memory_stream_pair()
    ms = MessageStream(local, peer, "node")
    far = FarEnd(remote)
    await far.send(wire.Hello(peer, "r0", "node", "127.0.0.1:1", []))
    await ms.send(wire.Hello("b", "r0", "node", "127.0.0.1:2", []))
    ms.hello = await ms.receive()
    await far.receive(1)
    nursery.start_soon(peers.run, ms, False)
    await trio.testing.wait_all_tasks_blocked()
    return far


async def _fetch(far: FarEnd, chunk: int) -> bytes:
    """Ask for a chunk and take its pieces until it is whole (a Reject: b"")."""
    await far.send(wire.Request(KEY[0], KEY[1], chunk))
    got = bytearray()
    while True:
        (msg,) = await far.receive(1)
        if isinstance(msg, wire.Reject):
            return b""
        if isinstance(msg, wire.Piece) and msg.chunk == chunk:
            got += msg.data
            if len(got) == msg.total:
                return bytes(got)


def _counting(monkeypatch) -> list:
    reads = []
    real = store_module._read_checked

    def counting(path, expected):
        reads.append(path.name)
        return real(path, expected)

    monkeypatch.setattr(store_module, "_read_checked", counting)
    return reads


async def _request_cancel(far: FarEnd, pairs: int, chunks: int) -> None:
    """`pairs` Requests over chunks 0..chunks-1, each followed by its Cancel in the next
    write, once the node had a moment to start on it (what arrives in one read the node
    sorts out before serving anything); the answers are drained. Stops where the node
    closes the session."""
    async def drain():
        while await far.receive(1):
            pass

    async with trio.open_nursery() as n:
        n.start_soon(drain)
        try:
            for c in range(pairs):
                await far.send(wire.Request(KEY[0], KEY[1], c % chunks))
                await trio.sleep(0.0005)
                await far.send(wire.Cancel(KEY[0], KEY[1], c % chunks))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # dropped
        await trio.sleep(0.2)
        n.cancel_scope.cancel()


def _run(tmp_path, monkeypatch, chunks: int, pairs: int, kept_chunks: int | None = None,
         budgets: PeerBudgets = PeerBudgets()):
    if kept_chunks is not None:
        monkeypatch.setattr(store_module, "SERVED_KEPT_BYTES", kept_chunks * CHUNK)
    store = store_with(tmp_path / "store", _chunks(chunks))
    peers = PeerSet("b", store, TokenBucket(None), _noop, budgets=budgets)
    reads = _counting(monkeypatch)
    out = {}

    async def main():
        with trio.fail_after(120):  # a bound on the test, not a measurement
            async with trio.open_nursery() as nursery:
                hostile = await _join(nursery, peers, "a")
                honest = await _join(nursery, peers, "c")
                t0, start = time.process_time(), trio.current_time()
                await _request_cancel(hostile, pairs, chunks)
                out["cpu"] = time.process_time() - t0
                out["seconds"] = trio.current_time() - start
                out["reads"] = len(reads)
                out["honest"] = [await _fetch(honest, c) for c in range(chunks)]
                out["sessions"] = sorted(peers.sessions)
                nursery.cancel_scope.cancel()

    trio.run(main)
    print(f"{pairs} Request+Cancel pairs over {chunks} chunks of {CHUNK:,} bytes in {out['seconds']:.2f} s: "
          f"{out['reads']} chunk reads, {out['cpu']:.2f} s CPU; {peers.reads_delayed} reads delayed")
    return out, peers


def test_a_request_cancel_loop_over_a_few_chunks_costs_a_read_each_at_most(tmp_path, monkeypatch):
    """Before: every pair cost a read and a SHA-256 of the chunk (1000 pairs: 997 reads, 1.0 s
    of CPU in this harness). Now a chunk served recently is served from the bytes checked then."""
    out, peers = _run(tmp_path, monkeypatch, chunks=8, pairs=1000)
    assert out["reads"] <= 8, out["reads"]
    assert out["honest"] == _chunks(8) and out["sessions"] == ["a", "c"] and not peers.dropped


def test_a_request_cancel_loop_over_more_chunks_than_are_kept_is_held_to_its_read_budget(tmp_path, monkeypatch):
    """40 chunks and 4 kept: every pair would be a read (before: 1000 pairs, 1000 reads). The
    bytes read for requests it cancelled are held to the budget's rate past its burst (here
    4 MiB/s past 8 MiB), and the honest peer beside it is served every chunk, at once."""
    rate, burst = 4 * CHUNK, 8 * CHUNK
    out, peers = _run(tmp_path, monkeypatch, chunks=40, pairs=1000, kept_chunks=4,
                      budgets=PeerBudgets(wasted_read_bytes_per_second=rate, wasted_read_burst=burst))
    assert out["reads"] <= (burst + rate * out["seconds"]) / CHUNK + 4, out  # + a read in flight or so
    assert peers.reads_delayed > 0 and out["sessions"] == ["a", "c"] and not peers.dropped
    assert out["honest"] == _chunks(40)


def test_a_kept_chunk_is_the_bytes_checked_and_one_let_go_is_checked_again_when_read(tmp_path, monkeypatch):
    """What is kept is what matched the manifest; a chunk let go (more served since) and
    damaged on disk meanwhile is found damaged when it is read again: never served."""
    monkeypatch.setattr(store_module, "SERVED_KEPT_BYTES", CHUNK)  # one chunk
    store = store_with(tmp_path, _chunks(2))
    path = next(p for p in tmp_path.iterdir() if p.is_dir()) / "000000.chunk"

    async def main():
        assert await store.serve_chunk(KEY, 0) == (_chunks(2)[0], True)
        assert await store.serve_chunk(KEY, 0) == (_chunks(2)[0], False)  # kept: no read
        assert await store.serve_chunk(KEY, 1) == (_chunks(2)[1], True)  # chunk 0 let go
        path.write_bytes(b"\x07" + _chunks(2)[0][1:])
        assert await store.serve_chunk(KEY, 0) == (None, True)
        assert await store.serve_chunk(KEY, 1) == (_chunks(2)[1], False)

    trio.run(main)
    assert store.chunk_reads == 3 and store.chunks_damaged == 1 and store.have(KEY) == {1}
    store.put_chunk(KEY, 1, _chunks(2)[1])  # a rewrite lets the kept bytes go
    assert store.serve_chunk_now(KEY, 1) == (_chunks(2)[1], True)
