"""qlinear on the CPU with fp32 activations: the weight stays in its planar GGUF rows and is
dequantized block by block in registers (C++, ops/cpu_build.py).

- up to GEMV_MAX_ROWS rows (decode, verify): a GEMV that reads each weight row once for all
  rows, output rows split over the threads. Every row's result is computed the same way
  whatever the row count, so a verify step's rows equal its one-row steps bit for bit.
- more rows (prefill): the weight dequantized into an fp32 matrix (the same kernel's
  blocks, in parallel), then one BLAS GEMM.

A block is dequantized with ggml's arithmetic (Q4_1: q * d + m, two roundings), so the fp32
weights equal the reference's (naive.py) exactly; only the dot products' summation order
differs from the reference's GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompile.ops.cpu_build import cpu_kernel, cpu_kernels_available
from kvcompile.ops.cpu_simd import SIMD
from kvcompile.ops.qlinear.formats import weight_format

# ggml type name -> the kernel's format code (its ggml id)
CPU_FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
CPU_IDS = {v: v for v in CPU_FORMATS.values()}      # ggml ids the kernel reads
GEMV_MAX_ROWS = 8

_SOURCE = SIMD + r"""
// one block of 32 weights as two vectors (elements 0..15, 16..31), planar rows
// (ops/qlinear/formats.py): Q4_0 qs[nb*16] d[nb]; Q4_1 qs[nb*16] d[nb] m[nb]; Q8_0
// qs[nb*32] d[nb]. d and m come converted to floats (a chunk of blocks at a time: one
// vector conversion for 16 blocks, where converting one scale a block took a shuffle port
// the nibbles need)
template <int FMT>
static inline void block(const uint8_t* row, int64_t b, float d_, float m_, V& w0, V& w1) {
    const V d = vset(d_);
    if constexpr (FMT == 2) {
        const uint8_t* q = row + b * 16;
        const V e = vset(8.0f);
        w0 = vmul(vsub(lo_nibbles(q), e), d);
        w1 = vmul(vsub(hi_nibbles(q), e), d);
    } else if constexpr (FMT == 3) {
        const uint8_t* q = row + b * 16;
        const V m = vset(m_);
        w0 = vadd(vmul(lo_nibbles(q), d), m);
        w1 = vadd(vmul(hi_nibbles(q), d), m);
    } else {
        w0 = vmul(signed_bytes(row + b * 32), d);
        w1 = vmul(signed_bytes(row + b * 32 + 16), d);
    }
}

constexpr int64_t CHUNK = 64;      // blocks whose scales are converted at once
template <int FMT> constexpr int64_t QBYTES = FMT == 8 ? 32 : 16;

// the scales (and Q4_1's mins) of blocks b0.. of a row as floats
template <int FMT>
static inline void scales(const uint8_t* row, int64_t nb, int64_t b0, int64_t n, float* d,
                          float* m) {
    halves_to_floats(row + nb * QBYTES<FMT> + b0 * 2, d, n);
    if constexpr (FMT == 3) halves_to_floats(row + nb * 18 + b0 * 2, m, n);
}

// every block of a row, dequantized (its scales read CHUNK blocks at a time): f(block, w0, w1)
template <int FMT, typename F>
static inline void each_block(const uint8_t* row, int64_t nb, F&& f) {
    float d[CHUNK], m[CHUNK];
    for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
        const int64_t nc = std::min(CHUNK, nb - b0);
        scales<FMT>(row, nb, b0, nc, d, m);
        for (int64_t j = 0; j < nc; j++) {
            V w0, w1;
            block<FMT>(row, b0 + j, d[j], m[j], w0, w1);
            f(b0 + j, w0, w1);
        }
    }
}

template <int FMT, int R>
static void gemv(const float* x, const uint8_t* w, float* y, int64_t N, int64_t K,
                 int64_t row_bytes) {
    const int64_t nb = K / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* row = w + n * row_bytes;
        // the rows a few ahead: the hardware prefetcher alone leaves a single thread at
        // about half of what it reaches with this
        if (n + 4 < N)
            for (int64_t c = 0; c < row_bytes; c += 64) prefetch(row + 4 * row_bytes + c);
        V acc[R][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = vzero();
        each_block<FMT>(row, nb, [&](int64_t b, V w0, V w1) {
            for (int r = 0; r < R; r++) {
                const float* xr = x + r * K + b * 32;
                acc[r][0] = vfma(w0, vload(xr), acc[r][0]);
                acc[r][1] = vfma(w1, vload(xr + 16), acc[r][1]);
            }
        });
        for (int r = 0; r < R; r++) y[r * N + n] = vsum(vadd(acc[r][0], acc[r][1]));
    }
}

