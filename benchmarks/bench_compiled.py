"""Captured decode on the device (issue 5), beside the eager path in one process, all through
`Engine.from_model`; rows merged into benchmarks/results/streaming.json (meta under "compiled").

    python benchmarks/bench_compiled.py [--resident-contexts 8192] [--streamed-contexts 131072]
        [--systems ours-captured,ours-captured-nopdl,ours-resident,ours-graphs,ours]
        [--kv q8_0/q4_0]
        [--arena-mib 2048] [--decode-steps 32] [--trials 1] [--weights bf16,q4_k,q8_0]
        [--out PATH]
    python benchmarks/bench_compiled.py --device cpu --tiny      # the logic, seconds

Llama-3-8B geometry, random bf16 weights made on the device (bench_streaming's builder);
`--weights` lists weight types to run every row with: bf16, or a GGUF block type (the same
random matrices quantized on the device by kvcompile.io.gguf.quantize, kept quantized: the
qlinear kernels and the quantized embedding), one model after the other in this process.
Every row is one Engine and two requests (bench_streaming.run_ours: a warm-up request, then
the measured one; its times from the GenerationResult):

  ours-captured   all resident, the Engine's programs: the forward traced through the pass
                  pipeline and run op by op, each decode step (and each full prefill chunk
                  after the first) one CUDA graph (bitwise equal to eager); on the CPU
                  reruns of the programs' fixed layouts
  ours-captured-nopdl  ours-captured with programmatic dependent launch off (ops/pdl.py):
                  what overlapping each kernel with its predecessor's tail buys
  ours-resident   all resident, the eager model: the captured path's speed-up is over this row
  ours-graphs     streamed through --arena-mib, the Engine's programs (each decode step one
                  CUDA graph, ring copies included)
  ours            streamed, the eager model

Resident rows carry the HBM roofline, `hbm_roofline_tok_s = hbm_gbps_measured / (weight
bytes a decode step reads + KV bytes of the context)` (HBM bandwidth measured in this run,
the embedding table counted as the one row a step reads unless the head shares it); streamed
rows the PCIe bound of bench_streaming. Targets (issue 5): ours-captured decode >= 0.8 x the
HBM roofline at 8K; the streamed path >= 0.85 x the PCIe bound at 128K. `speedup_vs_eager`
compares each row with its eager twin of the same context and KV type. `--trials N` runs
every row N times in the process and keeps the median run (runs of one build in one process
differ by up to ~3% on the H200: docs/benchmarks.md). Every row records its commit and date.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_util import (add_run_options, commit_date, free_memory, hbm_bandwidth, log,  # noqa: E402
                        param_bytes)

SYSTEMS = ("ours-captured", "ours-captured-nopdl", "ours-resident", "ours-graphs", "ours")
RESIDENT = ("ours-captured", "ours-captured-nopdl", "ours-resident")
CAPTURED = ("ours-captured", "ours-captured-nopdl", "ours-graphs")   # the Engine's programs
EAGER_TWIN = {"ours-captured": "ours-resident", "ours-captured-nopdl": "ours-resident",
              "ours-graphs": "ours"}


def weight_read_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, the embedding table as
    the one row looked up (unless the LM head is the same tensor and reads it all)."""
    total = param_bytes(model)
    emb = model.embed.qweight if model.embed.qtype else model.embed.weight
    head = model.lm_head.qweight if model.lm_head.qtype else model.lm_head.weight
    if head is not emb:
        total += emb[0].nbytes - emb.nbytes
    return total


