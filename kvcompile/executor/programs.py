"""A program: one step shape's device work, captured as a CUDA graph (or, on the CPU, kept to
be rerun), with the static input it reads.

A step writes its tokens and positions into the static input of its row count in place
(through a pinned staging buffer and a non-blocking copy: no host synchronisation); page
tables are updated in place by the store; the graph replays against the addresses it
captured. A program is keyed by its trace key (kind, rows) and the store's layout it was
captured in, so a program of another layout is never replayed (executor.py).

Kinds: "step" (decode), "verify" (a hybrid's, recording what rolls its recurrent state back),
each also as "+hidden" (the rows' final hidden states returned too: an MTP drafter's input),
"mtp" (the MTP layer's draft step, its hidden input static too) and "prefill" (full chunks
over an all-resident store of an attention-only model).
"""
from __future__ import annotations

import contextlib
import time

import torch


BUCKETS = (1, 2, 4, 8)      # rows of the captured programs (decode, verify, MTP)
# rows of wide verify steps (an ngram round's long drafts): the traced program, never
# captured (their outputs would hold memory a budget needs for the arena)
WIDE = (16, 32, 64)
VERIFY_WIDTHS = BUCKETS + WIDE
COUNTERS = ("captures", "replays", "eager_steps", "retraces", "warmup_s", "prepare_s",
            "launch_s", "close_s")      # the executor's program events


class TraceFailed(Exception):
    """The first traced step of a key failed: the step runs again with the eager model."""


def bucket_for(rows: int, widths: tuple = BUCKETS) -> int:
    return next(b for b in widths if rows <= b)


def trace_key(rows: int, *, all_rows: bool, hidden: bool, checkpoints: bool,
              hybrid: bool, prefill: bool):
    """The program a trunk step of `rows` rows runs, (kind, padded rows), or None (the
    eager model). prefill: a full chunk may run the prefill program."""
    widths = VERIFY_WIDTHS if all_rows and not hidden else BUCKETS
    if rows <= widths[-1] and (all_rows or not hidden):
        kind = ("verify" if checkpoints else
                "step" if rows == 1 or not hybrid else None)
        if kind is not None:
            return (kind + "+hidden" if hidden else kind), bucket_for(rows, widths)
    if prefill and not all_rows and not hidden:
        return "prefill", rows
    return None


def capturable(key) -> bool:
    """A program of this trace key may be captured: all but the wide verify steps."""
    kind, rows = key
    return kind == "prefill" or rows <= BUCKETS[-1]


def verify_width(rows: int) -> int:
    """The rows a verify step of `rows` rows computes (and a hybrid's records for its
    rollback): its program's padded width, or the rows themselves past the widest."""
    return bucket_for(rows, VERIFY_WIDTHS) if rows <= VERIFY_WIDTHS[-1] else rows


@contextlib.contextmanager
def warming(owner: dict, counts: bool = True):
    """Add the body's host seconds to owner["warmup_s"] (a trace, a capture: the warm-up a
    request reports apart); counts=False times nothing."""
    t = time.perf_counter()
    try:
        yield
    finally:
        if counts:
            owner["warmup_s"] += time.perf_counter() - t


class StaticInput:
    """A step's tokens and positions at fixed device addresses (`tokens`, `positions`),
    filled through a pinned staging buffer with a non-blocking copy: no host sync; an MTP
    step's hidden rows too (`hidden`, copied from the device)."""

    def __init__(self, rows: int, device, hidden: torch.Tensor | None = None):
        cuda = torch.device(device).type == "cuda"
        self._static = torch.zeros(2, rows, dtype=torch.long, device=device)
        # on the CPU the static buffer is host memory already: no staging, no copy
        self._host = torch.zeros(2, rows, dtype=torch.long, device="cpu",
                                 pin_memory=True) if cuda else \
            self._static
        self._host_np = self._host.numpy()     # writes from Python ints without tensor ops
        self._staged = torch.cuda.Event() if cuda else None
        self.tokens, self.positions = self._static[0], self._static[1]
        self.hidden = (None if hidden is None else
                       torch.zeros(rows, hidden.shape[-1], dtype=hidden.dtype, device=device))

    def load(self, tokens, positions, hidden: torch.Tensor | None = None) -> None:
        """tokens: host ints, or a tensor already on the device (a token picked there, see
        engine/tokens.py): copied device to device after the staged positions. hidden:
        [n, hidden] rows (n <= rows), the last repeated over the padding rows."""
        if self._staged is not None and not self._staged.query():
            self._staged.synchronize()   # the last copy must have read the staging buffer
            # (rarely taken: the step before this one's has run by the time its successor loads)
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            self._host_np[0] = tokens
        self._host_np[1] = positions
        if self._staged is not None:
            self._static.copy_(self._host, non_blocking=True)
            self._staged.record()
        if on_device:
            self.tokens.copy_(tokens.reshape(-1), non_blocking=True)
        if hidden is not None:
            n = hidden.shape[0]
            self.hidden[:n].copy_(hidden)
            self.hidden[n:].copy_(hidden[-1:].expand(self.hidden.shape[0] - n, -1))


class Rerun:
    """The CPU's stand-in for a CUDA graph: replay() runs the captured step again."""

    def __init__(self, fn):
        self.fn, self.out = fn, None

    def replay(self) -> None:
        self.out = self.fn()


class Program:
    """One layout's captured step: the graph (or the CPU's rerun), its output buffer, the
    bytes a replay copies (h2d, d2h) and what a replay fills ahead for the next step (a
    streamed store's record, or None)."""

    def __init__(self, graph, out, moved, filled=None):
        self.graph, self.out, self.moved, self.filled = graph, out, moved, filled

    @property
    def output(self):
        """What the last replay computed (the capture's output buffer on CUDA)."""
        return self.out if self.out is not None else self.graph.out
