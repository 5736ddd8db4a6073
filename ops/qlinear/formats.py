"""GGUF weight block formats as the quantized-linear kernels read them.

A GGUF row of a quantized weight is a run of blocks, each block a struct of fields (scales,
codes) stored one after the other (llama.cpp's `block_q4_K` and so on). On the GPU the same
bytes are kept *planar*: within a row, every block's copy of one field sits next to the
other blocks' copies of that field, field after field, so a kernel loads the codes of a
tile as one contiguous, 16-byte-aligned run (vector loads) instead of gathering them from
between the scales. Nothing is decoded or re-quantized: `to_planar` and `from_planar` move
bytes, and a planar row is the GGUF row's bytes plus at most 15 bytes of padding, with one
exception: Q4_K and Q5_K's twelve bytes of packed 6-bit scales and mins become sixteen
(`scale_min`: the eight scales, then the eight mins, a byte each), which the kernels read
with one load each instead of three loads and a dozen bit operations a group (+4 bytes a
block: 2.8% of Q4_K). The repacking is lossless both ways.

Planar row of a type with fields f1..fm (planar order: larger fields first, ties in GGUF
order) and nb = K / block blocks:
    [f1 of block 0 .. f1 of block nb-1][f2 of block 0 ..] ... [fm ...][pad to 16 bytes]
field f starts at byte nb * (sum of the sizes of the fields before it), so every fp16 /
uint16 / uint32 field starts 2- / 4-byte aligned whatever nb is, and the first (largest,
the codes) at a 16-byte boundary.

F16 / BF16 rows are their values (one field of 2 bytes an element).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.errors import UnsupportedModelError

ROW_ALIGN = 16


@dataclass(frozen=True)
class WeightFormat:
    name: str                          # ggml type name, e.g. "Q4_K"
    ggml_id: int
    block: int                         # values per block
    fields: tuple[tuple[str, int], ...]  # (name, bytes) in GGUF (struct) order
    unpacked: tuple = ()               # (GGUF field, planar field, bytes) repacked at load

    @property
    def block_bytes(self) -> int:
        return sum(size for _, size in self.fields)

    @property
    def planar_fields(self) -> tuple[tuple[str, int], ...]:
        swap = {gguf: (name, size) for gguf, name, size in self.unpacked}
        fields = [swap.get(name, (name, size)) for name, size in self.fields]
        order = sorted(range(len(fields)), key=lambda i: (-fields[i][1], i))
        return tuple(fields[i] for i in order)

    @property
    def planar_block_bytes(self) -> int:
        return sum(size for _, size in self.planar_fields)

    def blocks_per_row(self, k: int) -> int:
        if k % self.block:
            raise UnsupportedModelError(f"a {self.name} row holds whole blocks of {self.block} "
                                        f"values; {k} is not a multiple")
        return k // self.block

    def row_bytes(self, k: int) -> int:
        """Bytes of one GGUF row of k values."""
        return self.blocks_per_row(k) * self.block_bytes

    def planar_row_bytes(self, k: int) -> int:
        """Bytes of one planar row (its blocks' planar fields, padded to ROW_ALIGN)."""
        return -(-self.blocks_per_row(k) * self.planar_block_bytes // ROW_ALIGN) * ROW_ALIGN

    def field_offsets(self, k: int) -> dict[str, int]:
        """Byte offset of each field's plane inside a planar row of k values."""
        nb, at, out = self.blocks_per_row(k), 0, {}
        for name, size in self.planar_fields:
            out[name] = at
            at += nb * size
        return out


def _fmt(name, ggml_id, block, *fields, unpacked=()) -> WeightFormat:
    return WeightFormat(name, ggml_id, block, tuple(fields), unpacked)


def unpack_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> [..., 16]: the 8 6-bit scales, then the 8
    mins. Sub-blocks 0-3 sit in the low 6 bits of bytes 0-3 (scales) / 4-7 (mins); 4-7 take
    their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their top 2
    bits from the top of bytes 0-3 / 4-7 (ggml's get_scale_min_k4)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    return torch.cat((a & 63, (c & 15) | ((a >> 6) << 4),
                      b & 63, (c >> 4) | ((b >> 6) << 4)), dim=-1)


def pack_k_scales(u: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_k_scales: [..., 16] 6-bit values -> the 12 GGUF bytes."""
    sc, mn = u[..., 0:8], u[..., 8:16]
    return torch.cat((sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6),
                      mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6),
                      (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)), dim=-1)


# a repacked field's conversions: GGUF bytes -> planar bytes, and back
_REPACK = {"scale_min": (unpack_k_scales, pack_k_scales)}


# Field layouts from ggml-common.h (the GGUF on-disk structs); ids are ggml's.
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _fmt("F16", 1, 1, ("v", 2)),
    _fmt("BF16", 30, 1, ("v", 2)),
    _fmt("Q8_0", 8, 32, ("d", 2), ("qs", 32)),
    _fmt("Q4_0", 2, 32, ("d", 2), ("qs", 16)),
    _fmt("Q4_1", 3, 32, ("d", 2), ("m", 2), ("qs", 16)),
    _fmt("Q5_0", 6, 32, ("d", 2), ("qh", 4), ("qs", 16)),
    _fmt("Q5_1", 7, 32, ("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
    _fmt("Q2_K", 10, 256, ("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)),
    _fmt("Q3_K", 11, 256, ("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)),
    _fmt("Q4_K", 12, 256, ("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128),
         unpacked=(("scales", "scale_min", 16),)),
    _fmt("Q5_K", 13, 256, ("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128),
         unpacked=(("scales", "scale_min", 16),)),
    _fmt("Q6_K", 14, 256, ("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)),
    _fmt("IQ4_NL", 20, 32, ("d", 2), ("qs", 16)),
    _fmt("IQ4_XS", 23, 256, ("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)),
)}
BY_ID = {f.ggml_id: f for f in FORMATS.values()}


def weight_format(spec: str | int | WeightFormat) -> WeightFormat:
    """Look a format up by ggml name ("Q4_K", any case) or id."""
    if isinstance(spec, WeightFormat):
        return spec
    f = BY_ID.get(spec) if isinstance(spec, int) else FORMATS.get(str(spec).upper())
    if f is None:
        raise UnsupportedModelError(f"no quantized-linear kernel for weight type {spec!r}; "
                                    f"kernels exist for {', '.join(FORMATS)}")
    return f


def to_planar(raw: torch.Tensor, fmt: str | int | WeightFormat, k: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF rows uint8 [N, row_bytes(k)] -> planar rows uint8 [N, planar_row_bytes(k)]
    (into `out` when given: e.g. a slice of a preallocated device buffer)."""
    f = weight_format(fmt)
    n, nb = raw.shape[0], f.blocks_per_row(k)
    assert raw.dtype == torch.uint8 and raw.shape[1] == f.row_bytes(k), "GGUF rows of k values"
    if out is None:
        out = torch.empty((n, f.planar_row_bytes(k)), dtype=torch.uint8, device=raw.device)
    assert out.shape == (n, f.planar_row_bytes(k)) and out.dtype == torch.uint8
    blocks = raw.view(n, nb, f.block_bytes)
    src = {}
    at = 0
    for name, size in f.fields:
        src[name] = blocks[:, :, at:at + size]
        at += size
    for gguf, name, _ in f.unpacked:
        src[name] = _REPACK[name][0](src.pop(gguf))
    end = 0
    for name, at in f.field_offsets(k).items():
        size = src[name].shape[2]
        out[:, at:at + nb * size].view(n, nb, size).copy_(src[name])
        end = max(end, at + nb * size)
    out[:, end:].zero_()
    return out


def from_planar(planar: torch.Tensor, fmt: str | int | WeightFormat, k: int) -> torch.Tensor:
    """Inverse of to_planar: planar rows -> GGUF rows uint8 [N, row_bytes(k)]."""
    f = weight_format(fmt)
    n, nb = planar.shape[0], f.blocks_per_row(k)
    raw = torch.empty((n, nb, f.block_bytes), dtype=torch.uint8, device=planar.device)
    offsets = f.field_offsets(k)
    sizes = dict(f.planar_fields)
    packed = {gguf: name for gguf, name, _ in f.unpacked}
    at = 0
    for name, size in f.fields:
        src = packed.get(name, name)
        b = planar[:, offsets[src]:offsets[src] + nb * sizes[src]].view(n, nb, sizes[src])
        raw[:, :, at:at + size] = _REPACK[src][1](b) if src in _REPACK else b
        at += size
    return raw.view(n, nb * f.block_bytes)


def plane(planar: torch.Tensor, fmt: str | int | WeightFormat, k: int, field: str,
          dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """One field's plane of planar rows as [N, nb, size / itemsize] of `dtype` (a view
    when the rows are contiguous and the plane aligned; f16 d, uint16 scales_h, ...)."""
    f = weight_format(fmt)
    n, nb = planar.shape[0], f.blocks_per_row(k)
    size = dict(f.planar_fields)[field]
    at = f.field_offsets(k)[field]
    b = planar[:, at:at + nb * size].reshape(n, nb, size)
    return b if dtype == torch.uint8 else b.contiguous().view(dtype)
