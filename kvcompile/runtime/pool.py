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

from dataclasses import dataclass

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.runtime.copy_engine import CopyNote
from kvcompile.runtime.fences import DONE, AllOf, device_wait_all, wait_all
from kvcompile.runtime.placement import Placement
from kvcompile.span_plan import Ring

UNSAFE = frozenset({"skip_ready_wait", "skip_consumed_wait"})  # test-only broken orderings


@dataclass
class ForwardCounters:
    misses: int = 0
    resident_reads: int = 0
    streamed_reads: int = 0
    peak_held: int = 0
    copies: int = 0


class StreamingPool:
    def __init__(self, k_pool, v_pool, host, layers, engine, backend, max_pages: int,
                 unsafe=frozenset(), check_plans: bool | None = None):
        if set(unsafe) - UNSAFE:
            raise ValueError(f"unknown unsafe switches {set(unsafe) - UNSAFE}")
        self.k_pool, self.v_pool, self.host = k_pool, v_pool, host
        self.layers = tuple(layers)
        self.index = {layer: li for li, layer in enumerate(self.layers)}
        self.L, self.P = len(self.layers), k_pool.shape[0]
        self.engine, self.backend, self.unsafe = engine, backend, frozenset(unsafe)
        self.checker = engine.instrument.checker
        # Validate every placement as a SpanPlan (one span per resident page: ~0.5 ms per
        # layer at 128K context, so the backend decides; the CPU backend checks).
        self.check_plans = (getattr(backend, "check_plans", False) if check_plans is None
                            else check_plans)
        self.max_pages = max_pages
        dev = k_pool.device
        self.page_tables = {l: torch.zeros(max_pages, dtype=torch.int32, device=dev)
                            for l in self.layers}
        top = self.P // max(self.L, 1) + 1
        self._resident = [torch.arange(top, dtype=torch.int32, device=dev) * self.L + li
                          for li in range(self.L)]
        self.r = 0
        self.cursor = 0                          # next ring slot, relative to the ring start
        self.holder: list = [None] * self.P      # ring slot -> layer holding it this forward
        self.held = 0
        self.last_use: list = [DONE] * self.P    # consumed fence of every physical page
        self.valid_upto = [0] * self.L           # resident pages [0, v) hold host content
        self.issued: dict[int, Placement] = {}
        self.active = None                       # (n_pages, written logical pages) of a forward
        self.current = None
        self.order: list[int] = []
        self.count = ForwardCounters()

    # ---- layout --------------------------------------------------------------------------
    @property
    def ring(self) -> Ring:
        return Ring(self.L * self.r, self.P - self.L * self.r)

    def leased_pages(self) -> frozenset:
        """Pages a layer holds or the device may still touch (consumed fence pending)."""
        pending = {f for f in set(self.last_use) if not f.query()}
        if not pending and not self.held:
            return frozenset()
        return frozenset(p for p in range(self.P)
                         if self.holder[p] is not None or self.last_use[p] in pending)

    def repartition(self, r: int) -> None:
        """Switch to r resident pages per layer; pages changing role must be drained."""
        self._idle("repartition")
        if not 0 <= r * self.L <= self.P:
            raise KvLayoutError(f"{r} resident pages for {self.L} layers exceed {self.P} pages")
        lo, hi = sorted((self.r, r))
        wait_all(set(self.last_use[lo * self.L:hi * self.L]))
        self.valid_upto = [min(v, r) for v in self.valid_upto]
        if self.checker is not None:
            self.checker.release(range(lo * self.L, hi * self.L))
        self.r, self.cursor = r, 0

    def drop_resident(self) -> None:
        """Forget every resident page (overwritten with junk): host history must rebuild them."""
        self._idle("drop resident pages")
        n = self.L * self.r
        wait_all(set(self.last_use[:n]))
        self.k_pool[:n].fill_(0x7F)
        self.v_pool[:n].fill_(0x7F)
        self.valid_upto = [0] * self.L
        if self.checker is not None:
            self.checker.release(range(n))

    def forget(self) -> None:
        """A new sequence: no resident page holds host content any more."""
        self._idle("forget the sequence")
        self.drain()
        self.valid_upto = [0] * self.L
        if self.checker is not None:
            self.checker.release(range(self.L * self.r))

    def drain(self) -> None:
        self.engine.synchronize()
        wait_all(set(self.last_use))

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
        job = self.issued.get(li)
        if job is None:
            raise KvLayoutError(f"layer {layer} could not get ring slots: layers must be "
                                f"acquired in the order given to begin_forward, once each")
        if job.released:
            raise KvLayoutError(f"layer {layer} was already acquired in this forward; its "
                                f"ring slots may be reused by now")
        if self.backend.readiness_miss(job.ready):
            self.count.misses += 1
        if "skip_ready_wait" not in self.unsafe:
            # The compute side waits for the copies; on CUDA a stream wait, no host sync.
            device_wait_all(job.ready)
        table = self.page_tables[layer]
        job.write_table(table, self._resident[li])
        if self.check_plans:
            plan = job.span_plan(self.P, self.ring)
            if not torch.equal(plan.page_table(job.n), table[:job.n].cpu()):
                raise KvLayoutError(f"layer {layer}: page table disagrees with {plan}")
        if self.checker is not None:
            for pages, owners in job.claims:
                self.checker.claim(pages, owners)
            self.checker.read_start(job.pages(), [(li, lp) for lp in range(job.n)])
        delay = self.engine.instrument.compute_delay
        if delay is not None:
            self.backend.compute_delay(delay())
        self.count.resident_reads += job.r
        self.count.streamed_reads += job.n_streamed
        self.current = layer
        return table

    def release(self, layer: int) -> None:
        li = self.index[layer]
        job = self.issued[li]
        if self.checker is not None:     # before the consumed fence: its waiters follow these
            self.checker.read_end(job.pages())
            self.checker.release([p for s in job.slot_ranges() for p in s])
        done = self.backend.compute_fence()
        self.last_use[li:li + job.r * self.L:self.L] = [done] * job.r
        for s in job.slot_ranges():
            self.last_use[s.start:s.stop] = [done] * len(s)
        _, written = self.active
        for lp0, p0, n in job.runs(written.start, min(written.stop, job.n)):
            keys = tuple((li, lp) for lp in range(lp0, lp0 + n))
            f = self.engine.copy([(self.host.k[layer][lp0:lp0 + n], self.k_pool[p0:p0 + n]),
                                  (self.host.v[layer][lp0:lp0 + n], self.v_pool[p0:p0 + n])],
                                 CopyNote("publish", tuple(range(p0, p0 + n)), (), keys),
                                 after=[done])
            self.last_use[p0:p0 + n] = [f] * n
        self._unhold(job, None)
        job.released, self.current = True, None

    def end(self) -> None:
        if self.current is not None:
            self.release(self.current)
        for job in self.issued.values():     # issued but never acquired (a failed forward):
            if not job.released:             # its slots are free once its copies landed
                self._unhold(job, AllOf(job.ready))
                if self.checker is not None:
                    self.checker.release([p for s in job.slot_ranges() for p in s])
        self.active, self.issued = None, {}

    # ---- issuing ---------------------------------------------------------------------------
    def _prefetch(self) -> None:
        """Issue layers in order from the first not issued, as far as the ring allows."""
        nxt = len(self.issued)
        while nxt < len(self.order) and self._issue(self.order[nxt]):
            nxt += 1
        self.count.peak_held = max(self.count.peak_held, self.held)

    def _issue(self, li: int) -> bool:
        n_pages, _ = self.active
        ring, r = self.ring, min(self.r, n_pages)
        job = Placement.build(li, self.L, r, n_pages, ring, self.cursor)
        ignore_held = "skip_consumed_wait" in self.unsafe
        slots = job.slot_ranges()
        if not ignore_held and any(self.holder[s.start:s.stop].count(None) != len(s)
                                   for s in slots):
            return False
        layer = self.layers[li]
        for s in slots:
            self.held += self.holder[s.start:s.stop].count(None)
            self.holder[s.start:s.stop] = [layer] * len(s)
        self.cursor = (self.cursor + job.n_streamed) % max(ring.n_slots, 1)
        v = self.valid_upto[li]
        todo = job.runs(min(v, r), r) + job.ring_runs   # stale resident pages, then streamed
        self.valid_upto[li] = max(v, r)
        cut = self.host.rows_pages(layer)                # pages from here on have no rows
        for lp0, p0, n in todo:
            k = max(0, min(n, cut - lp0))
            self._fill(job, layer, lp0, p0, k, copy=True, ignore_held=ignore_held)
            self._fill(job, layer, lp0 + k, p0 + k, n - k, copy=False, ignore_held=ignore_held)
        self.issued[li] = job
        return True

    def _fill(self, job, layer, lp0, p0, n, copy, ignore_held) -> None:
        if not n:
            return
        after = [] if ignore_held else list(set(self.last_use[p0:p0 + n]))
        owners = tuple((job.li, lp) for lp in range(lp0, lp0 + n)) if self.checker else ()
        pages = tuple(range(p0, p0 + n)) if self.checker else ()
        if not copy:
            # Nothing published for these pages yet: no copy, but the layer's writes must
            # still wait for the pages' previous users (the checker hears of it at acquire).
            job.claims.append((pages, owners))
            job.ready += after
            return
        job.ready.append(self.engine.copy(
            [(self.k_pool[p0:p0 + n], self.host.k[layer][lp0:lp0 + n]),
             (self.v_pool[p0:p0 + n], self.host.v[layer][lp0:lp0 + n])],
            CopyNote("fill", pages, owners, owners), after=after))
        self.count.copies += 1

    def _unhold(self, job: Placement, fence) -> None:
        for s in job.slot_ranges():
            self.held -= len(s) - self.holder[s.start:s.stop].count(None)
            self.holder[s.start:s.stop] = [None] * len(s)
            if fence is not None:
                self.last_use[s.start:s.stop] = [fence] * len(s)

    def _idle(self, what: str) -> None:
        if self.active is not None:
            raise KvLayoutError(f"cannot {what} in the middle of a forward")
