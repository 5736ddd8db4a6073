"""Programmatic dependent launch (PDL, Hopper and later) for the decode-step kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is
still running. It must not read anything an earlier kernel wrote until it passed
`wait_for_producers` (griddepcontrol.wait: the previous grid has completed and its writes
are visible); once all its programs passed that point it lets the next kernel launch
(`wait_for_producers_hold_next`: only once all its programs have exited, for the
transposed decode split and the blocks split over quantized K, whose reduce would otherwise
take SM slots beside them).
Reads of data no kernel writes may go before the wait: the GEMV's first weight tile, the
norm weight, the decode reduce's output rotation (parameters and cache buffers; the ops'
docstrings say so).

Why: a captured decode step is hundreds of short kernels (docs/findings.md, "The decode
step: host overhead and kernels"); without PDL each launch and ramp-up starts only after
the previous kernel drained.

Rules that keep it exact: a kernel is launched with PDL if and only if it calls
`wait_for_producers` (or `_hold_next`) before its first dependent read and before any
write (`launch` returns both switches together); kernels launched without it (torch's,
cuBLAS) wait for their predecessor as usual, so every chain of waits reaches back to
completed work.
KVCOMPILE_PDL=0 turns it off (read at import; `ENABLED` may be set by benchmarks).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvcompile.ops.launching import interpreting, traced
from kvcompile.ops import debug

ENABLED = debug.PDL


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Block until the previous kernel completed, then let the next one launch (no-op
    without PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def wait_for_producers_hold_next(PDL: tl.constexpr):
    """wait_for_producers without the early launch of the next kernel: it launches only
    once all of this one's programs have exited (and still waits for its completion). Used
    by the transposed decode split, whose reduce's programs, launched at once, sat on a few
    SMs beside the split's, and by the blocks split over quantized K. Chosen per kernel:
    the legacy split and the blocks split over bf16 K were slower with it, the blocks split
    over quantized K faster (docs/findings.md, "Decode attention kernels")."""
    if PDL:
        gdc_wait()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def untraced_on_hopper(device: torch.device) -> bool:
    """Whether a launch now is untraced, not interpreted, on a Hopper-or-later GPU: where
    PDL and TMA (span_attention.tma_codes) can go."""
    return (device.type == "cuda" and not interpreting() and not traced()
            and _capability(device.index if device.index is not None
                            else torch.cuda.current_device()) >= 9)


def launch(device: torch.device) -> dict:
    """Keywords for a launch of a kernel with a `PDL` constexpr: PDL on (with the launch
    attribute) on a Hopper-or-later GPU in an eager or captured launch, off elsewhere
    (CPU, the Triton interpreter, KVCOMPILE_PDL=0, and traced launches: ops/launching)."""
    on = ENABLED and untraced_on_hopper(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
