"""Metrics: the collectors over status dicts (tables), then a real swarm scraped with prometheus-client's parser.

The real run starts a tracker, an origin and three nodes with `--metrics` and
`--log-format json`, checks /readyz answers 503 before the first version and
200 after, publishes versions, and checks every series the issue names is
present with values that follow from the run; every log line of every process
parses as JSON.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from patchswarm.node.net.metrics import NodeMetrics, OriginMetrics, TrackerMetrics

from swarmlab import SwarmLab, wait_until, write_checkpoint


def samples(collector, st: dict) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, as Prometheus would read them."""
    collector.attach(lambda: st)
    out = {}
    for family in collector.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


NODE_STATUS = {
    "version": 4, "latest_version": 6, "tracker_connected": True,
    "bytes_in": {"origin": 100, "same_region": 250, "other_region": 50},
    "bytes_out": 700, "bytes_out_arriving": 200, "chunks_rejected": 2, "manifests_rejected": 1,
    "manifests_stale": 9,
    "unusable": ["v3 patch"], "fetching": {"v5 patch": 3, "v6 patch": 4},
    "peers_dropped": {"connections per minute": 40, "protocol error": 1}, "sessions_replaced": 3, "peers_snubbed": 2, "peers_snubbed_slow": 1, "requests_given_up_early": 4,
    "peers": [{"id": "a", "region": "r1", "role": "node"}, {"id": "b", "region": "r1", "role": "node"},
              {"id": "o", "region": "r0", "role": "origin"},
              {"id": "w", "region": "r2", "role": "node", "transport": "webrtc"}],
    "spool": {"records": 7, "bytes": 7000, "appended_total": 20, "acked_total": 13, "upload_rate_bps": 1234.5,
              "storage_failed": False, "storage_failures": 2, "storage_recoveries": 2},
    "local_socket": {"limit_bytes": 1 << 30, "used_bytes": 4096, "peak_bytes": 8192, "waiting": 0, "waits": 5,
                     "refused": 1, "timed_out": 2},
    "applied": [{"version": 3, "published_at": 100.0, "applied_at": 101.5},
                {"version": 4, "published_at": 200.0, "applied_at": 203.0}],
}


def test_node_series_follow_the_status():
    got = samples(NodeMetrics(), NODE_STATUS)
    expected = {
        ("patchswarm_version", ()): 4, ("patchswarm_latest_version", ()): 6, ("patchswarm_versions_behind", ()): 2,
        ("patchswarm_bytes_total", (("direction", "in"), ("source", "origin"))): 100,
        ("patchswarm_bytes_total", (("direction", "in"), ("source", "same_region"))): 250,
        ("patchswarm_bytes_total", (("direction", "in"), ("source", "other_region"))): 50,
        ("patchswarm_bytes_total", (("direction", "out"), ("source", "store"))): 500,
        ("patchswarm_bytes_total", (("direction", "out"), ("source", "relay"))): 200,
        ("patchswarm_chunks_rejected_total", (("reason", "sha256_mismatch"),)): 2,
        ("patchswarm_manifests_rejected_total", ()): 1, ("patchswarm_manifests_stale_total", ()): 9,
        ("patchswarm_objects_unusable", ()): 1, ("patchswarm_chunks_missing", ()): 7,
        ("patchswarm_peers", (("region", "r1"), ("role", "node"), ("transport", "tcp"))): 2,
        ("patchswarm_peers", (("region", "r0"), ("role", "origin"), ("transport", "tcp"))): 1,
        ("patchswarm_peers", (("region", "r2"), ("role", "node"), ("transport", "webrtc"))): 1,
        ("patchswarm_peers_dropped_total", (("kind", "connections per minute"),)): 40,
        ("patchswarm_peers_dropped_total", (("kind", "protocol error"),)): 1,
        ("patchswarm_sessions_replaced_total", ()): 3, ("patchswarm_peers_snubbed_total", ()): 2,
        ("patchswarm_peers_snubbed_slow_total", ()): 1, ("patchswarm_requests_given_up_early_total", ()): 4,
        ("patchswarm_tracker_connected", ()): 1, ("patchswarm_stopping", ()): 0, ("patchswarm_spool_records", ()): 7,
        ("patchswarm_spool_bytes", ()): 7000, ("patchswarm_trajectories_appended_total", ()): 20,
        ("patchswarm_trajectories_acked_total", ()): 13,
        ("patchswarm_trajectory_upload_bytes_per_second", ()): 1234.5,
        ("patchswarm_storage_failed", ()): 0, ("patchswarm_storage_failures_total", ()): 2,
        ("patchswarm_storage_recoveries_total", ()): 2,
        ("patchswarm_local_buffered_bytes", ()): 4096, ("patchswarm_local_buffer_limit_bytes", ()): 1 << 30,
        ("patchswarm_local_buffer_waits_total", ()): 5,
        ("patchswarm_local_requests_refused_total", (("reason", "too_large"),)): 1,
        ("patchswarm_local_requests_refused_total", (("reason", "buffers_full"),)): 2,
        ("patchswarm_publish_to_applied_seconds_count", ()): 2,
        ("patchswarm_publish_to_applied_seconds_sum", ()): 4.5,
        ("patchswarm_publish_to_applied_seconds_bucket", (("le", "2.0"),)): 1,
        ("patchswarm_publish_to_applied_seconds_bucket", (("le", "5.0"),)): 2,
    }
    for key, value in expected.items():
        assert got.get(key) == value, key
    assert not any(name.startswith("patchswarm_engine") for name, _ in got)  # no engine configured: no series


