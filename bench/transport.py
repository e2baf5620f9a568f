"""Transport bench: CPU per MiB moved through the wire framing, trio.SSLStream against node/net/tlsstream.py.

For each stream class, a sender and a receiver process on loopback exchange
Hellos over mutual TLS 1.3 (the swarm's contexts), then the sender sends
`--mib` MiB in Piece messages of `--piece-kib` (1 MiB; a node's chunk parts are
64 KiB); each side reports its own CPU time (process_time) for the transfer.
The classes (`--streams`) run in the same invocation, alternating `--repeat`
times, and the table shows the best run of each. To set two trees side by
side, run one tree's bench file with each tree's interpreter: the package
comes from the interpreter's install.

    .venv/bin/python bench/transport.py [--mib 256] [--repeat 3] [--piece-kib 64] [--streams TLSSocketStream]

`--pace-mbit R`: the sender writes each Piece's frame in 8 KiB slices at R Mbit/s, as
bytes reach a node over a WAN link, not at loopback speed; the receiver's CPU per MiB
and its wake-ups (voluntary context switches) per MiB are what such a link costs it.

    .venv/bin/python bench/transport.py --mib 32 --piece-kib 64 --pace-mbit 100 --streams TLSSocketStream

`--webrtc`: WebRTC data channels (node/net/webrtc.py) against TCP+TLS
(TLSSocketStream), one pair of endpoints in one process on loopback, Piece
messages of 16-256 KiB through MessageStream: MB/s received. `--profile`
prints where the asyncio thread's time goes in a WebRTC run.

    .venv/bin/python bench/transport.py --webrtc [--mib 32] [--repeat 2] [--lanes 2] [--profile WebRTC]

Variants: "WebRTC stock" (aiortc as released), "WebRTC" (node/net/sctpfast.py's
speed-ups); both ends in one process, or each end in its own process
("2 processes"), or `--lanes` peer connections at once, each end of each in
its own process. Besides MB/s: MB per CPU second (the whole process; with
processes, the busiest end's), which a shared machine's load distorts less.

`--nat` (root, with `ip`, `nft` and coturn): the same pair measurement through
tests/nattopo.py's topology, each end in its own process and its own network
namespace, against the same pair on loopback in the same run: TCP+TLS with the
receiver behind NAT dialing out to a sender on the public network; WebRTC
direct between two hosts each behind its own port-preserving NAT (STUN only, from
a coturn on the public network: host/srflx candidates through the masquerade),
one and `--lanes` peer connections; WebRTC relayed through that coturn between
two hosts behind symmetric NAT (a new port per destination, so no hole punch).
Each WebRTC row checks the candidate pair ICE chose is the path it names, and
the relayed row also reports MB per CPU second of coturn. Namespaces, nftables
rules and coturn are removed at the end, on failure and on SIGTERM too.

    .venv/bin/python bench/transport.py --nat [--mib 8] [--repeat 1] [--lanes 2]

`--tuning`: the receive-path tunings one by one (node/net/udpreads.py's batched
reads, sctpfast.py's one SACK per queued run and the sender's burst limit), one
pair on loopback, each end in its own process.

    .venv/bin/python bench/transport.py --tuning [--mib 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the NAT topology and its coturn (tests/nattopo.py)

import trio  # noqa: E402

from patchswarm.node.net import transport, trust  # noqa: E402
from patchswarm.node.net.tlsstream import TLSSocketStream  # noqa: E402
from patchswarm.protocol import wire  # noqa: E402
import nattopo  # noqa: E402
from bench import procstat  # noqa: E402
from nattopo import TURN_PASSWORD, TURN_USER  # noqa: E402

STREAMS = ("trio.SSLStream", "TLSSocketStream")
PIECE = 1 << 20
CHILD_TIMEOUT_S = 120
PACE_SLICE = 8 << 10  # bytes per paced write: a few packets, about what one wake-up finds at WAN rates


def _stream(kind: str, tcp: trio.SocketStream, ctx, server_side: bool):
    if kind == "trio.SSLStream":
        return trio.SSLStream(tcp, ctx, server_side=server_side, server_hostname=None)
    return TLSSocketStream.wrap(tcp, ctx, server_side=server_side)


async def _paced_send(ms: transport.MessageStream, msg, pace_mbit: float, clock: list[float]) -> None:
    """Send `msg`'s frame in PACE_SLICE writes, each at its time on a `pace_mbit` link
    (clock[0]: when the next write is due)."""
    frame = memoryview(wire.encode(msg))  # header and body, as MessageStream.send writes it
    for at in range(0, len(frame), PACE_SLICE):
        piece = frame[at:at + PACE_SLICE]
        await trio.sleep_until(clock[0])
        await ms.stream.send_all(piece)
        clock[0] += len(piece) * 8 / (pace_mbit * 1e6)


async def _child(role: str, kind: str, creds_root: Path, host: str, port: int, size: int, total: int,
                 pace_mbit: float = 0) -> dict:
    """One end of a TCP+TLS pair: "send" listens on `host` (any port, printed), "receive" dials host:port."""
    name = "origin1" if role == "send" else "node1"
    creds = trust.Credentials.load(creds_root / name)
    count = max(1, total // size)
    result: dict = {}

    async def session(tls) -> None:
        with trio.fail_after(CHILD_TIMEOUT_S):
            await tls.do_handshake()
            peer, peer_role = trust.peer_identity(tls)
            ms = transport.MessageStream(tls, peer, peer_role)
            await transport.exchange_hello(ms, wire.Hello(name, "r0", "origin" if role == "send" else "node", "", []))
            t0, c0, k0, w0 = time.perf_counter(), time.process_time(), _system_s(), _wakeups()
            if role == "send":
                data = os.urandom(size)
                clock = [trio.current_time()]
                for i in range(count):
                    piece = wire.Piece(1, False, i, 0, size, data)
                    await (_paced_send(ms, piece, pace_mbit, clock) if pace_mbit else ms.send(piece))
                assert await ms.receive() is None  # the receiver closes once it holds everything
            else:
                for _ in range(count):
                    msg = await ms.receive()
                    assert isinstance(msg, wire.Piece) and len(msg.data) == size, msg
            result.update(cpu_s=time.process_time() - c0, sys_s=_system_s() - k0, wall_s=time.perf_counter() - t0,
                          bytes=count * size, wakeups=_wakeups() - w0)
            await ms.aclose()

    if role == "send":
        ctx = trust.server_context(creds)
        listener = socket.create_server((host, 0))
        print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
        sock, _ = await trio.to_thread.run_sync(listener.accept)
        listener.close()
        tcp = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        await session(_stream(kind, tcp, ctx, True))
    else:
        tcp = await trio.open_tcp_stream(host, port)
        await session(_stream(kind, tcp, trust.client_context(creds), False))
    return result


def _system_s() -> float:
    """This process's CPU seconds in the kernel so far (getrusage: Linux splits its precise CPU
    time by the tick-sampled user/system ratio, so the share means something only over ~1 s)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _wakeups() -> int:
    """Times this process waited for something (voluntary context switches): a receiver's
    wake-ups, one per wait for bytes that ended."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _tcp_processes(kind: str, creds_root: Path, size: int, total: int, host: str = "127.0.0.1",
                   send_ns: tuple[str, ...] = (), receive_ns: tuple[str, ...] = (), pace_mbit: float = 0
                   ) -> tuple[dict, dict]:
    """One TCP+TLS pair, each end in its own process (`*_ns`: a command prefix that runs
    it in a network namespace); the sender's and the receiver's results."""
    def argv(role: str, port: int = 0) -> list[str]:
        return [*(send_ns if role == "send" else receive_ns), sys.executable, __file__, "--child", role,
                "--kind", kind, "--creds", str(creds_root), "--host", host, "--port", str(port),
                "--size", str(size), "--mib", str(total >> 20), "--pace-mbit", str(pace_mbit)]

    sender = subprocess.Popen(argv("send"), stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(sender.stdout.readline() or "{}").get("port")
        if not port:
            raise SystemExit(f"{kind}: the sender did not start listening")
        receiver = subprocess.run(argv("receive", port), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        out_s, _ = sender.communicate(timeout=CHILD_TIMEOUT_S)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    if receiver.returncode or sender.returncode:
        raise SystemExit(f"{kind}: child failed (send rc {sender.returncode}, receive rc {receiver.returncode}):\n"
                         f"{receiver.stderr[-2000:]}")
    return _last_json(out_s), _last_json(receiver.stdout)


def _run_pair(kind: str, creds_root: Path, mib: int, piece: int = PIECE, pace_mbit: float = 0) -> dict:
    send, recv = _tcp_processes(kind, creds_root, piece, mib << 20, pace_mbit=pace_mbit)
    moved = recv["bytes"] / (1 << 20)  # whole Pieces: mib MiB, rounded down to a multiple of the piece
    return {"stream": kind, "send_ms_per_mib": 1e3 * send["cpu_s"] / moved,
            "receive_ms_per_mib": 1e3 * recv["cpu_s"] / moved, "mb_per_s": recv["bytes"] / 1e6 / recv["wall_s"],
            "receive_wakeups_per_mib": recv["wakeups"] / moved}


SIZES_KIB = (16, 64, 256)


async def _tls_pair(creds_root: Path):
    node, origin = (trust.Credentials.load(creds_root / n) for n in ("node1", "origin1"))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    await listeners[0].aclose()
    a = TLSSocketStream.wrap(client, trust.client_context(node), server_side=False)
    b = TLSSocketStream.wrap(server, trust.server_context(origin), server_side=True)
    async with trio.open_nursery() as n:
        n.start_soon(a.do_handshake)
        n.start_soon(b.do_handshake)
    return a, b, None


async def _webrtc_pair(rtc, fast_sctp: bool = True):
    pa, pb = rtc.peer(fast_sctp), rtc.peer(fast_sctp)
    await pa.accept_answer(await pb.local_answer(await pa.local_offer()))
    with trio.fail_after(30):
        return await pa.open(), await pb.open(), (pa, pb)


async def _throughput(kind: str, creds_root: Path, size: int, total: int) -> tuple[float, float]:
    """MB/s of `total` bytes of Pieces of `size` bytes, one way, through MessageStream,
    and MB per CPU second of the process (both ends, every thread)."""
    from patchswarm.node.net.webrtc import IceConfig, RTCLoop

    async def run(a, b) -> float:
        send, recv = transport.MessageStream(a, "b", "node"), transport.MessageStream(b, "a", "node")
        data, count = os.urandom(size), max(1, total // size)
        hello = wire.Hello("x", "r0", "node", "", [])

        async def sender():
            await send.send(hello)
            for i in range(count):
                await send.send(wire.Piece(1, False, i, 0, size, data))

        with trio.fail_after(CHILD_TIMEOUT_S * 5):
            async with trio.open_nursery() as n:
                n.start_soon(sender)
                assert isinstance(await recv.receive(), wire.Hello)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(count):
                    msg = await recv.receive()
                    assert isinstance(msg, wire.Piece) and len(msg.data) == size
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        await send.aclose()
        await recv.aclose()
        return count * size / 1e6 / wall, count * size / 1e6 / cpu

    if kind == "TCP+TLS":
        a, b, _ = await _tls_pair(creds_root)
        return await run(a, b)
    async with RTCLoop(IceConfig(host_addresses=("127.0.0.1",))) as rtc:
        a, b, _ = await _webrtc_pair(rtc, fast_sctp=kind != "WebRTC stock")
        return await run(a, b)


OPEN_TIMEOUT_S = 60  # ICE through a relay behind symmetric NAT tries every pair first


async def _rtc_child(role: str, size: int, total: int, fast: bool, ice_argv: list[str], channels: int = 0) -> dict:
    """One end of one peer connection in this process; the SDP through stdin/stdout.
    `ice_argv`: host address, STUN and TURN for IceConfig (`_ice_argv`). `channels`: 0,
    Piece messages through MessageStream on the peer's channel; N, raw `send`s of
    `size` bytes dealt over N more data channels of the same peer connection
    (`_raw_in_loop`), the MessageStream only to say when to start."""
    from patchswarm.node.net.webrtc import IceConfig, RTCLoop

    async def line() -> str:
        return json.loads(await trio.to_thread.run_sync(sys.stdin.readline))["sdp"]

    host, stun, turn = (ice_argv + ["", "", ""])[:3]
    ice = IceConfig(stun=stun or None, turn=turn or None, turn_user=TURN_USER if turn else None,
                    turn_password=TURN_PASSWORD if turn else None, host_addresses=(host or "127.0.0.1",))
    async with RTCLoop(ice) as rtc:
        peer = rtc.peer(fast)
        if role == "send":
            print(json.dumps({"sdp": await peer.local_offer()}), flush=True)
            await peer.accept_answer(await line())
        else:
            print(json.dumps({"sdp": await peer.local_answer(await line())}), flush=True)
        with trio.fail_after(OPEN_TIMEOUT_S):
            ms = transport.MessageStream(await peer.open(), "x", "node")
        pair = peer._selected_pair()  # which candidates ICE chose: the path the bytes take
        count, out = max(1, total // size), {
            "pair": f"{pair.local_candidate.type}-{pair.remote_candidate.type}" if pair else "unknown"}
        with trio.fail_after(CHILD_TIMEOUT_S * 5):
            if channels:
                if role == "receive":
                    ready = await rtc.run(_raw_channels(peer, channels))  # handlers on before the sender starts
                    c0, k0 = time.process_time(), _system_s()
                    await ms.send(wire.Hello("x", "r0", "node", "", []))
                    out.update(await rtc.run(_raw_in_loop(ready, role, size, count)))
                    out.update(bytes=count * size, cpu=time.process_time() - c0, sys=_system_s() - k0)
                else:
                    ready = await rtc.run(_raw_channels(peer, channels))
                    assert isinstance(await ms.receive(), wire.Hello)
                    c0, k0 = time.process_time(), _system_s()
                    await rtc.run(_raw_in_loop(ready, role, size, count))
                    out.update(cpu=time.process_time() - c0, sys=_system_s() - k0)
            elif role == "send":
                data = os.urandom(size)
                c0, k0 = time.process_time(), _system_s()
                await ms.send(wire.Hello("x", "r0", "node", "", []))
                for i in range(count):
                    await ms.send(wire.Piece(1, False, i, 0, size, data))
                await ms.receive()  # None once the receiver has everything and closed
                out.update(cpu=time.process_time() - c0, sys=_system_s() - k0)
            else:
                assert isinstance(await ms.receive(), wire.Hello)
                out["t0"], c0, k0 = time.time(), time.process_time(), _system_s()
                for _ in range(count):
                    msg = await ms.receive()
                    assert isinstance(msg, wire.Piece) and len(msg.data) == size
                out.update(t1=time.time(), bytes=count * size, cpu=time.process_time() - c0, sys=_system_s() - k0)
        await ms.aclose()
        return out


async def _raw_channels(peer, n: int) -> list:
    """In the loop: n more negotiated data channels on `peer`'s connection (ids 2, 4, ...),
    open, each receiving into a shared count."""
    import asyncio
    from patchswarm.node.net.webrtc import LOW_WATER
    chans = [peer._pc.createDataChannel(f"raw{i}", ordered=True, negotiated=True, id=2 + 2 * i) for i in range(n)]
    for ch in chans:
        ch.bufferedAmountLowThreshold = LOW_WATER
        if ch.readyState != "open":
            opened = asyncio.Event()
            ch.once("open", opened.set)
            await asyncio.wait_for(opened.wait(), OPEN_TIMEOUT_S)
    state = {"got": 0, "t0": None, "done": asyncio.get_running_loop().create_future()}

    def arrived(message) -> None:
        if state["t0"] is None:
            state["t0"] = time.time()
        state["got"] += len(message)
        if state["got"] >= state["want"] and not state["done"].done():
            state["done"].set_result(time.time())

    for ch in chans:
        ch.on("message", arrived)
    return [chans, state]


async def _raw_in_loop(ready: list, role: str, size: int, count: int) -> dict:
    """In the loop: the sender deals `count` messages of `size` bytes round-robin over the
    channels (each waiting for bufferedamountlow above HIGH_WATER) and waits for the
    receiver's one-byte answer; the receiver waits for every byte, then answers."""
    import asyncio
    from patchswarm.node.net.webrtc import HIGH_WATER
    chans, state = ready
    if role == "receive":
        state["want"] = count * size
        t1 = await asyncio.wait_for(state["done"], CHILD_TIMEOUT_S * 4)
        chans[0].send(b"!")
        return {"t0": state["t0"], "t1": t1}
    state["want"] = 1
    data = os.urandom(size)
    for i in range(count):
        ch = chans[i % len(chans)]
        if ch.bufferedAmount > HIGH_WATER:
            low = asyncio.Event()
            ch.once("bufferedamountlow", low.set)
            await asyncio.wait_for(low.wait(), CHILD_TIMEOUT_S)
        ch.send(data)
    await asyncio.wait_for(state["done"], CHILD_TIMEOUT_S * 4)
    return {}


