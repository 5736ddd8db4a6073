"""The Triton kernel of kv/row_publish.py: program (row r, block b) copies one block of
the bytes of position positions[r], K's blocks first and then V's, from the layer's arena
page (its page table picks it) to the same bytes of its host page. Launched directly (never
traced: the pool calls it from a lowered ring op or an eager forward), so pinned host
tensors can be arguments; the interpreter runs it on the CPU."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_block(pool, host, base, stride, row_bytes, pool_stride, host_stride, phys, lp,
                within, b, BLOCK: tl.constexpr):
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < row_bytes
    at = tl.load(base + offs, mask=m, other=0) + within * tl.load(stride + offs, mask=m, other=0)
    v = tl.load(pool + phys * pool_stride + at, mask=m)
    tl.store(host + lp * host_stride + at, v, mask=m)


@triton.jit
def _publish_rows(k_pool, k_host, k_base, k_stride, k_row_bytes, k_pool_stride,
                  k_host_stride, k_blocks, v_pool, v_host, v_base, v_stride, v_row_bytes,
                  v_pool_stride, v_host_stride, table, positions, page_size,
                  BLOCK: tl.constexpr):
    pos = tl.load(positions + tl.program_id(0)).to(tl.int64)
    lp = pos // page_size
    within = pos - lp * page_size
    phys = tl.load(table + lp).to(tl.int64)
    b = tl.program_id(1)
    if b < k_blocks:
        _copy_block(k_pool, k_host, k_base, k_stride, k_row_bytes, k_pool_stride,
                    k_host_stride, phys, lp, within, b, BLOCK)
    else:
        _copy_block(v_pool, v_host, v_base, v_stride, v_row_bytes, v_pool_stride,
                    v_host_stride, phys, lp, within, b - k_blocks, BLOCK)


def launch(pools, hosts, maps, table, positions, page_size: int, block: int) -> None:
    """pools, hosts, maps: (K, V) each; maps are (base, stride) int64 tensors."""
    (kp, vp), (kh, vh), ((kb, ks), (vb, vs)) = pools, hosts, maps
    k_blocks, v_blocks = triton.cdiv(kb.numel(), block), triton.cdiv(vb.numel(), block)
    if positions.numel() and k_blocks + v_blocks:
        _publish_rows[(positions.numel(), k_blocks + v_blocks)](
            kp, kh, kb, ks, kb.numel(), kp.stride(0), kh.stride(0), k_blocks,
            vp, vh, vb, vs, vb.numel(), vp.stride(0), vh.stride(0), table, positions,
            page_size,
            BLOCK=block, num_warps=4)
