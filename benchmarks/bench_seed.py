"""The seed's workload through the Engine: a quantized 27B hybrid at 256K inside a 16 GiB
device-memory budget, its next conversation turn, and the same turn cold all resident.

    python benchmarks/bench_seed.py FILE [--context 262144] [--decode-steps 32] [--turn 300]
        [--gpu-memory-gib 16] [--kv q8_0/q4_0] [--ubatch 512,256]
        [--part both|budget|resident] [--out PATH]

FILE: a GGUF of the seed-27b geometry (`kvcompile make-model --arch qwen35 --preset seed-27b
--type iq4_xs`). One process, ctx_size --context, a prompt of random token ids filling it
but for the decode steps and a next turn of --turn new tokens:
  budget    Engine(gpu_memory_gib=G, kv_stream_arena_mib="auto", cuda_graphs=True): a short
            warm-up request (it captures the decode programs, reported apart), the measured
            one (the prompt, cold): the arena the budget left, peak
            torch.cuda.max_memory_reserved() (<= G), decode tok/s over --decode-steps
            greedy steps (each to the sampler's read of its logits: GPU completion)
            against the PCIe bound measured in this run, pcie_gbps / (KV bytes of the
            context - arena bytes); then the next turn (the prompt + --turn tokens), which
            resumes at the history the store holds (the recurrent layers at the checkpoint
            where the prompt ended): its time to first token over the measured request's,
            its decode against the bound, its greedy tokens.
  resident  the same file, no budget, the whole KV on the device: the next turn cold (a
            cold Engine's prefill of all of it), stepping one token at a time so its greedy
            gaps are seen; its tokens against the budget row's turn (greedy_check.py: a
            divergence counts as equal only at a near tie).
Both run prefill chunks of the first --ubatch size whose workspace the budget leaves room
for beside the smallest arena (BudgetError: the next one). Each part appends its row
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
from bench_util import kernel_compiles, log, run_meta  # noqa: E402
from greedy_check import compare, record_gaps  # noqa: E402

GIB = 1 << 30
WARM_PROMPT, WARM_STEPS = 612, 4      # the warm-up request before the measured one
# (its last chunk's 100 rows, no multiple of 16: Triton compiles a kernel per divisibility of
# its integer arguments, once a process, and a next turn's chunk then measures no compile)


def summary(r) -> dict:
    return dict(prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                ttft_s=r.prefill_s, prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s,
                decode_steps=r.completion_tokens - 1, kv=r.kv, programs=r.programs,
                step_ms=r.step_ms(), host_step_ms=r.host_step_ms(), tokens=r.token_ids)


def run(path, ids, turn, args, cold_turn: bool = False, **options) -> dict:
    """One Engine: a warm-up request, then (budget) the prompt and the next turn, or
    (cold_turn) the next turn alone, cold, its greedy gaps recorded."""
    import kvcompile
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    k, v = args.kv.split("/")
    e = kvcompile.Engine(path, device=args.device, ctx_size=args.context,
                         cache_type_k=k, cache_type_v=v, ubatch=args.ubatch, cuda_graphs=True,
                         progress=False, **options)
    # warm-up request: captures the decode programs (seconds under a budget cap), which the
    # Engine keeps for the measured request
    w = e.generate(ids[:WARM_PROMPT], max_tokens=WARM_STEPS, temperature=0)
    e.store.reset()                        # the measured request prefills from 0
    out = dict(warmup=dict(prompt_tokens=WARM_PROMPT, decode_steps=WARM_STEPS - 1,
                           captures=w.programs.get("captures"),
                           step_ms_max=w.step_ms()["max"]))
    if cold_turn:
        gaps: list = []
        e.store.reset()
        e.pipeline = False                 # one step at a time: the host sampler sees logits
        with record_gaps(gaps):
            out["turn"] = summary(e.generate(turn, max_tokens=args.decode_steps + 1,
                                             temperature=0))
        out["turn"]["gaps"] = gaps
    else:
        out["prompt"] = summary(e.generate(ids, max_tokens=args.decode_steps + 1,
                                           temperature=0))
        with kernel_compiles() as compiled:
            out["turn"] = summary(e.generate(turn, max_tokens=args.decode_steps + 1,
                                             temperature=0))
        out["turn"]["kernel_compiles"] = compiled
        out["turn"]["ttft_over_prompt"] = out["turn"]["ttft_s"] / out["prompt"]["ttft_s"]
    out.update(max_memory_reserved=torch.cuda.max_memory_reserved() if cuda else 0,
               plan=e.memory.describe() if e.memory else None,
               arena_bytes=e.memory.arena if e.memory else int(
                   options.get("kv_stream_arena_mib", 0) * 2**20),
               kv_bytes=e.memory.kv_all if e.memory else None, runner_mode=e.executor.mode)
    e.store.close()
    del e
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


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
    ap.add_argument("--turn", type=int, default=300,
                    help="new tokens of the next turn after the prompt")
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
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the same code on a "
                    "tiny file (no budget: give --arena-mib)")
    ap.add_argument("--out", default="benchmarks/results/quantized_weights.json")
    args = ap.parse_args()
    meta = run_meta()
    pcie = (measure_h2d_gbps(torch.device("cuda"), 256 << 20)["pcie_gbps_measured"]
            if args.device.startswith("cuda") else None)
    from kvcompile.io.loader import open_model
    vocab = open_model(args.file).config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    n = args.context - 2 * (args.decode_steps + 2) - args.turn
    ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
    turn = ids + torch.randint(0, vocab, (args.turn,), generator=gen).tolist()
    log(f"PCIe {pcie or 0:.1f} GB/s; {len(ids)} prompt tokens")
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
                budget = run(args.file, ids, turn, args, **opts)
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
            budget["kv_bytes"] = kv_bytes(cfg, kv_layer_count(cfg, mtp=False), args.context, k, v)
        streamed = budget["kv_bytes"] - budget["arena_bytes"]
        bound = pcie * 1e9 / streamed if streamed > 0 and pcie else None
        for part in ("prompt", "turn"):
            budget[part]["decode_vs_bound"] = (budget[part]["decode_tok_s"] / bound
                                               if bound else None)
        row = dict(same, part="budget" if not args.arena_mib else "arena",
                   arena_mib=args.arena_mib or None, prompt_tokens=len(ids), ubatch=args.ubatch,
                   gpu_memory_gib=args.gpu_memory_gib, pcie_gbps_measured=pcie,
                   pcie_bound_tok_s=bound, decode_tok_s=budget["prompt"]["decode_tok_s"],
                   decode_vs_bound=budget["prompt"]["decode_vs_bound"],
                   reserved_within_budget=budget["max_memory_reserved"]
                   <= args.gpu_memory_gib * GIB, **budget,
                   **{k: v for k, v in meta.items() if k != "commit"})
        t = budget["turn"]
        log(f"budget: {budget['plan']}; decode {row['decode_tok_s']:.2f} tok/s = "
            f"{row['decode_vs_bound'] or 0:.3f} x the bound {bound or float('nan'):.2f}; "
            f"peak reserved {budget['max_memory_reserved'] / GIB:.2f} GiB; next turn: TTFT "
            f"{t['ttft_s']:.2f} s = {t['ttft_over_prompt']:.4f} x the prompt's "
            f"{budget['prompt']['ttft_s']:.1f} s ({t['cached_tokens']} reused), decode "
            f"{t['decode_vs_bound'] or 0:.3f} x the bound")
        rows.append(row)
    if args.part in ("both", "resident"):
        ref = [r for r in rows if r.get("part") in ("budget", "arena")
               and all(r.get(k) == v for k, v in same.items())]
        if not ref:
            raise SystemExit(f"no budget row of this file, context, KV and commit in {args.out}")
        args.ubatch = ref[-1]["ubatch"]
        resident = run(args.file, ids, turn, args, cold_turn=True)
        t = resident["turn"]
        check = compare(ref[-1]["turn"]["tokens"], t["tokens"], t["gaps"])
        rows.append(dict(same, part="resident", ubatch=args.ubatch, budget_turn=check,
                         **resident, **{k: v for k, v in meta.items() if k != "commit"}))
        log(f"resident, the next turn cold: TTFT {t['ttft_s']:.1f} s, decode "
            f"{t['decode_tok_s']:.2f} tok/s (stepwise); the budget row's resumed turn: tokens "
            f"equal {check['tokens_equal']} (near tie: {check['equal_or_near_tie']})")
    with open(args.out, "w") as f:
        json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
