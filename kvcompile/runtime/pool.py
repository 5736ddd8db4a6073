"""The resident/ring pool: which physical page holds each layer's logical page, and copies.

Physical pages [0, P) of the arena's K and V page pools (same index in both). Resident
page of (layer index li, logical page lp < r) is lp * L + li: growing or shrinking r moves
only the pages at the boundary. The ring is [L * r, P), one ring for all streamed layers,
handed out first-in first-out so the slots taken next are the ones released longest ago.

Per forward, layers are issued in order: a layer gets ring slots for its pages >= r (its
span plan), host->device copies of contiguous runs (one copy per run, K and V), and ready
fences. A layer only takes slots already released by earlier layers, so a copy waits only
on consumed fences that exist (recorded), never on future work; prefetch of later layers
stops at the first layer the ring cannot take yet. Release publishes the rows written this
forward to host history and records each page's consumed fence.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.runtime.copy_engine import CopyNote
from kvcompile.runtime.fences import DONE, AllOf, all_done, wait_all
from kvcompile.span_plan import RESIDENT, Ring, Span, SpanPlan

UNSAFE = frozenset({"skip_ready_wait", "skip_consumed_wait"})  # test-only broken orderings


@dataclass
class _Issued:
    plan: SpanPlan
    table: list[int]                 # physical page per logical page
    ring: list[int]                  # ring slots held, in logical order
    ready: list = field(default_factory=list)
    released: bool = False


@dataclass
class ForwardCounters:
    misses: int = 0
    resident_reads: int = 0
    streamed_reads: int = 0
    peak_held: int = 0
    copies: int = 0


class StreamingPool:
    def __init__(self, k_pool, v_pool, host, layers, engine, backend, max_pages: int,
                 unsafe=frozenset()):
        if set(unsafe) - UNSAFE:
            raise ValueError(f"unknown unsafe switches {set(unsafe) - UNSAFE}")
        self.k_pool, self.v_pool, self.host = k_pool, v_pool, host
        self.layers = tuple(layers)
        self.index = {layer: li for li, layer in enumerate(self.layers)}
        self.L, self.P = len(self.layers), k_pool.shape[0]
        self.engine, self.backend, self.unsafe = engine, backend, frozenset(unsafe)
        self.checker = engine.instrument.checker
        self.max_pages = max_pages
        self.page_tables = {l: torch.zeros(max_pages, dtype=torch.int32, device=k_pool.device)
                            for l in self.layers}
        self.r = 0
        self.cursor = 0                          # next ring slot, relative to the ring start
        self.holder: list = [None] * self.P      # ring slot -> layer holding it this forward
        self.last_use: list = [DONE] * self.P    # consumed fence of every physical page
        self.valid: set = set()                  # (li, lp) resident pages holding host content
        self.issued: dict[int, _Issued] = {}
        self.active = None                       # (n_pages, written logical pages) of a forward
        self.current = None
        self.order: list[int] = []
        self.count = ForwardCounters()

    # ---- layout --------------------------------------------------------------------------
    @property
    def ring(self) -> Ring:
        return Ring(self.L * self.r, self.P - self.L * self.r)

    def resident_page(self, li: int, lp: int) -> int:
        return lp * self.L + li

    def leased_pages(self) -> frozenset:
        """Pages a layer holds or the device may still touch (consumed fence pending)."""
        return frozenset(p for p in range(self.P)
                         if self.holder[p] is not None or not self.last_use[p].query())

    def repartition(self, r: int) -> None:
        """Switch to r resident pages per layer; pages changing role must be drained."""
        self._idle("repartition")
        if not 0 <= r * self.L <= self.P:
            raise KvLayoutError(f"{r} resident pages for {self.L} layers exceed {self.P} pages")
        lo, hi = sorted((self.r, r))
        changed = range(lo * self.L, hi * self.L)
        wait_all(self.last_use[p] for p in changed)
        self.valid = {(li, lp) for li, lp in self.valid if lp < r}
        if self.checker is not None:
            self.checker.release(changed)
        self.r, self.cursor = r, 0

    def drop_resident(self) -> None:
        """Forget every resident page (overwritten with junk): host history must rebuild them."""
        self._idle("drop resident pages")
        pages = range(self.L * self.r)
        wait_all(self.last_use[p] for p in pages)
        self.k_pool[: self.L * self.r].fill_(0x7F)
        self.v_pool[: self.L * self.r].fill_(0x7F)
        self.valid.clear()
        if self.checker is not None:
            self.checker.release(pages)

    def drain(self) -> None:
        self.engine.synchronize()
        wait_all(self.last_use)

    # ---- one forward -----------------------------------------------------------------------
    def begin(self, n_pages: int, written: range, layers=None) -> None:
        """Start a forward over n_pages per layer that writes logical pages `written`;
        `layers` (default all) are the layers it will acquire, in this order."""
        self._idle("begin a forward")
        self.order = [self.index[l] for l in (self.layers if layers is None else layers)]
        if len(set(self.order)) != len(self.order):
            raise KvLayoutError(f"a forward acquires each layer once; got {layers}")
        if n_pages - self.r > self.ring.n_slots:
            raise KvLayoutError(f"{n_pages} pages per layer need a ring of "
                                f"{n_pages - self.r} slots; the ring has {self.ring.n_slots}")
        self.active, self.issued, self.current = (n_pages, written), {}, None
        self.count = ForwardCounters()
        self._prefetch()

    def acquire(self, layer: int) -> torch.Tensor:
        """Make the layer's pages present, rewrite its page table, return the table."""
        li = self.index[layer]
        if self.current is not None:
            self.release(self.current)
        self._prefetch()
        if li not in self.issued:
            raise KvLayoutError(f"layer {layer} could not get ring slots: layers must be "
                                f"acquired in the order given to begin_forward, once each")
        job = self.issued[li]
        if job.released:
            raise KvLayoutError(f"layer {layer} was already acquired in this forward; its "
                                f"ring slots may be reused by now")
        if not all_done(job.ready):
            self.count.misses += 1
        if "skip_ready_wait" not in self.unsafe:
            wait_all(job.ready)
        self.page_tables[layer].copy_(job.plan.page_table(self.max_pages))
        if self.checker is not None:
            self.checker.read_start(job.table, [(li, lp) for lp in range(len(job.table))])
        delay = self.engine.instrument.compute_delay
        if delay is not None:
            time.sleep(delay())
        self.count.resident_reads += len(job.table) - len(job.ring)
        self.count.streamed_reads += len(job.ring)
        self.current = layer
        return self.page_tables[layer]

    def release(self, layer: int) -> None:
        li = self.index[layer]
        job = self.issued[li]
        if self.checker is not None:
            self.checker.read_end(job.table)
        done = self.backend.compute_fence()
        for p in job.table:
            self.last_use[p] = done
        _, written = self.active
        for lp0, p0, n in _runs([(lp, job.table[lp]) for lp in written]):
            keys = tuple((li, lp) for lp in range(lp0, lp0 + n))
            f = self.engine.copy([(self.host.k[layer][lp0:lp0 + n], self.k_pool[p0:p0 + n]),
                                  (self.host.v[layer][lp0:lp0 + n], self.v_pool[p0:p0 + n])],
                                 CopyNote("publish", tuple(range(p0, p0 + n)), (), keys),
                                 after=[done])
            for p in range(p0, p0 + n):
                self.last_use[p] = f
        for s in job.ring:
            self.holder[s] = None
        if self.checker is not None:
            self.checker.release(job.ring)
        job.released, self.current = True, None

    def end(self) -> None:
        if self.current is not None:
            self.release(self.current)
        for job in self.issued.values():     # issued but never acquired (a failed forward):
            if not job.released:             # its slots are free once its copies landed
                done = AllOf(job.ready)
                for s in job.ring:
                    self.holder[s], self.last_use[s] = None, done
                if self.checker is not None:
                    self.checker.release(job.ring)
        self.active, self.issued = None, {}

    # ---- issuing ---------------------------------------------------------------------------
    def _prefetch(self) -> None:
        """Issue layers in order from the first not issued, as far as the ring allows."""
        nxt = len(self.issued)
        while nxt < len(self.order) and self._issue(self.order[nxt]):
            nxt += 1
        held = sum(h is not None for h in self.holder)
        self.count.peak_held = max(self.count.peak_held, held)

    def _issue(self, li: int) -> bool:
        n_pages, _ = self.active
        ring, r = self.ring, min(self.r, n_pages)
        n_stream = n_pages - r
        slots = [ring.first_physical_page + (self.cursor + k) % max(ring.n_slots, 1)
                 for k in range(n_stream)]
        ignore_held = "skip_consumed_wait" in self.unsafe
        if not ignore_held and any(self.holder[s] is not None for s in slots):
            return False
        layer = self.layers[li]
        spans = [Span(lp, self.resident_page(li, lp), 1, RESIDENT) for lp in range(r)]
        if n_stream:
            spans += ring.spans(r, n_stream, self.cursor)
        plan = SpanPlan(spans, self.P, ring)
        table = [self.resident_page(li, lp) for lp in range(r)] + slots
        job = _Issued(plan, table, slots)
        for s in slots:
            self.holder[s] = layer
        self.cursor = (self.cursor + n_stream) % max(ring.n_slots, 1)
        todo = [(lp, p) for lp, p in enumerate(table) if lp >= r or (li, lp) not in self.valid]
        self.valid.update((li, lp) for lp in range(r))
        for lp0, p0, n in _runs(todo, cut=self.host.rows_pages(layer)):
            pages = tuple(range(p0, p0 + n))
            owners = tuple((li, lp) for lp in range(lp0, lp0 + n))
            after = [] if ignore_held else [self.last_use[p] for p in pages]
            if not self.host.has_rows(layer, lp0):
                # Nothing published for these pages yet: no copy, but the layer's writes
                # must still wait for the pages' previous users.
                if self.checker is not None:
                    self.checker.claim(pages, owners)
                job.ready += after
                continue
            job.ready.append(self.engine.copy(
                [(self.k_pool[p0:p0 + n], self.host.k[layer][lp0:lp0 + n]),
                 (self.v_pool[p0:p0 + n], self.host.v[layer][lp0:lp0 + n])],
                CopyNote("fill", pages, owners, owners), after=after))
            self.count.copies += 1
        self.issued[li] = job
        return True

    def _idle(self, what: str) -> None:
        if self.active is not None:
            raise KvLayoutError(f"cannot {what} in the middle of a forward")


def _runs(pairs, cut: int = -1):
    """[(logical, physical)] -> [(first logical, first physical, n)] for consecutive runs
    (a run never crosses logical page `cut`)."""
    out = []
    for lp, p in pairs:
        if (out and out[-1][0] + out[-1][2] == lp and out[-1][1] + out[-1][2] == p
                and lp != cut):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((lp, p, 1))
    return out
