"""Rounding helpers shared by the Triton kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# torch dtype -> Triton dtype of the row kernels' inputs and outputs
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def to_bf16(x, EXACT: tl.constexpr):
    """fp32 -> bf16, round to nearest even. EXACT=False (the interpreter, whose fp32 -> bf16
    cast truncates) rounds by hand on the bits."""
    if EXACT:
        return x.to(tl.bfloat16)  # cvt.rn
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EXACT: tl.constexpr):
    """fp32 x rounded to nearest even in DTYPE (fp32, fp16 or bf16)."""
    if DTYPE == tl.bfloat16:
        return to_bf16(x, EXACT)
    else:
        return x.to(DTYPE)
