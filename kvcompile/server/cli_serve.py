"""`kvcompile serve [MODEL]`: the command line of the server (docs/server.md).

kvcompile/cli.py adds it with `add_serve_parser(sub, _add_model_options, _engine_options)`:
the model and KV flags are generate's. Nothing here imports torch or the server's packages
until the command runs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from kvcompile.errors import KvcompileError


def add_serve_parser(subparsers, add_model_options, engine_options) -> None:
    """The `serve` subcommand. add_model_options(parser) adds the shared model / KV flags;
    engine_options(args) reads them back as Engine options."""
    # the shared flags come last and win a clash (conflict_handler="resolve"): a flag that
    # moves into them later replaces the one here
    p = subparsers.add_parser("serve", conflict_handler="resolve",
                              help="an OpenAI-compatible HTTP server (chat, completions, "
                                   "metrics, saved sessions)")
    p.add_argument("model_file", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file or Hugging Face folder (or -m; default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--queue", type=int, default=16, metavar="N",
                   help="requests that may wait while one runs; more get 503 (16)")
    p.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's id in /v1/models and requests (default: the file's name)")
    p.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                   help="max_tokens of a request that gives none (-1: until the context fills)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=256, help="prefill chunk (256)")
    p.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="resume each request at the longest prefix the engine holds (on; a "
                        "request's cache_prompt: false starts it cold)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="device-memory budget for weights, workspace and KV arena")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA-graph the decode steps (default: on with cuda)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="folder of saved sessions (POST /slots/0?action=save|restore)")
    p.add_argument("--cache-ram", type=float, default=None, metavar="GIB", help="host RAM "
                   "for recent conversations' KV (default: a quarter of what is available)")
    p.add_argument("--max-body-mib", type=float, default=8.0, metavar="MIB",
                   help="largest request body; more gets 413 (8)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (not on /health, /metrics)")
    add_model_options(p)
    p.set_defaults(func=lambda args: run_serve(args, engine_options))


def _settings_checks(args) -> None:
    """What can be refused before torch or the model loads."""
    if args.model_file is not None and args.model is not None:
        raise KvcompileError("give the model once: as MODEL or with -m")
    if not 0 <= args.port <= 65535:
        raise KvcompileError(f"--port must be in [0, 65535], got {args.port}")
    if args.queue < 1:
        raise KvcompileError(f"--queue must be at least 1, got {args.queue}")
    if args.max_body_mib <= 0:
        raise KvcompileError(f"--max-body-mib must be > 0, got {args.max_body_mib}")
    if args.slot_save_path is not None and not Path(args.slot_save_path).is_dir():
        raise KvcompileError(f"--slot-save-path {args.slot_save_path}: no such folder; "
                             f"create it first")


def run_serve(args, engine_options) -> int:
    _settings_checks(args)
    try:
        import uvicorn

        from kvcompile.server.app import ServerSettings, create_app, model_name_of
    except ImportError as e:
        raise KvcompileError(f"kvcompile serve needs the server's packages ({e.name} is "
                             f"missing): pip install 'kvcompile[serve]'") from None
    from kvcompile.engine.engine import Engine

    options = dict(ubatch=args.ubatch_size, cache_prompt=args.cache_prompt,
                   cache_ram_gib=args.cache_ram, gpu_memory_gib=args.gpu_memory_gib,
                   cuda_graphs=args.cuda_graphs)
    options.update(engine_options(args))      # the shared flags' values
    engine = Engine(args.model_file or args.model, **options)
    settings = ServerSettings(
        model_name=args.alias or model_name_of(engine), queue_size=args.queue,
        max_body_bytes=int(args.max_body_mib * 2**20), default_max_tokens=args.n_predict,
        slot_save_path=Path(args.slot_save_path) if args.slot_save_path else None,
        api_key=args.api_key)
    print(f"kvcompile serve: {settings.model_name} (context {engine.ctx_size}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(create_app(engine, settings), host=args.host, port=args.port,
                log_level="info", timeout_graceful_shutdown=5)
    return 0