def quantize_model(model, type_name: str) -> None:
    """Every matrix of the model (projections, head, embedding) replaced by its `type_name`
    blocks, quantized on its device. A fused projection is quantized whole and the Linears
    of its parts (views of its rows, as the builder made them) take views of its rows:
    the bytes are held once, as the loader holds them."""
    from kvcompile.io.gguf.quantize import quantize
    from kvcompile.models.layers import Embedding, Linear
    from kvcompile.models.quant_weight import QuantWeight
    name = type_name.upper()
    mats = [m for m in model.modules() if isinstance(m, (Linear, Embedding)) and not m.qtype]
    # a part: a Linear whose weight lies inside a larger one's storage (the fused matrix)
    whole = {}
    for m in mats:
        key = m.weight.untyped_storage().data_ptr()
        if key not in whole or m.weight.shape[0] > whole[key].weight.shape[0]:
            whole[key] = m
    parts = []
    for m in mats:
        fused = whole[m.weight.untyped_storage().data_ptr()]
        if fused is not m:
            r0 = (m.weight.storage_offset() - fused.weight.storage_offset()) // m.weight.stride(0)
            parts.append((m, fused, r0, m.weight.shape[0]))
    for m in mats:
        if any(m is p[0] for p in parts):
            continue
        w = m.weight
        q = QuantWeight.from_gguf_rows(quantize(w.float(), name), name, w.shape[1])
        if isinstance(m, Embedding):
            m.set_quantized(q, w.dtype)
        else:
            m.set_quantized(q)
        del w
    for m, fused, r0, rows in parts:
        m.set_quantized(QuantWeight(fused.qweight[r0:r0 + rows], name, (rows, m.in_features)))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_row(system, model, ctx, kv, args, ids) -> dict:
    """One Engine's measured request (bench_streaming.run_ours); -nopdl rows with
    programmatic dependent launch off while they run."""
    from kvcompile.ops import pdl
    arena = args.arena_mib if system in S.STREAMED else 0
    before, pdl.ENABLED = pdl.ENABLED, pdl.ENABLED and not system.endswith("-nopdl")
    try:
        return S.run_ours(model, ctx, kv, args, ids, arena_mib=arena,
                          graphs=system in CAPTURED)
    finally:
        pdl.ENABLED = before


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resident-contexts", default="8192")
    ap.add_argument("--streamed-contexts", default="131072")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--weights", default="bf16",
                    help="comma separated: bf16 and / or GGUF block types (q4_k, q8_0, ...)")
    ap.add_argument("--arena-mib", type=float, default=None, help="default 2048 (tiny: 0.9)")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--trials", type=int, default=1,
                    help="runs of each row in this process; the row is the median run's (of "
                         "an even count the slower middle one), every run's decode tok/s is "
                         "kept in run order (decode_tok_s_trials)")
    ap.add_argument("--ubatch", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry and contexts (logic check)")
    add_run_options(ap, S.RESULTS, merge=False, tiny_temp=False)
    args = ap.parse_args(argv)
    if args.tiny:
        for name, tiny in (("resident_contexts", "512"), ("streamed_contexts", "1024")):
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, tiny)
        args.ubatch = min(args.ubatch, 128)
        args.pcie_mib = min(args.pcie_mib, 16)
        args.decode_steps = min(args.decode_steps, 4)
    args.arena_mib = args.arena_mib if args.arena_mib is not None else (0.9 if args.tiny
                                                                         else 2048)
    args.out = args.out or S.RESULTS
    args.resident_contexts = [int(c) for c in args.resident_contexts.split(",") if c]
    args.streamed_contexts = [int(c) for c in args.streamed_contexts.split(",") if c]
    S.parse_lists(ap, args, SYSTEMS)
    if args.decode_steps < 1 or args.ubatch < 1 or args.trials < 1:
        ap.error("--decode-steps, --ubatch and --trials must be positive")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device, dtype = S.device_and_dtype(args.device,
                                       "use --device cpu --tiny for the CPU logic check")
    g = S.TINY if args.tiny else S.LLAMA3_8B
    contexts = args.resident_contexts + args.streamed_contexts
    ctx_len = max(contexts) + args.decode_steps + 64
    pcie = S.measure_h2d_gbps(device, args.pcie_mib << 20)
    hbm = hbm_bandwidth() if device.type == "cuda" else {"hbm_gbps_measured": None}
    log(f"PCIe {pcie['pcie_gbps_measured']:.1f} GB/s, HBM {S.fmt(hbm['hbm_gbps_measured'], '.0f')} GB/s")
    rows: list[dict] = []
    for weights in args.weights.split(","):
        model = S.build_models(g, ctx_len, dtype, device, args.seed, want_hf=False)[0]
        if weights != "bf16":
            quantize_model(model, weights)
        w_read = weight_read_bytes(model)
        meta = dict(geometry=g.name, weights_dtype=weights, weight_read_bytes=w_read,
                    ubatch=args.ubatch, decode_steps=args.decode_steps,
                    torch=torch.__version__, **commit_date(),
                    device=torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", **pcie, **hbm)
        for ctx in contexts:
            ids = S.random_ids(ctx, g.vocab, args.seed + ctx, "cpu")
            systems = [s for s in args.systems
                       if (s in RESIDENT) == (ctx in args.resident_contexts)]
            for system in systems:
                for kv in args.kv:
                    rows.append(measure(system, model, g, ctx, kv, args, ids, meta))
                    S.save(rows, meta, args.out, section="compiled")
                    free_memory(device)
        del model
        free_memory(device)
    for r in rows:
        twin = [t for t in rows if t["system"] == EAGER_TWIN.get(r["system"])
                and t["context"] == r["context"] and t["kv_type"] == r["kv_type"]
                and t["weights"] == r["weights"]
                and t.get("status") == "ok"]
        if twin and r.get("status") == "ok":
            r["speedup_vs_eager"] = r["decode_tok_s"] / twin[0]["decode_tok_s"]
            a, b = r["decode_tokens"], twin[0]["decode_tokens"]   # lengths may differ
            n = min(len(a), len(b))
            r["tokens_equal_eager"] = a[:n] == b[:n]
    S.save(rows, meta, args.out, section="compiled")
    report(rows)
    return rows


def measure(system, model, g, ctx, kv, args, ids, meta) -> dict:
    k_type, v_type = kv.split("/")
    kv_bytes = ctx * S.kv_bytes_per_token(g, k_type, v_type)
    streamed = system in S.STREAMED
    arena = args.arena_mib if streamed else 0
    hbm = meta["hbm_gbps_measured"]
    row = dict(system=system, run="compiled", context=ctx, kv_type=kv, arena_mib=arena,
               geometry=g.name, weights=meta["weights_dtype"],
               kv_bytes=kv_bytes, pcie_gbps_measured=meta["pcie_gbps_measured"],
               pcie_bound_tok_s=S.pcie_bound(meta["pcie_gbps_measured"], kv_bytes,
                                             int(arena * 2**20)) if streamed else None,
               hbm_gbps_measured=hbm, weight_read_bytes=meta["weight_read_bytes"],
               hbm_roofline_tok_s=(hbm * 1e9 / (meta["weight_read_bytes"] + kv_bytes)
                                   if hbm and not streamed else None),
               decode_steps=args.decode_steps, device=meta["device"],
               **commit_date())
    log(f"{system} {kv} @ {ctx}")
    try:
        runs = [run_row(system, model, ctx, kv, args, ids)
                for _ in range(args.trials)]
        # the median run (of an even count the slower middle one); all runs in run order
        median = sorted(runs, key=lambda r: r["decode_s"])[len(runs) // 2]
        S.finish(row, median, args.decode_steps)
        row["decode_tok_s_trials"] = [args.decode_steps / r["decode_s"] for r in runs]
        h = row["hbm_roofline_tok_s"]
        row["decode_vs_hbm_roofline"] = row["decode_tok_s"] / h if h else None
        spread = (f" (median of {len(runs)}: {min(row['decode_tok_s_trials']):.2f}-"
                  f"{max(row['decode_tok_s_trials']):.2f})" if len(runs) > 1 else "")
        log(f"  prefill {row['prefill_tok_s']:.0f} tok/s, decode {row['decode_tok_s']:.2f} "
            f"tok/s{spread} (x bound {S.fmt(row['decode_vs_bound'], '.2f')}, x HBM roofline "
            f"{S.fmt(row['decode_vs_hbm_roofline'], '.2f')})")
    except Exception as e:
        S.failed(row, e)
    return row


def report(rows: list[dict]) -> None:
    hdr = (f"{'system':14} {'weights':>7} {'context':>8} {'kv':>10} {'arena MiB':>9} {'decode t/s':>10} "
           f"{'x eager':>7} {'= eager':>7} {'roofline':>8} {'x roof':>6} {'bound':>7} {'x bound':>7}  status")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['system']:14} {r.get('weights', 'bf16'):>7} {r['context']:>8} {r['kv_type']:>10} {r['arena_mib']:>9g} "
              f"{S.fmt(r.get('decode_tok_s'), '10.2f')} {S.fmt(r.get('speedup_vs_eager'), '7.2f')} "
              f"{str(r.get('tokens_equal_eager', '-')):>7} "
              f"{S.fmt(r.get('hbm_roofline_tok_s'), '8.1f')} "
              f"{S.fmt(r.get('decode_vs_hbm_roofline'), '6.2f')} "
              f"{S.fmt(r.get('pcie_bound_tok_s'), '7.2f')} {S.fmt(r.get('decode_vs_bound'), '7.2f')}"
              f"  {r.get('status')}{': ' + str(r.get('reason'))[:80] if r.get('reason') else ''}")
    for r in rows:
        if r.get("status") != "ok":
            continue
        off = [t for t in rows if t["system"] == r["system"] + "-nopdl"
               and t["context"] == r["context"] and t["kv_type"] == r["kv_type"]
               and t.get("status") == "ok"]
        if off:
            print(f"PDL @ {r['context']} ({r['system']} {r['kv_type']}): "
                  f"{r['decode_tok_s']:.1f} vs {off[0]['decode_tok_s']:.1f} tok/s without "
                  f"({r['decode_tok_s'] / off[0]['decode_tok_s']:.3f}x)")
        if r["system"] in CAPTURED and r.get("decode_vs_hbm_roofline") is not None:
            x = r["decode_vs_hbm_roofline"]
            print(f"target @ {r['context']} ({r['system']} {r['kv_type']}): {x:.2f} x HBM "
                  f"roofline (>= 0.8: {x >= 0.8})")
        if r["system"] in S.STREAMED and r.get("decode_vs_bound") is not None:
            x = r["decode_vs_bound"]
            print(f"target @ {r['context']} ({r['system']} {r['kv_type']}): {x:.2f} x PCIe "
                  f"bound (>= 0.85: {x >= 0.85})")


if __name__ == "__main__":
    main()
