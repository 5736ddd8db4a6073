"""Hugging Face transformers as the benchmark's peer: LlamaForCausalLM on the device with
DynamicCache() (bf16 KV on the device) and DynamicCache(offloading=True) (KV on the host,
layers prefetched back one at a time), prefilled in ubatch chunks and decoded greedily."""
from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from bench_util import free_memory, sync


def hf_available() -> str | None:
    try:
        import transformers
        return transformers.__version__
    except ImportError:
        return None


def build_hf(g, context_length: int, dtype, device):
    """LlamaForCausalLM allocated on the device in dtype (its own init is overwritten)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.ffn,
                      num_hidden_layers=g.n_layers, num_attention_heads=g.n_heads,
                      num_key_value_heads=g.n_kv_heads, head_dim=g.head_dim,
                      max_position_embeddings=context_length, rms_norm_eps=g.rms_eps,
                      rope_theta=g.rope_theta, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False), cfg


def hf_cache_kwarg(hf) -> str:
    """The forward's name for the cache: `cache` in recent transformers 5.x releases,
    `past_key_values` before."""
    import inspect
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def hf_step(hf, cache, ids: torch.Tensor):
    kw = {hf_cache_kwarg(hf): cache}
    out = hf(input_ids=ids[None], use_cache=True, logits_to_keep=1, **kw)
    return out.logits[0, -1]


def hf_prefill(hf, cache, ids, ubatch, desc):
    logits = None
    for start in tqdm(range(0, ids.numel(), ubatch), desc=desc, unit="chunk", file=sys.stderr,
                      mininterval=10, disable=ids.numel() <= ubatch):
        logits = hf_step(hf, cache, ids[start:start + ubatch])
    return logits


def hf_decode(hf, cache, first: int, n: int, device) -> list[int]:
    toks, tok = [], first
    for _ in range(n):
        tok = int(hf_step(hf, cache, torch.tensor([tok], device=device)).argmax())
        toks.append(tok)
    return toks


def hf_timed_decode(hf, cache, first, steps, device) -> tuple[float, list[int]]:
    warm = hf_decode(hf, cache, first, 1, device)
    sync(device)
    t = time.perf_counter()
    toks = hf_decode(hf, cache, warm[-1], steps, device)
    sync(device)
    return time.perf_counter() - t, toks


def to_offloaded(cache, hf_cfg):
    """The prefilled DynamicCache as an offloading one in the state an offloaded prefill
    leaves: every layer on the host except layer 0, which the last layer prefetched back."""
    from transformers import DynamicCache

    data = [(layer.keys, layer.values) for layer in cache.layers]
    off = DynamicCache(data, config=hf_cfg, offloading=True)
    del data
    for i in range(1, len(off.layers)):
        off.offload(i, off.only_non_sliding)
    return off


def run_hf(hf, hf_cfg, systems, ctx, args, device, ids) -> dict[str, dict]:
    """hf-dynamic and/or hf-offload; returns {system: measurements}."""
    from transformers import DynamicCache

    out = {}
    steps = args.decode_steps
    own_offload_prefill = "hf-offload" in systems and (
        args.hf_offload_prefill or "hf-dynamic" not in systems)
    if "hf-dynamic" in systems or not own_offload_prefill:
        cache = DynamicCache(config=hf_cfg)
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            first = int(hf_prefill(hf, cache, ids, args.ubatch, f"hf prefill {ctx}").argmax())
        sync(device)
        prefill_s = time.perf_counter() - t
        with torch.inference_mode():
            off = to_offloaded(cache, hf_cfg) if "hf-offload" in systems and \
                not own_offload_prefill else None
            if off is not None:             # the offloaded copy first: dynamic decode grows KV
                decode_s, toks = hf_timed_decode(hf, off, first, steps, device)
                out["hf-offload"] = dict(prefill_s=None, decode_s=decode_s, decode_tokens=toks[:8],
                                         note="KV from the hf-dynamic prefill, then offloaded")
                del off
                free_memory(device)
            if "hf-dynamic" in systems:
                decode_s, toks = hf_timed_decode(hf, cache, first, steps, device)
                out["hf-dynamic"] = dict(prefill_s=prefill_s, decode_s=decode_s,
                                         decode_tokens=toks[:8])
            if "hf-offload" in out:
                out["hf-offload"]["prefill_s_dynamic"] = prefill_s
        del cache
        free_memory(device)
    if own_offload_prefill:
        cache = DynamicCache(config=hf_cfg, offloading=True)
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            first = int(hf_prefill(hf, cache, ids, args.ubatch, f"hf-offload prefill {ctx}")
                        .argmax())
        sync(device)
        prefill_s = time.perf_counter() - t
        with torch.inference_mode():
            decode_s, toks = hf_timed_decode(hf, cache, first, steps, device)
        out["hf-offload"] = dict(prefill_s=prefill_s, decode_s=decode_s, decode_tokens=toks[:8])
        del cache
        free_memory(device)
    return out
