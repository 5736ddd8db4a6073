"""span_attention's decode rows on the CPU over f32 pages, for the fast path's eager model
(ops/rows.py): one C++ kernel (ops/cpu_build.py) in place of the reference's gathers,
einsums and softmax, a few dozen torch ops a layer that cost more than the attention
itself at decode sizes. The op (op.py) keeps the fp32 reference.

Each (row, query head) is one task, split over the threads: its scores over the keys at
positions 0..q_pos (read through the page table, in logical order: the placement of a
page changes nothing), softmax, the weighted sum of the values. A row's result does not
depend on the other rows, so a verify step equals its one-row steps bit for bit.
"""
from __future__ import annotations

import torch

from kvcompile.ops.cpu_build import cpu_kernel, cpu_kernels_available
from kvcompile.ops.cpu_simd import SIMD

_SOURCE = SIMD + r"""
#include <vector>

// page p of a pool starts at pool + p * stride (bytes); an f32 page is [Hk, P, D]
extern "C" void kernel(const float* q, const uint8_t* k_pool, const uint8_t* v_pool,
                       const int32_t* table, const int32_t* pos, float* out, int64_t T,
                       int64_t Hq, int64_t Hk, int64_t D, int64_t P, int64_t k_stride,
                       int64_t v_stride, float scale, int64_t window) {
    const int64_t group = Hq / Hk, nv = D / 16;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < T * Hq; task++) {
        const int64_t t = task / Hq, h = task % Hq, g = h / group, n = pos[t] + 1;
        const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
        const float* qr = q + task * D;
        thread_local std::vector<float> scores;     // a thread's scores, kept across calls
        if ((int64_t)scores.size() < n) scores.resize(n);
        float* s = scores.data();
        float mx = -INFINITY;
        for (int64_t i = first; i < n; i++) {
            const int64_t at = table[i / P], off = i % P;
            const float* kr = (const float*)(k_pool + at * k_stride) + (g * P + off) * D;
            V acc = vzero();
            for (int64_t c = 0; c < nv; c++) acc = vfma(vload(qr + 16 * c), vload(kr + 16 * c), acc);
            s[i] = vsum(acc) * scale;
            mx = std::max(mx, s[i]);
        }
        float sum = 0.f;
        for (int64_t i = first; i < n; i++) { s[i] = std::exp(s[i] - mx); sum += s[i]; }
        const float inv = 1.0f / sum;
        V o[16];                                   // D <= 256
        for (int64_t c = 0; c < nv; c++) o[c] = vzero();
        for (int64_t i = first; i < n; i++) {
            const int64_t at = table[i / P], off = i % P;
            const float* vr = (const float*)(v_pool + at * v_stride) + (g * P + off) * D;
            V p = vset(s[i] * inv);
            for (int64_t c = 0; c < nv; c++) o[c] = vfma(p, vload(vr + 16 * c), o[c]);
        }
        for (int64_t c = 0; c < nv; c++) vstore(out + task * D + 16 * c, o[c]);
    }
}
"""
_ARGS = ("const float*", "const uint8_t*", "const uint8_t*", "const int32_t*", "const int32_t*",
         "float*", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t",
         "float", "int64_t")
MAX_HEAD_DIM = 256


def cpu_attention_fits(q: torch.Tensor, k_name: str, v_name: str, rows: int) -> bool:
    """Whether the C++ kernel runs this call: decode / verify rows of an fp32 q over f32
    pages, head dim a multiple of 16 up to MAX_HEAD_DIM, where kernels build."""
    d = q.shape[-1]
    return (q.dtype == torch.float32 and k_name == v_name == "f32" and 0 < rows <= 8
            and d % 16 == 0 and d <= MAX_HEAD_DIM and q.device.type == "cpu"
            and cpu_kernels_available())


def attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   page_table: torch.Tensor, q_pos: torch.Tensor, page_size: int,
                   scale: float, window: int = 0) -> torch.Tensor:
    """q [T, Hq, D] fp32 over f32 pools (kv_format): [T, Hq, D] fp32; window > 0: each
    row sees its last `window` positions only (op.py). A plain call: the eager model's
    (ops/rows.py)."""
    t, hq, d = q.shape
    hk = k_pool.shape[1] // (page_size * d * 4)
    out = torch.empty(t, hq, d, dtype=torch.float32)
    cpu_kernel(_SOURCE, _ARGS)(q.contiguous(), k_pool, v_pool,
                               page_table.to(torch.int32).contiguous(),
                               q_pos.to(torch.int32).contiguous(), out, t, hq, hk, d, page_size,
                               k_pool.stride(0), v_pool.stride(0), float(scale), window)
    return out
