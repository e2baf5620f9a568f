"""A node's durable state under SIGKILL, as real processes on loopback (issues 19 and 21).

The node keeps a base file and the stored patches after it; a version costs the
disk its patch, and the state is written whole only at the first version and
by compaction. Failpoints (node/failpoints.py) hold the node inside the step a
kill must land in, and the log shows it did: mid-apply (the state in memory
partly patched) and mid-compaction (a state-sized temporary on disk). Each
restart must resume at a complete verified version, bit-exact, with no
temporary left behind, and the node must go on to the newest version.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from swarmlab import SwarmLab, load_weights, same_bits, write_checkpoint
from synthetic import rl_checkpoints, served

pytestmark = pytest.mark.slow  # real processes

ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536"]
KILLS = 4


@pytest.fixture(scope="module")
def checkpoints():
    return rl_checkpoints("small", 1e-5, KILLS + 3)


def _leftovers(p) -> list[str]:
    return sorted(f.name for f in p.data_dir.iterdir() if ".tmp-" in f.name or ".compact-" in f.name)


def test_kills_mid_apply_and_mid_compaction_resume_bit_exact_with_nothing_left_behind(tmp_path, checkpoints):
    watch = tmp_path / "watch"
    expected = [served(s, torch.bfloat16) for s in checkpoints]
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS, wait=False)
        (node,) = lab.start_nodes([("n", "r0")], starting=[origin], extra=["--compact-every", "2"])
        write_checkpoint(watch, "step0000.safetensors", checkpoints[0])
        lab.wait_version([node], 0)  # a keyframe: written whole as the base at once
        assert node.status()["base_version"] == 0
        # The holds, armed only now (a SIGTERM, not a kill under test): version 0's apply would
        # sit out a whole hold, 30 s of the test.
        node.env = {"PATCHSWARM_FAILPOINTS": "apply.written=sleep:30,compact.applied=sleep:30"}
        lab.kill(node, signal.SIGTERM)
        lab.restart(node)
        landed = {"apply": 0, "apply and compaction": 0}
        since_restart = 0
        for v in range(1, KILLS + 1):
            offset = len(node.text())
            write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
            # Every version stops inside its apply, after its first chunk is written. A restart
            # with a chain of 2 or more after the base starts a compaction, which stops after
            # folding its first patch, its state-sized temporary on disk.
            lab.wait_log(node, r"failpoint apply\.written: holding", timeout=120, after=offset)
            compacting = "failpoint compact.applied: holding" in node.text()[since_restart:]
            if compacting:
                assert _leftovers(node), "a compaction in progress has its temporary on disk"
            landed["apply and compaction" if compacting else "apply"] += 1
            lab.kill(node, signal.SIGKILL)
            since_restart = len(node.text())
            lab.restart(node)  # with the holds still set: a restart replays, it does not hold
            lab.wait_version([node], v, timeout=120)
            assert not any(".tmp-" in f for f in _leftovers(node)), "a restart removes what an interrupted write left"
            assert same_bits(load_weights(node), expected[v])
        assert landed["apply and compaction"] >= 1, landed
        # Without holds: the rest of the versions, a compaction completes, the chain shrinks.
        node.env = {}
        lab.kill(node, signal.SIGKILL)
        lab.restart(node)
        for v in range(KILLS + 1, KILLS + 3):
            write_checkpoint(watch, f"step{v:04d}.safetensors", checkpoints[v])
            lab.wait_version([node], v, timeout=120)
        deadline = time.monotonic() + 120
        while node.status()["base_version"] != KILLS + 2:  # compacted up to the newest version
            assert time.monotonic() < deadline, node.status()
            time.sleep(0.2)
        st = node.status()
        assert st["version"] == KILLS + 2 and st["compactions"] >= 1
        assert same_bits(load_weights(node), expected[KILLS + 2])
        assert _leftovers(node) == []
        assert "Traceback" not in node.text()
        print(f"kills landed: {landed}")
