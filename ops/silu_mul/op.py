"""torch.ops.kvcompile.silu_mul: silu(gate) * up of a fused gate/up projection
gate_up [..., 2F] -> [..., F] (fp32 math, one rounding to the input dtype)."""
from __future__ import annotations

import torch

from kvcompile.errors import OpInputError
from kvcompile.ops.cast import TL_DTYPES
from kvcompile.ops.silu_mul.naive import silu_mul_naive
from kvcompile.ops.silu_mul.triton_kernel import silu_mul_triton


def check_silu_mul_args(gate_up):
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2 or gate_up.dtype not in TL_DTYPES:
        raise OpInputError(f"silu_mul needs gate_up [..., 2F] (gate, then up) in f32, f16 or "
                           f"bf16; got {tuple(gate_up.shape)} {gate_up.dtype}")


@torch.library.triton_op("kvcompile::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    check_silu_mul_args(gate_up)
    if gate_up.device.type == "cuda":
        return silu_mul_triton(gate_up)
    return silu_mul_naive(gate_up)   # plain torch ops
