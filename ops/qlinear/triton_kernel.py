"""Triton kernels of the quantized linear: y = x @ dequant(W)^T (+ bias) with W in planar
GGUF rows (formats.py), dequantized tile by tile in registers (dequant.py).

- one row (`_qgemv_row`): CUDA-core FMAs into a [BN, G, S] fp32 accumulator, the weight
  bytes streamed once; x is read at the tile's element indices (dequant.part_elems).
- 2..8 rows (`_qgemv_rows`): one tensor-core dot per part of a tile, x^T padded to 16
  columns.
- 9..63 rows (`_qgemm`): [BM, BN] output tiles, each weight tile dequantized once for BM
  rows of x. From DENSE_MIN_ROWS rows (prefill ubatches) `qlinear_dense` instead: this GEMM
  ran far behind cuBLAS there (docs/findings.md, "Quantized weights").
- `_dequant_rows`: whole rows in element order (the quantized embedding lookup).
fp32 accumulation; the dots take the weight tile rounded to bf16 (x is bf16 or fp16: x is
rounded to the weights' dot dtype, fp16 inputs stay fp16); one rounding to x's dtype.
SILU: the fused [gate; up] projection of a SwiGLU (same pairing as ops/gemv): program
rows 2c and 2c + 1 are gate row c and up row N / 2 + c, and the epilogue stores
silu(gate) * up of the rounded pair.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcompile.ops.cast import TL_DTYPES, round_to
from kvcompile.ops.gemv.triton_kernel import (_dot_rows, _weight_rows, store_row, store_rows,
                                              weight_row)
from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers
from kvcompile.ops.qlinear.dequant import (FIELD_ORDER, geometry, load_codes, part_affine,
                                           part_codes, part_elems, part_values)
from kvcompile.ops.qlinear.formats import weight_format
from kvcompile.ops.qlinear.int_dot import INT_DOT_DEFAULT, INT_DOT_TYPES, _qgemv_row_int


@triton.jit
def _tile_masks(QT: tl.constexpr, n, N, kb0, nb, K, G: tl.constexpr, S: tl.constexpr,
                GPB: tl.constexpr, BLOCK: tl.constexpr):
    """[BN, G, S] mask of real rows and values (the code bytes), [BN, G, 1] of real rows
    and blocks (their scales)."""
    g = tl.arange(0, G)[None, :, None]
    rows = n[:, None, None] < N
    okg = rows & (kb0 + g // GPB < nb)
    ok = rows & ((kb0 * BLOCK + part_elems(QT, 0, G, S))[None] < K)
    return ok, okg


@triton.jit
def _x_part(x_ptr, QT: tl.constexpr, P: tl.constexpr, kb0, K, BLOCK: tl.constexpr,
            G: tl.constexpr, S: tl.constexpr, EVEN_K: tl.constexpr):
    """Part P's activations of a tile, fp32 [1, G, S], and their sum a group [1, G]."""
    e = kb0 * BLOCK + part_elems(QT, P, G, S)[None]
    if EVEN_K:
        xv = tl.load(x_ptr + e).to(tl.float32)
    else:
        xv = tl.load(x_ptr + e, mask=e < K, other=0.0).to(tl.float32)
    return xv, tl.sum(xv, 2)


@triton.jit
def _row_part(QT: tl.constexpr, P: tl.constexpr, q, xv, sx, row, kb0, OB, OC, OD, OE, okg,
              G: tl.constexpr, S: tl.constexpr, EXACT: tl.constexpr):
    """[1, G]: each group's sum(value * x) over part P. A group's products are summed
    before its scale, sum(scale * code - offset) * x = scale * sum(code * x) - offset *
    sum(x): one FMA an element."""
    v = part_codes(QT, P, q, row, kb0, OB, OC, OD, okg, G, S, EXACT)
    sc, off = part_affine(QT, P, row, kb0, OB, OC, OD, OE, okg,
                          tl.arange(0, G)[None, :, None])
    return tl.sum(sc, 2) * tl.sum(v * xv, 2) - tl.sum(off, 2) * sx


