"""fp32 torch reference of the quantized linear: planar GGUF rows -> float32 weights.

Each decoder reads its fields with `formats.plane` and puts values in ggml's element order.
The float math follows ggml's dequantize_row_* operation by operation (scale times
sub-block scale first, then times the code, then the min subtracted), one fp32 rounding
each, so the result equals `gguf.quants.dequantize` of the same bytes bit for bit on the
CPU and on CUDA (no op here fuses a multiply-add).
"""
from __future__ import annotations

import torch

from kvcompile.ops.qlinear.formats import WeightFormat, plane, weight_format

# IQ4_NL / IQ4_XS codebook (ggml's kvalues_iq4nl): a code is an index into it
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(planar, f, k, field) -> torch.Tensor:
    """An fp16 field as float32 [N, nb, 1]."""
    return plane(planar, f, k, field, torch.float16).float()


def _u8(planar, f, k, field) -> torch.Tensor:
    """A byte field as int32 [N, nb, size] (int32: room for shifts and sign)."""
    return plane(planar, f, k, field).to(torch.int32)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., m] -> codes [..., 2m]: the m low nibbles, then the m high ones."""
    return torch.stack((b & 15, b >> 4), dim=-2).flatten(-2)


def _crumbs(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., m] -> 2-bit codes [..., 4, m]: bit pair s of every byte in row s."""
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=b.dtype)
    return (b.unsqueeze(-2) >> shifts[:, None]) & 3


def _bit_rows(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., m] -> bits [..., 8, m]: bit i of every byte in row i (hmask, K-quant qh)."""
    shifts = torch.arange(8, device=b.device, dtype=b.dtype)
    return (b.unsqueeze(-2) >> shifts[:, None]) & 1


def _bits_le(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., m] -> bits [..., 8m] in little-endian order (Q5_0's uint32 qh: bit i is
    element i)."""
    shifts = torch.arange(8, device=b.device, dtype=b.dtype)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _float(planar, f, k):
    dtype = torch.float16 if f.name == "F16" else torch.bfloat16
    return plane(planar, f, k, "v", dtype).float()


def _q8_0(planar, f, k):
    q = plane(planar, f, k, "qs").view(torch.int8).float()
    return q * _f16(planar, f, k, "d")


def _q4_0(planar, f, k):
    q = _nibbles(_u8(planar, f, k, "qs")) - 8
    return _f16(planar, f, k, "d") * q.float()


def _q4_1(planar, f, k):
    q = _nibbles(_u8(planar, f, k, "qs"))
    return _f16(planar, f, k, "d") * q.float() + _f16(planar, f, k, "m")


def _q5(planar, f, k):
    q = _nibbles(_u8(planar, f, k, "qs")) | (_bits_le(_u8(planar, f, k, "qh")) << 4)
    if f.name == "Q5_0":
        return _f16(planar, f, k, "d") * (q - 16).float()
    return _f16(planar, f, k, "d") * q.float() + _f16(planar, f, k, "m")


