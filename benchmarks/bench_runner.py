"""Decode and prefill through `Engine.generate` (the step runner), streamed and all resident.

    python benchmarks/bench_runner.py [--cases streamed:131072,streamed:65536,resident:8192]
        [--arena-mib 2048] [--kv q8_0/q4_0] [--decode-steps 64] [--weights bf16|q4_k|q8_0]
        [--fill-ahead both|on|off|default] [--pipeline on|off|default]
        [--no-cuda-graphs] [--second-request]
        [--ngram-check]
        [--out benchmarks/results/runner.json]
    python benchmarks/bench_runner.py --tiny --device cpu      # the same code, seconds, CPU

Llama-3-8B geometry with random weights made on the device (no file), wrapped by
`Engine.from_model`. Each case is one Engine and two requests: a short warm-up request
(captures programs, compiles kernels) and the measured one, a prompt of random token ids
filling the context but for the decode steps, greedy. Every number comes from the
GenerationResult the Engine returns: TTFT, prefill tok/s, decode tok/s (steps timed to the
sampler's read of the token: GPU completion), step p50 / p90 / max and mean / median, the
median host time of a decode step (until its work was queued), the request's program events
(captures must be 0 on the measured request) and the streaming telemetry.

Bounds measured in the same run: streamed, pcie_gbps / (KV bytes of the context - arena
bytes); all resident, hbm_gbps / (weight bytes + KV bytes). Rows (each with its commit and
date) are appended to --out. --second-request: the measured request again on the same
Engine (`second_request`: its captures, must be 0, and its time to first token against the
first's prefill time + one decode step). --ngram-check: after the measured request, the same prompt with
ngram-simple speculation on the same Engine; the row records whether its tokens equal the
plain ones (`ngram`; a random model's greedy text repeats itself, so drafts are found).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_util import free_memory, hbm_bandwidth, log, param_bytes, run_meta  # noqa: E402

WARM_PROMPT = 512          # tokens of the warm-up request
WARM_STEPS = 4


def build_model(g, ctx: int, weights: str, device, dtype, seed: int):
    model, _, _, _ = S.build_models(g, ctx, dtype, device, seed, want_hf=False)
    if weights != "bf16":
        from bench_compiled import quantize_model
        quantize_model(model, weights)
    return model


def replay_ms(stats: dict, part: str = "launch") -> float | None:
    """Mean host time of a replayed decode step's part: "prepare" (input, placement,
    layout; a capture on the way is warm-up), "launch" (the graph's `replay()`) or "close"
    (bookkeeping after it)."""
    n, key = stats.get("replays"), f"{part}_s"
    return 1e3 * stats[key] / n if n and key in stats else None


def launches_per_step(stats: dict) -> int | None:
    """Graph launches a decode step makes: one (a decode graph or a phase program), or None
    (eager: every kernel its own launch)."""
    if "decode_graphs" in stats:
        return 1 if stats["decode_graphs"] and stats.get("replays") else None
    if "captures" in stats and stats.get("lower") != "eager":
        return 1
    return None


def publish_mode(e) -> str | None:
    """How captured streamed steps publish their rows to the host: "rows" (a kernel),
    "pages" (copies; the kernel could not run) or None (no streamed cache)."""
    pool = getattr(e.store, "pool", None)
    return None if pool is None else ("rows" if pool.row_maps is not None else "pages")


def run_case(model, g, mode: str, ctx: int, args, device, meta: dict,
             fill_ahead: bool | None = None) -> dict:
    import kvcompile
    k_type, v_type = args.kv.split("/")
    arena = args.arena_mib if mode == "streamed" else 0
    kv_bytes = ctx * S.kv_bytes_per_token(g, k_type, v_type)
    row = dict(kind="runner", mode=mode, context=ctx, kv_type=args.kv, arena_mib=arena,
               weights=args.weights, geometry=g.name, decode_steps=args.decode_steps,
               cuda_graphs=args.cuda_graphs, kv_bytes=kv_bytes, **meta)
    e = kvcompile.Engine.from_model(model, ctx_size=ctx, cache_type_k=k_type,
                                    cache_type_v=v_type, ubatch=args.ubatch,
                                    kv_stream_arena_mib=arena, cuda_graphs=args.cuda_graphs,
                                    progress=False)
    row["runner_mode"] = e.executor.mode
    if args.pipeline != "default":
        e.pipeline = args.pipeline == "on"
    row["pipeline"] = e.pipeline
    if fill_ahead is not None and hasattr(e.store, "fill_ahead"):
        e.store.streamer.fill_ahead = fill_ahead
    row["fill_ahead"] = getattr(e.store, "fill_ahead", None)
    policy = getattr(e.store, "policy_config", None)
    row["decode_depth"] = None if policy is None else policy.decode_depth
    ids = S.random_ids(ctx - args.decode_steps - 2, g.vocab, args.seed, "cpu").tolist()
    warm = e.generate(ids[:WARM_PROMPT], max_tokens=WARM_STEPS, temperature=0)
    r = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    stats = r.stats()
    median = stats["step_ms"]["p50"] / 1e3
    mean = sum(r.step_s) / len(r.step_s)
    row.update(prompt_tokens=r.prompt_tokens, ttft_s=r.prefill_s, prefill_tok_s=r.prefill_tok_s,
               decode_tok_s=r.decode_tok_s, step_ms=stats["step_ms"],
               mean_over_median_step=mean / median, host_step_ms=stats["host_step_ms"],
               launch_ms=replay_ms(r.programs),
               host_split_ms={p: replay_ms(r.programs, p) for p in ("prepare", "launch", "close")},
               host_steps_ms=[round(1e3 * t, 3) for t in r.decode_host_s],
               warmup=dict(captures=warm.programs.get("captures"), ttft_s=warm.prefill_s,
                           warmup_s=warm.programs.get("warmup_s"),
                           decode_s=warm.decode_s),
               programs=r.programs, launches_per_step=launches_per_step(r.programs),
               kv=r.kv, tokens=r.token_ids[:16], publish=publish_mode(e))
    if args.second_request:
        row["second_request"] = second_request(e, ids, r, args)
    if args.ngram_check:
        row["ngram"] = ngram_check(e, ids, r, args)
    if mode == "streamed":
        bound = S.pcie_bound(meta["pcie_gbps_measured"], kv_bytes, int(arena * 2**20))
        row.update(pcie_bound_tok_s=bound,
                   decode_vs_bound=r.decode_tok_s / bound if bound else None)
    elif meta.get("hbm_gbps_measured"):
        roof = meta["hbm_gbps_measured"] * 1e9 / (meta["weight_bytes"] + kv_bytes)
        row.update(hbm_roofline_tok_s=roof, decode_vs_hbm_roofline=r.decode_tok_s / roof)
    log(f"{mode} {ctx} (fill ahead: {row['fill_ahead']}, pipelined: "
        f"{row['pipeline']}): decode {r.decode_tok_s:.2f} tok/s (x bound "
        f"{S.fmt(row.get('decode_vs_bound'), '.3f')}, x roofline "
        f"{S.fmt(row.get('decode_vs_hbm_roofline'), '.3f')}), step p50 "
        f"{stats['step_ms']['p50']:.2f} ms, mean/median {mean / median:.3f}, host "
        f"{stats['host_step_ms']:.2f} ms (prepare / launch / close "
        f"{'/'.join(S.fmt(v, '.2f') for v in row['host_split_ms'].values())}), "
        f"launches/step {row['launches_per_step']}, "
        f"captures {r.programs.get('captures')}, TTFT {r.prefill_s:.2f} s, "
        f"{r.kv.get('repartitions', '-')} repartitions, publish {row['publish']}")
    if hasattr(e.store, "close"):         # the streaming cache's copy stream and leases
        e.store.close()
    del e
    free_memory(device)
    return row


def second_request(e, ids: list[int], first, args) -> dict:
    """The measured request again on the same Engine: its program events (every program it
    needs was made by the first: captures 0), its time to first token against the first's
    prefill time + one decode step, and equal tokens."""
    r = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    p50 = first.stats()["step_ms"]["p50"] / 1e3
    out = dict(captures=r.programs.get("captures"), warmup_s=r.programs.get("warmup_s"),
               ttft_s=r.prefill_s,
               first_ttft_s=first.prefill_s, first_step_p50_s=p50,
               ttft_within=r.prefill_s <= first.prefill_s + p50,
               decode_tok_s=r.decode_tok_s, tokens_equal=r.token_ids == first.token_ids)
    log(f"second request: captures {out['captures']}, TTFT {r.prefill_s:.2f} s (first "
        f"{first.prefill_s:.2f} s + step {1e3 * p50:.1f} ms), {r.decode_tok_s:.2f} tok/s, "
        f"tokens equal {out['tokens_equal']}")
    return out


def ngram_check(e, ids: list[int], plain, args) -> dict:
    """The same request with ngram-simple speculation (n 2, m 8): equal tokens?"""
    from kvcompile.engine.speculative.options import SpecOptions
    spec = e.spec
    try:
        e.spec = SpecOptions.checked("ngram-simple", ngram_n=2, ngram_m=8)
        r = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    finally:
        e.spec = spec
    out = dict(tokens_equal=r.token_ids == plain.token_ids, decode_tok_s=r.decode_tok_s,
               spec=r.speculative)
    log(f"ngram-simple: tokens equal {out['tokens_equal']}, {r.decode_tok_s:.2f} tok/s, "
        f"{r.speculative}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="streamed:131072,streamed:65536,resident:8192",
                    help="MODE:CONTEXT,... with MODE streamed (through --arena-mib) or resident")
    ap.add_argument("--arena-mib", type=float, default=2048)
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--weights", default="bf16", help="bf16, or a GGUF type (q4_k, q8_0, ...)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the Engine's (on for CUDA)")
    ap.add_argument("--fill-ahead", choices=("default", "on", "off", "both"),
                    default="default", help="streamed cases: each captured step fills the "
                    "next one's first layers (KvStore.fill_ahead), or not, or both "
                    "in turn")
    ap.add_argument("--pipeline", choices=("default", "on", "off"), default="default",
                    help="greedy steps queued before the host reads the token before them "
                    "(Engine.pipeline; default: on for CUDA)")
    ap.add_argument("--second-request", action="store_true",
                    help="run each case's measured request twice on the same Engine: the "
                    "second's captures and time to first token")
    ap.add_argument("--ngram-check", action="store_true",
                    help="also decode each case's prompt with ngram-simple: equal tokens?")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model, small contexts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/runner.json")
    args = ap.parse_args(argv)
    if args.tiny:
        if args.cases == ap.get_default("cases"):
            args.cases = "streamed:1024,resident:1024"
        args.arena_mib = min(args.arena_mib, 0.4)     # of 0.8 MiB of KV: half streams
        args.decode_steps = min(args.decode_steps, 8)
        args.ubatch = min(args.ubatch, 128)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device, dtype = S.device_and_dtype(args.device, "use --device cpu --tiny")
    g = S.TINY if args.tiny else S.LLAMA3_8B
    cases = [(m, int(c)) for m, c in (x.split(":") for x in args.cases.split(","))]
    meta = run_meta()
    meta.update(S.measure_h2d_gbps(device, 64 << 20 if args.tiny else 1 << 30))
    if device.type == "cuda":
        meta.update(hbm_gbps_measured=hbm_bandwidth()["hbm_gbps_measured"])
    model = build_model(g, max(c for _, c in cases), args.weights, device, dtype, args.seed)
    meta["weight_bytes"] = param_bytes(model)
    rows = []
    ahead = {"default": [None], "on": [True], "off": [False], "both": [False, True]}
    for mode, ctx in cases:
        for p in (ahead[args.fill_ahead] if mode == "streamed" else [None]):
            rows.append(run_case(model, g, mode, ctx, args, device, meta, p))
            save(rows[-1:], args.out)
    return rows


def save(rows: list[dict], path: str | None) -> None:
    if not path:
        return
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("rows", [])
    with open(path, "w") as f:
        json.dump(dict(rows=old + rows), f, indent=1)


if __name__ == "__main__":
    main()
