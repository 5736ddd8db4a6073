"""The step runner: one object that runs `step(ids, start)` for an Engine, whatever the
cache and the program mode.

A step is a prefill chunk (up to the ubatch) or a decode step (one row). Which machinery
runs it is decided once, when the runner is built, from the cache and `cuda_graphs`:

| cache, model | `cuda_graphs` | how a step runs |
| --- | --- | --- |
| any | off | eagerly: `runtime.forward` (the streaming bracket when the cache streams) |
| all resident, attention-only | on | phase programs (`phase/manager.py`): prefill and decode layouts of one arena, programs kept across requests |
| streamed, or hybrid | on | each decode step one CUDA graph per layout, ring copies and fences included (`phase/decode_graph.py`; on the CPU the same fixed-layout steps, rerun); a streamed attention-only model's verify steps too (padded to 2, 4 or 8 rows); prefill eagerly |

The runner counts what each step cost on the host (`host_s`: from the call until the step's
work is queued, before anything waits for the device) and the program events of the current
request (`begin_request` / `request_stats`), so the Engine reports them and benchmarks read
them from the same place.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

from kvcompile.errors import KvcompileError
from kvcompile.phase.programs import check_step_positions
from kvcompile.runtime import forward as run_forward
from kvcompile.runtime.make import make_sequence_cache  # noqa: F401  (the Engine's slot)
from kvcompile.runtime.bracket import forward_bracket

# programs a verify width keeps (its layout's two, and the last layout's while a verify
# step's padding reaches into the next page)
VERIFY_PROGRAMS = 4
# counters of the program stats that count events (reported per request as differences)
EVENT_COUNTERS = ("captures", "transitions", "invalidated", "revived", "replays", "eager_steps",
                  "retraces", "warmup_s", "prepare_s", "launch_s", "close_s")


class StepRunner:
    def __init__(self, model, cache, *, device: torch.device, ubatch: int,
                 cuda_graphs: bool = False, trace: bool = False):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.ubatch, self.trace = ubatch, trace
        # The KV layers a trunk forward acquires: a hybrid model's attention layers without
        # its MTP layer (only `mtp` steps read and write that one); None = every layer.
        self.plan = model.layer_plan
        self.trunk_layers = self.plan.trunk_kv_layers
        self.phases = self.decode_graph = None
        if cuda_graphs:
            if cache.streams or self.trunk_layers is not None:   # streamed, hybrid, MTP
                from kvcompile.phase.decode_graph import DecodeGraph
                # the step runs the traced forward (over a streaming cache, its ring ops
                # lowered to the page movement)
                self.decode_graph = DecodeGraph(model, cache, layers=self.trunk_layers,
                                                strict=False, compile=True)
                self.verify_graphs: dict = {}     # padded verify width -> DecodeGraph
            else:
                from kvcompile.phase import PhaseManager
                self.phases = PhaseManager(model, cache, ubatch=min(ubatch, cache.capacity))
        self.host_s: list[float] = []       # host seconds of each step of this request
        self._base: dict = {}
        self._planned: int | None = None    # tokens the request will reach

    @property
    def mode(self) -> str:
        if self.phases is not None:
            return "phase programs"
        if self.decode_graph is not None:
            return "decode graphs"
        return "eager"

    # ---- one step ----------------------------------------------------------------------
    def step(self, ids: list[int], start: int, all_rows: bool = False) -> torch.Tensor:
        """Run ids at positions start.. through the model; the logits of the last one, or
        of every row with all_rows (a verify step), on the device: reading them waits for
        the step. A program's output buffer is valid until its next step. ids: host ints,
        or a tensor on the device (a token picked there: no host round trip)."""
        n = len(ids)
        with self._host_time():
            graph = self._graph_for(n, start, all_rows)
            if self.phases is not None and (not all_rows or n <= self.phases.buckets[-1]):
                logits = self.phases.forward(ids, start)      # a decode program: every row
            elif graph is not None and graph.rows == n:
                logits = graph.step(ids, start)
            elif graph is not None:                           # a verify width, padded
                logits = graph.step(list(ids) + [ids[-1]] * (graph.rows - n), start)[:n]
                self.cache.truncate(start + n)    # the padding rows are not history
            else:
                logits = self._eager(ids, start, all_rows)
        logits = logits if all_rows else logits[-1]
        if self.trace and getattr(self.cache, "telemetry", None):
            print(f"[kv step] {self.cache.telemetry[-1].as_dict()}", file=sys.stderr)
        return logits

    def _graph_for(self, n: int, start: int, all_rows: bool):
        """The decode graph that runs n rows at start, or None (eager): one row, the decode
        graph; a verify step of 2-8 rows over a streaming cache, the program of the
        smallest bucket that holds it (phase/layouts.py; the padding rows' KV is written
        past the kept rows, where the next step writes before anything reads it), while
        the padded step stays inside the request's planned context (else its last page
        would force a new split). A hybrid model's verify steps record recurrent
        checkpoints and run eagerly (`verify`)."""
        graph = self.decode_graph
        if graph is None or n == 1:
            return graph
        if (not all_rows or not self.cache.streams or self.plan.recurrent
                or graph.fallback is not None):
            return None
        from kvcompile.phase.layouts import BUCKETS, bucket_for
        if n > BUCKETS[-1]:
            return None
        width = bucket_for(n)
        if self._planned is not None and start + width > self._planned:
            return None
        try:                              # the cache's capacity, the model's rope table
            check_step_positions(self.model, self.cache, start, width)
        except KvcompileError:
            return None
        verify = self.verify_graphs.get(width)
        if verify is None:
            from kvcompile.phase.decode_graph import DecodeGraph
            verify = self.verify_graphs[width] = DecodeGraph(
                self.model, self.cache, rows=width, layers=self.trunk_layers, strict=False,
                like=graph, max_programs=VERIFY_PROGRAMS)
        return None if verify.fallback is not None else verify

    @contextmanager
    def _host_time(self):
        """Count the body's host seconds as one step's (until its work is queued)."""
        t = time.perf_counter()
        yield
        self.host_s.append(time.perf_counter() - t)

    def _eager(self, ids: list[int], start: int, all_rows: bool, ahead: bool = True,
               **model_kw):
        if self.phases is not None:
            self.phases.enter("prefill")   # a wide eager step: the prefill layout
        tokens = (ids.to(self.device, torch.long) if isinstance(ids, torch.Tensor) else
                  torch.tensor(ids, dtype=torch.long, device=self.device))
        positions = torch.arange(start, start + len(ids), dtype=torch.long, device=self.device)
        return run_forward(self.model, self.cache, tokens, positions, last_only=not all_rows,
                           layers=self.trunk_layers, start=start, ahead=ahead, **model_kw)

    # ---- speculative steps ---------------------------------------------------------------
    @property
    def recurrent(self):
        """The recurrent state of a hybrid model's request slot, or None."""
        return self.model.recurrent_state(self.cache) if self.plan.recurrent else None

    def verify(self, ids: list[int], start: int, hidden: bool = False):
        """Every row's logits of ids at start.. (a speculative verify step), and with
        hidden=True the rows' final hidden states too (an MTP drafter's input): (logits,
        hidden or None). A hybrid model records its recurrent state after each row, so that
        `rollback` can undo the rows a rejected draft added."""
        state = self.recurrent
        if not hidden and (state is None or len(ids) == 1):
            return self.step(ids, start, all_rows=True), None
        model_kw = {"return_hidden": True} if hidden else {}
        if state is not None:
            state.reserve_rows(len(ids))
            model_kw["checkpoints"] = True
        with self._host_time():   # with hidden rows an MTP step comes next, not a decode step
            out = self._eager(ids, start, all_rows=True, ahead=not hidden, **model_kw)
        return out if hidden else (out, None)

    def step_hidden(self, ids: list[int], start: int):
        """A prefill chunk that also returns its rows' final hidden states (the MTP
        drafter's input): (logits of the last row, hidden [n, hidden])."""
        with self._host_time():
            logits, hidden = self._eager(ids, start, all_rows=False, ahead=False,
                                         return_hidden=True)
        return logits[-1], hidden

    def rollback(self, keep: int, rows: int, start: int) -> None:
        """Keep the first `keep` of the `rows` rows of the verify step at `start`: a hybrid
        model's recurrent state goes back to its checkpoint after row keep-1, and a streamed
        cache's host history forgets the rows after it (their device copies are rewritten by
        the next step before any row reads those positions)."""
        if keep >= rows:
            return
        state = self.recurrent
        if state is not None:
            state.rollback(keep)
        if self.cache.streams:
            self.cache.truncate(start + keep)

    def mtp(self, ids: list[int], hidden: torch.Tensor, start: int):
        """The model's MTP layer over rows at positions start..: row i pairs the trunk's
        hidden state at position start + i with the token after it, ids[i]. Returns (the
        last row's logits [1, vocab], the MTP layer's output hidden rows)."""
        layer = self.model.config.n_layers
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), dtype=torch.long, device=self.device)
        with self._host_time(), forward_bracket(self.cache, positions, (layer,), start,
                                                ahead=False):
            return self.model.mtp_forward(tokens, hidden, positions, self.cache,
                                          return_hidden=True, last_only=True)

    # ---- requests ----------------------------------------------------------------------
    def begin_request(self, n_tokens: int | None = None) -> None:
        """A new sequence that will grow to n_tokens (prompt + max new tokens): the cache
        forgets the old one (a streaming cache plans its split for n_tokens); counters
        restart."""
        self.cache.reset()
        self._planned = n_tokens
        if n_tokens is not None and self.cache.streams:
            self.cache.plan(n_tokens)
        self.host_s = []
        self._base = self.program_stats()

    def program_stats(self) -> dict:
        if self.phases is not None:
            return self.phases.stats()
        if self.decode_graph is not None:
            return _summed([self.decode_graph.stats()] +
                           [g.stats() for g in self.verify_graphs.values()])
        return {}

    def request_stats(self) -> dict:
        """The program stats with every event counter as this request's count (`total_*`:
        since the runner was built), so a request that captured nothing shows captures 0."""
        now = self.program_stats()
        out = dict(now)
        for k in EVENT_COUNTERS:
            if k in now:
                out[k] = now[k] - self._base.get(k, 0)
                out[f"total_{k}"] = now[k]
        return out


def _summed(stats: list[dict]) -> dict:
    """The decode graph's stats with the verify graphs' programs and events added in; a
    verify graph's own failure (`fallback`, `trace_error`) is reported when the decode
    graph has none."""
    out = dict(stats[0])
    for other in stats[1:]:
        for k, v in other.items():
            if k not in out:
                out[k] = v
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] += v
    return out
