"""The tracker: its decisions without sockets (TrackerCore), and its I/O shell over memory streams.

The core takes events with the time and returns what to send and whom to
close, so liveness, reconnects, announcements, retention, peer-set deltas and
budgets are checked as tables of events. The shell is checked where it has
behaviour of its own: concurrent pushes through per-member queues, a member
that stops reading dropped without delaying the others.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import socket

import msgpack
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.node.net import transport, trust
from patchswarm.node.net.transport import MessageStream, connect, exchange_hello, serve
from patchswarm.protocol import responsibility, wire
from patchswarm.protocol.manifest import Manifest, sign_manifest, verify_manifest
from patchswarm.protocol.errors import PeerRefused, UsageError
from patchswarm.protocol.peersets import apply_delta
from patchswarm.protocol.responsibility import uplink_caps
from patchswarm.tracker import server
from patchswarm.tracker.core import (BAD_MESSAGE, BEHIND, OVER_ANNOUNCES, OVER_JOINS, OVER_SIGNALS, REPLACED, SILENT,
                                     UPLINK_CHANGE_S, Close, Send, TrackerCore)

KEY = Ed25519PrivateKey.generate()
SWARM = "sw-test"


def h(version: int) -> str:
    return "blake3:" + hashlib.sha256(b"%d" % version).hexdigest()


def envelope(version: int, keyframe: bool = False, key=KEY) -> bytes:
    m = Manifest(swarm_id=SWARM, version=version, base_version=None if keyframe else version - 1,
                 base_hash=None if keyframe else h(version - 1), target_hash=h(version),
                 tensors=[["w", "bf16", [4]]], chunks=[(100, hashlib.sha256(b"%d" % version).digest())],
                 codec={"format": 2}, created_at=0.0)
    return sign_manifest(m, key)


def hello(name: str, role: str = "node", region: str = "r0", versions=()) -> wire.Hello:
    return wire.Hello(name, region, role, f"{name}:7000", list(versions))


class Conn:
    """A connection token, as the shell's sessions are: the core never looks inside."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Conn({self.name})"


class Run:
    """Drives a TrackerCore and keeps what each connection was sent, as a member would."""

    def __init__(self, **options):
        options.setdefault("delta_delay", 0.1)
        self.core = TrackerCore(SWARM, KEY.public_key(), **options)
        self.got: dict[Conn, list] = {}
        self.closed: dict[Conn, str] = {}
        self.now = 0.0

    def do(self, actions):
        for a in actions:
            if isinstance(a, Send):
                assert wire.decode_body(a.frame[4:]) == a.msg
                for c in a.to:
                    self.got.setdefault(c, []).append(a.msg)
            else:
                assert isinstance(a, Close)
                self.closed[a.conn] = a.why
        return actions

    def join(self, name, role="node", region="r0", versions=(), at=None):
        c = Conn(name)
        self.now = self.now if at is None else at
        self.do(self.core.connected(c, hello(name, role, region, versions), f"{name}:7000", self.now))
        return c

    def send(self, conn, msg, at=None):
        self.now = self.now if at is None else at
        return self.do(self.core.received(conn, msg, self.now))

    def tick(self, at):
        self.now = at
        return self.do(self.core.tick(at))

    def peers(self, conn) -> dict[str, dict]:
        """The peer set a member holds from what it was sent."""
        held: dict[str, dict] = {}
        for msg in self.got.get(conn, []):
            if isinstance(msg, wire.PeerList):
                held = {p["id"]: p for p in msg.peers}
            elif isinstance(msg, wire.PeerDelta):
                held = apply_delta(held, msg)
                held.pop(conn.name, None)
        return held

    def notices(self, conn) -> list[tuple[int, bool]]:
        out = []
        for msg in self.got.get(conn, []):
            if isinstance(msg, wire.VersionNotice):
                m = verify_manifest(msg.manifest, KEY.public_key())
                out.append((m.version, m.is_keyframe))
        return out


def test_a_joining_node_gets_its_peers_then_the_retained_manifests_in_order():
    run = Run()
    origin = run.join("origin", "origin", "r0")
    for v, kf in [(0, True), (1, False), (2, False)]:
        run.send(origin, wire.Announce(envelope(v, kf)))
    a = run.join("a", region="r0")
    b = run.join("b", region="r1")
    first = run.got[b][0]
    assert isinstance(first, wire.PeerList)
    assert {p["id"] for p in first.peers} == {"origin", "a"}
    assert run.notices(b) == [(0, True), (1, False), (2, False)]
    assert run.notices(a) == [(0, True), (1, False), (2, False)]
    assert origin not in run.got or not run.notices(origin)  # the origin is not sent its own manifests


def hints(run, conn) -> list[tuple[int, bool]]:
    return [(m.version, m.keyframe) for m in run.got.get(conn, []) if isinstance(m, wire.VersionHint)]


def test_a_version_goes_whole_to_a_few_nodes_per_region_and_as_a_hint_to_the_rest():
    run = Run(notice_seeds=3)
    origin = run.join("origin", "origin", "r0")
    small = [run.join(f"s{i}", region="small") for i in range(3)]  # no larger than the seeds: all whole
    big = [run.join(f"b{i:02d}", region="big") for i in range(40)]
    run.send(origin, wire.Announce(envelope(0, True)))
    run.send(origin, wire.Announce(envelope(1)))
    for key in [(0, True), (1, False)]:
        assert all(key in run.notices(c) and key not in hints(run, c) for c in small)
        whole = [c for c in big if key in run.notices(c)]
        hinted = [c for c in big if key in hints(run, c)]
        assert len(whole) == 3 and len(hinted) == 37 and not set(whole) & set(hinted)
    seeds = {v: {c for c in big if (v, kf) in run.notices(c)} for v, kf in [(0, True), (1, False)]}
    assert seeds[0] != seeds[1]  # the seeding is spread over the region, object by object
    assert not run.notices(origin) and not hints(run, origin)


def test_a_hinted_node_that_asks_gets_the_manifest_once_and_only_a_retained_one():
    run = Run(notice_seeds=1)
    origin = run.join("origin", "origin", "r0")
    nodes = [run.join(f"n{i}") for i in range(5)]
    run.send(origin, wire.Announce(envelope(0, True)))
    seed = next(c for c in nodes if run.notices(c))
    asker = next(c for c in nodes if not run.notices(c))
    assert hints(run, asker) == [(0, True)]
    run.send(asker, wire.ManifestRequest(0, True))
    assert run.notices(asker) == [(0, True)]
    for _ in range(3):  # asking again costs the tracker nothing
        run.send(asker, wire.ManifestRequest(0, True))
        run.send(seed, wire.ManifestRequest(0, True))  # a seed was sent it already
    run.send(asker, wire.ManifestRequest(7, False))  # never announced
    assert run.notices(asker) == [(0, True)] and run.notices(seed) == [(0, True)]
    assert run.core.status()["manifests_requested"] == 1
    assert run.closed == {}


