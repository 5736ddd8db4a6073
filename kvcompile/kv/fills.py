"""The streaming pool's fills (pool.py): layers issued in order, as far as the ring allows;
a layer's ring slots taken first-in first-out, its pages copied from host history in one
copy group behind each page's last use, or, with split fills, the free part of its slots
first and the rest once the layer before releases them."""
from __future__ import annotations

from kvcompile.kv.copy_engine import CopyNote
from kvcompile.kv.placement import Placement


class RingFills:
    """StreamingPool's methods that place a layer's pages and fill them."""

    def _prefetch(self) -> None:
        """Issue layers in order from the first not issued, as far as the ring allows (the
        rest of a layer placed in part first)."""
        if self.partial is None or self._place(self.partial, self.partial.n):
            self.partial = None
            nxt = len(self.issued)
            while nxt < len(self.order) and self._issue(self.order[nxt],
                                                         copy=nxt >= self.ahead):
                nxt += 1
                if self.partial is not None:
                    break
        self.count["peak_held"] = max(self.count["peak_held"], self.held)

    def _issue(self, li: int, copy: bool = True) -> bool:
        """Place layer li (ring slots, runs) and fill it, or with split fills only the
        pages whose slots are free now (`partial`); copy=False: its fills were issued ahead
        into the very slots (fill_ahead), so only the placement is made."""
        n_pages, _ = self.active
        r = min(self.r, n_pages)
        job = Placement.build(li, self.L, r, n_pages, self._ring, self.cursor,
                              self.window_first(li))
        free = self._free_prefix(job)
        if free < job.n_streamed and (not copy or not self.split_fills or not free):
            return False
        self.cursor = (self.cursor + job.n_streamed) % max(self._ring.n_slots, 1)
        v = self.valid_upto[li]
        self.valid_upto[li] = max(v, r)
        job.placed = min(v, r)                       # stale resident pages are refilled
        self.issued[li] = job
        self._place(job, job.ring_from + free, copy)
        if not job.complete:
            self.partial = job
            self.count["split"] += 1
        return True

    def _free_prefix(self, job: Placement) -> int:
        """How many of the layer's streamed pages, in order, have a free ring slot."""
        if "skip_consumed_wait" in self.unsafe:
            return job.n_streamed
        free = 0
        for s in job.slot_ranges():
            seg = self.holder[s.start:s.stop]
            k = next((i for i, h in enumerate(seg) if h is not None), len(seg))
            free += k
            if k < len(seg):
                break
        return free

    def _place(self, job: Placement, upto: int, copy: bool = True) -> bool:
        """Take the slots of the job's logical pages [placed, upto) and fill them (one
        copy group: one copy per run, behind each page's last use); False, nothing
        done, while a slot is still held."""
        runs = job.runs(job.placed, upto)
        ring0 = self._ring.first_physical_page
        slots = [range(p0, p0 + n) for _, p0, n in runs if p0 >= ring0]
        ignore_held = "skip_consumed_wait" in self.unsafe
        if not ignore_held and any(self.holder[s.start:s.stop].count(None) != len(s)
                                   for s in slots):
            return False
        layer, li = self.layers[job.li], job.li
        for s in slots:
            self.held += self.holder[s.start:s.stop].count(None)
            self.holder[s.start:s.stop] = [layer] * len(s)
        job.held += slots
        job.placed = upto
        rows_cut = self.host.rows_pages(layer)           # pages from here on have no rows
        ring_cut = self.host.max_pages if self.fixed else rows_cut
        chk = self.checker is not None
        pairs, after, pages, owners = [], set(), [], []
        hkv = self.host.kv[layer]
        for lp0, p0, n in runs:
            k = max(0, min(n, (rows_cut if lp0 < job.r else ring_cut) - lp0))
            if k:      # published rows: copy them (all runs of the layer in one group)
                pairs.append((self.kv_pool[p0:p0 + k], hkv[lp0:lp0 + k]))
                if not ignore_held:
                    after.update(self.last_use[p0:p0 + k])
                if chk:
                    pages += range(p0, p0 + k)
                    owners += [(li, lp) for lp in range(lp0, lp0 + k)]
            if n - k:  # nothing published yet: no copy, but the layer's writes must still
                # wait for the pages' previous users (the checker hears of it at acquire)
                p1, lp1, m = p0 + k, lp0 + k, n - k
                job.claims.append((tuple(range(p1, p1 + m)) if chk else (),
                                   tuple((li, lp) for lp in range(lp1, lp1 + m)) if chk
                                   else ()))
                if not ignore_held:
                    job.ready += set(self.last_use[p1:p1 + m])
        if not copy:     # a capture forgot them (it drained first); a rerun waits on them
            job.ready += self.filled_ahead.ready.get(li, [])
        elif pairs:
            owners = tuple(owners)
            job.ready.append(self.engine.copy(pairs, CopyNote("fill", tuple(pages), owners,
                                                              owners), after=list(after)))
            self.count["copies"] += 1
        return True

    def _unhold(self, job: Placement, fence) -> None:
        for s in job.held:
            self.held -= len(s) - self.holder[s.start:s.stop].count(None)
            self.holder[s.start:s.stop] = [None] * len(s)
            if fence is not None:
                self.last_use[s.start:s.stop] = [fence] * len(s)
        job.held = []
