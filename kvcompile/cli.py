"""Command line: `kvcompile generate`, `kvcompile info`, `kvcompile make-model`,
`kvcompile eval` (kvcompile/engine/evaluate.py), `kvcompile serve` (kvcompile/server/).

Flag names follow llama.cpp where the concept is the same. Nothing here imports torch until
a command runs: `--help` answers at once, and a bad argument or prompt is reported before
any model (or torch) loads.
"""
from __future__ import annotations

import argparse
import math
import sys

from kvcompile.errors import KvcompileError
from kvcompile.server.cli_serve import add_serve_parser   # (imports no torch or starlette)

# The drafters of --spec-type, in the order the engine combines them (the engine's
# speculative.options.SPEC_TYPES, which imports torch, lists the same).
SPEC_DRAFTERS = ("ngram-simple", "draft-mtp")
CACHE_TYPES = "f32 (the default), f16, bf16, q8_0 or q4_0"


def _arena_mib(text: str):
    """--kv-stream-arena-mib: a number of MiB or 'auto'."""
    if text.lower() == "auto":
        return "auto"
    try:
        mib = float(text)
    except ValueError:
        mib = math.nan
    if not math.isfinite(mib):
        raise argparse.ArgumentTypeError(f"expected a number of MiB or auto, got {text!r}")
    return mib


def _spec_type(text: str) -> str:
    """--spec-type: none, or drafters joined by commas in any order, as the engine spells it."""
    names = [n.strip() for n in text.lower().split(",")]
    if names == ["none"]:
        return "none"
    if any(n not in SPEC_DRAFTERS for n in names) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(
            f"expected none, {' or '.join(SPEC_DRAFTERS)}, or both joined by a comma "
            f"({','.join(SPEC_DRAFTERS)}); got {text!r}")
    return ",".join(n for n in SPEC_DRAFTERS if n in names)


def _add_model_options(p) -> None:
    """The model and KV flags generate and eval share (_engine_options reads them)."""
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file or Hugging Face checkpoint folder (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="context size in tokens (default: min(model's, 4096))")
    p.add_argument("-ctk", "--cache-type-k", default="f32", metavar="TYPE",
                   help=f"K cache type: {CACHE_TYPES}")
    p.add_argument("-ctv", "--cache-type-v", default="f32", metavar="TYPE",
                   help=f"V cache type: {CACHE_TYPES}")
    p.add_argument("--kv-stream-arena-mib", type=_arena_mib, default=0, metavar="MIB",
                   help="KV history in host RAM, streamed through an arena of this many MiB "
                        "(0 = whole KV cache on the device, the default; auto = what the "
                        "device-memory budget leaves, the whole KV when it fits)")
    p.add_argument("--device", default=None, help="cpu (the default), cuda or cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="weights and activations: auto (the default: bf16 on cuda; on cpu "
                        "the fast path, f32 activations over the file's Q4_0 / Q4_1 / Q8_0 "
                        "weights), f32 (on cpu the fp32 reference path), f16 or bf16")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (loading, prefill of long prompts)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default: the physical cores other processes leave "
                        "free, followed as the load changes)")


