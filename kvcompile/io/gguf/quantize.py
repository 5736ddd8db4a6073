"""Quantize float rows into GGUF weight blocks, vectorised in torch (CPU or CUDA).

The `gguf` package quantizes only the legacy types; this writes every type the
quantized-linear kernels read, as the raw GGUF row bytes (the block structs of
ggml-common.h, what a .gguf file holds). The choices need not be llama.cpp's, only valid
and close to its quality:

- a (sub-)block's float scale (and min) come from a small search: a few candidate scales
  set the codes, least squares refits the scale (and min) to those codes, the best fit by
  squared error wins, then a few rounds of re-coding and refitting;
- K-quants and IQ4_XS then store the sub-block scales as small integers times the
  super-block's fp16 d (and dmin): the rounded integer or a neighbour, whichever gives the
  least error with the codes set to the nearest levels under the scales as stored.

Scales carry any sign the fit gives (d < 0 is common for the symmetric types: the value of
largest magnitude goes to the longer, negative side of the code range); the K-quant mins
follow llama.cpp (dmin >= 0, min = -dmin * m).

Bytes are the same on every device: the math is elementwise IEEE fp32 ops (no fused
multiply-add), max / min reductions, and sums over fixed halving trees (`tsum`), never a
reduction whose order a backend chooses.
"""
from __future__ import annotations

import gguf
import torch

from kvcompile.errors import UnsupportedModelError
from kvcompile.io.gguf.scale_fit import (Levels, fit_affine, fit_scale, nonzero,
                                         search_best, signed_absmax, tsum)

F16_MAX = 65504.0
# ggml's kvalues_iq4nl: an IQ4 code indexes this codebook
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


# --- roundings -------------------------------------------------------------------------------

def _f16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to a finite fp16, back in fp32."""
    return t.clamp(-F16_MAX, F16_MAX).half().float()


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """Per-block fp16 scales [N, nb, 1, ...] -> bytes [N, nb, 2]."""
    return _f16(t).half().reshape(t.shape[0], t.shape[1], 1).view(torch.uint8)


# --- shared packing -------------------------------------------------------------------------

def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 2m] (0..15) -> bytes [..., m]: element j in the low nibble of byte j,
    element m + j in its high nibble."""
    m = codes.shape[-1] // 2
    return codes[..., :m] | (codes[..., m:] << 4)


def _pack_fields(codes: torch.Tensor, shifts: int) -> torch.Tensor:
    """Codes [..., P, m] -> bytes [..., m]: row p at bits p * shifts of every byte."""
    out = codes[..., 0, :].clone()
    for p in range(1, codes.shape[-2]):
        out |= codes[..., p, :] << (p * shifts)
    return out


