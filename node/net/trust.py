"""Swarm trust on disk and on the wire: the trainer key, the swarm CA, node certificates, TLS 1.3 contexts.

A swarm directory (`init_swarm`) holds:

- trainer.key / trainer.pub: Ed25519, signs manifests (protocol/manifest.py);
- ca.key / ca.crt: the swarm CA, ECDSA P-256, self-signed, CA=True;
- issued.json: every certificate issued, by member name (names are unique:
  `issue` refuses a second one unless rotating, which revokes the old);
- revocations: the list of revoked serials signed by the CA
  (protocol/revocation.py), written by `revoke` and rotation, for the tracker
  to hand every member.

`issue` writes one member's credentials into a directory of their own:
NAME.crt / NAME.key (ECDSA P-256), plus copies of ca.crt and trainer.pub. The
certificate carries CN=NAME, OU=ROLE (one of ROLES), SAN DNS NAME + localhost
+ IP 127.0.0.1, EKU serverAuth + clientAuth, and with `region` a SAN URI
`patchswarm:region:R` (R percent-encoded, RFC 3986: every byte of its UTF-8
but letters, digits and `-._~`).

Why a URI in the SAN for the region: the subject's fields are the name and the
role, read by position-free attribute type, and a DNS SAN is a host name (a
region called like a member would read as one); a URI under the
`patchswarm:region:` prefix is a field of its own that nothing else writes, that
OpenSSL hands to Python's `getpeercert()` as it is (`("URI", ...)`), that needs
no private OID, and that a certificate without it (every certificate issued
before) simply lacks. The percent-encoding makes any region a node's
`--region` takes (UTF-8, at most wire.MAX_NAME_BYTES) one ASCII spelling, and
`region_of_uris` takes only that spelling, so one region has exactly one form.

On the wire both sides present certificates (mutual TLS 1.3) and trust only
the swarm CA. Hostnames are not checked: a peer is who its CA-signed
certificate says, and `require_role` decides what it may do; a certificate
whose serial is on the member's revocation list (`Credentials.revocations`)
is refused. A certificate that names a region is good for that region only:
`peer_region` reads it, and node/net/transport.py refuses a Hello that says
another (the region decides the WAN plan: which members bring which chunks
into a region); one that names none works as before, unless the tracker is
told to require one (`--require-region`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import ipaddress
import json
import os
import re
import ssl
import urllib.parse
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from patchswarm.protocol import wire
from patchswarm.protocol.regions import region_fault  # noqa: F401 (re-exported: transport.py, cli)
from patchswarm.protocol.errors import InvalidInput, UsageError
from patchswarm.protocol.revocation import RevocationBook, RevocationList, serial_hex, sign_list, verify_list

ROLES = frozenset({"tracker", "origin", "node"})
TRAINER_KEY = "trainer.key"
TRAINER_PUB = "trainer.pub"
CA_KEY = "ca.key"
CA_CRT = "ca.crt"
ISSUED = "issued.json"  # in the swarm directory: every certificate issued, by member name
REVOCATIONS = "revocations"  # in the swarm directory: the signed list to hand the tracker
CA_DAYS = 3650
LEAF_DAYS = 825
REGION_URI = "patchswarm:region:"  # a SAN URI's prefix: the rest is the member's region, percent-encoded
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


# ------------------------------------------------------------------ files


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with `mode`; never overwrite."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise UsageError(f"{path}: already exists; refusing to overwrite") from None
    try:
        os.fchmod(fd, mode)  # umask must not widen or narrow what we promise
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
    finally:
        if fd >= 0:
            os.close(fd)


def _pem_private(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_public(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


# ------------------------------------------------------------------ regions


def region_uri(region: str) -> str:
    """The SAN URI that binds a certificate to `region` (UsageError for a region no certificate may name)."""
    fault = region_fault(region)
    if fault is not None:
        raise UsageError(f"region: expected {fault}, found {region!r}")
    return REGION_URI + urllib.parse.quote(region, safe="")


def region_of_uris(uris, where: str = "certificate") -> str | None:
    """The region a certificate's SAN URIs (`uris`) bind it to; None where none starts with
    REGION_URI (any case). InvalidInput where several do, or where one is not exactly
    `region_uri(R)` of a region R (one region, one spelling)."""
    found = [u for u in uris if isinstance(u, str) and u[:len(REGION_URI)].lower() == REGION_URI]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidInput(f"{where}: expected at most one {REGION_URI} URI, found {len(found)}: "
                           f"{', '.join(repr(u[:80]) for u in found[:4])}")
    uri = found[0]
    try:
        region = urllib.parse.unquote(uri[len(REGION_URI):], errors="strict")
    except UnicodeDecodeError:
        region = None
    if region is None or region_fault(region) is not None or region_uri(region) != uri:
        raise InvalidInput(f"{where}: expected a URI {REGION_URI}R with R a region percent-encoded "
                           f"(RFC 3986, every byte but letters, digits and -._~), found {uri[:80]!r}")
    return region


def certificate_region(cert: x509.Certificate, where: str = "certificate") -> str | None:
    """The region `cert` binds its member to (`region_of_uris` of its SAN), None if it names none."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return region_of_uris(san.get_values_for_type(x509.UniformResourceIdentifier), where)


