"""A member's region bound to its certificate (node/net/trust.py `issue(region=...)`): the
SAN URI's spelling, issuing and rotating, and on loopback with real TLS the tracker and a
node refusing a Hello whose region is not the certificate's (node/net/transport.py), the
tracker's --require-region, and a daemon that will not start in another region."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.node.net import transport, trust
from patchswarm.node.net.trackerlink import TrackerLink
from patchswarm.node.net.transport import NO_REGION, WRONG_REGION, MessageStream, connect, exchange_hello, serve
from patchswarm.protocol import wire
from patchswarm.protocol.errors import InvalidInput, PeerRefused, UsageError, WrongRegion
from patchswarm.tracker import server

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


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "patchswarm.node.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # processes
def test_the_cli_issues_with_a_region_and_a_node_in_another_region_will_not_start(tmp_path):
    """`swarm issue --region`, `--rotate` keeping it; `patchswarm node --region` other than the
    certificate's stops at once with both regions named (exit 1, no traceback)."""
    sw, out = tmp_path / "sw", tmp_path / "n1"
    assert _cli("swarm", "init", sw).returncode == 0
    r = _cli("swarm", "issue", sw, "n1", "--role", "node", "-o", out, "--region", "us-west")
    assert r.returncode == 0 and "region 'us-west'" in r.stdout, r.stderr
    r = _cli("swarm", "issue", sw, "n1", "--role", "node", "-o", out, "--rotate")
    assert r.returncode == 0 and "region 'us-west'" in r.stdout, r.stderr
    assert trust.Credentials.load(out).region == "us-west"
    r = _cli("node", "--tracker", "127.0.0.1:9", "--creds", out, "--data-dir", tmp_path / "data",
             "--listen", "127.0.0.1:0", "--region", "us-east")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "binds 'n1' to region 'us-west', found --region 'us-east'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_a_node_or_origin_in_another_region_than_its_certificate_fails_at_construction(tmp_path):
    from patchswarm.node.daemon import Node, NodeConfig
    from patchswarm.node.trainer.origin import Origin, OriginConfig

    sw = tmp_path / "swarm"
    trust.init_swarm(sw)
    trust.issue(sw, "n1", "node", tmp_path / "n1", region="r1")
    trust.issue(sw, "o", "origin", tmp_path / "o", region="r1")
    with pytest.raises(UsageError, match="binds 'n1' to region 'r1', found --region 'r2'"):
        Node(NodeConfig("127.0.0.1:9", tmp_path / "n1", tmp_path / "d1", "127.0.0.1:0", "r2"))
    with pytest.raises(UsageError, match="binds 'o' to region 'r1', found --region 'default'"):
        Origin(OriginConfig("127.0.0.1:9", tmp_path / "o", sw / "trainer.key", tmp_path / "d2", "127.0.0.1:0"))
    Node(NodeConfig("127.0.0.1:9", tmp_path / "n1", tmp_path / "d1", "127.0.0.1:0", "r1"))  # its own region: fine


def test_require_region_reaches_the_credentials_every_connection_checks(tmp_path):
    """--require-region (flag or TOML key) of a node and an origin is the one their
    connections read: `creds.require_region` (transport.py, rtcsignal.py)."""
    from patchswarm.node.cli import build_parser
    from patchswarm.node.daemon import Node, NodeConfig
    from patchswarm.node.trainer.origin import Origin, OriginConfig

    sw = tmp_path / "swarm"
    trust.init_swarm(sw)
    trust.issue(sw, "n1", "node", tmp_path / "n1", region="r1")
    trust.issue(sw, "o", "origin", tmp_path / "o", region="r0")
    for strict in (False, True):
        node = Node(NodeConfig("127.0.0.1:9", tmp_path / "n1", tmp_path / "d1", "127.0.0.1:0", "r1",
                               require_region=strict))
        origin = Origin(OriginConfig("127.0.0.1:9", tmp_path / "o", sw / "trainer.key", tmp_path / "d2",
                                     "127.0.0.1:0", "r0", require_region=strict))
        assert node.creds.require_region is strict and origin.creds.require_region is strict
        assert node.creds.revocations is not None  # the rest of the credentials as loaded
    for service in ("node", "origin"):
        args = build_parser().parse_args([service, "--tracker", "127.0.0.1:9", "--creds", "c", "--data-dir", "d",
                                          "--region", "r1", "--require-region"] + (["--key", "k"] if service == "origin" else []))
        assert args.require_region is True
    toml = tmp_path / "node.toml"
    toml.write_text('service = "node"\nrequire-region = true\n')
    assert _cli("config", "check", str(toml)).returncode == 0


