"""Triton dequantization of one tile of planar GGUF weight rows (ops/qlinear/formats.py).

A tile is NB blocks of BN rows. Its code bytes are loaded once as a [BN, G, S] array: G
groups of S contiguous bytes (S * g + s inside the tile's run of the codes plane, so the
loads are long and aligned). Each byte holds PARTS values (two nibbles, four 2-bit codes,
or one whole code); `part_values(P)` turns the bytes into part P's fp32 values, [BN, G, S],
and `part_elems(P)` says which element of the tile (0 .. BK - 1) each of them is. The
kernels never put values back in element order: they read the activations at those
element indices instead (a dot product does not care about order), so a nibble never
moves between registers. A group's S values share one scale, loaded once a group.

QT is the ggml type id; the plane offsets OA..OE (bytes inside a planar row) name the
type's fields in the order `FIELD_ORDER` gives. F16 / BF16 rows are values: tiles of
32-element pseudo-blocks, masked per element, so any K works.
"""
from __future__ import annotations

import triton
import triton.language as tl

# ggml type ids, as constexprs the kernels compare QT with
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (tl.constexpr(i) for i in (1, 2, 3, 6, 7, 8))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (tl.constexpr(i) for i in (10, 11, 12, 13, 14))
IQ4_NL, IQ4_XS, BF16 = (tl.constexpr(i) for i in (20, 23, 30))

# which planar fields the kernels' offsets OA, OB, ... point at, per type
FIELD_ORDER = {
    "F16": ("v",), "BF16": ("v",), "Q8_0": ("qs", "d"), "Q4_0": ("qs", "d"),
    "IQ4_NL": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "Q5_0": ("qs", "d", "qh"),
    "Q5_1": ("qs", "d", "m", "qh"), "Q2_K": ("qs", "scales", "d", "dmin"),
    "Q3_K": ("qs", "hmask", "scales", "d"), "Q4_K": ("qs", "scale_min", "d", "dmin"),
    "Q5_K": ("qs", "qh", "scale_min", "d", "dmin"), "Q6_K": ("ql", "qh", "scales", "d"),
    "IQ4_XS": ("qs", "scales_l", "scales_h", "d"),
}


MAGIC = tl.constexpr(8388608.0)        # 2^23: the fp32 whose bits are 0x4B000000


@triton.jit
def small_f32(v):
    """int32 v (0 <= v < 2^23) as fp32 without a conversion instruction: the bits of 2^23
    with v in the mantissa are 2^23 + v exactly, less 2^23. (I2F issues at an eighth of the
    FMA rate on Hopper; it limited the GEMV.)"""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC


# bytes 0..3 of t into outputs 0..3 as 0x4B0000bb (selector: t's byte k, two zero bytes
# and the 0x4B of the second operand)
_PUT_BYTES = ("prmt.b32 $0, t, 0x4b000000, 0x7540; prmt.b32 $1, t, 0x4b000000, 0x7541; "
              "prmt.b32 $2, t, 0x4b000000, 0x7542; prmt.b32 $3, t, 0x4b000000, 0x7543; }")
_LOW_NIBBLE_ASM = tl.constexpr("{ .reg .b32 t; and.b32 t, $4, 0x0f0f0f0f; " + _PUT_BYTES)
_HIGH_NIBBLE_ASM = tl.constexpr("{ .reg .b32 t; shr.b32 t, $4, 4; and.b32 t, t, 0x0f0f0f0f; "
                                + _PUT_BYTES)
