"""Synthetic GGUF models: random weights with sane scales, full metadata, a real tokenizer.

Used to test architectures for which no small real checkpoint exists (qwen35) and to make
benchmark-sized models on the device. The file is streamed: the tensor plan (names, shapes,
types, byte sizes) is fixed first, headers are written from it, then each tensor is
generated, converted and appended in row chunks, so a 54 GB model never sits in RAM.

Scales keep activations O(1): matrices get std gain / sqrt(fan_in), norms ~1, and the
recurrent (GDN) gates get decays spanning slow to fast forgetting. Each tensor's values
depend only on (seed, tensor name), not on the write order.
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import gguf
import numpy as np

from kvcompile.errors import UnsupportedModelError
from kvcompile.gguf.synthetic_presets import SyntheticConfig, preset_config

__all__ = ["SyntheticConfig", "PlannedTensor", "preset_config", "tensor_plan",
           "write_synthetic_gguf", "WEIGHT_TYPES"]

# weight types the gguf package can quantize to, with the matching general.file_type
WEIGHT_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
}
_CHUNK_ELEMENTS = 1 << 25  # rows generated per step: ~128 MiB of float32


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]      # PyTorch order [out, in]
    ggml_type: gguf.GGMLQuantizationType
    init: str                   # see _values
    scale: float                # normal: std; norm: spread around 1; uniform: width
    low: float = 0.0            # uniform, neg_log_uniform: lower end

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

    def attention(p, gated):
        mat(f"{p}.attn_q.weight", q_rows * (2 if gated else 1), h)
        mat(f"{p}.attn_k.weight", kv_rows, h)
        mat(f"{p}.attn_v.weight", kv_rows, h)
        mat(f"{p}.attn_output.weight", h, q_rows)
        if gated:
            vec(f"{p}.attn_q_norm.weight", cfg.head_dim)
            vec(f"{p}.attn_k_norm.weight", cfg.head_dim)

    def ffn(p):
        mat(f"{p}.ffn_gate.weight", cfg.ffn, h)
        mat(f"{p}.ffn_up.weight", cfg.ffn, h)
        mat(f"{p}.ffn_down.weight", h, cfg.ffn)

    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        vec(f"{p}.attn_norm.weight", h)
        if cfg.arch == "llama":
            attention(p, gated=False)
            vec(f"{p}.ffn_norm.weight", h)
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
    mat(f"{p}.ssm_out.weight", h, value_dim)


def write_synthetic_gguf(cfg: SyntheticConfig, path, weight_type: str = "f32", seed: int = 0,
                         progress: bool = False) -> list[PlannedTensor]:
    """Write the model to `path`, streaming tensor by tensor. Returns the plan written."""
    from kvcompile.gguf.synthetic_vocab import add_tokenizer
    from kvcompile.gguf.synthetic_presets import add_model_metadata

    plan = tensor_plan(cfg, weight_type)
    tmp = f"{os.fspath(path)}.partial"
    writer = gguf.GGUFWriter(tmp, arch=cfg.arch)
    writer.add_name(cfg.name or f"synthetic-{cfg.arch}")
    writer.add_type("model")
    writer.add_file_type(WEIGHT_TYPES[weight_type.lower()])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_model_metadata(writer, cfg)
    add_tokenizer(writer, cfg.vocab_size)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes,
                               raw_dtype=t.ggml_type)
    bar = _progress_bar(sum(t.n_bytes for t in plan), progress)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        for t in plan:
            for chunk in _generate(t, seed):
                chunk.tofile(fout)
                bar.update(chunk.nbytes)
            writer.write_padding(fout, t.n_bytes)
    finally:
        writer.close()
        bar.close()
    os.replace(tmp, path)
    return plan


def _generate(t: PlannedTensor, seed: int):
    """Yield the tensor's bytes in row chunks, already converted to its ggml type."""
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    rows, cols = (t.shape[0], t.shape[1]) if len(t.shape) == 2 else (1, t.shape[0])
    step = max(1, _CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        x = _values(t, rng, (n, cols) if len(t.shape) == 2 else (cols,))
        if t.ggml_type == gguf.GGMLQuantizationType.F32:
            yield x
        else:
            yield gguf.quants.quantize(x, t.ggml_type)


def _values(t: PlannedTensor, rng: np.random.Generator, shape) -> np.ndarray:
    if t.init == "normal":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(t.scale)
    if t.init == "norm":
        return 1.0 + rng.standard_normal(shape, dtype=np.float32) * np.float32(t.scale)
    if t.init == "uniform":
        return rng.uniform(t.low, t.low + t.scale, shape).astype(np.float32)
    if t.init == "neg_log_uniform":
        return -np.exp(rng.uniform(t.low, t.low + t.scale, shape)).astype(np.float32)
    raise ValueError(f"unknown init {t.init!r} for {t.name}")


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not enabled)
