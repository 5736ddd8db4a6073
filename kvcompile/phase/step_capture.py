"""One step's device work captured as a CUDA graph (or, on the CPU, kept to be rerun)."""
from __future__ import annotations

import contextlib

import torch


class Rerun:
    """The CPU's stand-in for a CUDA graph: replay() runs the captured step again."""

    def __init__(self, fn):
        self.fn, self.out = fn, None

    def replay(self) -> None:
        self.out = self.fn()


class Program:
    """One layout's captured step: the graph (or the CPU's rerun), its output buffer, the
    bytes a replay copies (h2d, d2h) and what a replay fills ahead for the next step (a
    streaming cache's record, or None)."""

    def __init__(self, graph, out, moved, filled=None):
        self.graph, self.out, self.moved, self.filled = graph, out, moved, filled


def capture_step(work, device: torch.device, pool, engine=None):
    """(graph, output, (h2d, d2h) bytes a replay copies) of `work()` captured on the
    current stream into the memory pool `pool`; `engine`: a streaming cache's copy engine,
    whose side stream is forked into the capture and joined back. On failure the allocator
    and the copy stream are back to normal and the error propagates."""
    torch.cuda.synchronize(device)
    # Blocks cached by the caching allocator go back first: under a device-memory budget
    # (a per-process cap) the capture's pool must grow without freeing memory
    # mid-capture. (No gc.collect as torch.cuda.graph does: in a large process it can
    # take longer than the capture, and a capture comes every 256 tokens.)
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (a server's) do not break it
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        if engine is not None:
            engine.begin_capture()
        out = work()
        moved = engine.end_capture() if engine is not None else (0, 0)
    except BaseException:
        # the first error is the one told; the copy stream joins back first, or
        # capture_end fails before it gives the allocator back its normal mode
        for end in ((engine.end_capture,) if engine is not None else ()) + (graph.capture_end,):
            with contextlib.suppress(Exception):
                end()
        raise
    graph.capture_end()
    return graph, out, moved
