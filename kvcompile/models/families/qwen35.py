"""qwen35: the Qwen3.5-style hybrid (Gated DeltaNet layers between gated-attention layers,
an optional NextN/MTP layer). GGUF only; its config reader is io/gguf/qwen35_config.py."""
from __future__ import annotations

from kvcompile.io.gguf.qwen35_config import build_qwen35_config
from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.family import Family

ARCH = "qwen35"


def model_class():
    from kvcompile.models.qwen35 import Qwen35Model
    return Qwen35Model


def synthetic_metadata(w, cfg: SyntheticConfig) -> None:
    """The hybrid's keys as llama.cpp reads them."""
    a = ARCH
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


PRESETS = {
    "tiny": SyntheticConfig(ARCH, n_layers=8, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                            head_dim=64, vocab_size=4096, rope_dim=16, gdn_k_heads=2,
                            gdn_v_heads=4, gdn_head_dim=32, nextn_layers=1,
                            name="synthetic-qwen35-tiny"),
    # the seed system's 27B hybrid: 16 attention + 48 GDN layers, one MTP layer
    "seed-27b": SyntheticConfig(ARCH, n_layers=64, hidden=5120, ffn=17408, n_heads=24,
                                n_kv_heads=4, head_dim=256, vocab_size=248320, rope_dim=64,
                                context_length=262144, rope_theta=10_000_000.0,
                                gdn_k_heads=16, gdn_v_heads=48, gdn_head_dim=128,
                                conv_kernel=4, nextn_layers=1, name="synthetic-qwen35-27b"),
}

FAMILY = Family(name=ARCH, gguf_arch=ARCH, config_from_gguf=build_qwen35_config,
                model_class=model_class, presets=PRESETS, synthetic_metadata=synthetic_metadata)
