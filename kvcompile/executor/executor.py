"""The executor: every forward of a request slot, whatever the store's policy, the model's
layers and the kind of step, through one path.

A step is `rows` tokens at positions start.. over the store: a prefill chunk, a decode step,
a speculative verify step, an MTP draft step. It is bracketed by the store (open: checks and
the split; issue: placement and copies; end: rows published, telemetry) and runs one of:

- a **program**, when its shape has one (its trace key, programs.py: decode, verify and MTP
  widths 1, 2, 4, 8, padded by repeating the last row; a hybrid's verify program records
  what rolls its recurrent state back to any row; full prefill chunks over an all-resident
  store of an attention-only model): the model traced once per key (compile.py; the MTP layer runs
  eagerly inside its programs), its device work captured as a CUDA graph per layout of the
  store and replayed (on the CPU a replay reruns the step's code);
- the **eager model** otherwise (wider steps, prefill chunks that return hidden rows), its
  layers placing their pages through the store's per-layer hook.
docs/executor.md tells the keys, the padding and the capture rules.

Everything runs on the executor's stream (a capture needs a side stream); the caller's
stream waits for it after each step. A program's output is its graph's buffer: valid until
its next replay. The executor counts each step's host time (`host_s`: until its work is
queued) and the program events of a request (`begin_request` / `request_stats`).
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
import weakref
from collections import OrderedDict

import torch

from kvcompile.errors import ProgramError
from kvcompile.executor.capture import capture_program
from kvcompile.executor.compile import trace_forward
from kvcompile.executor.programs import (BUCKETS, COUNTERS, Program,  # noqa: F401
                                         StaticInput, TraceFailed, bucket_for, capturable,
                                         verify_width, trace_key, warming)
from kvcompile.kv.layer_kv import check_range
from kvcompile.models.layers import check_rope_range

MAX_LAYOUTS = 8             # captured programs a trace key keeps, least recently used out

class Executor:
    def __init__(self, model, store, *, ubatch: int, capture: bool = False,
                 compile: bool = False, strict: bool = False, trace: bool = False,
                 max_layouts: int = MAX_LAYOUTS):
        """capture: CUDA graphs (on the CPU, reruns of the fixed layout); compile: programs
        run the traced forward; strict (tests, benchmarks): a failed trace or capture
        raises instead of falling back to the eager model / uncaptured steps; trace: one
        stderr line of telemetry a step."""
        self.model, self.store, self.ubatch, self.trace = model, store, ubatch, trace
        self.plan = model.layer_plan
        self.trunk = self.plan.trunk_kv_layers       # None: every KV layer
        self.state = store.recurrent
        self.device = store.device
        self.cuda = self.device.type == "cuda"
        self.capture, self.compile, self.strict = capture, compile, strict
        self.max_layouts = max_layouts
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # one memory pool for every graph: programs run one at a time on one stream, each
        # output stays allocated while its program lives and is read before another runs
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda and capture else None
        self._inputs: dict[tuple, StaticInput] = {}     # by (trunk or MTP, rows)
        self._traced = None
        self.trace_error: str | None = None      # why the eager model replaced the traced
        self.fallback: dict = {}                 # trace key -> why it captures no more
        self.programs: dict[tuple, OrderedDict] = {}    # trace key -> layout -> Program
        self._warm: set = set()                  # trace keys whose first step ran
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.counts.update(warmup_s=0.0, prepare_s=0.0, launch_s=0.0, close_s=0.0)
        self.host_s: list[float] = []
        self._base: dict = {}
        self._start, self._t_begin = 0, 0.0

    @property
    def mode(self) -> str:
        return ("cuda graphs" if self.capture else "traced") if self.compile else (
            "cuda graphs (eager model)" if self.capture else "eager")

    # ---- the steps a request makes ---------------------------------------------------------
    def step(self, ids, start: int, all_rows: bool = False) -> torch.Tensor:
        """Logits [vocab] of the last of ids at positions start.. (a prefill chunk or a
        decode step), or with all_rows every row's [n, vocab]. ids: host ints, or one token
        already on the device."""
        out = self._trunk(ids, start, all_rows=all_rows)
        return out if all_rows else out[-1]

    def verify(self, ids, start: int, hidden: bool = False):
        """Every row's logits of ids at start.. (a speculative verify step), with hidden the
        rows' final hidden states too (an MTP drafter's input): (logits, hidden or None).
        A hybrid model records what rolls its recurrent state back to any row (`rollback`)."""
        checkpoints = self.state is not None and len(ids) > 1
        if checkpoints:
            rows = verify_width(len(ids))
            if rows > self.state.checkpoint_rows:     # new buffers: no graph writes the old
                self.state.reserve_rows(rows)
                self.programs = {k: p for k, p in self.programs.items()
                                 if not k[0].startswith("verify")}
                self._warm = {k for k in self._warm if not k[0].startswith("verify")}
        out = self._trunk(ids, start, all_rows=True, hidden=hidden, checkpoints=checkpoints,
                          ahead=not hidden)   # with hidden rows an MTP step comes next
        return out if hidden else (out, None)

    def step_hidden(self, ids, start: int):
        """A prefill chunk that also returns its rows' final hidden states (the MTP
        drafter's input): (logits of the last row, hidden [n, hidden])."""
        logits, hidden = self._trunk(ids, start, all_rows=False, hidden=True, ahead=False)
        return logits[-1], hidden

    def rollback(self, keep: int, rows: int, start: int) -> None:
        """Keep the first `keep` of the `rows` rows of the verify step at `start`: the
        recurrent state goes back to its checkpoint after row keep-1, the store forgets the
        rows after it (their device copies are rewritten before any row reads them)."""
        if keep >= rows:
            return
        if self.state is not None:
            self.state.rollback(keep)
        self.store.truncate(start + keep)

    def mtp(self, ids, hidden: torch.Tensor, start: int):
        """The model's MTP layer over rows at positions start..: row i pairs the trunk's
        hidden state at position start + i with the token after it, ids[i]. Returns (the
        last row's logits [1, vocab], the MTP layer's output hidden rows)."""
        layers = (self.model.config.n_layers,)
        n = len(ids)
        check_range(start, start + n - 1, self.store.capacity)

        def run():
            if n <= BUCKETS[-1]:
                logits, h = self._keyed(("mtp", bucket_for(n)), ids, start, n, False, hidden)
                return logits, h[:n]
            tokens, positions = self._tensors(ids, start, n)
            return self._bracketed(positions, start, n, layers, False,
                                   lambda: self.model.mtp_forward(
                                       tokens, hidden, positions, self.store,
                                       return_hidden=True, last_only=True))
        with self._host_time():
            self._t_begin, self._start = time.perf_counter(), start
            return self._on_stream(run)

    # ---- one trunk step -------------------------------------------------------------------
    def _trunk(self, ids, start: int, *, all_rows: bool, hidden: bool = False,
               checkpoints: bool = False, ahead: bool = True):
        n = len(ids)
        if n == 0:
            raise ProgramError("a step needs at least one token")
        with self._host_time():
            self._t_begin = time.perf_counter()
            self._start = start
            key = trace_key(n, all_rows=all_rows, hidden=hidden, checkpoints=checkpoints,
                            hybrid=self.state is not None,
                            prefill=(n == self.ubatch and self.store.resident
                                     and self.plan.plain))
            check_range(start, start + n - 1, self.store.capacity)
            check_rope_range((start, start + n - 1), self.model.config.context_length)
            if key is None:
                out = self._on_stream(lambda: self._eager(ids, start, n, all_rows, hidden,
                                                          checkpoints, ahead))
            else:
                out = self._on_stream(lambda: self._keyed(key, ids, start, n, ahead))
                if key[0] != "prefill":       # every (padded) row's logits
                    rows = slice(0, n) if all_rows else slice(n - 1, n)
                    # hidden rows leave the graph's buffer: an MTP drafter keeps them
                    out = (out[0][rows], out[1][:n].clone()) if hidden else out[rows]
        return out

    def _keyed(self, key, ids, start: int, n: int, ahead: bool, hidden=None):
        """A step that has a program: its static input loaded, then the captured program of
        the store's layout replayed, or the program's function run uncaptured. hidden: an
        MTP step's input rows."""
        kind, rows = key
        mtp = kind == "mtp"
        pad = rows - n
        inp = self._inputs.get((mtp, rows))
        if inp is None:
            inp = self._inputs[mtp, rows] = StaticInput(rows, self.device, hidden)
        inp.load(ids if not pad else list(ids) + [ids[-1]] * pad,
                 list(range(start, start + n)) + [start + n - 1] * pad, hidden)
        last_only = kind == "prefill"
        store = self.store
        state = None if mtp else self.state       # the MTP layer has no recurrent state
        n_tokens = state.n_tokens if state is not None else None
        store.open_forward(inp.positions, start, start + n - 1,
                           (self.model.config.n_layers,) if mtp else self.trunk)
        try:
            may_capture = (self.capture and key in self._warm and start > 0
                           and key not in self.fallback and capturable(key))
            layout = store.step_layout() if may_capture else None
            progs = self.programs.setdefault(key, OrderedDict())
            if layout is not None and layout not in progs:
                self._try_capture(key, layout, inp, last_only)
            program = progs.get(layout)
            if program is None:
                store.issue_forward()
                with warming(self.counts, self.compile and key not in self._warm):
                    out = self._call(key, inp, last_only)
                store.end_forward(ahead=ahead)
                self._warm.add(key)
                self.counts["eager_steps"] += 1
            else:
                out = self._replay(progs, layout, program, rows, state)
        except BaseException as e:
            store.end_forward(ok=False)
            if state is not None:
                state.n_tokens = n_tokens
            if not isinstance(e, TraceFailed):
                raise
            return self._keyed(key, ids, start, n, ahead, hidden)   # now the eager model
        if pad and kind.startswith("verify"):     # the padding rows fed the recurrence
            state.rollback(n)
        return out

    def _call(self, key, inp: StaticInput, last_only: bool) -> torch.Tensor:
        """The program's function over its static input: the traced forward, or the model
        itself (no compile, or its trace failed)."""
        kind, rows = key
        if kind == "mtp":     # eager inside its program (its positions checked: the store's)
            return self.model.mtp_forward(inp.tokens, inp.hidden, inp.positions, self.store,
                                          return_hidden=True, last_only=True)
        if self.state is not None:            # host bookkeeping a trace cannot hold
            self.state.begin(self._start, rows)
        kw = self._model_kw(kind.endswith("+hidden"), kind.startswith("verify"))
        if self.compile and self.trace_error is None:
            if self._traced is None:
                self._traced = trace_forward(self.model, self.store)
            try:
                return self._traced(inp.tokens, inp.positions, self.store,
                                    last_only=last_only, **kw)
            except Exception as e:
                # Not strict, the first traced step of a key that fails (dynamo cannot trace
                # the model, a pass refuses it) warns, and the step and every later one run
                # the eager model instead (still captured).
                if self.strict or isinstance(e, ProgramError) or key in self._warm:
                    raise
                self.trace_error = f"{type(e).__name__}: {e}"
                warnings.warn(f"tracing the model's step failed ({self.trace_error}); the "
                              f"eager model runs in its programs instead", RuntimeWarning,
                              stacklevel=2)
                raise TraceFailed() from e
        return self.model(inp.tokens, inp.positions, self.store, last_only=last_only, **kw)

    def _eager(self, ids, start: int, n: int, all_rows: bool, hidden: bool,
               checkpoints: bool, ahead: bool):
        tokens, positions = self._tensors(ids, start, n)
        kw = self._model_kw(hidden, checkpoints)

        def forward():
            if self.state is not None:
                self.state.begin(start, n)
            return self.model(tokens, positions, self.store, last_only=not all_rows, **kw)
        return self._bracketed(positions, start, n, self.trunk, ahead, forward)

    def _model_kw(self, hidden: bool, checkpoints: bool) -> dict:
        """The model's keywords for a step (a hybrid's state.begin is the executor's)."""
        return {k: True for k, on in (("return_hidden", hidden), ("checkpoints", checkpoints),
                                      ("state_begun", self.state is not None)) if on}

    def _bracketed(self, positions, start: int, n: int, layers, ahead: bool, forward):
        """forward() inside the store's bracket: its rows become history when it returns."""
        store, state = self.store, self.state
        n_tokens = state.n_tokens if state is not None else None
        store.open_forward(positions, start, start + n - 1, layers)
        try:
            store.issue_forward()
            out = forward()
        except BaseException:
            store.end_forward(ok=False)
            if state is not None:
                state.n_tokens = n_tokens
            raise
        store.end_forward(ahead=ahead)
        return out

    def _tensors(self, ids, start: int, n: int):
        tokens = (ids.reshape(-1).to(self.device, torch.long) if isinstance(ids, torch.Tensor)
                  else torch.tensor(ids, dtype=torch.long, device=self.device))
        return tokens, torch.arange(start, start + n, dtype=torch.long, device=self.device)

    def _on_stream(self, fn):
        """fn() on the executor's stream, the caller's stream ordered after it (CUDA)."""
        if not self.cuda:
            with torch.inference_mode():
                return fn()
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        try:
            with torch.cuda.stream(self.stream), torch.inference_mode():
                out = fn()
        finally:                      # (a failed step's queued work too, before the caller
            cur.wait_stream(self.stream)   # resets or restores state on its stream)
        for t in (out if isinstance(out, tuple) else (out,)):
            if isinstance(t, torch.Tensor):
                t.record_stream(cur)
        return out

    # ---- capture and replay ------------------------------------------------------------------
    def _try_capture(self, key, layout, inp: StaticInput, last_only: bool) -> None:
        """Capture the layout's program (a warm-up: the step's prepare time restarts)."""
        try:
            with warming(self.counts):
                self._capture(key, layout, inp, last_only)
        except Exception as e:
            if self.compile and "fail_on_recompile" in str(e):
                # the traced forward must be traced again (another program of this model
                # class reset its code): not inside a capture. This step runs uncaptured,
                # which retraces; the next one captures.
                self.counts["retraces"] += 1
                self._warm.discard(key)
                return
            if self.strict:
                raise
            self.fallback[key] = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture of {key} failed ({self.fallback[key]}); its "
                          f"steps run uncaptured from now on", RuntimeWarning, stacklevel=4)
        finally:
            self._t_begin = time.perf_counter()

    def _capture(self, key, layout, inp: StaticInput, last_only: bool) -> None:
        progs = self.programs[key]
        while len(progs) >= self.max_layouts:
            progs.popitem(last=False)
        store = self.store
        call = weakref.WeakMethod(self._call)     # a CPU rerun keeps work: no cycle

        def work():
            store.issue_forward(layout)
            out = call()(key, inp, last_only)
            store.end_issue()
            return out
        progs[layout] = capture_program(work, self.device, self._graph_pool, store,
                                        self.state, self._no_tracing)
        self.counts["captures"] += 1

    def _no_tracing(self):
        """While capturing, the traced forward may only run its graph: dynamo tracing
        makes calls a capture forbids (it saves the CUDA RNG state)."""
        if self._traced is None or self.trace_error is not None:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("fail_on_recompile")

    def _replay(self, progs: OrderedDict, layout, program: Program, rows: int, state):
        progs.move_to_end(layout)             # the most recently used
        if self.cuda:
            if state is not None:             # host bookkeeping the capture skipped
                state.begin(self._start, rows)
            self.store.join_copies()          # the graph's fills assume an idle copy side
        t = time.perf_counter()
        self.counts["prepare_s"] += t - self._t_begin
        program.graph.replay()                # on the CPU: reruns the step's code
        t2 = time.perf_counter()
        self.counts["launch_s"] += t2 - t
        self.store.end_replayed(program.moved, program.filled)
        self.counts["replays"] += 1
        self.counts["close_s"] += time.perf_counter() - t2
        return program.output

    # ---- requests ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _host_time(self):
        """Count the body's host seconds as one step's (until its work is queued)."""
        t = time.perf_counter()
        yield
        self.host_s.append(time.perf_counter() - t)
        if self.trace and self.store.telemetry:
            print(f"[kv step] {self.store.telemetry[-1].as_dict()}", file=sys.stderr)

    def begin_request(self, n_tokens: int | None = None) -> None:
        """A request that will grow the sequence to n_tokens (prompt + max new tokens): a
        streamed store plans its split for it; the counters restart. The store keeps its
        history (the engine resumes or resets it: kv/prefix.py)."""
        if n_tokens is not None:
            self.store.plan(n_tokens)
        self.host_s = []
        self._base = self.program_stats()

    def program_stats(self) -> dict:
        out = dict(self.counts, programs=sum(len(p) for p in self.programs.values()),
                   compiled=self.compile and self.trace_error is None)
        if self.trace_error:
            out["trace_error"] = self.trace_error
        if self.fallback:
            out["fallback"] = "; ".join(f"{k}: {v}" for k, v in self.fallback.items())
        return out

    def request_stats(self) -> dict:
        """The program stats with every event counter as this request's count (`total_*`:
        since the executor was built), so a request that captured nothing shows captures 0."""
        now = self.program_stats()
        out = dict(now)
        for k in COUNTERS:
            out[k] = now[k] - self._base.get(k, 0)
            out[f"total_{k}"] = now[k]
        return out
