"""WebRTC signalling through a real tracker (node/net/rtcsignal.py, tracker/server.py), in one
process on loopback: a session is as authenticated as a TLS one, and a fingerprint that is
unsigned, signed by someone else or changed after signing is refused and counted."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import InvalidInput
from patchswarm.node.net import trust
from patchswarm.node.net.rtcsignal import RTCSignaller
from patchswarm.node.net.trackerlink import TrackerLink
from patchswarm.node.net.webrtc import IceConfig
from patchswarm.tracker.server import Tracker

pytest.importorskip("aiortc")

LOOPBACK = IceConfig(host_addresses=("127.0.0.1",))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("rtcswarm")
    trust.init_swarm(root / "swarm")
    for name, role in [("tracker", "tracker"), ("n1", "node"), ("n2", "node"), ("n3", "node"), ("o", "origin")]:
        trust.issue(root / "swarm", name, role, root / name)
    trust.init_swarm(root / "rogue")
    trust.issue(root / "rogue", "n1", "node", root / "rogue-n1")
    return root


class Member:
    """A member with a tracker link and a signaller; sessions it accepts land in `accepted`."""

    def __init__(self, creds_dir, tracker_addr):
        self.creds = trust.Credentials.load(creds_dir)
        self.accepted: list = []
        self.got: list = []
        self.link = TrackerLink(tracker_addr, self.creds, self.hello, self.on_tracker)
        self.rtc = RTCSignaller(self.creds, LOOPBACK, self.link.send, self.hello, self.handler)

    def hello(self):
        return wire.Hello(self.creds.name, "r", self.creds.role, "", [])

    async def on_tracker(self, msg):
        if isinstance(msg, wire.Signal):
            await self.rtc.on_signal(msg)

    async def handler(self, ms):
        self.accepted.append(ms)
        while (msg := await ms.receive()) is not None:
            self.got.append(msg)
            await ms.send(wire.Error(f"echo {len(self.got)}"))

    async def start(self, nursery):
        await nursery.start(self.rtc.run)
        nursery.start_soon(self.link.run)
        with trio.fail_after(10):
            while not self.link.connected:
                await trio.sleep(0.02)


async def tracker_and_two(nursery, swarm, before_start=lambda a, b: None):
    """A tracker, and members n1 and n2 joined to it."""
    tracker = await nursery.start(Tracker(swarm / "tracker", "127.0.0.1:0").run)
    a, b = Member(swarm / "n1", tracker.listen_addr), Member(swarm / "n2", tracker.listen_addr)
    before_start(a, b)
    await a.start(nursery)
    await b.start(nursery)
    return tracker, a, b


def test_session_through_the_tracker_is_authenticated_and_carries_messages(swarm):
    async def main():
        async with trio.open_nursery() as n:
            tracker, a, b = await tracker_and_two(n, swarm)
            with trio.fail_after(60):
                ms = await a.rtc.connect("n2", "node")
                assert (ms.peer_name, ms.peer_role, ms.hello.node_id) == ("n2", "node", "n2")
                assert ms.stream.transport == "webrtc" and ms.stream.path == "direct"
                piece = wire.Piece(1, False, 0, 0, 200_000, bytes(range(256)) * 781 + b"abcdefghijklmnopqrstuvwxyzabcdefgh")
                await ms.send(piece)
                assert await ms.receive() == wire.Error("echo 1")
                assert b.got == [piece] and b.accepted[0].peer_name == "n1"
                assert b.accepted[0].peer_serial == trust.verify_statement(
                    b.creds, (swarm / "n1" / "n1.crt").read_bytes(), b"x",
                    trust.sign_statement(a.creds, b"x"))[2]
                await ms.aclose()
            assert tracker.signals_relayed == 2 and not a.rtc.refused and not b.rtc.refused
            n.cancel_scope.cancel()

    trio.run(main)


def _forgeries(swarm, good: wire.Signal, signer_creds, statement_for):
    """Offers from n1 to n2 that must each be refused, by name."""
    rogue = trust.Credentials.load(swarm / "rogue-n1")
    n3 = trust.Credentials.load(swarm / "n3")
    origin = trust.Credentials.load(swarm / "o")
    changed_sdp = good.sdp.replace("a=fingerprint:sha-256 ", "a=fingerprint:sha-256 00:", 1)

    def signed_by(creds, **kw):
        msg = dataclasses.replace(good, cert=trust.member_certificate(creds), **kw)
        return dataclasses.replace(msg, signature=trust.sign_statement(creds, statement_for(msg, creds.name)))

    return {
        "unsigned": dataclasses.replace(good, signature=b""),
        "fingerprint changed after signing": dataclasses.replace(good, sdp=changed_sdp),
        "no fingerprint": signed_by(signer_creds, sdp="v=0\r\n"),
        "another swarm's certificate": signed_by(rogue),
        "another member's certificate": signed_by(n3),
        "a role this member does not take": signed_by(origin),
        "signed for another recipient": dataclasses.replace(
            good, signature=trust.sign_statement(signer_creds, wire.signal_statement(
                signer_creds.swarm_id(), "n1", "n3", "offer", good.session, good.sdp))),
    }


async def three_members(nursery, swarm):
    """A tracker, and members n1, n2 and n3 joined to it."""
    tracker = await nursery.start(Tracker(swarm / "tracker", "127.0.0.1:0").run)
    members = [Member(swarm / name, tracker.listen_addr) for name in ("n1", "n2", "n3")]
    for m in members:
        await m.start(nursery)
    return members


def test_forged_offers_are_refused_and_counted(swarm):
    async def main():
        async with trio.open_nursery() as n:
            tracker, a, b = await tracker_and_two(n, swarm)
            peer = a.rtc._rtc.peer()
            sdp = await peer.local_offer()
            good = a.rtc._signal("n2", "offer", 42, sdp)

            def statement_for(msg, sender):  # what a sender named `sender` would sign for this message
                return wire.signal_statement(a.creds.swarm_id(), sender, "n2", "offer", msg.session, msg.sdp)

            forged = _forgeries(swarm, dataclasses.replace(good, peer="n1"), a.creds, statement_for)
            for why, msg in forged.items():
                with pytest.raises(InvalidInput):
                    b.rtc._check(msg, "offer", b.rtc.allowed_roles)
            before = sum(b.rtc.refused.values())
            for msg in forged.values():  # through the tracker: the same refusals, counted
                await a.link.send(dataclasses.replace(msg, peer="n2"))
            with trio.fail_after(10):
                while sum(b.rtc.refused.values()) < before + len(forged):
                    await trio.sleep(0.02)
            assert not b.accepted
            name, role, _, _ = b.rtc._check(dataclasses.replace(good, peer="n1"), "offer", b.rtc.allowed_roles)
            assert (name, role) == ("n1", "node")
            await peer.aclose()
            n.cancel_scope.cancel()

    trio.run(main)


def test_tracker_relays_only_to_members_and_stamps_the_sender(swarm):
    async def main():
        async with trio.open_nursery() as n:
            seen = []

            async def record(msg):
                seen.append(msg)
            tracker, a, b = await tracker_and_two(n, swarm, lambda a, b: setattr(b.link, "_on_message", record))
            sig = wire.Signal("nobody", "offer", 1, "v=0", b"", b"")
            await a.link.send(sig)
            await a.link.send(dataclasses.replace(sig, peer="n1"))  # to itself
            await a.link.send(dataclasses.replace(sig, peer="n2"))
            with trio.fail_after(10):
                while not any(isinstance(m, wire.Signal) for m in seen):
                    await trio.sleep(0.02)
            assert [m.peer for m in seen if isinstance(m, wire.Signal)] == ["n1"]
            assert (tracker.signals_relayed, tracker.signals_dropped) == (1, 2)
            n.cancel_scope.cancel()

    trio.run(main)


def test_an_offer_asks_for_the_relay_only_when_it_names_a_relay_candidate():
    from patchswarm.node.net.webrtc import offers_relay

    host = "a=candidate:1 1 udp 2130706431 192.168.1.2 5000 typ host"
    srflx = "a=candidate:2 1 udp 1694498815 203.0.113.7 6000 typ srflx raddr 192.168.1.2 rport 5000"
    relay = "a=candidate:3 1 udp 16777215 203.0.113.9 7000 typ relay raddr 203.0.113.7 rport 6000"
    assert not offers_relay("\r\n".join(["v=0", host, srflx]))
    assert offers_relay("\r\n".join(["v=0", host, srflx, relay]))
    assert not offers_relay("v=0\r\ns=typ relay\r\n")  # only candidate lines count
    assert not IceConfig(stun="s:1", turn="turn:t:2").servers(relay=False)[1:]  # TURN left out
    assert len(IceConfig(stun="s:1", turn="turn:t:2").servers()) == 2


def test_one_member_cannot_hold_every_answering_slot(swarm):
    """Offers being answered at once are capped (MAX_ANSWERING: each costs a peer connection).
    Before, the cap was for all members together: one member sending that many validly signed
    offers it never meant to complete held every slot (each up to 10-30 s, renewed as they
    lapse) and every other member's offer was refused as "busy". Now one member may have
    MAX_ANSWERING_PER_MEMBER offers answered at once."""
    from patchswarm.node.net import rtcsignal

    async def main():
        async with trio.open_nursery() as n:
            mallory, victim, honest = await three_members(n, swarm)
            peer = mallory.rtc._rtc.peer()
            sdp = await peer.local_offer()  # a live offer it never completes
            for session in range(rtcsignal.MAX_ANSWERING):
                await mallory.link.send(mallory.rtc._signal("n2", "offer", session, sdp))
            with trio.fail_after(10):
                while victim.rtc._answering + sum(victim.rtc.refused.values()) < rtcsignal.MAX_ANSWERING:
                    await trio.sleep(0.02)
            with trio.fail_after(8):  # well within the time mallory's offers hold their slots
                ms = await honest.rtc.connect("n2", "node")
            assert ms.peer_name == "n2" and victim.rtc.refused["busy"] == 0
            assert victim.rtc.refused["busy with that member"] == rtcsignal.MAX_ANSWERING - rtcsignal.MAX_ANSWERING_PER_MEMBER
            await ms.aclose()
            await peer.aclose()
            n.cancel_scope.cancel()

    trio.run(main)


def _unusable(sdp: str) -> list[str]:
    """A real SDP with one line changed so that aiortc's parser fails other than with ValueError:
    an unknown DTLS role (KeyError), a connection line cut short (AssertionError)."""
    bad_setup = "\r\n".join("a=setup:bogus" if line.startswith("a=setup:") else line for line in sdp.split("\r\n"))
    bad_c = "\r\n".join("c=IN" if line.startswith("c=") else line for line in sdp.split("\r\n"))
    assert bad_setup != sdp and bad_c != sdp
    return [bad_setup, bad_c]


def test_a_member_s_signed_sdp_that_aiortc_cannot_parse_costs_its_attempt_not_the_node(swarm):
    """A member signs any SDP it likes. One aiortc's parser fails on with a KeyError or an
    AssertionError (`a=setup:bogus`, a `c=` line cut short; only ValueError was caught)
    escaped the answering task into the signaller's nursery, and, as an answer, the dialer's:
    either ended the whole node (every peer, the weights, the local socket). Now such an SDP
    is InvalidInput: the offer is not answered, the dial fails, and the node serves on."""
    async def main():
        async with trio.open_nursery() as n:
            mallory, victim, honest = await three_members(n, swarm)
            peer = mallory.rtc._rtc.peer()
            offers = _unusable(await peer.local_offer())
            await peer.aclose()
            for session, sdp in enumerate(offers):
                await mallory.link.send(mallory.rtc._signal("n2", "offer", session, sdp))

            async def answer_badly(msg):  # mallory answers the victim's offers with unusable SDPs
                if isinstance(msg, wire.Signal) and msg.kind == "offer":
                    await mallory.link.send(mallory.rtc._signal(msg.peer, "answer", msg.session, answers.pop()))
            other = victim.rtc._rtc.peer()
            answers = _unusable((await other.local_offer()).replace("a=setup:actpass", "a=setup:active"))
            await other.aclose()
            mallory.link._on_message = answer_badly
            for _ in range(2):
                with trio.fail_after(10), pytest.raises(InvalidInput, match="SDP"):
                    await victim.rtc.connect("n1", "node")
            with trio.fail_after(10):  # the victim still answers, and mallory's offers were not taken
                ms = await honest.rtc.connect("n2", "node")
                while not victim.accepted:
                    await trio.sleep(0.02)
            assert ms.peer_name == "n2" and [s.peer_name for s in victim.accepted] == ["n3"]
            await ms.aclose()
            n.cancel_scope.cancel()

    trio.run(main)
