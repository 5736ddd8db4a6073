"""Probe (device, timing only): what one pass over a 32K decode's bytes costs, math aside.

Two floors, timed in one process beside the shipped transposed decode (with and without its
reduce, so the reduce's share is their difference):
- plain reads: a contiguous streaming read of exactly the KV bytes a 32K decode call reads
  (q4_0/q4_0, q8_0/q4_0, q8_0/q8_0), over several grids and unrolls, and torch's sum of the
  same bytes: one pass over that many bytes, launch and ramp included;
- the decode's own reads: a copy of the transposed split (decode_transposed._decode_split_t)
  that keeps everything that moves bytes (grid, chunks, tiles, warps and stages of its
  launch defaults unless a variant says otherwise, the PDL wait, the q_pos -> page table
  chain, K and V scales a tile ahead, codes by TMA block by block as the decode reads them,
  the partials it stores) and drops the math: each code tile meets a tile of ones in an
  int8 dot (so Triton stages it as it stages the decode's operands, with no conversion), no
  softmax, no P @ V, no reduce. Variants move the tile size, stages, programs an SM, and
  read the page id once a chunk (`hoist`, chunks inside one page) so the pipeliner can
  buffer more than one tile.
If a floor takes longer than 0.70 of HBM allows, no decode that also computes reaches 0.70
with that access pattern.

usage: python benchmarks/probe_read_floor.py [--contexts 32768] [--variants a,b]
       [--stream-only] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from torch._library.triton import set_wrap_triton_enabled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import GEOMS, ROT, DecodeCase, graph_ms  # noqa: E402
from bench_util import hbm_bandwidth, write_rows  # noqa: E402

from probe_overhead import reduce_replaced  # noqa: E402

from kvcompile.ops import kv_format as F  # noqa: E402
from kvcompile.ops.launching import launchable  # noqa: E402
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers_hold_next  # noqa: E402
from kvcompile.ops.span_attention import decode_transposed as DT  # noqa: E402
from kvcompile.ops.span_attention.decode_split import (decode_shape, decode_tile,  # noqa: E402
                                                       partial_slot,
                                                       program_rows_and_chunk, split_launch,
                                                       split_operands, store_partial_stats)
from kvcompile.ops.span_attention.tma_codes import (code_descriptors, k_code_block,  # noqa: E402
                                                     tma_possible, v_code_tile)


@triton.jit
def _floor_split(q_ptr, k_codes, k_scl, v_codes, v_scl, page_table, q_pos_ptr,
                 m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, n_rows, n_chunks,
                 chunk_len, table_len, k_page_elems, k_page_halves, k_code_halves,
                 v_page_elems, v_page_halves, v_code_halves,
                 G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
                 HOIST: tl.constexpr, TILE_V: tl.constexpr, PDL: tl.constexpr):
    """_decode_split_t's reads (q8_0 K, q4_0 V) with int8 dots against ones as the math."""
    wait_for_producers_hold_next(PDL)
    NB: tl.constexpr = D // 32
    W: tl.constexpr = D // 2
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    t, row_ok, qp, n_ctx, start, end = program_rows_and_chunk(q_pos_ptr, r, n_rows,
                                                              chunk_len, table_len, G, P)
    ones_k = tl.full([32, 8], 1, tl.int8)
    ones_v = tl.full([BLOCK_N, 8], 1, tl.int8)
    acc_k = tl.zeros([BLOCK_N, 8], tl.int32)
    acc_v = tl.zeros([W, 8], tl.int32)
    sk = tl.zeros([BLOCK_N, NB], tl.float32)
    sv = tl.zeros([NB, BLOCK_N], tl.float32)
    phys0 = DT.page_of(page_table, start, end, P)
    ks, vs = DT.tile_scales(phys0, start, end, k_scl, v_scl, h, k_page_halves, k_code_halves,
                            v_page_halves, v_code_halves, P, BLOCK_N, D)
    # HOIST: the chunk lies in one page (the launcher checks), so no table read in the loop
    phys_next = phys0 if HOIST else DT.page_of(page_table, start + BLOCK_N, end, P)
    for n0 in range(start, end, BLOCK_N):
        if HOIST:
            off = tl.multiple_of(n0 % P, BLOCK_N) + tl.arange(0, BLOCK_N)
            phys = phys0
        else:
            off, pos, _, phys = decode_tile(page_table, n0, end, P, BLOCK_N)
        ks_next, vs_next = DT.tile_scales(phys_next, n0 + BLOCK_N, end, k_scl, v_scl, h,
                                          k_page_halves, k_code_halves, v_page_halves,
                                          v_code_halves, P, BLOCK_N, D)
        if not HOIST:
            phys_next = DT.page_of(page_table, n0 + 2 * BLOCK_N, end, P)
        for b in tl.static_range(NB):
            c = k_code_block(k_codes, phys, h, n0, off, b, k_page_elems, P, BLOCK_N, D, 32,
                             TMA)
            acc_k = tl.dot(c.to(tl.int8, bitcast=True), ones_k, acc_k, out_dtype=tl.int32)
        if TILE_V:    # the same bytes as if a tile's V codes lay together (tile-major)
            v = tl.reshape(v_codes.load([phys.to(tl.int32),
                                         (h * (P // BLOCK_N) + (n0 % P) // BLOCK_N) * W, 0]),
                           (W, BLOCK_N))
        else:
            v = v_code_tile(v_codes, phys, h, n0, off, v_page_elems, P, BLOCK_N, W, TMA)
        acc_v = tl.dot(v.to(tl.int8, bitcast=True), ones_v, acc_v, out_dtype=tl.int32)
        sk += ks.to(tl.float32)
        sv += vs.to(tl.float32)
        ks, vs = ks_next, vs_next
    slot = partial_slot(tl.program_id(0), r, h, n_chunks, n_rows, G)
    ok = (r < n_rows * G) & (start < n_ctx)
    m_i = tl.zeros([BLOCK_R], tl.float32) + tl.sum(tl.sum(acc_k, 1), 0).to(tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32) + tl.sum(tl.sum(sk, 1), 0) + tl.sum(tl.sum(sv, 1), 0)
    store_partial_stats(m_ptr, l_ptr, -tl.abs(m_i), 1.0 + tl.abs(l_i), slot, ok)
    vsum = tl.sum(acc_v, 1).to(tl.float32)                                   # [W]
    base = acc_ptr + slot.to(tl.int64)[None, :] * D
    tl.store(base + tl.arange(0, W)[:, None], vsum[:, None] + tl.zeros([W, BLOCK_R],
                                                                     tl.float32),
             mask=ok[None, :])


def floor_launch(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, scale,
                 out=None, hoist=False, tile_v=False, **cfg):
    """The floor split launched as span_attention_decode_transposed launches its split
    (launch options `cfg` as split_launch takes them), no reduce.
    hoist: the page id read once before the loop (needs chunks inside one page); tile_v:
    each tile's V codes read as one contiguous block (a tile-major V layout's addresses, so
    the values are not the decode's: timing only)."""
    sh = decode_shape(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, out)
    tma = tma_possible(k_pool, v_pool)
    go = split_launch(sh, DT.transposed_config(sh.head_dim, tma), page_size, q.device, **cfg)
    assert not hoist or page_size % go.chunk_len == 0, "hoist needs chunks inside one page"
    bufs, _, (kv, ks, kpe, kph, kch), (vv, vs, vpe, vph, vch) = split_operands(
        sh, q, k_pool, v_pool, None, go.n_chunks, raw_codes=True)
    if tma:
        kv, vv = code_descriptors(k_pool, v_pool, sh.kg.kv_type, sh.vg.kv_type,
                                  sh.kg.n_heads, sh.head_dim, page_size, go.block_n)
    assert tma or not tile_v, "tile_v reads by TMA"
    if tile_v:
        from triton.tools.tensor_descriptor import TensorDescriptor
        w, bn = sh.head_dim // 2, go.block_n
        vv = TensorDescriptor(v_pool, [v_pool.shape[0], sh.kg.n_heads * page_size // bn * w,
                                       bn], [v_pool.stride(0), bn, 1], [1, w, bn])
    launchable(_floor_split)[(go.n_chunks, sh.n_kv)](
        q, kv, ks, vv, vs, page_table, q_pos, *bufs,
        q.stride(0), q.stride(1), sh.n_rows, go.n_chunks, go.chunk_len, sh.table_len,
        kpe, kph, kch, vpe, vph, vch, G=sh.group, D=sh.head_dim, P=page_size,
        BLOCK_R=max(2, triton.next_power_of_2(sh.mrows)), BLOCK_N=go.block_n, TMA=tma,
        HOIST=hoist, TILE_V=tile_v, num_warps=go.num_warps, num_stages=go.num_stages,
        **pdl_launch(q.device))
    return sh.out


@triton.jit
def _stream_read(x_ptr, out_ptr, n_per_prog, n_words, BLOCK: tl.constexpr,
                 UNROLL: tl.constexpr):
    """Sum (int32 words) of one contiguous span a program, the buffer's n_words words and
    no more: a plain streaming read."""
    start = tl.program_id(0).to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, n_per_prog, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            idx = start + i + u * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


STREAM_LAUNCHES = [(132, 4096, 4, 8), (264, 4096, 4, 8), (528, 4096, 4, 4),
                   (1056, 2048, 4, 4), (1056, 4096, 2, 4), (2112, 2048, 2, 4),
                   (528, 8192, 2, 8), (1056, 1024, 8, 2), (2112, 1024, 4, 2)]


def stream_rows(n_bytes: int, hbm: float, label: str) -> list:
    """What one pass over exactly n_bytes costs on this GPU, launch and ramp included: a
    plain contiguous read over grids and unrolls (programs, words a load, loads in flight,
    warps), and torch's fp32 sum of the same bytes. Calls rotate over ROT buffers, as the
    decode's timings rotate over KV copies, so that L2 (50 MB) does not serve them."""
    rows = []
    ideal_us = n_bytes / (hbm * 1e9) * 1e6
    n_words = n_bytes // 4
    xs = [torch.empty(n_words, dtype=torch.int32, device="cuda") for _ in range(ROT)]
    rows.append(dict(probe="torch_sum", us=graph_ms(
        [lambda x=x: x.view(torch.float32).sum() for x in xs] * 5) * 1e3))
    for progs, block, unroll, warps in STREAM_LAUNCHES:
        per = -(-n_words // progs // (block * unroll)) * block * unroll
        out = torch.empty(progs * block, dtype=torch.int32, device="cuda")
        us = graph_ms([lambda x=x: _stream_read[(progs,)](x, out, per, n_words, BLOCK=block,
                                                            UNROLL=unroll, num_warps=warps)
                       for x in xs] * 5) * 1e3
        rows.append(dict(probe="stream_read", programs=progs, block=block, unroll=unroll,
                         num_warps=warps, us=us))
    del xs
    for r in rows:
        r.update(bytes=n_bytes, what=label, ideal_us=ideal_us, us_at_070=ideal_us / 0.7,
                 frac_of_hbm=ideal_us / r["us"])
    best = min(rows, key=lambda r: r["us"])
    print(f"{label}: {n_bytes / 1e6:.1f} MB, 0.70 = {ideal_us / 0.7:.2f} us; torch sum "
          f"{rows[0]['us']:.2f} us ({rows[0]['frac_of_hbm']:.2f}), best plain read "
          f"{best['us']:.2f} us ({best['frac_of_hbm']:.2f}: {best.get('programs')} programs, "
          f"{best.get('block')} words x {best.get('unroll')}, {best.get('num_warps')} warps)",
          flush=True)
    return rows


def call_bytes(k_name: str, v_name: str, n_ctx: int = 32768) -> int:
    """KV bytes one decode call over n_ctx positions reads (8 x 128 and 4 x 256 alike)."""
    return n_ctx * sum(F.bytes_per_token(F.kv_type(t), 8, 128) for t in (k_name, v_name))


# One pass over the KV bytes of a 32K decode call, by quantized pair.
PASS_BYTES = [(f"{k}/{v} at 32K", call_bytes(k, v))
              for k, v in (("q4_0", "q4_0"), ("q8_0", "q4_0"), ("q8_0", "q8_0"))]


# floor split launches timed beside the shipped decode: (name, floor_launch keywords)
VARIANTS = [("floor", dict()),
            ("floor_hoist_s2", dict(hoist=True)),
            ("floor_hoist_s3", dict(hoist=True, num_stages=3)),
            ("floor_hoist_s4", dict(hoist=True, num_stages=4)),
            ("floor_pps4", dict(programs_per_sm=4)),
            ("floor_pps16_w1", dict(programs_per_sm=16, num_warps=1)),
            ("floor_bn128", dict(block_n=128)),
            ("floor_bn128_hoist", dict(block_n=128, hoist=True)),
            ("floor_bn128_pps4", dict(block_n=128, programs_per_sm=4)),
            ("floor_bn256_hoist_s1", dict(block_n=256, hoist=True, num_stages=1)),
            ("floor_tile_v", dict(tile_v=True)),
            ("floor_tile_v_bn128_hoist", dict(tile_v=True, block_n=128, hoist=True))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768")
    ap.add_argument("--variants", help="comma-separated names from VARIANTS (default all)")
    ap.add_argument("--json")
    ap.add_argument("--stream-only", action="store_true")
    a = ap.parse_args()
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    print(f"HBM {hbm:.0f} GB/s; q8_0 / q4_0, 1 row, untraced (PDL, TMA)", flush=True)
    want = a.variants.split(",") if a.variants else [n for n, _ in VARIANTS]
    rows = [r for label, n in PASS_BYTES for r in stream_rows(n, hbm, label)]
    if a.stream_only:
        return write_rows(a.json, hbm, rows)
    shipped = DT.span_attention_decode_transposed
    with set_wrap_triton_enabled(False):
        for n_kv, d, n_q in GEOMS:
            for n_ctx in (int(c) for c in a.contexts.split(",")):
                case = DecodeCase("q8_0", "q4_0", n_ctx, n_kv, d, n_q, "transposed")
                ideal_us = case.kv_bytes / (hbm * 1e9) * 1e6
                fns = [("shipped", shipped), ("shipped_split_only", split_only)]
                fns += [(n, (lambda kw: lambda *x, **k: floor_launch(*x, **kw, **k))(kw))
                        for n, kw in VARIANTS if n in want]
                times = {}
                for rep in range(2):              # alternate, keep the faster of two
                    for name, fn in fns:
                        case.launch = fn
                        try:
                            us = case.ms() * 1e3
                        except Exception as e:    # a config that does not compile
                            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                            continue
                        times[name] = min(us, times.get(name, us))
                row = dict(probe="read_floor", kv_types="q8_0/q4_0", n_kv_heads=n_kv,
                           head_dim=d, context=n_ctx, ideal_us=ideal_us,
                           us_at_070=ideal_us / 0.70, us=times,
                           frac={k: ideal_us / v for k, v in times.items()})
                rows.append(row)
                print(f"{n_kv}x{d} ctx {n_ctx:>6}: 0.70 = {ideal_us / 0.7:6.2f} us", flush=True)
                for k, v in times.items():
                    print(f"   {k:28s} {v:7.2f} us  {ideal_us / v:.2f} of HBM", flush=True)
                del case
                torch.cuda.empty_cache()
    write_rows(a.json, hbm, rows)


def split_only(*args, **kw):
    """The shipped transposed decode with its reduce replaced by nothing."""
    with reduce_replaced(lambda sh, *a, **k: sh.out):
        return DT.span_attention_decode_transposed(*args, **kw)


if __name__ == "__main__":
    main()
