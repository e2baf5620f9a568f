"""The tracker: membership, peer lists by region, the latest signed manifests, version notices.

Owns the live member table (one session per member id; a member that stops
heartbeating is dropped), pushing the peer list to every member when the
membership changes, verifying each manifest the origin announces (trainer
signature, swarm id, forward only) and pushing it to every node, and handing
the retained manifests (the latest keyframe's chain, plus recent patches) to
each member that joins. Soft state only: after a restart members reconnect,
the origin re-announces, and work continues.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import InvalidInput, ProtocolError, StaleVersion, UsageError
from patchswarm.protocol.publication import describe
from patchswarm.protocol.versions import NEW, VersionBook

from patchswarm.node.net.transport import CONNECTION_ERRORS, MessageStream, apply_revocations, format_addr, serve
from patchswarm.node.net.trust import Credentials

log = logging.getLogger("patchswarm.tracker")

HEARTBEAT_TIMEOUT = 10.0  # a member silent this long is dropped
RETAIN_PATCHES = 64
PEER_LIST_DELAY = 0.1  # coalesce membership changes into one peer list push


@dataclasses.dataclass(eq=False)
class Member:
    ms: MessageStream
    id: str
    role: str
    region: str
    addr: str
    joined_at: float
    last_seen: float
    versions: list[int]

    def entry(self) -> dict:
        return {"id": self.id, "region": self.region, "addr": self.addr, "role": self.role}


class Tracker:
    def __init__(self, creds: str | Path, listen: str, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 revocations: Path | None = None):
        self.creds = Credentials.load(creds)
        if self.creds.role != "tracker":
            raise UsageError(f"{creds}: expected credentials with role tracker, found {self.creds.role!r}")
        self.listen = listen
        self.listen_addr = listen
        self.heartbeat_timeout = heartbeat_timeout
        self.book = VersionBook(self.creds.swarm_id(), self.creds.trainer_public_key())
        self.members: dict[str, Member] = {}
        self.manifests_rejected = 0
        self.signals_relayed = 0  # WebRTC offers and answers forwarded between members
        self.signals_dropped = 0  # ... addressed to no member
        self._membership_changed = trio.Event()
        self.revocations_file = revocations
        self._revocations_seen: tuple[int, int] | None = None  # (mtime_ns, size) last read

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.listen_addr = await nursery.start(self._serve)
            log.info("tracker for swarm %s listening on %s", self.book.swarm_id, self.listen_addr)
            nursery.start_soon(self._expire_loop)
            nursery.start_soon(self._peer_list_loop)
            if self.revocations_file is not None:
                self._reload_revocations()
                nursery.start_soon(self._revocations_loop)
            task_status.started(self)

    async def _serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await serve(self.listen, self.creds, {"node", "origin"}, self._hello, self._session,
                    on_refused=lambda why: log.warning("refused a connection: %s", why), task_status=task_status)

    def _hello(self) -> wire.Hello:
        return wire.Hello(self.creds.name, "", "tracker", self.listen_addr, [])

    def _advertised(self, ms: MessageStream, listen: str) -> str:
        """The member's listen address, with a wildcard host replaced by the address it came from;
        "" for a member that accepts no connections (--no-listen)."""
        if not listen:
            return ""
        host, _, port = listen.rpartition(":")
        if host.strip("[]") in ("", "0.0.0.0", "::"):
            try:
                remote = ms.stream.getpeername()[0]
            except (AttributeError, OSError):
                return listen
            return format_addr(remote, int(port))
        return listen

    async def _session(self, ms: MessageStream) -> None:
        hello = ms.hello
        now = time.monotonic()
        m = Member(ms, ms.peer_name, ms.peer_role, hello.region, self._advertised(ms, hello.listen), now, now,
                   list(hello.versions))
        old = self.members.get(m.id)
        if old is not None:
            log.info("member %s reconnected; closing its old session", m.id)
            await old.ms.aclose()
        self.members[m.id] = m
        log.info("%s %s joined (region %s, %s, versions %s)", m.role, m.id, m.region, m.addr, m.versions or "none")
        reason = "left"
        try:
            if self.creds.revocations.envelope is not None:
                await ms.send(wire.Revocations(self.creds.revocations.envelope))
            await ms.send(wire.PeerList([x.entry() for x in self.members.values()]))
            for key in self.book.retained(RETAIN_PATCHES):
                await ms.send(wire.VersionNotice(key[0], self.book.envelope(key)))
            self._membership_changed.set()
            while True:
                msg = await ms.receive()
                if msg is None:
                    break
                m.last_seen = time.monotonic()
                if isinstance(msg, wire.Heartbeat):
                    m.versions = list(msg.versions)
                elif isinstance(msg, wire.Announce):
                    await self._announce(m, msg.manifest)
                elif isinstance(msg, wire.Signal):
                    await self._relay_signal(m, msg)
                elif isinstance(msg, wire.Bye):
                    break
                elif not isinstance(msg, wire.Error):
                    raise ProtocolError(f"sent {type(msg).__name__}, which the tracker does not take")
        except ProtocolError as e:
            reason = f"protocol error: {e}"
        except CONNECTION_ERRORS as e:
            reason = f"connection lost ({type(e).__name__})"
        finally:
            if self.members.get(m.id) is m:
                del self.members[m.id]
                self._membership_changed.set()
                log.info("%s %s %s", m.role, m.id, reason)

    async def _announce(self, m: Member, envelope: bytes) -> None:
        if m.role != "origin":
            self.manifests_rejected += 1
            log.warning("node %s tried to announce a version; only the origin may", m.id)
            await m.ms.send(wire.Error("only the origin announces versions"))
            return
        latest = self.book.latest_version
        try:
            status, man = self.book.offer(envelope, None)
        except StaleVersion as e:
            log.debug("ignored an announcement: %s", e)
            return
        except InvalidInput as e:
            self.manifests_rejected += 1
            log.warning("rejected a manifest from %s: %s", m.id, e)
            await m.ms.send(wire.Error(f"manifest rejected: {e}"))
            return
        if status != NEW:
            return
        key = (man.version, man.is_keyframe)
        if latest is not None and man.version < latest and key not in self.book.retained(RETAIN_PATCHES):
            return  # an old object re-announced after a restart, which nobody needs any more
        log.info("%s announced (%d chunks, %s bytes)", describe(key), len(man.chunks), f"{man.total_bytes:,}")
        self._prune()
        notice = wire.VersionNotice(man.version, envelope)
        for other in list(self.members.values()):
            if other.role == "node":
                await self._send_quietly(other, notice)

    async def _relay_signal(self, m: Member, msg: wire.Signal) -> None:
        """WebRTC signalling between members (node/net/rtcsignal.py): to the member it names,
        as from the member that sent it. The tracker checks nothing in it but who is who:
        the recipient checks the sender's signature."""
        to = self.members.get(msg.peer)
        if to is None or to is m:
            self.signals_dropped += 1
            log.debug("dropped a WebRTC %s from %s to %s: not a member", msg.kind, m.id, msg.peer)
            return
        self.signals_relayed += 1
        await self._send_quietly(to, dataclasses.replace(msg, peer=m.id))

    def _prune(self) -> None:
        keep = self.book.retained(RETAIN_PATCHES)
        if keep:
            self.book.forget_below(min(k[0] for k in keep))

    async def _send_quietly(self, m: Member, msg) -> None:
        try:
            with trio.fail_after(5):
                await m.ms.send(msg)
        except CONNECTION_ERRORS:
            await m.ms.aclose()

    async def _peer_list_loop(self) -> None:
        while True:
            await self._membership_changed.wait()
            await trio.sleep(PEER_LIST_DELAY)
            self._membership_changed = trio.Event()
            peers = wire.PeerList([x.entry() for x in self.members.values()])
            for m in list(self.members.values()):
                await self._send_quietly(m, peers)

    def _reload_revocations(self) -> bool:
        """Take the revocation list file if it changed; True if a newer list is now held."""
        try:
            st = self.revocations_file.stat()
        except FileNotFoundError:
            return False
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._revocations_seen:
            return False
        self._revocations_seen = seen
        try:
            ended = apply_revocations(self.creds, self.revocations_file.read_bytes())
        except (InvalidInput, OSError) as e:
            log.warning("ignoring %s: %s", self.revocations_file, e)
            return False
        if ended is None:
            return False
        rl = self.creds.revocations.current
        log.info("revocation list %d: %d certificates revoked; %d member connections ended",
                 rl.sequence, len(rl.serials), ended)
        return True

    async def _revocations_loop(self) -> None:
        """Hand every member a new revocation list within a second of its file changing."""
        while True:
            await trio.sleep(1.0)
            if self._reload_revocations():
                notice = wire.Revocations(self.creds.revocations.envelope)
                for m in list(self.members.values()):
                    await self._send_quietly(m, notice)

    async def _expire_loop(self) -> None:
        while True:
            await trio.sleep(1.0)
            cutoff = time.monotonic() - self.heartbeat_timeout
            for m in list(self.members.values()):
                if m.last_seen < cutoff:
                    log.warning("%s %s silent for %.0f s; dropping it", m.role, m.id, self.heartbeat_timeout)
                    await m.ms.aclose()

    def status(self) -> dict:
        return {
            "swarm_id": self.book.swarm_id,
            "listen": self.listen_addr,
            "latest_version": self.book.latest_version,
            "members": [{**m.entry(), "versions": m.versions} for m in self.members.values()],
            "manifests_rejected": self.manifests_rejected,
            "signals_relayed": self.signals_relayed,
            "signals_dropped": self.signals_dropped,
        }
