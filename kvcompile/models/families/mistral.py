"""mistral: Mistral 7B / NeMo-style decoders. llama.cpp converts them as `llama` files (its
newer `mistral3` architecture is not this), so this family reads HF folders of model_type
"mistral" and writes synthetic llama files of Mistral's geometry (a head dim that is not
hidden / heads, as in NeMo). A sliding window shorter than the context (Mistral 7B v0.1's
4096) windows every layer: span_attention's `window`, and the KV store keeps only the
window's pages of them."""
from __future__ import annotations

from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.families.dense import HF_LAYER_NAMES, llama_model_class
from kvcompile.models.families.llama import ARCH, config_from_gguf, config_from_hf
from kvcompile.models.family import Family

PRESETS = {
    "tiny": SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=768, n_heads=4, n_kv_heads=1,
                            head_dim=128, vocab_size=4096, rope_theta=1_000_000.0,
                            rms_eps=1e-5, name="synthetic-mistral-tiny"),
    # every layer over a window of 64 positions (as v0.1's 4096, scaled down)
    "window-tiny": SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=768, n_heads=4,
                                   n_kv_heads=1, head_dim=128, vocab_size=4096,
                                   rope_theta=10000.0, rms_eps=1e-5, sliding_window=64,
                                   name="synthetic-mistral-window-tiny"),
}

FAMILY = Family(name="mistral", gguf_arch=ARCH, config_from_gguf=config_from_gguf,
                model_class=llama_model_class, presets=PRESETS, config_from_hf=config_from_hf,
                hf_model_types=("mistral",), hf_tensor_names=HF_LAYER_NAMES, reads_gguf=False)
