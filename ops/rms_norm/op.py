"""torch.ops.kvcompile.rms_norm and add_rms_norm: RMS norm over the last dim (fp32 math,
output in x's dtype), add_rms_norm with the residual add fused in front.

x, residual: [..., n] float tensors of one dtype; weight [n] (any float dtype). On a GPU
with PDL (ops/pdl.py) the kernel reads `weight` before waiting for the kernel launched just
before it: a weight must be a parameter, not something that kernel computes.
"""
from __future__ import annotations

import torch

from kvcompile.errors import OpInputError
from kvcompile.ops.cast import TL_DTYPES
from kvcompile.ops.rms_norm.naive import rms_norm_naive
from kvcompile.ops.rms_norm.triton_kernel import rms_norm_triton


def check_rms_norm_args(x, weight, residual=None):
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise OpInputError(f"rms_norm needs x [..., n] and weight [n]; got x "
                             f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    if x.dtype not in TL_DTYPES:
        raise OpInputError(f"rms_norm runs on f32, f16 or bf16 rows; got {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise OpInputError(f"the residual must match x; got {tuple(residual.shape)} "
                             f"{residual.dtype} vs {tuple(x.shape)} {x.dtype}")


# triton_op: torch.compile sees the kernel on CUDA; elsewhere the body is the reference
# (plain torch ops; the models call it directly there, through ops/rows.py).
@torch.library.triton_op("kvcompile::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    if x.device.type == "cuda":
        return rms_norm_triton(x, weight, eps)[1]
    return rms_norm_naive(x, weight, eps)[1]


@torch.library.triton_op("kvcompile::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) with one rounding of the sum."""
    check_rms_norm_args(x, weight, residual)
    if x.device.type == "cuda":
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_naive(x, weight, eps, residual)
