"""A decode step as one CUDA graph, over any KV cache, streamed included.

A streamed step's device work -- page tables, ring fills from pinned host memory on the
copy stream, the ready and consumed fences between the two streams, every layer's kernels,
the publishes of the written rows back to the host -- is the same for every position of a
layout (runtime/step_layout.py). So the whole step is captured once per layout, the copy
stream forked into the capture and joined back, and a step is then: the policy's decision
on the host, one graph replay, the host's bookkeeping. A new layout (the context grew past
it, or the split changed) is captured at its first step; resident pages waiting for a
refill from the host are copied before it, outside the graph. With the cache's fill_ahead, a step ends by
filling the next step's first layers (inside its graph, after its last fills) and the next
step runs a second program of the layout, which skips those fills (`StepLayout.ahead`). A
resident cache (a hybrid model's) has one layout: its capture serves every step.

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
import time
import warnings

import torch

from kvcompile.errors import PhaseError
from kvcompile.phase.programs import StaticInput, check_step_positions, warming
from kvcompile.phase.step_capture import Program, Rerun, capture_step
from kvcompile.runtime.bracket import is_streamed


class _FixedRange:
    """A resident cache as a captured model sees it: the positions' range is the step's
    (reading the tensor would be a host synchronisation, which a capture forbids)."""

    def __init__(self, cache):
        self._cache, self.range = cache, (0, 0)

    def check_positions(self, positions) -> tuple[int, int]:
        return self.range

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _traced(model, cache, streamed: bool):
    """(what the traced forward takes as its cache, the traced forward). A streaming
    cache's view holds it weakly (runtime/compiled_view.py); a resident cache is passed as
    it is (no ring ops: every page is on the device)."""
    from kvcompile.passes import default_pipeline, streamed_pipeline
    from kvcompile.phase.compiled_forward import compile_forward
    if not streamed:
        return cache, compile_forward(model, default_pipeline(streamed=()))
    from kvcompile.runtime.compiled_view import CompiledKvView
    view = CompiledKvView(cache)
    return view, compile_forward(model, streamed_pipeline(view))


# programs kept (a layout's two: its first step's, and the one whose first layers were filled
# ahead by the step before; a second request of the same length reuses them)
MAX_PROGRAMS = 8


class DecodeGraph:
    def __init__(self, model, cache, rows: int = 1, layers=None, strict: bool = True,
                 compile: bool = False, like: "DecodeGraph | None" = None,
                 max_programs: int = MAX_PROGRAMS):
        """strict=False: a capture that fails warns and every later step runs eagerly
        (the engine keeps serving); strict (tests, benchmarks): the error propagates.
        compile: the steps run the model traced once by torch.compile; over a streaming
        cache through passes.streamed_pipeline, its ring ops lowered to the cache's page
        movement instead of the eager model's per-layer hook. like: another program of
        this model and cache (another number of rows) whose stream, graph memory pool and
        traced forward this one shares (tracing again would drop that one's graphs). A
        step of one row returns its logits; of more rows (a verify step), every row's.
        max_programs: captured programs kept, least recently used dropped first."""
        if rows < 1:
            raise PhaseError(f"a decode program runs at least one row, got {rows}")
        self.model, self.cache, self.rows, self.layers = model, cache, rows, layers
        self._recurrent = bool(model.layer_plan.recurrent)   # (the plan is built per call)
        self.strict = strict
        self.device = torch.device(getattr(cache, "device", "cpu"))
        self.cuda = self.device.type == "cuda"
        self.streamed = is_streamed(cache)
        # One memory pool for every layout's graph (a budget has little room), shared with
        # `like`: programs run one at a time on one stream, each output stays allocated
        # while its program lives and is read before another program runs, so a graph may
        # reuse the blocks another one only used inside itself.
        if like is not None:
            self.stream, self._pool = like.stream, like._pool
        else:
            self.stream = torch.cuda.Stream(self.device) if self.cuda else None
            self._pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._input = StaticInput(rows, self.device)
        self._resident = None if self.streamed else _FixedRange(cache)
        self._view = self._compiled = None
        if like is not None:
            self._view, self._compiled = like._view, like._compiled
        elif compile:
            self._view, self._compiled = _traced(model, cache, self.streamed)
        self.fallback: str | None = None  # why steps run eagerly after a failed capture
        self.programs: dict = {}          # layout -> Program, least recently used first
        self.max_programs = max_programs
        self._layout = None               # the layout being captured
        self.warm = False
        self._start = 0                   # the step's first position
        self.trace_error: str | None = None   # why the eager model replaced the traced one
        self.captures = self.replays = self.eager_steps = self.retraces = 0
        # host seconds of the replayed steps, in three parts: from the step's start to its
        # launch (input, the cache's placement and layout; a capture on the way is counted
        # in warmup_s instead), replay() (a graph's launch on
        # CUDA, the whole rerun step on the CPU) and the bookkeeping after it
        self.prepare_s = self.launch_s = self.close_s = 0.0
        self._t_begin = 0.0
        self.warmup_s = 0.0               # host seconds spent tracing and capturing
        self._trace_made = False          # the traced forward has run (is traced)

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
        """(logits, whether a program replayed them). Not strict, a first traced step that
        fails (dynamo cannot trace the model, a pass refuses it) warns, and this step and
        every later one run the eager model instead (still captured)."""
        if self._compiled is None or self.warm or self.strict:
            return self._run_step(tokens, start)
        state = self._state()
        n_tokens = state.n_tokens if state is not None else None
        try:
            return self._run_step(tokens, start)
        except Exception as e:
            if state is not None:         # its begin ran before the trace failed
                state.n_tokens = n_tokens
            self._compiled = None
            self.trace_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"tracing the decode step failed ({self.trace_error}); the eager "
                          f"model runs in its graphs instead", RuntimeWarning, stacklevel=4)
            return self._run_step(tokens, start)

    def _run_step(self, tokens, start: int):
        self._t_begin = time.perf_counter()
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
        with warming(self, self._compiled is not None and not self._trace_made):
            out = self._forward(cache)
        self._trace_made = self._compiled is not None
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
        last_only = self.rows == 1
        if self._compiled is None:
            return self.model(tokens, positions, cache, last_only=last_only)
        state = self._state()
        if state is None:
            return self._compiled(tokens, positions, self._view, last_only=last_only)
        state.begin(self._start, self.rows)   # host bookkeeping the trace cannot hold
        return self._compiled(tokens, positions, self._view, last_only=last_only,
                              state_begun=True)

    def stats(self) -> dict:
        return {"decode_graphs": len(self.programs), "captures": self.captures,
                "replays": self.replays, "eager_steps": self.eager_steps,
                "prepare_s": self.prepare_s, "launch_s": self.launch_s,
                "close_s": self.close_s,
                "compiled": self._compiled is not None, "retraces": self.retraces,
                "warmup_s": self.warmup_s,
                **({"trace_error": self.trace_error} if self.trace_error else {}),
                **({"fallback": self.fallback} if self.fallback else {})}

    def _state(self):
        return self.model.recurrent_state(self.cache) if self._recurrent else None

    # ---- capture and replay -------------------------------------------------------------
    def _try_capture(self, layout) -> None:
        """Capture layout's program (warm-up: the step's prepare time restarts after it)."""
        try:
            with warming(self):
                self._capture(layout)
        except Exception as e:
            if self._compiled is not None and "fail_on_recompile" in str(e):
                # The traced forward must be traced again (another program of this model
                # class reset its code, or torch._dynamo.reset()): not inside a capture.
                # This step runs eagerly, which retraces; the next one captures.
                self.retraces += 1
                self._trace_made = False
                return
            if self.strict:
                raise
            self.fallback = f"{type(e).__name__}: {e}"
            warnings.warn(f"decode CUDA graph capture failed ({self.fallback}); decoding "
                          f"eagerly from now on", RuntimeWarning, stacklevel=4)
        finally:
            self._t_begin = time.perf_counter()

    def _capture(self, layout) -> None:
        while len(self.programs) >= self.max_programs:    # the least recently used goes
            self.programs.pop(next(iter(self.programs)))
        self._layout = None if layout == "resident" else layout
        if not self.cuda:
            fn = self._layout, self._work
            self.programs[layout] = Program(Rerun(lambda: self._rerun(*fn)), None, (0, 0))
            self.captures += 1
            return
        state = self._state()
        n_tokens = state.n_tokens if state is not None else None
        engine = self.cache.engine if self.streamed else None
        if self.streamed:
            self.cache.prepare_capture()
        try:
            with self._no_tracing():
                graph, out, moved = capture_step(self._work, self.device, self._pool, engine)
        except BaseException:
            self._abandon()
            raise
        finally:
            if state is not None:             # the capture's state.begin() did not happen
                state.n_tokens = n_tokens
        filled = self.cache.captured() if self.streamed else None
        self.programs[layout] = Program(graph, out, moved, filled)
        self.captures += 1

    def _no_tracing(self):
        """While capturing, the traced forward may only run its graph: dynamo tracing
        makes calls a capture forbids (it saves the CUDA RNG state)."""
        if self._compiled is None:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("fail_on_recompile")

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

    def _replay(self, program: Program, layout, start: int) -> torch.Tensor:
        self.programs[layout] = self.programs.pop(layout)     # the most recently used
        if self.cuda:
            state = self._state()
            if state is not None:             # host bookkeeping the capture skipped
                state.begin(start, self.rows)
            if self.streamed:
                self.cache.join_copies()      # the graph's fills assume an idle copy side
        t = time.perf_counter()
        self.prepare_s += t - self._t_begin
        program.graph.replay()                # on the CPU: reruns the step's code,
        t2 = time.perf_counter()              # bookkeeping included
        self.launch_s += t2 - t
        out = program.out if self.cuda else program.graph.out
        if self.streamed:
            fence = self.cache.backend.compute_fence() if self.cuda else None
            self.cache.end_replayed(program.moved, fence, program.filled)
        self.replays += 1
        self.close_s += time.perf_counter() - t2
        return out
