"""Where an eager decode step spends its time (device): torch.profiler over a few decode
steps of a random-weight model, all resident and streaming; prints the top CPU-side ops
and the step time against the GPU kernel time it launched.

usage (device): python3 benchmarks/profile_decode.py [--ctx 8192] [--layers 32] [--arena 256]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
from bench_streaming import (LLAMA3_8B, TINY, build_models, close_cache,  # noqa: E402
                             device_and_dtype, ours_decode, ours_prefill, random_ids)
from bench_util import free_memory, sync  # noqa: E402

from kvcompile.runtime.make import make_kv_cache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--arena", type=float, default=256, help="MiB for the streaming run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry (a CPU smoke run)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "profile_decode.json"))
    a = ap.parse_args()
    dev, dtype = device_and_dtype(a.device, "use --device cpu --tiny for a CPU smoke run")
    g = TINY if a.tiny else dataclasses.replace(LLAMA3_8B, n_layers=a.layers)
    model, *_ = build_models(g, a.ctx + 64, dtype, dev, 0, want_hf=False)
    ids = random_ids(a.ctx, g.vocab, 0, dev)
    res = {}
    for name, arena in (("resident", 0), ("streaming", a.arena)):
        kv = ("q8_0", "q4_0") if dev.type == "cuda" else ("f32", "f32")
        cache = make_kv_cache(model.config, a.ctx + 64, arena, k_type=kv[0], v_type=kv[1],
                              device=dev)
        with torch.inference_mode():
            first = int(ours_prefill(model, cache, ids, 4096, dev, "prefill").argmax())
            ours_decode(model, cache, first, a.ctx, 2, dev)          # warm
            sync(dev)
            t = time.perf_counter()
            ours_decode(model, cache, first, a.ctx + 2, a.steps, dev)
            sync(dev)
            step_ms = (time.perf_counter() - t) / a.steps * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                ours_decode(model, cache, first, a.ctx + 2 + a.steps, 3, dev)
                sync(dev)
        ev = prof.key_averages()
        # kernels only: an op's self device time repeats its kernels' time
        cuda_ms = sum(e.self_device_time_total for e in ev
                      if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 / 3
        cpu_top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:25]
        print(f"== {name}: step {step_ms:.1f} ms, GPU kernel time {cuda_ms:.1f} ms a step")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        res[name] = dict(step_ms=step_ms, gpu_ms=cuda_ms, top_cpu=[
            dict(name=e.key, self_cpu_ms=e.self_cpu_time_total / 1e3 / 3, calls=e.count / 3)
            for e in cpu_top])
        close_cache(cache)
        del cache
        free_memory(dev)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