def test_a_stopping_node_says_so():
    """While it drains (uploads its spool before a stop, refusing submits) the node's status
    says `stopping`, and its metrics too."""
    assert samples(NodeMetrics(), {**NODE_STATUS, "stopping": True})[("patchswarm_stopping", ())] == 1


def test_each_applied_version_is_observed_once_across_scrapes():
    m = NodeMetrics()
    st = dict(NODE_STATUS)
    samples(m, st)
    st["applied"] = [*NODE_STATUS["applied"], {"version": 5, "published_at": 300.0, "applied_at": 300.5}]
    got = samples(m, st)
    assert got[("patchswarm_publish_to_applied_seconds_count", ())] == 3
    assert got[("patchswarm_publish_to_applied_seconds_sum", ())] == 5.0


@pytest.mark.parametrize("rejected, expected", [
    (0, {"sha256_mismatch": 0}),
    ({"sha256_mismatch": 1, "out_of_range": 2}, {"sha256_mismatch": 1, "out_of_range": 2}),
])
def test_rejections_by_reason(rejected, expected):
    got = samples(NodeMetrics(), {**NODE_STATUS, "chunks_rejected": rejected})
    assert {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "patchswarm_chunks_rejected_total"} == expected


@pytest.mark.parametrize("st, reason", [
    ({"version": None, "latest_version": None}, "no verified version yet"),
    ({"version": None, "latest_version": 2}, "no verified version yet"),
    ({"version": 1, "latest_version": 2}, "at version 1, latest heard of is 2"),
    ({"version": 2, "latest_version": None}, "at version 2, latest heard of is None"),
    ({"version": 2, "latest_version": 2}, None),
    ({"version": 2, "latest_version": 2, "engine": {"version": None, "last_error": None}},
     "at version 2, the engine holds None (pending)"),
    ({"version": 2, "latest_version": 2, "engine": {"version": 1, "last_error": "HTTP 503"}},
     "at version 2, the engine holds 1 (HTTP 503)"),
    ({"version": 2, "latest_version": 2, "engine": {"version": 2, "last_error": None}}, None),
])
def test_node_readiness(st, reason):
    assert NodeMetrics().not_ready(st) == reason


def test_engine_series_appear_only_with_an_engine_entry():
    st = {**NODE_STATUS, "engine": {"version": 2, "last_error": "refused", "publish_to_engine_s": 7.5}}
    got = samples(NodeMetrics(), st)
    assert got[("patchswarm_engine_version", ())] == 2
    assert got[("patchswarm_engine_versions_behind", ())] == 2
    assert got[("patchswarm_engine_error", ())] == 1
    assert got[("patchswarm_engine_handoff_seconds", ())] == 7.5


@pytest.mark.parametrize("metrics", [NodeMetrics, OriginMetrics])
def test_declared_measured_and_said_uplinks_are_gauges_where_the_status_has_them(metrics):
    base = NODE_STATUS if metrics is NodeMetrics else {"version": 1, "tracker_connected": True, "peers": []}
    got = samples(metrics(), {**base, "uplink_mbit": 100.0, "uplink_measured_mbit": 9.8, "uplink_said_mbit": 9.8})
    assert got[("patchswarm_uplink_declared_mbit", ())] == 100.0
    assert got[("patchswarm_uplink_measured_mbit", ())] == 9.8
    assert got[("patchswarm_uplink_said_mbit", ())] == 9.8
    none = samples(metrics(), {**base, "uplink_mbit": None, "uplink_measured_mbit": None})
    assert not any(name.startswith("patchswarm_uplink") for name, _ in none)  # no series for what is not known


