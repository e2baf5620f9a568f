"""Certificate revocation: a list of revoked certificate serials, signed by the swarm CA. Sans-IO.

Owns the list's one definition (msgpack, canonical), its signature (ECDSA P-256
over SHA-256 with the swarm CA's key, which every member already trusts through
ca.crt) and `RevocationBook`, the gate a member keeps: a list is taken only if
it verifies, names this swarm and has a higher sequence number than the one
held (an older list replayed cannot un-revoke anyone).

Why a list of our own rather than an X.509 CRL: members must drop a revoked
peer's live connections when a list arrives, not only refuse new handshakes;
OpenSSL's CRL check runs at handshake time only and a context cannot forget a
loaded CRL. The serials are what `getpeercert()` reports (upper-case hex).
"""

from __future__ import annotations

import dataclasses

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from .errors import CorruptData, InvalidInput, SignatureError, StaleVersion, UsageError

MAGIC = "patchswarm-revocations/1"
MAX_LIST_BYTES = 4 << 20
MAX_SERIALS = 100_000


def serial_hex(serial: int | str) -> str:
    """A certificate serial as `getpeercert()` writes it: upper-case hex, no leading zeros."""
    if isinstance(serial, int):
        if serial < 0:
            raise UsageError(f"serial: expected a non-negative int, found {serial}")
        return f"{serial:X}"
    if not isinstance(serial, str) or not serial or any(c not in "0123456789abcdefABCDEF" for c in serial):
        raise UsageError(f"serial: expected hex digits, found {serial!r}")
    return serial.upper().lstrip("0") or "0"


@dataclasses.dataclass(frozen=True)
class RevocationList:
    swarm_id: str
    sequence: int  # strictly increasing per swarm
    serials: tuple[str, ...]  # sorted, as serial_hex writes them
    issued_at: float

    def body(self) -> bytes:
        return msgpack.packb([MAGIC, self.swarm_id, self.sequence, list(self.serials), self.issued_at],
                             use_bin_type=True)


def sign_list(rl: RevocationList, ca_key: ec.EllipticCurvePrivateKey) -> bytes:
    body = rl.body()
    return msgpack.packb([body, ca_key.sign(body, ec.ECDSA(hashes.SHA256()))], use_bin_type=True)


def verify_list(envelope: bytes, ca_public_key: ec.EllipticCurvePublicKey) -> RevocationList:
    """The list in a signed envelope; SignatureError if the CA did not sign it, CorruptData if malformed."""
    if not isinstance(envelope, (bytes, bytearray)) or len(envelope) > MAX_LIST_BYTES:
        raise CorruptData(f"revocation list: expected at most {MAX_LIST_BYTES} bytes")
    try:
        outer = msgpack.unpackb(envelope, raw=False, max_bin_len=MAX_LIST_BYTES, max_array_len=2, max_map_len=0,
                                max_str_len=0)
    except Exception as e:
        raise CorruptData(f"revocation list: not msgpack ({type(e).__name__})") from None
    if not (isinstance(outer, list) and len(outer) == 2 and all(isinstance(x, bytes) for x in outer)):
        raise CorruptData("revocation list: expected [body, signature]")
    body, sig = outer
    try:
        ca_public_key.verify(sig, body, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise SignatureError("revocation list: the signature does not verify against the swarm CA") from None
    try:
        obj = msgpack.unpackb(body, raw=False, max_array_len=MAX_SERIALS, max_str_len=1 << 10, max_map_len=0)
    except Exception as e:
        raise CorruptData(f"revocation list body: not msgpack ({type(e).__name__})") from None
    if not (isinstance(obj, list) and len(obj) == 5 and obj[0] == MAGIC and isinstance(obj[1], str)
            and type(obj[2]) is int and obj[2] >= 0 and isinstance(obj[3], list)
            and all(isinstance(s, str) for s in obj[3]) and isinstance(obj[4], (int, float))):
        raise CorruptData(f"revocation list body: expected [{MAGIC!r}, swarm, sequence, [serials], issued_at]")
    try:
        serials = tuple(sorted({serial_hex(s) for s in obj[3]}))
    except UsageError as e:
        raise CorruptData(f"revocation list: {e}") from None
    return RevocationList(obj[1], obj[2], serials, float(obj[4]))


class RevocationBook:
    """The revocation list a member holds, and the question every handshake asks of it."""

    def __init__(self, swarm_id: str, ca_public_key: ec.EllipticCurvePublicKey):
        self.swarm_id = swarm_id
        self._key = ca_public_key
        self.current: RevocationList | None = None
        self.envelope: bytes | None = None
        self._serials: frozenset[str] = frozenset()

    @property
    def sequence(self) -> int:
        return -1 if self.current is None else self.current.sequence

    def offer(self, envelope: bytes) -> bool:
        """Take a signed list; True if it is newer than the one held (False: the same one).

        Raises SignatureError/CorruptData for an unsigned or malformed list, InvalidInput
        for another swarm's, StaleVersion for an older one."""
        rl = verify_list(envelope, self._key)
        if rl.swarm_id != self.swarm_id:
            raise InvalidInput(f"revocation list: expected swarm {self.swarm_id!r}, found {rl.swarm_id!r}")
        if rl == self.current:  # the same list (signatures differ per signing; the body does not)
            return False
        if rl.sequence <= self.sequence:
            raise StaleVersion(f"revocation list: expected a sequence above {self.sequence}, found {rl.sequence}")
        self.current, self.envelope = rl, bytes(envelope)
        self._serials = frozenset(rl.serials)
        return True

    def revoked(self, serial: int | str) -> bool:
        return serial_hex(serial) in self._serials
