"""span_attention for many query rows (prefill): causal flash attention over paged KV.

Program (query tile of BLOCK_M rows, query head). Key tiles that every row of the tile
sees (below min q_pos + 1) run without a mask; the rest, up to max q_pos, are masked by
key position <= q_pos[row]. Tiles are read through the page table in logical order and
dequantized in registers, so the result does not depend on where pages live.

One launch may also cover only a piece of the logical pages (first_page..end_page, the
piece a streamed layer has staged): every query tile then steps through the piece's key
tiles and carries its online-softmax state (m, l, fp32 accumulator) in an fp32 workspace
to the next launch; the launch of the last piece normalizes and writes the output
(prefill_chunks.PrefillAccumulator). The one-launch path is the same kernel over the whole
table without state I/O, so any split gives bitwise the same output: the same key tiles
in the same order through the same step code.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcompile.ops import kv_format as F
from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.span_attention.launch import (check_launch, dot_mode, k_split,
                                                 page_geometry, pool_args, query_operand)
from kvcompile.ops.span_attention.paged_tile import (causal_softmax, k_value_scores,
                                                     in_span, load_v_tile, qk_quantized,
                                                     v_operand, window_begin)
from kvcompile.ops.span_attention.dequant_pages import (DEQUANT_ROWS, DEQUANT_TOKENS,
                                                        dequant_pages, fp16_pool)

LOG2E = 1.4426950408889634


@triton.jit
def _tiles(n_lo, n_hi, q, acc, m_i, l_i, qp, k_vals, k_scl, v_vals, v_scl, page_table,
           table_base, hk, begin, n_ctx, win, k_page_elems, k_page_halves, k_code_halves,
           v_page_elems, v_page_halves, v_code_halves, QK_SCALE: tl.constexpr,
           MASKED: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
           K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, QK_F16: tl.constexpr,
           K_SPLIT: tl.constexpr, WINDOWED: tl.constexpr, INTERP: tl.constexpr):
    """The key tiles [n_lo, n_hi) in order, each through the online softmax (MASKED: by
    causality and the window)."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        lp = n0 // P
        off = tl.multiple_of(n0 % P, BLOCK_N) + tl.arange(0, BLOCK_N)
        pos = n0 + tl.arange(0, BLOCK_N)
        live = in_span(pos, begin, n_ctx, WINDOWED)
        phys = tl.load(page_table + (lp - table_base)).to(tl.int64)
        if K_TYPE == 2 or K_TYPE == 8:
            s = qk_quantized(q, k_vals, k_scl, phys, hk, off, live, k_page_elems,
                             k_page_halves, k_code_halves, BLOCK_N, P, D, K_TYPE, INTERP)
        else:
            s = k_value_scores(q, k_vals, k_scl, phys, hk, off, live, k_page_elems,
                               k_page_halves, k_code_halves, BLOCK_N, P, D, K_TYPE, K_SPLIT,
                               QK_F16, INTERP)
        p, alpha, m_new, l_i = causal_softmax(s, pos, qp, m_i, l_i, win, QK_SCALE, MASKED,
                                              WINDOWED)
        v = load_v_tile(v_vals, v_scl, phys, hk, off, live, v_page_elems, v_page_halves,
                        v_code_halves, BLOCK_N, P, D, V_TYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v_operand(v, V_TYPE))
        m_i = m_new
    return acc, m_i, l_i


# Integers that change from call to call are not specialized (Triton compiles a kernel per
# divisibility of its integer arguments): the piece bounds of a chunked prefill, and a
# chunk's rows and pages, which a conversation's next turn meets in combinations no earlier
# chunk had -- a compile inside that turn's time to first token.
@triton.jit(do_not_specialize=["n_rows", "table_len", "first_page", "end_page", "ws_m_off",
                               "ws_l_off"])
