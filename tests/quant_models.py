"""Synthetic models built in memory on a device, weights quantized by our quantizer, with a
dense twin holding the very same (dequantized) values: for comparing the quantized kernels
with dense math at sizes whose GGUF files would not travel (the 8B geometry)."""
from __future__ import annotations

import zlib

import torch

from kvcompile.io.gguf.quantize import quantize
from kvcompile.io.gguf.synthetic import preset_config, tensor_plan
from kvcompile.models.quant_weight import QuantWeight


def _values(t, device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + zlib.crc32(t.name.encode()))
    x = torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)
    if t.init == "normal":
        return x * t.scale
    if t.init == "norm":
        return 1.0 + x * t.scale
    u = torch.rand(t.shape, generator=gen, device=device)
    if t.init == "uniform":
        return t.low + t.scale * u
    return -torch.exp(t.low + t.scale * u)                    # neg_log_uniform


def quantized_pair(arch: str, preset: str, weight_type: str, device, dtype=torch.bfloat16,
                   seed: int = 0, **overrides):
    """(config, quantized tensors, dense tensors): GGUF-named weights, the matrices as
    QuantWeights of `weight_type` in one dict and dequantized to `dtype` in the other."""
    from kvcompile.io.gguf.arch_config import config_from_metadata  # noqa: F401 (same names)
    cfg = preset_config(arch, preset, **overrides)
    quant, dense = {}, {}
    for t in tensor_plan(cfg, weight_type):
        x = _values(t, device, seed)
        if t.ggml_type.name in ("F32",) or len(t.shape) == 1:
            v = x if len(t.shape) == 1 else x.to(dtype)
            quant[t.name] = dense[t.name] = v
            continue
        q = QuantWeight.from_gguf_rows(quantize(x, t.ggml_type.name), t.ggml_type.name,
                                       t.shape[1])
        del x
        quant[t.name] = q
        dense[t.name] = q.dequantize(dtype)
    return cfg, quant, dense


def model_config(cfg):
    """The ModelConfig a GGUF of this synthetic config would give."""
    from kvcompile.models.config import ModelConfig
    return ModelConfig(arch=cfg.arch, n_layers=cfg.n_layers, hidden=cfg.hidden, ffn=cfg.ffn,
                       n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       vocab_size=cfg.vocab_size, context_length=cfg.context_length,
                       rms_eps=cfg.rms_eps, rope_theta=cfg.rope_theta, rope_dim=cfg.rope_dim,
                       name=cfg.name)
