"""Manifests between members: passing on the ones this node accepts, asking the tracker for a hinted one.

Owns `ManifestRelay`. The tracker sends each object's signed manifest whole to
a few nodes per region and a VersionHint to the others (tracker/core.py,
`NOTICE_SEEDS`), so that its bytes per version grow with the fleet and not
with the fleet times the manifest. Every node that accepts a manifest new to
it passes it on to its node peers, except the one it came from: it spreads
through each region's peer sets in a few hops. A node that was hinted an
object and still has no manifest for it `HINT_WAIT` seconds later asks the
tracker (ManifestRequest), which answers once per member and object.

A manifest is the trainer's signed statement, so where it comes from does not
matter to trust: the applier's `offer` verifies it whatever the source. Must
not verify or plan itself.
"""

from __future__ import annotations

import logging
import math
from typing import Awaitable, Callable

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.publication import ObjKey

from patchswarm.node.peers import PeerSet, Session

log = logging.getLogger("patchswarm.manifests")

# Passing a manifest on takes a few peer hops of a round trip and 40 KB each;
# a second is long enough that asking the tracker is the exception.
HINT_WAIT = 1.0
MAX_HINTS_WAITING = 1024  # the tracker retains a keyframe and 64 patches: far more is a fault


class ManifestRelay:
    def __init__(self, offer: Callable[[bytes, str, bool], Awaitable[bool]], has: Callable[[ObjKey], bool], peers: PeerSet,
                 ask_tracker: Callable[[object], Awaitable[bool]], wait: float = HINT_WAIT):
        # (envelope, source, from a peer) -> True when new to this node and accepted; from a peer,
        # InvalidInput for one that does not verify (the sender's fault: its session ends)
        self._offer = offer
        self._has = has  # a manifest for this object is held, or the node would refuse one
        self.peers = peers
        self._ask = ask_tracker
        self.wait = wait
        self._due: dict[ObjKey, float] = {}  # hinted objects -> when to ask the tracker
        self._wake = trio.Event()
        self.passed_on = 0  # copies sent to peers
        self.requested = 0  # ManifestRequests sent to the tracker

    async def notice(self, msg: wire.VersionNotice, source: Session | None) -> None:
        """A whole manifest from the tracker (`source` None) or a peer. Its sender's next
        message waits until it is checked (a large one in a worker thread)."""
        if await self._offer(msg.manifest, "tracker" if source is None else f"peer {source.id}", source is not None):
            to = [s for s in self.peers.sessions.values() if s.role == "node" and s is not source]
            self.passed_on += len(self.peers.broadcast(msg, to=to))

    def hinted(self, msg: wire.VersionHint) -> None:
        key = (msg.version, msg.keyframe)
        if self._has(key) or key in self._due:
            return
        if len(self._due) >= MAX_HINTS_WAITING:
            log.warning("ignored a hint for %s: %d hints already wait for their manifest", key, len(self._due))
            return
        self._due[key] = trio.current_time() + self.wait
        self._wake.set()

    def status(self) -> dict:
        return {"manifests_passed_on": self.passed_on, "manifests_requested": self.requested,
                "hints_waiting": len(self._due)}

    async def run(self) -> None:
        """Ask the tracker for each hinted manifest no peer passed on in time, until cancelled."""
        while True:
            now = trio.current_time()
            for key in [k for k, t in self._due.items() if t <= now]:
                del self._due[key]
                # Not connected: nothing to ask now, and a reconnect brings every retained manifest.
                if not self._has(key) and await self._ask(wire.ManifestRequest(*key)):
                    self.requested += 1
                    log.info("asked the tracker for the manifest of %s: no peer passed it on in %.1f s", key,
                             self.wait)
            with trio.move_on_at(min(self._due.values(), default=math.inf)):
                await self._wake.wait()
            self._wake = trio.Event()