def test_origin_series():
    st = {"version": 2, "tracker_connected": False, "bytes_out": 900,
          "peers": [{"id": "n1", "region": "r1", "role": "node"}],
          "versions": [{"version": 0, "patch_bytes": None, "keyframe_bytes": 1000, "full_bytes": 4000, "encode_s": 0.4},
                       {"version": 1, "patch_bytes": 30, "keyframe_bytes": None, "full_bytes": 4000, "encode_s": 0.2},
                       {"version": 2, "patch_bytes": 40, "keyframe_bytes": None, "full_bytes": 4000, "encode_s": 0.3}],
          "trajectories": {"records": 5, "duplicates_dropped": 3, "duplicates_by_key": 2, "record_keys": 4,
                           "payload_bytes": 500, "storage_failed": True,
                           "storage_failures": 1, "storage_recoveries": 0},
          "chunks_damaged": 3, "chunks_recovered": 2, "chunks_lost": 1}
    m = OriginMetrics()
    got = samples(m, st)
    assert got[("patchswarm_version", ())] == 2
    assert got[("patchswarm_publish_encode_seconds_count", ())] == 3
    assert got[("patchswarm_published_patch_bytes", ())] == 40
    assert got[("patchswarm_published_keyframe_bytes", ())] == 1000
    assert got[("patchswarm_bytes_total", (("direction", "out"), ("source", "store")))] == 900
    assert got[("patchswarm_peers", (("region", "r1"), ("role", "node"), ("transport", "tcp")))] == 1
    assert got[("patchswarm_trajectories_received_total", ())] == 5
    assert got[("patchswarm_trajectories_duplicates_by_key_total", ())] == 2
    assert got[("patchswarm_trajectory_record_keys", ())] == 4
    assert got[("patchswarm_storage_failed", ())] == 1 and got[("patchswarm_storage_failures_total", ())] == 1
    assert [got[(f"patchswarm_chunks_{k}_total", ())] for k in ("damaged", "recovered", "lost")] == [3, 2, 1]
    assert m.not_ready(st) == "not connected to the tracker yet"
    assert m.not_ready({**st, "tracker_connected": True}) is None


def test_tracker_series():
    st = {"latest_version": 5, "manifests_rejected": 2, "drops": {"silent": 3}, "refused": {"over join budget": 7},
          "members": [
        {"id": "o", "region": "r0", "role": "origin", "addr": "x:1", "versions": [5]},
        {"id": "a", "region": "r1", "role": "node", "addr": "x:2", "versions": [5]},
        {"id": "b", "region": "r1", "role": "node", "addr": "x:3", "versions": [4]},
        {"id": "c", "region": "r1", "role": "node", "addr": "x:4", "versions": [1]},
        {"id": "d", "region": "r2", "role": "node", "addr": "x:5", "versions": []}]}
    got = samples(TrackerMetrics(), st)
    assert got[("patchswarm_latest_version", ())] == 5
    assert got[("patchswarm_members", (("region", "r1"), ("role", "node")))] == 3
    assert got[("patchswarm_members", (("region", "r0"), ("role", "origin")))] == 1
    assert got[("patchswarm_members_behind", (("behind", "0"), ("region", "r1")))] == 1
    assert got[("patchswarm_members_behind", (("behind", "1"), ("region", "r1")))] == 1
    assert got[("patchswarm_members_behind", (("behind", "3+"), ("region", "r1")))] == 1
    assert got[("patchswarm_members_behind", (("behind", "none"), ("region", "r2")))] == 1
    assert got[("patchswarm_manifests_rejected_total", ())] == 2
    assert got[("patchswarm_members_dropped_total", (("why", "silent"),))] == 3
    assert got[("patchswarm_connections_refused_total", (("kind", "over join budget"),))] == 7


# ------------------------------------------------------------------ a real swarm


