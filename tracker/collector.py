"""When the tracker process runs Python's cyclic garbage collector.

Owns the collector's schedule in the tracker process (`CollectorSchedule`):
CPython's own rule for full collections is replaced by one that scans only
young objects often and the whole heap rarely. It must not change what is
collected, only when: every cycle that becomes garbage is freed within
`full_every` seconds.

*Why:* a tracker with 10,000 members holds millions of objects (a TLS socket,
a reader and a sender task per member), and 5,000 heartbeats a second each
leave a few objects that live two seconds, until the member's next message:
long enough to be promoted to the oldest generation, where they then die by
reference counting. CPython runs a full collection whenever the objects
promoted since the last one reach a quarter of the heap, so that churn alone
made full collections walk the whole heap every few seconds: measured with
`bench/tracker_load.py` at 10,000 members, 57 % of the tracker's CPU was the
collector (tracker/README.md, "Garbage collection").

The schedule: automatic collections of the two young generations as usual;
no automatic full collection; every `freeze_every` seconds a full collection
of what is not frozen (objects that survived since the last freeze: cheap,
since most of them have died by then), after which the survivors are frozen
(`gc.freeze`: moved out of every generation the collector scans); every
`full_every` seconds, or when the frozen objects grew by a quarter more than
the load explains, everything is unfrozen and collected once, which frees
cycles among long-lived objects (members that left) and is the one pause that
grows with the fleet.

*Load:* the caller says how many long-lived things the heap grows with (the
tracker: its members). The heap is modelled as the baseline frozen at `start`
plus a cost per unit of load, measured at each complete collection; growth is
counted against that model. Without it, a fleet growing from 1,000 to 10,000
members looked like garbage piling up and set off a complete collection at
every quarter of growth, the last of them (0.76 s at 10,000 members) just as
the fleet reached its size; a member that leaves cycles behind still shows up
as frozen objects the load does not explain.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("patchswarm.tracker")

NO_AUTOMATIC_FULL = 1 << 30  # third threshold: gen-1 collections before CPython considers a full one

# The collector is the process's: several schedules (trackers in one test process) share one
# takeover, made by the first to start and undone by the last to stop.
_takeover: dict = {"schedules": 0, "thresholds": None}


class CollectorSchedule:
    def __init__(self, freeze_every: float = 60.0, full_every: float = 3600.0, growth: float = 0.25):
        if not 0 < freeze_every <= full_every:
            raise ValueError(f"expected 0 < freeze_every <= full_every, found {freeze_every} and {full_every}")
        self.freeze_every = freeze_every
        self.full_every = full_every
        self.growth = growth
        self._running = False
        self._last_freeze = self._last_full = 0.0
        self._baseline = 0  # objects frozen at start: imports and configuration
        self._per_load = 0.0  # frozen objects per unit of load beyond the baseline, at the last complete collection
        self._frozen_after_full = 0
        self._frozen = 0  # objects frozen, as counted after the last freeze
        self.freezes = self.fulls = 0
        self.longest_pause = 0.0  # seconds, of the collections this schedule ran
        self.last_full: dict | None = None

    def start(self, now: float) -> None:
        """Take over full collections from CPython (until `stop`)."""
        if not self._running:
            self._running = True
            if _takeover["schedules"] == 0:
                _takeover["thresholds"] = gc.get_threshold()
                young0, young1, _ = _takeover["thresholds"]
                gc.set_threshold(young0, young1, NO_AUTOMATIC_FULL)
            _takeover["schedules"] += 1
        # What exists now (imports, configuration) lives as long as the process: collected
        # once and frozen, it is the baseline the frozen heap's growth is measured from.
        gc.collect()
        gc.freeze()
        self._last_freeze = self._last_full = now
        self._baseline = self._frozen = self._frozen_after_full = gc.get_freeze_count()
        self._per_load = 0.0

    def stop(self) -> None:
        """CPython's schedule again, with nothing left frozen."""
        if self._running:
            self._running = False
            _takeover["schedules"] -= 1
            if _takeover["schedules"] == 0:
                gc.set_threshold(*_takeover["thresholds"])
                gc.unfreeze()

    def due(self, now: float) -> float:
        """When `tick` next has something to do."""
        return min(self._last_freeze + self.freeze_every, self._last_full + self.full_every)

    def tick(self, now: float, load: int = 0) -> str | None:
        """Run the collection that is due, if any; says which ("full" or "freeze").

        `load`: the long-lived things the heap grows with now (members)."""
        if not self._running:
            return None
        if now - self._last_full >= self.full_every:
            self.collect_all(now, load)
            return "full"
        if now - self._last_freeze < self.freeze_every:
            return None
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        # Counting the frozen objects walks all of them (gc.get_freeze_count is a list walk:
        # 0.6 s at 10,000 members on a busy machine, profiled): once per freeze, which is the
        # only time the count can grow, never per tick.
        self._frozen = gc.get_freeze_count()
        self._note(t0)
        self._last_freeze = now
        self.freezes += 1
        if self._frozen > self._allowed(load):
            self.collect_all(now, load)
            return "full"
        return "freeze"

    def _allowed(self, load: int) -> float:
        """Frozen objects beyond which garbage is taken to have piled up."""
        # What the last complete collection kept was all alive: never expect less than that,
        # or a heap that stays above the model would be collected at every tick.
        expected = max(self._frozen_after_full, self._baseline + self._per_load * load)
        return expected * (1 + self.growth) + 100_000

    def collect_all(self, now: float, load: int = 0) -> float:
        """One complete collection (everything unfrozen, collected, frozen again): its pause in seconds."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        cpu = time.thread_time() - cpu0
        pause = self._note(t0)
        self._last_full = self._last_freeze = now
        self._frozen = self._frozen_after_full = kept = gc.get_freeze_count()
        if load > 0:
            self._per_load = max(0.0, (kept - self._baseline) / load)
        self.fulls += 1
        self.last_full = {"unreachable": found, "objects": kept, "pause_s": round(pause, 4), "cpu_s": round(cpu, 4),
                          "load": load}
        log.debug("full collection: %d unreachable, %d objects kept, %.3f s", found, kept, pause)
        return pause

    def _note(self, t0: float) -> float:
        pause = time.perf_counter() - t0
        self.longest_pause = max(self.longest_pause, pause)
        return pause

    def status(self) -> dict:
        return {"freezes": self.freezes, "full_collections": self.fulls, "frozen_objects": self._frozen,
                "longest_pause_s": round(self.longest_pause, 4), "last_full": self.last_full}
