"""Windowed layers' own device pages in a streamed KV store: a ring of a few pages a layer.

A layer that attends over the last W positions reads only the pages of its window, so it
keeps them on the device: `slots` pages of its own (the window and the rows a forward
adds), logical page lp in slot lp % slots, a page table that never changes. A page is
copied from host history only when its slot does not hold it yet (after a new sequence,
a dropped arena, a resumed history); the rows a forward writes are published back to the
host as every layer's are, so the host stays authoritative. Nothing older than the
window is ever copied or read, and a decode step moves no byte of a windowed layer over
PCIe. The shared resident/ring pool (pool.py) serves the other layers.

Fences and the checker follow the pool's rules: a fill waits for the slot's last use (its
readers and its publishes), attention waits for the fills, and a slot changes owner only
after a release. A captured step (fixed forward) must do the same device work at every
replay: `refill` places and fills its pages outside the step, so inside it every page is
held already.
"""
from __future__ import annotations

from collections import Counter

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.kv.copy_engine import CopyNote
from kvcompile.kv.fences import DONE, device_wait_all, wait_all


def window_slots(window: int, rows: int, page_size: int) -> int:
    """Pages a ring must have for forwards of up to `rows` rows: the window's pages from a
    forward's first page on, the pages its rows reach, and one more where they straddle."""
    return -(-(window + rows) // page_size) + 2


def first_window_page(window: int, first_written: int, page_size: int) -> int:
    """The first logical page a layer reads when a forward writes from page first_written
    on (0 without a window): the page of the window of that page's first position."""
    if not window:
        return 0
    return max(first_written * page_size - window + 1, 0) // page_size


def window_rings_for(store, kv_pool, pair_views, engine, backend, host,
                     row_maps) -> "WindowRings | None":
    """A streamed store's windowed layers' rings at the arena's end (store.window_rows > 0
    and some layer not windowed: the shared pool keeps the arena's start), or None: then,
    also where the rings and one layer's whole context do not both fit the arena, the
    windowed layers stream their windows through the shared ring (pool.py), as exactly."""
    windows, n_pages = store.windows, store.num_pages
    if not store.window_rows or not windows or len(windows) == len(store.layers):
        return None
    slots = max(window_slots(w, store.window_rows, store.page_size) for w in windows.values())
    first = kv_pool.shape[0] - len(windows) * slots
    if first < n_pages:
        return None
    return WindowRings(kv_pool, pair_views, first, windows, slots, store.page_size, host,
                       engine, backend, n_pages, row_maps)


class WindowRings:
    def __init__(self, kv_pool, pair_views, first_page: int, windows: dict, slots: int,
                 page_size: int, host, engine, backend, max_pages: int, row_maps=None):
        """kv_pool: uint8 [pages, K page + V page], the whole arena's; the windowed layers
        (`windows`: layer -> window, in order) own `slots` pages each from `first_page`."""
        self.kv_pool, (self.k_pool, self.v_pool) = kv_pool, pair_views
        self.windows, self.slots, self.page_size = dict(windows), slots, page_size
        self.host, self.engine, self.backend, self.row_maps = host, engine, backend, row_maps
        self.checker = engine.instrument.checker
        self.base = {l: first_page + j * slots for j, l in enumerate(self.windows)}
        self.first_page, self.n_pages = first_page, len(self.windows) * slots
        width = -(-max_pages // 4) * 4
        lp = torch.arange(width, dtype=torch.int32, device=kv_pool.device) % slots
        self._tables = torch.stack([lp + b for b in self.base.values()]) if self.windows \
            else lp[None, :0]
        self.page_tables = {l: self._tables[j, :max_pages] for j, l in enumerate(self.windows)}
        self.held = {l: [None] * slots for l in self.windows}   # logical page in each slot
        self.last_use = [DONE] * self.n_pages
        self.active = None               # (n_pages, first written page, rows) of a forward
        self.reading: dict = {}          # layer -> logical pages read, until its release
        self.current = None
        self.count = Counter()

    def __contains__(self, layer) -> bool:
        return layer in self.windows

    def phys(self, layer, lp: int) -> int:
        return self.base[layer] + lp % self.slots

    # ---- one forward ---------------------------------------------------------------------
    def begin(self, n_pages: int, first_written: int, rows=None) -> None:
        """A forward over n_pages a layer writing from page first_written; `rows`: a fixed
        forward's positions, whose rows a kernel publishes (else pages are copied)."""
        self.active = (n_pages, first_written, rows if self.row_maps is not None else None)
        self.count = Counter()

    def read_pages(self, layer, n_pages: int, first_written: int) -> range:
        first = first_window_page(self.windows[layer], first_written, self.page_size)
        if n_pages - first > self.slots:
            raise KvLayoutError(
                f"a forward over pages {first}..{n_pages - 1} of a windowed layer whose ring "
                f"holds {self.slots} pages: forwards may write at most the rows the store "
                f"was sized for (window_rows); split it into smaller chunks")
        return range(first, n_pages)

    def _take(self, layer, lps) -> tuple[list, list]:
        """Slots for logical pages `lps` that are not held yet: filled from host history
        (one copy group) or, without rows there, claimed. Returns (ready fences, claims)."""
        rows_cut = self.host.rows_pages(layer)
        pairs, after, ready, claims, pages, owners = [], set(), [], [], [], []
        chk = self.checker is not None
        held = self.held[layer]
        for lp in lps:
            slot, p = lp % self.slots, self.phys(layer, lp)
            if held[slot] == lp:
                continue
            if chk and held[slot] is not None:
                self.checker.release([p])
            held[slot] = lp
            i = p - self.first_page
            if lp < rows_cut:
                pairs.append((self.kv_pool[p:p + 1], self.host.kv[layer][lp:lp + 1]))
                after.add(self.last_use[i])
                pages.append(p)
                owners.append((layer, lp))
            else:
                ready.append(self.last_use[i])
                claims.append(((p,), ((layer, lp),)))
        if pairs:
            ready.append(self.engine.copy(pairs, CopyNote("fill", tuple(pages) if chk else (),
                                                          tuple(owners) if chk else (),
                                                          tuple(owners) if chk else ()),
                                          after=list(after)))
            self.count["copies"] += 1
        return ready, claims

    def _settle(self, ready, claims) -> None:
        device_wait_all(ready)
        if self.checker is not None:
            for pages, owners in claims:
                self.checker.claim(pages, owners)

    def acquire(self, layer) -> torch.Tensor:
        n, first_written, _ = self.active
        read = self.read_pages(layer, n, first_written)
        self._settle(*self._take(layer, read))
        if self.checker is not None:
            self.checker.read_start([self.phys(layer, lp) for lp in read],
                                    [(layer, lp) for lp in read])
        self.count["resident_reads"] += len(read)
        self.reading[layer], self.current = read, layer
        return self.page_tables[layer]

    def release(self, layer) -> None:
        read = self.reading.pop(layer)
        n, first_written, rows = self.active
        table = self.page_tables[layer]
        if rows is not None:             # while the layer still reads its pages
            self.engine.publish_rows((self.k_pool, self.v_pool),
                                     (self.host.k[layer], self.host.v[layer]), table, rows,
                                     self.row_maps)
        if self.checker is not None:
            self.checker.read_end([self.phys(layer, lp) for lp in read])
        done = self.backend.compute_fence()
        for lp in read:
            self.last_use[self.phys(layer, lp) - self.first_page] = done
        if rows is None:
            for lp in range(first_written, n):   # a page a copy (rows of 1-2 pages a step)
                p = self.phys(layer, lp)
                keys = ((layer, lp),) if self.checker is not None else ()
                f = self.engine.copy([(self.host.kv[layer][lp:lp + 1], self.kv_pool[p:p + 1])],
                                     CopyNote("publish", (p,) if keys else (), (), keys),
                                     after=[done])
                self.last_use[p - self.first_page] = f
        self.current = None

    def release_current(self) -> None:
        if self.current is not None:
            self.release(self.current)

    def end(self) -> None:
        """Close the forward: the layer still reading is released (its rows published, as
        the pool's last layer is); any other acquired but never released (a failed
        capture) stops reading."""
        self.release_current()
        self.abandon()

    def abandon(self) -> None:
        """Layers acquired but never released (a failed capture: its work never ran) stop
        reading, without publishing."""
        for layer, read in list(self.reading.items()):
            if self.checker is not None:
                self.checker.read_end([self.phys(layer, lp) for lp in read])
            for lp in read:
                self.last_use[self.phys(layer, lp) - self.first_page] = \
                    self.backend.compute_fence()
        self.reading, self.current, self.active = {}, None, None

    def refill(self, n_pages: int, first_written: int, layers) -> None:
        """Before a fixed forward over n_pages writing from first_written: its windowed
        layers' pages placed and filled now, so that the step itself copies nothing."""
        for layer in layers:
            if layer in self.windows:
                self._settle(*self._take(layer, self.read_pages(layer, n_pages,
                                                                  first_written)))

    # ---- the sequence and captures ---------------------------------------------------------
    def drain(self) -> None:
        wait_all(set(self.last_use))

    def forget(self) -> None:
        """A new sequence: no slot holds host content."""
        self.drain()
        if self.checker is not None:
            self.checker.release(range(self.first_page, self.first_page + self.n_pages))
        self.held = {l: [None] * self.slots for l in self.windows}

    def drop(self) -> None:
        """Every slot overwritten with junk: later reads refill from host history."""
        self.forget()
        self.kv_pool[self.first_page:self.first_page + self.n_pages].fill_(0x7F)
        self.last_use = [self.backend.compute_fence()] * self.n_pages

    def forget_fences(self) -> None:
        self.last_use = [DONE] * self.n_pages

    def replayed(self, fence) -> None:
        self.last_use = [fence] * self.n_pages
