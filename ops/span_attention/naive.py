"""fp32 torch reference of span_attention (also the CPU implementation)."""
from __future__ import annotations

import torch

from kvcompile.ops import kv_format as F


def span_attention_naive(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         page_table: torch.Tensor, q_pos: torch.Tensor, k_type: int,
                         v_type: int, page_size: int, scale: float,
                         window: int = 0) -> torch.Tensor:
    """Rows of q at absolute positions q_pos see keys at positions 0..q_pos[t] (causal); with
    `window` > 0 only the last `window` of them (q_pos[t] - window < key). Pages wholly
    before every row's window are not read (their table entries may name anything)."""
    kt, vt = F.kv_type(k_type), F.kv_type(v_type)
    n_rows, n_q_heads, head_dim = q.shape
    n_kv_heads = F.n_kv_heads_of(k_pool, kt, page_size, head_dim)
    n_ctx = int(q_pos.max()) + 1
    n_pages = (n_ctx + page_size - 1) // page_size
    first_page = window_first_page(q_pos, window, page_size)
    first = first_page * page_size
    # index_select: a row memcpy, far faster than [] on uint8 (docs/findings.md, "The CPU path")
    phys = page_table[first_page:n_pages].long()
    # [pages, H, P, D] -> [H, pages * P, D] in logical order
    k = F.decode_pages(k_pool.index_select(0, phys), kt, n_kv_heads, page_size, head_dim,
                       role="k")
    v = F.decode_pages(v_pool.index_select(0, phys), vt, n_kv_heads, page_size, head_dim,
                       role="v")
    k = k.permute(1, 0, 2, 3).reshape(n_kv_heads, -1, head_dim)[:, :n_ctx - first]
    v = v.permute(1, 0, 2, 3).reshape(n_kv_heads, -1, head_dim)[:, :n_ctx - first]
    group = n_q_heads // n_kv_heads
    qf = q.float().reshape(n_rows, n_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    scores = torch.einsum("hgtd,hsd->hgts", qf, k) * scale
    key_pos = torch.arange(first, n_ctx, device=q.device)
    rows = q_pos.long()[:, None]
    visible = key_pos[None, :] <= rows                                    # [T, S]
    if window > 0:
        visible &= key_pos[None, :] > rows - window
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hgts,hsd->hgtd", torch.softmax(scores, dim=-1), v)
    return out.permute(2, 0, 1, 3).reshape(n_rows, n_q_heads, head_dim).to(q.dtype)


def window_first_page(q_pos: torch.Tensor, window: int, page_size: int) -> int:
    """The first logical page some row at q_pos reads (0 without a window; a host read)."""
    if window <= 0:
        return 0
    return max(int(q_pos.min()) - window + 1, 0) // page_size