def http_get(addr: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(addr: str) -> list:
    """Every sample the member exports, parsed as Prometheus parses them."""
    status, body = http_get(addr, "/metrics")
    assert status == 200
    return [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]


def lookup(scraped: list, name: str, **labels) -> float | None:
    return next((s.value for s in scraped
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), None)


def value(scraped: list, name: str, **labels) -> float:
    v = lookup(scraped, name, **labels)
    if v is None:
        raise AssertionError(f"no sample {name}{labels}; found {sorted({s.name for s in scraped})}")
    return v


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g).to(torch.bfloat16)
    flat = w.view(-1)
    flat[step * 997 % flat.numel():][:2000] += 1  # a sparse change per version
    return {"w": w, "b": torch.arange(64, dtype=torch.int32) + step}


@pytest.mark.slow
def test_real_swarm_metrics_readiness_and_json_logs(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    json_logs = ["--log-format", "json"]
    with SwarmLab(tmp_path) as lab:
        tracker = lab.start_tracker(extra=["--metrics", "127.0.0.1:0", *json_logs])
        addrs = {"tracker": lab.http_addr(tracker)}
        nodes = []
        for i, region in enumerate(["r1", "r1", "r2"]):
            p = lab.start_node(f"n{i}", region, extra=["--metrics", "127.0.0.1:0", *json_logs])
            addrs[p.name] = lab.http_addr(p)
            nodes.append(p)
        # Nothing published yet: not ready, with the reason; alive.
        status, body = http_get(addrs["n0"], "/readyz")
        assert status == 503 and json.loads(body) == {"ready": False, "reason": "no verified version yet"}
        assert http_get(addrs["n0"], "/healthz")[0] == 200
        origin = lab.start_origin(region="r0", watch=ckpt, extra=["--metrics", "127.0.0.1:0", *json_logs])
        addrs["origin"] = lab.http_addr(origin)
        for v in range(3):
            write_checkpoint(ckpt, f"{v:04d}.safetensors", state(v))
            lab.wait_version(nodes, v)
        for p in nodes:
            assert http_get(addrs[p.name], "/readyz") == (200, b'{"ready": true}\n')
            f = scrape(addrs[p.name])
            assert value(f, "patchswarm_version") == 2 and value(f, "patchswarm_versions_behind") == 0
            assert value(f, "patchswarm_publish_to_applied_seconds_count") >= 3  # a keyframe and two patches, or more
            bytes_in = sum(value(f, "patchswarm_bytes_total", direction="in", source=s)
                           for s in ("origin", "same_region", "other_region"))
            assert bytes_in > 0
            value(f, "patchswarm_bytes_total", direction="out", source="store")
            value(f, "patchswarm_bytes_total", direction="out", source="relay")
            assert value(f, "patchswarm_chunks_rejected_total", reason="sha256_mismatch") == 0
            assert value(f, "patchswarm_peers", role="origin", region="r0", transport="tcp") == 1
            assert value(f, "patchswarm_spool_records") == 0
            assert value(f, "patchswarm_local_buffer_limit_bytes") == 1 << 30
            value(f, "patchswarm_trajectory_upload_bytes_per_second")
            assert value(f, "patchswarm_ready") == 1
            assert value(f, "patchswarm_build_info", service="node") == 1
            value(f, "process_resident_memory_bytes")
        f = scrape(addrs["origin"])
        assert value(f, "patchswarm_version") == 2 and value(f, "patchswarm_publish_encode_seconds_count") == 3
        assert value(f, "patchswarm_bytes_total", direction="out", source="store") > 0
        assert http_get(addrs["origin"], "/readyz")[0] == 200
        def tracker_sees_r1_current():  # the tracker learns versions from heartbeats (every 2 s)
            f = scrape(addrs["tracker"])
            return f if lookup(f, "patchswarm_members_behind", region="r1", behind="0") == 2 else None

        f = wait_until(tracker_sees_r1_current, "the tracker sees r1's nodes current")
        assert value(f, "patchswarm_latest_version") == 2
        assert value(f, "patchswarm_members", region="r0", role="origin") == 1
        assert value(f, "patchswarm_members", region="r2", role="node") == 1
    for p in lab.procs:
        lines = [line for line in p.text().splitlines() if line.strip()]
        assert lines, p.name
        for line in lines:
            obj = json.loads(line)  # every line, or the test fails here with the line
            assert obj["ts"].endswith("Z") and obj["event"] and obj["service"].split()[0] in ("tracker", "origin", "node")
