"""One-row quantized GEMV on integer dot products (PTX dp4a: four byte products summed
into an int32 in one instruction).

The float one-row kernel (`triton_kernel._qgemv_row`) turns every code into fp32 and
multiplies it: about five instructions a value, more than the H200 issues per weight byte
at its HBM rate. Here the activations of a tile are turned into integers once, shared by
the rows a program walks:

- a group's S activations (one scale group of the weight) get a power-of-two scale
  2^(14 - E), E the exponent of their largest magnitude, so each becomes an integer v with
  |v| < 2^15: exact for every bf16 / fp16 value within 2^-7 of the group's largest (their
  8 / 11 significant bits land above the binary point), rounded to 2^-14 of it otherwise;
- v is held as two byte planes, v = 256 * hi + lo (hi signed, lo unsigned), packed four
  to a word in element order;
- a word of code bytes (4 codes: int8 for Q8_0 and the IQ4 codebook, nibbles for Q4_*, the
  high ones times 16 so no shift is needed) meets each plane in one dp4a, and the words'
  int32 sums become fp32 once a group (exact: every sum is below 2^22).

Then value = scale * code - offset gives, per group, scale * dx * sum(code * v) - offset *
sum(x), as in the float kernel. Compiled (EXACT), the byte work is inline PTX (prmt, dp4a);
the interpreter computes the same integers with shifts and masks.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.ops.gemv.triton_kernel import _weight_rows, store_row, weight_row
from kvcompile.ops.pdl import wait_for_producers
from kvcompile.ops.qlinear.dequant import (IQ4_NL, IQ4_XS, Q8_0, _load, codebook_words,
                                           elems_at, iq4_value, part_affine)

# the types this kernel takes (dequant.geometry: 32-value groups, or 16 for IQ4 / Q4_0..)
INT_DOT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "Q4_K")
# where it is the default (row_config): ahead of the float kernel in the one-row sweep
# (docs/findings.md, "Quantized weights")
INT_DOT_DEFAULT = ("IQ4_NL", "IQ4_XS")

ROUND = tl.constexpr(12582912.0)       # 1.5 * 2^23: an fp32 add rounds to an integer there
ROUND_BITS = tl.constexpr(0x4B400000)  # its bits; their low 16 are zero

# four words (one byte plane's value each, low 16 bits v) -> the low bytes and the high
# bytes of the four, packed in order
_PACK_ASM = tl.constexpr(
    "{ .reg .b32 a, b; prmt.b32 a, $2, $3, 0x5140; prmt.b32 b, $4, $5, 0x5140;"
    " prmt.b32 $0, a, b, 0x5410; prmt.b32 $1, a, b, 0x7632; }")


def _dot_asm(code: str, signed: bool, words: int) -> str:
    """PTX: a group's code words ($2 ..) made codes by `code` (t from w), dotted with as
    many high-plane words into $0 and low-plane words into $1, the products of each plane
    chained through dp4a's accumulator."""
    a = "s32" if signed else "u32"
    out = ["{ .reg .b32 h, l; mov.b32 h, 0; mov.b32 l, 0;"]
    for i in range(words):
        w, hi, lo = 2 + i, 2 + words + i, 2 + 2 * words + i
        out.append(f" {{ .reg .b32 w, t; mov.b32 w, ${w};{code}"
                   f" dp4a.{a}.s32 h, t, ${hi}, h; dp4a.{a}.u32 l, t, ${lo}, l; }}")
    out.append(" mov.b32 $0, h; mov.b32 $1, l; }")
    return "".join(out)


# IQ4: a word's eight nibbles looked up in the codebook (words $3..$6) by byte permutes,
# four at a time (a selector nibble's bit 3 picks the entries 8-15), then the values of
# the low nibbles into $0 and of the high nibbles into $1, in byte order
_IQ4_CODES_ASM = tl.constexpr(
    "{ .reg .b32 s, m, s1, m1, a, b, t0, t1;"
    " and.b32 s, $2, 0x77777777; shr.b32 m, $2, 1; and.b32 m, m, 0x44444444;"
    " or.b32 m, m, 0x32103210; shr.b32 s1, s, 16; shr.b32 m1, m, 16;"
    " prmt.b32 a, $3, $4, s; prmt.b32 b, $5, $6, s; prmt.b32 t0, a, b, m;"
    " prmt.b32 a, $3, $4, s1; prmt.b32 b, $5, $6, s1; prmt.b32 t1, a, b, m1;"
    " prmt.b32 $0, t0, t1, 0x6420; prmt.b32 $1, t0, t1, 0x7531; }")