def init_swarm(directory: str | os.PathLike) -> dict[str, Path]:
    """Create a swarm's trainer key and CA in `directory`. Refuses to overwrite any of them."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = {n: d / n for n in (TRAINER_KEY, TRAINER_PUB, CA_KEY, CA_CRT)}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing:
        raise UsageError(f"swarm init: {', '.join(existing)} already exist; refusing to overwrite")

    trainer = Ed25519PrivateKey.generate()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "patchswarm"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"patchswarm swarm CA {d.resolve().name}"),
    ])
    now = _now()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_new(paths[TRAINER_KEY], _pem_private(trainer), 0o600)
    _write_new(paths[TRAINER_PUB], _pem_public(trainer), 0o644)
    _write_new(paths[CA_KEY], _pem_private(ca_key), 0o600)
    _write_new(paths[CA_CRT], ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return paths


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no {what} here (run `patchswarm swarm init` first?)") from None


def _registry(d: Path) -> dict[str, list[dict]]:
    p = d / ISSUED
    if not p.exists():
        return {}
    try:
        obj = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{p}: expected JSON, found undecodable text ({e})") from None
    if not isinstance(obj, dict):
        raise InvalidInput(f"{p}: expected a JSON object of member name -> issued certificates")
    return obj


def _write_replacing(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    _write_new(tmp, data, mode)
    os.replace(tmp, path)


def _load_ca_key(d: Path) -> ec.EllipticCurvePrivateKey:
    try:
        ca_key = serialization.load_pem_private_key(_read(d / CA_KEY, "swarm CA key"), password=None)
    except ValueError as e:
        raise InvalidInput(f"{d / CA_KEY}: swarm CA key does not load: {e}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise InvalidInput(f"{d / CA_KEY}: expected an EC P-256 key, found {type(ca_key).__name__}")
    return ca_key


def revoke(directory: str | os.PathLike, name: str, reason: str = "revoked") -> Path:
    """Revoke every certificate issued to `name` and write the swarm's signed revocation
    list (`DIR/revocations`, for the tracker's --revocations); returns its path."""
    d = Path(directory)
    registry = _registry(d)
    entries = registry.get(name)
    if not entries:
        raise UsageError(f"revoke: no certificate was issued to {name!r} from {d} (see {d / ISSUED})")
    now = _now().isoformat()
    for e in entries:
        e.setdefault("revoked", now)
        e.setdefault("reason", reason)
    return _write_revocations(d, registry)


def _write_revocations(d: Path, registry: dict[str, list[dict]]) -> Path:
    trainer_pub = serialization.load_pem_public_key(_read(d / TRAINER_PUB, "trainer public key"))
    serials = sorted({serial_hex(e["serial"]) for es in registry.values() for e in es if e.get("revoked")})
    previous = -1
    if (d / REVOCATIONS).exists():
        try:
            previous = verify_list((d / REVOCATIONS).read_bytes(), _load_ca_key(d).public_key()).sequence
        except InvalidInput:
            previous = -1
    rl = RevocationList(swarm_id_of(trainer_pub), previous + 1, tuple(serials), _now().timestamp())
    _write_replacing(d / ISSUED, (json.dumps(registry, indent=2, sort_keys=True) + "\n").encode(), 0o600)
    _write_replacing(d / REVOCATIONS, sign_list(rl, _load_ca_key(d)), 0o644)
    return d / REVOCATIONS


def issue(directory: str | os.PathLike, name: str, role: str, out: str | os.PathLike,
          rotate: bool = False, region: str | None = None) -> dict[str, Path]:
    """Issue credentials for member `name` with `role` from the swarm in `directory` into `out`.

    A name already issued (and not revoked) is refused: two members with one name knock
    each other off the tracker. `rotate` issues a new certificate for it and revokes the
    old ones (the new revocation list is written for the tracker).

    `region`: the region the certificate binds the member to (a SAN URI, see above; its
    Hello must then say that region). None: none, or on rotation the region of the
    certificate it replaces (as issued.json records it); "": none, also on rotation. A
    tracker has no region."""
    if role not in ROLES:
        raise UsageError(f"issue: role must be one of {sorted(ROLES)}, found {role!r}")
    if not isinstance(name, str) or len(name) > 253 or not _NAME.match(name):
        raise UsageError(f"issue: name must be a DNS name (letters, digits, '-', '.'), found {name!r}")
    if region and role == "tracker":
        raise UsageError(f"issue: a tracker has no region (its Hello names none), found --region {region!r}")
    if region:
        try:
            region_uri(region)
        except UsageError as e:
            raise UsageError(f"issue: {e}") from None
    d, o = Path(directory), Path(out)
    ca_crt_pem = _read(d / CA_CRT, "swarm CA certificate")
    trainer_pub = _read(d / TRAINER_PUB, "trainer public key")
    ca_key = _load_ca_key(d)
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_crt_pem)
    except ValueError as e:
        raise InvalidInput(f"{d}: swarm CA certificate does not load: {e}") from None

    registry = _registry(d)
    live = [e for e in registry.get(name, []) if not e.get("revoked")]
    if live and not rotate:
        raise UsageError(f"issue: {name!r} already has a certificate (serial {live[-1]['serial']}); "
                         f"names are unique in a swarm: --rotate issues a new one and revokes the old")
    if region is None and live:  # rotation keeps the region unless told otherwise
        region = live[-1].get("region")
        if region and role == "tracker":
            raise UsageError(f"issue: {name!r} was issued region {region!r}, which a tracker cannot have: "
                             f"rotate it with --region ''")
    region = region or None
    o.mkdir(parents=True, exist_ok=True)
    others = [p.name for p in o.glob("*.crt") if p.name != CA_CRT]
    if rotate and others == [f"{name}.crt"]:
        for suffix in (".crt", ".key"):
            (o / f"{name}{suffix}").unlink()
        others = []
    if others:
        raise UsageError(f"issue: {o} already holds credentials ({', '.join(sorted(others))}); "
                         f"use one directory per member")
    for fname, data in ((CA_CRT, ca_crt_pem), (TRAINER_PUB, trainer_pub)):
        p = o / fname
        if p.exists() and p.read_bytes() != data:
            raise UsageError(f"issue: {p} belongs to another swarm; refusing to overwrite")

    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "patchswarm"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(min(now + datetime.timedelta(days=LEAF_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName(name), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            *([x509.UniformResourceIdentifier(region_uri(region))] if region else []),
        ]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"crt": o / f"{name}.crt", "key": o / f"{name}.key", "ca": o / CA_CRT, "trainer_pub": o / TRAINER_PUB}
    _write_new(paths["key"], _pem_private(key), 0o600)
    _write_new(paths["crt"], cert.public_bytes(serialization.Encoding.PEM), 0o644)
    for fname, data in ((CA_CRT, ca_crt_pem), (TRAINER_PUB, trainer_pub)):
        if not (o / fname).exists():
            _write_new(o / fname, data, 0o644)
    now_iso = now.isoformat()
    for e in live:  # rotation: the old certificates stop working once the tracker has the list
        e["revoked"], e["reason"] = now_iso, "rotated"
    entry = {"serial": serial_hex(cert.serial_number), "role": role,
             "issued": now_iso, "not_after": cert.not_valid_after_utc.isoformat()}
    if region:
        entry["region"] = region
    registry.setdefault(name, []).append(entry)
    if live:
        paths["revocations"] = _write_revocations(d, registry)
    else:
        _write_replacing(d / ISSUED, (json.dumps(registry, indent=2, sort_keys=True) + "\n").encode(), 0o600)
    return paths


# ------------------------------------------------------------------ credentials


@dataclasses.dataclass(frozen=True)
class Credentials:
    """One member's credentials directory, as written by `issue`."""

    directory: Path
    name: str
    role: str
    cert: Path
    key: Path
    ca: Path
    trainer_pub: Path
    # The swarm's revocation list as this member last heard it; every handshake asks it.
    revocations: RevocationBook | None = dataclasses.field(default=None, compare=False, repr=False)
    region: str | None = None  # the region the certificate binds this member to; None: any
    # Refuse peers whose certificate names no region (--require-region), on every path: TLS both
    # ways (transport.py) and WebRTC (rtcsignal.py). Set by the member's service (dataclasses.replace).
    require_region: bool = dataclasses.field(default=False, compare=False)

    def no_region_refusal(self, name: str, role: str) -> str:
        """Why a peer whose certificate names no region is refused under `require_region`."""
        return (f"{role} {name!r}: its certificate names no region, and this {self.role} requires one: issue it "
                f"one (`patchswarm swarm issue SWARM {name} --role {role} --rotate --region R`)")

    def check_region(self, region: str) -> None:
        """UsageError unless this member may say `region` in its Hello: the certificate names
        that region or none. A member started in another region would be refused by everyone,
        and so would one whose region is no member's region (`region_fault`)."""
        fault = region_fault(region)
        if fault is not None:
            raise UsageError(f"region: expected {fault}, found {region!r}")
        if self.region is not None and region != self.region:
            raise UsageError(f"{self.cert}: the certificate binds {self.name!r} to region {self.region!r}, "
                             f"found --region {region!r}; run it with --region {self.region}, or issue it a "
                             f"certificate for {region!r} (`patchswarm swarm issue SWARM {self.name} --role "
                             f"{self.role} --rotate --region R`)")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Credentials":
        d = Path(directory)
        crts = sorted(p for p in d.glob("*.crt") if p.name != CA_CRT)
        if len(crts) != 1:
            raise UsageError(f"{d}: expected exactly one member certificate besides {CA_CRT}, "
                             f"found {[p.name for p in crts]}")
        crt = crts[0]
        paths = {"key": crt.with_suffix(".key"), "ca": d / CA_CRT, "trainer_pub": d / TRAINER_PUB}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise UsageError(f"{d}: missing {', '.join(missing)}")
        try:
            cert = x509.load_pem_x509_certificate(crt.read_bytes())
        except ValueError as e:
            raise InvalidInput(f"{crt}: not a PEM certificate: {e}") from None
        name, role = _name_role(cert.subject, str(crt))
        creds = cls(d, name, role, crt, paths["key"], paths["ca"], paths["trainer_pub"],
                    region=certificate_region(cert, str(crt)))
        try:
            ca_key = x509.load_pem_x509_certificate(paths["ca"].read_bytes()).public_key()
        except ValueError as e:
            raise InvalidInput(f"{paths['ca']}: not a PEM certificate: {e}") from None
        if not isinstance(ca_key, ec.EllipticCurvePublicKey):
            raise InvalidInput(f"{paths['ca']}: expected an EC P-256 CA key, found {type(ca_key).__name__}")
        object.__setattr__(creds, "revocations", RevocationBook(creds.swarm_id(), ca_key))
        return creds

    def trainer_public_key(self) -> Ed25519PublicKey:
        try:
            key = serialization.load_pem_public_key(self.trainer_pub.read_bytes())
        except ValueError as e:
            raise InvalidInput(f"{self.trainer_pub}: not a PEM public key: {e}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise InvalidInput(f"{self.trainer_pub}: expected an Ed25519 key, found {type(key).__name__}")
        return key

    def swarm_id(self) -> str:
        """The swarm's name on manifests: a fingerprint of the trainer key, so no two swarms share it."""
        return swarm_id_of(self.trainer_public_key())


def swarm_id_of(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sw-" + hashlib.sha256(raw).hexdigest()[:16]


def _name_role(subject: x509.Name, where: str) -> tuple[str, str]:
    cn = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(cn) != 1 or len(ou) != 1:
        raise InvalidInput(f"{where}: expected one CN and one OU (role) in the subject, found {subject.rfc4514_string()}")
    role = ou[0].value
    if role not in ROLES:
        raise InvalidInput(f"{where}: expected role in {sorted(ROLES)}, found {role!r}")
    return str(cn[0].value), str(role)


# ------------------------------------------------------------------ TLS


def _context(purpose: int, creds: Credentials) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if purpose == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = False  # identity is CA + role, not DNS
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(str(creds.cert), str(creds.key))
    ctx.load_verify_locations(cafile=str(creds.ca))
    # The wire revisions (protocol/wire.py), newest first: the listener selects the newest both
    # offer, and a peer reads what that revision added; a member of the first version offers
    # no ALPN protocol, and so selects none.
    ctx.set_alpn_protocols(list(wire.WIRE_REVISIONS))
    return ctx


def server_context(creds: Credentials) -> ssl.SSLContext:
    """TLS 1.3 server context that requires a client certificate from the swarm CA.

    It issues no session tickets: no member resumes a session (each dial is a full
    handshake, so that its certificate is checked against the current revocations),
    and the two tickets OpenSSL sends by default cost the listener a quarter of its
    handshake CPU (`bench/handshake.py`: 1.22 -> 0.91 ms, 2026-12-05): a member refused
    over its admission budget (node/net/admission.py) or a fleet reconnecting to a
    restarted tracker paid that for nothing."""
    ctx = _context(ssl.PROTOCOL_TLS_SERVER, creds)
    ctx.num_tickets = 0
    return ctx


def client_context(creds: Credentials) -> ssl.SSLContext:
    """TLS 1.3 client context presenting `creds` and trusting only the swarm CA: a new one,
    the caller's to change (a test offering other ALPN revisions does). Dials use `dial_context`."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, creds)


# Client contexts for dials, by credentials directory's files: (what they were built from, the context).
# One entry per set of credential paths a process dials with (one for a member, a few in a test).
_dial_contexts: dict[tuple, tuple[tuple, ssl.SSLContext]] = {}
dial_contexts_built = 0  # contexts dial_context built (a test counts them)


def _files_now(*paths: Path) -> tuple:
    """What says a file changed: a rotation (`issue --rotate`) writes new files under the same
    names, so the inode changes even where the size and a coarse mtime do not."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def dial_context(creds: Credentials) -> ssl.SSLContext:
    """`client_context(creds)`, built once and shared by every dial with the same credentials:
    building one reads and parses the certificate, key and CA (~1 ms; 4 % of a node's event
    loop at start-up in a 12-node swarm). Rebuilt when the files change (a rotated certificate is
    presented from the next dial, as before) or the wire revisions offered do. Never change it:
    it is shared (`client_context` makes one to change). A missing file raises as building does."""
    global dial_contexts_built
    paths = (creds.cert, creds.key, creds.ca)
    try:
        built_from = (_files_now(*paths), wire.WIRE_REVISIONS)
    except OSError:  # let building say which file and why, as it did per dial
        built_from = None
    cached = _dial_contexts.get(paths)
    if built_from is not None and cached is not None and cached[0] == built_from:
        return cached[1]
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT, creds)
    dial_contexts_built += 1
    if built_from is not None:
        _dial_contexts[paths] = (built_from, ctx)
    return ctx


def peer_identity(ssl_object) -> tuple[str, str]:
    """`(name, role)` of the verified peer of `ssl_object` (ssl.SSLObject/SSLSocket, or a trio.SSLStream)."""
    cert = ssl_object.getpeercert()
    if not cert:
        raise InvalidInput("peer: expected a verified certificate, found none")
    cn = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    ou = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "organizationalUnitName"]
    if len(cn) != 1 or len(ou) != 1:
        raise InvalidInput(f"peer certificate: expected one CN and one OU (role), found {cert.get('subject')!r}")
    if ou[0] not in ROLES:
        raise InvalidInput(f"peer {cn[0]!r}: expected role in {sorted(ROLES)}, found {ou[0]!r}")
    return cn[0], ou[0]


def peer_region(ssl_object) -> str | None:
    """The region the verified peer's certificate binds it to (`region_of_uris`); None if it names none."""
    cert = ssl_object.getpeercert()
    if not cert:
        raise InvalidInput("peer: expected a verified certificate, found none")
    uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]
    return region_of_uris(uris, "peer certificate")


