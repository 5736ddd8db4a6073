"""Where a decode step spends its time (device): torch.profiler over a few decode steps of a
random-weight model, eager all resident, eager streaming, and compiled + captured (the
PhaseManager, all resident); prints the top CPU-side ops, the top GPU kernels and the step
time against the GPU kernel time it launched.

usage (device): python3 tools/profile/profile_decode.py [--ctx 8192] [--layers 32] [--arena 256]
    [--modes resident,streaming,compiled]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_streaming import (LLAMA3_8B, TINY, build_models, close_cache,  # noqa: E402
                             device_and_dtype, greedy_steps, manager_prefill,
                             ours_decode, ours_prefill, random_ids)
from bench_util import free_memory, sync  # noqa: E402

from kvcompile.kv.make import make_kv_cache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--arena", type=float, default=256, help="MiB for the streaming run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry (a CPU smoke run)")
    ap.add_argument("--modes", default="resident,streaming,compiled")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "profile_decode.json"))
    a = ap.parse_args()
    dev, dtype = device_and_dtype(a.device, "use --device cpu --tiny for a CPU smoke run")
    g = TINY if a.tiny else dataclasses.replace(LLAMA3_8B, n_layers=a.layers)
    model, *_ = build_models(g, a.ctx + 64, dtype, dev, 0, want_hf=False)
    ids = random_ids(a.ctx, g.vocab, 0, dev)
    res = {}
    kv = ("q8_0", "q4_0") if dev.type == "cuda" else ("f32", "f32")
    for name in a.modes.split(","):
        with torch.inference_mode():
            step, cleanup = start_mode(name, model, a, ids, kv, dev)
            step(2)                                                  # warm (and capture)
            sync(dev)
            t = time.perf_counter()
            step(a.steps)
            sync(dev)
            step_ms = (time.perf_counter() - t) / a.steps * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(3)
                sync(dev)
        ev = prof.key_averages()
        # kernels only: an op's self device time repeats its kernels' time
        kernels = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
        cuda_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / 3
        n_kernels = sum(e.count for e in kernels) / 3
        cpu_top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:25]
        gpu_top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
        print(f"== {name}: step {step_ms:.2f} ms, GPU kernel time {cuda_ms:.2f} ms a step, "
              f"{n_kernels:.0f} kernels a step")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        print(f"-- {name}: GPU kernels, ms a step")
        for e in gpu_top:
            ms = e.self_device_time_total / 1e3 / 3
            print(f"{ms:8.3f} ms {e.count / 3:6.1f} x  {e.key[:90]}")
        res[name] = dict(step_ms=step_ms, gpu_ms=cuda_ms, kernels=n_kernels, top_cpu=[
            dict(name=e.key, self_cpu_ms=e.self_cpu_time_total / 1e3 / 3, calls=e.count / 3)
            for e in cpu_top], top_gpu=[
            dict(name=e.key, gpu_ms=e.self_device_time_total / 1e3 / 3, calls=e.count / 3)
            for e in gpu_top])
        cleanup()
        free_memory(dev)
    json.dump(res, open(a.out, "w"), indent=1)


def start_mode(name, model, a, ids, kv, dev):
    """Prefill `ids` in mode `name`; returns (step(n): n more greedy decode steps, cleanup)."""
    pos = [a.ctx]
    if name == "compiled":
        from kvcompile.kv.store import KvStore
        from kvcompile.phase import PhaseManager
        ub = min(4096, a.ctx)
        m = PhaseManager(model, KvStore(model.config, a.ctx + 64, *kv, device=dev),
                         ubatch=ub)
        tok = [manager_prefill(m, ids.tolist(), ub)]
        held = [m]

        def step(n):
            tok[0] = greedy_steps(held[0].forward, tok[0], pos[0], n)[-1]
            pos[0] += n

        def cleanup():
            held.clear()                     # the manager and its arena
            torch._dynamo.reset()
        return step, cleanup
    if name not in ("resident", "streaming"):
        raise SystemExit(f"unknown mode {name!r}: use resident, streaming, compiled")
    cache = make_kv_cache(model.config, a.ctx + 64, a.arena if name == "streaming" else 0,
                          k_type=kv[0], v_type=kv[1], device=dev)
    first = int(ours_prefill(model, cache, ids, 4096, dev, "prefill").argmax())
    tok = [first]

    def step(n):
        tok[0] = ours_decode(model, cache, tok[0], pos[0], n, dev)[-1]
        pos[0] += n
    return step, lambda: close_cache(cache)


if __name__ == "__main__":
    main()