_INT8_ASM = tl.constexpr("{ .reg .b32 t; xor.b32 t, $4, 0x80808080; " + _PUT_BYTES)
# IQ4: the nibbles of four bytes looked up in ggml's codebook (kvalues_iq4nl as int8 bytes,
# entries 0-7 in k0:k1, 8-15 in k2:k3) by byte permutes, then as int8 above. A permute
# takes a 3-bit index (bit 3 of a selector nibble asks for sign replication), so both
# halves are looked up and a third permute picks per byte by the index's bit 3.
_IQ4_LOOKUP = (
    " .reg .b32 x, s, s7, lo, hi, m;"
    " shr.b32 x, t, 4; or.b32 x, x, t; prmt.b32 s, x, 0, 0x4420;"   # nibbles n0 n1 n2 n3
    " and.b32 s7, s, 0x7777; prmt.b32 lo, $5, $9, s7; prmt.b32 hi, $13, $17, s7;"
    " shr.b32 m, s, 1; and.b32 m, m, 0x4444; or.b32 m, m, 0x3210; prmt.b32 t, lo, hi, m;"
    " xor.b32 t, t, 0x80808080; ")
# ggml's IQ4 codebook (kvalues_iq4nl) as int8 bytes, four entries a word
CODEBOOK = tl.constexpr((-1079142271, -152379953, 639175937, 1901675829))
_IQ4_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r" + ",r" * 16)
_IQ4_LOW_ASM = tl.constexpr("{ .reg .b32 t; and.b32 t, $4, 0x0f0f0f0f;" + _IQ4_LOOKUP
                            + _PUT_BYTES)
_IQ4_HIGH_ASM = tl.constexpr("{ .reg .b32 t; shr.b32 t, $4, 4; and.b32 t, t, 0x0f0f0f0f;"
                             + _IQ4_LOOKUP + _PUT_BYTES)


@triton.jit
def nibble_f32(q, P: tl.constexpr, EXACT: tl.constexpr):
    """fp32 nibble P (0: low, 1: high) of each uint8 code byte. Compiled (EXACT): four
    bytes a register, one mask for the four and a byte permute each, putting the nibble
    under the 2^23 exponent (small_f32) without a shift; the interpreter computes the same."""
    if EXACT:
        if P == 0:
            v = tl.inline_asm_elementwise(_LOW_NIBBLE_ASM, "=r,=r,=r,=r,r", [q], dtype=tl.int32,
                                          is_pure=True, pack=4)
        else:
            v = tl.inline_asm_elementwise(_HIGH_NIBBLE_ASM, "=r,=r,=r,=r,r", [q], dtype=tl.int32,
                                          is_pure=True, pack=4)
        return v.to(tl.float32, bitcast=True) - MAGIC
    else:
        return small_f32((q.to(tl.int32) >> (4 * P)) & 15)


@triton.jit
def int8_f32(q, EXACT: tl.constexpr):
    """fp32 of each uint8 code byte read as int8 (Q8_0): the sign bit flipped (byte + 128)
    under the 2^23 exponent, less 2^23 + 128."""
    if EXACT:
        v = tl.inline_asm_elementwise(_INT8_ASM, "=r,=r,=r,=r,r", [q], dtype=tl.int32,
                                      is_pure=True, pack=4)
    else:
        v = (q.to(tl.int32) ^ 128) | 0x4B000000
    return v.to(tl.float32, bitcast=True) - (MAGIC + 128.0)


@triton.jit
def codebook_words(like):
    """The four CODEBOOK words as int32 tensors of `like`'s shape (inline-asm operands)."""
    return (tl.full(like.shape, CODEBOOK[0], tl.int32), tl.full(like.shape, CODEBOOK[1], tl.int32),
            tl.full(like.shape, CODEBOOK[2], tl.int32), tl.full(like.shape, CODEBOOK[3], tl.int32))


