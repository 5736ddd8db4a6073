"""A decode step as one CUDA graph, over any KV cache, streamed included.

A streamed step's device work -- page tables, ring fills from pinned host memory on the
copy stream, the ready and consumed fences between the two streams, every layer's kernels,
the publishes of the written page back to the host -- is the same for every position of a
layout (runtime/step_layout.py). So the whole step is captured once per layout, the copy
stream forked into the capture and joined back, and a step is then: the policy's decision
on the host, one graph replay, the host's bookkeeping. A new layout (the context grew past
it, or the split changed) is captured at its first step; a step whose resident pages wait
for a refill from the host runs eagerly once. A resident cache (a hybrid model's) has one
layout: its capture serves every step.

The capture computes nothing (captured work does not run), so the step is then replayed
for real. A program's first step runs eagerly on the capture stream (Triton compiles and
autotunes, cuBLAS gets its workspace), and so does a step at position 0 (it starts a
sequence: a hybrid model's state reset is host work). Between replays the host does not
wait for the device.

On the CPU there are no graphs: a "capture" keeps the step's code and each "replay" runs it
again, in the same fixed layout, so CI runs the same bookkeeping and the same device work.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from kvcompile.errors import PhaseError
from kvcompile.phase.programs import StaticInput, check_step_positions
from kvcompile.runtime.bracket import is_streamed


class _Rerun:
    """The CPU's stand-in for a CUDA graph: replay() runs the captured step again."""

    def __init__(self, fn):
        self.fn, self.out = fn, None

    def replay(self) -> None:
        self.out = self.fn()


class _FixedRange:
    """A resident cache as a captured model sees it: the positions' range is the step's
    (reading the tensor would be a host synchronisation, which a capture forbids)."""

    def __init__(self, cache):
        self._cache, self.range = cache, (0, 0)

    def check_positions(self, positions) -> tuple[int, int]:
        return self.range

    def __getattr__(self, name):
        return getattr(self._cache, name)


class _Program:
    """One layout's captured step: the graph (or the CPU's rerun), its output buffer and
    the bytes a replay copies (h2d, d2h)."""

    def __init__(self, graph, out, moved):
        self.graph, self.out, self.moved = graph, out, moved


MAX_PROGRAMS = 4    # layouts kept (a second request of the same length reuses its capture)