def peer_serial(ssl_object) -> str:
    """The verified peer certificate's serial, as revocation lists name it."""
    cert = ssl_object.getpeercert()
    if not cert or "serialNumber" not in cert:
        raise InvalidInput("peer: expected a verified certificate with a serial number, found none")
    return serial_hex(cert["serialNumber"])


def require_role(ssl_object, allowed: set[str] | frozenset[str]) -> tuple[str, str]:
    """`peer_identity(ssl_object)` when its role is in `allowed`; InvalidInput otherwise."""
    name, role = peer_identity(ssl_object)
    if role not in allowed:
        raise InvalidInput(f"peer {name!r}: expected role {' or '.join(sorted(allowed))}, found {role!r}")
    return name, role


# ------------------------------------------------------------------ signed statements


def sign_statement(creds: Credentials, data: bytes) -> bytes:
    """`data` signed with the member's certificate key (ECDSA P-256, SHA-256, DER): how a
    member vouches for something that does not travel over its TLS connection (a WebRTC
    DTLS fingerprint, node/net/rtcsignal.py)."""
    key = serialization.load_pem_private_key(creds.key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidInput(f"{creds.key}: expected an EC P-256 key, found {type(key).__name__}")
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def member_certificate(creds: Credentials) -> bytes:
    """The member's own certificate (PEM), to send beside a signed statement."""
    return creds.cert.read_bytes()


def verify_statement(creds: Credentials, cert_pem: bytes, data: bytes,
                     signature: bytes) -> tuple[str, str, str, str | None]:
    """`(name, role, serial, region)` of the member whose certificate `cert_pem` signed `data`
    (`region`: the one the certificate binds it to, None if none).

    InvalidInput unless the certificate is issued by this swarm's CA, is valid now,
    is not revoked (`creds.revocations`), names a role (and a region at most once, well
    spelled), and its key signed `data`."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise InvalidInput(f"signed statement: expected a PEM certificate, found undecodable bytes ({e})") from None
    ca = x509.load_pem_x509_certificate(creds.ca.read_bytes())
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise InvalidInput(f"signed statement: expected a certificate issued by this swarm's CA, found one that is "
                           f"not ({type(e).__name__})") from None
    now = _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise InvalidInput(f"signed statement: certificate valid {cert.not_valid_before_utc} to "
                           f"{cert.not_valid_after_utc}, not now")
    name, role = _name_role(cert.subject, "signed statement certificate")
    region = certificate_region(cert, "signed statement certificate")
    serial = serial_hex(cert.serial_number)
    if creds.revocations is not None and creds.revocations.revoked(serial):
        raise InvalidInput(f"signed statement: the certificate of {name!r} (serial {serial}) is revoked")
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise InvalidInput(f"signed statement: expected an EC P-256 key in {name!r}'s certificate, "
                           f"found {type(key).__name__}")
    if not signature:
        raise InvalidInput(f"signed statement from {name!r}: expected a signature, found none")
    try:
        key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise InvalidInput(f"signed statement from {name!r}: the signature does not match what it signs") from None
    return name, role, serial, region
