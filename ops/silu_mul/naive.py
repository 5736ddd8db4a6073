"""fp32 torch reference of silu_mul (also the CPU implementation)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_naive(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] (gate then up) -> silu(gate) * up [..., F], fp32 math, one rounding."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)
