"""Streaming KV runtime on the device: decode/prefill tok/s against the PCIe bound and HF.

    python benchmarks/bench_streaming.py [--contexts 32768,65536,131072]
        [--systems ours,ours-resident,hf-offload,hf-dynamic] [--kv q8_0/q4_0,bf16/bf16]
        [--arena-mib 2048] [--decode-steps 16] [--quick] [--out PATH]
    python benchmarks/bench_streaming.py --device cpu --tiny     # the logic, on a CPU, seconds

Llama-3-8B geometry with random bf16 weights made on the device (no file): one set of tensors,
shared by our LlamaModel and Hugging Face's LlamaForCausalLM, so a short-prompt sanity check
compares the two implementations on the same weights. Systems:

  ours            the Engine (Engine.from_model), KV history on the host streamed through an
                  arena of --arena-mib MiB, the eager model (cuda_graphs and compile off)
  ours-graphs     the same Engine with the executor's programs: the traced forward, each
                  decode step one CUDA graph, ring copies included (on the CPU: reruns of
                  the programs' fixed layouts); prefill chunks eager
  ours-resident   the Engine with the whole KV on the device (arena 0), eager
  hf-offload      transformers DynamicCache(offloading=True), bf16 KV
  hf-dynamic      transformers DynamicCache(), bf16 KV

`ours*` run once per --kv entry, each row its own Engine (no prefix reuse) and two requests:
a warm-up (the first --ubatch prompt tokens: kernels compiled, programs traced and captured)
and the measured one, greedy: the context prefilled in --ubatch chunks (timed to the first
token: prefill_tok_s), 1 untimed decode step (2 for ours-graphs: the first step at the
context and its layout's capture), then --decode-steps timed steps, every time taken from
the GenerationResult (each step to the sampler's read of its token). HF prefills the
context in --ubatch chunks and decodes 1 warm-up step, then --decode-steps timed steps. When
hf-dynamic runs too, hf-offload decodes from the same prefilled KV moved to the state an
offloaded prefill leaves (layer 0 on the device, the rest on the host), which saves one long
prefill; --hf-offload-prefill times its own offloaded prefill instead.

The PCIe bound: pcie_bound_tok_s = pcie_gbps_measured / (KV bytes of the context - arena
bytes), the decode rate of a perfect system that streams only what does not fit in the
arena (pinned host -> device bandwidth measured in the same run). Rows go to --out as soon as
each finishes (merged with rows already there, same key replaced), so a run split over several
calls, or cut by a time limit, keeps what it measured; every row records its commit and date.
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
from dataclasses import dataclass

import torch

from kvcompile.errors import KvcompileError
from kvcompile.io.hf_checkpoint import gguf_name
from kvcompile.kv.kv_pages import min_arena_bytes
from kvcompile.models.config import ModelConfig
from kvcompile.models.llama import LlamaModel
from kvcompile.ops import kv_format as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH-proof
from bench_util import add_run_options, free_memory, log, run_meta, sync  # noqa: E402
from hf_baseline import build_hf, hf_available, hf_decode, hf_prefill, run_hf  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "streaming.json")
SYSTEMS = ("ours", "ours-graphs", "ours-resident", "hf-offload", "hf-dynamic")
STREAMED = ("ours", "ours-graphs")      # systems that stream through --arena-mib
MB = 1e6
GB = 1e9


@dataclass(frozen=True)
class Geometry:
    name: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    rms_eps: float = 1e-5


LLAMA3_8B = Geometry("llama-3-8b (random weights)", 32, 4096, 14336, 32, 8, 128, 128256, 500000.0)
TINY = Geometry("tiny (random weights)", 4, 128, 256, 4, 2, 64, 512, 10000.0)


# ---- weights: one seeded set, HF names, shared by both models --------------------------------
def hf_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    kv = g.n_kv_heads * g.head_dim
    shapes = {"model.embed_tokens.weight": (g.vocab, g.hidden), "model.norm.weight": (g.hidden,),
              "lm_head.weight": (g.vocab, g.hidden)}
    for i in range(g.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (g.hidden,),
            p + "post_attention_layernorm.weight": (g.hidden,),
            p + "self_attn.q_proj.weight": (g.n_heads * g.head_dim, g.hidden),
            p + "self_attn.k_proj.weight": (kv, g.hidden),
            p + "self_attn.v_proj.weight": (kv, g.hidden),
            p + "self_attn.o_proj.weight": (g.hidden, g.n_heads * g.head_dim),
            p + "mlp.gate_proj.weight": (g.ffn, g.hidden),
            p + "mlp.up_proj.weight": (g.ffn, g.hidden),
            p + "mlp.down_proj.weight": (g.hidden, g.ffn)})
    return shapes


def fill_weights(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """In place: norms 1, matrices normal * 0.02 (a trained model's scale, so activations
    stay finite through 32 layers); tensor k of the sorted names from seed + k, so the
    weights do not depend on which model allocated them."""
    for k, name in enumerate(sorted(tensors)):
        t = tensors[name]
        if name.endswith("norm.weight"):
            t.fill_(1.0)
            continue
        gen = torch.Generator(device=t.device).manual_seed(seed + k)
        t.normal_(0.0, 0.02, generator=gen)


def our_config(g: Geometry, context_length: int) -> ModelConfig:
    # HF keeps q/k rows in the NEOX rope layout; rope_neox=True reads them as stored.
    return ModelConfig(arch="llama", n_layers=g.n_layers, hidden=g.hidden, ffn=g.ffn,
                       n_heads=g.n_heads, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim,
                       vocab_size=g.vocab, context_length=context_length, rms_eps=g.rms_eps,
                       rope_theta=g.rope_theta, rope_neox=True, name=g.name)


def build_models(g: Geometry, context_length: int, dtype, device, seed: int, want_hf: bool):
    """(ours, hf or None, hf_config or None, hf_reason): the same weight tensors in both."""
    hf, hf_cfg, reason = None, None, None
    if want_hf:
        if hf_available() is None:
            reason = "transformers is not installed"
        else:
            hf, hf_cfg = build_hf(g, context_length, dtype, device)
    if hf is not None:
        tensors = dict(hf.state_dict())
        missing = set(hf_shapes(g)) - set(tensors)
        if missing:
            raise RuntimeError(f"HF model lacks {sorted(missing)[:3]}: update hf_shapes()")
        tensors = {n: tensors[n] for n in hf_shapes(g)}
    else:
        tensors = {n: torch.empty(s, dtype=dtype, device=device) for n, s in hf_shapes(g).items()}
    with torch.no_grad():
        fill_weights(tensors, seed)
    named = {gguf_name(n): t for n, t in tensors.items()}
    # same device and dtype: from_weights assigns the tensors themselves, except the fused
    # q/k/v and gate/up weights it builds (the HF model, when there is one, keeps the parts)
    ours = LlamaModel.from_weights(our_config(g, context_length), named, dtype=dtype,
                                   device=device)
    return ours, hf, hf_cfg, reason


# ---- measurements --------------------------------------------------------------------------
def measure_h2d_gbps(device: torch.device, nbytes: int, reps: int = 5) -> dict:
    """Pinned host -> device copy bandwidth (GB/s, 1e9); on a CPU run a plain memcpy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)          # warm-up (driver mappings, clocks)
    sync(device)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        rates.append(nbytes / (time.perf_counter() - t) / GB)
    del src, dst
    rates.sort()
    return dict(pcie_gbps_measured=rates[len(rates) // 2], pcie_gbps_max=rates[-1],
                pcie_copy_bytes=nbytes, pcie_kind="pinned h2d" if device.type == "cuda"
                else "cpu memcpy (no PCIe)")


def kv_bytes_per_token(g: Geometry, k_type: str, v_type: str, page_size: int = 256) -> int:
    kb = F.page_bytes(F.kv_type(k_type), page_size, g.n_kv_heads, g.head_dim)
    vb = F.page_bytes(F.kv_type(v_type), page_size, g.n_kv_heads, g.head_dim)
    return g.n_layers * (kb + vb) // page_size


def pcie_bound(gbps: float, kv_bytes: int, arena_bytes: int) -> float | None:
    """None: the whole KV fits, nothing must cross PCIe per token (no bound)."""
    streamed = kv_bytes - arena_bytes
    return gbps * GB / streamed if streamed > 0 else None


def device_and_dtype(name: str, cpu_hint: str) -> tuple[torch.device, torch.dtype]:
    """The run's device (a missing CUDA device is an exit with `cpu_hint`) and the weights'
    dtype: the engine's default for it (bf16 on CUDA, fp32 on the CPU)."""
    from kvcompile.engine.dtypes import resolve_dtype
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device; {cpu_hint}")
    return device, resolve_dtype(None, device)


def random_ids(n: int, vocab: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).to(device)


# ---- our model: one Engine a row -------------------------------------------------------------
WARM_STEPS = 4          # decode steps of each Engine's warm-up request


def ours_engine(model, ctx_size: int, kv: str, arena_mib: float = 0, graphs: bool = False,
                ubatch: int = 256):
    """`Engine.from_model` over `model` as a row of ours runs it: `kv` is "K/V" types,
    arena_mib 0 keeps the whole KV on the device; graphs: the executor's programs (the traced
    forward, each decode step one CUDA graph, ring copies included; on the CPU reruns of
    their fixed layouts), strict (a failed trace or capture raises: no row measures a silent
    fallback), else the eager model. No prefix reuse: every request prefills its prompt."""
    import kvcompile
    k_type, v_type = kv.split("/")
    e = kvcompile.Engine.from_model(model, ctx_size=ctx_size, cache_type_k=k_type,
                                    cache_type_v=v_type, ubatch=ubatch,
                                    kv_stream_arena_mib=arena_mib, cuda_graphs=graphs,
                                    compile=graphs, cache_prompt=False, progress=False)
    e.executor.strict = graphs
    return e


def close_engine(e) -> None:
    """The store's copy engine stopped and its arena given back."""
    e.store.close()


def warm_steps(graphs: bool) -> int:
    """Untimed decode steps at the start of the measured request: the first step at its
    context (with graphs: and the capture of that context's layout)."""
    return 2 if graphs else 1


def run_ours(model, ctx: int, kv: str, args, ids, *, arena_mib: float = 0,
             graphs: bool = False, extra=None) -> dict:
    """One Engine (ours_engine) and two requests, greedy: a warm-up (the first
    min(ubatch, ctx / 2) prompt tokens, WARM_STEPS steps: kernels compiled, programs traced
    and captured), then the measured one: `ids` (ctx tokens) prefilled, warm_steps(graphs)
    untimed decode steps and args.decode_steps timed ones, every time taken from the
    GenerationResult. `extra(engine)`: more row fields, read before the Engine closes."""
    prompt = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    n_warm = warm_steps(graphs)
    e = ours_engine(model, len(prompt) + n_warm + args.decode_steps + 1, kv, arena_mib,
                    graphs, args.ubatch)
    try:
        n = max(1, min(args.ubatch, len(prompt) // 2))
        warm = e.generate(prompt[:n], max_tokens=WARM_STEPS, temperature=0)
        first = len(e.store.telemetry)
        r = e.generate(prompt, max_tokens=n_warm + args.decode_steps + 1, temperature=0)
        row = measured(e, r, first, n_warm, args.decode_steps)
        row["warmup"] = dict(prompt_tokens=n, ttft_s=warm.prefill_s,
                             warmup_s=warm.programs.get("warmup_s"),
                             captures=warm.programs.get("captures"))
        return {**row, **extra(e)} if extra is not None else row
    finally:
        close_engine(e)


def measured(e, r, first: int, n_warm: int, steps: int) -> dict:
    """A measured request's times and telemetry: prefill_s (to the first token), decode_s
    (the steps after the n_warm untimed ones), the first 8 decoded tokens after the
    prefill's (warm steps included, so they compare across systems), the program events,
    and from the store's telemetry since `first` the h2d bytes a timed step and each timed
    step's record."""
    from kvcompile.kv.telemetry import summarize
    if len(r.step_s) != n_warm + steps:
        raise RuntimeError(f"the request made {len(r.step_s)} decode steps, not "
                           f"{n_warm + steps} ({r.finish_reason})")
    tel = e.store.telemetry[first:]
    n_prefill = len(tel) - len(r.step_s)         # one record a forward: chunks, then steps
    dec = tel[n_prefill + n_warm:]
    row = dict(prefill_s=r.prefill_s, decode_s=sum(r.step_s[n_warm:]),
               decode_tokens=r.token_ids[1:9], warm_steps=n_warm,
               cached_tokens=r.cached_tokens, executor_mode=e.executor.mode,
               pipeline=e.pipeline, programs=r.programs, step_ms=r.step_ms(),
               host_step_ms=r.host_step_ms(),
               h2d_bytes_per_token=sum(s.h2d_bytes for s in dec) / max(len(dec), 1),
               h2d_source="telemetry" if e.store.streams else "all resident")
    if e.executor.capture:
        row.update(graphs=r.programs.get("total_captures"),
                   graph_replays=r.programs.get("replays"))
    row["telemetry"] = summarize(dec)
    row["telemetry"]["prefill"] = summarize(tel[:n_prefill])
    # per timed step: host ms from the forward's open to its close, split changes, misses
    row["steps"] = [dict(host_ms=round(s.wall_ms, 2), repart=s.repartitioned,
                         misses=s.readiness_misses, copy_busy=round(s.copy_busy_pct, 1),
                         resident=s.resident_pages, ring=s.ring_slots) for s in dec]
    return row


def smallest_arena_mib(model, max_tokens: int, kv: str) -> float:
    """The smallest arena for max_tokens of `kv` KV (a ring of one layer's pages): every
    layer streams."""
    k_type, v_type = kv.split("/")
    need = min_arena_bytes(model.layer_plan.kv_config(model.config), max_tokens, k_type,
                           v_type)
    return (need + 256) / 2**20


def ours_reference(model, ids: list[int], steps: int, kv: str, arena_mib: float):
    """Eager, through an Engine: every row's logits of `ids` in one executor step over the
    empty store, then the greedy tokens of a request of `steps` tokens with that prompt."""
    e = ours_engine(model, len(ids) + steps + 1, kv, arena_mib)
    try:
        logits = e.executor.step(ids, 0, all_rows=True).float().clone()
        greedy = e.generate(ids, max_tokens=steps, temperature=0).token_ids
    finally:
        close_engine(e)
    return logits, greedy


def finish(row: dict, res: dict, decode_steps: int) -> None:
    """A measured row: the run's results, ok, tok/s and the share of its PCIe bound."""
    row.update(res)
    row["status"] = "ok"
    row["prefill_tok_s"] = row["context"] / res["prefill_s"] if res.get("prefill_s") else None
    row["decode_tok_s"] = decode_steps / res["decode_s"]
    b = row["pcie_bound_tok_s"]
    row["decode_vs_bound"] = row["decode_tok_s"] / b if b else None


def failed(row: dict, e: Exception) -> None:
    """A row whose run raised: skipped (out of memory, or refused with a KvcompileError)
    with the reason, else an error with its traceback in the log."""
    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
    row.update(status="skipped" if oom or isinstance(e, KvcompileError) else "error",
               reason=f"{'OOM: ' if oom else ''}{type(e).__name__}: {e}"[:500])
    if row["status"] == "error":
        traceback.print_exc()
    log(f"{row['system']} @ {row['context']}: {row['status']}: {row['reason'][:200]}")


# ---- sanity: ours against HF (and streaming against resident) on a short prompt ------------
def sanity(ours, hf, g, args, device, kvs) -> dict:
    n, steps = 48, 8
    ids = random_ids(n, g.vocab, args.seed + 1, device)
    res = {"prompt_tokens": n, "greedy_steps": steps}
    ref = None
    if hf is not None:
        with torch.inference_mode():
            ref = hf(input_ids=ids[None], use_cache=False).logits[0].float()
            from transformers import DynamicCache
            c = DynamicCache()
            first = int(hf_prefill(hf, c, ids, n, "").argmax())
            res["hf_greedy"] = [first] + hf_decode(hf, c, first, steps - 1, device)
            # bf16 noise floor: HF against itself, the prompt in two chunks vs one forward
            c = DynamicCache()
            half = hf_prefill(hf, c, ids, n // 2, "").float()
            res["hf_two_chunks_vs_full_last_row_rel"] = float(
                (half - ref[-1]).abs().max() / ref[-1].abs().max())
            del c
    prompt = ids.tolist()
    for kv in dict.fromkeys(["bf16/bf16", *kvs]):   # bf16 KV: the one nearest HF's
        for name, arena in (("resident", 0),
                            ("stream", smallest_arena_mib(ours, n + steps + 1, kv))):
            logits, greedy = ours_reference(ours, prompt, steps, kv, arena)
            key = f"ours {kv} {name}"
            entry = {"greedy": greedy}
            if name == "resident":
                base = (logits, greedy)
            else:
                entry["bitwise_equal_resident"] = bool(torch.equal(logits, base[0]))
                entry["greedy_equal_resident"] = greedy == base[1]
            if ref is not None:
                entry["rel_max_diff_vs_hf"] = float((logits - ref).abs().max() / ref.abs().max())
                entry["last_row_rel_vs_hf"] = float((logits[-1] - ref[-1]).abs().max()
                                                    / ref[-1].abs().max())
                entry["top1_agree_vs_hf"] = float((logits.argmax(-1) == ref.argmax(-1))
                                                  .float().mean())
                entry["greedy_equal_hf"] = sum(a == b for a, b in zip(greedy, res["hf_greedy"]))
            res[key] = entry
    return res


# ---- rows, table, JSON -------------------------------------------------------------------------
def row_key(r: dict) -> tuple:
    """`run` names another script's rows (bench_compiled: "compiled"), so its eager twins
    never replace this table's rows of the same configuration."""
    return (r["system"], r["context"], r["kv_type"], r["arena_mib"], r.get("geometry"),
            r.get("run"))


def save(rows: list[dict], meta: dict, path: str, section: str | None = None) -> None:
    """Merge rows into the file at path (same row_key replaced). The file's meta becomes
    `meta`, or with `section` keeps the old meta and puts `meta` under that key (another
    script appending its rows)."""
    old, old_meta = [], {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
            old, old_meta = data.get("rows", []), data.get("meta", {})
        except (json.JSONDecodeError, AttributeError):
            old = []
    if section is not None:
        meta = {**old_meta, section: meta}
    keys = {row_key(r) for r in rows}
    merged = [r for r in old if row_key(r) not in keys] + rows
    merged.sort(key=lambda r: (r["context"], SYSTEMS.index(r["system"])
                               if r["system"] in SYSTEMS else 9, r["kv_type"]))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": merged, "targets": targets(merged)}, f, indent=2)
    os.replace(tmp, path)


def targets(rows: list[dict]) -> list[dict]:
    """Per context and KV type: ours-streaming decode / PCIe bound and / hf-offload decode
    (this script's rows only: ratios within one run)."""
    out = []
    ok = [r for r in rows if r.get("status") == "ok" and r.get("run") is None]
    for r in ok:
        if r["system"] not in STREAMED:
            continue
        hf = [h for h in ok if h["system"] == "hf-offload" and h["context"] == r["context"]
              and h.get("geometry") == r.get("geometry")]
        t = dict(system=r["system"], context=r["context"], kv_type=r["kv_type"],
                 arena_mib=r["arena_mib"],
                 decode_vs_pcie_bound=r.get("decode_vs_bound"),
                 decode_vs_hf_offload=(r["decode_tok_s"] / hf[0]["decode_tok_s"]) if hf else None)
        res = [x for x in ok if x["system"] == "ours-resident" and x["context"] == r["context"]
               and x["kv_type"] == r["kv_type"] and x.get("geometry") == r.get("geometry")]
        t["decode_vs_resident"] = r["decode_tok_s"] / res[0]["decode_tok_s"] if res else None
        t["meets_0.8x_bound"] = (t["decode_vs_pcie_bound"] >= 0.8
                                 if t["decode_vs_pcie_bound"] is not None else None)
        t["meets_4x_hf_offload"] = (t["decode_vs_hf_offload"] >= 4
                                    if t["decode_vs_hf_offload"] is not None else None)
        out.append(t)
    return out


def fmt(x, spec: str) -> str:
    if x is None:
        return "-"
    return format(x, spec)


def print_table(rows: list[dict], sanity_res: dict | None, targets_too: bool = True) -> None:
    hdr = (f"{'system':14} {'context':>8} {'kv':>10} {'arena MiB':>9} {'KV GB':>7} "
           f"{'prefill t/s':>11} {'decode t/s':>10} {'h2d MB/tok':>10} {'PCIe GB/s':>9} "
           f"{'bound t/s':>9} {'x bound':>7}  status")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ok = r.get("status") == "ok"
        print(f"{r['system']:14} {r['context']:>8} {r['kv_type']:>10} {r['arena_mib']:>9g} "
              f"{r['kv_bytes'] / GB:7.2f} {fmt(r.get('prefill_tok_s'), '11.1f')} "
              f"{fmt(r.get('decode_tok_s'), '10.2f')} "
              f"{fmt(r.get('h2d_bytes_per_token') and r['h2d_bytes_per_token'] / MB, '10.1f')} "
              f"{r['pcie_gbps_measured']:9.1f} {fmt(r.get('pcie_bound_tok_s'), '9.2f')} "
              f"{fmt(r.get('decode_vs_bound'), '7.2f')}  "
              f"{'ok' if ok else r.get('status')}{'' if ok else ': ' + str(r.get('reason'))[:80]}")
    for t in targets(rows) if targets_too else ():
        hf = ("" if t["decode_vs_hf_offload"] is None else
              f"{fmt(t['decode_vs_hf_offload'], '.2f')} x hf-offload "
              f"(>= 4: {t['meets_4x_hf_offload']}), ")
        print(f"target @ {t['context']} ({t['system']} {t['kv_type']}): decode "
              f"{fmt(t['decode_vs_pcie_bound'], '.2f')} x PCIe bound "
              f"(>= 0.8: {t['meets_0.8x_bound']}), {hf}"
              f"{fmt(t['decode_vs_resident'], '.2f')} x ours-resident")
    if sanity_res:
        print("sanity (short prompt, same weights):")
        for k, v in sanity_res.items():
            if isinstance(v, float):
                print(f"  {k}: {v:.3g}")
            if isinstance(v, dict):
                print(f"  {k}: " + ", ".join(f"{a}={b}" for a, b in v.items() if a != "greedy"))


# ---- main --------------------------------------------------------------------------------------
def parse_lists(ap, args, systems) -> None:
    """--systems and --kv from comma lists to checked lists (ap.error names the bad entry)."""
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in systems]
    if bad:
        ap.error(f"unknown systems {bad}; choose from {','.join(systems)}")
    args.kv = [k for k in args.kv.split(",") if k]
    for k in args.kv:
        parts = k.split("/")
        if len(parts) != 2 or any(p not in F.KV_TYPES for p in parts):
            ap.error(f"--kv entries are K/V type pairs from {sorted(F.KV_TYPES)}, got {k!r}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--kv", default="q8_0/q4_0", help="K/V types of our runs, comma separated "
                    "(e.g. q8_0/q4_0,bf16/bf16); HF always keeps bf16 KV")
    ap.add_argument("--arena-mib", type=float, default=None, help="default 2048 (tiny: 0.9)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--ubatch", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry and contexts (logic check)")
    ap.add_argument("--quick", action="store_true", help="32K only, 8 decode steps")
    ap.add_argument("--hf-offload-prefill", action="store_true",
                    help="time hf-offload's own offloaded prefill even when hf-dynamic runs")
    add_run_options(ap, RESULTS)
    args = ap.parse_args(argv)
    if args.tiny:
        if args.contexts == ap.get_default("contexts"):
            args.contexts = "512,1024"
        if args.ubatch == ap.get_default("ubatch"):
            args.ubatch = 128
        args.pcie_mib = min(args.pcie_mib, 16)
    if args.quick:
        args.contexts = "32768" if not args.tiny else args.contexts.split(",")[0]
        args.decode_steps = min(args.decode_steps, 8)
    if args.arena_mib is None:
        args.arena_mib = 0.9 if args.tiny else 2048
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "streaming_tiny.json")
                            if args.tiny else RESULTS)
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    parse_lists(ap, args, SYSTEMS)
    if args.decode_steps < 1 or args.ubatch < 1 or not args.contexts:
        ap.error("--decode-steps, --ubatch and --contexts must be positive")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device, dtype = device_and_dtype(args.device, "use --device cpu --tiny for the CPU logic check")
    g = TINY if args.tiny else LLAMA3_8B
    ctx_len = max(args.contexts) + args.decode_steps + 64
    hf_systems = [s for s in args.systems if s.startswith("hf-")]
    t_all = time.perf_counter()

    log(f"PCIe: {args.pcie_mib} MiB pinned host -> {device}")
    pcie = measure_h2d_gbps(device, args.pcie_mib << 20)
    log(f"PCIe: {pcie['pcie_gbps_measured']:.1f} GB/s (median), {pcie['pcie_gbps_max']:.1f} max")

    log(f"weights: {g.name}, {dtype}, on {device}")
    t = time.perf_counter()
    ours, hf, hf_cfg, hf_reason = build_models(g, ctx_len, dtype, device, args.seed,
                                               bool(hf_systems) or not args.no_sanity)
    sync(device)
    if hf is not None:
        shared = ours.embed.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        log(f"weights shared by both models: {shared}")
    log(f"weights: {time.perf_counter() - t:.1f} s"
        + (f" (HF skipped: {hf_reason})" if hf_reason else ""))
    if hf is not None and device.type != "cuda" and "hf-offload" in hf_systems:
        hf_systems.remove("hf-offload")
        skip_offload = "DynamicCache(offloading=True) needs CUDA"
    else:
        skip_offload = None

    meta = dict(geometry=g.name, layers=g.n_layers, hidden=g.hidden, ffn=g.ffn,
                n_heads=g.n_heads, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim,
                vocab=g.vocab, weights_dtype=str(dtype).replace("torch.", ""),
                device=torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine(),
                torch=torch.__version__, transformers=hf_available(), ubatch=args.ubatch,
                decode_steps=args.decode_steps, **pcie)
    run = run_meta()                # commit and date of this run, in its meta and every row
    meta.update(commit=run["commit"], date=run["date"])
    sanity_res = None
    if not args.no_sanity:
        log("sanity: ours vs HF on a short prompt")
        try:
            sanity_res = sanity(ours, hf, g, args, device, args.kv)
        except Exception as e:     # the benchmark still runs; the record says why
            traceback.print_exc()
            sanity_res = {"error": f"{type(e).__name__}: {e}"}
        meta["sanity"] = sanity_res
        free_memory(device)

    # (each row of ours warms its own Engine up: run_ours)
    if hf is not None and hf_systems:
        log("warm-up: hf")
        from transformers import DynamicCache
        with torch.inference_mode():
            c = DynamicCache(config=hf_cfg)
            hf_decode(hf, c, int(hf_prefill(hf, c, random_ids(64, g.vocab, 7, device), 64, "")
                                 .argmax()), 2, device)
        del c
    free_memory(device)

    rows: list[dict] = []
    if args.fresh and os.path.exists(args.out):
        os.remove(args.out)

    def base(system, ctx, kv, arena_mib):
        k_type, v_type = kv.split("/")
        kv_bytes = ctx * kv_bytes_per_token(g, k_type, v_type)
        return dict(system=system, context=ctx, kv_type=kv, arena_mib=arena_mib,
                    geometry=g.name, kv_bytes=kv_bytes,
                    pcie_gbps_measured=pcie["pcie_gbps_measured"],
                    pcie_bound_tok_s=pcie_bound(pcie["pcie_gbps_measured"], kv_bytes,
                                                int(arena_mib * 2**20))
                    if system in STREAMED + ("hf-offload",) else None,
                    decode_steps=args.decode_steps, device=meta["device"],
                    commit=run["commit"], date=run["date"])

    def record(row):
        rows.append(row)
        save(rows, meta, args.out)
        free_memory(device)

    for ctx in args.contexts:
        ids = random_ids(ctx, g.vocab, args.seed + ctx, device)
        for system in [s for s in args.systems if s.startswith("ours")]:
            arena = args.arena_mib if system in STREAMED else 0
            for kv in args.kv:
                row = base(system, ctx, kv, arena)
                log(f"{system} {kv} arena {arena:g} MiB @ {ctx}")
                try:
                    finish(row, run_ours(ours, ctx, kv, args, ids, arena_mib=arena,
                                         graphs=system == "ours-graphs"), args.decode_steps)
                    log(f"  prefill {row['prefill_tok_s']:.0f} tok/s, decode "
                        f"{row['decode_tok_s']:.2f} tok/s, h2d "
                        f"{row['h2d_bytes_per_token'] / MB:.1f} MB/token")
                except Exception as e:
                    failed(row, e)
                record(row)
        hf_rows = {s: base(s, ctx, "bf16/bf16", 0) for s in args.systems if s.startswith("hf-")}
        for s, row in hf_rows.items():
            if hf is None or (s == "hf-offload" and skip_offload):
                row.update(status="skipped", reason=hf_reason or skip_offload)
                record(row)
        todo = [s for s in hf_rows if hf is not None and s in hf_systems]
        if todo:
            log(f"{', '.join(todo)} @ {ctx}")
            try:
                res = run_hf(hf, hf_cfg, todo, ctx, args, device, ids)
            except Exception as e:
                for s in todo:
                    failed(hf_rows[s], e)
                res = {}
            for s in todo:
                row = hf_rows[s]
                if s in res:
                    finish(row, res[s], args.decode_steps)
                    # offloading moves the whole KV in each decode step (layer by layer)
                    row["h2d_bytes_per_token"] = row["kv_bytes"] if s == "hf-offload" else 0
                    row["h2d_source"] = "model: every layer prefetched each step" \
                        if s == "hf-offload" else "all resident"
                    log(f"  {s}: prefill {fmt(row['prefill_tok_s'], '.0f')} tok/s, decode "
                        f"{row['decode_tok_s']:.2f} tok/s")
                elif "status" not in row:
                    row.update(status="error", reason="no result")
                record(row)
    log(f"done in {time.perf_counter() - t_all:.0f} s; rows in {args.out}")
    everything = rows
    if os.path.exists(args.out):
        with open(args.out) as f:
            everything = json.load(f)["rows"]
    print_table([r for r in everything if r.get("geometry") == g.name], sanity_res)
    return rows


if __name__ == "__main__":
    main()
