"""Synthetic GGUF models: random weights with sane scales, full metadata, a real tokenizer.

Used to test architectures for which no small real checkpoint exists (qwen35) and to make
benchmark-sized models on the device. The file is streamed: the tensor plan (names, shapes,
types, byte sizes) is fixed first, headers are written from it, then each tensor is
generated, converted and appended in row chunks, so a 54 GB model never sits in RAM.

Scales keep activations O(1): matrices get std gain / sqrt(fan_in), norms ~1, and the
recurrent (GDN) gates get decays spanning slow to fast forgetting. Values depend only on
(seed, tensor name, shape, type), not on the write order or thread count
(synthetic_values).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import gguf
import numpy as np

from kvcompile.errors import UnsupportedModelError
from kvcompile.io.gguf.synthetic_presets import SyntheticConfig, add_model_metadata, preset_config
from kvcompile.io.gguf.synthetic_values import stream_chunks
from kvcompile.io.gguf.synthetic_vocab import add_tokenizer

__all__ = ["SyntheticConfig", "PlannedTensor", "preset_config", "tensor_plan",
           "write_synthetic_gguf", "WEIGHT_TYPES"]

# weight types of the matrices, with the general.file_type written (the K mixes' labels:
# every matrix whose rows fit the blocks takes the one type, like llama.cpp's --pure)
_F = gguf.LlamaFileType
WEIGHT_TYPES = {
    "f32": _F.ALL_F32, "f16": _F.MOSTLY_F16, "bf16": _F.MOSTLY_BF16, "q8_0": _F.MOSTLY_Q8_0,
    "q4_0": _F.MOSTLY_Q4_0, "q4_1": _F.MOSTLY_Q4_1, "q5_0": _F.MOSTLY_Q5_0,
    "q5_1": _F.MOSTLY_Q5_1, "q2_k": _F.MOSTLY_Q2_K, "q3_k": _F.MOSTLY_Q3_K_M,
    "q4_k": _F.MOSTLY_Q4_K_M, "q5_k": _F.MOSTLY_Q5_K_M, "q6_k": _F.MOSTLY_Q6_K,
    "iq4_nl": _F.MOSTLY_IQ4_NL, "iq4_xs": _F.MOSTLY_IQ4_XS,
}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]      # PyTorch order [out, in]
    ggml_type: gguf.GGMLQuantizationType
    init: str                   # see synthetic_values._values
    scale: float                # normal: std; norm: spread around 1; uniform: width
    low: float = 0.0            # uniform, neg_log_uniform: lower end
    values: tuple[float, ...] = ()   # init "values": the tensor itself (rope_freqs)

    @property
    def n_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block * size


def weight_qtype(weight_type: str) -> gguf.GGMLQuantizationType:
    if weight_type.lower() not in WEIGHT_TYPES:
        raise UnsupportedModelError(f"weight type {weight_type!r} cannot be written; use one "
                                    f"of {', '.join(WEIGHT_TYPES)}")
    return gguf.GGMLQuantizationType[weight_type.upper()]


def tensor_plan(cfg: SyntheticConfig, weight_type: str = "f32") -> list[PlannedTensor]:
    """Every tensor of the model in file order. Matrices take `weight_type` when their
    rows fit its blocks; vectors and the conv kernel stay F32 (as llama.cpp converts them)."""
    qtype = weight_qtype(weight_type)
    plan: list[PlannedTensor] = []

    def mat(name, out, inp, gain=1.0):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        t = qtype if inp % block == 0 else gguf.GGMLQuantizationType.F32
        plan.append(PlannedTensor(name, (out, inp), t, "normal", gain / math.sqrt(inp)))

    def vec(name, n, init="norm", scale=0.1, low=0.0):
        plan.append(PlannedTensor(name, (n,), gguf.GGMLQuantizationType.F32, init, scale, low))

    h, q_rows = cfg.hidden, cfg.n_heads * cfg.head_dim
    kv_rows = cfg.n_kv_heads * cfg.head_dim
    plan.append(PlannedTensor("token_embd.weight", (cfg.vocab_size, h), qtype, "normal", 1.0))
    if cfg.rope_scaling == "llama3":
        plan.append(_rope_freqs(cfg))

    def attention(p, gated):
        mat(f"{p}.attn_q.weight", q_rows * (2 if gated else 1), h)
        mat(f"{p}.attn_k.weight", kv_rows, h)
        mat(f"{p}.attn_v.weight", kv_rows, h)
        if cfg.qkv_bias:            # qwen2's biases are large next to the projections
            for name, n in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                vec(f"{p}.attn_{name}.bias", n, "normal", 0.5)
        mat(f"{p}.attn_output.weight", h, q_rows, gain=cfg.residual_gain)
        if gated or cfg.qk_norm:
            vec(f"{p}.attn_q_norm.weight", cfg.head_dim)
            vec(f"{p}.attn_k_norm.weight", cfg.head_dim)

    def ffn(p):
        mat(f"{p}.ffn_gate.weight", cfg.ffn, h)
        mat(f"{p}.ffn_up.weight", cfg.ffn, h)
        mat(f"{p}.ffn_down.weight", h, cfg.ffn, gain=cfg.residual_gain)

    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        vec(f"{p}.attn_norm.weight", h)
        if not cfg.hybrid:
            attention(p, gated=False)
            vec(f"{p}.ffn_norm.weight", h)
            if cfg.post_norms:
                vec(f"{p}.post_attention_norm.weight", h)
                vec(f"{p}.post_ffw_norm.weight", h)
        else:
            vec(f"{p}.post_attention_norm.weight", h)
            if cfg.is_full_attention(i):
                attention(p, gated=True)
            else:
                _gdn_tensors(cfg, p, mat, vec, plan)
        ffn(p)
    for i in range(cfg.n_layers, cfg.n_layers + cfg.nextn_layers):
        p = f"blk.{i}"
        vec(f"{p}.attn_norm.weight", h)
        vec(f"{p}.post_attention_norm.weight", h)
        attention(p, gated=True)
        ffn(p)
        mat(f"{p}.nextn.eh_proj.weight", h, 2 * h)
        vec(f"{p}.nextn.enorm.weight", h)
        vec(f"{p}.nextn.hnorm.weight", h)
        vec(f"{p}.nextn.shared_head_norm.weight", h)
    vec("output_norm.weight", h)
    mat("output.weight", cfg.vocab_size, h, gain=cfg.logit_gain)
    return plan


def _rope_freqs(cfg: SyntheticConfig) -> PlannedTensor:
    """Llama 3.1-style per-pair rope divisors, as llama.cpp's converter writes them."""
    from kvcompile.models.rope import llama3_factors
    factors = llama3_factors(cfg.rotary_dim, cfg.rope_theta, cfg.rope_factor,
                             cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                             cfg.rope_original_context or cfg.context_length)
    return PlannedTensor("rope_freqs.weight", (cfg.rotary_dim // 2,),
                         gguf.GGMLQuantizationType.F32, "values", 0.0,
                         values=tuple(factors.float().tolist()))


def _gdn_tensors(cfg, p, mat, vec, plan):
    h, value_dim = cfg.hidden, cfg.gdn_v_heads * cfg.gdn_head_dim
    conv_dim = 2 * cfg.gdn_k_heads * cfg.gdn_head_dim + value_dim
    mat(f"{p}.attn_qkv.weight", conv_dim, h)
    mat(f"{p}.attn_gate.weight", value_dim, h)
    plan.append(PlannedTensor(f"{p}.ssm_conv1d.weight", (conv_dim, cfg.conv_kernel),
                              gguf.GGMLQuantizationType.F32, "normal",
                              1.0 / math.sqrt(cfg.conv_kernel)))
    vec(f"{p}.ssm_dt.bias", cfg.gdn_v_heads, "uniform", 3.0, low=-2.0)
    # stored as -exp(A_log): A in [0.05, 1] gives per-token decays from ~0.97 to ~0.3
    vec(f"{p}.ssm_a", cfg.gdn_v_heads, "neg_log_uniform", math.log(20.0), low=math.log(0.05))
    mat(f"{p}.ssm_beta.weight", cfg.gdn_v_heads, h)
    mat(f"{p}.ssm_alpha.weight", cfg.gdn_v_heads, h, gain=0.5)
    vec(f"{p}.ssm_norm.weight", cfg.gdn_head_dim)
    mat(f"{p}.ssm_out.weight", h, value_dim, gain=cfg.residual_gain)


def write_synthetic_gguf(cfg: SyntheticConfig, path, weight_type: str = "f32", seed: int = 0,
                         progress: bool = False, workers: int | None = None) -> list[PlannedTensor]:
    """Write the model to `path`, streaming chunk by chunk (values made by `workers`
    threads, default: up to 16 cores). Returns the plan written."""
    plan = tensor_plan(cfg, weight_type)
    tmp = f"{os.fspath(path)}.partial"
    writer = gguf.GGUFWriter(tmp, arch=cfg.arch)
    writer.add_name(cfg.name or f"synthetic-{cfg.arch}")
    writer.add_type("model")
    writer.add_file_type(WEIGHT_TYPES[weight_type.lower()])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_model_metadata(writer, cfg)
    add_tokenizer(writer, cfg.vocab_size, cfg.tokenizer)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes,
                               raw_dtype=t.ggml_type)
    bar = _progress_bar(sum(t.n_bytes for t in plan), progress)
    done = False
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        for t, chunk, last in stream_chunks(plan, seed, workers):
            chunk.tofile(fout)
            bar.update(chunk.nbytes)
            if last:
                writer.write_padding(fout, t.n_bytes)
        done = True
    finally:
        writer.close()
        bar.close()
        if not done and os.path.exists(tmp):
            os.remove(tmp)  # never leave tens of GB of a half-written model behind
    os.replace(tmp, path)
    return plan


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not enabled)
