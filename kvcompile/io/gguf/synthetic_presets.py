"""Geometries for synthetic models (each family's presets, models/families/) and the GGUF
metadata that describes them."""
from __future__ import annotations

from dataclasses import replace

from kvcompile.errors import UnsupportedModelError
from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.registry import FAMILIES, GGUF_ARCHS, family_named

__all__ = ["PRESETS", "SyntheticConfig", "preset_config", "check_config", "add_model_metadata"]

# make-model's --arch NAME --preset P
PRESETS: dict[str, dict[str, SyntheticConfig]] = {
    name: dict(family.presets) for name, family in FAMILIES.items()}


def preset_config(arch: str, preset: str, **overrides) -> SyntheticConfig:
    family_named(arch)                  # an unknown family is refused with the known ones
    if preset not in PRESETS[arch]:
        raise UnsupportedModelError(f"no preset {preset!r} for {arch}; use one of "
                                    f"{', '.join(PRESETS[arch])}")
    cfg = PRESETS[arch][preset]
    unknown = set(overrides) - set(cfg.__dataclass_fields__)
    if unknown:
        raise UnsupportedModelError(f"unknown model setting(s) {sorted(unknown)}; valid ones: "
                                    f"{', '.join(sorted(cfg.__dataclass_fields__))}")
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    check_config(cfg)
    return cfg


def check_config(cfg: SyntheticConfig) -> None:
    def need(ok, what):
        if not ok:
            raise UnsupportedModelError(f"invalid synthetic {cfg.arch} geometry: {what}")
    need(min(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) > 0,
         "layers, heads, KV heads and head dim must be positive")
    need(cfg.n_heads % cfg.n_kv_heads == 0, "query heads must be a multiple of KV heads")
    need(cfg.rotary_dim % 2 == 0 and cfg.rotary_dim <= cfg.head_dim,
         "rope dims must be even and at most the head dim")
    need(cfg.vocab_size > 300, "vocab size must exceed 300 (bytes + special tokens)")
    need(cfg.rope_scaling in ("", "linear", "yarn", "llama3"),
         "rope scaling must be linear, yarn or llama3 (or none)")
    if cfg.hybrid:
        need(cfg.gdn_k_heads > 0 and cfg.gdn_v_heads % cfg.gdn_k_heads == 0,
             "GDN value heads must be a multiple of GDN key heads")
        need(cfg.gdn_head_dim > 0 and cfg.conv_kernel >= 2, "GDN head dim and conv kernel")
        need(cfg.full_attention_interval >= 1, "full attention interval must be >= 1")


def add_model_metadata(writer, cfg: SyntheticConfig) -> None:
    """The `{arch}.*` keys llama.cpp reads for this architecture."""
    a = cfg.arch
    w = writer
    w.add_uint32(f"{a}.context_length", cfg.context_length)
    w.add_uint32(f"{a}.embedding_length", cfg.hidden)
    w.add_uint32(f"{a}.block_count", cfg.n_layers + cfg.nextn_layers)
    w.add_uint32(f"{a}.feed_forward_length", cfg.ffn)
    w.add_uint32(f"{a}.attention.head_count", cfg.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.n_kv_heads)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.rotary_dim)
    w.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    if cfg.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", cfg.sliding_window)
    if cfg.rope_scaling in ("linear", "yarn"):     # llama3's factors are a tensor instead
        w.add_string(f"{a}.rope.scaling.type", cfg.rope_scaling)
        w.add_float32(f"{a}.rope.scaling.factor", cfg.rope_factor)
        if cfg.rope_original_context:
            w.add_uint32(f"{a}.rope.scaling.original_context_length", cfg.rope_original_context)
    extra = GGUF_ARCHS[a].synthetic_metadata
    if extra is not None:
        extra(w, cfg)
