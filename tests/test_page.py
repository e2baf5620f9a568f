"""The tracker's swarm page: the view it draws from, and the page in headless Chromium over a running swarm."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request

import pytest
import torch

from patchswarm.tracker.page import page_html, swarm_view

from aptinstall import ensure_command
from swarmlab import SwarmLab, write_checkpoint

STATUS = {"swarm_id": "sw-1", "latest_version": 7, "manifests_rejected": 1, "members": [
    {"id": "gpu-2", "region": "us-east", "role": "node", "addr": "10.0.0.2:7701", "versions": [7]},
    {"id": "gpu-1", "region": "us-east", "role": "node", "addr": "10.0.0.1:7701", "versions": [5]},
    {"id": "gpu-9", "region": "eu-west", "role": "node", "addr": "10.1.0.9:7701", "versions": []},
    {"id": "trainer", "region": "us-west", "role": "origin", "addr": "10.2.0.1:7702", "versions": [7]}]}


def test_view_groups_members_by_region_origin_region_first_with_lag():
    v = swarm_view(STATUS)
    assert [r["region"] for r in v["regions"]] == ["us-west", "eu-west", "us-east"]
    east = v["regions"][2]["members"]
    assert [(m["id"], m["version"], m["lag"]) for m in east] == [("gpu-1", 5, 2), ("gpu-2", 7, 0)]
    assert v["regions"][1]["members"][0]["lag"] is None  # holds nothing yet
    assert (v["members"], v["nodes"], v["nodes_current"]) == (4, 3, 1)
    assert v["tracker_rejections"] == {"manifests": 1}


def test_page_embeds_the_view_so_no_member_text_can_close_the_script():
    st = {**STATUS, "members": [{"id": "</script><b>x", "region": "r", "role": "node", "addr": "a:1",
                                 "versions": [1]}]}
    html = page_html(swarm_view(st))
    assert html.count("</script>") == 2  # the JSON data block's and the code's own
    embedded = re.search(r'<script id="initial" type="application/json">(.*?)</script>', html, re.S).group(1)
    assert json.loads(embedded)["regions"][0]["members"][0]["id"] == "</script><b>x"
    assert "http://" not in html and "https://" not in html  # no external assets


def chromium(binary: str, profile, *args: str) -> subprocess.CompletedProcess:
    # The flags a closed network needs: no background fetches, no first-run, no updates or sync.
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--no-first-run", "--disable-component-update", "--disable-sync", "--disable-quic",
                           "--disable-extensions", "--disable-default-apps", f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_page_in_headless_chromium_shows_the_members_of_a_running_swarm(tmp_path):
    browser = ensure_command("chromium", "chromium")
    ckpt = tmp_path / "ckpt"
    with SwarmLab(tmp_path) as lab:
        tracker = lab.start_tracker(extra=["--metrics", "127.0.0.1:0"])
        http = lab.http_addr(tracker)
        origin = lab.start_origin(region="us-west", watch=ckpt, wait=False)
        nodes = lab.start_nodes([("gpu-1", "us-east"), ("gpu-2", "us-east"), ("gpu-3", "eu-west")], starting=[origin])
        write_checkpoint(ckpt, "0000.safetensors", {"w": torch.arange(4096, dtype=torch.float32)})
        lab.wait_version(nodes, 0)
        with urllib.request.urlopen(f"http://{http}/swarm.json", timeout=10) as r:
            assert json.loads(r.read())["members"] == 4
        url = f"http://{http}/"
        dom = chromium(browser, tmp_path / "profile-dom", "--virtual-time-budget=3000", "--dump-dom", url)
        assert dom.returncode == 0, dom.stderr[-2000:]
        drawn = dom.stdout.split('<script id="initial"')[0]
        for want in ("region us-west (1)", "region us-east (2)", "region eu-west (1)", "gpu-1", "gpu-2", "gpu-3",
                     "origin", "latest version"):
            assert want in drawn, (want, drawn[:3000])
        shot = tmp_path / "swarm-page.png"
        r = chromium(browser, tmp_path / "profile-shot", "--virtual-time-budget=3000", "--window-size=1100,800",
                     "--hide-scrollbars", f"--screenshot={shot}", url)
        assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
