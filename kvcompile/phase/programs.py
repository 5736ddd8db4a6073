"""A phase program: one forward shape (rows) run from static buffers, captured as a CUDA
graph on the device and run eagerly on the CPU (the same code path minus the capture).

A step writes its tokens and positions into the program's static input in place (through a
pinned staging buffer and a non-blocking copy: no host synchronisation), page tables are
updated in place by the cache, and the graph replays against the addresses it captured.
The program remembers the arena regions it was captured against; once a phase transition
replaced any of them (`arena.is_current`) or the manager invalidated it, running it raises
PhaseError instead of replaying kernels into memory that now belongs to something else.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from kvcompile.errors import ArenaError, PhaseError
from kvcompile.runtime.arena import MIB

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (tokens, positions) -> logits


def check_step_positions(model, cache, start: int, rows: int) -> None:
    """The range check a compiled or replayed step cannot make itself (reading positions
    back would synchronise): on Python ints, against the KV cache's capacity and the
    model's rope table."""
    from kvcompile.kv_cache import check_range
    from kvcompile.models.layers import check_rope_range
    hi = start + rows - 1
    check_range(start, hi, cache.capacity)
    rope = getattr(model, "rope_cos", None)
    if rope is not None:
        check_rope_range((start, hi), rope.shape[0])


@contextlib.contextmanager
def warming(owner, counts: bool = True):
    """Add the body's host seconds to `owner.warmup_s` (a trace, a capture: the warm-up a
    request reports apart); counts=False times nothing."""
    t = time.perf_counter()
    try:
        yield
    finally:
        if counts:
            owner.warmup_s += time.perf_counter() - t


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
        speculative/decode.py): copied device to device after the staged positions."""
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
            self.tokens.copy_(tokens, non_blocking=True)


class PhaseProgram:
    def __init__(self, name: str, fn: StepFn, rows: int, device: torch.device, arena,
                 bound: tuple, capture: bool, workspace_limit: int, estimate: int):
        self.name, self.fn, self.rows, self.device = name, fn, rows, torch.device(device)
        self.arena, self.bound = arena, tuple(bound)   # Regions whose addresses it uses
        self.capture = capture
        self.workspace_limit = workspace_limit         # bytes its activations may take
        self.estimate = estimate                       # what the CPU build charges
        self.valid = True
        self.parked = False
        self.graph = None
        self.out = None
        self.workspace = None                          # bytes measured at capture
        self.replays = 0
        self._input = StaticInput(rows, self.device)   # what the graph reads

    # ---- validity ------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Drop the graph (its memory pool goes back) and refuse every later run."""
        self.valid, self.parked, self.graph, self.out = False, False, None, None

    def park(self) -> None:
        """Its layout is being replaced: refuse to run until `revive` proves the addresses
        it captured are back (the graph and its memory pool are kept)."""
        self.parked = True

    def revive(self, regions: dict) -> bool:
        """Run again if every region it was captured against is placed at the same offset
        and size in `regions` (the arena's current map); False (still parked) otherwise."""
        if not self.valid:
            return False
        now = [regions.get(r.name) for r in self.bound]
        if any(n is None or (n.offset, n.size) != (r.offset, r.size)
               for n, r in zip(now, self.bound)):
            return False
        self.bound, self.parked = tuple(now), False
        return True

    def check_current(self) -> None:
        if self.parked:
            raise PhaseError(f"phase program {self.name} was parked by a phase transition: "
                             f"its layout is not the arena's current one; ask the phase "
                             f"manager for the current program")
        if not self.valid:
            raise PhaseError(f"phase program {self.name} was invalidated by a phase transition; "
                             f"ask the phase manager for the current program (it recaptures)")
        stale = [r.name for r in self.bound if not self.arena.is_current(r)]
        if stale:
            raise PhaseError(f"phase program {self.name} was captured against arena regions "
                             f"{stale} that a newer layout replaced; replaying it would run "
                             f"kernels on memory that now holds something else. Ask the phase "
                             f"manager for the current program (it recaptures lazily)")

    # ---- running --------------------------------------------------------------------------
    def run(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits of the step (valid until this program runs again). The first run builds the
        program: on CUDA it warms up (compiles, autotunes: the step's own KV writes, which are
        idempotent), captures, checks the measured workspace, then replays."""
        self.check_current()
        if len(tokens) != self.rows or len(positions) != self.rows:
            raise PhaseError(f"phase program {self.name} runs exactly {self.rows} rows, got "
                             f"{len(tokens)} tokens and {len(positions)} positions; a larger "
                             f"ubatch than the program's batch needs a program of that shape")
        self._input.load(tokens, positions)
        if self.graph is None and self.capture:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            if self.workspace is None:
                self._charge(self.estimate)
            self.out = self.fn(self._input.tokens, self._input.positions)
        self.replays += 1
        return self.out

    def _capture(self) -> None:
        dev = self.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):   # warm up on the capture stream (its cuBLAS workspace)
            for _ in range(2):
                self.fn(self._input.tokens, self._input.positions)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()     # under a budget's cap the graph pool grows without a free
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = self.fn(self._input.tokens, self._input.positions)
        torch.cuda.synchronize(dev)
        self._charge(torch.cuda.max_memory_allocated(dev) - base)
        self.graph, self.out = graph, out

    def _charge(self, nbytes: int) -> None:
        self.workspace = int(nbytes)
        if nbytes > self.workspace_limit:
            self.invalidate()
            raise ArenaError(
                f"phase program {self.name} needs {nbytes / MIB:.2f} MiB of workspace but its "
                f"layout reserves {self.workspace_limit / MIB:.2f} MiB; give the phase a larger "
                f"workspace (a larger arena) or run fewer rows (--ubatch-size)")
