"""KV page formats: how one page of K (or V) for one layer is laid out in bytes.

A page holds `page_size` token positions for all KV heads of a layer. Pools are uint8
tensors [num_pages, page_bytes] so that pages can live anywhere in an arena (resident
region or ring slot) and be copied as raw bytes. Pages may lie further apart than their
size (`pool.stride(0)` >= page_bytes: the streaming cache keeps a K and a V page side by
side, kv/kv_pages.py); kernels address page p at p * pool.stride(0). Inside a page
the layout is head-major, codes apart from scales, and depends on the role (K or V) for
the quantized types:

  f32/f16/bf16:  values [H, P, D] of that dtype (K and V)
  q8_0 K:        codes int8 [H, P, D], then fp16 scales [H, P, D/32]
  q4_0 K:        nibbles uint8 [H, P, D/2], then fp16 scales [H, P, D/32]
  q8_0 V:        codes int8 [H, D, P], then fp16 scales [H, D/32, P]
  q4_0 V:        nibbles uint8 [H, D/2, P], then fp16 scales [H, D/32, P]

K is read along D (Q.K contracts over it), so its codes keep D contiguous. V is read along
positions (P @ V contracts over them), so its codes keep positions contiguous: the tensor
cores' operand then comes from contiguous bytes, not byte by byte, which made the decode
faster (docs/findings.md, "KV page format"). Same bytes per token either way.

q8_0 and q4_0 follow llama.cpp's blocks of 32 values with one fp16 scale: q8_0 stores
round(x / d) with d = amax / 127; q4_0 stores min(15, trunc(x / d + 8.5)) with
d = max / -8 (max = the signed value of largest magnitude), byte j of a block holding
values j (low nibble) and j + 16 (high nibble). Type ids are ggml's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.errors import KvLayoutError

QK = 32  # values per quantization block


@dataclass(frozen=True)
class KvType:
    name: str
    ggml_id: int
    bits_per_value_num: int  # bytes per block of 32 values (floats: 32 * element size)

    @property
    def bytes_per_block(self) -> int:
        return self.bits_per_value_num

    @property
    def quantized(self) -> bool:
        return self.name in ("q8_0", "q4_0")


F32 = KvType("f32", 0, 128)
F16 = KvType("f16", 1, 64)
Q4_0 = KvType("q4_0", 2, 18)
Q8_0 = KvType("q8_0", 8, 34)
BF16 = KvType("bf16", 30, 64)

KV_TYPES = {t.name: t for t in (F32, F16, BF16, Q8_0, Q4_0)}
_BY_ID = {t.ggml_id: t for t in KV_TYPES.values()}
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def kv_type(spec: str | int | KvType) -> KvType:
    """Look a KV type up by name ('q8_0'), ggml id (8) or pass one through."""
    if isinstance(spec, KvType):
        return spec
    t = _BY_ID.get(spec) if isinstance(spec, int) else KV_TYPES.get(str(spec).lower())
    if t is None:
        raise KvLayoutError(
            f"unsupported KV cache type {spec!r}; use one of {', '.join(KV_TYPES)}")
    return t


def page_bytes(t: KvType, page_size: int, n_kv_heads: int, head_dim: int) -> int:
    check_geometry(t, head_dim)
    return page_size * n_kv_heads * head_dim // QK * t.bytes_per_block


def bytes_per_token(t: KvType, n_kv_heads: int, head_dim: int) -> int:
    return n_kv_heads * head_dim // QK * t.bytes_per_block


def check_geometry(t: KvType, head_dim: int) -> None:
    if head_dim % QK:
        raise KvLayoutError(f"head dim {head_dim} is not a multiple of {QK}")
    if t.quantized and head_dim not in SUPPORTED_HEAD_DIMS:
        raise KvLayoutError(
            f"{t.name} KV pages need head dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")


def check_cuda_head_dim(device: torch.device, head_dim: int, what: str) -> None:
    """The Triton kernels are built for SUPPORTED_HEAD_DIMS (the CPU reference takes any)."""
    if device.type == "cuda" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise KvLayoutError(f"the CUDA {what} supports head dims {SUPPORTED_HEAD_DIMS}, "
                            f"got {head_dim}")


def check_page_size(page_size: int) -> None:
    if page_size <= 0:
        raise KvLayoutError(f"page size must be a positive number of positions, got "
                            f"{page_size!r}")


def dense_pages(pool: torch.Tensor) -> bool:
    """Rows of pages the kernels can address: a dense last dim, pages stride(0) apart."""
    return pool.dim() == 2 and pool.stride(1) == 1 and pool.stride(0) >= pool.shape[1]


def n_kv_heads_of(pool: torch.Tensor, t: KvType, page_size: int, head_dim: int) -> int:
    per_head = page_size * head_dim // QK * t.bytes_per_block
    if (pool.dim() != 2 or pool.dtype != torch.uint8 or pool.shape[1] % per_head
            or pool.shape[1] == 0):
        raise KvLayoutError(
            f"KV pool must be uint8 [pages, n_kv_heads * {per_head}] for {t.name} "
            f"with page size {page_size} and head dim {head_dim}; got "
            f"{pool.dtype} {tuple(pool.shape)}")
    return pool.shape[1] // per_head


# ---- reference quantizers (fp32 math, bit-exact with ggml / gguf-py) --------------------

def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (codes int8 [..., D], scales fp16 [..., D/32])."""
    b = x.float().reshape(*x.shape[:-1], -1, QK)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    y = b * inv
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).to(torch.int8)  # C roundf: half away from 0
    return q.reshape(x.shape), d.squeeze(-1).to(torch.float16)


