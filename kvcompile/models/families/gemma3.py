"""gemma3: Gemma 3's text decoder (models/gemma3.py): five of every six layers attend over a
sliding window with rope base 10000, the sixth over the whole context with the file's base
and rope scaling; q/k norms, post-norms, GeGLU, embeddings scaled by sqrt(hidden). GGUF
files and HF `gemma3_text` folders, whose RMSNorms multiply by (1 + w): their norm weights
are read with the 1 added, as llama.cpp's converter stores them."""
from __future__ import annotations

import math

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.config_fields import base_fields
from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.config import ModelConfig
from kvcompile.models.families.dense import HF_LAYER_NAMES, HF_QK_NORM_NAMES
from kvcompile.models.family import Family
from kvcompile.models.rope_scaling import hf_rope_scaling

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


def config_from_hf(hf: dict, path: str = "config.json") -> ModelConfig:
    """An HF Gemma3ForCausalLM config.json (model_type gemma3_text)."""
    def need(key):
        if key not in hf:
            raise ModelFileError(f"{path} lacks {key!r}; re-download the checkpoint's config.json")
        return hf[key]

    n_layers, n_heads = int(need("num_hidden_layers")), int(need("num_attention_heads"))
    pattern = int(hf.get("sliding_window_pattern") or SWA_PATTERN)
    types = hf.get("layer_types")
    if types is not None and list(types) != [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)]:
        raise UnsupportedModelError(f"{path}: layer_types {types[:8]}... are not five windowed "
                                    f"layers then a global one; such a Gemma 3 is not supported")
    scalar = hf.get("query_pre_attn_scalar")
    return ModelConfig(
        arch=ARCH, n_layers=n_layers, hidden=int(need("hidden_size")),
        ffn=int(need("intermediate_size")), n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(need("head_dim")), vocab_size=int(need("vocab_size")),
        context_length=int(need("max_position_embeddings")),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", 1_000_000.0)), rope_neox=True,
        rope_scaling=hf_rope_scaling(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        name=str(hf.get("_name_or_path", "")), qk_norm=True,
        sliding_window=int(hf.get("sliding_window") or 0), sliding_window_pattern=pattern,
        rope_theta_local=float(hf.get("rope_local_base_freq", LOCAL_ROPE_BASE)),
        attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
        final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0))


def hf_tensor_fix(name: str, t):
    """Gemma's RMSNorm multiplies by (1 + w): the weight as a GGUF file stores it."""
    return t.float() + 1.0 if name.endswith("norm.weight") else t


HF_NAMES = {**{k: v for k, v in HF_LAYER_NAMES.items() if "layernorm" not in k},
            **HF_QK_NORM_NAMES,
            "input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


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
                model_class=model_class, presets=PRESETS, synthetic_metadata=synthetic_metadata,
                config_from_hf=config_from_hf, hf_model_types=("gemma3_text",),
                hf_tensor_names=HF_NAMES, hf_tensor_fix=hf_tensor_fix)