def _super_scale(s: torch.Tensor, lv: Levels) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-block float scales [N, nb, J, 1] -> (fp16 super-block d [N, nb, 1, 1] as fp32,
    integer sub-block scales in lv.lo..lv.hi as fp32): the largest magnitude maps to lv.lo
    when it is negative (signed ranges), else to lv.hi."""
    if lv.lo < 0:
        d = _f16(signed_absmax(s, -2) / lv.lo)
    else:
        d = _f16(s.amax(-2, keepdim=True) / lv.hi)
    return d, torch.round(s / nonzero(d)).clamp(lv.lo, lv.hi)


def _q_nearest(x, scale, lv: Levels):
    """Codes of x under the stored per-(sub-)block scale (0 where the scale is 0)."""
    idx, _ = lv.nearest(x / nonzero(scale))
    return torch.where(scale == 0, torch.zeros_like(idx), idx)


# --- the types ------------------------------------------------------------------------------

def _grid(lo: float, hi: float, n: int) -> tuple[float, ...]:
    return tuple(lo + (hi - lo) * i / (n - 1) for i in range(n))


# candidate factors of each type's scale search (picked on Gaussian rows; fit_scale and
# fit_affine say what a factor means); the IQ4 codebook and Q6_K gain from trying the
# top level too (and then re-quantize their own output exactly)
_BOTH_SIDES = _grid(0.9, 1.2, 7) + tuple(-f for f in _grid(0.95, 1.1, 4))
FACTORS = {
    "Q8_0": (1.0,), "Q4_0": _grid(0.9, 1.2, 7), "Q5_0": _grid(0.9, 1.2, 7),
    "IQ4_NL": _BOTH_SIDES, "Q4_1": _grid(0.85, 1.1, 21), "Q5_1": _grid(0.85, 1.1, 21),
    "Q2_K": _grid(0.7, 1.1, 17), "Q3_K": _grid(0.8, 1.35, 12), "Q4_K": _grid(0.85, 1.1, 21),
    "Q5_K": _grid(0.85, 1.1, 21), "Q6_K": _BOTH_SIDES, "IQ4_XS": _BOTH_SIDES,
}


def _float(dtype):
    def q(xb):
        n, nb, _ = xb.shape
        return [xb.to(dtype).reshape(n, nb, 1).view(torch.uint8)]
    return q


def _q8_0(xb):
    lv = Levels(-128, 127)
    d = _f16(fit_scale(xb, lv, FACTORS["Q8_0"], rounds=1))
    return [_f16_bytes(d), (_q_nearest(xb, d, lv).to(torch.int16) - 128).to(torch.int8)
            .view(torch.uint8)]


def _sym_32(name, lo, hi, table=None):
    """Q4_0 / Q5_0 / IQ4_NL: one fp16 d, codes nearest levels of x / d."""
    lv = Levels(lo, hi, table)

    def q(xb):
        d = _f16(fit_scale(xb, lv, FACTORS[name]))
        codes = _q_nearest(xb, d, lv)
        if table is not None or hi - lo < 16:     # 4-bit codes
            return [_f16_bytes(d), _pack_nibbles(codes)]
        return [_f16_bytes(d), _qh_32(codes), _pack_nibbles(codes & 15)]
    return q


def _qh_32(codes):
    """Bit 4 of 32 codes -> 4 bytes, little-endian: element i at bit i % 8 of byte i // 8."""
    bits = (codes >> 4).reshape(*codes.shape[:-1], 4, 8).transpose(-1, -2)
    return _pack_fields(bits, 1)


def _affine_32(name, nmax):
    """Q4_1 / Q5_1: fp16 d and m, x ~ d q + m."""
    def q(xb):
        s, b = fit_affine(xb, nmax, FACTORS[name], nonneg_min=False)
        d, m = _f16(s), _f16(b)
        codes = torch.where(d == 0, torch.zeros_like(xb),
                            torch.round((xb - m) / nonzero(d)).clamp(0, nmax)).to(torch.uint8)
        fields = [_f16_bytes(d), _f16_bytes(m)]
        if nmax == 31:
            fields.append(_qh_32(codes))
        return fields + [_pack_nibbles(codes & 15)]
    return q


def _affine_k(xb, sub: int, nmax: int, smax: int, factors):
    """The K-quants with mins (Q2_K, Q4_K, Q5_K): x ~ d sc q - dmin m per sub-block, sc and
    m integers 0..smax. Returns (d, dmin, sc, m, codes [N, nb, J, sub]) (floats, uint8)."""
    n, nb, _ = xb.shape
    xs = xb.reshape(n, nb, -1, sub)
    s, b = fit_affine(xs, nmax, factors, nonneg_min=True)
    lv = Levels(0, smax)
    d, sc0 = _super_scale(s, lv)
    dmin, m0 = _super_scale(-b, lv)
    # rounding sc and m to integers costs more than the float fit left: try the neighbours

    def evaluate(dsc, dm):
        sc, m = (sc0 + dsc).clamp(0, smax), (m0 + dm).clamp(0, smax)
        scale, offset = d * sc, dmin * m         # as the dequantizer forms them
        q = torch.round((xs + offset) / nonzero(scale)).clamp_(0, nmax)
        q = torch.where(scale == 0, torch.zeros_like(q), q)
        r = xs - (scale * q - offset)
        return tsum(r * r), sc, m, q
    _, sc, m, q = search_best(xs, _NEIGHBOURS_2D, evaluate)
    return d, dmin, sc.to(torch.uint8).squeeze(-1), m.to(torch.uint8).squeeze(-1), \
        q.to(torch.uint8)


