"""Triton silu_mul: the SwiGLU activation of the fused gate/up GEMM's output in one kernel
(was: silu, then the multiply, each rounding to the model dtype)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.ops.cast import TL_DTYPES, round_to
from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers

BLOCK = 1024


@triton.jit
def _silu_mul(x_ptr, out_ptr, f, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
              EXACT: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < f
    g = tl.load(x_ptr + row * 2 * f + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * f + f + c, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * f + c, round_to(y, DTYPE, EXACT), mask=m)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    x = gate_up.contiguous()
    f = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], f), dtype=x.dtype, device=x.device)
    rows = out.numel() // f if f else 0
    if rows:
        launchable(_silu_mul)[(rows, triton.cdiv(f, BLOCK))](
            x, out, f, BLOCK=BLOCK, DTYPE=TL_DTYPES[x.dtype], EXACT=not interpreting(),
            num_warps=4, **pdl_launch(x.device))
    return out
