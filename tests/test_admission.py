"""A valid member that reconnects in a loop: its budget of connections per member id
(node/net/admission.py) as a table, and refused right after TLS on loopback with real
credentials (node/net/transport.py `serve`)."""

from __future__ import annotations

import collections

import pytest
import trio
import trio.testing

from patchswarm.node.net import trust
from patchswarm.node.net.admission import ADMISSIONS, MemberAdmission
from patchswarm.node.net.transport import BEFORE_HELLO, MessageStream, connect, serve
from patchswarm.protocol import wire
from patchswarm.protocol.errors import BudgetExceeded, PeerRefused, UsageError


# ------------------------------------------------------------ the budget, as a table


def test_a_member_gets_its_burst_then_one_connection_per_refill():
    adm = MemberAdmission(burst=3, per_minute=6)  # a token every 10 s
    for _ in range(3):
        adm.admit("m", 0.0)
    with pytest.raises(BudgetExceeded, match=r"the next is admitted in 10\.0 s") as e:
        adm.admit("m", 0.0)
    assert e.value.budget == ADMISSIONS
    adm.admit("other", 0.0)  # another member's budget is its own
    assert adm.wait("m", 4.0) == pytest.approx(6.0)
    with pytest.raises(BudgetExceeded):
        adm.admit("m", 9.9)
    adm.admit("m", 10.0)
    with pytest.raises(BudgetExceeded):
        adm.admit("m", 10.0)


def test_refusals_take_nothing_so_the_wait_is_bounded_however_often_a_member_tries():
    """An honest member whose dialer retries while refused is admitted at the time its first
    refusal named: a refused attempt must not push its own admission back."""
    adm = MemberAdmission(burst=2, per_minute=12)  # a token every 5 s
    adm.admit("m", 0.0)
    adm.admit("m", 0.0)
    promised = adm.wait("m", 0.0)
    assert promised == pytest.approx(5.0)
    t = 0.0
    while t < promised - 0.01:
        with pytest.raises(BudgetExceeded):
            adm.admit("m", t)
        t += 0.1
    adm.admit("m", promised)


def test_full_buckets_are_forgotten():
    adm = MemberAdmission(burst=2, per_minute=60)
    for i in range(100):
        adm.admit(f"m{i}", 0.0)
    assert len(adm) == 100
    adm.prune(0.5)
    assert len(adm) == 100  # half a token back: not full yet
    adm.prune(1.0)
    assert len(adm) == 0


def test_a_budget_that_admits_nobody_is_a_usage_error():
    with pytest.raises(UsageError, match="burst >= 1"):
        MemberAdmission(burst=0)


# ------------------------------------------------------------ the listener, on loopback


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    trust.init_swarm(root / "swarm")
    for name in ("victim", "mallory", "honest"):
        trust.issue(root / "swarm", name, "node", root / name)
    trust.init_swarm(root / "elsewhere")  # another swarm's CA: its members are outsiders here
    trust.issue(root / "elsewhere", "outsider", "node", root / "outsider")
    return {name: trust.Credentials.load(root / name) for name in ("victim", "mallory", "honest", "outsider")}


def _hello(name: str) -> wire.Hello:
    return wire.Hello(name, "r0", "node", "127.0.0.1:1", [])


async def _victim(nursery, pki, handler, refused, **limits) -> str:
    """A listener as "victim" on loopback, in `nursery`, with `limits` (serve's keywords); its address."""
    return await nursery.start(lambda task_status: serve(
        "127.0.0.1:0", pki["victim"], {"node"}, lambda: _hello("victim"), handler, refused=refused,
        task_status=task_status, **limits))


def _recording(sessions: list):
    """A victim's handler that notes each admitted member's name and closes its session."""
    async def handler(ms: MessageStream) -> None:
        sessions.append(ms.peer_name)
        await ms.aclose()
    return handler


