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
    "Q3_K": ("qs", "hmask", "scales", "d"), "Q4_K": ("qs", "scales", "d", "dmin"),
    "Q5_K": ("qs", "qh", "scales", "d", "dmin"), "Q6_K": ("ql", "qh", "scales", "d"),
    "IQ4_XS": ("qs", "scales_l", "scales_h", "d"),
}


@triton.jit
def iq4_value(nib):
    """ggml's IQ4 codebook entry (kvalues_iq4nl: -127, -104, .., 113) of a nibble, exactly:
    a quartic through the 16 entries lies within 0.48 of each, so it rounds to them. No
    table load: a gather inside the loop, which the pipeliner staged through shared memory
    (320 KB for the GEMM)."""
    x = nib.to(tl.float32)
    p = (((0.0013247202 * x + 0.0412168242) * x - 1.5001835823) * x + 24.7432460785) * x
    return tl.floor(p - 126.5436019897)


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
    """The tile's code bytes [BN, G, S] (uint8 as int32; F16 / BF16: the fp32 values).
    row: [BN, 1, 1] uint8 pointers to the rows; kb0: the tile's first block; ok: [BN, G, S]
    mask of real rows and blocks."""
    g, s = _gs(G, S)
    if QT == F16:
        p = (row + OA).to(tl.pointer_type(tl.float16)) + kb0 * 32 + (32 * g + s)[None]
        return tl.load(p, mask=ok, other=0.0).to(tl.float32)
    elif QT == BF16:
        p = (row + OA).to(tl.pointer_type(tl.bfloat16)) + kb0 * 32 + (32 * g + s)[None]
        return tl.load(p, mask=ok, other=0.0).to(tl.float32)
    else:
        return tl.load(row + OA + kb0 * (S * GPB) + (S * g + s)[None], mask=ok,
                       other=0).to(tl.int32)


@triton.jit
def _f16(row, off, idx, ok):
    return tl.load((row + off).to(tl.pointer_type(tl.float16)) + idx, mask=ok,
                   other=0.0).to(tl.float32)


@triton.jit
def _u8(row, off, idx, ok):
    return tl.load(row + off + idx, mask=ok, other=0).to(tl.int32)


