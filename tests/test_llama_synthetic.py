"""LlamaModel variants that SmolLM2 does not exercise, against llama.cpp on tiny random
F32 GGUFs written with the gguf package: NEOX rope with Q/K/V biases and an untied head
(arch qwen2), head dim 128 with 4 query heads per KV head, linear rope scaling (arch llama).

The tokenizer metadata is borrowed from SmolLM2 (llama.cpp needs one to load a file);
tokens are fresh random ids.
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from kvcompile.models.config import ModelConfig
from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from llama_oracle import agreement, llama_cpp, llama_cpp_logits

N_TOKENS = 300          # crosses a 256-position page boundary


def random_weights(c: ModelConfig, bias: bool, tied: bool, g: np.random.Generator) -> dict:
    def mat(out_dim, in_dim):
        return (g.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim):
        return (1.0 + 0.1 * g.standard_normal(dim)).astype(np.float32)

    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    w = {"token_embd.weight": (0.2 * g.standard_normal((c.vocab_size, c.hidden))).astype(np.float32),
         "output_norm.weight": norm(c.hidden)}
    if not tied:
        w["output.weight"] = mat(c.vocab_size, c.hidden) * 4   # peaky logits: top-1 is meaningful
    for i in range(c.n_layers):
        p = f"blk.{i}."
        w |= {p + "attn_norm.weight": norm(c.hidden), p + "ffn_norm.weight": norm(c.hidden),
              p + "attn_q.weight": mat(q_dim, c.hidden) * 2, p + "attn_k.weight": mat(kv_dim, c.hidden) * 2,
              p + "attn_v.weight": mat(kv_dim, c.hidden), p + "attn_output.weight": mat(c.hidden, q_dim),
              p + "ffn_gate.weight": mat(c.ffn, c.hidden), p + "ffn_up.weight": mat(c.ffn, c.hidden),
              p + "ffn_down.weight": mat(c.hidden, c.ffn)}
        if bias:
            for name, dim in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                w[p + name + ".bias"] = (0.5 * g.standard_normal(dim)).astype(np.float32)
    return w


def write_gguf(path, c: ModelConfig, weights: dict, tokenizer_src) -> None:
    a = c.arch
    w = gguf.GGUFWriter(str(path), a)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ffn)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_dimension_count(c.rotary_dim)
    if c.rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_scaling["factor"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    r = gguf.GGUFReader(str(tokenizer_src))
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub)
    for name, arr in weights.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CASES = {
    # qwen2: NEOX rope (llama.cpp's rope type for this arch), Q/K/V biases, separate head
    "qwen2-neox-bias": (ModelConfig(arch="qwen2", n_layers=2, hidden=256, ffn=512, n_heads=4,
                                    n_kv_heads=2, head_dim=64, vocab_size=49152,
                                    context_length=1024, rms_eps=1e-6, rope_theta=1e6,
                                    rope_neox=True), True, False),
    # llama: adjacent-pair rope, head dim 128, 8 query heads on 2 KV heads, tied head
    "llama-hd128-gqa4": (ModelConfig(arch="llama", n_layers=2, hidden=512, ffn=768, n_heads=4,
                                     n_kv_heads=1, head_dim=128, vocab_size=49152,
                                     context_length=1024, rope_theta=10000.0,
                                     tie_embeddings=True), False, True),
    # llama with linear rope scaling (positions divided by the factor)
    "llama-linear-rope-x4": (ModelConfig(arch="llama", n_layers=2, hidden=256, ffn=512, n_heads=4,
                                         n_kv_heads=2, head_dim=64, vocab_size=49152,
                                         context_length=1024, rope_theta=10000.0,
                                         rope_scaling={"type": "linear", "factor": 4.0}),
                             False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_random_model_matches_llama_cpp(case, tmp_path, smollm2_path):
    config, bias, tied = CASES[case]
    seed = int.from_bytes(os.urandom(4), "little")
    g = np.random.default_rng(seed)
    weights = random_weights(config, bias, tied, g)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, config, weights, smollm2_path)

    tokens = g.integers(0, config.vocab_size, N_TOKENS).tolist()
    llm = llama_cpp(path, n_ctx=512)
    try:
        ref = llama_cpp_logits(llm, tokens)
    finally:
        llm.close()

    model = LlamaModel.from_weights(config, {k: torch.from_numpy(v) for k, v in weights.items()})
    cache = KvStore(config, N_TOKENS)
    with torch.inference_mode():
        ours = torch.cat([model(torch.tensor(tokens[a:b]), torch.arange(a, b), cache)
                          for a, b in ((0, 200), (200, 201), (201, N_TOKENS))])
    top1, kl, kl_max = agreement(ours, ref)
    diff = (ours - ref).abs().max().item()
    print(f"{case} (seed {seed}): top-1 {top1:.4%}, mean KL {kl:.3e}, max KL {kl_max:.3e}, "
          f"max |logit diff| {diff:.3e}, logit std {ref.std().item():.2f}")
    assert top1 >= 0.99 and kl <= 1e-5
