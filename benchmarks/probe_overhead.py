"""Probe (device): where a decode attention call's fixed time goes, and whether a Triton
GEMV beats cuBLAS on the 8B decode shapes. Prints tables; --json writes the rows.

- attention: split + reduce vs split only vs reduce only, 8 KV heads x 128 (and 4 x 256 with
  --both-geometries), contexts 256 .. 128K (--contexts), q8_0/q4_0 and bf16, graph replays
  over 4 disjoint KV copies; an empty Triton kernel gives the per-launch floor of a graph.
- gemv: y = x @ W^T, x [M, K] bf16 (M = 1, 4, 8), W [N, K] bf16, 4 rotated weight copies:
  cuBLAS against candidate kernels of ops/gemv's design (the same loops without masks, bias
  and the exact rounding), a config sweep that chose ops/gemv's launch defaults.
- reduce (--only reduce): the full call with the reduce's other launches (value columns a
  program, warps; decode_split.launch_reduce's probe options), K/V pairs --pairs
  (q8_0/q4_0 by default), for quantized V also with the models' output rotation, in one
  process.
- sweep (--only sweep): decode launch configs by context (1 row, full call). With
  --untraced the launches run as inside the op (wrap_triton off: with PDL between the
  split and the reduce, ops/pdl.py).
--impl NAME times that decode implementation (attention, reduce, sweep; default: the op's choice
by shape, which for quantized K and V is now the transposed kernel; the 2026-11-30 runs
before 07:20 UTC timed blocks, what the op chose then: --impl blocks repeats them).
Rows of the 2026-11-30 runs: benchmarks/results/probe_overhead.json, decode_sweep.json;
of the reduce and the later attention runs: decode_probes.json.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import torch
import triton
import triton.language as tl
from torch._library.triton import set_wrap_triton_enabled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import DecodeCase, graph_ms  # noqa: E402
from bench_util import hbm_bandwidth, write_rows  # noqa: E402

import kvcompile.ops  # noqa: F401,E402
from kvcompile.kv_rotation import V_BLOCK, diagonal_blocks, v_rotation  # noqa: E402
from kvcompile.ops import kv_format as F  # noqa: E402
from kvcompile.ops.span_attention import (decode_blocks, decode_kernel, decode_split,  # noqa: E402
                                          decode_transposed)


# the modules whose launchers call launch_reduce (patched out for split-only timings)
SPLIT_MODULES = (decode_blocks, decode_kernel, decode_transposed)
ATTN_CONTEXTS = (256, 2048, 8192, 32768, 131072)


@triton.jit
def _empty(x_ptr):
    pass


@contextlib.contextmanager
def reduce_replaced(fn):
    """The decode launchers call `fn` in place of decode_split.launch_reduce."""
    for mod in SPLIT_MODULES:
        mod.launch_reduce = fn
    try:
        yield
    finally:
        for mod in SPLIT_MODULES:
            mod.launch_reduce = decode_split.launch_reduce


def case_fields(kn: str, vn: str, n_kv: int, d: int, n_ctx: int) -> dict:
    """The fields that name a decode case in a row."""
    return dict(kv=f"{kn}/{vn}", n_kv_heads=n_kv, head_dim=d, context=n_ctx)


def case_label(kn: str, vn: str, n_kv: int, d: int, n_ctx: int) -> str:
    """How a printed line names a decode case."""
    return f"{kn}/{vn} {n_kv}x{d} ctx {n_ctx:>6}"


def attention_rows(hbm, impl=None, geoms=((8, 128, 32),), contexts=ATTN_CONTEXTS,
                   pps_list=(None, 1, 4)):
    rows = []
    x = torch.zeros(1, device="cuda")
    floor = graph_ms([lambda: _empty[(256,)](x)] * 40)
    print(f"empty triton kernel in a graph: {floor * 1e3:.2f} us a launch", flush=True)
    rows.append(dict(probe="empty_kernel", us=floor * 1e3))
    for (n_kv, d, n_q), (kn, vn), n_ctx in [(g, p, c) for g in geoms
                                            for p in [("q8_0", "q4_0"), ("bf16", "bf16")]
                                            for c in contexts]:
        case = DecodeCase(kn, vn, n_ctx, n_kv, d, n_q, impl)
        for pps in pps_list:
            cfg = {} if pps is None else dict(programs_per_sm=pps)
            full = case.ms(**cfg)

            with reduce_replaced(lambda sh, bufs, *a, **kw: sh.out):     # the split alone
                split = case.ms(**cfg)
            ideal = case.kv_bytes / (hbm * 1e9) * 1e3
            row = dict(probe="attention", **case_fields(kn, vn, n_kv, d, n_ctx),
                       programs_per_sm=pps, full_us=full * 1e3, split_us=split * 1e3,
                       reduce_us=(full - split) * 1e3, ideal_us=ideal * 1e3,
                       frac_of_hbm=ideal / full)
            rows.append(row)
            print(f"{case_label(kn, vn, n_kv, d, n_ctx)} pps {pps}: full {full*1e3:7.2f} us, "
                  f"split {split*1e3:7.2f}, reduce {(full-split)*1e3:6.2f}, ideal "
                  f"{ideal*1e3:7.2f} ({ideal/full:.2f} of HBM)", flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


REDUCE_VARIANTS = [{}, dict(block_d=16), dict(block_d=64), dict(block_d=128),
                   dict(block_d=32, num_warps=4), dict(block_d=32, num_warps=2),
                   dict(block_d=32, num_warps=1),
                   dict(block_d=16, num_warps=1), dict(block_d=64, num_warps=1),
                   dict(block_d=64, num_warps=2), dict(block_d=128, num_warps=4), {}]


# with the output rotation the models' decode applies in the reduce (V_BLOCK-wide blocks)
REDUCE_ROT_VARIANTS = [{}, dict(num_warps=1), dict(num_warps=2), dict(num_warps=4),
                       dict(num_warps=8), {}]


def reduce_rows(hbm, impl=None, geoms=((8, 128, 32),), contexts=(32768, 131072),
                pairs=(("q8_0", "q4_0"),)):
    """The full decode call (K / V type `pairs`) with each of REDUCE_VARIANTS' reduce
    launches ({}: the defaults, timed first and last), then, for quantized V, with the
    output rotation of the models' V (kv_rotation) and each of REDUCE_ROT_VARIANTS; outputs
    compared with each group's defaults."""
    rows = []
    for (n_kv, d, n_q), (kn, vn), n_ctx in [(g, p, c) for g in geoms for p in pairs
                                            for c in contexts]:
        case = DecodeCase(kn, vn, n_ctx, n_kv, d, n_q, impl)
        ideal = case.kv_bytes / (hbm * 1e9) * 1e3
        groups = [({}, REDUCE_VARIANTS)]
        v_rot = v_rotation(F.kv_type(vn), d)      # the models rotate quantized V only
        if v_rot is not None:
            rot = diagonal_blocks(v_rot.float(), V_BLOCK).cuda()
            groups.append((dict(out_rot=rot), REDUCE_ROT_VARIANTS))
        for cfg, variants in groups:
            ref = None
            for variant in variants:
                with reduce_replaced(functools.partial(decode_split.launch_reduce, **variant)):
                    ms = case.ms(**cfg)
                    out = case.out.float().clone()    # the last replayed call's: the last copy
                ref = out if ref is None else ref
                diff = (out - ref).abs().max().item()
                rows.append(dict(probe="reduce", **case_fields(kn, vn, n_kv, d, n_ctx),
                                 reduce=variant, out_rot=bool(cfg), us=ms * 1e3,
                                 frac_of_hbm=ideal / ms, max_abs_diff_vs_default=diff))
                print(f"{case_label(kn, vn, n_kv, d, n_ctx)} {'rot ' if cfg else ''}reduce "
                      f"{variant}: {ms*1e3:7.2f} us ({ideal/ms:.3f} of HBM), |out - default| "
                      f"{diff:.1e}", flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


@triton.jit
def _gemv_dot(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k0 + kk[None, :])
        x = tl.load(x_ptr + m[None, :] * K + k0 + kk[:, None], mask=m[None, :] < M, other=0.0)
        acc = tl.dot(w, x, acc)
    tl.store(y_ptr + m[None, :] * N + n[:, None], acc.to(tl.bfloat16), mask=m[None, :] < M)


@triton.jit
def _gemv_fma(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k0 + kk[None, :])
        x = tl.load(x_ptr + k0 + kk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + n, tl.sum(acc, 1).to(tl.bfloat16))


SWEEP = {("q8_0", 128): [{}, dict(block_n=64, num_warps=1, num_stages=3, programs_per_sm=8),
                         dict(block_n=32, num_warps=1, num_stages=3, programs_per_sm=8),
                         dict(block_n=64, num_warps=2, num_stages=3, programs_per_sm=4),
                         dict(block_n=64, num_warps=2, num_stages=3, programs_per_sm=8),
                         dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=4),
                         dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=4),
                         dict(block_n=64, num_warps=1, num_stages=2, programs_per_sm=16),
                         dict(block_n=32, num_warps=1, num_stages=3, programs_per_sm=16,
                              maxnreg=128),
                         dict(block_n=32, num_warps=2, num_stages=3, programs_per_sm=8,
                              maxnreg=128),
                         dict(block_n=64, num_warps=2, num_stages=3, programs_per_sm=8,
                              maxnreg=128)],
         ("q8_0", 256): [{}, dict(block_n=32, num_warps=1, num_stages=3, programs_per_sm=8),
                         dict(block_n=32, num_warps=2, num_stages=3, programs_per_sm=8),
                         dict(block_n=64, num_warps=2, num_stages=3, programs_per_sm=4),
                         dict(block_n=32, num_warps=4, num_stages=3, programs_per_sm=4)],
         ("bf16", 128): [{}, dict(programs_per_sm=4), dict(programs_per_sm=8),
                         dict(block_n=32, num_warps=4, programs_per_sm=8),
                         dict(block_n=64, num_warps=2, programs_per_sm=8)],
         ("bf16", 256): [{}, dict(programs_per_sm=4), dict(programs_per_sm=8),
                         dict(block_n=32, num_warps=4, programs_per_sm=4)]}


