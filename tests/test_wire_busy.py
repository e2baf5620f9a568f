"""Wire revision 3: TrajectoriesBusy, and which revision two members of any versions select.

The message is the origin's "not now" to a trajectory batch it had no room for
(node/trainer/origin.py). A member of revision 2 does not know the type and
refuses a frame of it, so it goes only on connections that selected revision 3;
these tests pin the frame, its bounds, and the ALPN selection between members
of revisions 1 (no ALPN), 2 and 3, both ways round.
"""

import ssl

import msgpack
import pytest
from hypothesis import given
import hypothesis.strategies as st

from patchswarm.node.net import trust
from patchswarm.protocol import wire
from patchswarm.protocol.errors import ProtocolError, UsageError
from patchswarm.protocol.wire import Connection, TrajectoriesBusy

HELLO = wire.Hello("n1", "r1", "node", "127.0.0.1:1", [])


def frame(obj) -> bytes:
    return wire.frame(msgpack.packb(obj, use_bin_type=True))


@given(st.integers(0, wire.MAX_RETRY_MS))
def test_a_deferral_round_trips_through_a_connection_for_any_wait_in_bounds(retry_ms):
    msg = TrajectoriesBusy(retry_ms)
    data = wire.encode(msg)
    assert data == frame({"t": "TrajectoriesBusy", "retry_ms": retry_ms})  # the frame, byte for byte
    conn = Connection()
    conn.receive_data(wire.encode(HELLO) + data)
    assert conn.next_event() == HELLO and conn.next_event() == msg and conn.next_event() is wire.NEED_DATA


@pytest.mark.parametrize("value, found", [
    (wire.MAX_RETRY_MS + 1, f"int {wire.MAX_RETRY_MS + 1}"),
    (-1, "int -1"),
    (1.5, "float 1.5"),
    ("1000", "str '1000'"),
    (True, "bool True"),
])
def test_a_wait_out_of_bounds_is_refused_by_sender_and_reader_saying_what_was_found(value, found):
    with pytest.raises(UsageError, match="TrajectoriesBusy.retry_ms: expected") as sent:
        wire.encode(TrajectoriesBusy(value))
    assert found in str(sent.value)
    with pytest.raises(ProtocolError, match="TrajectoriesBusy.retry_ms"):
        wire.decode_body(frame({"t": "TrajectoriesBusy", "retry_ms": value})[4:])


def test_a_deferral_without_its_wait_or_with_another_field_is_refused():
    with pytest.raises(ProtocolError, match=r"missing \['retry_ms'\]"):
        wire.decode_body(frame({"t": "TrajectoriesBusy"})[4:])
    with pytest.raises(ProtocolError, match=r"unexpected \['seqs'\]"):
        wire.decode_body(frame({"t": "TrajectoriesBusy", "retry_ms": 5, "seqs": [1]})[4:])


@given(st.binary(max_size=40))
def test_random_bytes_after_a_deferrals_type_key_raise_only_protocol_error(tail):
    body = b"\x82" + msgpack.packb("t") + msgpack.packb("TrajectoriesBusy") + tail
    try:
        msg = wire.decode_body(body)
    except ProtocolError:
        return
    assert type(msg) is TrajectoriesBusy and 0 <= msg.retry_ms <= wire.MAX_RETRY_MS


@pytest.mark.parametrize("selected, number", [(None, 1), ("patchswarm/2", 2), ("patchswarm/3", 3),
                                              ("patchswarm/4", 4), ("patchswarm/5", 5), ("patchswarm/6", 6),
                                              (wire.WIRE_REVISION, 6)])
def test_the_selected_revision_as_a_number(selected, number):
    assert wire.revision(selected) == number


@pytest.mark.parametrize("selected", ["patchswarm/1", "patchswarm/", "patchswarm/x", "h2", "patchswarm/²"])
def test_a_revision_this_side_never_offers_is_a_protocol_error(selected):
    with pytest.raises(ProtocolError, match=f"found {selected!r}"):
        wire.revision(selected)