_LOW, _HIGH = " and.b32 t, w, 0x0f0f0f0f;", " and.b32 t, w, 0xf0f0f0f0;"
_IQ4_ASM = tl.constexpr(_dot_asm(" mov.b32 t, w;", True, 4))                # 16-byte groups
_Q4_LOW_ASM, _Q4_HIGH_ASM = (tl.constexpr(_dot_asm(c, False, 4)) for c in (_LOW, _HIGH))
_Q4K_LOW_ASM, _Q4K_HIGH_ASM = (tl.constexpr(_dot_asm(c, False, 8)) for c in (_LOW, _HIGH))
_Q8_ASM = tl.constexpr(_dot_asm(" mov.b32 t, w;", True, 8))                 # 32-byte groups


@triton.jit
def _split4(t):
    """[..., 4] -> its four [...] slices in order."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _byte(w, k: tl.constexpr, SIGNED: tl.constexpr):
    b = (w >> (8 * k)) & 255
    if SIGNED:
        b = tl.where(b > 127, b - 256, b)
    return b


@triton.jit
def _pack(v0, v1, v2, v3, EXACT: tl.constexpr):
    """(low bytes, high bytes) of four int32s, each packed into one word in order."""
    if EXACT:
        lo, hi = tl.inline_asm_elementwise(_PACK_ASM, "=r,=r,r,r,r,r", [v0, v1, v2, v3],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = (v0 & 255) | ((v1 & 255) << 8) | ((v2 & 255) << 16) | ((v3 & 255) << 24)
        hi = (((v0 >> 8) & 255) | (((v1 >> 8) & 255) << 8) | (((v2 >> 8) & 255) << 16)
              | (((v3 >> 8) & 255) << 24))
    return lo, hi


@triton.jit
def _values(p, DTYPE: tl.constexpr):
    """fp32 (first, second) of int32 words each holding two bf16 / fp16 values."""
    if DTYPE == tl.bfloat16:
        return (p << 16).to(tl.float32, bitcast=True), \
            (p & -65536).to(tl.float32, bitcast=True)
    else:
        return (p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _quarter(x_ptr, QT: tl.constexpr, P: tl.constexpr, kb0, K, BLOCK: tl.constexpr,
             G: tl.constexpr, Q: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 activations of part P's values in code bytes 8Q .. 8Q + 7 of each group, eight
    [1, G] tensors (one pair-of-values load a thread each group: x's values for a part's
    run of codes are contiguous)."""
    g = tl.arange(0, G)[None, :, None]
    e = kb0 * BLOCK + elems_at(QT, P, g, 8 * Q + 2 * tl.arange(0, 4)[None, None, :])
    pairs = (x_ptr + e).to(tl.pointer_type(tl.int32), bitcast=True)
    if EVEN_K:
        w = tl.load(pairs)
    else:
        w = tl.load(pairs, mask=e < K, other=0)
    p0, p1, p2, p3 = _split4(w)
    a0, a1 = _values(p0, DTYPE)
    a2, a3 = _values(p1, DTYPE)
    a4, a5 = _values(p2, DTYPE)
    a6, a7 = _values(p3, DTYPE)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _round(v, mul):
    """Bits of round(v * mul) + 1.5 * 2^23: their low 16 bits are the integer."""
    return (v * mul + ROUND).to(tl.int32, bitcast=True)


@triton.jit
def _words(v, mul, EXACT: tl.constexpr):
    """(high, low) plane words of the eight values v (two words each), scaled by mul."""
    l0, h0 = _pack(_round(v[0], mul), _round(v[1], mul), _round(v[2], mul), _round(v[3], mul),
                   EXACT)
    l1, h1 = _pack(_round(v[4], mul), _round(v[5], mul), _round(v[6], mul), _round(v[7], mul),
                   EXACT)
    return h0, h1, l0, l1


@triton.jit
def _stats(v, amax, sx):
    """amax, sx updated with the largest magnitude and the sum of the eight values v."""
    for i in tl.static_range(8):
        amax = tl.maximum(amax, tl.abs(v[i]))
        sx += v[i]
    return amax, sx