@triton.jit
def iq4_f32(q, P: tl.constexpr, EXACT: tl.constexpr):
    """fp32 IQ4 codebook entry of nibble P of each uint8 code byte: compiled, byte permutes
    (_IQ4_LOW_ASM / _IQ4_HIGH_ASM, about five instructions a value); the interpreter, the
    exact quartic iq4_value."""
    if EXACT:
        # the codebook words as operands (four copies each, one a packed value): constants
        # the compiler keeps in registers across the loop
        k0, k1, k2, k3 = codebook_words(q)
        if P == 0:
            v = tl.inline_asm_elementwise(_IQ4_LOW_ASM, _IQ4_CONSTRAINTS, [q, k0, k1, k2, k3],
                                          dtype=tl.int32, is_pure=True, pack=4)
        else:
            v = tl.inline_asm_elementwise(_IQ4_HIGH_ASM, _IQ4_CONSTRAINTS, [q, k0, k1, k2, k3],
                                          dtype=tl.int32, is_pure=True, pack=4)
        return v.to(tl.float32, bitcast=True) - (MAGIC + 128.0)
    else:
        return iq4_value(nibble_f32(q, P, EXACT))


@triton.jit
def iq4_value(x):
    """ggml's IQ4 codebook entry (kvalues_iq4nl: -127, -104, .., 113) of a nibble x (fp32
    0..15), exactly: a quartic through the 16 entries lies within 0.48 of each, so rounding
    it (1.5 * 2^23 added and taken away: fp32 adds round to integers there) gives them. No
    table load: a gather inside the loop, which the pipeliner staged through shared memory
    (320 KB for the GEMM)."""
    p = (((0.0013247202 * x + 0.0412168242) * x - 1.5001835823) * x + 24.7432460785) * x \
        - 127.0436019897
    return (p + 12582912.0) - 12582912.0


def geometry(type_name: str) -> tuple[int, int, int, int]:
    """(values a block for tiling, PARTS values a code byte, S bytes a group, groups a
    block) of a type."""
    if type_name in ("F16", "BF16", "Q8_0"):
        return 32, 1, 32, 1
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"):
        return 32, 2, 16, 1
    if type_name in ("Q4_K", "Q5_K"):
        return 256, 2, 32, 4
    if type_name in ("Q6_K", "IQ4_XS"):
        return 256, 2, 16, 8
    if type_name in ("Q2_K", "Q3_K"):
        return 256, 4, 16, 4
    raise KeyError(type_name)


@triton.jit
def _gs(G: tl.constexpr, S: tl.constexpr):
    return tl.arange(0, G)[:, None], tl.arange(0, S)[None, :]


