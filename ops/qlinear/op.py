"""torch.ops.kvcompile.qlinear / qembedding: activations times GGUF block-format weights.

qlinear(x, weight, qtype, k, bias=None, silu_mul=False): y = x @ dequant(weight)^T (+ bias)
  x [M, K] f16 / bf16 on CUDA (any float dtype on the CPU: the fp32 reference); weight the
  planar rows uint8 [N, planar_row_bytes(K)] of ggml type `qtype` (formats.py); bias [N] of
  x's dtype. One row: a CUDA-core GEMV; 2..8 rows: tensor-core GEMV; 9..63: a Triton GEMM,
  each weight tile dequantized in registers; 64 and more (prefill ubatches): the weight
  dequantized to x's dtype in row chunks, then cuBLAS (triton_kernel.qlinear_dense). fp32
  accumulation, one rounding to x's dtype. silu_mul=True (up to 8 rows): weight is a fused
  [gate; up] projection and the result is silu(gate) * up [M, N / 2], as ops/gemv
  computes it.
  With PDL (ops/pdl.py) the GEMVs wait before their first load. On the CPU, fp32
  activations and a type of cpu_kernel.CPU_FORMATS run the C++ kernel (cpu_kernel.py),
  anything else the fp32 reference.
qembedding(weight, qtype, k, tokens, dtype): rows `tokens` of the weight dequantized,
  [T, K] in `dtype` (a quantized token embedding).
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcompile.errors import OpInputError
from kvcompile.ops.qlinear.cpu_kernel import cpu_qlinear_fits, qlinear_cpu
from kvcompile.ops.qlinear.formats import weight_format
from kvcompile.ops.qlinear.naive import dequantize_rows, qlinear_naive
from kvcompile.ops.qlinear.triton_kernel import dequant_rows_triton, qlinear_triton
from kvcompile.ops.silu_mul.naive import silu_mul_naive

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
SILU_MAX_ROWS = 8


def check_qlinear_args(x, weight, qtype, k, bias, silu_mul) -> str:
    """The type's name; OpInputError naming every problem otherwise."""
    problems = []
    fmt = weight_format(qtype)
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        problems.append(f"weight as planar uint8 rows [N, bytes]; got {weight.dtype} "
                        f"{tuple(weight.shape)}")
    elif k <= 0 or k % fmt.block or weight.shape[1] != fmt.planar_row_bytes(k):
        want = fmt.planar_row_bytes(k) if k > 0 and k % fmt.block == 0 else "?"
        problems.append(f"rows of {want} bytes for K={k} values of {fmt.name} (K a multiple of "
                        f"{fmt.block}); got rows of {weight.shape[1]} bytes")
    if x.dim() != 2 or x.shape[-1] != k:
        problems.append(f"x [M, {k}]; got {tuple(x.shape)}")
    if not x.is_floating_point() or (x.is_cuda and x.dtype not in KERNEL_DTYPES):
        problems.append(f"x f16 or bf16 on CUDA (any float on the CPU); got {x.dtype}")
    if x.device != weight.device:
        problems.append(f"x and weight on one device; got {x.device} and {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        problems.append(f"bias [{weight.shape[0]}] of x's dtype; got {tuple(bias.shape)} "
                        f"{bias.dtype}")
    if silu_mul and (weight.shape[0] % 2 or x.shape[0] > SILU_MAX_ROWS):
        problems.append(f"with silu_mul an even number of weight rows (gate then up) and at "
                        f"most {SILU_MAX_ROWS} rows of x; got {weight.shape[0]} and {x.shape[0]}")
    if problems:
        raise OpInputError("qlinear needs " + "; ".join(problems))
    return fmt.name


@torch.library.triton_op("kvcompile::qlinear", mutates_args=())
def qlinear(x: torch.Tensor, weight: torch.Tensor, qtype: int, k: int,
            bias: Optional[torch.Tensor] = None, silu_mul: bool = False) -> torch.Tensor:
    name = check_qlinear_args(x, weight, qtype, k, bias, silu_mul)
    if x.device.type == "cuda":
        x = x if x.stride(1) == 1 else x.contiguous()
        return qlinear_triton(x, weight, name, k, bias, silu_mul=silu_mul)
    if cpu_qlinear_fits(x, qtype):
        y = qlinear_cpu(x, weight, qtype, k, bias)
    else:
        y = qlinear_naive(x, weight, name, k, bias)
    return silu_mul_naive(y) if silu_mul else y


@torch.library.triton_op("kvcompile::qembedding", mutates_args=())
def qembedding(weight: torch.Tensor, qtype: int, k: int, tokens: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    name = weight_format(qtype).name
    if tokens.dtype not in (torch.int32, torch.int64) or tokens.device != weight.device:
        raise OpInputError(f"qembedding needs integer tokens on the weight's device; got "
                           f"{tokens.dtype} on {tokens.device}")
    flat = tokens.reshape(-1)
    if weight.device.type == "cuda" and dtype in KERNEL_DTYPES + (torch.float32,):
        out = dequant_rows_triton(weight, name, k, flat, dtype)
    else:
        out = dequantize_rows(weight, flat, name, k).to(dtype)
    return out.view(*tokens.shape, k)
