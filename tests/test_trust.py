"""Swarm trust: signed manifests and the version gate, the swarm CA and member certificates, mutual TLS 1.3."""

import dataclasses
import functools
import hashlib
import ssl
import stat
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.node.net import trust
from patchswarm.node.net.tlsstream import TLSSocketStream
from patchswarm.protocol.errors import CorruptData, InvalidInput, SignatureError, UsageError
from patchswarm.protocol.manifest import (MAX_CHUNKS, Manifest, ObjKey, chunk_ok, decode_manifest, describe,
                                          encode_manifest, sign_manifest, verify_manifest)
from patchswarm.protocol.patch import CHUNK_BYTES
from patchswarm.protocol.wire import HaveOne, encode

ROOT = Path(__file__).resolve().parents[1]
KEY = Ed25519PrivateKey.generate()
OTHER_KEY = Ed25519PrivateKey.generate()
CHUNKS = [b"first chunk", b"", b"x" * 1000]


def manifest(version=2, base_version=1, swarm_id="s1", **kw):
    fields = dict(
        swarm_id=swarm_id, version=version, base_version=base_version,
        base_hash=None if base_version is None else "sha256:" + "ab" * 32,
        target_hash="sha256:" + "cd" * 32,
        tensors=[["layer.0.weight", "bf16", [4, 8]], ["layer.0.bias", "fp32", [8]]],
        chunks=[(len(c), hashlib.sha256(c).digest()) for c in CHUNKS],
        codec={"zeta": 1, "alpha": {"b": [1, 2], "a": "x"}}, created_at=1700000000.25,
    )
    fields.update(kw)
    return Manifest(**fields)


# ------------------------------------------------------------------ manifests


def test_sign_verify_round_trip():
    m = manifest()
    got = verify_manifest(sign_manifest(m, KEY), KEY.public_key())
    assert got == m
    assert got.chunks[0] == (len(CHUNKS[0]), hashlib.sha256(CHUNKS[0]).digest())
    assert not got.is_keyframe and got.total_bytes == sum(map(len, CHUNKS))
    k = manifest(version=0, base_version=None)
    assert verify_manifest(sign_manifest(k, KEY), KEY.public_key()) == k and k.is_keyframe


def test_encoding_is_canonical():
    a = manifest(codec={"b": 1, "a": 2})
    b = manifest(codec={"a": 2, "b": 1})
    assert encode_manifest(a) == encode_manifest(b)
    assert decode_manifest(encode_manifest(a)) == a
    # same content in a non-canonical encoding (codec keys unsorted) is refused
    obj = msgpack.unpackb(encode_manifest(a))
    obj[8] = {"b": 1, "a": 2}
    with pytest.raises(CorruptData):
        decode_manifest(msgpack.packb(obj, use_bin_type=True))


def test_a_narrower_encoding_of_the_same_manifest_is_refused():
    body = encode_manifest(manifest(created_at=0.5))
    assert body[-9:] == b"\xcb" + struct.pack(">d", 0.5)  # msgpack's float64, last
    with pytest.raises(CorruptData, match="canonical"):
        decode_manifest(body[:-9] + b"\xca" + struct.pack(">f", 0.5))  # the same value as float32


def test_manifest_arrays_of_another_length_are_named():
    obj = msgpack.unpackb(encode_manifest(manifest()))
    for other in (obj[:-1], obj + [0]):
        with pytest.raises(CorruptData, match="expected an array of 10"):
            decode_manifest(msgpack.packb(other, use_bin_type=True))


@pytest.mark.parametrize("base_version, base_hash", [(None, "sha256:" + "ab" * 32), (1, None)])
def test_base_version_and_base_hash_come_together(base_version, base_hash):
    with pytest.raises(UsageError, match="base_version/base_hash"):
        manifest(base_version=base_version, base_hash=base_hash)


