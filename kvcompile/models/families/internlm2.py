"""internlm2: InternLM2 decoders as GGUF files store them (llama.cpp's converter splits the
fused wqkv into attn_q / attn_k / attn_v and permutes q/k into adjacent-pair rope): llama
layers under their own `internlm2.*` keys. No HF folders (those need remote code)."""
from __future__ import annotations

from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.families.dense import gguf_config, llama_model_class
from kvcompile.models.family import Family

ARCH = "internlm2"


def config_from_gguf(md, tensors, path: str = "the model file"):
    return gguf_config(md, tensors, path, arch=ARCH, rope_neox=False)


PRESETS = {
    "tiny": SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                            head_dim=64, vocab_size=4096, rope_theta=1_000_000.0,
                            name="synthetic-internlm2-tiny"),
}

FAMILY = Family(name=ARCH, gguf_arch=ARCH, config_from_gguf=config_from_gguf,
                model_class=llama_model_class, presets=PRESETS)