@triton.jit
def _k4_scale_min(row, OB, blk, j, ok):
    """Q4_K / Q5_K: the 6-bit scale and min number j (0..7) of block blk (ggml's
    get_scale_min_k4 over the 12 scale bytes)."""
    base = blk * 12
    lo = j < 4
    a = _u8(row, OB, base + j, ok)                               # bytes j (j < 4)
    b = _u8(row, OB, base + j + 4, ok)                           # bytes j + 4
    c = _u8(row, OB, base + tl.where(lo, j, j - 4), ok)          # bytes j - 4 (j >= 4)
    sc = tl.where(lo, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def part_values(QT: tl.constexpr, P: tl.constexpr, q, row, kb0, OB, OC, OD, OE,
                okg, G: tl.constexpr, S: tl.constexpr):
    """fp32 values [BN, G, S] of part P from the code bytes q (load_codes). okg: [BN, G, 1]
    mask of real rows and blocks (scale loads)."""
    g, s = _gs(G, S)
    g = g[None]                                   # [1, G, 1]
    s = s[None]                                   # [1, 1, S]
    if QT == F16 or QT == BF16:
        return q
    elif QT == Q8_0:
        d = _f16(row, OB, kb0 + g, okg)
        return d * (q - ((q & 128) << 1)).to(tl.float32)       # int8 from its byte
    elif QT == Q4_0 or QT == IQ4_NL or QT == Q4_1:
        blk = kb0 + g
        nib = (q >> (4 * P)) & 15
        d = _f16(row, OB, blk, okg)
        if QT == Q4_0:
            return d * (nib - 8).to(tl.float32)
        elif QT == IQ4_NL:
            return d * iq4_value(nib)
        else:
            return d * nib.to(tl.float32) + _f16(row, OC, blk, okg)
    elif QT == Q5_0 or QT == Q5_1:
        blk = kb0 + g
        if QT == Q5_0:
            qh_off = OC
        else:
            qh_off = OD
        qh = tl.load((row + qh_off).to(tl.pointer_type(tl.uint32)) + blk, mask=okg, other=0)
        hi = ((qh >> (s + 16 * P).to(tl.uint32)) & 1).to(tl.int32)
        v = ((q >> (4 * P)) & 15) | (hi << 4)
        d = _f16(row, OB, blk, okg)
        if QT == Q5_0:
            return d * (v - 16).to(tl.float32)
        else:
            return d * v.to(tl.float32) + _f16(row, OC, blk, okg)
    elif QT == Q4_K or QT == Q5_K:
        blk = kb0 + g // 4
        j = 2 * (g % 4) + P
        if QT == Q4_K:
            sc, mn = _k4_scale_min(row, OB, blk, j, okg)
            d, dmin = _f16(row, OC, blk, okg), _f16(row, OD, blk, okg)
            v = (q >> (4 * P)) & 15
        else:
            sc, mn = _k4_scale_min(row, OC, blk, j, okg)
            d, dmin = _f16(row, OD, blk, okg), _f16(row, OE, blk, okg)
            h = (_u8(row, OB, blk * 32 + s, okg) >> j) & 1
            v = ((q >> (4 * P)) & 15) | (h << 4)
        return (d * sc) * v.to(tl.float32) - dmin * mn
    elif QT == Q6_K:
        blk = kb0 + g // 8
        r = g % 8
        hf = r // 4
        a = (r % 4) // 2
        u = r % 2
        h = (_u8(row, OB, blk * 64 + 32 * hf + 16 * u + s, okg) >> (2 * a + 4 * P)) & 3
        v = ((q >> (4 * P)) & 15) | (h << 4)
        sc = _u8(row, OC, blk * 16 + 8 * hf + 2 * a + u + 4 * P, okg)
        sc = sc - ((sc & 128) << 1)                               # int8
        d = _f16(row, OD, blk, okg)
        return (d * sc.to(tl.float32)) * (v - 32).to(tl.float32)
    elif QT == Q2_K:
        blk = kb0 + g // 4
        hf = (g % 4) // 2
        u = g % 2
        b = _u8(row, OB, blk * 16 + 8 * hf + 2 * P + u, okg)
        d, dmin = _f16(row, OC, blk, okg), _f16(row, OD, blk, okg)
        v = (q >> (2 * P)) & 3
        return (d * (b & 15).to(tl.float32)) * v.to(tl.float32) - dmin * (b >> 4).to(tl.float32)
    elif QT == Q3_K:
        blk = kb0 + g // 4
        hf = (g % 4) // 2
        u = g % 2
        i = 8 * hf + 2 * P + u                                    # scale number 0..15
        low = (_u8(row, OC, blk * 12 + i % 8, okg) >> (4 * (i // 8))) & 15
        high = (_u8(row, OC, blk * 12 + 8 + i % 4, okg) >> (2 * (i // 4))) & 3
        sc = (low | (high << 4)) - 32
        m = (_u8(row, OB, blk * 32 + 16 * u + s, okg) >> (4 * hf + P)) & 1
        v = ((q >> (2 * P)) & 3) - 4 * (1 - m)
        return (_f16(row, OD, blk, okg) * sc.to(tl.float32)) * v.to(tl.float32)
    else:  # IQ4_XS
        blk = kb0 + g // 8
        ib = g % 8
        lo = (_u8(row, OB, blk * 4 + ib // 2, okg) >> (4 * (ib % 2))) & 15
        sh = tl.load((row + OC).to(tl.pointer_type(tl.uint16)) + blk, mask=okg,
                     other=0).to(tl.int32)
        ls = lo | (((sh >> (2 * ib)) & 3) << 4)
        d = _f16(row, OD, blk, okg) * (ls - 32).to(tl.float32)
        return d * iq4_value((q >> (4 * P)) & 15)
