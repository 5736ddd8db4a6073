"""Speculative decoding against plain decoding, through `Engine.generate`, in one run.

    python benchmarks/bench_speculative.py [--model PATH] [--device cpu|cuda]
        [--max-tokens 160] [--spec ngram-simple] [--ngram 3,8] [--out PATH]
    python benchmarks/bench_speculative.py --oracle FILE --context 262144 [--depth 5]
        [--arena-mib 2240|auto] [--gpu-memory-gib 16] [--kv q8_0/q4_0]
        [--widths 1,2,3,4,5,6] [--device cuda] [--mtp-context 32768,262144]

The edit task (issue 27's ngram line): a chat prompt asks the model (default: SmolLM2-135M
Instruct) to repeat a paragraph with one word replaced, so most of the answer quotes the
prompt and ngram drafts find it. One Engine per mode, each a warm-up request and the
measured one, greedy: plain decoding, then the speculative mode. Each row records the
tokens a verify forward yields (`tokens_per_forward`), the acceptance, decode tok/s of both
(steps timed to the sampler's read of the token: GPU completion), their ratio, and whether
the tokens are equal (they must be). Rows (commit, date) are appended to --out.

The oracle task (issue 27's ceiling): one Engine over FILE (a seed-27b GGUF on the device,
random weights), a prompt of random ids filling --context but for the decode steps, streamed
through --arena-mib (or, with --gpu-memory-gib G --arena-mib auto, the arena a G GiB budget
leaves: the issue's configuration; the budget counts the verify rows' rollback buffers, so
the widest width must fit it). Request 1 decodes plainly and records its greedy
continuation; request 2 drafts exactly that continuation, --depth tokens a round (the Engine's drafter replaced
by the oracle), so every draft is kept: its decode tok/s over plain is what perfect
acceptance at that depth buys. Then, on the same context, one verify step of each width in
--widths, timed to completion (the executor's own verify step), as the cost ratio to width 1.
With --mtp-context N[,N...] (a model with an MTP layer): then, on the same Engine, a prompt
of N tokens decoded plainly and with draft-mtp (depth --depth, p-min 0): the tokens must be
equal (random weights reject nearly every draft, so the rounds exercise the rollback); a row
in `mtp` for each. N at least the prompt (e.g. 262144): the draft-mtp request runs first on
the whole prompt, so the plain and oracle requests resume its history: one prefill for all.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
from bench_runner import save  # noqa: E402
from bench_util import log, run_meta  # noqa: E402

from kvcompile.engine.speculative.decode import Drafter  # noqa: E402

PARAGRAPH = (
    "The keeper climbed the tower at dusk, trimmed the wick and lit the lamp. He wrote in "
    "the log that the wind had backed to the west, that the sea was calm, and that one "
    "ship had passed to the north. Then he sat by the lamp and mended a net until the "
    "tide turned, and at midnight he climbed the tower again to check the lamp.")
TASK = ("Repeat the following paragraph word for word, but replace every \"lamp\" with "
        "\"lantern\":\n\n" + PARAGRAPH)


def run_mode(args, spec: str) -> dict:
    import kvcompile
    n, m = map(int, args.ngram.split(","))
    e = kvcompile.Engine(args.model, device=args.device, ctx_size=args.ctx_size,
                         progress=False, spec_type=spec, spec_ngram_size_n=n,
                         spec_ngram_size_m=m)
    messages = [{"role": "user", "content": TASK}]
    e.generate(messages=messages, max_tokens=8, temperature=0)          # warm-up
    r = e.generate(messages=messages, max_tokens=args.max_tokens, temperature=0)
    return dict(result=r, spec=r.speculative, decode_tok_s=r.decode_tok_s,
                completion_tokens=r.completion_tokens, text=r.text)


class OracleDrafter(Drafter):
    """Drafts the known greedy continuation, `depth` tokens a round."""

    def __init__(self, continuation: list[int], prompt_len: int, depth: int):
        self.cont, self.n0, self.depth = continuation, prompt_len, depth

    def propose(self, history, limit: int) -> list[int]:
        at = len(history) - self.n0
        return self.cont[at:at + min(self.depth, limit)]


class OracleSpec:
    """An Engine's speculation settings (what `Engine.spec` answers a request) with the
    oracle as the drafter: the Engine's own verify rounds run, only the drafts differ."""
    enabled, uses_ngram, uses_mtp = True, False, False

    def __init__(self, drafter: Drafter):
        self._drafter = drafter

    def drafter(self, executor) -> Drafter:
        return self._drafter


