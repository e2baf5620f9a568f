"""WebRTC sessions between members: signalled through the tracker, bound to swarm identities.

Owns `RTCSignaller`: dialing a member over WebRTC (`connect`: an offer to it
through the tracker, its answer back) and answering the offers the tracker
relays (`on_signal`), each ending as an authenticated `MessageStream`
(node/net/transport.py) over a data channel (node/net/webrtc.py), exactly as a
TLS connection ends: the peer's name, role, certificate serial and region (if
its certificate names one) known, Hellos exchanged and checked against them. Must not choose whom to dial (node/dialer.py)
or say anything on a session.

Why a data channel is as authenticated as a TLS connection: every offer and
answer carries the sender's swarm certificate and its signature over the
SDP, which names the DTLS certificate fingerprint (`wire.signal_statement`:
swarm, sender, recipient, step, attempt, SDP). The recipient takes it only if
the certificate is the swarm CA's, unrevoked, of the member the tracker says
sent it and of a role it accepts, and the signature holds; DTLS then accepts
only the certificate with that fingerprint (aiortc checks it). The tracker
relays but cannot forge: a changed SDP breaks the signature, another
certificate breaks DTLS. Refusals are counted by reason (`refused`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
from typing import Awaitable, Callable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import InvalidInput, PatchswarmError

from patchswarm.node.net.transport import CONNECTION_ERRORS, MessageStream, exchange_hello, one_line
from patchswarm.node.net.trust import Credentials, member_certificate, sign_statement, verify_statement
from patchswarm.node.net.webrtc import IceConfig, RTCLoop, RTCPeer, offers_relay, sdp_fingerprints

log = logging.getLogger("patchswarm.webrtc")

CONNECT_SECONDS = 30.0  # an offer to an open channel with Hellos done: signalling, ICE, DTLS, SCTP
# With a TURN server configured, a first offer without relay candidates gets this long: aioice
# nominates the first pair whose check succeeds, so offered together a check through the relay
# can win over a direct pair still waiting for the other side's NAT mapping (seen in
# bench/transport.py --nat). Peers behind symmetric NAT pay it once per connection.
DIRECT_SECONDS = 8.0
MAX_ANSWERING = 16  # offers being answered at once; more are refused (each costs a peer connection)
# ... of them from one member: an honest dialer has one attempt at a time (direct, then through
# the relay); a second covers one that lapses as the next arrives. *Why:* with the global cap
# alone, one member sending MAX_ANSWERING signed offers it never meant to complete held every
# slot, and every other member's offer was refused as busy (tests/test_rtcsignal.py).
MAX_ANSWERING_PER_MEMBER = 2


@dataclasses.dataclass(eq=False)
class _Offered:
    peer: str
    answer: wire.Signal | None = None
    arrived: trio.Event = dataclasses.field(default_factory=trio.Event)


class RTCSignaller:
    def __init__(self, creds: Credentials, ice: IceConfig, send: Callable[[wire.Signal], Awaitable[bool]],
                 hello: Callable[[], wire.Hello], handler: Callable[[MessageStream], Awaitable[None]], *,
                 allowed_roles: frozenset[str] = frozenset({"node"}),
                 on_receive: Callable[[int], Awaitable[None]] | None = None):
        self.creds = creds
        self.ice = ice
        self._send = send  # to the tracker; False when not connected
        self.hello = hello
        self.handler = handler
        self.allowed_roles = allowed_roles
        self.on_receive = on_receive
        self.swarm_id = creds.swarm_id()
        self.refused: collections.Counter[str] = collections.Counter()  # reason -> signals refused
        self._cert = member_certificate(creds)
        self._offered: dict[int, _Offered] = {}  # session -> our offer awaiting its answer
        self._answering = 0
        self._answering_from: collections.Counter[str] = collections.Counter()  # member -> offers being answered
        self._rtc: RTCLoop | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Hold the asyncio loop and the answering tasks until cancelled."""
        async with RTCLoop(self.ice) as rtc:
            try:
                async with trio.open_nursery() as nursery:
                    self._rtc, self._nursery = rtc, nursery
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                self._rtc = self._nursery = None

    # ------------------------------------------------------------ dialing

    async def connect(self, peer_id: str, role: str) -> MessageStream:
        """An authenticated session with member `peer_id` over a data channel.

        With a TURN server configured, a first offer gathers no relay candidates
        (DIRECT_SECONDS); only if it does not connect is a second one made with them.
        Raises as `transport.connect` does: a connection error (no tracker, no
        answer, ICE or DTLS failed, within CONNECT_SECONDS) or InvalidInput /
        ProtocolError (the answer or the Hello does not hold)."""
        if self._rtc is None:
            raise trio.BrokenResourceError("WebRTC is not running")
        if self.ice.turn:  # direct first, the relay only where no direct path opens
            try:
                return await self._dial(peer_id, role, relay=False, seconds=DIRECT_SECONDS)
            except CONNECTION_ERRORS as e:
                log.info("no direct WebRTC path to %s (%s): trying through the TURN relay", peer_id, one_line(e))
        return await self._dial(peer_id, role, relay=True, seconds=CONNECT_SECONDS)

    async def _dial(self, peer_id: str, role: str, relay: bool, seconds: float) -> MessageStream:
        rtc = self._rtc
        if rtc is None:
            raise trio.BrokenResourceError("WebRTC is not running")
        peer = rtc.peer(relay=relay)
        session = secrets.randbits(63)
        try:
            with trio.fail_after(seconds):
                offer = await peer.local_offer()
                waiting = self._offered[session] = _Offered(peer_id)
                if not await self._send(self._signal(peer_id, "offer", session, offer)):
                    raise trio.BrokenResourceError("no tracker connection to signal through")
                await waiting.arrived.wait()
                who = self._check(waiting.answer, "answer", frozenset({role}))
                await peer.accept_answer(waiting.answer.sdp)  # InvalidInput for one aiortc cannot take
                return await self._session(peer, *who)
        except BaseException:
            with trio.CancelScope(shield=True):
                await peer.aclose()
            raise
        finally:
            self._offered.pop(session, None)

    # ------------------------------------------------------------ answering

    async def on_signal(self, msg: wire.Signal) -> None:
        """A Signal the tracker relayed (`msg.peer` is its sender). Returns at once."""
        if msg.kind == "answer":
            waiting = self._offered.get(msg.session)
            if waiting is None or waiting.peer != msg.peer or waiting.answer is not None:
                self._refuse("answer to no offer of ours", msg, "no offer of ours to them with that session")
                return
            waiting.answer = msg
            waiting.arrived.set()
        elif self._nursery is None:
            self._refuse("webrtc off", msg, "WebRTC is not running here")
        elif self._answering >= MAX_ANSWERING:
            self._refuse("busy", msg, f"{MAX_ANSWERING} offers are being answered already")
        elif self._answering_from[msg.peer] >= MAX_ANSWERING_PER_MEMBER:
            self._refuse("busy with that member", msg, f"{MAX_ANSWERING_PER_MEMBER} offers of {msg.peer!r} "
                                                       f"are being answered already")
        else:
            self._answering += 1
            self._answering_from[msg.peer] += 1
            self._nursery.start_soon(self._answer, msg)

    async def _answer(self, msg: wire.Signal) -> None:
        peer = None
        try:
            try:
                who = self._check(msg, "offer", self.allowed_roles)
            except InvalidInput:
                return
            relay = offers_relay(msg.sdp)  # an offer without relay candidates asks for a direct path
            peer = self._rtc.peer(relay=relay)
            with trio.fail_after(CONNECT_SECONDS if relay else DIRECT_SECONDS + 2.0):
                answer = await peer.local_answer(msg.sdp)
                if not await self._send(self._signal(msg.peer, "answer", msg.session, answer)):
                    raise trio.BrokenResourceError("no tracker connection to answer through")
                ms = await self._session(peer, *who)
        except (*CONNECTION_ERRORS, PatchswarmError) as e:  # InvalidInput: an SDP aiortc cannot take
            log.info("WebRTC offer from %s not completed: %s", msg.peer, one_line(e))
            if peer is not None:
                with trio.CancelScope(shield=True):
                    await peer.aclose()
            return
        finally:
            self._answering -= 1
            self._answering_from[msg.peer] -= 1
            if not self._answering_from[msg.peer]:
                del self._answering_from[msg.peer]  # one entry per member with an offer in hand, no more
        try:
            await self.handler(ms)
        except Exception:  # a bug must not take the signaller (and every WebRTC peer) down
            log.exception("connection handler for %s failed", ms.peer_name)
        finally:
            await ms.aclose()

    # ------------------------------------------------------------ both

    async def _session(self, peer: RTCPeer, name: str, role: str, serial: str, region: str | None) -> MessageStream:
        stream = await peer.open()
        ms = MessageStream(stream, name, role, on_receive=self.on_receive, peer_serial=serial, creds=self.creds,
                           peer_region=region)  # its Hello must then say that region (transport.exchange_hello)
        await exchange_hello(ms, self.hello())
        return ms

    def _signal(self, to: str, kind: str, session: int, sdp: str) -> wire.Signal:
        statement = wire.signal_statement(self.swarm_id, self.creds.name, to, kind, session, sdp)
        return wire.Signal(to, kind, session, sdp, self._cert, sign_statement(self.creds, statement))

    def _check(self, msg: wire.Signal, kind: str, roles: frozenset[str]) -> tuple[str, str, str, str | None]:
        """(name, role, serial, region) of the member that signed `msg` (its certificate's region,
        None if none); InvalidInput (counted) if it does not hold."""
        try:
            if msg.kind != kind:
                raise InvalidInput(f"expected an {kind}, found an {msg.kind}")
            if not sdp_fingerprints(msg.sdp):
                raise InvalidInput("expected a DTLS fingerprint in the SDP, found none")
            statement = wire.signal_statement(self.swarm_id, msg.peer, self.creds.name, kind, msg.session, msg.sdp)
            name, role, serial, region = verify_statement(self.creds, msg.cert, statement, msg.signature)
            if name != msg.peer:
                raise InvalidInput(f"relayed as from {msg.peer!r}, signed with the certificate of {name!r}")
            if role not in roles:
                raise InvalidInput(f"expected role {' or '.join(sorted(roles))}, found {role!r}")
        except InvalidInput as e:
            self._refuse("fingerprint not signed by the sender", msg, str(e))
            raise
        if self.creds.require_region and region is None:
            why = self.creds.no_region_refusal(name, role)
            self._refuse("no region", msg, why)
            raise InvalidInput(why)
        return name, role, serial, region

    def _refuse(self, reason: str, msg: wire.Signal, detail: str) -> None:
        self.refused[reason] += 1
        log.warning("refused a WebRTC %s from %s: %s", msg.kind, msg.peer, detail)
