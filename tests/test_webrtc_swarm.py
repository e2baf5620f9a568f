"""Nodes that accept nothing inbound, as real processes on loopback: tracker, origin, and
two nodes with --no-listen --transport webrtc. They reach each other only over WebRTC data
channels signalled through the tracker (node/net/rtcsignal.py), reach every version
bit-exactly, and what moves between them is counted as peer-to-peer."""

from __future__ import annotations

import time

import pytest
import torch

from synthetic import rl_checkpoints, served
from swarmlab import SwarmLab, load_weights, same_bits, write_checkpoint

pytest.importorskip("aiortc")
pytestmark = pytest.mark.slow  # real processes

ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536"]
NATED = ["--no-listen", "--transport", "webrtc", "--ice-host", "127.0.0.1"]


@pytest.fixture(scope="module")
def checkpoints():
    return rl_checkpoints("small", 1e-5, 3)


def test_no_listen_nodes_exchange_over_webrtc_and_reach_every_version(tmp_path, checkpoints):
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        watch = tmp_path / "watch"
        lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS)
        nodes = [lab.start_node(name, "r0", extra=NATED, wait=False) for name in ("a", "b")]
        for p in nodes:
            lab.wait_log(p, r"listening on no address")
        for v in range(len(checkpoints)):
            write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
            lab.wait_version(nodes, v, timeout=180)
            for p in nodes:
                assert same_bits(load_weights(p), served(checkpoints[v], torch.bfloat16)), f"{p.name} at {v}"
        st = {p.name: p.status() for p in nodes}
        for me, other in (("a", "b"), ("b", "a")):
            peers = {q["id"]: q for q in st[me]["peers"]}
            assert peers["origin"]["transport"] == "tcp"
            assert (peers[other]["transport"], peers[other]["path"]) == ("webrtc", "direct")
            assert st[me]["listen"] == "" and st[me]["webrtc_refused"] == {}
        # Bytes between the two nodes went over the data channel and are counted peer-to-peer.
        p2p_in = sum(s["bytes_in"]["same_region"] for s in st.values())
        assert p2p_in > 0
        assert p2p_in == sum(q["bytes_in"] for s in st.values() for q in s["peers"] if q["id"] in ("a", "b"))


def test_nodes_the_tracker_cannot_reach_meet_over_webrtc_and_dial_the_others_over_tcp(tmp_path, checkpoints):
    """--probe-reachability: b and d advertise an address nobody answers on (as a host behind
    NAT that listens does); the tracker lists them without one and tells them. They dial a,
    which is reachable, over TCP, and meet each other over WebRTC (--transport auto); every
    version arrives bit-exactly, and a sees the tracker's probe as no refused connection."""
    import socket
    with socket.socket() as s:  # a port with nobody listening on it
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    auto = ["--transport", "auto", "--ice-host", "127.0.0.1"]
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker(extra=["--probe-reachability"])
        watch = tmp_path / "watch"
        lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS)
        nodes = [lab.start_node("a", "r0", extra=auto)]
        nodes += [lab.start_node(name, "r0", extra=[*auto, "--advertise", nowhere]) for name in ("b", "d")]
        for p in nodes[1:]:
            lab.wait_log(p, r"the tracker could not connect to " + nowhere.replace(".", r"\."))
        for v in range(len(checkpoints)):
            write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
            lab.wait_version(nodes, v, timeout=180)
            for p in nodes:
                assert same_bits(load_weights(p), served(checkpoints[v], torch.bfloat16)), f"{p.name} at {v}"
        for _ in range(300):  # connections may still be forming after the last version (bounded: 30 s)
            st = {p.name: p.status() for p in nodes}
            if all({q["id"] for q in s["peers"]} >= set("abd") - {me} for me, s in st.items()):
                break
            time.sleep(0.1)
        assert st["a"]["unreachable"] is None and st["b"]["unreachable"].startswith(nowhere)
        transports = {(me, q["id"]): q["transport"] for me, s in st.items() for q in s["peers"]}
        assert transports["b", "d"] == transports["d", "b"] == "webrtc"
        assert {transports[x, "a"] for x in "bd"} == {"tcp"} and transports["a", "b"] == "tcp"
        assert "refused a connection" not in nodes[0].text()  # the probe is not a refusal
