"""Which manifests a member trusts, and which objects take a node from its version to the latest. Sans-IO.

Owns `VersionBook`: signed manifests in (verified against the trainer key,
checked against the swarm id, never two different manifests for one object,
never an object at or below the version the node already holds), and
`plan(current_version, current_hash)`: the objects to apply, in order, that
reach the highest version reachable for the fewest bytes: the patch chain, or
a keyframe plus the patches after it (late joiners, or nodes too far behind).

The tracker uses the same book to keep what it hands to joining nodes
(`retained`). No clocks, no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .errors import ConflictingManifest, InvalidInput, StaleVersion
from .manifest import Manifest, ObjKey, describe, key_of, origin_region_of, peek_key, verify_manifest

KNOWN = "known"
NEW = "new"


@dataclasses.dataclass(frozen=True, eq=False)
class Verified:
    """What `VersionBook.verify` found: the envelope's SHA-256 and its manifest, under
    the key it was checked with. `offer` takes it in place of checking again."""

    digest: bytes
    manifest: Manifest
    key: Ed25519PublicKey


class VersionBook:
    def __init__(self, swarm_id: str, trainer_key: Ed25519PublicKey):
        self.swarm_id = swarm_id
        self._key = trainer_key
        self._manifests: dict[ObjKey, Manifest] = {}
        self._envelopes: dict[ObjKey, bytes] = {}
        self._by_digest: dict[bytes, ObjKey] = {}  # SHA-256 of each held envelope
        self._unusable: set[ObjKey] = set()  # held, but their verified chunks did not apply

    # ------------------------------------------------------------ facts in

    def verify(self, envelope: bytes) -> Verified:
        """The signature check and decode `offer` does, alone: it reads nothing of the book
        that changes, so a caller may run it in a worker thread (a 140,000-tensor keyframe
        manifest takes 0.47 s) and hand the result to `offer`. Raises as `offer` does for a
        manifest the trainer did not sign."""
        return Verified(hashlib.sha256(envelope).digest(), verify_manifest(envelope, self._key), self._key)

    def needs_check(self, envelope: bytes, current_version: int | None = None, drop_superseded: bool = False) -> bool:
        """Whether `offer(envelope, current_version, drop_superseded=)` would verify it: False
        for an envelope held (KNOWN) or one it refuses unread."""
        digest = hashlib.sha256(envelope).digest()
        if digest in self._by_digest:
            return False
        key = peek_key(envelope)
        return key is None or self._refusal(key, current_version, drop_superseded) is None

    def refuses(self, key: ObjKey, current_version: int | None, drop_superseded: bool = False) -> bool:
        """Whether `offer` would refuse any manifest of `key` not held now, unread."""
        return self._refusal(key, current_version, drop_superseded) is not None

    def _refusal(self, key: ObjKey, current_version: int | None, drop_superseded: bool) -> str | None:
        """Why a manifest of `key` is refused before any check, or None. An old keyframe's
        manifest that peers pass on again, or a member replays from a long history, costs its
        digest and a few header bytes, not a check and decode (0.47 s at 140,000 tensors) per
        copy. None for a held object: its envelope is always checked (a second signed
        manifest of it is the trainer's fault, and said so)."""
        if key in self._envelopes:
            return None
        if current_version is not None and key[0] <= current_version:
            return f"expected a version above the current {current_version}, found {key[0]} (replayed or older)"
        keyframe = self.latest_keyframe if drop_superseded else None
        if keyframe is not None and self._superseded(key, keyframe, current_version):
            return (f"expected a version above v{keyframe}'s keyframe, which is held, found {key[0]} "
                    f"(superseded: no plan uses it)")
        return None

    @staticmethod
    def _superseded(key: ObjKey, keyframe: int, current_version: int | None) -> bool:
        """Whether no plan from `current_version` uses `key` once `keyframe`'s is held: an
        older keyframe; with no version yet, anything at or below it but that keyframe. (A
        patch below it may still be a link of the chain from a version the member holds.)"""
        if key[1]:
            return key[0] < keyframe
        return current_version is None and key[0] <= keyframe

    def offer(self, envelope: bytes, current_version: int | None = None,
              verified: Verified | None = None, drop_superseded: bool = False) -> tuple[str, Manifest]:
        """Verify a signed manifest; (NEW, m) if it is new, (KNOWN, m) if already held.

        Raises SignatureError / CorruptData for a manifest the trainer did not
        sign, InvalidInput for another swarm's, ConflictingManifest for a
        second, different manifest of one object, StaleVersion for an object
        at or below `current_version` that is not already held. With `verified`
        (from `verify` of these bytes, with this book's key) the check is not
        done again.

        `drop_superseded`: a running node's offers, which keep only what a plan from
        `current_version` can use. No plan goes through a keyframe below the latest one
        held (that keyframe reaches every version the older one does, for fewer bytes),
        nor, for a member with no version yet, through anything at or below it: such an
        object is refused too (StaleVersion, unread), and held ones are dropped when a
        later keyframe is taken. *Why:* a member passing a node with no version the old
        keyframes of a long history had each one checked (0.47 s at 140,000 tensors),
        held (~47 MB) and passed on to the node's peers. Not for the tracker or the origin
        (`retained` hands nodes a little behind the patches before the latest keyframe),
        nor for a store's objects read back at a start, before the base they follow is.
        """
        # The same envelope again (from the tracker, then from peers) is known by its bytes: a
        # 140,000-tensor keyframe's costs seconds to verify and decode, its digest milliseconds.
        digest = hashlib.sha256(envelope).digest() if isinstance(envelope, (bytes, bytearray, memoryview)) else None
        known = self._by_digest.get(digest)
        if known is not None:
            return KNOWN, self._manifests[known]
        peeked = peek_key(envelope)
        refusal = None if peeked is None else self._refusal(peeked, current_version, drop_superseded)
        if refusal is not None:
            raise StaleVersion(f"manifest {describe(peeked)}: {refusal}; not checked")
        if verified is not None and verified.digest == digest and verified.key is self._key:
            m = verified.manifest
        else:
            m = verify_manifest(envelope, self._key)
        if m.swarm_id != self.swarm_id:
            raise InvalidInput(f"manifest: expected swarm {self.swarm_id!r}, found {m.swarm_id!r}")
        key = key_of(m)
        held = self._envelopes.get(key)
        if held is not None:
            if held == bytes(envelope):
                return KNOWN, m
            raise ConflictingManifest(f"manifest {describe(key)}: a different, validly signed manifest "
                                      f"is already held (target {self._manifests[key].target_hash[:16]}…, "
                                      f"found {m.target_hash[:16]}…)")
        refusal = self._refusal(key, current_version, drop_superseded)  # its first fields did not parse alone
        if refusal is not None:
            raise StaleVersion(f"manifest {describe(key)}: {refusal}")
        self._manifests[key] = m
        self._envelopes[key] = bytes(envelope)
        self._by_digest[digest] = key
        if drop_superseded and key[1] and key[0] == self.latest_keyframe:
            for old in [k for k in self._manifests if self._superseded(k, key[0], current_version)]:
                self.discard(old)
        return NEW, m

    def mark_unusable(self, key: ObjKey) -> None:
        """`key`'s verified chunks did not apply (the trainer published a patch that does not
        fit its base, or a keyframe whose state is not its hash): no plan goes through it,
        and as a keyframe it supersedes nothing. Its manifest stays held, so the copies peers
        pass on are known by their digest, not checked again. *Why:* the node used to drop it
        from the plan it was given, which left the patches after a bad keyframe planned onto a
        state they do not follow (each then failed and was marked in turn), where the chain
        from the node's version, or an older keyframe, was a path; and a node with no version
        refused the older keyframes as superseded by the one it could not use."""
        self._unusable.add(key)

    @property
    def unusable(self) -> frozenset[ObjKey]:
        return frozenset(self._unusable)

    def discard(self, key: ObjKey) -> None:
        """Forget one object (its publisher withdrew it before announcing it)."""
        self._manifests.pop(key, None)
        envelope = self._envelopes.pop(key, None)
        if envelope is not None:
            self._by_digest.pop(hashlib.sha256(envelope).digest(), None)

    def forget_below(self, version: int) -> None:
        """Drop manifests of versions below `version` (they can never be needed again)."""
        for key in [k for k in self._manifests if k[0] < version]:
            self.discard(key)
        self._unusable = {k for k in self._unusable if k[0] >= version}

    # ------------------------------------------------------------ questions

    def get(self, key: ObjKey) -> Manifest | None:
        return self._manifests.get(key)

    def envelope(self, key: ObjKey) -> bytes | None:
        return self._envelopes.get(key)

    def keys(self) -> list[ObjKey]:
        return sorted(self._manifests)

    @property
    def latest_version(self) -> int | None:
        return max((k[0] for k in self._manifests), default=None)

    @property
    def latest_keyframe(self) -> int | None:
        """The version of the latest keyframe held that is not unusable."""
        return max((k[0] for k in self._manifests if k[1] and k not in self._unusable), default=None)

    @property
    def origin_region(self) -> str | None:
        """The origin's region as the newest manifest held that names one says it
        (protocol/manifest.py `origin_region_of`); None if none does."""
        for key in sorted(self._manifests, reverse=True):
            region = origin_region_of(self._manifests[key])
            if region is not None:
                return region
        return None

    def retained(self, max_patches: int) -> list[ObjKey]:
        """What a tracker keeps: the latest keyframe, every patch after it, and up to
        `max_patches` patches in all (so nodes a little behind take patches, not a keyframe)."""
        keyframes = sorted(k for k in self._manifests if k[1])
        patches = sorted(k for k in self._manifests if not k[1])
        keep = set(patches[-max_patches:]) if max_patches > 0 else set()
        if keyframes:
            kf = keyframes[-1]
            keep.add(kf)
            keep.update(p for p in patches if p[0] > kf[0])
        return sorted(keep)

    def plan(self, current_version: int | None, current_hash: str | None) -> list[ObjKey]:
        """Objects to apply in order to reach the highest reachable version, fewest bytes first.

        Empty when the node is up to date or nothing known leads anywhere yet.
        A patch joins a path only if its base hash is the state the path is at; an
        object marked unusable joins none.
        """
        latest = self.latest_version
        if latest is None:
            return []
        floor = -1 if current_version is None else current_version
        for target in range(latest, floor, -1):
            best = self._cheapest(current_version, current_hash, target)
            if best is not None:
                return best
        return []

    def _chain(self, start_version: int, start_hash: str, target: int) -> list[ObjKey] | None:
        """Patches start_version+1 .. target, each based on the previous one's target."""
        path, at = [], start_hash
        for v in range(start_version + 1, target + 1):
            m = self._manifests.get((v, False))
            if m is None or m.base_version != v - 1 or m.base_hash != at or (v, False) in self._unusable:
                return None
            path.append((v, False))
            at = m.target_hash
        return path

    def _cost(self, path: list[ObjKey]) -> int:
        return sum(self._manifests[k].total_bytes for k in path)

    def _cheapest(self, current_version: int | None, current_hash: str | None, target: int) -> list[ObjKey] | None:
        options = []
        if current_version is not None and current_hash is not None:
            chain = self._chain(current_version, current_hash, target)
            if chain is not None:
                options.append((self._cost(chain), 0, chain))
        floor = -1 if current_version is None else current_version
        for k in self._manifests:
            if k[1] and floor < k[0] <= target and k not in self._unusable:
                chain = self._chain(k[0], self._manifests[k].target_hash, target)
                if chain is not None:
                    path = [k, *chain]
                    options.append((self._cost(path), 1, path))
        if not options:
            return None
        return min(options, key=lambda o: (o[0], o[1]))[2]
