"""The decoder's row ops as the models call them: the custom op (one Triton kernel) on CUDA,
the fp32 reference itself elsewhere, or on the CPU's fast path (`cpu`) its C++ kernels
(ops/*/cpu_kernel.py), called directly. `linear` picks the gemv op for decode rows on CUDA and
F.linear for everything else. Why: on the CPU the op's dispatch (a triton_op around
the reference's custom_op) costs more than the reference's work, a visible share of a
SmolLM2 decode step (docs/findings.md, "The CPU path"); the reference traces into plain aten
ops under torch.compile."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompile.ops.gemv.op import GEMV_DTYPES, GEMV_MAX_ROWS
from kvcompile.ops.kv_format import kv_type
from kvcompile.ops.kv_write.cpu_kernel import cpu_kv_write_fits, write_rows
from kvcompile.ops.qlinear.cpu_kernel import (CPU_IDS, cpu_qlinear_fits, dequantize_cpu,
                                              qlinear_rows)
from kvcompile.ops.qlinear.formats import weight_format
from kvcompile.ops.rms_norm.cpu_kernel import rms_norm_rows
from kvcompile.ops.rms_norm.naive import rms_norm_naive
from kvcompile.ops.rms_norm.op import check_rms_norm_args
from kvcompile.ops.rope_rotate.cpu_kernel import rope_rows
from kvcompile.ops.rope_rotate.naive import rope_rotate_naive
from kvcompile.ops.rope_rotate.op import check_rope_rotate_args
from kvcompile.ops.silu_mul.cpu_kernel import silu_mul_rows
from kvcompile.ops.silu_mul.naive import silu_mul_naive
from kvcompile.ops.silu_mul.op import check_silu_mul_args
from kvcompile.ops.span_attention.cpu_kernel import attention_rows, cpu_attention_fits


def _kernels(cpu: bool, *xs: torch.Tensor) -> bool:
    """Whether the CPU's C++ row kernels take the call: asked for (`cpu`: the module's
    flag, set on the fast path, models/layers.use_cpu_kernels), fp32 on the CPU, eager."""
    return (cpu and all(x.dtype == torch.float32 and not x.is_cuda for x in xs)
            and not torch.compiler.is_compiling())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             cpu: bool = False) -> torch.Tensor:
    if x.is_cuda:
        return torch.ops.kvcompile.rms_norm(x, weight, eps)
    check_rms_norm_args(x, weight)
    if _kernels(cpu, x, weight):
        return rms_norm_rows(x, weight, eps)[1]
    return rms_norm_naive(x, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, cpu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        return torch.ops.kvcompile.add_rms_norm(x, residual, weight, eps)
    check_rms_norm_args(x, weight, residual)
    if _kernels(cpu, x, residual, weight):
        return rms_norm_rows(x, weight, eps, residual)
    return rms_norm_naive(x, weight, eps, residual)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
                n_rope: int, rot_a: torch.Tensor | None,
                rot_b: torch.Tensor | None, cpu: bool = False) -> torch.Tensor:
    if x.is_cuda:
        return torch.ops.kvcompile.rope_rotate(x, cos, sin, neox, n_rope, rot_a, rot_b)
    check_rope_rotate_args(x, cos, sin, n_rope, rot_a, rot_b)
    if rot_a is None and rot_b is None and _kernels(cpu, x, cos, sin):
        return rope_rows(x, cos, sin, neox, n_rope)
    return rope_rotate_naive(x, cos, sin, neox, n_rope, rot_a, rot_b)


def silu_mul(gate_up: torch.Tensor, cpu: bool = False) -> torch.Tensor:
    if gate_up.is_cuda:
        return torch.ops.kvcompile.silu_mul(gate_up)
    check_silu_mul_args(gate_up)
    if _kernels(cpu, gate_up):
        return silu_mul_rows(gate_up)
    return silu_mul_naive(gate_up)


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
            and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias: the gemv op for a decode step's few rows on CUDA (f16 / bf16),
    F.linear (cuBLAS) for prefill, fp32 and other devices."""
    if _gemv_fits(x, weight, bias):
        return torch.ops.kvcompile.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """silu_mul(linear(x, weight, bias)) for a fused [gate; up] weight: on the gemv path
    one kernel (the product in the GEMV's epilogue, same values), else two."""
    if _gemv_fits(x, weight, bias):
        return torch.ops.kvcompile.gemv(x, weight, bias, True)
    return silu_mul(linear(x, weight, bias))


# qlinear and the KV ops. qlinear: the eager model calls the C++ kernel directly where it
# takes the call (a custom op's dispatch costs as much as the kernel at decode sizes); the
# op picks the same kernel (a traced forward). The KV ops: the C++ kernels on the fast path
# (`cpu`), called directly; the op (the fp32 reference on the CPU) otherwise.
def qlinear(x: torch.Tensor, weight: torch.Tensor, qtype: int, k: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    if not x.is_cuda and not torch.compiler.is_compiling() and cpu_qlinear_fits(x, qtype):
        return qlinear_rows(x, weight, qtype, k, bias)
    return torch.ops.kvcompile.qlinear(x, weight, qtype, k, bias)


def qembedding(weight: torch.Tensor, qtype: int, k: int, tokens: torch.Tensor,
               dtype: torch.dtype, cpu: bool = False) -> torch.Tensor:
    if (cpu and dtype == torch.float32 and not weight.is_cuda and qtype in CPU_IDS
            and not torch.compiler.is_compiling()):
        flat = tokens.reshape(-1)
        out = dequantize_cpu(weight.index_select(0, flat), weight_format(qtype).name, k)
        return out.view(*tokens.shape, k)
    return torch.ops.kvcompile.qembedding(weight, qtype, k, tokens, dtype)


def kv_write(k_pool, v_pool, k, v, q_pos, k_type: int, v_type: int, page_size: int,
             page_table, cpu: bool = False) -> None:
    if (_kernels(cpu, k, v) and k.shape[0] and cpu_kv_write_fits(
            k, kv_type(k_type).name, kv_type(v_type).name, page_table, k_pool, v_pool)):
        return write_rows(k_pool, v_pool, k, v, q_pos, page_table, page_size)
    torch.ops.kvcompile.kv_write(k_pool, v_pool, k, v, q_pos, k_type, v_type, page_size,
                                 page_table)


def span_attention(q, k_pool, v_pool, page_table, q_pos, k_type: int, v_type: int,
                   page_size: int, scale: float, workspace, out_rot,
                   window: int = 0, cpu: bool = False) -> torch.Tensor:
    if (out_rot is None and _kernels(cpu, q) and k_pool.stride(1) == 1
            and v_pool.stride(1) == 1
            and cpu_attention_fits(q, kv_type(k_type).name, kv_type(v_type).name, q.shape[0])):
        return attention_rows(q, k_pool, v_pool, page_table, q_pos, page_size, scale, window)
    return torch.ops.kvcompile.span_attention(q, k_pool, v_pool, page_table, q_pos, k_type,
                                              v_type, page_size, scale, workspace, out_rot,
                                              window)