def test_a_node_joining_later_gets_every_retained_manifest_whole():
    run = Run(notice_seeds=1)
    origin = run.join("origin", "origin", "r0")
    for i in range(4):
        run.join(f"n{i}")
    run.send(origin, wire.Announce(envelope(0, True)))
    late = run.join("late")
    assert run.notices(late) == [(0, True)] and not hints(run, late)
    run.send(late, wire.ManifestRequest(0, True))
    assert run.notices(late) == [(0, True)]


def test_notice_seeds_must_be_positive():
    with pytest.raises(UsageError, match="at least 1 notice seed"):
        Run(notice_seeds=0)


def test_a_silent_member_is_dropped_and_the_others_told():
    run = Run(heartbeat_timeout=10.0)
    a = run.join("a", at=0.0)
    b = run.join("b", at=0.0)
    run.tick(0.2)
    assert "b" in run.peers(a)
    run.send(a, wire.Heartbeat([]), at=6.0)
    assert run.tick(9.9) == []
    run.tick(10.0)
    assert run.closed == {b: SILENT}
    run.tick(10.2)  # after the coalescing delay
    assert "b" not in run.peers(a)
    assert run.core.drops[SILENT] == 1
    assert run.tick(15.9) == [] and a not in run.closed  # it heartbeat at 6
    run.tick(16.0)
    assert run.closed[a] == SILENT


def test_an_announce_from_a_node_is_refused_counted_and_not_spread():
    run = Run()
    origin = run.join("origin", "origin")
    a = run.join("a")
    mallory = run.join("mallory")
    run.send(mallory, wire.Announce(envelope(1)))
    assert run.core.manifests_rejected == 1
    assert run.core.book.latest_version is None
    assert run.notices(a) == []
    assert [m for m in run.got[mallory] if isinstance(m, wire.Error)]
    assert mallory not in run.closed  # refused, not dropped: one mistake is not an attack
    run.send(origin, wire.Announce(envelope(1)))
    assert run.notices(a) == [(1, False)]


def test_a_reconnect_closes_the_old_session_and_its_late_close_changes_nothing():
    run = Run()
    a = run.join("a")
    old = run.join("b")
    run.tick(0.2)
    n_a = len(run.got[a])
    new = run.join("b")
    assert run.closed == {old: REPLACED}
    assert run.do(run.core.closed(old, run.now)) == []  # the old session's end, seen later
    assert "b" in run.core.members and run.core.members["b"].conn is new
    run.tick(0.5)
    assert len(run.got[a]) == n_a  # same region and address: nobody else hears of it
    assert isinstance(run.got[new][0], wire.PeerList) and {p["id"] for p in run.got[new][0].peers} == {"a"}


def test_a_stale_reannouncement_is_ignored():
    run = Run(retain_patches=2)
    origin = run.join("origin", "origin")
    a = run.join("a")
    run.send(origin, wire.Announce(envelope(0, True)))
    for v in range(1, 6):
        run.send(origin, wire.Announce(envelope(v)))
    run.send(origin, wire.Announce(envelope(5, True)))
    before = list(run.got[a])
    # The origin restarts and re-announces objects nobody needs any more, and the latest again.
    for e in (envelope(1), envelope(2), envelope(5)):
        assert run.send(origin, wire.Announce(e)) == []
    assert run.got[a] == before
    assert (1, False) not in run.core.book.keys() and (2, False) not in run.core.book.keys()


def test_retained_manifests_are_pruned_to_the_latest_keyframe_and_recent_patches():
    run = Run(retain_patches=2)
    origin = run.join("origin", "origin")
    run.send(origin, wire.Announce(envelope(0, True)))
    for v in range(1, 6):
        run.send(origin, wire.Announce(envelope(v)))
    run.send(origin, wire.Announce(envelope(5, True)))
    run.send(origin, wire.Announce(envelope(6)))
    late = run.join("late")
    # the latest keyframe and every patch after it, and the last two patches in all
    assert run.notices(late) == [(5, False), (5, True), (6, False)]
    assert run.core.book.keys() == [(5, False), (5, True), (6, False)]


def test_a_new_same_region_peer_reaches_the_region_by_delta():
    run = Run()
    run.join("origin", "origin", "r0")
    r1 = [run.join(f"n{i}", region="r1") for i in range(5)]
    r2 = [run.join(f"m{i}", region="r2") for i in range(5)]
    run.tick(0.2)
    before = {c: len(run.got[c]) for c in r1 + r2}
    run.join("n-new", region="r1", at=1.0)
    assert run.tick(1.05) == []  # coalesced, not yet
    run.tick(1.1)
    for c in r1:
        assert "n-new" in run.peers(c)
        assert isinstance(run.got[c][-1], wire.PeerDelta)
    # r2 members: only those whose sample of r1 now takes the newcomer hear of it
    for c in r2:
        assert len(run.got[c]) == before[c] + ("n-new" in run.peers(c))


def test_membership_deltas_are_coalesced_into_one_message_per_member():
    run = Run()
    a = run.join("a", region="r0")
    run.tick(0.2)
    n = len(run.got[a])
    for i in range(20):
        run.join(f"x{i}", region="r0", at=1.0 + i * 0.004)
        run.tick(run.now)  # the shell ticks whenever the core has something due
    run.tick(1.2)
    assert len(run.got[a]) == n + 1
    assert {f"x{i}" for i in range(20)} <= run.peers(a).keys()


def test_three_hundred_joins_from_one_certificate_cost_the_others_a_bounded_number_of_pushes():
    run = Run(join_budget=(10, 10.0))
    honest = [run.join(f"h{i}", region="r0") for i in range(5)]
    run.tick(0.2)
    before = len(run.got[honest[0]])
    for i in range(300):
        c = Conn("mallory")
        run.now = 1.0 + i * 0.05
        # each time from another address, so that every accepted join is a real change
        run.do(run.core.connected(c, wire.Hello("mallory", "r0", "node", f"10.6.6.{i % 250}:7000", []),
                                  f"10.6.6.{i % 250}:7000", run.now))
        run.tick(run.now)
    run.tick(run.now + 1.0)
    assert run.core.drops[OVER_JOINS] >= 290 - 15 * 10 / 60
    pushes = len(run.got[honest[0]]) - before
    assert pushes <= 10 + 3, pushes  # the burst, plus the refill over 15 s
    assert run.core.members["mallory"].conn is not c  # refused joins replace nothing


