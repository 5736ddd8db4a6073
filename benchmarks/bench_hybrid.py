"""Hybrid Qwen3.5 model (seed 27B geometry) on the device: decode/prefill tok/s against the
PCIe bound, streaming vs all-resident KV.

    python benchmarks/bench_hybrid.py [--contexts 8192,32768,131072,262144]
        [--systems ours,ours-graphs,ours-resident] [--kv q8_0/q4_0] [--arena-mib 2240]
        [--decode-steps 16] [--ubatch 4096] [--quick] [--out PATH]
    python benchmarks/bench_hybrid.py --tiny      # tiny geometry on the CPU, seconds

Geometry: the `make-model --preset seed-27b` one (64 layers, every 4th full attention:
16 attention + 48 Gated DeltaNet layers, hidden 5120, 24 query heads, 4 KV heads x 256,
FFN 17408, vocab 248320, GDN 16 key / 48 value heads x 128, conv kernel 4, one MTP layer).
No file is written: the config goes through the same GGUF metadata -> ModelConfig code a
made model file would, and the tensors of `synthetic.tensor_plan` (names, shapes, scales)
are filled on the device with random values (matrices bf16, vectors and the conv kernel
fp32, as a `--type bf16` file stores them) and handed to Qwen35Model.from_weights.

Systems (`ours*` run once per --kv entry), each row through its own `Engine.from_model`
(bench_streaming.run_ours: a warm-up request, then the measured one):
  ours            attention KV history on the host, streamed through an arena of --arena-mib,
                  the eager model
  ours-graphs     ours with the executor's programs: each decode step one CUDA graph
  ours-resident   the whole KV on the device (arena 0), eager

The Engine's store holds pages for the 16 main attention layers (the MTP layer gets pages
only when a draft-mtp drafter will read them; none runs here); the GDN state
(RecurrentState, fp32) stays on the device and is never streamed. The measured request
prefills the context in --ubatch chunks (timed to the first token), then decodes greedily:
1 untimed step (2 for ours-graphs: the first step at the context and its capture),
--decode-steps timed, each to the sampler's read of its token.

PCIe bound, as in bench_streaming (whose helpers this script imports): pcie_bound_tok_s =
pcie_gbps_measured / (attention KV bytes of the context - arena bytes), None when the
whole KV fits in the arena. Target (issue 6): ours decode at 256K >= 0.8 x that bound.
Rows are merged into --out as each finishes, so a run split over several calls keeps what
every call measured; every row records its commit and date.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
import bench_streaming as S  # noqa: E402
from bench_util import add_run_options, param_bytes, run_meta  # noqa: E402
from kvcompile.io.gguf.arch_config import config_from_metadata  # noqa: E402
from kvcompile.io.gguf.synthetic_presets import add_model_metadata, preset_config  # noqa: E402
from kvcompile.models.qwen35 import Qwen35Model  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "hybrid.json")
SYSTEMS = ("ours", "ours-graphs", "ours-resident")
CONTEXTS = "8192,32768,131072,262144"
TARGET_CONTEXT = 262144
MB, GB = S.MB, S.GB


# ---- model ---------------------------------------------------------------------------------
class _Metadata(dict):
    """Collects what add_model_metadata would write into a GGUF header."""

    def add_uint32(self, key, value):
        self[key] = int(value)

    def add_float32(self, key, value):
        self[key] = float(value)

    def add_array(self, key, value):
        self[key] = list(value)


def synthetic(tiny: bool, context_length: int):
    """(SyntheticConfig, ModelConfig, tensor plan) of the seed-27b preset (tiny: the qwen35
    tiny preset). The ModelConfig is read back from the GGUF metadata the preset writes,
    exactly as loading a `make-model` file would build it."""
    try:
        from kvcompile.io.gguf.synthetic import tensor_plan
    except ImportError as e:     # the plan module needs the gguf package for its types
        raise SystemExit(f"{e}: install the gguf package (e.g. pip install .whl/gguf-*.whl)")
    syn = preset_config("qwen35", "tiny" if tiny else "seed-27b", context_length=context_length)
    md = _Metadata({"general.architecture": syn.arch, "general.name": syn.name})
    add_model_metadata(md, syn)
    plan = tensor_plan(syn, "bf16")
    config = config_from_metadata(md, {t.name: t for t in plan}, path=f"preset {syn.name}")
    return syn, config, plan


def make_weights(plan, dtype, device, seed: int) -> dict[str, torch.Tensor]:
    """The plan's tensors made on the device: matrices in dtype, the plan's F32 tensors
    (vectors, conv kernel) in fp32. The values follow the plan's init kinds (as
    synthetic_values draws them on the host): normal(0, scale); norm 1 + normal(0, scale);
    uniform [low, low + scale); neg_log_uniform -exp(uniform). Tensor `name` draws from
    its own generator seeded by (seed, crc32(name)), so no value depends on the order."""
    out = {}
    for t in plan:
        dt = torch.float32 if t.ggml_type.name == "F32" else dtype
        x = torch.empty(t.shape, dtype=dt, device=device)
        gen = torch.Generator(device=device).manual_seed(
            (seed << 32) + zlib.crc32(t.name.encode()))
        if t.init == "normal":
            x.normal_(0.0, t.scale, generator=gen)
        elif t.init == "norm":
            x.normal_(1.0, t.scale, generator=gen)
        elif t.init == "uniform":
            x.uniform_(t.low, t.low + t.scale, generator=gen)
        elif t.init == "neg_log_uniform":
            x.uniform_(t.low, t.low + t.scale, generator=gen).exp_().neg_()
        else:
            raise ValueError(f"unknown init {t.init!r} for {t.name}: update make_weights()")
        out[t.name] = x
    return out


def build_model(plan, config, dtype, device, seed: int) -> Qwen35Model:
    with torch.no_grad():
        tensors = make_weights(plan, dtype, device, seed)
    # same device and dtype: from_weights assigns the matrices themselves (no second copy)
    return Qwen35Model.from_weights(config, tensors, dtype=dtype, device=device)


def weight_bytes(model: Qwen35Model) -> int:
    return param_bytes(model)


def kv_bytes_per_token(model, k_type: str, v_type: str) -> int:
    return S.kv_bytes_per_token(replace(model.config, n_layers=len(model.layer_plan.attention)),
                                k_type, v_type)


def gdn_backend(device) -> str:
    from kvcompile.models import gdn_fla
    return "fla (Triton)" if gdn_fla.usable(torch.empty(1, device=device)) else "torch reference"


# ---- one row ----------------------------------------------------------------------------
def run_row(model, ctx: int, kv: str, arena_mib: float, args, ids,
            graphs: bool = False) -> dict:
    return S.run_ours(model, ctx, kv, args, ids, arena_mib=arena_mib, graphs=graphs,
                      extra=lambda e: dict(
                          gdn_state_bytes=e.store.recurrent.nbytes,
                          kv_device_bytes=int(e.store.nbytes),
                          kv_layers=len(model.layer_plan.attention),
                          store_kv_layers=len(e.store.layers)))


def sanity(model, args, device) -> dict:
    """A short prompt through the smallest arena (every attention layer streamed) against
    all resident, each through an Engine (eager): logits and greedy tokens should be
    bitwise equal."""
    n, steps = 48, 8
    ids = S.random_ids(n, model.config.vocab_size, args.seed + 1, "cpu").tolist()
    res = {"prompt_tokens": n, "greedy_steps": steps}
    for kv in args.kv:
        got = {name: S.ours_reference(model, ids, steps, kv, arena)
               for name, arena in (("resident", 0),
                                   ("stream", S.smallest_arena_mib(model, n + steps + 1, kv)))}
        (lr, gr), (ls, gs) = got["resident"], got["stream"]
        res[kv] = dict(bitwise_equal_resident=bool(torch.equal(lr, ls)),
                       max_abs_diff=float((lr - ls).abs().max()),
                       greedy_equal_resident=gr == gs, finite=bool(torch.isfinite(lr).all()),
                       logits_std=float(lr.std()), greedy=gs)
    return res


# ---- report --------------------------------------------------------------------------------
def target_line(rows: list[dict]) -> str:
    ours = [r for r in rows if r["system"] in S.STREAMED and r["context"] == TARGET_CONTEXT
            and r.get("status") == "ok"]
    if not ours:
        return f"target @ {TARGET_CONTEXT}: not measured (run --contexts {TARGET_CONTEXT})"
    parts = []
    for r in ours:
        x = r.get("decode_vs_bound")
        parts.append(f"{r['system']} {r['kv_type']}: decode {r['decode_tok_s']:.2f} tok/s = "
                     f"{S.fmt(x, '.2f')} x PCIe bound {S.fmt(r.get('pcie_bound_tok_s'), '.2f')}"
                     f" (>= 0.8: {None if x is None else x >= 0.8})")
    return f"target @ {TARGET_CONTEXT}: " + "; ".join(parts)


def print_report(rows: list[dict], sanity_res: dict | None) -> None:
    S.print_table(rows, None, targets_too=False)   # the hybrid target is its own line
    print("hybrid: weights GB, GDN state MB (on the device, never streamed), first decoded "
          "tokens equal to ours-resident's (else, for ours-graphs, eager ours')")
    for r in rows:
        if r.get("status") != "ok":
            continue
        ref = [x for name in ("ours-resident", "ours") for x in rows
               if x["system"] == name != r["system"] and x.get("status") == "ok"
               and x["context"] == r["context"] and x["kv_type"] == r["kv_type"]
               and (name == "ours-resident" or r["system"] == "ours-graphs")]
        a, b = r["decode_tokens"], ref[0]["decode_tokens"] if ref else None
        same = a[:len(b)] == b[:len(a)] if b is not None else None   # lengths may differ
        tel = r.get("telemetry") or {}
        print(f"  {r['system']:14} {r['context']:>8} {r['kv_type']:>10}  weights "
              f"{r['weight_bytes'] / GB:6.2f}  GDN {r['gdn_state_bytes'] / MB:7.1f}  "
              f"same first tokens: {same}  misses/step "
              f"{S.fmt(tel.get('readiness_misses', 0) / tel['steps'] if tel else None, '.1f')}")
    if sanity_res:
        for kv, v in sanity_res.items():
            if isinstance(v, dict):
                print(f"sanity {kv}: " + ", ".join(f"{a}={b}" for a, b in v.items()
                                                   if a != "greedy"))
    print(target_line(rows))


# ---- main ----------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default=CONTEXTS)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--kv", default="q8_0/q4_0", help="K/V type pairs, comma separated")
    ap.add_argument("--arena-mib", type=float, default=None, help="default 2240 (tiny: 0.45)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--ubatch", type=int, default=4096)
    ap.add_argument("--device", default=None, help="default cuda (tiny: cpu)")
    ap.add_argument("--tiny", action="store_true",
                    help="qwen35 tiny geometry, contexts 256,1536 (the logic, on a CPU)")
    ap.add_argument("--quick", action="store_true", help="8K only, at most 8 decode steps")
    add_run_options(ap, RESULTS)
    args = ap.parse_args(argv)
    if args.tiny:
        if args.contexts == CONTEXTS:
            args.contexts = "256,1536"
        if args.ubatch == ap.get_default("ubatch"):
            args.ubatch = 128
        args.pcie_mib = min(args.pcie_mib, 16)
    if args.quick:
        args.contexts = args.contexts.split(",")[0] if args.tiny else "8192"
        args.decode_steps = min(args.decode_steps, 8)
    if args.arena_mib is None:
        # tiny: 2 attention layers of 52 KiB 256-token pages (q8_0/q4_0): 8 pages; 256
        # tokens fit, 1536 stream (624 KiB of attention KV)
        args.arena_mib = 0.45 if args.tiny else 2240
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "hybrid_tiny.json")
                            if args.tiny else RESULTS)
    try:
        args.contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        ap.error(f"--contexts takes token counts separated by commas, got {args.contexts!r}")
    S.parse_lists(ap, args, SYSTEMS)
    if (args.decode_steps < 1 or args.ubatch < 1 or not args.contexts
            or min(args.contexts) < 1 or args.arena_mib <= 0):
        ap.error("--decode-steps, --ubatch, --contexts and --arena-mib must be positive")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device, dtype = S.device_and_dtype(args.device, "use --tiny for the CPU logic check")
    ctx_len = max(args.contexts) + args.decode_steps + 64
    t_all = time.perf_counter()

    S.log(f"PCIe: {args.pcie_mib} MiB pinned host -> {device}")
    pcie = S.measure_h2d_gbps(device, args.pcie_mib << 20)
    S.log(f"PCIe: {pcie['pcie_gbps_measured']:.1f} GB/s (median), {pcie['pcie_gbps_max']:.1f} max")

    syn, config, plan = synthetic(args.tiny, ctx_len)
    geometry = f"{syn.name} (random weights)"
    S.log(f"weights: {geometry}, {dtype}, on {device}")
    t = time.perf_counter()
    model = build_model(plan, config, dtype, device, args.seed)
    S.sync(device)
    w_bytes, gdn = weight_bytes(model), gdn_backend(device)
    S.log(f"weights: {w_bytes / GB:.2f} GB in {time.perf_counter() - t:.1f} s; GDN: {gdn}")
    attn = model.layer_plan.attention
    meta = dict(geometry=geometry, preset="seed-27b" if not args.tiny else "qwen35 tiny",
                layers=config.n_layers, attention_layers=list(attn),
                gdn_layers=config.n_layers - len(attn), nextn_layers=config.nextn_layers,
                hidden=config.hidden, ffn=config.ffn, n_heads=config.n_heads,
                n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                rope_dim=config.rotary_dim, vocab=config.vocab_size,
                gdn_k_heads=config.ssm_k_heads, gdn_v_heads=config.ssm_v_heads,
                gdn_head_dim=config.ssm_head_dim, conv_kernel=config.ssm_conv_kernel,
                weights_dtype=str(dtype).replace("torch.", ""), weight_bytes=w_bytes,
                gdn_backend=gdn,
                mtp_kv="no MTP drafter runs: the store holds no MTP layer pages",
                device=torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine(),
                torch=torch.__version__, ubatch=args.ubatch, decode_steps=args.decode_steps,
                **pcie)
    run = run_meta()                # commit and date of this run, in its meta and every row
    meta.update(commit=run["commit"], date=run["date"])
    sanity_res = None
    if not args.no_sanity:
        S.log("sanity: streaming (smallest arena) vs resident, short prompt")
        try:
            sanity_res = sanity(model, args, device)
        except Exception as e:     # the benchmark still runs; the record says why
            traceback.print_exc()
            sanity_res = {"error": f"{type(e).__name__}: {e}"}
        meta["sanity"] = sanity_res
        S.free_memory(device)

    # (each row warms its own Engine up: bench_streaming.run_ours)
    rows: list[dict] = []
    if args.fresh and os.path.exists(args.out):
        os.remove(args.out)
    for ctx in args.contexts:
        ids = S.random_ids(ctx, config.vocab_size, args.seed + ctx, "cpu")
        for system in args.systems:
            arena = args.arena_mib if system in S.STREAMED else 0
            for kv in args.kv:
                k_type, v_type = kv.split("/")
                kv_bytes = ctx * kv_bytes_per_token(model, k_type, v_type)
                row = dict(system=system, context=ctx, kv_type=kv, arena_mib=arena,
                           geometry=geometry, kv_bytes=kv_bytes, weight_bytes=w_bytes,
                           pcie_gbps_measured=pcie["pcie_gbps_measured"],
                           pcie_bound_tok_s=S.pcie_bound(pcie["pcie_gbps_measured"], kv_bytes,
                                                         int(arena * 2**20))
                           if system in S.STREAMED else None,
                           decode_steps=args.decode_steps, device=meta["device"],
                           commit=run["commit"], date=run["date"])
                S.log(f"{system} {kv} arena {arena:g} MiB @ {ctx}")
                try:
                    S.finish(row, run_row(model, ctx, kv, arena, args, ids,
                                          graphs=system == "ours-graphs"), args.decode_steps)
                    S.log(f"  prefill {row['prefill_tok_s']:.0f} tok/s, decode "
                          f"{row['decode_tok_s']:.2f} tok/s (bound "
                          f"{S.fmt(row['pcie_bound_tok_s'], '.2f')}), h2d "
                          f"{row['h2d_bytes_per_token'] / MB:.1f} MB/token")
                except Exception as e:
                    S.failed(row, e)
                rows.append(row)
                S.save(rows, meta, args.out)
                S.free_memory(device)
        del ids
    S.log(f"done in {time.perf_counter() - t_all:.0f} s; rows in {args.out}")
    everything = rows
    if os.path.exists(args.out):
        with open(args.out) as f:
            everything = json.load(f)["rows"]
    print_report([r for r in everything if r.get("geometry") == geometry], sanity_res)
    return rows


if __name__ == "__main__":
    main()
