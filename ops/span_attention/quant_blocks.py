"""Triton helpers for the "blocks" decode path: q8_0 / q4_0 tiles consumed block by block.

Why: dequantizing a tile to rows (int -> float converts, a hi + lo split of code * scale,
the q4_0 nibble interleave) cost more issue slots than the bytes it saved. Here:
- Q.K: one fp16 dot per 32-value block, q[:, block] x codes[block]^T (codes are small
  integers, q * code is exact in fp32), times the block's scale in fp32 and summed over
  blocks: exact up to fp32 accumulation, no hi/lo split. q4_0 keeps its nibble order:
  low nibbles (values 0..15 of a block) meet q[.., 0:16], high nibbles q[.., 16:32];
  the query is read in that order, K is never shuffled.
- P @ V: V tile as fp16 code * scale (one rounding, as before); q4_0 low and high
  nibbles feed two accumulators whose columns are put back in value order only at the
  final store. V pages are position-major (kv_format), so the tile's codes run along the
  contraction and reach the tensor-core operand without byte-wise shared-memory reads.
- Codes reach fp16 without int->float converts (quarter-rate on Hopper): 0x6400 | u is
  the fp16 1024 + u for a byte u, so u - bias is one bit-or and one (packed) subtract.
The split kernel's loop in sm_90 SASS (tools/profile/sass_decode.py) has no I2F and no
byte-wise LDS.U8/U16, and far fewer instructions than decode_kernel's (docs/findings.md,
"KV page format").
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def byte_to_f16(u, BIAS: tl.constexpr):
    """uint8 u -> fp16 (u - BIAS), exact (u < 256, so 1024 + u is an fp16 integer)."""
    return (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + BIAS)


# The same on 4 bytes a register (Triton's own lowering works byte by byte): prmt puts
# byte k under the fp16 exponent byte 0x64 (selectors 0x5140: bytes 0, 1; 0x5342: bytes
# 2, 3), sub.f16x2 removes 1024 + bias from two values at once.


@triton.jit
def q8_codes_f16(c, INTERP: tl.constexpr):
    """uint8 bytes of int8 codes -> fp16 codes."""
    if INTERP:
        return byte_to_f16(c ^ 0x80, 128)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, m, c; mov.b32 m, 0x64646464; mov.b32 c, 0x64806480; "
            "xor.b32 t, $2, 0x80808080; prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x5342; "
            "sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; }",
            "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def q4_codes_f16(byte, INTERP: tl.constexpr):
    """q4_0 bytes -> (low nibble - 8, high nibble - 8) as fp16."""
    if INTERP:
        return byte_to_f16(byte & 15, 8), byte_to_f16(byte >> 4, 8)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u, m, c; mov.b32 m, 0x64646464; mov.b32 c, 0x64086408; "
            "and.b32 t, $4, 0x0F0F0F0F; shr.b32 u, $4, 4; and.b32 u, u, 0x0F0F0F0F; "
            "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x5342; "
            "prmt.b32 $2, u, m, 0x5140; prmt.b32 $3, u, m, 0x5342; "
            "sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; "
            "sub.f16x2 $2, $2, c; sub.f16x2 $3, $3, c; }",
            "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def v_scales_t(scl, phys, head, off, mask, page_halves, code_halves, D: tl.constexpr,
               P: tl.constexpr):
    """The V scales [NB, N] (fp16) of positions `off` of a position-major V page (kv_format),
    0 where not `mask`."""
    NB: tl.constexpr = D // 32
    b = tl.arange(0, NB)
    return tl.load(scl + phys * page_halves + code_halves + (head * NB + b[:, None]) * P
                   + off[None, :], mask=mask[None, :], other=0.0)


@triton.jit
def v_operands_t(vals, phys, head, off, page_elems, scales, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, P: tl.constexpr, V_TYPE: tl.constexpr, INTERP: tl.constexpr):
    """fp16 V^T operands (a, b) of positions `off` of a position-major V page (kv_format)
    with their scales [NB, N] (v_scales_t), code rows by positions: q8_0: a = [D, N] rows in
    value order, b unused (= a); q4_0: a = [D/2, N] the low-nibble values (row 16 k + j =
    value 32 k + j), b the high ones (value 32 k + 16 + j). Each is code * scale, one
    rounding. Codes are read as runs of contiguous positions, unmasked: `scales` must be 0
    at positions past the context (v_scales_t's mask)."""
    W: tl.constexpr = D if V_TYPE == 8 else D // 2
    return scaled_v_codes_t(v_code_rows(vals, phys, head, off, page_elems, P, W), scales,
                            BLOCK_N, D, V_TYPE, INTERP)


@triton.jit
def v_code_rows(vals, phys, head, off, page_elems, P: tl.constexpr, W: tl.constexpr):
    """Code bytes [W, N] of a position-major V page: the W code rows of `head` at page
    offsets `off`, unmasked (their scales mask the tail)."""
    c = tl.arange(0, W)
    return tl.load(vals + phys * page_elems + (head * W + c[:, None]) * P + off[None, :])


@triton.jit
def scaled_v_codes_t(codes, scales, BLOCK_N: tl.constexpr, D: tl.constexpr,
                     V_TYPE: tl.constexpr, INTERP: tl.constexpr):
    """V code bytes [W, N] (rows as in v_operands_t) times their scales [NB, N]: the fp16
    operands (a, b) of v_operands_t."""
    NB: tl.constexpr = D // 32
    W: tl.constexpr = D if V_TYPE == 8 else D // 2
    if V_TYPE == 8:
        sw = tl.reshape(tl.broadcast_to(scales[:, None, :], (NB, 32, BLOCK_N)), (D, BLOCK_N))
        va = q8_codes_f16(codes, INTERP) * sw
        vb = va
    else:
        sw = tl.reshape(tl.broadcast_to(scales[:, None, :], (NB, 16, BLOCK_N)), (W, BLOCK_N))
        lo, hi = q4_codes_f16(codes, INTERP)
        va = lo * sw
        vb = hi * sw
    return va, vb


@triton.jit
def v_blocks(vals, scl, phys, head, off, mask, page_elems, page_halves, code_halves,
             BLOCK_N: tl.constexpr, D: tl.constexpr, P: tl.constexpr, V_TYPE: tl.constexpr,
             INTERP: tl.constexpr):
    """The P @ V operands [N, D] (q8_0) or [N, D/2] (q4_0 halves) of v_operands_t, with the
    tile's scales read here; the contraction runs along the codes' contiguous positions, so
    the tensor-core operand needs no byte shuffles."""
    s = v_scales_t(scl, phys, head, off, mask, page_halves, code_halves, D, P)
    va, vb = v_operands_t(vals, phys, head, off, page_elems, s, BLOCK_N, D, P, V_TYPE, INTERP)
    return tl.trans(va), tl.trans(vb)


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
              K_TYPE: tl.constexpr, INTERP: tl.constexpr):
    """Scores [M, N] (fp32, before the softmax scale) of the query rows `qrow` (pointers,
    any float dtype, read as fp16) against K rows `row` (head * P + position in page) of
    physical page `phys`: one dot per 32-value block (the query block is re-read from L1; a
    batched 3-D dot put the blocks across warps and replicated the softmax), times the
    block's scale.
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
            qb = tl.load(qrow[:, None] + b * 32 + j[None, :], mask=row_ok[:, None],
                         other=0.0).to(tl.float16)
            part = tl.dot(qb, q8_codes_f16(c, INTERP))
        else:
            j = tl.arange(0, 16)
            byte = tl.load(base + row[None, :] * (D // 2) + b * 16 + j[:, None])
            qa = tl.load(qrow[:, None] + b * 32 + j[None, :], mask=row_ok[:, None],
                         other=0.0).to(tl.float16)
            qb = tl.load(qrow[:, None] + b * 32 + 16 + j[None, :], mask=row_ok[:, None],
                         other=0.0).to(tl.float16)
            lo, hi = q4_codes_f16(byte, INTERP)
            part = tl.dot(qa, lo)
            part = tl.dot(qb, hi, part)
        s += part * sc[None, :]
    return s
