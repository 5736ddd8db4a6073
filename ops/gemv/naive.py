"""fp32 torch reference of gemv (also its CPU implementation)."""
from __future__ import annotations

import torch


def gemv_naive(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) in fp32, one rounding to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
