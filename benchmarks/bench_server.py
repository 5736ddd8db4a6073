"""`kvcompile serve` on the device: a conversation's later turns against its first, and a
saved session restored in a new process against the prefill it replaces.

    python benchmarks/bench_server.py [--first 65536] [--turns 6] [--new 300]
        [--session 32768] [--arena-mib 2048] [--kv q8_0/q4_0] [--out PATH]
    python benchmarks/bench_server.py --tiny --device cpu      # the same code, seconds, CPU

Llama-3-8B geometry, random bf16 weights made on the device (bench_streaming.py), one Engine
(`Engine.from_model`, KV streamed through --arena-mib) behind the server's app
(kvcompile/server/app.py) on 127.0.0.1, uvicorn in this process. Turns: token-id prompts on
/v1/completions over HTTP (stdlib client), each the conversation so far (the previous
prompt, its reply, --new new tokens); each turn's time to first token is the Engine's, as
the response's `timings.prompt_ms` reports it. Target: every later turn <= 0.05 x the first.
Session: a --session-token prompt and 8 tokens, `Engine.save_session`; a new process
(this script, --restore) builds the same model (same seed), `load_session`s it and runs
the next turn; its tokens must equal this process's uninterrupted next turn, and the load
must take <= 0.1 x the session prompt's cold prefill. Rows (commit, date) go to --out.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_util import log, run_meta  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "server.json")


def build_engine(args, ctx: int):
    from kvcompile.engine.engine import Engine
    device, dtype = S.device_and_dtype(args.device, "use --device cpu --tiny")
    g = S.TINY if args.tiny else S.LLAMA3_8B
    model, _, _, _ = S.build_models(g, ctx, dtype, device, args.seed, want_hf=False)
    k, v = args.kv.split("/")
    return Engine.from_model(model, ctx_size=ctx, kv_stream_arena_mib=args.arena_mib,
                             cache_type_k=k, cache_type_v=v, ubatch=args.ubatch,
                             progress=False), g


def serve(engine):
    """The app on a free port in a thread; returns (port, server)."""
    import socket

    import uvicorn

    from kvcompile.server.app import ServerSettings, create_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerSettings()),
                                           host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return port, server


def complete(port: int, prompt: list[int], max_tokens: int) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = json.dumps(dict(prompt=prompt, max_tokens=max_tokens, temperature=0,
                           return_tokens=True))
    t = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    out = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError(f"server answered {r.status}: {out}")
    out["wall_s"] = time.perf_counter() - t
    return out


def turns(engine, g, args) -> dict:
    port, server = serve(engine)
    try:
        complete(port, S.random_ids(600, g.vocab, args.seed + 1, "cpu").tolist(), 4)  # warm-up
        prompt = S.random_ids(args.first, g.vocab, args.seed + 2, "cpu").tolist()
        rows = []
        for k in range(args.turns):
            r = complete(port, prompt, args.reply)
            t = r["timings"]
            rows.append(dict(turn=k + 1, prompt_tokens=r["usage"]["prompt_tokens"],
                             cached_tokens=r["usage"]["prompt_tokens_details"]["cached_tokens"],
                             ttft_s=t["prompt_ms"] / 1e3, wall_s=r["wall_s"]))
            log(f"turn {k + 1}: {rows[-1]}")
            extra = S.random_ids(args.new, g.vocab, args.seed + 10 + k, "cpu").tolist()
            prompt = prompt + r["choices"][0]["tokens"] + extra
    finally:
        server.should_exit = True
    first = rows[0]["ttft_s"]
    worst = max(r["ttft_s"] for r in rows[1:]) / first
    log(f"later turns: worst TTFT {worst:.4f} x the first's {first:.2f} s")
    return dict(part="turns", first_tokens=args.first, new_tokens=args.new, turns=rows,
                worst_later_over_first=worst, target_met=worst <= 0.05)


def session(engine, g, args) -> dict:
    prompt = S.random_ids(args.session, g.vocab, args.seed + 3, "cpu").tolist()
    engine.store.reset()
    cold = engine.generate(prompt, max_tokens=8, temperature=0)
    path = os.path.join(tempfile.mkdtemp(), "s.session")
    t = time.perf_counter()
    saved = engine.save_session(path)
    save_s = time.perf_counter() - t
    turn = prompt + cold.token_ids + S.random_ids(args.new, g.vocab, args.seed + 4,
                                                  "cpu").tolist()
    want = engine.generate(turn, max_tokens=16, temperature=0)
    cmd = [sys.executable, os.path.abspath(__file__), "--restore", path, "--turn-file",
           path + ".turn", *sys.argv[1:]]
    with open(path + ".turn", "w") as f:
        json.dump(turn, f)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"the restoring process failed:\n{r.stderr[-3000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    out = dict(part="session", session_tokens=args.session, saved_tokens=saved["tokens"],
               file_bytes=saved["bytes"], save_s=save_s, cold_prefill_s=cold.prefill_s,
               restore_s=got["restore_s"], restore_over_prefill=got["restore_s"] / cold.prefill_s,
               cached_tokens=got["cached"], want_cached=want.cached_tokens,
               tokens_equal=got["tokens"] == want.token_ids)
    out["target_met"] = out["tokens_equal"] and out["restore_over_prefill"] <= 0.1
    log(f"session: {out}")
    return out


def restore(args) -> None:
    """The new process of the session part: the same model, the session, the next turn."""
    with open(args.turn_file) as f:
        turn = json.load(f)
    engine, _ = build_engine(args, args.ctx)
    t = time.perf_counter()
    engine.load_session(args.restore)
    restore_s = time.perf_counter() - t
    r = engine.generate(turn, max_tokens=16, temperature=0)
    print(json.dumps(dict(restore_s=restore_s, cached=r.cached_tokens, tokens=r.token_ids)))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=65536)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new", type=int, default=300)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--session", type=int, default=32768)
    ap.add_argument("--parts", default="turns,session")
    ap.add_argument("--arena-mib", type=float, default=2048)
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--ubatch", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model, small contexts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--restore", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--turn-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.first, args.session, args.new, args.arena_mib = 1024, 768, 40, 1.0
        args.ubatch = min(args.ubatch, 64)
    turns_ctx = args.first + args.turns * (args.new + args.reply) + 64
    args.ctx = max(turns_ctx, args.session + args.new + 64)
    if args.restore:
        return restore(args)
    engine, g = build_engine(args, args.ctx)
    meta = run_meta()
    rows = []
    for part in args.parts.split(","):
        row = turns(engine, g, args) if part == "turns" else session(engine, g, args)
        row.update(geometry=g.name, kv=args.kv, arena_mib=args.arena_mib, ctx=args.ctx, **meta)
        rows.append(row)
    if args.out:
        old = json.load(open(args.out)) if os.path.exists(args.out) else []
        with open(args.out, "w") as f:
            json.dump(old + rows, f, indent=1)
        log(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
