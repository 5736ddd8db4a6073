"""The KV store: everything a request slot keeps between forwards.

One device arena holds the decode kernels' scratch (`workspace`) and the KV pages (`kv`): a
physical page is a K page and a V page side by side (kv_pages.PagePair), so a run of pages is
one copy. Per attention layer the model reads a `LayerKv` (pools, page table, types,
rotations: layer_kv.py). Beside the pages: how far each layer's history reaches, a hybrid
model's recurrent state (and its host checkpoints for prefix reuse), the token ids the
engine fed, and a telemetry record of every forward.

Where the pages live is a policy of the store (`placement`), not another class:
- all resident (`arena_mib=0`, resident.py): the arena holds every page of the context; the
  device pages are the history (no host copy), page tables never change;
- streamed (`arena_mib > 0`, streamer.py): the history is on the host (pinned on CUDA) and
  the `Streamer` places each forward's pages (resident region and one ring shared by all
  layers) in the arena, prefetching ahead of the layers that read them (pool.py).

A forward is bracketed: `open_forward` (checks, the split, bookkeeping), `issue_forward`
(placement; for a captured step its fixed layout's work), the model's layers (each
`layer(i)` acquires its pages in an eager forward; a traced forward's lowered ring ops call
`acquire_pages` / `release_pages`), then `end_forward` (rows published, telemetry) or, after a
CUDA graph replay, `end_replayed`. `begin_forward` is open + issue. The executor drives the
bracket (executor/executor.py); tests may drive it by hand.
"""
from __future__ import annotations

import time

import torch

from kvcompile.errors import ArenaError, ContextLengthError, KvLayoutError
from kvcompile.kv.arena import MIB, Arena, align, mib_for
from kvcompile.kv.backend import Backend, make_backend
from kvcompile.kv.host_history import HostHistory, RowCounts
from kvcompile.kv.kv_pages import PagePair, check_arena_mib, min_arena_bytes, page_bytes
from kvcompile.kv.layer_kv import LayerKv, check_positions, check_range, decode_workspace_numel
from kvcompile.kv.prefix import PrefixState
from kvcompile.kv.recurrent_state import RecurrentState
from kvcompile.kv.resident import RESIDENT, AllResident
from kvcompile.kv.rotation import k_rotation, v_rotation
from kvcompile.kv.streamer import Streamer
from kvcompile.kv.telemetry import StepStats, summarize
from kvcompile.ops import kv_format as F


COPY_RUN_PAGES = 64        # pages a history copy moves at once (its device temporaries)


