"""Rope angle tables, as llama.cpp computes them from a model's metadata.

Angle of pair i at position p: p * theta^(-2i/R) / ff[i], where ff are per-pair frequency
factors (a Llama 3.1+ GGUF's `rope_freqs.weight`, or computed from an HF config's "llama3"
rope scaling the way the GGUF converter does). Then, by `rope_scaling["type"]`:
- none: as is;
- linear (llama.cpp's default when only a factor is given): angles times 1 / factor;
- yarn: each pair mixes the interpolated angle (times 1 / factor) and the original one by a
  ramp over the pair index between the "correction dims" of beta_fast / beta_slow, and
  cos / sin are scaled by the magnitude factor 1 + 0.1 ln(factor).
`attn_factor` (GGUF `rope.scaling.attn_factor`) scales cos / sin in every mode, as llama.cpp
multiplies it into its rope's mscale.
"""
from __future__ import annotations

import math

import torch

from kvcompile.errors import UnsupportedModelError
from kvcompile.models.rope_scaling import scaling_type


def llama3_factors(rotary_dim: int, theta: float, factor: float, low_freq_factor: float,
                   high_freq_factor: float, original_context: int) -> torch.Tensor:
    """Per-pair divisors of the rope frequencies for Llama 3.1-style scaling (float64 [R/2]):
    wavelengths shorter than original_context / high_freq_factor keep their frequency, those
    longer than original_context / low_freq_factor are slowed by `factor`, and between the
    two the frequency is interpolated linearly in original_context / wavelength."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mixed = 1.0 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen > original_context / low_freq_factor,
                      torch.full_like(wavelen, factor), mixed)
    return torch.where(wavelen < original_context / high_freq_factor, torch.ones_like(out), out)


def _yarn_corr_dim(rotary_dim: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    """The pair dimension whose wavelength makes n_rot turns over the original context."""
    return rotary_dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp(rotary_dim: int, theta: float, n_ctx_orig: int, beta_fast: float,
              beta_slow: float) -> torch.Tensor:
    """float64 [R/2]: 1 where a pair keeps its original angle (extrapolation), 0 where it is
    fully interpolated, linear between the correction dims (floored / ceiled as ggml does)."""
    low = max(0.0, math.floor(_yarn_corr_dim(rotary_dim, n_ctx_orig, beta_fast, theta)))
    high = min(rotary_dim - 1.0, math.ceil(_yarn_corr_dim(rotary_dim, n_ctx_orig, beta_slow, theta)))
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return 1 - ((i - low) / max(0.001, high - low)).clamp(0, 1)


def rope_tables(rotary_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                freq_factors: torch.Tensor | None = None,
                context_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [max_positions, rotary_dim / 2]; angles in float64. freq_factors:
    per-pair divisors (rope_freqs.weight); context_length: the training context, YaRN's
    original context when the metadata names none."""
    scaling = dict(scaling or {})
    kind = scaling_type(scaling)
    factor = float(scaling.get("factor") or 1.0)
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    if kind == "llama3" and freq_factors is None:
        freq_factors = llama3_factors(
            rotary_dim, theta, factor, float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_context_length", 8192)))
    if freq_factors is not None:
        if tuple(freq_factors.shape) != (rotary_dim // 2,):
            raise UnsupportedModelError(
                f"rope frequency factors of shape {tuple(freq_factors.shape)} for {rotary_dim} "
                f"rotated dims; expected ({rotary_dim // 2},): the file is inconsistent")
        inv_freq = inv_freq / freq_factors.to(torch.float64).cpu()
    scale = 1.0 / factor if kind in ("linear", "yarn") else 1.0
    mscale = float(scaling.get("attn_factor") or 1.0)
    per_pair = torch.full_like(inv_freq, scale)
    if kind == "yarn":
        ext = float(scaling.get("yarn_ext_factor", -1.0))
        ext = 1.0 if ext < 0 else ext                # negative: unset (llama.cpp's default)
        if float(scaling.get("yarn_log_multiplier") or 0.0) != 0.0:
            raise UnsupportedModelError("YaRN with a log multiplier (DeepSeek-style mscale) is "
                                        "not supported; use a model without it")
        n_orig = int(scaling.get("original_context_length") or context_length or max_positions)
        ramp = yarn_ramp(rotary_dim, theta, n_orig, float(scaling.get("yarn_beta_fast", 32.0)),
                         float(scaling.get("yarn_beta_slow", 1.0))) * ext
        per_pair = scale * (1 - ramp) + ramp
        if ext != 0.0 and factor > 1.0:
            mscale *= 1.0 + 0.1 * math.log(factor)
    pos = torch.arange(max_positions, dtype=torch.float64)
    angles = pos[:, None] * (inv_freq * per_pair)[None, :]
    return (torch.cos(angles) * mscale).float(), (torch.sin(angles) * mscale).float()


def config_rope_tables(config, freq_factors: torch.Tensor | None = None):
    """A ModelConfig's tables over its whole context."""
    return rope_tables(config.rotary_dim, config.context_length, config.rope_theta,
                       config.rope_scaling, freq_factors, config.context_length)
