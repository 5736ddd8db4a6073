"""Where a replayed streamed decode step spends its time (device): the 8B geometry (random
bf16 weights, bench_streaming's builder) through `Engine.from_model`, streamed through an
arena; a few decode steps of a long request, run by the Engine's own loop, under
torch.profiler (the copy engine's and the SMs' busy time, the copy engine's idle gaps) and
under cProfile (the host's work inside `Executor.step`, which is wrapped to switch both on
and off around those steps).

usage (device): python3 tools/profile/timeline_streamed.py [--ctx 65536] [--arena-mib 2048]
    [--steps 6] [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import bench_streaming as S  # noqa: E402


def publish_mode(e) -> str | None:
    """How captured streamed steps publish their rows to the host: "rows" (a kernel),
    "pages" (copies; the kernel could not run) or None (no streamed store)."""
    streamer = e.store.streamer
    return None if streamer is None else (
        "rows" if streamer.pool.row_maps is not None else "pages")


def union(spans):
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def gaps(spans, lo, hi, min_us=30.0):
    out, end = [], lo
    for a, b in sorted(spans):
        if a - end > min_us:
            out.append((end, a))
        end = max(end, b)
    if hi - end > min_us:
        out.append((end, hi))
    return out


def analyse(trace_path: str) -> dict:
    with open(trace_path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    dev = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev
                   if e.get("cat") == "user_annotation" and e["name"] == "decode_step")
    h2d = [e for e in dev if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
    d2h = [e for e in dev if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]]
    ker = [e for e in dev if e["cat"] == "kernel"]
    span = lambda es: [(e["ts"], e["ts"] + e["dur"]) for e in es]  # noqa: E731
    lo, hi = min(e["ts"] for e in dev), max(e["ts"] + e["dur"] for e in dev)
    h2d_bytes = sum(e.get("args", {}).get("bytes", 0) for e in h2d)
    busy = union(span(h2d))
    idle = gaps(span(h2d), lo, hi)
    per_copy = sorted((e.get("args", {}).get("bytes", 0) / max(e["dur"], 1e-3) / 1e3)
                      for e in h2d if e.get("args", {}).get("bytes", 0) > 1 << 20)
    big_gaps = sorted(idle, key=lambda g: g[0] - g[1])[:12]
    what = []
    for a, b in big_gaps:      # what the SMs ran while the copy engine idled
        ks = [e for e in ker if e["ts"] < b and e["ts"] + e["dur"] > a]
        inside = [(max(x, a), min(y, b)) for x, y in span(ks)]
        what.append(dict(at_us=round(a - lo), idle_us=round(b - a),
                         kernels=len(ks), kernel_us=round(union(inside), 1),
                         first=[k["name"][:40] for k in ks[:3]]))
    return dict(window_us=hi - lo, steps=len(steps),
                host_step_us=[round(b - a) for a, b in steps],
                h2d_copies=len(h2d), h2d_bytes=h2d_bytes, h2d_busy_us=busy,
                h2d_gbps_busy=h2d_bytes / max(busy, 1e-9) / 1e3,
                h2d_idle_us=sum(b - a for a, b in idle), h2d_idle_gaps=len(idle),
                per_copy_gbps_median=per_copy[len(per_copy) // 2] if per_copy else None,
                d2h_copies=len(d2h), d2h_busy_us=union(span(d2h)),
                d2h_overlapping_h2d_us=union(span(d2h)) + busy - union(span(d2h) + span(h2d)),
                kernel_busy_us=union(span(ker)), kernels=len(ker),
                both_busy_us=busy + union(span(ker)) - union(span(h2d) + span(ker)),
                largest_idle=what)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--arena-mib", type=float, default=2048)
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=8, help="decode steps before the profiled ones")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import kvcompile
    device, dtype = S.device_and_dtype("cuda", "needs CUDA")
    g = S.LLAMA3_8B
    model = S.build_models(g, args.ctx, dtype, device, 0, want_hf=False)[0]
    k, v = args.kv.split("/")
    e = kvcompile.Engine.from_model(model, ctx_size=args.ctx, cache_type_k=k, cache_type_v=v,
                                    kv_stream_arena_mib=args.arena_mib, progress=False)
    ids = S.random_ids(args.ctx - 64, g.vocab, 0, "cpu").tolist()
    e.generate(ids[:512], max_tokens=4, temperature=0)
    executor, step = e.executor, e.executor.step
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    host = cProfile.Profile()
    seen = {"n": 0}

    def traced_step(ids_, start, all_rows=False):
        if len(ids_) != 1:
            return step(ids_, start, all_rows)
        seen["n"] += 1
        n = seen["n"] - args.skip
        if n == 1:
            torch.cuda.synchronize()
            prof.start()
        if 1 <= n <= args.steps:
            host.enable()
            with torch.profiler.record_function("decode_step"):
                out = step(ids_, start, all_rows)
            host.disable()
            return out
        if n == args.steps + 1:
            torch.cuda.synchronize()
            prof.stop()
        return step(ids_, start, all_rows)

    executor.step = traced_step
    r = e.generate(ids, max_tokens=args.skip + args.steps + 4, temperature=0)
    os.makedirs(args.out, exist_ok=True)
    trace = os.path.join(args.out, "trace.json")
    prof.export_chrome_trace(trace)
    summary = analyse(trace)
    summary.update(ctx=args.ctx, arena_mib=args.arena_mib, kv=r.kv, programs=r.programs,
                   publish=publish_mode(e), fill_ahead=e.store.streamer.fill_ahead,
                   decode_depth=e.store.streamer.policy_config.decode_depth,
                   host_step_ms=r.stats()["host_step_ms"], step_ms=r.stats()["step_ms"])
    s = io.StringIO()
    pstats.Stats(host, stream=s).sort_stats("cumulative").print_stats(40)
    with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
        f.write(s.getvalue())
    s2 = io.StringIO()
    pstats.Stats(host, stream=s2).sort_stats("tottime").print_stats(25)
    with open(os.path.join(args.out, "timeline.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("kv", "programs")},
                     indent=1, default=str))
    print(s2.getvalue()[:6000])


if __name__ == "__main__":
    main()
