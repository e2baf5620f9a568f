"""Nodes behind real NAT (tests/nattopo.py: network namespaces, nftables masquerade) with a real
coturn: tracker, origin and coturn on the public network, two nodes each behind its own NAT
that accepts nothing inbound. Behind port-preserving NAT they punch through with the STUN
address coturn tells them and exchange directly; behind symmetric NAT (a new port for every
destination) they fall back to the TURN relay. Either way they reach every version
bit-exactly and what moves between them is counted peer-to-peer. Skipped, with the reason,
where namespaces, nftables or coturn cannot be had."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aptinstall import ensure_command
from nattopo import PUBLIC, TURN_PASSWORD, TURN_USER, NatTopology, skip_reason, start_coturn
from synthetic import rl_checkpoints, served
from swarmlab import SwarmLab, load_weights, same_bits, write_checkpoint

pytest.importorskip("aiortc")
pytestmark = pytest.mark.slow  # namespaces, real processes

ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536"]


@pytest.fixture(scope="module")
def checkpoints():
    return rl_checkpoints("small", 1e-5, 2)


@pytest.fixture(scope="module")
def turnserver():
    ensure_command("nft", "nftables")  # before the probe, which needs it: a fresh machine lacks it
    why = skip_reason()
    if why:
        pytest.skip(why)
    return ensure_command("turnserver", "coturn")


def wait_connected(nodes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    names = {p.name for p in nodes}
    for p in nodes:
        while True:
            try:
                if names - {p.name} <= {q["id"] for q in p.status()["peers"]}:
                    break
            except Exception:  # not up yet: its local socket appears once it runs
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{p.name} did not connect to {names - {p.name}} in {timeout} s:\n"
                                     f"{p.text()[-3000:]}")
            time.sleep(0.2)


def run_case(tmp_path, checkpoints, turnserver, symmetric: bool, connect_s: float = 120) -> dict:
    topo = NatTopology("psw-rtc", 2, symmetric)
    coturn = None
    try:
        coturn = start_coturn(turnserver, topo, tmp_path)
        with SwarmLab(tmp_path) as lab:
            pub = topo.exec(topo.pub)
            lab.start_tracker(extra=["--listen", f"{PUBLIC}:0"], prefix=pub)
            watch = tmp_path / "watch"
            lab.start_origin(region="r0", watch=watch, extra=[*ORIGIN_ARGS, "--listen", f"{PUBLIC}:0"], prefix=pub)
            nodes = []
            for name, ns, addr in zip(("a", "b"), topo.hosts, topo.host_addrs):
                extra = ["--no-listen", "--transport", "webrtc", "--ice-host", addr, "--stun", f"{PUBLIC}:3478",
                         "--turn", f"turn:{PUBLIC}:3478", "--turn-user", TURN_USER, "--turn-password", TURN_PASSWORD]
                nodes.append(lab.start_node(name, "r0", extra=extra, wait=False, prefix=topo.exec(ns)))
            wait_connected(nodes, timeout=connect_s)  # before any version, so the two have something to exchange
            for v in range(len(checkpoints)):
                write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
                lab.wait_version(nodes, v, timeout=240)
                for p in nodes:
                    assert same_bits(load_weights(p), served(checkpoints[v], torch.bfloat16)), f"{p.name} at {v}"
            return {p.name: {**p.status(), "log": p.text()} for p in nodes}
    finally:
        if coturn is not None:
            coturn.terminate()
            coturn.wait(timeout=10)
        topo.close()


def _check(st: dict, path: str) -> None:
    for me, other in (("a", "b"), ("b", "a")):
        peers = {q["id"]: q for q in st[me]["peers"]}
        assert peers["origin"]["transport"] == "tcp"
        assert (peers[other]["transport"], peers[other]["path"]) == ("webrtc", path), peers
        assert st[me]["webrtc_refused"] == {}
    assert sum(s["bytes_in"]["same_region"] for s in st.values()) > 0


FALLBACK = "no direct WebRTC path"  # node/net/rtcsignal.py: the first offer, without relay candidates, failed


def test_behind_port_preserving_nat_nodes_exchange_directly(tmp_path, checkpoints, turnserver):
    st = run_case(tmp_path, checkpoints, turnserver, symmetric=False)
    _check(st, "direct")
    assert not any(FALLBACK in s["log"] for s in st.values())  # TURN configured, and not needed


def test_behind_symmetric_nat_nodes_fall_back_to_turn(tmp_path, checkpoints, turnserver):
    # Each node's ICE checks from its relay go to every candidate the other names, its private
    # host address included: the public network routes that address somewhere (tests/nattopo.py),
    # as the internet does, or coturn closes the allocation on the failed send.
    st = run_case(tmp_path, checkpoints, turnserver, symmetric=True, connect_s=60)
    _check(st, "relayed")
    assert any(FALLBACK in s["log"] for s in st.values())  # direct first, then the relay


BENCH = Path(__file__).resolve().parent.parent / "bench" / "transport.py"


def _namespaces_of(pid: int) -> list[str]:
    tag = f"psw-bt{pid % 100000}-"  # tests/nattopo.py names them prefix + pid
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]


def test_transport_bench_nat_mode_runs_each_path_and_removes_its_namespaces(turnserver):
    # bench/transport.py --nat at its smallest: every row moves its bytes, each WebRTC row over
    # the path it names (the bench also checks ICE's chosen pair), and nothing of the topology is left.
    bench = subprocess.Popen([sys.executable, str(BENCH), "--nat", "--mib", "1", "--repeat", "1", "--sizes", "16",
                              "--lanes", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = bench.communicate(timeout=600)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, out[-2000:] + err[-3000:]
    for row in ("TCP+TLS, loopback", "TCP+TLS, NATed to public", "WebRTC, loopback", "WebRTC direct, NAT to NAT",
                "WebRTC relayed, symmetric NATs"):
        assert f"  {row}, 16 KiB messages: " in out, out
    line = out.split("candidate pairs ICE chose (local-remote, at the receiver): ", 1)[1].splitlines()[0]
    pairs = dict(item.split(": ") for item in line.split("; "))
    assert "relay" not in pairs["WebRTC direct, NAT to NAT"] and "relay" in pairs["WebRTC relayed, symmetric NATs"], line
    assert _namespaces_of(bench.pid) == []


def test_transport_bench_nat_mode_removes_its_namespaces_when_stopped(turnserver):
    bench = subprocess.Popen([sys.executable, str(BENCH), "--nat", "--mib", "1", "--sizes", "16"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert bench.stdout.readline().startswith("run 0"), "the bench did not build its topology"
        assert _namespaces_of(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 143
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert _namespaces_of(bench.pid) == []
