"""Launcher helpers shared by the span_attention Triton kernels (Python side)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F


@dataclass(frozen=True)
class PageGeometry:
    kv_type: int      # ggml id
    n_heads: int
    code_bytes: int   # bytes of values / codes before the scales (whole page); pages are
                      # addressed by the pool's stride(0), not by their size

    @property
    def quantized(self) -> bool:
        return self.kv_type in (2, 8)     # q4_0, q8_0


def page_geometry(pool: torch.Tensor, kv_type: int, page_size: int,
                  head_dim: int) -> PageGeometry:
    t = F.kv_type(kv_type)
    n_heads = F.n_kv_heads_of(pool, t, page_size, head_dim)
    if t.name == "q8_0":
        code = n_heads * page_size * head_dim
    elif t.name == "q4_0":
        code = n_heads * page_size * head_dim // 2
    else:
        code = pool.shape[1]
    return PageGeometry(t.ggml_id, n_heads, code)


def dot_mode(q_dtype: torch.dtype, k_type: int) -> int:
    """1: Q.K in fp16 (exact for f16/quantized K and for bf16 queries in fp16's normal
    range); 0: bf16 (a bf16 query against a bf16 K page, exact)."""
    return 0 if (q_dtype == torch.bfloat16 and k_type == F.BF16.ggml_id) else 1


def k_split(k_type: int) -> int:
    """1 for f32 K pages: Q.K as fp16 hi + lo."""
    return int(k_type == F.F32.ggml_id)


def query_operand(q: torch.Tensor, qk_f16: int) -> torch.Tensor:
    """The query as the kernels read it: fp16 (exact for bf16 values in fp16's normal
    range) unless the Q.K dot runs in bf16."""
    want = torch.float16 if qk_f16 else torch.bfloat16
    return q if q.dtype == want else q.to(want)


_VIEW = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16, 8: torch.int8, 2: torch.uint8}


def pool_args(pool: torch.Tensor, g: PageGeometry, raw_codes: bool = False):
    """(typed view, fp16 view, page stride in elements, page stride in halves, code
    halves) for load_tile: page p starts p * pool.stride(0) bytes in (kv_format);
    raw_codes: quantized pools stay uint8 (quant_blocks reads code bytes)."""
    vals = pool if raw_codes and g.quantized else pool.view(_VIEW[g.kv_type])
    stride = pool.stride(0)
    return (vals, pool.view(torch.float16), stride // vals.element_size(), stride // 2,
            g.code_bytes // 2)


def check_launch(q, k_pool, v_pool, page_table, q_pos, page_size):
    """What the Triton kernels need beyond the op's own checks (KvLayoutError otherwise)."""
    problems = []
    if q.dim() != 3 or q.stride(2) != 1:
        problems.append("q must be [T, Hq, D] with a dense last dim")
    if not (F.dense_pages(k_pool) and F.dense_pages(v_pool)):
        problems.append("k_pool and v_pool must be rows of pages with a dense last dim")
    if k_pool.dtype != torch.uint8 or v_pool.dtype != torch.uint8:
        problems.append("k_pool and v_pool must be uint8")
    if page_table.dtype != torch.int32 or not page_table.is_contiguous():
        problems.append(f"page_table must be contiguous int32, got {page_table.dtype}")
    if q_pos.dtype != torch.int32 or not q_pos.is_contiguous():
        problems.append(f"q_pos must be contiguous int32, got {q_pos.dtype}")
    if not q.device == k_pool.device == v_pool.device == page_table.device == q_pos.device:
        problems.append("q, the pools, page_table and q_pos must be on one device")
    if page_size & (page_size - 1) or page_size < 16:
        problems.append(f"page size {page_size} must be a power of two >= 16")
    if problems:
        raise KvLayoutError("span_attention on the GPU: " + "; ".join(problems))


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8   # interpreter runs: a small fixed number keeps chunking deterministic
    return _sms(device.index if device.index is not None else torch.cuda.current_device())
