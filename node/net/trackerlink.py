"""A member's standing connection to the tracker: join, heartbeat, hear, rejoin.

Owns `TrackerLink`: dial the tracker (mutual TLS, role tracker), heartbeat
with the member's current version, hand every message to the owner, and on
any loss reconnect with capped exponential backoff, jittered (node/net/backoff.py)
so a fleet that lost the same tracker does not come back in lockstep, for ever. The tracker is
soft state, so a reconnect is the whole recovery: the owner's `on_connect`
re-announces what the tracker must know. Must not interpret messages, but
for the swarm's revocation list, which is trust: the link takes it into the
credentials every handshake asks, and keeps it in `revocations_file`.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Awaitable, Callable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import InvalidInput, PatchswarmError, PeerRefused, ProtocolError

from patchswarm.node.net.backoff import Backoff
from patchswarm.node.net.transport import CONNECTION_ERRORS, MessageStream, apply_revocations, connect, one_line
from patchswarm.node.net.trust import Credentials

log = logging.getLogger("patchswarm.tracker-link")
HEARTBEAT_SECONDS = 2.0
BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0


class TrackerLink:
    def __init__(self, addr: str, creds: Credentials, hello: Callable[[], wire.Hello],
                 on_message: Callable[[object], Awaitable[None]],
                 on_connect: Callable[[MessageStream], Awaitable[None]] | None = None,
                 revocations_file: Path | None = None):
        self.addr = addr
        self.creds = creds
        self._hello = hello
        self._on_message = on_message
        self._on_connect = on_connect
        self.stream: MessageStream | None = None
        self.hello_sent: wire.Hello | None = None  # the Hello of the current (or last) session
        self.backoff = Backoff(BACKOFF_MIN, BACKOFF_MAX)
        self.stopping = False  # set by a member that drains before it stops (node/daemon.py drain)
        # The revocation list is trust, not swarm policy: the link takes it into the
        # credentials itself (every handshake asks them), and keeps it across restarts.
        self._revocations_file = revocations_file
        if revocations_file is not None and revocations_file.exists():
            try:
                apply_revocations(creds, revocations_file.read_bytes())
            except (InvalidInput, OSError) as e:
                log.warning("ignoring %s: %s", revocations_file, one_line(e))

    def _take_revocations(self, envelope: bytes) -> None:
        try:
            ended = apply_revocations(self.creds, envelope)
        except InvalidInput as e:  # unsigned, another swarm's, or older than the one held
            log.warning("tracker sent a revocation list this member does not take: %s", one_line(e))
            return
        if ended is None:
            return
        rl = self.creds.revocations.current
        log.info("revocation list %d: %d certificates revoked; %d connections ended", rl.sequence, len(rl.serials), ended)
        if self._revocations_file is not None:
            tmp = self._revocations_file.with_name(self._revocations_file.name + ".tmp")
            tmp.write_bytes(envelope)
            os.replace(tmp, self._revocations_file)

    @property
    def connected(self) -> bool:
        return self.stream is not None

    async def run(self) -> None:
        while True:
            try:
                hello = self._hello()
                ms = await connect(self.addr, self.creds, {"tracker"}, hello)
            except (*CONNECTION_ERRORS, PatchswarmError) as e:
                delay = self.backoff.next()
                if isinstance(e, PeerRefused):  # it answered: it says why (a budget, this member's region)
                    log.warning("tracker %s refused this member: %s; retrying in %.1f s", self.addr,
                                one_line(e.reason), delay)
                else:
                    log.warning("tracker %s unreachable (%s); retrying in %.1f s", self.addr, one_line(e), delay)
                await trio.sleep(delay)
                continue
            self.backoff.reset()
            self.hello_sent = hello
            log.info("joined the swarm via tracker %s", self.addr)
            try:
                async with trio.open_nursery() as n:
                    self.stream = ms
                    if self._on_connect is not None:
                        await self._on_connect(ms)
                    n.start_soon(self._heartbeat, ms)
                    while True:
                        msg = await ms.receive()
                        if msg is None:
                            raise trio.BrokenResourceError("tracker closed the connection")
                        if isinstance(msg, wire.Bye):
                            raise trio.BrokenResourceError(f"tracker said bye: {msg.reason}")
                        if isinstance(msg, wire.Error):
                            log.warning("tracker says: %s", msg.message)
                            continue
                        if isinstance(msg, wire.Revocations):
                            self._take_revocations(msg.envelope)
                            continue
                        await self._on_message(msg)
            except* (*CONNECTION_ERRORS, ProtocolError) as group:
                if self.stopping or trio.current_effective_deadline() == -math.inf:
                    # This member is stopping (draining, or its SIGTERM's cancel came while the loss
                    # was read): a tracker stopped beside it (a fleet or a demo shut down) is no
                    # fault to warn of.
                    log.info("lost the tracker (%s) as this member stops", one_line(group.exceptions[0]))
                else:
                    log.warning("lost the tracker (%s); reconnecting", one_line(group.exceptions[0]))
            finally:
                self.stream = None
                await ms.aclose()
            await trio.sleep(self.backoff.next())

    async def _heartbeat(self, ms: MessageStream) -> None:
        while True:
            with trio.fail_after(HEARTBEAT_SECONDS * 5):
                await ms.send(self._heartbeat_of(ms))
            await trio.sleep(HEARTBEAT_SECONDS)

    def _heartbeat_of(self, ms: MessageStream) -> wire.Heartbeat:
        # A heartbeat says the member's uplink now where the tracker reads it (revision 6): it
        # may have moved since the Hello (protocol/uplinkmeter.py UplinkReport).
        hello = self._hello()
        says_uplink = wire.revision(ms.wire_revision) >= wire.UPLINK_NOW_REVISION
        return wire.Heartbeat(hello.versions, uplink=hello.uplink if says_uplink else None)

    async def heartbeat_now(self) -> bool:
        """A heartbeat now, besides the periodic ones (the member's uplink changed: the sooner the
        tracker has it, the sooner the region plans with it); False if not connected."""
        ms = self.stream
        return ms is not None and await self.send(self._heartbeat_of(ms))

    async def send(self, msg) -> bool:
        """Send now if connected; False if not (the owner's on_connect catches up later)."""
        ms = self.stream
        if ms is None:
            return False
        try:
            await ms.send(msg)
            return True
        except CONNECTION_ERRORS:
            return False
