"""Triton helpers shared by the span_attention kernels: read one tile of a KV page.

A tile is BLOCK_N consecutive positions of one KV head inside one page (BLOCK_N divides
the page size, so a tile never crosses a page). The page layout is kv_format's: values or
codes [H, P, D'] first, then fp16 scales [H, P, D/32]. Quantized tiles are dequantized in
registers; nothing is written back.

Precision: Q.K is exact up to fp32 accumulation (bf16 x bf16, fp16 x fp16, fp16 x integer
codes per block then times the block scale for q8_0 / q4_0, fp16 x (hi + lo) for f32 K);
P and V enter P @ V as fp16 (P in [0, 1]).
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
    come back in their own dtype; quantized pages as fp16 code * scale (one rounding).
    Rows outside `mask` read as 0 (pages may hold garbage, even NaN bit patterns, past the
    written positions)."""
    row = head * P + off                                            # [BLOCK_N]
    d = tl.arange(0, D)
    m2 = mask[:, None]
    if KV_TYPE == 0 or KV_TYPE == 1 or KV_TYPE == 30:
        x = tl.load(vals + phys * page_elems + row[:, None] * D + d[None, :], mask=m2,
                    other=0.0)
    else:
        # each value's block scale, read where it lies (neighbours share an L1 line)
        sp = scl + phys * page_halves + code_halves + row[:, None] * (D // 32) + d[None, :] // 32
        s = tl.load(sp, mask=m2, other=0.0)
        if KV_TYPE == 8:
            c = tl.load(vals + phys * page_elems + row[:, None] * D + d[None, :], mask=m2,
                        other=0).to(tl.float16)
        else:
            byte_of = (d // 32) * 16 + d % 16                       # ggml nibble order
            shift = ((d // 16) % 2) * 4
            b = tl.load(vals + phys * page_elems + row[:, None] * (D // 2) + byte_of[None, :],
                        mask=m2, other=0).to(tl.int32)
            c = (((b >> shift[None, :]) & 15) - 8).to(tl.float16)
        x = c * s                                  # exact operands: one rounding to fp16
    return x


@triton.jit
def qk_quantized(q_rows, row_ok, k_vals, k_scl, phys, head, off, mask, page_elems,
                 page_halves, code_halves, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 P: tl.constexpr, D: tl.constexpr, K_TYPE: tl.constexpr):
    """Scores [BLOCK_M, BLOCK_N] of fp16 query rows (pointers `q_rows`) against a q8_0 /
    q4_0 K tile without dequantizing it: for each block of 32 values, a dot of the query
    slice with the integer codes (exact fp16 operands) times the block scale in fp32."""
    row = head * P + off
    base_c = k_vals + phys * page_elems
    base_s = k_scl + phys * page_halves + code_halves + row * (D // 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b in tl.static_range(D // 32):
        s_b = tl.load(base_s + b, mask=mask, other=0.0).to(tl.float32)
        if K_TYPE == 8:
            j = tl.arange(0, 32)
            c = tl.load(base_c + row[:, None] * D + b * 32 + j[None, :], mask=mask[:, None],
                        other=0).to(tl.float16)
            qb = tl.load(q_rows[:, None] + b * 32 + j[None, :], mask=row_ok[:, None], other=0.0)
            t = tl.dot(qb, tl.trans(c))
        else:
            j = tl.arange(0, 16)
            byte = tl.load(base_c + row[:, None] * (D // 2) + b * 16 + j[None, :],
                           mask=mask[:, None], other=0).to(tl.int32)
            lo = ((byte & 15) - 8).to(tl.float16)                  # values b*32 + j
            hi = ((byte >> 4) - 8).to(tl.float16)                  # values b*32 + 16 + j
            q_lo = tl.load(q_rows[:, None] + b * 32 + j[None, :], mask=row_ok[:, None], other=0.0)
            q_hi = tl.load(q_rows[:, None] + b * 32 + 16 + j[None, :], mask=row_ok[:, None],
                           other=0.0)
            t = tl.dot(q_lo, tl.trans(lo)) + tl.dot(q_hi, tl.trans(hi))
        acc += t * s_b[None, :]
    return acc


@triton.jit
def qk_scores(q, k, K_SPLIT: tl.constexpr, QK_F16: tl.constexpr,
              BF16_EMULATE: tl.constexpr):
    """q [M, D] (fp16 or bf16) @ k [N, D]^T with fp32 accumulation.

    K_SPLIT (fp32 tiles of f32 pages): k = hi + lo in two fp16 tiles and two dots, so the
    scores carry (almost) no fp16 rounding of K. The Triton interpreter
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
    fp16's normal range; one rounding for f32 pages; quantized tiles already are)."""
    if V_TYPE == 1:
        return v
    elif V_TYPE == 30:
        return v.to(tl.float32).to(tl.float16)
    else:
        return v.to(tl.float16)