@dataclasses.dataclass(frozen=True)
class End:
    """Where one end of a pair runs: a command prefix (a network namespace, or none)
    and its ICE settings (host address, STUN HOST:PORT, TURN URL; empty: none)."""

    prefix: tuple[str, ...] = ()
    ice: tuple[str, ...] = ()


def _rtc_processes(lanes: int, size: int, total: int, fast: bool, send: End = End(), receive: End = End(),
                   tune: str = "", channels: int = 0) -> tuple[float, float, set[str], tuple[float, float], tuple[float, float]]:
    """MB/s of `lanes` peer connections at once, each end in its own process: received
    bytes of all of them over the time from the first start to the last finish; MB
    per CPU second of the busiest end (what one pair moves where each end has a core);
    the candidate pairs ICE chose, as seen by the receivers; and MB per CPU second of
    the busiest sender and of the busiest receiver; the kernel's share (system time) of
    all senders' CPU and of all receivers'. `tune`: "SACK_EVERY,MAX_BURST,BATCH" for
    both ends (`_tune`), "" for the defaults; `channels`: see `_rtc_child`."""
    def argv(role: str, end: End) -> list[str]:
        return ([*end.prefix, sys.executable, __file__, "--rtc-child", role, "--size", str(size),
                 "--mib", str(total >> 20), "--ice", json.dumps(list(end.ice))] + ([] if fast else ["--stock"])
                + (["--tune", tune] if tune else []) + (["--rtc-channels", str(channels)] if channels else []))

    procs: list[subprocess.Popen] = []
    try:
        senders = [subprocess.Popen(argv("send", send), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for _ in range(lanes)]
        procs += senders
        receivers = [subprocess.Popen(argv("receive", receive), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True) for _ in range(lanes)]
        procs += receivers
        for s, r in zip(senders, receivers):
            r.stdin.write(s.stdout.readline())
            r.stdin.flush()
            s.stdin.write(r.stdout.readline())
            s.stdin.flush()
        results = [_last_json(r.communicate(timeout=CHILD_TIMEOUT_S * 5)[0]) for r in receivers]
        sent = [_last_json(s.communicate(timeout=CHILD_TIMEOUT_S)[0]) for s in senders]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"WebRTC child failed: {[p.returncode for p in procs]}")
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    busiest = max(max(r["cpu"], s["cpu"]) / r["bytes"] for r, s in zip(results, sent))
    ends = (min(r["bytes"] / s["cpu"] for r, s in zip(results, sent)) / 1e6,
            min(r["bytes"] / r["cpu"] for r in results) / 1e6)
    kernel = tuple(sum(e["sys"] for e in side) / sum(e["cpu"] for e in side) for side in (sent, results))
    return sum(r["bytes"] for r in results) / 1e6 / wall, 1 / busiest / 1e6, {r["pair"] for r in results}, ends, kernel