# ------------------------------------------------------------------ on loopback, real TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """tracker; a1 (node, r1), o1 (origin, r1), free (node, no region), peer (node, r1)."""
    root = tmp_path_factory.mktemp("regions")
    sw = root / "swarm"
    trust.init_swarm(sw)
    for name, role, region in [("tracker", "tracker", None), ("a1", "node", "r1"), ("o1", "origin", "r1"),
                               ("free", "node", None), ("peer", "node", "r1"), ("listener", "node", "r1")]:
        trust.issue(sw, name, role, root / name, region=region)
    return {"root": root, **{n: trust.Credentials.load(root / n)
                             for n in ("tracker", "a1", "o1", "free", "peer", "listener")}}


def _hello(name: str, region: str, role: str = "node") -> wire.Hello:
    return wire.Hello(name, region, role, "127.0.0.1:1", [])


def _tracker_run(pki, check, **options):
    async def main():
        tracker = server.Tracker(pki["root"] / "tracker", "127.0.0.1:0", **options)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(tracker.run)
                await check(tracker)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_tracker_takes_a_member_in_its_certificates_region_and_refuses_another(pki, monkeypatch):
    monkeypatch.setattr(transport, "REFUSAL_HOLD", 0.05)

    async def check(tracker):
        ms = await connect(tracker.listen_addr, pki["a1"], {"tracker"}, _hello("a1", "r1"))
        first = await ms.receive()
        assert isinstance(first, wire.PeerList)
        with pytest.raises(PeerRefused) as e:
            await connect(tracker.listen_addr, pki["o1"], {"tracker"}, _hello("o1", "r2", "origin"))
        assert e.value.reason == "origin 'o1': its Hello says region 'r2', its certificate binds it to region 'r1'"
        st = tracker.status()
        assert st["refused"] == {WRONG_REGION: 1}
        assert [(m["id"], m["region"]) for m in st["members"]] == [("a1", "r1")]  # the core never heard of o1
        from patchswarm.node.net.metrics import TrackerMetrics
        rows = {(f.name, s.labels.get("kind")): s.value for f in TrackerMetrics().families(st) for s in f.samples}
        assert rows[("patchswarm_connections_refused", WRONG_REGION)] == 1  # /metrics counts it by kind
        free = await connect(tracker.listen_addr, pki["free"], {"tracker"}, _hello("free", "anywhere"))
        assert isinstance(await free.receive(), wire.PeerList)  # no region in its certificate: as before
        assert {m["id"]: m["region"] for m in tracker.status()["members"]} == {"a1": "r1", "free": "anywhere"}
        for m in (ms, free):
            await m.aclose()

    _tracker_run(pki, check)


@pytest.mark.parametrize("region", ["", "r1\n2026-12-06 origin WARNING forged", "r\x1b[31m1"])
def test_the_tracker_refuses_a_hello_whose_region_no_member_may_have(pki, region):
    """A region is quoted in logs, the page and peers' lists: one with a newline let a member
    whose certificate names no region forge lines in the tracker's log. Refused as no region
    a certificate or --region may name is (`trust.region_fault`), and counted."""

    async def check(tracker):
        with pytest.raises((InvalidInput, *transport.CONNECTION_ERRORS)):
            ms = await connect(tracker.listen_addr, pki["free"], {"tracker"}, _hello("free", region))
            await ms.receive()  # the listener closed the connection after reading our Hello
        assert tracker.status()["refused"] == {"refused": 1}
        ok = await connect(tracker.listen_addr, pki["a1"], {"tracker"}, _hello("a1", "r1"))
        assert isinstance(await ok.receive(), wire.PeerList)
        assert [m["id"] for m in tracker.status()["members"]] == ["a1"]
        await ok.aclose()

    _tracker_run(pki, check)


