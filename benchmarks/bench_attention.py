"""Benchmark span_attention's Triton kernels on the GPU; writes benchmarks/results/attention.json.

- HBM bandwidth, measured in the same run: a large device copy (bytes read + written)
  and a large reduction (bytes read); the larger is the reference.
- decode: 1 query row (and 8, the widest verify) over resident pages at 32K/128K/256K for
  4 KV heads x 256 dims (24 q heads) and 8 KV heads x 128 dims (32 q heads), q8_0 K / q4_0 V
  and bf16 K / V. gbps = KV bytes of the context / time. Pages are scattered (random page
  table) and four disjoint copies of the KV rotate so that L2 cannot serve repeats.
  Timed as CUDA-graph replays (how decode runs in a phase program). --untraced launches
  as inside the op (wrap_triton off: PDL between the split and the reduce, ops/pdl.py, and
  the transposed decode's codes by TMA, span_attention/tma_codes.py), as the models' decode
  steps run; rows say which (`launch`, `codes`).
- prefill: 16K query rows over 16K keys, causal, beside F.scaled_dot_product_attention on
  the same shapes (bf16; K/V expanded to the query heads for SDPA).
- kv_write: 16K rows quantized into pages.

usage: python benchmarks/bench_attention.py [--quick] [--out PATH]
       python benchmarks/bench_attention.py --decode-only --impls legacy,blocks,transposed
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn

import kvcompile.ops  # noqa: F401
from kvcompile.ops import kv_format as F
from kvcompile.ops.kv_write.op import physical_slots
from kvcompile.ops.span_attention.decode_blocks import DECODE_IMPLS, decode_launcher
from kvcompile.ops.span_attention.decode_transposed import transposed_takes
from kvcompile.ops.span_attention.tma_codes import tma_possible
from kvcompile.ops.span_attention.prefill_kernel import span_attention_prefill

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
from bench_util import events_ms, hbm_bandwidth  # noqa: E402

GEOMS = [(4, 256, 24), (8, 128, 32)]            # (KV heads, head dim, q heads)
KV_PAIRS = [("q8_0", "q4_0"), ("bf16", "bf16")]
ROT = 4                                          # disjoint KV copies rotated in decode


def graph_ms(calls, reps: int = 10) -> float:
    """Capture `calls` (a list of thunks) in one CUDA graph; ms per call over replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return events_ms(g.replay, reps) / len(calls)


def make_pools(k_name, v_name, n_ctx, n_kv, d, copies, page=256):
    """`copies` disjoint logical KV sets in one pool, each with a scattered page table."""
    n_pages = math.ceil(n_ctx / page)
    kt, vt = F.kv_type(k_name), F.kv_type(v_name)
    total = copies * n_pages
    kp = torch.empty(total, F.page_bytes(kt, page, n_kv, d), dtype=torch.uint8, device="cuda")
    vp = torch.empty(total, F.page_bytes(vt, page, n_kv, d), dtype=torch.uint8, device="cuda")
    perm = torch.randperm(total, device="cuda").int()
    tables = [perm[i * n_pages:(i + 1) * n_pages].contiguous() for i in range(copies)]
    step = 16384
    for table in tables:
        for s0 in range(0, n_ctx, step):
            pos = torch.arange(s0, min(n_ctx, s0 + step), device="cuda")
            rows = torch.randn(len(pos), n_kv, d, device="cuda", dtype=torch.bfloat16)
            torch.ops.kvcompile.kv_write(kp, vp, rows, rows, pos, kt.ggml_id, vt.ggml_id, page,
                                         table)
    kv_bytes = n_ctx * (F.bytes_per_token(kt, n_kv, d) + F.bytes_per_token(vt, n_kv, d))
    return kp, vp, tables, kv_bytes


