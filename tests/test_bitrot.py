"""A chunk that changes on a running member's disk after it was stored (bit rot, a bad sector,
another program): real processes on loopback (tests/swarmlab.py).

Before, the member served such a chunk as it read it, and the receiver, finding that it did
not match its manifest, dropped the member (an honest one) as a sender of bad data. Checked
here from the receiver's side of the wire: a member with valid credentials asks the node for
every chunk of a patch whose files were damaged after the node applied it, and gets a Reject
for each (so it asks another holder), not a byte of them; the node counts and removes them,
stays up and keeps the session."""

from __future__ import annotations

import pytest
import trio

from patchswarm.node.net import trust
from patchswarm.node.net.transport import connect
from patchswarm.protocol import wire
from swarmlab import SwarmLab, write_checkpoint
from synthetic import rl_checkpoints

pytestmark = pytest.mark.slow  # real processes

ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536"]


async def _ask_all(creds, addr: str, n: int) -> dict[int, str]:
    """Ask the node at `addr` for chunks 0..n-1 of version 1's patch: chunk -> the first answer's kind."""
    ms = await connect(addr, creds, {"node"}, wire.Hello("probe", "r1", "node", "", []), expect_name="a")
    answers: dict[int, str] = {}
    try:
        await ms.send_many([wire.Request(1, False, c) for c in range(n)])
        with trio.fail_after(30):
            while len(answers) < n:
                msg = await ms.receive()
                assert msg is not None, "the node closed the session"
                if isinstance(msg, (wire.Piece, wire.Reject)) and (msg.version, msg.keyframe) == (1, False):
                    answers.setdefault(msg.chunk, type(msg).__name__)
    finally:
        await ms.aclose()
    return answers


def test_a_chunk_damaged_on_a_running_nodes_disk_is_refused_not_sent(tmp_path):
    checkpoints = rl_checkpoints("small", 1e-5, 2)
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        (a,) = lab.start_nodes([("a", "r1")], starting=[origin])
        for v in (0, 1):
            write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
            lab.wait_version([a], v)
        files = sorted((a.data_dir / "objects" / "v0000000001-patch").glob("*.chunk"))
        assert len(files) >= 2, "the patch must have several chunks"
        for f in files:  # one bit of each, in place, as the disk would
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x04
            f.write_bytes(bytes(data))
        creds = trust.Credentials.load(lab.creds("probe", "node"))
        answers = trio.run(_ask_all, creds, a.addr, len(files))
        assert answers == {c: "Reject" for c in range(len(files))}
        st = a.status()
        assert st["chunks_damaged"] == len(files) and not any(f.exists() for f in files)
        # each damaged chunk was read from disk (a damaged one is never kept), none delayed
        assert st["chunk_reads"] >= len(files) and st["reads_delayed"] == 0
        assert a.alive() and st["peers_dropped"].get("misbehaved", 0) == 0
        assert "Traceback" not in a.text()
