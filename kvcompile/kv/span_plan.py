"""Span plans: where each logical KV page of a layer lives for one attention call.

A plan is an ordered list of spans; each maps a run of consecutive logical pages to a
run of consecutive physical pages of the arena's page pool, either resident pages or
ring slots. A streamed run that wraps around the end of the ring is two ring spans
(before and after the wrap). The plan must cover logical pages 0..n-1 exactly once, in
order, and no two spans may share a physical page. `page_table()` turns it into the
int32 table that `torch.ops.kvcompile.span_attention` takes (physical page of each
logical page); the kernels split work by logical position only, so every valid plan
for the same logical KV gives bitwise the same attention output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.errors import KvLayoutError

RESIDENT = "resident"
RING = "ring"
KINDS = (RESIDENT, RING)


@dataclass(frozen=True)
class Span:
    first_logical_page: int
    first_physical_page: int
    n_pages: int
    kind: str = RESIDENT

    @property
    def logical_end(self) -> int:
        return self.first_logical_page + self.n_pages

    @property
    def physical_end(self) -> int:
        return self.first_physical_page + self.n_pages


@dataclass(frozen=True)
class Ring:
    """The ring's physical slots: [first_physical_page, first_physical_page + n_slots)."""
    first_physical_page: int
    n_slots: int

    def spans(self, first_logical_page: int, n_pages: int, start_slot: int) -> list[Span]:
        """Ring spans holding logical pages [first, first + n_pages) from ring slot
        `start_slot` on, split in two where the run wraps past the last slot."""
        if not 0 < n_pages <= self.n_slots:
            raise KvLayoutError(f"a ring of {self.n_slots} slots cannot hold a run of "
                                f"{n_pages} pages; give the ring more slots or stream "
                                f"fewer pages per layer")
        if not 0 <= start_slot < self.n_slots:
            raise KvLayoutError(f"ring slot {start_slot} is outside 0..{self.n_slots - 1}")
        head = min(n_pages, self.n_slots - start_slot)
        out = [Span(first_logical_page, self.first_physical_page + start_slot, head, RING)]
        if head < n_pages:
            out.append(Span(first_logical_page + head, self.first_physical_page,
                            n_pages - head, RING))
        return out


class SpanPlan:
    """A validated, ordered span plan (see the module docstring)."""

    def __init__(self, spans, num_physical_pages: int | None = None,
                 ring: Ring | None = None, first_page: int = 0):
        """first_page: the plan covers logical pages from there (a windowed layer's window:
        the pages before it are never read)."""
        self.spans = tuple(spans)
        self.num_physical_pages = num_physical_pages
        self.ring = ring
        self.first_page = first_page
        validate(self.spans, num_physical_pages, ring, first_page)

    @property
    def n_logical_pages(self) -> int:
        return self.spans[-1].logical_end if self.spans else 0

    def check_covers(self, n_ctx: int, page_size: int) -> None:
        need = -(-n_ctx // page_size)
        if need > self.n_logical_pages:
            raise KvLayoutError(f"{n_ctx} tokens need {need} pages of {page_size} but the "
                                f"span plan covers {self.n_logical_pages}; add spans for "
                                f"logical pages {self.n_logical_pages}..{need - 1}")

    def page_table(self, length: int | None = None, device=None) -> torch.Tensor:
        """int32 [length] physical page per logical page; entries past the plan are 0
        (never read: the kernels stop at the last query position)."""
        n = self.n_logical_pages
        length = n if length is None else length
        if length < n:
            raise KvLayoutError(f"a page table of {length} entries cannot hold a plan of "
                                f"{n} logical pages; pass length >= {n}")
        table = torch.zeros(length, dtype=torch.int32)
        for s in self.spans:
            table[s.first_logical_page:s.logical_end] = torch.arange(
                s.first_physical_page, s.physical_end, dtype=torch.int32)
        return table if device is None else table.to(device)

    def __repr__(self) -> str:
        rows = ", ".join(f"{s.kind}[{s.first_logical_page}:{s.logical_end})"
                         f"->{s.first_physical_page}" for s in self.spans)
        return f"SpanPlan({rows})"


def validate(spans, num_physical_pages: int | None, ring: Ring | None,
             first_page: int = 0) -> None:
    """Raise KvLayoutError unless the spans cover logical pages first_page..n-1 in order,
    without gaps or overlaps, on distinct physical pages inside the pool (ring spans inside
    the ring, resident spans outside it)."""
    if not spans:
        raise KvLayoutError("a span plan needs at least one span")
    expect = first_page
    for i, s in enumerate(spans):
        if s.kind not in KINDS:
            raise KvLayoutError(f"span {i} has kind {s.kind!r}; use 'resident' or 'ring'")
        if s.n_pages <= 0:
            raise KvLayoutError(f"span {i} has {s.n_pages} pages; every span needs >= 1")
        if s.first_physical_page < 0 or s.first_logical_page < 0:
            raise KvLayoutError(f"span {i} has a negative page index")
        if s.first_logical_page > expect:
            raise KvLayoutError(f"gap in the span plan: logical pages {expect}.."
                                f"{s.first_logical_page - 1} are in no span (span {i} "
                                f"starts at {s.first_logical_page})")
        if s.first_logical_page < expect:
            raise KvLayoutError(f"span {i} starts at logical page {s.first_logical_page}, "
                                f"overlapping or out of order with the spans before it "
                                f"(which end at {expect}); list spans in logical order "
                                f"without overlaps")
        expect = s.logical_end
        if num_physical_pages is not None and s.physical_end > num_physical_pages:
            raise KvLayoutError(f"span {i} uses physical pages {s.first_physical_page}.."
                                f"{s.physical_end - 1} but the pool has "
                                f"{num_physical_pages}")
        if ring is not None:
            r0, r1 = ring.first_physical_page, ring.first_physical_page + ring.n_slots
            inside = r0 <= s.first_physical_page and s.physical_end <= r1
            apart = s.physical_end <= r0 or s.first_physical_page >= r1
            if s.kind == RING and not inside:
                raise KvLayoutError(f"ring span {i} (physical {s.first_physical_page}.."
                                    f"{s.physical_end - 1}) leaves the ring {r0}..{r1 - 1}")
            if s.kind == RESIDENT and not apart:
                raise KvLayoutError(f"resident span {i} (physical {s.first_physical_page}.."
                                    f"{s.physical_end - 1}) overlaps the ring {r0}..{r1 - 1}")
    by_phys = sorted(range(len(spans)), key=lambda j: spans[j].first_physical_page)
    for a, b in zip(by_phys, by_phys[1:]):
        if spans[b].first_physical_page < spans[a].physical_end:
            raise KvLayoutError(f"spans {a} and {b} share physical pages from "
                                f"{spans[b].first_physical_page}; each logical page needs "
                                f"its own physical page")