_NEIGHBOURS_2D = [(a, b) for a in (0, -1, 1) for b in (0, -1, 1)]


def _k_scales_12(sc, m):
    """Q4_K / Q5_K: 8 six-bit scales and mins -> 12 bytes (bytes 0-3: scales 0-3 plus the
    top bits of scales 4-7; 4-7: mins likewise; 8-11: low nibbles of scales / mins 4-7)."""
    return torch.cat((sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                      m[..., :4] | ((m[..., 4:] >> 4) << 6),
                      (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)), dim=-1)


def _q2_k(xb):
    n, nb, _ = xb.shape
    d, dmin, sc, m, codes = _affine_k(xb, 16, 3, 15, FACTORS["Q2_K"])
    # element 128h + 32s + l (sub-block 8h + 2s + l // 16) -> bits 2s of byte 32h + l
    qs = _pack_fields(codes.reshape(n, nb, 2, 4, 32), 2).reshape(n, nb, 64)
    return [sc | (m << 4), qs, _f16_bytes(d), _f16_bytes(dmin)]


def _q45_k(name, nmax):
    def q(xb):
        n, nb, _ = xb.shape
        d, dmin, sc, m, codes = _affine_k(xb, 32, nmax, 63, FACTORS[name])
        # sub-blocks 2c, 2c + 1 -> low, high nibbles of bytes 32c..32c + 31
        qs = _pack_fields((codes & 15).reshape(n, nb, 4, 2, 32), 4).reshape(n, nb, 128)
        fields = [_f16_bytes(d), _f16_bytes(dmin), _k_scales_12(sc, m)]
        if nmax == 31:
            fields.append(_pack_fields(codes >> 4, 1))  # sub-block i at bit i of byte l
        return fields + [qs]
    return q


def _sym_k(xb, sub: int, codes_lv: Levels, scale_lv: Levels, factors):
    """The signed-scale super-blocks (Q3_K, Q6_K, IQ4_XS): x ~ d sc level, sc an integer
    in scale_lv. Returns (d, sc [N, nb, J] int, code indices [N, nb, J, sub])."""
    n, nb, _ = xb.shape
    xs = xb.reshape(n, nb, -1, sub)
    d, sc0 = _super_scale(fit_scale(xs, codes_lv, factors), scale_lv)

    def evaluate(delta):   # the integer sc nearest the float fit is not always the best
        sc = (sc0 + delta).clamp(scale_lv.lo, scale_lv.hi)
        scale = d * sc
        idx, v = codes_lv.nearest(xs / nonzero(scale))
        r = xs - scale * v
        return tsum(r * r), sc, torch.where(scale == 0, torch.zeros_like(idx), idx)
    _, sc, idx = search_best(xs, (0, -1, 1), evaluate)
    return d, sc.squeeze(-1).to(torch.int16), idx


def _q3_k(xb):
    n, nb, _ = xb.shape
    d, sc, codes = _sym_k(xb, 16, Levels(-4, 3), Levels(-32, 31), FACTORS["Q3_K"])
    codes = codes.reshape(n, nb, 2, 4, 32)      # code = level + 4
    hmask = _pack_fields((codes >> 2).reshape(n, nb, 8, 32), 1)   # element 32i + l: bit i
    qs = _pack_fields(codes & 3, 2).reshape(n, nb, 64)
    u = (sc + 32).to(torch.uint8)               # scale j: low nibble in byte j % 8 (high
    low = (u[..., :8] & 15) | ((u[..., 8:] & 15) << 4)  # half for j >= 8), top 2 bits at
    high = _pack_fields((u >> 4).reshape(n, nb, 4, 4), 2)  # byte 8 + j % 4, bits 2 (j // 4)
    return [hmask, qs, torch.cat((low, high), dim=-1), _f16_bytes(d)]


