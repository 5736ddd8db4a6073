"""What the three decode implementations (decode_kernel, decode_blocks, decode_transposed)
share around their split kernels: the launch's shapes and output, its options and the
chunking of the page table, a program's query rows, tiles and chunk of positions, its
partial softmax statistics, and the reduce launch."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcompile.ops.launching import launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers
from kvcompile.ops.span_attention.paged_tile import in_span, window_begin
from kvcompile.ops.span_attention.launch import (PageGeometry, check_launch, dot_mode,
                                                 num_sms, page_geometry, pool_args)
from kvcompile.ops.span_attention.workspace import carve, chunks_per_head


@dataclass(frozen=True)
class DecodeShape:
    n_rows: int
    head_dim: int
    group: int                 # query heads a KV head
    n_kv: int
    mrows: int                 # query rows x group: the rows of one program's tile
    table_len: int
    kg: PageGeometry
    vg: PageGeometry
    out: torch.Tensor

    @property
    def block_m(self) -> int:
        """The query-row tile: every row of a KV head, at least 16 (tl.dot's minimum)."""
        return max(16, triton.next_power_of_2(self.mrows))


def decode_shape(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size,
                 out) -> DecodeShape:
    """Check the launch and size it; `out` (any float dtype) is allocated like q when None."""
    check_launch(q, k_pool, v_pool, page_table, q_pos, page_size)
    n_rows, n_q_heads, head_dim = q.shape
    kg = page_geometry(k_pool, k_type, page_size, head_dim)
    vg = page_geometry(v_pool, v_type, page_size, head_dim)
    group = n_q_heads // kg.n_heads
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1, "out must be [T, Hq, D], last dim dense"
    return DecodeShape(n_rows, head_dim, group, kg.n_heads, n_rows * group,
                       page_table.shape[0], kg, vg, out)


def split_operands(sh: DecodeShape, q, k_pool, v_pool, workspace, n_chunks: int,
                   raw_codes: bool = False):
    """What either split kernel reads besides its tile config: (the partials' buffers in
    the workspace, whether Q.K runs in fp16 (the kernels cast the query), the K pool's and
    the V pool's arguments)."""
    bufs = carve(workspace, sh.n_kv, n_chunks, sh.mrows, sh.head_dim, q.device)
    return (bufs, dot_mode(q.dtype, sh.kg.kv_type), pool_args(k_pool, sh.kg, raw_codes),
            pool_args(v_pool, sh.vg, raw_codes))


def decode_chunking(table_len: int, page_size: int, n_kv_heads: int, block_n: int,
                    sms: int, programs_per_sm: int) -> tuple[int, int]:
    """(chunk_len, n_chunks): about `programs_per_sm` programs per SM over the table."""
    n_tiles = table_len * page_size // block_n
    want = chunks_per_head(n_kv_heads, sms, programs_per_sm)
    tiles_per_chunk = max(1, math.ceil(n_tiles / want))
    chunk_len = tiles_per_chunk * block_n
    return chunk_len, math.ceil(table_len * page_size / chunk_len)


@dataclass(frozen=True)
class SplitLaunch:
    """A split kernel's launch: tile, warps, stages, register cap, and its chunking."""
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None
    chunk_len: int
    n_chunks: int


def split_launch(sh: DecodeShape, defaults: dict, page_size: int, device,
                 chunk_len: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 programs_per_sm: int | None = None,
                 maxnreg: int | None = None) -> SplitLaunch:
    """The caller's launch options over a kernel's `defaults` (block_n, num_warps,
    num_stages, programs_per_sm, optionally maxnreg), checked, and the chunks they give."""
    block_n = min(block_n or defaults["block_n"], page_size)
    assert page_size % block_n == 0, f"block_n {block_n} must divide page size {page_size}"
    chunk_len, n_chunks = chunks(sh, page_size, block_n, chunk_len,
                                 programs_per_sm or defaults["programs_per_sm"], device)
    return SplitLaunch(block_n, num_warps or defaults["num_warps"],
                       num_stages or defaults["num_stages"], maxnreg or defaults.get("maxnreg"),
                       chunk_len, n_chunks)


def chunks(sh: DecodeShape, page_size: int, block_n: int, chunk_len: int | None,
           programs_per_sm: int, device) -> tuple[int, int]:
    """(chunk_len, n_chunks): the caller's chunk_len (a multiple of block_n), else about
    programs_per_sm programs an SM."""
    if chunk_len is None:
        return decode_chunking(sh.table_len, page_size, sh.n_kv, block_n, num_sms(device),
                               programs_per_sm)
    assert chunk_len % block_n == 0, "chunk_len must be a multiple of block_n"
    return chunk_len, math.ceil(sh.table_len * page_size / chunk_len)


# torch.compile takes every tensor a store's address depends on for written (and clones it
# before each launch under inductor); through a helper's call it follows all the helper's
# arguments. So the partials' addresses come from `partial_slot` alone (no pointer, no
# loaded value among its arguments): tests/test_kernel_access.py checks it.


@triton.jit
def program_rows_and_chunk(q_pos_ptr, r, n_rows, chunk_len, table_len, win, G: tl.constexpr,
                           P: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """For tile rows r (query row t = r // G): t, which rows exist, their positions, the
    context length, the program's chunk [start, end) of logical positions (empty past
    the context), the tile its loop starts at (`first`: the chunk's start, or with a window
    the tile of `begin`, the first position any row sees, where that is later) and `begin`.
    Chunks stay cut from the table alone; a chunk before every row's window runs no tile
    but still stores its (empty) partials. The context is read from q_pos on the device:
    no host sync."""
    t = r // G
    row_ok = t < n_rows
    qp = tl.load(q_pos_ptr + t, mask=row_ok, other=-1)
    n_ctx = tl.minimum(tl.max(qp, 0) + 1, table_len * P)
    start = tl.program_id(0) * chunk_len
    end = tl.minimum(start + chunk_len, n_ctx)  # start >= end: chunk past the context
    begin = window_begin(qp, row_ok, win, WINDOWED)
    if WINDOWED:
        first = tl.maximum(start, begin // BLOCK_N * BLOCK_N)
    else:
        first = start
    return t, row_ok, qp, n_ctx, start, first, end, begin


@triton.jit
def decode_tile(page_table, n0, begin, end, P: tl.constexpr, BLOCK_N: tl.constexpr,
                WINDOWED: tl.constexpr):
    """Tile [n0, n0 + BLOCK_N) of a program's chunk (inside one page): its offsets in the
    page, its logical positions, which of them lie before the chunk's end (and, WINDOWED,
    from `begin` on: read; the rest load as 0), and the page's physical index."""
    off = tl.multiple_of(n0 % P, BLOCK_N) + tl.arange(0, BLOCK_N)
    pos = n0 + tl.arange(0, BLOCK_N)
    return off, pos, in_span(pos, begin, end, WINDOWED), \
        tl.load(page_table + n0 // P).to(tl.int64)


@triton.jit
def partial_slot(chunk, r, h, n_chunks, n_rows, G: tl.constexpr):
    """Row of the partials' buffers that holds tile row r of `chunk` (KV head h): the split
    writes its own chunk's, the reduce reads them all."""
    return (h * n_chunks + chunk) * (n_rows * G) + r


@triton.jit
def partial_rows_ok(r, n_rows, G: tl.constexpr, start, n_ctx):
    """Which tile rows r store partials: real rows of a chunk that starts inside the
    context. Both sides are tensors: Triton 3.9's interpreter rejects a mask made from a
    tensor and a scalar comparison ('mask has unsupported dtype')."""
    return (r < n_rows * G) & (r * 0 + start < n_ctx)


@triton.jit
def store_partial_stats(m_ptr, l_ptr, m_i, l_i, slot, ok):
    """Store the program's running max and sum at `slot` where `ok`."""
    tl.store(m_ptr + slot, m_i, mask=ok)
    tl.store(l_ptr + slot, l_i, mask=ok)


@triton.jit
def _merge(m_run, l_run, acc, mc, lc, ac):
    """Running (max, sum, accumulator) merged with a tile of chunk partials."""
    m_new = tl.maximum(m_run, tl.max(mc, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_run - m_use)
    w = tl.exp2(mc - m_use)
    l_run = l_run * alpha + tl.sum(lc * w, 0)
    acc = acc * alpha + tl.sum(ac * w[:, None], 0)
    return m_new, l_run, acc


@triton.jit
def _decode_reduce(m_ptr, l_ptr, acc_ptr, q_pos_ptr, rot_ptr, out_ptr, stride_ot, stride_oh,
                   n_rows, n_chunks, chunk_len, table_len,
                   G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                   ROWS_P2: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                   ONE_STEP: tl.constexpr, ROT: tl.constexpr, PDL: tl.constexpr):
    """Value columns [pid2 * BLOCK_D, +BLOCK_D) of (head, tile row): the chunks' partials
    merged in chunk order; with ROT, times the rotation's diagonal block pid2 (fp32
    [BLOCK_D, BLOCK_D] at rot_ptr), which mixes only these columns. ONE_STEP (all chunks
    fit one tile): the partials are read alongside q_pos, not after it, and the chunks past
    the context masked once they are known (one memory round trip less)."""
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    if ROT:    # constant: read before the wait (ops/pdl.py)
        j = tl.arange(0, BLOCK_D)
        blk = rot_ptr + tl.program_id(2) * BLOCK_D * BLOCK_D
        rot = tl.load(blk + j[:, None] * BLOCK_D + j[None, :])
    wait_for_producers(PDL)
    h = tl.program_id(0)
    r = tl.program_id(1)
    tr = tl.arange(0, ROWS_P2)
    if ONE_STEP:
        cc = tl.arange(0, BLOCK_C)
        slot = partial_slot(cc, r, h, n_chunks, n_rows, G)
        have = cc < n_chunks
        mc = tl.load(m_ptr + slot, mask=have, other=float("-inf"))
        lc = tl.load(l_ptr + slot, mask=have, other=0.0)
        ac = tl.load(acc_ptr + slot.to(tl.int64)[:, None] * D + d[None, :],
                     mask=have[:, None], other=0.0)
    qp = tl.load(q_pos_ptr + tr, mask=tr < n_rows, other=-1)
    n_ctx = tl.minimum(tl.max(qp, 0) + 1, table_len * P)
    used = tl.cdiv(n_ctx, chunk_len)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    if ONE_STEP:       # chunks past the context hold stale partials: masked, never mixed in
        ok = cc < used
        m_run, l_run, acc = _merge(m_run, l_run, acc, tl.where(ok, mc, float("-inf")),
                                   tl.where(ok, lc, 0.0), tl.where(ok[:, None], ac, 0.0))
    else:
        for c0 in range(0, used, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            ok = cc < used
            slot = partial_slot(cc, r, h, n_chunks, n_rows, G)
            mc = tl.load(m_ptr + slot, mask=ok, other=float("-inf"))
            lc = tl.load(l_ptr + slot, mask=ok, other=0.0)
            ac = tl.load(acc_ptr + slot.to(tl.int64)[:, None] * D + d[None, :],
                         mask=ok[:, None], other=0.0)
            m_run, l_run, acc = _merge(m_run, l_run, acc, mc, lc, ac)
    t = r // G
    g = r % G
    o = acc / l_run
    if ROT:
        o = tl.sum(o[:, None] * rot, 0)
    optr = out_ptr + t.to(tl.int64) * stride_ot + (h * G + g) * stride_oh + d
    tl.store(optr, o.to(out_ptr.dtype.element_ty))


# fp32 partial accumulators one reduce program holds at once ([BLOCK_C, BLOCK_D] tile):
# 32 value columns a program without a rotation (more programs, shorter chains); with one,
# a diagonal block of it (the columns it mixes; a dense 256-wide rotation is correct but
# register-heavy, the cache's V rotation has 64-wide blocks). Warps: reduce_warps.
REDUCE_TILE_FLOATS = 8192
REDUCE_ROT_TILE_FLOATS = 16384
REDUCE_BLOCK_D = 32
REDUCE_ONE_WARP_FLOATS = 4096


def reduce_block(n_chunks: int, columns: int = REDUCE_BLOCK_D,
                 tile_floats: int = REDUCE_TILE_FLOATS) -> int:
    """Chunks merged a loop step: all of them in one step when they fit the tile (the
    reduce is latency bound: each step is a round trip to memory), at least 16."""
    return max(16, min(triton.next_power_of_2(n_chunks), tile_floats // columns))


def reduce_warps(tile_floats: int, rot: bool, block_d: int, few_warps: bool = False) -> int:
    """Warps of a reduce program: 4, or 8 for tiles over REDUCE_TILE_FLOATS or over 64
    columns. `few_warps` (after the transposed split): 1 without a rotation up to
    REDUCE_ONE_WARP_FLOATS, 2 with one up to REDUCE_TILE_FLOATS. After the transposed
    split (128 chunks a head) one warp was faster (outputs within a rounding of the 4-warp
    ones: another fp32 summation order), and 2 warps with the models' rotation; after the
    legacy split (bf16, 64 chunks) one warp was slower, so the other splits keep 4
    (docs/findings.md, "Decode attention kernels"). Measured while the reduce launched
    early beside the split; not re-measured since the transposed split holds its launch
    (ops/pdl.py)."""
    if few_warps and not rot and tile_floats <= REDUCE_ONE_WARP_FLOATS:
        return 1
    if tile_floats > REDUCE_TILE_FLOATS or block_d > 64:
        return 8
    return 2 if few_warps and rot else 4


def launch_reduce(sh: DecodeShape, bufs, q_pos, n_chunks: int, chunk_len: int,
                  page_size: int, out_rot: torch.Tensor | None = None,
                  few_warps: bool = False,
                  block_d: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Pass 2: one program per (KV head, tile row, 32 value columns) merges the partials
    in chunk order; with `out_rot` (fp32 diagonal blocks [NB, B, B] of the output's
    rotation, applied before the one rounding), per block of B columns. `few_warps`: see
    reduce_warps. `block_d` (no rotation only), `num_warps`: other launches, for probes
    and sweeps."""
    m_buf, l_buf, acc_buf = bufs
    out = sh.out
    rot = out_rot is not None
    assert not (rot and block_d), "with out_rot the reduce's columns are the rotation's blocks"
    if rot:
        nb, block_d = out_rot.shape[0], out_rot.shape[-1]
        assert out_rot.shape == (nb, block_d, block_d) and nb * block_d == sh.head_dim \
            and out_rot.dtype == torch.float32 and out_rot.is_contiguous(), \
            "out_rot must be contiguous fp32 diagonal blocks [NB, B, B], NB * B = D"
        block_c = reduce_block(n_chunks, block_d, REDUCE_ROT_TILE_FLOATS)
    else:
        block_d = min(block_d or REDUCE_BLOCK_D, sh.head_dim)
        block_c = reduce_block(n_chunks, block_d)
    assert sh.head_dim % block_d == 0, "head dims are powers of two (decode tiles)"
    launchable(_decode_reduce)[(sh.n_kv, sh.mrows, sh.head_dim // block_d)](
        m_buf, l_buf, acc_buf, q_pos, out_rot if rot else out, out, out.stride(0),
        out.stride(1), sh.n_rows, n_chunks, chunk_len, sh.table_len,
        G=sh.group, D=sh.head_dim, P=page_size,
        ROWS_P2=max(2, triton.next_power_of_2(sh.n_rows)), BLOCK_C=block_c,
        BLOCK_D=block_d, ONE_STEP=block_c >= n_chunks, ROT=rot,
        num_warps=num_warps or reduce_warps(block_c * block_d, rot, block_d, few_warps),
        **pdl_launch(out.device))
    return out
