"""silu_mul of fp32 rows on the CPU, for the fast path's eager model (ops/rows.py): one C++
kernel (ops/cpu_build.py) in place of the reference's four torch ops."""
from __future__ import annotations

import torch

from kvcompile.ops.cpu_build import cpu_kernel

_SOURCE = r"""
#include <cstdint>
#include <cmath>

// gate_up rows [2F] (gate then up) -> silu(gate) * up [F]
extern "C" void kernel(const float* gu, float* out, int64_t T, int64_t F) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < F; i++) {
            const float g = gu[t * 2 * F + i];
            out[t * F + i] = g / (1.0f + std::exp(-g)) * gu[t * 2 * F + F + i];
        }
}
"""
_ARGS = ("const float*", "float*", "int64_t", "int64_t")


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """naive.silu_mul_naive of fp32 rows [..., 2F] on the CPU."""
    gate_up = gate_up.contiguous()
    f = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], f)
    cpu_kernel(_SOURCE, _ARGS)(gate_up, out, gate_up.numel() // (2 * f), f)
    return out
