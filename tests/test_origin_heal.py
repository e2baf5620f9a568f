"""A chunk damaged on the origin's own disk: taken back from a node that holds it, or, where no
node does, routed around with a keyframe-only version. Real node processes on loopback
(tests/swarmlab.py) with the origin in this process (its status read in place).

Before, the origin found the damage when it read the chunk (store.py's `_read_checked`), removed
it and answered every request for it with a Reject, for good: a node that joined after the last
holder left stalled at the version before it, and a restart dropped the version (and every one
after it) from the origin's store, so its next publish reused version numbers nodes had taken.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import trio

from patchswarm.node.net import trust
from patchswarm.node.net.transport import connect
from patchswarm.node.trainer.origin import SyncOrigin, served_copy
from patchswarm.protocol import wire
from swarmlab import SwarmLab, load_weights, same_bits, wait_until
from synthetic import rl_checkpoints

pytestmark = pytest.mark.slow  # real processes

SMALL = dict(chunk_bytes=32768, segment_elements=65536)  # a patch of several chunks


def _origin(lab: SwarmLab, **kw) -> SyncOrigin:
    # served_kept_bytes=0: every request reads the chunk's file, as on an origin whose recent
    # chunks have moved out of its 32 MiB of kept bytes (the damage is found on that read).
    return SyncOrigin(tracker=lab.tracker_addr, creds=lab.creds("origin", "origin"), key=lab.swarm / "trainer.key",
                      data_dir=lab.root / "origin", listen="127.0.0.1:0", region="r0", served_kept_bytes=0,
                      **SMALL, **kw)


@contextlib.contextmanager
def _published(tmp_path, ckpts):
    """A tracker and the origin with `ckpts` published (versions 0 and 1), no node."""
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        with _origin(lab) as origin:
            for s in ckpts:
                origin.publish(s)
            yield lab, origin


@contextlib.contextmanager
def _swarm_at_1(tmp_path, ckpts):
    """A tracker, the origin with `ckpts` published (versions 0 and 1) and node a at version 1."""
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        with _origin(lab) as origin:
            a = lab.start_node("a", region="r1")
            for s in ckpts:
                origin.publish(s)
            lab.wait_version([a], 1)
            yield lab, origin, a


def _damage(data_dir: Path, version: int, chunk: int = 0, kind: str = "patch") -> Path:
    """Flip one bit in the middle of a stored chunk file of `version`'s patch (or keyframe), in place."""
    f = data_dir / "objects" / f"v{version:010d}-{kind}" / f"{chunk:06d}.chunk"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    return f


async def _ask(creds, addr: str, key: tuple[int, bool], chunk: int) -> str:
    """Ask the origin at `addr` for one chunk as a node would: the first answer's kind."""
    ms = await connect(addr, creds, {"origin"}, wire.Hello("probe", "r1", "node", "", []), expect_name="origin")
    try:
        await ms.send(wire.Request(key[0], key[1], chunk))
        with trio.fail_after(30):
            while True:
                msg = await ms.receive()
                assert msg is not None, "the origin closed the session"
                if isinstance(msg, (wire.Piece, wire.Reject)) and msg.chunk == chunk:
                    return type(msg).__name__
    finally:
        await ms.aclose()


async def _lie(creds, addr: str, key: tuple[int, bool], chunk: int, size: int) -> list[str]:
    """As a node, ask the origin for a chunk (so that it finds the damage) and answer its request
    for that chunk with bytes of the right size that are not the chunk: what the origin sent."""
    ms = await connect(addr, creds, {"origin"}, wire.Hello("liar", "r1", "node", "", []), expect_name="origin")
    seen: list[str] = []
    try:
        await ms.send(wire.Request(key[0], key[1], chunk))
        with trio.fail_after(30):
            while True:
                try:
                    msg = await ms.receive()
                except trio.BrokenResourceError:
                    msg = None
                if msg is None:
                    return seen + ["closed"]
                seen.append(type(msg).__name__)
                if isinstance(msg, wire.Request) and (msg.version, msg.keyframe, msg.chunk) == (*key, chunk):
                    await ms.send(wire.Piece(key[0], key[1], chunk, 0, size, bytes(size)))
    finally:
        await ms.aclose()


