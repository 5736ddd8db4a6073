"""Quantized code tiles read by TMA (the Hopper tensor memory accelerator) or by pointers.

Why: the transposed decode's loop was bound by its own memory requests, not by HBM: asking
L2 for more (prefetch) made it slower, fewer instructions did not make it faster. One TMA
copy moves a whole tile (a K block column, all V rows) into shared memory without the
load/store unit or per-thread addresses, and the decode got faster at every context in
both geometries (docs/findings.md, "Decode attention kernels").

A pool is [pages, page_bytes] uint8, pages stride(0) apart, with the codes first
(kv_format). The descriptors see only the codes: K as [pages, heads * P, row bytes] (a
position's codes one row), V, which is position-major, as [pages, heads * W, P] (a value
row across the page's positions).

TMA needs a Hopper-or-later GPU, 16-byte aligned pools and pages, and an untraced launch
(torch's wrap_triton cannot trace host-side descriptors outside dynamo): inside the op when
it runs eagerly, in a captured CUDA graph or in a graph-lowered step (the default lowering).
A step lowered by inductor traces the op's body, and traced and interpreted launches read the
same bytes through pointers (cp.async), in the same order: bitwise equal results, slower.
Each untraced launch builds two descriptors on the host (a few microseconds of CPU, not
measured); captured graphs replay them for free.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.ops import kv_format as F
from kvcompile.ops.pdl import untraced_on_hopper
from kvcompile.ops.span_attention.quant_blocks import v_code_rows


def tma_possible(k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether these pools can be read by TMA in a launch now (see the module docstring)."""
    return untraced_on_hopper(k_pool.device) and all(
        p.data_ptr() % 16 == 0 and p.stride(0) % 16 == 0 for p in (k_pool, v_pool))


def code_bytes(kv_type: int, head_dim: int) -> int:
    """A position's code bytes of one head (K's row, V's code rows a head) of ggml type
    `kv_type`: kv_format.code_cols."""
    t = F.kv_type(kv_type)
    assert t.quantized, f"TMA code tiles are q8_0 / q4_0, not {t.name}"
    return F.code_cols(t, head_dim)


def code_descriptors(k_pool, v_pool, k_type: int, v_type: int, n_heads: int, head_dim: int,
                     page_size: int, block_n: int):
    """TMA descriptors of the K codes (blocks: one 32-value block's bytes, 32 for q8_0 and
    16 for q4_0, of block_n positions) and the V codes (blocks: all of a head's code rows
    over block_n positions)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    k_row, v_rows = code_bytes(k_type, head_dim), code_bytes(v_type, head_dim)
    kd = TensorDescriptor(k_pool, [k_pool.shape[0], n_heads * page_size, k_row],
                          [k_pool.stride(0), k_row, 1], [1, block_n, k_row * 32 // head_dim])
    vd = TensorDescriptor(v_pool, [v_pool.shape[0], n_heads * v_rows, page_size],
                          [v_pool.stride(0), page_size, 1], [1, v_rows, block_n])
    return kd, vd


@triton.jit
def k_code_block(k_codes, phys, h, n0, off, b, page_elems, P: tl.constexpr,
                 BLOCK_N: tl.constexpr, KROW: tl.constexpr, WB: tl.constexpr,
                 TMA: tl.constexpr):
    """Code bytes [BLOCK_N, WB] of value block b (WB bytes: 32 for q8_0, 16 for q4_0) of
    head h at page offsets `off` on page `phys`: the tile of logical positions [n0,
    n0 + BLOCK_N), which lies inside one page."""
    if TMA:
        blk = k_codes.load([phys.to(tl.int32), h * P + n0 % P, b * WB])
        return tl.reshape(blk, (BLOCK_N, WB))
    else:
        j = tl.arange(0, WB)
        return tl.load(k_codes + phys * page_elems + (h * P + off)[:, None] * KROW + b * WB
                       + j[None, :])


@triton.jit
def v_code_tile(v_codes, phys, h, n0, off, page_elems, P: tl.constexpr,
                BLOCK_N: tl.constexpr, W: tl.constexpr, TMA: tl.constexpr):
    """quant_blocks.v_code_rows of the tile of logical positions [n0, n0 + BLOCK_N) (page
    offsets `off`), by TMA or by pointers."""
    if TMA:
        return tl.reshape(v_codes.load([phys.to(tl.int32), h * W, n0 % P]), (W, BLOCK_N))
    else:
        return v_code_rows(v_codes, phys, h, off, page_elems, P, W)
