"""The all-resident policy of a KV store: the arena holds every page of the context, the
device pages are the history, page tables never change. A forward places nothing and copies
nothing; it only records its telemetry. The streamed policy's counterpart: streamer.py."""
from __future__ import annotations

import time
import weakref

from kvcompile.kv.fences import DONE
from kvcompile.kv.telemetry import StepStats

RESIDENT = "resident"     # the layout of every step over an all-resident store


def _nothing(self, *args) -> None:
    """A step of the streamed policy that has nothing to do when every page is resident."""


class AllResident:
    def __init__(self, store):
        self.store = weakref.proxy(store)     # the store owns this: no cycle (streamer.py)

    # nothing to place, copy, fence or publish: the store's bracket and a capture's hooks
    open = issue = prepare_capture = begin_capture = abandon_capture = end_issue = _nothing
    join_copies = forget = plan = synchronize = _nothing

    def end(self, s: dict, ok: bool, ahead: bool) -> None:
        if ok:
            self.record(s)

    def replayed(self, s: dict, moved, filled) -> None:
        self.record(s, replayed=True)

    def record(self, s: dict, replayed: bool = False) -> None:
        """The forward's telemetry: nothing crossed PCIe."""
        st = self.store
        n = s["hi"] // st.page_size + 1
        st.telemetry.append(StepStats(
            step=len(st.telemetry), tokens=s["tokens"], context_pages=n,
            resident_pages=len(st.layers) * st.num_pages, ring_slots=0, h2d_bytes=0,
            d2h_bytes=0, readiness_misses=0, copy_busy_pct=0.0, ring_occupancy=0.0,
            resident_reads=n * len(s["layers"]), streamed_reads=0, layers=len(s["layers"]),
            repartitioned=False, policy="all resident",
            wall_ms=1e3 * (time.perf_counter() - s["t0"]), replayed=replayed))

    def step_layout(self, s: dict):
        """One layout for every step: the tables never change."""
        return RESIDENT

    def end_capture(self) -> tuple[int, int]:
        return 0, 0                       # a replay copies nothing

    def captured(self):
        return None                       # nothing filled ahead

    def close(self):
        """The fence of the arena's last use: none pending beyond the caller's stream."""
        return DONE
