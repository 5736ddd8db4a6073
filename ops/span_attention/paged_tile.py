"""Triton helpers shared by the span_attention kernels: read one tile of a KV page.

A tile is BLOCK_N consecutive positions of one KV head inside one page (BLOCK_N divides
the page size, so a tile never crosses a page). The page layout is kv_format's: values or
codes [H, P, D'] first, then fp16 scales [H, P, D/32]. Quantized tiles are dequantized in
registers; nothing is written back.

Dot operand precision (what `load_tile` returns) is chosen by the launcher:
  DOT_F16 = 1: fp16. Exact for f16 pages; one round-to-nearest of code * scale for
               q8_0 / q4_0 (relative error <= 2^-11); exact for bf16 values whose
               magnitude lies in [2^-14, 65504] (the fp16 normal range).
  DOT_F16 = 0: bf16 (only used when both the query and the K page are bf16: exact).
"""
from __future__ import annotations

import triton
import triton.language as tl

KV_F32 = 0
KV_F16 = 1
KV_Q4_0 = 2
KV_Q8_0 = 8
KV_BF16 = 30


@triton.jit
def page_ptr(pool_ptr, page_table_ptr, logical_page, page_bytes):
    """uint8 pointer to the first byte of a logical page (scalar)."""
    phys = tl.load(page_table_ptr + logical_page).to(tl.int64)
    return pool_ptr + phys * page_bytes


@triton.jit
def load_tile(base, head, off, d, mask, code_bytes,
              P: tl.constexpr, D: tl.constexpr, KV_TYPE: tl.constexpr,
              DOT_F16: tl.constexpr):
    """[BLOCK_N, D] values of rows `off` (positions inside the page) of one head.

    Rows outside `mask` read as 0 (pages may hold garbage, even NaN bit patterns, past the
    written positions)."""
    row = head * P + off                                   # [BLOCK_N] row index in page
    m2 = mask[:, None]
    if DOT_F16:
        out_ty = tl.float16
    else:
        out_ty = tl.bfloat16
    if KV_TYPE == 0:
        p = (base + (row[:, None] * D + d[None, :]) * 4).to(tl.pointer_type(tl.float32))
        x = tl.load(p, mask=m2, other=0.0).to(out_ty)
    elif KV_TYPE == 1:
        p = (base + (row[:, None] * D + d[None, :]) * 2).to(tl.pointer_type(tl.float16))
        x = tl.load(p, mask=m2, other=0.0).to(out_ty)
    elif KV_TYPE == 30:
        p = (base + (row[:, None] * D + d[None, :]) * 2).to(tl.pointer_type(tl.bfloat16))
        x = tl.load(p, mask=m2, other=0.0)
        if DOT_F16:
            x = x.to(tl.float32).to(tl.float16)
    else:
        sp = base + code_bytes + (row[:, None] * (D // 32) + (d[None, :] // 32)) * 2
        s = tl.load(sp.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0)
        if KV_TYPE == 8:
            cp = (base + row[:, None] * D + d[None, :]).to(tl.pointer_type(tl.int8))
            c = tl.load(cp, mask=m2, other=0).to(tl.float16)
        else:
            cp = base + row[:, None] * (D // 2) + (d[None, :] // 32) * 16 + d[None, :] % 16
            b = tl.load(cp, mask=m2, other=0).to(tl.int32)
            c = (((b >> ((d[None, :] // 16) % 2) * 4) & 15) - 8).to(tl.float16)
        # integer code (exact in fp16) times fp16 scale: one correctly rounded product
        x = c * s
        if not DOT_F16:
            x = x.to(tl.float32).to(out_ty)
    return x


@triton.jit
def qk_dot(q, k, BF16_EMULATE: tl.constexpr):
    """q [M, D] @ k[N, D]^T with fp32 accumulation. The Triton interpreter cannot multiply
    bf16 tiles (numpy has no bf16), so interpreted runs take the exact fp32 route, which
    gives the same products as bf16 tensor cores (bf16 * bf16 is exact in fp32)."""
    if BF16_EMULATE:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k))
