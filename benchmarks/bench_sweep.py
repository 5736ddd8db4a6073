"""Arena sweep (issue 28): decode and prefill tok/s against context, per arena and peer.

KV arenas of several sizes, `auto` and Hugging Face peers in one run, as JSON rows and a PNG.

    python benchmarks/bench_sweep.py [--contexts 8192,32768,65536,131072,262144]
        [--arenas 1024,2048,4096,auto | none] [--kv q8_0/q4_0] [--decode-steps 32]
        [--peer-max-ctx 65536] [--no-peers] [--hf-offload-prefill] [--limit-s 540]
        [--long-arenas 2048 [--long-from 262144]]
        [--out benchmarks/results/sweep.json] [--plot docs/arena_sweep.png]
    python benchmarks/bench_sweep.py --plot-only benchmarks/results/sweep.json --plot PNG
    python benchmarks/bench_sweep.py --tiny --device cpu --no-peers    # the same code, seconds

Llama-3-8B geometry, random bf16 weights made on the device once (shared with the peers).
kvcompile: one `Engine.from_model` per arena (ctx_size: the largest context, `engine_ctx`; no
prefix reuse; a warm-up request pays for programs and kernels once), then per context
bench_runner's request (random ids filling the context but for the decode steps, greedy) and the
GenerationResult's prefill tok/s (to the first token), decode tok/s (steps timed to the
sampler's read) and step p50. `auto`: the Engine's rule for a model file (plan_budget: all KV
resident if it fits the free device memory, else the rest as arena), planned here;
`arena_mib_used` has the answer (0: resident). Peers (hf_baseline.py, contexts <=
--peer-max-ctx): hf-resident (DynamicCache), hf-offloaded (CUDA only; decodes from
hf-resident's prefill unless --hf-offload-prefill); bf16 KV, hence kv_type in every row.
Bounds: streamed, pcie_gbps / (KV - arena bytes); resident, hbm_gbps / (weight + KV bytes);
hf-offloaded, pcie_gbps / KV bytes. `tokens`: kvcompile's from the first generated, the
peers' from the third. Rows go to --out as each case ends. --limit-s: a case starts only if
its estimate (that context's time before, else the nearest smaller one's x the squared
ratio) ends in time; skipped cases are printed. A full sweep takes several calls into one
--out (e.g. --contexts 8192,32768,65536,131072; then --contexts 262144 --arenas 1024,2048
--no-peers; then 4096,auto); --plot draws --out's newest commit (its newest row per system,
arena, context, KV): the last call draws them all.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_runner import WARM_PROMPT, WARM_STEPS, launches_per_step, save  # noqa: E402
from bench_util import free_memory, hbm_bandwidth, log, param_bytes, run_meta  # noqa: E402
from hf_baseline import run_hf  # noqa: E402
from sweep_plot import latest_rows, load, plot_rows  # noqa: E402,F401

PEERS = {"hf-dynamic": "hf-resident", "hf-offload": "hf-offloaded"}
SHORT = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32"}


def auto_arena_mib(model, ctx: int, k: str, v: str, ubatch: int, device) -> float:
    """The Engine's `auto` (from_model refuses it: it plans from a file's header)."""
    import torch
    from kvcompile.engine import memory_budget as M
    from kvcompile.kv.kv_pages import min_arena_bytes
    if device.type != "cuda":
        return 0.0                                  # the Engine's rule: no budget on the CPU
    c = model.config
    return M.plan_budget(budget=M.device_budget(device, None),       # free + torch's reserve
                         weights=torch.cuda.memory_allocated(device),  # every live tensor
                         workspace=M.workspace_bytes(c, min(ubatch, ctx), device),
                         kv_all=M.kv_bytes(c, M.kv_layer_count(c, mtp=False), ctx, k, v),
                         min_arena=min_arena_bytes(c, ctx, k, v), arena="auto").arena_mib


class Guard:
    """Starts a case only if its estimated seconds end within the limit."""
    def __init__(self, limit_s: float):
        self.t0, self.limit, self.cost, self.skipped = time.perf_counter(), limit_s, {}, []

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.t0)

    def admit(self, name: str, kind: str, ctx: int, extra: float = 0.0) -> bool:
        seen = {c: s for (k, c), s in self.cost.items() if k == kind}
        below = max((c for c in seen if c <= ctx), default=None)
        est = extra + (seen[below] * (ctx / below) ** 2 if below else min(seen.values(), default=0))
        if est > self.left():
            self.skipped.append(f"{name} (estimate {est:.0f} s, {self.left():.0f} s left)")
            log(f"skip {self.skipped[-1]}")
        return est <= self.left()

    def record(self, kind: str, ctx: int, seconds: float) -> None:
        self.cost[(kind, ctx)] = max(seconds, self.cost.get((kind, ctx), 0.0))


def bound(meta: dict, kv_bytes: int, arena_bytes: int, resident: bool) -> tuple:
    """(kind, tok/s): PCIe for what must stream, the HBM roofline when all is resident."""
    if resident:
        hbm = meta.get("hbm_gbps_measured")
        return ("hbm", hbm * 1e9 / (meta["weight_bytes"] + kv_bytes)) if hbm else (None, None)
    b = S.pcie_bound(meta["pcie_gbps_measured"], kv_bytes, arena_bytes)
    return ("pcie", b) if b else (None, None)


def row_of(system, arena, used, ctx, kv_type, prefill, decode, p50, bnd, args, meta, **more):
    return dict(kind="sweep", system=system, arena_mib=arena, arena_mib_used=used, ctx=ctx,
                kv_type=kv_type, prefill_tok_s=prefill, decode_tok_s=decode, step_p50_ms=p50,
                bound_kind=bnd[0], bound_tok_s=bnd[1],
                decode_vs_bound=decode / bnd[1] if bnd[1] else None,
                decode_steps=args.decode_steps, ubatch=args.ubatch, **more, **meta)


def prompt(g, ctx: int, args, device="cpu"):
    """bench_runner's prompt: random ids filling the context but for the decode steps."""
    ids = S.random_ids(ctx - args.decode_steps - 2, g.vocab, args.seed, device)
    return ids.tolist() if device == "cpu" else ids


