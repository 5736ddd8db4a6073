"""llama: Llama 1-3 (3.1+ with the per-pair rope factors of `rope_freqs.weight`), SmolLM2 and
the many files converted as `llama`. GGUF q/k rows come permuted by llama.cpp's converter
into adjacent-pair rope; HF folders keep the NEOX layout."""
from __future__ import annotations

from kvcompile.io.gguf.synthetic_config import SyntheticConfig
from kvcompile.models.families.dense import HF_LAYER_NAMES, gguf_config, hf_config, llama_model_class
from kvcompile.models.family import Family

ARCH = "llama"


def config_from_gguf(md, tensors, path: str = "the model file"):
    return gguf_config(md, tensors, path, arch=ARCH, rope_neox=False)


def config_from_hf(hf: dict, path: str = "config.json"):
    return hf_config(hf, path, arch=ARCH)


_TINY = SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                        head_dim=64, vocab_size=4096, name="synthetic-llama-tiny")
PRESETS = {
    "tiny": _TINY,
    # Llama 3.1 rope: factors that slow the pairs whose wavelength exceeds 512 positions
    # eightfold (interpolated from 128 up), so contexts of 1-2K tokens exercise them
    "llama3-tiny": SyntheticConfig(ARCH, n_layers=4, hidden=256, ffn=512, n_heads=4,
                                   n_kv_heads=2, head_dim=64, vocab_size=4096,
                                   rope_scaling="llama3", rope_factor=8.0,
                                   rope_original_context=512, name="synthetic-llama3-tiny"),
    # Llama-3-8B geometry (the peers table in the design notes)
    "llama3-8b": SyntheticConfig(ARCH, n_layers=32, hidden=4096, ffn=14336, n_heads=32,
                                 n_kv_heads=8, head_dim=128, vocab_size=128256,
                                 context_length=131072, rope_theta=500000.0, rms_eps=1e-5,
                                 name="synthetic-llama3-8b"),
}

FAMILY = Family(name=ARCH, gguf_arch=ARCH, config_from_gguf=config_from_gguf,
                model_class=llama_model_class, presets=PRESETS, config_from_hf=config_from_hf,
                hf_model_types=("llama",), hf_tensor_names=HF_LAYER_NAMES)
