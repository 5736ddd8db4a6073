"""Gemma 3's windowed streaming through `Engine.generate`: a long context through a small
arena, against the same model all resident.

    python benchmarks/bench_families.py [--preset gemma3-12b] [--context 131072]
        [--arena-mib 2048] [--kv q8_0/q4_0] [--decode-steps 32] [--no-resident]
        [--out benchmarks/results/families.json]
    python benchmarks/bench_families.py --tiny --device cpu     # the same code, seconds, CPU

The family's make-model preset geometry with random weights made on the device (no file),
wrapped by `Engine.from_model`. Five of every six layers attend over a sliding window and
keep it in a ring of their own (kv/window_rings.py); only the global layers' history that
is not resident must cross PCIe. Each row records the host->device bytes of a timed decode
step against those bytes (`h2d_over_global_streamed`, at most 1.05 wanted), decode tok/s
against the PCIe bound over them (`decode_vs_bound`, pinned copy bandwidth measured in the
same run), and whether the greedy tokens and the logits of one more step equal the
all-resident run's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_util import add_run_options, free_memory, log, run_meta  # noqa: E402

RESULTS = "benchmarks/results/families.json"


def model_config(preset: str, context: int, layers: int | None = None):
    """The preset's geometry as the gemma3 family reads it from a file's metadata."""
    from kvcompile.models.families import gemma3
    c = gemma3.PRESETS[preset]
    md = {f"gemma3.{k}": v for k, v in dict(
        context_length=context, embedding_length=c.hidden, block_count=layers or c.n_layers,
        feed_forward_length=c.ffn, **{"attention.head_count": c.n_heads,
                                      "attention.head_count_kv": c.n_kv_heads,
                                      "attention.key_length": c.head_dim,
                                      "attention.layer_norm_rms_epsilon": c.rms_eps,
                                      "attention.sliding_window": c.sliding_window,
                                      "rope.freq_base": c.rope_theta,
                                      "rope.scaling.type": c.rope_scaling or "none",
                                      "rope.scaling.factor": c.rope_factor}).items()}
    md["gemma3.vocab_size"] = c.vocab_size
    return gemma3.config_from_gguf(md, {}, path=f"preset {preset}")


@torch.no_grad()
def build_model(config, dtype, device, seed: int):
    """Random weights (norms 1, matrices normal * 0.02) on the device; norms in fp32."""
    from kvcompile.models.gemma3 import Gemma3Model
    with torch.device(device):
        model = Gemma3Model(config)
    tensors = dict(model.named_parameters())
    for name, t in tensors.items():
        if not name.endswith("norm.weight"):
            t.data = t.data.to(dtype)
    S.fill_weights({n: p.data for n, p in tensors.items()}, seed)
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def global_streamed_bytes(e, steps: int) -> float:
    """Bytes a decode step must copy, over the last `steps` steps: the global layers' pages
    past the resident split (the windowed layers' rings hold their windows)."""
    pool = e.store.streamer.pool
    tel = e.store.telemetry[-steps:]
    return sum(pool.L * max(s.context_pages - pool.r, 0) * pool.kv_pool.shape[1]
               for s in tel) / len(tel)


def next_logits(e) -> torch.Tensor:
    """The logits of one more decode step after the measured request (the last sampled
    token at the next position): the streamed run's against the resident run's."""
    tokens, n = e.store.prefix.tokens, e.store.rows()
    if len(tokens) <= n:                  # no token waiting: the last row again
        n = len(tokens) - 1
        e.store.truncate(n)
    return e.executor.step([tokens[n]], n).float().cpu()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gemma3-12b")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--arena-mib", type=float, default=2048)
    ap.add_argument("--kv", default="q8_0/q4_0")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--no-resident", action="store_true",
                    help="skip the all-resident run (when it does not fit the device)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    ap.add_argument("--tiny", action="store_true",
                    help="gemma3 tiny with 12 layers (two global), 1K context, the CPU")
    add_run_options(ap, RESULTS, merge=False)
    args = ap.parse_args(argv)
    if args.tiny:
        args.preset, args.context, args.arena_mib, args.decode_steps = "tiny", 1024, 2, 8
        args.ubatch, args.layers = 128, 12
    device, dtype = S.device_and_dtype(args.device, "use --tiny --device cpu")
    graphs = device.type == "cuda"
    config = model_config(args.preset, args.context + 64, args.layers)
    log(f"{args.preset}: {config.n_layers} layers, window {config.sliding_window}, "
        f"context {args.context}, arena {args.arena_mib:g} MiB")
    model = build_model(config, dtype, device, args.seed)
    ids = S.random_ids(args.context, config.vocab_size, args.seed + 1, "cpu")
    meta = {**run_meta(), **S.measure_h2d_gbps(device, args.pcie_mib << 20)}
    rows, logits = [], []
    for mode, arena in ((("resident", 0),) if not args.no_resident else ()) + \
            (("streamed", args.arena_mib),):
        row = dict(system="kvcompile", preset=args.preset, mode=mode, context=args.context,
                   layers=config.n_layers, kv=args.kv,
                   arena_mib=arena, decode_steps=args.decode_steps, **meta)

        def extra(e, row=row):
            if not e.store.streams:
                return {"_next_logits": next_logits(e)}
            rings = e.store.streamer.rings
            need = global_streamed_bytes(e, args.decode_steps)
            return dict(window_rings=None if rings is None else
                        dict(layers=len(rings.windows), slots=rings.slots),
                        global_layers=e.store.streamer.pool.L,
                        global_streamed_bytes=need, _next_logits=next_logits(e))
        try:
            res = S.run_ours(model, args.context, args.kv, args, ids, arena_mib=arena,
                             graphs=graphs, extra=extra)
        except Exception as exc:        # a row that failed says why (bench_streaming)
            S.failed(row, exc)
            rows.append(row)
            continue
        logits.append(res.pop("_next_logits"))
        row["pcie_bound_tok_s"] = (meta["pcie_gbps_measured"] * S.GB / res["global_streamed_bytes"]
                                   if res.get("global_streamed_bytes") else None)
        S.finish(row, res, args.decode_steps)
        if res.get("global_streamed_bytes"):
            row["h2d_over_global_streamed"] = (res["h2d_bytes_per_token"]
                                               / res["global_streamed_bytes"])
        rows.append(row)
        free_memory(device)
        log(f"{mode}: {row.get('decode_tok_s', 0):.2f} tok/s, vs bound "
            f"{row.get('decode_vs_bound')}, h2d/step {res.get('h2d_bytes_per_token')}")
    ok = [r for r in rows if r.get("status") == "ok"]
    if len(ok) == 2:
        ok[1]["tokens_equal_resident"] = ok[0]["decode_tokens"] == ok[1]["decode_tokens"]
        ok[1]["logits_equal_resident"] = bool(torch.equal(logits[0], logits[1]))
        ok[1]["logits_max_abs_diff"] = float((logits[0] - logits[1]).abs().max())
    out = args.out or (os.path.join(os.environ.get("TMPDIR", "/tmp"), "families.json")
                       if args.tiny else RESULTS)
    old = json.load(open(out)) if os.path.exists(out) and not args.tiny else []
    with open(out, "w") as f:
        json.dump(old + rows, f, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
