"""CPU decode on a busy machine: the default threads (the physical cores other processes
leave free) against a fixed count of every core, idle and beside a parallel CPU load.

    ./dev python benchmarks/bench_cpu_threads.py [--load 1] [--decode-tokens 64] [--out PATH]

The load is `--load` processes spinning in a loop (a build or a second job beside the
user's). Each system decodes through `Engine.generate` after a warm-up request; the load
starts before the Engine is built and runs through the measured request. Writes
benchmarks/results/cpu_threads.json (rows with the commit and date); target: the default
under load within 2x of its idle decode tok/s.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
from bench_util import commit_date  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "cpu_threads.json")
PROMPT = "The lighthouse keeper counted the ships that passed each night, and"


def spin() -> None:
    while True:
        pass


def decode(threads: int | None, n_decode: int) -> tuple[float, int]:
    """Decode tok/s of one greedy request and the thread count it ended with."""
    import torch

    from kvcompile.engine.engine import Engine
    engine = Engine(None, ctx_size=256, cache_prompt=False, progress=False, threads=threads)
    engine.generate(PROMPT, max_tokens=4, temperature=0)                # warm-up
    time.sleep(1.2)                     # a full window of the load for the thread choice
    r = engine.generate(PROMPT, max_tokens=n_decode + 1, temperature=0)
    return r.decode_tok_s, torch.get_num_threads()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=1, help="spinning processes beside it")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)

    from kvcompile.engine.threads import physical_cores
    cores = physical_cores()
    rows = []
    for load in (0, args.load):
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(load)]
        for p in spinners:
            p.start()
        try:
            for name, threads in (("default", None), (f"fixed {cores}", cores)):
                tok_s, used = decode(threads, args.decode_tokens)
                rows.append(dict(threads=name, load=load, threads_used=used,
                                 decode_tok_s=tok_s))
        finally:
            for p in spinners:
                p.terminate()
    idle = {r["threads"]: r["decode_tok_s"] for r in rows if r["load"] == 0}
    meta = commit_date()
    print(f"{'threads':10} {'load':>5} {'used':>5} {'decode tok/s':>13} {'x idle':>7}")
    for r in rows:
        r.update(vs_idle=r["decode_tok_s"] / idle[r["threads"]], cores=cores,
                 cpus=os.cpu_count(), machine=platform.processor() or platform.machine(),
                 decode_tokens=args.decode_tokens, **meta)
        print(f"{r['threads']:10} {r['load']:5} {r['threads_used']:5} "
              f"{r['decode_tok_s']:13.1f} {r['vs_idle']:7.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