def test_joins_that_passed_the_gate_together_cost_the_member_only_the_newest():
    """Two connections of one member past the server's gate at once (it takes nothing) with
    one join left: the first becomes the live session, the second is refused, and the first
    stays; before, the refusal also ended the first, leaving the member with no session."""
    run = Run(join_budget=(2, 1.0))
    a = run.join("a", region="r0")
    first, second = Conn("a"), Conn("a")
    hello = wire.Hello("a", "r0", "node", "a:7000", [])
    assert run.core.join_wait("a", 1.0) == 0 and run.core.join_wait("a", 1.0) == 0  # both admitted by the gate
    run.do(run.core.connected(first, hello, "a:7000", 1.0))
    out = run.core.connected(second, hello, "a:7000", 1.0)
    assert [(type(m).__name__, m.conn) for m in out if isinstance(m, Close)] == [("Close", second)]
    assert run.core.members["a"].conn is first
    assert run.core.drops[OVER_JOINS] == 1 and run.core.drops[REPLACED] == 1  # `a`'s first session replaced by `first`
    assert first not in run.closed and a in run.closed


def test_a_member_over_its_announce_budget_is_dropped_and_counted():
    run = Run(announce_budget=(5, 5.0))
    mallory = run.join("mallory")
    for i in range(6):
        if mallory in run.closed:
            break
        run.send(mallory, wire.Announce(envelope(1)), at=0.1 * i)
    assert run.closed[mallory] == OVER_ANNOUNCES
    assert run.core.drops[OVER_ANNOUNCES] == 1 and "mallory" not in run.core.members


def test_a_message_the_tracker_does_not_take_drops_the_member():
    run = Run()
    a = run.join("a")
    run.send(a, wire.Request(1, False, 0))
    assert run.closed == {a: BAD_MESSAGE} and "a" not in run.core.members


def test_gateways_of_a_new_version_learn_each_other_at_once():
    run = Run(wan_gateways=2)
    origin = run.join("origin", "origin", "r0")
    conns = {f"n{r}.{i}": run.join(f"n{r}.{i}", region=f"r{r}") for r in range(3) for i in range(8)}
    run.tick(0.2)
    run.send(origin, wire.Announce(envelope(0, True)))
    run.send(origin, wire.Announce(envelope(1)))  # no tick: the gateways' deltas go with the notice
    gws = {r: run.core.peers.gateways(f"r{r}") for r in range(3)}
    assert all(len(g) == 2 for g in gws.values())
    for r, mine in gws.items():
        for g in mine:
            held = run.peers(conns[g])
            for other, theirs in gws.items():
                if other != r:
                    assert theirs <= held.keys(), (g, other)


@pytest.mark.parametrize("regions, size", [(8, 25), (8, 100), (24, 25)])
def test_a_membership_change_costs_its_region_and_its_samplers_not_the_fleet(regions, size):
    """One node of r3 leaves and another joins, 20 times: the deltas reach the region and the
    members that sampled the node (3 per member of each other region, spread over the region's
    nodes: about 3 x (regions - 1) of them), never the fleet; each carries a few entries."""
    core = TrackerCore(SWARM, KEY.public_key(), delta_delay=0.1, heartbeat_timeout=1e9)
    core.connected(Conn("origin"), hello("origin", "origin", "r0"), "origin:7000", 0.0)
    for r in range(regions):
        for i in range(size):
            core.connected(Conn(f"n{r}.{i}"), hello(f"n{r}.{i}", region=f"r{r}"), f"n{r}.{i}:7000", 0.0)
    core.tick(1.0)
    recipients, pushed, changes = 0, 0, 0
    for k in range(20):
        t = 2.0 + k
        name, joiner = f"n3.{k}", Conn(f"n3.{k}b")
        acts = core.closed(core.members[name].conn, t)
        acts += core.connected(joiner, hello(f"n3.{k}b", region="r3"), f"n3.{k}b:7000", t)
        acts += core.tick(t + 0.2)
        sends = [a for a in acts if isinstance(a, Send) and a.to != (joiner,)]  # not the joiner's own list
        recipients += sum(len(a.to) for a in sends)
        pushed += sum(len(a.frame) * len(a.to) for a in sends)
        changes += 2
    affected = size + 3 * (regions - 1)  # the region, and the samplers a node has on average
    assert recipients / changes <= 1.5 * affected, (recipients / changes, affected)
    assert pushed / recipients <= 160  # a delta of one or two entries, not a list
    assert recipients / changes < (regions * size) / 3  # far from the fleet


# ------------------------------------------------------------------ the shell


def _creds(tmp_path):
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    out = {}
    for name, role in [("tracker", "tracker")]:
        trust.issue(swarm, name, role, tmp_path / name)
        out[name] = tmp_path / name
    return out


async def _member(tracker: server.Tracker, nursery, name: str, region: str = "r0", *, role: str = "node",
                  my_hello: wire.Hello | None = None, pair=trio.testing.lockstep_stream_pair):
    """A member joined to `tracker` over an in-memory stream (`pair`; by default lockstep: a send
    waits for its reader), saying `my_hello` (default: `hello(name, region=region)`)."""
    ours, theirs = pair()
    t_ms = MessageStream(theirs, name, role)
    m_ms = MessageStream(ours, tracker.creds.name, "tracker")

    async def tracker_side():
        t_ms.hello = await t_ms.receive()
        await t_ms.send(tracker._hello())
        await tracker._session(t_ms)

    nursery.start_soon(tracker_side)
    await exchange_hello(m_ms, my_hello or hello(name, region=region))
    return m_ms


async def _read_all(ms, into: list) -> None:
    while (msg := await ms.receive()) is not None:
        into.append(msg)


