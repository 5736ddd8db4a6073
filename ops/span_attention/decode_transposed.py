"""span_attention decode, "transposed" implementation: the blocks kernel's math with scores
computed as S^T = K Q^T, positions on the tensor-core tile's 16-row side.

Why: one query row of a GQA model brings only G = 4-8 query rows a KV head. The blocks
kernel puts them on the dot's row side (M, padded to 16), so 12 of 16 rows of every score,
softmax and accumulator tile are padding. Transposed, positions fill M and the query rows
sit on the narrow side (N, padded by Triton to the MMA's 8): half the score registers and
elementwise work, half the MMAs, and V enters P @ V as V^T straight from its position-major
page (no transpose). Same chunks, same partials, same reduce as the other decode kernels, so
placement independence holds the same way.

Quantized K and V only (q8_0 / q4_0 pairs); the codes reach fp16 as in quant_blocks. The
codes are staged in shared memory by Triton's pipeliner: by TMA in untraced launches on
Hopper (inside the op, unless inductor traces it), else by cp.async (tma_codes: the same
bytes, the same bits); the K and V scales are read one tile ahead by hand (tile_scales) and
their page two tiles ahead (page_of).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvcompile.ops.launching import interpreting, launchable, register_cap
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers_hold_next
from kvcompile.ops.span_attention.decode_kernel import LOG2E
from kvcompile.ops.span_attention.decode_split import (decode_shape, decode_tile,
                                                       launch_reduce, partial_slot,
                                                       program_rows_and_chunk, split_launch,
                                                       split_operands, store_partial_stats,
                                                       partial_rows_ok)
from kvcompile.ops.span_attention.paged_tile import in_span, online_softmax_along, visible
from kvcompile.ops.span_attention.quant_blocks import (q4_codes_f16, q8_codes_f16,
                                                       scaled_v_codes_t, v_scales_t,
                                                       value_columns)
from kvcompile.ops.span_attention.tma_codes import (code_descriptors, k_code_block,
                                                     tma_possible, v_code_tile)


@triton.jit
def page_of(page_table, n0, end, P: tl.constexpr):
    """Physical page of logical position n0 (int64), 0 from `end` on (no read past it)."""
    return tl.load(page_table + n0 // P, mask=n0 < end, other=0).to(tl.int64)


@triton.jit
def tile_scales(phys, n0, begin, end, k_scl, v_scl, h, k_page_halves, k_code_halves,
                v_page_halves, v_code_halves, P: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, WINDOWED: tl.constexpr):
    """The K scales [N, NB] and V scales [NB, N] (fp16) of tile [n0, n0 + BLOCK_N) of head h
    on page `phys`, 0 at positions outside [begin, end)."""
    NB: tl.constexpr = D // 32
    off = tl.multiple_of(n0 % P, BLOCK_N) + tl.arange(0, BLOCK_N)
    live = in_span(n0 + tl.arange(0, BLOCK_N), begin, end, WINDOWED)
    row = h * P + off
    b = tl.arange(0, NB)
    ks = tl.load(k_scl + phys * k_page_halves + k_code_halves + row[:, None] * NB + b[None, :],
                 mask=live[:, None], other=0.0)
    return ks, v_scales_t(v_scl, phys, h, off, live, v_page_halves, v_code_halves, D, P)


@triton.jit
def qk_blocks_t(qrow, row_ok, k_codes, ks, phys, h, n0, off, page_elems, P: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr,
                K_TYPE: tl.constexpr, TMA: tl.constexpr, INTERP: tl.constexpr):
    """Scores^T [N, R] (fp32, before the softmax scale) of positions `off` (tile [n0,
    n0 + BLOCK_N)) of head h on page `phys`, scales ks [N, NB] (tile_scales), against the
    query rows `qrow` (pointers, read as fp16): per 32-value block one dot codes [N, 32] x
    q^T [32, R], times the block's scale (exact up to fp32 accumulation, as
    quant_blocks.qk_blocks). Codes (tma_codes.k_code_block) unmasked: rows past the context
    have scale 0."""
    NB: tl.constexpr = D // 32
    KROW: tl.constexpr = D if K_TYPE == 8 else D // 2
    ks = ks.to(tl.float32)
    s = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
    for b in tl.static_range(NB):
        sc = tl.sum(tl.where(tl.arange(0, NB)[None, :] == b, ks, 0.0), 1)      # column b
        if K_TYPE == 8:
            j = tl.arange(0, 32)
            c = k_code_block(k_codes, phys, h, n0, off, b, page_elems, P, BLOCK_N, KROW, 32,
                             TMA)                                                # [N, 32]
            qb = tl.load(qrow[None, :] + b * 32 + j[:, None], mask=row_ok[None, :],
                         other=0.0).to(tl.float16)                               # [32, R]
            part = tl.dot(q8_codes_f16(c, INTERP), qb)
        else:
            j = tl.arange(0, 16)
            byte = k_code_block(k_codes, phys, h, n0, off, b, page_elems, P, BLOCK_N, KROW, 16,
                                TMA)
            qa = tl.load(qrow[None, :] + b * 32 + j[:, None], mask=row_ok[None, :],
                         other=0.0).to(tl.float16)
            qb = tl.load(qrow[None, :] + b * 32 + 16 + j[:, None], mask=row_ok[None, :],
                         other=0.0).to(tl.float16)
            lo, hi = q4_codes_f16(byte, INTERP)
            part = tl.dot(lo, qa)
            part = tl.dot(hi, qb, part)
        s += part * sc[:, None]
    return s


@triton.jit
def _decode_split_t(q_ptr, k_codes, k_scl, v_codes, v_scl, page_table, q_pos_ptr,
                    m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, n_rows, n_chunks,
                    chunk_len, table_len, k_page_elems, k_page_halves, k_code_halves,
                    v_page_elems, v_page_halves, v_code_halves, win,
                    QK_SCALE: tl.constexpr,
                    G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, TMA: tl.constexpr,
                    WINDOWED: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers_hold_next(PDL)
    V4: tl.constexpr = V_TYPE == 2
    DA: tl.constexpr = D // 2 if V4 else D        # accumulator heights (q4_0: two halves)
    DB: tl.constexpr = D // 2 if V4 else 16
    W: tl.constexpr = D // 2 if V4 else D         # V code rows a head
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    t, row_ok, qp, n_ctx, start, first, end, begin = program_rows_and_chunk(
        q_pos_ptr, r, n_rows, chunk_len, table_len, win, G, P, BLOCK_N, WINDOWED)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + (h * G + r % G) * stride_qh
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc_a = tl.zeros([DA, BLOCK_R], tl.float32)
    acc_b = tl.zeros([DB, BLOCK_R], tl.float32)
    # Scales are read a tile ahead and their page two tiles ahead: the pipeliner stages
    # only the dots' operands (the codes), and an unstaged scale load waited a whole memory
    # latency every tile (Nsight Compute put most stalls on them: docs/findings.md,
    # "Decode attention kernels").
    ks, vs = tile_scales(page_of(page_table, first, end, P), first, begin, end, k_scl, v_scl,
                         h, k_page_halves, k_code_halves, v_page_halves, v_code_halves, P,
                         BLOCK_N, D, WINDOWED)
    phys_next = page_of(page_table, first + BLOCK_N, end, P)
    for n0 in range(first, end, BLOCK_N):
        off, pos, _, phys = decode_tile(page_table, n0, begin, end, P, BLOCK_N, WINDOWED)
        ks_next, vs_next = tile_scales(phys_next, n0 + BLOCK_N, begin, end, k_scl, v_scl, h,
                                       k_page_halves, k_code_halves, v_page_halves,
                                       v_code_halves, P, BLOCK_N, D, WINDOWED)
        phys_next = page_of(page_table, n0 + 2 * BLOCK_N, end, P)
        s = qk_blocks_t(qrow, row_ok, k_codes, ks, phys, h, n0, off, k_page_elems, P,
                        BLOCK_N, BLOCK_R, D, K_TYPE, TMA, INTERP)
        s = s * QK_SCALE
        s = tl.where(visible(pos[:, None], qp[None, :], win, WINDOWED), s, float("-inf"))
        p, alpha, m_new, l_i = online_softmax_along(s, m_i, l_i, 0)   # scores^T
        p16 = p.to(tl.float16)
        va, vb = scaled_v_codes_t(v_code_tile(v_codes, phys, h, n0, off, v_page_elems, P,
                                              BLOCK_N, W, TMA),
                                  vs, BLOCK_N, D, V_TYPE, INTERP)
        acc_a = tl.dot(va, p16, acc_a * alpha[None, :])
        if V4:
            acc_b = tl.dot(vb, p16, acc_b * alpha[None, :])
        m_i = m_new
        ks, vs = ks_next, vs_next
    slot = partial_slot(tl.program_id(0), r, h, n_chunks, n_rows, G)
    ok = partial_rows_ok(r, n_rows, G, start, n_ctx)
    store_partial_stats(m_ptr, l_ptr, m_i, l_i, slot, ok)
    base = acc_ptr + slot.to(tl.int64)[None, :] * D
    tl.store(base + value_columns(DA, 0 if V4 else -1)[:, None], acc_a, mask=ok[None, :])
    if V4:
        tl.store(base + value_columns(DB, 1)[:, None], acc_b, mask=ok[None, :])


# Most query rows a KV head (rows x group) this kernel takes; wider verify batches fill the
# blocks kernel's 16-row side anyway.
TRANSPOSED_MAX_ROWS = 16


def transposed_takes(k_quantized: bool, v_quantized: bool, rows_per_kv_head: int) -> bool:
    """Whether span_attention_decode_transposed takes this shape."""
    return k_quantized and v_quantized and rows_per_kv_head <= TRANSPOSED_MAX_ROWS


def transposed_config(head_dim: int, tma: bool) -> dict:
    """Launch defaults from sweeps at 32K-256K (1 query row, q8_0/q4_0, bench_attention.py;
    docs/findings.md, "Decode attention kernels"): 64 positions; 2 warps x 8 programs an SM
    for D <= 128, 4 warps x 4 programs an SM for D = 256 (128 registers a thread either way
    in the offline sm_90 count). Codes read by TMA: 2 stages (at D 256, 3 took 163
    registers, 3 programs an SM); by pointers (cp.async): 3 stages."""
    stages = 2 if tma else 3
    if head_dim <= 128:
        return dict(block_n=64, num_warps=2, num_stages=stages, programs_per_sm=8)
    return dict(block_n=64, num_warps=4, num_stages=stages, programs_per_sm=4)


def span_attention_decode_transposed(q, k_pool, v_pool, page_table, q_pos, k_type, v_type,
                                     page_size, scale, out=None, chunk_len=None,
                                     block_n=None, num_warps=None, num_stages=None,
                                     programs_per_sm=None, maxnreg=None, workspace=None,
                                     out_rot=None, tma=None, window=0):
    """Same contract as decode_kernel.span_attention_decode, for quantized K and V and at
    most TRANSPOSED_MAX_ROWS query rows a KV head. `tma`: read the codes by TMA (default:
    wherever tma_codes.tma_possible; True where it is not is an error, but for the
    interpreter, which reads descriptors too), False: by pointers; the same bits either way."""
    sh = decode_shape(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, out)
    kg, vg, head_dim = sh.kg, sh.vg, sh.head_dim
    assert transposed_takes(kg.quantized, vg.quantized, sh.mrows), \
        f"the transposed decode takes q8_0 / q4_0 K and V and at most {TRANSPOSED_MAX_ROWS} " \
        f"query rows a KV head (here {sh.mrows}): use blocks"
    possible = tma_possible(k_pool, v_pool)
    assert possible or interpreting() or not tma, "TMA needs a Hopper GPU, 16-byte aligned " \
        "pools and pages and an untraced launch (tma_codes); pass tma=None or False"
    tma = possible if tma is None else bool(tma)
    block_r = max(2, triton.next_power_of_2(sh.mrows))
    go = split_launch(sh, transposed_config(head_dim, tma), page_size, q.device, chunk_len,
                      block_n, num_warps, num_stages, programs_per_sm, maxnreg)
    bufs, _, (kv, ks, kpe, kph, kch), (vv, vs, vpe, vph, vch) = split_operands(
        sh, q, k_pool, v_pool, workspace, go.n_chunks, raw_codes=True)
    if tma:
        kv, vv = code_descriptors(k_pool, v_pool, kg.kv_type, vg.kv_type, kg.n_heads, head_dim,
                                  page_size, go.block_n)
    launchable(_decode_split_t)[(go.n_chunks, sh.n_kv)](
        q, kv, ks, vv, vs, page_table, q_pos, *bufs,
        q.stride(0), q.stride(1), sh.n_rows, go.n_chunks, go.chunk_len, sh.table_len,
        kpe, kph, kch, vpe, vph, vch, window,
        QK_SCALE=scale * LOG2E, G=sh.group, D=head_dim, P=page_size, BLOCK_R=block_r,
        BLOCK_N=go.block_n, K_TYPE=kg.kv_type, V_TYPE=vg.kv_type, TMA=tma,
        WINDOWED=window > 0, INTERP=interpreting(), num_warps=go.num_warps,
        num_stages=go.num_stages,
        **pdl_launch(q.device), **register_cap(go.maxnreg))
    return launch_reduce(sh, bufs, q_pos, go.n_chunks, go.chunk_len, page_size, out_rot,
                         few_warps=True)
