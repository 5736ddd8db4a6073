"""rope_rotate of fp32 heads on the CPU without rotations (f32 KV), for the fast path's
eager model (ops/rows.py): one C++ kernel (ops/cpu_build.py) in place of the reference's
dozen torch ops. Same formula as naive.rope_f32: x * cos + partner(x) * sin, the sign in
the sin table (layers.rope_rows)."""
from __future__ import annotations

import torch

from kvcompile.ops.cpu_build import cpu_kernel

_SOURCE = r"""
#include <cstdint>
#include <cstring>

// x [T, H, D]: heads < n_rope rotate their first R dims (partner: the pair (2i, 2i+1), or
// with neox (i, i + R/2)); the rest is copied
extern "C" void kernel(const float* x, const float* cos, const float* sin, float* out,
                       int64_t T, int64_t H, int64_t D, int64_t R, int64_t n_rope,
                       int64_t neox) {
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos + t * R;
        const float* s = sin + t * R;
        for (int64_t h = 0; h < H; h++) {
            const float* xr = x + (t * H + h) * D;
            float* o = out + (t * H + h) * D;
            int64_t done = 0;
            if (h < n_rope) {
                for (int64_t i = 0; i < R; i++) {
                    const int64_t p = neox ? (i < R / 2 ? i + R / 2 : i - R / 2) : (i ^ 1);
                    o[i] = xr[i] * c[i] + xr[p] * s[i];
                }
                done = R;
            }
            std::memcpy(o + done, xr + done, (D - done) * sizeof(float));
        }
    }
}
"""
_ARGS = ("const float*", "const float*", "const float*", "float*", "int64_t", "int64_t",
         "int64_t", "int64_t", "int64_t", "int64_t")


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
              n_rope: int) -> torch.Tensor:
    """naive.rope_rotate_naive of fp32 x [T, H, D] with cos / sin fp32 [T, R], no
    rotations."""
    x = x.contiguous()
    t, h, d = x.shape
    out = torch.empty_like(x)
    cpu_kernel(_SOURCE, _ARGS)(x, cos.contiguous(), sin.contiguous(), out, t, h, d,
                               cos.shape[-1], n_rope, int(neox))
    return out
