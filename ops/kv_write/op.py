"""torch.ops.kvcompile.kv_write: quantize-on-write of new K/V rows into their pages.

k_pool / v_pool: uint8 [num_pages, page_bytes] (see kv_format; pages stride(0) apart),
mutated in place.
k_new / v_new:   [T, n_kv_heads, head_dim] rows to store.
slots:           int [T], physical page * page_size + offset of each row; with page_table
                 (int32 [logical pages]) the row's logical position instead, mapped in the
                 kernel to page_table[pos // page_size] * page_size + pos % page_size (a
                 model passes its q_pos: no slot arithmetic a layer). The kernel trusts
                 slots and positions to fit the pools and the table: the caches check them
                 on the host; the op checks them where it can read them (ops/index_checks:
                 CPU tensors, CUDA ones with KVCOMPILE_CHECK_INDICES=1).
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F
from kvcompile.ops.index_checks import check_write_targets, values_readable
from kvcompile.ops.kv_write.naive import kv_write_naive
from kvcompile.ops.kv_write.triton_kernel import kv_write_triton


def check_kv_write_args(k_pool, v_pool, k_new, v_new, slots, k_type, v_type, page_size,
                        page_table=None):
    kt, vt = F.kv_type(k_type), F.kv_type(v_type)
    F.check_page_size(page_size)
    if slots.dtype not in (torch.int32, torch.int64):
        raise KvLayoutError(f"slots must be int32 or int64, got {slots.dtype}")
    if page_table is not None and (page_table.dim() != 1 or page_table.dtype != torch.int32
                                   or page_table.device != k_pool.device):
        raise KvLayoutError(f"page_table must be int32 [logical pages] on the pools' device, "
                            f"got {page_table.dtype} {tuple(page_table.shape)} on "
                            f"{page_table.device}")
    if k_new.dim() != 3 or k_new.shape != v_new.shape:
        raise KvLayoutError(f"k_new and v_new must both be [T, n_kv_heads, head_dim]; got "
                            f"{tuple(k_new.shape)} and {tuple(v_new.shape)}")
    if not (k_new.is_floating_point() and v_new.is_floating_point()):
        raise KvLayoutError(f"k_new and v_new must be floating rows, got {k_new.dtype} and "
                            f"{v_new.dtype}")
    if slots.shape != (k_new.shape[0],):
        raise KvLayoutError(f"slots must be [T={k_new.shape[0]}], got {tuple(slots.shape)}")
    if k_pool.shape[0] != v_pool.shape[0]:
        raise KvLayoutError(f"k_pool and v_pool must have the same number of pages, got "
                            f"{k_pool.shape[0]} and {v_pool.shape[0]}")
    _, n_heads, head_dim = k_new.shape
    F.check_geometry(kt, head_dim)
    F.check_geometry(vt, head_dim)
    F.check_cuda_head_dim(k_pool.device, head_dim, "kv_write")
    for name, pool, t in (("k_pool", k_pool, kt), ("v_pool", v_pool, vt)):
        if F.n_kv_heads_of(pool, t, page_size, head_dim) != n_heads:
            raise KvLayoutError(f"{name} pages hold {F.n_kv_heads_of(pool, t, page_size, head_dim)}"
                                f" KV heads but the rows have {n_heads}")
    if k_pool.device.type == "cuda":
        problems = [text for bad, text in (
            (not (F.dense_pages(k_pool) and F.dense_pages(v_pool)),
             "pools of dense page rows"),
            (k_new.stride(2) != 1 or v_new.stride(2) != 1, "rows with a dense last dim"),
            (not slots.is_contiguous(), "contiguous slots"),
            (page_table is not None and not page_table.is_contiguous(),
             "a contiguous page_table")) if bad]
        if problems:
            raise KvLayoutError("kv_write on the GPU needs " + ", ".join(problems))
    if values_readable(slots, page_table):
        check_write_targets(slots, page_table, k_pool.shape[0], page_size)


@torch.library.custom_op("kvcompile::kv_write_reference", mutates_args=("k_pool", "v_pool"))
def kv_write_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor,
                       v_new: torch.Tensor, slots: torch.Tensor, k_type: int, v_type: int,
                       page_size: int) -> None:
    """The fp32 reference as an opaque op (the CPU implementation of kv_write)."""
    kv_write_naive(k_pool, v_pool, k_new, v_new, slots, k_type, v_type, page_size)


@kv_write_reference.register_fake
def _(k_pool, v_pool, k_new, v_new, slots, k_type, v_type, page_size):
    return None


# triton_op: torch.compile traces into this body and sees the Triton kernel on CUDA; on
# other devices the body calls the opaque reference op above.
@torch.library.triton_op("kvcompile::kv_write", mutates_args=("k_pool", "v_pool"))
def kv_write(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor,
             v_new: torch.Tensor, slots: torch.Tensor, k_type: int, v_type: int,
             page_size: int, page_table: Optional[torch.Tensor] = None) -> None:
    check_kv_write_args(k_pool, v_pool, k_new, v_new, slots, k_type, v_type, page_size,
                        page_table)
    if k_new.shape[0] == 0:
        return
    if k_pool.device.type == "cuda":
        kv_write_triton(k_pool, v_pool, k_new, v_new, slots, k_type, v_type, page_size,
                        page_table)
    else:
        if page_table is not None:
            slots = physical_slots(slots, page_table, page_size)
        kv_write_reference(k_pool, v_pool, k_new, v_new, slots, k_type, v_type, page_size)


def physical_slots(positions: torch.Tensor, page_table: torch.Tensor,
                   page_size: int) -> torch.Tensor:
    """page_table[pos // page_size] * page_size + pos % page_size, int64."""
    positions = positions.long()
    return page_table[positions // page_size].long() * page_size + positions % page_size