def test_a_node_or_origin_with_a_region_no_member_may_have_fails_at_construction(tmp_path):
    from patchswarm.node.daemon import Node, NodeConfig
    from patchswarm.node.trainer.origin import Origin, OriginConfig

    sw = tmp_path / "swarm"
    trust.init_swarm(sw)
    trust.issue(sw, "n1", "node", tmp_path / "n1")
    trust.issue(sw, "o", "origin", tmp_path / "o")
    with pytest.raises(UsageError, match=r"region: expected printable characters, found 'eu\\twest'"):
        Node(NodeConfig("127.0.0.1:9", tmp_path / "n1", tmp_path / "d1", "127.0.0.1:0", "eu\twest"))
    with pytest.raises(UsageError, match="region: expected a non-empty str, found ''"):
        Origin(OriginConfig("127.0.0.1:9", tmp_path / "o", sw / "trainer.key", tmp_path / "d2", "127.0.0.1:0",
                            region=""))


def test_with_require_region_a_certificate_naming_none_is_refused(pki, monkeypatch):
    monkeypatch.setattr(transport, "REFUSAL_HOLD", 0.05)

    async def check(tracker):
        with pytest.raises(PeerRefused, match="its certificate names no region, and this tracker requires one"):
            await connect(tracker.listen_addr, pki["free"], {"tracker"}, _hello("free", "r1"))
        ms = await connect(tracker.listen_addr, pki["a1"], {"tracker"}, _hello("a1", "r1"))
        assert isinstance(await ms.receive(), wire.PeerList)
        with pytest.raises(PeerRefused, match="Hello says region 'r9'"):
            await connect(tracker.listen_addr, pki["peer"], {"tracker"}, _hello("peer", "r9"))
        st = tracker.status()
        assert st["refused"] == {NO_REGION: 1, WRONG_REGION: 1} and st["require_region"] is True
        assert [m["id"] for m in st["members"]] == ["a1"]
        await ms.aclose()

    _tracker_run(pki, check, require_region=True)


def test_the_tracker_link_logs_why_the_tracker_refused_it(pki, monkeypatch, caplog):
    """What a member's log (and so the CLI) shows: the tracker's reason, both regions."""
    monkeypatch.setattr(transport, "REFUSAL_HOLD", 0.05)
    caplog.set_level(logging.WARNING, "patchswarm.tracker-link")

    async def check(tracker):
        async def on_message(msg):
            pass

        link = TrackerLink(tracker.listen_addr, pki["a1"], lambda: _hello("a1", "r2"), on_message)
        async with trio.open_nursery() as n:
            n.start_soon(link.run)
            with trio.fail_after(10):
                while "refused this member" not in caplog.text:
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()
        assert not link.connected

    _tracker_run(pki, check)
    line = next(r.getMessage() for r in caplog.records if "refused this member" in r.getMessage())
    assert "node 'a1': its Hello says region 'r2', its certificate binds it to region 'r1'" in line, line


async def _listener(nursery, pki, refused, region: str = "r1", creds=None, **kw) -> tuple[str, list]:
    sessions = []
    creds = pki["listener"] if creds is None else creds

    async def handler(ms: MessageStream) -> None:
        sessions.append((ms.peer_name, ms.hello.region))
        await ms.aclose()

    addr = await nursery.start(lambda task_status: serve(
        "127.0.0.1:0", creds, {"node", "tracker"}, lambda: _hello(creds.name, region), handler, refused=refused,
        refusal_hold=0.05, task_status=task_status, **kw))
    return addr, sessions