@triton.jit
def x_words(x_ptr, QT: tl.constexpr, P: tl.constexpr, kb0, K, BLOCK: tl.constexpr,
            G: tl.constexpr, S: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr,
            EXACT: tl.constexpr):
    """Part P's activations of a tile as integers, a scale a group: (high plane words,
    low plane words) of each group (S / 4 [1, G] tensors each), the scales dx [1, G]
    (x = dx * (256 * hi + lo)) and the sums of x [1, G]."""
    q0 = _quarter(x_ptr, QT, P, kb0, K, BLOCK, G, 0, EVEN_K, DTYPE)
    q1 = _quarter(x_ptr, QT, P, kb0, K, BLOCK, G, 1, EVEN_K, DTYPE)
    amax, sx = _stats(q0, tl.zeros([1, G], tl.float32), tl.zeros([1, G], tl.float32))
    amax, sx = _stats(q1, amax, sx)
    q2 = q0
    q3 = q1
    if S == 32:
        q2 = _quarter(x_ptr, QT, P, kb0, K, BLOCK, G, 2, EVEN_K, DTYPE)
        q3 = _quarter(x_ptr, QT, P, kb0, K, BLOCK, G, 3, EVEN_K, DTYPE)
        amax, sx = _stats(q2, amax, sx)
        amax, sx = _stats(q3, amax, sx)
    ex = tl.maximum(amax.to(tl.int32, bitcast=True) >> 23, 15)      # biased exponent E + 127
    mul = ((268 - ex) << 23).to(tl.float32, bitcast=True)            # 2^(14 - E)
    dx = ((ex - 14) << 23).to(tl.float32, bitcast=True)              # 2^(E - 14)
    h0, h1, l0, l1 = _words(q0, mul, EXACT)
    h2, h3, l2, l3 = _words(q1, mul, EXACT)
    if S == 32:
        h4, h5, l4, l5 = _words(q2, mul, EXACT)
        h6, h7, l6, l7 = _words(q3, mul, EXACT)
        hi = (h0, h1, h2, h3, h4, h5, h6, h7)
        lo = (l0, l1, l2, l3, l4, l5, l6, l7)
    else:
        hi = (h0, h1, h2, h3)
        lo = (l0, l1, l2, l3)
    return hi, lo, dx, sx


@triton.jit
def _code_word(QT: tl.constexpr, P: tl.constexpr, w):
    """The interpreter's part P codes of a word (part_words'): Q8_0 and IQ4 int8 values
    as they are, the nibble types' low nibbles (P 0) or high nibbles times 16 (P 1)."""
    if QT == Q8_0 or QT == IQ4_NL or QT == IQ4_XS:
        return w
    elif P == 0:
        return w & 0x0F0F0F0F
    else:
        return w & -252645136                                        # 0xF0F0F0F0


