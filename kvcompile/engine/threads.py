"""CPU threads for the steps: `threads` as given, or by default the physical cores less
those other processes keep busy, re-read about once a second. OpenMP's threads meet at a
barrier after every op, so one thread descheduled by another process stalls the others:
on a busy machine fewer threads decode far faster than the full count."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

RECHECK_S = 1.0
# torch's thread count is the process's: what the last CpuThreads set, and the ceiling it
# found (a count set by anyone else, OMP_NUM_THREADS included, is the caller's ceiling)
_process = {"set": None, "ceiling": None}


def physical_cores() -> int:
    """Cores (not hyper-threads) this process may run on."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:                      # not on Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores) or os.cpu_count() or 1


def _busy_s() -> float | None:
    """Seconds all CPUs spent busy since boot (Linux), None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


def _set(n: int) -> None:
    if _process["ceiling"] is None:               # the process's count before any Engine's
        _process["ceiling"] = torch.get_num_threads()
    torch.set_num_threads(n)
    _process["set"] = n


def ceiling() -> int:
    """The most threads a default Engine uses: the physical cores, or fewer where the
    process was told so (torch.set_num_threads, OMP_NUM_THREADS)."""
    now = torch.get_num_threads()
    if now != _process["set"]:
        _process["ceiling"] = now
    return min(physical_cores(), _process["ceiling"])


class CpuThreads:
    def __init__(self, threads: int | None):
        self.fixed = threads
        self.cores = ceiling() if threads is None else threads
        self._last = None if threads is not None else (time.monotonic(), _busy_s(), _own_s())
        self.want = self.cores
        _set(self.cores)

    def adjust(self) -> None:
        """Follow other processes' load (cheap: one read of /proc/stat a second). The count
        is the process's: another Engine may have set its own since this one's last step."""
        if torch.get_num_threads() != self.want:
            _set(self.want)
        if self.fixed is not None or self._last is None or self._last[1] is None:
            return
        now = time.monotonic()
        if now - self._last[0] < RECHECK_S:
            return
        busy, own = _busy_s(), _own_s()
        t0, busy0, own0 = self._last
        self._last = (now, busy, own)
        others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)   # cores' worth
        self.want = max(1, min(self.cores, self.cores - math.ceil(others - 0.25)))
        if self.want != torch.get_num_threads():
            _set(self.want)
