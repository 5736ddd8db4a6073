"""Geometries for synthetic models (presets) and the GGUF metadata that describes them."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvcompile.errors import UnsupportedModelError


@dataclass(frozen=True)
class SyntheticConfig:
    arch: str                        # "llama" or "qwen35"
    n_layers: int                    # main stack, without NextN layers
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int = 4096
    rope_theta: float = 10000.0
    rope_dim: int | None = None      # rotated dims per head (None: all)
    rms_eps: float = 1e-6
    logit_gain: float = 2.0          # std of the logits for a unit-RMS final hidden state
    residual_gain: float = 1.0       # gain of the matrices that write the residual stream
    # qwen35 hybrid
    full_attention_interval: int = 4
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_head_dim: int = 0
    conv_kernel: int = 4
    nextn_layers: int = 0
    name: str = ""
    tokenizer: str = "auto"          # synthetic_vocab: auto, smollm2 or bytes

    def is_full_attention(self, layer: int) -> bool:
        return self.arch == "llama" or (layer + 1) % self.full_attention_interval == 0

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim


PRESETS: dict[str, dict[str, SyntheticConfig]] = {
    "llama": {
        "tiny": SyntheticConfig("llama", n_layers=4, hidden=256, ffn=512, n_heads=4,
                                n_kv_heads=2, head_dim=64, vocab_size=4096,
                                name="synthetic-llama-tiny"),
        # Llama-3-8B geometry (the peers table in the design notes)
        "llama3-8b": SyntheticConfig("llama", n_layers=32, hidden=4096, ffn=14336, n_heads=32,
                                     n_kv_heads=8, head_dim=128, vocab_size=128256,
                                     context_length=131072, rope_theta=500000.0,
                                     rms_eps=1e-5, name="synthetic-llama3-8b"),
    },
    "qwen35": {
        "tiny": SyntheticConfig("qwen35", n_layers=8, hidden=256, ffn=512, n_heads=4,
                                n_kv_heads=2, head_dim=64, vocab_size=4096, rope_dim=16,
                                gdn_k_heads=2, gdn_v_heads=4, gdn_head_dim=32, nextn_layers=1,
                                name="synthetic-qwen35-tiny"),
        # the seed system's 27B hybrid: 16 attention + 48 GDN layers, one MTP layer
        "seed-27b": SyntheticConfig("qwen35", n_layers=64, hidden=5120, ffn=17408, n_heads=24,
                                    n_kv_heads=4, head_dim=256, vocab_size=248320, rope_dim=64,
                                    context_length=262144, rope_theta=10_000_000.0,
                                    gdn_k_heads=16, gdn_v_heads=48, gdn_head_dim=128,
                                    conv_kernel=4, nextn_layers=1, name="synthetic-qwen35-27b"),
    },
}


def preset_config(arch: str, preset: str, **overrides) -> SyntheticConfig:
    if arch not in PRESETS:
        raise UnsupportedModelError(f"cannot make a synthetic {arch!r} model; use --arch "
                                    f"{' or '.join(PRESETS)}")
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
    if cfg.arch == "qwen35":
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
    if a != "qwen35":
        return
    # text positions use three equal M-RoPE sections, the 4th is empty: plain NEOX rope
    pairs = cfg.rotary_dim // 2
    third = -(-pairs // 3)
    w.add_array(f"{a}.rope.dimension_sections", [third, third, pairs - 2 * third, 0])
    w.add_uint32(f"{a}.ssm.conv_kernel", cfg.conv_kernel)
    w.add_uint32(f"{a}.ssm.state_size", cfg.gdn_head_dim)
    w.add_uint32(f"{a}.ssm.group_count", cfg.gdn_k_heads)
    w.add_uint32(f"{a}.ssm.time_step_rank", cfg.gdn_v_heads)
    w.add_uint32(f"{a}.ssm.inner_size", cfg.gdn_v_heads * cfg.gdn_head_dim)
    w.add_uint32(f"{a}.full_attention_interval", cfg.full_attention_interval)
    w.add_uint32(f"{a}.nextn_predict_layers", cfg.nextn_layers)
