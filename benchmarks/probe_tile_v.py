"""Probe (device, timing only): the transposed decode if a tile's V codes and scales lay
together in the page.

Quantized V pages are position-major (a code row holds the page's 256 positions), so a
64-position tile reads a 64-byte strip of every code row; probe_decode_reads.py measured
that pattern at 0.88 of HBM for pure reads at 256K against 0.97-1.01 for the same bytes read
contiguously. Here `--v-order tile` swaps the kernel's V readers (quant_blocks.v_scales_t
and tma_codes.v_code_tile as decode_transposed calls them; codes read by pointers, not TMA)
for ones that read each tile's codes [W, 64] and scales [NB, 64] as one contiguous run of
the page (the layout a tile-major V page would have), everything else unchanged. The pages
hold position-major data, so the outputs are wrong: this times the access pattern, nothing
else. `--v-order page` is the shipped kernel with pointer reads. Run each order in its own
process (Triton keys a kernel's compiled code on its dependencies when it first compiles).

usage: python benchmarks/probe_tile_v.py --v-order page|tile [--json PATH]
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
from bench_attention import GEOMS, DecodeCase  # noqa: E402
from bench_util import hbm_bandwidth, write_rows  # noqa: E402

from kvcompile.ops.span_attention import decode_transposed  # noqa: E402


@triton.jit
def v_scales_t_tile_major(scl, phys, head, off, mask, page_halves, code_halves,
                          D: tl.constexpr, P: tl.constexpr):
    """quant_blocks.v_scales_t with tile-major addresses: the tile's [NB, N] scales as one
    contiguous run."""
    NB: tl.constexpr = D // 32
    N: tl.constexpr = off.shape[0]
    b = tl.arange(0, NB)
    t0 = (off // N) * N                              # the tile's first position (all equal)
    return tl.load(scl + phys * page_halves + code_halves + head * NB * P + t0[None, :] * NB
                   + b[:, None] * N + (off % N)[None, :], mask=mask[None, :], other=0.0)


@triton.jit
def v_code_tile_tile_major(v_codes, phys, h, n0, off, page_elems, P: tl.constexpr,
                           BLOCK_N: tl.constexpr, W: tl.constexpr, TMA: tl.constexpr):
    """tma_codes.v_code_tile (pointer reads) with tile-major addresses: the tile's [W, N]
    codes as one contiguous run."""
    c = tl.arange(0, W)
    t0 = (off // BLOCK_N) * BLOCK_N
    return tl.load(v_codes + phys * page_elems + h * W * P + t0[None, :] * W
                   + c[:, None] * BLOCK_N + (off % BLOCK_N)[None, :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--v-order", choices=("page", "tile"), required=True)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.v_order == "tile":     # the names the kernel calls (a stale name would patch nothing)
        assert all(hasattr(decode_transposed, n) for n in ("v_scales_t", "v_code_tile"))
        decode_transposed.v_scales_t = v_scales_t_tile_major
        decode_transposed.v_code_tile = v_code_tile_tile_major
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    print(f"HBM {hbm:.0f} GB/s, V read by {a.v_order}", flush=True)
    rows = []
    for n_kv, d, n_q in GEOMS:
        for n_ctx in (32768, 131072, 262144):
            case = DecodeCase("q8_0", "q4_0", n_ctx, n_kv, d, n_q, "transposed")
            with set_wrap_triton_enabled(False):          # as inside the op (PDL)
                ms = case.ms(tma=False)                   # pointer reads, as patched
            frac = case.kv_bytes / (ms * 1e-3) / 1e9 / hbm
            rows.append(dict(probe="tile_v", v_order=a.v_order, n_kv_heads=n_kv, head_dim=d,
                             context=n_ctx, us=ms * 1e3, frac_of_hbm=frac,
                             kv_types="q8_0/q4_0"))
            print(f"{n_kv}x{d} ctx {n_ctx:>6}: {ms * 1e3:7.1f} us, {frac:.2f} of HBM",
                  flush=True)
            del case
            torch.cuda.empty_cache()
    write_rows(a.json, hbm, rows)


if __name__ == "__main__":
    main()