def test_a_node_refuses_a_peer_claiming_another_region_than_its_certificates(pki):
    refused = collections.Counter()

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                addr, sessions = await _listener(nursery, pki, refused)
                with pytest.raises(PeerRefused, match="node 'peer': its Hello says region 'r2', its certificate "
                                                      "binds it to region 'r1'"):
                    await connect(addr, pki["peer"], {"node"}, _hello("peer", "r2"), expect_name="listener")
                ms = await connect(addr, pki["peer"], {"node"}, _hello("peer", "r1"), expect_name="listener")
                await ms.aclose()
                ms = await connect(addr, pki["free"], {"node"}, _hello("free", "r7"), expect_name="listener")
                await ms.aclose()
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert sessions == [("peer", "r1"), ("free", "r7")]
                assert refused == {WRONG_REGION: 1}
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_dialer_refuses_a_listener_whose_hello_is_not_its_certificates_region(pki):
    refused = collections.Counter()

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                addr, _ = await _listener(nursery, pki, refused, region="r3")  # its certificate says r1
                with pytest.raises(WrongRegion, match="node 'listener': its Hello says region 'r3', its "
                                                      "certificate binds it to region 'r1'"):
                    await connect(addr, pki["peer"], {"node"}, _hello("peer", "r1"), expect_name="listener")
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_webrtc_session_checks_the_region_of_the_certificate_that_signed_its_offer(pki):
    """Over a data channel the peer's certificate comes signed in its offer (node/net/rtcsignal.py):
    `verify_statement` reads its region, and the Hellos are checked against it as over TLS."""
    root = pki["root"]
    statement = b"offer"
    who = trust.verify_statement(pki["a1"], (root / "peer" / "peer.crt").read_bytes(), statement,
                                 trust.sign_statement(pki["peer"], statement))
    assert who[0] == "peer" and who[3] == "r1"
    assert trust.verify_statement(pki["a1"], (root / "free" / "free.crt").read_bytes(), statement,
                                  trust.sign_statement(pki["free"], statement))[3] is None

    async def main():
        a, b = trio.testing.memory_stream_pair()
        mine = MessageStream(a, "peer", "node", peer_region=who[3])
        theirs = MessageStream(b, "a1", "node")
        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(exchange_hello, theirs, _hello("peer", "r2"))
                with pytest.raises(WrongRegion, match="Hello says region 'r2'"):
                    await exchange_hello(mine, _hello("a1", "r1"))
                n.cancel_scope.cancel()

    trio.run(main)


def _strict(creds: trust.Credentials) -> trust.Credentials:
    """`creds` as a member started with --require-region holds them (node/daemon.py, origin.py)."""
    return dataclasses.replace(creds, require_region=True)


def test_a_member_with_require_region_refuses_a_peer_whose_certificate_names_none_either_way(pki):
    """The tracker's --require-region keeps such a member out of the plan; a node's or origin's
    own keeps it from claiming a region to that member directly (it may still dial it)."""
    refused = collections.Counter()

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                # Listening: a dialer without a region is told why; one bound to its region is taken.
                addr, sessions = await _listener(nursery, pki, refused, creds=_strict(pki["listener"]))
                with pytest.raises(PeerRefused, match="node 'free': its certificate names no region, and this "
                                                      "node requires one"):
                    await connect(addr, pki["free"], {"node"}, _hello("free", "r1"), expect_name="listener")
                ms = await connect(addr, pki["peer"], {"node"}, _hello("peer", "r1"), expect_name="listener")
                await ms.aclose()
                # The tracker (its certificate names no region: it is in none) still dials it.
                ms = await connect(addr, pki["tracker"], {"node"}, _hello("tracker", "", "tracker"),
                                   expect_name="listener")
                await ms.aclose()
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert sessions == [("peer", "r1"), ("tracker", "")] and refused == {NO_REGION: 1}
                # Dialing: a listener without a region is refused before any Hello.
                free_addr, free_sessions = await _listener(nursery, pki, refused, creds=pki["free"])
                with pytest.raises(InvalidInput, match="node 'free': its certificate names no region, and this "
                                                       "node requires one"):
                    await connect(free_addr, _strict(pki["peer"]), {"node"}, _hello("peer", "r1"),
                                  expect_name="free")
                ms = await connect(free_addr, pki["peer"], {"node"}, _hello("peer", "r1"), expect_name="free")
                await ms.aclose()  # without --require-region, as before
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert free_sessions == [("peer", "r1")]
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_strict_member_still_joins_a_tracker_and_refuses_a_webrtc_offer_signed_without_a_region(pki):
    """Over WebRTC the peer's certificate comes in its signed offer (node/net/rtcsignal.py): a
    member with --require-region refuses an offer whose certificate names no region, counted."""
    from patchswarm.node.net.rtcsignal import RTCSignaller
    from patchswarm.node.net.webrtc import IceConfig

    async def check(tracker):
        ms = await connect(tracker.listen_addr, _strict(pki["a1"]), {"tracker"}, _hello("a1", "r1"))
        assert isinstance(await ms.receive(), wire.PeerList)
        await ms.aclose()

    _tracker_run(pki, check)

    async def send(msg):
        return True

    async def handler(ms):
        pass

    def signalled(creds, to: str) -> wire.Signal:
        """An offer `creds` signed for `to`, as the tracker relays it (`peer`: its sender)."""
        rtc = RTCSignaller(creds, IceConfig(), send, lambda: _hello(creds.name, "r1"), handler)
        sdp = "v=0\r\na=fingerprint:sha-256 " + ":".join(["AB"] * 32) + "\r\n"
        return dataclasses.replace(rtc._signal(to, "offer", 7, sdp), peer=creds.name)

    strict = RTCSignaller(_strict(pki["a1"]), IceConfig(), send, lambda: _hello("a1", "r1"), handler)
    with pytest.raises(InvalidInput, match="node 'free': its certificate names no region, and this node requires"):
        strict._check(signalled(pki["free"], "a1"), "offer", frozenset({"node"}))
    assert strict.refused == {"no region": 1}
    assert strict._check(signalled(pki["peer"], "a1"), "offer", frozenset({"node"}))[3] == "r1"
    lax = RTCSignaller(pki["a1"], IceConfig(), send, lambda: _hello("a1", "r1"), handler)
    assert lax._check(signalled(pki["free"], "a1"), "offer", frozenset({"node"}))[3] is None


