"""Where one layer's logical pages live during one forward, in O(1) runs, not per page.

Resident page of (layer index li, logical page lp < r) is lp * L + li; the streamed pages
[r, n) sit in consecutive ring slots, split in two where the ring wraps. A windowed layer
reads only from its window's first page (`first`): its streamed pages start there when
that is past r (`ring_from`), and the table entries between r and it are never written
nor read. The page table is written with a few tensor ops; the same placement as a
validated SpanPlan is available for checks (building it costs one span per resident page).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcompile.kv.span_plan import RESIDENT, Ring, Span, SpanPlan


@dataclass
class Placement:
    li: int
    L: int
    r: int                           # resident logical pages [0, r)
    n: int                           # logical pages read
    ring_runs: list                  # [(first logical, first physical, count)], at most 2
    first_slot: int = 0              # ring slot (from the ring's start) of logical page r
    ready: list = field(default_factory=list)
    claims: list = field(default_factory=list)   # (pages, owners) taken without a copy
    released: bool = False
    placed: int = 0                  # logical pages [0, placed) have their slots and fills
    held: list = field(default_factory=list)     # ring slot ranges this layer holds
    first: int = 0                   # first logical page read (a windowed layer's window)

    @classmethod
    def build(cls, li, L, r, n, ring: Ring, cursor: int, first: int = 0) -> "Placement":
        start = max(r, first)
        runs, left, lp, slot = [], n - start, start, cursor
        while left > 0:
            cnt = min(left, ring.n_slots - slot)
            runs.append((lp, ring.first_physical_page + slot, cnt))
            lp, left, slot = lp + cnt, left - cnt, 0
        return cls(li, L, r, n, runs, cursor, first=first)

    @property
    def ring_from(self) -> int:
        """The first logical page in the ring: r, or a windowed layer's first page."""
        return max(self.r, self.first)

    @property
    def n_streamed(self) -> int:
        return max(self.n - self.ring_from, 0)

    @property
    def n_resident_read(self) -> int:
        """Resident pages attention reads (those from the window's first page on)."""
        return max(min(self.r, self.n) - self.first, 0)

    def read_pages(self) -> range:
        """The logical pages attention reads."""
        return range(min(self.first, self.n), self.n)

    @property
    def complete(self) -> bool:
        return self.placed == self.n

    def slot_ranges(self):
        return [range(p0, p0 + c) for _, p0, c in self.ring_runs]

    def phys(self, lp: int) -> int:
        if lp < self.r:
            return lp * self.L + self.li
        for lp0, p0, c in self.ring_runs:
            if lp < lp0 + c:
                return p0 + lp - lp0
        raise IndexError(f"logical page {lp} is outside this placement ({self.n} pages)")

    def pages(self) -> list[int]:
        """Physical page of every logical page read (read_pages), in logical order."""
        out = [lp * self.L + self.li for lp in range(self.first, self.r)]
        for r in self.slot_ranges():
            out.extend(r)
        return out

    def runs(self, lo: int, hi: int):
        """[(first logical, first physical, count)] covering logical pages [lo, hi)."""
        out = [(lp, lp * self.L + self.li, 1) for lp in range(lo, min(hi, self.r))]
        for lp0, p0, c in self.ring_runs:
            a, b = max(lo, lp0), min(hi, lp0 + c)
            if a < b:
                out.append((a, p0 + a - lp0, b - a))
        return out

    def write_table(self, table: torch.Tensor, resident: torch.Tensor,
                    ring_pages: torch.Tensor | None = None, known: int = 0) -> int:
        """table[:n] = physical pages, by device ops only (no host copy). `resident` holds
        lp * L + li for lp < r (cached); `known` leading entries already hold it (they
        are skipped); `ring_pages` is the physical page of every ring slot, at least twice over, so
        the streamed pages are one slice even when they wrap. Returns the new `known`."""
        if known < self.r:
            table[known:self.r].copy_(resident[known:self.r])
        if not self.n_streamed:
            return max(known, self.r)
        if ring_pages is not None:
            table[self.ring_from:self.n].copy_(ring_pages[self.first_slot:
                                                          self.first_slot + self.n_streamed])
        else:
            for lp0, p0, c in self.ring_runs:
                table[lp0:lp0 + c] = torch.arange(p0, p0 + c, dtype=table.dtype,
                                                  device=table.device)
        return self.r

    def span_plan(self, num_physical_pages: int, ring: Ring) -> SpanPlan:
        """The pages read as a plan (from the first page read: a windowed layer's)."""
        spans = [Span(lp, lp * self.L + self.li, 1, RESIDENT)
                 for lp in range(self.first, self.r)]
        if self.n_streamed:
            first = self.ring_runs[0][1] - ring.first_physical_page
            spans += ring.spans(self.ring_from, self.n_streamed, first)
        return SpanPlan(spans, num_physical_pages, ring, first_page=min(self.first, self.n))
