"""A service's HTTP side: /metrics, /healthz, /readyz (and any page the service adds), on `--metrics HOST:PORT`.

Owns the Prometheus registry of one service (its status collector from
node/net/metrics.py, the process's own series, build info, event-loop lag,
readiness), the event-loop monitor behind /healthz, the readiness latch behind
/readyz, and serving them with node/net/httpserve.py. Everything runs as tasks
in the nursery `Exporter.run` opens: no threads. Must not read a service's
internals: it gets a status function once the service has started (`attach`).

- /healthz: 200 while the event loop answers: a task sleeps LOOP_TICK and
  records how late it woke; a lateness over LOOP_STALL (something blocked the
  loop) answers 503 until a tick is on time again. A loop blocked right now
  answers nothing at all, which a probe counts as a failure too.
- /readyz: 503 (with the reason) until the service's rule says ready (a node:
  a verified version that is the latest heard of, and handed to the engine
  where one is configured), then 200 for the life of the process: a node a
  version behind while it fetches the next one still serves the one it has.
"""

from __future__ import annotations

import json
import logging
from typing import Iterable

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from patchswarm.node.net.httpserve import Response, Route, serve_http
from patchswarm.node.net.logs import event
from patchswarm.node.net.metrics import StatusFn, StatusMetrics
from patchswarm.node.net.service import package_version

log = logging.getLogger("patchswarm.exporter")

LOOP_TICK = 0.5  # s between the loop monitor's wake-ups
LOOP_STALL = 5.0  # s late: the loop was blocked; /healthz answers 503
READY_POLL = 0.5  # s between readiness checks (a node may be current only briefly)


class LoopMonitor:
    """How late the event loop runs a task that asked to wake up: the loop's responsiveness."""

    def __init__(self, tick: float = LOOP_TICK, stall: float = LOOP_STALL) -> None:
        self.tick, self.stall = tick, stall
        self.lag = 0.0
        self.max_lag = 0.0

    async def run(self) -> None:
        while True:
            asked = trio.current_time() + self.tick
            await trio.sleep_until(asked)
            self.lag = max(0.0, trio.current_time() - asked)
            self.max_lag = max(self.max_lag, self.lag)

    def healthy(self) -> bool:
        return self.lag <= self.stall


class Exporter:
    def __init__(self, metrics: StatusMetrics, pages: dict[str, Route] | None = None,
                 loop: LoopMonitor | None = None):
        self.metrics = metrics
        self.loop = loop or LoopMonitor()
        self.ready = False
        self.not_ready_reason = "starting"
        self.version = package_version()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(metrics)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.routes: dict[str, Route] = {"/metrics": self._metrics, "/healthz": self._healthz,
                                         "/readyz": self._readyz, **(pages or {})}

    def attach(self, status: StatusFn) -> None:
        """The service has started: from now on its status feeds the metrics and readiness."""
        self.metrics.attach(status)
        self.check_ready()

    # ------------------------------------------------ collector of the exporter's own series

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily("patchswarm_build_info", "the running patchswarm's version and service",
                              labels=["version", "service"])
        g.add_metric([self.version, self.metrics.service], 1)
        yield g
        yield GaugeMetricFamily("patchswarm_event_loop_lag_seconds", "how late the event loop last ran a timed wake-up",
                                value=self.loop.lag)
        yield GaugeMetricFamily("patchswarm_event_loop_lag_max_seconds", "the largest such lateness since start",
                                value=self.loop.max_lag)
        yield GaugeMetricFamily("patchswarm_ready", "1 once /readyz answers 200", value=int(self.ready))

    # ------------------------------------------------ routes

    def check_ready(self) -> bool:
        if not self.ready:
            st = self.metrics.status()
            reason = "starting" if st is None else self.metrics.not_ready(st)
            if reason is None:
                self.ready = True
                log.info("ready", extra=event("ready"))
            else:
                self.not_ready_reason = reason
        return self.ready

    def _metrics(self) -> Response:
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    def _healthz(self) -> Response:
        ok = self.loop.healthy()
        body = {"healthy": ok, "event_loop_lag_s": round(self.loop.lag, 4)}
        return Response(200 if ok else 503, json.dumps(body).encode() + b"\n", "application/json")

    def _readyz(self) -> Response:
        ready = self.check_ready()
        body = {"ready": ready} if ready else {"ready": False, "reason": self.not_ready_reason}
        return Response(200 if ready else 503, json.dumps(body).encode() + b"\n", "application/json")

    # ------------------------------------------------ life

    async def run(self, addr: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve on `addr` until cancelled; reports the bound address."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.loop.run)
            bound = await nursery.start(serve_http, addr, self.routes)
            log.info("metrics, health and readiness on http://%s/metrics", bound,
                     extra=event("http_listening", addr=bound, routes=sorted(self.routes)))
            task_status.started(bound)
            while not self.check_ready():
                await trio.sleep(READY_POLL)
