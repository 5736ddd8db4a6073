"""The resident/ring pool: which physical page holds each layer's logical page, and copies.

Physical pages [0, P) of the arena's K and V page pools (same index in both). Resident
page of (layer index li, logical page lp < r) is lp * L + li: growing or shrinking r moves
only the pages at the boundary. The ring is [L * r, P), one ring for all streamed layers,
handed out first-in first-out so the slots taken next are the ones released longest ago.

Per forward, layers are issued in order: a layer gets ring slots for its pages >= r (its
span plan), host->device copies of contiguous runs (one group per layer: one copy per run, a
physical page holding its K and V page side by side), and ready fences; the page tables of a forward over consecutive layers are all
written at its start (first-in first-out slots make every layer's placement known). A
layer only takes slots already released by earlier layers, so a copy waits only on
consumed fences that exist (recorded), never on future work. Split fills: a layer whose
first slots are free but whose last ones the layer before it still holds takes and fills
the free ones now (they land while that layer computes) and the rest once it releases, so
a ring of one layer's stream plus a margin keeps the copy engine busy (kv/policy.py,
`decode_depth`); prefetch of later layers stops at such a layer. Release publishes the
rows written this forward to host history and records each page's consumed fence.
A windowed layer (`windows`) streams only the pages from its window's first page on (that
of the forward's first written page: placement.py), so pages older than the window are
never copied nor read; its resident pages stay as a global layer's.

Fixed forwards (captured steps) and what surrounds them: kv/fixed_forwards.py.
"""
from __future__ import annotations

from collections import Counter

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.kv.copy_engine import CopyNote
from kvcompile.kv.fences import DONE, AllOf, device_wait_all, wait_all
from kvcompile.kv.fills import RingFills
from kvcompile.kv.fixed_forwards import FilledAhead, FixedForwards
from kvcompile.kv.placement import Placement
from kvcompile.kv.span_plan import Ring

UNSAFE = frozenset({"skip_ready_wait", "skip_consumed_wait"})  # test-only broken orderings


# what a forward's telemetry counts: misses, resident_reads, streamed_reads, peak_held,
# copies, split (layers filled in two parts: split fills)


