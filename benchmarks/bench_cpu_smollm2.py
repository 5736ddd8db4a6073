"""SmolLM2-135M on the CPU: kvcompile prefill/decode tok/s next to llama.cpp, same process.

    ./dev python benchmarks/bench_cpu_smollm2.py [--prompt-tokens 256] [--decode-tokens 64]
        [--out PATH]

kvcompile through `Engine.generate` (a warm-up request, then the measured one: prefill to the
first token, decode steps to the sampler's read), llama.cpp through llama_cpp.Llama.eval.
Prints a table and writes benchmarks/results/cpu_smollm2.json (rows with the commit and
date). For the record only: the CPU path is the fp32 reference backend (dequantized
weights), llama.cpp runs quantized kernels, so no target is set here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
from bench_util import run_meta  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "cpu_smollm2.json")
TEXT = ("The lighthouse keeper counted the ships that passed each night, writing their names "
        "in a ledger that had belonged to her grandmother. ")


def bench_kvcompile(prompt_ids: list[int], n_decode: int, threads: int) -> dict:
    """Through the Engine (no prefix reuse): a warm-up request, then the measured one, greedy;
    prefill to the first token and decode steps as the GenerationResult times them."""
    from kvcompile.engine.engine import Engine

    engine = Engine(None, ctx_size=len(prompt_ids) + n_decode + 8, cache_prompt=False,
                    progress=False, threads=threads)
    engine.generate(prompt_ids[:8], max_tokens=2, temperature=0)          # warm-up
    r = engine.generate(prompt_ids, max_tokens=n_decode + 1, temperature=0)
    return dict(system="kvcompile (cpu, fp32 reference)", prefill_tok_s=r.prefill_tok_s,
                decode_tok_s=r.decode_tok_s, decode_steps=len(r.step_s),
                finish_reason=r.finish_reason)


def bench_llama_cpp(path: str, prompt_ids: list[int], n_decode: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=len(prompt_ids) + n_decode + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)
    llm.eval(prompt_ids[:8])
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt_ids)
    prefill = time.perf_counter() - t
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    t = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
    decode = time.perf_counter() - t
    return dict(system="llama.cpp (cpu, Q4_1)", prefill_tok_s=len(prompt_ids) / prefill,
                decode_tok_s=n_decode / decode)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)

    from kvcompile.io.default_model import default_model_path
    from kvcompile.io.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    ids = (tok.encode(TEXT * (1 + args.prompt_tokens // 20)))[: args.prompt_tokens]
    rows = [bench_llama_cpp(path, ids, args.decode_tokens, args.threads),
            bench_kvcompile(ids, args.decode_tokens, args.threads)]
    meta = run_meta()
    for r in rows:
        r.update(prompt_tokens=len(ids), decode_tokens=args.decode_tokens, threads=args.threads,
                 machine=platform.processor() or platform.machine(), commit=meta["commit"],
                 date=meta["date"])
    base = rows[0]
    print(f"{'system':36} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs llama.cpp':>20}")
    for r in rows:
        r["decode_vs_llama_cpp"] = r["decode_tok_s"] / base["decode_tok_s"]
        print(f"{r['system']:36} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f} "
              f"{r['decode_vs_llama_cpp']:19.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
