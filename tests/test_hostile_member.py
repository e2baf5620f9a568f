"""A member with a valid node certificate sends every class of bad message while two honest nodes
keep receiving versions (issue 21): real processes on loopback (tests/swarmlab.py). And one that
announces every chunk and serves none, beside a node in the origin's region (snubbed).

The attacker ("mallory") runs in this process and cycles, one connection at a time, through:
an all-ones Have bitfield of the largest size the wire allows for a version the victim holds;
64 such Haves of versions nobody published; a 16 MiB frame of nested msgpack arrays; 100k
Requests for chunks nobody holds; a 16 MiB frame half sent and held; 2**17 + 1000 HaveOnes in a
burst. Beside it, rounds of 200 TCP connections from another loopback address that never finish
TLS try to hold the victim's slots before Hello (at most 16 per host are let in).

Checked: both honest nodes reach every version bit-exactly; the victim stays up and drops
mallory for each class (status "peers_dropped"); the victim's RSS grows by less than RSS_BUDGET
over its RSS before the attack (which holds the state). Time to each version with and
without the attacker is printed (speed is for reading, not asserted).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import torch
import trio

from patchswarm.node.net import trust
from patchswarm.node.store import MANIFEST_NAME
from patchswarm.node.net.transport import connect, parse_addr
from patchswarm.protocol import wire
from patchswarm.protocol.manifest import decode_manifest
from patchswarm.protocol.picker import SNUB_AFTER
from swarmlab import SwarmLab, load_weights, same_bits, write_checkpoint
from synthetic import rl_checkpoints, served

pytestmark = pytest.mark.slow  # real processes

ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536"]
RSS_BUDGET = 256 << 20  # the victim's growth over its footprint before the attack (state included)
HELLO = wire.Hello("mallory", "r1", "node", "127.0.0.1:1", [])
CROWD_HOST = "127.0.0.2"  # the unauthenticated connections' source: another host than the members'


@pytest.fixture(scope="module")
def checkpoints():
    return rl_checkpoints("small", 1e-5, 6)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def _drain(ms, seconds: float) -> str:
    """Read until the victim hangs up (or `seconds` pass): how the connection ended."""
    try:
        with trio.move_on_after(seconds):
            while await ms.receive() is not None:
                pass
            return "closed by the victim"
        return "still open"
    except (wire.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return "closed by the victim"


def _frames(msg, n: int) -> bytes:
    return wire.encode(msg) * n


async def attack(creds, addr: str, kind: str, version: int) -> str:
    """One attack of `kind` on one connection; how it ended."""
    try:
        ms = await connect(addr, creds, {"node"}, HELLO, expect_name="a")
    except (OSError, trio.BrokenResourceError, trio.TooSlowError, wire.ProtocolError) as e:
        return f"not connected ({type(e).__name__})"
    ones = b"\xff" * wire.MAX_BITFIELD_BYTES
    try:
        if kind == "huge bitfield":
            await ms.send(wire.Have(version, False, ones))
        elif kind == "unknown-version Haves":
            for v in range(1_000_000, 1_000_064):
                await ms.send(wire.Have(v, False, ones))
            await ms.send(wire.Bye("done"))
        elif kind == "nested msgpack":
            n = (16 << 20) - 5
            await ms.stream.send_all((n + 5).to_bytes(4, "big") + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
        elif kind == "request flood":
            raw = b"".join(wire.encode(wire.Request(version, False, c)) for c in range(100_000))
            await ms.stream.send_all(raw)
        elif kind == "half-sent frame":
            await ms.stream.send_all((16 << 20).to_bytes(4, "big") + b"\x00" * (8 << 20))
            await trio.sleep(3)  # held, then let go
        elif kind == "announcement flood":
            await ms.stream.send_all(_frames(wire.HaveOne(version, False, 0), (1 << 17) + 1000))
        return await _drain(ms, 15)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return "closed by the victim"
    finally:  # cancelled with the scenario too: the victim sees it go
        with trio.CancelScope(shield=True):
            await ms.aclose()


ATTACKS = ("huge bitfield", "unknown-version Haves", "nested msgpack", "request flood", "half-sent frame",
           "announcement flood")


async def unauthenticated(addr: str, count: int, hold: float) -> int:
    """`count` TCP connections that send half a TLS record and hold; how many the victim closed at once."""
    host, port = parse_addr(addr)
    streams, closed = [], 0
    for _ in range(count):
        s = await trio.open_tcp_stream(host, port, local_address=CROWD_HOST)
        await s.send_all(b"\x16\x03\x01\x40\x00" + b"\x01" * 100)  # a 16 KiB handshake record, 100 B of it
        streams.append(s)
    await trio.sleep(0.5)
    for s in streams:
        with trio.move_on_after(0.01):
            try:
                if await s.receive_some() == b"":
                    closed += 1
            except (trio.BrokenResourceError, OSError):
                closed += 1
    await trio.sleep(hold)
    for s in streams:
        await s.aclose()
    return closed


def test_a_hostile_member_cannot_stop_honest_nodes_or_grow_the_victim(tmp_path, checkpoints):
    watch = tmp_path / "watch"
    states = [served(s, torch.bfloat16) for s in checkpoints]
    times: dict[int, float] = {}
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        a, b = lab.start_nodes([("a", "r1"), ("b", "r1")], starting=[origin])
        write_checkpoint(watch, "step0000.safetensors", checkpoints[0])
        lab.wait_version([a, b], 0)

        def publish_and_wait(v: int) -> None:
            start = time.monotonic()
            write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
            lab.wait_version([a, b], v, timeout=180)
            times[v] = time.monotonic() - start
            for p in (a, b):
                assert same_bits(load_weights(p), states[v]), f"{p.name} at version {v} is not bit-exact"

        for v in (1, 2):  # without the attacker
            publish_and_wait(v)
        creds = trust.Credentials.load(lab.creds("mallory", "node"))
        rss_before = _rss(a.popen.pid)
        peak = {"rss": rss_before}
        endings: dict[str, list[str]] = {k: [] for k in ATTACKS}
        refused_at_once = []

        async def scenario():
            async with trio.open_nursery() as n:
                async def sample():
                    while True:
                        peak["rss"] = max(peak["rss"], _rss(a.popen.pid))
                        await trio.sleep(0.05)

                async def mallory():
                    while True:
                        for kind in ATTACKS:
                            version = a.status()["version"]
                            endings[kind].append(await attack(creds, a.addr, kind, version))

                async def crowd():
                    while True:
                        refused_at_once.append(await unauthenticated(a.addr, 200, hold=2.0))

                n.start_soon(sample)
                n.start_soon(mallory)
                n.start_soon(crowd)
                for v in (3, 4, 5):  # with the attacker
                    await trio.to_thread.run_sync(publish_and_wait, v)
                while not all(endings.values()):  # every class tried at least once
                    await trio.sleep(0.5)
                n.cancel_scope.cancel()

        trio.run(scenario)
        assert a.alive() and b.alive()
        st = a.status()
        dropped = st["peers_dropped"]
        grew = peak["rss"] - rss_before
        print(f"\ntime to version (both nodes, s): without attacker {[round(times[v], 2) for v in (1, 2)]}, "
              f"with {[round(times[v], 2) for v in (3, 4, 5)]}")
        print(f"victim RSS before the attack {rss_before >> 20} MiB, peak during it {peak['rss'] >> 20} MiB "
              f"(+{grew >> 20} MiB; budget +{RSS_BUDGET >> 20} MiB)")
        print(f"victim's drops by kind: {dropped}; unauthenticated connections closed at once per round "
              f"of 200: {refused_at_once}")
        for kind, ends in endings.items():
            print(f"  {kind}: {ends}")
        assert grew < RSS_BUDGET
        assert st["version"] == 5 and b.status()["version"] == 5
        for kind in ("huge bitfield", "nested msgpack", "announcement flood"):
            assert endings[kind][0] == "closed by the victim", (kind, endings[kind])
        assert endings["unknown-version Haves"][0] == "closed by the victim"  # after its Bye
        assert dropped.get("protocol error", 0) >= 2  # the bitfield and the nested arrays
        assert dropped.get("announcements per minute", 0) >= 1
        assert dropped.get("connections before Hello", 0) >= 150 and refused_at_once[0] >= 150
        for _ in range(100):  # its last connection, cancelled with the scenario, is being closed
            if "mallory" not in {p["id"] for p in a.status()["peers"]}:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the victim still holds a session with mallory")
        assert "Traceback" not in a.text()


DRIP_S = 4.9  # a drip member's parts, just under SNUB_AFTER apart
BUSY_S = 2.1  # a busy member's parts (an eighth of a chunk each): SNUB_AFTER's busy honest member


def _stored_chunk_sizes(objects: Path, version: int) -> list[int] | None:
    """The chunk sizes of a version's patch manifest a node stored (None: not there yet)."""
    for path in objects.glob(f"*/{MANIFEST_NAME}"):
        try:
            body, _sig = msgpack.unpackb(path.read_bytes())
        except (OSError, ValueError):
            continue
        m = decode_manifest(body)
        if m.version == version and m.base_version is not None:
            return [size for size, _ in m.chunks]
    return None


