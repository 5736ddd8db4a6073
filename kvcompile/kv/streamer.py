"""The streamed policy of a KV store: history in host memory, pages placed per forward.

The store (store.py) owns the arena and the history; with an arena smaller than the whole KV
it hands every forward to a `Streamer`, which runs the resident/ring pool (pool.py): the
policy's split of the arena for the context the request will reach (policy.py), the layers'
ring fills from host history on the copy engine, the fences, the publishes of the written rows
back to the host, the layouts of captured steps (step_layout.py), and the telemetry of what
crossed PCIe. After every forward the host holds the authoritative KV.

A forward: `open` (the host's checks and the split), then `issue` (placement and the first
copies; or, for a captured step, its fixed layout's work, which a replay repeats), the
model's layers acquiring and releasing their pages, then `close` (publish, telemetry). After
a forward the next one is begun ahead on the guess that it is the decode step after it
(`prefetch_next`); a forward that is something else drops the guess. With `window_rows`,
windowed layers keep their windows in rings of their own (window_rings.py) at the arena's
end and the pool and its policy serve the other layers.
"""
from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import replace

from kvcompile.errors import ArenaError
from kvcompile.kv.fences import AllOf
from kvcompile.kv import policy as P
from kvcompile.kv.pool import StreamingPool
from kvcompile.kv.row_publish import RowMap
from kvcompile.kv.step_layout import StepLayout
from kvcompile.kv.telemetry import StepStats
from kvcompile.kv.window_rings import window_rings_for


def decode_depth(setting, default: float | None) -> float | None:
    """The decode steps' ring depth in layers (None: prefill's ring and whole-layer fills):
    "auto" takes the backend's `default`, "off" or None turns it off, else a number of
    layers from 1 to 8. Its margin over one layer must land while a layer computes."""
    if setting == "auto":
        return default
    if setting is None or setting == "off":
        return None
    if isinstance(setting, bool) or not isinstance(setting, (int, float)) \
            or not 1.0 <= setting <= 8.0:
        raise ArenaError(f"decode_depth must be a ring depth in layers from 1 to 8 (e.g. "
                         f"1.25), 'auto' or 'off'; got {setting!r}")
    return float(setting)


def _busy_pct(busy_s: float, wall_s: float) -> float:
    """The copy engine's busy share of a wall-clock span, in percent (capped at 100)."""
    return min(100.0, 100.0 * busy_s / wall_s)


