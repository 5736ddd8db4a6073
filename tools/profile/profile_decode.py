"""Where a decode step spends its time (device): torch.profiler over a few decode steps of a
random-weight model, each mode one `Engine.from_model` (eager all resident, eager streaming,
captured programs all resident or streamed); prints the top CPU-side ops, the top GPU kernels
and the step time against the GPU kernel time it launched.

Each mode: a warm-up request, then one request of a prompt of --ctx tokens whose decode steps
are the Engine's own (pipelined on CUDA); 2 steps warm (and capture), --steps timed (their
times from the GenerationResult), then 3 under torch.profiler (the Executor's `step` wrapped
to start and stop it, the device synchronized at both ends).

usage (device): python3 tools/profile/profile_decode.py [--ctx 8192] [--layers 32] [--arena 256]
    [--modes resident,streaming,compiled,streaming-compiled]
usage (CPU smoke run): python3 tools/profile/profile_decode.py --device cpu --tiny
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_streaming import (LLAMA3_8B, TINY, build_models, close_engine,  # noqa: E402
                             device_and_dtype, ours_engine, random_ids)
from bench_util import free_memory, sync  # noqa: E402

# mode -> (streamed, the executor's programs)
MODES = {"resident": (False, False), "streaming": (True, False), "compiled": (False, True),
         "streaming-compiled": (True, True)}
WARM, PROFILED = 2, 3


class StepWindow:
    """Wraps an Engine's `executor.step`: calls `enter()` before the decode step number
    `first` (1: the step at position `prompt_len`, the first after the prompt) and `leave()`
    after the step `count` steps later, so a profiler sees those steps as the Engine's own
    loop runs them."""

    def __init__(self, engine, prompt_len: int, first: int, count: int, enter, leave):
        self.ex, self.step = engine.executor, engine.executor.step
        self.prompt_len = prompt_len
        self.first, self.count, self.enter, self.leave = first, count, enter, leave
        self.n = 0
        self.ex.step = self

    def __call__(self, ids, start, all_rows=False):
        if start < self.prompt_len:                  # a prefill chunk
            return self.step(ids, start, all_rows)
        self.n += 1
        if self.n == self.first:
            self.enter()
        out = self.step(ids, start, all_rows)
        if self.n == self.first + self.count - 1:
            self.leave()
        return out

    def close(self) -> None:
        self.ex.step = self.step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--arena", type=float, default=256, help="MiB for the streaming modes")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ubatch", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry (a CPU smoke run)")
    ap.add_argument("--modes", default="resident,streaming,compiled")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "profile_decode.json"))
    a = ap.parse_args()
    if a.tiny:
        a.ctx, a.arena, a.ubatch = min(a.ctx, 1024), min(a.arena, 2), min(a.ubatch, 128)
    dev, dtype = device_and_dtype(a.device, "use --device cpu --tiny for a CPU smoke run")
    g = TINY if a.tiny else dataclasses.replace(LLAMA3_8B, n_layers=a.layers)
    n_steps = WARM + a.steps + PROFILED
    model, *_ = build_models(g, a.ctx + n_steps + 64, dtype, dev, 0, want_hf=False)
    ids = random_ids(a.ctx, g.vocab, 0, "cpu").tolist()
    kv = "q8_0/q4_0" if dev.type == "cuda" else "f32/f32"
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    res = {}
    for name in a.modes.split(","):
        if name not in MODES:
            raise SystemExit(f"unknown mode {name!r}: use {', '.join(MODES)}")
        streamed, graphs = MODES[name]
        e = ours_engine(model, a.ctx + n_steps + 1, kv, a.arena if streamed else 0, graphs,
                        a.ubatch)
        prof = torch.profiler.profile(activities=activities)

        def enter(prof=prof):
            sync(dev)
            prof.start()

        def leave(prof=prof):
            sync(dev)
            prof.stop()
        try:
            e.generate(ids[:min(a.ubatch, a.ctx // 2)], max_tokens=4, temperature=0)   # warm-up
            window = StepWindow(e, len(ids), WARM + a.steps + 1, PROFILED, enter, leave)
            r = e.generate(ids, max_tokens=n_steps + 1, temperature=0)
            window.close()
        finally:
            close_engine(e)
        step_ms = sum(r.step_s[WARM:WARM + a.steps]) / a.steps * 1e3
        ev = prof.key_averages()
        # kernels only: an op's self device time repeats its kernels' time
        kernels = [x for x in ev if x.device_type == torch.autograd.DeviceType.CUDA]
        cuda_ms = sum(x.self_device_time_total for x in kernels) / 1e3 / PROFILED
        n_kernels = sum(x.count for x in kernels) / PROFILED
        cpu_top = sorted(ev, key=lambda x: -x.self_cpu_time_total)[:25]
        gpu_top = sorted(kernels, key=lambda x: -x.self_device_time_total)[:25]
        print(f"== {name} ({e.executor.mode}): step {step_ms:.2f} ms, GPU kernel time "
              f"{cuda_ms:.2f} ms a step, {n_kernels:.0f} kernels a step")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        print(f"-- {name}: GPU kernels, ms a step")
        for x in gpu_top:
            ms = x.self_device_time_total / 1e3 / PROFILED
            print(f"{ms:8.3f} ms {x.count / PROFILED:6.1f} x  {x.key[:90]}")
        res[name] = dict(mode=e.executor.mode, step_ms=step_ms, gpu_ms=cuda_ms,
                         kernels=n_kernels, programs=r.programs, top_cpu=[
            dict(name=x.key, self_cpu_ms=x.self_cpu_time_total / 1e3 / PROFILED,
                 calls=x.count / PROFILED) for x in cpu_top], top_gpu=[
            dict(name=x.key, gpu_ms=x.self_device_time_total / 1e3 / PROFILED,
                 calls=x.count / PROFILED) for x in gpu_top])
        del e
        free_memory(dev)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