def test_a_member_that_stops_reading_is_dropped_and_never_delays_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "SEND_TIMEOUT", 3.0)
    creds = _creds(tmp_path)
    received: dict[str, list] = {}

    async def main():
        tracker = server.Tracker(creds["tracker"], "127.0.0.1:0", heartbeat_timeout=1e6, delta_delay=0.1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tracker._tick_loop)
            readers = {}
            for name in ("a", "b", "c"):
                readers[name] = await _member(tracker, nursery, name)
                received[name] = []
                nursery.start_soon(_read_all, readers[name], received[name])
            stuck = await _member(tracker, nursery, "stuck")  # never reads after its Hello
            await trio.sleep(0.5)
            assert "stuck" in tracker.core.members
            # Joins keep changing everyone's set; the stuck member's sender blocks on its first frame.
            t0 = trio.current_time()
            for i in range(5):
                nursery.start_soon(_read_all, await _member(tracker, nursery, f"x{i}"), [])
                await trio.sleep(0.2)
            # Everyone who reads was told of every newcomer within the coalescing delay.
            for name in ("a", "b", "c"):
                held = {}
                for msg in received[name]:
                    held = {p["id"]: p for p in msg.peers} if isinstance(msg, wire.PeerList) else apply_delta(held, msg)
                assert {f"x{i}" for i in range(5)} <= held.keys()
            assert trio.current_time() - t0 < 3.0  # no push waited for the stuck member's send
            await trio.sleep(3.5)
            assert "stuck" not in tracker.core.members
            assert tracker.core.drops[BEHIND] == 1
            nursery.cancel_scope.cancel()
        del stuck

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.01))


def test_a_member_whose_queue_overflows_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "SEND_QUEUE", 4)
    monkeypatch.setattr(server, "SEND_TIMEOUT", 1e6)
    creds = _creds(tmp_path)

    async def main():
        tracker = server.Tracker(creds["tracker"], "127.0.0.1:0", heartbeat_timeout=1e6, delta_delay=0.01)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tracker._tick_loop)
            await _member(tracker, nursery, "stuck")
            for i in range(8):  # each join is one delta for "stuck": its queue fills up
                nursery.start_soon(_read_all, await _member(tracker, nursery, f"x{i}"), [])
                await trio.sleep(0.05)
            assert "stuck" not in tracker.core.members
            assert tracker.core.drops[BEHIND] == 1
            assert {f"x{i}" for i in range(8)} <= tracker.core.members.keys()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.01))


def _swarm_of(tmp_path) -> dict:
    """A swarm under tmp_path with a tracker and nodes a, b, c: name -> Credentials."""
    trust.init_swarm(tmp_path / "swarm")
    creds = {}
    for name, role in [("tracker", "tracker"), ("a", "node"), ("b", "node"), ("c", "node")]:
        trust.issue(tmp_path / "swarm", name, role, tmp_path / name)
        creds[name] = trust.Credentials.load(tmp_path / name)
    return creds


def test_over_tls_a_member_learns_of_a_new_same_region_peer_by_delta(tmp_path):
    """The real service on loopback: b joins after a; a is sent b's entry, b's list holds a."""
    creds = _swarm_of(tmp_path)

    async def main():
        tracker = server.Tracker(tmp_path / "tracker", "127.0.0.1:0")
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(tracker.run)
                members = {}
                for name, region in [("a", "r1"), ("c", "r2"), ("b", "r1")]:
                    members[name] = await connect(tracker.listen_addr, creds[name], {"tracker"},
                                                  wire.Hello(name, region, "node", f"127.0.0.1:{7000 + ord(name)}", []))
                first = {name: await ms.receive() for name, ms in members.items()}
                assert isinstance(first["b"], wire.PeerList) and "a" in {p["id"] for p in first["b"].peers}
                held = {p["id"]: p for p in first["a"].peers}
                while "b" not in held:
                    msg = await members["a"].receive()
                    assert isinstance(msg, wire.PeerDelta), msg
                    held = apply_delta(held, msg)
                assert held["b"] == {"id": "b", "region": "r1", "addr": f"127.0.0.1:{7000 + ord('b')}", "role": "node"}
                joins = tracker.status()["recent_joins"]  # from TCP accept to the peer list, the tracker's part
                assert joins["count"] == 3 and 0 < joins["p50_s"] <= joins["max_s"] < 30
                for ms in members.values():
                    await ms.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_over_tls_a_member_over_its_join_budget_is_refused_before_its_hello(tmp_path, monkeypatch):
    """A member that reconnects in a loop: past its join budget the listener refuses it right
    after TLS (an Error in place of the tracker's Hello, held REFUSAL_HOLD), before the core
    or its old session hear of it; before, each try cost a Hello exchange and came back at
    once. Counted in status "refused"; the member is let in again once a join is back."""
    monkeypatch.setattr(transport, "REFUSAL_HOLD", 0.3)
    creds = _swarm_of(tmp_path)

    async def main():
        tracker = server.Tracker(tmp_path / "tracker", "127.0.0.1:0", join_budget=(2, 120.0))  # one per 0.5 s
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(tracker.run)
                hello = wire.Hello("a", "r1", "node", "127.0.0.1:7001", [])
                for _ in range(2):
                    ms = await connect(tracker.listen_addr, creds["a"], {"tracker"}, hello)
                    assert isinstance(await ms.receive(), wire.PeerList)
                    kept = ms  # the last one stays open: a refusal must not end it
                t0 = trio.current_time()
                with pytest.raises(PeerRefused, match="joins in a row"):
                    await connect(tracker.listen_addr, creds["a"], {"tracker"}, hello)
                assert trio.current_time() - t0 >= 0.3  # held
                st = tracker.status()
                assert st["refused"] == {OVER_JOINS: 1} and OVER_JOINS not in st["drops"]
                assert [m["id"] for m in st["members"]] == ["a"]  # its session stands
                await trio.sleep(tracker.core.join_wait("a", trio.current_time()))
                again = await connect(tracker.listen_addr, creds["a"], {"tracker"}, hello)
                assert isinstance(await again.receive(), wire.PeerList)
                for m in (kept, again):
                    await m.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_an_unreachable_node_is_listed_without_an_address_and_told_why():
    run = Run()
    a, b = run.join("a", region="r1"), run.join("b", region="r1")
    run.tick(0.2)
    assert run.peers(a)["b"]["addr"] == "b:7000"
    run.do(run.core.unreachable(b, "b:7000", "connection refused", 1.0))
    run.tick(1.2)
    assert run.peers(a)["b"]["addr"] == ""  # peers stop dialing it; it dials them
    assert [m for m in run.got[b] if isinstance(m, wire.Unreachable)] == [wire.Unreachable("b:7000", "connection refused")]
    c = run.join("c", region="r1", at=2.0)
    assert {p["id"]: p["addr"] for p in run.got[c][0].peers}["b"] == ""  # a joiner's full list too
    # A probe that ends after the member left, or joined again (a new session, perhaps a new address):
    assert run.core.unreachable(b, "b:7000", "late", 3.0) == []  # already listed without one
    b2 = run.join("b", region="r1", at=4.0)
    assert run.core.unreachable(b, "b:7000", "from the old session", 4.1) == []
    run.tick(4.3)
    assert run.peers(a)["b"]["addr"] == "b:7000" and b2 in run.got


