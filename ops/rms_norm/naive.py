"""fp32 torch reference of rms_norm / add_rms_norm (also the CPU implementation)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = x + residual rounded to x's dtype (x itself without a residual);
    y = s * rsqrt(mean(s^2) + eps) * weight over the last dim, in fp32, rounded to x's dtype."""
    s = x if residual is None else x + residual
    y = F.rms_norm(s.float(), (s.shape[-1],), weight.float(), eps).to(x.dtype)
    return s, y