@triton.jit
def _qgemv_row(x_ptr, w_ptr, b_ptr, y_ptr, N, K, nb, stride_w, OA, OB, OC, OD, OE,
               QT: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
               S: tl.constexpr, GPB: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
               BLOCK_N: tl.constexpr,
               HAS_BIAS: tl.constexpr, SILU: tl.constexpr, DTYPE: tl.constexpr,
               EXACT: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr):
    """BLOCK_N weight rows one after another over each tile of NB blocks: a tile is [G, S]
    code bytes a row spread over all threads, so every thread holds the same columns of
    each row and converts (and sums) the activations of a tile once for all of them.
    Rows past N read row N - 1 (their sums are not stored), so loads need no row mask;
    EVEN_K (the tiles cover K exactly) drops the column masks too."""
    j = tl.arange(0, BLOCK_N)
    g = tl.arange(0, G)[None, :, None]
    wait_for_producers(PDL)
    acc = tl.zeros([BLOCK_N, G], tl.float32)
    for kb0 in range(0, nb, NB):
        if EVEN_K:
            okg = None
            ok = None
        else:
            okg = kb0 + g // GPB < nb                                    # [1, G, 1]
            ok = (kb0 * BLOCK + part_elems(QT, 0, G, S))[None] < K       # [1, G, S]
        x0, s0 = _x_part(x_ptr, QT, 0, kb0, K, BLOCK, G, S, EVEN_K)
        x1, s1 = x0, s0
        x2, s2 = x0, s0
        x3, s3 = x0, s0
        if PARTS > 1:
            x1, s1 = _x_part(x_ptr, QT, 1, kb0, K, BLOCK, G, S, EVEN_K)
        if PARTS > 2:
            x2, s2 = _x_part(x_ptr, QT, 2, kb0, K, BLOCK, G, S, EVEN_K)
            x3, s3 = _x_part(x_ptr, QT, 3, kb0, K, BLOCK, G, S, EVEN_K)
        for r in tl.static_range(BLOCK_N):
            nr = weight_row(r, BLOCK_N, N, SILU)
            row = w_ptr + tl.minimum(nr, N - 1).to(tl.int64) * stride_w
            q = load_codes(QT, row, kb0, OA, ok, G, S, GPB)
            part = _row_part(QT, 0, q, x0, s0, row, kb0, OB, OC, OD, OE, okg, G, S, EXACT)
            if PARTS > 1:
                part += _row_part(QT, 1, q, x1, s1, row, kb0, OB, OC, OD, OE, okg, G, S,
                                  EXACT)
            if PARTS > 2:
                part += _row_part(QT, 2, q, x2, s2, row, kb0, OB, OC, OD, OE, okg, G, S,
                                  EXACT)
                part += _row_part(QT, 3, q, x3, s3, row, kb0, OB, OC, OD, OE, okg, G, S,
                                  EXACT)
            acc = tl.where(j[:, None] == r, acc + part, acc)
    y = tl.sum(acc, 1)
    store_row(y, _weight_rows(BLOCK_N, N, SILU), b_ptr, y_ptr, N, BLOCK_N, HAS_BIAS, SILU,
              DTYPE, EXACT)


