"""kv_write of fp32 rows into f32 pages on the CPU, for the fast path's eager model
(ops/rows.py): one C++ kernel (ops/cpu_build.py) copying each row's heads to their slots,
in place of the reference's views, index arithmetic and index_put (a dozen torch ops a
layer, more than the copy costs at decode sizes). Slots come as positions through the
page table, as the op takes them. The op (op.py) keeps the fp32 reference."""
from __future__ import annotations

import torch

from kvcompile.ops.cpu_build import cpu_kernel, cpu_kernels_available

_SOURCE = r"""
#include <cstdint>
#include <cstring>

// page p of a pool starts at pool + p * stride (bytes); an f32 page is [H, P, D]; row t's
// head h goes to page table[pos / P], offset pos % P
extern "C" void kernel(uint8_t* k_pool, uint8_t* v_pool, const float* k, const float* v,
                       const int32_t* pos, const int32_t* table, int64_t T, int64_t H,
                       int64_t D, int64_t P, int64_t k_stride, int64_t v_stride) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t page = table[pos[t] / P], off = pos[t] % P;
        for (int64_t h = 0; h < H; h++) {
            std::memcpy((float*)(k_pool + page * k_stride) + (h * P + off) * D,
                        k + (t * H + h) * D, D * sizeof(float));
            std::memcpy((float*)(v_pool + page * v_stride) + (h * P + off) * D,
                        v + (t * H + h) * D, D * sizeof(float));
        }
    }
}
"""
_ARGS = ("uint8_t*", "uint8_t*", "const float*", "const float*", "const int32_t*",
         "const int32_t*", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t")


def cpu_kv_write_fits(k_new: torch.Tensor, k_name: str, v_name: str, page_table,
                      k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether the C++ kernel runs this call: fp32 rows into f32 pages of dense page rows,
    positions through a page table, where kernels build."""
    return (k_new.dtype == torch.float32 and k_name == v_name == "f32"
            and k_new.device.type == "cpu" and page_table is not None and k_pool.stride(1) == 1 and v_pool.stride(1) == 1
            and cpu_kernels_available())


def write_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
               page_size: int) -> None:
    """k_new / v_new [T, H, D] fp32 into the f32 pools at `positions` (mapped through
    page_table, as kv_write's slots with a table). A plain call: the eager model's
    (ops/rows.py)."""
    t, h, d = k_new.shape
    cpu_kernel(_SOURCE, _ARGS)(k_pool, v_pool, k_new.contiguous(), v_new.contiguous(),
                               positions.to(torch.int32).contiguous(),
                               page_table.to(torch.int32).contiguous(), t, h, d, page_size,
                               k_pool.stride(0), v_pool.stride(0))
