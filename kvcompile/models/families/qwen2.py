"""qwen2: Qwen2 / Qwen2.5 decoders: llama layers with biases on the q, k and v projections,
NEOX rope (llama.cpp converts their q/k rows unpermuted); Qwen2.5's long-context variants
declare YaRN rope scaling."""
from __future__ import annotations

from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.families.dense import HF_LAYER_NAMES, gguf_config, hf_config, llama_model_class
from kvcompile.models.family import Family

ARCH = "qwen2"


def config_from_gguf(md, tensors, path: str = "the model file"):
    return gguf_config(md, tensors, path, arch=ARCH, rope_neox=True, qkv_bias=True)


def config_from_hf(hf: dict, path: str = "config.json"):
    return hf_config(hf, path, arch=ARCH, qkv_bias=True)


_TINY = SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                        head_dim=64, vocab_size=4096, rope_theta=1_000_000.0, qkv_bias=True,
                        name="synthetic-qwen2-tiny")
PRESETS = {
    "tiny": _TINY,
    # YaRN (as Qwen2.5's long-context configs ask): 4x over a 256-token training context
    "yarn-tiny": SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=512, n_heads=4,
                                 n_kv_heads=2, head_dim=64, vocab_size=4096,
                                 rope_theta=10000.0, qkv_bias=True, rope_scaling="yarn",
                                 rope_factor=4.0, rope_original_context=256,
                                 name="synthetic-qwen2-yarn-tiny"),
}

FAMILY = Family(name=ARCH, gguf_arch=ARCH, config_from_gguf=config_from_gguf,
                model_class=llama_model_class, presets=PRESETS, config_from_hf=config_from_hf,
                hf_model_types=("qwen2",), hf_tensor_names=HF_LAYER_NAMES)
