"""Triton helpers shared by the span_attention kernels: read one tile of a KV page.

A tile is BLOCK_N consecutive positions of one KV head inside one page (BLOCK_N divides
the page size, so a tile never crosses a page). The page layout is kv_format's: values or
codes [H, P, D'] first, then fp16 scales [H, P, D/32]. Quantized tiles are dequantized in
registers; nothing is written back.

Precision: Q.K is exact up to fp32 accumulation (bf16 x bf16, fp16 x fp16, or fp16 x
(hi + lo) for fp32 / dequantized K); P and V enter P @ V as fp16 (P in [0, 1]).
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
def load_tile(vals, scl, phys, head, off, mask, page_elems, page_halves, code_halves,
              BLOCK_N: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
              KV_TYPE: tl.constexpr):
    """[BLOCK_N, D] values of rows `off` (positions inside physical page `phys`) of one head.

    `vals` is the pool viewed in the page's value type (f32/f16/bf16, int8 codes for q8_0,
    uint8 nibbles for q4_0), `scl` the pool viewed as fp16; `page_elems` / `page_halves`
    are the page size in those units and `code_halves` where the scales start. Float pages
    come back in their own dtype; quantized pages as exact fp32 code * scale. Rows outside
    `mask` read as 0 (pages may hold garbage, even NaN bit patterns, past the written
    positions)."""
    row = head * P + off                                            # [BLOCK_N]
    if KV_TYPE == 0 or KV_TYPE == 1 or KV_TYPE == 30:
        d = tl.arange(0, D)
        x = tl.load(vals + phys * page_elems + row[:, None] * D + d[None, :],
                    mask=mask[:, None], other=0.0)
    else:
        NB: tl.constexpr = D // 32
        b = tl.arange(0, NB)
        s = tl.load(scl + phys * page_halves + code_halves + row[:, None] * NB + b[None, :],
                    mask=mask[:, None], other=0.0).to(tl.float32)[:, :, None]
        m3 = mask[:, None, None]
        if KV_TYPE == 8:
            j = tl.arange(0, 32)
            cp = vals + phys * page_elems + row[:, None, None] * D + b[None, :, None] * 32 \
                + j[None, None, :]
            c = tl.load(cp, mask=m3, other=0).to(tl.float32)
            x = tl.reshape(c * s, (BLOCK_N, D))
        else:
            j = tl.arange(0, 16)
            cp = vals + phys * page_elems + row[:, None, None] * (D // 2) + b[None, :, None] * 16 \
                + j[None, None, :]
            byte = tl.load(cp, mask=m3, other=0).to(tl.int32)
            lo = ((byte & 15) - 8).to(tl.float32) * s                # values j of each block
            hi = ((byte >> 4) - 8).to(tl.float32) * s                # values j + 16
            x = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BLOCK_N, D))
    return x


@triton.jit
def qk_scores(q, k, K_SPLIT: tl.constexpr, QK_F16: tl.constexpr,
              BF16_EMULATE: tl.constexpr):
    """q [M, D] (fp16 or bf16) @ k [N, D]^T with fp32 accumulation.

    K_SPLIT (fp32 tiles: f32 pages, dequantized q8_0 / q4_0): k = hi + lo in two fp16
    tiles and two dots, so the scores carry no fp16 rounding of K (a dequantized value,
    <= 8 bits of code times an 11-bit scale, is exactly hi + lo). The Triton interpreter
    cannot multiply bf16 tiles (numpy has no bf16), so interpreted bf16 runs take the exact
    fp32 route: bf16 * bf16 products are exact in fp32, as on tensor cores."""
    if K_SPLIT:
        hi = k.to(tl.float16)
        lo = (k - hi.to(tl.float32)).to(tl.float16)
        return tl.dot(q, tl.trans(hi)) + tl.dot(q, tl.trans(lo))
    elif QK_F16:
        return tl.dot(q, tl.trans(k.to(tl.float16)))
    elif BF16_EMULATE:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(q, tl.trans(k))


@triton.jit
def v_operand(v, V_TYPE: tl.constexpr):
    """The V tile as the fp16 operand of P @ V (exact for f16 pages and for bf16 values in
    fp16's normal range; one rounding for f32 and dequantized pages)."""
    if V_TYPE == 1:
        return v
    elif V_TYPE == 30:
        return v.to(tl.float32).to(tl.float16)
    else:
        return v.to(tl.float16)