@pytest.mark.parametrize("mode", ["silent", "drip", "busy"])
def test_a_member_that_announces_every_chunk_and_serves_none_holds_a_node_up_only_snub_after(tmp_path, checkpoints,
                                                                                             mode):
    """The hostile-peer hunt's member (protocol/README.md, "The longest a node sits"): mallory,
    with a valid node certificate, says it is in the origin's region beside node a and announces
    every chunk of the next version before a has its manifest (an all-ones Have, kept until the
    manifest comes), then answers nothing ("silent"), or a byte of each answer every 4.9 s, just
    under SNUB_AFTER ("drip": never silent), or an eighth of each answer every 2.1 s ("busy": a
    chunk in 17 s at that rate, under SLOW_CHUNK_S; never the last part). a asks it first (a
    neighbour before the origin): each request held until the 30 s timeout, 4 at a time. Now a
    snubs it SNUB_AFTER after it was asked (all of its requests cancelled at once; the drip
    member as slow: a chunk of 32 KiB would take it hours at a byte per 4.9 s; the busy one,
    whose chunk would take 17 s, beside an origin whose answers come in well under a second:
    SLOW_CHUNK_MIN_S), takes the version from the origin, and it is asked at most one chunk at a
    time after that. Before SLOW_CHUNK_MIN_S the busy member held a until its last part did not
    come (~15 s), then for SNUB_AFTER more."""
    watch = tmp_path / "watch"
    heard: list[tuple[float, object]] = []  # what mallory got from a, and when (trio's clock)
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS)
        a = lab.start_node("a", region="r0")
        write_checkpoint(watch, "step0000.safetensors", checkpoints[0])
        lab.wait_version([a], 0)
        creds = trust.Credentials.load(lab.creds("mallory", "node"))
        done: dict[str, float] = {}
        drips: list[float] = []  # when mallory sent a part
        every = BUSY_S if mode == "busy" else DRIP_S

        async def drip(ms):
            """A part of each request of version 1 every `every` s from when it came, in order, until it
            is cancelled, never its last byte: a byte ("drip") or an eighth of the chunk ("busy") (the
            chunk sizes from the manifest a stored: a node's peers need not be sent it)."""
            sizes, due = None, {}  # chunk -> [bytes sent of it, when its next byte goes]
            seen = 0
            while True:
                await trio.sleep(0.05)
                if sizes is None:
                    sizes = _stored_chunk_sizes(a.data_dir / "objects", 1)
                for t, msg in heard[seen:]:
                    if isinstance(msg, wire.Request) and msg.version == 1:
                        due.setdefault(msg.chunk, [0, t + every])
                    elif isinstance(msg, wire.Cancel) and msg.version == 1:
                        due.pop(msg.chunk, None)
                seen = len(heard)
                now = trio.current_time()
                for c, entry in sorted(due.items()) if sizes is not None else ():
                    if entry[1] <= now and entry[0] < sizes[c] - 1:  # never the last byte
                        part = 1 if mode == "drip" else min(max(1, sizes[c] // 8), sizes[c] - 1 - entry[0])
                        await ms.send(wire.Piece(1, False, c, entry[0], sizes[c], b"\0" * part))
                        entry[0] += part
                        entry[1] += every
                        drips.append(trio.current_time())

        async def scenario():
            hello = wire.Hello("mallory", "r0", "node", "127.0.0.1:1", [])
            ms = await connect(a.addr, creds, {"node"}, hello, expect_name="a")
            try:
                async with trio.open_nursery() as n:
                    async def listen():
                        while (msg := await ms.receive()) is not None:
                            heard.append((trio.current_time(), msg))

                    n.start_soon(listen)
                    if mode != "silent":
                        n.start_soon(drip, ms)
                    await ms.send(wire.Have(1, False, b"\xff" * 64))  # every chunk of version 1 (up to 512)
                    await trio.sleep(0.5)  # taken in
                    write_checkpoint(watch, "step0001.safetensors", checkpoints[1])
                    await trio.to_thread.run_sync(lambda: lab.wait_version([a], 1, timeout=SNUB_AFTER + 20))
                    done["at"] = trio.current_time()
                    done["status"] = await trio.to_thread.run_sync(a.status)  # mallory still connected
                    n.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await ms.aclose()

        trio.run(scenario)
        asked = [(t, m) for t, m in heard if isinstance(m, wire.Request) and m.version == 1]
        cancels = [t for t, m in heard if isinstance(m, wire.Cancel) and m.version == 1]
        assert asked, "a never asked mallory: the scenario did not happen"
        first = asked[0][0]
        print(f"\nmallory asked {len(asked)} times, first cancel {cancels[0] - first:.2f} s after the first request; "
              f"a held version 1 {done['at'] - first:.2f} s after it")
        # Upper bounds with room for a loaded machine, and still far below what they tell apart:
        # without snubs a request is given up only at REQUEST_TIMEOUT (30 s).
        assert SNUB_AFTER - 0.5 <= cancels[0] - first <= SNUB_AFTER + 10.0
        assert done["at"] - first <= SNUB_AFTER + 15.0  # 480 s for 64 chunks before snubs (the simulation)
        if mode == "busy":  # ~20 s before SLOW_CHUNK_MIN_S: its parts until the last, then silence
            assert done["at"] - first <= SNUB_AFTER + 6.0
        st = done["status"]
        [m] = [p for p in st["peers"] if p["id"] == "mallory"]
        assert m["snubbed"] is True
        if mode != "silent":
            print(f"mallory sent {mode} parts: {len(drips)}, the first {drips[0] - first:.2f} s after the first "
                  f"request; a's status: {m['snub_reason']}, peers_snubbed_slow {st['peers_snubbed_slow']}")
            assert m["snub_reason"] == "slow" and st["peers_snubbed_slow"] == 1 and st["peers_snubbed"] == 0
        else:
            assert m["snub_reason"] == "silent" and st["peers_snubbed"] == 1
        assert "Traceback" not in a.text()
