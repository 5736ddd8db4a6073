"""The fixed forwards of the streaming pool: steps captured as one CUDA graph each.

A fixed forward (`begin(..., fixed=True)`, a step captured as one CUDA graph) does the same
device work whatever the position within its pages: slots from ring slot 0, every streamed
page filled whether or not the host holds rows for it yet (a page the context has not
reached is read as junk and never attended to). It publishes the bytes of its rows (`rows`,
the step's positions as a device tensor) on the compute side before the consumed fence
(kv/row_publish.py), or without row maps every page of `written`. `fill_ahead` issues,
between two fixed forwards, the fills the next one's begin would issue (its first layers,
as far as the empty ring takes them), so the copy engine works while the host samples and
launches; that forward then begins with `ahead=k` and skips them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvcompile.kv.fences import DONE, AllOf, device_wait_all, wait_all
from kvcompile.kv.placement import Placement


@dataclass
class FilledAhead:
    """What fill_ahead issued: for a fixed forward over n_pages of these layers at split r
    that writes from page `first` (windowed layers' placements depend on it), its first k
    layers, with their fills' ready fences (by layer index) and slots."""
    n_pages: int
    layers: tuple
    r: int
    k: int
    ready: dict
    slots: list
    first: int = 0


class FixedForwards:
    """StreamingPool's methods around fixed forwards: filling ahead, refills outside a
    step, and the bookkeeping of a capture and of its replays."""

    def fill_ahead(self, n_pages: int, layers, first: int = 0) -> int:
        """Issue now the fills the next fixed forward over n_pages would issue at its
        begin, into the same slots, behind every page's last use; returns how many layers
        (0: stale resident pages want refills first, which such a forward does not make).
        A forward that is not that one finds those slots' last use in these fills.
        first: the page that forward writes from (its layout's)."""
        self._idle("fill ahead")
        if self.refills(n_pages, layers):
            return 0
        count = self.count                   # the last forward's, for its telemetry
        split, self.split_fills = self.split_fills, False   # whole layers: the forward
        try:                                                 # skips them
            self.begin(n_pages, range(first, first), layers, fixed=True)
        finally:
            self.split_fills = split
        self.count = count
        jobs = self.issued
        for job in jobs.values():            # free again once their copies landed
            self._unhold(job, AllOf(job.ready))
        self.active, self.issued, self.fixed = None, {}, False
        self.filled_ahead = FilledAhead(
            n_pages, tuple(layers), self.r, len(jobs),
            {li: list(job.ready) for li, job in jobs.items()},
            [p for job in jobs.values() for s in job.slot_ranges() for p in s], first)
        return len(jobs)

    def ahead_for(self, n_pages: int, layers, first: int = 0) -> int:
        """How many first layers of a fixed forward over n_pages, writing from page
        `first`, were filled ahead."""
        a = self.filled_ahead
        match = a is not None and (a.n_pages, a.layers, a.r, a.first) == (
            n_pages, tuple(layers), self.r, first)
        return a.k if match else 0

    def _publish_rows(self, layer, rows: torch.Tensor) -> None:
        self.engine.publish_rows((self.k_pool, self.v_pool),
                                 (self.host.k[layer], self.host.v[layer]),
                                 self.page_tables[layer], rows, self.row_maps)

    def warm_row_publish(self, rows: torch.Tensor, layer) -> None:
        """Launch the row publish once as a fixed forward will (rows: its positions) for
        `layer`, outside a capture: rows it writes to the host are rewritten by the
        forward."""
        if self.row_maps is not None:
            self._publish_rows(layer, rows)

    def _drop_ahead(self) -> None:
        """The forward filled ahead for will not run: its slots are free once filled (the
        checker, which saw them filled for that forward, waits and hears so)."""
        a, self.filled_ahead = self.filled_ahead, None
        if a is not None and self.checker is not None and a.slots:
            wait_all([f for fs in a.ready.values() for f in fs])
            self.checker.release(a.slots)

    def refill(self, n_pages: int, layers) -> None:
        """Copy now, outside any forward, the stale resident pages a forward over n_pages
        would refill (`refills`), and order the compute side after them: that forward can
        then be a captured step, which must not repeat the refill at every replay."""
        self._idle("refill resident pages")
        r = min(self.r, n_pages)
        ready = []
        for layer in layers:
            li = self.index[layer]
            v, cut = self.valid_upto[li], min(r, self.host.rows_pages(layer))
            if v < cut:                      # a placement of its resident pages alone
                job = Placement.build(li, self.L, r, r, self._ring, 0)
                job.placed = v
                self._place(job, cut)
                self.last_use[v * self.L + li:cut * self.L + li:self.L] = \
                    [job.ready[-1]] * (cut - v)      # (its copy: every page has rows)
                ready += job.ready
            self.valid_upto[li] = max(v, cut)
        device_wait_all(ready)

    def refills(self, n_pages: int, layers) -> bool:
        """Would a forward over n_pages copy stale resident pages from host history (once,
        after a repartition or drop_resident: such a forward must not be captured)?"""
        r = min(self.r, n_pages)
        return any(min(self.valid_upto[self.index[l]], r) < min(r, self.host.rows_pages(l))
                   for l in layers)

    def prepare_capture(self) -> None:
        """Before a capture: everything issued so far has completed, a captured step may
        only wait on what it records itself, and what the capture changes is noted for
        `abandon`."""
        self.drain()
        self._before_capture = self.cursor, list(self.valid_upto)
        self.forget_fences()

    def forget_fences(self) -> None:
        """Every page's last use is done: after a drain, or after a capture (its events
        were never recorded: nothing ran)."""
        self.last_use = [DONE] * self.P
        self.filled_ahead = self.ahead_record()

    def abandon(self) -> None:
        """After a failed capture: its forward goes without publishing (captured work never
        ran), and the bookkeeping it changed comes back; every page table is rewritten by
        the next forward."""
        for job in self.issued.values():
            self._unhold(job, None)
            job.released = True
        self.active, self.issued, self.current, self.fixed = None, {}, None, False
        self.partial = None
        self.rows = self.filled_ahead = None
        self.cursor, self.valid_upto = self._before_capture
        self._table_known = [0] * self.L
        self.forget_fences()

    def replayed(self, fence, filled: FilledAhead | None = None) -> None:
        """A captured step ran: every page's last use is that step (`fence`, recorded after
        its replay, covers its copies too); what it filled ahead (`filled`, its capture's
        `ahead_record`) is the fill ahead now, landed by `fence`."""
        self.last_use = [fence] * self.P
        self.filled_ahead = (None if filled is None else
                             replace(filled, ready={li: [fence] for li in filled.ready}))

    def ahead_record(self) -> FilledAhead | None:
        """What was filled ahead, its fences left out (a capture's: they never ran)."""
        a = self.filled_ahead
        return None if a is None else replace(a, ready={li: [] for li in a.ready})