def test_every_tampered_byte_is_caught():
    data = sign_manifest(manifest(), KEY)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises((SignatureError, CorruptData)):
            verify_manifest(bytes(bad), KEY.public_key())


def test_tampered_manifest_body_is_signature_error():
    body, sig = msgpack.unpackb(sign_manifest(manifest(), KEY))
    tampered = body.replace(b"layer.0.weight", b"layer.0.weighT")
    assert tampered != body
    with pytest.raises(SignatureError):
        verify_manifest(msgpack.packb([tampered, sig]), KEY.public_key())
    bad_sig = bytes([sig[0] ^ 0x80]) + sig[1:]
    with pytest.raises(SignatureError):
        verify_manifest(msgpack.packb([body, bad_sig]), KEY.public_key())


def test_other_key_is_signature_error():
    with pytest.raises(SignatureError):
        verify_manifest(sign_manifest(manifest(), OTHER_KEY), KEY.public_key())


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage", msgpack.packb([b"x"]), msgpack.packb({"a": 1}),
                                  msgpack.packb([1, 2]), sign_manifest(manifest(), KEY)[:-5]])
def test_garbage_is_corrupt_data(data):
    with pytest.raises(CorruptData):
        verify_manifest(data, KEY.public_key())


def test_signed_but_malformed_manifest_is_corrupt_data():
    for body in (b"\xc1", msgpack.packb(["wrong magic"]), msgpack.packb([1] * 10)):
        with pytest.raises(CorruptData):
            verify_manifest(msgpack.packb([body, KEY.sign(body)]), KEY.public_key())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_signature_or_corrupt(data):
    try:
        verify_manifest(data, KEY.public_key())
    except (SignatureError, CorruptData):
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_envelopes_raise_only_signature_or_corrupt(draw):
    data = bytearray(sign_manifest(manifest(), KEY))
    for _ in range(draw.draw(st.integers(1, 4))):
        i = draw.draw(st.integers(0, len(data) - 1))
        data[i] = draw.draw(st.integers(0, 255))
    cut = draw.draw(st.integers(0, len(data)))
    try:
        verify_manifest(bytes(data[:cut]), KEY.public_key())
    except (SignatureError, CorruptData):
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                          st.binary(max_size=40), st.lists(st.integers(), max_size=3),
                          st.dictionaries(st.text(max_size=3), st.integers(), max_size=3)), max_size=11))
def test_signed_arbitrary_arrays_raise_only_corrupt(obj):
    try:
        body = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError):
        return
    try:
        verify_manifest(msgpack.packb([body, KEY.sign(body)]), KEY.public_key())
    except CorruptData:
        pass


def test_manifest_fields_are_checked():
    with pytest.raises(UsageError):
        manifest(base_version=1, base_hash=None)
    with pytest.raises(UsageError):
        manifest(version=1, base_version=1)
    with pytest.raises(UsageError):
        manifest(chunks=[(3, b"short")])
    with pytest.raises(UsageError):
        manifest(codec={1: "x"})


@pytest.mark.parametrize("field, value", [
    ("tensors", [["w", "bf16", [4, -1]]]),  # a negative dimension
    ("tensors", [["w", "bf16", [4, 2.0]]]),  # a dimension that is not an int
    ("chunks", [(-1, bytes(32))]),  # a negative size
    ("chunks", [(1, "a" * 32)]),  # a digest of the right length that is not bytes
    ("chunks", [(1, bytes(33))]),  # a digest too long
    ("tensors", [["w", 5, [4]]]),  # a dtype that is not a str
    ("base_hash", ""),
    ("base_hash", 5),
    ("codec", {"n": -(2**63) - 1}),  # ints msgpack cannot carry
    ("codec", {"n": 2**64}),
])
def test_manifest_entries_out_of_range_are_refused(field, value):
    with pytest.raises(UsageError, match=f"manifest {field}"):
        manifest(**{field: value})