def _engine_options(args) -> dict:
    return dict(ctx_size=args.ctx_size, cache_type_k=args.cache_type_k,
                cache_type_v=args.cache_type_v, kv_stream_arena_mib=args.kv_stream_arena_mib,
                device=args.device, dtype=args.dtype, progress=not args.no_progress,
                threads=args.threads)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt text (with --chat: the user's message); or -f FILE")
    p.add_argument("-f", "--file", default=None, metavar="PATH",
                   help="read the prompt from a UTF-8 text file (- reads stdin): for prompts "
                        "longer than a command-line argument may be")
    p.add_argument("--system-file", default=None, metavar="PATH",
                   help="read the system message (with --chat) from a text file")
    _add_model_options(p)
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate (256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0 = off (40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off (0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="0 = off (0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="recent tokens the repeat penalty looks at (64)")
    p.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=256, help="prefill chunk (256)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="device-memory budget for weights + workspace + KV arena, enforced "
                        "(default: the GPU's free memory); with --kv-stream-arena-mib auto "
                        "the arena gets what it leaves")
    p.add_argument("--trace", action="store_true", help="print per-step KV telemetry to stderr")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run decode and verify steps (and, all resident, full prefill chunks) "
                        "as CUDA graphs captured once per layout of the KV arena, ring copies "
                        "included, kept across requests. Default: on with a cuda device, off "
                        "on the CPU (where --cuda-graphs reruns the same fixed steps); "
                        "--no-cuda-graphs runs the traced steps uncaptured")
    p.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of the longest common prefix with what the engine holds "
                        "(on by default; one request per process has nothing to reuse)")
    p.add_argument("--cache-ram", type=float, default=None, metavar="GIB",
                   help="host RAM for the KV of recent conversations besides the one held "
                        "(default: a quarter of the available memory; 0: none)")
    p.add_argument("--ctx-checkpoints", type=int, default=8,
                   help="hybrid models: copies of the recurrent state kept in host memory "
                        "for prefix reuse (8)")
    p.add_argument("--spec-type", type=_spec_type, default="none", metavar="TYPE",
                   help="speculative decoding (the output is the same, in fewer forwards): "
                        "none (the default); ngram-simple drafts from earlier occurrences of "
                        "the last tokens in the prompt and output; draft-mtp drafts with the "
                        "model's MTP (NextN) layer; ngram-simple,draft-mtp: ngram when it "
                        "matches, else MTP")
    p.add_argument("--spec-ngram-size-n", type=int, default=3,
                   help="ngram-simple: tokens of the lookup key (3)")
    p.add_argument("--spec-ngram-size-m", type=int, default=8,
                   help="ngram-simple: most tokens a draft proposes (8)")
    p.add_argument("--spec-draft-n-max", type=int, default=3,
                   help="draft-mtp: the MTP depth, tokens drafted a round, 1..5 (3)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.7,
                   help="draft-mtp: stop drafting when the draft token's probability under "
                        "the MTP layer falls below this (0.7)")
    p.add_argument("--no-stats", action="store_true", help="no statistics line at the end")
    p.set_defaults(func=_run_generate)


def _source(path: str, flag: str) -> str:
    return f"{flag} - (stdin)" if path == "-" else f"{flag} {path}"


def _read_text(path: str, flag: str) -> str:
    """A UTF-8 text file, or stdin for -: both read as bytes, so bad bytes are named the
    same way (and before any model loads)."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise KvcompileError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise KvcompileError(f"{_source(path, flag)}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvcompileError(f"{_source(path, flag)}: not UTF-8 text (byte {e.start}); convert "
                             f"it first, e.g. iconv -t UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")   # newlines as text-mode reads give


def _prompt_text(args) -> str:
    """The prompt: the argument or -f's file (stdin for -), exactly one of them, not empty."""
    if args.file is not None and args.prompt is not None:
        raise KvcompileError("give the prompt once: as an argument or with -f FILE")
    if args.file is not None:
        text, source = _read_text(args.file, "-f"), _source(args.file, "-f")
    elif args.prompt is None:
        raise KvcompileError("no prompt: give it as an argument, or -f FILE (-f - reads "
                             "stdin)")
    else:
        text, source = args.prompt, "the prompt argument"
    if not text:
        raise KvcompileError(f"the prompt is empty ({source} holds no text); give at least "
                             f"one token of text")
    return text


def _run_generate(args) -> int:
    # What needs no model is checked first, the prompt before torch is even imported: a
    # typo or a bad file should not cost a model load.
    args.prompt = _prompt_text(args)
    if args.system_file is not None:
        if args.system is not None:
            raise KvcompileError("give the system message once: --system or --system-file")
        if args.system_file == "-" and args.file == "-":
            raise KvcompileError("-f - and --system-file - both read stdin; give one a file")
        args.system = _read_text(args.system_file, "--system-file")
    if args.system is not None and not args.chat:
        raise KvcompileError("--system needs --chat (the system message goes into the chat "
                             "template)")
    if args.trace and not args.kv_stream_arena_mib:
        raise KvcompileError("--trace prints the streaming runtime's per-step telemetry: it "
                             "needs --kv-stream-arena-mib N")
    from kvcompile.engine.engine import Engine
    from kvcompile.engine.sampling import SamplingParams

    request = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                   repeat_last_n=args.repeat_last_n, seed=args.seed, stop=tuple(args.stop))
    SamplingParams.from_options(**request)      # Engine checks its own options before loading
    engine = Engine(args.model, **_engine_options(args), ubatch=args.ubatch_size,
                    trace=args.trace, cuda_graphs=args.cuda_graphs,
                    gpu_memory_gib=args.gpu_memory_gib, cache_prompt=args.cache_prompt,
                    cache_ram_gib=args.cache_ram, ctx_checkpoints=args.ctx_checkpoints,
                    spec_type=args.spec_type,
                    spec_ngram_size_n=args.spec_ngram_size_n,
                    spec_ngram_size_m=args.spec_ngram_size_m,
                    spec_draft_n_max=args.spec_draft_n_max,
                    spec_draft_p_min=args.spec_draft_p_min)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        stream = engine.stream(messages=messages, **request)
    else:
        stream = engine.stream(args.prompt, **request)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    r = stream.result
    if not args.no_stats:
        print(r.stats_line(), file=sys.stderr)
        if engine.store.streams and r.kv:
            print(f"[kv streaming: {r.kv['streamed_fraction']:.0%} of page reads from the ring, "
                  f"{r.kv['h2d_bytes'] / 2**20:.1f} MiB host->device, "
                  f"{r.kv['readiness_misses']} readiness misses]", file=sys.stderr)
        if engine.executor.capture:
            print(_graphs_line(r.programs), file=sys.stderr)
    return 0