def test_a_chunk_damaged_on_the_origins_disk_is_taken_back_from_a_node_and_a_late_joiner_gets_it(tmp_path):
    ckpts = rl_checkpoints("small", 1e-5, 1)
    with _swarm_at_1(tmp_path, ckpts) as (lab, origin, a):
        _damage(origin.origin.data_dir, 1)
        probe = trust.Credentials.load(lab.creds("probe", "node"))
        # The read that finds the damage: refused (never sent), then taken back from a.
        t0 = time.monotonic()
        assert trio.run(_ask, probe, origin.listen_addr, (1, False), 0) == "Reject"
        st = wait_until(lambda: (s := origin.stats())["chunks_recovered"] and s, "chunk recovered", poll=0.1)
        print(f"damage found -> chunk taken back from a: {time.monotonic() - t0:.2f} s")  # for reading
        assert st["chunks_damaged"] == 1 and st["chunks_recovered"] == 1 and st["chunks_lost"] == 0
        assert trio.run(_ask, probe, origin.listen_addr, (1, False), 0) == "Piece"
        lab.kill(a)  # the only other holder gone: b can have it from the origin alone
        b = lab.start_node("b", region="r1")
        lab.wait_version([b], 1, timeout=60)
        assert same_bits(load_weights(b), served_copy(ckpts[1]))
        assert origin.stats()["version"] == 1  # nothing published in its place


def test_a_node_answering_with_other_bytes_is_dropped_and_nothing_is_stored(tmp_path):
    with _published(tmp_path, rl_checkpoints("small", 1e-5, 1)) as (lab, origin):
        f = _damage(origin.origin.data_dir, 1)
        liar = trust.Credentials.load(lab.creds("liar", "node"))
        seen = trio.run(_lie, liar, origin.listen_addr, (1, False), 0, f.stat().st_size)
        assert "Request" in seen and seen[-1] == "closed"  # asked, then dropped for its answer
        st = origin.stats()
        assert st["peers_dropped"].get("misbehaved") == 1 and st["chunks_recovered"] == 0
        assert not f.exists()  # the damaged file removed, the lie never stored


async def _far_nodes(creds: list, addr: str, key: tuple[int, bool], chunk: int, true_chunk: bytes,
                     answer, seen: list, until) -> None:
    """Nodes far from the origin, connected to it at once: the first sends a Request for the
    chunk (so that the origin reads it and finds the damage); each answers the origin's Request
    for it, 0.6 s later (a round trip away), with a Reject or the true chunk as `answer(n)`
    says of the n-th request any of them got (-1: the chunk after 3 s, unless cancelled first).
    `seen` gets (time, name, what) for each Request, Cancel and answer; ends when `until()`."""
    connected = trio.Event()
    count = [0]

    async def node(c, first: bool) -> None:
        ms = await connect(addr, c, {"origin"}, wire.Hello(c.name, "r1", "node", "", []), expect_name="origin")
        count[0] += 1
        if count[0] == len(creds):
            connected.set()
        pending: dict = {}
        try:
            async with trio.open_nursery() as n:
                async def reply(token, kind: str, delay: float) -> None:
                    await trio.sleep(delay)
                    if pending.pop(token, None) is None:
                        return  # cancelled meanwhile
                    seen.append((trio.current_time(), c.name, kind))
                    if kind == "Reject":
                        await ms.send(wire.Reject(key[0], key[1], chunk, "not held here"))
                    else:
                        await ms.send(wire.Piece(key[0], key[1], chunk, 0, len(true_chunk), true_chunk))

                if first:
                    await connected.wait()
                    await ms.send(wire.Request(key[0], key[1], chunk))
                while True:
                    msg = await ms.receive()
                    if msg is None:
                        return
                    if isinstance(msg, (wire.Request, wire.Cancel)) and (msg.version, msg.keyframe, msg.chunk) \
                            == (*key, chunk):
                        seen.append((trio.current_time(), c.name, type(msg).__name__))
                        if isinstance(msg, wire.Cancel):
                            pending.clear()
                            continue
                        count_asked = sum(1 for _, _, w in seen if w == "Request")
                        how = answer(count_asked)
                        token = object()
                        pending[token] = True
                        n.start_soon(reply, token, "Reject" if how == 0 else "Piece", 0.6 if how >= 0 else 3.0)
        finally:
            await ms.aclose()

    async with trio.open_nursery() as n:
        for i, c in enumerate(creds):
            n.start_soon(node, c, i == 0)
        with trio.fail_after(60):
            while not await trio.to_thread.run_sync(until):  # origin.stats() blocks: off this loop
                await trio.sleep(0.05)
        n.cancel_scope.cancel()


