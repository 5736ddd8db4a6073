"""Triton GEMV: y [M, N] = x [M, K] @ W [N, K]^T for the few rows of a decode step
(M <= 8), streaming the weight once at close to HBM bandwidth.

Why not cuBLAS: for one row it reads the 8B decode weights well below HBM bandwidth (the o
projection, 4096 x 4096, furthest below); these kernels are faster on the q/k/v, o and down
shapes and match it on the large ones (docs/findings.md, "The decode step: host overhead
and kernels").
- one row (`_gemv_row`): CUDA-core FMAs into a [BLOCK_N, BLOCK_K] fp32 tile, summed once
  at the end; a row needs 1 FMA per weight element, far below the issue rate.
- 2..8 rows (`_gemv_rows`): one tensor-core dot per weight tile, the rows padded to 16.
fp32 accumulation, bias added in fp32, one rounding to x's dtype.
SILU (the fused gate / up projection of a SwiGLU): tile row 2c is gate row c, 2c + 1 up row
N / 2 + c, and the epilogue stores silu(gate) * up of the rounded pair (ops/silu_mul's
formula), BLOCK_N / 2 outputs a program: no separate silu_mul kernel in a decode step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.ops.cast import TL_DTYPES, round_to
from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers


@triton.jit
def _weight_tile(rows, n, k, N, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(rows + k[None, :])
    else:
        return tl.load(rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)


@triton.jit
def _x_tile(x_ptr, k, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptr + k)
    else:
        return tl.load(x_ptr + k, mask=k < K, other=0.0)


@triton.jit
def _xt_tile(x_ptr, m, k, M, K, stride_xm, EVEN: tl.constexpr):
    """x rows m as a [BLOCK_K, 16] operand (rows past M are zeros)."""
    if EVEN:
        return tl.load(x_ptr + m[None, :] * stride_xm + k[:, None], mask=m[None, :] < M,
                       other=0.0)
    else:
        return tl.load(x_ptr + m[None, :] * stride_xm + k[:, None],
                       mask=(m[None, :] < M) & (k[:, None] < K), other=0.0)


@triton.jit
def _dot_rows(w, xt, acc, EXACT: tl.constexpr):
    if EXACT:
        return tl.dot(w, xt, acc)
    else:  # the interpreter's bf16 dot is wrong: take the (exact) fp32 products
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _weight_rows(BLOCK_N: tl.constexpr, N, SILU: tl.constexpr):
    """Weight rows of the program's tile (weight_row of each j)."""
    return weight_row(tl.arange(0, BLOCK_N), BLOCK_N, N, SILU)