# --tuning rows: (what, "SACK_EVERY,MAX_BURST,BATCH"), node/README.md "Throughput" (3).
TUNINGS = (
    ("one read per turn, a SACK per packet", "1,4,1"),
    ("batched reads, a SACK per packet", "1,4,64"),
    ("batched reads, a SACK per <= 2", "2,4,64"),
    ("batched reads, a SACK per <= 4", "4,4,64"),
    ("batched reads, a SACK per <= 8", "8,4,64"),
    ("... and bursts of 12 (the default)", "8,12,64"),
)


def _tune(spec: str) -> None:
    """In a WebRTC child: set sctpfast's SACK_EVERY and MAX_BURST and udpreads' BATCH."""
    from patchswarm.node.net import sctpfast, udpreads
    sctpfast.SACK_EVERY, sctpfast.MAX_BURST, udpreads.BATCH = (int(x) for x in spec.split(","))


def tuning_table(mib: int, repeat: int) -> None:
    """The receive-side tunings of node/net/udpreads.py and sctpfast.py one by one: one
    pair on loopback, each end in its own process, 64 KiB messages, best of `repeat`."""
    best: dict[str, tuple[float, float]] = {}
    for i in range(repeat):
        for what, spec in TUNINGS:
            mbs, per_cpu, *_ = _rtc_processes(1, 64 << 10, mib << 20, fast=True, tune=spec)
            print(f"  run {i}: {what} ({spec}): {mbs:.1f} MB/s, {per_cpu:.1f} MB per CPU s", flush=True)
            old = best.get(what, (0.0, 0.0))
            best[what] = (max(old[0], mbs), max(old[1], per_cpu))
    print(f"\n{'WebRTC, one pair in 2 processes':>40}  SACK_EVERY,MAX_BURST,BATCH    MB/s  MB per CPU s")
    for what, spec in TUNINGS:
        print(f"{what:>40}  {spec:>26}  {best[what][0]:>6.1f}  {best[what][1]:>12.1f}")
    print(f"({mib} MiB one way per row, 64 KiB messages, on loopback, best of {repeat}; MB per CPU s of the busiest end)")


