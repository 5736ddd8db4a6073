"""StreamingKvCache: the model-facing KV cache whose pages live in host history and an arena.

It offers the surface the models read from PagedKvCache (`layer(i)` -> LayerKv with pools,
page table and types; `has_layer`, `check_positions`, `reset`, `capacity`), and brackets
every forward with `begin_forward(positions)` / `end_forward()` (use `forward()` in bracket.py,
which calls them around `model(...)`). `layer(i)` is the per-layer hook: it releases the
previous layer, makes layer i's pages present (resident, or copied into ring slots while
earlier layers computed) and has its page table in place (written for all layers at
begin_forward when they run in order) before the model's kv_write and span_attention use
it. Release publishes the rows written this forward to host history,
so after every forward the host holds the authoritative KV.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace

import torch

from kvcompile.errors import ArenaError, ContextLengthError, KvLayoutError
from kvcompile.kv_cache import LayerKv, check_positions, check_range, decode_workspace
from kvcompile.ops import kv_format as F
from kvcompile.runtime import policy as P
from kvcompile.runtime.arena import MIB, Arena, align, mib_for
from kvcompile.runtime.backend import CpuBackend
from kvcompile.runtime.fences import AllOf
from kvcompile.runtime.host_history import HostHistory
from kvcompile.runtime.kv_pages import PagePair, layer_extras, min_arena_bytes, page_bytes
from kvcompile.runtime.pool import StreamingPool
from kvcompile.runtime.row_publish import RowMap
from kvcompile.runtime.step_layout import StepLayout
from kvcompile.runtime.telemetry import StepStats, summarize


def decode_depth(default: float | None) -> float | None:
    """The decode steps' ring depth in layers (None: prefill's, whole-layer fills):
    KVCOMPILE_DECODE_DEPTH ("off": None), else the backend's `default`. Its margin over one
    layer must land while a layer computes: a GPU whose layers compute longer against their
    copy wants more."""
    raw = os.environ.get("KVCOMPILE_DECODE_DEPTH")
    if raw is None:
        return default
    if raw.strip().lower() == "off":
        return None
    try:
        depth = float(raw)
    except ValueError:
        depth = 0.0
    if not 1.0 <= depth <= 8.0:
        raise ArenaError(f"KVCOMPILE_DECODE_DEPTH={raw!r}: give a ring depth in layers "
                         f"from 1 to 8, e.g. 1.25, or off")
    return depth


def _busy_pct(busy_s: float, wall_s: float) -> float:
    """The copy engine's busy share of a wall-clock span, in percent (capped at 100)."""
    return min(100.0, 100.0 * busy_s / wall_s)


