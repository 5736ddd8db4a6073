"""The one place CUDA graphs are captured: a step's device work, with the store's copy
stream forked into the capture and joined back (on the CPU a program reruns the work)."""
from __future__ import annotations

import contextlib

import torch

from kvcompile.executor.programs import Program, Rerun


def capture_program(work, device: torch.device, pool, store, state, no_tracing) -> Program:
    """The program of `work()` (a step's device work in one layout of the store): a CUDA
    graph, or on the CPU its rerun. state: a hybrid's recurrent state, whose host count
    the capture's (never run) work must not move; no_tracing: makes the context in which
    the traced forward may only run its graph (entered only around a CUDA capture). On failure the store forgets the capture's
    placement and events, and the error propagates."""
    if device.type != "cuda":
        return Program(Rerun(work), None, (0, 0))
    n_tokens = state.n_tokens if state is not None else None
    store.prepare_capture()
    try:
        with no_tracing():
            graph, out, moved = capture_step(work, device, pool, store)
    except BaseException:
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize(device)
        store.abandon_capture()
        raise
    finally:
        if state is not None:          # the capture's state.begin() did not happen
            state.n_tokens = n_tokens
    return Program(graph, out, moved, store.captured())


def capture_step(work, device: torch.device, pool, store):
    """(graph, output, (h2d, d2h) bytes a replay copies) of `work()` captured on the
    current stream into the memory pool `pool`; the store's copy stream (a streamed store)
    is forked into the capture and joined back. On failure the allocator and the copy
    stream are back to normal and the error propagates."""
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
        store.begin_capture()
        out = work()
        moved = store.end_capture()
    except BaseException:
        # the first error is the one told; the copy stream joins back first, or
        # capture_end fails before it gives the allocator back its normal mode
        for end in (store.end_capture, graph.capture_end):
            with contextlib.suppress(Exception):
                end()
        raise
    graph.capture_end()
    return graph, out, moved
