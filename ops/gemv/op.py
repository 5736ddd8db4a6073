"""torch.ops.kvcompile.gemv: y = x @ weight^T (+ bias) for the few rows of a decode step,
and torch.ops.kvcompile.rms_norm_gemv: the same of rms_norm(x + residual) for one row, the
norm computed inside the GEMV (one kernel where a decode step had two).

x [M, K] with M <= GEMV_MAX_ROWS (1 for rms_norm_gemv), f16 or bf16, last dim dense;
weight [N, K] and bias [N] of x's dtype. fp32 accumulation, one rounding to x's dtype.
Wider inputs and fp32 stay with F.linear (ops/rows.linear, ops/rows.norm_linear pick).
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcompile.errors import OpInputError
from kvcompile.ops.gemv.naive import gemv_naive
from kvcompile.ops.gemv.triton_kernel import gemv_triton, norm_gemv_triton
from kvcompile.ops.rms_norm.naive import rms_norm_naive
from kvcompile.ops.rms_norm.op import check_rms_norm_args

GEMV_MAX_ROWS = 8
GEMV_DTYPES = (torch.float16, torch.bfloat16)


def check_gemv_args(x, weight, bias):
    problems = []
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        problems.append(f"x [M, K] and weight [N, K]; got x {tuple(x.shape)} and weight "
                        f"{tuple(weight.shape)}")
    elif x.shape[0] > GEMV_MAX_ROWS:
        problems.append(f"at most {GEMV_MAX_ROWS} rows (F.linear for more); got {x.shape[0]}")
    if x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype:
        problems.append(f"x and weight both f16 or both bf16; got {x.dtype} and {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        problems.append(f"bias [{weight.shape[0]}] of x's dtype; got {tuple(bias.shape)} "
                        f"{bias.dtype}")
    if problems:
        raise OpInputError("gemv needs " + "; ".join(problems))


# triton_op: torch.compile sees the kernel on CUDA; elsewhere the body is the reference.
@torch.library.triton_op("kvcompile::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
         ) -> torch.Tensor:
    check_gemv_args(x, weight, bias)
    if x.device.type == "cuda":
        x = x if x.stride(1) == 1 else x.contiguous()
        return gemv_triton(x, weight.contiguous(), bias)
    return gemv_naive(x, weight, bias)


@torch.library.triton_op("kvcompile::rms_norm_gemv", mutates_args=())
def rms_norm_gemv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = x + residual rounded to x's dtype (a copy of x without a residual), y =
    rms_norm(s) * norm_weight (rounded to x's dtype) @ weight^T + bias. One row."""
    check_rms_norm_args(x, norm_weight, residual)
    check_gemv_args(x, weight, bias)
    if x.shape[0] != 1:
        raise OpInputError(f"rms_norm_gemv takes one row (decode); got {x.shape[0]}: use "
                           f"rms_norm, then gemv")
    if x.device.type == "cuda":
        return norm_gemv_triton(x.contiguous(), residual, norm_weight, eps, weight.contiguous(),
                                bias)
    s, h = rms_norm_naive(x, norm_weight, eps, residual)
    return s.clone() if residual is None else s, gemv_naive(h, weight, bias)
