"""Triton helpers shared by the span_attention kernels: read one tile of a KV page.

A tile is BLOCK_N consecutive positions of one KV head inside one page (BLOCK_N divides
the page size, so a tile never crosses a page). The page layout is kv_format's: values or
codes [H, P, D'] first, then fp16 scales [H, P, D/32]; quantized V pages are position-major
(codes [H, D', P], scales [H, D/32, P]: load_v_tile). Quantized tiles are dequantized in
registers; nothing is written back.

Precision: Q.K is exact up to fp32 accumulation (bf16 x bf16, fp16 x fp16, or fp16 x
(hi + lo) for q8_0 / q4_0 / f32 K; a prefill launch of many rows reads quantized K as fp16,
dequant_pages.py); P and V enter P @ V as fp16 (P in [0, 1]).
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
def online_softmax_along(s, m_i, l_i, AXIS: tl.constexpr):
    """One tile of the streaming softmax over scores s (log2 domain, -inf masked), positions
    along AXIS: (p = exp2(s - m_new), alpha rescaling the old accumulator, m_new, l_new).
    Query rows with nothing visible yet keep m = -inf and contribute p = 0."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - tl.expand_dims(m_use, AXIS))
    return p, alpha, m_new, l_i * alpha + tl.sum(p, AXIS)


@triton.jit
def online_softmax(s, m_i, l_i):
    """online_softmax_along for scores s [M, N]: query rows down, positions across."""
    return online_softmax_along(s, m_i, l_i, 1)