def sweep_rows(hbm, impl=None):
    """Decode launch configs (1 query row, auto implementation) by context: full call
    (split + reduce) as graph replays."""
    rows = []
    for (kn, d), cfgs in SWEEP.items():
        vn = "q4_0" if kn == "q8_0" else "bf16"
        n_kv, n_q = (8, 32) if d == 128 else (4, 24)
        for n_ctx in [8192, 32768, 131072, 262144]:
            case = DecodeCase(kn, vn, n_ctx, n_kv, d, n_q, impl)
            ideal = case.kv_bytes / (hbm * 1e9) * 1e6
            line = []
            for cfg in cfgs:
                try:
                    us = 1e3 * case.ms(**cfg)
                except Exception as e:  # config does not compile / fit
                    print(f"  {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)
                    continue
                rows.append(dict(probe="sweep", kv=f"{kn}/{vn}", head_dim=d, context=n_ctx,
                                 config=cfg, us=us, frac_of_hbm=ideal / us))
                line.append(f"{ideal / us:.2f}")
            print(f"{kn}/{vn} D{d} ctx {n_ctx:>6}: " + " ".join(line), flush=True)
            del case
            torch.cuda.empty_cache()
    for key, cfgs in SWEEP.items():
        print(f"configs {key}: " + "; ".join(str(c) for c in cfgs))
    return rows


SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096)]