def test_the_tracker_probes_node_addresses_when_asked(tmp_path):
    """The real service on loopback with --probe-reachability: a node that listens where it says
    keeps its address; one that names an address nobody answers on is listed without one and
    told why; nodes are not probed without the flag."""
    creds = _swarm_of(tmp_path)

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                # a: a real node listener (its TLS and Hello, role checks as a daemon's)
                probes = []

                async def accepted(ms):
                    probes.append(ms.peer_role)
                    await ms.aclose()

                a_addr = await nursery.start(functools.partial(
                    serve, "127.0.0.1:0", creds["a"], {"node", "tracker"},
                    lambda: wire.Hello("a", "r1", "node", "", []), accepted))
                with socket.socket() as s:  # b: an address with nobody listening on it
                    s.bind(("127.0.0.1", 0))
                    b_addr = f"127.0.0.1:{s.getsockname()[1]}"
                for probe in (True, False):
                    tracker = server.Tracker(tmp_path / "tracker", "127.0.0.1:0", probe=probe)
                    await nursery.start(tracker.run)
                    members = {name: await connect(tracker.listen_addr, creds[name], {"tracker"},
                                                   wire.Hello(name, "r1", "node", addr, []))
                               for name, addr in [("a", a_addr), ("b", b_addr), ("c", "127.0.0.1:1")]}
                    held = {p["id"]: p for p in (await members["c"].receive()).peers}
                    said = None
                    while probe and said is None:  # b is told
                        msg = await members["b"].receive()
                        said = msg if isinstance(msg, wire.Unreachable) else None
                    while probe and held["b"]["addr"]:  # and c, its peer, hears it has no address
                        msg = await members["c"].receive()
                        if isinstance(msg, wire.PeerDelta):
                            held = apply_delta(held, msg)
                    if probe:
                        assert held["a"]["addr"] == a_addr and held["b"]["addr"] == ""
                        assert said.addr == b_addr and said.reason
                        for _ in range(100):
                            if tracker.status()["probed"].get("unreachable") == 2:
                                break
                            await trio.sleep(0.05)
                        assert tracker.status()["probed"] == {"reachable": 1, "unreachable": 2}  # c: 127.0.0.1:1
                        assert probes == ["tracker"]
                    else:
                        await trio.sleep(0.5)
                        assert tracker.status()["probed"] is None and probes == ["tracker"]  # not again
                    for ms in members.values():
                        await ms.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)


# --- the swarm's WAN rates (tracker --wan-rates) -----------------------------------

RATES = {"r0": 100.0, "r1": 50.0, "r2": 20.0}


def test_every_member_that_reads_the_field_is_told_the_swarms_wan_rates_and_an_older_one_its_old_frame():
    run = Run(wan_rates=RATES)
    new = Conn("a")
    run.do(run.core.connected(new, hello("a"), "a:7000", 0.0, wire_revision=wire.WIRE_REVISION))
    origin = Conn("origin")
    run.do(run.core.connected(origin, hello("origin", "origin"), "origin:7000", 0.0, wire_revision=wire.WIRE_REVISION))
    old = Conn("b")  # a member of the previous version: its connection chose no wire revision
    to_old = run.do(run.core.connected(old, hello("b", region="r1"), "b:7000", 0.0))
    assert run.got[new][0].wan_rates == RATES and run.got[origin][0].wan_rates == RATES
    assert run.got[old][0] == wire.PeerList(run.got[old][0].peers)  # no rates ...
    frame = next(a.frame for a in to_old if isinstance(a, Send) and old in a.to)
    assert list(msgpack.unpackb(frame[4:])) == ["t", "peers"]  # ... and the frame it has always read
    assert run.core.status()["wan_rates"] == RATES
    reconnect = Conn("a")  # every session's PeerList says them again
    run.do(run.core.connected(reconnect, hello("a"), "a:7000", 1.0, wire_revision=wire.WIRE_REVISION))
    assert run.got[reconnect][0].wan_rates == RATES


def test_a_tracker_without_wan_rates_tells_no_member_any():
    run = Run()
    a = Conn("a")
    run.do(run.core.connected(a, hello("a"), "a:7000", 0.0, wire_revision=wire.WIRE_REVISION))
    assert run.got[a][0].wan_rates is None and run.core.status()["wan_rates"] is None


def test_new_wan_rates_reach_every_member_that_reads_them_with_its_peer_set_at_once():
    """The tracker's configuration re-read (SIGHUP): each node and origin of wire revision 2 or
    later gets its peer set again with the new rates; an older member, which would refuse the
    field, gets nothing; a member told it cannot be reached is told again right after (a
    member takes a PeerList as a session's start). The same rates again: nothing sent."""
    run = Run(wan_rates=RATES)
    new, origin, unreachable = Conn("a"), Conn("origin"), Conn("c")
    run.do(run.core.connected(new, hello("a"), "a:7000", 0.0, wire_revision=wire.WIRE_REVISION))
    run.do(run.core.connected(origin, hello("origin", "origin"), "origin:7000", 0.0, wire_revision=wire.WIRE_REVISION))
    run.do(run.core.connected(unreachable, hello("c"), "c:7000", 0.0, wire_revision=wire.WIRE_REVISION))
    old = run.join("b", region="r1")
    run.do(run.core.unreachable(unreachable, "c:7000", "connection refused", 0.5))
    run.tick(1.0)
    before = {c: len(run.got[c]) for c in (new, origin, unreachable, old)}
    slower = {"r0": 100.0, "r1": 20.0, "r2": 50.0}
    run.do(run.core.set_wan_rates(slower))
    sent = {c: run.got[c][before[c]:] for c in before}
    assert [type(m).__name__ for m in sent[new]] == ["PeerList"] and sent[new][0].wan_rates == slower
    assert sent[new][0].peers == run.core.peers.full("a")
    assert sent[origin][0].wan_rates == slower
    assert sent[unreachable] == [wire.PeerList(run.core.peers.full("c"), slower),
                                 wire.Unreachable("c:7000", "connection refused")]
    assert sent[old] == []
    assert run.core.status()["wan_rates"] == slower
    assert run.core.set_wan_rates(dict(slower)) == []
    run.do(run.core.set_wan_rates(None))  # rates removed: members plan with their own again
    assert run.got[new][-1].wan_rates is None and run.core.wan_rates is None
    with pytest.raises(UsageError, match="wan_rates: expected region -> rate > 0"):
        run.core.set_wan_rates({"r0": 0})
    assert run.core.wan_rates is None