def _waves(times: list[float], gap: float) -> list[int]:
    """Sizes of the groups of `times` (sorted) that lie within `gap` of the one before."""
    sizes: list[int] = []
    for i, t in enumerate(times):
        if i and t - times[i - 1] < gap:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def test_the_origin_asks_for_a_lost_chunk_in_waves_and_cancels_the_rest_once_one_node_sends_it(tmp_path):
    """Twelve far nodes, none holding the damaged chunk in the first round: the origin asks one,
    then two, four and the last five at once (a round trip a wave, not one a node). In the
    second round the first three asked decline and the next four hold it: the first to send it
    whole is taken, the other three get a Cancel, and nothing more is asked."""
    with _published(tmp_path, rl_checkpoints("small", 1e-5, 1)) as (lab, origin):
        f = origin.origin.data_dir / "objects" / f"v{1:010d}-patch" / f"{0:06d}.chunk"
        true_chunk = f.read_bytes()
        _damage(origin.origin.data_dir, 1)
        creds = [trust.Credentials.load(lab.creds(f"far{i}", "node")) for i in range(12)]
        seen: list = []

        def answer(n: int) -> int:  # 0: Reject; 1: the chunk; -1: the chunk, slowly
            return 0 if n <= 12 + 3 else 1 if n == 12 + 4 else -1

        def done() -> bool:  # taken back, and the rest of its wave told so
            return origin.stats()["chunks_recovered"] == 1 and sum(w == "Cancel" for _, _, w in seen) >= 3

        trio.run(_far_nodes, creds, origin.listen_addr, (1, False), 0, true_chunk, answer, seen, done)
        st = origin.stats()
        probe = trust.Credentials.load(lab.creds("probe", "node"))
        assert trio.run(_ask, probe, origin.listen_addr, (1, False), 0) == "Piece"
    asked = sorted(t for t, _, what in seen if what == "Request")
    assert len(asked) == 12 + 7, seen  # round 1: all twelve; round 2: 1 + 2 + 4
    first, second = asked[:12], asked[12:]
    assert _waves(first, 0.3) == [1, 2, 4, 5], seen
    assert _waves(second, 0.3) == [1, 2, 4], seen
    last_wave = {name for t, name, what in seen if what == "Request" and t >= second[3] - 0.01}
    sent = [name for _, name, what in seen if what == "Piece"]
    cancelled = {name for _, name, what in seen if what == "Cancel"}
    assert len(sent) == 1 and cancelled == last_wave - set(sent), seen
    assert st["chunks_damaged"] == 1 and st["chunks_recovered"] == 1 and st["chunks_lost"] == 0