def quantize_q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (packed uint8 [..., D/2], scales fp16 [..., D/32])."""
    b = x.float().reshape(*x.shape[:-1], -1, QK)
    idx = b.abs().argmax(-1, keepdim=True)
    mx = torch.gather(b, -1, idx)
    d = mx / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.clamp(torch.trunc(b * inv + 8.5), max=15).to(torch.uint8)
    packed = q[..., : QK // 2] | (q[..., QK // 2:] << 4)
    return packed.reshape(*x.shape[:-1], -1), d.squeeze(-1).to(torch.float16)


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    b = codes.float().reshape(*codes.shape[:-1], -1, QK)
    return (b * scales.float().unsqueeze(-1)).reshape(codes.shape)


def dequantize_q4_0(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    p = packed.reshape(*packed.shape[:-1], -1, QK // 2)
    q = torch.cat([p & 0xF, p >> 4], dim=-1).float() - 8.0
    out = q * scales.float().unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], -1)


# ---- page views ----------------------------------------------------------------------------

ROLES = ("k", "v")


def position_major(t: KvType, role: str) -> bool:
    """True where codes and scales are stored [H, cols, P] (quantized V pages)."""
    if role not in ROLES:
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    return t.quantized and role == "v"


def code_cols(t: KvType, head_dim: int) -> int:
    """Code bytes of one head at one position of a quantized type: D for q8_0, D / 2 for
    q4_0 (two 4-bit codes a byte)."""
    assert t.quantized, f"{t.name} has no codes"
    return head_dim if t.name == "q8_0" else head_dim // 2


def split_pages(pages: torch.Tensor, t: KvType, n_kv_heads: int, page_size: int,
                head_dim: int, *, role: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """uint8 [N, page_bytes] -> typed views (values or codes [N, H, P, *], scales
    [N, H, P, D/32] or None), indexed by position whatever the storage order (role "v" of
    a quantized type gives transposed views). Codes are views of `pages`; scales are a copy
    (fp16 views of an offset slice may be misaligned): write them back with scale_bytes()."""
    n = pages.shape[0]
    if not t.quantized:
        position_major(t, role)                      # validates role
        vals = pages.view(FLOAT_DTYPES[t.name]).view(n, n_kv_heads, page_size, head_dim)
        return vals, None
    cols = code_cols(t, head_dim)
    code_bytes = n_kv_heads * page_size * cols
    codes = pages[:, :code_bytes]
    scales = pages[:, code_bytes:].contiguous().view(torch.float16)
    nb = head_dim // QK
    if position_major(t, role):
        codes = codes.view(n, n_kv_heads, cols, page_size).transpose(2, 3)
        scales = scales.view(n, n_kv_heads, nb, page_size).transpose(2, 3)
    else:
        codes = codes.view(n, n_kv_heads, page_size, cols)
        scales = scales.view(n, n_kv_heads, page_size, nb)
    if t.name == "q8_0":
        codes = codes.view(torch.int8)
    return codes, scales


def scale_bytes(scales: torch.Tensor, t: KvType, role: str) -> torch.Tensor:
    """Scales as split_pages returned them ([N, H, P, D/32]) -> uint8 [N, scale bytes] in
    storage order, to write back into the pages."""
    if position_major(t, role):
        scales = scales.transpose(2, 3)
    return scales.contiguous().reshape(scales.shape[0], -1).view(torch.uint8)


def row_byte_offsets(t: KvType, n_kv_heads: int, page_size: int, head_dim: int, *,
                     role: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where one position's bytes lie in a page: int64 (base, stride), one entry per byte of
    the position (bytes_per_token of them, in the order of split_pages' views: codes or
    values by head, then scales by head); position p's bytes are at base + p * stride.
    Each region of a page (values, codes, scales) is [segments, P, width] bytes, position
    major for quantized V, so a byte's stride is its region's width."""
    h, d, p = n_kv_heads, head_dim, page_size
    if not t.quantized:
        position_major(t, role)                      # validates role
        regions = [(0, h, d * t.bytes_per_block // QK)]
    else:
        cols, nb = code_cols(t, d), d // QK
        code_bytes = h * p * cols
        regions = ([(0, h * cols, 1), (code_bytes, h * nb, 2)] if position_major(t, role)
                   else [(0, h, cols), (code_bytes, h, nb * 2)])
    base, stride = [], []
    for off, segments, width in regions:
        seg = torch.arange(segments, dtype=torch.int64)[:, None] * (p * width)
        base.append((off + seg + torch.arange(width, dtype=torch.int64)).reshape(-1))
        stride.append(torch.full((segments * width,), width, dtype=torch.int64))
    return torch.cat(base), torch.cat(stride)


def decode_pages(pages: torch.Tensor, t: KvType, n_kv_heads: int, page_size: int,
                 head_dim: int, *, role: str) -> torch.Tensor:
    """uint8 [N, page_bytes] -> float32 [N, H, P, D] (the dequantized values)."""
    vals, scales = split_pages(pages, t, n_kv_heads, page_size, head_dim, role=role)
    if scales is None:
        return vals.float()
    if t.name == "q8_0":
        return dequantize_q8_0(vals, scales)
    return dequantize_q4_0(vals, scales)


def encode_rows(rows: torch.Tensor, t: KvType) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows [..., D] -> (values or codes, scales or None) in the page's element types."""
    if not t.quantized:
        return rows.to(FLOAT_DTYPES[t.name]), None
    return quantize_q8_0(rows) if t.name == "q8_0" else quantize_q4_0(rows)
