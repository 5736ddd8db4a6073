"""span_attention decode, "blocks" implementation: the split kernel of decode_kernel with
quantized K / V consumed block by block (quant_blocks), float pages as before.

Same split by logical position and the same reduce kernel, so placement independence and
chunking are unchanged; only the per-tile math differs (see quant_blocks for why).
"""
from __future__ import annotations


import triton
import triton.language as tl

from kvcompile.ops import kv_format as F
from kvcompile.ops import debug
from kvcompile.ops.launching import interpreting, launchable, register_cap
from kvcompile.ops.pdl import (launch as pdl_launch, wait_for_producers,
                               wait_for_producers_hold_next)
from kvcompile.ops.span_attention.decode_kernel import LOG2E, span_attention_decode
from kvcompile.ops.span_attention.decode_split import (decode_shape, decode_tile,
                                                       launch_reduce, partial_slot,
                                                       program_rows_and_chunk, split_launch,
                                                       split_operands, store_partial_stats,
                                                       partial_rows_ok)
from kvcompile.ops.span_attention.decode_transposed import (span_attention_decode_transposed,
                                                            transposed_takes)
from kvcompile.ops.span_attention.launch import k_split
from kvcompile.ops.span_attention.paged_tile import (causal_softmax, k_value_scores,
                                                     load_v_tile, query_tile, v_operand)
from kvcompile.ops.span_attention.quant_blocks import qk_blocks, v_blocks, value_columns


@triton.jit
def _decode_split_blocks(q_ptr, k_vals, k_scl, v_vals, v_scl, page_table, q_pos_ptr,
                         m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, n_rows, n_chunks,
                         chunk_len, table_len, k_page_elems, k_page_halves, k_code_halves,
                         v_page_elems, v_page_halves, v_code_halves, win,
                         QK_SCALE: tl.constexpr,
                         G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, QK_F16: tl.constexpr,
                         K_SPLIT: tl.constexpr, WINDOWED: tl.constexpr, INTERP: tl.constexpr,
                         PDL: tl.constexpr):
    KQ: tl.constexpr = K_TYPE == 2 or K_TYPE == 8
    # Quantized K: the reduce launches once this split's programs exited (as the transposed
    # split), which is faster there; float K keeps the early launch, which the hold slowed
    # (docs/findings.md, "Decode attention kernels").
    if KQ:
        wait_for_producers_hold_next(PDL)
    else:
        wait_for_producers(PDL)
    V4: tl.constexpr = V_TYPE == 2
    VQ: tl.constexpr = V_TYPE == 2 or V_TYPE == 8
    DA: tl.constexpr = D // 2 if V4 else D        # accumulator widths (q4_0: two halves)
    DB: tl.constexpr = D // 2 if V4 else 16
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    t, row_ok, qp, n_ctx, start, first, end, begin = program_rows_and_chunk(
        q_pos_ptr, r, n_rows, chunk_len, table_len, win, G, P, BLOCK_N, WINDOWED)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + (h * G + r % G) * stride_qh
    if not KQ:
        d = tl.arange(0, D)
        q = query_tile(tl.load(qrow[:, None] + d[None, :], mask=row_ok[:, None], other=0.0),
                       QK_F16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_M, DB], tl.float32)
    for n0 in range(first, end, BLOCK_N):
        off, pos, live, phys = decode_tile(page_table, n0, begin, end, P, BLOCK_N, WINDOWED)
        if KQ:
            s = qk_blocks(qrow, row_ok, k_vals, k_scl, phys, h * P + off, live, k_page_elems,
                          k_page_halves, k_code_halves, BLOCK_M, BLOCK_N, D, K_TYPE, INTERP)
        else:
            s = k_value_scores(q, k_vals, k_scl, phys, h, off, live, k_page_elems,
                               k_page_halves, k_code_halves, BLOCK_N, P, D, K_TYPE, K_SPLIT,
                               QK_F16, INTERP)
        p, alpha, m_new, l_i = causal_softmax(s, pos, qp, m_i, l_i, win, QK_SCALE, True, WINDOWED)
        p16 = p.to(tl.float16)
        if VQ:
            va, vb = v_blocks(v_vals, v_scl, phys, h, off, live, v_page_elems,
                              v_page_halves, v_code_halves, BLOCK_N, D, P, V_TYPE, INTERP)
            acc_a = tl.dot(p16, va, acc_a * alpha[:, None])
            if V4:
                acc_b = tl.dot(p16, vb, acc_b * alpha[:, None])
        else:
            v = load_v_tile(v_vals, v_scl, phys, h, off, live, v_page_elems, v_page_halves,
                          v_code_halves, BLOCK_N, P, D, V_TYPE)
            acc_a = tl.dot(p16, v_operand(v, V_TYPE), acc_a * alpha[:, None])
        m_i = m_new
    slot = partial_slot(tl.program_id(0), r, h, n_chunks, n_rows, G)
    ok = partial_rows_ok(r, n_rows, G, start, n_ctx)
    store_partial_stats(m_ptr, l_ptr, m_i, l_i, slot, ok)
    base = acc_ptr + slot.to(tl.int64)[:, None] * D
    tl.store(base + value_columns(DA, 0 if V4 else -1)[None, :], acc_a, mask=ok[:, None])
    if V4:
        tl.store(base + value_columns(DB, 1)[None, :], acc_b, mask=ok[:, None])