def cases(guard: Guard, kind: str, name: str, contexts, measure, out) -> list[dict]:
    """measure(ctx) -> the case's rows, for each context the guard admits: logged and
    appended to `out` at once."""
    rows = []
    for ctx in contexts:
        if not guard.admit(f"{name} ctx {ctx}", kind, ctx):
            continue
        t = time.perf_counter()
        new = measure(ctx)
        guard.record(kind, ctx, time.perf_counter() - t)
        for r in new:
            r["case_s"] = time.perf_counter() - t
            log(f"{r['system']} arena {r['arena_mib']} ctx {ctx}: prefill "
                f"{S.fmt(r['prefill_tok_s'], '.0f')} tok/s, decode {r['decode_tok_s']:.2f} "
                f"tok/s ({S.fmt(r['decode_vs_bound'], '.3f')} x {r['bound_kind'] or 'no'} "
                f"bound), step p50 {S.fmt(r['step_p50_ms'], '.2f')} ms, {r['case_s']:.1f} s, "
                f"{guard.left():.0f} s left")
        save(new, out)
        rows += new
    return rows


def sweep_arena(model, g, arena, args, device, meta, guard) -> list[dict]:
    import kvcompile
    k, v = args.kv.split("/")
    contexts = [c for c in args.contexts if c < args.long_from or args.long_arenas is None
                or str(arena) in args.long_arenas]
    top = max(contexts)
    used = auto_arena_mib(model, top, k, v, args.ubatch, device) if arena == "auto" else arena
    name = f"kvcompile arena {arena if arena == 'auto' else format(arena, 'g')}"
    if not guard.admit(f"{name} (every context)", "kvcompile", contexts[0],
                       guard.cost.get(("setup", 0), 0.0)):
        return []
    t = time.perf_counter()
    # no prefix reuse: the contexts' prompts share their first tokens, and each row times
    # a whole prefill
    e = kvcompile.Engine.from_model(model, ctx_size=top, cache_type_k=k, cache_type_v=v,
                                    ubatch=args.ubatch, kv_stream_arena_mib=used,
                                    cache_prompt=False, progress=False)
    e.generate(prompt(g, contexts[0], args)[:WARM_PROMPT], max_tokens=WARM_STEPS,
               temperature=0)
    guard.record("setup", 0, time.perf_counter() - t)
    log(f"{name}: {e.executor.mode}, {used:g} MiB (0: all resident), set up in "
        f"{time.perf_counter() - t:.1f} s")

    def measure(ctx):
        r = e.generate(prompt(g, ctx, args), max_tokens=args.decode_steps + 1, temperature=0)
        b = bound(meta, ctx * S.kv_bytes_per_token(g, k, v), int(used * 2**20), not used)
        return [row_of("kvcompile", arena, used, ctx, args.kv, r.prefill_tok_s, r.decode_tok_s,
                       r.stats()["step_ms"]["p50"], b, args, meta, executor_mode=e.executor.mode,
                       captures=r.programs.get("captures"), kv=r.kv, engine_ctx=top,
                       launches_per_step=launches_per_step(r.programs),
                       prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                       tokens=r.token_ids[:8])]
    try:
        return cases(guard, "kvcompile", name, contexts, measure, args.out)
    finally:
        e.store.close()                       # the store's copy engine and arena


