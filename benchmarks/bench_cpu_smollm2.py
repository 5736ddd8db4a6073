"""SmolLM2-135M on the CPU: kvcompile prefill/decode tok/s next to llama.cpp, same process.

    ./dev python benchmarks/bench_cpu_smollm2.py [--prompt-tokens 256] [--decode-tokens 64]
        [--threads N [N ...]] [--fidelity-tokens 1024] [--no-fidelity] [--no-quickstart]
        [--out PATH]

Rows: llama.cpp through llama_cpp.Llama.eval; kvcompile's CPU fast path (the default:
GGUF weights, C++ kernels) and its fp32 reference path (dtype f32), each through
`Engine.generate` (a warm-up request, then the measured one: prefill to the first token,
decode steps to the sampler's read); `vs_llama_cpp` is the ratio to llama.cpp's row of the
same run and thread count (`--threads 1 2`: each count in turn). Then the fast path against the reference, teacher-forced over --fidelity-tokens
of text (engine/evaluate.py): top-1 agreement and mean KL, once in prefill chunks (ubatch)
and once a token at a time (the decode kernels); and the quick start timed as a user runs
it: `python -m kvcompile generate --chat ... -n 64` in a fresh process (load + 64 tokens).
Prints a table and writes benchmarks/results/cpu_smollm2.json (rows with the commit and
date, overwritten).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from bench_util import run_meta  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "cpu_smollm2.json")
TEXT = ("The lighthouse keeper counted the ships that passed each night, writing their names "
        "in a ledger that had belonged to her grandmother. ")
QUICKSTART = "Explain in two sentences why the sky is blue."
SYSTEMS = {"kvcompile (cpu fast path)": None, "kvcompile (cpu, fp32 reference)": "f32"}


def bench_kvcompile(prompt_ids: list[int], n_decode: int, threads: int, dtype) -> dict:
    """Through the Engine (no prefix reuse): a warm-up request, then the measured one, greedy;
    prefill to the first token and decode steps as the GenerationResult times them."""
    from kvcompile.engine.engine import Engine

    engine = Engine(None, ctx_size=len(prompt_ids) + n_decode + 8, cache_prompt=False,
                    progress=False, threads=threads, dtype=dtype)
    engine.generate(prompt_ids[:8], max_tokens=2, temperature=0)          # warm-up
    r = engine.generate(prompt_ids, max_tokens=n_decode + 1, temperature=0)
    return dict(prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s,
                decode_steps=len(r.step_s), finish_reason=r.finish_reason,
                fast_path=engine.cpu_fast)


def bench_llama_cpp(path: str, prompt_ids: list[int], n_decode: int, threads: int) -> dict:
    from llama_oracle import plain_cpu_buffers
    plain_cpu_buffers()          # without it llama.cpp segfaults on VMs without AMX tiles
    from llama_cpp import Llama

    import numpy as np
    llm = Llama(path, n_ctx=len(prompt_ids) + n_decode + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)

    def greedy() -> int:          # the last row's logits (the only row llama.cpp outputs)
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())
    llm.eval(prompt_ids[:8])
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt_ids)
    tok = greedy()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = greedy()
    decode = time.perf_counter() - t
    return dict(prefill_tok_s=len(prompt_ids) / prefill, decode_tok_s=n_decode / decode)


def fidelity(ids: list[int]) -> list[dict]:
    """The fast path against the fp32 reference, teacher-forced over ids: in ubatch chunks
    (prefill) and one token a step (decode). Untimed: default threads (they follow the
    machine's load)."""
    from kvcompile.engine.engine import Engine
    from kvcompile.engine.evaluate import evaluate, summary

    common = dict(ctx_size=len(ids) + 8, cache_prompt=False, progress=False)
    fast, ref = Engine(None, **common), Engine(None, dtype="f32", **common)
    rows = []
    for mode, chunk in (("prefill chunks", fast.ubatch), ("decode steps", 1)):
        s = summary(evaluate(fast, ids, chunk, reference=ref))
        rows.append(dict(system=f"fast path vs fp32 reference, {mode}", tokens=len(ids),
                         chunk=chunk, top1=s["top1"], mean_kl=s["kl"], ppl=s["ppl"]))
    return rows


def quickstart() -> dict:
    """The README's first command in a fresh process (its default threads): seconds to the
    answer of 64 tokens."""
    cmd = [sys.executable, "-m", "kvcompile", "generate", "--chat", QUICKSTART, "-n", "64",
           "--temperature", "0", "--no-progress"]
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return dict(system="quick start (fresh process: load + 64 tokens)",
                seconds=time.perf_counter() - t, answer=out.stdout.strip()[:300])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 2],
                    help="thread counts, each measured for every system (default: all CPUs)")
    ap.add_argument("--fidelity-tokens", type=int, default=1024)
    ap.add_argument("--no-fidelity", action="store_true")
    ap.add_argument("--no-quickstart", action="store_true")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)

    from kvcompile.io.default_model import default_model_path
    from kvcompile.io.tokenizer import load_tokenizer

    load = os.getloadavg()[0]          # other processes' share of the cores, at the start
    path = default_model_path()
    tok = load_tokenizer(path)
    ids = (tok.encode(TEXT * (1 + args.prompt_tokens // 20)))[: args.prompt_tokens]
    rows = []
    print(f"{'system':34} {'threads':>7} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'prefill vs':>11} {'decode vs llama.cpp':>20}")
    for threads in args.threads:
        group = [dict(system="llama.cpp (cpu, Q4_1)",
                      **bench_llama_cpp(path, ids, args.decode_tokens, threads))]
        group += [dict(system=name, **bench_kvcompile(ids, args.decode_tokens, threads, dtype))
                  for name, dtype in SYSTEMS.items()]
        base = group[0]
        for r in group:
            r.update(prompt_tokens=len(ids), decode_tokens=args.decode_tokens, threads=threads,
                     decode_vs_llama_cpp=r["decode_tok_s"] / base["decode_tok_s"],
                     prefill_vs_llama_cpp=r["prefill_tok_s"] / base["prefill_tok_s"])
            print(f"{r['system']:34} {threads:7d} {r['prefill_tok_s']:14.1f} "
                  f"{r['decode_tok_s']:13.1f} {r['prefill_vs_llama_cpp']:10.2f}x "
                  f"{r['decode_vs_llama_cpp']:19.2f}x")
        rows += group
    if not args.no_fidelity:
        text = tok.encode(open(__file__, encoding="utf-8").read() * 8)[: args.fidelity_tokens]
        for r in fidelity(text):
            print(f"{r['system']}: top-1 {r['top1']:.4f}, mean KL {r['mean_kl']:.2e} over "
                  f"{r['tokens']} tokens")
            rows.append(r)
    if not args.no_quickstart:
        r = quickstart()
        print(f"{r['system']}: {r['seconds']:.1f} s")
        rows.append(r)
    meta = run_meta()
    for r in rows:
        r.update(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                 load_1m=load, commit=meta["commit"], date=meta["date"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
