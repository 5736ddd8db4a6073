"""A program: one step shape's device work, captured as a CUDA graph (or, on the CPU, kept to
be rerun), with the static input it reads.

A step writes its tokens and positions into the static input of its row count in place
(through a pinned staging buffer and a non-blocking copy: no host synchronisation); page
tables are updated in place by the store; the graph replays against the addresses it
captured. A program is keyed by its trace key (kind, rows) and the store's layout it was
captured in, so a program of another layout is never replayed (executor.py).
"""
from __future__ import annotations

import contextlib
import time

import torch


BUCKETS = (1, 2, 4, 8)      # rows of the decode / verify programs


def bucket_for(rows: int) -> int:
    return next(b for b in BUCKETS if rows <= b)


def checkpoint_rows_for(rows: int) -> int:
    """Checkpoint rows a hybrid's verify step of `rows` rows records: its program's padded
    width, or the rows themselves past the widest program."""
    return bucket_for(rows) if rows <= BUCKETS[-1] else rows


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
    filled through a pinned staging buffer with a non-blocking copy: no host sync."""

    def __init__(self, rows: int, device):
        cuda = torch.device(device).type == "cuda"
        self._static = torch.zeros(2, rows, dtype=torch.long, device=device)
        # on the CPU the static buffer is host memory already: no staging, no copy
        self._host = torch.zeros(2, rows, dtype=torch.long, pin_memory=True) if cuda else \
            self._static
        self._host_np = self._host.numpy()     # writes from Python ints without tensor ops
        self._staged = torch.cuda.Event() if cuda else None
        self.tokens, self.positions = self._static[0], self._static[1]

    def load(self, tokens, positions) -> None:
        """tokens: host ints, or a tensor already on the device (a token picked there, see
        engine/tokens.py): copied device to device after the staged positions."""
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