@pytest.mark.parametrize("bad", [{"r0": -5}, {"r0": 0}, {"r0": float("nan")}, {"r0": "fast"}])
def test_the_trackers_wan_rates_are_checked_when_it_starts(bad):
    with pytest.raises(UsageError, match=r"wan_rates: expected region -> rate > 0, found \[\('r0'"):
        TrackerCore(SWARM, KEY.public_key(), wan_rates=bad)


def test_over_tls_members_of_this_version_get_the_rates_and_members_or_trackers_of_the_previous_one_interoperate(
        tmp_path, monkeypatch):
    """The real service on loopback. A member of this version offers the wire revision in ALPN and
    is told the rates; one of the previous version offers none (a context without ALPN) and gets
    the PeerList it always got; a tracker of the previous version selects none, so a member of
    this version joins it as before and is told no rates."""
    creds = _swarm_of(tmp_path)

    def previous_version(ctx):
        ctx.set_alpn_protocols([])  # what a context of the previous version offered: nothing
        return ctx

    async def first_list(tracker, name, ssl_context=None):
        ms = await connect(tracker.listen_addr, creds[name], {"tracker"},
                           wire.Hello(name, "r1", "node", f"127.0.0.1:{7000 + ord(name)}", []), ssl_context=ssl_context)
        msg = await ms.receive()
        assert isinstance(msg, wire.PeerList)
        return ms, msg

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                tracker = server.Tracker(tmp_path / "tracker", "127.0.0.1:0", wan_rates=RATES)
                await nursery.start(tracker.run)
                a, said = await first_list(tracker, "a")
                assert a.wire_revision == wire.WIRE_REVISION and said.wan_rates == RATES
                b, said = await first_list(tracker, "b", previous_version(trust.client_context(creds["b"])))
                assert b.wire_revision is None and said.wan_rates is None
                for ms in (a, b):
                    await ms.aclose()
                # A tracker of the previous version: its TLS context offers no ALPN protocol.
                monkeypatch.setattr(transport, "server_context", lambda c: previous_version(trust.server_context(c)))
                old = server.Tracker(tmp_path / "tracker", "127.0.0.1:0", wan_rates=RATES)
                await nursery.start(old.run)
                c, said = await first_list(old, "c")
                assert c.wire_revision is None and said.wan_rates is None
                await c.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)


def _signal(to: str, i: int = 0) -> wire.Signal:
    return wire.Signal(to, "offer", i, "v=0 " + "x" * 1000, b"(cert)", b"(signature)")


def test_a_member_over_its_signal_budget_is_dropped_and_counted_and_the_one_it_floods_hears_a_bounded_number():
    """WebRTC signalling is relayed to the member it names. Before, without a budget, one member
    could send any number of Signals to another: the tracker queued each for the recipient,
    whose queue (SEND_QUEUE frames) overflowed, and the recipient, an honest member, was dropped
    (and, rejoining, soon over its own join budget)."""
    run = Run(signal_budget=(20, 60.0))
    mallory, victim = run.join("mallory"), run.join("victim")
    before = len(run.got.get(victim, []))
    for i in range(1000):
        if mallory in run.closed:
            break
        run.send(mallory, _signal("victim", i), at=1.0 + 0.001 * i)
    assert run.closed == {mallory: OVER_SIGNALS}
    assert run.core.drops[OVER_SIGNALS] == 1 and "victim" in run.core.members
    relayed = [m for m in run.got[victim][before:] if isinstance(m, wire.Signal)]
    assert len(relayed) == 20 and {m.peer for m in relayed} == {"mallory"}


def test_an_honest_members_signalling_stays_within_the_default_budget():
    """A node that dials every peer of its set over WebRTC at once (16 of its region, 3 of each
    of 9 other regions), twice each (direct, then through the relay), and answers as many."""
    run = Run()
    a = run.join("a")
    peers = [run.join(f"p{i}") for i in range(16 + 27)]
    for i, p in enumerate(peers * 4):
        run.send(a, _signal(p.name, i), at=1.0)
    assert a not in run.closed and run.core.signals_relayed == 4 * len(peers)


def test_a_signal_flood_does_not_drop_the_member_it_is_addressed_to(tmp_path):
    """Over the shell's real queues: a member that reads slowly (here: not at all, for the test's
    length) keeps its tracker session while another floods it with Signals."""
    creds = _creds(tmp_path)

    async def main():
        tracker = server.Tracker(creds["tracker"], "127.0.0.1:0", heartbeat_timeout=1e6, delta_delay=0.01)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tracker._tick_loop)
            await _member(tracker, nursery, "victim")  # never read: its queue only grows
            mallory = await _member(tracker, nursery, "mallory")
            nursery.start_soon(_read_all, mallory, [])

            async def flood():
                with trio.move_on_after(1.0):  # it stops being read once closed: over its budget
                    for i in range(server.SEND_QUEUE + 100):
                        await mallory.send(_signal("victim", i))

            with trio.fail_after(5):  # less than SEND_TIMEOUT: the victim's write stays pending
                await flood()
            assert "victim" in tracker.core.members and tracker.core.drops[BEHIND] == 0
            assert "mallory" not in tracker.core.members
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.01))


def test_a_members_error_messages_are_logged_a_few_times_per_session_not_each(caplog):
    import logging
    from patchswarm.tracker.core import ERRORS_LOGGED
    run = Run()
    mallory = run.join("mallory")
    with caplog.at_level(logging.DEBUG, logger="patchswarm.tracker"):
        for _ in range(1000):
            run.send(mallory, wire.Error("x" * 4000))
    said = [r for r in caplog.records if "says" in r.getMessage()]
    assert len(said) == 1000 and sum(r.levelno >= logging.INFO for r in said) == ERRORS_LOGGED
    assert mallory not in run.closed