template <int FMT>
static void dequant(const uint8_t* w, float* y, int64_t N, int64_t K, int64_t row_bytes) {
    const int64_t nb = K / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        each_block<FMT>(w + n * row_bytes, nb, [&](int64_t b, V w0, V w1) {
            vstore(y + n * K + b * 32, w0);
            vstore(y + n * K + b * 32 + 16, w1);
        });
    }
}

template <int FMT>
static void run(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                int64_t row_bytes) {
    switch (M) {
        case 0: return dequant<FMT>(w, y, N, K, row_bytes);
        case 1: return gemv<FMT, 1>(x, w, y, N, K, row_bytes);
        case 2: return gemv<FMT, 2>(x, w, y, N, K, row_bytes);
        case 3: return gemv<FMT, 3>(x, w, y, N, K, row_bytes);
        case 4: return gemv<FMT, 4>(x, w, y, N, K, row_bytes);
        case 5: return gemv<FMT, 5>(x, w, y, N, K, row_bytes);
        case 6: return gemv<FMT, 6>(x, w, y, N, K, row_bytes);
        case 7: return gemv<FMT, 7>(x, w, y, N, K, row_bytes);
        default: return gemv<FMT, 8>(x, w, y, N, K, row_bytes);
    }
}

// M rows of x (M = 0: y = the weight dequantized, [N, K])
extern "C" void kernel(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N,
                       int64_t K, int64_t row_bytes, int64_t fmt) {
    if (fmt == 2) run<2>(x, w, y, M, N, K, row_bytes);
    else if (fmt == 3) run<3>(x, w, y, M, N, K, row_bytes);
    else run<8>(x, w, y, M, N, K, row_bytes);
}
"""
_ARGS = ("const float*", "const uint8_t*", "float*", "int64_t", "int64_t", "int64_t", "int64_t",
         "int64_t")


def _kernel():
    return cpu_kernel(_SOURCE, _ARGS)


def cpu_qlinear_fits(x: torch.Tensor, qtype: int) -> bool:
    """Whether the C++ kernel runs this call: fp32 activations on the CPU, a type it reads
    (its ggml id), on a machine where it builds."""
    return (x.dtype == torch.float32 and qtype in CPU_IDS and x.device.type == "cpu"
            and cpu_kernels_available())


def dequantize_cpu(weight: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    """The planar rows as fp32 [N, k] (equal to naive.dequantize_planar's)."""
    w = weight.contiguous()
    y = torch.empty(w.shape[0], k, dtype=torch.float32)
    _kernel()(y, w, y, 0, w.shape[0], k, w.shape[1], CPU_FORMATS[type_name])
    return y


def qlinear_rows(x: torch.Tensor, weight: torch.Tensor, qtype: int, k: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] fp32 times the planar weight [N, row bytes] of ggml type `qtype` (one of
    CPU_FORMATS), + bias: [M, N] fp32. A plain call: the eager model's (ops/rows.py)."""
    fmt = CPU_IDS[qtype]
    m = x.shape[0]
    if m > GEMV_MAX_ROWS:
        return F.linear(x, dequantize_cpu(weight, weight_format(qtype).name, k), bias)
    x = x.contiguous()
    w = weight.contiguous()
    y = torch.empty(m, w.shape[0], dtype=torch.float32)
    if m:
        _kernel()(x, w, y, m, w.shape[0], k, w.shape[1], fmt)
    return y if bias is None else y + bias


@torch.library.custom_op("kvcompile::qlinear_cpu", mutates_args=())
def qlinear_cpu(x: torch.Tensor, weight: torch.Tensor, qtype: int, k: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """qlinear_rows as an op: opaque to torch.compile (an extern call in a compiled step)."""
    return qlinear_rows(x, weight, qtype, k, bias)


@qlinear_cpu.register_fake
def _(x, weight, qtype, k, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])
