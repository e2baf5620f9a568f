"""CPU time from /proc, for the benches' CPU columns: one process's, and the whole machine's.

Both count clock ticks (SC_CLK_TCK) the kernel charged; the difference of two
readings is the CPU time spent between them.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` (all its threads) has used so far; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent not idle since boot."""
    return machine_cpu_seconds()[0]


def machine_cpu_seconds() -> tuple[float, float]:
    """CPU seconds every core of the machine spent not idle since boot, and of them those
    spent in the kernel (system, irq, softirq: on the WAN bench, mostly the emulated
    links' packet work, which no process's nice value reaches)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    kernel = ticks[2] + ticks[5] + ticks[6]  # system, irq, softirq
    return (sum(ticks[:8]) - idle) / _TICK, kernel / _TICK  # to steal; guest time is counted in user already
