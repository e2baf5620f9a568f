"""Whom a node keeps connected (node/dialer.py `Dialer.wanted`): the origin always; up to
SAME_REGION_PEERS nodes of its region and OTHER_REGION_PEERS of each other region, chosen by a
hash of both ids (stable, and different from node to node); only the origin for the star."""

import pytest
import trio
import trio.testing

from patchswarm.node.dialer import OTHER_REGION_PEERS, SAME_REGION_PEERS, Dialer


def _members(layout: dict[str, int]) -> dict[str, dict]:
    """{region: nodes} -> tracker entries, with an origin in r0."""
    out = {"origin": {"id": "origin", "role": "origin", "region": "r0", "addr": "x:1"}}
    for region, n in layout.items():
        for i in range(n):
            pid = f"{region}.n{i}"
            out[pid] = {"id": pid, "role": "node", "region": region, "addr": "x:1"}
    return out


def _wanted(me: str, region: str, layout: dict[str, int], no_peers: bool = False) -> dict[str, dict]:
    d = Dialer(me, region, creds=None, peers=None, hello=None, download=None, no_peers=no_peers)
    d.set_members(_members(layout))
    return d.wanted()


@pytest.mark.parametrize("layout, per_region", [
    ({"r0": 4, "r1": 4}, {"r0": 3, "r1": 3}),  # everyone of my region (but me), three of the other
    ({"r0": 40, "r1": 2}, {"r0": SAME_REGION_PEERS, "r1": 2}),
    ({"r0": 1, "r1": 9, "r2": 9}, {"r0": 0, "r1": OTHER_REGION_PEERS, "r2": OTHER_REGION_PEERS}),
])
def test_the_origin_and_a_bounded_share_of_each_region(layout, per_region):
    wanted = _wanted("r0.n0", "r0", layout)
    assert "origin" in wanted and "r0.n0" not in wanted
    nodes = [p for p in wanted.values() if p["role"] == "node"]
    assert {r: sum(p["region"] == r for p in nodes) for r in layout} == per_region


def test_the_choice_is_stable_and_differs_between_nodes():
    layout = {"r0": 40, "r1": 20}
    a = _wanted("r0.n0", "r0", layout)
    assert a == _wanted("r0.n0", "r0", layout)
    assert set(a) != set(_wanted("r0.n1", "r0", layout))


def test_the_star_dials_only_the_origin():
    assert list(_wanted("r0.n0", "r0", {"r0": 4, "r1": 4}, no_peers=True)) == ["origin"]


@pytest.mark.parametrize("transport,has_rtc,addr,role,tcp_failures,expected", [
    ("tcp", False, "10.0.0.2:7000", "node", 0, "tcp"),
    ("tcp", False, "", "node", 0, None),  # accepts nothing inbound, and this member has no WebRTC
    ("webrtc", True, "10.0.0.2:7000", "node", 0, "webrtc"),
    ("webrtc", True, "10.0.0.1:7000", "origin", 0, "tcp"),  # the origin answers no offers
    ("auto", True, "10.0.0.2:7000", "node", 0, "tcp"),
    ("auto", True, "10.0.0.2:7000", "node", 1, "tcp"),
    ("auto", True, "10.0.0.2:7000", "node", 2, "webrtc"),  # TCP dials to it kept failing
    ("auto", True, "", "node", 0, "webrtc"),  # it has no address
    ("auto", True, "", "origin", 0, None),
])
def test_route_picks_tcp_or_webrtc(transport, has_rtc, addr, role, tcp_failures, expected):
    d = Dialer("n1", "r0", creds=None, peers=None, hello=None, download=None, rtc=object() if has_rtc else None,
               transport=transport)
    d._tcp_failures["n2"] = tcp_failures
    assert d.route({"id": "n2", "region": "r0", "addr": addr, "role": role}) == expected


@pytest.mark.parametrize("me,mine,theirs,first", [
    ("n1", "10.0.0.1:7000", "10.0.0.2:7000", True),  # both reachable: the smaller id
    ("n3", "10.0.0.1:7000", "10.0.0.2:7000", False),
    ("n1", "", "", True),  # neither: the smaller id (over WebRTC)
    ("n3", "", "", False),
    ("n3", "", "10.0.0.2:7000", True),  # behind NAT: it dials the reachable one over TCP
    ("n1", "10.0.0.1:7000", "", False),  # and the reachable one waits for that, not WebRTC
])
def test_who_dials_first(me, mine, theirs, first):
    from patchswarm.protocol import wire
    d = Dialer(me, "r0", creds=None, peers=None, hello=lambda: wire.Hello(me, "r0", "node", mine, []),
               download=None, rtc=object(), transport="auto")
    peer = {"id": "n2", "region": "r1", "addr": theirs, "role": "node"}
    assert d.dials_first(peer) is first
    if first and mine == "" and theirs:
        assert d.route(peer) == "tcp"


