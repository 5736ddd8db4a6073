"""The seed's workload through the Engine: a quantized 27B hybrid at 256K inside a 16 GiB
device-memory budget, beside the same model all resident without a budget.

    python benchmarks/bench_seed.py FILE [--context 262144] [--decode-steps 32]
        [--gpu-memory-gib 16] [--kv q8_0/q4_0] [--ubatch 512,256]
        [--part both|budget|resident] [--out PATH]

FILE: a GGUF of the seed-27b geometry (`kvcompile make-model --arch qwen35 --preset seed-27b
--type iq4_xs`). One process, ctx_size --context, one prompt of random token ids filling it
but for the decode steps:
Each part is one Engine and two requests: a short warm-up (it captures the decode programs,
reported apart) and the measured one.
  budget    Engine(gpu_memory_gib=G, kv_stream_arena_mib="auto", cuda_graphs=True): the
            arena the budget left, peak torch.cuda.max_memory_reserved() (<= G), decode
            tok/s over --decode-steps greedy steps (each step ends in the sampler's read of
            its logits: timed to GPU completion) against the PCIe bound measured in this run,
            pcie_gbps / (KV bytes of the context - arena bytes)
  resident  the same file, no budget, the whole KV on the device: its greedy tokens
Both run prefill chunks of the first --ubatch size whose workspace the budget leaves room
for beside the smallest arena (BudgetError: the next one); a smaller ubatch leaves the
arena more (at ubatch 512 the 16 GiB budget kept 1.39 GiB for it). Targets (issue 25):
peak reserved <= G, decode >= 0.8 x the bound, tokens equal. Each part appends its row
(commit, date, its greedy tokens) to --out; `--part` runs one of them, so the two 256K
prefills can take a device call each.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
from bench_streaming import measure_h2d_gbps  # noqa: E402
from bench_util import log, run_meta  # noqa: E402

GIB = 1 << 30
WARM_PROMPT, WARM_STEPS = 512, 4      # the warm-up request before the measured one


def run(path, ids, args, **options) -> tuple[dict, list[int]]:
    import kvcompile
    torch.cuda.reset_peak_memory_stats()
    k, v = args.kv.split("/")
    e = kvcompile.Engine(path, device="cuda", ctx_size=args.context,
                         cache_type_k=k, cache_type_v=v, ubatch=args.ubatch, cuda_graphs=True,
                         progress=False, **options)
    # warm-up request: captures the decode programs (seconds under a budget cap), which the
    # Engine keeps for the measured request
    w = e.generate(ids[:WARM_PROMPT], max_tokens=WARM_STEPS, temperature=0)
    r = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    out = dict(prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s,
               warmup=dict(prompt_tokens=WARM_PROMPT, decode_steps=WARM_STEPS - 1,
                           captures=w.programs.get("captures"),
                           step_ms_max=w.step_ms()["max"]),
               decode_steps=r.completion_tokens - 1,
               max_memory_reserved=torch.cuda.max_memory_reserved(),
               plan=e.memory.describe() if e.memory else None,
               arena_bytes=e.memory.arena if e.memory else int(
                   options.get("kv_stream_arena_mib", 0) * 2**20),
               kv_bytes=e.memory.kv_all if e.memory else None, kv=r.kv,
               programs=r.programs, step_ms=r.step_ms(), host_step_ms=r.host_step_ms(),
               runner_mode=e.executor.mode)
    del e
    gc.collect()
    torch.cuda.empty_cache()
    return out, r.token_ids


def load_rows(path: str) -> list:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f).get("rows", [])
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--context", type=int, default=262144)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--gpu-memory-gib", type=float, default=16)
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--ubatch", default="512,256", help="sizes to try, largest first")
    ap.add_argument("--part", choices=("both", "budget", "resident"), default="both",
                    help="one run a call (a 256K prefill takes minutes); the resident part "
                         "compares its tokens with the newest budget row of the same file, "
                         "context, KV types and commit in --out")
    ap.add_argument("--arena-mib", type=float, default=0,
                    help="the budget part with this arena and no device-memory budget (to "
                         "tell the budget's effect from the arena's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/quantized_weights.json")
    args = ap.parse_args()
    meta = run_meta()
    pcie = measure_h2d_gbps(torch.device("cuda"), 256 << 20)["pcie_gbps_measured"]
    from kvcompile.io.loader import open_model
    vocab = open_model(args.file).config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.context - args.decode_steps - 2,),
                        generator=gen).tolist()
    log(f"PCIe {pcie:.1f} GB/s; {len(ids)} prompt tokens")
    same = dict(kind="seed_workload", file=os.path.basename(args.file), context=args.context,
                kv_type=args.kv, commit=meta["commit"])
    rows = load_rows(args.out)
    if args.part in ("both", "budget"):
        from kvcompile.engine.memory_budget import BudgetError
        for ubatch in map(int, args.ubatch.split(",")):
            args.ubatch = ubatch
            try:
                opts = (dict(kv_stream_arena_mib=args.arena_mib) if args.arena_mib else
                        dict(gpu_memory_gib=args.gpu_memory_gib, kv_stream_arena_mib="auto"))
                budget, tokens = run(args.file, ids, args, **opts)
                break
            except BudgetError as e:
                log(f"ubatch {ubatch}: {e}")
        else:
            raise SystemExit("no ubatch fits the budget")
        if budget["kv_bytes"] is None:       # no budget plan: the context's KV, as it counts
            from kvcompile.io.loader import open_model as _open
            from kvcompile.engine.memory_budget import kv_bytes, kv_layer_count
            cfg = _open(args.file).config
            k, v = args.kv.split("/")
            budget["kv_bytes"] = kv_bytes(cfg, kv_layer_count(cfg), args.context, k, v)
        streamed = budget["kv_bytes"] - budget["arena_bytes"]
        bound = pcie * 1e9 / streamed if streamed > 0 else None
        row = dict(same, part="budget" if not args.arena_mib else "arena",
                   arena_mib=args.arena_mib or None, prompt_tokens=len(ids), ubatch=args.ubatch,
                   gpu_memory_gib=args.gpu_memory_gib, pcie_gbps_measured=pcie,
                   pcie_bound_tok_s=bound,
                   decode_vs_bound=budget["decode_tok_s"] / bound if bound else None,
                   reserved_within_budget=budget["max_memory_reserved"]
                   <= args.gpu_memory_gib * GIB, tokens=tokens, **budget,
                   **{k: v for k, v in meta.items() if k != "commit"})
        log(f"budget: {budget['plan']}; decode {budget['decode_tok_s']:.2f} tok/s = "
            f"{row['decode_vs_bound'] or 0:.2f} x the bound {bound or float('nan'):.2f}; "
            f"peak reserved {budget['max_memory_reserved'] / GIB:.2f} GiB")
        rows.append(row)
    if args.part in ("both", "resident"):
        ref = [r for r in rows if r.get("part") == "budget"
               and all(r.get(k) == v for k, v in same.items())]
        if not ref:
            raise SystemExit(f"no budget row of this file, context, KV and commit in {args.out}")
        args.ubatch = ref[-1]["ubatch"]
        resident, tokens = run(args.file, ids, args)
        equal = tokens == ref[-1]["tokens"]
        rows.append(dict(same, part="resident", ubatch=args.ubatch, tokens=tokens,
                         tokens_equal_budget=equal,
                         first_difference=next((i for i, (a, b) in
                                                enumerate(zip(tokens, ref[-1]["tokens"]))
                                                if a != b), None), **resident,
                         **{k: v for k, v in meta.items() if k != "commit"}))
        log(f"resident decode {resident['decode_tok_s']:.2f} tok/s; greedy tokens equal to "
            f"the budget run's: {equal}")
    with open(args.out, "w") as f:
        json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
