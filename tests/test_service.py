"""Running a service: the loopback warning, READY=1 to systemd, --advertise reaching the tracker, --version."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.metadata import version

import pytest

from patchswarm.node.cli import main
from patchswarm.node.net.service import loopback_warning, sd_notify

from swarmlab import ROOT, SwarmLab


@pytest.mark.parametrize("advertised, tracker, warns", [
    ("127.0.0.1:7701", "10.0.0.5:7700", True),
    ("localhost:7701", "tracker.example:7700", True),
    ("[::1]:7701", "[2001:db8::1]:7700", True),
    ("127.0.0.1:7701", "127.0.0.1:7700", False),  # one host: loopback is right
    ("127.0.0.2:7701", "localhost:7700", False),
    ("0.0.0.0:7701", "10.0.0.5:7700", False),  # the tracker puts the address it sees in place of a wildcard
    ("10.0.0.9:7701", "10.0.0.5:7700", False),
    ("gpu-17.internal:7701", "10.0.0.5:7700", False),  # a name: not resolved for a warning
])
def test_loopback_warning(advertised, tracker, warns):
    why = loopback_warning(advertised, tracker)
    assert (why is not None) == warns
    if warns:
        assert advertised in why and "--advertise" in why


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_sends_one_datagram(tmp_path, monkeypatch, abstract):
    name = f"\0patchswarm-test-{time.monotonic_ns()}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(name)
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name[1:] if abstract else name)
        assert sd_notify("READY=1")
        assert s.recv(100) == b"READY=1"


def test_sd_notify_without_a_manager(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify("READY=1") is False


@pytest.mark.slow
def test_a_service_tells_systemd_ready_once_listening_and_stopping_on_sigterm(tmp_path):
    lab = SwarmLab(tmp_path)
    creds = lab.creds("tracker", "tracker")
    sock_path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(sock_path))
        s.settimeout(60)
        log = open(tmp_path / "tracker.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "patchswarm.node.cli", "tracker", "--creds", str(creds),
                              "--listen", "127.0.0.1:0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "NOTIFY_SOCKET": str(sock_path)})
        try:
            assert s.recv(100) == b"READY=1"
            assert "listening on" in (tmp_path / "tracker.log").read_text()  # ready came after the bind
            p.send_signal(signal.SIGTERM)
            assert s.recv(100) == b"STOPPING=1"
            assert p.wait(timeout=30) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            log.close()


@pytest.mark.slow
def test_the_tracker_hands_out_the_advertised_address(tmp_path):
    with SwarmLab(tmp_path) as lab:
        tracker = lab.start_tracker(extra=["--metrics", "127.0.0.1:0"])
        http = lab.http_addr(tracker)
        lab.start_node("n1", "r1", extra=["--advertise", "127.0.0.1:45999"])
        node = lab.start_node("n2", "r1")

        def members():
            with urllib.request.urlopen(f"http://{http}/swarm.json", timeout=10) as r:
                view = json.loads(r.read())
            return {m["id"]: m["addr"] for region in view["regions"] for m in region["members"]}

        deadline = time.monotonic() + 60
        while len(got := members()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got["n1"] == "127.0.0.1:45999"  # what it said, not what it bound
        assert got["n2"] == node.addr
        assert "loopback address" not in lab.procs[1].text()  # loopback tracker: nothing to warn about


@pytest.mark.parametrize("argv", [["--version"], ["node", "--version"], ["tracker", "--version"]])
def test_version_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"patchswarm {version('patchswarm')}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_service_runs_from_its_config_file_with_the_environment_over_it(tmp_path):
    """A real tracker: listen and metrics from the file, the log format from PATCHSWARM_LOG_FORMAT over
    the file's, the metrics address from the flag over PATCHSWARM_METRICS."""
    lab = SwarmLab(tmp_path)
    creds = lab.creds("tracker", "tracker")
    listen, file_metrics, flag_metrics = _free_port(), _free_port(), _free_port()
    cfg = tmp_path / "tracker.toml"
    cfg.write_text(f'service = "tracker"\ncreds = "{creds}"\nlisten = "127.0.0.1:{listen}"\n'
                   f'metrics = "127.0.0.1:{file_metrics}"\nlog-format = "text"\n')
    env = {**os.environ, "PATCHSWARM_LOG_FORMAT": "json", "PATCHSWARM_METRICS": "127.0.0.1:1"}
    log = tmp_path / "tracker.log"
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "patchswarm.node.cli", "tracker", "--config", str(cfg),
                              "--metrics", f"127.0.0.1:{flag_metrics}"], cwd=ROOT, stdout=out,
                             stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        lines = [json.loads(line) for line in log.read_text().splitlines()]  # json: the variable won
        assert any(f"listening on 127.0.0.1:{listen}" in x["message"] for x in lines)  # the file's listen
        ready = None
        while ready is None and time.monotonic() < deadline:  # served at the flag's address
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{flag_metrics}/readyz", timeout=10) as r:
                    ready = r.status
            except urllib.error.HTTPError:  # 503 for the moment between listening and started
                time.sleep(0.1)
        assert ready == 200
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
