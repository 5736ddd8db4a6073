"""Quantized KV pages dequantized once into fp16 pages for a prefill launch.

The prefill kernel reads each key tile once per query tile: over q8_0 / q4_0 pages it would
dequantize every tile once per (query head, query tile) and compute Q.K exactly in two dots
(paged_tile.qk_quantized). With many query rows that arithmetic, not the bytes, bounds the
kernel. So a launch of at least DEQUANT_ROWS rows first writes the pages it reads as fp16
pages (code * scale, one rounding, as V tiles always were) into an fp16 pool of up to
DEQUANT_TOKENS positions, attends over those with the fp16 kernel, and carries the
online-softmax state from one such span to the next (prefill_chunks' piece protocol).
Pages past the rows' last position, or before a windowed layer's window, are not written:
the kernel never reads them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.ops import kv_format as F
from kvcompile.ops.launching import launchable
from kvcompile.ops.span_attention.launch import PageGeometry, pool_args
from kvcompile.ops.span_attention.paged_tile import load_tile, load_v_tile

DEQUANT_ROWS = 256        # query rows from which a launch dequantizes pages first
DEQUANT_TOKENS = 16384    # positions of K (and of V) dequantized at once


def dequant_bytes(n_kv_heads: int, head_dim: int) -> int:
    """Device bytes of the fp16 pools (K and V of DEQUANT_TOKENS positions)."""
    return 2 * DEQUANT_TOKENS * n_kv_heads * head_dim * 2


@triton.jit
def _row_span(q_pos_ptr, n_rows, win, BLOCK_R: tl.constexpr, WINDOWED: tl.constexpr):
    """(first position any row reads, last position any row reads)."""
    top = tl.full([BLOCK_R], -1, tl.int32)
    low = tl.full([BLOCK_R], 1 << 30, tl.int32)
    for r0 in range(0, n_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        p = tl.load(q_pos_ptr + r, mask=r < n_rows, other=-1)
        top = tl.maximum(top, p)
        low = tl.minimum(low, tl.where(r < n_rows, p, 1 << 30))
    if WINDOWED:
        begin = tl.maximum(tl.min(low, 0) - win + 1, 0)
    else:
        begin = 0
    return begin, tl.max(top, 0)


@triton.jit(do_not_specialize=["n_rows", "first_page"])
def _dequant(vals, scl, table, q_pos_ptr, dst, n_rows, first_page, win, page_elems,
             page_halves, code_halves, H: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, KV_TYPE: tl.constexpr,
             IS_V: tl.constexpr, WINDOWED: tl.constexpr):
    i = tl.program_id(0)          # page of the piece
    h = tl.program_id(1)          # KV head
    begin, last = _row_span(q_pos_ptr, n_rows, win, BLOCK_R, WINDOWED)
    start = (first_page + i) * P
    if start <= last and start + P > begin:
        phys = tl.load(table + i).to(tl.int64)
        d = tl.arange(0, D)
        for o in range(0, P, BLOCK_N):
            off = o + tl.arange(0, BLOCK_N)
            pos = start + off
            live = (pos <= last) & (pos >= begin)
            if IS_V:
                x = load_v_tile(vals, scl, phys, h, off, live, page_elems, page_halves,
                                code_halves, BLOCK_N, P, D, KV_TYPE)
            else:
                x = load_tile(vals, scl, phys, h, off, live, page_elems, page_halves,
                              code_halves, BLOCK_N, P, D, KV_TYPE)
            row = (i * H + h) * P + off
            tl.store(dst + row.to(tl.int64)[:, None] * D + d[None, :], x.to(tl.float16))


def dequant_pages(pool: torch.Tensor, g: PageGeometry, page_size: int, head_dim: int,
                  table: torch.Tensor, q_pos: torch.Tensor, first_page: int, window: int,
                  is_v: bool, out: torch.Tensor) -> torch.Tensor:
    """Pages table[0..n) of a q8_0 / q4_0 pool as fp16 pages (kv_format's f16 layout) in
    `out` (uint8 [>= n, f16 page bytes]); returns the first n of them. Logical page
    first_page + i is table[i]; only pages some row of q_pos reads are written."""
    n = table.shape[0]
    dst = out[:n]
    vals, halves, pe, ph, ch = pool_args(pool, g)
    grid = (n, g.n_heads)
    launchable(_dequant)[grid](
        vals, halves, table, q_pos, dst.view(torch.float16), q_pos.shape[0], first_page,
        window, pe, ph, ch, H=g.n_heads, P=page_size, D=head_dim,
        BLOCK_N=min(32, page_size), BLOCK_R=256, KV_TYPE=g.kv_type, IS_V=is_v,
        WINDOWED=window > 0, num_warps=4)
    return dst


def fp16_pool(n_pages: int, n_kv_heads: int, page_size: int, head_dim: int,
              device) -> torch.Tensor:
    """An uninitialized pool of n_pages fp16 pages."""
    return torch.empty(n_pages, F.page_bytes(F.F16, page_size, n_kv_heads, head_dim),
                       dtype=torch.uint8, device=device)