def oracle_run(args, meta) -> dict:
    import time

    import torch

    import kvcompile
    from kvcompile.engine.speculative.options import SpecOptions
    from kvcompile.io.loader import open_model
    k, v = args.kv.split("/")
    widths = [int(w) for w in args.widths.split(",")]
    mtp_contexts = [int(n) for n in args.mtp_context.split(",") if n and int(n) > 0]
    e = kvcompile.Engine(args.oracle, device=args.device, ctx_size=args.context,
                         cache_type_k=k, cache_type_v=v, kv_stream_arena_mib=args.arena_mib,
                         gpu_memory_gib=args.gpu_memory_gib,
                         progress=False,   # MTP pages only when draft-mtp runs later
                         spec_type="ngram-simple,draft-mtp" if mtp_contexts
                         else "ngram-simple",
                         spec_ngram_size_m=max(args.depth, max(widths) - 1))
    vocab = open_model(args.oracle).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    room = args.decode_steps + max(widths) + 2          # the decode steps, then the widths
    ids = torch.randint(0, vocab, (args.context - room,), generator=gen).tolist()
    spec = e.spec
    e.spec = SpecOptions.checked("none")                                      # plain
    e.generate(ids[:512], max_tokens=4, temperature=0)                        # warm-up
    full_mtp = None
    if any(n >= len(ids) for n in mtp_contexts):
        # draft-mtp on the whole prompt first: its prefill fills the MTP layer's pages
        # too, so the plain and oracle requests after it resume its history (one prefill)
        e.spec = SpecOptions.checked("draft-mtp", draft_n_max=args.depth, draft_p_min=0.0)
        full_mtp = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
        e.spec = SpecOptions.checked("none")
    plain = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    log(f"plain: {plain.decode_tok_s:.2f} tok/s")
    oracle = OracleDrafter(plain.token_ids[1:], len(ids) + 1, args.depth)
    e.spec = OracleSpec(oracle)
    spec_r = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    log(f"oracle depth {args.depth}: {spec_r.decode_tok_s:.2f} tok/s")
    e.spec = spec
    # verify steps of each width at the end of the same context, timed to completion: the
    # executor's own verify step (the recurrent state restored after each). The first two
    # of a width are not timed: a width's program runs uncaptured once, then is captured.
    executor, pos = e.executor, len(ids) + len(plain.token_ids) - 1
    state = e.store.recurrent
    cost = {}
    with torch.inference_mode():
        before = state.snapshot() if state is not None else None
        for w in widths:
            times = []
            for i in range(2 + 3):
                t = time.perf_counter()
                rows, _ = executor.verify(plain.token_ids[-1:] + plain.token_ids[:w - 1], pos)
                rows[-1, 0].item()                     # completion
                if i >= 2:
                    times.append(time.perf_counter() - t)
                if state is not None:
                    state.restore(before)              # every width from the same state
            cost[w] = sorted(times)[1]
    e.store.reset()      # the verify rows are no request's history: the next one starts cold
    mtp = [mtp_row(full_mtp, plain, len(ids), args)] if full_mtp is not None else []
    mtp += [mtp_exactness(e, ids[:n], args) for n in mtp_contexts if n < len(ids)]
    return dict(kind="oracle", file=os.path.basename(args.oracle), context=args.context,
                kv_type=args.kv, arena_mib=args.arena_mib, gpu_memory_gib=args.gpu_memory_gib,
                plan=e.memory.describe() if e.memory else None,
                depth=args.depth,
                tokens_equal=spec_r.token_ids == plain.token_ids,
                cached_tokens=dict(plain=plain.cached_tokens, oracle=spec_r.cached_tokens),
                plain_decode_tok_s=plain.decode_tok_s, spec_decode_tok_s=spec_r.decode_tok_s,
                speedup=spec_r.decode_tok_s / plain.decode_tok_s, spec=spec_r.speculative,
                verify_s={str(w): c for w, c in cost.items()},
                verify_cost_over_width1={str(w): c / cost[widths[0]] for w, c in cost.items()},
                mtp=mtp, **meta)