def copy_in_runs(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) a run of pages at a time: a copy between devices of a strided view
    stages through a temporary, which stays this small."""
    for i in range(0, src.shape[0], COPY_RUN_PAGES):
        dst[i:i + COPY_RUN_PAGES].copy_(src[i:i + COPY_RUN_PAGES])


class KvStore:
    def __init__(self, config, max_tokens: int, arena_mib: float = 0, k_type="f32",
                 v_type="f32", page_size: int = 256, *, device=None, layers=None,
                 backend: Backend | None = None, recurrent: RecurrentState | None = None,
                 rotate: bool = True, policy: dict | None = None, unsafe=frozenset(),
                 decode_depth="auto", prefetch_next: bool | None = None,
                 fill_ahead: bool | None = None, ctx_checkpoints: int = 0,
                 windows: dict | None = None, window_rows: int = 0):
        """config: the geometry (n_layers counts every KV layer index, MTP layers included);
        layers: the KV layers (default: the config's attention layers); windows: layer ->
        sliding window of the windowed layers (a streamed store copies only their window's
        pages; default: the config's, ModelConfig.layer_window); window_rows > 0: a
        streamed store keeps each windowed layer's window in a ring of its own on the
        device, sized for forwards of up to that many rows (window_rings.py); arena_mib:
        0 keeps
        every page on the device, N > 0 streams the history through N MiB of KV pages;
        backend: where memory and copies come from (default: the device's); recurrent: a
        hybrid model's state; ctx_checkpoints: host copies of that state kept for prefix
        reuse (prefix.py)."""
        if max_tokens <= 0:
            raise ContextLengthError(f"the KV cache needs room for at least one token; "
                                     f"got max_tokens={max_tokens}")
        if page_size <= 0:
            raise KvLayoutError(f"page size must be positive, got {page_size}")
        self.config, self.page_size = config, page_size
        self.k_type, self.v_type = F.kv_type(k_type), F.kv_type(v_type)
        self.backend = backend if backend is not None else make_backend(device, arena_mib)
        self.device = self.backend.device
        if layers is None:     # every attention layer (all of them, except in hybrid models)
            layers = [i for i in range(config.n_layers) if config.is_attention_layer(i)]
        self.layers = tuple(sorted(set(layers)))
        self.windows = {i: config.layer_window(i) for i in self.layers
                        if config.layer_window(i)} if windows is None else dict(windows)
        self.window_rows = window_rows
        bad = [i for i in self.layers if not 0 <= i < config.n_layers]
        if bad:
            raise KvLayoutError(f"KV layers {bad} are outside the model's {config.n_layers} "
                                f"layers")
        self.num_pages = -(-max_tokens // page_size)
        self.capacity = self.num_pages * page_size
        self.resident = not arena_mib
        pair = PagePair(*page_bytes(config, self.k_type, self.v_type, page_size))
        L = len(self.layers)
        if self.resident:
            n_phys = L * self.num_pages
        else:
            n_phys = self._streamed_pages(arena_mib, max_tokens, pair)
            self.backend.check_host_bytes(L * self.num_pages * pair.stride)
        scratch = self._scratch_bytes()
        nbytes = align(scratch) + align(n_phys * pair.stride)
        # zeroed once: pages past a sequence's rows hold the same bytes every run
        self.arena = Arena(nbytes, self.backend.device_buffer(nbytes).zero_())
        with self.arena.begin() as tx:
            tx.reserve("workspace", scratch).reserve("kv", n_phys * pair.stride)
        self._leases = [self.arena.lease("workspace"), self.arena.lease("kv")]
        kv_pool = self._leases[1].view().view(n_phys, pair.stride)
        self.pages = kv_pool              # uint8 [physical pages, K page + V page]
        workspace = (self._leases[0].view().view(torch.float32) if scratch else None)
        self.streamer: Streamer | None = None      # the streamed policy's machinery
        if self.resident:
            self.history = RowCounts(self.layers, page_size)
            self.placement = AllResident(self)
            k_pool, v_pool = pair.views(kv_pool)
            # rows 16-byte aligned (a multiple of 4 entries), like the pool's tables
            width = -(-self.num_pages // 4) * 4
            self._tables = (torch.arange(width, dtype=torch.int32,
                                         device=self.device)[None, :] * L
                            + torch.arange(L, dtype=torch.int32, device=self.device)[:, None])
            tables = {layer: self._tables[li, :self.num_pages]
                      for li, layer in enumerate(self.layers)}
        else:
            self.history = HostHistory(self.layers, self.num_pages, pair, page_size,
                                       alloc=self.backend.host_buffer)
            self.streamer = Streamer(self, kv_pool, pair, self.history, self.backend,
                                     policy=policy, unsafe=unsafe, depth=decode_depth,
                                     prefetch_next=prefetch_next, fill_ahead=fill_ahead)
            self.placement = self.streamer
            k_pool, v_pool = self.streamer.k_pool, self.streamer.v_pool
            tables = self.streamer.page_tables
        d = config.head_dim
        k_rot = k_rotation(self.k_type, d) if rotate else None
        v_rot = v_rotation(self.v_type, d) if rotate else None
        rot = {"k_rot": None if k_rot is None else k_rot.to(self.device),
               "v_rot": None if v_rot is None else v_rot.to(self.device)}
        self._kv = {i: LayerKv(k_pool, v_pool, tables[i], self.k_type.ggml_id,
                               self.v_type.ggml_id, page_size, workspace=workspace, **rot)
                    for i in self.layers}
        self.recurrent = recurrent
        self.prefix = PrefixState(self, ctx_checkpoints)
        self.telemetry: list[StepStats] = []
        self._step: dict | None = None

    def _streamed_pages(self, arena_mib, max_tokens: int, pair: PagePair) -> int:
        if arena_mib == "auto":
            raise ArenaError("kv_stream_arena_mib='auto' is what the Engine's memory budget "
                             "leaves: give the store a size in MiB")
        check_arena_mib(arena_mib)
        nbytes = int(arena_mib * MIB)
        need = min_arena_bytes(self.config, max_tokens, self.k_type, self.v_type,
                               self.page_size)
        if nbytes < need:
            raise ArenaError(
                f"an arena of {arena_mib:g} MiB is too small for {self.capacity} tokens of "
                f"{self.k_type.name}/{self.v_type.name} KV (the ring must hold one layer's "
                f"whole context); use --kv-stream-arena-mib {mib_for(need)} or more, or "
                f"lower --ctx-size")
        return pair.fit(nbytes)

    def _scratch_bytes(self) -> int:
        """The decode kernels' partials for the widest verify (CUDA; the CPU reference
        needs none): one buffer for every layer, which run in turn."""
        if self.device.type != "cuda":
            return 0
        from kvcompile.ops.span_attention.launch import num_sms
        return 4 * decode_workspace_numel(self.config, num_sms(self.device))

    # ---- what a model reads (KvAccess, models/contract.py) --------------------------------
    def layer(self, i: int) -> LayerKv:
        """Layer i's buffers. In an eager forward over a streamed store this is the hook
        that places the layer's pages (the previous layer released, its page table
        written); a traced forward reads the buffers only (its ring ops place them)."""
        if self.streamer is not None and not torch.compiler.is_compiling():
            self.acquire_pages(i)
        return self._kv[i]

    def has_layer(self, i: int) -> bool:
        return i in self._kv

    def check_positions(self, positions: torch.Tensor) -> tuple[int, int]:
        """(min, max) of positions, checked against the capacity: free for the positions
        the open forward began with, else one host read (a sync on CUDA)."""
        s = self._step
        if s is not None and positions is s["positions"]:
            return s["lo"], s["hi"]
        return check_positions(positions, self.capacity)

    def acquire_pages(self, i: int) -> torch.Tensor:
        """Layer i's pages present, its page table written (a lowered `ring_acquire`)."""
        if self._step is None:
            raise KvLayoutError("a streamed KV store places a layer's pages inside a forward; "
                                "run the model through the executor or begin_forward()")
        return self.streamer.acquire(i)

    def release_pages(self, i: int) -> None:
        """Layer i's ring slots consumed, its rows published (a lowered `ring_release`)."""
        self.streamer.release(i)

    @property
    def streams(self) -> bool:
        return self.streamer is not None

    # ---- the forward bracket ------------------------------------------------------------
    def begin_forward(self, positions: torch.Tensor, layers=None,
                      start: int | None = None) -> None:
        """open_forward + issue_forward. start: the positions are start, start + 1, ...
        (the caller's ints: the tensor is not read)."""
        if start is None:
            lo, hi = check_positions(positions, self.capacity)
        else:
            lo, hi = int(start), int(start) + positions.numel() - 1
            if positions.device.type == "cpu" and not torch.equal(
                    positions.reshape(-1), torch.arange(lo, hi + 1, dtype=positions.dtype)):
                raise KvLayoutError(f"positions are not {lo}..{hi}; pass start= only for "
                                    f"consecutive positions from start")
        self.open_forward(positions, lo, hi, layers)
        self.issue_forward()

    def open_forward(self, positions: torch.Tensor, lo: int, hi: int, layers=None) -> None:
        """The host half of a forward's begin: checks, the split, its bookkeeping. positions:
        the device tensor the model gets; lo / hi: its smallest and largest value."""
        layers = self.layers if layers is None else tuple(layers)
        if self._step is not None:
            raise KvLayoutError("begin_forward called twice without end_forward")
        missing = [i for i in layers if i not in self._kv]
        if missing:
            raise KvLayoutError(f"layers {missing} have no KV in this cache")
        check_range(lo, hi, self.capacity)
        have = min(self.history.rows[i] for i in layers)
        if lo > have:
            raise ContextLengthError(f"position {lo} leaves a gap after the {have} "
                                     f"positions already in the cache")
        s = dict(t0=time.perf_counter(), lo=lo, hi=hi, layers=layers, positions=positions,
                 tokens=hi - lo + 1)
        self.placement.open(s)
        self.history.truncate(lo, layers)   # rows from lo on are rewritten by this forward
        self._step = s

    def issue_forward(self, layout=None) -> None:
        """Issue the open forward's placement and first copies, or with a layout the fixed
        work of a captured step."""
        self.placement.issue(self._step, None if layout == RESIDENT else layout)

    def end_forward(self, ok: bool = True, ahead: bool = True) -> None:
        """Close the open forward: its rows become history (ok), its telemetry; ahead=False
        when the caller knows another kind of forward comes next (no guess begun ahead)."""
        if self._step is None:
            return
        s, self._step = self._step, None
        if ok:       # (first: a forward begun ahead copies the pages that hold rows)
            self.history.publish(s["hi"] + 1, s["layers"])
        self.placement.end(s, ok, ahead)

    # ---- captured steps (executor/executor.py) ----------------------------------------------
    def step_layout(self):
        """The fixed layout the open forward runs in as a captured step: RESIDENT for an
        all-resident store (its tables never change), else the streamer's layout."""
        return self.placement.step_layout(self._step)

    def prepare_capture(self) -> None:
        """Before capturing the open forward (streamed: no copy in flight, the row publish
        kernel loaded)."""
        self.placement.prepare_capture(self._step)

    def begin_capture(self) -> None:
        """The copy stream forked into the capture that begins now (streamed)."""
        self.placement.begin_capture()

    def end_capture(self) -> tuple[int, int]:
        """Join the copy stream back; the (h2d, d2h) bytes a replay of the capture copies."""
        return self.placement.end_capture()

    def captured(self):
        """After a capture: what its replays fill ahead for the next step (or None)."""
        return self.placement.captured()

    def abandon_capture(self) -> None:
        """After a failed capture (the device synchronized): the placement and events it
        made go; the forward stays open, to run uncaptured."""
        self.placement.abandon_capture()

    def end_issue(self) -> None:
        """The end of a captured step's device work (the last layer's release, fills ahead)."""
        self.placement.end_issue(self._step)

    def join_copies(self) -> None:
        """Order the compute side after every copy issued so far (no host wait)."""
        self.placement.join_copies()

    def end_replayed(self, moved: tuple[int, int] = (0, 0), filled=None) -> None:
        """Close the open forward after its captured work ran (a replay, or on the CPU a
        rerun): `moved` = the bytes a replay copies, `filled` = what it filled ahead."""
        s, self._step = self._step, None
        self.history.publish(s["hi"] + 1, s["layers"])
        self.placement.replayed(s, moved, filled)

    # ---- the sequence ---------------------------------------------------------------------
    def rows(self, layers=None) -> int:
        """Positions whose KV every one of `layers` (default: all) holds."""
        return min(self.history.rows[i] for i in (self.layers if layers is None else layers))

    def reset(self) -> None:
        """Forget the sequence (the split and the telemetry stay)."""
        if self._step is not None:
            self.end_forward(ok=False)
        self.placement.forget()
        self.history.reset()
        self.prefix.forget()
        if self.recurrent is not None:
            self.recurrent.reset()

    def plan(self, n_tokens: int) -> None:
        """The sequence will grow to n_tokens (prompt + max new tokens): a streamed store's
        policy splits the arena for that context from the next forward on, instead of
        repartitioning (a drain each time) as prefill and decode grow it."""
        self.placement.plan(-(-int(n_tokens) // self.page_size))

    def truncate(self, n_tokens: int) -> None:
        """Keep only positions < n_tokens (rejected speculative rows, a diverging prompt)."""
        self.history.truncate(n_tokens)
        self.prefix.truncate(n_tokens)

    def history_pages(self, layer: int) -> torch.Tensor:
        """Layer's pages that hold rows, as stored (uint8 [pages, K page + V page]): a view
        of the host history (streamed; synchronize() first) or of the device pages
        (resident: page p of the layer at index l is physical page p * layers + l, a
        strided view, nothing gathered)."""
        n = self.history.rows_pages(layer)
        if self.streamer is not None:
            return self.history.kv[layer][:n]
        per_page = self.pages.view(self.num_pages, len(self.layers), -1)
        return per_page[:n, self.layers.index(layer)]

    def adopt_pages(self, layer: int, pages: torch.Tensor, rows: int) -> None:
        """Make `pages` (as history_pages gives them) layer's history of `rows` positions,
        after a reset(): no device page of a streamed store holds history then."""
        n = pages.shape[0]
        mine = self.history.kv[layer][:n] if self.streamer is not None else \
            self.pages.view(self.num_pages, len(self.layers), -1)[:n, self.layers.index(layer)]
        copy_in_runs(mine, pages)
        self.history.rows[layer] = rows

    def drop_resident(self) -> None:
        """Throw away every resident device page of a streamed store; later reads rebuild
        them from host history."""
        if self.streamer is None:
            raise KvLayoutError("an all-resident store keeps its history in its device pages")
        self.streamer.drop_resident()

    def synchronize(self) -> None:
        """Wait for every copy issued so far, a replayed step's too (before reading host
        history on the host)."""
        self.placement.synchronize()

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def stats(self) -> dict:
        return summarize(self.telemetry)

    def close(self) -> None:
        """Stop the copy engine and give the regions back, fenced by their last use."""
        if self._step is not None:
            self.end_forward(ok=False)
        fence = self.placement.close()
        for lease in self._leases:
            if lease.active:
                lease.release(fence)

    @classmethod
    def for_model(cls, model, max_tokens: int, k_type="f32", v_type="f32", arena_mib=0,
                  *, device=None, page_size: int = 256, mtp: bool = True,
                  **options) -> "KvStore":
        """The request slot of `model`: KV pages for the layers its plan declares (the
        attention layers, and the MTP layers unless mtp=False: only an MTP drafter reads
        them), its recurrent state beside them."""
        plan = model.layer_plan
        device = torch.device(device) if device is not None else model.device
        recurrent = RecurrentState(model.config, device) if plan.recurrent else None
        layers = plan.kv_layers if mtp else plan.attention
        options.setdefault("windows", dict(plan.windows))
        return cls(plan.kv_config(model.config), max_tokens, arena_mib, k_type, v_type,
                   page_size, device=device, layers=layers, recurrent=recurrent, **options)


