"""qwen3: Qwen3 dense decoders: llama layers whose q and k heads each get an RMSNorm
(attn_q_norm / attn_k_norm, over the head dim) before NEOX rope; no QKV bias."""
from __future__ import annotations

from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.families.dense import (HF_LAYER_NAMES, HF_QK_NORM_NAMES, gguf_config,
                                             hf_config, llama_model_class)
from kvcompile.models.family import Family

ARCH = "qwen3"


def config_from_gguf(md, tensors, path: str = "the model file"):
    return gguf_config(md, tensors, path, arch=ARCH, rope_neox=True, qk_norm=True)


def config_from_hf(hf: dict, path: str = "config.json"):
    return hf_config(hf, path, arch=ARCH, qk_norm=True)


PRESETS = {
    # 8 query heads of 64: the q rows (512) are not the hidden size, as in Qwen3
    "tiny": SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=512, n_heads=8, n_kv_heads=2,
                            head_dim=64, vocab_size=4096, rope_theta=1_000_000.0,
                            qk_norm=True, name="synthetic-qwen3-tiny"),
}

FAMILY = Family(name=ARCH, gguf_arch=ARCH, config_from_gguf=config_from_gguf,
                model_class=llama_model_class, presets=PRESETS, config_from_hf=config_from_hf,
                hf_model_types=("qwen3",),
                hf_tensor_names={**HF_LAYER_NAMES, **HF_QK_NORM_NAMES})