def mtp_exactness(e, ids: list[int], args) -> dict:
    """Plain greedy decoding, then draft-mtp on the same Engine and prompt: equal tokens."""
    from kvcompile.engine.speculative.options import SpecOptions
    spec = e.spec
    try:
        e.spec = SpecOptions.checked("none")
        plain = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
        e.spec = SpecOptions.checked("draft-mtp", draft_n_max=args.depth, draft_p_min=0.0)
        r = e.generate(ids, max_tokens=args.decode_steps + 1, temperature=0)
    finally:
        e.spec = spec
    return mtp_row(r, plain, len(ids), args)


def mtp_row(r, plain, context: int, args) -> dict:
    """A draft-mtp request against the plain one of the same prompt."""
    out = dict(context=context, depth=args.depth, tokens_equal=r.token_ids == plain.token_ids,
               plain_decode_tok_s=plain.decode_tok_s, spec_decode_tok_s=r.decode_tok_s,
               spec=r.speculative)
    log(f"draft-mtp at {context}: tokens equal {out['tokens_equal']}, "
        f"{r.decode_tok_s:.2f} vs {plain.decode_tok_s:.2f} tok/s, {r.speculative}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--spec", default="ngram-simple")
    ap.add_argument("--ngram", default="3,8", help="--spec-ngram-size-n,m")
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    ap.add_argument("--oracle", metavar="FILE", help="the oracle task over this GGUF")
    ap.add_argument("--context", type=int, default=262144)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--arena-mib", type=lambda a: a if a == "auto" else float(a), default=2240,
                    help="MiB, or auto (with --gpu-memory-gib)")
    ap.add_argument("--gpu-memory-gib", type=float, default=None)
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--widths", default="1,2,3,4,5,6")
    ap.add_argument("--mtp-context", default="",
                    help="oracle task: also check draft-mtp's tokens at these contexts "
                         "(comma-separated; one at least --context: on the whole prompt, "
                         "before the plain request)")
    args = ap.parse_args(argv)
    meta = run_meta()
    if args.oracle:
        row = oracle_run(args, meta)
        log(f"oracle: {row['speedup']:.2f}x plain; verify cost over width 1: "
            + ", ".join(f"{w}: {c:.2f}" for w, c in row["verify_cost_over_width1"].items()))
        save([row], args.out)
        return row
    plain = run_mode(args, "none")
    log(f"plain: {plain['decode_tok_s']:.1f} tok/s")
    spec = run_mode(args, args.spec)
    s = spec["spec"]
    row = dict(kind="edit_task", model=os.path.basename(args.model or "SmolLM2-135M-Instruct"),
               spec_type=args.spec, ngram=args.ngram, max_tokens=args.max_tokens,
               completion_tokens=spec["completion_tokens"],
               tokens_equal=plain["result"].token_ids == spec["result"].token_ids,
               plain_decode_tok_s=plain["decode_tok_s"], spec_decode_tok_s=spec["decode_tok_s"],
               speedup=spec["decode_tok_s"] / plain["decode_tok_s"],
               forwards=s["forwards"], drafted=s["drafted"], accepted=s["accepted"],
               acceptance=s["acceptance"], verify_width=s["verify_width"],
               tokens_per_forward=s["tokens_per_forward"],
               answer_head=spec["text"][:120], **meta)
    log(f"{args.spec}: {spec['decode_tok_s']:.1f} tok/s = {row['speedup']:.2f}x plain; "
        f"{row['tokens_per_forward']:.2f} tokens a forward, acceptance "
        f"{row['acceptance']:.2f}; tokens equal: {row['tokens_equal']}")
    save([row], args.out)
    return row


if __name__ == "__main__":
    main()
