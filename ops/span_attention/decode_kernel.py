"""span_attention for few query rows (decode, speculative verify): flash-decoding.

Pass 1 (`_decode_split`): program (chunk c, KV head h) covers logical positions
[c * CHUNK, (c + 1) * CHUNK) for all query rows and all query heads of h's group
(M = rows * group rows of one tl.dot), dequantizes each tile in registers and writes a
partial (m, l, acc). Pass 2 (`decode_split._decode_reduce`): one program per (h, row)
merges the partials in chunk order. Chunks are cut by logical position from the page table's length
only, never by where a page lives, so any placement of the same logical KV gives bitwise
the same output. The context length is read from q_pos on the device (no host sync).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers
from kvcompile.ops.span_attention.decode_split import (decode_shape, decode_tile,
                                                       launch_reduce, partial_slot,
                                                       program_rows_and_chunk, split_launch,
                                                       split_operands, store_partial_stats,
                                                       partial_rows_ok)
from kvcompile.ops.span_attention.launch import k_split
from kvcompile.ops.span_attention.paged_tile import (causal_softmax, k_value_scores,
                                                     load_v_tile, qk_quantized, query_tile,
                                                     v_operand)

LOG2E = 1.4426950408889634


def legacy_programs_per_sm(head_dim: int, k_quantized: bool) -> int:
    """Split programs an SM: 4 for float K at D <= 128 (bf16 KV, 1 row: faster than 2 from
    32K on), else 2 (D = 256 bf16 was slower with 4; quantized K here means a wide verify,
    not measured with 4). From a launch-config sweep (docs/findings.md, "Decode attention
    kernels")."""
    return 4 if head_dim <= 128 and not k_quantized else 2


@triton.jit
def _decode_split(q_ptr, k_vals, k_scl, v_vals, v_scl, page_table, q_pos_ptr,
                  m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, n_rows, n_chunks, chunk_len,
                  table_len, k_page_elems, k_page_halves, k_code_halves, v_page_elems,
                  v_page_halves, v_code_halves, win, QK_SCALE: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, QK_F16: tl.constexpr,
                  K_SPLIT: tl.constexpr, WINDOWED: tl.constexpr, INTERP: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_producers(PDL)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    t, row_ok, qp, n_ctx, start, first, end, begin = program_rows_and_chunk(
        q_pos_ptr, r, n_rows, chunk_len, table_len, win, G, P, BLOCK_N, WINDOWED)
    d = tl.arange(0, D)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + (h * G + r % G) * stride_qh
    q = query_tile(tl.load(qrow[:, None] + d[None, :], mask=row_ok[:, None], other=0.0), QK_F16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(first, end, BLOCK_N):
        off, pos, live, phys = decode_tile(page_table, n0, begin, end, P, BLOCK_N, WINDOWED)
        if K_TYPE == 2 or K_TYPE == 8:
            s = qk_quantized(q, k_vals, k_scl, phys, h, off, live, k_page_elems, k_page_halves,
                             k_code_halves, BLOCK_N, P, D, K_TYPE, INTERP)
        else:
            s = k_value_scores(q, k_vals, k_scl, phys, h, off, live, k_page_elems,
                               k_page_halves, k_code_halves, BLOCK_N, P, D, K_TYPE, K_SPLIT,
                               QK_F16, INTERP)
        p, alpha, m_new, l_i = causal_softmax(s, pos, qp, m_i, l_i, win, QK_SCALE, True, WINDOWED)
        v = load_v_tile(v_vals, v_scl, phys, h, off, live, v_page_elems, v_page_halves,
                      v_code_halves, BLOCK_N, P, D, V_TYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v_operand(v, V_TYPE))
        m_i = m_new
    slot = partial_slot(tl.program_id(0), r, h, n_chunks, n_rows, G)
    ok = partial_rows_ok(r, n_rows, G, start, n_ctx)
    store_partial_stats(m_ptr, l_ptr, m_i, l_i, slot, ok)
    tl.store(acc_ptr + slot.to(tl.int64)[:, None] * D + d[None, :], acc, mask=ok[:, None])


def span_attention_decode(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size,
                          scale, out=None, chunk_len=None, block_n=None, num_warps=None,
                          num_stages=None, programs_per_sm=None, workspace=None,
                          out_rot=None, window=0):
    """Launch the split + reduce kernels; `out` may be given in any float dtype (tests use
    fp32 to see the kernel's own error without the final rounding); `workspace` is an fp32
    buffer for the partials (workspace.py), allocated per call when None; `out_rot` the fp32
    diagonal blocks [NB, B, B] of a rotation the reduce multiplies each output row by
    (launch_reduce); `window` > 0: each row attends to its last `window` positions only."""
    sh = decode_shape(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, out)
    kg, vg, head_dim = sh.kg, sh.vg, sh.head_dim
    defaults = dict(block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2,
                    programs_per_sm=legacy_programs_per_sm(head_dim, kg.quantized))
    go = split_launch(sh, defaults, page_size, q.device, chunk_len, block_n, num_warps,
                      num_stages, programs_per_sm)
    bufs, qk_f16, (kv, ks, kpe, kph, kch), (vv, vs, vpe, vph, vch) = split_operands(
        sh, q, k_pool, v_pool, workspace, go.n_chunks)
    launchable(_decode_split)[(go.n_chunks, sh.n_kv)](
        q, kv, ks, vv, vs, page_table, q_pos, *bufs,
        q.stride(0), q.stride(1), sh.n_rows, go.n_chunks, go.chunk_len, sh.table_len,
        kpe, kph, kch, vpe, vph, vch, window,
        QK_SCALE=scale * LOG2E, G=sh.group, D=head_dim, P=page_size, BLOCK_M=sh.block_m,
        BLOCK_N=go.block_n,
        K_TYPE=kg.kv_type, V_TYPE=vg.kv_type, QK_F16=qk_f16, K_SPLIT=k_split(kg.kv_type),
        WINDOWED=window > 0, INTERP=interpreting(),
        num_warps=go.num_warps, num_stages=go.num_stages, **pdl_launch(q.device))
    return launch_reduce(sh, bufs, q_pos, go.n_chunks, go.chunk_len, page_size, out_rot)
