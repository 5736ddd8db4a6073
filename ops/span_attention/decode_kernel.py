"""span_attention for few query rows (decode, speculative verify): flash-decoding.

Pass 1 (`_decode_split`): program (chunk c, KV head h) covers logical positions
[c * CHUNK, (c + 1) * CHUNK) for all query rows and all query heads of h's group
(M = rows * group rows of one tl.dot), dequantizes each tile in registers and writes a
partial (m, l, acc). Pass 2 (`_decode_reduce`): one program per (h, row) merges the
partials in chunk order. Chunks are cut by logical position from the page table's length
only, never by where a page lives, so any placement of the same logical KV gives bitwise
the same output. The context length is read from q_pos on the device (no host sync).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvcompile.ops.span_attention.launch import (check_launch, dot_mode, interpreting, k_split,
                                                 launchable, pool_args, query_operand,
                                                 num_sms, page_geometry)
from kvcompile.ops.span_attention.paged_tile import (load_tile, load_v_tile, online_softmax,
                                                     qk_quantized, qk_scores, v_operand)
from kvcompile.ops.span_attention.workspace import carve

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split(q_ptr, k_vals, k_scl, v_vals, v_scl, page_table, q_pos_ptr,
                  m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, n_rows, n_chunks, chunk_len,
                  table_len, k_page_elems, k_page_halves, k_code_halves, v_page_elems,
                  v_page_halves, v_code_halves, QK_SCALE: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, QK_F16: tl.constexpr,
                  K_SPLIT: tl.constexpr, INTERP: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    n_kv = tl.num_programs(1)
    r = tl.arange(0, BLOCK_M)
    t = r // G
    row_ok = t < n_rows
    qp = tl.load(q_pos_ptr + t, mask=row_ok, other=-1)
    n_ctx = tl.minimum(tl.max(qp, 0) + 1, table_len * P)
    start = c * chunk_len
    end = tl.minimum(start + chunk_len, n_ctx)  # start >= end: chunk past the context
    d = tl.arange(0, D)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + (h * G + r % G) * stride_qh
    q = tl.load(qrow[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        lp = n0 // P
        off = tl.multiple_of(n0 % P, BLOCK_N) + tl.arange(0, BLOCK_N)
        pos = n0 + tl.arange(0, BLOCK_N)
        live = pos < end
        phys = tl.load(page_table + lp).to(tl.int64)
        if K_TYPE == 2 or K_TYPE == 8:
            s = qk_quantized(q, k_vals, k_scl, phys, h, off, live, k_page_elems, k_page_halves,
                             k_code_halves, BLOCK_N, P, D, K_TYPE, INTERP)
        else:
            k = load_tile(k_vals, k_scl, phys, h, off, live, k_page_elems, k_page_halves,
                          k_code_halves, BLOCK_N, P, D, K_TYPE)
            s = qk_scores(q, k, K_SPLIT, QK_F16, INTERP)
        s = s * QK_SCALE
        s = tl.where(pos[None, :] <= qp[:, None], s, float("-inf"))
        p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
        v = load_v_tile(v_vals, v_scl, phys, h, off, live, v_page_elems, v_page_halves,
                      v_code_halves, BLOCK_N, P, D, V_TYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v_operand(v, V_TYPE))
        m_i = m_new
    mrows = n_rows * G
    slot = (h * n_chunks + c) * mrows + r
    ok = (r < mrows) & (start < n_ctx)
    tl.store(m_ptr + slot, m_i, mask=ok)
    tl.store(l_ptr + slot, l_i, mask=ok)
    tl.store(acc_ptr + slot.to(tl.int64)[:, None] * D + d[None, :], acc, mask=ok[:, None])


@triton.jit
def _decode_reduce(m_ptr, l_ptr, acc_ptr, q_pos_ptr, out_ptr, stride_ot, stride_oh,
                   n_rows, n_chunks, chunk_len, table_len,
                   G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                   ROWS_P2: tl.constexpr, BLOCK_C: tl.constexpr):
    h = tl.program_id(0)
    r = tl.program_id(1)
    tr = tl.arange(0, ROWS_P2)
    qp = tl.load(q_pos_ptr + tr, mask=tr < n_rows, other=-1)
    n_ctx = tl.minimum(tl.max(qp, 0) + 1, table_len * P)
    used = tl.cdiv(n_ctx, chunk_len)
    mrows = n_rows * G
    d = tl.arange(0, D)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for c0 in range(0, used, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        ok = cc < used
        slot = (h * n_chunks + cc) * mrows + r
        mc = tl.load(m_ptr + slot, mask=ok, other=float("-inf"))
        lc = tl.load(l_ptr + slot, mask=ok, other=0.0)
        ac = tl.load(acc_ptr + slot.to(tl.int64)[:, None] * D + d[None, :],
                     mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(mc, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        w = tl.exp2(mc - m_use)
        l_run = l_run * alpha + tl.sum(lc * w, 0)
        acc = acc * alpha + tl.sum(ac * w[:, None], 0)
        m_run = m_new
    t = r // G
    g = r % G
    o = acc / l_run
    optr = out_ptr + t.to(tl.int64) * stride_ot + (h * G + g) * stride_oh + d
    tl.store(optr, o.to(out_ptr.dtype.element_ty))


PROGRAMS_PER_SM = 2


def decode_chunking(table_len: int, page_size: int, n_kv_heads: int, block_n: int,
                    sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """(chunk_len, n_chunks): about `programs_per_sm` programs per SM over the table."""
    n_tiles = table_len * page_size // block_n
    want = max(1, (programs_per_sm * sms) // n_kv_heads)
    tiles_per_chunk = max(1, math.ceil(n_tiles / want))
    chunk_len = tiles_per_chunk * block_n
    return chunk_len, math.ceil(table_len * page_size / chunk_len)


def span_attention_decode(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size,
                          scale, out=None, chunk_len=None, block_n=None, num_warps=None,
                          num_stages=None, programs_per_sm=PROGRAMS_PER_SM, workspace=None):
    """Launch the split + reduce kernels; `out` may be given in any float dtype (tests use
    fp32 to see the kernel's own error without the final rounding); `workspace` is an fp32
    buffer for the partials (workspace.py), allocated per call when None."""
    check_launch(q, k_pool, v_pool, page_table, q_pos, page_size)
    n_rows, n_q_heads, head_dim = q.shape
    kg = page_geometry(k_pool, k_type, page_size, head_dim)
    vg = page_geometry(v_pool, v_type, page_size, head_dim)
    n_kv = kg.n_heads
    group = n_q_heads // n_kv
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, "out must be [T, Hq, D], last dim dense"
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    block_n = min(block_n, page_size)
    assert page_size % block_n == 0, f"block_n {block_n} must divide page size {page_size}"
    table_len = page_table.shape[0]
    if chunk_len is None:
        chunk_len, n_chunks = decode_chunking(table_len, page_size, n_kv, block_n,
                                              num_sms(q.device), programs_per_sm)
    else:
        assert chunk_len % block_n == 0, "chunk_len must be a multiple of block_n"
        n_chunks = math.ceil(table_len * page_size / chunk_len)
    mrows = n_rows * group
    block_m = max(16, triton.next_power_of_2(mrows))
    m_buf, l_buf, acc_buf = carve(workspace, n_kv, n_chunks, mrows, head_dim, q.device)
    qk_f16 = dot_mode(q.dtype, kg.kv_type)
    q16 = query_operand(q, qk_f16)
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2
    kv, ks, kpe, kph, kch = pool_args(k_pool, kg)
    vv, vs, vpe, vph, vch = pool_args(v_pool, vg)
    launchable(_decode_split)[(n_chunks, n_kv)](
        q16, kv, ks, vv, vs, page_table, q_pos, m_buf, l_buf, acc_buf,
        q16.stride(0), q16.stride(1), n_rows, n_chunks, chunk_len, table_len,
        kpe, kph, kch, vpe, vph, vch,
        QK_SCALE=scale * LOG2E, G=group, D=head_dim, P=page_size, BLOCK_M=block_m,
        BLOCK_N=block_n,
        K_TYPE=kg.kv_type, V_TYPE=vg.kv_type, QK_F16=qk_f16, K_SPLIT=k_split(kg.kv_type),
        INTERP=interpreting(),
        num_warps=num_warps, num_stages=num_stages)
    launchable(_decode_reduce)[(n_kv, mrows)](
        m_buf, l_buf, acc_buf, q_pos, out, out.stride(0), out.stride(1),
        n_rows, n_chunks, chunk_len, table_len,
        G=group, D=head_dim, P=page_size, ROWS_P2=max(2, triton.next_power_of_2(n_rows)),
        BLOCK_C=16, num_warps=4)
    return out