def test_a_wildcard_listen_address_whose_port_is_not_a_number_is_listed_as_none(tmp_path):
    """A member's Hello names its listen address; one with a wildcard host is completed with the
    address the member came from, and its port was read with int(): "0.0.0.0:http" raised
    ValueError out of the session's handler (a traceback in the tracker's log per join, the
    member never joined). Such an address leads nowhere: the member is listed with none, as
    one that accepts no connections, and the peers dial nothing."""
    creds = _creds(tmp_path)

    async def main():
        tracker = server.Tracker(creds["tracker"], "127.0.0.1:0", heartbeat_timeout=1e6)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tracker._tick_loop)
            for name, listen in (("a", "0.0.0.0:http"), ("b", "[::]:99999"), ("c", "0.0.0.0:7000")):
                pair = trio.testing.lockstep_stream_pair

                def from_an_address(pair=pair):  # a member that came from 10.0.0.9, as over TCP
                    ours, theirs = pair()
                    theirs.getpeername = lambda: ("10.0.0.9", 5555)
                    return ours, theirs

                await _member(tracker, nursery, name, pair=from_an_address,
                              my_hello=wire.Hello(name, "r0", "node", listen, []))
            with trio.fail_after(5):
                while len(tracker.core.members) < 3:
                    await trio.sleep(0.01)
            assert {m: tracker.core.members[m].addr for m in "abc"} == {"a": "", "b": "", "c": "10.0.0.9:7000"}
            nursery.cancel_scope.cancel()

    trio.run(main)



def test_a_listen_address_that_leads_nowhere_is_listed_as_none_and_no_peer_is_told_it(tmp_path):
    """A member's Hello names its listen address and the tracker passed any non-wildcard one on as
    it was: "a..b:7000" (a host no lookup takes) reached every peer, and each peer that dialed it
    exited with UnicodeError (tests/test_dialer.py). Such an address is listed as none, as for a
    member that accepts no connections; a good one is listed as it was said."""
    creds = _creds(tmp_path)
    bad = {"a": "a..b:7000", "b": "x" * 64 + ".example:7000", "c": "a\x07b:7000", "d": "host:99999", "e": "noport"}

    async def main():
        tracker = server.Tracker(creds["tracker"], "127.0.0.1:0", heartbeat_timeout=1e6)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tracker._tick_loop)
            honest = await _member(tracker, nursery, "honest", my_hello=wire.Hello("honest", "r0", "node",
                                                                                   "node-1.example:7000", []))
            got: list = []
            nursery.start_soon(_read_all, honest, got)
            for name, listen in bad.items():
                await _member(tracker, nursery, name, my_hello=wire.Hello(name, "r0", "node", listen, []))
            with trio.fail_after(5):
                while len(tracker.core.members) < 1 + len(bad):
                    await trio.sleep(0.01)
            assert {m: tracker.core.members[m].addr for m in bad} == dict.fromkeys(bad, "")
            assert tracker.core.members["honest"].addr == "node-1.example:7000"
            with trio.fail_after(5):  # the delta that lists them reaches the honest member
                while not all(any(isinstance(x, wire.PeerDelta) and any(e["id"] == m for e in x.add) for x in got)
                              for m in bad):
                    await trio.sleep(0.01)
            told = [e["addr"] for x in got if isinstance(x, (wire.PeerDelta, wire.PeerList))
                    for e in (x.add if isinstance(x, wire.PeerDelta) else x.peers) if e["id"] in bad]
            assert told and set(told) == {""}
            nursery.cancel_scope.cancel()

    trio.run(main)


# --- declared uplinks (wire revision 5) ------------------------------------------------

REV4 = "patchswarm/4"


def _join_at(run: Run, name: str, revision: str | None, uplink=None, region="r0", at=0.0, role="node") -> Conn:
    c = Conn(name)
    run.now = at
    h = dataclasses.replace(hello(name, role, region), uplink=uplink)
    run.do(run.core.connected(c, h, f"{name}:7000", at, wire_revision=revision))
    return c


def _uplinks_in(msgs) -> list:
    """Every "uplink" any peer entry in `msgs` carries, as (id, uplink)."""
    return [(e["id"], e["uplink"]) for msg in msgs for e in getattr(msg, "peers", getattr(msg, "add", []))
            if "uplink" in e]


def test_an_uplink_reaches_members_of_revision_5_and_never_one_of_revision_4_or_before():
    """a (revision 5, 100 Mbit/s) and c (revision 5, 10 Mbit/s) see each other's uplinks, in
    their PeerList and in the deltas; b (revision 4) and d (no revision) get the same entries
    without the key they would refuse, from their PeerList on, in deltas of their own."""
    run = Run()
    a = _join_at(run, "a", wire.WIRE_REVISION, uplink=100)
    b = _join_at(run, "b", REV4)
    d = _join_at(run, "d", None)
    c = _join_at(run, "c", wire.WIRE_REVISION, uplink=10)
    assert ("a", 100) in _uplinks_in(run.got[c][:1])  # c's PeerList
    run.tick(1.0)
    assert run.peers(a)["c"]["uplink"] == 10 and run.peers(c)["a"]["uplink"] == 100
    assert "uplink" not in run.peers(a)["b"]  # b declared none (its revision has no field for it)
    for old in (b, d):
        assert _uplinks_in(run.got[old]) == [], old
        assert run.peers(old)["c"] == {"id": "c", "region": "r0", "addr": "c:7000", "role": "node"}
    # A reconnect with another uplink is a change like a new address: to each in its own form.
    before = {x: len(run.got[x]) for x in (a, b, d)}
    c2 = _join_at(run, "c", wire.WIRE_REVISION, uplink=50, at=1.5)
    run.tick(3.0)
    assert run.peers(a)["c"]["uplink"] == 50 and [("c", 50)] == _uplinks_in(run.got[a][before[a]:])
    for old in (b, d):
        news = run.got[old][before[old]:]
        assert news and _uplinks_in(news) == [] and run.peers(old)["c"]["addr"] == "c:7000"
    assert run.peers(c2)["a"]["uplink"] == 100
    statuses = {m["id"]: m.get("uplink") for m in run.core.status()["members"]}
    assert statuses == {"a": 100, "b": None, "d": None, "c": 50}


