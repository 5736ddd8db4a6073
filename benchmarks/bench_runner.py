"""Decode and prefill through `Engine.generate` (the executor), streamed and all resident.

    python benchmarks/bench_runner.py [--cases streamed:131072,streamed:65536,resident:8192]
        [--arena-mib 2048] [--kv q8_0/q4_0] [--decode-steps 64] [--weights bf16|q4_k|q8_0]
        [--fill-ahead both|on|off|default] [--pipeline on|off|default]
        [--no-cuda-graphs] [--second-request] [--turn 300] [--ngram-check]
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
Engine (`second_request`: its captures, must be 0; the store holds the prompt, so it
computes only the prompt's last chunk: its time to first token, and equal tokens).
--turn N: the prompt plus N new tokens (a conversation's next turn) on the same Engine
(`turn`: its time to first token over the measured request's, the prompt tokens it reused),
then the same prompt cold (the store reset: a cold Engine's prefill) with greedy tokens
compared, a divergence forgiven only at a near tie (greedy_check.py).
--ngram-check: after the measured request, the same prompt with ngram-simple speculation on
the same Engine; the row records whether its tokens equal the plain ones (`ngram`; a random
model's greedy text repeats itself, so drafts are found); its verify widths are traced and
captured after the warm-up request.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_util import (free_memory, hbm_bandwidth, kernel_compiles, log,  # noqa: E402
                        param_bytes, run_meta)
from greedy_check import compare, record_gaps  # noqa: E402

WARM_PROMPT = 512          # tokens of the warm-up request (at least two chunks)
# and its last chunk's rows, no multiple of 16: Triton compiles a kernel per divisibility of
# its integer arguments, once a process; a later chunk of such a width (a next turn's) then
# measures no compile
WARM_TAIL = 100
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
    """Graph launches a decode step makes: one (its program replayed), or None (uncaptured:
    every kernel its own launch)."""
    return 1 if stats.get("replays") else None


def publish_mode(e) -> str | None:
    """How captured streamed steps publish their rows to the host: "rows" (a kernel),
    "pages" (copies; the kernel could not run) or None (an all-resident store)."""
    if not e.store.streams:
        return None
    return "rows" if e.store.streamer.pool.row_maps is not None else "pages"


def run_case(model, g, mode: str, ctx: int, args, device, meta: dict,
             fill_ahead: bool | None = None) -> dict:
    import kvcompile
    k_type, v_type = args.kv.split("/")
    arena = args.arena_mib if mode == "streamed" else 0
    # (a next turn needs room after the prompt, in every case alike: the same prompt)
    room = args.turn + min(args.decode_steps, 16) + 2 if args.turn else 0
    n_prompt = ctx - args.decode_steps - 2 - room
    # the KV the measured steps read: the context at their middle
    kv_bytes = (n_prompt + args.decode_steps // 2) * S.kv_bytes_per_token(g, k_type, v_type)
    row = dict(kind="runner", mode=mode, context=ctx, kv_type=args.kv, arena_mib=arena,
               weights=args.weights, geometry=g.name, decode_steps=args.decode_steps,
               cuda_graphs=args.cuda_graphs, kv_bytes=kv_bytes, **meta)
    e = kvcompile.Engine.from_model(model, ctx_size=ctx, cache_type_k=k_type,
                                    cache_type_v=v_type, ubatch=args.ubatch,
                                    kv_stream_arena_mib=arena, cuda_graphs=args.cuda_graphs,
                                    fill_ahead=fill_ahead, progress=False)
    row["runner_mode"] = e.executor.mode
    if args.pipeline != "default":
        e.pipeline = args.pipeline == "on"
    row["pipeline"] = e.pipeline
    streamer = e.store.streamer
    row["fill_ahead"] = None if streamer is None else streamer.fill_ahead
    row["decode_depth"] = None if streamer is None else streamer.policy_config.decode_depth
    turn = args.turn and mode == "streamed" and ctx == max(
        c for m, c in args.case_list if m == "streamed")
    ids = S.random_ids(n_prompt, g.vocab, args.seed, "cpu").tolist()
    # (two chunks at least: a prefill program's second chunk is captured)
    warm = e.generate(ids[:max(WARM_PROMPT, 2 * args.ubatch) + WARM_TAIL],
                      max_tokens=WARM_STEPS, temperature=0)
    if args.ngram_check:
        warm_verify_steps(e, ids)
    e.store.reset()                       # the measured request prefills from 0
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
    if turn:
        row["turn"] = next_turn(e, ids, r, args, g.vocab)
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
    e.store.close()                       # the copy stream and the arena's leases
    del e
    free_memory(device)
    return row


def second_request(e, ids: list[int], first, args) -> dict:
    """The measured request again on the same Engine: its program events (every program it
    needs was made by the first: captures 0), its time to first token (the store holds the
    prompt: only its last chunk is computed again, as the first request cut it), equal
    tokens."""
    with kernel_compiles() as compiled:
        r = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    out = dict(captures=r.programs.get("captures"), warmup_s=r.programs.get("warmup_s"),
               kernel_compiles=compiled, ttft_s=r.prefill_s, first_ttft_s=first.prefill_s,
               cached_tokens=r.cached_tokens, decode_tok_s=r.decode_tok_s,
               tokens_equal=r.token_ids == first.token_ids)
    log(f"second request: captures {out['captures']}, TTFT {r.prefill_s:.3f} s (first "
        f"{first.prefill_s:.2f} s), {r.cached_tokens} tokens reused, {r.decode_tok_s:.2f} "
        f"tok/s, tokens equal {out['tokens_equal']}")
    return out


def next_turn(e, ids: list[int], first, args, vocab: int) -> dict:
    """A conversation's next turn: the measured prompt plus args.turn new tokens. Its time
    to first token over the measured (cold) request's; then the same turn cold (the store
    reset); greedy tokens of both compared, stepping one token at a time so the host
    sampler sees each step's logits (a divergence counts only at a near tie)."""
    extra = S.random_ids(args.turn, vocab, args.seed + 7, "cpu").tolist()
    turn = ids + extra
    n = min(args.decode_steps, 16) + 1
    with kernel_compiles() as compiled:
        r = e.generate(turn, max_tokens=n, temperature=0)   # resumes the history held now
    gaps: list = []
    e.store.reset()                                     # a cold Engine's prefill
    pipeline, e.pipeline = e.pipeline, False            # (the host sampler sees logits)
    try:
        with record_gaps(gaps):
            cold = e.generate(turn, max_tokens=n, temperature=0)
    finally:
        e.pipeline = pipeline
    out = dict(new_tokens=len(extra), cached_tokens=r.cached_tokens, kernel_compiles=compiled,
               ttft_s=r.prefill_s,
               first_ttft_s=first.prefill_s, ttft_over_first=r.prefill_s / first.prefill_s,
               cold_ttft_s=cold.prefill_s, tokens=r.token_ids, cold_tokens=cold.token_ids,
               **compare(r.token_ids, cold.token_ids, gaps))
    log(f"next turn (+{len(extra)} tokens): TTFT {r.prefill_s:.3f} s = "
        f"{out['ttft_over_first']:.4f} x the first request's {first.prefill_s:.2f} s "
        f"({r.cached_tokens} reused, {len(compiled)} kernels compiled; cold "
        f"{cold.prefill_s:.2f} s); tokens equal to cold "
        f"{out['tokens_equal']} (near tie: {out['equal_or_near_tie']})")
    return out


def warm_verify_steps(e, ids: list[int]) -> None:
    """The verify steps an ngram round of ngram_check's drafts (1-8 tokens) runs, each width
    twice after the warm-up request (traced, then captured where it is captured), so the
    timed ngram request compiles nothing."""
    import torch
    pos = e.store.rows()
    with torch.inference_mode():
        for w in (2, 3, 5, 9):
            for _ in range(2):
                e.executor.verify(ids[pos:pos + w], pos)


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
    ap.add_argument("--turn", type=int, default=0,
                    help="the largest streamed case: its prompt plus this many new tokens "
                    "(a next turn) on the same Engine, against a cold prefill of the same")
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
    cases = args.case_list = [(m, int(c)) for m, c in
                              (x.split(":") for x in args.cases.split(","))]
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