@triton.jit
def load_blocks(vals, scl, phys, row, mask, page_elems, page_halves, code_halves,
                D: tl.constexpr, KV_TYPE: tl.constexpr):
    """A q8_0 / q4_0 tile by blocks: (codes A, codes B, scales), fp16, codes [BLOCK_N,
    D/32, W] (small integers, exact), scales [BLOCK_N, D/32, 1]. q8_0: A = the 32 codes of
    each block (W = 32), B unused; q4_0: A = values 0..15 of each block, B = 16..31
    (W = 16, ggml's low and high nibbles). Every load is of whole contiguous runs."""
    NB: tl.constexpr = D // 32
    b = tl.arange(0, NB)
    m3 = mask[:, None, None]
    s = tl.load(scl + phys * page_halves + code_halves + row[:, None] * NB + b[None, :],
                mask=mask[:, None], other=0.0)[:, :, None]
    if KV_TYPE == 8:
        j = tl.arange(0, 32)
        cp = vals + phys * page_elems + row[:, None, None] * D + b[None, :, None] * 32 \
            + j[None, None, :]
        ca = tl.load(cp, mask=m3, other=0).to(tl.float16)
        cb = ca
    else:
        j = tl.arange(0, 16)
        cp = vals + phys * page_elems + row[:, None, None] * (D // 2) + b[None, :, None] * 16 \
            + j[None, None, :]
        byte = tl.load(cp, mask=m3, other=0).to(tl.int32)
        ca = ((byte & 15) - 8).to(tl.float16)
        cb = ((byte >> 4) - 8).to(tl.float16)
    return ca, cb, s


@triton.jit
def to_rows(xa, xb, BLOCK_N: tl.constexpr, D: tl.constexpr, KV_TYPE: tl.constexpr):
    """Blocks back to [BLOCK_N, D] rows in value order."""
    if KV_TYPE == 8:
        return tl.reshape(xa, (BLOCK_N, D))
    else:
        return tl.reshape(tl.permute(tl.join(xa, xb), (0, 1, 3, 2)), (BLOCK_N, D))


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
    if KV_TYPE == 0 or KV_TYPE == 1 or KV_TYPE == 30:
        d = tl.arange(0, D)
        x = tl.load(vals + phys * page_elems + row[:, None] * D + d[None, :],
                    mask=mask[:, None], other=0.0)
    else:
        ca, cb, s = load_blocks(vals, scl, phys, row, mask, page_elems, page_halves,
                                code_halves, D, KV_TYPE)
        x = to_rows(ca * s, cb * s, BLOCK_N, D, KV_TYPE)  # exact operands: one rounding
    return x


@triton.jit
def load_v_tile(vals, scl, phys, head, off, mask, page_elems, page_halves, code_halves,
                BLOCK_N: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                KV_TYPE: tl.constexpr):
    """load_tile for V pages: quantized ones are position-major, read as [code rows,
    BLOCK_N] runs of contiguous positions, dequantized (fp16 code * scale, one rounding as
    in load_tile) and returned as [BLOCK_N, D] rows in value order; float pages as load_tile."""
    if KV_TYPE == 2 or KV_TYPE == 8:
        NB: tl.constexpr = D // 32
        W: tl.constexpr = D if KV_TYPE == 8 else D // 2           # code rows of a head
        c = tl.arange(0, W)
        b = tl.arange(0, NB)
        codes = tl.load(vals + phys * page_elems + (head * W + c[:, None]) * P + off[None, :],
                        mask=mask[None, :], other=0)                       # [W, N]
        s = tl.load(scl + phys * page_halves + code_halves + (head * NB + b[:, None]) * P
                    + off[None, :], mask=mask[None, :], other=0.0)         # [NB, N]
        if KV_TYPE == 8:
            sw = tl.reshape(tl.broadcast_to(s[:, None, :], (NB, 32, BLOCK_N)), (D, BLOCK_N))
            x = codes.to(tl.float16) * sw
        else:
            sw = tl.reshape(tl.broadcast_to(s[:, None, :], (NB, 16, BLOCK_N)), (W, BLOCK_N))
            byte = codes.to(tl.int32)
            lo = tl.reshape(((byte & 15) - 8).to(tl.float16) * sw, (NB, 16, BLOCK_N))
            hi = tl.reshape(((byte >> 4) - 8).to(tl.float16) * sw, (NB, 16, BLOCK_N))
            # value 32 k + j is low nibble j of block k, value 32 k + 16 + j its high nibble
            x = tl.reshape(tl.permute(tl.join(lo, hi), (0, 3, 1, 2)), (D, BLOCK_N))
        return tl.trans(x)
    else:
        return load_tile(vals, scl, phys, head, off, mask, page_elems, page_halves,
                         code_halves, BLOCK_N, P, D, KV_TYPE)


@triton.jit
def _residual(c, s, hi, INTERP: tl.constexpr):
    """c * s - hi exactly (hi = fp16(c * s)); numpy has no fp16 fma, so the interpreter
    takes it in fp32 (exact as well)."""
    if INTERP:
        return (c.to(tl.float32) * s.to(tl.float32) - hi.to(tl.float32)).to(tl.float16)
    return tl.fma(c, s, -hi)


@triton.jit
def qk_quantized(q, k_vals, k_scl, phys, head, off, mask, page_elems, page_halves,
                 code_halves, BLOCK_N: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                 K_TYPE: tl.constexpr, INTERP: tl.constexpr):
    """Scores of fp16 queries against a q8_0 / q4_0 K tile with no rounding of K: the
    dequantized value code * scale is hi + lo exactly (hi = the fp16 product, lo = its
    rounding error, an fma), and Q.K = Q.hi + Q.lo in two fp16 dots."""
    row = head * P + off
    ca, cb, s = load_blocks(k_vals, k_scl, phys, row, mask, page_elems, page_halves,
                            code_halves, D, K_TYPE)
    ha = ca * s
    hb = cb * s
    hi = to_rows(ha, hb, BLOCK_N, D, K_TYPE)
    lo = to_rows(_residual(ca, s, ha, INTERP), _residual(cb, s, hb, INTERP), BLOCK_N, D,
                 K_TYPE)
    return tl.dot(q, tl.trans(hi)) + tl.dot(q, tl.trans(lo))


@triton.jit
def query_tile(x, QK_F16: tl.constexpr):
    """The loaded query rows as the Q.K operand: fp16 unless the dot runs in bf16
    (launch.dot_mode). Cast here rather than on the host: one kernel a layer fewer."""
    if QK_F16:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def qk_scores(q, k, K_SPLIT: tl.constexpr, QK_F16: tl.constexpr,
              INTERP: tl.constexpr):
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
    elif INTERP:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(q, tl.trans(k))


@triton.jit
def k_value_scores(q, k_vals, k_scl, phys, head, off, mask, page_elems, page_halves,
                   code_halves, BLOCK_N: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                   K_TYPE: tl.constexpr, K_SPLIT: tl.constexpr, QK_F16: tl.constexpr,
                   INTERP: tl.constexpr):
    """Scores q @ K^T of one tile of K pages read as values (load_tile, then qk_scores)."""
    k = load_tile(k_vals, k_scl, phys, head, off, mask, page_elems, page_halves, code_halves,
                  BLOCK_N, P, D, K_TYPE)
    return qk_scores(q, k, K_SPLIT, QK_F16, INTERP)


@triton.jit
def causal_softmax(s, pos, qp, m_i, l_i, win, QK_SCALE: tl.constexpr, MASKED: tl.constexpr,
                   WINDOWED: tl.constexpr):
    """A tile's scores scaled (to the log2 domain), positions after a query row's masked
    (MASKED: the tile may reach past a row or, WINDOWED, before its window of `win`
    positions), through online_softmax."""
    s = s * QK_SCALE
    if MASKED:
        s = tl.where(visible(pos[None, :], qp[:, None], win, WINDOWED), s, float("-inf"))
    return online_softmax(s, m_i, l_i)


@triton.jit
def visible(pos, qp, win, WINDOWED: tl.constexpr):
    """Key position `pos` is seen by the query row at `qp`: causal and, WINDOWED, one of
    the row's last `win` positions (qp - pos < win, llama.cpp's sliding window)."""
    if WINDOWED:
        return (pos <= qp) & (pos + win > qp)
    else:
        return pos <= qp


@triton.jit
def in_span(pos, begin, end, WINDOWED: tl.constexpr):
    """Positions that are read: before `end` and, WINDOWED, from `begin` on."""
    if WINDOWED:
        return (pos >= begin) & (pos < end)
    else:
        return pos < end


@triton.jit
def window_begin(qp, row_ok, win, WINDOWED: tl.constexpr):
    """The first key position any real row sees (0 without a window): positions before it
    are never read."""
    if WINDOWED:
        low = tl.min(tl.where(row_ok, qp, 1 << 30), 0)
        return tl.maximum(low - win + 1, 0)
    else:
        return 0


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