def test_manifest_bounds_are_inclusive():
    m = manifest(tensors=[["w", "bf16", [0, 4]]], chunks=[(0, bytes(32))], codec={"lo": -(2**63), "hi": 2**64 - 1})
    assert decode_manifest(encode_manifest(m)) == m


def test_chunk_count_is_bounded_by_max_chunks():
    entry = (0, bytes(32))
    assert len(manifest(chunks=[entry] * MAX_CHUNKS).chunks) == MAX_CHUNKS
    with pytest.raises(UsageError, match=f"at most {MAX_CHUNKS}, found {MAX_CHUNKS + 1}"):
        manifest(chunks=[entry] * (MAX_CHUNKS + 1))


def test_a_2_tib_version_in_the_codecs_chunks_fits_one_manifest():
    """The design's capacity (a 500 GB checkpoint's keyframe is ~250k chunks): 2 TiB of the
    codec's CHUNK_BYTES chunks in one manifest, and every chunk index a wire message may name."""
    n = (2 << 40) // CHUNK_BYTES
    assert len(manifest(chunks=[(CHUNK_BYTES, bytes(32))] * n).chunks) == n
    assert encode(HaveOne(version=2, keyframe=True, chunk=n - 1))  # UsageError past MAX_CHUNKS
    with pytest.raises(UsageError, match="manifest chunks"):  # and no more: the wire's bounds follow from it
        manifest(chunks=[(CHUNK_BYTES, bytes(32))] * (n + 1))


@pytest.mark.parametrize("fields, named", [
    ({"swarm_id": ""}, "swarm_id"), ({"swarm_id": 5}, "swarm_id"),
    ({"version": -1}, "version"), ({"version": "2"}, "version"), ({"version": 2.0}, "version"),
    ({"base_version": -1}, "base_version"), ({"base_version": 2}, "base_version"), ({"base_version": 3}, "base_version"),
    ({"target_hash": ""}, "target_hash"), ({"target_hash": 5}, "target_hash"),
    ({"tensors": [["w", "bf16"]]}, "tensors entry"), ({"tensors": [["w", "bf16", [4], "x"]]}, "tensors entry"),
    ({"tensors": [[5, "bf16", [4]]]}, "tensors entry"), ({"tensors": ["w"]}, "tensors entry"),
    ({"tensors": [["w", "bf16", [-1]]]}, "tensors entry"), ({"tensors": [["w", "bf16", [4.0]]]}, "tensors entry"),
    ({"created_at": True}, "created_at"), ({"created_at": float("nan")}, "created_at"),
    ({"created_at": float("inf")}, "created_at"), ({"created_at": "1"}, "created_at"),
    ({"codec": {"x": 2**65}}, "codec: int"), ({"codec": {"x": -(2**63) - 1}}, "codec: int"),
])
def test_each_bad_field_is_refused_and_named(fields, named):
    with pytest.raises(UsageError, match=f"manifest {named}"):
        manifest(**fields)


def test_a_manifest_cannot_be_changed_once_checked():
    m = manifest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.version = 3
    assert m == manifest()


@pytest.mark.parametrize("sig_len", [0, 63, 65, 128])
def test_a_signature_of_another_length_is_refused_with_its_length(sig_len):
    body = encode_manifest(manifest())
    sig = (KEY.sign(body) * 2)[:sig_len]
    with pytest.raises(SignatureError, match=f"expected 64 bytes, found {sig_len}$"):
        verify_manifest(msgpack.packb([body, sig], use_bin_type=True), KEY.public_key())


@pytest.mark.parametrize("items", [0, 1])
def test_an_envelope_of_fewer_than_two_elements_is_refused(items):
    body = encode_manifest(manifest())
    with pytest.raises(CorruptData, match="expected \\[manifest: bin, signature: bin\\]$"):
        verify_manifest(msgpack.packb([body, KEY.sign(body)][:items], use_bin_type=True), KEY.public_key())