@triton.jit
def part_elems(QT: tl.constexpr, P: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    """[G, S] int32: the tile element each value of part P is."""
    g, s = _gs(G, S)
    return elems_at(QT, P, g, s)


@triton.jit
def elems_at(QT: tl.constexpr, P: tl.constexpr, g, s):
    """The tile element of part P's value in code byte s of group g (int32 tensors that
    broadcast together)."""
    if QT == F16 or QT == BF16 or QT == Q8_0:
        e = 32 * g + s
    elif QT == Q4_K or QT == Q5_K:
        e = 64 * g + 32 * P + s
    elif QT == Q6_K:
        e = 128 * (g // 4) + 16 * (g % 4) + 64 * P + s
    elif QT == Q2_K or QT == Q3_K:
        e = 128 * (g // 2) + 16 * (g % 2) + 32 * P + s
    else:  # Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL IQ4_XS: 32-value sub-blocks, low then high nibbles
        e = 32 * g + 16 * P + s
    return e


@triton.jit
def load_codes(QT: tl.constexpr, row, kb0, OA, ok, G: tl.constexpr, S: tl.constexpr,
               GPB: tl.constexpr):
    """The tile's code bytes [BN, G, S] (uint8; F16 / BF16: the fp32 values).
    row: [BN, 1, 1] uint8 pointers to the rows; kb0: the tile's first block; ok: [BN, G, S]
    mask of real rows and blocks."""
    g, s = _gs(G, S)
    if QT == F16:
        p = (row + OA).to(tl.pointer_type(tl.float16)) + kb0 * 32 + (32 * g + s)[None]
        return _load(p, ok).to(tl.float32)
    elif QT == BF16:
        p = (row + OA).to(tl.pointer_type(tl.bfloat16)) + kb0 * 32 + (32 * g + s)[None]
        return _load(p, ok).to(tl.float32)
    else:
        return _load(row + OA + kb0 * (S * GPB) + (S * g + s)[None], ok)


@triton.jit
def _load(p, mask):
    """Load, zeros where `mask` is false; mask None: every lane real (no predicate)."""
    if mask is None:
        return tl.load(p)
    else:
        return tl.load(p, mask=mask, other=0)


@triton.jit
def _f16(row, off, idx, ok):
    return _load((row + off).to(tl.pointer_type(tl.float16)) + idx, ok).to(tl.float32)


@triton.jit
def _u8(row, off, idx, ok):
    return _load(row + off + idx, ok).to(tl.int32)


@triton.jit
def _k4_scale_min(row, OB, blk, j, ok):
    """Q4_K / Q5_K: scale and min number j (0..7) of block blk, from the planar scale_min
    field (formats.unpack_k_scales: a byte each)."""
    return (small_f32(_u8(row, OB, blk * 16 + j, ok)),
            small_f32(_u8(row, OB, blk * 16 + 8 + j, ok)))


@triton.jit
def part_values(QT: tl.constexpr, P: tl.constexpr, q, row, kb0, OB, OC, OD, OE,
                okg, G: tl.constexpr, S: tl.constexpr, EXACT: tl.constexpr):
    """fp32 values [BN, G, S] of part P from the code bytes q (load_codes). okg: [BN, G, 1]
    mask of real rows and blocks (scale loads)."""
    v = part_codes(QT, P, q, row, kb0, OB, OC, OD, okg, G, S, EXACT)
    sc, mn = part_affine(QT, P, row, kb0, OB, OC, OD, OE, okg, tl.arange(0, G)[None, :, None])
    return sc * v - mn


@triton.jit
def part_codes(QT: tl.constexpr, P: tl.constexpr, q, row, kb0, OB, OC, OD, okg,
               G: tl.constexpr, S: tl.constexpr, EXACT: tl.constexpr):
    """Part P's codes as fp32 [BN, G, S], before their group's scale: value = scale * code
    - offset (part_affine). Small integers (the IQ4 codebook's entries, F16 / BF16: the
    values themselves)."""
    g, s = _gs(G, S)
    g = g[None]                                   # [1, G, 1]
    s = s[None]                                   # [1, 1, S]
    if QT == F16 or QT == BF16:
        return q
    elif QT == Q8_0:
        return int8_f32(q, EXACT)
    elif QT == Q4_0 or QT == Q4_1 or QT == Q4_K:
        return nibble_f32(q, P, EXACT)
    elif QT == IQ4_NL or QT == IQ4_XS:
        return iq4_f32(q, P, EXACT)
    elif QT == Q5_0 or QT == Q5_1:
        if QT == Q5_0:
            qh_off = OC
        else:
            qh_off = OD
        qh = _load((row + qh_off).to(tl.pointer_type(tl.uint32)) + kb0 + g, okg)
        hi = ((qh >> (s + 16 * P).to(tl.uint32)) & 1).to(tl.int32)
        return small_f32(((q.to(tl.int32) >> (4 * P)) & 15) | (hi << 4))
    elif QT == Q5_K:
        j = 2 * (g % 4) + P
        h = (_u8(row, OB, (kb0 + g // 4) * 32 + s, okg) >> j) & 1
        return small_f32(((q.to(tl.int32) >> (4 * P)) & 15) | (h << 4))
    elif QT == Q6_K:
        r = g % 8
        h = _u8(row, OB, (kb0 + g // 8) * 64 + 32 * (r // 4) + 16 * (r % 2) + s, okg)
        h = (h >> (2 * ((r % 4) // 2) + 4 * P)) & 3
        return small_f32(((q.to(tl.int32) >> (4 * P)) & 15) | (h << 4))
    elif QT == Q2_K:
        return small_f32((q.to(tl.int32) >> (2 * P)) & 3)
    else:  # Q3_K: 2 low bits and the hmask bit, offset by 4 (part_affine takes 4 away)
        m = _u8(row, OB, (kb0 + g // 4) * 32 + 16 * (g % 2) + s, okg)
        m = (m >> (4 * ((g % 4) // 2) + P)) & 1
        return small_f32(((q.to(tl.int32) >> (2 * P)) & 3) | (m << 2))


@triton.jit
def part_affine(QT: tl.constexpr, P: tl.constexpr, row, kb0, OB, OC, OD, OE, okg, g):
    """(scale, offset) fp32 of part P's groups g (tile group numbers, e.g. [1, G, 1]; the
    result takes the shape of row and g): value = scale * code - offset (part_codes). The
    plane offsets follow FIELD_ORDER (the codes' plane is OA). okg: mask of the loads (g's
    shape), or None (every row and block real)."""
    if QT == F16 or QT == BF16:
        return tl.full(g.shape, 1.0, tl.float32), tl.zeros(g.shape, tl.float32)
    elif QT == Q8_0 or QT == IQ4_NL:
        return _f16(row, OB, kb0 + g, okg), tl.zeros(g.shape, tl.float32)
    elif QT == Q4_0:
        d = _f16(row, OB, kb0 + g, okg)
        return d, 8.0 * d
    elif QT == Q5_0:
        d = _f16(row, OB, kb0 + g, okg)
        return d, 16.0 * d
    elif QT == Q4_1 or QT == Q5_1:                # value = d * code + m
        return _f16(row, OB, kb0 + g, okg), -_f16(row, OC, kb0 + g, okg)
    elif QT == Q4_K or QT == Q5_K:
        blk = kb0 + g // 4
        j = 2 * (g % 4) + P
        if QT == Q4_K:
            sc, mn = _k4_scale_min(row, OB, blk, j, okg)
            d, dmin = _f16(row, OC, blk, okg), _f16(row, OD, blk, okg)
        else:
            sc, mn = _k4_scale_min(row, OC, blk, j, okg)
            d, dmin = _f16(row, OD, blk, okg), _f16(row, OE, blk, okg)
        return d * sc, dmin * mn
    elif QT == Q6_K:
        blk = kb0 + g // 8
        r = g % 8
        sc = _u8(row, OC, blk * 16 + 8 * (r // 4) + 2 * ((r % 4) // 2) + r % 2 + 4 * P, okg)
        sc = small_f32(sc ^ 128) - 128.0                           # int8
        d = _f16(row, OD, blk, okg) * sc
        return d, 32.0 * d
    elif QT == Q2_K:
        blk = kb0 + g // 4
        b = _u8(row, OB, blk * 16 + 8 * ((g % 4) // 2) + 2 * P + g % 2, okg)
        d, dmin = _f16(row, OC, blk, okg), _f16(row, OD, blk, okg)
        return d * small_f32(b & 15), dmin * small_f32(b >> 4)
    elif QT == Q3_K:
        blk = kb0 + g // 4
        i = 8 * ((g % 4) // 2) + 2 * P + g % 2                    # scale number 0..15
        low = (_u8(row, OC, blk * 12 + i % 8, okg) >> (4 * (i // 8))) & 15
        high = (_u8(row, OC, blk * 12 + 8 + i % 4, okg) >> (2 * (i // 4))) & 3
        d = _f16(row, OD, blk, okg) * (small_f32(low | (high << 4)) - 32.0)
        return d, 4.0 * d
    else:  # IQ4_XS
        blk = kb0 + g // 8
        ib = g % 8
        lo = (_u8(row, OB, blk * 4 + ib // 2, okg) >> (4 * (ib % 2))) & 15
        sh = _load((row + OC).to(tl.pointer_type(tl.uint16)) + blk, okg).to(tl.int32)
        ls = lo | (((sh >> (2 * ib)) & 3) << 4)
        d = _f16(row, OD, blk, okg) * (small_f32(ls) - 32.0)
        return d, tl.zeros(g.shape, tl.float32)
