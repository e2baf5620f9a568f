"""Revocation: names are unique, rotation revokes, a signed list only moves forward, and a
revoked member is refused at the handshake and its live connections end."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from patchswarm.node.net import trust
from patchswarm.protocol.errors import CorruptData, InvalidInput, SignatureError, StaleVersion, UsageError
from patchswarm.protocol.revocation import RevocationBook, RevocationList, serial_hex, sign_list, verify_list

CA = ec.generate_private_key(ec.SECP256R1())


def signed(seq: int, serials=(), swarm="sw-1", key=CA) -> bytes:
    return sign_list(RevocationList(swarm, seq, tuple(serial_hex(s) for s in serials), 0.0), key)


def test_a_list_moves_forward_only_and_must_be_the_swarm_cas():
    book = RevocationBook("sw-1", CA.public_key())
    assert book.offer(signed(0, [0xABC]))
    assert book.revoked(0xABC) and book.revoked("0abc") and not book.revoked(1)
    assert not book.offer(signed(0, [0xABC]))  # the same list again: nothing new
    with pytest.raises(StaleVersion):
        book.offer(signed(0, []))  # another list with the same sequence cannot un-revoke
    assert book.offer(signed(3, [0xABC, 5]))
    with pytest.raises(StaleVersion, match="above 3, found 1"):
        book.offer(signed(1, []))  # a replayed older list
    with pytest.raises(SignatureError):
        book.offer(signed(9, [], key=ec.generate_private_key(ec.SECP256R1())))
    with pytest.raises(InvalidInput, match="expected swarm 'sw-1'"):
        book.offer(signed(9, [], swarm="sw-2"))
    assert book.sequence == 3 and book.revoked(5)


@pytest.mark.parametrize("bad", [b"", b"\xc1", b"\x92\xc4\x01x\xc4\x01y", b"\x91\x01"])
def test_garbage_lists_are_corrupt_or_unsigned(bad):
    with pytest.raises((CorruptData, SignatureError)):
        verify_list(bad, CA.public_key())


def test_issue_refuses_a_second_certificate_for_a_name_unless_rotating(tmp_path):
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    first = trust.issue(swarm, "gpu-1", "node", tmp_path / "a")
    with pytest.raises(UsageError, match="already has a certificate"):
        trust.issue(swarm, "gpu-1", "node", tmp_path / "b")
    old = trust.Credentials.load(tmp_path / "a")
    rotated = trust.issue(swarm, "gpu-1", "node", tmp_path / "a", rotate=True)
    new = trust.Credentials.load(tmp_path / "a")
    assert rotated["revocations"] == swarm / trust.REVOCATIONS and first["crt"] == rotated["crt"]
    registry = json.loads((swarm / trust.ISSUED).read_text())["gpu-1"]
    assert [e.get("reason") for e in registry] == ["rotated", None]
    rl = verify_list((swarm / trust.REVOCATIONS).read_bytes(), trust._load_ca_key(swarm).public_key())
    old_serial = registry[0]["serial"]
    assert rl.serials == (old_serial,) and rl.swarm_id == new.swarm_id()
    assert new.revocations.offer((swarm / trust.REVOCATIONS).read_bytes())
    assert new.revocations.revoked(old_serial) and not new.revocations.revoked(registry[1]["serial"])
    assert old.name == new.name


def test_revoke_writes_a_newer_list_each_time(tmp_path):
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    trust.issue(swarm, "a", "node", tmp_path / "a")
    trust.issue(swarm, "b", "node", tmp_path / "b")
    with pytest.raises(UsageError, match="no certificate was issued to 'c'"):
        trust.revoke(swarm, "c")
    key = trust._load_ca_key(swarm).public_key()
    first = verify_list(trust.revoke(swarm, "a").read_bytes(), key)
    second = verify_list(trust.revoke(swarm, "b").read_bytes(), key)
    assert (first.sequence, second.sequence) == (0, 1) and len(second.serials) == 2