@pytest.mark.parametrize("key, match", [(b"k", "codec: expected str keys"), (7, "not msgpack")])
def test_a_codec_map_with_a_non_str_key_does_not_decode(key, match):
    body = msgpack.packb(msgpack.unpackb(encode_manifest(manifest(codec={})))[:-2] + [{key: 1}, 1700000000.25],
                         use_bin_type=True)
    with pytest.raises(CorruptData, match=match):
        decode_manifest(body)


def test_chunk_ok_refuses_every_other_content_of_the_right_size():
    """Wrong bytes of the right size: refused whether their digest sorts below or above."""
    m = manifest()
    wrong = [bytes([i]) * len(CHUNKS[2]) for i in range(64)]
    digests = [hashlib.sha256(w).digest() for w in wrong]
    assert min(digests) < m.chunks[2][1] < max(digests)
    assert not any(chunk_ok(m, 2, w) for w in wrong)


def test_chunk_ok_refuses_indices_past_either_end():
    m = manifest()
    assert not chunk_ok(m, -1, CHUNKS[-1]) and not chunk_ok(m, len(CHUNKS) + 1, b"")
    assert chunk_ok(m, len(CHUNKS) - 1, CHUNKS[-1])


@pytest.mark.parametrize("entry", [
    (1, bytes(32), 0), [1, bytes(32), b""],  # three elements: a size, a digest, and more
    (1,), [], 7, "ab", None, b"ab",
])
def test_a_chunk_entry_is_a_size_and_digest_pair(entry):
    with pytest.raises(UsageError, match="chunks entry"):
        manifest(chunks=[(0, bytes(32)), entry])


def test_malformed_envelope_and_magic_are_named():
    body = msgpack.packb(["wrong magic"] + [0] * 9)
    with pytest.raises(CorruptData, match="found 'wrong magic'"):
        verify_manifest(msgpack.packb([body, KEY.sign(body)]), KEY.public_key())
    with pytest.raises(CorruptData, match="at most 2 elements"):
        verify_manifest(msgpack.packb([body, KEY.sign(body), b""]), KEY.public_key())


def test_describe_names_version_and_kind():
    assert (describe(ObjKey(3, False)), describe(ObjKey(4, True))) == ("v3 patch", "v4 keyframe")


def test_chunk_ok():
    m = manifest()
    assert all(chunk_ok(m, i, c) for i, c in enumerate(CHUNKS))
    assert not chunk_ok(m, 0, CHUNKS[0] + b"!")
    assert not chunk_ok(m, 0, b"First chunk")
    assert not chunk_ok(m, 1, b"x")
    assert not chunk_ok(m, len(CHUNKS), b"") and not chunk_ok(m, -1, b"")


# ------------------------------------------------------------------ swarm CA and certificates


def mode(p):
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("swarm")
    trust.init_swarm(root / "swarm")
    for name, role in (("tracker1", "tracker"), ("node1", "node"), ("origin1", "origin")):
        trust.issue(root / "swarm", name, role, root / name)
    trust.init_swarm(root / "rogue")
    trust.issue(root / "rogue", "node1", "node", root / "rogue-node")
    return root


def test_init_and_issue_write_files(swarm):
    s = swarm / "swarm"
    assert sorted(p.name for p in s.iterdir()) == ["ca.crt", "ca.key", "issued.json", "trainer.key", "trainer.pub"]
    assert mode(s / "ca.key") == 0o600 and mode(s / "trainer.key") == 0o600 and mode(s / "issued.json") == 0o600
    n = swarm / "node1"
    assert sorted(p.name for p in n.iterdir()) == ["ca.crt", "node1.crt", "node1.key", "trainer.pub"]
    assert mode(n / "node1.key") == 0o600
    assert (n / "ca.crt").read_bytes() == (s / "ca.crt").read_bytes()
    creds = trust.Credentials.load(n)
    assert (creds.name, creds.role) == ("node1", "node")
    m = manifest()
    assert verify_manifest(sign_manifest(m, _trainer_key(s)), creds.trainer_public_key()) == m