def webrtc_table(creds_root: Path, mib: int, repeat: int, profile: bool, lanes: int) -> None:
    # (name, how): in one process (both ends on one asyncio thread), or each end in its
    # own process, one or `lanes` peer connections at once.
    kinds = ["TCP+TLS", "WebRTC stock", "WebRTC", "WebRTC stock, 2 processes", "WebRTC, 2 processes",
             f"WebRTC, {lanes} pairs in {2 * lanes} processes"]
    best: dict[tuple[str, int], float] = {}
    best_cpu: dict[tuple[str, int], float] = {}
    for i in range(repeat):
        for kib in SIZES_KIB:
            for kind in kinds:
                if "processes" in kind:
                    n = lanes if "pairs" in kind else 1
                    mbs, per_cpu, *_ = _rtc_processes(n, kib << 10, mib << 20, fast="stock" not in kind)
                else:
                    mbs, per_cpu = trio.run(_throughput, kind, creds_root, kib << 10, mib << 20)
                print(f"  run {i}: {kind}, {kib} KiB messages: {mbs:.1f} MB/s, {per_cpu:.1f} MB per CPU s",
                      flush=True)
                best[kind, kib] = max(best.get((kind, kib), 0.0), mbs)
                best_cpu[kind, kib] = max(best_cpu.get((kind, kib), 0.0), per_cpu)
    if repeat:
        print(f"\n{'transport':>28}  " + "  ".join(f"{k:>4} KiB MB/s" for k in SIZES_KIB))
        for kind in kinds:
            print(f"{kind:>28}  " + "  ".join(f"{best[kind, k]:>13.1f}" for k in SIZES_KIB))
        print(f"\n{'MB per CPU second':>28}  " + "  ".join(f"{k:>4} KiB      " for k in SIZES_KIB))
        for kind in kinds:
            print(f"{kind:>28}  " + "  ".join(f"{best_cpu[kind, k]:>13.1f}" for k in SIZES_KIB))
        print("(in one process: the whole process's CPU, both ends; in processes: the busiest end's,"
              " so what one pair moves where each end has a core of its own)")
        print(f"\n({mib} MiB one way per cell and pair, on loopback, best of {repeat}; without '2 processes',"
              " both ends in one process)")
    if profile:
        import cProfile
        import pstats
        import asyncio
        prof = cProfile.Profile()  # enabled in the asyncio thread, from inside its run_forever
        real_run_forever = asyncio.BaseEventLoop.run_forever

        def profiled(self):
            prof.enable()
            try:
                return real_run_forever(self)
            finally:
                prof.disable()
        asyncio.BaseEventLoop.run_forever = profiled
        try:
            trio.run(_throughput, profile, creds_root, 64 << 10, mib << 20)  # (MB/s, MB per CPU s)
        finally:
            asyncio.BaseEventLoop.run_forever = real_run_forever
        print(f"\nWhere the asyncio thread's time goes ({profile}, 64 KiB messages), by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


@contextlib.contextmanager
def _nat_network(symmetric: bool, turnserver: str, workdir: Path):
    """tests/nattopo.py's topology with two private hosts, and coturn on its public network;
    both gone when the block is left, however it is left."""
    topo, coturn = nattopo.NatTopology("psw-bt", 2, symmetric), None
    try:
        coturn = nattopo.start_coturn(turnserver, topo, workdir)
        yield topo, coturn
    finally:
        if coturn is not None:
            coturn.terminate()
            try:
                coturn.wait(timeout=10)
            except subprocess.TimeoutExpired:
                coturn.kill()
                coturn.wait()
        topo.close()


def _cell(table: dict, kind: str, kib: int, fmt: str) -> str:
    """One cell of a printed table: `fmt` of the value (a tuple fills several fields), "-" where none."""
    value = table.get((kind, kib))
    if value is None:
        return f"{'-':>13}"
    return f"{fmt.format(*value) if isinstance(value, tuple) else fmt.format(value):>13}"


def nat_table(creds_root: Path, mib: int, repeat: int, lanes: int, sizes_kib: tuple[int, ...], channels: int = 2) -> None:
    """The pair through tests/nattopo.py's NAT topology against the same pair on loopback;
    each end in its own process. See the module's docstring."""
    why = nattopo.skip_reason()
    turnserver = shutil.which("turnserver")
    if why or not turnserver:
        raise SystemExit(f"--nat: {why or 'coturn is not installed (apt-get install coturn)'}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks remove the namespaces
    stun, turn = f"{nattopo.PUBLIC}:{nattopo.TURN_PORT}", f"turn:{nattopo.PUBLIC}:{nattopo.TURN_PORT}"
    lanes_row = f"WebRTC direct, {lanes} pairs" if lanes > 1 else None
    # Raw channel sends (no MessageStream), on 1 and on `channels` data channels of one connection.
    raw_rows = ["direct, raw sends, 1 channel", f"direct, raw sends, {channels} channels"] if channels > 1 else []
    kinds = [k for k in ("TCP+TLS, loopback", "TCP+TLS, NATed to public", "WebRTC, loopback",
                         "WebRTC direct, NAT to NAT", lanes_row, *raw_rows, "WebRTC relayed, symmetric NATs") if k]
    best: dict[tuple[str, int], float] = {}
    best_cpu: dict[tuple[str, int], float] = {}
    relay_cpu: dict[int, float] = {}
    pairs: dict[str, set[str]] = {k: set() for k in kinds}

    ends: dict[tuple[str, int], tuple[float, float]] = {}  # (sender, receiver) MB per CPU s
    kernel: dict[tuple[str, int], tuple[float, float]] = {}  # (sender, receiver) system time / CPU time

    def record(kind: str, kib: int, mbs: float, per_cpu: float, send_recv: tuple[float, float],
               sys_share: tuple[float, float]) -> None:
        print(f"  {kind}, {kib} KiB messages: {mbs:.1f} MB/s, {per_cpu:.1f} MB per CPU s (sender "
              f"{send_recv[0]:.1f}, {sys_share[0]:.0%} in the kernel; receiver {send_recv[1]:.1f}, "
              f"{sys_share[1]:.0%})", flush=True)
        best[kind, kib] = max(best.get((kind, kib), 0.0), mbs)
        if per_cpu > best_cpu.get((kind, kib), 0.0):  # the ends' figures of the same run
            best_cpu[kind, kib], ends[kind, kib], kernel[kind, kib] = per_cpu, send_recv, sys_share

    def tcp(kind: str, kib: int, **where) -> None:
        send, recv = _tcp_processes("TLSSocketStream", creds_root, kib << 10, mib << 20, **where)
        mb = recv["bytes"] / 1e6
        record(kind, kib, mb / recv["wall_s"], mb / max(send["cpu_s"], recv["cpu_s"]),
               (mb / send["cpu_s"], mb / recv["cpu_s"]), (send["sys_s"] / send["cpu_s"], recv["sys_s"] / recv["cpu_s"]))

    def rtc(kind: str, kib: int, n: int, send: End = End(), receive: End = End(), relayed: bool = False,
            raw_channels: int = 0) -> None:
        mbs, per_cpu, chosen, send_recv, sys_share = _rtc_processes(n, kib << 10, mib << 20, True, send, receive,
                                                                    channels=raw_channels)
        pairs[kind] |= chosen
        if any(("relay" in p) != relayed for p in chosen):
            raise SystemExit(f"{kind}: ICE chose {chosen}, expected {'a relayed' if relayed else 'a direct'} path")
        record(kind, kib, mbs, per_cpu, send_recv, sys_share)

    with tempfile.TemporaryDirectory(prefix="psw-transport-nat-") as tmp:
        for i in range(repeat):
            for symmetric in (False, True):
                with _nat_network(symmetric, turnserver, Path(tmp)) as (topo, coturn):
                    # Direct rows: STUN only. With a relay candidate too, aioice's aggressive nomination
                    # takes whichever pair answers first, and under load that was once the relay.
                    a, b = (End(tuple(topo.exec(ns)), (addr, stun) + ((turn,) if symmetric else ()))
                            for ns, addr in zip(topo.hosts, topo.host_addrs))
                    for kib in sizes_kib:
                        print(f"run {i}, {kib} KiB messages, {'symmetric' if symmetric else 'port-preserving'} NATs:",
                              flush=True)
                        if symmetric:
                            c0 = procstat.process_cpu_seconds(coturn.pid)
                            rtc(kinds[-1], kib, 1, a, b, relayed=True)
                            moved = max(1, (mib << 20) // (kib << 10)) * (kib << 10)
                            relay_cpu[kib] = max(relay_cpu.get(kib, 0.0), moved / 1e6 / max(procstat.process_cpu_seconds(coturn.pid) - c0, 1e-3))
                            continue
                        tcp(kinds[0], kib)
                        tcp(kinds[1], kib, host=nattopo.PUBLIC, send_ns=tuple(topo.exec(topo.pub)), receive_ns=a.prefix)
                        rtc(kinds[2], kib, 1)
                        rtc(kinds[3], kib, 1, a, b)
                        if lanes_row:
                            rtc(lanes_row, kib, lanes, a, b)
                        if raw_rows and kib <= 64:  # a channel message is at most 64 KiB (RFC 8841)
                            rtc(raw_rows[0], kib, 1, a, b, raw_channels=1)
                            rtc(raw_rows[1], kib, 1, a, b, raw_channels=channels)
    header = "  ".join(f"{k:>4} KiB     " for k in sizes_kib)

    def table(title: str, cells: dict, fmt: str) -> None:
        print(f"\n{title:>32}  {header}")
        for kind in kinds:
            print(f"{kind:>32}  " + "  ".join(_cell(cells, kind, k, fmt) for k in sizes_kib))

    table("MB/s received", best, "{:.1f}")
    table("MB per CPU s of the busiest end", best_cpu, "{:.1f}")
    print(f"{'coturn, relayed row':>32}  " + "  ".join(f"{relay_cpu[k]:>13.1f}" for k in sizes_kib))
    table("MB per CPU s, sender / receiver", ends, "{:.0f} / {:.0f}")
    table("in the kernel, sender / receiver", kernel, "{:2.0%} / {:2.0%}")
    print("(system time over CPU time of each end: the kernel's share, where the network path's work is counted;"
          " sampled per clock tick, so meaningless for ends that used well under a second, as TCP's do)")
    print("\ncandidate pairs ICE chose (local-remote, at the receiver): "
          + "; ".join(f"{k}: {', '.join(sorted(p))}" for k, p in pairs.items() if p))
    print(f"({mib} MiB one way per cell and pair, each end in its own process, best of {repeat}; NATed ends in"
          " network namespaces behind nftables masquerade, TCP+TLS receiver dialing out to a public sender)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB moved per run")
    ap.add_argument("--piece-kib", type=int, default=PIECE >> 10,
                    help="TCP+TLS rows: each Piece's bytes, in KiB (a node sends chunk parts of 64)")
    ap.add_argument("--pace-mbit", type=float, default=0,
                    help="the sender writes 8 KiB at a time at this rate, as over a WAN link (0: as fast as it can)")
    ap.add_argument("--streams", default=",".join(STREAMS),
                    help=f"TCP+TLS rows: which stream classes, of {', '.join(STREAMS)}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per stream class (best kept)")
    ap.add_argument("--webrtc", action="store_true", help="WebRTC data channels against TCP+TLS, 16-256 KiB messages")
    ap.add_argument("--profile", choices=("WebRTC", "WebRTC stock"), help="with --webrtc: where that variant's CPU goes")
    ap.add_argument("--lanes", type=int, default=2, help="with --webrtc or --nat: peer connections at once in a row")
    ap.add_argument("--nat", action="store_true",
                    help="the pair through a NAT topology (root: namespaces, nftables, coturn) against loopback")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_KIB)), help="with --nat: message sizes in KiB")
    ap.add_argument("--tuning", action="store_true",
                    help="WebRTC: batched reads and fewer SACKs one by one (node/net/udpreads.py, sctpfast.py)")
    ap.add_argument("--tune", help=argparse.SUPPRESS)
    ap.add_argument("--channels", type=int, default=2,
                    help="with --nat: data channels on one peer connection in the raw-send row")
    ap.add_argument("--rtc-channels", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rtc-child", choices=("send", "receive"), help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=PIECE, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--ice", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=STREAMS, help=argparse.SUPPRESS)
    ap.add_argument("--creds", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mib < 1 or args.repeat < (0 if args.profile else 1):
        ap.error("--mib and --repeat: expected at least 1 (--repeat 0 with --profile: the profile alone)")
    streams = [k.strip() for k in args.streams.split(",") if k.strip()]
    if not streams or any(k not in STREAMS for k in streams):
        ap.error(f"--streams: expected some of {', '.join(STREAMS)}, found {args.streams!r}")
    if not 1 <= args.piece_kib <= (wire.MAX_FRAME_BYTES >> 10) - 1 or args.piece_kib << 10 > args.mib << 20:
        ap.error(f"--piece-kib: expected 1 to {(wire.MAX_FRAME_BYTES >> 10) - 1} KiB and at most --mib, "
                 f"found {args.piece_kib}")
    if args.rtc_child:
        if args.tune:
            _tune(args.tune)
        print(json.dumps(trio.run(_rtc_child, args.rtc_child, args.size, args.mib << 20, not args.stock,
                                  json.loads(args.ice), args.rtc_channels)), flush=True)
        return 0
    if args.child:
        print(json.dumps(trio.run(_child, args.child, args.kind, Path(args.creds), args.host, args.port, args.size,
                                  args.mib << 20, args.pace_mbit)), flush=True)
        return 0
    if args.tuning:
        tuning_table(args.mib, args.repeat)
        return 0
    with tempfile.TemporaryDirectory(prefix="psw-transport-") as tmp:
        root = Path(tmp)
        trust.init_swarm(root / "swarm")
        for name, role in (("origin1", "origin"), ("node1", "node")):
            trust.issue(root / "swarm", name, role, root / name)
        if args.webrtc:
            webrtc_table(root, args.mib, args.repeat, args.profile, args.lanes)
            return 0
        if args.nat:
            nat_table(root, args.mib, args.repeat, args.lanes, tuple(int(k) for k in args.sizes.split(",")),
                      args.channels)
            return 0
        best: dict[str, dict] = {}
        for i in range(args.repeat):
            for kind in streams:
                r = _run_pair(kind, root, args.mib, args.piece_kib << 10, args.pace_mbit)
                print(f"  run {i}: {kind}: send {r['send_ms_per_mib']:.2f} ms/MiB, receive "
                      f"{r['receive_ms_per_mib']:.2f} ms/MiB ({r['receive_wakeups_per_mib']:.0f} wake-ups/MiB), "
                      f"{r['mb_per_s']:.0f} MB/s", flush=True)
                cost = r["send_ms_per_mib"] + r["receive_ms_per_mib"]
                if kind not in best or cost < best[kind]["send_ms_per_mib"] + best[kind]["receive_ms_per_mib"]:
                    best[kind] = r
    print(f"\n{'stream':>16}  {'send CPU ms/MiB':>15}  {'receive CPU ms/MiB':>18}  "
          f"{'receive wake-ups/MiB':>20}  {'MB/s':>6}")
    for kind in streams:
        r = best[kind]
        print(f"{kind:>16}  {r['send_ms_per_mib']:>15.2f}  {r['receive_ms_per_mib']:>18.2f}  "
              f"{r['receive_wakeups_per_mib']:>20.0f}  {r['mb_per_s']:>6.0f}")
    what = f"{args.mib} MiB in Pieces of {args.piece_kib} KiB through MessageStream on loopback, best of {args.repeat}"
    if args.pace_mbit:
        what += f", sent in {PACE_SLICE >> 10} KiB writes at {args.pace_mbit:g} Mbit/s"
    if len(streams) == len(STREAMS):
        a, b = best[STREAMS[0]], best[STREAMS[1]]
        print(f"\nTLSSocketStream / trio.SSLStream CPU: send {b['send_ms_per_mib'] / a['send_ms_per_mib']:.2f}, "
              f"receive {b['receive_ms_per_mib'] / a['receive_ms_per_mib']:.2f} ({what})")
    else:
        print(f"\n({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