def test_revisions_are_offered_newest_first():
    assert wire.WIRE_REVISIONS[0] == wire.WIRE_REVISION
    numbers = [wire.revision(r) for r in wire.WIRE_REVISIONS]
    assert numbers == sorted(numbers, reverse=True) and numbers[-1] == 2


# --- ALPN between members of revisions 1, 2 and 3 ------------------------------------------


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    root = tmp_path_factory.mktemp("swarm")
    trust.init_swarm(root / "swarm")
    trust.issue(root / "swarm", "origin", "origin", root / "origin")
    trust.issue(root / "swarm", "n1", "node", root / "n1")
    return trust.Credentials.load(root / "origin"), trust.Credentials.load(root / "n1")


def _offering(ctx: ssl.SSLContext, revisions) -> ssl.SSLContext:
    if revisions is not None:  # None: this version's own offer
        ctx.set_alpn_protocols(list(revisions))
    return ctx


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> tuple[str | None, str | None]:
    """A TLS handshake between two contexts through memory BIOs: what each side selected."""
    sin, sout, cin, cout = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(sin, sout, server_side=True)
    client = client_ctx.wrap_bio(cin, cout, server_side=False)
    done = {server: False, client: False}
    for _ in range(20):  # TLS 1.3 takes 2-3 flights
        for side in (client, server):
            try:
                side.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
        sin.write(cout.read())
        cin.write(sout.read())
        if all(done.values()):
            break
    assert all(done.values()), "the handshake did not finish"
    return server.selected_alpn_protocol(), client.selected_alpn_protocol()


@pytest.mark.parametrize("origin_offers, node_offers, selected", [
    (None, None, "patchswarm/6"),  # both of this version: deferrals, record keys, uplinks said in heartbeats
    (None, ["patchswarm/5", "patchswarm/4", "patchswarm/3", "patchswarm/2"], "patchswarm/5"),  # no heartbeat uplink
    (["patchswarm/5", "patchswarm/4", "patchswarm/3", "patchswarm/2"], None, "patchswarm/5"),
    (None, ["patchswarm/4", "patchswarm/3", "patchswarm/2"], "patchswarm/4"),  # a node of revision 4: no uplinks
    (["patchswarm/4", "patchswarm/3", "patchswarm/2"], None, "patchswarm/4"),  # this node, an origin of revision 4
    (None, ["patchswarm/3", "patchswarm/2"], "patchswarm/3"),  # a node of revision 3: no record keys
    (["patchswarm/3", "patchswarm/2"], None, "patchswarm/3"),  # this node, an origin of revision 3
    (None, ["patchswarm/2"], "patchswarm/2"),  # a node of revision 2: no deferral ever sent to it
    (None, [], None),  # a node of the first version, no ALPN at all
    (["patchswarm/2"], None, "patchswarm/2"),  # this node, an origin of revision 2
    ([], None, None),  # this node, an origin of the first version
])
def test_each_pair_of_versions_selects_the_newest_revision_both_speak(creds, origin_offers, node_offers, selected):
    origin, node = creds
    got = _handshake(_offering(trust.server_context(origin), origin_offers),
                     _offering(trust.client_context(node), node_offers))
    assert got == (selected, selected)
    # record keys where both speak revision 4, declared uplinks 5, uplinks in heartbeats only this version
    assert (wire.revision(got[0]) >= wire.RECORD_KEYS_REVISION) == (selected in ("patchswarm/4", "patchswarm/5",
                                                                                 "patchswarm/6"))
    assert (wire.revision(got[0]) >= wire.UPLINK_REVISION) == (selected in ("patchswarm/5", "patchswarm/6"))
    assert (wire.revision(got[0]) >= wire.UPLINK_NOW_REVISION) == (selected == wire.WIRE_REVISION)