class StreamingKvCache:
    streams = True      # history on the host: every forward is bracketed (begin/end_forward)

    def __init__(self, config, max_tokens: int, arena_mib: float, k_type="f32", v_type="f32",
                 page_size: int = 256, layers=None, backend=None, workspace_bytes: int = 0,
                 policy: dict | None = None, unsafe=frozenset(),
                 prefetch_next: bool | None = None):
        if max_tokens <= 0:
            raise ContextLengthError(f"the KV cache needs room for at least one token; "
                                     f"got max_tokens={max_tokens}")
        self.config, self.page_size = config, page_size
        self.k_type, self.v_type = F.kv_type(k_type), F.kv_type(v_type)
        self.backend = backend or CpuBackend()
        self.device = self.backend.device
        self.layers = tuple(range(config.n_layers)) if layers is None else tuple(sorted(set(layers)))
        self.num_pages = -(-max_tokens // page_size)
        self.capacity = self.num_pages * page_size
        kb, vb = page_bytes(config, self.k_type, self.v_type, page_size)
        nbytes = int(arena_mib * MIB)
        need = min_arena_bytes(config, max_tokens, self.k_type, self.v_type, page_size,
                               workspace_bytes)
        if nbytes < need:
            raise ArenaError(
                f"an arena of {arena_mib:g} MiB is too small for {self.capacity} tokens of "
                f"{self.k_type.name}/{self.v_type.name} KV (the ring must hold one layer's "
                f"whole context); use --kv-stream-arena-mib {mib_for(need)} or more, or "
                f"lower --ctx-size")
        pair = PagePair(kb, vb)
        self.backend.check_host_bytes(len(self.layers) * self.num_pages * pair.stride)
        n_phys = pair.fit(nbytes - align(workspace_bytes))
        self.arena = Arena(nbytes, self.backend.device_buffer(nbytes))
        with self.arena.begin() as tx:
            tx.reserve("workspace", workspace_bytes).reserve("kv", n_phys * pair.stride)
        self._leases = [self.arena.lease("kv")]
        kv_pool = self._leases[0].view().view(n_phys, pair.stride)
        self.host = HostHistory(self.layers, self.num_pages, pair, page_size,
                                alloc=self.backend.host_buffer)
        self.engine = self.backend.copy_engine()
        maps = tuple(RowMap.of(t, config.n_kv_heads, page_size, config.head_dim, role,
                               kv_pool.device) for t, role in ((self.k_type, "k"),
                                                              (self.v_type, "v")))
        self.pool = StreamingPool(kv_pool, pair, self.host, self.layers, self.engine,
                                  self.backend, self.num_pages, unsafe, row_maps=maps)
        # Prefill: depth >= 2 (the next layer's copies run while this one computes) unless
        # asked. Decode: a layer's compute is short; with split fills a part of a layer
        # as margin covers it, and the bytes a step streams fall with the ring (policy.py).
        depth = decode_depth(getattr(self.backend, "decode_depth", None))
        policy = {"min_depth": 2, "decode_depth": depth, **(policy or {})}
        self.pool.split_fills = depth is not None
        self.policy_config = P.PolicyConfig(len(self.layers), n_phys, **policy)
        self.planned_pages = 0            # pages the current request will reach (plan())
        self.policy_state = P.PolicyState(depth=self.policy_config.max_depth)
        extras = {n: t.to(self.device) for n, t in
                  layer_extras(config, self.k_type, self.v_type, page_size,
                               self.layers[0]).items()}
        # decode kernels' scratch (CUDA; None on the CPU), one for all layers like PagedKvCache
        extras["workspace"] = decode_workspace(self.device, config)
        k_pool, v_pool = self.pool.k_pool, self.pool.v_pool      # views of the page pairs
        self._kv = {i: LayerKv(k_pool, v_pool, self.pool.page_tables[i], self.k_type.ggml_id,
                               self.v_type.ggml_id, page_size, **extras) for i in self.layers}
        self.telemetry: list[StepStats] = []
        # After each forward the next one is begun ahead (its fills issued as far as the ring
        # allows) on the guess that it is the decode step after it; a next forward that is
        # something else drops the guess (its copies only filled free ring slots).
        self.prefetch_next = (getattr(self.backend, "prefetch_next", True)
                              if prefetch_next is None else prefetch_next)
        # A captured decode step fills the next one's first layers before it ends (end_issue)
        self.fill_ahead = getattr(self.backend, "fill_ahead", True)
        self._next = None                 # (lo, hi, n_pages, layers) begun ahead
        self._step = None
        self._last = None                 # (t0, busy) of the forward telemetry[-1] records
        self._layout: StepLayout | None = None   # of the captured decode steps (step_layout)
        self.layout_slack = 0             # pages a new layout reaches past its step

    # ---- the surface the model reads ----------------------------------------------------
    def layer(self, i: int) -> LayerKv:
        """The eager model's per-layer hook: the layer's pages placed, its buffers."""
        self.acquire_pages(i)
        return self._kv[i]

    def acquire_pages(self, i: int) -> torch.Tensor:
        """Layer i's pages present (the previous layer released), its page table written:
        what `cache.layer(i)` does, and what a compiled forward's lowered `ring_acquire`
        calls (passes/lower_ring.py)."""
        if self._step is None:
            raise KvLayoutError("StreamingKvCache.layer() is the per-layer hook of a forward; "
                                "run the model through kvcompile.runtime.forward()")
        return self.pool.acquire(i)

    def release_pages(self, i: int) -> None:
        """Layer i's ring slots consumed, its written rows published (a lowered
        `ring_release`, right after the layer's attention)."""
        self.pool.release(i)

    def has_layer(self, i: int) -> bool:
        return i in self._kv

    def check_positions(self, positions: torch.Tensor) -> tuple[int, int]:
        """The model's range check, (min, max): free for the positions this forward began with."""
        return self.position_range(positions)

    def position_range(self, positions: torch.Tensor, start: int | None = None
                       ) -> tuple[int, int]:
        """(min, max) of positions, checked against the capacity. Free for the tensor this
        forward began with; with `start` (positions are start, start + 1, ..., ints the
        caller has) the tensor is not read; else one host read (a sync on CUDA)."""
        st = self._step
        if st is not None and positions is st["positions"]:
            return st["lo"], st["hi"]
        n = positions.numel()
        if start is None or n == 0:
            return check_positions(positions, self.capacity)
        lo, hi = int(start), int(start) + n - 1
        if positions.device.type == "cpu" and not torch.equal(
                positions.reshape(-1), torch.arange(lo, hi + 1, dtype=positions.dtype)):
            raise KvLayoutError(f"positions are not {lo}..{hi}; pass start= only for "
                                f"consecutive positions from start")
        check_range(lo, hi, self.capacity)
        return lo, hi

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    # ---- forward bracket ------------------------------------------------------------------
    def begin_forward(self, positions: torch.Tensor, layers=None,
                      start: int | None = None) -> None:
        """Start a forward at these positions that will acquire `layers` (default: all KV
        layers, in order; an MTP step names only its own layer). `start`: the positions
        are start, start + 1, ... (the caller's ints: no host read of the tensor)."""
        self.open_forward(positions, layers, start)
        self.issue_forward()

    def open_forward(self, positions: torch.Tensor, layers=None,
                     start: int | None = None) -> None:
        """The host half of begin_forward: checks, the policy's split for this forward,
        its bookkeeping. `issue_forward` then issues its device work (or a captured step
        replays it)."""
        layers = self.layers if layers is None else tuple(layers)
        if self._step is not None:
            raise KvLayoutError("begin_forward called twice without end_forward")
        missing = [i for i in layers if i not in self._kv]
        if missing:
            raise KvLayoutError(f"layers {missing} have no KV in this cache")
        lo, hi = self.position_range(positions, start)   # at most one host read
        have = min(self.host.rows[i] for i in layers)
        if lo > have:
            raise ContextLengthError(f"position {lo} leaves a gap after the {have} "
                                     f"positions already in the cache")
        n_pages = hi // self.page_size + 1
        if self._next is not None and self._next != (lo, hi, n_pages, layers):
            self._drop_next()             # begun ahead for another forward
        self.host.truncate(lo, layers)    # rows from lo on are rewritten by this forward
        t0, busy = time.perf_counter(), self.engine.busy_s
        self._settle_copy_busy(t0, busy)
        # a forward begun ahead counts the fills issued then
        h2d = self.engine.bytes_h2d if self._next is None else self._next_h2d
        repart, reason = self._apply_policy(n_pages, hi - lo + 1)
        self._step = dict(t0=t0, busy=busy, lo=lo, hi=hi, h2d=h2d, d2h=self.engine.bytes_d2h,
                          tokens=int(positions.numel()), pages=n_pages, repart=repart,
                          reason=reason, layers=layers, positions=positions)

    def issue_forward(self, layout: StepLayout | None = None) -> None:
        """Issue the open forward's placement and first copies (unless it was begun ahead),
        or with a layout the fixed work of a captured step (step_layout)."""
        s = self._step
        if layout is not None:
            self.pool.begin(layout.pages, range(layout.first, layout.pages), s["layers"],
                            fixed=True, rows=s["positions"], ahead=layout.ahead)
        elif self._next is None:
            self.pool.begin(s["pages"], range(s["lo"] // self.page_size, s["pages"]),
                            s["layers"])
        self._next = None

    def end_forward(self, ok: bool = True, ahead: bool = True) -> None:
        """Publish the forward's rows (ok) and, with prefetch_next, begin the next decode
        step's copies; ahead=False when the caller knows another kind of forward comes next
        (a speculative round's MTP step), whose begin would only drop the guess."""
        if self._step is None:
            return
        s, self._step = self._step, None
        self.pool.end()
        if not ok:                        # rows of a failed forward are not history
            # Its layers were issued but maybe never acquired: their refills of resident
            # pages count as valid from the next forward on, so they must have landed.
            self.pool.drain()
            return
        if self.backend.sync_each_forward:
            self.engine.synchronize()     # CPU: trivial; the published rows are in place
        # CUDA: no host sync; the next forward's fills follow these publishes on the same
        # in-order copy stream, and host readers call synchronize() first.
        self._close(s)
        if self.prefetch_next and ahead:
            self._begin_next(s["hi"], s["layers"])

    # ---- captured decode steps ------------------------------------------------------------
    def step_layout(self) -> StepLayout:
        """The fixed layout the open forward can run in as a captured step: the last one
        while it serves, else a new one from this step's page on. Resident pages waiting
        for their refill from host history (after a change of split) are copied first,
        outside the step: a captured step would repeat the refill at every replay."""
        s = self._step
        lay = self._layout_for(s["lo"] // self.page_size, s["pages"], s["layers"])
        self._drop_next()                 # a forward begun ahead is not a fixed one (and
        self.pool.refill(lay.pages, s["layers"])         # it may have refilled pages)
        self._layout = lay
        ahead = self.pool.ahead_for(lay.pages, s["layers"])   # by the last replay's guess
        return replace(lay, ahead=ahead) if ahead else lay

    def _layout_for(self, first: int, pages: int, layers) -> StepLayout:
        """The last layout while it serves a step writing from page `first` over `pages`
        pages, else a new one from there."""
        r, lay = self.pool.r, self._layout
        if lay is None or not lay.serves(r, first, pages, tuple(layers)):
            room = min(self.num_pages, r + self.pool.ring.n_slots)
            lay = StepLayout.around(r, first, pages, layers, room, self.layout_slack)
        return lay

    def prepare_capture(self) -> None:
        """Before capturing the open forward: no copy in flight, no fence from before, and
        the row-publish kernel launched once with the capture's arguments (a first launch
        compiles and loads it, which a capture forbids; the rows it writes are rewritten
        by the step)."""
        self.pool.prepare_capture()
        if self.pool.row_maps is None:
            return
        try:
            self.pool.warm_row_publish(self._step["positions"], self._step["layers"][0])
        except Exception as e:            # e.g. a Triton that cannot reach pinned memory
            warnings.warn(f"publishing rows by kernel failed ({type(e).__name__}: {e}); "
                          f"captured steps publish whole pages instead", RuntimeWarning,
                          stacklevel=2)
            self.pool.row_maps = None

    def captured(self):
        """After a capture: the fences it recorded never ran (nothing did). Returns what
        the captured step fills ahead for the next one (None: nothing), for end_replayed."""
        self.pool.forget_fences()
        return self.pool.ahead_record()

    def abandon_capture(self) -> None:
        """After a failed capture (the device synchronized): its forward and events go."""
        self.engine.abandon_capture()
        self.pool.abandon()

    def end_issue(self) -> None:
        """The end of a captured step's device work: the last layer's release, then, with
        fill_ahead, the next step's first layers filled into the slots that step's
        program of this layout gives them (as far as the ring allows), inside the step: the
        copy engine works through the last layers' compute, the head and the graph's
        boundary, and the next step's program skips those fills (`StepLayout.ahead`). A
        guess: another forward comes instead and finds only those slots' last use in the
        fills."""
        self.pool.end()
        lay = self._layout
        if self.fill_ahead and lay is not None:
            self.pool.fill_ahead(lay.pages, self._step["layers"])

    def end_replayed(self, moved: tuple[int, int] = (0, 0), fence=None, filled=None) -> None:
        """Close the open forward after its captured work ran (a CUDA graph replay, or on
        the CPU its rerun): `moved` = the (h2d, d2h) bytes a replay copies, `fence` = the
        compute stream after the replay (CUDA), the last use of every page; `filled` = what
        the replayed step filled ahead (`captured()`; a rerun records its own)."""
        s, self._step = self._step, None
        self.engine.count_replay(*moved)
        if fence is not None:
            self.pool.replayed(fence, filled)
        elif self.backend.sync_each_forward:
            self.engine.synchronize()
        self._close(s, replayed=True)

    def join_copies(self) -> None:
        """Order the compute side after every copy issued so far (no host wait)."""
        self.engine.join()

    def _close(self, s: dict, replayed: bool = False) -> None:
        """The forward's rows are history; its telemetry."""
        self.host.publish(s["hi"] + 1, s["layers"])
        c, ring = self.pool.count, self.pool.ring.n_slots
        wall = max(time.perf_counter() - s["t0"], 1e-9)
        self.telemetry.append(StepStats(
            step=len(self.telemetry), tokens=s["tokens"], context_pages=s["pages"],
            resident_pages=self.pool.L * self.pool.r, ring_slots=ring,
            h2d_bytes=self.engine.bytes_h2d - s["h2d"], d2h_bytes=self.engine.bytes_d2h - s["d2h"],
            readiness_misses=c.misses,
            copy_busy_pct=_busy_pct(self.engine.busy_s - s["busy"], wall),
            ring_occupancy=c.peak_held / ring if ring else 0.0,
            resident_reads=c.resident_reads, streamed_reads=c.streamed_reads, layers=len(s["layers"]),
            repartitioned=s["repart"], policy=s["reason"], wall_ms=1e3 * wall,
            replayed=replayed, split_layers=c.split))
        self._last = (s["t0"], s["busy"])

    def _begin_next(self, hi: int, layers) -> None:
        """Begin the forward of position hi + 1 (the next decode step) now: the copy engine
        fills its first layers' ring slots while this forward's last layers, the sampler
        and the host's next call run, instead of idling until the next begin_forward."""
        lo = hi + 1
        n_pages = lo // self.page_size + 1
        r = self.pool.r
        if lo >= self.capacity or n_pages - min(r, n_pages) > self.pool.ring.n_slots:
            return                        # out of room, or the split must change first
        self._next_h2d = self.engine.bytes_h2d
        self._next_valid = list(self.pool.valid_upto)
        self.pool.begin(n_pages, range(lo // self.page_size, n_pages), layers)
        self._next = (lo, lo, n_pages, layers)

    def _drop_next(self) -> None:
        """Forget a forward begun ahead: wait for its copies, free its ring slots, and count
        the resident pages it refilled or claimed as stale again (the next forward redoes
        them in its own order). Only a forward that was not the guessed one pays this."""
        if self._next is not None:
            self._next = None
            self.pool.drain()             # first: its slots are released once filled
            self.pool.end()
            self.pool.valid_upto = self._next_valid

    def _settle_copy_busy(self, now: float, busy: float) -> None:
        """The last forward's copy-busy share, over the time from its begin to this one.
        Its copies may land after its host work ended (the host runs ahead of the device,
        far ahead with CUDA graphs); the next begin comes after the caller read the
        forward's output, so by then they were timed."""
        last, self._last = self._last, None
        if last is None or not self.telemetry:
            return
        pct = _busy_pct(busy - last[1], max(now - last[0], 1e-9))
        self.telemetry[-1] = replace(self.telemetry[-1], copy_busy_pct=pct)

    def _apply_policy(self, n_pages: int, rows: int) -> tuple[bool, str]:
        last = self.telemetry[-1] if self.telemetry else None
        obs = P.Observation(
            context_pages=n_pages, planned_pages=min(self.planned_pages, self.num_pages),
            decode=rows <= P.DECODE_ROWS,
            readiness_misses=last.readiness_misses if last else 0,
            # (a replayed step observed no misses nor copy time: no feedback from it)
            ring_occupancy=last.ring_occupancy if last and not last.replayed else None,
            copy_busy=last.copy_busy_pct / 100 if last else 0.0)
        d = P.step(self.policy_config, self.policy_state, obs)
        if d.accepted or not P.serves(self.policy_config, d.resident_per_layer, n_pages):
            self._drop_next()             # the split changes: the guess's slots go back
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

    # ---- whole-cache operations --------------------------------------------------------------
    def drop_resident(self) -> None:
        """Throw away every resident device page; later reads rebuild them from host history."""
        self._drop_next()
        self.pool.drop_resident()

    def reset(self) -> None:
        """Forget the sequence (the split and the telemetry stay)."""
        if self._step is not None:
            self.end_forward(ok=False)
        self._drop_next()
        self.pool.forget()
        self.host.reset()
        self.planned_pages = 0

    def plan(self, n_tokens: int) -> None:
        """The sequence will grow to n_tokens (prompt + max new tokens): the policy splits
        the arena for that context from the next forward on, instead of repartitioning
        (a drain each time) as prefill and decode grow it."""
        self.planned_pages = -(-int(n_tokens) // self.page_size)

    def truncate(self, n_tokens: int) -> None:
        """Keep only positions < n_tokens (e.g. rejected speculative rows)."""
        self.host.truncate(n_tokens)

    def synchronize(self) -> None:
        """Wait for every copy issued so far, a replayed step's too (before reading host
        history on the host)."""
        self.pool.drain()

    def stats(self) -> dict:
        return summarize(self.telemetry)

    def close(self) -> None:
        """Stop the copy engine and give the KV regions back, fenced by their last use."""
        if self._step is not None:
            self.end_forward(ok=False)
        self._drop_next()
        try:
            self.pool.drain()
        except RuntimeError:      # a failed copy was already raised to its forward
            pass
        self.engine.close()
        for lease in self._leases:
            if lease.active:
                lease.release(AllOf(self.pool.last_use))
