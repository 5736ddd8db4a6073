"""Rope scaling as metadata (no torch: read by the config builders, which the CLI's help
imports): the kinds kvcompile runs and an HF config's rope_scaling in the GGUF keys' terms.
The tables themselves: models/rope.py."""
from __future__ import annotations

from kvcompile.errors import UnsupportedModelError

SCALING_TYPES = ("none", "linear", "yarn", "llama3")


def scaling_type(scaling: dict) -> str:
    """The rope scaling kind; llama.cpp reads a missing type as linear (a no-op without a
    factor)."""
    kind = str(scaling.get("type") or "linear")
    if kind not in SCALING_TYPES:
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported; supported: {', '.join(SCALING_TYPES)}")
    return kind


def hf_rope_scaling(hf: dict) -> dict:
    """An HF config.json's rope_scaling in the GGUF metadata's terms (type, factor,
    original_context_length, ...); {} when there is none."""
    raw = dict(hf.get("rope_scaling") or {})
    kind = raw.pop("rope_type", None) or raw.pop("type", None) or "linear"
    if kind == "default" or not raw and kind == "linear":
        return {}
    out = {"type": kind, **{k: v for k, v in raw.items()
                            if k not in ("original_max_position_embeddings", "beta_fast",
                                         "beta_slow", "attention_factor")}}
    if "original_max_position_embeddings" in raw:
        out["original_context_length"] = int(raw["original_max_position_embeddings"])
    for hf_key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if hf_key in raw:
            out[gguf_key] = float(raw[hf_key])
    if raw.get("attention_factor") is not None:
        raise UnsupportedModelError("rope_scaling.attention_factor is not supported; use a "
                                    "model without it")
    scaling_type(out)
    return out