def sweep_peers(hf, hf_cfg, g, args, device, dtype, meta, guard) -> list[dict]:
    kv = SHORT.get(str(dtype), str(dtype))
    hf_args = SimpleNamespace(decode_steps=args.decode_steps, ubatch=args.ubatch,
                              hf_offload_prefill=args.hf_offload_prefill)
    systems = tuple(PEERS) if device.type == "cuda" else ("hf-dynamic",)
    if device.type != "cuda":
        log("no hf-offloaded: transformers' offloading cache needs CUDA")

    def measure(ctx):
        ids = prompt(g, ctx, args, device)
        kv_bytes = ctx * S.kv_bytes_per_token(g, kv, kv)
        res = run_hf(hf, hf_cfg, systems, ctx, hf_args, device, ids)
        return [row_of(PEERS[name], None, None, ctx, f"{kv}/{kv}",
                       ids.numel() / m["prefill_s"] if m.get("prefill_s") else None,
                       args.decode_steps / m["decode_s"], None,
                       ("pcie", S.pcie_bound(meta["pcie_gbps_measured"], kv_bytes, 0))
                       if name == "hf-offload" else bound(meta, kv_bytes, 0, True), args, meta,
                       step_mean_ms=m["decode_s"] / args.decode_steps * 1e3, note=m.get("note"),
                       prompt_tokens=ids.numel(), tokens=m["decode_tokens"][:8])
                for name, m in res.items()]
    contexts = [c for c in args.contexts if c <= args.peer_max_ctx]
    return cases(guard, "hf", "hf peers", contexts, measure, args.out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,32768,65536,131072,262144")
    ap.add_argument("--arenas", default="1024,2048,4096,auto", help="MiB or auto; none: peers only")
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--long-arenas", help="only these arenas (as given in --arenas) run the "
                    "contexts >= --long-from (a long prefill takes minutes)")
    for opt, default in (("--long-from", 262144), ("--decode-steps", 32), ("--ubatch", 512),
                         ("--peer-max-ctx", 65536),
                         ("--limit-s", 540), ("--seed", 0)):
        ap.add_argument(opt, type=int, default=default)
    for flag in ("--no-peers", "--hf-offload-prefill", "--tiny"):   # tiny: 4 layers, 1K tokens
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="default benchmarks/results/sweep.json (tiny: none)")
    ap.add_argument("--plot", help="a PNG; default docs/arena_sweep.png (tiny: none)")
    ap.add_argument("--plot-only", metavar="JSON", help="redraw --plot from JSON's newest commit")
    args = ap.parse_args(argv)
    if args.tiny:
        if args.contexts == ap.get_default("contexts"):
            args.contexts = "256,512,1024"
        if args.arenas == ap.get_default("arenas"):
            args.arenas = "0.3,0.5,auto"              # of 0.8 MiB of KV at 1024 tokens
        args.decode_steps, args.ubatch = min(args.decode_steps, 8), min(args.ubatch, 128)
    else:
        args.plot = args.plot or "docs/arena_sweep.png"
        if not args.plot_only:
            args.out = args.out or "benchmarks/results/sweep.json"
    args.contexts = sorted(int(c) for c in args.contexts.split(","))
    args.arenas = [] if args.arenas == "none" else [
        a if a == "auto" else float(a) for a in args.arenas.split(",")]
    if args.long_arenas is not None:
        args.long_arenas = {a if a == "auto" else str(float(a))
                            for a in args.long_arenas.split(",")}
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.plot_only:
        plot_rows(latest_rows(load(args.plot_only)), args.plot or "arena_sweep.png")
        return []
    guard = Guard(args.limit_s)
    device, dtype = S.device_and_dtype(args.device, "use --device cpu --tiny")
    g = S.TINY if args.tiny else S.LLAMA3_8B
    meta = run_meta()
    meta.update(S.measure_h2d_gbps(device, 64 << 20 if args.tiny else 1 << 30))
    if device.type == "cuda":
        meta.update(hbm_gbps_measured=hbm_bandwidth()["hbm_gbps_measured"])
    peers = not args.no_peers and args.contexts[0] <= args.peer_max_ctx
    model, hf, hf_cfg, why = S.build_models(g, max(args.contexts), dtype, device, args.seed,
                                            want_hf=peers)
    if peers and hf is None:
        log(f"no peers: {why}")
    meta.update(weight_bytes=param_bytes(model), geometry=g.name)
    jobs = [(f"kvcompile arena {a}", lambda a=a: sweep_arena(model, g, a, args, device, meta,
                                                             guard)) for a in args.arenas]
    if hf is not None:
        jobs.append(("hf peers", lambda: sweep_peers(hf, hf_cfg, g, args, device, dtype, meta,
                                                     guard)))
    rows = []
    for name, job in jobs:
        try:
            rows += job()
        except Exception as exc:      # one part's failure (memory, say) spares the others
            traceback.print_exc()
            guard.skipped.append(f"{name}: {type(exc).__name__}: {exc}")
        free_memory(device)           # an arena's Engine is gone: its device memory too
    log(f"{len(rows)} rows in {time.perf_counter() - guard.t0:.0f} s; skipped: "
        + ("; ".join(guard.skipped) or "none"))
    if args.plot and rows:
        plot_rows(latest_rows(load(args.out)) if args.out else rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
