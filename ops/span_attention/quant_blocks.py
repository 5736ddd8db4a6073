"""Triton helpers for the "blocks" decode path: q8_0 / q4_0 tiles consumed block by block.

Why: dequantizing a tile to rows (int -> float converts, a hi + lo split of code * scale,
the q4_0 nibble interleave) cost more issue slots than the bytes it saved. Here:
- Q.K: one batched dot per 32-value block, q [NB, M, 32] x codes [NB, 32, N] in fp16
  (codes are small integers, q * code is exact in fp32), then times the block's scale in
  fp32 and summed over blocks: exact up to fp32 accumulation, no hi/lo split. q4_0 keeps
  its nibble order: low nibbles (values 0..15 of a block) meet q[.., 0:16], high nibbles
  q[.., 16:32]; the query is permuted once, K is never shuffled.
- P @ V: V tile as fp16 code * scale (one rounding, as before); q4_0 low and high
  nibbles feed two accumulators whose columns are put back in value order only at the
  final store.
- Codes reach fp16 without int->float converts (quarter-rate on Hopper): 0x6400 | u is
  the fp16 1024 + u for a byte u, so u - bias is one bit-or and one (packed) subtract.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def byte_to_f16(u, BIAS: tl.constexpr):
    """uint8 u -> fp16 (u - BIAS), exact (u < 256, so 1024 + u is an fp16 integer)."""
    return (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + BIAS)


@triton.jit
def v_blocks(vals, scl, phys, row, mask, page_elems, page_halves, code_halves,
             BLOCK_N: tl.constexpr, D: tl.constexpr, V_TYPE: tl.constexpr):
    """fp16 V operands (a, b): q8_0: a = [N, D] rows in value order, b unused (= a);
    q4_0: a = [N, D/2] the low-nibble values (column 16 k + j = value 32 k + j), b the
    high ones (value 32 k + 16 + j). Each is code * scale, one rounding."""
    NB: tl.constexpr = D // 32
    b = tl.arange(0, NB)
    base = vals + phys * page_elems
    s = tl.load(scl + phys * page_halves + code_halves + row[:, None] * NB + b[None, :],
                mask=mask[:, None], other=0.0)[:, :, None]          # [N, NB, 1]
    if V_TYPE == 8:
        j = tl.arange(0, 32)
        ptr = base + row[:, None, None] * D + (b * 32)[None, :, None] + j[None, None, :]
        c = tl.load(ptr)                                            # unmasked: scale 0
        va = tl.reshape(byte_to_f16(c ^ 0x80, 128) * s, (BLOCK_N, D))
        vb = va
    else:
        j = tl.arange(0, 16)
        ptr = base + row[:, None, None] * (D // 2) + (b * 16)[None, :, None] + j[None, None, :]
        byte = tl.load(ptr)
        va = tl.reshape(byte_to_f16(byte & 15, 8) * s, (BLOCK_N, D // 2))
        vb = tl.reshape(byte_to_f16(byte >> 4, 8) * s, (BLOCK_N, D // 2))
    return va, vb


@triton.jit
def value_columns(W: tl.constexpr, HALF: tl.constexpr):
    """Value index of accumulator column k: q4_0 halves (W = D/2) hold 32 (k // 16) +
    16 HALF + k % 16; a full-width accumulator (HALF < 0) holds value k."""
    k = tl.arange(0, W)
    if HALF < 0:
        return k
    else:
        return (k // 16) * 32 + HALF * 16 + k % 16


@triton.jit
def qk_blocks(qrow, row_ok, vals, scl, phys, row, mask, page_elems, page_halves, code_halves,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
               K_TYPE: tl.constexpr):
    """Scores [M, N] (fp32, before the softmax scale) of the query rows `qrow` (pointers,
    fp16) against K rows `row` (head * P + position in page) of physical page `phys`:
    one dot per 32-value block (the query block is re-read from L1; a batched 3-D dot put
    the blocks across warps and replicated the softmax), times the block's scale.
    `vals` is the pool as uint8, `scl` as fp16. Codes are read unmasked (rows past the
    context lie inside the page and have their scale masked to 0)."""
    NB: tl.constexpr = D // 32
    base = vals + phys * page_elems
    sbase = scl + phys * page_halves + code_halves + row * NB
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b in tl.static_range(NB):
        sc = tl.load(sbase + b, mask=mask, other=0.0).to(tl.float32)
        if K_TYPE == 8:
            j = tl.arange(0, 32)
            c = tl.load(base + row[None, :] * D + b * 32 + j[:, None])          # [32, N]
            qb = tl.load(qrow[:, None] + b * 32 + j[None, :], mask=row_ok[:, None], other=0.0)
            part = tl.dot(qb, byte_to_f16(c ^ 0x80, 128))
        else:
            j = tl.arange(0, 16)
            byte = tl.load(base + row[None, :] * (D // 2) + b * 16 + j[:, None])
            qa = tl.load(qrow[:, None] + b * 32 + j[None, :], mask=row_ok[:, None], other=0.0)
            qb = tl.load(qrow[:, None] + b * 32 + 16 + j[None, :], mask=row_ok[:, None],
                         other=0.0)
            part = tl.dot(qa, byte_to_f16(byte & 15, 8))
            part = tl.dot(qb, byte_to_f16(byte >> 4, 8), part)
        s += part * sc[None, :]
    return s