@triton.jit
def _qgemv_rows(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, nb, stride_w, stride_xm,
                OA, OB, OC, OD, OE, QT: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
               S: tl.constexpr, GPB: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                DTYPE: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
    n = _weight_rows(BLOCK_N, N, SILU)
    m = tl.arange(0, 16)
    row = w_ptr + n[:, None, None].to(tl.int64) * stride_w
    wait_for_producers(PDL)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for kb0 in range(0, nb, NB):
        ok, okg = _tile_masks(QT, n, N, kb0, nb, K, G, S, GPB, BLOCK)
        q = load_codes(QT, row, kb0, OA, ok, G, S, GPB)
        for p in tl.static_range(PARTS):
            e = tl.reshape(kb0 * BLOCK + part_elems(QT, p, G, S), (G * S,))
            xt = tl.load(x_ptr + m[None, :] * stride_xm + e[:, None],
                         mask=(m[None, :] < M) & (e[:, None] < K), other=0.0)
            w = part_values(QT, p, q, row, kb0, OB, OC, OD, OE, okg, G, S, EXACT)
            w = tl.reshape(w, (BLOCK_N, G * S)).to(xt.dtype)
            acc = _dot_rows(w, xt, acc, EXACT)
    store_rows(acc, n, m, b_ptr, y_ptr, M, N, BLOCK_N, HAS_BIAS, SILU, DTYPE, EXACT)


@triton.jit
def _qgemm(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, nb, stride_w, stride_xm,
           OA, OB, OC, OD, OE, QT: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
               S: tl.constexpr, GPB: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
           BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
           DTYPE: tl.constexpr, EXACT: tl.constexpr):
    # grouped ordering: programs that run together share weight tiles in L2
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pm = first_m + (pid % (GROUP_M * n_n)) % size_m
    pn = (pid % (GROUP_M * n_n)) // size_m
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w_ptr + n[:, None, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb0 in range(0, nb, NB):
        ok, okg = _tile_masks(QT, n, N, kb0, nb, K, G, S, GPB, BLOCK)
        q = load_codes(QT, row, kb0, OA, ok, G, S, GPB)
        for p in tl.static_range(PARTS):
            e = tl.reshape(kb0 * BLOCK + part_elems(QT, p, G, S), (G * S,))
            xs = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + e[None, :],
                         mask=(m[:, None] < M) & (e[None, :] < K), other=0.0)
            w = part_values(QT, p, q, row, kb0, OB, OC, OD, OE, okg, G, S, EXACT)
            w = tl.reshape(w, (BLOCK_N, G * S)).to(xs.dtype)
            acc = _dot_rows(xs, tl.trans(w), acc, EXACT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None].to(tl.int64) * N + n[None, :], round_to(acc, DTYPE, EXACT),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _dequant_rows(idx_ptr, w_ptr, y_ptr, R, K, nb, stride_w, OA, OB, OC, OD, OE,
                  QT: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                  S: tl.constexpr, GPB: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
                  BLOCK_R: tl.constexpr, DTYPE: tl.constexpr, EXACT: tl.constexpr):
    """Program (b, t): tile t of weight rows idx[b * BLOCK_R ..] (R of them in all), stored
    in element order into y's rows b * BLOCK_R .."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb0 = tl.program_id(1) * NB
    r = tl.load(idx_ptr + i, mask=i < R, other=0).to(tl.int64)
    row = w_ptr + r[:, None, None] * stride_w
    ok, okg = _tile_masks(QT, i, R, kb0, nb, K, G, S, GPB, BLOCK)
    q = load_codes(QT, row, kb0, OA, ok, G, S, GPB)
    out = y_ptr + i[:, None, None].to(tl.int64) * K
    for p in tl.static_range(PARTS):
        e = kb0 * BLOCK + part_elems(QT, p, G, S)[None]
        w = part_values(QT, p, q, row, kb0, OB, OC, OD, OE, okg, G, S, EXACT)
        tl.store(out + e, round_to(w, DTYPE, EXACT), mask=ok)


DENSE_CHUNK_BYTES = 64 << 20
DENSE_MIN_ROWS = 64            # from this many rows of x: dequantize + cuBLAS (qlinear_dense)


# ---- launchers -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _field_args(type_name: str, k: int) -> dict:
    offs = weight_format(type_name).field_offsets(k)
    names = FIELD_ORDER[type_name]
    vals = [offs[f] for f in names] + [0] * (5 - len(names))
    return dict(zip(("OA", "OB", "OC", "OD", "OE"), vals))


@functools.lru_cache(maxsize=None)
def _geometry_args(type_name: str, k: int, nb_tile: int) -> dict:
    """The kernels' constexpr geometry (dequant.geometry) for tiles of nb_tile blocks, and
    the row's block count."""
    block, parts, s, gpb = geometry(type_name)
    return dict(nb=-(-k // block), QT=weight_format(type_name).ggml_id, BLOCK=block,
                PARTS=parts, S=s, GPB=gpb, G=nb_tile * gpb, NB=nb_tile)


def row_config(type_name: str, n: int, k: int, block_n: int | None = None,
               num_warps: int | None = None, int_dot: bool | None = None) -> dict:
    """One row: `block_n` rows a program; a tile is as many blocks as put 16 code bytes
    in each thread of a row (one vector load), or a scale group each with the integer dot
    (int_dot.py). Defaults from the sweep at the 8B shapes (bench_qlinear.py --sweep): for
    the byte-a-value types one warp (four from K > 8192, so a long row takes fewer, wider
    tiles) and 4 rows, for the others two warps and 8 rows; the integer dot where it was
    ahead of the float kernel (the IQ4 types; `int_dot` forces it where the type has it)."""
    block, _, s, gpb = geometry(type_name)
    byte_types = type_name in ("Q8_0", "F16", "BF16")
    if num_warps is None:
        num_warps = (4 if k > 8192 else 1) if byte_types else 2
    if int_dot is None:
        int_dot = type_name in INT_DOT_DEFAULT
    int_dot = int_dot and type_name in INT_DOT_TYPES
    if block_n is None:
        block_n = 4 if byte_types else 8
    code_bytes = block * 2 if type_name in ("F16", "BF16") else s * gpb
    # integer dot: a group a thread; else 16 code bytes a thread
    nb_tile = 32 * num_warps // gpb if int_dot else 16 * 32 * num_warps // code_bytes
    return dict(NB=max(1, nb_tile), BLOCK_N=block_n, num_warps=num_warps, INT_DOT=int_dot)


def rows_config(type_name: str, n: int, k: int) -> dict:
    """2..8 rows: 16 rows a program (a dot's M side), 256 values a tile (same sweep)."""
    return dict(NB=max(1, 256 // geometry(type_name)[0]), BLOCK_N=16, num_warps=4,
                num_stages=3)


def gemm_config(type_name: str, m: int, n: int, k: int) -> dict:
    """Prefill: 64 or 128 rows of x by 128 weight rows, 256 values a tile (64 for the
    32-value block types)."""
    nb_tile = 1 if geometry(type_name)[0] == 256 else 2
    # the 256-value block types stage their gathered scales too: three stages needed up to
    # 288 KB of shared memory under Triton 3.9 (an SM has 227 KB), two fit
    return dict(NB=nb_tile, BLOCK_M=64 if m <= 64 else 128, BLOCK_N=128, GROUP_M=8,
                num_warps=8, num_stages=2 if nb_tile == 1 else 3)


def qlinear_triton(x: torch.Tensor, weight: torch.Tensor, type_name: str, k: int,
                   bias: torch.Tensor | None = None, silu_mul: bool = False,
                   config: dict | None = None) -> torch.Tensor:
    """x [M, K] (last dim dense) @ dequant(weight)^T (+ bias): weight planar uint8 rows
    [N, planar_row_bytes(K)]; silu_mul pairs gate and up rows (M <= 8 only); `config`
    overrides the launch defaults (benchmarks, tests)."""
    m, n = x.shape[0], weight.shape[0]
    assert weight.dtype == torch.uint8 and weight.stride(1) == 1 and x.stride(1) == 1, \
        "qlinear needs dense rows"
    assert not silu_mul or (n % 2 == 0 and m <= 8), "silu_mul: even N, at most 8 rows"
    if m >= DENSE_MIN_ROWS and config is None and not interpreting():
        return qlinear_dense(x, weight, type_name, k, bias)
    y = torch.empty((m, n // 2 if silu_mul else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if m == 1:
        cfg = dict(config or row_config(type_name, n, k))
        # the integer dot reads x in pairs of values (storages start aligned; the offset
        # is known while torch.compile traces with fake tensors, the address is not)
        if cfg.get("INT_DOT") and x.storage_offset() * x.element_size() % 4:
            cfg = row_config(type_name, n, k, int_dot=False)
        kernel, extra = _qgemv_row_int if cfg.pop("INT_DOT", False) else _qgemv_row, ()
        cfg["EVEN_K"] = k % (cfg["NB"] * geometry(type_name)[0]) == 0
    elif m <= 8:
        kernel, cfg, extra = _qgemv_rows, dict(config or rows_config(type_name, n, k)), (m,)
    else:
        kernel, cfg = _qgemm, dict(config or gemm_config(type_name, m, n, k))
        extra = (m,)
    geo = _geometry_args(type_name, k, cfg.pop("NB"))
    common = dict(HAS_BIAS=bias is not None, DTYPE=TL_DTYPES[x.dtype], EXACT=not interpreting(),
                  **_field_args(type_name, k), **{k_: v for k_, v in geo.items() if k_ != "nb"})
    b = y if bias is None else bias
    if kernel is _qgemm:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        launchable(kernel)[grid](x, weight, b, y, m, n, k, geo["nb"], weight.stride(0),
                                 x.stride(0), **common, **cfg)
    else:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
        strides = (weight.stride(0),) if m == 1 else (weight.stride(0), x.stride(0))
        launchable(kernel)[grid](x, weight, b, y, *extra, n, k, geo["nb"], *strides,
                                 SILU=silu_mul, **common, **cfg, **pdl_launch(x.device))
    return y


def dequant_rows_triton(weight: torch.Tensor, type_name: str, k: int, rows: torch.Tensor,
                        dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `rows` of the planar weight, dequantized in element order: [len(rows), K]."""
    y = out if out is not None else torch.empty((rows.numel(), k), dtype=dtype,
                                                device=weight.device)
    if rows.numel() == 0:
        return y
    geo = dict(_geometry_args(type_name, k, max(1, 256 // geometry(type_name)[0])))
    nb = geo.pop("nb")
    block_r = 1 if rows.numel() < 16 else 16
    grid = (triton.cdiv(rows.numel(), block_r), triton.cdiv(nb, geo["NB"]))
    launchable(_dequant_rows)[grid](rows.reshape(-1), weight, y, rows.numel(), k, nb,
                                    weight.stride(0), BLOCK_R=block_r, DTYPE=TL_DTYPES[dtype],
                                    EXACT=not interpreting(), **_field_args(type_name, k),
                                    **geo, num_warps=4)
    return y




def qlinear_dense(x: torch.Tensor, weight: torch.Tensor, type_name: str, k: int,
                  bias: torch.Tensor | None = None,
                  chunk_bytes: int = DENSE_CHUNK_BYTES) -> torch.Tensor:
    """Prefill ubatches: the weight dequantized to x's dtype in row chunks of at most
    DENSE_CHUNK_BYTES (a scratch the caching allocator reuses), each multiplied by cuBLAS.
    For many rows the dequantization is a small share of the product (2 bytes written an
    element against 2 M flops), and cuBLAS is far ahead of a fused Triton GEMM here."""
    m, n = x.shape[0], weight.shape[0]
    per = max(1, chunk_bytes // (k * x.element_size()))
    if per >= n:
        w = dequant_rows_triton(weight, type_name, k, torch.arange(n, device=x.device),
                                x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    y_t = torch.empty((n, m), dtype=x.dtype, device=x.device)   # y^T: row chunks contiguous
    scratch = torch.empty((per, k), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, per):
        n1 = min(n, n0 + per)
        w = dequant_rows_triton(weight, type_name, k, torch.arange(n0, n1, device=x.device),
                                x.dtype, out=scratch[:n1 - n0])
        torch.mm(w, x.t(), out=y_t[n0:n1])
    y = y_t.t().contiguous()
    return y if bias is None else y + bias