def blocks_config(head_dim: int, block_m: int, k_quantized: bool) -> dict:
    """Launch defaults. Quantized K with all query rows of a KV head in one 16-row tile
    (decode, narrow verify): the best of a sweep at 8K-256K, 1 query row: small programs,
    many an SM (the loop is latency bound): 64 positions, 1 warp, 8 programs an SM for
    D <= 128; 64 positions, 2 warps, 4 programs an SM for D = 256; both well ahead of the
    defaults they replaced (D <= 128: 128 positions x 4 warps x 2 programs) at long
    contexts (docs/findings.md, "Decode attention kernels"). No register cap by default
    (`maxnreg`; none under torch.compile: ops/launching).
    Wider verify: 64 positions (32 past 32 rows: registers), 8 warps; float K keeps
    decode_kernel's tile; both 2 programs an SM."""
    if k_quantized and block_m <= 16:
        if head_dim <= 128:
            return dict(block_n=64, num_warps=1, num_stages=3, programs_per_sm=8)
        return dict(block_n=64, num_warps=2, num_stages=3, programs_per_sm=4)
    num_warps = 4 if block_m <= 16 else 8
    if k_quantized:
        block_n = 64 if block_m <= 32 else 32
    else:
        block_n = 64 if head_dim <= 128 else 32
    return dict(block_n=block_n, num_warps=num_warps, num_stages=2, programs_per_sm=2)


def span_attention_decode_blocks(q, k_pool, v_pool, page_table, q_pos, k_type, v_type,
                                 page_size, scale, out=None, chunk_len=None, block_n=None,
                                 num_warps=None, num_stages=None, programs_per_sm=None,
                                 maxnreg=None, workspace=None, out_rot=None, window=0):
    """Same contract as decode_kernel.span_attention_decode; `maxnreg` caps registers a
    thread (more programs resident per SM; dropped under torch.compile). Launch options
    left None come from blocks_config."""
    sh = decode_shape(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, out)
    kg, vg, head_dim = sh.kg, sh.vg, sh.head_dim
    block_m = sh.block_m
    go = split_launch(sh, blocks_config(head_dim, block_m, kg.quantized), page_size, q.device,
                      chunk_len, block_n, num_warps, num_stages, programs_per_sm, maxnreg)
    bufs, qk_f16, (kv, ks, kpe, kph, kch), (vv, vs, vpe, vph, vch) = split_operands(
        sh, q, k_pool, v_pool, workspace, go.n_chunks, raw_codes=True)
    launchable(_decode_split_blocks)[(go.n_chunks, sh.n_kv)](
        q, kv, ks, vv, vs, page_table, q_pos, *bufs,
        q.stride(0), q.stride(1), sh.n_rows, go.n_chunks, go.chunk_len, sh.table_len,
        kpe, kph, kch, vpe, vph, vch, window,
        QK_SCALE=scale * LOG2E, G=sh.group, D=head_dim, P=page_size, BLOCK_M=block_m,
        BLOCK_N=go.block_n, K_TYPE=kg.kv_type, V_TYPE=vg.kv_type, QK_F16=qk_f16,
        K_SPLIT=k_split(kg.kv_type), WINDOWED=window > 0, INTERP=interpreting(),
        num_warps=go.num_warps, num_stages=go.num_stages, **pdl_launch(q.device),
        **register_cap(go.maxnreg))
    return launch_reduce(sh, bufs, q_pos, go.n_chunks, go.chunk_len, page_size, out_rot)


DECODE_IMPLS = {"legacy": span_attention_decode, "blocks": span_attention_decode_blocks,
                "transposed": span_attention_decode_transposed}
# The op's decode kernel; KVCOMPILE_DECODE_IMPL=auto|legacy|blocks|transposed, read once at
# import (a forced transposed refuses shapes it does not take).
DECODE_IMPL = debug.DECODE_IMPL
if DECODE_IMPL not in (*DECODE_IMPLS, "auto"):
    raise ValueError(f"KVCOMPILE_DECODE_IMPL={DECODE_IMPL!r}; use auto or one of "
                     f"{sorted(DECODE_IMPLS)}")
# auto: transposed for quantized K and V up to 8 query rows a KV head (there the blocks
# kernel's 16-row tile is at least half padding), blocks for other quantized pages up to 32
# query rows a KV head, legacy otherwise. Transposed is well ahead of blocks at 1 row (both
# geometries, 32K-256K) and at 8 rows a KV head, a tie at 12 and mixed at 16, so the switch
# stays at 8; blocks is ahead of legacy at 32 query rows a KV head and behind it at 48
# (docs/findings.md, "Decode attention kernels").
TRANSPOSED_AUTO_ROWS_PER_KV_HEAD = 8
BLOCKS_MAX_ROWS_PER_KV_HEAD = 32


def decode_launcher(impl: str | None = None, rows_per_kv_head: int = 1,
                    k_quantized: bool = True, v_quantized: bool = True):
    """The decode launcher of `impl` (default: DECODE_IMPL; auto picks by shape)."""
    impl = impl or DECODE_IMPL
    if impl == "auto":
        if transposed_takes(k_quantized, v_quantized, rows_per_kv_head) and \
                rows_per_kv_head <= TRANSPOSED_AUTO_ROWS_PER_KV_HEAD:
            impl = "transposed"
        elif (k_quantized or v_quantized) and rows_per_kv_head <= BLOCKS_MAX_ROWS_PER_KV_HEAD:
            impl = "blocks"
        else:
            impl = "legacy"
    return DECODE_IMPLS[impl]


def launcher_for(q, n_kv_heads: int, k_type, v_type, impl: str | None = None):
    """The decode launcher the op picks for query rows q [T, Hq, D] over n_kv_heads KV heads
    of these types (decode_launcher by shape; `impl` forces one)."""
    kt, vt = F.kv_type(k_type), F.kv_type(v_type)
    return decode_launcher(impl, q.shape[0] * (q.shape[1] // n_kv_heads), kt.quantized,
                           vt.quantized)
