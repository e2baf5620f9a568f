"""Nodes that accept nothing inbound, as real processes on loopback: tracker, origin, and
two nodes with --no-listen --transport webrtc. They reach each other only over WebRTC data
channels signalled through the tracker (node/net/rtcsignal.py), reach every version
bit-exactly, and what moves between them is counted as peer-to-peer."""

from __future__ import annotations

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
