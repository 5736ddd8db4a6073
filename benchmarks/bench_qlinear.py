"""The quantized-linear kernels (ops/qlinear) on the device, each timed to GPU completion.

    python benchmarks/bench_qlinear.py [--types Q4_K,Q8_0,...] [--out PATH]

Rows, for the Llama-3-8B decode shapes (qkv 6144 x 4096, o 4096 x 4096, gate/up 28672 x
4096, down 4096 x 14336, the LM head 128256 x 4096):
  gemv      1 and 8 rows: microseconds (calls captured in a CUDA graph and replayed, as a
            decode step runs them: no host time) and the fraction of the HBM bandwidth
            measured in this run that reading the weight's bytes once at that time amounts to
  sweep     (--sweep) the same over launch configurations, to pick the defaults
  gemm      a 512- and 4096-row ubatch: TFLOP/s, beside cuBLAS on the same weights
            dequantized to bf16 (same process)
Every row records the git commit and date (bench_util.run_meta).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import events_ms, hbm_bandwidth, log, run_meta  # noqa: E402

from kvcompile.io.gguf.quantize import quantize  # noqa: E402
from kvcompile.ops.qlinear.formats import FORMATS, to_planar, weight_format  # noqa: E402
from kvcompile.ops.qlinear.naive import dequantize_planar  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "head": (128256, 4096)}


def weight(type_name: str, n: int, k: int, gen) -> torch.Tensor:
    x = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    return to_planar(quantize(x, type_name), type_name, k)


def graph_us(fn, calls: int = 20, reps: int = 5) -> float:
    """Microseconds a call of fn, replayed from a CUDA graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return 1e3 * events_ms(g.replay, reps) / calls


def sweep(types, shapes, hbm, meta, gen) -> list:
    from kvcompile.ops.qlinear.dequant import geometry
    from kvcompile.ops.qlinear.int_dot import INT_DOT_TYPES
    from kvcompile.ops.qlinear.triton_kernel import qlinear_triton, row_config
    rows = []
    for name in types:
        block = geometry(name)[0]
        for shape in shapes:
            n, k = SHAPES[shape]
            w = weight(name, n, k, gen)
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                best = None
                ints = (True, False) if name in INT_DOT_TYPES else (False,)
                cfgs = ([row_config(name, n, k, bn, warps, int_dot) for bn in (2, 4, 8, 16)
                         for warps in (1, 2, 4) for int_dot in ints]
                        if m == 1 else
                        [dict(BLOCK_N=bn, NB=max(1, bk // block), num_warps=4, num_stages=st)
                         for bn in (16, 32) for bk in (256, 512) for st in (2, 3)])
                for cfg in cfgs:
                    try:
                        us = graph_us(lambda: qlinear_triton(x, w, name, k, config=cfg))
                    except Exception as e:          # out of resources: not a candidate
                        log(f"  {name} {shape} m{m} {cfg}: {type(e).__name__}")
                        continue
                    frac = w.numel() / (us * 1e-6) / 1e9 / hbm
                    rows.append(dict(kind="sweep", type=name, shape=shape, rows=m, us=us,
                                     hbm_fraction=frac, config=cfg, **meta))
                    if best is None or us < best[0]:
                        best = (us, frac, cfg)
                log(f"sweep {name:6s} {shape:7s} m{m}: best {best[0]:.1f} us {best[1]:.2f} of "
                    f"HBM with {best[2]}")
            del w
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--gemm-rows", default="512,4096")
    ap.add_argument("--sweep", action="store_true", help="time launch configurations")
    ap.add_argument("--sweep-only", action="store_true", help="no default rows after it")
    ap.add_argument("--out", default="benchmarks/results/qlinear.json")
    args = ap.parse_args()
    meta = run_meta()
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    log(f"HBM {hbm:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    if args.sweep:
        rows += sweep(args.types.split(","), args.shapes.split(","), hbm, meta, gen)
    for name in [] if args.sweep_only else args.types.split(","):
        qt = weight_format(name).ggml_id
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            w = weight(name, n, k, gen)
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                us = graph_us(lambda: torch.ops.kvcompile.qlinear(x, w, qt, k))
                frac = w.numel() / (us * 1e-6) / 1e9 / hbm
                rows.append(dict(kind="gemv", type=name, shape=shape, n=n, k=k, rows=m,
                                 us=us, weight_bytes=w.numel(), hbm_fraction=frac, **meta))
                log(f"gemv {name:6s} {shape:7s} m{m}: {us:8.1f} us  {frac:.2f} of HBM")
            if shape in ("qkv", "down"):
                dense = dequantize_planar(w, name, k).to(torch.bfloat16)
                for m in map(int, args.gemm_rows.split(",")):
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    ours = events_ms(lambda: torch.ops.kvcompile.qlinear(x, w, qt, k), 20)
                    cublas = events_ms(lambda: x @ dense.t(), 20)
                    tf = 2 * m * n * k / 1e12
                    rows.append(dict(kind="gemm", type=name, shape=shape, n=n, k=k, rows=m,
                                     tflops=tf / (ours * 1e-3),
                                     cublas_bf16_tflops=tf / (cublas * 1e-3),
                                     ratio_to_cublas=cublas / ours, **meta))
                    log(f"gemm {name:6s} {shape:7s} m{m}: {tf / (ours * 1e-3):6.1f} TFLOP/s, "
                        f"{cublas / ours:.2f} x cuBLAS bf16")
                del dense
            del w
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(hbm_gbps=hbm, rows=rows), f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
