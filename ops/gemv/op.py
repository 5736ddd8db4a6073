"""torch.ops.kvcompile.gemv: y = x @ weight^T (+ bias) for the few rows of a decode step.

x [M, K] with M <= GEMV_MAX_ROWS, f16 or bf16, last dim dense; weight [N, K] and bias [N]
of x's dtype (with PDL the kernel starts reading `weight` before the kernel launched just
before it has finished: weights are parameters, never that kernel's output; ops/pdl.py).
fp32 accumulation, one rounding to x's dtype. Wider inputs and fp32 stay with
F.linear (ops/rows.linear picks).
silu_mul=True: weight is a fused [gate; up] projection (N even) and the result is
silu(gate) * up [M, N / 2] of the rounded halves, as ops/silu_mul computes it: each program
pairs gate row i with up row N / 2 + i, so the product never makes a round trip to memory.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcompile.errors import OpInputError
from kvcompile.ops.gemv.naive import gemv_naive
from kvcompile.ops.gemv.triton_kernel import gemv_triton

GEMV_MAX_ROWS = 8
GEMV_DTYPES = (torch.float16, torch.bfloat16)


def check_gemv_args(x, weight, bias, silu_mul=False):
    problems = []
    if silu_mul and weight.dim() == 2 and weight.shape[0] % 2:
        problems.append(f"an even number of weight rows (gate then up) with silu_mul; got "
                        f"{weight.shape[0]}")
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
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         silu_mul: bool = False) -> torch.Tensor:
    check_gemv_args(x, weight, bias, silu_mul)
    if x.device.type == "cuda":
        x = x if x.stride(1) == 1 else x.contiguous()
        return gemv_triton(x, weight.contiguous(), None if bias is None else bias.contiguous(),
                           silu_mul=silu_mul)
    return gemv_naive(x, weight, bias, silu_mul)