def test_the_trackers_gateways_skip_a_slow_member_as_the_nodes_do():
    """One node of r1 declares 10 Mbit/s among 100: it is no gateway of any version while the
    region has others, and the gateways the tracker introduces are those of the nodes' own plan
    (responsibility.gateways with the region's uplink_caps)."""
    run = Run(wan_gateways=2)
    origin = _join_at(run, "origin", wire.WIRE_REVISION, uplink=1000, role="origin")
    ups = {f"n{r}.{i}": (10 if (r, i) == (1, 0) else 100) for r in range(3) for i in range(4)}
    for name, up in ups.items():
        _join_at(run, name, wire.WIRE_REVISION, uplink=up, region=f"r{name[1]}")
    run.tick(0.2)
    run.send(origin, wire.Announce(envelope(0, True)))
    r1 = [m for m in ups if m.startswith("n1.")]
    assert any("n1.0" in responsibility.gateways((v, False), r1, 2) for v in range(1, 20))  # were uplinks not declared
    for v in range(1, 20):
        run.send(origin, wire.Announce(envelope(v)))
        key = (v, False)
        for r in range(3):
            there = [m for m in ups if m.startswith(f"n{r}.")]
            caps = uplink_caps(there, {m: ups[m] for m in there})
            assert run.core.peers.gateways(f"r{r}") == responsibility.gateways(key, there, 2, caps)
        assert "n1.0" not in run.core.peers.gateways("r1")


def test_an_uplink_said_in_a_heartbeat_reaches_every_member_and_moves_the_gateways():
    """Revision 6: a node's heartbeat says the uplink it has now (it measured 9.44 Mbit/s of the
    100 it declared). Its entry takes it; the next delta tells the members that know it (b of
    revision 4 without the key), its region's gateways are re-ranked with it, and a change
    within UPLINK_CHANGE_S of the last is left for a later heartbeat."""
    run = Run(wan_gateways=2)
    origin = _join_at(run, "origin", wire.WIRE_REVISION, uplink=1000, role="origin")
    ups = {f"n{i}": 100 for i in range(4)}
    conns = {m: _join_at(run, m, wire.WIRE_REVISION, uplink=up, region="r1") for m, up in ups.items()}
    b = _join_at(run, "b", REV4, region="r1")
    run.tick(0.5)
    slow = next(m for m in ups if any(m in responsibility.gateways((v, False), [*ups, "b"], 2)
                                      for v in range(1, 4)))  # a gateway of a version while it is not slow
    before = {c: len(run.got[c]) for c in [*conns.values(), b]}
    run.send(conns[slow], wire.Heartbeat([], uplink=9.44), at=1.0)
    run.tick(2.0)
    for m, c in conns.items():
        if m != slow:
            assert _uplinks_in(run.got[c][before[c]:]) == [(slow, 9.44)] and run.peers(c)[slow]["uplink"] == 9.44
    assert _uplinks_in(run.got[b][before[b]:]) == [] and "uplink" not in run.peers(b)[slow]
    caps = uplink_caps([*ups, "b"], {**ups, slow: 9.44})
    assert caps[slow] < responsibility.SLOW_UPLINK
    for v in range(1, 4):
        run.send(origin, wire.Announce(envelope(v, v == 1)))
        assert slow not in run.core.peers.gateways("r1")
        assert run.core.peers.gateways("r1") == responsibility.gateways((v, v == 1), [*ups, "b"], 2, caps)
    # Too soon after the change: kept for later; the same value again is no change.
    run.send(conns[slow], wire.Heartbeat([], uplink=100), at=1.0 + UPLINK_CHANGE_S - 0.5)
    run.send(conns[slow], wire.Heartbeat([], uplink=9.44), at=1.0 + UPLINK_CHANGE_S - 0.2)
    assert {m["id"]: m.get("uplink") for m in run.core.status()["members"]}[slow] == 9.44
    for c in [origin, b, *conns.values()]:  # all alive past the heartbeat timeout
        run.send(c, wire.Heartbeat([], uplink=100 if c is not b else None), at=1.0 + UPLINK_CHANGE_S - 1.0)
    run.send(conns[slow], wire.Heartbeat([], uplink=None), at=1.0 + UPLINK_CHANGE_S)  # its estimate aged out
    run.tick(1.0 + UPLINK_CHANGE_S + 1.0)
    other = conns["n0" if slow != "n0" else "n1"]
    assert "uplink" not in run.peers(other)[slow] and run.peers(other)["b"] == {"id": "b", "region": "r1",
                                                                                "addr": "b:7000", "role": "node"}


def test_a_heartbeat_uplink_counts_only_on_a_connection_of_revision_6():
    """A member whose connection chose revision 5 keeps its Hello's uplink: a member of that
    revision sends none in heartbeats (exchange rules, node/net/trackerlink.py), and what one
    would say there is not taken."""
    run = Run()
    a = _join_at(run, "a", "patchswarm/5", uplink=100)
    c = _join_at(run, "c", wire.WIRE_REVISION, uplink=100)
    run.tick(0.5)
    run.send(a, wire.Heartbeat([], uplink=5.0), at=1.0)
    run.tick(2.0)
    assert run.peers(c)["a"]["uplink"] == 100
    assert {m["id"]: m.get("uplink") for m in run.core.status()["members"]} == {"a": 100, "c": 100}


def test_over_tls_a_node_of_revision_5_declares_its_uplink_and_one_of_revision_4_leaves_it_out(tmp_path):
    """The real service on loopback. a (this version) declares 100 Mbit/s; b offers only up to
    revision 4 and builds its Hello with an uplink too, which exchange_hello leaves out (a
    revision-4 tracker would refuse the field); c (this version) is told a's uplink and none
    for b, and b is told a's entry without the key."""
    creds = _swarm_of(tmp_path)

    def revision_4(ctx):
        ctx.set_alpn_protocols([REV4, "patchswarm/3", "patchswarm/2"])
        return ctx

    async def join(tracker, name, uplink, ssl_context=None):
        return await connect(tracker.listen_addr, creds[name], {"tracker"},
                             wire.Hello(name, "r1", "node", f"127.0.0.1:{7000 + ord(name)}", [], uplink=uplink),
                             ssl_context=ssl_context)

    async def main():
        tracker = server.Tracker(tmp_path / "tracker", "127.0.0.1:0")
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(tracker.run)
                a = await join(tracker, "a", 100)
                assert isinstance(await a.receive(), wire.PeerList)
                b = await join(tracker, "b", 50, revision_4(trust.client_context(creds["b"])))
                assert b.wire_revision == REV4
                to_b = await b.receive()
                c = await join(tracker, "c", 10.5)
                to_c = await c.receive()
                assert {p["id"]: p.get("uplink") for p in to_c.peers} == {"a": 100, "b": None}
                assert {p["id"]: p.get("uplink") for p in to_b.peers} == {"a": None}
                members = {m["id"]: m.get("uplink") for m in tracker.status()["members"]}
                assert members == {"a": 100, "b": None, "c": 10.5}
                for ms in (a, b, c):
                    await ms.aclose()
                nursery.cancel_scope.cancel()

    trio.run(main)