def _graphs_line(programs: dict) -> str:
    """The --cuda-graphs statistics of a request: replayed, captured and uncaptured steps."""
    line = (f"[cuda graphs: {programs['replays']} steps replayed, {programs['captures']} "
            f"captured, {programs['eager_steps']} uncaptured")
    if programs.get("compiled"):
        line += ", traced forward"
    if programs.get("trace_error"):
        line += f"; trace failed, eager model in the graphs: {programs['trace_error']}"
    if programs.get("fallback"):
        line += f"; capture failed, uncaptured from then on: {programs['fallback']}"
    return line + "]"


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="architecture, geometry, quant types and KV bytes of a model")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file or Hugging Face checkpoint folder (default: the embedded "
                        "SmolLM2-135M-Instruct, the model generate runs without -m)")
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    from kvcompile.errors import UnsupportedModelError
    from kvcompile.io.default_model import default_model_path
    from kvcompile.io.model_info import format_gguf_metadata, format_model_info, model_info

    path = default_model_path() if args.model is None else args.model
    try:
        print(format_model_info(model_info(path)))
    except UnsupportedModelError:
        # the engine cannot run it, but its header still says what it is
        summary = format_gguf_metadata(path)
        if summary:
            print(summary)
        raise
    return 0


def _add_make_model(sub) -> None:
    from kvcompile.io.make_model import add_make_model_args, run_make_model

    p = sub.add_parser("make-model", help="write a synthetic GGUF (random weights) from a preset")
    add_make_model_args(p)
    p.set_defaults(func=run_make_model)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity over a text; with --reference, KL and top-1 "
                                    "agreement against another KV setup, per chunk")
    p.add_argument("-f", "--file", required=True, metavar="PATH",
                   help="UTF-8 text to evaluate (- reads stdin); it must fit in --ctx-size")
    _add_model_options(p)
    p.add_argument("--chunk", type=int, default=512, metavar="N",
                   help="tokens a step and a reported row (512)")
    p.add_argument("--reference", default=None, metavar="REF",
                   help="f32 (f32 everywhere, all resident), resident (the same KV types, all "
                        "resident) or K/V types like q8_0/q4_0 (all resident)")
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    """A row per chunk, then the whole text's line, all on stdout (`> out.txt` keeps it)."""
    if args.chunk <= 0:
        raise KvcompileError(f"--chunk must be a positive number of tokens, got {args.chunk}")
    text = _read_text(args.file, "-f")
    if not text:
        raise KvcompileError(f"{_source(args.file, '-f')} holds no text; eval needs at least "
                             f"2 tokens")
    from kvcompile.engine.engine import Engine
    from kvcompile.engine.evaluate import evaluate, reference_options, summary

    options = dict(_engine_options(args), ubatch=args.chunk, cuda_graphs=False)
    ref_opts = reference_options(args.reference, options)   # checked before any load
    engine = Engine(args.model, **options)
    ids = engine.tokenizer.encode(text)
    if len(ids) > engine.ctx_size:        # before the reference's load
        raise KvcompileError(f"the text has {len(ids)} tokens but the context holds "
                             f"{engine.ctx_size}; raise --ctx-size (-c) or shorten the text")
    stats = evaluate(engine, ids, args.chunk, Engine(args.model, **ref_opts) if ref_opts
                     else None)
    for s in stats:
        kl = "" if s.kl is None else (f"  KL {s.kl / (s.end - s.start):.3e}  "
                                      f"top-1 {s.top1 / (s.end - s.start):.4f}")
        print(f"[{s.start:>7}, {s.end:>7})  ppl {s.ppl:10.4f}{kl}")
    tot = summary(stats)
    vs = (f", mean KL {tot['kl']:.3e}, top-1 agreement {tot['top1']:.4f} vs {args.reference}"
          if "kl" in tot else "")
    print(f"all {tot['tokens']} tokens: perplexity {tot['ppl']:.4f}{vs}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; it imports no torch (each command imports what it runs)."""
    parser = argparse.ArgumentParser(
        prog="kvcompile", description="Exact long-context LLM inference with a streamed KV cache.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_info(sub)
    _add_make_model(sub)
    _add_eval(sub)
    add_serve_parser(sub, _add_model_options, _engine_options)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from kvcompile import __version__
        print(f"kvcompile {__version__}")
        return 0
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KvcompileError as e:
        print(f"kvcompile: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:                      # e.g. `kvcompile info x.gguf | head`
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("\nkvcompile: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