def test_a_node_the_tracker_could_not_reach_dials_as_one_without_an_address():
    from patchswarm.protocol import wire
    d = Dialer("n3", "r0", creds=None, peers=None, hello=lambda: wire.Hello("n3", "r0", "node", "10.0.0.3:7000", []),
               download=None, rtc=object(), transport="auto")
    reachable = {"id": "n2", "region": "r0", "addr": "10.0.0.2:7000", "role": "node"}
    assert not d.dials_first(reachable)  # the larger id waits...
    d.unreachable = "10.0.0.3:7000: no answer in 5 s"
    assert d.dials_first(reachable) and d.route(reachable) == "tcp"  # ...unless peers cannot dial it


def test_the_one_that_joined_later_dials_first_whatever_the_ids():
    """Members listed in a joiner's first peer set learn of it only from the tracker's next
    delta (up to 1 s later), and may not want it: the joiner dials them first, whatever the
    ids; a member that came after it is a joiner in its turn and dials it. One that left and
    came back is a joiner again. Reachability still comes first."""
    from patchswarm.protocol import wire
    d = Dialer("n9", "r2", creds=None, peers=None, hello=lambda: wire.Hello("n9", "r2", "node", "10.0.0.9:7000", []),
               download=None, rtc=None)
    old = {"id": "n2", "region": "r1", "addr": "10.0.0.2:7000", "role": "node"}
    natted = {"id": "n3", "region": "r1", "addr": "", "role": "node"}
    d.set_members({"n2": old, "n3": natted, "n9": {"id": "n9"}})
    assert d.dials_first(old)
    assert not d.dials_first(natted)  # reachable here, not there: it dials this one over TCP, as before
    later = {"id": "n5", "region": "r1", "addr": "10.0.0.5:7000", "role": "node"}
    d.set_members({"n2": old, "n3": natted, "n5": later})
    assert d.dials_first(old) and not d.dials_first(later)
    d.set_members({"n3": natted, "n5": later})  # n2 left...
    d.set_members({"n2": old, "n3": natted, "n5": later})  # ...and joined again
    assert not d.dials_first(old)
    first = Dialer("n1", "r1", creds=None, peers=None,
                   hello=lambda: wire.Hello("n1", "r1", "node", "10.0.0.1:7000", []), download=None, rtc=None)
    assert first.dials_first(later)  # no peer set yet: the smaller id
    first.set_members({})  # the swarm's first member
    first.set_members({"n5": later})
    assert not first.dials_first(later)  # n5 joined after it: n5 dials


def test_told_it_is_unreachable_a_node_stops_waiting_to_be_dialed():
    from patchswarm.protocol import wire

    async def main():
        d = Dialer("n3", "r0", creds=None, peers=None, hello=lambda: wire.Hello("n3", "r0", "node", "10.0.0.3:7000", []),
                   download=None, rtc=object(), transport="auto")
        d._second.add("n2")
        d._dial_after["n2"] = trio.current_time() + 2.0  # waiting for n2 (the smaller id) to dial
        d._dial_after["n1"] = trio.current_time() + 8.0  # a backoff after failed dials: stays
        d.set_unreachable("10.0.0.3:7000: refused")
        assert "n2" not in d._dial_after and "n1" in d._dial_after and not d._second

    trio.run(main)


def test_a_refusal_over_the_peers_budget_is_retried_after_the_longest_backoff(monkeypatch):
    """Each try at a member that refused us (node/net/admission.py) costs it a TLS handshake:
    the dialer waits BACKOFF_MAX (jittered 5-10 s) before the next, not the 1-2 s after
    another failure; the member admits it again within 6 s of its last admission."""
    from patchswarm.node import dialer
    from patchswarm.node.net.ratelimit import TokenBucket
    from patchswarm.protocol import wire
    from patchswarm.protocol.errors import PeerRefused, ProtocolError

    outcome = {}

    async def refusing(*a, **k):
        raise outcome["error"]

    monkeypatch.setattr(dialer, "connect", refusing)
    peer = {"id": "n2", "region": "r0", "addr": "10.0.0.2:7000", "role": "node"}

    async def main():
        d = Dialer("n1", "r0", creds=None, peers=None, hello=lambda: wire.Hello("n1", "r0", "node", "x:1", []),
                   download=TokenBucket(None))
        waits = {}
        for name, error in (("refused", PeerRefused("peer 'n2' refused the connection: over budget")),
                            ("broken hello", ProtocolError("expected Hello"))):
            outcome["error"] = error
            d._dial_after.pop("n2", None)
            d._failures.pop("n2", None)  # each a first failure
            await d._dial(peer)
            waits[name] = d._dial_after["n2"] - trio.current_time()
        return waits

    waits = trio.run(main, clock=trio.testing.MockClock())
    assert dialer.BACKOFF_MAX / 2 <= waits["refused"] <= dialer.BACKOFF_MAX
    assert waits["broken hello"] <= 2.0