def _prefill(q_ptr, k_vals, k_scl, v_vals, v_scl, page_table, q_pos_ptr, out_ptr, ws_ptr,
             stride_qt, stride_qh, stride_ot, stride_oh, n_rows, table_len, first_page,
             end_page, ws_m_off, ws_l_off,
             k_page_elems, k_page_halves, k_code_halves, v_page_elems, v_page_halves,
             v_code_halves, win, QK_SCALE: tl.constexpr,
             G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, QK_F16: tl.constexpr,
             K_SPLIT: tl.constexpr, LOAD_STATE: tl.constexpr, FINISH: tl.constexpr,
             WINDOWED: tl.constexpr, INTERP: tl.constexpr):
    # longest query tiles first: they have the most key tiles
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // G
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = t < n_rows
    qp = tl.load(q_pos_ptr + t, mask=row_ok, other=0)
    cap = table_len * P - 1
    qp = tl.minimum(qp, cap)
    lo = tl.min(tl.where(row_ok, qp, cap), 0) + 1           # every row sees [0, lo)
    hi = tl.max(tl.where(row_ok, qp, 0), 0) + 1             # some row sees [.., hi)
    full_end = (lo // BLOCK_N) * BLOCK_N
    # with a window: key tiles from `w_first` (the tile of the first position any row sees)
    # up to `w_full` are masked at the window's edge; from w_full on, every row sees all of
    # a tile up to full_end (w_full <= full_end; tiles stay in ascending order)
    begin = window_begin(qp, row_ok, win, WINDOWED)
    if WINDOWED:
        w_first = begin // BLOCK_N * BLOCK_N
        last_edge = tl.maximum(tl.max(tl.where(row_ok, qp, 0), 0) - win + 1, 0)
        w_full = tl.minimum(tl.cdiv(last_edge, BLOCK_N) * BLOCK_N, full_end)
    else:
        w_first = 0
        w_full = 0
    # this launch's key positions: the pages first_page..end_page - 1 (piece bounds are
    # multiples of BLOCK_N, so the key tiles are those of one launch). The first piece
    # starts at 0 and the last ends at the table's end (hi <= table_len * P): constant
    # bounds there keep the one-launch loops (first and last at once) as they were.
    if LOAD_STATE or WINDOWED:   # a windowed layer's first piece may start past page 0
        base = first_page
        n_begin = first_page * P
        start_masked = tl.maximum(full_end, n_begin)
    else:
        base = 0
        n_begin = 0
        start_masked = full_end
    if FINISH:
        end_full = full_end
        end_all = hi
        end_edge = w_full
    else:
        end_full = tl.minimum(full_end, end_page * P)
        end_all = tl.minimum(hi, end_page * P)
        end_edge = tl.minimum(w_full, end_page * P)
    # some key tile in this piece; a tensor over the rows, since Triton 3.9's interpreter
    # rejects masks made with a scalar comparison (decode_split.partial_rows_ok)
    touched = t * 0 + n_begin < end_all
    d = tl.arange(0, D)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + hq * stride_qh
    q = tl.load(qrow[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    wrow = hq.to(tl.int64) * n_rows + t                      # workspace row of (hq, t)
    if LOAD_STATE:
        if FINISH:
            live = row_ok
        else:                   # an untouched tile's state is only needed to normalize it
            live = row_ok & touched
        m_i = tl.load(ws_ptr + ws_m_off + wrow, mask=live, other=float("-inf"))
        l_i = tl.load(ws_ptr + ws_l_off + wrow, mask=live, other=0.0)
        acc = tl.load(ws_ptr + wrow[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
    # the key tiles in ascending order: a windowed tile's masked edge, the tiles every row
    # sees whole, then those that reach past some row
    pages = (k_vals, k_scl, v_vals, v_scl, page_table, base, hk, begin, hi, win,
             k_page_elems, k_page_halves, k_code_halves, v_page_elems, v_page_halves,
             v_code_halves)
    if WINDOWED:
        acc, m_i, l_i = _tiles(tl.maximum(w_first, n_begin), end_edge, q, acc, m_i, l_i, qp,
                               *pages, QK_SCALE, True, D, P, BLOCK_N, K_TYPE, V_TYPE, QK_F16,
                               K_SPLIT, WINDOWED, INTERP)
        n_full = tl.maximum(w_full, n_begin)
    else:
        n_full = n_begin
    acc, m_i, l_i = _tiles(n_full, end_full, q, acc, m_i, l_i, qp, *pages, QK_SCALE, False, D,
                           P, BLOCK_N, K_TYPE, V_TYPE, QK_F16, K_SPLIT, WINDOWED, INTERP)
    acc, m_i, l_i = _tiles(start_masked, end_all, q, acc, m_i, l_i, qp, *pages, QK_SCALE,
                           True, D, P, BLOCK_N, K_TYPE, V_TYPE, QK_F16, K_SPLIT, WINDOWED,
                           INTERP)
    if FINISH:
        o = acc / l_i[:, None]
        optr = out_ptr + t.to(tl.int64)[:, None] * stride_ot + hq * stride_oh + d[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # the first piece stores every tile's state (the next piece loads it); later
        # pieces only the tiles they changed
        if LOAD_STATE:
            keep = row_ok & touched
        else:
            keep = row_ok
        tl.store(ws_ptr + ws_m_off + wrow, m_i, mask=keep)
        tl.store(ws_ptr + ws_l_off + wrow, l_i, mask=keep)
        tl.store(ws_ptr + wrow[:, None] * D + d[None, :], acc, mask=keep[:, None])


def prefill_config(head_dim: int, page_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an H100/H200-class GPU."""
    if head_dim <= 64:
        cfg = (128, 64, 4, 3)
    elif head_dim <= 128:
        cfg = (128, 128, 8, 2)
    else:
        cfg = (128, 64, 8, 2)
    return cfg[0], min(cfg[1], page_size), cfg[2], cfg[3]


def workspace_numel(n_rows: int, n_q_heads: int, head_dim: int) -> int:
    """fp32 elements of the state carried between prefill pieces for q of [n_rows,
    n_q_heads, head_dim]: acc [Hq, T, D], then m [Hq, T], then l [Hq, T] (4 * that bytes:
    about (head_dim + 2) / head_dim times an fp32 output)."""
    return n_q_heads * n_rows * (head_dim + 2)


def launch_prefill(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, scale,
                   out, *, n_pages=None, first_page=0, workspace=None, load_state=False,
                   finish=True, block_m=None, block_n=None, num_warps=None,
                   num_stages=None, window=0, dequant_rows=DEQUANT_ROWS,
                   dequant_tokens=DEQUANT_TOKENS):
    """One launch over logical pages first_page..first_page + len(page_table) - 1
    (page_table[i] = physical page of logical page first_page + i) for every query tile.
    n_pages: the layer's logical pages (default: the table's), which caps q_pos.
    load_state: start from the state in `workspace`, else from nothing; finish: write
    `out` normalized, else store the state to `workspace`. window > 0: each row sees its
    last `window` positions only (a windowed layer's first piece may start at the window's
    first page; pages before it are never read). From `dequant_rows` query rows on, q8_0 /
    q4_0 pages are first dequantized to fp16 pages, `dequant_tokens` positions at a time,
    and each such span is one launch (dequant_pages.py)."""
    check_launch(q, k_pool, v_pool, page_table, q_pos, page_size)
    table_len = page_table.shape[0] if n_pages is None else n_pages
    # the kernel's constant bounds rely on these (PrefillAccumulator checks the caller's)
    assert load_state or window or first_page == 0, "a piece without state starts at page 0"
    assert not finish or first_page + page_table.shape[0] == table_len, \
        "the finishing piece ends at the last page"
    assert workspace is not None or (finish and not load_state), "state needs a workspace"
    head_dim = q.shape[2]
    kg = page_geometry(k_pool, k_type, page_size, head_dim)
    vg = page_geometry(v_pool, v_type, page_size, head_dim)
    piece = Piece(table_len, first_page, workspace, load_state, finish)
    launch = Launch(page_size, scale, window, block_m, block_n, num_warps, num_stages)
    if (kg.quantized or vg.quantized) and q.shape[0] >= dequant_rows:
        return _launch_dequantized(q, (k_pool, kg), (v_pool, vg), page_table, q_pos, out,
                                   piece, launch, dequant_tokens)
    return _launch(q, (k_pool, kg), (v_pool, vg), page_table, q_pos, out, piece, launch)


class Piece(NamedTuple):
    """Where a launch stands in the layer's pages (launch_prefill's arguments)."""
    table_len: int
    first_page: int
    workspace: torch.Tensor | None
    load_state: bool
    finish: bool


class Launch(NamedTuple):
    """What every launch of one prefill shares."""
    page_size: int
    scale: float
    window: int
    block_m: int | None
    block_n: int | None
    num_warps: int | None
    num_stages: int | None


def _launch(q, k, v, page_table, q_pos, out, piece: Piece, launch: Launch):
    """The kernel over one table: k and v are (pool, PageGeometry)."""
    (k_pool, kg), (v_pool, vg) = k, v
    n_rows, n_q_heads, head_dim = q.shape
    page_size = launch.page_size
    bm, bn, nw, ns = prefill_config(head_dim, page_size)
    block_m = launch.block_m or bm
    block_n = min(launch.block_n or bn, page_size)
    assert page_size % block_n == 0, f"block_n {block_n} must divide page size {page_size}"
    qk_f16 = dot_mode(q.dtype, kg.kv_type)
    q16 = query_operand(q, qk_f16)
    grid = (triton.cdiv(n_rows, block_m), n_q_heads)
    kv, ks, kpe, kph, kch = pool_args(k_pool, kg)
    vv, vs, vpe, vph, vch = pool_args(v_pool, vg)
    rows = n_q_heads * n_rows
    # not read or written without state
    ws = out if piece.workspace is None else piece.workspace
    launchable(_prefill)[grid](
        q16, kv, ks, vv, vs, page_table, q_pos, out, ws,
        q16.stride(0), q16.stride(1), out.stride(0), out.stride(1), n_rows, piece.table_len,
        piece.first_page, piece.first_page + page_table.shape[0], rows * head_dim,
        rows * (head_dim + 1), kpe, kph, kch, vpe, vph, vch, launch.window,
        QK_SCALE=launch.scale * LOG2E, G=n_q_heads // kg.n_heads, D=head_dim, P=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        K_TYPE=kg.kv_type, V_TYPE=vg.kv_type, QK_F16=qk_f16, K_SPLIT=k_split(kg.kv_type),
        LOAD_STATE=piece.load_state, FINISH=piece.finish, WINDOWED=launch.window > 0,
        INTERP=interpreting(), num_warps=launch.num_warps or nw,
        num_stages=launch.num_stages or ns)
    return out


def _launch_dequantized(q, k, v, page_table, q_pos, out, piece: Piece, launch: Launch,
                        dequant_tokens: int):
    """_launch over fp16 copies of the quantized pages, a span at a time, the softmax
    state carried between spans. A float pool's pages are gathered beside them as they
    are (the kernel takes one page table for K and V)."""
    n, d, p = page_table.shape[0], q.shape[2], launch.page_size
    per = max(1, min(n, dequant_tokens // p))
    ws = piece.workspace
    if ws is None and not (piece.finish and n <= per and not piece.load_state):
        ws = torch.empty(workspace_numel(*q.shape), dtype=torch.float32, device=q.device)
    # (pool, geometry, is V, the fp16 pool it is dequantized into, that pool's geometry)
    sides = []
    for (pool, g), is_v in ((k, False), (v, True)):
        buf = fp16_pool(per, g.n_heads, p, d, q.device) if g.quantized else None
        sides.append((pool, g, is_v, buf,
                      page_geometry(buf, F.F16.ggml_id, p, d) if g.quantized else g))
    ident = torch.arange(per, dtype=torch.int32, device=q.device)
    for s in range(0, n, per):
        span = page_table[s:s + per]
        first = piece.first_page + s
        k16, v16 = [(dequant_pages(pool, g, p, d, span, q_pos, first, launch.window, is_v,
                                   buf), g16)
                    if g.quantized else (pool.index_select(0, span.long()), g)
                    for pool, g, is_v, buf, g16 in sides]
        _launch(q, k16, v16, ident[:span.shape[0]], q_pos, out,
                Piece(piece.table_len, first, ws, piece.load_state or s > 0,
                      piece.finish and s + per >= n), launch)
    return out


def span_attention_prefill(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size,
                           scale, out=None, **launch_opts):
    """Causal attention of every row of q over the whole page table in one launch (or one
    per dequantized span: launch_prefill's options)."""
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, "out must be [T, Hq, D], last dim dense"
    return launch_prefill(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size,
                          scale, out, **launch_opts)
