"""What the dense decoder families (llama, mistral, qwen2, qwen3) share: their config from a
GGUF header or an HF config.json, and the HF tensor names of a llama-style checkpoint. Each
family passes its variants (rope layout, QKV bias, per-head q/k norm)."""
from __future__ import annotations

from typing import Mapping

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.config_fields import base_fields
from kvcompile.models.config import ModelConfig
from kvcompile.models.rope_scaling import hf_rope_scaling, scaling_type

HF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
HF_LAYER_NAMES = {
    **{f"self_attn.{h}_proj.{p}": f"attn_{h}.{p}" for h in "qkv" for p in ("weight", "bias")},
    **{f"mlp.{m}_proj.weight": f"ffn_{m}.weight" for m in ("gate", "up", "down")},
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
HF_QK_NORM_NAMES = {"self_attn.q_norm.weight": "attn_q_norm.weight",
                    "self_attn.k_norm.weight": "attn_k_norm.weight"}


def window_of(window, context: int) -> int:
    """A declared sliding window as the config keeps it: 0 (none) unless shorter than the
    context (a window as long as the context changes nothing)."""
    window = int(window or 0)
    if window < 0:
        raise ModelFileError(f"a sliding window of {window} tokens; the metadata is corrupt, "
                             f"re-convert the model")
    return window if window < context else 0


def gguf_config(md: Mapping, tensors: Mapping, path: str, *, arch: str, rope_neox: bool,
                qkv_bias: bool = False, qk_norm: bool = False) -> ModelConfig:
    """A dense family's config from GGUF metadata. QKV biases are also taken where the file
    has them (some llama files do)."""
    base = base_fields(arch, md, tensors, rope_neox=rope_neox, path=path)
    scaling_type(base["rope_scaling"])          # an unknown scaling kind fails at the header
    # every layer windowed where the file declares a window (Mistral 7B v0.1-style; note
    # llama.cpp reads no window from these architectures and attends to everything)
    window = window_of(md.get(f"{arch}.attention.sliding_window"), base["context_length"])
    return ModelConfig(**base, qkv_bias=qkv_bias or "blk.0.attn_q.bias" in tensors,
                       qk_norm=qk_norm, sliding_window=window)


def hf_config(hf: dict, path: str, *, arch: str, qkv_bias: bool = False,
              qk_norm: bool = False) -> ModelConfig:
    """A dense family's config from a Hugging Face config.json (q/k rows in HF's NEOX
    layout, so rope_neox)."""
    def need(key):
        if key not in hf:
            raise ModelFileError(f"{path} lacks {key!r}; re-download the checkpoint's config.json")
        return hf[key]

    hidden, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    context = int(need("max_position_embeddings"))
    window = window_of(hf.get("sliding_window"), context) \
        if hf.get("use_sliding_window", True) else 0
    if window and arch == "qwen2":
        raise UnsupportedModelError(
            f"{path}: Qwen2's sliding window applies to some layers only (max_window_layers), "
            f"which is not supported; use the checkpoint with use_sliding_window false")
    return ModelConfig(
        arch=arch,
        n_layers=int(need("num_hidden_layers")),
        hidden=hidden,
        ffn=int(need("intermediate_size")),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or hidden // n_heads),
        vocab_size=int(need("vocab_size")),
        context_length=context,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_dim=None,
        rope_neox=True,  # HF q/k rows are in the NEOX (rotate-halves) layout
        rope_scaling=hf_rope_scaling(hf),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        name=str(hf.get("_name_or_path", "")),
        qkv_bias=qkv_bias or bool(hf.get("attention_bias", False)),
        qk_norm=qk_norm,
        sliding_window=window,
    )


def llama_model_class():
    """Every dense family runs on LlamaModel with its variants switched on by the config."""
    from kvcompile.models.llama import LlamaModel
    return LlamaModel