class DecodeGraph:
    def __init__(self, model, cache, rows: int = 1, layers=None, strict: bool = True,
                 compile: bool = False):
        """strict=False: a capture that fails warns and every later step runs eagerly
        (the engine keeps serving); strict (tests, benchmarks): the error propagates.
        compile: a streamed cache's steps run the model traced by torch.compile, its ring
        ops lowered to the cache's page movement (passes.streamed_pipeline) instead of the
        eager model's per-layer hook."""
        if rows < 1:
            raise PhaseError(f"a decode program runs at least one row, got {rows}")
        if compile and not is_streamed(cache):
            raise PhaseError("a compiled decode graph takes a streaming cache (a resident "
                             "one has no ring ops to lower)")
        self.model, self.cache, self.rows, self.layers = model, cache, rows, layers
        self.strict = strict
        self.device = torch.device(getattr(cache, "device", "cpu"))
        self.cuda = self.device.type == "cuda"
        self.streamed = is_streamed(cache)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # One memory pool for every layout's graph (a budget has little room): programs run
        # one at a time on one stream, each output stays allocated while its program lives
        # and is read before another program runs, so a graph may reuse the blocks another
        # one only used inside itself.
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._input = StaticInput(rows, self.device)
        self._resident = None if self.streamed else _FixedRange(cache)
        self._view = self._compiled = None
        if compile:
            from kvcompile.passes import streamed_pipeline
            from kvcompile.phase.compiled_forward import compile_forward
            from kvcompile.runtime.compiled_view import CompiledKvView
            self._view = CompiledKvView(cache)
            self._compiled = compile_forward(model, streamed_pipeline(self._view))
        self.fallback: str | None = None  # why steps run eagerly after a failed capture
        self.programs: dict = {}          # layout -> _Program, least recently used first
        self._layout = None               # the layout being captured
        self.warm = False
        self._start = 0                   # the step's first position
        self.captures = self.replays = self.eager_steps = 0

    # ---- one step ----------------------------------------------------------------------
    def step(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [rows, vocab] of tokens at positions start.. (valid until the next step)."""
        if len(tokens) != self.rows:
            raise PhaseError(f"this decode program runs {self.rows} rows, got {len(tokens)}")
        check_step_positions(self.model, self.cache, start, self.rows)
        if not self.cuda:
            with torch.inference_mode():
                return self._step(tokens, start)[0]
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream), torch.inference_mode():
            out, replayed = self._step(tokens, start)
            if not replayed:                  # an eager step's: read on the caller's stream
                out.record_stream(cur)
        cur.wait_stream(self.stream)
        return out

    def _step(self, tokens, start: int):
        """(logits, whether a program replayed them)."""
        self._input.load(tokens, range(start, start + self.rows))
        self._start = start
        may_capture = self.warm and start > 0 and self.fallback is None
        if not self.streamed:
            self._resident.range = (start, start + self.rows - 1)
            layout = "resident" if may_capture else None
            if layout is not None and layout not in self.programs:
                self._try_capture(layout)
            program = self.programs.get(layout)
            if program is None:
                return self._eager(self._resident), False
            return self._replay(program, layout, start), True
        cache = self.cache
        cache.open_forward(self._input.positions, self.layers, start)
        try:
            layout = cache.step_layout() if may_capture else None
            if layout is not None and layout not in self.programs:
                self._try_capture(layout)
            program = self.programs.get(layout)
            if program is None:
                cache.issue_forward()
                out = self._eager(cache)
                cache.end_forward()
                return out, False
            return self._replay(program, layout, start), True
        except BaseException:
            cache.end_forward(ok=False)
            raise

    def _eager(self, cache) -> torch.Tensor:
        out = self._forward(cache)
        self.warm = True
        self.eager_steps += 1
        return out

    def _work(self) -> torch.Tensor:
        """The device work of one step in the layout being captured: what a graph holds."""
        if not self.streamed:
            return self._forward(self._resident)
        self.cache.issue_forward(self._layout)
        out = self._forward(self.cache)
        self.cache.end_issue()
        return out

    def _forward(self, cache) -> torch.Tensor:
        """The model over the step's static input: traced (its ring ops lowered) or eager."""
        tokens, positions = self._input.tokens, self._input.positions
        if self._compiled is None:
            return self.model(tokens, positions, cache, last_only=True)
        state = self._state()
        if state is not None:             # host bookkeeping the traced forward skips
            state.begin(self._start, self.rows)
        return self._compiled(tokens, positions, self._view, last_only=True)

    def stats(self) -> dict:
        return {"decode_graphs": len(self.programs), "captures": self.captures,
                "replays": self.replays, "eager_steps": self.eager_steps,
                "compiled": self._compiled is not None,
                **({"fallback": self.fallback} if self.fallback else {})}

    def _state(self):
        plan = self.model.layer_plan
        return self.model.recurrent_state(self.cache) if plan.recurrent else None

    # ---- capture and replay -------------------------------------------------------------
    def _try_capture(self, layout) -> None:
        try:
            self._capture(layout)
        except Exception as e:
            if self.strict:
                raise
            self.fallback = f"{type(e).__name__}: {e}"
            warnings.warn(f"decode CUDA graph capture failed ({self.fallback}); decoding "
                          f"eagerly from now on", RuntimeWarning, stacklevel=4)

    def _capture(self, layout) -> None:
        while len(self.programs) >= MAX_PROGRAMS:     # the least recently used goes
            self.programs.pop(next(iter(self.programs)))
        self._layout = None if layout == "resident" else layout
        if not self.cuda:
            fn = self._layout, self._work
            self.programs[layout] = _Program(_Rerun(lambda: self._rerun(*fn)), None, (0, 0))
            self.captures += 1
            return
        state = self._state()
        n_tokens = state.n_tokens if state is not None else None
        engine = self.cache.engine if self.streamed else None
        if self.streamed:
            self.cache.prepare_capture()
        torch.cuda.synchronize(self.device)
        # Blocks cached by the caching allocator go back first: under a device-memory budget
        # (a per-process cap) the capture's pool must grow without freeing memory
        # mid-capture. (No gc.collect as torch.cuda.graph does: in a large process it can
        # take longer than the capture, and a capture comes every 256 tokens.)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (a server's) do not break it
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                if engine is not None:
                    engine.begin_capture()
                out = self._work()
                moved = engine.end_capture() if engine is not None else (0, 0)
            except BaseException:
                # the first error is the one told; the copy stream joins back first, or
                # capture_end fails before it gives the allocator back its normal mode
                for end in ((engine.end_capture,) if engine is not None else ()) + (
                        graph.capture_end,):
                    with contextlib.suppress(Exception):
                        end()
                raise
            graph.capture_end()
        except BaseException:
            self._abandon()
            raise
        finally:
            if state is not None:             # the capture's state.begin() did not happen
                state.n_tokens = n_tokens
        if self.streamed:
            self.cache.captured()
        self.programs[layout] = _Program(graph, out, moved)
        self.captures += 1

    def _rerun(self, layout, work):
        self._layout = layout
        return work()

    def _abandon(self) -> None:
        """After a failed capture: the cache forgets the capture's forward and events."""
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            pass
        if self.streamed:
            self.cache.abandon_capture()

    def _replay(self, program: _Program, layout, start: int) -> torch.Tensor:
        self.programs[layout] = self.programs.pop(layout)     # the most recently used
        if self.cuda:
            state = self._state()
            if state is not None:             # host bookkeeping the capture skipped
                state.begin(start, self.rows)
            if self.streamed:
                self.cache.join_copies()      # the graph's fills assume an idle copy side
            program.graph.replay()
            out = program.out
        else:
            program.graph.replay()            # reruns the step's code, bookkeeping included
            out = program.graph.out
        if self.streamed:
            fence = self.cache.backend.compute_fence() if self.cuda else None
            self.cache.end_replayed(program.moved, fence)
        self.replays += 1
        return out