@triton.jit
def _iq4_word(w, EXACT: tl.constexpr):
    """The codebook int8s of a word's low nibbles and of its high nibbles, a word each."""
    if EXACT:
        k0, k1, k2, k3 = codebook_words(w)
        return tl.inline_asm_elementwise(
            _IQ4_CODES_ASM, "=r,=r,r,r,r,r,r",
            [w, k0, k1, k2, k3],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = tl.zeros(w.shape, tl.int32)
        hi = tl.zeros(w.shape, tl.int32)
        for i in tl.static_range(4):
            vl = iq4_value(((w >> (8 * i)) & 15).to(tl.float32)).to(tl.int32)
            vh = iq4_value(((w >> (8 * i + 4)) & 15).to(tl.float32)).to(tl.int32)
            lo |= (vl & 255) << (8 * i)
            hi |= (vh & 255) << (8 * i)
        return lo, hi


@triton.jit
def part_words(QT: tl.constexpr, w, EXACT: tl.constexpr):
    """(part 0's, part 1's) code words of a row's words w: the IQ4 types' looked up in the
    codebook (both parts from one lookup), the others' as they are (the dot masks them)."""
    if QT == IQ4_NL or QT == IQ4_XS:
        a0, b0 = _iq4_word(w[0], EXACT)
        a1, b1 = _iq4_word(w[1], EXACT)
        a2, b2 = _iq4_word(w[2], EXACT)
        a3, b3 = _iq4_word(w[3], EXACT)
        return (a0, a1, a2, a3), (b0, b1, b2, b3)
    else:
        return w, w


@triton.jit
def _asm_dot(asm: tl.constexpr, args):
    return tl.inline_asm_elementwise(asm, "=r,=r" + ",r" * len(args), args,
                                     dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _dot_word(QT: tl.constexpr, P: tl.constexpr, w, hi, lo, dh, dl):
    """The interpreter's dp4a: dh, dl plus one word's four products with each plane."""
    SIGNED: tl.constexpr = QT == Q8_0 or QT == IQ4_NL or QT == IQ4_XS
    c = _code_word(QT, P, w)
    for i in tl.static_range(4):
        ci = _byte(c, i, SIGNED)
        dh += ci * _byte(hi, i, True)
        dl += ci * _byte(lo, i, False)
    return dh, dl


@triton.jit
def dot_groups(QT: tl.constexpr, P: tl.constexpr, S: tl.constexpr, w, hi, lo,
               EXACT: tl.constexpr):
    """(sum of code * hi, sum of code * lo) over each group's values of part P, int32
    [1, G]: w, hi, lo lists of S / 4 [1, G] words (codes, x_words' planes)."""
    if EXACT:
        args = w + hi + lo
        if S == 32:
            if QT == Q8_0:
                return _asm_dot(_Q8_ASM, args)
            elif P == 0:
                return _asm_dot(_Q4K_LOW_ASM, args)
            else:
                return _asm_dot(_Q4K_HIGH_ASM, args)
        else:
            if QT == IQ4_NL or QT == IQ4_XS:
                return _asm_dot(_IQ4_ASM, args)
            elif P == 0:
                return _asm_dot(_Q4_LOW_ASM, args)
            else:
                return _asm_dot(_Q4_HIGH_ASM, args)
    else:
        dh = tl.zeros(w[0].shape, tl.int32)
        dl = tl.zeros(w[0].shape, tl.int32)
        for i in tl.static_range(S // 4):
            dh, dl = _dot_word(QT, P, w[i], hi[i], lo[i], dh, dl)
        return dh, dl


@triton.jit
def small_int_f32(v):
    """fp32 of int32 v, |v| < 2^22, by the 1.5 * 2^23 bits (no conversion instruction)."""
    return (v + ROUND_BITS).to(tl.float32, bitcast=True) - ROUND


@triton.jit
def row_part(QT: tl.constexpr, P: tl.constexpr, S: tl.constexpr, w, xq, row, kb0,
             OB, OC, OD, OE, okg, g, EXACT: tl.constexpr):
    """[1, G]: each group's sum(value * x) over part P of one weight row (w: its code
    words, S / 4 [1, G] tensors; xq: x_words of the part); okg: mask of the scale loads (or
    None)."""
    hi, lo, dx, sx = xq
    dh, dl = dot_groups(QT, P, S, w, hi, lo, EXACT)
    dot = small_int_f32(dh) * 256.0 + small_int_f32(dl)
    if QT != Q8_0 and QT != IQ4_NL and QT != IQ4_XS and P == 1:
        dot = dot * 0.0625                                           # the high nibbles' 16
    sc, off = part_affine(QT, P, row, kb0, OB, OC, OD, OE, okg, g)
    return sc * (dot * dx) - off * sx


@triton.jit
def _code_words(row, OA, kb0, wq, okw, S: tl.constexpr, GPB: tl.constexpr):
    """A row's code words of the tile, S / 4 [1, G] tensors (16-byte loads)."""
    words = (row + OA).to(tl.pointer_type(tl.int32)) + kb0 * (S * GPB // 4) + wq
    w0, w1, w2, w3 = _split4(_load(words, okw))
    if S == 32:
        w4, w5, w6, w7 = _split4(_load(words + 4, okw))
        return (w0, w1, w2, w3, w4, w5, w6, w7)
    else:
        return (w0, w1, w2, w3)


@triton.jit
def _qgemv_row_int(x_ptr, w_ptr, b_ptr, y_ptr, N, K, nb, stride_w, OA, OB, OC, OD, OE,
                   QT: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                   S: tl.constexpr, GPB: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                   DTYPE: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """As `_qgemv_row` (BLOCK_N rows walked in turn over each tile of NB blocks, rows past
    N read row N - 1), the tile's activations made integers once for all of them. A
    thread takes whole groups (S code bytes: one or two 16-byte loads)."""
    j = tl.arange(0, BLOCK_N)
    g = tl.arange(0, G)[None, :]                                     # [1, G]
    wq = ((S // 4) * g)[:, :, None] + tl.arange(0, 4)[None, None, :]  # [1, G, 4] words
    wait_for_producers(PDL)
    acc = tl.zeros([BLOCK_N, G], tl.float32)
    for kb0 in range(0, nb, NB):
        if EVEN_K:
            okg = None
            okw = None
        else:
            okg = kb0 + g // GPB < nb                                    # [1, G]
            okw = okg[:, :, None]
        x0 = x_words(x_ptr, QT, 0, kb0, K, BLOCK, G, S, EVEN_K, DTYPE, EXACT)
        x1 = x0
        if PARTS > 1:
            x1 = x_words(x_ptr, QT, 1, kb0, K, BLOCK, G, S, EVEN_K, DTYPE, EXACT)
        for r in tl.static_range(BLOCK_N):
            nr = weight_row(r, BLOCK_N, N, SILU)
            row = w_ptr + tl.minimum(nr, N - 1).to(tl.int64) * stride_w
            w0, w1 = part_words(QT, _code_words(row, OA, kb0, wq, okw, S, GPB), EXACT)
            part = row_part(QT, 0, S, w0, x0, row, kb0, OB, OC, OD, OE, okg, g, EXACT)
            if PARTS > 1:
                part += row_part(QT, 1, S, w1, x1, row, kb0, OB, OC, OD, OE, okg, g, EXACT)
            acc = tl.where(j[:, None] == r, acc + part, acc)
    y = tl.sum(acc, 1)
    store_row(y, _weight_rows(BLOCK_N, N, SILU), b_ptr, y_ptr, N, BLOCK_N, HAS_BIAS, SILU,
              DTYPE, EXACT)
