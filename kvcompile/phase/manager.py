"""The phase manager: prefill and decode as two layouts of one arena, and the programs of
the current layout.

A transition (`enter(phase)`): drain the device (every kernel that used the old layout has
finished), park every program (they captured the old addresses: a parked program refuses to
run), release the leases of regions that change, commit the new region map through an arena
transaction, lease and rebind (the cache's attention scratch becomes a view of the new
workspace region), then revive the parked programs of the new phase whose regions came back
at the same addresses; the others are invalidated and recaptured lazily, on first use. The `kv` region keeps its size, so the transaction keeps
it in place and its lease proves it: the KV written during prefill is where decode reads it.

The manager is written against the arena and a cache's per-layer buffers (`cache.layers`,
`cache.layer(i)` with `k_pool`, `v_pool`, `workspace`), so a streaming cache can take its
pages from `kv` + `kv_extra` the same way; today it binds the all-resident PagedKvCache.
"""
from __future__ import annotations

import torch

from kvcompile.errors import PhaseError, UnsupportedModelError
from kvcompile.phase import layouts as L
from kvcompile.phase.compiled_forward import compile_forward
from kvcompile.phase.programs import PhaseProgram, check_step_positions, warming
from kvcompile.runtime.arena import Arena, align
from kvcompile.runtime.fences import DONE
from kvcompile.runtime.bracket import is_streamed