# ------------------------------------------------------------------ real processes


@pytest.mark.slow  # real processes
def test_a_tracker_with_require_region_and_real_nodes(tmp_path):
    """`patchswarm tracker --require-region`: nodes whose certificates name their region join;
    one whose certificate names none is refused, and its log says why; a real node daemon
    refuses a peer that claims another region than its certificate's, and counts it. The same
    real nodes declare uplinks (--uplink-mbit, tests/test_uplinks.py for the plan): `patchswarm
    status` shows a node's own and each peer's."""
    sys.path.insert(0, str(Path(__file__).parent))
    from swarmlab import ROOT, SwarmLab, wait_until

    with SwarmLab(tmp_path) as lab:
        lab.start_tracker(extra=["--require-region"])
        good = lab.start_node("good", region="r1", creds=lab.creds("good", "node", region="r1"),
                              extra=["--uplink-mbit", "100"])
        lab.wait_log(good, "joined the swarm via tracker")
        lab.start_node("b", region="r1", creds=lab.creds("b", "node", region="r1"), extra=["--uplink-mbit", "12.5"])
        lab.wait_log(good, r"peer b \(node, region r1\) connected")
        # b's declared uplink comes with the tracker's next peer list, which may follow b's
        # connection: the status client (no torch to import now) can ask before it is in.
        wait_until(lambda: [p.get("uplink") for p in good.status()["peers"]] == [12.5], "b's declared uplink")
        shown = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", "status", "--socket", str(good.socket)],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "b (r1, 12.5 Mbit/s up)" in shown.stdout, shown.stdout + shown.stderr
        assert "100 Mbit/s declared" in shown.stdout
        st = good.status()  # what `patchswarm status --json` prints
        assert st["uplink_mbit"] == 100 and [p.get("uplink") for p in st["peers"]] == [12.5]
        bare = lab.start_node("bare", region="r1", creds=lab.creds("bare", "node"))
        lab.wait_log(bare, r"refused this member: node 'bare': its certificate names no region, "
                           r"and this tracker requires one")
        liar = trust.Credentials.load(lab.creds("liar", "node", region="r1"))

        async def main():
            with trio.fail_after(60):
                with pytest.raises(PeerRefused, match="node 'liar': its Hello says region 'r2'"):
                    await connect(good.addr, liar, {"node"}, _hello("liar", "r2"), expect_name="good")

        trio.run(main)
        st = good.status()
        assert st["peers_dropped"].get(WRONG_REGION) == 1, st["peers_dropped"]
        assert st["region"] == "r1" and [p["id"] for p in st["peers"]] == ["b"]