def _trainer_key(swarm_dir):
    from cryptography.hazmat.primitives import serialization
    return serialization.load_pem_private_key((swarm_dir / "trainer.key").read_bytes(), password=None)


def test_init_and_issue_refuse_overwrite(swarm, tmp_path):
    before = (swarm / "swarm" / "ca.key").read_bytes()
    with pytest.raises(UsageError, match="overwrite"):
        trust.init_swarm(swarm / "swarm")
    assert (swarm / "swarm" / "ca.key").read_bytes() == before
    with pytest.raises(UsageError):
        trust.issue(swarm / "swarm", "node2", "node", swarm / "node1")  # one member per directory
    with pytest.raises(UsageError, match="role"):
        trust.issue(swarm / "swarm", "x", "admin", tmp_path / "x")
    with pytest.raises(UsageError, match="name"):
        trust.issue(swarm / "swarm", "../evil", "node", tmp_path / "y")
    with pytest.raises(UsageError):
        trust.issue(tmp_path / "nowhere", "x", "node", tmp_path / "z")


# ------------------------------------------------------------------ mutual TLS


async def _serve(nursery, server_ctx, handler):
    # The TLS stream class the swarm runs on (node/net/tlsstream.py), not trio.SSLStream.
    async def wrapped(tcp):
        await handler(TLSSocketStream.wrap(tcp, server_ctx, server_side=True))

    serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
    listeners = await nursery.start(serve, wrapped, 0)
    return listeners[0].socket.getsockname()[1]


async def _connect(port, ctx):
    return TLSSocketStream.wrap(await trio.open_tcp_stream("127.0.0.1", port), ctx, server_side=False)


def _exchange(swarm, client_ctx, allowed_clients={"node", "origin"}):
    """Serve as tracker1; connect with `client_ctx`. Returns (server outcomes, client outcome)."""
    server_seen, client_seen = [], []

    async def handler(stream):
        try:
            await stream.do_handshake()
            name, role = trust.require_role(stream, allowed_clients)
            server_seen.append((name, role))
            await stream.send_all(b"hello " + name.encode())
        except (trio.BrokenResourceError, InvalidInput) as e:
            server_seen.append(e)
        finally:
            await trio.aclose_forcefully(stream)

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                port = await _serve(nursery, trust.server_context(trust.Credentials.load(swarm / "tracker1")), handler)
                stream = await _connect(port, client_ctx)
                try:
                    await stream.do_handshake()
                    peer = trust.require_role(stream, {"tracker"})
                    data = await stream.receive_some(100)
                    client_seen.append((peer, data))
                except (trio.BrokenResourceError, ssl.SSLError, OSError) as e:
                    client_seen.append(e)
                finally:
                    await trio.aclose_forcefully(stream)  # also closes the TCP socket, so the server sees the end
                while not server_seen:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

    trio.run(main)
    return server_seen, client_seen


def test_node_connects_to_tracker_and_both_see_identities(swarm):
    server, client = _exchange(swarm, trust.client_context(trust.Credentials.load(swarm / "node1")))
    assert server == [("node1", "node")]
    assert client == [(("tracker1", "tracker"), b"hello node1")]


def test_client_from_other_ca_is_refused(swarm):
    ctx = trust.client_context(trust.Credentials.load(swarm / "rogue-node"))
    ctx.load_verify_locations(cafile=str(swarm / "swarm" / "ca.crt"))  # it trusts us; we must not trust it
    server, client = _exchange(swarm, ctx)
    assert len(server) == 1 and isinstance(server[0], trio.BrokenResourceError)
    assert len(client) == 1 and not isinstance(client[0], tuple)  # no payload reached the rogue


def test_client_without_cert_is_refused(swarm):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=str(swarm / "swarm" / "ca.crt"))
    server, client = _exchange(swarm, ctx)
    assert len(server) == 1 and isinstance(server[0], trio.BrokenResourceError)
    assert len(client) == 1 and not isinstance(client[0], tuple)