def test_a_member_over_its_budget_is_refused_after_tls_before_any_hello(pki):
    """mallory reconnects as fast as it can: the first `burst` connections reach the handler
    (the session, its Haves), every later one is refused right after the TLS handshake with an
    Error the dialer reads (PeerRefused, saying when to come back), and counted by budget.
    An honest member is admitted meanwhile, and mallory again once a token came back."""
    refused: collections.Counter = collections.Counter()
    # A token every 3 s: the ten tries must not earn one back. With one every 0.5 s, a run with
    # a WAN bench beside it took longer than that over them, and a fourth try was admitted.
    admission = MemberAdmission(burst=3, per_minute=20)
    sessions = []
    handler = _recording(sessions)

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                addr = await _victim(nursery, pki, handler, refused, admission=admission, refusal_hold=0.05)
                errors = []
                for _ in range(10):
                    try:
                        ms = await connect(addr, pki["mallory"], {"node"}, _hello("mallory"), expect_name="victim")
                        await ms.aclose()
                    except PeerRefused as e:
                        errors.append(str(e))
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert sessions == ["mallory"] * 3
                assert len(errors) == 7 and refused[ADMISSIONS] == 7, (errors, refused)
                assert "refused the connection" in errors[0] and "the next is admitted in" in errors[0]
                ms = await connect(addr, pki["honest"], {"node"}, _hello("honest"), expect_name="victim")
                await ms.aclose()
                await trio.sleep(admission.wait("mallory", trio.current_time()) + 0.05)
                ms = await connect(addr, pki["mallory"], {"node"}, _hello("mallory"), expect_name="victim")
                await ms.aclose()
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert sessions == ["mallory"] * 3 + ["honest", "mallory"]
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_refusals_are_held_so_a_looping_member_gets_few_handshakes_a_second(pki):
    """A refusal comes `refusal_hold` after the handshake, its connection holding a slot before
    Hello meanwhile: mallory dialing 12 at once past its budget, from one host with 4 such
    slots, has 4 handshakes done (each refused after the hold); the other 8 connections are
    closed before TLS. Without the hold it had all 12, and as many more as it could make."""
    refused: collections.Counter = collections.Counter()
    hold = 2.0

    async def handler(ms: MessageStream) -> None:
        await ms.aclose()

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                addr = await _victim(nursery, pki, handler, refused, admission=MemberAdmission(burst=1, per_minute=1),
                                     refusal_hold=hold, max_before_hello_per_host=4)
                ms = await connect(addr, pki["mallory"], {"node"}, _hello("mallory"), expect_name="victim")
                await ms.aclose()
                ends = []

                async def one() -> None:
                    t0 = trio.current_time()
                    try:
                        await connect(addr, pki["mallory"], {"node"}, _hello("mallory"), expect_name="victim")
                        ends.append(("admitted", 0.0))
                    except PeerRefused:
                        ends.append(("refused", trio.current_time() - t0))
                    except (OSError, trio.BrokenResourceError, trio.TooSlowError, wire.ProtocolError):
                        ends.append(("closed before TLS", trio.current_time() - t0))

                async with trio.open_nursery() as crowd:
                    for _ in range(12):
                        crowd.start_soon(one)
                kinds = collections.Counter(k for k, _ in ends)
                assert kinds == {"refused": 4, "closed before TLS": 8}, ends
                assert all(t >= hold for k, t in ends if k == "refused"), ends
                assert refused[ADMISSIONS] == 4 and refused[BEFORE_HELLO] == 8
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_failed_handshakes_hold_their_slots_so_an_outsider_gets_few_a_second(pki):
    """A host outside the swarm (a certificate of another CA) dialing as fast as it can: each
    handshake fails, and its connection keeps its slot before Hello until `refusal_hold` after
    it was accepted, so from one host with 4 such slots it gets about 4 handshakes per hold;
    the rest are closed before TLS. Before, a failed handshake freed its slot at once: as many
    handshakes as it could make, each nearly a whole one's CPU. A member is admitted meanwhile."""
    refused: collections.Counter = collections.Counter()
    hold, window = 0.5, 1.6
    sessions = []
    handler = _recording(sessions)

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                addr = await _victim(nursery, pki, handler, refused, refusal_hold=hold, max_before_hello_per_host=4)
                tries = 0

                async def outsider() -> None:
                    nonlocal tries
                    while True:
                        tries += 1
                        with pytest.raises((OSError, trio.BrokenResourceError, trio.TooSlowError, wire.ProtocolError)):
                            await connect(addr, pki["outsider"], {"node"}, _hello("outsider"))

                async with trio.open_nursery() as crowd:
                    for _ in range(8):
                        crowd.start_soon(outsider)
                    await trio.sleep(window)
                    ms = await connect(addr, pki["honest"], {"node"}, _hello("honest"), expect_name="victim",
                                       local_address="127.0.0.2")  # another host: slots of its own
                    await ms.aclose()
                    crowd.cancel_scope.cancel()
                await trio.testing.wait_all_tasks_blocked(0.05)
                handshakes = refused["refused"]
                # 4 slots, each taken again at most every `hold`: 4 * (window / hold + 1) = 16 at most.
                assert 4 <= handshakes <= 4 * (window / hold + 1), (handshakes, refused, tries)
                assert refused[BEFORE_HELLO] > handshakes  # the rest were closed before TLS
                assert sessions == ["honest"]
                nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.slow  # real processes
def test_a_node_daemon_replaces_a_members_session_and_refuses_it_past_its_budget(tmp_path):
    """`patchswarm node --member-connections 2` on loopback: mallory's second connection
    replaces its first (which the node closes), its third is refused with the node's reason,
    and status counts both."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from swarmlab import SwarmLab

    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        v = lab.start_node("v", region="r0", extra=["--member-connections", "2"])
        mallory = trust.Credentials.load(lab.creds("mallory", "node"))

        async def main():
            with trio.fail_after(60):
                first = await connect(v.addr, mallory, {"node"}, _hello("mallory"), expect_name="v")
                second = await connect(v.addr, mallory, {"node"}, _hello("mallory"), expect_name="v")
                with trio.fail_after(10):
                    while await first.receive() is not None:  # the node ends the replaced session
                        pass
                with pytest.raises(PeerRefused, match="connections in a row"):
                    await connect(v.addr, mallory, {"node"}, _hello("mallory"), expect_name="v")
                st = await trio.to_thread.run_sync(v.status)
                await second.aclose()
                return st

        st = trio.run(main)
        assert st["peers_dropped"].get(ADMISSIONS) == 1 and st["sessions_replaced"] == 1, st
        assert [p["id"] for p in st["peers"]] == ["mallory"]  # the second session stands
