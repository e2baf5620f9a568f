"""Every host link's byte counters, sampled every few ms while a WAN bench run fetches (a diagnosis).

Owns `LinkTrace`: one thread that enters each host's network namespace in turn
(setns(2) acts on the calling thread only, so the bench's other threads stay in
the root namespace, and no process of ours joins a host's namespace: teardown,
which kills whatever runs there, finds none) and reads that namespace's
/proc/thread-self/net/dev. One reading of all hosts takes well under a
millisecond per host, against 5-10 ms for `ip -s link` (a process per reading),
so the trace resolves the 50-100 ms in which a version's last chunks move.
Also `rate_table`: the samples as Mbit/s per interval of a few hosts' links.

What it settled (bench/RESULTS.md, issue 26, 2026-12-06): in the origin's region
the origin's uplink and every member's downlink ran at the link's rate from the
first 0.1 s to the origin's last byte, so that region's time over its bound is
the origin's bytes over the patch (its rests and second copies: 1.03-1.10x), a
slower first 0.1 s where 12 daemons share 2 cores, and the fan-out of the last
chunks after the origin's last byte.

Must not change any namespace's settings, or read anything but the counters.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import time

CLONE_NEWNET = 0x40000000
SAMPLE_S = 0.01
MAX_SAMPLES = 100_000  # per host: 1000 s at SAMPLE_S, far past any run's limit


class LinkTraceError(RuntimeError):
    """The trace could not enter a host's namespace or read its counters."""


def _setns(libc, fd: int, name: str) -> None:
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise LinkTraceError(f"setns into {name}'s namespace: {os.strerror(ctypes.get_errno())}")


def read_counters(iface: str) -> tuple[int, int]:
    """(rx bytes, tx bytes) of `iface` in the calling thread's network namespace."""
    with open("/proc/thread-self/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise LinkTraceError(f"/proc/thread-self/net/dev: expected a line for {iface!r}, found none")


class LinkTrace:
    """Samples (wall-clock time, rx bytes, tx bytes) of each host's link from `start` to `stop`.

        trace = LinkTrace({h.name: (h.netns, h.iface) for h in topo.hosts})
        trace.start(); ...; trace.stop()
        trace.samples["origin"]  # [(time.time(), rx, tx), ...]
    """

    def __init__(self, links: dict[str, tuple[str, str]], sample_s: float = SAMPLE_S):
        if not links:
            raise ValueError("links: expected at least one (netns, iface) to trace, found none")
        if not 0 < sample_s <= 1:
            raise ValueError(f"sample_s: expected 0 < s <= 1, found {sample_s}")
        self.links = dict(links)
        self.sample_s = sample_s
        self.samples: dict[str, list[tuple[float, int, int]]] = {name: [] for name in links}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LinkTrace: started twice")
        self._thread = threading.Thread(target=self._run, name="link-trace", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the sampling; raises what stopped it early, if anything did."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise LinkTraceError(f"the sampling thread did not end within {timeout_s} s")
        if self.error is not None:
            raise LinkTraceError(f"link trace stopped early: {self.error}") from self.error

    def close(self) -> None:
        """End the sampling if it runs, quietly (after a failed run; `stop` reports errors)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        fds: dict[str, int] = {}
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            for name, (netns, _) in self.links.items():
                fds[name] = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            for _ in range(MAX_SAMPLES):
                if self._stop.is_set():
                    return
                for name, fd in fds.items():
                    _setns(libc, fd, name)
                    rx, tx = read_counters(self.links[name][1])
                    self.samples[name].append((time.time(), rx, tx))
                self._stop.wait(self.sample_s)
        except BaseException as e:  # reported by stop(), in the bench's thread
            self.error = e
        finally:
            for fd in fds.values():
                os.close(fd)


def _at(rows: list[tuple[float, int, int]], t: float, way: int) -> int | None:
    """The counter (`way` 1: rx, 2: tx) at the last sample at or before `t`."""
    i = bisect.bisect_right(rows, t, key=lambda r: r[0])
    return rows[i - 1][way] if i else None


def rate_table(samples: dict[str, list[tuple[float, int, int]]], columns: list[tuple[str, str]],
               t0: float, until_s: float, step_s: float = 0.1) -> str:
    """Mbit/s per `step_s` interval from wall-clock `t0` to `t0 + until_s`, one column per
    (host, "rx" | "tx") of `columns`, as counted by the link (what the shaper let through).
    A host not sampled yet shows "-"; the interval its first sample falls in counts from that
    sample, so its column's total is what its samples in the window saw move."""
    if step_s <= 0 or until_s <= 0:
        raise ValueError(f"step_s and until_s: expected > 0, found {step_s}, {until_s}")
    if not columns:
        raise ValueError("columns: expected at least one (host, 'rx' | 'tx'), found none")
    heads = [f"{host} {way}" for host, way in columns]
    width = max(7, *(len(h) for h in heads))
    lines = ["     s  " + " ".join(f"{h:>{width}}" for h in heads)]
    totals = [0] * len(columns)
    for k in range(int(round(until_s / step_s))):
        a, b = t0 + k * step_s, t0 + (k + 1) * step_s
        cells = []
        for i, (host, way) in enumerate(columns):
            rows, w = samples[host], 1 if way == "rx" else 2
            x, y = _at(rows, a, w), _at(rows, b, w)
            if x is None and y is not None:
                x = rows[0][w]  # this host's first sample came inside the interval: count from it
            if x is None or y is None:
                cells.append(f"{'-':>{width}}")
                continue
            totals[i] += y - x
            cells.append(f"{(y - x) * 8 / step_s / 1e6:>{width}.1f}")
        lines.append(f"{(k + 1) * step_s:6.2f}  " + " ".join(cells))
    lines.append("    MB  " + " ".join(f"{t / 1e6:>{width}.2f}" for t in totals))
    return "\n".join(lines)