class StreamingPool(RingFills, FixedForwards):
    def __init__(self, kv_pool, pair, host, layers, engine, backend, max_pages: int,
                 unsafe=frozenset(), check_plans: bool | None = None, row_maps=None,
                 windows: dict | None = None, page_size: int = 0):
        """kv_pool: uint8 [P, pair.stride], physical pages each a K and a V page
        (kv_pages.PagePair): a run of pages is one copy. windows: layer -> sliding window
        (positions) of the windowed layers, whose pages are `page_size` positions."""
        if set(unsafe) - UNSAFE:
            raise ValueError(f"unknown unsafe switches {set(unsafe) - UNSAFE}")
        self.kv_pool, self.host = kv_pool, host
        self.k_pool, self.v_pool = pair.views(kv_pool)
        self.layers = tuple(layers)
        self.index = {layer: li for li, layer in enumerate(self.layers)}
        self.windows = {self.index[l]: w for l, w in (windows or {}).items()
                        if w and l in self.index}
        self.page_size = page_size
        if self.windows and page_size <= 0:
            raise ValueError("windowed layers need the page size")
        self.L, self.P = len(self.layers), kv_pool.shape[0]
        self.engine, self.backend, self.unsafe = engine, backend, frozenset(unsafe)
        self.checker = engine.instrument.checker
        # Validate every placement as a SpanPlan (one span per resident page: ~0.5 ms per
        # layer at 128K context, so the backend decides; the CPU backend checks).
        self.check_plans = backend.check_plans if check_plans is None else check_plans
        self.max_pages = max_pages
        self.row_maps = row_maps                 # (K, V) RowMaps: fixed forwards publish rows
        self.rows = None                         # the active fixed forward's positions
        self.filled_ahead: FilledAhead | None = None
        self.split_fills = True                  # a layer may take its free slots first
        self.partial: Placement | None = None    # the layer waiting for its last slots
        dev = kv_pool.device
        # Every layer's table is a row of one tensor, so a forward over all layers writes
        # them in one device op (begin). Rows start 16-byte aligned, like separate tensors.
        self._tables = torch.zeros(self.L, -(-max_pages // 4) * 4, dtype=torch.int32,
                                   device=dev)
        self.page_tables = {l: self._tables[li, :max_pages] for li, l in enumerate(self.layers)}
        top = self.P // max(self.L, 1) + 1
        self._resident = (torch.arange(top, dtype=torch.int32, device=dev) * self.L
                          + torch.arange(self.L, dtype=torch.int32, device=dev)[:, None])
        self._tables_written = False             # this forward's tables are all in place
        # Leading entries of each layer's table that hold its resident pages already (the
        # resident page of a logical page does not depend on the split): not rewritten.
        self._table_known = [0] * self.L
        self.r = 0
        self._ring_pages_of: dict = {}
        self._set_ring()
        self.cursor = 0                          # next ring slot, relative to the ring start
        self.holder: list = [None] * self.P      # ring slot -> layer holding it this forward
        self.held = 0
        self.last_use: list = [DONE] * self.P    # consumed fence of every physical page
        self.valid_upto = [0] * self.L           # resident pages [0, v) hold host content
        self.issued: dict[int, Placement] = {}
        self.active = None                       # (n_pages, written logical pages) of a forward
        self.fixed = False                       # the active forward is a fixed one
        self.ahead = 0                           # its first layers filled by fill_ahead
        self.current = None
        self.order: list[int] = []
        self.count = Counter()

    # ---- layout --------------------------------------------------------------------------
    @property
    def ring(self) -> Ring:
        return self._ring

    def _set_ring(self) -> None:
        self._ring = ring = Ring(self.L * self.r, self.P - self.L * self.r)
        # The physical page of ring slot i % n_slots at i: the streamed pages of a layer
        # (which may wrap) are one slice from its first slot, and since slots go first-in
        # first-out, those of L consecutive layers from the cursor are one [L, n - r] view.
        # One tensor per split, kept: a captured step reads the one of its split, by address.
        have = self._ring_pages_of.get(self.r)
        if have is None:
            n = ring.n_slots + self.L * min(ring.n_slots, self.max_pages)
            slots = torch.arange(n, dtype=torch.int32, device=self.kv_pool.device)
            have = self._ring_pages_of[self.r] = (slots % max(ring.n_slots, 1)
                                                  + ring.first_physical_page)
        self._ring_pages = have

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
        self._drop_ahead()
        if not 0 <= r * self.L <= self.P:
            raise KvLayoutError(f"{r} resident pages for {self.L} layers exceed {self.P} pages")
        lo, hi = sorted((self.r, r))
        wait_all(set(self.last_use[lo * self.L:hi * self.L]))
        self.valid_upto = [min(v, r) for v in self.valid_upto]
        if self.checker is not None:
            self.checker.release(range(lo * self.L, hi * self.L))
        self.r, self.cursor = r, 0
        self._set_ring()

    def drop_resident(self) -> None:
        """Forget every resident page (overwritten with junk): host history must rebuild them."""
        self._idle("drop resident pages")
        self._drop_ahead()
        n = self.L * self.r
        wait_all(set(self.last_use[:n]))
        self.kv_pool[:n].fill_(0x7F)
        self.last_use[:n] = [self.backend.compute_fence()] * n   # refills follow the junk
        self.valid_upto = [0] * self.L
        if self.checker is not None:
            self.checker.release(range(n))

    def forget(self) -> None:
        """A new sequence: no resident page holds host content any more."""
        self._idle("forget the sequence")
        self._drop_ahead()
        self.drain()
        self.valid_upto = [0] * self.L
        if self.checker is not None:
            self.checker.release(range(self.L * self.r))

    def drain(self) -> None:
        self.engine.synchronize()
        wait_all(set(self.last_use))

    # ---- one forward -----------------------------------------------------------------------
    def begin(self, n_pages: int, written: range, layers=None, fixed: bool = False,
              rows: torch.Tensor | None = None, ahead: int = 0) -> None:
        """Start a forward over n_pages per layer that writes logical pages `written`;
        `layers` (default all) are the layers it will acquire, in this order. fixed: the
        device work must not depend on the host's rows, `rows` (its positions) are what it
        publishes, and its first `ahead` layers were filled by fill_ahead (module
        docstring)."""
        self._idle("begin a forward")
        order = tuple(self.layers if layers is None else layers)
        if ahead and (not fixed or self.ahead_for(n_pages, order, written.start) < ahead):
            raise KvLayoutError(f"a forward cannot skip {ahead} layers' fills that were "
                                f"not issued ahead ({self.filled_ahead})")
        if not ahead:
            self._drop_ahead()
        self.fixed, self.ahead = fixed, ahead
        self.rows = rows if fixed and self.row_maps is not None else None
        if fixed:
            self.cursor = 0
        self.order = [self.index[l] for l in order]
        if len(set(self.order)) != len(self.order):
            raise KvLayoutError(f"a forward acquires each layer once; got {layers}")
        if n_pages - self.r > self.ring.n_slots:
            raise KvLayoutError(f"{n_pages} pages per layer need a ring of "
                                f"{n_pages - self.r} slots; the ring has {self.ring.n_slots}")
        self.active, self.issued, self.current = (n_pages, written), {}, None
        self.partial = None
        self.count = Counter()
        self._tables_written = self._write_all_tables(n_pages)
        self._prefetch()
        if ahead:                        # the forward took over the fills made ahead
            if len(self.issued) < ahead:
                raise KvLayoutError(f"{ahead} layers were filled ahead, the ring took "
                                    f"{len(self.issued)} at this forward's begin")
            self.filled_ahead = None

    def window_first(self, li: int) -> int:
        """The first logical page layer li reads in the active forward: 0, or for a
        windowed layer the page of the window of the forward's first written position."""
        w = self.windows.get(li, 0)
        if not w:
            return 0
        return max(self.active[1].start * self.page_size - w + 1, 0) // self.page_size

    def _write_all_tables(self, n_pages: int) -> bool:
        """Write the page tables of this forward's layers now, in one or two device ops,
        when it acquires consecutive layers in order (else acquire writes each). Slots go
        first-in first-out, so the k-th layer issued gets ring slots from cursor + k * (n - r)
        however long its issue has to wait; its table may be written before its copies
        land: attention waits for those (ready fences), not for the table."""
        o, m = self.order, len(self.order)
        if m < 2 or o != list(range(o[0], o[0] + m)) or any(li in self.windows for li in o):
            return False               # (windowed layers take fewer slots: each its own)
        a, r = o[0], min(self.r, n_pages)
        ns, rows, known = n_pages - r, self._tables[a:a + m], self._table_known[a:a + m]
        if self.fixed or min(known) < r:     # a captured step writes all: eager steps
            # between its replays may have put ring pages where its resident ones go
            rows[:, :r].copy_(self._resident[a:a + m, :r])
        if ns:
            c = self.cursor
            rows[:, r:n_pages].copy_(self._ring_pages[c:c + m * ns].view(m, ns))
            self._table_known[a:a + m] = [r] * m
        else:
            self._table_known[a:a + m] = [max(k, r) for k in known]
        return True

    def acquire(self, layer: int) -> torch.Tensor:
        """Make the layer's pages present, its page table in place (written here unless
        begin wrote every layer's), and return the table."""
        li = self.index[layer]
        if self.current is not None:
            self.release(self.current)
        self._prefetch()
        job = self.issued.get(li)
        if job is None or not job.complete:
            raise KvLayoutError(f"layer {layer} could not get ring slots: layers must be "
                                f"acquired in the order given to begin_forward, once each")
        if job.released:
            raise KvLayoutError(f"layer {layer} was already acquired in this forward; its "
                                f"ring slots may be reused by now")
        if not self.fixed and self.backend.readiness_miss(job.ready):   # (a capture cannot ask)
            self.count["misses"] += 1
        if "skip_ready_wait" not in self.unsafe:
            # The compute side waits for the copies; on CUDA a stream wait, no host sync.
            device_wait_all(job.ready)
        table = self.page_tables[layer]
        if not self._tables_written:
            self._table_known[li] = job.write_table(
                table, self._resident[li], self._ring_pages,
                0 if self.fixed else self._table_known[li])
        if self.check_plans:
            plan, read = job.span_plan(self.P, self.ring), job.read_pages()
            if not torch.equal(plan.page_table(job.n)[read.start:],
                               table[read.start:job.n].cpu()):
                raise KvLayoutError(f"layer {layer}: page table disagrees with {plan}")
        if self.checker is not None:
            for pages, owners in job.claims:
                self.checker.claim(pages, owners)
            self.checker.read_start(job.pages(), [(li, lp) for lp in job.read_pages()])
        delay = self.engine.instrument.compute_delay
        if delay is not None:
            self.backend.compute_delay(delay())
        self.count["resident_reads"] += job.n_resident_read
        self.count["streamed_reads"] += job.n_streamed
        self.current = layer
        return table

    def release(self, layer: int) -> None:
        li = self.index[layer]
        job = self.issued[li]
        if self.rows is not None:        # while the layer still reads its pages
            keys = self._row_keys(li) if self.checker is not None else ()
            if keys:
                self.checker.publish_start((), keys)
            self._publish_rows(layer, self.rows)
            if keys:
                self.checker.publish_end((), keys)
        if self.checker is not None:     # before the consumed fence: its waiters follow these
            self.checker.read_end(job.pages())
            self.checker.release([p for s in job.slot_ranges() for p in s])
        done = self.backend.compute_fence()
        self.last_use[li:li + job.r * self.L:self.L] = [done] * job.r
        for s in job.slot_ranges():
            self.last_use[s.start:s.stop] = [done] * len(s)
        _, written = self.active
        chk = self.checker is not None   # pages and keys are the checker's (tuples cost)
        runs = job.runs(written.start, min(written.stop, job.n)) if self.rows is None else ()
        for lp0, p0, n in runs:
            keys = tuple((li, lp) for lp in range(lp0, lp0 + n)) if chk else ()
            f = self.engine.copy([(self.host.kv[layer][lp0:lp0 + n], self.kv_pool[p0:p0 + n])],
                                 CopyNote("publish", tuple(range(p0, p0 + n)) if chk else (),
                                          (), keys),
                                 after=[done])
            self.last_use[p0:p0 + n] = [f] * n
        self._unhold(job, None)
        job.released, self.current = True, None

    def _row_keys(self, li: int) -> tuple:
        """The host pages a row publish writes, for the checker: read from the positions
        where that costs no device sync (the CPU); none on CUDA."""
        if self.rows.device.type != "cpu":
            return ()
        ps = self.row_maps[0].page_size
        return tuple(sorted({(li, int(p) // ps) for p in self.rows.tolist()}))

    def end(self) -> None:
        if self.current is not None:
            self.release(self.current)
        for job in self.issued.values():     # issued but never acquired (a failed forward):
            if not job.released:             # its slots are free once its copies landed
                if self.checker is not None:
                    self.checker.release([p for s in job.held for p in s])
                self._unhold(job, AllOf(job.ready))
        self.active, self.issued, self.rows, self.partial = None, {}, None, None

    def _idle(self, what: str) -> None:
        if self.active is not None:
            raise KvLayoutError(f"cannot {what} in the middle of a forward")
