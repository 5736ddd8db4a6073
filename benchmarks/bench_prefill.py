"""Prefill through `Engine.generate`, all resident and streamed, beside transformers'
DynamicCache on the same weights, and the prefill attention kernel beside SDPA.

    python benchmarks/bench_prefill.py [--context 131072] [--arena-mib 2048]
        [--kv q8_0/q4_0] [--ubatch 512] [--hf-chunk 512] [--kernel-contexts 16384,65536]
        [--out benchmarks/results/prefill.json]
    python benchmarks/bench_prefill.py --tiny --device cpu      # the same code, the CPU

Llama-3-8B geometry, random bf16 weights made on the device. Rows (each with its commit and
date, appended to --out):
- "engine": a prompt of `context - 2` random tokens and one generated token through an
  Engine (resident: the whole KV on the device; streamed: --arena-mib), after a warm-up
  request that compiles and captures; prefill tok/s = prompt tokens / time to first token
  (the GenerationResult's). The streamed row records its ratio to the resident one and
  whether their first tokens agree.
- "hf": LlamaForCausalLM sharing the same weight tensors, DynamicCache (bf16 KV on the
  device), the prompt in chunks of --hf-chunk tokens, timed to GPU completion; its first
  token beside ours.
- "kernel" (CUDA only): the prefill kernel over q8_0/q4_0 and bf16 pages at each kernel
  context (queries = keys, causal) beside F.scaled_dot_product_attention with bf16 K/V
  (bench_attention.bench_prefill).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_runner import save  # noqa: E402
from bench_util import free_memory, log, run_meta, sync  # noqa: E402

WARM_TAIL = 100          # a warm-up request is two full chunks and a tail: the first chunk
                         # (position 0) is never captured, the second is


def engine_row(model, g, mode: str, ids: list[int], args, meta: dict) -> dict:
    import kvcompile
    k_type, v_type = args.kv.split("/")
    arena = args.arena_mib if mode == "streamed" else 0
    e = kvcompile.Engine.from_model(model, ctx_size=args.context, cache_type_k=k_type,
                                    cache_type_v=v_type, ubatch=args.ubatch,
                                    kv_stream_arena_mib=arena, progress=False)
    try:
        warm = min(2 * args.ubatch + WARM_TAIL, len(ids) // 2)
        e.generate(ids[:warm], max_tokens=2, temperature=0)
        e.store.reset()                                   # the measured prompt from 0
        r = e.generate(ids, max_tokens=1, temperature=0)
        return dict(kind="engine", mode=mode, context=args.context, kv_type=args.kv,
                    arena_mib=arena, ubatch=args.ubatch, geometry=g.name,
                    prompt_tokens=r.prompt_tokens, ttft_s=r.prefill_s,
                    prefill_tok_s=r.prefill_tok_s, first_token=r.token_ids[0],
                    captures=r.programs.get("captures"), **meta)
    finally:
        S.close_engine(e)


def hf_row(hf, hf_cfg, g, ids: list[int], args, device, meta: dict) -> dict:
    from transformers import DynamicCache

    from hf_baseline import hf_prefill
    t_ids = torch.tensor(ids, device=device)
    with torch.inference_mode():                       # warm-up: kernels, allocator
        hf_prefill(hf, DynamicCache(config=hf_cfg), t_ids[:2 * args.hf_chunk + WARM_TAIL],
                   args.hf_chunk, "hf")
        free_memory(device)
        cache = DynamicCache(config=hf_cfg)
        sync(device)
        t = time.perf_counter()
        logits = hf_prefill(hf, cache, t_ids, args.hf_chunk, f"hf prefill {len(ids)}")
        first = int(logits.argmax())
        sync(device)
        s = time.perf_counter() - t
    del cache
    free_memory(device)
    return dict(kind="hf", mode="hf-dynamic", context=args.context, kv_type="bf16/bf16",
                chunk=args.hf_chunk, geometry=g.name, prompt_tokens=len(ids), ttft_s=s,
                prefill_tok_s=len(ids) / s, first_token=first, **meta)


def kernel_rows(contexts: list[int], meta: dict) -> list[dict]:
    from bench_attention import bench_prefill
    from bench_util import hbm_bandwidth
    hbm = hbm_bandwidth()["hbm_gbps_measured"]
    rows = []
    for n in contexts:
        rows += [dict(r, kind="kernel", **meta)
                 for r in bench_prefill(hbm, n, {}, reps=5 if n <= 16384 else 2)]
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--arena-mib", type=float, default=2048)
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--hf-chunk", type=int, default=512,
                    help="transformers' prompt chunk (0: no transformers row)")
    ap.add_argument("--kernel-contexts", default="16384,65536",
                    help="kernel rows' query rows = keys (CUDA; empty: none)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model, a short prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/prefill.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.context = min(args.context, 1024)
        args.arena_mib = min(args.arena_mib, 0.4)
        args.ubatch = min(args.ubatch, 128)
        args.hf_chunk = min(args.hf_chunk, 128)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device, dtype = S.device_and_dtype(args.device, "use --device cpu --tiny")
    g = S.TINY if args.tiny else S.LLAMA3_8B
    meta = run_meta()
    want_hf = args.hf_chunk > 0
    model, hf, hf_cfg, reason = S.build_models(g, args.context, dtype, device, args.seed,
                                               want_hf)
    ids = S.random_ids(args.context - 2, g.vocab, args.seed, "cpu").tolist()
    rows = []
    for mode in ("resident", "streamed"):
        rows.append(engine_row(model, g, mode, ids, args, meta))
        log(f"{mode}: {rows[-1]['prefill_tok_s']:.0f} tok/s ({rows[-1]['ttft_s']:.2f} s)")
        free_memory(device)
    resident, streamed = rows
    streamed.update(vs_resident=streamed["prefill_tok_s"] / resident["prefill_tok_s"],
                    first_token_equal=streamed["first_token"] == resident["first_token"])
    if hf is not None:
        rows.append(hf_row(hf, hf_cfg, g, ids, args, device, meta))
        resident["vs_hf"] = resident["prefill_tok_s"] / rows[-1]["prefill_tok_s"]
        log(f"hf: {rows[-1]['prefill_tok_s']:.0f} tok/s; ours resident {resident['vs_hf']:.2f}x")
    elif want_hf:
        log(f"no transformers row: {reason}")
    del hf, model
    free_memory(device)
    contexts = [int(c) for c in args.kernel_contexts.split(",") if c]
    if device.type == "cuda" and contexts:
        rows += kernel_rows(contexts, meta)
    save(rows, args.out)
    return rows


if __name__ == "__main__":
    main()