def test_failed_dials_in_a_row_back_off_2_4_8_then_the_longest(monkeypatch):
    """A member that is down gets a dial from each of its peers after 2, 4, 8, then 10 s
    (each jittered into its upper half), not every 1-2 s for as long as it is down; a dial
    that connects starts the count again, and members that left are forgotten."""
    from patchswarm.node import dialer
    from patchswarm.node.net.ratelimit import TokenBucket
    from patchswarm.protocol import wire

    outcome = {"fail": True}

    async def connecting(*a, **k):
        if outcome["fail"]:
            raise ConnectionRefusedError("refused")
        return "a stream"

    monkeypatch.setattr(dialer, "connect", connecting)
    peer = {"id": "n2", "region": "r0", "addr": "10.0.0.2:7000", "role": "node"}

    class Peers:
        async def run(self, ms, outbound):
            pass

    async def main():
        d = Dialer("n1", "r0", creds=None, peers=Peers(), hello=lambda: wire.Hello("n1", "r0", "node", "x:1", []),
                   download=TokenBucket(None))
        d.set_members({"n2": peer})
        waits = []
        for _ in range(5):
            await d._dial(peer)
            waits.append(d._dial_after["n2"] - trio.current_time())
        outcome["fail"] = False
        await d._dial(peer)  # connects
        outcome["fail"] = True
        await d._dial(peer)
        waits.append(d._dial_after["n2"] - trio.current_time())
        d.set_members({})
        return waits, dict(d._failures), dict(d._tcp_failures)

    waits, failures, tcp_failures = trio.run(main, clock=trio.testing.MockClock())
    for wait, step in zip(waits, (2, 4, 8, 10, 10, 2)):
        assert step / 2 <= wait <= step, (waits, step)
    assert failures == {} and tcp_failures == {}


def test_a_session_that_fails_ends_that_session_not_the_node(monkeypatch, caplog):
    """A session this node dialed that raises (a bug: in a WAN bench run, 2026-12-06, the
    picker's UsageError from a session replaced mid-greeting, since fixed) is logged with its
    traceback and ends that session, as an accepted one's does (node/net/transport.py
    `serve`). Before: it left `_dial` and the dialer's nursery, and the node exited."""
    from patchswarm.node import dialer
    from patchswarm.node.net.ratelimit import TokenBucket
    from patchswarm.protocol import wire

    async def connecting(*a, **k):
        return "a stream"

    monkeypatch.setattr(dialer, "connect", connecting)
    peer = {"id": "n2", "region": "r0", "addr": "10.0.0.2:7000", "role": "node"}

    class Peers:
        runs = 0

        async def run(self, ms, outbound):
            Peers.runs += 1
            raise RuntimeError("a bug in the session")

    async def main():
        d = Dialer("n1", "r0", creds=None, peers=Peers(), hello=lambda: wire.Hello("n1", "r0", "node", "x:1", []),
                   download=TokenBucket(None))
        d.set_members({"n2": peer})
        with caplog.at_level("ERROR", logger=dialer.log.name):
            await d._dial(peer)
            await d._dial(peer)  # and the next dial of it goes on as usual
        assert Peers.runs == 2 and "n2" not in d._dialing

    trio.run(main, clock=trio.testing.MockClock())
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == ["session with node n2 failed"] * 2
    assert all("a bug in the session" in r.exc_text for r in caplog.records if r.levelname == "ERROR")


@pytest.mark.parametrize("addr", ["a..b:7000", "x" * 64 + ".example:7000", "\U0001F600.example:7000"])
def test_a_peer_address_no_lookup_takes_is_a_failed_dial_not_an_exit(addr):
    """A peer's address comes from the tracker, which had it from that peer's Hello. A host
    getaddrinfo cannot encode (an empty label, one over 63 characters) raised UnicodeError out of
    trio.open_tcp_stream, which `_dial` did not catch: the node exited. It is a failed dial
    (node/net/transport.py `parse_addr` refuses the address), backed off like any other."""
    from patchswarm.node.net.ratelimit import TokenBucket
    from patchswarm.protocol import wire

    peer = {"id": "n2", "region": "r0", "addr": addr, "role": "node"}

    async def main():
        d = Dialer("n1", "r0", creds=None, peers=None, hello=lambda: wire.Hello("n1", "r0", "node", "x:1", []),
                   download=TokenBucket(None))
        d.set_members({"n2": peer})
        with trio.fail_after(5):
            await d._dial(peer)
        return d._failures.get("n2"), d._dial_after["n2"] - trio.current_time()

    failures, wait = trio.run(main, clock=trio.testing.MockClock())
    assert failures == 1 and 1.0 <= wait <= 2.0