def _sms(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    from kvcompile.ops.span_attention.launch import num_sms
    return num_sms(device)


class _Bytes:
    """A byte range as __cuda_array_interface__ / __array_interface__, holding its owner (a
    view of the arena) alive: the tensor made from it keeps this object, this the arena."""

    def __init__(self, view: torch.Tensor):
        self.owner = view
        iface = {"shape": (view.numel(),), "typestr": "|u1", "data": (view.data_ptr(), False),
                 "version": 3, "strides": None}
        if view.device.type == "cuda":
            self.__cuda_array_interface__ = {**iface, "stream": None}
        else:
            self.__array_interface__ = iface


def separate_storage(view: torch.Tensor) -> torch.Tensor:
    """The same device bytes as `view` (a typed view of an arena region) behind a storage of
    its own. Why: inductor's front end (aot_autograd) sees every KV pool as a mutated graph
    input; views of one storage make it merge them into a "synthetic base", which it refuses
    for views of another dtype than the base and which otherwise clones a pool and writes
    it back every layer. The arena's regions never overlap, so separate storages tell it
    the truth."""
    flat = view.reshape(-1).view(torch.uint8)
    if view.device.type == "cuda":
        raw = torch.as_tensor(_Bytes(flat), device=view.device)
    else:
        import numpy as np
        raw = torch.from_numpy(np.asarray(_Bytes(flat)))    # the ndarray keeps _Bytes
    return raw.view(view.dtype).view(view.shape)


class PhaseManager:
    def __init__(self, model, cache, *, ubatch: int, arena_bytes: int | None = None,
                 compile: bool | None = None, capture: bool | None = None,
                 lower: str | None = None, workspace_bytes: dict[str, int] | None = None,
                 buckets=L.BUCKETS):
        if not all(hasattr(cache, a) for a in ("layers", "layer", "capacity")) or \
                is_streamed(cache):
            raise UnsupportedModelError(
                f"phase programs bind an all-resident paged KV cache, not "
                f"{type(cache).__name__}; run the streaming cache without --cuda-graphs for now")
        if not model.layer_plan.plain:
            raise UnsupportedModelError(
                "phase programs support attention-only (llama-family) models; hybrid models "
                "with recurrent state run without --cuda-graphs")
        if not isinstance(ubatch, int) or isinstance(ubatch, bool) or ubatch <= 0:
            raise PhaseError(f"the prefill ubatch must be a positive number of tokens, got "
                             f"{ubatch!r}")
        if ubatch > cache.capacity:     # its program could never be filled
            raise PhaseError(f"the prefill ubatch of {ubatch} tokens is larger than the KV "
                             f"cache's {cache.capacity} positions; use --ubatch-size "
                             f"{cache.capacity} or less")
        self.model, self.cache, self.ubatch = model, cache, ubatch
        self.device = torch.device(cache.device)
        self.buckets = tuple(sorted(buckets))
        if not self.buckets or any(not isinstance(b, int) or b <= 0 for b in self.buckets):
            raise PhaseError(f"decode buckets must be positive row counts, got {buckets!r}")
        self.capture = self.device.type == "cuda" if capture is None else capture
        # Capture needs the compiled forward: eager forwards check positions on the host
        # (a synchronisation, illegal while capturing); the compiled graph leaves it out.
        self.compile = self.capture if compile is None else compile
        if self.capture and self.device.type != "cuda":
            raise PhaseError(f"CUDA graphs capture on a CUDA device, the cache is on "
                             f"{self.device}; on the CPU programs run eagerly (capture=False)")
        if self.capture and not self.compile:
            raise PhaseError("captured programs run the compiled forward (the eager one "
                             "synchronises to check positions); pass compile=True")
        # "graph" (default): the pass pipeline's graph op by op, bitwise the eager model.
        # "inductor" (opt-in, experimental): torch ops fused around the kvcompile ops, not
        # bitwise, and slower than "graph" on the 8B decode (0.57 vs 0.66 of the HBM
        # roofline, docs/phases.md), so it is not the default.
        from kvcompile.passes.pipeline import LOWERS
        self.lower = lower or "graph"
        if self.lower not in LOWERS:
            raise PhaseError(f"unknown lowering {lower!r}; use one of {LOWERS}")
        # each pool starts aligned, so typed views of it (f32, fp16 scales) are legal
        self.kv_bytes = sum(align(getattr(cache.layer(i), a).nbytes)
                            for i in cache.layers for a in ("k_pool", "v_pool"))
        self.scratch = L.attention_scratch_bytes(model.config, _sms(self.device))
        # inductor programs allocate a scratch per attention layer (_bind_workspace)
        scratches = model.config.n_layers if self.lower == "inductor" else 1
        ws = {p: L.workspace_bytes(model.config, p, ubatch, _sms(self.device), scratches)
              for p in L.PHASES}
        unknown = set(workspace_bytes or {}) - set(L.PHASES)
        if unknown:
            raise PhaseError(f"workspace_bytes names unknown phase(s) {sorted(unknown)}; the "
                             f"phases are {list(L.PHASES)}")
        ws.update(workspace_bytes or {})
        if any(w < self.scratch for w in ws.values()):
            raise PhaseError(f"a phase workspace must hold at least the attention scratch of "
                             f"{self.scratch} bytes; got {ws}")
        self.workspaces = ws
        if arena_bytes is None:
            arena_bytes = align(self.kv_bytes) + max(align(w) for w in ws.values())
        self.layouts = L.plan_layouts(arena_bytes, self.kv_bytes, ws)
        self.arena = Arena(arena_bytes, device=self.device)
        with self.arena.begin() as tx:     # alone first: kv sits at offset 0 for good
            tx.reserve(L.KV, self.kv_bytes)
        self._leases = {L.KV: self.arena.lease(L.KV)}
        self._bind_kv()
        self.phase: str | None = None
        self.programs: dict[tuple[str, int], PhaseProgram] = {}   # of the current layout
        self.parked: dict[tuple[str, int], PhaseProgram] = {}     # of the other layout
        self.captures = 0          # programs built (CUDA graphs captured on the device)
        self.warmup_s = 0.0        # host seconds of programs' first runs (trace, capture)
        self.transitions = 0
        self.invalidated = 0
        self.revived = 0           # parked programs that ran again in their layout
        self._compiled = None

    # ---- layouts --------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """Make `phase`'s layout current (a no-op if it already is)."""
        if phase not in self.layouts:
            raise PhaseError(f"unknown phase {phase!r}; phases are {tuple(self.layouts)}")
        if phase == self.phase:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)      # drain: the old layout is unused now
        for key, p in self.programs.items():        # refused until their layout is back
            p.park()
            self.parked[key] = p
        self.programs = {}
        want = self.layouts[phase].regions
        current = self.arena.regions()
        for name in [n for n in self._leases if n not in want
                     or current[n].size != want[n]]:
            self._leases.pop(name).release(DONE)     # DONE: the drain above proved it
        with self.arena.begin() as tx:
            for name, nbytes in want.items():
                tx.reserve(name, nbytes)
        for name in want:
            if name not in self._leases:
                self._leases[name] = self.arena.lease(name)
        self._bind_workspace()
        self.phase = phase
        self.transitions += 1
        self._revive(phase)

    def _revive(self, phase: str) -> None:
        """Programs of `phase` captured in an earlier visit run again when every region they
        were captured against came back at the same offset and size (the layouts are
        deterministic, so they do): a request after the first captures nothing. A program
        whose regions moved is invalidated and dropped."""
        current = self.arena.regions()
        for key in [k for k in self.parked if k[0] == phase]:
            prog = self.parked.pop(key)
            if prog.revive(current):
                self.programs[key] = prog
                self.revived += 1
            else:
                prog.invalidate()
                self.invalidated += 1

    def _bind_kv(self) -> None:
        """Every layer's K and V pool becomes a view of the kv region (contents carried over)."""
        view, off = self._leases[L.KV].view(), 0
        for i in self.cache.layers:
            kv = self.cache.layer(i)
            for attr in ("k_pool", "v_pool"):
                old = getattr(kv, attr)
                new = self._own(view[off:off + old.nbytes].view(old.dtype).view(old.shape))
                new.copy_(old)
                setattr(kv, attr, new)
                off += align(old.nbytes)

    def _bind_workspace(self) -> None:
        """The decode kernels' scratch of every layer: the head of the workspace region.
        Inductor programs get none: span_attention does not declare writing its scratch, so
        inductor would clone a bound one every layer; unbound, the op allocates it inside the
        graph, from the program's own pool, and the capture measures it (`_bound_scratch`)."""
        scratch = None
        if self._bound_scratch():
            scratch = self._leases[L.WORKSPACE].view(0, self.scratch).view(torch.float32)
        for i in self.cache.layers:
            self.cache.layer(i).workspace = scratch

    def _bound_scratch(self) -> int:
        """Bytes of the workspace region the bound attention scratch takes (0 if none)."""
        return align(self.scratch) if self.scratch and self.lower != "inductor" else 0

    def _own(self, view: torch.Tensor) -> torch.Tensor:
        return separate_storage(view) if self.lower == "inductor" else view

    def kv_pool_bytes(self, phase: str) -> int:
        return self.layouts[phase].kv_pool_bytes

    # ---- programs -------------------------------------------------------------------------
    def program(self, phase: str, rows: int) -> PhaseProgram:
        """The current layout's program for `rows` (entering the phase; built lazily)."""
        self.enter(phase)
        key = (phase, rows)
        prog = self.programs.get(key)
        if prog is None:
            last_only = phase == "prefill"
            fn = self._step_fn(last_only)
            limit = self.arena.region(L.WORKSPACE).size - self._bound_scratch()
            estimate = L.activation_bytes(self.model.config, rows, 1 if last_only else rows)
            prog = PhaseProgram(f"{phase}/{rows}", fn, rows, self.device, self.arena,
                                (self.arena.region(L.KV), self.arena.region(L.WORKSPACE)),
                                self.capture, limit, estimate)
            self.programs[key] = prog
            self.captures += 1
        return prog

    def _step_fn(self, last_only: bool):
        model, cache = self.model, self.cache
        if self.compile and self._compiled is None:
            from kvcompile.passes import default_pipeline
            # streamed=(): every page is resident, no ring ops to place
            self._compiled = compile_forward(model, default_pipeline(streamed=()),
                                             lower=self.lower)
        if not self.compile:
            return lambda tokens, positions: model(tokens, positions, cache, last_only=last_only)
        compiled = self._compiled
        return lambda tokens, positions: compiled(tokens, positions, cache, last_only=last_only)

    @torch.inference_mode()
    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits of ids at positions start..: every row's for a decode step (up to the widest
        bucket, padded by repeating the last row: same slot, same bytes), the last row's for a
        prefill chunk. Full ubatch chunks run the prefill program; other widths over the
        widest bucket run the model eagerly in the prefill layout."""
        n = len(ids)
        if n == 0:
            raise PhaseError("a step needs at least one token")
        if n > self.ubatch:
            raise PhaseError(f"a prefill chunk of {n} tokens is larger than the ubatch of "
                             f"{self.ubatch} the prefill workspace is sized for; split it or "
                             f"raise --ubatch-size")
        check_step_positions(self.model, self.cache, start, n)
        if n <= self.buckets[-1]:
            rows = L.bucket_for(n, self.buckets)
            pad = rows - n
            prog = self.program("decode", rows)
            positions = list(range(start, start + n)) + [start + n - 1] * pad
            if pad:                    # (a token on the device is one row: no pad then)
                ids = (torch.cat([ids, ids[-1:].expand(pad)]) if isinstance(ids, torch.Tensor)
                       else ids + ids[-1:] * pad)
            out = self._run(prog, ids, positions)
            return out[:n]
        if n == self.ubatch:
            return self._run(self.program("prefill", n), ids, list(range(start, start + n)))
        self.enter("prefill")
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + n, dtype=torch.long, device=self.device)
        return self.model(tokens, positions, self.cache, last_only=True)

    def _run(self, prog: PhaseProgram, ids: list[int], positions: list[int]) -> torch.Tensor:
        """prog's step; its first run (a trace, a capture) counts as warm-up."""
        with warming(self, counts=not prog.replays):
            return prog.run(ids, positions)

    def stats(self) -> dict:
        return {"phase": self.phase, "lower": self.lower if self.compile else "eager",
                "captures": self.captures, "warmup_s": self.warmup_s, "transitions": self.transitions,
                "invalidated": self.invalidated, "revived": self.revived,
                "replays": sum(p.replays for p in (*self.programs.values(),
                                                   *self.parked.values())),
                "arena_bytes": self.arena.nbytes,
                "kv_pool_bytes": {p: self.kv_pool_bytes(p) for p in self.layouts},
                "workspace_bytes": dict(self.workspaces),
                "program_workspace": {p.name: p.workspace
                                       for p in self.programs.values()}}
