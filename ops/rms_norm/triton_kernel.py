"""Triton rms_norm with an optional residual add in front: one program a row, fp32 math.

Why one kernel: in a decode step every norm was three kernels (cast up, norm, cast down)
plus the residual add before it, each a launch for a few KB of data.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.ops.cast import TL_DTYPES, round_to
from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers


@triton.jit
def _rms_norm(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, n, eps, HAS_RESIDUAL: tl.constexpr,
              BLOCK: tl.constexpr, DTYPE: tl.constexpr, EXACT: tl.constexpr,
              PDL: tl.constexpr):
    c = tl.arange(0, BLOCK)
    m = c < n
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)   # constant: before the wait
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * n
    x = tl.load(x_ptr + row + c, mask=m, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # x + residual rounded once to the model dtype, as torch's add rounds it
        r = tl.load(r_ptr + row + c, mask=m, other=0.0).to(tl.float32)
        s = round_to(x + r, DTYPE, EXACT)
        tl.store(s_ptr + row + c, s, mask=m)
        x = s.to(tl.float32)
    # to fp32 before the root: inductor hands a float argument over as an fp64 constant;
    # correctly rounded root and division (once a row), as torch's norm computes them
    ms = (tl.sum(x * x, 0) / n + eps).to(tl.float32)
    inv = tl.math.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.math.sqrt_rn(ms))
    tl.store(y_ptr + row + c, round_to(x * inv * w, DTYPE, EXACT), mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(s, y) as rms_norm_naive, s None without a residual (never an alias of x); x (and
    residual) are made dense rows first."""
    n = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    s = None if residual is None else torch.empty_like(x)
    r = x if residual is None else residual.contiguous()
    rows = x.numel() // n if n else 0
    if rows:
        block = triton.next_power_of_2(n)
        launchable(_rms_norm)[(rows,)](
            x, r, weight.contiguous(), y if s is None else s, y, n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, DTYPE=TL_DTYPES[x.dtype],
            EXACT=not interpreting(), num_warps=max(1, min(16, block // 512)),
            **pdl_launch(x.device))
    return s, y
