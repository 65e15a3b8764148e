"""What else the machine was doing during a benchmark (other processes distort CPU timings here), and the
peak-memory probes the memory benchmarks share."""

from __future__ import annotations

import os
import time


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(CPU seconds busy on the whole machine, CPU seconds of this process, wall clock); None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()


def other_cores(start: tuple[float, float, float] | None) -> float | None:
    """Average number of cores other processes kept busy since `start` (None where /proc/stat is missing)."""
    end = cpu_snapshot()
    if start is None or end is None:
        return None
    return max((end[0] - start[0]) - (end[1] - start[1]), 0.0) / (end[2] - start[2])


def proc_status_kib(key: str) -> int | None:
    """A kB field of /proc/self/status (VmRSS, VmHWM, ...); None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Set VmHWM to the current VmRSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
