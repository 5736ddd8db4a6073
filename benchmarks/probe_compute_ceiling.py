"""Probe (device, timing only): the decode with its memory traffic taken away.

The page table of a long context points, page after page, into a few pages that stay in L2
(`--l2-pages`, 16 by default: 7 MB at 8 x 128, q8_0 / q4_0), so the kernel does all its work
(every tile, the whole grid, split and reduce) with its reads served by L2. Beside it the
same context over scattered resident pages, as bench_attention times it. If the L2 time is
close to the HBM time the decode is bound by its own work, not by HBM; the gap is what better
overlap of loads and math could win at most.

usage: python benchmarks/probe_compute_ceiling.py [--impl transposed] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch._library.triton import set_wrap_triton_enabled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import GEOMS, DecodeCase  # noqa: E402
from bench_util import hbm_bandwidth, write_rows  # noqa: E402

PAGE = 256


def l2_case(n_ctx: int, n_kv: int, d: int, n_q: int, impl: str, l2_pages: int) -> DecodeCase:
    """A DecodeCase whose page tables cycle over `l2_pages` pages of one small pool."""
    case = DecodeCase("q8_0", "q4_0", l2_pages * PAGE, n_kv, d, n_q, impl)
    n_pages = -(-n_ctx // PAGE)
    cycle = torch.arange(n_pages, device="cuda") % l2_pages
    case.tables = [t[cycle].contiguous() for t in case.tables[:1]]
    case.q_pos = torch.tensor([n_ctx - 1], device="cuda", dtype=torch.int32)
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="transposed")
    ap.add_argument("--l2-pages", type=int, default=16)
    ap.add_argument("--contexts", default="32768,131072,262144")
    ap.add_argument("--json")
    a = ap.parse_args()
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    print(f"HBM {hbm:.0f} GB/s; decode {a.impl}, q8_0 / q4_0, 1 row", flush=True)
    rows = []
    for n_kv, d, n_q in GEOMS:
        for n_ctx in (int(c) for c in a.contexts.split(",")):
            with set_wrap_triton_enabled(False):          # as inside the op (PDL)
                hbm_case = DecodeCase("q8_0", "q4_0", n_ctx, n_kv, d, n_q, a.impl)
                ms_hbm = hbm_case.ms()
                kv_bytes = hbm_case.kv_bytes
                del hbm_case
                torch.cuda.empty_cache()
                ms_l2 = l2_case(n_ctx, n_kv, d, n_q, a.impl, a.l2_pages).ms()
            frac = kv_bytes / (ms_hbm * 1e-3) / 1e9 / hbm
            rows.append(dict(probe="compute_ceiling", impl=a.impl, n_kv_heads=n_kv,
                             head_dim=d, context=n_ctx, us_hbm=ms_hbm * 1e3,
                             us_l2=ms_l2 * 1e3, l2_pages=a.l2_pages, frac_of_hbm=frac,
                             frac_of_hbm_if_l2_time=kv_bytes / (ms_l2 * 1e-3) / 1e9 / hbm,
                             kv_types="q8_0/q4_0"))
            print(f"{n_kv}x{d} ctx {n_ctx:>6}: HBM pages {ms_hbm * 1e3:7.1f} us ({frac:.2f} "
                  f"of HBM), L2 pages {ms_l2 * 1e3:7.1f} us", flush=True)
            torch.cuda.empty_cache()
    write_rows(a.json, hbm, rows)


if __name__ == "__main__":
    main()