class Streamer:
    def __init__(self, store, kv_pool, pair, host, backend, *, policy: dict | None = None,
                 unsafe=frozenset(), depth="auto", prefetch_next: bool | None = None,
                 fill_ahead: bool | None = None):
        # weakly: the store owns this policy; a cycle would hold the store's device memory
        # until a garbage collection
        self.store, self.host, self.backend = weakref.proxy(store), host, backend
        self.layers, self.page_size = store.layers, store.page_size
        self.num_pages, self.capacity = store.num_pages, store.capacity
        self.engine = backend.copy_engine()
        c = store.config
        maps = tuple(RowMap.of(t, c.n_kv_heads, store.page_size, c.head_dim, role,
                               kv_pool.device)
                     for t, role in ((store.k_type, "k"), (store.v_type, "v")))
        self.k_pool, self.v_pool = pair.views(kv_pool)     # every layer's pools
        self.rings = window_rings_for(store, kv_pool, (self.k_pool, self.v_pool), self.engine,
                                      backend, host, maps)
        rings = self.rings
        shared = kv_pool[:rings.first_page] if rings is not None else kv_pool
        self.pool = StreamingPool(shared, pair, host, self.trunk(self.layers), self.engine,
                                  backend, self.num_pages, unsafe, row_maps=maps,
                                  windows={} if rings is not None else store.windows,
                                  page_size=store.page_size)
        self.page_tables = {**self.pool.page_tables,
                            **(rings.page_tables if rings is not None else {})}
        # Prefill: depth >= 2 (the next layer's copies run while this one computes) unless
        # asked. Decode: a layer's compute is short; with split fills a part of a layer
        # as margin covers it, and the bytes a step streams fall with the ring (policy.py).
        depth = decode_depth(depth, backend.decode_depth)
        policy = {"min_depth": 2, "decode_depth": depth, **(policy or {})}
        self.pool.split_fills = depth is not None
        self.policy_config = P.PolicyConfig(self.pool.L, shared.shape[0], **policy)
        self.policy_state = P.PolicyState(depth=self.policy_config.max_depth)
        self.planned_pages = 0            # pages the current request will reach (plan())
        self.prefetch_next = backend.prefetch_next if prefetch_next is None else prefetch_next
        # a captured decode step fills the next one's first layers before it ends (end_issue)
        self.fill_ahead = backend.fill_ahead if fill_ahead is None else fill_ahead
        self._next = None                 # (lo, hi, n_pages, layers) begun ahead
        self._next_h2d, self._next_valid = 0, None
        self._last = None                 # (t0, busy) of the forward telemetry[-1] records
        # the last layout of the captured steps of each layer set (the trunk's, an MTP
        # layer's: alternating steps keep their own)
        self._layouts: dict[tuple, StepLayout] = {}
        self.layout_slack = 0             # pages a new layout reaches past its step

    def trunk(self, layers) -> tuple:
        """The layers the shared pool serves (those without a window ring)."""
        rings = self.rings
        return tuple(layers) if rings is None else tuple(l for l in layers if l not in rings)

    def acquire(self, layer) -> None:
        """Make the layer's pages present (the pool's, or its window ring's)."""
        if self.rings is not None:
            self.rings.release_current()
            if layer in self.rings:
                if self.pool.current is not None:
                    self.pool.release(self.pool.current)
                return self.rings.acquire(layer)
        return self.pool.acquire(layer)

    def release(self, layer) -> None:
        if self.rings is not None and layer in self.rings:
            self.rings.release(layer)
        else:
            self.pool.release(layer)

    # ---- one forward ------------------------------------------------------------------------
    def open(self, s: dict) -> None:
        """The host half of a forward's begin: the policy's split for it, its counters."""
        n_pages = s["hi"] // self.page_size + 1
        if self._next is not None and self._next != (s["lo"], s["hi"], n_pages, s["layers"]):
            self.drop_next()              # begun ahead for another forward
        t0, busy = s["t0"], self.engine.busy_s
        self._settle_copy_busy(t0, busy)
        # a forward begun ahead counts the fills issued then
        h2d = self.engine.bytes_h2d if self._next is None else self._next_h2d
        repart, reason = self._apply_policy(n_pages, s["hi"] - s["lo"] + 1)
        s.update(busy=busy, h2d=h2d, d2h=self.engine.bytes_d2h, pages=n_pages, repart=repart,
                 reason=reason)

    def issue(self, s: dict, layout: StepLayout | None = None) -> None:
        """The open forward's placement and first copies (unless it was begun ahead), or
        with a layout the fixed work of a captured step (step_layout)."""
        if self.rings is not None:
            self.rings.begin(*((layout.pages, layout.first, s["positions"]) if layout else
                               (s["pages"], s["lo"] // self.page_size)))
        if layout is not None:
            self.pool.begin(layout.pages, range(layout.first, layout.pages),
                            self.trunk(s["layers"]), fixed=True, rows=s["positions"],
                            ahead=layout.ahead)
        elif self._next is None:
            self.pool.begin(s["pages"], range(s["lo"] // self.page_size, s["pages"]),
                            self.trunk(s["layers"]))
        self._next = None

    def end(self, s: dict, ok: bool, ahead: bool) -> None:
        """Publish the forward's rows (ok) and, with prefetch_next, begin the next decode
        step's copies; ahead=False when the caller knows another kind of forward comes next."""
        self.pool.end()
        if self.rings is not None:
            self.rings.end()
        if not ok:                        # rows of a failed forward are not history
            # Its layers were issued but maybe never acquired: their refills of resident
            # pages count as valid from the next forward on, so they must have landed.
            self.synchronize()
            return
        if self.backend.sync_each_forward:
            self.engine.synchronize()     # CPU: trivial; the published rows are in place
        # CUDA: no host sync; the next forward's fills follow these publishes on the same
        # in-order copy stream, and host readers call synchronize() first.
        self.record(s)
        if self.prefetch_next and ahead:
            self._begin_next(s["hi"], s["layers"])

    # ---- captured decode steps ----------------------------------------------------------------
    def step_layout(self, s: dict) -> StepLayout:
        """The fixed layout the open forward can run in as a captured step: the last one
        while it serves, else a new one from this step's page on. Resident pages waiting
        for their refill from host history (after a change of split) are copied first,
        outside the step: a captured step would repeat the refill at every replay."""
        layers = tuple(s["layers"])
        r, lay, first = self.pool.r, self._layouts.get(layers), s["lo"] // self.page_size
        if lay is None or not lay.serves(r, first, s["pages"], layers):
            room = min(self.num_pages, r + self.pool.ring.n_slots)
            lay = StepLayout.around(r, first, s["pages"], s["layers"], room, self.layout_slack)
        self.drop_next()                  # a forward begun ahead is not a fixed one (and
        self.pool.refill(lay.pages, self.trunk(s["layers"]))   # it may have refilled pages)
        if self.rings is not None:
            self.rings.refill(lay.pages, lay.first, s["layers"])
        self._layouts[layers] = lay
        # by the last replay's guess
        ahead = self.pool.ahead_for(lay.pages, self.trunk(s["layers"]), lay.first)
        return replace(lay, ahead=ahead) if ahead else lay

    def prepare_capture(self, s: dict) -> None:
        """Before capturing the open forward: no copy in flight, no fence from before, and
        the row-publish kernel launched once with the capture's arguments (a first launch
        compiles and loads it, which a capture forbids; the rows it writes are rewritten
        by the step)."""
        self.pool.prepare_capture()
        if self.rings is not None:
            self.rings.drain()
            self.rings.forget_fences()
        if self.pool.row_maps is None or not self.trunk(s["layers"]):
            return
        try:
            self.pool.warm_row_publish(s["positions"], self.trunk(s["layers"])[0])
        except Exception as e:            # e.g. a Triton that cannot reach pinned memory
            warnings.warn(f"publishing rows by kernel failed ({type(e).__name__}: {e}); "
                          f"captured steps publish whole pages instead", RuntimeWarning,
                          stacklevel=2)
            self.pool.row_maps = None
            if self.rings is not None:
                self.rings.row_maps = None

    def begin_capture(self) -> None:
        """Copies issued until end_capture join the CUDA graph being captured."""
        self.engine.begin_capture()

    def end_capture(self) -> tuple[int, int]:
        """The copy stream joined back; the (h2d, d2h) bytes a replay of the capture copies."""
        return self.engine.end_capture()

    def join_copies(self) -> None:
        """Order the compute side after every copy issued so far (no host wait)."""
        self.engine.join()

    def captured(self):
        """After a capture: the fences it recorded never ran. Returns what the captured
        step fills ahead for the next one (None: nothing), for `replayed`."""
        self.pool.forget_fences()
        if self.rings is not None:
            self.rings.forget_fences()
        return self.pool.ahead_record()

    def abandon_capture(self) -> None:
        """After a failed capture (the device synchronized): its forward and events go."""
        self.engine.abandon_capture()
        self.pool.abandon()
        if self.rings is not None:
            self.rings.abandon()
            self.rings.forget_fences()

    def end_issue(self, s: dict) -> None:
        """The end of a captured step's device work: the last layer's release, then, with
        fill_ahead, the next step's first layers filled into the slots that step's
        program of this layout gives them (a guess: another forward comes instead and
        finds only those slots' last use in the fills)."""
        self.pool.end()
        if self.rings is not None:
            self.rings.end()
        lay = self._layouts.get(tuple(s["layers"]))
        if self.fill_ahead and lay is not None:
            self.pool.fill_ahead(lay.pages, self.trunk(s["layers"]), lay.first)

    def replayed(self, s: dict, moved, filled) -> None:
        """Close the open forward after its captured work ran (a CUDA graph replay, or on
        the CPU its rerun): `moved` = the (h2d, d2h) bytes a replay copies, `filled` = what
        the replayed step filled ahead (`captured()`)."""
        self.engine.count_replay(*moved)
        if self.backend.sync_each_forward:
            self.engine.synchronize()
        else:                             # the compute stream after the replay: every
            fence = self.backend.compute_fence()                       # page's last use
            self.pool.replayed(fence, filled)
            if self.rings is not None:
                self.rings.replayed(fence)
        self.record(s, replayed=True)

    # ---- bookkeeping -------------------------------------------------------------------------
    def record(self, s: dict, replayed: bool = False) -> None:
        """The forward's telemetry."""
        c, ring = self.pool.count, self.pool.ring.n_slots
        if self.rings is not None:         # their pages are resident, read in place
            c = c + self.rings.count
        wall = max(time.perf_counter() - s["t0"], 1e-9)
        tel = self.store.telemetry
        tel.append(StepStats(
            step=len(tel), tokens=s["tokens"], context_pages=s["pages"],
            resident_pages=self.pool.L * self.pool.r + (self.rings.n_pages if self.rings
                                                        is not None else 0),
            ring_slots=ring,
            h2d_bytes=self.engine.bytes_h2d - s["h2d"],
            d2h_bytes=self.engine.bytes_d2h - s["d2h"], readiness_misses=c["misses"],
            copy_busy_pct=_busy_pct(self.engine.busy_s - s["busy"], wall),
            ring_occupancy=c["peak_held"] / ring if ring else 0.0,
            resident_reads=c["resident_reads"], streamed_reads=c["streamed_reads"],
            layers=len(s["layers"]), repartitioned=s["repart"], policy=s["reason"],
            wall_ms=1e3 * wall, replayed=replayed, split_layers=c["split"]))
        self._last = (s["t0"], s["busy"])

    def _begin_next(self, hi: int, layers) -> None:
        """Begin the forward of position hi + 1 (the next decode step) now: the copy engine
        fills its first layers' ring slots while this forward's last layers, the sampler
        and the host's next call run, instead of idling until the next begin."""
        lo = hi + 1
        n_pages = lo // self.page_size + 1
        r = self.pool.r
        if lo >= self.capacity or n_pages - min(r, n_pages) > self.pool.ring.n_slots:
            return                        # out of room, or the split must change first
        self._next_h2d = self.engine.bytes_h2d
        self._next_valid = list(self.pool.valid_upto)
        self.pool.begin(n_pages, range(lo // self.page_size, n_pages), self.trunk(layers))
        self._next = (lo, lo, n_pages, layers)

    def drop_next(self) -> None:
        """Forget a forward begun ahead: wait for its copies, free its ring slots, and count
        the resident pages it refilled or claimed as stale again (the next forward redoes
        them in its own order). Only a forward that was not the guessed one pays this."""
        if self._next is not None:
            self._next = None
            self.pool.drain()             # first: its slots are released once filled
            self.pool.end()
            self.pool.valid_upto = self._next_valid

    def _settle_copy_busy(self, now: float, busy: float) -> None:
        """The last forward's copy-busy share, over the time from its begin to this one
        (its copies may land after its host work ended; by the next begin they were timed)."""
        last, self._last = self._last, None
        tel = self.store.telemetry
        if last is None or not tel:
            return
        pct = _busy_pct(busy - last[1], max(now - last[0], 1e-9))
        tel[-1] = replace(tel[-1], copy_busy_pct=pct)

    def _apply_policy(self, n_pages: int, rows: int) -> tuple[bool, str]:
        tel = self.store.telemetry
        last = tel[-1] if tel else None
        obs = P.Observation(
            context_pages=n_pages, planned_pages=min(self.planned_pages, self.num_pages),
            decode=rows <= P.DECODE_ROWS,
            readiness_misses=last.readiness_misses if last else 0,
            # (a replayed step observed no misses nor copy time: no feedback from it)
            ring_occupancy=last.ring_occupancy if last and not last.replayed else None,
            copy_busy=last.copy_busy_pct / 100 if last else 0.0)
        d = P.step(self.policy_config, self.policy_state, obs)
        if d.accepted or not P.serves(self.policy_config, d.resident_per_layer, n_pages):
            self.drop_next()              # the split changes: the guess's slots go back
        if d.accepted:
            # Leased pages only ever block a change (policy.py), so a decision that keeps
            # the split stands without them: they cost a query of every page's fence, so
            # they are gathered only for a change the policy would accept.
            obs = replace(obs, leased_pages=self.pool.leased_pages())
            d = P.step(self.policy_config, self.policy_state, obs)
        if d.urgent:                      # forced, or a new phase, but blocked by leases:
            self.pool.drain()             # wait, then ask again
            obs = replace(obs, leased_pages=self.pool.leased_pages())
            d = P.step(self.policy_config, self.policy_state, obs)
        self.policy_state = d.state
        if d.accepted:
            self.pool.repartition(d.resident_per_layer)
        return d.accepted, d.reason

    # ---- whole-sequence operations -------------------------------------------------------------
    def forget(self) -> None:
        """A new sequence: no resident page holds host content any more."""
        self.drop_next()
        self.pool.forget()
        if self.rings is not None:
            self.rings.forget()

    def plan(self, pages: int) -> None:
        """The request will reach `pages` pages: the split is made for them at once."""
        self.planned_pages = pages

    def synchronize(self) -> None:
        """Wait for every copy issued so far, a replayed step's too."""
        self.pool.drain()
        if self.rings is not None:
            self.rings.drain()

    def drop_resident(self) -> None:
        """Throw away every resident device page; later reads rebuild them from history."""
        self.drop_next()
        self.pool.drop_resident()
        if self.rings is not None:
            self.rings.drop()

    def close(self):
        """Stop the copy engine; returns the fence of every page's last use."""
        self.drop_next()
        try:
            self.synchronize()
        except RuntimeError:      # a failed copy was already raised to its forward
            pass
        self.engine.close()
        return AllOf(self.pool.last_use
                     + (self.rings.last_use if self.rings is not None else []))
