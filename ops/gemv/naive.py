"""fp32 torch reference of gemv (also its CPU implementation)."""
from __future__ import annotations

import torch

from kvcompile.ops.silu_mul.naive import silu_mul_naive


def gemv_naive(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) in fp32, one rounding to x's dtype; with
    silu_mul, then silu(first half) * second half (silu_mul_naive) -> [M, N / 2]."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return silu_mul_naive(y) if silu_mul else y