class DecodeCase:
    """One decode shape over resident pages (ROT disjoint copies, make_pools), one query row
    at the last position, and the decode launcher for it (the op's choice, or `impl`)."""

    def __init__(self, kn, vn, n_ctx, n_kv, d, n_q, impl=None):
        self.kp, self.vp, self.tables, self.kv_bytes = make_pools(kn, vn, n_ctx, n_kv, d, ROT)
        self.q = torch.randn(1, n_q, d, device="cuda", dtype=torch.bfloat16)
        self.q_pos = torch.tensor([n_ctx - 1], device="cuda", dtype=torch.int32)
        self.out = torch.empty_like(self.q)
        quant = kn != "bf16"
        self.launch = decode_launcher(impl, k_quantized=quant, v_quantized=quant,
                                     rows_per_kv_head=n_q // n_kv)
        self.types = (F.kv_type(kn).ggml_id, F.kv_type(vn).ggml_id)
        self.scale = d ** -0.5

    def ms(self, **cfg) -> float:
        """ms a call (launch options `cfg`), graph replays over the rotated copies."""
        return graph_ms([lambda t=t: self.launch(self.q, self.kp, self.vp, t, self.q_pos,
                                                 *self.types, 256, self.scale, out=self.out,
                                                 **cfg) for t in self.tables] * 5)


def bench_decode(hbm, rows_list, contexts, configs, impls=("legacy", "blocks")):
    out = []
    for n_kv, d, n_q in GEOMS:
        for kn, vn in KV_PAIRS:
            for n_ctx in contexts:
                kp, vp, tables, kv_bytes = make_pools(kn, vn, n_ctx, n_kv, d, ROT)
                for rows, impl in [(r, i) for r in rows_list for i in impls]:
                    if impl == "transposed" and not transposed_takes(
                            F.kv_type(kn).quantized, F.kv_type(vn).quantized,
                            rows * n_q // n_kv):
                        continue
                    decode = decode_launcher(impl)
                    q = torch.randn(rows, n_q, d, device="cuda", dtype=torch.bfloat16)
                    q_pos = torch.arange(n_ctx - rows, n_ctx, device="cuda", dtype=torch.int32)
                    outb = torch.empty_like(q)
                    best = None
                    for cfg in configs[impl]:
                        calls = [lambda t=t, c=cfg: decode(
                            q, kp, vp, t, q_pos, F.kv_type(kn).ggml_id, F.kv_type(vn).ggml_id,
                            256, d ** -0.5, out=outb, **c) for t in tables] * 5
                        try:
                            ms = graph_ms(calls)
                        except Exception as e:  # a config that does not compile or fit
                            print(f"  decode {impl} config {cfg} failed: {type(e).__name__}: "
                                  f"{str(e)[:120]}", flush=True)
                            torch.cuda.synchronize()
                            continue
                        print(f"  decode {impl} {kn}/{vn} D{d} ctx {n_ctx} rows {rows} {cfg}: "
                              f"{ms:.4f} ms", flush=True)
                        if best is None or ms < best[0]:
                            best = (ms, cfg)
                    if best is None:
                        continue
                    ms, cfg = best
                    gbps = kv_bytes / (ms * 1e-3) / 1e9
                    codes = ("tma" if cfg.get("tma") is not False and tma_possible(kp, vp)
                             else "pointers") if impl == "transposed" else "pointers"
                    out.append(dict(kernel="decode", impl=impl, kv_type=f"{kn}/{vn}", context=n_ctx,
                                    q_rows=rows, n_kv_heads=n_kv, head_dim=d, n_q_heads=n_q,
                                    ms=ms, gbps=gbps, hbm_gbps_measured=hbm,
                                    frac_of_hbm=gbps / hbm, kv_bytes=kv_bytes, config=cfg,
                                    codes=codes))
                    print(fmt(out[-1]), flush=True)
                del kp, vp
                torch.cuda.empty_cache()
    return out


def bench_prefill(hbm, n_ctx, configs, reps=5):
    out = []
    for n_kv, d, n_q in GEOMS:
        q = torch.randn(n_ctx, n_q, d, device="cuda", dtype=torch.bfloat16)
        q_pos = torch.arange(n_ctx, device="cuda", dtype=torch.int32)
        flops = 4 * n_ctx * n_ctx / 2 * d * n_q      # causal: half of the full score matrix
        qs = q.transpose(0, 1)[None]
        ks = torch.randn(1, n_q, n_ctx, d, device="cuda", dtype=torch.bfloat16)
        vs = torch.randn_like(ks)
        ms_sdpa = events_ms(lambda: Fn.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                            reps)
        sdpa_tf = flops / (ms_sdpa * 1e-3) / 1e12
        del ks, vs
        out.append(dict(kernel="sdpa", kv_type="bf16/bf16", context=n_ctx, q_rows=n_ctx,
                        n_kv_heads=n_q, head_dim=d, n_q_heads=n_q, ms=ms_sdpa, tflops=sdpa_tf,
                        hbm_gbps_measured=hbm))
        print(fmt(out[-1]), flush=True)
        for kn, vn in KV_PAIRS[::-1]:
            kp, vp, tables, _ = make_pools(kn, vn, n_ctx, n_kv, d, 1)
            res = []
            for cfg in configs.get(d, [{}]):
                try:
                    ms = events_ms(lambda: span_attention_prefill(
                        q, kp, vp, tables[0], q_pos, F.kv_type(kn).ggml_id,
                        F.kv_type(vn).ggml_id, 256, d ** -0.5, **cfg), reps)
                except Exception as e:  # a config that does not fit (shared memory)
                    print(f"  prefill config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                res.append((ms, cfg))
                print(f"  prefill {kn}/{vn} D{d} {cfg}: {ms:.2f} ms "
                      f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)
            ms, cfg = min(res, key=lambda r: r[0])
            tf = flops / (ms * 1e-3) / 1e12
            out.append(dict(kernel="prefill", kv_type=f"{kn}/{vn}", context=n_ctx, q_rows=n_ctx,
                            n_kv_heads=n_kv, head_dim=d, n_q_heads=n_q, ms=ms, tflops=tf,
                            hbm_gbps_measured=hbm, vs_sdpa=tf / sdpa_tf, config=cfg))
            print(fmt(out[-1]), flush=True)
            del kp, vp
            torch.cuda.empty_cache()
    return out


def bench_kv_write(hbm):
    out = []
    for n_kv, d, _ in GEOMS:
        for kn, vn in KV_PAIRS:
            kp, vp, tables, _ = make_pools(kn, vn, 16384, n_kv, d, 1)
            rows = torch.randn(16384, n_kv, d, device="cuda", dtype=torch.bfloat16)
            pos = torch.arange(16384, device="cuda")
            slots = physical_slots(pos, tables[0], 256)
            kt, vt = F.kv_type(kn), F.kv_type(vn)
            ms = events_ms(lambda: torch.ops.kvcompile.kv_write(
                kp, vp, rows, rows, slots, kt.ggml_id, vt.ggml_id, 256), 10)
            nbytes = 2 * rows.numel() * 2 + 16384 * (F.bytes_per_token(kt, n_kv, d)
                                                     + F.bytes_per_token(vt, n_kv, d))
            out.append(dict(kernel="kv_write", kv_type=f"{kn}/{vn}", context=16384,
                            q_rows=16384, n_kv_heads=n_kv, head_dim=d, ms=ms,
                            gbps=nbytes / (ms * 1e-3) / 1e9, hbm_gbps_measured=hbm))
            print(fmt(out[-1]), flush=True)
    return out


def fmt(r: dict) -> str:
    val = f"{r['gbps']:8.0f} GB/s" if "gbps" in r else f"{r['tflops']:8.1f} TFLOP/s"
    extra = f" {r['frac_of_hbm']:.2f} of HBM" if "frac_of_hbm" in r else ""
    extra += f" {r['vs_sdpa']:.2f}x SDPA" if "vs_sdpa" in r else ""
    return (f"{r['kernel']:8s} {r.get('impl', ''):10s} {r['kv_type']:10s} "
            f"Hkv{r['n_kv_heads']}xD{r['head_dim']:<4d} ctx {r['context']:7d} "
            f"rows {r['q_rows']:6d} {r['ms']:9.4f} ms {val}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="32K decode only, short prefill")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention.json"))
    ap.add_argument("--parts", default="decode,prefill,kv_write")
    ap.add_argument("--pairs", default="q8_0/q4_0,bf16/bf16", help="K/V type pairs")
    ap.add_argument("--rows", default="1,8", help="decode query rows")
    ap.add_argument("--impls", default="legacy,blocks,transposed",
                    help="decode implementations to time, e.g. legacy,blocks (rows tagged impl;"
                         " transposed only where it applies: quantized K and V, <= 16 query "
                         "rows a KV head)")
    ap.add_argument("--decode-only", action="store_true", help="same as --parts decode")
    ap.add_argument("--contexts", default="", help="decode contexts, e.g. 32768,131072")
    ap.add_argument("--untraced", action="store_true",
                    help="decode: launch as inside the op (wrap_triton off: PDL)")
    ap.add_argument("--configs-from", help="decode: time a slice of one implementation's "
                                            "config list, e.g. transposed:8: (from the stage "
                                            "and one-warp configs on)")
    ap.add_argument("--configs", help="decode: JSON {impl: [launch options, ...]} that "
                                       "replaces the named implementations' lists below, e.g. "
                                       "'{\"transposed\": [{}, {\"num_stages\": 4}]}'")
    ap.add_argument("--defaults-only", action="store_true",
                    help="decode: time each implementation's launch defaults only (no sweep)")
    args = ap.parse_args()
    if sum(map(bool, (args.defaults_only, args.configs_from, args.configs))) > 1:
        ap.error("--defaults-only, --configs-from and --configs pick different configs: "
                 "give one")
    if (args.configs_from or args.configs) and args.out == ap.get_default("out"):
        ap.error("a config sweep keeps each case's fastest config: give --out so it does not "
                 "replace the published results/attention.json")
    given = json.loads(args.configs) if args.configs else {}
    if not (isinstance(given, dict) and all(
            k in DECODE_IMPLS and isinstance(v, list) and all(isinstance(c, dict) for c in v)
            for k, v in given.items())):
        ap.error(f"--configs takes {{impl: [options, ...]}} for impl in "
                 f"{sorted(DECODE_IMPLS)}, got {args.configs}")
    KV_PAIRS[:] = [tuple(p.split("/")) for p in args.pairs.split(",")]
    torch.manual_seed(0)
    t0 = time.time()
    bw = hbm_bandwidth()
    print(f"HBM: copy {bw['copy_gbps']:.0f} GB/s (read+write), read {bw['read_gbps']:.0f} GB/s",
          flush=True)
    hbm = bw["hbm_gbps_measured"]
    rows = []
    parts = ["decode"] if args.decode_only else args.parts.split(",")
    if "decode" in parts:
        ctxs = [32768] if args.quick else [32768, 131072, 262144]
        if args.contexts:
            ctxs = [int(c) for c in args.contexts.split(",")]
        dcfg = [dict(block_n=b, num_warps=w, programs_per_sm=p)
                for b, w, p in ((32, 4, 2), (64, 4, 2), (32, 4, 4), (64, 8, 4))]
        # blocks: its own defaults, then without cp.async pipelining (num_stages 1: V codes
        # reach fp16 in registers, not byte by byte from shared memory; 168 registers, 3
        # programs an SM), more programs per SM, and a register cap (3 resident programs
        # with pipelining), 128 positions a tile (13% fewer instructions a position, fewer
        # programs resident). programs_per_sm alone does not recompile.
        dcfg = {"legacy": dcfg, "blocks": [
            {}, dict(programs_per_sm=4), dict(num_stages=1), dict(num_stages=1, programs_per_sm=4),
            dict(maxnreg=168, programs_per_sm=4), dict(block_n=128, num_stages=1),
            # small programs (the layout probe's winners): 1-2 warps, no cross-warp softmax
            dict(block_n=32, num_warps=1, num_stages=3, programs_per_sm=8),
            dict(block_n=64, num_warps=1, num_stages=3, programs_per_sm=8),
            dict(block_n=32, num_warps=2, num_stages=3, programs_per_sm=6),
            dict(block_n=32, num_warps=2, num_stages=3, programs_per_sm=8, maxnreg=128),
            # register caps at 128: 16 one-warp or 8 two-warp programs
            dict(block_n=32, num_warps=1, num_stages=3, programs_per_sm=16, maxnreg=128),
            dict(block_n=64, num_warps=2, num_stages=3, programs_per_sm=8, maxnreg=128),
            # fewer, longer chunks: at 32K the fixed cost (partials, reduce) dominates
            dict(programs_per_sm=1), dict(block_n=64, num_warps=2, num_stages=3,
                                          programs_per_sm=1)],
            # transposed (positions on the MMA's 16-row side): fewer registers a warp (offline
            # sm_90 counts: 128-168 for 2 warps x 64 positions, 168 for 1 warp x 32), so
            # more programs resident
            # (stages: the launch default, 2 with TMA code reads and 3 with pointer reads)
            "transposed": [{}] + [dict(block_n=b, num_warps=w, programs_per_sm=p)
                                  for b, w, p in ((64, 2, 8), (64, 2, 6), (32, 1, 12),
                                                  (32, 1, 8), (32, 2, 8), (64, 4, 4),
                                                  (128, 4, 4), (64, 2, 4), (128, 4, 2))]
            # deeper prefetch (more tiles in flight a program), and one-warp programs held
            # to 128 registers (no spills at D 128 offline: 16 an SM, no cross-warp softmax)
            + [dict(block_n=64, num_warps=2, num_stages=s, programs_per_sm=p)
               for s, p in ((4, 8), (5, 8), (4, 6), (4, 5))]
            + [dict(block_n=32, num_warps=1, num_stages=s, programs_per_sm=16, maxnreg=128)
               for s in (3, 5)]}
        dcfg.update(given)
        if args.defaults_only:
            dcfg = {impl: [{}] for impl in dcfg}
        elif args.configs_from:       # a slice of the list, e.g. "transposed:8:" (Python slice)
            impl, _, sl = args.configs_from.partition(":")
            dcfg[impl] = dcfg[impl][slice(*(int(x) if x else None for x in sl.split(":")))]
        from torch._library.triton import set_wrap_triton_enabled
        with set_wrap_triton_enabled(not args.untraced):
            decode_rows = bench_decode(hbm, [int(r) for r in args.rows.split(",")], ctxs,
                                       dcfg, args.impls.split(","))
        rows += [dict(r, launch="untraced" if args.untraced else "traced")
                 for r in decode_rows]
    if "prefill" in parts:
        pcfg = {128: [dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
                      dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
                      dict(block_m=64, block_n=64, num_warps=4, num_stages=3)],
                256: [dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
                      dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
                      dict(block_m=64, block_n=32, num_warps=4, num_stages=3)]}
        rows += bench_prefill(hbm, 4096 if args.quick else 16384, pcfg)
    if "kv_write" in parts:
        rows += bench_kv_write(hbm)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                hbm_copy_gbps=bw["copy_gbps"], hbm_read_gbps=bw["read_gbps"],
                v_page_layout="position-major (quantized V, since 2026-11-29)")
    out.write_text(json.dumps([dict(r, **meta) for r in rows], indent=1))
    print(f"wrote {out} ({len(rows)} rows, {time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