def test_client_refuses_server_from_other_ca(swarm):
    ctx = trust.client_context(trust.Credentials.load(swarm / "rogue-node"))  # trusts only the rogue CA
    server, client = _exchange(swarm, ctx)
    assert len(client) == 1 and isinstance(client[0], (trio.BrokenResourceError, ssl.SSLError))
    assert len(server) == 1 and isinstance(server[0], trio.BrokenResourceError)


def test_server_rejects_wrong_role_over_tls(swarm):
    server, client = _exchange(swarm, trust.client_context(trust.Credentials.load(swarm / "origin1")),
                               allowed_clients={"node"})
    assert len(server) == 1 and isinstance(server[0], InvalidInput)
    assert "expected role node" in str(server[0]) and "'origin'" in str(server[0])
    assert len(client) == 1 and (not isinstance(client[0], tuple) or client[0][1] == b"")


class FakePeer:
    def __init__(self, cert):
        self.cert = cert

    def getpeercert(self):
        return self.cert


def test_require_role_rejects_wrong_role():
    peer = FakePeer({"subject": ((("organizationName", "patchswarm"),), (("organizationalUnitName", "node"),),
                                 (("commonName", "n7"),))})
    assert trust.peer_identity(peer) == ("n7", "node")
    assert trust.require_role(peer, {"node", "origin"}) == ("n7", "node")
    with pytest.raises(InvalidInput, match=r"expected role tracker, found 'node'"):
        trust.require_role(peer, {"tracker"})
    with pytest.raises(InvalidInput, match="none"):
        trust.require_role(FakePeer(None), {"node"})
    with pytest.raises(InvalidInput, match="role"):
        trust.peer_identity(FakePeer({"subject": ((("organizationalUnitName", "admin"),), (("commonName", "x"),))}))


# ------------------------------------------------------------------ CLI