def test_a_chunk_no_node_holds_is_routed_around_with_a_keyframe_only_version_at_once(tmp_path):
    ckpts = rl_checkpoints("small", 1e-5, 1)
    with _swarm_at_1(tmp_path, ckpts) as (lab, origin, a):
        lab.kill(a)
        _damage(origin.origin.data_dir, 1)
        t0 = time.monotonic()
        b = lab.start_node("b", region="r1")  # asks the origin for the patch: the damage is found
        st = wait_until(lambda: (s := origin.stats())["chunks_lost"] and s, "chunk declared lost", poll=0.1)
        assert st["chunks_recovered"] == 0
        # Version 2: the served state of version 1 again, as a keyframe and no patch, so no
        # chain through the lost chunk leads to the latest version.
        lab.wait_version([b], 2, timeout=60)
        print(f"b started -> b at the keyframe-only version 2: {time.monotonic() - t0:.2f} s")  # for reading
        v2 = [v for v in origin.stats()["versions"] if v["version"] == 2]
        assert v2 and v2[0]["patch_bytes"] is None and v2[0]["keyframe_bytes"]
        assert same_bits(load_weights(b), served_copy(ckpts[1]))
        # The trainer's next version follows it, a patch again.
        assert origin.publish(ckpts[0]) == 3
        lab.wait_version([b], 3, timeout=60)
        assert same_bits(load_weights(b), served_copy(ckpts[0]))


def test_a_chunk_of_the_served_versions_keyframe_no_node_holds_is_made_again_from_the_served_state(tmp_path):
    ckpts = rl_checkpoints("small", 1e-5, 1)
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        with _origin(lab) as origin:
            origin.publish(ckpts[0])  # a keyframe only, and no node has taken a chunk of it
            _damage(origin.origin.data_dir, 0, chunk=1, kind="keyframe")
            b = lab.start_node("b", region="r1")
            lab.wait_version([b], 0, timeout=60)
            assert same_bits(load_weights(b), served_copy(ckpts[0]))
            st = origin.stats()
            # lost (b lacked it), then encoded again bit for bit: no version in its place
            assert (st["chunks_damaged"], st["chunks_lost"], st["chunks_recovered"], st["version"]) == (1, 1, 1, 0)


def test_an_origin_restarted_with_a_damaged_chunk_takes_it_back_and_keeps_its_versions(tmp_path):
    ckpts = rl_checkpoints("small", 1e-5, 2)
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        a = lab.start_node("a", region="r1")
        with _origin(lab) as origin:
            for s in ckpts:
                origin.publish(s)
            lab.wait_version([a], 2)
        # Version 1's patch is in the chain a restart replays (the base is version 0).
        _damage(lab.root / "origin", 1)
        with _origin(lab) as origin:
            # Replayed to version 2 once a brought the chunk back (version 0 before).
            st = wait_until(lambda: (s := origin.stats())["version"] == 2 and s, "version 2", poll=0.1)
            assert st["chunks_recovered"] == 1 and st["chunks_lost"] == 0
            lab.kill(a)
            b = lab.start_node("b", region="r1")
            lab.wait_version([b], 2, timeout=60)
            assert same_bits(load_weights(b), served_copy(ckpts[2]))
            assert origin.publish(ckpts[0]) == 3  # the numbering goes on


def test_an_origin_restarted_with_a_chunk_of_its_chain_no_node_holds_goes_on_with_a_keyframe_only_version(tmp_path):
    ckpts = rl_checkpoints("small", 1e-5, 2)
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        with _origin(lab) as origin:
            for s in ckpts:
                origin.publish(s)
        _damage(lab.root / "origin", 1)
        with _origin(lab, catch_up_s=2.0) as origin:
            # No node: the chain stops at version 0, and the versions announced stay taken.
            st = wait_until(lambda: (s := origin.stats())["chunks_lost"] and s, "chunk declared lost", poll=0.1)
            assert st["version"] == 0 and st["chunks_recovered"] == 0
            assert origin.publish(ckpts[0]) == 3  # a keyframe only: no patch follows version 0's state
            v3 = origin.stats()["versions"][-1]
            assert v3["version"] == 3 and v3["patch_bytes"] is None and v3["keyframe_bytes"]
            b = lab.start_node("b", region="r1")
            lab.wait_version([b], 3, timeout=60)
            assert same_bits(load_weights(b), served_copy(ckpts[0]))
            assert origin.publish(ckpts[1]) == 4
            lab.wait_version([b], 4, timeout=60)
            assert same_bits(load_weights(b), served_copy(ckpts[1]))
