"""What each service exports to Prometheus, read from its own status at scrape time, and when it is ready.

Owns one collector per service (`NodeMetrics`, `OriginMetrics`, `TrackerMetrics`):
each turns the dict its service's `status()` / `stats()` already returns into
metric families when Prometheus scrapes, so the services keep no metrics
objects and their code has no counter calls. Histograms of events the status
lists (versions applied, versions published) are observed once per event, at
the first scrape that sees it. Each also says whether its service is ready
(`not_ready(status)` -> the reason, or None). Must not import the services:
it reads dicts, and a key a service does not report is left out, never faked.

The status keys read here are the contract with the services (node/daemon.py,
node/trainer/origin.py, tracker/server.py); tests/test_metrics.py runs a real
swarm and checks every series below is present.

Engine hand-off (issue 20): a node whose status has an `engine` entry
{"version": int | None, "last_error": str | None, "publish_to_engine_s": float | None}
gets the engine series, and is ready only once the engine holds its version.
Without that entry there is no engine series at all.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
StatusFn = Callable[[], dict]


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> Iterable[Metric]:
    if value is None:
        return
    g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), float(value))
    yield g


def _disk(st: dict) -> Iterable[Metric]:
    """Our disk failing writes (node/diskspace.py): the same keys in a node's and the origin's status."""
    if "disk_full" not in st:
        return
    full = st["disk_full"] or (st.get("spool") or {}).get("disk_full") or st.get("trajectory_disk_full")
    yield from _gauge("patchswarm_disk_full", "1 while a write to the data dir failed on the disk and none "
                      "succeeded since (it is retried)", int(bool(full)))
    yield from _counter("patchswarm_disk_write_failures", "writes to the data dir that failed on the disk",
                        st.get("disk_write_failures"))
    yield from _gauge("patchswarm_disk_free_bytes", "bytes free on the data dir's file system", st.get("disk_free_bytes"))


def _uplink(st: dict) -> Iterable[Metric]:
    """The uplink a member declared, the one measured while its sends backed up
    (protocol/uplinkmeter.py) and (a node's) the one it says: the same keys in a node's and the
    origin's status, which has no said one."""
    yield from _gauge("patchswarm_uplink_declared_mbit", "the uplink this member declared (--uplink-mbit), "
                      "which its share of each version is planned on", st.get("uplink_mbit"))
    yield from _gauge("patchswarm_uplink_measured_mbit", "this member's upload rate while more than one of its "
                      "sends within its region waited at once (the median of the last 32 half-second samples)",
                      st.get("uplink_measured_mbit"))
    yield from _gauge("patchswarm_uplink_said_mbit", "the uplink this member tells the tracker, which every member "
                      "plans its share on: declared, or measured where that is under a quarter of it",
                      st.get("uplink_said_mbit"))


def _storage(st: dict) -> Iterable[Metric]:
    """The trajectory log's I/O errors other than a full disk (node/seglog.py): the node's spool
    or the origin's trajectory store, whichever this status has."""
    log = st.get("spool") or st.get("trajectories") or {}
    if "storage_failed" not in log:
        return
    yield from _gauge("patchswarm_storage_failed", "1 while trajectory commits fail because the log could not be cut "
                      "back after an I/O error (retried at most once a second)", int(bool(log["storage_failed"])))
    yield from _counter("patchswarm_storage_failures", "trajectory commits failed by an I/O error other than a full "
                        "disk (nothing of them acknowledged)", log.get("storage_failures"))
    yield from _counter("patchswarm_storage_recoveries", "recoveries from those without a restart",
                        log.get("storage_recoveries"))


def _counter(name: str, doc: str, value: float | None) -> Iterable[Metric]:
    if value is None:
        return
    yield CounterMetricFamily(name, doc, value=float(value))


def _peers(peers: list[dict]) -> Metric:
    """Connected peers by region, role and transport (TCP+TLS unless the status names another)."""
    counts: dict[tuple[str, str, str], int] = {}
    for p in peers:
        key = (p.get("region", ""), p.get("role", ""), p.get("transport", "tcp"))
        counts[key] = counts.get(key, 0) + 1
    g = GaugeMetricFamily("patchswarm_peers", "connected peers by region, role and transport",
                          labels=["region", "role", "transport"])
    for key, n in sorted(counts.items()):
        g.add_metric(list(key), n)
    return g


def _links(st: dict) -> Iterable[Metric]:
    """A member's connections: its peers (where its status lists them) and the tracker link."""
    if "peers" in st:
        yield _peers(st["peers"])
    if "peers_dropped" in st:
        d = CounterMetricFamily("patchswarm_peers_dropped", "peers dropped and connections refused, by kind of "
                                                            "fault or budget (node/peers.py)", labels=["kind"])
        for kind, n in sorted(st["peers_dropped"].items()):
            d.add_metric([kind], n)
        yield d
    yield from _counter("patchswarm_sessions_replaced", "peer sessions ended by the same member's new connection",
                        st.get("sessions_replaced"))
    yield from _counter("patchswarm_peers_snubbed", "peers that held requests and sent no part for SNUB_AFTER s "
                                                    "(protocol/picker.py), each time", st.get("peers_snubbed"))
    yield from _counter("patchswarm_peers_snubbed_slow", "peers that served so slowly that a chunk would take them "
                                                         "10 s or more, more where this node's chunks come slowly "
                                                         "(protocol/picker.py SLOW_CHUNK_MIN_S), each time",
                        st.get("peers_snubbed_slow"))
    yield from _counter("patchswarm_requests_given_up_early", "requests given up before their timeout, their chunk "
                                                              "due from that peer only after it at its rate "
                                                              "(protocol/picker.py PAST_ITS_TIMEOUT)",
                        st.get("requests_given_up_early"))
    yield from _gauge("patchswarm_tracker_connected", "1 while the tracker link is up",
                      int(bool(st.get("tracker_connected"))))


class StatusMetrics:
    """A Prometheus collector over one service's status dict (None until the service has started)."""

    service = "service"

    def __init__(self) -> None:
        self._status: StatusFn | None = None

    def attach(self, status: StatusFn) -> None:
        self._status = status

    def status(self) -> dict | None:
        return None if self._status is None else self._status()

    def describe(self) -> list:
        return []  # families vary with the status; the registry must not call collect() to learn names

    def collect(self) -> Iterable[Metric]:
        st = self.status()
        if st is not None:
            yield from self.families(st)

    def families(self, st: dict) -> Iterable[Metric]:
        raise NotImplementedError

    def not_ready(self, st: dict) -> str | None:
        """Why the service is not ready yet (None: it is)."""
        return None


class NodeMetrics(StatusMetrics):
    service = "node"

    def __init__(self) -> None:
        super().__init__()
        self.publish_to_applied = Histogram(
            "patchswarm_publish_to_applied_seconds",
            "from the origin signing a version (manifest created_at) to this node holding it verified",
            buckets=LATENCY_BUCKETS, registry=None)
        self._observed_version = -1

    def families(self, st: dict) -> Iterable[Metric]:
        version, latest = st.get("version"), st.get("latest_version")
        yield from _gauge("patchswarm_version", "the verified version this node holds", version)
        yield from _gauge("patchswarm_latest_version", "the newest version this node has heard of", latest)
        if latest is not None:
            behind = latest + 1 if version is None else max(0, latest - version)
            yield from _gauge("patchswarm_versions_behind", "versions between the held one and the latest heard of "
                                                            "(latest + 1 with none held)", behind)
        for entry in st.get("applied", ()):
            if entry["version"] > self._observed_version and "published_at" in entry:
                self.publish_to_applied.observe(max(0.0, entry["applied_at"] - entry["published_at"]))
                self._observed_version = entry["version"]
        yield from self.publish_to_applied.collect()
        b = CounterMetricFamily("patchswarm_bytes", "chunk bytes by direction and source: in from the origin, "
                                                    "the same region or other regions; out from the store or "
                                                    "relayed while still arriving", labels=["direction", "source"])
        for source, n in st.get("bytes_in", {}).items():
            b.add_metric(["in", source], n)
        if "bytes_out" in st:
            relayed = st.get("bytes_out_arriving", 0)
            b.add_metric(["out", "store"], st["bytes_out"] - relayed)
            b.add_metric(["out", "relay"], relayed)
        yield b
        rejected = st.get("chunks_rejected")
        if rejected is not None:
            r = CounterMetricFamily("patchswarm_chunks_rejected", "chunks refused, by reason",
                                    labels=["reason"])
            by_reason = rejected if isinstance(rejected, dict) else {"sha256_mismatch": rejected}
            for reason, n in sorted(by_reason.items()):
                r.add_metric([reason], n)
            yield r
        yield from _counter("patchswarm_manifests_rejected", "manifests refused (signature, swarm, conflict)",
                            st.get("manifests_rejected"))
        yield from _counter("patchswarm_manifests_stale", "manifests refused unread: at or below the node's version, "
                            "or superseded by its latest keyframe (a member replaying old ones shows here)",
                            st.get("manifests_stale"))
        if "unusable" in st:
            yield from _gauge("patchswarm_objects_unusable", "verified objects that failed to apply",
                              len(st["unusable"]))
        if "fetching" in st:
            yield from _gauge("patchswarm_chunks_missing", "chunks still to fetch for the versions wanted",
                              sum(st["fetching"].values()))
        yield from _links(st)
        yield from _disk(st)
        yield from _storage(st)
        yield from _uplink(st)
        yield from _gauge("patchswarm_stopping", "1 while the node stops: it uploads its trajectory spool first and "
                          "refuses submits (--drain-s)", int(bool(st.get("stopping"))))
        spool = st.get("spool")
        if spool:
            yield from _gauge("patchswarm_spool_records", "trajectories spooled and not yet acknowledged by the origin",
                              spool["records"])
            yield from _gauge("patchswarm_spool_bytes", "bytes of those trajectories", spool["bytes"])
            yield from _counter("patchswarm_trajectories_appended", "trajectories submitted and made durable",
                                spool.get("appended_total"))
            yield from _counter("patchswarm_trajectories_acked", "trajectories the origin acknowledged",
                                spool.get("acked_total"))
            yield from _counter("patchswarm_trajectories_repeated", "resubmitted trajectories answered with the seq "
                                "their record id was stored under, not stored again", spool.get("repeated_total"))
            yield from _gauge("patchswarm_trajectory_upload_bytes_per_second",
                              "trajectory bytes sent to the origin per second, over the last 5 s",
                              spool.get("upload_rate_bps"))
        local = st.get("local_socket")
        if local:
            yield from _gauge("patchswarm_local_buffered_bytes", "bytes of requests received on the local socket and "
                              "not yet handled, all clients together", local["used_bytes"])
            yield from _gauge("patchswarm_local_buffer_limit_bytes", "the most the local socket holds so",
                              local["limit_bytes"])
            yield from _counter("patchswarm_local_buffer_waits", "times a local client's request waited for room "
                                "(the node stopped reading it)", local["waits"])
            r = CounterMetricFamily("patchswarm_local_requests_refused", "local requests refused for room: larger than "
                                    "the whole budget (too_large), or no room within the wait (buffers_full)",
                                    labels=["reason"])
            r.add_metric(["too_large"], float(local["refused"]))
            r.add_metric(["buffers_full"], float(local["timed_out"]))
            yield r
        engine = st.get("engine")
        if engine is not None:
            yield from _gauge("patchswarm_engine_version", "the version the inference engine holds",
                              engine.get("version"))
            if version is not None:
                held = engine.get("version")
                yield from _gauge("patchswarm_engine_versions_behind", "versions the engine lags this node",
                                  version + 1 if held is None else max(0, version - held))
            yield from _gauge("patchswarm_engine_error", "1 while the last hand-off failed",
                              int(engine.get("last_error") is not None))
            yield from _gauge("patchswarm_engine_handoff_seconds", "publish to engine holding it, last version",
                              engine.get("publish_to_engine_s"))

    def not_ready(self, st: dict) -> str | None:
        version, latest = st.get("version"), st.get("latest_version")
        if version is None:
            return "no verified version yet"
        if latest is None or version < latest:
            return f"at version {version}, latest heard of is {latest}"
        engine = st.get("engine")
        if engine is not None and engine.get("version") != version:
            return f"at version {version}, the engine holds {engine.get('version')} ({engine.get('last_error') or 'pending'})"
        return None


class OriginMetrics(StatusMetrics):
    service = "origin"

    def __init__(self) -> None:
        super().__init__()
        self.encode_seconds = Histogram("patchswarm_publish_encode_seconds",
                                        "publish: cast, hash, diff, encode, sign and write one version",
                                        buckets=LATENCY_BUCKETS, registry=None)
        self._observed_version = -1

    def families(self, st: dict) -> Iterable[Metric]:
        yield from _gauge("patchswarm_version", "the latest version published", st.get("version"))
        history = st.get("versions", [])
        for v in history:
            if v["version"] > self._observed_version:
                self.encode_seconds.observe(v["encode_s"])
                self._observed_version = v["version"]
        yield from self.encode_seconds.collect()
        if history:
            last = history[-1]
            yield from _gauge("patchswarm_published_patch_bytes", "bytes of the latest version's patch",
                              last.get("patch_bytes"))
            yield from _gauge("patchswarm_published_keyframe_bytes", "bytes of the latest keyframe published",
                              next((v["keyframe_bytes"] for v in reversed(history) if v.get("keyframe_bytes")), None))
            yield from _gauge("patchswarm_checkpoint_bytes", "raw bytes of the served checkpoint", last.get("full_bytes"))
        if "bytes_out" in st:
            b = CounterMetricFamily("patchswarm_bytes", "chunk bytes by direction and source",
                                    labels=["direction", "source"])
            b.add_metric(["out", "store"], st["bytes_out"])
            yield b
        yield from _links(st)
        yield from _disk(st)
        yield from _storage(st)
        yield from _uplink(st)
        yield from _counter("patchswarm_chunks_damaged", "published chunks found changed on this origin's disk when read",
                            st.get("chunks_damaged"))
        yield from _counter("patchswarm_chunks_recovered", "chunks lost on this origin's disk and taken back from a node "
                            "or encoded again", st.get("chunks_recovered"))
        yield from _counter("patchswarm_chunks_lost", "chunks lost on this origin's disk that no node brought back "
                            "(routed around)", st.get("chunks_lost"))
        t = st.get("trajectories")
        if t:
            yield from _counter("patchswarm_trajectories_received", "trajectory records stored", t.get("records"))
            yield from _counter("patchswarm_trajectories_duplicates_dropped", "trajectory records received twice",
                                t.get("duplicates_dropped"))
            yield from _counter("patchswarm_trajectories_duplicates_by_key", "of those, records whose client record id "
                                "the store held (resubmitted, maybe through another node)", t.get("duplicates_by_key"))
            yield from _gauge("patchswarm_trajectory_record_keys", "record keys the store remembers (at most its window)",
                              t.get("record_keys"))
            yield from _counter("patchswarm_trajectory_payload_bytes", "trajectory payload bytes stored",
                                t.get("payload_bytes"))

    def not_ready(self, st: dict) -> str | None:
        return None if st.get("tracker_connected") else "not connected to the tracker yet"


class TrackerMetrics(StatusMetrics):
    service = "tracker"

    def families(self, st: dict) -> Iterable[Metric]:
        latest = st.get("latest_version")
        yield from _gauge("patchswarm_latest_version", "the newest version announced", latest)
        members = st.get("members", [])
        by: dict[tuple[str, str], int] = {}
        lag: dict[tuple[str, str], int] = {}
        for m in members:
            by[(m["region"], m["role"])] = by.get((m["region"], m["role"]), 0) + 1
            if m["role"] == "node":
                held = max(m["versions"], default=None)
                bucket = "none" if held is None else str(min(3, max(0, (latest or 0) - held)))
                bucket = "3+" if bucket == "3" else bucket
                lag[(m["region"], bucket)] = lag.get((m["region"], bucket), 0) + 1
        g = GaugeMetricFamily("patchswarm_members", "members connected, by region and role", labels=["region", "role"])
        for key, n in sorted(by.items()):
            g.add_metric(list(key), n)
        yield g
        g = GaugeMetricFamily("patchswarm_members_behind", "nodes by region and versions behind the latest "
                                                           "(0, 1, 2, 3+, none held)", labels=["region", "behind"])
        for key, n in sorted(lag.items()):
            g.add_metric(list(key), n)
        yield g
        yield from _counter("patchswarm_manifests_rejected", "announcements refused (not the origin, bad manifest)",
                            st.get("manifests_rejected"))
        for name, doc, key, label in (
                ("patchswarm_members_dropped", "member sessions ended by the tracker, by reason", "drops", "why"),
                ("patchswarm_connections_refused", "connections the listener refused before a session, by kind "
                                                   "(over join budget, connections before Hello, region, TLS)", "refused",
                 "kind")):
            if key in st:
                c = CounterMetricFamily(name, doc, labels=[label])
                for k, n in sorted(st[key].items()):
                    c.add_metric([k], n)
                yield c
