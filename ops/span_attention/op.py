"""torch.ops.kvcompile.span_attention: exact attention of query rows over paged KV.

q:          [T, n_q_heads, head_dim] new query rows (1 for decode, a few for verify, many
            for prefill), causal among themselves through q_pos.
k_pool/v_pool: uint8 [num_pages, page_bytes] page pools (kv_format), page p at
            p * stride(0) (pages may lie further apart than their size); resident pages
            and ring slots are just different physical page indices.
page_table: int32 [max_logical_pages], physical page of each logical page (built from an
            ordered span plan, see kvcompile.kv.span_plan). Work is split by logical position
            only, so the result does not depend on where a page lives.
q_pos:      int32 [T], absolute position of each query row; row t sees keys 0..q_pos[t].
            Values (q_pos within the table, table entries within the pools, no physical
            page twice) are checked by ops/index_checks: on the CPU always, on CUDA with
            KVCOMPILE_CHECK_INDICES=1. page_size must be the one the pools were built with:
            a pool does not record it (the KV head count is derived from it).
workspace:  optional fp32 scratch of the decode kernels (ops/span_attention/workspace.py),
            owned by the cache so decode allocates nothing per call; ignored on the CPU.
out_rot:    optional rotation every output head row is multiplied by (the inverse of the
            rotation quantized V rows are stored under, kvcompile.kv.rotation): a
            block-diagonal [D, D] given as its diagonal blocks [NB, B, B] (NB * B = D; a
            dense [D, D] is one block). The decode kernels apply it in fp32 inside their
            reduce (no separate kernel, one rounding); prefill and the CPU multiply the
            rounded output in fp32 and round again.
window:     0, or a sliding window: row t sees keys q_pos[t] - window < key <= q_pos[t]
            (llama.cpp's sliding window). Pages wholly before every row's window are never
            read, so their table entries may name any page (a windowed layer keeps only
            its window's pages).
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F
from kvcompile.ops.index_checks import check_context_table, values_readable
from kvcompile.ops.span_attention.decode_blocks import launcher_for
from kvcompile.ops.span_attention.naive import span_attention_naive
from kvcompile.ops.span_attention.prefill_kernel import span_attention_prefill


def check_span_attention_args(q, k_pool, v_pool, page_table, q_pos, k_type, v_type,
                              page_size) -> tuple[F.KvType, F.KvType, int]:
    """Raise KvLayoutError for inconsistent arguments; returns the K and V types and the
    number of KV heads."""
    kt, vt = F.kv_type(k_type), F.kv_type(v_type)
    F.check_page_size(page_size)
    if q.dim() != 3 or not q.is_floating_point():
        raise KvLayoutError(f"q must be [T, n_q_heads, head_dim] of a floating dtype, got "
                            f"{q.dtype} {tuple(q.shape)}")
    head_dim = q.shape[2]
    F.check_geometry(kt, head_dim)
    F.check_geometry(vt, head_dim)
    hk = F.n_kv_heads_of(k_pool, kt, page_size, head_dim)
    hv = F.n_kv_heads_of(v_pool, vt, page_size, head_dim)
    if hk != hv or q.shape[1] % hk:
        raise KvLayoutError(f"{q.shape[1]} query heads cannot share {hk} K / {hv} V heads")
    if k_pool.shape[0] != v_pool.shape[0]:
        raise KvLayoutError("k_pool and v_pool must have the same number of pages")
    if q_pos.shape != (q.shape[0],):
        raise KvLayoutError(f"q_pos must be [T={q.shape[0]}], got {tuple(q_pos.shape)}")
    if page_table.dim() != 1:
        raise KvLayoutError("page_table must be 1-D (physical page per logical page)")
    for name, x in (("q_pos", q_pos), ("page_table", page_table)):
        if x.dtype not in (torch.int32, torch.int64):
            raise KvLayoutError(f"{name} must be int32 (or int64 on the CPU), got {x.dtype}")
    return kt, vt, hk


# Rows up to this many take the split (flash-decoding) kernel, more the prefill kernel.
DECODE_MAX_ROWS = 8


@torch.library.custom_op("kvcompile::span_attention_reference", mutates_args=())
def span_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             page_table: torch.Tensor, q_pos: torch.Tensor, k_type: int,
                             v_type: int, page_size: int, scale: float,
                             window: int = 0) -> torch.Tensor:
    """The fp32 reference as an opaque op (the CPU implementation of span_attention). Up
    to DECODE_MAX_ROWS rows (decode and verify steps) each row is its own call, so a row's
    bits do not depend on how many rows came with it (fp32 GEMMs round by row count): a
    speculative verify step equals its one-row steps exactly."""
    if q.shape[0] <= DECODE_MAX_ROWS:
        return torch.cat([span_attention_naive(q[i:i + 1], k_pool, v_pool, page_table,
                                               q_pos[i:i + 1], k_type, v_type, page_size,
                                               scale, window) for i in range(q.shape[0])])
    return span_attention_naive(q, k_pool, v_pool, page_table, q_pos, k_type, v_type,
                                page_size, scale, window).contiguous()


@span_attention_reference.register_fake
def _(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, scale, window=0):
    return torch.empty_like(q)


# triton_op: torch.compile traces into this body and sees the Triton kernels on CUDA; on
# other devices the body calls the opaque reference op above. `workspace` is scratch: the
# kernels overwrite it before reading it and nothing reads it afterwards, so it is not a
# declared mutation (declaring an optional mutated arg also breaks calls that omit it on
# torch 2.11: the dispatcher drops the trailing None and the version bump indexes past it).
@torch.library.triton_op("kvcompile::span_attention", mutates_args=())
def span_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   page_table: torch.Tensor, q_pos: torch.Tensor, k_type: int, v_type: int,
                   page_size: int, scale: float,
                   workspace: Optional[torch.Tensor] = None,
                   out_rot: Optional[torch.Tensor] = None,
                   window: int = 0) -> torch.Tensor:
    kt, vt, n_kv = check_span_attention_args(q, k_pool, v_pool, page_table, q_pos, k_type,
                                             v_type, page_size)
    if window < 0:
        raise KvLayoutError(f"window must be 0 (no sliding window) or a positive number of "
                            f"positions, got {window}")
    if values_readable(page_table, q_pos):
        check_context_table(page_table, q_pos, k_pool.shape[0], page_size, window)
    d = q.shape[2]
    out_rot = rotation_blocks(out_rot, d, q.device)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if q.device.type != "cuda":
        out = span_attention_reference(q, k_pool, v_pool, page_table, q_pos, k_type, v_type,
                                       page_size, scale, window)
        return out if out_rot is None else _rotate_rows(out, out_rot)
    F.check_cuda_head_dim(q.device, d, "span_attention")
    if q.shape[0] <= DECODE_MAX_ROWS:
        # legacy, blocks or transposed by shape (KVCOMPILE_DECODE_IMPL overrides, read once
        # at import)
        launch = launcher_for(q, n_kv, kt, vt)
        return launch(q, k_pool, v_pool, page_table, q_pos, k_type, v_type, page_size, scale,
                      workspace=workspace,
                      out_rot=out_rot, window=window)
    out = span_attention_prefill(q, k_pool, v_pool, page_table, q_pos, k_type, v_type,
                                 page_size, scale, window=window)
    return out if out_rot is None else _rotate_rows(out, out_rot)


def rotation_blocks(out_rot: torch.Tensor | None, d: int, device) -> torch.Tensor | None:
    """out_rot as contiguous fp32 diagonal blocks [NB, B, B] (KvLayoutError if it cannot
    be one)."""
    if out_rot is None:
        return None
    blocks = out_rot[None] if out_rot.dim() == 2 else out_rot
    nb, b = (blocks.shape[0], blocks.shape[-1]) if blocks.dim() == 3 else (0, 0)
    if (blocks.dim() != 3 or blocks.shape[1] != b or nb * b != d or b & (b - 1) or b < 16
            or out_rot.device != torch.device(device)):
        raise KvLayoutError(f"out_rot must be a [{d}, {d}] rotation or its diagonal blocks "
                            f"[NB, B, B] with NB * B = {d} (B a power of two >= 16) on "
                            f"{device}; got {tuple(out_rot.shape)} on {out_rot.device}")
    return blocks.float().contiguous()


def _rotate_rows(out: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] times the block-diagonal rotation, fp32, one rounding."""
    t, h, d = out.shape
    nb, b = blocks.shape[0], blocks.shape[-1]
    x = out.float().view(t, h, nb, b)
    return torch.einsum("thnb,nbc->thnc", x, blocks).reshape(t, h, d).to(out.dtype)