def gemv_rows(hbm):
    rows = []
    for name, n, k in SHAPES:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        wbytes = n * k * 2
        ideal = wbytes / (hbm * 1e9) * 1e3
        for m in (1, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().t()
            cub = graph_ms([lambda w=w: torch.mm(x, w.t(), out=y) for w in ws] * 5)
            best = None
            cands = [("dot", bn, bk, nw, ns) for bn in (16, 32, 64) for bk in (128, 256)
                     for nw in (4, 8) for ns in (3, 5)]
            if m == 1:
                cands += [("fma", bn, bk, nw, 1) for bn in (4, 8, 16) for bk in (256, 512)
                          for nw in (4, 8)]
            for kind, bn, bk, nw, ns in cands:
                if n % bn or k % bk:
                    continue
                if kind == "dot":
                    fn = lambda w: _gemv_dot[(n // bn,)](x, w, y, m, n, k, BLOCK_M=16,
                                                        BLOCK_N=bn, BLOCK_K=bk,
                                                        num_warps=nw, num_stages=ns)
                else:
                    fn = lambda w: _gemv_fma[(n // bn,)](x, w, y, m, n, k, BLOCK_N=bn,
                                                        BLOCK_K=bk, num_warps=nw)
                try:
                    fn(ws[0])
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    ms = graph_ms([lambda w=w: fn(w) for w in ws] * 5)
                except Exception as e:  # config does not compile / fit
                    print(f"  {name} m{m} {kind} {bn} {bk} {nw} {ns}: {type(e).__name__}",
                          flush=True)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, (kind, bn, bk, nw, ns), err)
            ms, cfg, err = best
            row = dict(probe="gemv", shape=name, n=n, k=k, m=m, cublas_us=cub * 1e3,
                       triton_us=ms * 1e3, ideal_us=ideal * 1e3, cublas_frac=ideal / cub,
                       triton_frac=ideal / ms, config=cfg, rel_err=err)
            rows.append(row)
            print(f"{name:8} m {m}: cuBLAS {cub*1e3:8.2f} us ({ideal/cub:.2f}), triton "
                  f"{ms*1e3:8.2f} us ({ideal/ms:.2f}) {cfg} err {err:.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", choices=["attention", "gemv", "sweep", "reduce"])
    ap.add_argument("--untraced", action="store_true",
                    help="attention, reduce, sweep: launch as inside the ops (wrap_triton "
                    "off: PDL)")
    ap.add_argument("--both-geometries", action="store_true",
                    help="attention, reduce: 4 KV heads x 256 as well as 8 x 128")
    ap.add_argument("--contexts", help="attention, reduce: contexts, e.g. 256,32768,262144")
    ap.add_argument("--pairs", default="q8_0/q4_0", help="reduce: K/V type pairs")
    ap.add_argument("--defaults-only", action="store_true",
                    help="attention: launch defaults only (no programs_per_sm 1 and 4)")
    ap.add_argument("--impl", choices=sorted(decode_blocks.DECODE_IMPLS),
                    help="decode implementation timed (default: the op's choice by shape)")
    a = ap.parse_args()
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    print(f"HBM {hbm:.0f} GB/s", flush=True)
    rows = []
    if a.only in (None, "attention"):
        geoms = ((8, 128, 32), (4, 256, 24)) if a.both_geometries else ((8, 128, 32),)
        ctxs = tuple(int(c) for c in a.contexts.split(",")) if a.contexts else ATTN_CONTEXTS
        pps = (None,) if a.defaults_only else (None, 1, 4)
        with set_wrap_triton_enabled(not a.untraced):
            rows += [dict(r, launch="untraced" if a.untraced else "traced")
                     for r in attention_rows(hbm, a.impl, geoms, ctxs, pps)]
    if a.only == "reduce":
        geoms = ((8, 128, 32), (4, 256, 24)) if a.both_geometries else ((8, 128, 32),)
        ctxs = tuple(int(c) for c in a.contexts.split(",")) if a.contexts else (32768, 131072)
        with set_wrap_triton_enabled(not a.untraced):
            rows += [dict(r, launch="untraced" if a.untraced else "traced")
                     for r in reduce_rows(hbm, a.impl, geoms, ctxs,
                                          [tuple(p.split("/")) for p in a.pairs.split(",")])]
    if a.only == "sweep":
        with set_wrap_triton_enabled(not a.untraced):
            rows += [dict(r, launch="untraced" if a.untraced else "traced")
                     for r in sweep_rows(hbm, a.impl)]
    if a.only in (None, "gemv"):
        rows += gemv_rows(hbm)
    write_rows(a.json, hbm, rows)


if __name__ == "__main__":
    main()
