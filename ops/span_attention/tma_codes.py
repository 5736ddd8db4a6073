"""Quantized code tiles read by TMA (the Hopper tensor memory accelerator) or by pointers.

Why: the transposed decode's loop was bound by its own memory requests, not by HBM: asking
L2 for more (prefetch) made it slower, fewer instructions did not make it faster. One TMA
copy moves a whole tile (a K block column, all V rows) into shared memory without the
load/store unit or per-thread addresses; at 8 x 128 and 128K the decode went from 0.71 to
0.80 of HBM (docs/performance.md, "TMA").

A pool is [pages, page_bytes] uint8 with the codes first (kv_format). The descriptors see
only the codes: K as [pages, heads * P, row bytes] (a position's codes one row), V, which is
position-major, as [pages, heads * W, P] (a value row across the page's positions).

TMA needs a Hopper-or-later GPU, 16-byte aligned pools and pages, and an untraced launch
(torch's wrap_triton cannot trace host-side descriptors outside dynamo): inside the op, as
the models' steps run. Traced and interpreted launches read the same bytes through pointers
(cp.async), in the same order, so results are bitwise equal either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.ops.launching import interpreting, traced
from kvcompile.ops.pdl import _capability


def tma_possible(k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether these pools can be read by TMA in a launch now (see the module docstring)."""
    dev = k_pool.device
    return (dev.type == "cuda" and not interpreting() and not traced()
            and _capability(dev.index if dev.index is not None
                            else torch.cuda.current_device()) >= 9
            and all(p.data_ptr() % 16 == 0 and p.stride(0) % 16 == 0
                    for p in (k_pool, v_pool)))


def code_descriptors(k_pool, v_pool, n_heads: int, head_dim: int, page_size: int,
                     k_row: int, v_rows: int, block_n: int):
    """TMA descriptors of the K codes (blocks: one 32-value block column of block_n
    positions) and the V codes (blocks: all v_rows value rows of block_n positions); k_row
    is a position's K code bytes (D for q8_0, D / 2 for q4_0), v_rows V's code rows a head."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    k_block = 32 if k_row == head_dim else 16
    kd = TensorDescriptor(k_pool, [k_pool.shape[0], n_heads * page_size, k_row],
                          [k_pool.stride(0), k_row, 1], [1, block_n, k_block])
    vd = TensorDescriptor(v_pool, [v_pool.shape[0], n_heads * v_rows, page_size],
                          [v_pool.stride(0), page_size, 1], [1, v_rows, block_n])
    return kd, vd


@triton.jit
def k_code_block(k_codes, phys, h, n0, off, b, page_elems, P: tl.constexpr,
                 BLOCK_N: tl.constexpr, KROW: tl.constexpr, WB: tl.constexpr,
                 TMA: tl.constexpr):
    """Code bytes [BLOCK_N, WB] of value block b (WB bytes: 32 for q8_0, 16 for q4_0) of
    positions `off` (tile [n0, n0 + BLOCK_N) of its page) of head h on page `phys`."""
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
    """Code bytes [W, BLOCK_N] of a position-major V page: the W code rows of head h at
    positions `off` (tile [n0, n0 + BLOCK_N)), unmasked (their scales mask the tail)."""
    if TMA:
        return tl.reshape(v_codes.load([phys.to(tl.int32), h * W, n0 % P]), (W, BLOCK_N))
    else:
        c = tl.arange(0, W)
        return tl.load(v_codes + phys * page_elems + (h * W + c[:, None]) * P + off[None, :])
