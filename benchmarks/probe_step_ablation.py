"""Probe (device): what each small kernel of a captured 8B decode step costs, as the decode
speed with that kernel left out (its outputs are wrong: timing only, never a result).

    python benchmarks/probe_step_ablation.py [--ctx 8192] [--json PATH]

Llama-3-8B geometry, random bf16 weights, q8_0/q4_0 KV, all resident, lower="graph" +
CUDA graphs, as bench_compiled's ours-captured. Variants, each one process-local patch:
  base        nothing left out
  no_kv_write the K/V page writes
  no_reduce   the decode attention's reduce kernel (the split's partials are never merged)
  none_of_2   both left out
  no_norm     every rms_norm (its input passed on; the residual add too)
  no_rope     the rope_rotate of q / k / v
  gemv:N=../bn=../bk=..[/w=..][/s=..]  nothing left out; the one-row GEMV of N outputs
              launched with that BLOCK_N, BLOCK_K, num_warps, num_stages ('+' between
              several shapes: gemv:N=4096/bn=8/bk=512+N=6144/bn=8/bk=512)
  ppsN        nothing left out; the decode split launched with N programs an SM (fewer,
              longer chunks: fewer partials for the reduce)
  split:bn=../w=../s=../pps=../r=..  nothing left out; the quantized decode split launched
              with those positions a tile, warps, stages, programs an SM and register cap
              (maxnreg; any subset)
  impl:NAME   nothing left out; the decode attention forced to NAME (blocks, transposed,
              legacy) instead of the op's choice by shape
The gap between a variant and base bounds what fusing that kernel away can gain. (The
2026-11-30 03:47 run also left out silu_mul and the output's rotation, then kernels of their
own; both now live inside other kernels: results/step_ablation.json keeps those rows.)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_compiled as B  # noqa: E402
import bench_streaming as S  # noqa: E402
from bench_util import hbm_bandwidth, log  # noqa: E402

from kvcompile.ops import rows  # noqa: E402
from kvcompile.ops.gemv import triton_kernel as gemv_kernel  # noqa: E402
from kvcompile.ops.kv_write import op as kv_write_op  # noqa: E402
from kvcompile.ops.span_attention import (decode_blocks, decode_kernel,  # noqa: E402
                                          decode_transposed)


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def leave_out(what: str):
    stack = contextlib.ExitStack()
    if what in ("no_kv_write", "none_of_2"):
        stack.enter_context(patched(kv_write_op, "kv_write_triton", lambda *a, **k: None))
    if what in ("no_reduce", "none_of_2"):
        for mod in (decode_blocks, decode_kernel, decode_transposed):   # their launchers
            stack.enter_context(patched(mod, "launch_reduce", lambda sh, *a, **kw: sh.out))
    if what.startswith("impl:"):
        stack.enter_context(patched(decode_blocks, "DECODE_IMPL", what[5:]))
    if what == "no_norm":
        stack.enter_context(patched(rows, "rms_norm", lambda x, w, eps: x))
        stack.enter_context(patched(rows, "add_rms_norm", lambda x, r, w, eps: (x, x)))
    if what == "no_rope":
        stack.enter_context(patched(rows, "rope_rotate", lambda x, *a: x))
    if what.startswith("gemv:"):
        real_row = gemv_kernel.row_config
        keys = dict(bn="BLOCK_N", bk="BLOCK_K", w="num_warps", s="num_stages")
        over = {}
        for shape in what[5:].split("+"):
            kv = dict(item.split("=") for item in shape.split("/"))
            n = int(kv.pop("N"))
            over[n] = {keys[k]: int(v) for k, v in kv.items()}

        def row_config(n, k):
            return dict(real_row(n, k), **over.get(n, {}))
        stack.enter_context(patched(gemv_kernel, "row_config", row_config))
    if what.startswith("pps") or what.startswith("split:"):
        if what.startswith("pps"):
            over = dict(programs_per_sm=int(what[3:]))
        else:
            keys = dict(bn="block_n", w="num_warps", s="num_stages", pps="programs_per_sm",
                        r="maxnreg")
            over = {keys[k]: int(v) for k, v in (item.split("=")
                                                 for item in what[6:].split("/"))}
        for mod, name in ((decode_blocks, "blocks_config"),
                          (decode_transposed, "transposed_config")):
            real = getattr(mod, name)
            stack.enter_context(patched(mod, name,
                                        lambda *a, real=real: dict(real(*a), **over)))
    return stack


VARIANTS = ("base", "no_kv_write", "no_reduce", "none_of_2", "no_norm", "no_rope")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json")
    a = ap.parse_args()
    args = B.parse_args(["--resident-contexts", str(a.ctx), "--streamed-contexts", "",
                         "--decode-steps", "64"])
    device, dtype = S.device_and_dtype("cuda", "needs CUDA")
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    model = S.build_models(S.LLAMA3_8B, a.ctx + args.decode_steps + 64, dtype, device,
                           0, want_hf=False)[0]
    ids = S.random_ids(a.ctx, S.LLAMA3_8B.vocab, a.ctx, device)
    roofline = hbm * 1e9 / (B.weight_read_bytes(model)
                            + a.ctx * S.kv_bytes_per_token(S.LLAMA3_8B, "q8_0", "q4_0"))
    out = []
    for v in a.variants.split(","):
        with leave_out(v):
            row = B.timed_compiled(model, a.ctx, "q8_0/q4_0", args, device, ids, "graph")
        tok_s = args.decode_steps / row["decode_s"]
        out.append(dict(variant=v, decode_tok_s=tok_s, step_ms=1e3 / tok_s,
                        x_roofline=tok_s / roofline))
        log(f"{v:12s} {tok_s:7.1f} tok/s  {1e3 / tok_s:6.3f} ms a step  "
            f"{tok_s / roofline:.3f} x roofline ({roofline:.1f})")
    base = out[0]["step_ms"]
    for r in out:
        print(f"{r['variant']:12s} step {r['step_ms']:.3f} ms ({r['step_ms'] - base:+.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(hbm_gbps_measured=hbm, roofline_tok_s=roofline, rows=out), f,
                      indent=1)


if __name__ == "__main__":
    main()
