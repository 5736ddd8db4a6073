"""Probe (device): how fast can the bytes the quantized decode reads be read, with no math?

A kernel with the transposed decode's grid, chunks, tiles and warps (its launch defaults,
decode_transposed.transposed_config) loads exactly the bytes it loads for q8_0 K / q4_0 V
pages (K codes and scales, V codes and scales, page by page through the page table) and
only adds them up. Two V orders: "page" reads V where the kernel reads it (a 64-byte strip
of every code row of the page: V is position-major, a row is 256 positions), "tile" reads
the same number of bytes as one contiguous run (as if a tile's V codes lay together). If
"page" reads at the HBM rate, the decode's gap to it is its math, not its access pattern.

usage: python benchmarks/probe_decode_reads.py [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import graph_ms, make_pools  # noqa: E402
from bench_util import hbm_bandwidth, write_rows  # noqa: E402

from kvcompile.ops.span_attention.decode_split import decode_chunking  # noqa: E402
from kvcompile.ops.span_attention.decode_transposed import transposed_config  # noqa: E402
from kvcompile.ops.span_attention.launch import num_sms  # noqa: E402


@triton.jit
def _reads(k32, v32, page_table, out, chunk_len, n_ctx, k_page, k_codes, v_page, v_codes,
           D: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, TILE_V: tl.constexpr):
    """Sum (as int32 words) of the K/V bytes of this program's chunk, head program_id(1).
    Offsets in 4-byte words: k_page / v_page a page, k_codes / v_codes its codes."""
    NB: tl.constexpr = D // 32
    W: tl.constexpr = D // 2                  # q4_0 V: bytes a position and head
    h = tl.program_id(1)
    start = tl.program_id(0) * chunk_len
    end = tl.minimum(start + chunk_len, n_ctx)
    acc_k = tl.zeros([BN, D // 4], tl.int32)
    acc_ks = tl.zeros([BN, NB // 2], tl.int32)
    acc_v = tl.zeros([W, BN // 4], tl.int32)
    acc_vs = tl.zeros([NB, BN // 2], tl.int32)
    for n0 in range(start, end, BN):
        o0 = n0 % P
        phys = tl.load(page_table + n0 // P).to(tl.int64)
        row = h * P + o0 + tl.arange(0, BN)
        kb = k32 + phys * k_page
        acc_k += tl.load(kb + row[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :])
        acc_ks += tl.load(kb + k_codes + row[:, None] * (NB // 2)
                          + tl.arange(0, NB // 2)[None, :])
        vb = v32 + phys * v_page
        c = tl.arange(0, W)
        b = tl.arange(0, NB)
        if TILE_V:
            acc_v += tl.load(vb + (h * W * P + o0 * W) // 4 + c[:, None] * (BN // 4)
                             + tl.arange(0, BN // 4)[None, :])
            acc_vs += tl.load(vb + v_codes + (h * NB * P + o0 * NB) // 2
                              + b[:, None] * (BN // 2) + tl.arange(0, BN // 2)[None, :])
        else:
            acc_v += tl.load(vb + ((h * W + c[:, None]) * P + o0) // 4
                             + tl.arange(0, BN // 4)[None, :])
            acc_vs += tl.load(vb + v_codes + ((h * NB + b[:, None]) * P + o0) // 2
                              + tl.arange(0, BN // 2)[None, :])
    total = tl.sum(tl.sum(acc_k, 1), 0) + tl.sum(tl.sum(acc_ks, 1), 0) \
        + tl.sum(tl.sum(acc_v, 1), 0) + tl.sum(tl.sum(acc_vs, 1), 0)
    tl.store(out + tl.program_id(0) * tl.num_programs(1) + h, total)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    print(f"HBM {hbm:.0f} GB/s", flush=True)
    rows = []
    for n_kv, d in ((8, 128), (4, 256)):
        cfg = transposed_config(d, tma=False)    # its pointer reads
        for n_ctx in (32768, 262144):
            kp, vp, tables, kv_bytes = make_pools("q8_0", "q4_0", n_ctx, n_kv, d, 4)
            k32, v32 = kp.view(torch.int32), vp.view(torch.int32)
            k_codes = n_kv * 256 * d // 4
            v_codes = n_kv * 256 * d // 2 // 4
            chunk_len, n_chunks = decode_chunking(tables[0].shape[0], 256, n_kv,
                                                  cfg["block_n"], num_sms(kp.device),
                                                  cfg["programs_per_sm"])
            out = torch.empty(n_chunks * n_kv, dtype=torch.int32, device="cuda")
            for tile_v in (0, 1):
                ms = graph_ms([lambda t=t: _reads[(n_chunks, n_kv)](
                    k32, v32, t, out, chunk_len, n_ctx, kp.shape[1] // 4, k_codes,
                    vp.shape[1] // 4, v_codes, D=d, P=256, BN=cfg["block_n"], TILE_V=tile_v,
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
                    for t in tables] * 5)
                frac = kv_bytes / (ms * 1e-3) / 1e9 / hbm
                rows.append(dict(probe="decode_reads", n_kv_heads=n_kv, head_dim=d,
                                 context=n_ctx, v_order="tile" if tile_v else "page",
                                 us=ms * 1e3, frac_of_hbm=frac, kv_bytes=kv_bytes,
                                 kv_types="q8_0/q4_0", launch=cfg))
                print(f"{n_kv}x{d} ctx {n_ctx:>6} V by {'tile' if tile_v else 'page'}: "
                      f"{ms * 1e3:7.1f} us, {frac:.2f} of HBM", flush=True)
            del kp, vp, k32, v32
            torch.cuda.empty_cache()
    write_rows(a.json, hbm, rows)


if __name__ == "__main__":
    main()
