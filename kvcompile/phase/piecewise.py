"""Piecewise CUDA graphs for decode over any KV cache, streaming included.

A streamed forward cannot be one graph: before each attention layer the cache's hook
(`cache.layer(i)`: release the previous layer, issue ring copies, make the compute stream
wait for this layer's copies, record fences) is host logic whose decisions change from
step to step. Everything between two hooks is the same kernels on the same addresses every
step (weights, page pools, page-table rows, the decode workspace, recurrent state, the
static token and position buffers), so it is captured once as one CUDA graph. A step is
then: begin the forward (tables written), replay segment 0, hook, replay segment 1, ...,
end the forward -- tens of host calls instead of thousands of kernel launches.

Capture needs no separate model code: the model runs once with a proxy cache whose
`layer(i)` ends the current capture, runs the real hook, and begins the next one. That
capture forward computes nothing (captured kernels do not run), so it is bracketed as a
failed forward (its rows never become history) and the step is then replayed for real.
The first step of a program runs eagerly on the capture stream, so Triton kernels are
compiled and autotuned and cuBLAS has its workspace before anything is captured.
Programs stay valid for their cache: its pools, tables and workspace never move (a phase
transition or a new cache needs a new program).
"""
from __future__ import annotations

import warnings

import torch

from kvcompile.errors import PhaseError
from kvcompile.phase.programs import StaticInput, check_step_positions
from kvcompile.runtime.streaming_cache import forward, forward_bracket


class _SegmentingCache:
    """The cache as the model sees it during capture: each layer() call is a segment cut,
    and the positions' range is the one the step was given (reading the tensor would be a
    host synchronisation, which capture forbids)."""

    def __init__(self, cache, cut, lo_hi: tuple[int, int]):
        self._cache, self._cut, self._lo_hi = cache, cut, lo_hi

    def layer(self, i: int):
        return self._cut(i)

    def check_positions(self, positions) -> tuple[int, int]:
        return self._lo_hi

    def __getattr__(self, name):
        return getattr(self._cache, name)


class PiecewiseDecode:
    def __init__(self, model, cache, rows: int = 1, layers=None, strict: bool = True):
        """strict=False: a capture that fails warns and every later step runs eagerly
        (the engine keeps serving); strict (tests, benchmarks): the error propagates."""
        dev = torch.device(getattr(cache, "device", "cpu"))
        if dev.type != "cuda":
            raise PhaseError(f"piecewise CUDA graphs need a CUDA cache, this one is on {dev}")
        if rows < 1:
            raise PhaseError(f"a decode program runs at least one row, got {rows}")
        self.model, self.cache, self.rows, self.layers = model, cache, rows, layers
        self.strict = strict
        self.fallback: str | None = None  # why steps run eagerly after a failed capture
        self.device = dev
        self.stream = torch.cuda.Stream(dev)
        self._input = StaticInput(rows, dev)
        self.graphs: list | None = None
        self.order: list[int] = []        # the hooks' layers, in call order
        self.out = None
        self.warm = False
        self.replays = 0
        self.captures = 0

    # ---- one step ----------------------------------------------------------------------
    def step(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [rows, vocab] of tokens at positions start.. (valid until the next step)."""
        if len(tokens) != self.rows:
            raise PhaseError(f"this decode program runs {self.rows} rows, got {len(tokens)}")
        check_step_positions(self.model, self.cache, start, self.rows)
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream), torch.inference_mode():
            self._input.load(tokens, range(start, start + self.rows))
            # a program's first step runs eagerly (compiles, autotunes, warms the stream);
            # so does a step at position 0, which starts a sequence (never captured, where a
            # hybrid model's state reset would be recorded; its replay is not tested)
            if self.graphs is None and self.warm and start and self.fallback is None:
                self._try_capture(start)
            if self.graphs is None or start == 0:
                out = self._eager(start)
                out.record_stream(cur)        # read on the caller's stream
                self.warm = True
            else:
                out = self._replay(start)
        cur.wait_stream(self.stream)
        return out

    def _try_capture(self, start: int) -> None:
        try:
            self._capture(start)
        except Exception as e:
            if self.strict:
                raise
            self.fallback = f"{type(e).__name__}: {e}"
            warnings.warn(f"piecewise CUDA graph capture failed ({self.fallback}); decoding "
                          f"eagerly from now on", RuntimeWarning, stacklevel=3)

    def _eager(self, start: int) -> torch.Tensor:
        return forward(self.model, self.cache, self._input.tokens, self._input.positions,
                       last_only=True, layers=self.layers, start=start)

    def _bracket(self, start: int, keep: bool = True):
        return forward_bracket(self.cache, self._input.positions, self.layers, start, keep)

    def stats(self) -> dict:
        return {"piecewise_graphs": len(self.graphs or ()), "captures": self.captures,
                "replays": self.replays, **({"fallback": self.fallback} if self.fallback else {})}

    def _state(self):
        get = getattr(self.model, "recurrent_state", None)
        return get(self.cache) if get is not None else None

    # ---- capture and replay -------------------------------------------------------------
    def _capture(self, start: int) -> None:
        state = self._state()
        n_tokens = state.n_tokens if state is not None else None
        pool = torch.cuda.graph_pool_handle()
        graphs, order = [], []
        current = [torch.cuda.CUDAGraph()]

        def cut(i: int):
            current[0].capture_end()
            graphs.append(current[0])
            order.append(i)
            kv = self.cache.layer(i)          # the real hook, between captures
            current[0] = torch.cuda.CUDAGraph()
            current[0].capture_begin(pool=pool)
            return kv

        torch.cuda.synchronize(self.device)
        # Blocks cached by the caching allocator (prefill's activations) go back first: under
        # a device-memory budget (a per-process cap) the capture's pool must grow without
        # freeing memory mid-capture, which a capture forbids (it would fail, and the engine
        # would decode eagerly).
        torch.cuda.empty_cache()
        capturing = False
        try:
            with self._bracket(start, keep=False):    # nothing ran: its rows are not history
                try:
                    current[0].capture_begin(pool=pool)
                    capturing = True
                    proxy = _SegmentingCache(self.cache, cut, (start, start + self.rows - 1))
                    out = self.model(self._input.tokens, self._input.positions, proxy,
                                     last_only=True)
                    capturing = False
                    current[0].capture_end()
                    graphs.append(current[0])
                except BaseException:
                    if capturing:
                        try:
                            current[0].capture_end()
                        except RuntimeError:
                            pass
                    raise
        finally:
            if state is not None:             # the capture's state.begin() did not happen
                state.n_tokens = n_tokens
            torch.cuda.synchronize(self.device)
        self.graphs, self.order, self.out = graphs, order, out
        self.captures += 1

    def _replay(self, start: int) -> torch.Tensor:
        state = self._state()
        with self._bracket(start):
            if state is not None:
                state.begin(start, self.rows)
            graphs = self.graphs
            for k, layer in enumerate(self.order):
                graphs[k].replay()
                self.cache.layer(layer)
            graphs[-1].replay()
        self.replays += 1
        return self.out
