"""The swarm's WAN rates from the tracker, as real processes on loopback.

`patchswarm tracker --wan-rates` is told to every member in its PeerList; a
node plans with it, and one whose own --wan-rates differ says so once, naming
both. Bad rates stop the tracker at start-up with what was expected and what
was found. The re-plan itself is pure (tests/test_picker.py and
tests/test_picker_swarm.py -k wan_rates); the rates on the wire and the older
versions on either side are in tests/test_wire.py and tests/test_tracker.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from swarmlab import ROOT, SwarmLab

pytestmark = pytest.mark.slow  # real processes (a few seconds)


def test_nodes_plan_with_the_trackers_wan_rates_and_one_configured_otherwise_says_so_once(tmp_path):
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker(extra=["--wan-rates", "r0=100,r1=50,r2=20"])
        quiet = lab.start_node("quiet", "r1")
        drifted = lab.start_node("drifted", "r2", extra=["--wan-rates", "r0=100,r1=20,r2=50"])
        lab.wait_log(quiet, r"WAN rates now r0=100,r1=50,r2=20 \(the tracker's\)")
        lab.wait_log(drifted, r"this node's --wan-rates r0=100,r1=20,r2=50 differ from the tracker's "
                              r"r0=100,r1=50,r2=20: planning with the tracker's")
        lab.wait_log(drifted, r"WAN rates now r0=100,r1=50,r2=20 \(the tracker's\)")
        assert "differ from the tracker's" not in quiet.text()
        assert drifted.text().count("differ from the tracker's") == 1
        assert quiet.status()["wan_rates"] == drifted.status()["wan_rates"] == {"r0": 100, "r1": 50, "r2": 20}
        shown = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", "status", "--socket", str(quiet.socket)],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "r0=100,r1=50,r2=20 Mbit/s" in shown.stdout, shown.stdout + shown.stderr


def test_the_tracker_reads_new_wan_rates_on_sighup_and_every_node_replans_without_a_restart(tmp_path):
    """`systemctl reload` (SIGHUP) of a tracker run from a --config file: new wan-rates reach
    the node at once, with no new session; a setting read only at start is named as such; a
    file made bad is refused by name and the rates in use stay."""
    conf = tmp_path / "tracker.toml"
    conf.write_text('service = "tracker"\nwan-rates = "r0=100,r1=50,r2=20"\n')
    with SwarmLab(tmp_path / "lab") as lab:
        tracker = lab.start_tracker(extra=["--config", str(conf)])
        node = lab.start_node("n", "r1")
        lab.wait_log(node, r"WAN rates now r0=100,r1=50,r2=20 \(the tracker's\)")
        sessions = node.text().count("joined the swarm via tracker")

        conf.write_text('service = "tracker"\nwan-rates = "r0=100,r1=20,r2=50"\nnotice-seeds = 3\n')
        at = len(node.text())
        tracker.popen.send_signal(signal.SIGHUP)
        lab.wait_log(tracker, r"WAN rates now r0=100,r1=20,r2=50, told to 1 member \(")
        lab.wait_log(tracker, r"SIGHUP: notice-seeds changed in .*tracker.toml; taken at the next start")
        lab.wait_log(node, r"WAN rates now r0=100,r1=20,r2=50 \(the tracker's\)", after=at)
        assert node.status()["wan_rates"] == {"r0": 100, "r1": 20, "r2": 50}
        assert node.text().count("joined the swarm via tracker") == sessions  # the same session

        conf.write_text('service = "tracker"\nwan-rates = "r0:100"\n')
        tracker.popen.send_signal(signal.SIGHUP)
        lab.wait_log(tracker, r"SIGHUP: kept the configuration in use: bad configuration.*wan-rates.*'r0:100'")
        assert tracker.alive() and node.status()["wan_rates"] == {"r0": 100, "r1": 20, "r2": 50}


@pytest.mark.parametrize("rates, found", [
    ("r0=100,r1=-5", "found 'r1=-5'"),
    ("r0:100", "found 'r0:100'"),
    ("r0=100,r0=50", "found 'r0' twice"),
])
def test_bad_wan_rates_stop_the_tracker_at_start_up_saying_what_was_expected_and_found(tmp_path, rates, found):
    r = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", "tracker", "--creds", str(tmp_path),
                        "--wan-rates", rates], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--wan-rates" in r.stderr and "expected" in r.stderr and "REGION=MBIT" in r.stderr and found in r.stderr