@triton.jit
def weight_row(j, BLOCK_N: tl.constexpr, N, SILU: tl.constexpr):
    """Weight row of the program's tile row j (an index or a tensor of them): output j, or
    with SILU the gate (j even) / up (j odd) row of output j // 2."""
    if SILU:
        return tl.program_id(0) * (BLOCK_N // 2) + j // 2 + (j % 2) * (N // 2)
    else:
        return tl.program_id(0) * BLOCK_N + j


@triton.jit
def _silu_pairs(y, DTYPE: tl.constexpr, EXACT: tl.constexpr, ROWS: tl.constexpr):
    """fp32 y [BLOCK_N, ...] with (gate, up) in row pairs -> silu(gate) * up [BLOCK_N / 2,
    ...] in fp32, from the pair rounded to DTYPE as silu_mul reads it."""
    y = round_to(y, DTYPE, EXACT).to(tl.float32)
    if not ROWS:
        g, u = tl.split(tl.reshape(y, (y.shape[0] // 2, 2)))
    else:
        g, u = tl.split(tl.permute(tl.reshape(y, (y.shape[0] // 2, 2, y.shape[1])),
                                   (0, 2, 1)))
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def store_row(y, n, b_ptr, y_ptr, N, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
              SILU: tl.constexpr, DTYPE: tl.constexpr, EXACT: tl.constexpr):
    """One-row epilogue (shared with ops/qlinear): fp32 y of weight rows n, plus the bias,
    stored rounded to DTYPE; with SILU silu(gate) * up of the program's row pairs."""
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    if SILU:
        c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + c, round_to(_silu_pairs(y, DTYPE, EXACT, False), DTYPE, EXACT),
                 mask=c < N // 2)
    else:
        tl.store(y_ptr + n, round_to(y, DTYPE, EXACT), mask=n < N)


@triton.jit
def store_rows(acc, n, m, b_ptr, y_ptr, M, N, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
               SILU: tl.constexpr, DTYPE: tl.constexpr, EXACT: tl.constexpr):
    """Epilogue of 2..8 rows (shared with ops/qlinear): acc [BLOCK_N, 16] of weight rows n
    and x rows m, as store_row."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    if SILU:
        c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + m[None, :] * (N // 2) + c[:, None],
                 round_to(_silu_pairs(acc, DTYPE, EXACT, True), DTYPE, EXACT),
                 mask=(m[None, :] < M) & (c[:, None] < N // 2))
    else:
        tl.store(y_ptr + m[None, :] * N + n[:, None], round_to(acc, DTYPE, EXACT),
                 mask=(m[None, :] < M) & (n[:, None] < N))


@triton.jit
def _gemv_row(x_ptr, w_ptr, b_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
              DTYPE: tl.constexpr, EXACT: tl.constexpr, SILU: tl.constexpr,
              PDL: tl.constexpr):
    n = _weight_rows(BLOCK_N, N, SILU)
    kk = tl.arange(0, BLOCK_K)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    # the first weight tile before the wait: no kernel writes weights (ops/pdl.py)
    w = _weight_tile(rows, n, kk, N, K, EVEN)
    wait_for_producers(PDL)
    acc = w.to(tl.float32) * _x_tile(x_ptr, kk, K, EVEN).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + kk
        w = _weight_tile(rows, n, k, N, K, EVEN)
        acc += w.to(tl.float32) * _x_tile(x_ptr, k, K, EVEN).to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    store_row(y, n, b_ptr, y_ptr, N, BLOCK_N, HAS_BIAS, SILU, DTYPE, EXACT)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, HAS_BIAS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
               DTYPE: tl.constexpr, EXACT: tl.constexpr, SILU: tl.constexpr,
               PDL: tl.constexpr):
    n = _weight_rows(BLOCK_N, N, SILU)
    m = tl.arange(0, 16)
    kk = tl.arange(0, BLOCK_K)
    rows = w_ptr + n[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    w = _weight_tile(rows, n, kk, N, K, EVEN)      # before the wait, as in _gemv_row
    wait_for_producers(PDL)
    acc = _dot_rows(w, _xt_tile(x_ptr, m, kk, M, K, stride_xm, EVEN), acc, EXACT)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + kk
        w = _weight_tile(rows, n, k, N, K, EVEN)
        acc = _dot_rows(w, _xt_tile(x_ptr, m, k, M, K, stride_xm, EVEN), acc, EXACT)
    store_rows(acc, n, m, b_ptr, y_ptr, M, N, BLOCK_N, HAS_BIAS, SILU, DTYPE, EXACT)


def row_config(n: int, k: int) -> dict:
    """One row: long K tiles, few output rows a program (swept inside the captured 8B
    decode step with PDL: against the earlier 4 x 512 (N <= 4096), 16 x 512 (N <= 8192)
    and 16 x 256 tiles, 4 x 1024 for the o and down shapes (N 4096) and 8 x 512 for q/k/v
    (6144) and gate/up (28672) made the step faster; docs/findings.md, "The decode step:
    host overhead and kernels"); the LM head (N above 32768) keeps 16 x 256. K tiles no
    longer than K."""
    if n <= 4096:
        block_n, block_k = 4, 1024
    elif n <= 32768:
        block_n, block_k = 8, 512
    else:
        block_n, block_k = 16, 256
    return dict(BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))),
                num_warps=4)


def rows_config(n: int) -> dict:
    """2..8 rows: 64 output rows a program; deeper pipelines and longer K tiles for the
    small weights (from a sweep; 4 stages at N <= 4096: the first tile loaded ahead of
    the loop (ops/pdl.py) takes a fifth's shared memory)."""
    if n <= 4096:
        return dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)
    if n <= 8192:
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5)
    return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 8, last dim dense), weight [N, K] contiguous, bias [N] or None;
    `config` overrides the launch defaults (benchmarks); silu_mul: y [M, N / 2] =
    silu(gate) * up of the [gate; up] rows (module docstring)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.is_contiguous() and x.stride(1) == 1, "gemv needs dense rows"
    assert not silu_mul or n % 2 == 0, "silu_mul pairs gate and up rows: N must be even"
    y = torch.empty((m, n // 2 if silu_mul else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if m == 1:
        kernel, cfg, shape = _gemv_row, config or row_config(n, k), (n, k)
    else:
        kernel, cfg, shape = _gemv_rows, config or rows_config(n), (m, n, k, x.stride(0))
    even = n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0
    launchable(kernel)[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, y if bias is None else bias, y, *shape, HAS_BIAS=bias is not None,
        EVEN=even, DTYPE=TL_DTYPES[x.dtype], EXACT=not interpreting(), SILU=silu_mul, **cfg,
        **pdl_launch(x.device))
    return y