def cli(*args):
    return subprocess.run([sys.executable, "-m", "patchswarm.node.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_cli_swarm_init_and_issue(tmp_path):
    r = cli("swarm", "init", tmp_path / "sw")
    assert r.returncode == 0, r.stderr
    assert mode(tmp_path / "sw" / "ca.key") == 0o600 and mode(tmp_path / "sw" / "trainer.key") == 0o600
    r = cli("swarm", "issue", tmp_path / "sw", "edge-1", "--role", "origin", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "edge-1" in r.stdout
    creds = trust.Credentials.load(tmp_path / "out")
    assert (creds.name, creds.role) == ("edge-1", "origin") and mode(creds.key) == 0o600
    r = cli("swarm", "init", tmp_path / "sw")
    assert r.returncode == 1 and r.stderr.startswith("patchswarm: ") and "Traceback" not in r.stderr
    r = cli("swarm", "issue", tmp_path / "sw", "x", "--role", "admin", "-o", tmp_path / "o2")
    assert r.returncode == 2


def test_the_listener_issues_no_session_tickets(swarm):
    """No member resumes a TLS session, so a ticket is work for nothing: OpenSSL's two per
    handshake were a quarter of a listener's handshake CPU (bench/handshake.py)."""
    import socket
    import threading

    server_ctx = trust.server_context(trust.Credentials.load(swarm / "tracker1"))
    client_ctx = trust.client_context(trust.Credentials.load(swarm / "node1"))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)

        def serve_one() -> None:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                s.sendall(b"x")  # after the tickets, if any: the client has read them with it
                s.recv(1)

        t = threading.Thread(target=serve_one)
        t.start()
        with socket.create_connection(listener.getsockname(), timeout=10) as raw, \
                client_ctx.wrap_socket(raw) as s:
            assert s.recv(1) == b"x"
            assert s.session is not None and not s.session.has_ticket
            s.sendall(b"y")
        t.join(10)


def test_dials_share_one_client_context_until_the_credentials_change(tmp_path):
    """Building a client context per dial (reading and parsing the certificate, key and CA)
    was ~4 % of a node's event loop at start-up in a 12-node swarm. Now dials with the same
    credentials share one (two dials: one build), a rotated certificate is presented from the
    next dial (a new build; the listener sees the new serial), and the handshake still checks
    the peer: credentials from another CA are refused by both sides."""
    from patchswarm.node.net import transport
    from patchswarm.protocol import wire

    trust.init_swarm(tmp_path / "swarm")
    for name, role in (("tracker1", "tracker"), ("node1", "node")):
        trust.issue(tmp_path / "swarm", name, role, tmp_path / name)
    trust.init_swarm(tmp_path / "rogue")
    trust.issue(tmp_path / "rogue", "node1", "node", tmp_path / "rogue-node")
    tracker = trust.Credentials.load(tmp_path / "tracker1")
    node = trust.Credentials.load(tmp_path / "node1")
    seen = []  # (name, serial) of each member the listener accepted

    async def handler(ms):
        seen.append((ms.peer_name, ms.peer_serial))

    async def dial(addr, creds):
        ms = await transport.connect(addr, creds, {"tracker"}, wire.Hello(creds.name, "r1", "node", "", []))
        await ms.aclose()

    async def accepted(n):  # the listener's handler runs after the dial returns: wait for it
        while len(seen) < n:
            await trio.sleep(0.01)

    async def main():
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                addr = await nursery.start(functools.partial(
                    transport.serve, "127.0.0.1:0", tracker, {"node"}, lambda: wire.Hello("tracker1", "r1", "tracker",
                                                                                         "", []), handler))
                built = trust.dial_contexts_built
                await dial(addr, node)
                await dial(addr, node)
                assert trust.dial_contexts_built - built == 1  # the second dial reused the first's context
                await accepted(2)
                first_serial = seen[-1][1]
                assert seen == [("node1", first_serial)] * 2

                trust.issue(tmp_path / "swarm", "node1", "node", tmp_path / "node1", rotate=True)
                rotated = trust.Credentials.load(tmp_path / "node1")
                await dial(addr, rotated)
                await dial(addr, node)  # the old Credentials object names the same files: also the new ones
                assert trust.dial_contexts_built - built == 2
                await accepted(4)
                assert seen[2][1] == seen[3][1] != first_serial  # the rotated certificate was presented

                with pytest.raises(Exception):  # the listener trusts only its swarm's CA, the dialer only its own
                    await dial(addr, trust.Credentials.load(tmp_path / "rogue-node"))
                await trio.sleep(0.2)  # time for a wrongly accepted handshake to reach the handler
                assert len(seen) == 4
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_session_whose_handler_fails_ends_that_session_not_the_listener(swarm, caplog):
    """A bug in one accepted session's handler is logged with the member it served and the
    listener goes on accepting (as a dialed session's bug ends only that session: test_dialer)."""
    from patchswarm.node.net import transport
    from patchswarm.protocol import wire

    tracker, node = trust.Credentials.load(swarm / "tracker1"), trust.Credentials.load(swarm / "node1")
    served = []

    async def handler(ms):
        served.append(ms.peer_name)
        if len(served) == 1:
            raise KeyError("a bug in the first session")

    async def main():
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                addr = await nursery.start(functools.partial(
                    transport.serve, "127.0.0.1:0", tracker, {"node"},
                    lambda: wire.Hello("tracker1", "r1", "tracker", "", []), handler))
                for n in (1, 2):
                    ms = await transport.connect(addr, node, {"tracker"}, wire.Hello("node1", "r1", "node", "", []))
                    await ms.aclose()
                    while len(served) < n:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

    with caplog.at_level("ERROR", logger="patchswarm.transport"):
        trio.run(main)
    assert served == ["node1", "node1"]
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == "session with node node1 failed" and "a bug in the first session" in caplog.text
