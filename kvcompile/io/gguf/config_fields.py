"""The metadata keys every llama-like GGUF architecture shares, read into ModelConfig's
keyword arguments (`base_fields`); a family adds its own keys (models/families/)."""
from __future__ import annotations

from typing import Mapping

from kvcompile.errors import ModelFileError, UnsupportedModelError


def require(md: Mapping, key: str, path: str = "the model file"):
    if key not in md:
        raise ModelFileError(
            f"{path} lacks the required metadata key {key!r}; re-convert the model with a "
            f"current llama.cpp convert_hf_to_gguf.py (or add the key with gguf's "
            f"gguf_new_metadata.py)")
    return md[key]


def int_field(md: Mapping, key: str, path: str) -> int:
    value = require(md, key, path)
    if isinstance(value, list):  # per-layer arrays: only uniform ones are supported here
        if not value or len(set(value)) != 1:
            raise UnsupportedModelError(
                f"{key} varies per layer ({value[:8]}...); kvcompile supports uniform layers only")
        value = value[0]
    return int(value)


def base_fields(arch: str, md: Mapping, tensors: Mapping, rope_neox: bool,
                path: str = "the model file") -> dict:
    """ModelConfig keyword arguments shared by llama-like architectures."""
    p = f"{arch}."
    hidden = int_field(md, p + "embedding_length", path)
    n_heads = int_field(md, p + "attention.head_count", path)
    n_kv = int_field(md, p + "attention.head_count_kv", path) if p + "attention.head_count_kv" in md else n_heads
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise ModelFileError(
            f"{path}: head_count {n_heads} is not a positive multiple of head_count_kv {n_kv}; "
            f"the metadata is corrupt, re-convert the model")
    if p + "attention.key_length" in md:
        head_dim = int_field(md, p + "attention.key_length", path)
    elif hidden % n_heads == 0:
        head_dim = hidden // n_heads
    else:
        raise ModelFileError(
            f"{path}: hidden size {hidden} is not divisible by {n_heads} heads and "
            f"{p}attention.key_length is missing; add the key or re-convert the model")
    n_layers = int_field(md, p + "block_count", path)
    if n_layers <= 0 or hidden <= 0:
        raise ModelFileError(f"{path}: block_count {n_layers} and embedding_length {hidden} "
                             f"must be positive; the metadata is corrupt, re-convert the model")
    rope_dim = int(md.get(p + "rope.dimension_count", head_dim))
    scaling = {k[len(p + "rope.scaling."):]: v for k, v in md.items()
               if k.startswith(p + "rope.scaling.")}
    return dict(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        ffn=int_field(md, p + "feed_forward_length", path),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab_size(md, tensors, arch, path),
        context_length=int_field(md, p + "context_length", path),
        rms_eps=float(require(md, p + "attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
        rope_dim=None if rope_dim == head_dim else rope_dim,
        rope_neox=rope_neox,
        rope_scaling=scaling,
        tie_embeddings="output.weight" not in tensors,
        name=str(md.get("general.name", "")),
    )


def vocab_size(md: Mapping, tensors: Mapping, arch: str, path: str) -> int:
    """Rows of token_embd (what the model computes with), else the token list's length."""
    emb = tensors.get("token_embd.weight")
    if emb is not None:
        return int(emb.shape[0])
    if f"{arch}.vocab_size" in md:
        return int(md[f"{arch}.vocab_size"])
    if "tokenizer.ggml.tokens" in md:
        return len(md["tokenizer.ggml.tokens"])
    raise ModelFileError(f"{path} has no token_embd.weight tensor and no token list; "
                         f"it is not a complete model file")