def _q6_k(xb):
    n, nb, _ = xb.shape
    d, sc, codes = _sym_k(xb, 16, Levels(-32, 31), Levels(-128, 127), FACTORS["Q6_K"])
    # element 128h + 64s + l (l < 64) -> nibble s of ql[64h + l]; its top 2 bits, as element
    # 128h + 32t + l (l < 32) -> bits 2t of qh[32h + l]
    ql = _pack_fields((codes & 15).reshape(n, nb, 2, 2, 64), 4).reshape(n, nb, 128)
    qh = _pack_fields((codes >> 4).reshape(n, nb, 2, 4, 32), 2).reshape(n, nb, 64)
    return [ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)]


def _iq4_xs(xb):
    n, nb, _ = xb.shape
    d, sc, codes = _sym_k(xb, 32, Levels(-127, 113, IQ4_VALUES), Levels(-32, 31),
                          FACTORS["IQ4_XS"])
    u = (sc + 32).to(torch.int32)
    h = tsum((u >> 4) << torch.arange(0, 16, 2, device=u.device))  # scale j: bits 2j of a
    scales_h = torch.cat((h & 255, h >> 8), dim=-1).to(torch.uint8)   # uint16 (disjoint bits)
    scales_l = _pack_nibbles((u & 15).to(torch.uint8).reshape(n, nb, 4, 2).transpose(-1, -2)
                             .reshape(n, nb, 8))   # scales 2i, 2i + 1 -> byte i
    return [_f16_bytes(d), scales_h, scales_l, _pack_nibbles(codes).reshape(n, nb, 128)]


_QUANTIZERS = {
    "F16": _float(torch.float16), "BF16": _float(torch.bfloat16), "Q8_0": _q8_0,
    "Q4_0": _sym_32("Q4_0", -8, 7), "Q5_0": _sym_32("Q5_0", -16, 15),
    "Q4_1": _affine_32("Q4_1", 15), "Q5_1": _affine_32("Q5_1", 31), "Q2_K": _q2_k,
    "Q3_K": _q3_k, "Q4_K": _q45_k("Q4_K", 15), "Q5_K": _q45_k("Q5_K", 31), "Q6_K": _q6_k,
    "IQ4_NL": _sym_32("IQ4_NL", -127, 113, IQ4_VALUES),
    "IQ4_XS": _iq4_xs,
}


def quantizable_types() -> list[str]:
    """ggml type names `quantize` writes."""
    return list(_QUANTIZERS)


def quantize(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """Rows float [N, K] -> GGUF rows uint8 [N, row bytes] of ggml type `type_name`
    (e.g. "Q4_K", any case), on x's device."""
    name = str(type_name).upper()
    if name not in _QUANTIZERS:
        raise UnsupportedModelError(f"cannot quantize to {type_name!r}; pick one of "
                                    f"{', '.join(_QUANTIZERS)}")
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    if x.dim() != 2 or x.shape[1] % block:
        raise UnsupportedModelError(f"{name} stores rows of whole {block}-value blocks; got "
                                    f"shape {tuple(x.shape)}: give [rows, K] with K a "
                                    f"multiple of {block}, or store the tensor as F16/F32")
    x = x.float().contiguous()
    if not bool(torch.isfinite(x).all()):
        raise UnsupportedModelError(f"cannot quantize to {name}: the values hold NaN or "
                                    f"infinity; fix the weights first")
    n, nb = x.shape[0], x.shape[1] // block
    fields = _QUANTIZERS[name](x.view(n, nb, block))
    out = torch.cat([f.reshape(n, nb, -1) for f in fields], dim=-1)
    assert out.shape[-1] == type_size and out.dtype == torch.uint8, (name, out.shape)
    return out.reshape(n, nb * type_size)
