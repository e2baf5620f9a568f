"""A member's region bound to its certificate (node/net/trust.py `issue(region=...)`): the
SAN URI's spelling, issuing and rotating."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.node.net import trust
from patchswarm.protocol import wire
from patchswarm.protocol.errors import InvalidInput, UsageError

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the SAN URI


def _region_ok(r: str) -> bool:
    return bool(r) and r.isprintable() and len(r.encode("utf-8")) <= wire.MAX_NAME_BYTES


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=300).filter(_region_ok))
def test_every_region_a_certificate_may_name_reads_back_from_its_uri(region):
    uri = trust.region_uri(region)
    assert uri.startswith(trust.REGION_URI) and uri.isascii()
    assert trust.region_of_uris(["https://elsewhere.example/", uri]) == region


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=40), st.text(alphabet="%0123456789abcdefABCDEF-._~xü ", max_size=20)))
def test_any_uri_under_the_prefix_reads_as_one_region_or_is_refused(tail):
    """Whatever follows the prefix: its one spelling of a region, or InvalidInput; nothing else."""
    uri = trust.REGION_URI + tail
    try:
        region = trust.region_of_uris([uri])
    except InvalidInput as e:
        assert "expected a URI patchswarm:region:" in str(e)
        return
    assert _region_ok(region) and trust.region_uri(region) == uri


@pytest.mark.parametrize("uris, match", [
    (["patchswarm:region:r1", "patchswarm:region:r2"], "at most one"),
    (["PATCHSWARM:REGION:r1", "patchswarm:region:r1"], "at most one"),  # the prefix in any case counts
    (["patchswarm:region:"], "expected a URI"),  # empty
    (["patchswarm:region:a%2db"], "expected a URI"),  # '-' needs no escape: another spelling of a-b
    (["patchswarm:region:a%2Fb%"], "expected a URI"),  # a broken escape
    (["patchswarm:region:%FF"], "expected a URI"),  # not UTF-8
    (["patchswarm:region:%0A"], "expected a URI"),  # a newline: not printable
    (["patchswarm:region:" + "a" * 257], "expected a URI"),  # past wire.MAX_NAME_BYTES
])
def test_a_region_uri_not_in_its_one_spelling_is_refused(uris, match):
    with pytest.raises(InvalidInput, match=match):
        trust.region_of_uris(uris)


def test_no_region_uri_is_no_region():
    assert trust.region_of_uris([]) is None
    assert trust.region_of_uris(["patchswarm:other:x", "https://x/patchswarm:region:r1"]) is None


# ------------------------------------------------------------------ issuing


def test_issue_binds_the_region_and_rotation_keeps_or_replaces_it(tmp_path):
    sw = tmp_path / "swarm"
    trust.init_swarm(sw)
    trust.issue(sw, "n1", "node", tmp_path / "n1", region="eu west/ü")
    creds = trust.Credentials.load(tmp_path / "n1")
    assert creds.region == "eu west/ü"
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(creds.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["patchswarm:region:eu%20west%2F%C3%BC"]
    assert san.get_values_for_type(x509.DNSName) == ["n1", "localhost"]  # the other fields as before
    serial = creds.cert.read_bytes()

    trust.issue(sw, "n1", "node", tmp_path / "n1", rotate=True)  # no region said: kept
    assert trust.Credentials.load(tmp_path / "n1").region == "eu west/ü"
    assert creds.cert.read_bytes() != serial
    trust.issue(sw, "n1", "node", tmp_path / "n1", rotate=True, region="r2")  # replaced
    assert trust.Credentials.load(tmp_path / "n1").region == "r2"
    trust.issue(sw, "n1", "node", tmp_path / "n1", rotate=True, region="")  # removed
    assert trust.Credentials.load(tmp_path / "n1").region is None
    trust.issue(sw, "n1", "node", tmp_path / "n1", rotate=True)  # none kept as none
    assert trust.Credentials.load(tmp_path / "n1").region is None
    entries = json.loads((sw / trust.ISSUED).read_text())["n1"]
    assert [e.get("region") for e in entries] == ["eu west/ü", "eu west/ü", "r2", None, None]

    trust.issue(sw, "plain", "node", tmp_path / "plain")  # as before: no region
    assert trust.Credentials.load(tmp_path / "plain").region is None


@pytest.mark.parametrize("name, role, region, match", [
    ("t", "tracker", "r1", "a tracker has no region"),
    ("n", "node", "a" * (wire.MAX_NAME_BYTES + 1), "at most 256 bytes"),
    ("n", "node", "é" * 129, "at most 256 bytes"),  # 258 bytes of UTF-8
    ("n", "node", "r\n1", "printable"),
    ("n", "node", "r\ud8001", "printable"),  # a lone surrogate: not UTF-8
])
def test_issue_refuses_a_region_no_hello_could_carry(tmp_path, name, role, region, match):
    trust.init_swarm(tmp_path / "swarm")
    with pytest.raises(UsageError, match=match):
        trust.issue(tmp_path / "swarm", name, role, tmp_path / name, region=region)
    assert not (tmp_path / name / f"{name}.crt").exists()
