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
def load_query_blocks(qrow, row_ok, NB: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr):
    """q [NB, M, W] with [b, m, j] = q[m, 32 b + 16 HALF + j] (qrow: [M] row pointers)."""
    b = tl.arange(0, NB)
    j = tl.arange(0, W)
    ptr = qrow[None, :, None] + (b * 32 + HALF * 16)[:, None, None] + j[None, None, :]
    return tl.load(ptr, mask=row_ok[None, :, None], other=0.0)


@triton.jit
def qk_blocks(qa, qb, vals, scl, phys, row, mask, page_elems, page_halves, code_halves,
              D: tl.constexpr, K_TYPE: tl.constexpr):
    """Scores [M, N] (fp32, before the softmax scale) of the query blocks qa (q8_0: all 32
    values of each block; q4_0: values 0..15) and qb (q4_0: values 16..31) against the
    K rows `row` (head * P + position in page) of physical page `phys`. `vals` is the
    pool as uint8, `scl` as fp16. Masked rows have codes and scales 0."""
    NB: tl.constexpr = D // 32
    b = tl.arange(0, NB)
    m3 = mask[None, None, :]
    base = vals + phys * page_elems
    if K_TYPE == 8:
        j = tl.arange(0, 32)
        ptr = base + row[None, None, :] * D + (b * 32)[:, None, None] + j[None, :, None]
        c = tl.load(ptr, mask=m3, other=0)                          # [NB, 32, N]
        part = tl.dot(qa, byte_to_f16(c ^ 0x80, 128))               # int8 bits: u - 128
    else:
        j = tl.arange(0, 16)
        ptr = base + row[None, None, :] * (D // 2) + (b * 16)[:, None, None] + j[None, :, None]
        byte = tl.load(ptr, mask=m3, other=0x88)                    # [NB, 16, N]
        part = tl.dot(qa, byte_to_f16(byte & 15, 8))
        part = tl.dot(qb, byte_to_f16(byte >> 4, 8), part)
    s = tl.load(scl + phys * page_halves + code_halves + row[None, None, :] * NB
                + b[:, None, None], mask=m3, other=0.0)             # [NB, 1, N]
    return tl.sum(part * s.to(tl.float32), 0)


@triton.jit
def v_blocks(vals, scl, phys, row, mask, page_elems, page_halves, code_halves,
             BLOCK_N: tl.constexpr, D: tl.constexpr, V_TYPE: tl.constexpr):
    """fp16 V operands (a, b): q8_0: a = [N, D] rows in value order, b unused (= a);
    q4_0: a = [N, D/2] the low-nibble values (column 16 k + j = value 32 k + j), b the
    high ones (value 32 k + 16 + j). Each is code * scale, one rounding."""
    NB: tl.constexpr = D // 32
    b = tl.arange(0, NB)
    m3 = mask[:, None, None]
    base = vals + phys * page_elems
    s = tl.load(scl + phys * page_halves + code_halves + row[:, None] * NB + b[None, :],
                mask=mask[:, None], other=0.0)[:, :, None]          # [N, NB, 1]
    if V_TYPE == 8:
        j = tl.arange(0, 32)
        ptr = base + row[:, None, None] * D + (b * 32)[None, :, None] + j[None, None, :]
        c = tl.load(ptr, mask=m3, other=0)
        va = tl.reshape(byte_to_f16(c ^ 0x80, 128) * s, (BLOCK_N, D))
        vb = va
    else:
        j = tl.arange(0, 16)
        ptr = base + row[:, None, None] * (D // 2) + (b * 16)[None, :, None] + j[None, None, :]
        byte = tl.load(ptr, mask=m3, other=0x88)
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
