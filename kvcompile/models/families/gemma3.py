"""gemma3: Gemma 3's text decoder (models/gemma3.py): five of every six layers attend over a
sliding window with rope base 10000, the sixth over the whole context with the file's base
and rope scaling; q/k norms, post-norms, GeGLU, embeddings scaled by sqrt(hidden). GGUF
only (an HF folder's (1 + w) norms are not converted here)."""
from __future__ import annotations

import math

from kvcompile.io.gguf.config_fields import base_fields
from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.config import ModelConfig
from kvcompile.models.family import Family

ARCH = "gemma3"
# llama.cpp's gemma3: the pattern of local and global layers, the local layers' rope base
SWA_PATTERN = 6
LOCAL_ROPE_BASE = 10000.0
# Gemma 3 27B (62 layers) scales scores by 1 / sqrt(hidden / heads) (its
# query_pre_attn_scalar), the others by 1 / sqrt(head_dim); llama.cpp tells them by depth
LAYERS_27B = 62


def config_from_gguf(md, tensors, path: str = "the model file") -> ModelConfig:
    base = base_fields(ARCH, md, tensors, rope_neox=True, path=path)
    scale = (1.0 / math.sqrt(base["hidden"] / base["n_heads"])
             if base["n_layers"] == LAYERS_27B else 0.0)
    return ModelConfig(**base, qk_norm=True,
                       sliding_window=int(md.get(f"{ARCH}.attention.sliding_window", 0)),
                       sliding_window_pattern=SWA_PATTERN, rope_theta_local=LOCAL_ROPE_BASE,
                       attn_scale=scale,
                       final_logit_softcap=float(md.get(f"{ARCH}.final_logit_softcapping", 0.0)))


def model_class():
    from kvcompile.models.gemma3 import Gemma3Model
    return Gemma3Model


def synthetic_metadata(w, cfg: SyntheticConfig) -> None:
    if cfg.final_logit_softcap:
        w.add_float32(f"{ARCH}.final_logit_softcapping", cfg.final_logit_softcap)


PRESETS = {
    # six layers (five windowed, one global), a window of 64: contexts of 512+ tokens cross
    # it many times; the global layer's rope linearly scaled as Gemma 3 4B+ files have it
    "tiny": SyntheticConfig(ARCH, n_layers=6, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                            head_dim=64, vocab_size=4096, rope_theta=1_000_000.0,
                            qk_norm=True, post_norms=True, sliding_window=64,
                            rope_scaling="linear", rope_factor=8.0,
                            name="synthetic-gemma3-tiny"),
    # Gemma 3 12B's geometry (48 layers: 40 windowed over 1024 positions, 8 global)
    "gemma3-12b": SyntheticConfig(ARCH, n_layers=48, hidden=3840, ffn=15360, n_heads=16,
                                  n_kv_heads=8, head_dim=256, vocab_size=262144,
                                  context_length=131072, rope_theta=1_000_000.0,
                                  qk_norm=True, post_norms=True, sliding_window=1024,
                                  rope_scaling="linear", rope_factor=8.0,
                                  name="synthetic-gemma3-12b"),
}

FAMILY = Family(name=ARCH, gguf_arch=ARCH, config_from_gguf=config_from_gguf,
                model_class=model_class, presets=PRESETS, synthetic_metadata=synthetic_metadata)
