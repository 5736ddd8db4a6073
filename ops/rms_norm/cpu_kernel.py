"""rms_norm / add_rms_norm of fp32 rows on the CPU, for the fast path's eager model
(ops/rows.py): one C++ kernel (ops/cpu_build.py) in place of the reference's seven torch
ops. Same math as naive.py (s = x + residual; y = s * rsqrt(mean(s^2) + eps) * weight),
summed in another order."""
from __future__ import annotations

import torch

from kvcompile.ops.cpu_build import cpu_kernel

_SOURCE = r"""
#include <cstdint>
#include <cmath>

// rows of n: s = x (+ r, when r is given: s written to s_out), y = s * rsqrt(mean(s^2) + eps) * w
extern "C" void kernel(const float* x, const float* r, const float* w, float* s_out, float* y,
                       int64_t T, int64_t n, int64_t has_r, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * n;
        float* s = has_r ? s_out + t * n : nullptr;
        float acc = 0.f;
        for (int64_t i = 0; i < n; i++) {
            float v = has_r ? xr[i] + r[t * n + i] : xr[i];
            if (has_r) s[i] = v;
            acc += v * v;
        }
        const float inv = 1.0f / std::sqrt(acc / (float)n + eps);
        const float* src = has_r ? s : xr;
        for (int64_t i = 0; i < n; i++) y[t * n + i] = src[i] * inv * w[i];
    }
}
"""
_ARGS = ("const float*", "const float*", "const float*", "float*", "float*", "int64_t",
         "int64_t", "int64_t", "float")


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y) as naive.rms_norm_naive, x / residual fp32 [..., n] on the CPU, weight fp32."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    if residual is None:
        s, r = x, x
    else:
        s, r = torch.empty_like(x), residual.contiguous()
    cpu_kernel(_SOURCE, _ARGS)(x, r, weight.contiguous(), s, y, x.numel() // n, n,
                               int(residual is not None), float(eps))
    return s, y
