"""SmolLM2-135M on the CPU: kvcompile prefill/decode tok/s next to llama.cpp, same process.

    ./dev python benchmarks/bench_cpu_smollm2.py [--prompt-tokens 256] [--decode-tokens 64]

Prints a table and writes benchmarks/results/cpu_smollm2.json. For the record only: the
CPU path is the fp32 reference backend (dequantized weights), llama.cpp runs quantized
kernels, so no target is set here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "results", "cpu_smollm2.json")
TEXT = ("The lighthouse keeper counted the ships that passed each night, writing their names "
        "in a ledger that had belonged to her grandmother. ")


def bench_kvcompile(prompt_ids: list[int], n_decode: int, threads: int) -> dict:
    from kvcompile.engine.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine(None, ctx_size=len(prompt_ids) + n_decode + 8, progress=False)
    with torch.inference_mode():
        engine.store.reset()
        engine.forward(prompt_ids[:8], 0)                       # warm-up
        engine.store.reset()
        t = time.perf_counter()
        logits = engine._prefill(prompt_ids)
        prefill = time.perf_counter() - t
        tok, pos = int(logits.argmax()), len(prompt_ids)
        t = time.perf_counter()
        for i in range(n_decode):
            tok = int(engine.forward([tok], pos + i).argmax())
        decode = time.perf_counter() - t
    return dict(system="kvcompile (cpu, fp32 reference)", prefill_tok_s=len(prompt_ids) / prefill,
                decode_tok_s=n_decode / decode)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    from kvcompile.io.default_model import default_model_path
    from kvcompile.io.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    ids = (tok.encode(TEXT * (1 + args.prompt_tokens // 20)))[: args.prompt_tokens]
    rows = [bench_llama_cpp(path, ids, args.decode_tokens, args.threads),
            bench_kvcompile(ids, args.decode_tokens, args.threads)]
    for r in rows:
        r.update(prompt_tokens=len(ids), decode_tokens=args.decode_tokens, threads=args.threads,
                 machine=platform.processor() or platform.machine())
    base = rows[0]
    print(f"{'system':36} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs llama.cpp':>20}")
    for r in rows:
        r["decode_vs_llama_cpp"] = r["decode_tok_s"] / base["decode_tok_s"]
        print(f"{r['system']:36} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f} "
              f"{r['decode_vs_llama_cpp']:19.2f}x")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