def _q2_k(planar, f, k):
    n, nb = planar.shape[0], f.blocks_per_row(k)
    sc = _u8(planar, f, k, "scales")                              # [N, nb, 16]
    dl = (_f16(planar, f, k, "d") * (sc & 15).float()).unsqueeze(-1)
    ml = (_f16(planar, f, k, "dmin") * (sc >> 4).float()).unsqueeze(-1)
    # element 128h + 32s + l: bits 2s of qs[32h + l]; sub-blocks of 16 in that order
    q = _crumbs(_u8(planar, f, k, "qs").view(n, nb, 2, 32)).reshape(n, nb, 16, 16)
    return dl * q.float() - ml


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K 12 scale bytes [..., 12] -> 16 signed scales: low nibbles of bytes 0-7 then their
    high nibbles, each with 2 more bits from bytes 8-11 (scale j: byte 8 + j % 4, bits
    2 (j // 4)), minus 32."""
    low = torch.cat((s[..., 0:8] & 15, s[..., 0:8] >> 4), dim=-1)
    high = _crumbs(s[..., 8:12]).flatten(-2)
    return (low | (high << 4)) - 32


def _q3_k(planar, f, k):
    n, nb = planar.shape[0], f.blocks_per_row(k)
    dl = (_f16(planar, f, k, "d") * _q3_k_scales(_u8(planar, f, k, "scales")).float())
    low = _crumbs(_u8(planar, f, k, "qs").view(n, nb, 2, 32)).reshape(n, nb, 8, 32)
    # hmask bit i of byte l belongs to element 32i + l; a clear bit subtracts 4
    high = _bit_rows(_u8(planar, f, k, "hmask"))                  # [N, nb, 8, 32]
    q = (low - ((high ^ 1) << 2)).reshape(n, nb, 16, 16)
    return dl.unsqueeze(-1) * q.float()


def _q45_k(planar, f, k):
    n, nb = planar.shape[0], f.blocks_per_row(k)
    scale_min = _u8(planar, f, k, "scale_min")                  # [N, nb, 8 + 8]
    sc, mn = scale_min[..., :8], scale_min[..., 8:]
    d = (_f16(planar, f, k, "d") * sc.float()).unsqueeze(-1)
    dm = (_f16(planar, f, k, "dmin") * mn.float()).unsqueeze(-1)
    # chunk c of 64: low nibbles of qs[32c..] are sub-block 2c, high nibbles 2c + 1
    q = _nibbles(_u8(planar, f, k, "qs").view(n, nb, 4, 32)).reshape(n, nb, 8, 32)
    if f.name == "Q5_K":
        q = q | (_bit_rows(_u8(planar, f, k, "qh")) << 4)         # bit i: sub-block i
    return d * q.float() - dm


def _q6_k(planar, f, k):
    n, nb = planar.shape[0], f.blocks_per_row(k)
    sc = plane(planar, f, k, "scales").view(torch.int8).float()   # [N, nb, 16]
    dl = (_f16(planar, f, k, "d") * sc).unsqueeze(-1)
    # element 128h + 32t + l: nibble (t // 2) of ql[64h + 32(t % 2) + l], bits 2t of qh[32h + l]
    ql = _nibbles(_u8(planar, f, k, "ql").view(n, nb, 2, 64)).view(n, nb, 2, 4, 32)
    qh = _crumbs(_u8(planar, f, k, "qh").view(n, nb, 2, 32))      # [N, nb, 2, 4, 32]
    q = ((ql | (qh << 4)) - 32).reshape(n, nb, 16, 16)
    return dl * q.float()


def _iq4_nl(planar, f, k):
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=planar.device)
    return _f16(planar, f, k, "d") * table[_nibbles(_u8(planar, f, k, "qs"))]


def _iq4_xs(planar, f, k):
    n, nb = planar.shape[0], f.blocks_per_row(k)
    lo = _nibbles(_u8(planar, f, k, "scales_l").unsqueeze(-1)).flatten(-2)  # byte j: 2j, 2j+1
    hb = _u8(planar, f, k, "scales_h")       # uint16 LE: sub-block j's top 2 bits at bit 2j
    hi = ((hb[..., 0:1] | (hb[..., 1:2] << 8)) >> torch.arange(0, 16, 2, device=hb.device)) & 3
    dl = (_f16(planar, f, k, "d") * ((lo | (hi << 4)) - 32).float()).unsqueeze(-1)
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=planar.device)
    # sub-block j of 32: low nibbles of qs[16j..16j+15], then their high nibbles
    q = _nibbles(_u8(planar, f, k, "qs").view(n, nb, 8, 16))
    return dl * table[q]


_DECODERS = {
    "F16": _float, "BF16": _float, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
    "Q5_0": _q5, "Q5_1": _q5, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q45_k, "Q5_K": _q45_k,
    "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}


def dequantize_planar(planar: torch.Tensor, fmt: str | int | WeightFormat, k: int) -> torch.Tensor:
    """Planar rows uint8 [N, planar_row_bytes(k)] -> float32 [N, k] in ggml element order."""
    f = weight_format(fmt)
    return _DECODERS[f.name](planar, f, k).reshape(planar.shape[0], k)


def dequantize_rows(planar: torch.Tensor, rows: torch.Tensor, fmt: str | int | WeightFormat,
                    k: int) -> torch.Tensor:
    """The selected rows dequantized (an embedding lookup): float32 [len(rows), k]."""
    return dequantize_planar(planar[rows], fmt, k)


def qlinear_naive(x: torch.Tensor, planar: torch.Tensor, fmt: str | int | WeightFormat, k: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ W^T (+ bias) with W the dequantized planar weight [N, k], in fp32, one
    rounding to x's dtype."""
    y = x.float() @ dequantize_planar(planar, fmt, k).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
